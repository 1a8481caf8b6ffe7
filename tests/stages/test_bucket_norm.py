"""The gradients' global norm where the step already holds them in buckets: stages 1 and 2
(without accumulation) take each reduce-scattered bucket's sum of squares as one reduction,
instead of one reduction per leaf; everywhere else the norm is taken per leaf. The value is
the same either way (the padding of a bucket is zeros)."""
import jax
import numpy as np
import optax
import pytest

import zerojax as zj
import zerojax._precision as precision
from tests.helpers import batches, init_params, loss_fn, walk
from zerojax.stages._gradients import grads_fn


def _state(stage, gas=1, **extra):
    config = zj.ZeroConfig(stage=stage, gradient_accumulation_steps=gas, **extra)
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.adam(1e-2), config=config)


def _scalar_dots(jaxpr) -> int:
    """dot_generals with a scalar result (the sums of squares), nested programs included."""
    return sum(eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape == () for eqn in walk(jaxpr))


@pytest.mark.parametrize("stage,gas,extra", [
    (0, 1, {}), (1, 1, {}), (1, 2, {}), (2, 1, {}), (2, 2, {}), (3, 1, {}),
    (1, 1, {"reduce_scatter": False}), (2, 1, {"reduce_bucket_size": 64}),
])
def test_sum_of_squares_equals_the_returned_gradients(stage, gas, extra):
    state = _state(stage, gas, **extra)
    run = jax.jit(grads_fn(loss_fn, state.plan, with_sumsq=True))
    batch = batches(1)[0]
    grads, loss, sumsq = run(state.params, batch, np.float32(4.0), jax.random.PRNGKey(1))
    want = sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in jax.tree_util.tree_leaves(grads))
    np.testing.assert_allclose(float(sumsq), want, rtol=1e-6)
    # and the step's reported norm is that of the unscaled gradients, as plain optax computes it
    step = zj.make_train_step(loss_fn, state, donate=False)
    _, metrics = step(state, batch)
    plain = optax.tree.norm(jax.grad(loss_fn)(init_params(jax.random.PRNGKey(0)), batch))
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(plain), rtol=1e-5)


@pytest.mark.parametrize("stage,gas,per_bucket", [(0, 1, False), (1, 1, True), (1, 2, True), (2, 1, True),
                                                  (2, 2, False)])
def test_norm_is_one_reduction_per_bucket_where_the_gradients_are_reduced_once(stage, gas, per_bucket, monkeypatch):
    monkeypatch.setattr(precision, "SMALL_LEAF", 1)  # no leaf is summed with others: one reduction a leaf
    state = _state(stage, gas, reduce_bucket_size=10**9)  # every partitioned leaf in one bucket
    plan = state.plan
    whole = sum(not plan.grad_partitioned(lay) for lay in plan.leaves)
    parts = len(plan.leaves) - whole
    assert parts > 1 or stage == 0  # otherwise one bucket and per leaf are the same count
    batch = batches(1, 8 * gas)[0]
    jaxpr = jax.make_jaxpr(zj.make_train_step(loss_fn, state).jitted)(state, batch).jaxpr
    assert _scalar_dots(jaxpr) == whole + (1 if per_bucket else parts)
    assert stage > 0 or whole == len(plan.leaves)


@pytest.mark.parametrize("stage", [0, 3])
def test_small_leaves_are_summed_as_one_vector(stage):
    """Leaves below SMALL_LEAF elements (every leaf of this model) share one reduction: stage 0's
    whole leaves, and stage 3's shards, each summed as one flattened vector."""
    state = _state(stage)
    assert all(lay.size < precision.SMALL_LEAF for lay in state.plan.leaves) and len(state.plan.leaves) > 2
    jaxpr = jax.make_jaxpr(zj.make_train_step(loss_fn, state).jitted)(state, batches(1)[0]).jaxpr
    whole = any(not state.plan.grad_partitioned(lay) for lay in state.plan.leaves)
    parts = any(state.plan.grad_partitioned(lay) for lay in state.plan.leaves)
    assert _scalar_dots(jaxpr) == int(whole) + int(parts)


def test_total_sum_of_squares_mixes_large_and_small_leaves():
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(s).astype(np.float32) for s in
              [(precision.SMALL_LEAF + 3,), (3, 5), (7,), (2, precision.SMALL_LEAF // 2), ()]]
    got = jax.jit(precision.total_sum_of_squares)(leaves)
    want = sum(float(np.sum(np.square(x.astype(np.float64)))) for x in leaves)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    assert float(jax.jit(precision.total_sum_of_squares)([])) == 0.0
    leaves[1][2, 3] = np.inf  # inf in a small leaf reaches the total
    assert not np.isfinite(float(jax.jit(precision.total_sum_of_squares)(leaves)))
