"""Planning at scale: GPT models of 1.3B, 7B and 70B params on 8, 64 and 512 devices.

For each (model, devices): the stored bytes per device zerojax plans (``zj.estimate``, shapes only,
stage 3, bf16 with an fp32 master and Adam) next to the ZeRO paper's (2 + 12)Ψ/N (REFERENCE §1;
gradients live inside the step, so they are not stored), their ratio and how long planning took.
Then the compiled step itself (``zj.plan_step``: one sequence per device, GAS 1) for the sizes
whose compilation finishes within --compile-budget seconds; bigger device counts of a model are
skipped once one of its compilations runs past it. Device counts above this process's 8 compile
in a child process on simulated CPU devices.

    python benchmarks/scale.py [--compile-budget 60] [--no-compile]
"""
import argparse
import functools
import time

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.tools._estimate import zero_paper_bytes  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.tools._planning import gpt_sizes  # noqa: E402

MODELS = {k: v for k, v in gpt_sizes().items() if k != "gpt2-small"}
DEVICES = (8, 64, 512)
GiB = 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-budget", type=float, default=60.0,
                    help="seconds one compilation may take before larger device counts of that model are skipped")
    ap.add_argument("--no-compile", action="store_true", help="stored bytes from shapes only")
    args = ap.parse_args()
    config = zj.ZeroConfig(stage=3, precision="bf16")
    t_all = time.perf_counter()

    print("stored train state per device, stage 3, bf16 + fp32 master + Adam (zj.estimate, shapes only)")
    print(f"{'model':<10}{'params':>9}{'devices':>9}{'planned GiB':>13}{'(2+12)Ψ/N GiB':>15}{'ratio':>8}"
          f"{'plan s':>8}")
    for name, cfg in MODELS.items():
        init = functools.partial(gpt.init_params, cfg)
        for n in DEVICES:
            t0 = time.perf_counter()
            planned = zj.estimate(init, n, config).max_bytes("device")
            dt = time.perf_counter() - t0
            paper = zero_paper_bytes(cfg.n_params, n, 3, "bf16", include_grads=False)
            print(f"{name:<10}{cfg.n_params / 1e9:>8.2f}B{n:>9}{planned / GiB:>13.3f}{paper / GiB:>15.3f}"
                  f"{planned / paper:>8.3f}{dt:>8.2f}", flush=True)

    if args.no_compile:
        return
    print(f"\ncompiled step per device (zj.plan_step, micro-batch 1 x {MODELS['gpt-1.3b'].seq_len} tokens, "
          "CPU backend: 16-bit collectives and temporaries may be widened to f32)")
    print(f"{'model':<10}{'devices':>9}{'peak GiB':>10}{'stored':>9}{'temps':>9}{'comm GiB':>10}"
          f"{'comm/theory':>12}{'compile s':>11}{'where':>8}")
    for name, cfg in MODELS.items():
        for n in DEVICES:
            batch = {"tokens": jax.ShapeDtypeStruct((n, cfg.seq_len + 1), jnp.int32)}
            t0 = time.perf_counter()
            try:
                p = zj.plan_step(functools.partial(gpt.init_params, cfg), zj.Ref("zerojax.models.gpt:loss_fn", cfg),
                                 batch, devices=n, config=config, tx=zj.Ref("optax:adamw", 1e-4),
                                 timeout=args.compile_budget * 3)
            except RuntimeError as e:
                print(f"{name:<10}{n:>9}  not planned: {str(e).splitlines()[0]}", flush=True)
                break
            wall = time.perf_counter() - t0
            ratio = p.collective_elements / p.theory_elements
            print(f"{name:<10}{n:>9}{p.peak_bytes / GiB:>10.3f}{p.stored_bytes / GiB:>9.3f}{p.temp_bytes / GiB:>9.3f}"
                  f"{p.collective_bytes / GiB:>10.3f}{ratio:>12.3f}{p.seconds:>11.1f}"
                  f"{'child' if p.subprocess else 'here':>8}", flush=True)
            if wall > args.compile_budget:
                print(f"{name:<10}  {wall:.0f}s > {args.compile_budget:.0f}s budget: larger device counts skipped")
                break
    print(f"\ntotal {time.perf_counter() - t_all:.0f}s")


if __name__ == "__main__":
    main()
