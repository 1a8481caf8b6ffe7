"""Low-precision model states: bf16 params as their own master, bf16 optimizer states, and the
stochastic rounding of the bf16 master update, against plain references.

Bytes per parameter (REFERENCE.md section 1: 2 bytes of 16-bit params, 2 of 16-bit grads,
K = 12 optimizer bytes for Adam with an fp32 master and fp32 moments): a bf16 master that is
the params drops the master's 4 (K = 8), bf16 moments halve the other 8 (K = 4). A zerojax
TrainState stores no gradients, so it holds 2 + K: 14, 10 and 6 bytes per parameter.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import (
    batches,
    init_params,
    loss_fn,
    max_rel_err,
    mixed_reference_run,
)
import zerojax._placement as placement
from zerojax.config._deepspeed import key_report
from zerojax._errors import ConfigError, IgnoredKeysWarning, StepOptionError
from zerojax._low_precision import stochastic_round
from zerojax.tools._estimate import zero_paper_bytes

BF16 = jnp.bfloat16
LOW = {"fp32 states": (None, None), "bf16 master": ("bfloat16", None), "bf16 master + states": ("bfloat16",
                                                                                                 "bfloat16")}
STORED = {"fp32 states": 14, "bf16 master": 10, "bf16 master + states": 6}  # 2 + K, derived above
WITH_GRADS = {"fp32 states": 16, "bf16 master": 12, "bf16 master + states": 8}  # 2 + 2 + K


def config(stage, kind, **kw):
    master, opt = LOW[kind]
    return zj.ZeroConfig(stage=stage, precision="bf16", master_weights_dtype=master, optimizer_state_dtype=opt,
                         param_persistence_threshold=0, **kw)


def wide(tree):
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), tree)


def train(params, tx, data, cfg, rng=None):
    state = zj.shard_train_state(params, tx, config=cfg, rng=rng)
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0))


# --------------------------------------------------------------------------- bytes per parameter
def even_params(key):
    """Every leaf divides 8 devices: no padding, so bytes per parameter come out exact."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {"a": jax.random.normal(k1, (256, 64)), "b": jax.random.normal(k2, (64, 128)),
            "c": jax.random.normal(k3, (512,))}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", list(LOW))
def test_stored_bytes_per_parameter(stage, kind):
    params = even_params(jax.random.PRNGKey(1))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(params))
    state = zj.shard_train_state(params, optax.adamw(1e-3), config=config(stage, kind))
    report = zj.memory_report(state)
    n = state.plan.n
    count = 4 * n  # Adam's int32 step count, one per device: not per parameter
    stored = report.total_bytes("device") - n * report.by_part["other"]["device"] - count
    copies = 1 if stage == 3 else n  # below stage 3 every device holds the whole 16-bit params
    assert (stored - 2 * psi * (copies - 1)) / psi == STORED[kind]
    # the same per device: 2 bytes of params (split at stage 3) and the rest split over N
    per_device = sum(report.by_part[p]["device"] for p in ("params", "master", "optimizer") if p in report.by_part)
    params_bytes = 2 * psi / (n if stage == 3 else 1)
    assert per_device - 4 == params_bytes + (STORED[kind] - 2) * psi / n
    assert ("master" in report.by_part) == (kind == "fp32 states")
    # the estimator reads the same plan without building it; the ZeRO-paper count says 14/10/6 and 16/12/8
    assert zj.estimate(params, state.plan.mesh, state.plan.config).max_bytes("device") == report.max_bytes("device")
    master, opt = LOW[kind]
    low = dict(master_weights_dtype=master, optimizer_state_dtype=opt)
    assert zero_paper_bytes(psi, 1, 0, include_grads=False, **low) == STORED[kind] * psi
    assert zero_paper_bytes(psi, 1, 0, **low) == WITH_GRADS[kind] * psi
    assert zero_paper_bytes(psi, n, stage, include_grads=False, **low) == per_device - 4


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["bf16 master", "bf16 master + states"])
def test_bf16_states_match_a_reference_with_the_same_casts(stage, kind, params):
    """The reference: bf16 params that are the master, every update in fp32 from them, the
    result and (bf16 states) the moments rounded to nearest bf16 after each step."""
    data, tx = batches(6), optax.adamw(1e-2)
    state, losses = train(params, tx, data, config(stage, kind))
    master, opt = LOW[kind]
    ref = mixed_reference_run(params, tx, data, "bf16", stage=stage, master_dtype=BF16,
                              opt_dtype=BF16 if opt else jnp.float32)
    assert state.master is None
    assert all(x.dtype == BF16 for x in jax.tree_util.tree_leaves(state.params))
    moments = jax.tree_util.tree_leaves((state.opt_state[0].mu, state.opt_state[0].nu))
    assert {x.dtype for x in moments} == {jnp.dtype(BF16 if opt else jnp.float32)}
    assert state.opt_state[0].count.dtype == jnp.int32
    assert_bf16_rounding_apart(state.full_params(jnp.float32), wide(ref.params), steps=len(data))
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)  # those params move the loss by 4e-6 at most
    # the check can tell the storage apart: the fp32-master (and fp32-moment) references differ
    other = mixed_reference_run(params, tx, data, "bf16", stage=stage, master_dtype=BF16 if opt else jnp.float32)
    assert np.mean(flat(state.full_params(jnp.float32)) != flat(wide(other.params))) > 0.03


