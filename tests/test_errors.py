"""Bad input gets a clear error naming what is wrong and how to fix it."""
import jax
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0))


def test_mesh_without_data_axis(params):
    mesh = zj.make_mesh((8,), ("batch",))
    with pytest.raises(zj.ConfigError, match=r"no 'data' axis.*zj.make_mesh\(\)"):
        zj.shard_train_state(params, optax.sgd(0.1), mesh=mesh, config=zj.ZeroConfig(stage=1))
    # naming the axis works
    state = zj.shard_train_state(params, optax.sgd(0.1), mesh=mesh, config=zj.ZeroConfig(stage=1, data_axis="batch"))
    assert state.plan.n == 8


@pytest.mark.parametrize("bad,match", [
    (dict(stage=4), "stage"),
    (dict(stage="2"), "stage"),
    (dict(precision="fp8"), "precision"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(gradient_clipping=-1.0), "gradient_clipping"),
    (dict(stage=2, offload_param="cpu"), "offload_param"),
    (dict(stage=1, offload_optimizer="nvme"), "nvme_path"),
    (dict(stage=1, offload_optimizer="gpu"), "offload_optimizer"),
    (dict(stage=3, max_live_parameters=-1), "max_live_parameters"),
])
def test_bad_config_values(bad, match):
    with pytest.raises(zj.ConfigError, match=match):
        zj.ZeroConfig(**bad)


def test_batch_that_does_not_divide_the_devices(params):
    state = zj.shard_train_state(params, optax.sgd(0.1), config=zj.ZeroConfig(stage=2, gradient_accumulation_steps=2))
    step = zj.make_train_step(loss_fn, state)
    b = batches(1, batch_size=24)[0]
    with pytest.raises(ValueError, match=r"batch leaf 'tok' has leading dimension 24.*8 x 2 = 16"):
        step(state, b)


def test_params_tree_that_does_not_match_the_state(params):
    state = zj.shard_train_state(params, optax.sgd(0.1), config=zj.ZeroConfig(stage=3))
    step = zj.make_train_step(loss_fn, state)
    missing = {k: v for k, v in state.params.items() if k != "odd"}
    with pytest.raises(ValueError, match="no longer matches the plan"):
        step(state.replace(params=missing), batches(1)[0])
    reshaped = dict(state.params, odd=jax.numpy.zeros((3, 7)))
    with pytest.raises(ValueError, match=r"odd: shape \(3, 7\), expected \(7, 3\)"):
        step(state.replace(params=reshaped), batches(1)[0])


def test_step_from_another_state(params):
    a = zj.shard_train_state(params, optax.sgd(0.1), config=zj.ZeroConfig(stage=1))
    b = zj.shard_train_state(params, optax.sgd(0.1), config=zj.ZeroConfig(stage=1))
    with pytest.raises(ValueError, match="another state's plan"):
        zj.make_train_step(loss_fn, a)(b, batches(1)[0])


def test_zero_optimizer_tree_mismatch(params):
    tx = zj.zero_optimizer(optax.adam(1e-3), config=zj.ZeroConfig(stage=1))
    state = tx.init(params)
    grads = {k: v for k, v in params.items() if k != "out"}
    with pytest.raises(ValueError, match="does not match the params tree"):
        tx.update(grads, state, params)


def test_non_array_leaf(params):
    with pytest.raises(zj.ConfigError, match="'extra' is a str"):
        zj.shard_train_state(dict(params, extra="x"), optax.sgd(0.1))


def test_annotation_with_unknown_mesh_axis(params):
    specs = jax.tree_util.tree_map(lambda _: None, params)
    specs["out"] = jax.sharding.PartitionSpec(None, "model")
    with pytest.raises(zj.ConfigError, match="'out'.*mesh axis 'model'"):
        zj.shard_train_state(params, optax.sgd(0.1), param_specs=specs)
