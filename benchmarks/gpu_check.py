"""One GPU check that prints, within about 8 minutes on one H200, every figure that needs a GPU:

1. the Pallas fused AdamW's achieved bandwidth / the device's copy bandwidth (goal >= 0.85);
2. ZenFlow's step time against plain optimizer offload (goal <= 0.5x);
3. optimizer offload against the same step on the device;
4. the stage ratios of benchmarks/vs_plain_jax.py (zerojax stages 0-3 against plain-jit DDP and
   GSPMD FSDP) on one device-sized GPT shape;
5. the compiled per-device peak of stage 3 against stage 0, each beside what zj.plan_step(target=...)
   predicts for this GPU (XLA:GPU compiling for compile-only devices of its kind, on this machine's
   CPU): how far the planner's view is from the real one;
6. whether this JAX's partitioner (Shardy) compiles an all-gather of many operands, on 8
   simulated CPU devices (benchmarks/variadic_gather.py: stages 1-2 would gather each bucket
   with one, without a copy kernel per leaf shape).

    python benchmarks/gpu_check.py            # on a GPU
    python benchmarks/gpu_check.py --smoke    # tiny sizes on the CPU (the test suite runs this)

Every section prints its figures and the goal beside them; a section that fails prints why and
the others still run. On a single GPU the stage ratios compare one-device programs: the
collectives are no-ops there, so they show the cost of zerojax's step around the same math.
"""
import argparse
import functools
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the CPU check simulates a small mesh; on a GPU the real devices are used
    from _common import simulate_devices

    simulate_devices(8)
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
import vs_plain_jax  # noqa: E402
from fused_adam import copy_bandwidth, time_fused  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402


def line(name, value, goal=None, better="lower"):
    if goal is None:
        print(f"  {name:<44} {value:8.3f}")
        return
    ok = value <= goal if better == "lower" else value >= goal
    sign = "<=" if better == "lower" else ">="
    print(f"  {name:<44} {value:8.3f}   goal {sign} {goal}   {'ok' if ok else 'MISSED'}")


def fused_adam_bandwidth(n: int, reps: int):
    print(f"\n1. fused AdamW, {n / 1e6:.0f}M params (bf16 gradients, bf16 params out)")
    copy_bw = copy_bandwidth(n, reps)
    moved = (4 * 3 + 2) + (4 * 3 + 2)  # read master, m, v, grad; write master, m, v, params
    fused_bw = moved * n / time_fused(n, jnp.bfloat16, reps)
    line("copy bandwidth (GB/s)", copy_bw / 1e9)
    line("fused AdamW bandwidth (GB/s)", fused_bw / 1e9)
    line("fused / copy", fused_bw / copy_bw, 0.85, better="higher")


class Run:
    """One zerojax step on a fixed batch, in the shape vs_plain_jax.time_all times."""

    def __init__(self, cfg, params, config, tx=None):
        tx = tx or optax.inject_hyperparams(optax.adamw)(learning_rate=1e-4, weight_decay=0.01)
        self.state = zj.shard_train_state(params, tx, config=config)
        self.step = zj.make_train_step(loss_fn(cfg), self.state)

    def run(self, batch):
        self.state, m = self.step(self.state, batch)
        return m["loss"]

    def ready(self):
        jax.block_until_ready(self.state)


def offload_and_zenflow(cfg, batch, rounds, steps):
    print(f"\n2-3. offload and ZenFlow, GPT {cfg.n_params / 1e6:.0f}M params, bf16, stage 2")
    base = dict(stage=2, precision="bf16")
    params = vs_plain_jax.gpt_params(cfg)
    runs = {"device": Run(cfg, params, zj.ZeroConfig(**base)),
            "offload": Run(cfg, params, zj.ZeroConfig(**base, offload_optimizer="cpu")),
            "zenflow": Run(cfg, params, zj.ZeroConfig(**base, offload_optimizer="cpu",
                                                      zenflow={"topk_ratio": 0.1, "update_interval": 4}))}
    try:  # three warm-up steps compile every variant ZenFlow runs (selection, host update)
        ms = vs_plain_jax.time_all(runs, batch, rounds, steps, warmup=3)
    finally:
        for r in runs.values():
            r.step.close()
    for k, v in ms.items():
        line(f"{k} ms/step", v * 1e3)
    line("ZenFlow / plain offload", ms["zenflow"] / ms["offload"], 0.5)
    line("offload / on device", ms["offload"] / ms["device"])


def stage_ratios(shape_args):
    print("\n4. stages against plain jit (benchmarks/vs_plain_jax.py)")
    for name in shape_args.shapes:
        vs_plain_jax.gpt_case(name, shape_args)
    vs_plain_jax.optimizer_bound_case(shape_args)


