"""Train a small GPT with several processes, each loading only its own rows of every batch.

    zerojax launch --nproc 2 --devices-per-proc 4 examples/train_multiprocess.py   # 2 processes x 4 CPU devices
    python examples/train_multiprocess.py                                           # 1 process x 8 CPU devices
    srun python examples/train_multiprocess.py                                      # SLURM: one process per task

The global batch is the same whatever the process count (row r of step s is generated from
(s, r) alone), so the printed losses are the same too: 2 x 4 devices and 1 x 8 give one curve.
Options: --stage 0..3, --steps N, --rows-per-device N, --checkpoint DIR (saved by every process
together every --save-every steps and at the end; restore it with any process count).

With --checkpoint the run resumes from the newest intact step in DIR, so a job that was stopped
goes on where it was: a preempted one (SIGTERM: zerojax saves the step it is in and exits with
code 75) when started again, and a stuck or crashed one under
`zerojax launch --max-restarts 3 ...`.
"""
import argparse
import functools
import os
import time

import jax
import numpy as np
import optax

import zerojax as zj
from zerojax.models.gpt import GPTConfig, init_params, loss_fn


class LocalLoader:
    """This process's rows of each step's global batch; no process ever builds the whole batch.

    Rows are counting sequences (start, start + stride, ...) modulo the vocabulary with a start
    and stride drawn from (seed, step, global row index), which a small model learns in a few
    dozen steps.
    """

    def __init__(self, global_rows: int, length: int, vocab: int, seed: int = 0):
        n, i = jax.process_count(), jax.process_index()
        if global_rows % n:
            raise ValueError(f"{global_rows} rows per step do not split over {n} processes")
        per = global_rows // n
        self.rows = range(i * per, (i + 1) * per)
        self.length, self.vocab, self.seed = length, vocab, seed

    def batch(self, step: int) -> dict:
        out = np.empty((len(self.rows), self.length), np.int32)
        for j, r in enumerate(self.rows):
            rng = np.random.default_rng((self.seed, step, r))
            start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
            out[j] = (start + stride * np.arange(self.length)) % self.vocab
        return {"tokens": out}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows-per-device", type=int, default=2, help="sequences per device per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint", default=None,
                   help="directory to save in (all processes) and to resume from when it holds a step")
    p.add_argument("--save-every", type=int, default=10, help="steps between saves with --checkpoint")
    args = p.parse_args(argv)

    if zj.distributed.process_env() is None and "device_count=" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", 8)  # a plain run simulates 8 CPU devices
    zj.distributed.initialize()  # before any other use of jax; nothing happens in a plain run
    rank0 = jax.process_index() == 0
    mesh = zj.make_mesh()  # every device of every process on the 'data' axis
    model = GPTConfig(vocab=128, n_layer=2, d_model=64, n_head=4, seq_len=32)
    state = zj.shard_train_state(functools.partial(init_params, model), optax.adamw(args.lr), mesh=mesh,
                                 config=zj.ZeroConfig(stage=args.stage), rng=jax.random.PRNGKey(0))
    # open before the loop: a preemption signal saves through the manager opened last
    mngr = zj.checkpoint.CheckpointManager(args.checkpoint, max_to_keep=2) if args.checkpoint else None
    if mngr is not None and mngr.latest_step() is not None:
        state, _ = mngr.restore(state, step="latest_intact")  # the batches follow from the step alone
        if rank0:
            print(f"resumed from step {int(state.step)} of {args.checkpoint}")
    first = int(state.step)
    step = zj.make_train_step(loss_fn(model), state)
    loader = LocalLoader(args.rows_per_device * jax.device_count(), model.seq_len + 1, model.vocab)
    if rank0:
        print(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices; ZeRO-{args.stage}; "
              f"global batch {args.rows_per_device * jax.device_count()} rows, {len(loader.rows)} loaded "
              f"per process; {model.n_params:,} params")
        print(zj.memory_report(state))

    losses, start = [], time.perf_counter()
    for i in range(first, args.steps):
        batch = zj.distributed.shard_batch(loader.batch(i), mesh)  # this process's rows -> the global batch
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # the same value on every process
        if rank0 and (i % 5 == 0 or i == args.steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.4f}", flush=True)
        if mngr is not None and (i + 1) % args.save_every == 0 and i + 1 < args.steps:
            mngr.save(i + 1, state)  # every process writes its shards; asynchronous
    if rank0:
        print(f"{args.steps - first} steps in {time.perf_counter() - start:.1f}s (first step includes compilation)")
    if mngr is not None:
        if args.steps not in mngr.all_steps():
            mngr.save(args.steps, state)
        mngr.close()
        if rank0:
            print(f"saved step {args.steps} to {args.checkpoint}")
    return losses


if __name__ == "__main__":
    main()
