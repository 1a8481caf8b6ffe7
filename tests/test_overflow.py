"""Overflow handling in the step: DeepSpeed's loss-scaler semantics, skipped steps change nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn


def poisoned_loss(params, batch):
    # poison = inf puts an inf into the gradient of "odd" (and the loss); 0 leaves all as is
    return loss_fn(params, batch) + jnp.sum(params["odd"].astype(jnp.float32)) * batch["poison"][0]


def poisoned_batches(flags):
    out = []
    for b, bad in zip(batches(len(flags)), flags):
        b = dict(b)
        b["poison"] = np.full((32,), np.inf if bad else 0.0, np.float32)
        out.append(b)
    return out


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("stage,offload", [(1, None), (3, None), (2, "cpu")])
def test_fp16_overflow_sequence_and_bitwise_skip(stage, offload):
    flags = [True, True, False, False, False, True]
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 0.0, 100))
    config = zj.ZeroConfig(stage=stage, precision="fp16", initial_scale_power=8, loss_scale_window=2,
                           hysteresis=2, param_persistence_threshold=0, offload_optimizer=offload)
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx, config=config)
    step = zj.make_train_step(poisoned_loss, state)
    seen = []
    for bad, b in zip(flags, poisoned_batches(flags)):
        before = leaves((state.params, state.master, state.opt_state))
        state, m = step(state, b)
        after = leaves((state.params, state.master, state.opt_state))
        seen.append((float(state.loss_scale.scale), int(state.loss_scale.hysteresis)))
        assert bool(m["skipped"]) == bad
        same = all(np.array_equal(x, y) for x, y in zip(before, after))
        assert same == bad  # skipped: bitwise unchanged; clean: updated
    # REFERENCE.md §4 test vector
    assert seen == [(256, 1), (128, 1), (128, 1), (128, 1), (256, 2), (256, 1)]
    # the schedule advanced only on the 3 clean steps; the global step counter on all 6
    assert int(state.opt_state.count) == 3
    assert int(state.step) == 6


def test_bf16_skips_non_finite_gradients():
    config = zj.ZeroConfig(stage=2, precision="bf16")
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.adamw(1e-2), config=config)
    step = zj.make_train_step(poisoned_loss, state)
    before = leaves(state.master)
    state, m = step(state, poisoned_batches([True])[0])
    assert bool(m["skipped"])
    assert all(np.array_equal(x, y) for x, y in zip(before, leaves(state.master)))
    state, m = step(state, poisoned_batches([False])[0])
    assert not bool(m["skipped"])


def test_overflow_at_minimum_scale_raises_on_host_and_keeps_state():
    config = zj.ZeroConfig(stage=1, precision="fp16", initial_scale_power=8, hysteresis=1, min_loss_scale=256)
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.adamw(1e-2), config=config)
    step = zj.make_train_step(poisoned_loss, state)
    with pytest.raises(zj.LossScaleError, match="minimum") as info:
        step(state, poisoned_batches([True])[0])
    kept = info.value.state
    assert float(kept.loss_scale.scale) == 256 and bool(kept.loss_scale.at_minimum)
    assert int(kept.step) == 1


def test_fp32_non_finite_loss_is_a_clear_error():
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.adamw(1e-2),
                                 config=zj.ZeroConfig(stage=2))
    step = zj.make_train_step(poisoned_loss, state)
    before = leaves(state.params)
    with pytest.raises(zj.NonFiniteError, match="inf/nan.*fp32") as info:
        step(state, poisoned_batches([True])[0])
    assert all(np.array_equal(x, y) for x, y in zip(before, leaves(info.value.state.params)))
