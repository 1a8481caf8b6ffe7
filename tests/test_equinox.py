"""Equinox modules are callable pytrees: zerojax takes them as params (never calls them on the
PRNG key), refuses a whole model with non-array leaves naming the leaf, and trains the array
half of ``eqx.partition`` exactly like plain optax."""
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax._init_rule import split_params_or_init

KEY = jax.random.PRNGKey(0)


def mlp_with_dropout():
    k1, k2 = jax.random.split(KEY)
    return eqx.nn.Sequential([eqx.nn.Linear(3, 16, key=k1), eqx.nn.Lambda(jax.nn.tanh), eqx.nn.Dropout(0.1),
                              eqx.nn.Linear(16, 2, key=k2)])


def arrays(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def data(steps=4, rows=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(rows, 3)).astype(np.float32), "y": rng.normal(size=(rows, 2)).astype(np.float32)}
            for _ in range(steps)]


def test_a_linear_layer_is_params_not_called():
    lin = eqx.nn.Linear(2, 4, key=KEY)
    state = zj.shard_train_state(lin, optax.adam(1e-3), mesh=zj.make_mesh(8), config=zj.ZeroConfig(stage=3))
    full = state.full_params()
    assert isinstance(full, eqx.nn.Linear)
    assert full.weight.shape == (4, 2) and full.bias.shape == (4,)
    for got, want in zip(arrays(full), arrays(lin)):
        np.testing.assert_array_equal(got, want)
    abstract = zj.abstract_train_state(lin, optax.adam(1e-3), mesh=zj.make_mesh(8), config=zj.ZeroConfig(stage=3))
    assert [x.shape for x in jax.tree_util.tree_leaves(abstract.params)] == \
        [x.shape for x in jax.tree_util.tree_leaves(state.params)]


def test_estimate_counts_the_layer_bytes():
    """12 fp32 params: 48 bytes of params and 96 of Adam moments on one device (a layer called on
    the key would give one (4,) array: 16 bytes)."""
    lin = eqx.nn.Linear(2, 4, key=KEY)
    mesh = zj.make_mesh(1)
    report = zj.estimate(lin, mesh, zj.ZeroConfig(stage=0), tx=optax.adam(1e-3))
    assert report.by_part["params"]["device"] == 48
    real = zj.memory_report(zj.shard_train_state(lin, optax.adam(1e-3), mesh=mesh, config=zj.ZeroConfig(stage=0)))
    assert report.total_bytes() == real.total_bytes() and report.by_part == real.by_part


def test_the_partitioned_model_with_dropout_trains_like_plain_optax():
    model = mlp_with_dropout()
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adam(1e-2)

    def loss_fn(p, batch):
        m = eqx.nn.inference_mode(eqx.combine(p, static))
        pred = jax.vmap(m)(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(8),
                                 config=zj.ZeroConfig(stage=3, param_persistence_threshold=0))
    step = zj.make_train_step(loss_fn, state)
    ref_p, ref_s = params, tx.init(params)
    for b in data():
        state, metrics = step(state, b)
        loss, g = jax.value_and_grad(loss_fn)(ref_p, b)
        u, ref_s = tx.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    for got, want in zip(arrays(state.full_params()), arrays(ref_p)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(arrays(ref_p)[0], arrays(params)[0])  # it trained


def test_initialize_and_estimate_take_the_partitioned_model():
    params, _ = eqx.partition(mlp_with_dropout(), eqx.is_array)
    state, _ = zj.initialize(params, lambda p, b: 0.0, {"train_micro_batch_size_per_gpu": 2,
                                                         "zero_optimization": {"stage": 2},
                                                         "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                             mesh=zj.make_mesh(8))
    for got, want in zip(arrays(state.full_params()), arrays(params)):
        np.testing.assert_array_equal(got, want)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert zj.estimate(params, zj.make_mesh(1), zj.ZeroConfig(stage=0)).by_part["params"]["device"] == 4 * n


@pytest.mark.parametrize("entry", ["shard_train_state", "abstract_train_state", "estimate", "initialize"])
def test_a_whole_model_is_refused_naming_the_leaf(entry):
    model = mlp_with_dropout()  # holds tanh, the dropout rate and its inference flag
    mesh = zj.make_mesh(8)
    calls = {
        "shard_train_state": lambda: zj.shard_train_state(model, optax.adam(1e-3), mesh=mesh),
        "abstract_train_state": lambda: zj.abstract_train_state(model, optax.adam(1e-3), mesh=mesh),
        "estimate": lambda: zj.estimate(model, 8),
        "initialize": lambda: zj.initialize(model, lambda p, b: 0.0, zj.ZeroConfig(), mesh=mesh,
                                            optimizer=optax.adam(1e-3)),
    }
    with pytest.raises(zj.ConfigError, match="eqx.partition") as info:
        calls[entry]()
    assert ".layers[1].fn" in str(info.value) and "eqx.combine" in str(info.value)


def test_init_functions_are_still_called():
    def init(key):
        return {"w": jax.random.normal(key, (4, 3))}

    class Factory:
        def make(self, key):
            return init(key)

    leaves = lambda s: [x.shape for x in jax.tree_util.tree_leaves(s.params)]
    for fn in (init, functools.partial(init), jax.tree_util.Partial(init), Factory().make, jax.jit(init),
               zj.init_fn(init)):
        assert split_params_or_init(fn)[0] is not None, fn
        state = zj.shard_train_state(fn, optax.sgd(0.1), mesh=zj.make_mesh(2), config=zj.ZeroConfig(stage=1))
        assert leaves(state) == [(4, 3)]


def test_init_fn_wrapper_calls_a_callable_pytree():
    """A callable pytree holding arrays is params unless marked: zj.init_fn makes zerojax call it."""
    lin = eqx.nn.Linear(2, 4, key=KEY)
    state = zj.shard_train_state(zj.init_fn(lin), optax.sgd(0.1), mesh=zj.make_mesh(1))
    assert [x.shape for x in jax.tree_util.tree_leaves(state.params)] == [(4,)]  # the layer applied to the key


def test_an_init_function_returning_a_whole_model_is_refused():
    with pytest.raises(zj.ConfigError, match="the init function returned"):
        zj.shard_train_state(lambda key: mlp_with_dropout(), optax.sgd(0.1), mesh=zj.make_mesh(1))


def test_linear_check_catches_the_callable_rule(monkeypatch):
    """The negative control: deciding by callable(...) calls the layer on the key and fails the check."""
    import zerojax._init_rule as rule
    import zerojax._state as state_module

    old = lambda x, where="params_or_init": (x, None) if callable(x) else (None, x)
    monkeypatch.setattr(rule, "split_params_or_init", old)
    monkeypatch.setattr(state_module, "split_params_or_init", old)
    with pytest.raises(AssertionError):
        test_a_linear_layer_is_params_not_called()
