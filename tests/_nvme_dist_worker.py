"""Subprocess side of tests/runtime/test_nvme_processes.py: NVMe offload on several processes.

    _nvme_dist_worker.py OUT STAGE NVME [CKPT [resume]]      STAGE: 1, 2, 3 or infinity
        trains STEPS steps of STAGE with offload_optimizer="nvme" under NVME (each process its own
        store), saves step STEPS // 2 to CKPT when given (with "resume": restores CKPT's newest
        step first and trains the rest); rank 0 writes OUT/result.npz (losses and fp32 params)
Run under ``zerojax launch --nproc 2 --devices-per-proc 4`` or alone (one process, 8 devices).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax  # noqa: E402

if "ZEROJAX_PROCESS_ID" not in os.environ and "device_count=" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from tests._dist_worker import ROWS, local_rows  # noqa: E402
from tests.helpers import batches, init_params, loss_fn  # noqa: E402

STEPS = 4


def config(stage, nvme: str):
    """``stage`` 1-3, or "infinity": stage 3 with the params on NVMe too."""
    params = {"offload_param": "nvme"} if stage == "infinity" else {}
    return zj.ZeroConfig(stage=3 if stage == "infinity" else int(stage), precision="bf16",
                         param_persistence_threshold=16, offload_optimizer="nvme", nvme_path=nvme, sub_group_size=500,
                         **params)


def tx():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 1e-3, STEPS),
                                                 weight_decay=0.1)


def main(out: str, stage, nvme: str, ckpt: str | None = None, mode: str = "save") -> None:
    zj.distributed.initialize()
    mesh = zj.make_mesh()
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx(), mesh=mesh, config=config(stage, nvme))
    if mode == "resume":
        with zj.CheckpointManager(ckpt) as mngr:
            state, _ = mngr.restore(state)
    losses = []
    with zj.make_train_step(loss_fn, state) as step:
        for i, b in enumerate(batches(STEPS, batch_size=ROWS)):
            if i < int(state.step):
                continue
            state, m = step(state, zj.distributed.shard_batch(local_rows(b), mesh))
            losses.append(float(m["loss"]))
            if ckpt and mode == "save" and i + 1 == STEPS // 2:
                with zj.CheckpointManager(ckpt) as mngr:
                    mngr.save(i + 1, state)
        params = step.full_params(np.float32)
    if jax.process_index() == 0:
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(os.path.join(out, "result.npz"), losses=np.asarray(losses), **{f"params/{k}": v for k, v in flat.items()})
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *sys.argv[4:6])
