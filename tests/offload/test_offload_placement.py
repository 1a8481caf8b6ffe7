"""Offloaded state lives in host memory between steps and trains exactly like on-device state."""
import warnings

import jax
import optax
import pytest

import zerojax as zj
from zerojax.kernels import _native as native
import jax.numpy as jnp

from tests.helpers import OPTIMIZERS, batches, init_params, loss_fn, max_rel_err, reference_train


@pytest.mark.parametrize("config,device_parts,host_kind", [
    (dict(stage=2, offload_optimizer="cpu"), {"params"}, "pinned_host"),
    (dict(stage=1, offload_optimizer="cpu", pin_memory=False), {"params"}, "unpinned_host"),
    (dict(stage=3, offload_optimizer="cpu", offload_param="cpu"), set(), "pinned_host"),
])
def test_offloaded_state_in_host_memory_trains_like_on_device(config, device_parts, host_kind):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)
    want, _ = reference_train(params, optax.adamw(1e-2), data)
    state = zj.shard_train_state(params, optax.adamw(1e-2), config=zj.ZeroConfig(param_persistence_threshold=0, **config))
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    assert max_rel_err(state.full_params(), want) < 1e-6
    report = zj.memory_report(state)
    on_device = {part for part, kinds in report.by_part.items() if kinds.get("device") and part != "other"}
    assert on_device == device_parts
    assert report.by_part["optimizer"] == {host_kind: report.by_part["optimizer"][host_kind]}
    plan = state.plan
    for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(state.params)):
        assert x.sharding.memory_kind == plan.param_sharding(lay).memory_kind


# optimizers whose update mixes host-memory values with fresh constants in ways the host
# computation's typing rejects; they keep their state on the host and update on the device
UPDATED_ON_DEVICE = {"adafactor", "chain_clip_schedule", "lamb"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_offloaded_optimizer_equals_plain_optax_for_every_optimizer(name):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)
    want, _ = reference_train(params, OPTIMIZERS[name](), data, clip=0.3)
    config = zj.ZeroConfig(stage=2, offload_optimizer="cpu", gradient_clipping=0.3)
    state = zj.shard_train_state(params, OPTIMIZERS[name](), config=config)
    step = zj.make_train_step(loss_fn, state)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for b in data:
            state, _ = step(state, b)
    fell_back = any(issubclass(w.category, zj.HostUpdateWarning) for w in seen)
    assert fell_back == (name in UPDATED_ON_DEVICE)
    assert max_rel_err(state.full_params(), want) < 1e-6


def _host_calls(state, batch):
    text = zj.make_train_step(loss_fn, state).lower(state, batch).as_text()
    return [line for line in text.splitlines() if "call @host_apply(" in line]


def _kernel_calls(state, batch):
    text = zj.make_train_step(loss_fn, state).lower(state, batch).as_text()
    return [line for line in text.splitlines() if f"@{native.TARGET}(" in line]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_update_runs_on_the_host_fed_16_bit_gradients(stage, monkeypatch):
    """On this CPU mesh AdamW runs in the native host kernel, fed the bf16 gradients; without the
    kernel (as on a GPU mesh) under compute_on("device_host"), fed the same."""
    params = init_params(jax.random.PRNGKey(0))
    b = batches(1)[0]
    on_device = zj.shard_train_state(params, optax.adamw(1e-2), config=zj.ZeroConfig(stage=stage, precision="bf16"))
    assert _host_calls(on_device, b) == [] and _kernel_calls(on_device, b) == []
    state = zj.shard_train_state(params, optax.adamw(1e-2), config=zj.ZeroConfig(
        stage=stage, precision="bf16", offload_optimizer="cpu", param_persistence_threshold=0))
    n = len(state.plan.leaves)
    kernel = _kernel_calls(state, b)
    assert len(kernel) == 1 and _host_calls(state, b) == []
    # operands: the scalars, then per leaf the fp32 master, the bf16 gradient and both fp32 moments
    operands = kernel[0].rsplit(": (", 1)[1].split(") ->")[0]
    types = [t.strip(" ,") for t in operands.split("tensor<")[1:]]
    assert len(types) == 1 + 4 * n
    assert all(t.endswith("bf16>") for t in types[2::4]), types[2::4]
    assert all(t.endswith("f32>") for i, t in enumerate(types) if i % 4 != 2), types
    monkeypatch.setattr(native, "available", lambda warn=True: False)
    calls = _host_calls(state, b)
    assert len(calls) == 1 and '_xla_compute_type = "host"' in calls[0]
    operands = calls[0].split(":", 1)[1].split("->")[0]
    # inputs: n gradients (bf16), n fp32 master leaves, then the optimizer state
    types = [t.strip() for t in operands.strip(" ()").split("tensor<")[1:]]
    assert all(t.endswith("bf16>,") or t.endswith("bf16>") for t in types[:n]), types[:n]
    assert all("f32>" in t for t in types[n:2 * n]), types[n:2 * n]
    results = calls[0].split("->")[1]
    assert results.count("bf16>") == n  # the updated params come back in 16 bits


def test_bf16_host_update_tracks_on_device_update():
    params = init_params(jax.random.PRNGKey(0))
    data = batches(6)
    out = {}
    for offload in (None, "cpu"):
        config = zj.ZeroConfig(stage=2, precision="bf16", offload_optimizer=offload)
        state = zj.shard_train_state(params, optax.adamw(1e-2), config=config)
        step = zj.make_train_step(loss_fn, state)
        for b in data:
            state, m = step(state, b)
        out[offload] = state.full_params(jnp.float32)
    # gradients cross to the host in bf16, as they were reduced: the same numbers
    assert max_rel_err(out["cpu"], out[None]) < 1e-6
