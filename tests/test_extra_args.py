"""Optimizers that read the loss: ``make_train_step`` passes it as ``update(..., value=loss)``.

reduce_on_plateau, polyak_sgd and momo train and equal plain optax given the same losses;
sam, whose update takes extra arguments but not ``value``, trains given none, as in plain
optax; optimizers that need a function of the params (line searches, Sophia, opaque sam) and a
chain that reads the loss beside sam are refused by name. ``zero_optimizer`` passes ``value=``
on the same way.
"""
import jax
import optax
import optax.contrib
import pytest

import zerojax as zj
import zerojax._placement as placement
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_train

OPTIMIZERS = {
    "reduce_on_plateau": lambda: optax.chain(optax.adam(1e-2),
                                             optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0,
                                                                             accumulation_size=1)),
    "polyak_sgd": lambda: optax.polyak_sgd(max_learning_rate=0.5),
    "momo": lambda: optax.contrib.momo(learning_rate=0.1),
}


def reference(params, tx, data):
    state = tx.init(params)

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for b in data:
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 2])
def test_optimizers_that_read_the_loss_equal_optax(name, stage):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)
    want, want_losses = reference(params, OPTIMIZERS[name](), data)
    state = zj.shard_train_state(params, OPTIMIZERS[name](), config=zj.ZeroConfig(stage=stage))
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    got = jax.tree_util.tree_unflatten(state.plan.treedef, placement.params_logical(state.plan, state.params))
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert max_rel_err(got, want) < 1e-6


def test_reduce_on_plateau_scale_follows_the_loss():
    """The plateau's scale is read from the losses the step passes: with a learning rate of 0 the
    loss never improves, the scale falls on every plateau, and it equals plain optax's given the
    same losses (it would stay 1 if the step did not pass them)."""
    def make():
        return optax.chain(optax.sgd(0.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0,
                                                                           accumulation_size=1))

    params = init_params(jax.random.PRNGKey(0))
    data = batches(1) * 4
    ref_state = make().init(params)
    tx = make()
    for b in data:
        loss, g = jax.value_and_grad(loss_fn)(params, b)
        _, ref_state = tx.update(g, ref_state, params, value=loss)
    state = zj.shard_train_state(params, make(), config=zj.ZeroConfig(stage=1))
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    want = float(ref_state[1].scale)
    assert want < 1.0
    assert float(jax.tree_util.tree_leaves(state.opt_state[1].scale)[0]) == pytest.approx(want)


@pytest.mark.parametrize("tx", [
    pytest.param(lambda: optax.lbfgs(), id="lbfgs-linesearch"),
    pytest.param(lambda: optax.chain(optax.sgd(0.1), optax.scale_by_backtracking_linesearch(max_backtracking_steps=5)),
                 id="backtracking"),
])
def test_optimizers_that_need_a_function_of_the_params_are_refused(tx):
    params = init_params(jax.random.PRNGKey(0))
    state = zj.shard_train_state(params, tx(), config=zj.ZeroConfig(stage=1))
    with pytest.raises(zj.OptimizerError, match="needs more than the loss"):
        zj.make_train_step(loss_fn, state)


def _sam(**kw):
    return optax.contrib.sam(optax.sgd(5e-2), optax.sgd(1e-2), sync_period=2, **kw)


@pytest.mark.parametrize("name,make,stage", [
    ("sam", _sam, 3),
    ("clip_sam", lambda: optax.chain(optax.clip(1.0), _sam()), 1),  # a chain hides that sam refuses value=
])
def test_sam_trains_without_the_loss_and_equals_optax(name, make, stage):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)  # two adversarial steps and two outer ones (sync_period=2)
    want, want_losses = reference_train(params, make(), data)
    state = zj.shard_train_state(params, make(), config=zj.ZeroConfig(stage=stage))
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    got = jax.tree_util.tree_unflatten(state.plan.treedef, placement.params_logical(state.plan, state.params))
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert max_rel_err(got, want) < 1e-6
    assert max_rel_err(got, params) > 1e-3  # it trained


def test_a_chain_reading_the_loss_beside_sam_is_refused():
    """optax's chain hands value= to every part taking extra arguments: the plateau needs it, sam
    fails on it, so no call serves the chain."""
    params = init_params(jax.random.PRNGKey(0))
    tx = optax.chain(optax.contrib.reduce_on_plateau(patience=1), _sam())
    state = zj.shard_train_state(params, tx, config=zj.ZeroConfig(stage=1))
    with pytest.raises(zj.OptimizerError, match="cannot be given the loss") as caught:
        zj.make_train_step(loss_fn, state)
    assert "unexpected keyword argument 'value'" in str(caught.value)
    assert "optax.contrib.sam" in str(caught.value)


def test_opaque_sam_is_refused():
    params = init_params(jax.random.PRNGKey(0))
    state = zj.shard_train_state(params, _sam(opaque_mode=True), config=zj.ZeroConfig(stage=1))
    with pytest.raises(zj.OptimizerError, match="needs more than the loss") as caught:
        zj.make_train_step(loss_fn, state)
    assert "grad_fn" in str(caught.value)


def test_zero_optimizer_passes_the_loss_on():
    """polyak_sgd reads the loss through zero_optimizer as through optax; sam is given nothing;
    a function of the params is refused by name."""
    params = init_params(jax.random.PRNGKey(0))
    data = batches(3)
    for make in (OPTIMIZERS["polyak_sgd"], _sam):
        want, _ = reference(params, make(), data) if make is not _sam else reference_train(params, make(), data)
        tx = zj.zero_optimizer(make(), config=zj.ZeroConfig(stage=2))

        @jax.jit
        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, s = tx.update(g, s, p, value=loss)
            return optax.apply_updates(p, u), s

        got, opt_state = params, tx.init(params)
        for b in data:
            got, opt_state = step(got, opt_state, b)
        assert max_rel_err(got, want) < 1e-6, make
    with pytest.raises(zj.OptimizerError, match="grad_fn="):
        tx.update(params, opt_state, params, grad_fn=jax.grad(loss_fn))
