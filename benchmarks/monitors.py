"""Step time with every monitor on against none, measured side by side in one run.

A small GPT on 8 simulated devices, ZeRO stage 2. Three steps of the same config:

    off          zj.make_train_step(...)
    on           + csv_monitor, tensorboard, wandb (offline), steps_per_print, comms_logger,
                   flops_profiler (the writers that are installed)
    on+wallclock + wall_clock_breakdown, which synchronises every step by design

Each is compiled and run past the one-time reports (the comms logger's and the FLOPs
profiler's extra compile at steps 0 and 1), then timed in interleaved rounds so machine noise
hits them alike (the order reversed every other round); the median per-step time is compared
with "off". Goal: on / off <= 1.03. On simulated CPU devices the writers' host work (a wandb
log is milliseconds of Python and an IPC to wandb's own process) competes with the "devices"
for the same cores; on an accelerator it runs while the host waits for the device.

    python benchmarks/monitors.py [--rounds 7] [--steps 10] [--smoke]
"""
import argparse
import os
import statistics
import tempfile

from _common import simulate_devices, time_interleaved

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402
from zerojax.monitor import (CommsLogger, CSVMonitor, FlopsProfiler, Monitors, TensorBoardMonitor,  # noqa: E402
                             WandbMonitor)


def installed(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def monitors(out: str, wall_clock: bool) -> Monitors:
    sink = []  # the progress lines and reports go to a list: the terminal is not what is timed
    return Monitors(
        csv=CSVMonitor(out, "csv"),
        tensorboard=TensorBoardMonitor(out, "tb") if installed("tensorboardX") else None,
        wandb=WandbMonitor(project="zerojax-bench", dir=out, mode="offline") if installed("wandb") else None,
        steps_per_print=1, wall_clock_breakdown=wall_clock, comms_logger=CommsLogger(),
        flops_profiler=FlopsProfiler(profile_step=1), print_fn=sink.append)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-per-device", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds of 2 steps, no on+wallclock")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.vocab, args.layers, args.d, args.seq = 2, 2, 64, 1, 32, 8
    os.environ.setdefault("WANDB_SILENT", "true")
    cfg = GPTConfig(vocab=args.vocab, n_layer=args.layers, d_model=args.d, n_head=4, seq_len=args.seq)
    mesh = zj.make_mesh()
    n = mesh.shape["data"]
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab, (n * args.batch_per_device, cfg.seq_len + 1), dtype=np.int32)}
    print(f"GPT {cfg.n_params / 1e6:.2f}M params, {n} devices, stage 2, global batch {batch['tokens'].shape[0]} x "
          f"{cfg.seq_len}; writers: csv" + ", tensorboard" * installed("tensorboardX") + ", wandb (offline)" *
          installed("wandb"))
    out = tempfile.mkdtemp(prefix="zerojax-monitors-")
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg, jax.random.PRNGKey(0)))
    runs = {}
    contenders = [("off", None), ("on", monitors(os.path.join(out, "on"), False))]
    if not args.smoke:
        contenders.append(("on+wallclock", monitors(os.path.join(out, "wc"), True)))
    for name, mon in contenders:
        state = zj.shard_train_state(params, optax.adamw(1e-4), mesh=mesh, config=zj.ZeroConfig(stage=2))
        step = zj.make_train_step(loss_fn(cfg), state, monitors=mon)
        for _ in range(3):  # compile, and the one-time reports at steps 0 and 1
            state, m = step(state, batch)
        jax.block_until_ready(m)
        runs[name] = [step, state, []]
    time_interleaved(runs, batch, args.rounds, args.steps)
    base = statistics.median(runs["off"][2])
    print(f"{'step':<14}{'median ms':>10}{'/ off':>8}{'caller us/step':>16}{'writer cpu us':>16}")
    for name, (step, _, times) in runs.items():
        ms = statistics.median(times) * 1e3
        step.finish(runs[name][1])
        cost = ""
        if hasattr(step, "overhead"):  # the caller's figure leaves out the two steps with one-time reports
            cost = f"{step.overhead['caller'] / (step.steps - 2) * 1e6:>16.0f}" \
                   f"{step.overhead['writer'] / step.steps * 1e6:>16.0f}"
        print(f"{name:<14}{ms:>10.2f}{ms / (base * 1e3):>8.3f}{cost}")
        step.close()
    on = statistics.median(runs["on"][2]) / base
    print(f"monitors on / off: {on:.3f}x (goal <= 1.03; {args.rounds} interleaved rounds of {args.steps} steps, "
          "medians). caller: the monitors' time on the training thread per step (wall_clock_breakdown's wait "
          "excluded); writer: the writer thread's CPU time, beside the step")


if __name__ == "__main__":
    main()
