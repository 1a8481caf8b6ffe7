"""offload_ratio (DeepSpeed's offload_optimizer.ratio): a share of the optimizer state lives and
is updated in host memory, the rest on the device, in one step, with the numbers of plain optax."""
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import OPTIMIZERS, batches, init_params, loss_fn, max_rel_err, reference_train
from zerojax.checkpoint import CheckpointManager
from zerojax.kernels import _native as native
from zerojax._plan import host_share

N = 8  # devices (tests/conftest.py)
TX = lambda: optax.adamw(1e-2, weight_decay=0.1)


def config(ratio=0.5, offload="cpu", **kw):
    return zj.ZeroConfig(stage=3, offload_optimizer=offload, offload_ratio=ratio, param_persistence_threshold=0,
                         **kw)


def train(state, data):
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    return state


def per_device_elements(plan):
    """path -> elements of one fp32 copy of the leaf on each device: every leaf is split over the
    8 devices at stage 3 with threshold 0, in its padded storage shape."""
    return {lay.path: int(np.prod(lay.storage_shape)) // N for lay in plan.leaves}


def greedy(sizes: dict, ratio: float) -> set:
    """The documented rule, written out: largest first (ties by name order), take a leaf when
    that brings the host total strictly closer to ratio * total."""
    target, host, taken = ratio * sum(sizes.values()), 0, set()
    for path in sorted(sizes, key=lambda p: (-sizes[p], list(sizes).index(p))):
        if abs(host + sizes[path] - target) < abs(host - target):
            taken.add(path)
            host += sizes[path]
    return taken


# ------------------------------------------------------------------------------ the split
def test_host_share_is_a_deterministic_largest_first_greedy():
    assert host_share([5, 4, 3, 3], 0.5) == [True, True, False, False]  # 9/15: greedy, not the best 7/15
    assert host_share([3, 3, 4, 5], 0.5) == [False, False, True, True]
    assert host_share([2, 2, 2, 2], 0.5) == [True, True, False, False]  # ties: earliest first
    assert host_share([7, 1], 1.0) == [True, True]
    assert host_share([10, 10], 0.2) == [False, False]  # below half the smallest share: nothing moves
    rng = np.random.default_rng(0)
    for _ in range(50):  # never farther from the target than the closer of "all" and "none" of the rest
        sizes = [int(s) for s in rng.integers(1, 100, 6)]
        r = float(rng.uniform(0.05, 0.95))
        got = sum(s for s, t in zip(sizes, host_share(sizes, r)) if t) / sum(sizes)
        best = min(abs(sum(c) / sum(sizes) - r) for k in range(7) for c in itertools.combinations(sizes, k))
        assert abs(got - r) <= max(sizes) / sum(sizes) / 2 + 1e-12 and abs(got - r) >= best - 1e-12


def test_plan_splits_whole_leaves_by_the_greedy_rule():
    params = init_params(jax.random.PRNGKey(0))
    plan = zj.ZeroPlan.create(params, zj.make_mesh(), config(0.5))
    sizes = per_device_elements(plan)
    want = greedy(sizes, 0.5)
    assert plan.offloaded_paths == want and 0 < len(want) < len(sizes) and plan.partial_offload
    share = sum(sizes[p] for p in want) / sum(sizes.values())
    # the model's leaves allow no closer split than this one
    best = min(abs(sum(sizes[p] for p in c) / sum(sizes.values()) - 0.5)
               for k in range(len(sizes) + 1) for c in itertools.combinations(sizes, k))
    assert plan.host_fraction == pytest.approx(share) and abs(share - 0.5) == pytest.approx(best)
    full = zj.ZeroPlan.create(params, zj.make_mesh(), config(1.0))
    assert full.offloaded_paths == set(sizes) and not full.partial_offload
    assert "opt state host" in plan.describe() and "opt state device" in plan.describe()


# ------------------------------------------------------------------ memory and placement
def test_ratio_half_memory_per_device_matches_the_split():
    params = init_params(jax.random.PRNGKey(0))
    states = {r: zj.shard_train_state(params, TX(), config=config(r, precision="bf16")) for r in (0.5, 1.0)}
    states[None] = zj.shard_train_state(params, TX(), config=config(1.0, offload=None, precision="bf16"))
    sizes = per_device_elements(states[0.5].plan)
    host = sum(sizes[p] for p in greedy(sizes, 0.5))
    dev = sum(sizes.values()) - host
    count = 4  # adam's int32 step count: no param owns it, it stays with the offloaded state
    report = zj.memory_report(states[0.5])
    # fp32 master 4 bytes, mu and nu 4 + 4 bytes per element; the bf16 params stay on the device
    assert report.by_part["master"] == {"pinned_host": 4 * host, "device": 4 * dev}
    assert report.by_part["optimizer"] == {"pinned_host": 8 * host + count, "device": 8 * dev}
    assert report.by_part["params"] == {"device": 2 * (host + dev)}
    assert report.max_bytes("pinned_host") == 12 * host + count
    other = zj.memory_report(states[None]).max_bytes("device") - 14 * (host + dev) - count
    assert report.max_bytes("device") == 2 * (host + dev) + 12 * dev + other
    for d in report.per_device.values():  # every device holds the same
        assert d == {"pinned_host": 12 * host + count, "device": 2 * (host + dev) + 12 * dev + other}
    full = zj.memory_report(states[1.0])
    assert full.max_bytes("pinned_host") == 12 * (host + dev) + count
    assert full.max_bytes("device") == 2 * (host + dev) + other
    # the shape-only estimate says the same
    est = zj.estimate(params, zj.make_mesh(), config(0.5, precision="bf16"), TX())
    assert est.per_device == report.per_device and est.by_part == report.by_part


def test_each_leaf_of_master_and_opt_state_lives_where_the_split_says():
    params = init_params(jax.random.PRNGKey(0))
    state = zj.shard_train_state(params, TX(), config=config(0.5, precision="bf16"))
    state = train(state, batches(1))  # and stays there after a step
    on_host = greedy(per_device_elements(state.plan), 0.5)
    kind = lambda path: "pinned_host" if path in on_host else "device"
    paths = [lay.path for lay in state.plan.leaves]
    adam = state.opt_state[0]  # optax.adamw = chain(scale_by_adam, add_decayed_weights, scale_by_lr)
    for tree in (state.master, adam.mu, adam.nu):
        leaves = state.plan.treedef.flatten_up_to(tree)
        assert [x.sharding.memory_kind for x in leaves] == [kind(p) for p in paths]
    assert adam.count.sharding.memory_kind == "pinned_host"
    for x in jax.tree_util.tree_leaves(state.params):
        assert x.sharding.memory_kind == "device"


def _host_call_gradients(state, batch):
    text = zj.make_train_step(loss_fn, state).lower(state, batch).as_text()
    calls = [line for line in text.splitlines() if "call @host_apply(" in line]
    assert len(calls) == 1 and '_xla_compute_type = "host"' in calls[0]
    operands = calls[0].split(":", 1)[1].split("->")[0]
    return [t for t in operands.split("tensor<")[1:] if "bf16" in t]


def test_only_the_host_side_goes_to_the_host(monkeypatch):
    # both under compute_on, as on a GPU mesh (full offload on this CPU mesh would otherwise run
    # the native host kernel, which tests/offload/test_offload_placement.py checks)
    monkeypatch.setattr(native, "available", lambda warn=True: False)
    params = init_params(jax.random.PRNGKey(0))
    b = batches(1)[0]
    half = zj.shard_train_state(params, TX(), config=config(0.5, precision="bf16"))
    full = zj.shard_train_state(params, TX(), config=config(1.0, precision="bf16"))
    assert len(_host_call_gradients(half, b)) == len(half.plan.offloaded_paths) < len(half.plan.leaves)
    assert len(_host_call_gradients(full, b)) == len(full.plan.leaves)


# ------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_ratio_half_trains_like_full_offload_no_offload_and_plain_optax(precision):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)
    out = {}
    for ratio, offload in ((0.5, "cpu"), (1.0, "cpu"), (1.0, None)):
        state = zj.shard_train_state(params, TX(), config=config(ratio, offload, precision=precision,
                                                                gradient_clipping=0.3))
        out[ratio, offload] = train(state, data).full_params(jnp.float32)
    assert max_rel_err(out[0.5, "cpu"], out[1.0, "cpu"]) < 1e-6
    assert max_rel_err(out[0.5, "cpu"], out[1.0, None]) < 1e-6
    if precision == "fp32":
        want, _ = reference_train(params, TX(), data, clip=0.3)
        assert max_rel_err(out[0.5, "cpu"], want) < 1e-6


# optimizers whose host update falls back to the device (see test_offload_placement.py)
UPDATED_ON_DEVICE = {"adafactor", "lamb"}
MIXES_PARAMS = {"chain_clip_schedule"}  # optax.clip_by_global_norm inside the optimizer


@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - MIXES_PARAMS))
def test_every_per_leaf_optimizer_splits(name):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(3)
    want, _ = reference_train(params, OPTIMIZERS[name](), data)
    state = zj.shard_train_state(params, OPTIMIZERS[name](), config=config(0.5))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state = train(state, data)
    assert any(issubclass(w.category, zj.HostUpdateWarning) for w in seen) == (name in UPDATED_ON_DEVICE)
    assert max_rel_err(state.full_params(), want) < 1e-6


