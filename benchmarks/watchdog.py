"""The step watchdog's cost: the example GPT's step with the watchdog on (the default) against off
(``step_timeout=0``), measured side by side in one run.

examples/train_gpt.py's model (byte vocabulary, 4 layers, d 128, 64 tokens, batch 32) on 8
simulated devices, ZeRO stage 2, bf16. Both steps are compiled and run a few steps first, then
timed in interleaved rounds (the order reversed every other round) so machine noise hits them
alike; the median per-step time of "on" is compared with "off". Goal: on / off <= 1.01.

What "on" adds to each step, on the caller's thread: two ledger records (64 bytes packed into a
ring each), a deque append handing the step's loss to the waiter thread, and the preemption
check (a flag; JAX's sync-point query with ``jax.distributed``). The waiter thread blocks on the
loss beside the step, and the deadline thread wakes about once a second. The caller's share is
printed too, measured over many calls of the wrapper around a step that returns at once.

    python benchmarks/watchdog.py [--rounds 7] [--steps 20] [--smoke]
"""
import argparse
import statistics
import time

from _common import simulate_devices, time_interleaved

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402
from zerojax.runtime import _watchdog as wd  # noqa: E402
from zerojax.runtime._watched_step import WatchedStep  # noqa: E402


class _Instant:
    """A step that returns at once (the wrapper's own cost, measured alone)."""

    plan = None

    def __init__(self):
        self.loss = jax.numpy.float32(0.0)

    def __call__(self, state, batch):
        return state, {"loss": self.loss}


def caller_us(calls: int) -> float:
    watched = WatchedStep(_Instant(), wd.DEFAULT_STEP_TIMEOUT, 2 * wd.DEFAULT_STEP_TIMEOUT)
    state = None
    t0 = time.perf_counter()
    for _ in range(calls):
        state, _ = watched(state, None)
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds of 2 steps")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.layers, args.d, args.seq, args.batch = 2, 2, 1, 32, 8, 8
    cfg = GPTConfig(vocab=256, n_layer=args.layers, d_model=args.d, n_head=4, seq_len=args.seq)
    mesh = zj.make_mesh()
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab, (args.batch, cfg.seq_len + 1), dtype=np.int32)}
    print(f"GPT {cfg.n_params / 1e6:.2f}M params (examples/train_gpt.py's shape), {mesh.shape['data']} devices, "
          f"stage 2, bf16, global batch {args.batch} x {cfg.seq_len}")
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg, jax.random.PRNGKey(0)))
    runs = {}
    for name, timeout in (("off", 0), ("on", None)):
        state = zj.shard_train_state(params, optax.adamw(1e-4), mesh=mesh,
                                     config=zj.ZeroConfig(stage=2, precision="bf16", step_timeout=timeout))
        step = zj.make_train_step(loss_fn(cfg), state)
        assert isinstance(step, WatchedStep) == (name == "on")
        for _ in range(3):
            state, m = step(state, batch)
        jax.block_until_ready(m)
        runs[name] = [step, state, []]
    time_interleaved(runs, batch, args.rounds, args.steps)
    base = statistics.median(runs["off"][2])
    print(f"{'watchdog':<10}{'median ms':>10}{'/ off':>8}{'lowest ms':>11}{'highest ms':>12}")
    for name, (_, _, times) in runs.items():
        ms = statistics.median(times) * 1e3
        print(f"{name:<10}{ms:>10.2f}{ms / (base * 1e3):>8.3f}{min(times) * 1e3:>11.2f}{max(times) * 1e3:>12.2f}")
    ratios = [a / b for a, b in zip(runs["on"][2], runs["off"][2])]
    on = statistics.median(runs["on"][2]) / base
    us = caller_us(200 if args.smoke else 20000)
    dog = wd.watchdog()
    print(f"watchdog on / off: {on:.3f}x (goal <= 1.01; per-round ratios {min(ratios):.3f}-{max(ratios):.3f}; "
          f"{args.rounds} interleaved rounds of {args.steps} steps, medians); the wrapper's own time on the caller's "
          f"thread: {us:.1f} us a step, {us / (base * 1e6) * 100:.3f}% of the step; its deadline now "
          f"{dog.deadline():.0f} s")


if __name__ == "__main__":
    main()