def test_bf16_states_offloaded_to_the_host_match_the_reference(params):
    data, tx = batches(4), optax.adamw(1e-2)
    state, _ = train(params, tx, data, config(2, "bf16 master + states", offload_optimizer="cpu"))
    kinds = {(x.sharding.memory_kind, x.dtype) for x in jax.tree_util.tree_leaves(state.opt_state)}
    assert kinds == {("pinned_host", jnp.dtype(BF16)), ("pinned_host", jnp.dtype(jnp.int32))}
    ref = mixed_reference_run(params, tx, data, "bf16", stage=2, master_dtype=BF16, opt_dtype=BF16, offload=True)
    assert_bf16_rounding_apart(state.full_params(jnp.float32), wide(ref.params), steps=len(data))
    # the check can tell the storage apart: with fp32 moments 5% of the params differ
    other = mixed_reference_run(params, tx, data, "bf16", stage=2, master_dtype=BF16, offload=True)
    assert np.mean(flat(state.full_params(jnp.float32)) != flat(wide(other.params))) > 0.03


def flat(tree):
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree_util.tree_leaves(tree)])


def assert_bf16_rounding_apart(got, want, lr=1e-2, steps=6):
    """bf16 params equal to the reference's but where a rounding differs: the zerojax program and
    the reference's are compiled apart, and XLA may round an intermediate of one element
    differently; a bf16 moment one step apart then moves that param by a different Adam step
    (jax 0.12's XLA: 2-4 of 1185 params after 4-6 steps, the furthest 6e-5 apart; none on jax 0.10).
    Fewer than 1% may differ, each by at most what Adam can move a param in ``steps`` steps."""
    got, want = flat(got), flat(want)
    assert np.mean(got != want) < 0.01
    assert np.max(np.abs(got - want)) <= lr * steps


