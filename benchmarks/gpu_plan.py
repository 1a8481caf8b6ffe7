"""GPT steps compiled by XLA's GPU compiler for GPUs this machine does not have.

For each model and GPU count: zerojax's step at stages 0-3 (bf16, AdamW, one sequence per GPU)
and, beside stage 3 in fp32, GSPMD's plain FSDP of the same model (fp32), each compiled with
``zj.plan_step(..., target=...)`` for N compile-only GPUs: the per-GPU peak against the GPU's
memory (fits or not), the asynchronous collectives with compute before their done (all of them,
and ZeRO's all-gathers and reduce-scatters alone: AG+RS), the roofline step time and the compile
time.

    python benchmarks/gpu_plan.py                                  # 1.3B/7B/70B on 8/64/512 H100s
    python benchmarks/gpu_plan.py --models gpt-1.3b --gpus 8 --target h200
    python benchmarks/gpu_plan.py --models gpt-1.3b --gpus 8 --remat     # with activation checkpointing
    python benchmarks/gpu_plan.py --smoke                          # tiny, 8 GPUs (the suite runs it)

Needs JAX's CUDA plugin (docs/gpu-plan.md). The step is lowered over N simulated CPU devices and
compiled by XLA:GPU: this process simulates the largest GPU count asked for up to 64 (the smoke
run's 8 included), and each plan for more GPUs compiles in a child process simulating its N, so
the table takes minutes per model.
"""
import argparse
import dataclasses
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _simulated_devices(argv) -> int:
    """The CPU devices this process simulates for the lowerings (read before jax starts): the
    largest GPU count asked for up to 64 (8 for --smoke); a plan for more starts a child."""
    if "--smoke" in argv:
        return 8
    counts = [8, 64, 512]
    if "--gpus" in argv:
        counts = []
        for word in argv[argv.index("--gpus") + 1:]:
            if not word.isdigit():
                break
            counts.append(int(word))
    return max([c for c in counts if c <= 64], default=1)


if __name__ == "__main__":
    from _common import simulate_devices

    simulate_devices(_simulated_devices(sys.argv[1:]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.tools._gpu import gpu_target  # noqa: E402
from zerojax.tools._planning import Ref, gpt_sizes, named_gpt  # noqa: E402


def plan(model, gpus, stage, precision, target, seq_len, plain=None, remat=False):
    cfg, init_fn, loss_fn = named_gpt(model, seq_len) if model in gpt_sizes() else model
    batch = {"tokens": jax.ShapeDtypeStruct((gpus, cfg.seq_len + 1), jnp.int32)}
    extra = {"activation_checkpointing": {"cpu_checkpointing": False}} if remat else {}
    config = zj.ZeroConfig(stage=stage, precision=precision, **extra)
    return zj.plan_step(init_fn, loss_fn, batch, devices=gpus, config=config, tx=Ref("optax:adamw", 1e-4),
                        target=target, plain=plain)


def row(name, p):
    gib = 2**30
    done, starts = p.overlapped
    verdict = "fits" if p.fits else "NO"
    # the all-gathers and reduce-scatters alone: ZeRO's own collectives
    ag_rs = [p.async_collectives.get(k, (0, 0)) for k in ("all-gather", "reduce-scatter")]
    zero = f"{sum(o for _, o in ag_rs)}/{sum(n for n, _ in ag_rs)}"
    return (f"  {name:<22} {p.peak_bytes / gib:>9.2f} {verdict:>5} {p.stored_bytes / gib:>10.2f} "
            f"{done:>4}/{starts:<4} {zero:>8} {p.roofline['step'] * 1e3:>10.1f} {p.mfu or 0:>6.1%} {p.seconds:>9.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["gpt-1.3b", "gpt-7b", "gpt-70b"], choices=sorted(gpt_sizes()))
    ap.add_argument("--gpus", nargs="*", type=int, default=[8, 64, 512])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="a 2-layer d 64 GPT on 8 GPUs, stages 0 and 3 and FSDP")
    ap.add_argument("--remat", action="store_true",
                    help="only stages 0 and 3 in bf16 with activation checkpointing (each block recomputed)")
    args = ap.parse_args(argv)
    models = args.models
    stages = (0, 1, 2, 3)
    if args.smoke:
        tiny = gpt.GPTConfig(vocab=512, n_layer=2, d_model=64, n_head=4, seq_len=16, scan=True)
        models = [("tiny", (tiny, functools.partial(gpt.init_params, tiny), Ref("zerojax.models.gpt:loss_fn", tiny)))]
        args.gpus, stages = [8], (0, 3)
    else:
        models = [(m, m) for m in models]
    target = gpu_target(args.target)
    print(f"{target.title}: {target.memory_bytes / 2**30:.2f} GiB per GPU, nodes of 8; AdamW, one sequence of "
          f"{args.seq_len if not args.smoke else 16} tokens per GPU; compiled by XLA:GPU for compile-only GPUs")
    head = (f"  {'step':<22} {'peak GiB':>9} {'fits':>5} {'stored GiB':>10} {'overlap':>9} {'AG+RS':>8} "
            f"{'roofline ms':>10} {'MFU':>6} {'compile s':>9}")
    for name, model in models:
        for gpus in args.gpus:
            cfg = model[0] if isinstance(model, tuple) else dataclasses.replace(gpt_sizes()[model], seq_len=args.seq_len)
            print(f"\n{name}: {cfg.n_params / 1e9:.2f}B params, {cfg.n_layer} layers, d {cfg.d_model}; {gpus} GPUs")
            print(head, flush=True)
            t0 = time.perf_counter()
            plans = {}
            if args.remat:
                for stage in (0, 3):
                    plans[stage] = plan(model, gpus, stage, "bf16", args.target, args.seq_len, remat=True)
                    print(row(f"stage {stage} bf16 remat", plans[stage]), flush=True)
                print(f"  stage 3 / stage 0 peak with activation checkpointing (bf16) "
                      f"{plans[3].peak_bytes / plans[0].peak_bytes:.3f}", flush=True)
                continue
            for stage in stages:
                plans[f"stage {stage} bf16"] = plan(model, gpus, stage, "bf16", args.target, args.seq_len)
                print(row(f"stage {stage} bf16", plans[f"stage {stage} bf16"]), flush=True)
            plans["stage 3 fp32"] = plan(model, gpus, 3, "fp32", args.target, args.seq_len)
            print(row("stage 3 fp32", plans["stage 3 fp32"]), flush=True)
            plans["FSDP fp32"] = plan(model, gpus, 3, "fp32", args.target, args.seq_len, plain="fsdp")
            print(row("plain FSDP fp32", plans["FSDP fp32"]), flush=True)
            s3, s0, fsdp = plans["stage 3 bf16"], plans["stage 0 bf16"], plans["FSDP fp32"]
            print(f"  stage 3 / stage 0 peak (bf16) {s3.peak_bytes / s0.peak_bytes:.3f}; stage 3 / plain FSDP "
                  f"peak (fp32) {plans['stage 3 fp32'].peak_bytes / fsdp.peak_bytes:.3f}; "
                  f"{time.perf_counter() - t0:.0f} s for the {len(plans)} plans", flush=True)


if __name__ == "__main__":
    main()
