"""LossScaler against the DeepSpeed test vectors (REFERENCE.md section 4), with update jitted."""
import jax
import jax.numpy as jnp
import pytest

from zerojax import LossScaler, ZeroConfig


def _run(scaler: LossScaler, overflows):
    """(scale, remaining hysteresis, at_minimum) after each jitted update."""
    update = jax.jit(scaler.update)
    state, out = scaler.init(), []
    for overflow in overflows:
        state = update(state, jnp.bool_(overflow))
        out.append((float(state.scale), int(state.hysteresis), bool(state.at_minimum)))
    return out


def test_hysteresis_window_sequence():
    scaler = LossScaler(initial_scale_power=8, loss_scale_window=2, hysteresis=2)
    got = [(s, h) for s, h, _ in _run(scaler, [True, True, False, False, False, True])]
    assert got == [(256, 1), (128, 1), (128, 1), (128, 1), (256, 2), (256, 1)]


def test_no_overflow_doubles_every_window():
    scaler = LossScaler(initial_scale_power=8, loss_scale_window=2)
    got = [s for s, _, _ in _run(scaler, [False] * 10)]
    assert got == [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]


def test_hysteresis_one_halves_to_minimum_then_flags():
    scaler = LossScaler(initial_scale_power=8, hysteresis=1)
    got = _run(scaler, [True] * 9)
    assert [s for s, _, _ in got[:8]] == [128, 64, 32, 16, 8, 4, 2, 1]
    assert not any(m for _, _, m in got[:8])
    # the 9th overflow arrives at min_loss_scale: the host raises LossScaleError on this flag
    assert got[8][0] == 1 and got[8][2]


def test_defaults_three_overflows():
    got = _run(LossScaler(), [True, True, True])
    assert got[0][:2] == (65536, 1)
    assert [s for s, _, _ in got[1:]] == [32768, 16384]


def test_consecutive_hysteresis_refills_on_clean_step():
    scaler = LossScaler(initial_scale_power=8, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    got = [(s, h) for s, h, _ in _run(scaler, [True, False, True, True])]
    assert got == [(256, 1), (256, 2), (256, 1), (128, 1)]


def test_static_scale_never_changes():
    scaler = LossScaler(loss_scale=128.0)
    assert [s for s, _, _ in _run(scaler, [True, False, True, False])] == [128] * 4


def test_last_overflow_iter_and_iter_counters():
    scaler = LossScaler(initial_scale_power=4)
    update = jax.jit(scaler.update)
    state = scaler.init()
    for overflow in (False, True, False):
        state = update(state, overflow)
    assert int(state.iter) == 3 and int(state.last_overflow_iter) == 1


@pytest.mark.parametrize("power,window,hyst", [(8, 2, 2), (16, 1000, 2), (5, 3, 1)])
def test_config_builds_the_same_scaler(power, window, hyst):
    config = ZeroConfig.from_deepspeed(
        {"train_batch_size": 8, "fp16": {"enabled": True, "initial_scale_power": power,
                                         "loss_scale_window": window, "hysteresis": hyst}}, world_size=1)
    assert config.loss_scaler == LossScaler(initial_scale_power=power, loss_scale_window=window, hysteresis=hyst)
