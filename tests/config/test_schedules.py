"""DeepSpeed learning-rate schedules against REFERENCE.md section 5 (count = lbi + 1)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.config import _schedules as schedules
from zerojax.config import ConfigError

LOG_WARMUP = [0.1, 0.130103, 0.147712, 0.160206, 0.169897, 0.177815, 0.18451, 0.190309, 0.195424, 0.2, 0.2, 0.2]


def _at_lbi(fn, lbis):
    """Evaluate a schedule, jitted, at DeepSpeed's last_batch_iteration values."""
    jitted = jax.jit(fn)
    return [float(jitted(jnp.int32(lbi + 1))) for lbi in lbis]


def _sched(kind, base_lr=0.2, **params):
    return schedules.from_deepspeed({"type": kind, "params": params}, base_lr)


def test_warmup_lr_log():
    got = _at_lbi(_sched("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10), range(12))
    np.testing.assert_allclose(got, LOG_WARMUP, rtol=1e-5)


def test_warmup_lr_linear():
    got = _at_lbi(_sched("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10,
                         warmup_type="linear"), range(12))
    np.testing.assert_allclose(got, [0.1 + 0.01 * i for i in range(10)] + [0.2, 0.2], rtol=1e-5)


def test_warmup_lr_first_step_is_min_and_plain_function_agrees():
    assert float(schedules.warmup_lr(0, warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10)) == \
        pytest.approx(0.1)
    got = [float(schedules.warmup_lr(lbi + 1, 0.1, 0.2, 10)) for lbi in range(12)]
    np.testing.assert_allclose(got, LOG_WARMUP, rtol=1e-5)


def test_warmup_lr_max_defaults_to_base_lr():
    assert float(_sched("WarmupLR", base_lr=0.5, warmup_num_steps=2)(10)) == pytest.approx(0.5)


@pytest.mark.parametrize("w", [0, 1, 2])
def test_warmup_steps_at_least_two(w):
    got = _at_lbi(_sched("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=w,
                         warmup_type="linear"), [0, 1, 2])
    np.testing.assert_allclose(got, [0.0, 0.5, 1.0])


def test_warmup_decay_lr():
    expected = LOG_WARMUP[:10] + [0.2 - 0.01 * i for i in range(11)] + [0.1]
    got = _at_lbi(_sched("WarmupDecayLR", warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10,
                         total_num_steps=20), range(22))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_warmup_cosine_lr():
    fn = _sched("WarmupCosineLR", base_lr=0.0015, total_num_steps=100, warmup_num_steps=10,
                warmup_min_ratio=0.2, cos_min_ratio=0.1)
    lbis = [0, 1, 9, 10, 54, 99]
    np.testing.assert_allclose(_at_lbi(fn, lbis), [3.0e-4, 6.61236e-4, 1.5e-3, 1.499589e-3, 8.25e-4, 1.5e-4],
                               rtol=1e-5)
    assert _at_lbi(fn, [-1, 150]) == pytest.approx([0.0, 1.5e-4])


ONECYCLE = dict(cycle_min_lr=1e-5, cycle_max_lr=1e-2, cycle_first_step_size=10, decay_lr_rate=1e-3,
                decay_step_size=10)


def test_onecycle_lr():
    got = _at_lbi(_sched("OneCycle", **ONECYCLE), [-1, 0, 8, 9, 10, 19, 20, 29])
    np.testing.assert_allclose(got, [1e-5, 1.009e-3, 9.001e-3, 1e-2, 9.001e-3, 1e-5, 9.9990001e-6, 9.99001e-6],
                               rtol=1e-5)


def test_onecycle_without_decay_stays_at_min():
    got = _at_lbi(_sched("OneCycle", cycle_min_lr=1e-5, cycle_max_lr=1e-2, cycle_first_step_size=10), [25, 500])
    np.testing.assert_allclose(got, [1e-5, 1e-5], rtol=1e-6)


def test_onecycle_second_step_size():
    fn = _sched("OneCycle", cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=2, cycle_second_step_size=4)
    # b = lbi + 1: up over 2 steps, down over 4
    np.testing.assert_allclose(_at_lbi(fn, [-1, 0, 1, 2, 3, 4]), [0, 0.5, 1, 0.75, 0.5, 0.25], atol=1e-6)


def test_onecycle_momentum_is_inverse_of_lr():
    mom = jax.jit(lambda c: schedules.onecycle_momentum(c, 0.8, 0.9, decay_mom_rate=0.1,
                                                        cycle_first_step_size=10, decay_step_size=10))
    got = [float(mom(lbi + 1)) for lbi in (-1, 4, 9, 19, 29)]
    np.testing.assert_allclose(got, [0.9, 0.85, 0.8, 0.9, 0.99], rtol=1e-5)
    from_block = schedules.onecycle_momentum_from_deepspeed(
        {"type": "OneCycle", "params": {**ONECYCLE, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}})
    assert float(from_block(5)) == pytest.approx(0.85)
    assert schedules.onecycle_momentum_from_deepspeed(
        {"type": "OneCycle", "params": {**ONECYCLE, "cycle_momentum": False}}) is None
    assert schedules.onecycle_momentum_from_deepspeed({"type": "WarmupLR", "params": {}}) is None


def test_lr_range_test():
    fn = _sched("LRRangeTest", lr_range_test_min_lr=1e-3, lr_range_test_step_size=10, lr_range_test_step_rate=2.0)
    np.testing.assert_allclose(_at_lbi(fn, [-1, 4, 9]), [1e-3, 2e-3, 3e-3], rtol=1e-6)
    stair = _sched("LRRangeTest", lr_range_test_min_lr=1e-3, lr_range_test_step_size=10,
                   lr_range_test_staircase=True)
    np.testing.assert_allclose(_at_lbi(stair, [-1, 8, 9, 18, 19]), [1e-3, 1e-3, 2e-3, 2e-3, 3e-3], rtol=1e-6)


def check_resumed_after_lbi_4(fn):
    # resumed after lbi 4: the next steps run at lbi 4, 5, ... (REFERENCE.md section 5's vector)
    np.testing.assert_allclose([float(fn(count)) for count in range(4)], LOG_WARMUP[4:8], rtol=1e-5)


def test_last_batch_iteration_resumes():
    check_resumed_after_lbi_4(_sched("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10,
                                     last_batch_iteration=4))


def test_resume_check_catches_a_schedule_that_ignores_last_batch_iteration():
    with pytest.raises(AssertionError):
        check_resumed_after_lbi_4(_sched("WarmupLR", warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10))


def test_traced_and_vmapped_counts():
    fn = _sched("WarmupDecayLR", warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=10, total_num_steps=20)
    got = jax.jit(jax.vmap(fn))(jnp.arange(1, 23, dtype=jnp.int32))
    np.testing.assert_allclose(np.asarray(got), LOG_WARMUP[:10] + [0.2 - 0.01 * i for i in range(11)] + [0.1],
                               rtol=1e-5)


def test_none_is_constant():
    assert float(schedules.from_deepspeed(None, 3e-4)(123)) == pytest.approx(3e-4)


def test_resolve_fills_defaults():
    out = schedules.resolve_scheduler({"type": "WarmupCosineLR", "params": {"total_num_steps": 50}}, 1e-3)
    assert out == {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 50, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 1e-4,
        "warmup_type": "log", "last_batch_iteration": -1}}


@pytest.mark.parametrize("block,match", [
    ({"type": "WarmupLr", "params": {}}, 'scheduler.type.*Did you mean "WarmupLR"'),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 5}}, 'scheduler.params.warmup_num_step.*"warmup_num_steps"'),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type"),
    ({"type": "WarmupDecayLR", "params": {}}, "scheduler.params.total_num_steps"),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 1.0}}, "scheduler.params.cycle_min_lr"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}, "scheduler.params.warmup_num_steps"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "big"}}, "scheduler.params.warmup_max_lr"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}},
     "scheduler.params.cos_min_ratio"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": 1}}, "scheduler.params.lr_range_test_staircase"),
    ({"type": "WarmupLR", "parms": {}}, 'scheduler.parms.*"params"'),
])
def test_invalid_scheduler_blocks(block, match):
    with pytest.raises(ConfigError, match=match):
        schedules.from_deepspeed(block, 1e-3)


def test_log_warmup_formula_matches_math():
    for lbi in range(1, 10):
        expected = 0.1 + 0.1 * math.log(lbi + 1) / math.log(10)
        assert float(schedules.warmup_lr(lbi + 1, 0.1, 0.2, 10)) == pytest.approx(expected, rel=1e-6)
