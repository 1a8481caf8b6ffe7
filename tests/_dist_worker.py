"""Subprocess side of tests/test_distributed.py, run under ``zerojax launch`` (or alone, as one process).

    _dist_worker.py train OUT ONE_CKPT   # stages 0-3 (STEPS steps each) on the global batch built by
                                         # shard_batch; saves OUT/two; restores ONE_CKPT once ONE_CKPT.done
                                         # exists; rank 0 writes OUT/result.npz and OUT/result.json
    _dist_worker.py loop                 # cross-process sums until killed; every rank prints READY <pid>
    _dist_worker.py init                 # zj.distributed.initialize(), print the process count, exit
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

STAGES = (0, 1, 2, 3)
STEPS = 3
ROWS = 32  # global batch


def config(stage: int):
    import zerojax as zj

    return zj.ZeroConfig(stage=stage, param_persistence_threshold=0,
                         gradient_accumulation_steps=2 if stage == 2 else 1,
                         gather_16bit_weights_on_model_save=stage == 3)


def tx():
    import optax

    return optax.adamw(1e-2, weight_decay=0.1)


def local_rows(batch: dict) -> dict:
    """This process's rows of the global batch (process order), as a per-process loader gives them."""
    import jax

    n, i = jax.process_count(), jax.process_index()
    per = ROWS // n
    return {k: v[i * per:(i + 1) * per] for k, v in batch.items()}


def replicated(tree):
    """Every leaf whole on every device, so any process can read it."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    leaves = jax.tree_util.tree_leaves(tree)
    mesh = leaves[0].sharding.mesh
    return jax.device_get(jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree))


def logical_opt(state):
    """The optimizer leaves unpadded, as host arrays (gathered across processes)."""
    import jax

    lays = state.plan.opt_leaf_layouts(state.opt_state, stored=True)
    out = []
    for x, lay in zip(jax.tree_util.tree_leaves(replicated(state.opt_state)), lays):
        out.append(x if lay is None else x[tuple(slice(0, s) for s in lay.shape)])
    return out


def train_all(mesh, data):
    """{stage: (losses, final state)} for every stage, each from the same start."""
    import jax
    from tests.helpers import init_params, loss_fn

    import zerojax as zj

    out = {}
    for stage in STAGES:
        state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx(), mesh=mesh, config=config(stage))
        step = zj.make_train_step(loss_fn, state)
        losses = []
        for b in data:
            state, metrics = step(state, zj.distributed.shard_batch(local_rows(b), mesh))
            losses.append(float(metrics["loss"]))
        out[stage] = (losses, state)
    return out


def flat_params(state) -> dict:
    import jax

    from zerojax._plan import path_str

    tree = jax.device_get(state.full_params())
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _wait_for(path: str, timeout: float = 300.0) -> None:
    """The test writes the one-process checkpoint while this run trains; wait for it."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.2)


def train(out_dir: str, one_ckpt: str) -> None:
    import jax
    import numpy as np
    from tests.helpers import batches, init_params

    import zerojax as zj

    spec = zj.distributed.initialize()
    mesh = zj.make_mesh()
    data = batches(STEPS, batch_size=ROWS)
    arrays = {f"batch/{k}": v for k, v in replicated(zj.distributed.shard_batch(local_rows(data[0]), mesh)).items()}
    results = train_all(mesh, data)
    info = {"process_count": jax.process_count(), "device_count": jax.device_count(),
            "source": spec.source if spec else None}
    for stage, (losses, state) in results.items():
        arrays[f"s{stage}/losses"] = np.asarray(losses)
        for k, v in flat_params(state).items():
            arrays[f"s{stage}/params/{k}"] = v

    state = results[3][1]
    report = zj.memory_report(state)
    info["report"] = {"total": report.total_bytes(), "max": report.max_bytes(), "devices": len(report.per_device),
                      "per_process": {str(p): v.get("device", 0) for p, v in report.per_process.items()},
                      "mine": sorted(report.devices_of()), "process_index": report.process_index}

    # this process count saves; the checkpoint written by one process restores here onto another stage
    mngr = zj.checkpoint.CheckpointManager(os.path.join(out_dir, "two"))
    mngr.save(STEPS, state, data_state={"saved_by": jax.process_count()})
    mngr.close()
    target = zj.abstract_train_state(init_params(jax.random.PRNGKey(0)), tx(), mesh=mesh, config=config(2))
    _wait_for(one_ckpt + ".done")
    restored, data_state = zj.checkpoint.restore(one_ckpt, target)
    info["restored"] = {"step": int(restored.step), "data_state": data_state}
    for k, v in flat_params(restored).items():
        arrays[f"restored/params/{k}"] = v
    for i, x in enumerate(logical_opt(restored)):
        arrays[f"restored/opt/{i}"] = x

    # uneven rows across processes: an error on every process, not a hang
    try:
        zj.distributed.shard_batch({"x": np.zeros((4 * (1 + jax.process_index()), 3), np.float32)}, mesh)
        info["uneven"] = None
    except ValueError as e:
        info["uneven"] = str(e)
    if jax.process_index() == 0:
        np.savez(os.path.join(out_dir, "result.npz"), **arrays)
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(info, f)
    print(f"DONE rank {jax.process_index()}", flush=True)


def loop() -> None:
    import jax
    import numpy as np

    import zerojax as zj

    zj.distributed.initialize()
    mesh = zj.make_mesh()
    x = zj.distributed.shard_batch(np.ones((jax.local_device_count(), 4), np.float32), mesh)
    total = jax.jit(lambda a: a.sum())
    print(f"READY {os.getpid()} sum {float(total(x))}", flush=True)
    while True:
        float(total(x))
        time.sleep(0.02)


def init() -> None:
    import jax

    import zerojax as zj

    spec = zj.distributed.initialize()
    print(f"PROCESSES {jax.process_count()} DEVICES {jax.device_count()} SOURCE {spec and spec.source}", flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"train": train, "loop": loop, "init": init}[mode](*args)
