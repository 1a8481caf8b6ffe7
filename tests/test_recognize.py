"""Optimizer recognition reads the user's settings exactly (the fp32 numbers optax multiplies by)
and compiles a few programs to do it, not one per operation."""
import jax
import numpy as np
import optax
import pytest

from tests.helpers import count_compiles
from zerojax.update import _recognize

f32 = lambda x: float(np.float32(x))  # noqa: E731

SETTINGS = [(lr, wd, eps) for lr in (1e-2, 1e-3, 3e-4, 5e-5) for wd in (0.0, 1e-4, 3e-3, 0.05, 0.1)
            for eps in (1e-8, 1e-6)]


@pytest.mark.parametrize("lr,wd,eps", SETTINGS)
def test_adamw_settings_are_read_to_the_bit(lr, wd, eps):
    opt = _recognize._recognize(optax.adamw(lr, b1=0.85, eps=eps, weight_decay=wd))
    assert opt is not None and opt.kind == "adam"
    c = opt.constants
    assert (c["learning_rate"], c["weight_decay"], c["eps"]) == (f32(lr), f32(wd), f32(eps)), c


@pytest.mark.parametrize("lr,wd", [(1e-2, 0.0), (3e-4, 0.1), (1e-3, 1e-3)])
def test_lion_settings_are_read_to_the_bit(lr, wd):
    opt = _recognize._recognize(optax.lion(lr, b1=0.93, weight_decay=wd))
    assert opt is not None and opt.kind == "lion"
    assert (opt.constants["learning_rate"], opt.constants["weight_decay"]) == (f32(lr), f32(wd)), opt.constants


@pytest.mark.parametrize("momentum,nesterov", [(None, False), (0.9, False), (0.95, True)])
def test_sgd_settings_are_read_to_the_bit(momentum, nesterov):
    opt = _recognize._recognize(optax.sgd(3e-4, momentum=momentum, nesterov=nesterov))
    assert opt is not None and opt.kind == "sgd" and opt.nesterov == nesterov
    assert opt.constants["learning_rate"] == f32(3e-4), opt.constants


def test_a_setting_off_by_an_ulp_is_not_rounded_to_a_neighbour():
    """The shortest-decimal rule applies within a few ulps only: a deliberately odd fp32 number
    is read as itself."""
    odd = float(np.nextafter(np.float32(0.1), np.float32(1)) * np.float32(1.0 + 2 ** -10))
    opt = _recognize._recognize(optax.adamw(1e-3, weight_decay=odd))
    assert opt.constants["weight_decay"] == f32(odd)




@pytest.mark.parametrize("make_tx,recipe", [
    (lambda: optax.adamw(1.23e-3, weight_decay=0.021), "adam_recipe"),
    (lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1.23e-3), "adam_recipe"),
    (lambda: optax.sgd(1.23e-3, momentum=0.9), "momentum_recipe"),
    (lambda: optax.lion(1.23e-3), None),  # its b1 search is a second probe program
])
def test_recognition_and_the_gated_check_compile_two_programs(make_tx, recipe):
    """A step's build recognises its optimizer and checks its gated pass: one program probes the
    settings (none for injected ones; Lion's b1 a second), one checks the rule and the pass together. Op-by-op
    probing compiled 36 programs in a new process; separate checks 9 or more."""
    from zerojax.stages import _adam, _momentum

    jax.clear_caches()
    for memory in (_recognize._cache, _adam.adam_recipe, _momentum.momentum_recipe):
        memory.cache_clear()  # an equal optimizer recognised by an earlier test would be remembered
    tx = make_tx()
    with count_compiles() as seen:
        if recipe is None:
            opt = _recognize._recognize(tx)
        else:
            assert getattr({"adam_recipe": _adam, "momentum_recipe": _momentum}[recipe], recipe)(tx) is not None
            opt = _recognize.recognize(tx)  # remembered: nothing more compiled
    assert opt is not None
    assert len(seen) <= (1 if opt.injected else 2) + (opt.kind == "lion"), seen


def test_a_pass_that_differs_from_optax_is_not_used():
    """The gated pass is checked against the optimizer's own update: one that is off by a little
    (here, a learning rate 1e-5 relative too large) is refused while the recognition stands."""
    from zerojax.stages._adam import AdamRecipe, gated_adam

    tx = optax.adamw(1e-3, weight_decay=0.01)

    def off(opt):
        wrong = AdamRecipe(dict(opt.constants, learning_rate=opt.constants["learning_rate"] * (1 + 1e-5)))
        return lambda *a: gated_adam(wrong, tx, *a)

    opt, exact = _recognize._find(tx, off)
    assert opt is not None and opt.kind == "adam" and not exact
    opt, exact = _recognize._find(tx, lambda o: lambda *a: gated_adam(AdamRecipe(o.constants), tx, *a))
    assert exact


def test_an_equal_optimizer_built_again_is_remembered_and_a_different_one_is_not():
    """Recognition is remembered by what built the transformation (its code and values), not by
    the object: ``optax.adamw(...)`` made again with the same values compiles nothing more, as
    a test or a restarted build makes it; other values are recognised anew, with their own
    settings; a transformation whose closure holds a large array is remembered by identity."""
    from zerojax.stages import _adam

    for memory in (_recognize._cache, _adam.adam_recipe):
        memory.cache_clear()
    make = lambda wd: optax.inject_hyperparams(optax.adamw)(  # noqa: E731
        learning_rate=optax.linear_schedule(2.5e-3, 1e-4, 7), weight_decay=wd)
    first = _adam.adam_recipe(make(0.031))
    assert first is not None
    with count_compiles() as seen:
        again = _adam.adam_recipe(make(0.031))
        opt = _recognize.recognize(make(0.031))
    assert again is first and opt is not None and not seen, seen
    assert _recognize.transformation_key(make(0.031)) != _recognize.transformation_key(make(0.032))
    with count_compiles() as seen:
        other = _recognize.recognize(optax.adamw(2.5e-3, weight_decay=0.032))
    assert seen and other.constants["weight_decay"] == pytest.approx(0.032, rel=1e-5)

    table = jax.numpy.arange(5000.0)  # too large to key: remembered by identity
    masked = optax.chain(optax.adamw(1e-3), optax.scale_by_schedule(lambda n: table[n % 5000] * 0 + 1))
    with pytest.raises(TypeError):
        _recognize.transformation_key(masked)
    assert _recognize.recognize(masked) is _recognize.recognize(masked)


def test_probe_programs_compile_with_the_cheap_cpu_options_and_agree_with_jit():
    """Recognition's probe programs (a few scalar operations, run once) are compiled with XLA:CPU's
    older emitters and no LLVM optimisation on a CPU backend; a program so compiled gives the
    same values as ``jax.jit``, bit for bit, on the recognition's kind of arithmetic."""
    from zerojax import _compat

    tx = optax.adamw(1.7e-3, weight_decay=0.013)
    x = {"x": np.array([0.0, 1e3, -2.5, 7.0], np.float32)}

    def update(g, p):
        return tx.update(g, tx.init(p), p)

    got = jax.device_get(_compat.probe_jit(update)(x, x))
    want = jax.device_get(jax.jit(update)(x, x))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), got, want))
    if jax.default_backend() == "cpu":  # the options this XLA accepts are used (every XLA has the LLVM level)
        options = _compat.probe_options()
        assert options and options.items() <= _compat._PROBE_OPTIONS.items()
        assert options["xla_backend_optimization_level"] == 0
        if _compat.known_xla_flags(["--xla_cpu_use_fusion_emitters=false"]):
            assert options == _compat._PROBE_OPTIONS