def test_stochastic_round_is_unbiased_where_round_to_nearest_is_not():
    # bf16 steps by 2**-7 in [1, 2): x sits an eighth of a step above 1
    x = jnp.full((200_000,), 1.0 + 2.0**-10, jnp.float32)
    y = stochastic_round(x, jax.random.PRNGKey(0)).astype(jnp.float32)
    assert set(np.unique(np.asarray(y))) == {1.0, 1.0 + 2.0**-7}
    sigma = 2.0**-7 * np.sqrt(1 / 8 * 7 / 8 / x.size)
    assert abs(float(y.mean()) - (1.0 + 2.0**-10)) < 5 * sigma
    assert float(x.astype(BF16).astype(jnp.float32).mean()) == 1.0  # round to nearest: the eighth is lost
    # many updates below the resolution: 1000 additions of 2**-12 (a 32nd of a step)
    n, inc = 1000, 2.0**-12

    def walk(stochastic):
        def body(i, w):
            new = w.astype(jnp.float32) + inc
            return stochastic_round(new, jax.random.fold_in(jax.random.PRNGKey(1), i)) if stochastic \
                else new.astype(BF16)
        return jax.lax.fori_loop(0, n, body, jnp.ones((512,), BF16)).astype(jnp.float32)

    assert abs(float(walk(True).mean()) - (1.0 + n * inc)) < 0.015  # 5 sigma of the 512-walk mean
    assert float(jnp.max(jnp.abs(walk(False) - 1.0))) == 0.0
    # special values pass; negative values round by magnitude, unbiased too
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0], jnp.float32)
    out = np.asarray(stochastic_round(special, jax.random.PRNGKey(2)).astype(jnp.float32))
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2]) and (out[3:] == 0).all()
    neg = stochastic_round(-x, jax.random.PRNGKey(3)).astype(jnp.float32)
    assert abs(float(neg.mean()) + (1.0 + 2.0**-10)) < 5 * sigma


def _drift_loss(p, batch):
    return jnp.sum(p["w"].astype(jnp.float32)) + 0.0 * jnp.sum(batch["x"])


def _drift(rng, stochastic, stage=2, steps=16):
    """sgd with lr 2**-11 on a loss whose gradient is 1 everywhere: each step asks for w -= 2**-11,
    an eighth of bf16's step just below 1 (2**-8)."""
    cfg = zj.ZeroConfig(stage=stage, precision="bf16", master_weights_dtype="bfloat16",
                        stochastic_rounding=stochastic, param_persistence_threshold=0)
    state = zj.shard_train_state({"w": jnp.ones((4096,))}, optax.sgd(2.0**-11), config=cfg, rng=rng)
    step = zj.make_train_step(_drift_loss, state)
    for _ in range(steps):
        state, _ = step(state, {"x": jnp.zeros((8, 1))})
    return np.asarray(state.full_params(jnp.float32)["w"])


def test_stochastic_rounding_in_the_step_tracks_the_fp32_update():
    want = 1.0 - 16 * 2.0**-11
    got = _drift(jax.random.PRNGKey(0), True)
    assert abs(got.mean() - want) < 5e-4  # sigma of the mean is about 8e-5; the bias of nearest is 8e-3
    assert (_drift(jax.random.PRNGKey(0), False) == 1.0).all()  # round to nearest never moves
    # reproducible for a fixed rng, on any stage; another rng draws other bits
    np.testing.assert_array_equal(got, _drift(jax.random.PRNGKey(0), True, stage=3))
    assert not np.array_equal(got, _drift(jax.random.PRNGKey(1), True))


# --------------------------------------------------------------------------- the DeepSpeed keys
def test_deepspeed_bf16_keys_are_honoured_through_initialize(params):
    cfg = {"train_batch_size": 32, "gradient_clipping": 0.0,
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
           "zero_optimization": {"stage": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        state, step = zj.initialize(params, loss_fn, cfg, optimizer=optax.adamw(1e-2, weight_decay=0.01))
    c = state.plan.config
    assert (c.master_weights_dtype, c.optimizer_state_dtype, c.stochastic_rounding) == ("bfloat16", "bfloat16", False)
    assert state.master is None
    data = batches(3)
    for b in data:
        state, _ = step(state, b)
    tx = optax.adamw(1e-2, weight_decay=0.01)
    ref = mixed_reference_run(params, tx, data, "bf16", stage=2, master_dtype=BF16, opt_dtype=BF16)
    assert max_rel_err(state.full_params(jnp.float32), wide(ref.params)) <= 1e-6
    rows = {r.path: r for r in key_report(cfg, world_size=8)}
    for key in ("bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states"):
        assert rows[key].kind == "honoured" and "ZeroConfig." in rows[key].why


@pytest.mark.parametrize("block,match", [
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}},
     r"bf16\.bf16_optimizer_states=.*needs bf16 master weights \(bf16\.bf16_master_weights_and_grads is off\)"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 0}},
     r"bf16\.bf16_master_weights_and_grads=.*needs ZeRO stage 1, 2 or 3 \(zero_optimization\.stage is 0\)"),
    ({"bf16": {"bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 1}},
     r"bf16\.bf16_master_weights_and_grads=.*needs bf16 mixed precision \(bf16\.enabled gives 'fp32'\)"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
     r"bf16\.bf16_master_weights_and_grads=.*not available with zero_optimization\.offload_optimizer\.device"),
])
def test_deepspeed_rules_of_the_bf16_keys(block, match):
    with pytest.raises(ConfigError, match=match):
        zj.ZeroConfig.from_deepspeed({"train_batch_size": 8, **block}, world_size=1)


