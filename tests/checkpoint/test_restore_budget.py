"""Restore under a host-memory budget: the state is read group by group (a param with the
optimizer leaves that mirror it), each laid out before the next is read. The result is the same
state, bit for bit, onto any mesh and stage; identical layers share one layout program; a damaged
leaf in any group is still named. A leaf larger than the budget is read in pieces (boxes of at
most a quarter of the budget, counted through the read hook) into its destination, and
consolidation streams it the same way."""
import json
import math
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
from zerojax.checkpoint import _pieces

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


# ------------------------------------------------------------------ leaves larger than the budget
BIG = (512, 256)  # 512 KiB in fp32: eight times the 64 KiB pieces of budget=256 KiB
BUDGET = 256 << 10
PIECE = BUDGET // fmt._GROUP_SHARE


def init_big(rng):
    k = jax.random.split(rng, 2)
    return {"emb": jax.random.normal(k[0], BIG), "head": {"w": jax.random.normal(k[1], (256, 8)) * 0.1}}


def loss_big(params, batch):
    return jnp.mean((params["emb"][batch["t"]] @ params["head"]["w"]) ** 2)


def big_target(n, **kw):
    return zj.abstract_train_state(init_big, optax.adamw(1e-2), mesh=zj.make_mesh(n), config=config(**kw))


@pytest.fixture(scope="module")
def saved_big(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("big"))
    state = zj.shard_train_state(init_big, optax.adamw(1e-2), mesh=zj.make_mesh(8), config=config(),
                                 rng=jax.random.PRNGKey(1))
    step = zj.make_train_step(loss_big, state)
    state, _ = step(state, {"t": jnp.arange(8 * 4).reshape(8, 4) % BIG[0]})  # moments that are not zeros
    with CheckpointManager(directory) as mngr:
        mngr.save(2, state)
    return directory, state


@pytest.fixture
def reads(monkeypatch):
    """(stored array, bytes) of every box read in pieces."""
    seen = []
    real = _pieces.read_box

    def counted(store, box):
        x = real(store, box)
        seen.append((str(store.kvstore.path), x.nbytes))
        return x

    monkeypatch.setattr(_pieces, "read_box", counted)
    return seen


def test_boxes_cover_a_region_once_in_row_major_order():
    lo, hi = (3, 0, 1), (40, 5, 9)
    got = np.zeros([h - a for a, h in zip(lo, hi)], int)
    order = []
    for box in _pieces.boxes(lo, hi, 4, 100, align=(16, 5, 8)):
        assert math.prod(s.stop - s.start for s in box) * 4 <= 100
        got[tuple(slice(s.start - a, s.stop - a) for s, a in zip(box, lo))] += 1
        order.append(tuple(s.start for s in box))
    assert (got == 1).all() and order == sorted(order)


@pytest.mark.parametrize("n,stage,precision", [(8, 3, "bf16"), (1, 3, "bf16"), (2, 1, "fp32")])
def test_a_leaf_larger_than_the_budget_is_read_in_pieces(saved_big, reads, n, stage, precision):
    directory, state = saved_big
    whole, _ = zj.checkpoint.restore(directory, big_target(n, stage=stage, precision=precision))
    assert not reads  # the default budget reads this state whole, through Orbax
    got, _ = zj.checkpoint.restore(directory, big_target(n, stage=stage, precision=precision), budget=BUDGET)
    assert_same(got, whole)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(whole)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
    emb = [size for path, size in reads if path.rstrip("/").endswith("params.emb")]
    mu = [size for path, size in reads if path.rstrip("/").endswith("mu.emb")]
    assert max(size for _, size in reads) <= PIECE
    assert sum(emb) >= 4 * BIG[0] * BIG[1] and len(emb) >= 8  # the whole leaf, in 8 pieces or more
    assert len(mu) >= 8
    if n == 8:
        assert_same(got, state)  # bit for bit the state that was saved


def test_a_damaged_leaf_read_in_pieces_is_named(saved_big, tmp_path, monkeypatch):
    directory = tmp_path / "ck"
    shutil.copytree(saved_big[0], directory)
    _flip_a_data_byte(directory)
    with pytest.raises(CheckpointError, match=str(directory / "2")):
        zj.checkpoint.restore(directory, big_target(8), budget=BUDGET)
    real = _pieces.read_box

    def one_wrong_value(store, box):  # a piece of the moment read back with one value changed
        x = real(store, box)
        if str(store.kvstore.path).rstrip("/").endswith("mu.emb") and box[0].start == 0:
            x = x.copy()
            x.flat[0] += 1.0
        return x

    monkeypatch.setattr(_pieces, "read_box", one_wrong_value)
    with pytest.raises(CheckpointError, match="opt_state/0/mu/emb"):
        zj.checkpoint.restore(saved_big[0], big_target(8), budget=BUDGET)


def test_consolidation_streams_a_leaf_in_pieces(saved_big, reads, tmp_path):
    directory, state = saved_big
    out = zj.checkpoint.consolidate(directory, tmp_path / "m.safetensors", progress=False, budget=BUDGET)
    assert max(size for _, size in reads) <= PIECE and len(reads) >= 8
    blob = open(out, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    start, stop = header["emb"]["data_offsets"]
    emb = np.frombuffer(blob[8 + n + start:8 + n + stop], np.float32).reshape(BIG)
    np.testing.assert_array_equal(emb, np.asarray(state.full_params(jnp.float32)["emb"]))
    with pytest.raises(zj.ZeroJaxError, match="budget"):
        zj.checkpoint.consolidate(directory, tmp_path / "x.safetensors", progress=False, budget=-1)
