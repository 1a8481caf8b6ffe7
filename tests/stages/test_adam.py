"""The gated Adam pass (zerojax/stages/_adam.py): which optimizers it takes, optax's numbers when
applied, the state untouched when skipped, and no state copies in the compiled step."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.config._optimizers import optimizer_from_config
from zerojax.stages._adam import adam_node, adam_recipe, gated_adam

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 5)

TAKEN = {
    "adamw": lambda: optax.adamw(1e-4, weight_decay=0.01),
    "adam": lambda: optax.adam(3e-3),
    "adamw-defaults": lambda: optax.adamw(1e-3),
    "adamw-settings": lambda: optax.adamw(2e-3, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1),
    "injected-schedule": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.1),
    "deepspeed-AdamW": lambda: optimizer_from_config(zj.ZeroConfig(optimizer={
        "type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}})),
}

REFUSED = {
    "nadamw": lambda: optax.nadamw(1e-3),
    "schedule-not-injected": lambda: optax.adamw(SCHEDULE),
    "masked-decay": lambda: optax.adamw(1e-3, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)),
    "global-clip-after-adam": lambda: optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(1e3),
                                                  optax.scale(-1e-3)),
    "lamb": lambda: optax.lamb(1e-3),
    "sgd": lambda: optax.sgd(1e-2, momentum=0.9),
    "eps_root": lambda: optax.adam(1e-3, eps_root=1e-8),
    "bf16-moments": lambda: optax.adam(1e-3, mu_dtype=jnp.bfloat16),
    "deepspeed-Adam-L2": lambda: optimizer_from_config(zj.ZeroConfig(optimizer={
        "type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False}})),
    "deepspeed-no-bias-correction": lambda: optimizer_from_config(zj.ZeroConfig(optimizer={
        "type": "AdamW", "params": {"lr": 1e-3, "bias_correction": False}})),
}


def _params():
    rng = np.random.default_rng(1)
    return {"w": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32), "b": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}


def _grads(i):
    rng = np.random.default_rng(10 + i)
    return {"w": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32), "b": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}


def assert_trains_as_optax(gated, recipe, tx, moved):
    """Six applied steps of ``gated`` against ``tx.update`` from the same start: every leaf of params
    and state equal, and the params moved by more than ``moved``."""
    params, state = _params(), tx.init(_params())
    ref_p, ref_s = params, state
    for i in range(6):
        params, state = gated(recipe, tx, params, _grads(i), state, jnp.asarray(True))
        u, ref_s = tx.update(_grads(i), ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    for a, b in zip(jax.tree_util.tree_leaves((params, state)), jax.tree_util.tree_leaves((ref_p, ref_s))):
        # moments bit for bit; params within an ulp or two (a probed eps is the user's to ~1e-7)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=2.5e-7)
    assert np.abs(np.asarray(params["w"]) - np.asarray(_params()["w"])).max() > moved  # it trained


def assert_skip_is_exact(gated, recipe, tx):
    """One applied step, then a skipped one (under jit) with nan and inf gradients: params and
    state exactly as after the first. Returns the state after the skip."""
    params, state = gated(recipe, tx, _params(), _grads(0), tx.init(_params()), jnp.asarray(True))
    bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.nan), _grads(1))
    bad["b"] = bad["b"].at[1].set(jnp.inf)
    new_p, new_s = jax.jit(lambda *a: gated(recipe, tx, *a))(params, bad, state, jnp.asarray(False))
    for a, b in zip(jax.tree_util.tree_leaves((new_p, new_s)), jax.tree_util.tree_leaves((params, state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return new_s


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_taken_and_equal_to_optax(name):
    tx = TAKEN[name]()
    recipe = adam_recipe(tx)
    assert recipe is not None
    assert_trains_as_optax(gated_adam, recipe, tx, moved=1e-4)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name):
    assert adam_recipe(REFUSED[name]()) is None


@pytest.mark.parametrize("name", ["adamw", "injected-schedule"])
def test_skipped_step_leaves_everything_exactly(name):
    tx = TAKEN[name]()
    state = assert_skip_is_exact(gated_adam, adam_recipe(tx), tx)
    assert int(adam_node(state).count) == 1


def _copies_of(compiled_text, shape):
    """Param-sized copies in the program's entry computation (the ones that move memory)."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    return len(re.findall(rf"f32\[{shape}\]\S* copy\(", entry))


@pytest.mark.parametrize("make_tx", [lambda: optax.adamw(1e-3, weight_decay=0.01),
                                     lambda: optax.sgd(1e-3, momentum=0.9)], ids=["adamw", "sgd-momentum"])
def test_compiled_step_copies_no_moment(make_tx):
    """Stage 0 on one device: the step's program copies no more param-sized buffers than
    ``jit`` of the bare optax update does (a select over the state made XLA copy each moment)."""
    shape = (256, 128)
    params = {"w": jnp.zeros(shape), "v": jnp.zeros(shape)}
    tx = make_tx()

    def loss(p, batch):
        return jnp.sum(jnp.tanh(batch["x"] @ p["w"]) * (batch["x"] @ p["v"]))

    batch = {"x": np.ones((1, 256), np.float32)}
    mesh = zj.make_mesh(1)
    state = zj.shard_train_state(lambda _: params, tx, mesh=mesh, config=zj.ZeroConfig(stage=0))
    step = zj.make_train_step(loss, state)
    ours = _copies_of(step.lower(state, batch).compile().as_text(), "256,128")

    def plain(p, s, batch):
        g = jax.grad(loss)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    text = jax.jit(plain, donate_argnums=(0, 1)).lower(params, tx.init(params), batch).compile().as_text()
    assert ours <= _copies_of(text, "256,128")
