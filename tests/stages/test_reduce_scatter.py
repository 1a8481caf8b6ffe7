"""``reduce_scatter=False`` (DeepSpeed's zero_optimization.reduce_scatter): stages 1 and 2
average the gradients with an all-reduce (each device keeping its own partition) instead of
a reduce-scatter; the numbers do not change, the compiled collectives do; stage 3 ignores it."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_train
from zerojax._errors import IgnoredKeysWarning


def _train(stage, gas, reduce_scatter, tx, data):
    config = zj.ZeroConfig(stage=stage, gradient_accumulation_steps=gas, reduce_scatter=reduce_scatter)
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx, config=config)
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state.full_params(), losses


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("gas", [1, 2])
def test_all_reduce_matches_reduce_scatter_and_plain_optax(stage, gas):
    data = batches(4)
    want, want_losses = reference_train(init_params(jax.random.PRNGKey(0)), optax.adamw(1e-2, weight_decay=0.1), data)
    got, losses = _train(stage, gas, False, optax.adamw(1e-2, weight_decay=0.1), data)
    scattered, _ = _train(stage, gas, True, optax.adamw(1e-2, weight_decay=0.1), data)
    assert max_rel_err(got, want) < 1e-6
    assert max_rel_err(got, scattered) < 1e-6
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


def _data_loss(params, batch):
    """``loss_fn`` scaled by the batch, so that no gradient is the same in every micro-batch (the
    compiler would reduce such a gradient once, outside the micro-batch loop)."""
    return loss_fn(params, batch) * (1.0 + 1e-3 * jnp.mean(batch["y"].astype(jnp.float32)))


def _padded(lays) -> int:
    """Elements of the leaves' padded storage: what one reduce-scatter of their gradients moves."""
    return sum(lay.size + lay.pad * lay.size // lay.shape[lay.axis] for lay in lays)


def _report(stage, gas, reduce_scatter, bucket, **extra):
    config = zj.ZeroConfig(stage=stage, gradient_accumulation_steps=gas, reduce_scatter=reduce_scatter,
                           reduce_bucket_size=bucket, **extra)
    state = zj.abstract_train_state(init_params, optax.sgd(0.1), config=config)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(1, 8 * gas)[0])
    return zj.comm_report(zj.make_train_step(_data_loss, state), state, batch), state.plan


@pytest.mark.parametrize("stage,gas", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_compiled_step_all_reduces_instead_of_reduce_scattering(stage, gas):
    rs, plan = _report(stage, gas, True, 1)
    ar, _ = _report(stage, gas, False, 1)
    lays = plan.leaves
    psi = sum(lay.size for lay in lays)
    padded = _padded(lays)
    reductions = gas if stage == 2 else 1  # stage 2 reduces every micro-batch, stage 1 once per step
    # reduce_scatter=True: the gradients leave through reduce-scatters of Ψ (padded) per reduction
    assert rs.kinds["reduce-scatter"][2] == reductions * padded, rs
    assert rs.kinds["reduce-scatter"][1] == reductions * padded * 4, rs  # fp32
    # reduce_scatter=False: no reduce-scatter; all-reduces of 2Ψ (unpadded) per reduction instead
    assert "reduce-scatter" not in ar.kinds, ar
    assert ar.kinds["all-reduce"][2] - rs.kinds["all-reduce"][2] == reductions * 2 * psi, (rs, ar)
    assert ar.kinds["all-reduce"][1] - rs.kinds["all-reduce"][1] == reductions * 2 * psi * 4, (rs, ar)
    assert ar.largest_all_reduce == max(lay.size for lay in lays)
    assert ar.kinds["all-gather"] == rs.kinds["all-gather"]  # the params' gather is unchanged


def test_stage3_ignores_it_with_a_warning_naming_the_key():
    params = init_params(jax.random.PRNGKey(0))
    with pytest.warns(IgnoredKeysWarning, match="reduce_scatter"):
        zj.ZeroPlan.create(params, zj.make_mesh(), zj.ZeroConfig(stage=3, reduce_scatter=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        for stage in (1, 2):
            zj.ZeroPlan.create(params, zj.make_mesh(), zj.ZeroConfig(stage=stage, reduce_scatter=False))
        zj.ZeroPlan.create(params, zj.make_mesh(), zj.ZeroConfig(stage=3))
    # and the stage-3 step still reduce-scatters, as DeepSpeed's does (gathered and persistent params)
    with pytest.warns(IgnoredKeysWarning):
        ar, plan = _report(3, 1, False, 1, param_persistence_threshold=100)
    rs, _ = _report(3, 1, True, 1, param_persistence_threshold=100)
    assert {lay.params_partitioned for lay in plan.leaves} == {True, False}
    padded = _padded(plan.leaves)
    # every leaf's gradient is reduce-scattered, each element once (several leaves may share one)
    assert ar.kinds == rs.kinds and rs.kinds["reduce-scatter"][2] == padded, (rs.kinds, padded)
