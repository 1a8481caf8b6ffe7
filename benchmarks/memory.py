"""Stored model-state bytes per device vs the ZeRO formula (REFERENCE.md §1).

GPT-2-small shape (vocab 50257, 12 layers, d 768) on 8 simulated devices. The state is
really built (created directly in its sharded layout) and measured with zj.memory_report
from the arrays' shards; the formula counts stored params + optimizer state:

    stage 0: (P + K)Ψ    stages 1-2: PΨ + KΨ/N    stage 3: (P + K)Ψ/N
    P = 2 (16-bit) or 4 (fp32) param bytes, K = 12 (mixed precision) or 8 (fp32)

    python benchmarks/memory.py [--stages 0 1 2 3] [--precisions fp32 bf16 fp16]
"""
import argparse
import gc

from _common import simulate_devices

simulate_devices(8)

import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPT2_SMALL, init_params  # noqa: E402


def formula(stage: int, precision: str, psi: int, n: int) -> float:
    p, k = (4, 8) if precision == "fp32" else (2, 12)
    return {0: (p + k) * psi, 1: p * psi + k * psi / n, 2: p * psi + k * psi / n, 3: (p + k) * psi / n}[stage]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"])
    args = ap.parse_args()
    cfg = GPT2_SMALL
    mesh = zj.make_mesh()
    n = mesh.shape["data"]
    psi = cfg.n_params
    print(f"GPT-2 small: {psi:,} params, {n} devices; stored bytes per device (max over devices)")
    print(f"{'stage':>5} {'precision':>9} {'measured MiB':>13} {'formula MiB':>12} {'ratio':>7}")
    worst = 0.0
    for precision in args.precisions:
        for stage in args.stages:
            config = zj.ZeroConfig(stage=stage, precision=precision)
            state = zj.shard_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-4), mesh=mesh, config=config)
            measured = zj.memory_report(state).max_bytes("device")
            expect = formula(stage, precision, psi, n)
            ratio = measured / expect
            worst = max(worst, abs(ratio - 1))
            print(f"{stage:>5} {precision:>9} {measured / 2**20:>13.2f} {expect / 2**20:>12.2f} {ratio:>7.4f}", flush=True)
            del state
            gc.collect()
    print(f"worst deviation from the formula: {worst * 100:.3f}% (goal: within 1%)")


if __name__ == "__main__":
    main()
