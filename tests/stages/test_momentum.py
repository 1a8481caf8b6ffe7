"""The gated SGD-momentum pass (zerojax/stages/_momentum.py): which optimizers it takes, optax's
numbers when applied, the state untouched when skipped, and the step using it."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.stages._gated import gated_recipe
from zerojax.stages._momentum import MomentumRecipe, gated_momentum, momentum_recipe
from tests.stages.test_adam import _params, assert_skip_is_exact, assert_trains_as_optax

TAKEN = {
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "sgd-momentum-0.5": lambda: optax.sgd(0.3, momentum=0.5),
    "injected-schedule": lambda: optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(1e-1, 1e-2, 5), momentum=0.9),
}
REFUSED = {
    "nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "no-momentum": lambda: optax.sgd(1e-2),  # no state to select: the general path costs nothing
    "decay-first": lambda: optax.chain(optax.add_decayed_weights(0.1), optax.trace(0.9), optax.scale(-1e-2)),
    "schedule-not-injected": lambda: optax.sgd(optax.linear_schedule(1e-1, 1e-2, 5), momentum=0.9),
    "bf16-trace": lambda: optax.chain(optax.trace(0.9, accumulator_dtype=jnp.bfloat16), optax.scale(-1e-2)),
}


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_taken_and_equal_to_optax(name):
    tx = TAKEN[name]()
    recipe = momentum_recipe(tx)
    assert isinstance(recipe, MomentumRecipe) and isinstance(gated_recipe(tx), MomentumRecipe)
    assert_trains_as_optax(gated_momentum, recipe, tx, moved=1e-3)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    assert momentum_recipe(REFUSED[name]()) is None


@pytest.mark.parametrize("name", ["sgd-momentum", "injected-schedule"])
def test_skipped_step_leaves_everything_exactly(name):
    tx = TAKEN[name]()
    assert_skip_is_exact(gated_momentum, momentum_recipe(tx), tx)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_step_with_momentum_equals_optax_and_skips(stage):
    params = _params()
    tx = optax.sgd(1e-2, momentum=0.9)

    def loss(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(3)]
    state = zj.shard_train_state(params, tx, config=zj.ZeroConfig(stage=stage, param_persistence_threshold=0))
    step = zj.make_train_step(loss, state)
    ref_p, ref_s = params, tx.init(params)
    for b in batches:
        state, _ = step(state, b)
        u, ref_s = tx.update(jax.grad(loss)(ref_p, b), ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    for a, b in zip(jax.tree_util.tree_leaves(state.full_params()), jax.tree_util.tree_leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    before = jax.tree_util.tree_map(np.asarray, (state.full_params(), state.opt_state))
    with pytest.raises(zj.NonFiniteError) as err:
        step(state, {"x": np.full((16, 8), np.nan, np.float32)})
    after = jax.tree_util.tree_map(np.asarray, (err.value.state.full_params(), err.value.state.opt_state))
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(a, b)
