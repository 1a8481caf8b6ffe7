"""ZeRO's partitions over the data axis times the mesh's other replicating axes.

A mesh with a sequence-parallel "seq" axis: every model state ZeRO splits is split over
data x seq (as DeepSpeed's ZeRO shards over its data x sequence-parallel ranks), the "seq"
axis staying automatic inside the step's data-manual body; training equals plain optax,
with the batch split over data x seq (its sequence dim over "seq").
"""
import math

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_run


@pytest.fixture(scope="module")
def reference():
    params = init_params(jax.random.PRNGKey(0))
    data = batches(3)
    return params, data, reference_run(params, optax.adamw(1e-2), data)


@pytest.mark.parametrize("shape,stage", [((4, 2), 1), ((4, 2), 3), ((2, 4), 2)])
def test_states_split_over_data_and_seq_and_train_like_optax(reference, shape, stage):
    params, data, ref = reference
    mesh = zj.make_mesh(shape, ("data", "seq"))
    state = zj.shard_train_state(params, optax.adamw(1e-2), mesh=mesh,
                                 config=zj.ZeroConfig(stage=stage, param_persistence_threshold=0))
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    assert max_rel_err(jax.device_get(state.full_params()), ref.params) < 1e-5

    plan = state.plan
    moments = [x for x, lay in zip(jax.tree_util.tree_leaves(state.opt_state),
                                   plan.opt_leaf_layouts(state.opt_state, stored=True)) if lay is not None]
    assert moments
    for lay in plan.leaves:
        assert lay.extra == ("seq",), lay.path
    for x in moments:  # each device holds 1/8 of every moment, not 1/data
        assert x.sharding.spec[next(i for i, e in enumerate(x.sharding.spec) if e)] == ("data", "seq")
        assert {s.data.size for s in x.addressable_shards} == {x.size // 8}
    stored = jax.tree_util.tree_leaves(state.params)
    want = 8 if stage == 3 else 1
    for lay, x in zip(plan.leaves, stored):
        assert {s.data.size for s in x.addressable_shards} == {math.prod(plan.param_shape(lay)) // want}, lay.path
