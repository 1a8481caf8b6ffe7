"""Restore under a host-memory budget: the state is read group by group (a param with the
optimizer leaves that mirror it), each laid out before the next is read. The result is the same
state, bit for bit, onto any mesh and stage; identical layers share one layout program; a damaged
leaf in any group is still named."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.checkpoint.test_checkpoint import _flip_a_data_byte, assert_same
from zerojax.checkpoint import CheckpointError, CheckpointManager
from zerojax.checkpoint import _format as fmt

LAYERS = 4


def init(rng):
    keys = jax.random.split(rng, LAYERS + 1)
    params = {f"h{i}": {"w": jax.random.normal(keys[i], (16, 24)) * 0.2, "b": jnp.zeros((24,))}
              for i in range(LAYERS)}
    params["emb"] = jax.random.normal(keys[-1], (10, 16))
    return params


def loss(params, batch):
    h = params["emb"][batch["t"]]
    for i in range(LAYERS):
        layer = params[f"h{i}"]
        h = jnp.tanh(h @ layer["w"] + layer["b"])[..., :16]
    return jnp.mean(h ** 2)


def config(**kw):
    return zj.ZeroConfig(stage=kw.pop("stage", 3), precision=kw.pop("precision", "bf16"),
                         param_persistence_threshold=0, step_timeout=0, **kw)


def target(n, **kw):
    return zj.abstract_train_state(init, optax.adamw(1e-2), mesh=zj.make_mesh(n), config=config(**kw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("budget"))
    state = zj.shard_train_state(init, optax.adamw(1e-2), mesh=zj.make_mesh(8), config=config(),
                                 rng=jax.random.PRNGKey(0))
    step = zj.make_train_step(loss, state)
    for i in range(2):
        state, _ = step(state, {"t": jnp.arange(8 * 3).reshape(8, 3) % 10 + i})
    with CheckpointManager(directory) as mngr:
        mngr.save(2, state)
    return directory, state


def test_groups_follow_the_budget():
    abstract = target(8)
    opt = fmt._opt_entries(abstract.plan, abstract.opt_state)
    leaves = abstract.plan.leaves
    whole = fmt.read_groups(abstract.plan, opt, 1 << 30)
    assert len(whole) == 1 and sorted(whole[0][0]) == list(range(len(leaves)))
    one_each = fmt.read_groups(abstract.plan, opt, 1)
    assert [g[0] for g in one_each] == [[i] for i in range(len(leaves))]  # every param in its own group
    for pi, oi in one_each[1:]:  # ... with the optimizer leaves that mirror it (Adam's two moments)
        assert {opt[j][2].path for j in oi} == {leaves[pi[0]].path} and len(oi) == 2
    assert {opt[j][2] for j in one_each[0][1]} >= {None}  # the count rides with the first group
    assert sorted(j for _, oi in one_each for j in oi) == list(range(len(opt)))


@pytest.mark.parametrize("n,stage,precision", [(8, 3, "bf16"), (4, 1, "fp32")])
def test_any_budget_restores_the_same_state_on_any_mesh(saved, n, stage, precision):
    directory, _ = saved
    want, _ = zj.checkpoint.restore(directory, target(n, stage=stage, precision=precision))
    before = fmt.program_misses
    got, _ = zj.checkpoint.restore(directory, target(n, stage=stage, precision=precision), budget=1)
    # one program per distinct leaf layout (the layers share theirs), not one per group
    assert fmt.program_misses - before <= 4
    assert_same(got, want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.sharding == b.sharding


def test_restored_state_equals_the_saved_one(saved):
    directory, state = saved
    got, _ = CheckpointManager(directory).restore(target(8), budget=1)
    assert_same(got, state)


def test_a_damaged_leaf_in_a_later_group_is_named(saved, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    _flip_a_data_byte(directory)
    with pytest.raises(CheckpointError, match=str(directory / "2")):
        zj.checkpoint.restore(directory, target(8), budget=1)


def test_a_bad_budget_is_refused(saved):
    with pytest.raises(CheckpointError, match="budget"):
        zj.checkpoint.restore(saved[0], target(8), budget=0)