# ------------------------------------------------------------------------------ refusals
def test_an_optimizer_that_mixes_params_is_refused_by_name():
    params = init_params(jax.random.PRNGKey(0))
    with pytest.raises(zj.ConfigError, match=r"offload_ratio=0.5.*cannot be split by param.*clip_by_global_norm"):
        zj.shard_train_state(params, OPTIMIZERS["chain_clip_schedule"](), config=config(0.5))
    # one non-finite count for every param: state that no single param owns, computed from all
    tx = optax.apply_if_finite(optax.adam(1e-2), 3)
    with pytest.raises(zj.ConfigError, match=r"offload_ratio=0.5.*cannot be split by param: .* depends on params whose state is in host memory"):
        zj.shard_train_state(params, tx, config=config(0.5))
    with pytest.raises(zj.ConfigError, match=r"offload_ratio"):  # a step built for a state made elsewhere
        zj.make_train_step(loss_fn, zj.shard_train_state(params, tx, config=config(1.0)).replace(
            plan=zj.ZeroPlan.create(params, zj.make_mesh(), config(0.5))))
    # the same optimizers are fine when nothing is split
    zj.shard_train_state(params, tx, config=config(1.0))


def test_factored_adafactor_statistics_follow_their_param():
    """adafactor's row and column statistics of a 128 x 128 weight belong to that weight."""
    key = jax.random.PRNGKey(1)
    params = {"w": jax.random.normal(key, (128, 128)) * 0.1, "b": jnp.zeros((200,))}
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (4, 32, 128)))

    def loss(p, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ p["w"]) ** 2) + jnp.mean((p["b"] - 1.0) ** 2)

    tx = lambda: optax.adafactor(1e-2)
    want, s = params, tx().init(params)
    for xb in x:
        g = jax.grad(loss)(want, {"x": xb})
        u, s = tx().update(g, s, want)
        want = optax.apply_updates(want, u)
    state = zj.shard_train_state(params, tx(), config=config(0.5))
    assert state.plan.offloaded_paths == {"w"}
    factored = [leaf for leaf in jax.tree_util.tree_leaves(state.opt_state) if leaf.shape == (128,)]
    assert len(factored) == 2 and {f.sharding.memory_kind for f in factored} == {"pinned_host"}
    step = zj.make_train_step(loss, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zj.HostUpdateWarning)  # adafactor updates on the device
        for xb in x:
            state, _ = step(state, {"x": xb})
    assert max_rel_err(state.full_params(), want) < 1e-6


