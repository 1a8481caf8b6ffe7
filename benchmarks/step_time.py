"""Step time of ZeRO stages 1, 2, 3 relative to stage 0, measured side by side in one run.

A small GPT on 8 simulated devices. Each stage's step is compiled first, then the stages
are timed in interleaved rounds (so machine noise hits them alike) and the median per-step
time is compared with stage 0's. Goal: stages 1-2 <= 0.90x (each device updates only 1/N of
the optimizer state), stage 3 <= 1.10x.

    python benchmarks/step_time.py [--precision fp32] [--rounds 5] [--steps 4]
"""
import argparse
import statistics
import time

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch-per-device", type=int, default=2)
    ap.add_argument("--scan", action="store_true")
    args = ap.parse_args()
    cfg = GPTConfig(vocab=args.vocab, n_layer=args.layers, d_model=args.d, n_head=4, seq_len=args.seq, scan=args.scan)
    mesh = zj.make_mesh()
    n = mesh.shape["data"]
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab, (n * args.batch_per_device, cfg.seq_len + 1), dtype=np.int32)}
    print(f"GPT {cfg.n_params / 1e6:.1f}M params, {n} devices, precision {args.precision}, "
          f"global batch {batch['tokens'].shape[0]} x {cfg.seq_len}")
    runs = {}
    for stage in (0, 1, 2, 3):
        config = zj.ZeroConfig(stage=stage, precision=args.precision, param_persistence_threshold=0)
        state = zj.shard_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-4), mesh=mesh, config=config)
        step = zj.make_train_step(loss_fn(cfg), state)
        state, m = step(state, batch)  # compile
        jax.block_until_ready(state)
        runs[stage] = [state, step, []]
    for _ in range(args.rounds):
        for stage, run in runs.items():
            state, step, times = run
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = step(state, batch)
            jax.block_until_ready(state)
            times.append((time.perf_counter() - t0) / args.steps)
            run[0] = state
    base = statistics.median(runs[0][2])
    print(f"{'stage':>5} {'ms/step':>9} {'vs stage 0':>11}")
    for stage, (_, _, times) in runs.items():
        t = statistics.median(times)
        print(f"{stage:>5} {t * 1e3:>9.1f} {t / base:>10.2f}x")
    print("goal: stages 1-2 <= 0.90x, stage 3 <= 1.10x")


if __name__ == "__main__":
    main()
