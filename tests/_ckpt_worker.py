"""Subprocess side of tests/test_checkpoint.py: trains the test model and saves checkpoints.

    python _ckpt_worker.py half DIR PRECISION   # 5 steps, save step 5, exit
    python _ckpt_worker.py loop DIR             # save step 1, print READY, then save every step (printing SAVING k) until killed
"""
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax
import optax
from tests.helpers import batches, init_params, loss_fn

import zerojax as zj

CONFIGS = {
    "fp32": dict(stage=3, param_persistence_threshold=0),
    # scale 2**20 (2**17 per device once the 1/8 mean is folded in) overflows now and then: after
    # step 5 the scaler is mid-hysteresis (1 of 3 left)
    "fp16": dict(stage=2, precision="fp16", initial_scale_power=20, hysteresis=3, loss_scale_window=2),
}


def make_state(kind: str, n: int = 8, **overrides):
    config = zj.ZeroConfig(**dict(CONFIGS[kind], **overrides))
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.adamw(1e-2, weight_decay=0.1),
                                mesh=zj.make_mesh(n), config=config)


def main(mode: str, directory: str, precision: str = "fp32") -> None:
    from zerojax.checkpoint import CheckpointManager

    state = make_state(precision)
    step = zj.make_train_step(loss_fn, state)
    data = batches(40)
    mngr = CheckpointManager(directory)
    if mode == "half":
        for b in data[:5]:
            state, _ = step(state, b)
        mngr.save(5, state, data_state={"next_batch": 5})
        mngr.close()
        return
    state, _ = step(state, data[0])
    mngr.save(1, state, data_state={"next_batch": 1})
    mngr.wait_until_finished()
    print("READY", flush=True)
    for i, b in enumerate(data[1:], start=2):
        state, _ = step(state, b)
        print(f"SAVING {i}", flush=True)
        mngr.save(i, state, data_state={"next_batch": i})
    mngr.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