def planner_target():
    """The zj.plan_step target for this machine's GPU (None on a CPU or an unknown GPU, or without
    the CUDA plugin, which a GPU install has)."""
    from zerojax._compat import cuda_plugin
    from zerojax.tools._gpu import TARGETS

    dev = jax.devices()[0]
    if dev.platform != "gpu" or cuda_plugin() is None:
        return None
    return next((name for name in TARGETS if name.upper() in dev.device_kind.upper()), None)


def stage3_peak(cfg, batch):
    print(f"\n5. compiled per-device peak, GPT {cfg.n_params / 1e6:.0f}M params, fp32")
    target = planner_target()
    print(f"  beside each: zj.plan_step(target={target!r})'s peak, compiled by XLA:GPU without this GPU"
          if target else "  (the planner's prediction needs a known GPU: none here)")
    peaks, predicted = {}, {}
    shapes = {"tokens": jax.ShapeDtypeStruct(batch["tokens"].shape, batch["tokens"].dtype)}
    # stage 3 at DeepSpeed's default max_reuse_distance (kept gathered from forward to backward)
    # and lean (max_reuse_distance 0: gathered again for the backward pass); the goal is the lean one's
    for key, stage, extra in ((0, 0, {}), (3, 3, {}), ("lean", 3, {"max_reuse_distance": 0})):
        config = zj.ZeroConfig(stage=stage, param_persistence_threshold=0, **extra)
        state = zj.abstract_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-4), config=config)
        step = zj.make_train_step(loss_fn(cfg), state)
        peaks[key] = zj.peak_memory(step, state, batch).peak
        if target:
            predicted[key] = zj.plan_step(functools.partial(init_params, cfg), zj.Ref("zerojax.models.gpt:loss_fn", cfg),
                                          shapes, devices=len(jax.devices()), config=config,
                                          tx=zj.Ref("optax:adamw", 1e-4), target=target).peak_bytes
    for key, name in ((0, "stage 0 peak (MiB)"), (3, "stage 3 peak (MiB)"), ("lean", "stage 3 lean peak (MiB)")):
        line(name, peaks[key] / 2**20)
        if key in predicted:
            line(f"  planned / measured ({predicted[key] / 2**20:.1f} MiB planned)", predicted[key] / peaks[key])
    line("stage 3 lean / stage 0", peaks["lean"] / peaks[0], 0.20)
    if predicted:
        line("  planned: stage 3 lean / stage 0", predicted["lean"] / predicted[0], 0.20)


def variadic_all_gather():
    print("\n6. an all-gather of many operands under Shardy (benchmarks/variadic_gather.py, CPU)")
    import variadic_gather

    got = variadic_gather.run_child("partitioner,shardy", JAX_PLATFORMS="cpu")
    print("  runs" if got["runs"] else f"  fails: {got['error']}")


def section(fn, *args):
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - one failed section must not hide the others' figures
        print("  FAILED:")
        traceback.print_exc(file=sys.stdout)
        return False
    print(f"  ({fn.__name__}: {time.perf_counter() - t0:.0f} s)")
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {len(jax.devices())} x {dev.device_kind} ({dev.platform})")
    t0 = time.perf_counter()
    if args.smoke:
        n, reps, rounds, steps = 2**14, 2, 1, 1
        gpt = GPTConfig(vocab=517, n_layer=1, d_model=32, n_head=2, seq_len=8)
        # one ratio and one optimizer: every ratio of the same code is smoke-tested by vs_plain_jax.py --smoke
        shapes = argparse.Namespace(shapes=["smoke"], seq=8, batch=len(jax.devices()), rounds=1, steps=1,
                                    opt_params=4096 * 8, pairs=False, opt_tx=["adamw"],
                                    gpt2_devices=len(jax.devices()), ratios=["s3/s0"], smoke=True)
        batch_rows = len(jax.devices())
    else:
        n, reps, rounds, steps = 256 * 2**20, 10, 3, 3
        gpt = GPTConfig(vocab=50257, n_layer=12, d_model=768, n_head=12, seq_len=512)
        shapes = argparse.Namespace(shapes=["gpt2-small"], seq=512, batch=16 * len(jax.devices()), rounds=3,
                                    steps=3, opt_params=50 * 2**20, pairs=False, opt_tx=["adamw", "lion"], gpt2_devices=len(jax.devices()),
                                    ratios=list(vs_plain_jax.RATIOS))
        batch_rows = 8 * len(jax.devices())
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, gpt.vocab, (batch_rows, gpt.seq_len + 1), dtype=np.int32)}
    ok = [section(fused_adam_bandwidth, n, reps), section(offload_and_zenflow, gpt, batch, rounds, steps),
          section(stage_ratios, shapes), section(stage3_peak, gpt, batch), section(variadic_all_gather)]
    print(f"\n{sum(ok)} of {len(ok)} sections ran in {time.perf_counter() - t0:.0f} s")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
