"""Offloaded state lives in host memory between steps and trains exactly like on-device state."""
import jax
import optax
import pytest

import zerojax as zj
from helpers import batches, init_params, loss_fn, max_rel_err, reference_train


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
