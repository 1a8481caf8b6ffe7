"""visualize: the ZeRO picture, compared with pictures derived by hand from ZeRO's semantics.

The model: b f32[4] and w f32[8, 4] (36 parameters, 144 bytes), 4 devices, fp32 Adam
(count 4 bytes + m and v 144 bytes each). Stage 1 partitions the optimizer state (each device
owns one quarter: 4 + 36 + 36 = 76 bytes), stage 2 also the gradients (36 bytes), stage 3 also
the params (36 bytes).
"""
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.tools._visualize import visualize

HEAD = "       params            gradients*        optimizer states  bytes on the device"
TAIL = ("█ stored on this device   · held by other devices only   H in this device's host memory (offload)\n"
        "* gradients are transient: the step's fp32 accumulators, not part of the stored state")


def title(stage, precision="fp32", over="4 devices", width=16):
    return (f"ZeRO stage {stage} over {over}, {precision}: where each device's state lives, "
            f"1 cell = 1/{width} of a column")


S1 = "params 144 B, grads* 144 B, optimizer 76 B"
S2 = "params 144 B, grads* 36 B, optimizer 76 B"
S3 = "params 36 B, grads* 36 B, optimizer 76 B"
EXPECTED = {
    1: "\n".join([title(1), HEAD,
                  "dev 0  ████████████████  ████████████████  ████············  " + S1,
                  "dev 1  ████████████████  ████████████████  ····████········  " + S1,
                  "dev 2  ████████████████  ████████████████  ········████····  " + S1,
                  "dev 3  ████████████████  ████████████████  ············████  " + S1,
                  TAIL]),
    2: "\n".join([title(2), HEAD,
                  "dev 0  ████████████████  ████············  ████············  " + S2,
                  "dev 1  ████████████████  ····████········  ····████········  " + S2,
                  "dev 2  ████████████████  ········████····  ········████····  " + S2,
                  "dev 3  ████████████████  ············████  ············████  " + S2,
                  TAIL]),
    3: "\n".join([title(3), HEAD,
                  "dev 0  ████············  ████············  ████············  " + S3,
                  "dev 1  ····████········  ····████········  ····████········  " + S3,
                  "dev 2  ········████····  ········████····  ········████····  " + S3,
                  "dev 3  ············████  ············████  ············████  " + S3,
                  TAIL]),
}


def tiny():
    return {"b": jnp.zeros((4,)), "w": jnp.arange(32.0).reshape(8, 4)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_picture_of_each_stage_from_the_real_state(stage):
    config = zj.ZeroConfig(stage=stage, param_persistence_threshold=0)
    state = zj.shard_train_state(tiny(), optax.adamw(1e-3), mesh=zj.make_mesh(4), config=config)
    assert visualize(state) == EXPECTED[stage]
    # the plan alone draws the shardings the state was built with
    assert visualize(zj.ZeroPlan.create(tiny(), zj.make_mesh(4), config)) == EXPECTED[stage]


def test_stage0_replicates_everything():
    pic = visualize(zj.ZeroPlan.create(tiny(), zj.make_mesh(4), zj.ZeroConfig(stage=0)))
    assert pic.splitlines()[2] == ("dev 0  ████████████████  ████████████████  ████████████████  "
                                   "params 144 B, grads* 144 B, optimizer 292 B")


def test_offloaded_optimizer_is_drawn_on_the_host():
    # bf16 params (72 bytes); host: fp32 master 36 + count 4 + m 36 + v 36 = 112 bytes per device
    config = zj.ZeroConfig(stage=2, precision="bf16", offload_optimizer="cpu")
    pic = visualize(zj.ZeroPlan.create(tiny(), zj.make_mesh(4), config)).splitlines()
    assert pic[0] == title(2, "bf16")
    assert pic[2] == ("dev 0  ████████████████  ████············  HHHH············  "
                      "params 72 B, grads* 36 B, optimizer 0 B + host 112 B")
    assert pic[5] == ("dev 3  ████████████████  ············████  ············HHHH  "
                      "params 72 B, grads* 36 B, optimizer 0 B + host 112 B")


def test_model_parallel_axis_splits_each_data_chunk():
    # w split over 'model' on dim 1 and over 'data' on dim 0: each device holds 1/4 of it; the
    # optimizer column holds count (whole), m and v (each split like w), so blocks alternate
    mesh = zj.make_mesh((2, 2), ("data", "model"))
    config = zj.ZeroConfig(stage=3, param_persistence_threshold=0)
    plan = zj.ZeroPlan.create({"w": jnp.zeros((8, 4))}, mesh, config, param_specs={"w": P(None, "model")})
    rows = visualize(plan, width=8).splitlines()
    assert rows[0] == title(3, over="4 devices (2 on the 'data' axis)", width=8)
    assert rows[2:6] == [
        "dev 0  ██······  ██······    █·█·····          params 32 B, grads* 32 B, optimizer 68 B",
        "dev 1  ··██····  ··██····    ·█·█····          params 32 B, grads* 32 B, optimizer 68 B",
        "dev 2  ····██··  ····██··    ····█·█·          params 32 B, grads* 32 B, optimizer 68 B",
        "dev 3  ······██  ······██    ·····█·█          params 32 B, grads* 32 B, optimizer 68 B",
    ]


def test_many_devices_are_truncated_and_errors_say_what_to_pass():
    plan = zj.ZeroPlan.create(tiny(), zj.make_mesh(8), zj.ZeroConfig(stage=1))
    lines = visualize(plan, max_devices=2).splitlines()
    assert lines[4] == "... 6 more devices (max_devices=None shows all)"
    assert len(visualize(plan, max_devices=None).splitlines()) == 12
    with pytest.raises(zj.ZeroJaxError, match="ZeroPlan"):
        visualize({"w": 1})
    with pytest.raises(ValueError, match="width"):
        visualize(plan, width=0)
