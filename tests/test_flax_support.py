"""Flax NNX and Linen models train through ZeRO with their tensor-parallel annotations kept."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax._plan import path_str

IN, HID, OUT = 6, 16, 3


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.fc1 = nnx.Linear(IN, HID, kernel_init=nnx.with_partitioning(init, (None, "model")),
                              bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)
        self.fc2 = nnx.Linear(HID, OUT, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(HID, kernel_init=nn.with_partitioning(init, (None, "model")),
                     bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ("model",)))(x)
        return nn.Dense(OUT, kernel_init=nn.with_partitioning(init, ("model", None)))(jnp.tanh(x))


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def data(steps=3, batch=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(batch, IN)).astype(np.float32), "y": rng.normal(size=(batch, OUT)).astype(np.float32)}
            for _ in range(steps)]


def reference(params, loss, tx, batches):
    """Plain optax on one device."""
    params = jax.device_put(params, jax.devices()[0])
    opt = tx.init(params)
    losses = []
    for b in batches:
        value, g = jax.value_and_grad(loss)(params, b)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
        losses.append(float(value))
    return params, losses


def zero_run(params, specs, loss, tx, batches, stage=3):
    mesh = zj.make_mesh((4, 2), ("data", "model"))
    state = zj.shard_train_state(params, tx, mesh=mesh, config=zj.ZeroConfig(stage=stage, param_persistence_threshold=0),
                                 param_specs=specs)
    step = zj.make_train_step(loss, state, donate=False)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def assert_close(got, want, tol=1e-5):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def specs_by_path(tree):
    return {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_nnx_annotations_become_param_specs():
    with nnx.use_eager_sharding(False):
        model = NNXMLP(nnx.Rngs(0))
    _, specs, _ = zj.nnx_params(model)
    got = specs_by_path(specs)
    assert got["fc1/kernel/value"] == P(None, "model") and got["fc1/bias/value"] == P("model")
    assert got["fc2/kernel/value"] == P("model", None) and got["fc2/bias/value"] == P()
    with pytest.raises(zj.ConfigError, match="nn.Module|nnx.Module"):
        zj.nnx_params({"not": "a module"})


def test_nnx_plan_keeps_model_axis_and_adds_data_and_trains_like_optax():
    with nnx.use_eager_sharding(False):
        model = NNXMLP(nnx.Rngs(0))
    graphdef, _ = nnx.split(model)
    params, specs, merge = zj.nnx_params(model)

    def loss(p, b):
        return mse(nnx.merge(graphdef, p)(b["x"]), b["y"])

    batches, tx = data(), optax.adam(1e-2)
    state, losses = zero_run(params, specs, loss, tx, batches)
    layouts = specs_by_path(state.plan.map(lambda lay: lay.spec(lay.params_partitioned, "data")))
    assert layouts["fc1/kernel/value"] == P("data", "model")
    assert layouts["fc2/kernel/value"] == P("model", "data")
    assert layouts["fc1/bias/value"] == P("model")  # its only dim is the model's: nothing left for data
    assert state.params["fc1"]["kernel"].get_value().sharding.spec == P("data", "model")

    want, want_losses = reference(params, lambda p, b: mse(merge(p)(b["x"]), b["y"]), tx, batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_close(state.full_params(), want)


def test_nnx_model_built_under_a_mesh():
    mesh = zj.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        model = NNXMLP(nnx.Rngs(0))
    params, specs, merge = zj.nnx_params(model)
    assert params["fc1"]["kernel"].get_value().sharding.spec == P(None, "model")
    state = zj.shard_train_state(params, optax.sgd(0.1), mesh=mesh, config=zj.ZeroConfig(stage=3),
                                 param_specs=specs)
    b = data(1)[0]
    state, m = zj.make_train_step(lambda p, b: mse(merge(p)(b["x"]), b["y"]), state)(state, b)
    assert np.isfinite(float(m["loss"]))


def test_linen_partitioned_params_train_like_optax():
    model = LinenMLP()
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, IN)))
    params, specs = zj.linen_params(variables)
    got = specs_by_path(specs)
    assert got["Dense_0/kernel"] == P(None, "model") and got["Dense_1/kernel"] == P("model", None)
    assert got["Dense_1/bias"] == P()
    assert not any(isinstance(x, nn.Partitioned) for x in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, nn.Partitioned)))

    def loss(p, b):
        return mse(model.apply({"params": p}, b["x"]), b["y"])

    batches, tx = data(), optax.adam(1e-2)
    state, losses = zero_run(params, specs, loss, tx, batches)
    layouts = specs_by_path(state.plan.map(lambda lay: lay.spec(lay.params_partitioned, "data")))
    assert layouts["Dense_0/kernel"] == P("data", "model")
    want, want_losses = reference(params, loss, tx, batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_close(state.full_params(), want)


def test_linen_logical_axes_need_rules():
    class Logical(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(HID, kernel_init=init)(x)

    variables = Logical().init(jax.random.PRNGKey(0), jnp.ones((1, IN)))
    with pytest.raises(zj.ConfigError, match="rules="):
        zj.linen_params(variables)
    _, specs = zj.linen_params(variables, rules=[("embed", None), ("mlp", "model")])
    assert specs_by_path(specs)["Dense_0/kernel"] == P(None, "model")