def test_zeroconfig_rules():
    for kw, match in [(dict(stage=1, master_weights_dtype="bfloat16"), r"needs bf16 mixed precision"),
                      (dict(stage=1, precision="bf16", optimizer_state_dtype="bfloat16"), r"needs bf16 master"),
                      (dict(stage=1, precision="bf16", stochastic_rounding=True), r"has nothing to round"),
                      (dict(stage=0, precision="bf16", master_weights_dtype="bfloat16"), r"needs ZeRO stage 1"),
                      (dict(stage=1, precision="bf16", master_weights_dtype="float16"), r"expected None, 'float32'"),
                      (dict(stage=1, precision="bf16", master_weights_dtype="bfloat16", zenflow={"topk_ratio": 0.1},
                            offload_optimizer="cpu"), r"not available with ZeroConfig\.zenflow")]:
        with pytest.raises(ConfigError, match=match):
            zj.ZeroConfig(**kw)
    assert zj.ZeroConfig(stage=1, precision="bf16", master_weights_dtype="float32").master_weights_dtype is None


def test_zero_optimizer_refuses_low_precision_states():
    with pytest.raises(ConfigError, match=r"zero_optimizer: master_weights_dtype='bfloat16'.*is not supported here"):
        zj.zero_optimizer(optax.adamw(1e-3), config=config(1, "bf16 master"))


def test_fused_adam_is_refused_with_bf16_states(params):
    state = zj.shard_train_state(params, optax.inject_hyperparams(optax.adamw)(1e-3),
                                 config=config(1, "bf16 master"))
    with pytest.raises(StepOptionError, match="fused_adam=True: the fused kernel updates an fp32 master"):
        zj.make_train_step(loss_fn, state, fused_adam=True)


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("src,dst", [("bf16 master + states", "fp32 states"), ("fp32 states", "bf16 master + states"),
                                     ("bf16 master + states", "bf16 master")])
def test_checkpoint_round_trips_between_state_precisions(tmp_path, params, src, dst):
    tx = optax.adamw(1e-2)
    state, _ = train(params, tx, batches(2), config(2, src))
    saved_params = jax.device_get(state.full_params(jnp.float32))
    saved_mu = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(
        state.plan.map(lambda lay, x: placement.unpad(x, lay), state.opt_state[0].mu))]
    with zj.checkpoint.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, state)
    target = zj.abstract_train_state(params, tx, mesh=zj.make_mesh(4), config=config(3, dst))
    restored, _ = zj.checkpoint.restore(tmp_path, target)
    master, opt = LOW[dst]
    store = lambda x: x.astype(BF16).astype(jnp.float32) if master else x  # noqa: E731
    want = jax.tree_util.tree_map(store, wide(saved_params))
    assert max_rel_err(jax.device_get(restored.full_params(jnp.float32)), jax.device_get(want)) == 0.0
    assert (restored.master is None) == bool(master)
    mu = restored.plan.map(lambda lay, x: placement.unpad(x, lay), restored.opt_state[0].mu)
    for got, ref in zip(jax.tree_util.tree_leaves(mu), saved_mu):
        assert got.dtype == jnp.dtype(BF16 if opt else jnp.float32)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(jnp.asarray(ref).astype(BF16 if opt else jnp.float32), np.float32))
    # and it trains on
    step = zj.make_train_step(loss_fn, restored)
    restored, m = step(restored, batches(1, seed=5)[0])
    assert np.isfinite(float(m["loss"]))
