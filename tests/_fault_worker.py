"""A training script as a user writes it, run by tests/runtime/test_faults.py under ``zerojax launch``
(or alone): it resumes from the latest intact checkpoint of ``--ckpt`` when there is one, trains to
``--steps`` saving every ``--save-every`` steps, and saves the final step. Nothing in it is about
preemption or the watchdog: zerojax handles both.

The faults are injected from outside the training code, on the job's first start only
(ZEROJAX_RESTART unset or 0):

* ``--stall RANK:STEP``: process RANK stops (sleeps) in step STEP's iteration, before the step;
* ``--term-at STEP``: process 0 sends SIGTERM to its launcher (to itself when run alone) after
  step STEP;
* ``--term-during-save STEP``: the same, right after starting the asynchronous save of step STEP
  (its write is in flight).

Step STEP is the state's step after it (1-based). The final params go to ``--out`` (npz) from process 0.
"""
import argparse
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

if "ZEROJAX_PROCESS_ID" not in os.environ and "device_count=" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402

ROWS = 16


def init(rng):
    k1, k2 = jax.random.split(rng)
    return {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 1)) * 0.3}


def loss_fn(params, batch):
    h = jax.numpy.tanh(batch["x"] @ params["w1"])
    return jax.numpy.mean((h @ params["w2"] - batch["y"]) ** 2)


def global_batch(step: int) -> dict:
    """Step ``step``'s batch (0-based), the same whatever the process count."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((ROWS, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :1]).astype(np.float32)}


def local_rows(batch: dict) -> dict:
    n, i = jax.process_count(), jax.process_index()
    per = ROWS // n
    return {k: v[i * per:(i + 1) * per] for k, v in batch.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--step-timeout", type=float, default=None)
    p.add_argument("--stall", default=None)
    p.add_argument("--first-step-timeout", type=float, default=None)
    p.add_argument("--term-at", type=int, default=None)
    p.add_argument("--signal", default="SIGTERM", help="the signal --term-at sends")
    p.add_argument("--preemption-signal", default=None, help="ZeroConfig.preemption_signal")
    p.add_argument("--term-during-save", type=int, default=None)
    p.add_argument("--step-seconds", type=float, default=0.0, help="host work after each step (a data loader)")
    p.add_argument("--out", default=None)
    p.add_argument("--nvme", default=None, help="offload_optimizer='nvme' with this nvme_path")
    p.add_argument("--zenflow", action="store_true", help="ZenFlow (top 25% of rows on the device, host every 2 steps)")
    args = p.parse_args(argv)
    first_start = os.environ.get("ZEROJAX_RESTART", "0") == "0"
    stall = tuple(int(v) for v in args.stall.split(":")) if args.stall and first_start else None

    zj.distributed.initialize()
    rank = jax.process_index()
    mesh = zj.make_mesh()
    nvme = dict(offload_optimizer="nvme", nvme_path=args.nvme) if args.nvme else {}
    if args.zenflow:
        nvme = dict(offload_optimizer="cpu", zenflow={"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True})
    cfg = zj.ZeroConfig(stage=args.stage, step_timeout=args.step_timeout, first_step_timeout=args.first_step_timeout,
                        preemption_signal=args.preemption_signal, **nvme)
    target = os.getppid() if "ZEROJAX_PROCESS_ID" in os.environ else os.getpid()  # the launcher, or this process
    state = zj.shard_train_state(init, optax.adamw(1e-2), mesh=mesh, config=cfg, rng=jax.random.PRNGKey(0))
    mngr = zj.CheckpointManager(args.ckpt)
    if mngr.latest_step() is not None:
        state, _ = mngr.restore(state, step="latest_intact")
        print(f"resumed from step {int(state.step)}", flush=True)
    step = zj.make_train_step(loss_fn, state)
    for i in range(int(state.step), args.steps):
        n = i + 1
        if stall == (rank, n):
            print(f"process {rank} stalls in step {n}", flush=True)
            time.sleep(3600)
        batch = zj.distributed.shard_batch(local_rows(global_batch(i)), mesh)
        state, metrics = step(state, batch)
        print(f"step {n} loss {float(metrics['loss']):.6f}", flush=True)
        time.sleep(args.step_seconds)
        if n % args.save_every == 0 and n < args.steps:
            mngr.save(n, state)
            if first_start and rank == 0 and args.term_during_save == n:
                print(f"SIGTERM while step {n}'s save is written (in flight: {mngr.writing == n})", flush=True)
                os.kill(target, signal.SIGTERM)
        if first_start and rank == 0 and args.term_at == n:
            print(f"{args.signal} after step {n}", flush=True)
            os.kill(target, getattr(signal, args.signal))
    if args.steps not in mngr.all_steps():
        mngr.save(args.steps, state)
    mngr.close()
    params = state.full_params()
    if rank == 0 and args.out:
        np.savez(args.out, **{k: np.asarray(v) for k, v in params.items()})
    print("done", flush=True)


if __name__ == "__main__":
    main()