@pytest.mark.parametrize("offload", [None, "nvme"])
def test_ratio_without_in_step_cpu_offload_is_refused(offload, tmp_path):
    params = init_params(jax.random.PRNGKey(0))
    with pytest.raises(zj.ConfigError, match=r"offload_ratio=0.5.*offload_optimizer=\"cpu\""):
        zj.shard_train_state(params, TX(), config=config(0.5, offload, nvme_path=str(tmp_path)))


# ----------------------------------------------------------------------- DeepSpeed config
def test_initialize_from_a_deepspeed_dict_with_ratio_trains():
    params = init_params(jax.random.PRNGKey(0))
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    state, step = zj.initialize(params, loss_fn, ds)
    assert state.plan.config.offload_ratio == 0.5 and state.plan.partial_offload
    data = batches(4)
    for b in data:
        state, m = step(state, b)
    assert not bool(m["skipped"])
    want, _ = reference_train(params, zj.optimizer_from_config(zj.ZeroConfig.from_deepspeed(ds, world_size=N)), data)
    assert max_rel_err(state.full_params(), want) < 1e-6


# ------------------------------------------------------------------------------ checkpoints
def _values(state):
    """Params (fp32) and the logical optimizer leaves, on the host."""
    plan = state.plan
    out = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state.full_params(jnp.float32)))]
    adam = state.opt_state[0]
    for tree in (adam.mu, adam.nu):
        for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(tree)):
            out.append(np.asarray(jax.device_get(x))[tuple(slice(0, s) for s in lay.shape)])
    return out + [np.asarray(adam.count), np.asarray(state.step)]


def test_checkpoint_moves_between_ratio_half_and_full_offload(tmp_path):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)
    half = train(zj.shard_train_state(params, TX(), config=config(0.5, precision="bf16")), data[:2])
    with CheckpointManager(str(tmp_path / "half")) as mngr:
        mngr.save(2, half, data_state={"next": 2})
    target = zj.abstract_train_state(params, TX(), mesh=zj.make_mesh(), config=config(1.0, precision="bf16"))
    full, data_state = CheckpointManager(str(tmp_path / "half")).restore(target)
    assert data_state == {"next": 2}
    for x, y in zip(_values(half), _values(full)):
        np.testing.assert_array_equal(x, y)
    for got, want in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(target)):
        assert got.sharding.memory_kind == want.sharding.memory_kind
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves((full.master, full.opt_state))} == {"pinned_host"}
    # and back into a split state
    with CheckpointManager(str(tmp_path / "full")) as mngr:
        mngr.save(2, full)
    target = zj.abstract_train_state(params, TX(), mesh=zj.make_mesh(), config=config(0.5, precision="bf16"))
    back, _ = CheckpointManager(str(tmp_path / "full")).restore(target)
    for x, y in zip(_values(half), _values(back)):
        np.testing.assert_array_equal(x, y)
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(target)):
        assert got.sharding.memory_kind == want.sharding.memory_kind
    # resuming on either setting continues the same run
    a, b = train(back, data[2:]), train(full, data[2:])
    assert max_rel_err(a.full_params(jnp.float32), b.full_params(jnp.float32)) < 1e-6
