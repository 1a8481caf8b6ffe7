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




def test_recognition_compiles_a_handful_of_programs():
    jax.clear_caches()
    with count_compiles() as seen:
        opt = _recognize._recognize(optax.adamw(1.23e-3, weight_decay=0.021))
    assert opt is not None and opt.kind == "adam"
    # op-by-op probing compiled 36 programs in a new process; jitted probes a handful
    assert len(seen) <= 8, seen
