"""Every stage x every optimizer reproduces plain unsharded optax, clipping and mixed precision their
written-out references; shardings follow the plan."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import broken
from tests.helpers import (
    OPTIMIZERS,
    batches,
    init_params,
    loss_fn,
    max_rel_err,
    mixed_reference_run,
    reference_run,
    reference_train,
)
from zerojax import _precision


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def data():
    return batches(10)


def run_zero(params, tx, data, **config):
    """(final state, every step's metrics as floats)."""
    config.setdefault("param_persistence_threshold", 0)
    state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(**config))
    step = zj.make_train_step(loss_fn, state)
    history = []
    for b in data:
        state, metrics = step(state, b)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def column(history, key):
    return [m[key] for m in history]


@pytest.fixture(scope="module")
def plain_reference(params, data):
    """Plain optax's (final params, losses) per optimizer, computed once for the four stages."""
    cache = {}

    def get(opt):
        if opt not in cache:
            cache[opt] = reference_train(params, OPTIMIZERS[opt](), data)
        return cache[opt]

    return get


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_plain_optax_fp32(stage, opt, params, data, plain_reference):
    want, want_losses = plain_reference(opt)
    state, history = run_zero(params, OPTIMIZERS[opt](), data, stage=stage)
    assert max_rel_err(state.full_params(), want) < 1e-6
    np.testing.assert_allclose(column(history, "loss"), want_losses, rtol=1e-6)


def test_the_chained_clip_engages_on_every_step(params, data):
    """OPTIMIZERS["chain_clip_schedule"] clips at 0.05, below every step's global norm: a ZeRO
    update that took the norm over its own partition only would not match the reference."""
    assert min(reference_run(params, OPTIMIZERS["chain_clip_schedule"](), data).norms) > 0.05


# ------------------------------------------------------------------ clipping
CLIP = 0.05  # below every step's gradient norm (0.17-0.36 on these batches): it clips every step


@pytest.fixture(scope="module")
def clipped_reference(params, data):
    return reference_run(params, optax.adamw(1e-2), data, clip=CLIP)


def check_accumulation_and_clipping(stage, params, data, ref):
    # 4 micro-batches of 8 give the same mean gradient as one batch of 32
    state, history = run_zero(params, optax.adamw(1e-2), data, stage=stage, gradient_accumulation_steps=4,
                              gradient_clipping=CLIP)
    assert min(ref.norms) > CLIP  # the clip engages on every step
    np.testing.assert_allclose(column(history, "grad_norm"), ref.norms, rtol=1e-5)
    err = max_rel_err(state.full_params(), ref.params)
    assert err < 1e-6, f"params differ from the clipped reference by {err:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_accumulation_and_clipping(stage, params, data, clipped_reference):
    check_accumulation_and_clipping(stage, params, data, clipped_reference)


def test_clipping_check_catches_an_inverted_coefficient(monkeypatch, params, data, clipped_reference):
    broken.invert_clipping(monkeypatch)
    with pytest.raises(AssertionError):
        check_accumulation_and_clipping(2, params, data, clipped_reference)


# ------------------------------------------------------------------ mixed precision
SCALE_POWER = 8  # a dynamic scale that never overflows here: no step is skipped


@pytest.fixture(scope="module")
def mixed_reference(params, data):
    """The casting reference per precision (one gradient-accumulation step: the same at every stage)."""
    cache = {}

    def get(precision):
        if precision not in cache:
            scale = 2.0**SCALE_POWER if precision == "fp16" else 1.0
            cache[precision] = mixed_reference_run(params, optax.adamw(1e-2), data, precision, scale=scale)
        return cache[precision]

    return get


