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
from zerojax.stages._gating import gated_gradient
from zerojax.stages._momentum import gated_momentum, momentum_recipe

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
    bad["w"] = bad["w"].at[1].set(1e30).at[2].set(-1e19)  # finite, but the first's square is not
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


def _selects_on_the_flag(compiled_text) -> int:
    """Elementwise selects whose condition is one scalar broadcast to every element (the step's
    flag): the CPU backend's LLVM compiles each loop holding one twice (unswitching)."""
    flags = set(re.findall(r"(%[\w.\-]+) = pred\[[0-9,]+\]\S* broadcast\(", compiled_text))
    firsts = re.findall(r"= \w+\[[0-9,]+\]\S* select\((%[\w.\-]+),", compiled_text)
    return sum(f in flags for f in firsts)


@pytest.mark.parametrize("make_tx,gated", [(lambda: optax.adamw(1e-3, weight_decay=0.01), gated_adam),
                                           (lambda: optax.sgd(1e-3, momentum=0.9), gated_momentum)],
                         ids=["adamw", "sgd-momentum"])
def test_gated_pass_has_no_select_on_the_flag(make_tx, gated):
    """The skip is in the coefficients and in which gradient elements are used, decided per
    element: no select on the step's flag over whole arrays (it doubled each moment kernel's code)."""
    tx = make_tx()
    recipe = (adam_recipe if gated is gated_adam else momentum_recipe)(tx)
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    text = jax.jit(lambda p, g, s, a: gated(recipe, tx, p, g, s, a)).lower(
        params, params, tx.init(params), jnp.asarray(True)).compile().as_text()
    assert _selects_on_the_flag(text) == 0


def test_gated_gradient_keeps_finite_values_exactly_and_known_flags_as_given():
    g = jnp.asarray([1.5, -2.0 ** 63, jnp.nan, jnp.inf, -jnp.inf, 1e30, 3e-39], jnp.float32)
    traced = np.asarray(jax.jit(gated_gradient)(jnp.asarray(False), g))
    np.testing.assert_array_equal(traced, [1.5, -2.0 ** 63, 0, 0, 0, 0, np.float32(3e-39)])
    # a flag known while tracing (bf16 without the overflow check: applied, inf and nan included)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda g: gated_gradient(True, g))(g)), np.asarray(g))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda g: gated_gradient(False, g))(g)), np.zeros(7))
    # other dtypes: zeros where the flag is false, as a select
    h = g.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(gated_gradient)(jnp.asarray(False), h), np.float32), np.zeros(7))