def check_mixed_precision(stage, precision, params, data, ref):
    state, history = run_zero(params, optax.adamw(1e-2), data, stage=stage, precision=precision,
                              initial_scale_power=SCALE_POWER)
    scale = 2.0**SCALE_POWER if precision == "fp16" else 1.0
    assert column(history, "loss_scale") == [scale] * len(data) and not any(column(history, "skipped"))
    assert jax.tree_util.tree_leaves(state.params)[0].dtype == _precision.compute_dtype(precision)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.master))
    err = max_rel_err(state.full_params(jnp.float32), ref.params)
    assert err < 1e-5, f"params differ from the casting reference by {err:.2e}"
    np.testing.assert_allclose(column(history, "loss"), ref.losses, rtol=1e-5)
    np.testing.assert_allclose(column(history, "grad_norm"), ref.norms, rtol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_tracks_fp32_master_reference(stage, precision, params, data, mixed_reference):
    check_mixed_precision(stage, precision, params, data, mixed_reference(precision))


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (3, "fp16")])
def test_mixed_precision_check_catches_an_update_without_master(monkeypatch, stage, precision, params, data,
                                                                 mixed_reference):
    broken.update_without_master(monkeypatch)
    with pytest.raises(AssertionError):
        check_mixed_precision(stage, precision, params, data, mixed_reference(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_leaf_sharded_as_planned(stage, precision, params, data):
    state, _ = run_zero(params, optax.adamw(1e-2), data[:1], stage=stage, precision=precision)
    plan = state.plan
    for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(state.params)):
        assert x.sharding.is_equivalent_to(plan.param_sharding(lay), x.ndim), lay.path
        assert x.shape == plan.param_shape(lay)
        assert (lay.params_partitioned) == (stage == 3)
    if precision == "bf16":
        for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(state.master)):
            assert x.sharding.is_equivalent_to(plan.master_sharding(lay), x.ndim), lay.path
    mu = state.opt_state[0].mu
    for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(mu)):
        split = x.sharding.shard_shape(x.shape) != x.shape
        assert split == (stage >= 1), (lay.path, x.sharding)
        # per device: 1/N of the padded leaf
        if stage >= 1:
            assert x.addressable_shards[0].data.size == lay.padded * (lay.size // lay.shape[lay.axis]) // 8


def test_stage3_persistence_threshold_keeps_small_params_whole(params):
    config = zj.ZeroConfig(stage=3, param_persistence_threshold=100)
    state = zj.shard_train_state(params, optax.sgd(0.1), config=config)
    split = {lay.path: lay.params_partitioned for lay in state.plan.leaves}
    assert split == {"emb": True, "dense/kernel": True, "dense/bias": False, "odd": False, "out": True}  # 100 elements: not fewer than 100
    want, _ = reference_train(params, optax.sgd(0.1), batches(3))
    step = zj.make_train_step(loss_fn, state)
    for b in batches(3):
        state, _ = step(state, b)
    assert max_rel_err(state.full_params(), want) < 1e-6


def test_caller_arrays_survive_donated_steps(params):
    mine = jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.devices()[0]), params)
    for stage in (0, 3):
        state = zj.shard_train_state(mine, optax.sgd(0.1), config=zj.ZeroConfig(stage=stage))
        step = zj.make_train_step(loss_fn, state)
        for b in batches(2):
            state, _ = step(state, b)
    for x, y in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(params)):
        assert not x.is_deleted()
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_init_fn_builds_the_same_state_as_params():
    key = jax.random.PRNGKey(3)
    config = zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0)
    from_fn = zj.shard_train_state(init_params, optax.adamw(1e-3), config=config, rng=key)
    init_key, _ = jax.random.split(key)
    from_tree = zj.shard_train_state(init_params(init_key), optax.adamw(1e-3), config=config, rng=key)
    for a, b in zip(jax.tree_util.tree_leaves(from_fn), jax.tree_util.tree_leaves(from_tree)):
        # jit fuses the initializer's arithmetic, so allow an ulp or so
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-7)
        assert a.sharding == b.sharding


@pytest.mark.parametrize("stage", [1, 3])
def test_init_fn_in_groups_equals_one_program(stage, monkeypatch):
    """An init bigger than a group runs as several programs (the trace less what a group's leaves
    do not need): the state equals the one program's, shardings included (XLA may fuse a group's
    fp32 arithmetic otherwise than the whole program's: an ulp at most)."""
    from zerojax import _init_groups

    key = jax.random.PRNGKey(5)
    config = zj.ZeroConfig(stage=stage, precision="bf16", param_persistence_threshold=0)
    one = zj.shard_train_state(init_params, optax.adamw(1e-3), config=config, rng=key)
    runs = []
    real = _init_groups.buckets
    monkeypatch.setattr(_init_groups, "GROUP_BYTES", 256)
    monkeypatch.setattr(_init_groups, "buckets", lambda n, limit: runs.append(real(n, limit)) or runs[-1])
    grouped = zj.shard_train_state(init_params, optax.adamw(1e-3), config=config, rng=key)
    assert len(runs) == 1 and len(runs[0]) > 1
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(grouped)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2.5e-7, atol=1e-7)
        assert a.sharding == b.sharding and a.dtype == b.dtype


def test_metrics_report_learning_rate_and_step(params):
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 0.0, 10))
    state = zj.shard_train_state(params, tx, config=zj.ZeroConfig(stage=2))
    step = zj.make_train_step(loss_fn, state)
    lrs = []
    for b in batches(3):
        state, m = step(state, b)
        lrs.append(float(m["learning_rate"]))
        assert not bool(m["skipped"]) and float(m["loss_scale"]) == 1.0 and float(m["grad_norm"]) > 0
    np.testing.assert_allclose(lrs, [1e-2, 9e-3, 8e-3], rtol=1e-6)
    assert int(state.step) == 3


def test_step_lowers_and_donates(params):
    state = zj.shard_train_state(params, optax.adamw(1e-3), config=zj.ZeroConfig(stage=2))
    step = zj.make_train_step(loss_fn, state)
    lowered = step.lower(state, batches(1)[0])
    assert "donated" in lowered.as_text() or "tf.aliasing_output" in lowered.as_text()
    old = state.params
    state, _ = step(state, batches(1)[0])
    assert jax.tree_util.tree_leaves(old)[0].is_deleted()
