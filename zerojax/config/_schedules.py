"""DeepSpeed's learning-rate schedules as jittable optax schedules.

Every schedule is a plain function of ``count``, the number of optimizer steps applied so far
(optax's convention: ``count == 0`` for the first update). DeepSpeed evaluates its schedules at
``last_batch_iteration`` (lbi), which is ``-1`` for the first step, so here ``lbi = count - 1``
(shifted by the schedule's own ``last_batch_iteration`` parameter when resuming). Steps skipped
because of an fp16/bf16 overflow must not be counted: pass the number of *applied* steps (the
engine does this), exactly as DeepSpeed does not advance its scheduler on a skipped step.

All functions use ``jnp`` ops only, so ``count`` may be a traced integer::

    sched = from_deepspeed({"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, base_lr=0.2)
    jax.jit(sched)(jnp.int32(3))   # lr of the 4th optimizer step (lbi = 2)

Differences from DeepSpeed: a missing ``warmup_max_lr`` defaults to the optimizer's lr
(``base_lr``; DeepSpeed's constructor uses 1e-3, which equals the default optimizer lr), an
unknown ``warmup_type`` is an error (DeepSpeed logs a warning and uses "log"), and OneCycle's
stair counts are accepted and, as in DeepSpeed, have no effect.
"""
from __future__ import annotations

import difflib
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from zerojax._errors import ConfigError


__all__ = [
    "SCHEDULE_DEFAULTS",
    "from_deepspeed",
    "lr_range_test",
    "onecycle_lr",
    "onecycle_momentum",
    "onecycle_momentum_from_deepspeed",
    "resolve_scheduler",
    "warmup_cosine_lr",
    "warmup_decay_lr",
    "warmup_lr",
]

REQUIRED = "<required>"  # marks a parameter without a default


def _lbi(count, last_batch_iteration: int) -> jax.Array:
    """DeepSpeed's last_batch_iteration for the step that runs after ``count`` applied steps."""
    return jnp.asarray(count, jnp.int32) + jnp.int32(last_batch_iteration)


def _warmup_gamma(lbi: jax.Array, warmup_num_steps: int, warmup_type: str) -> jax.Array:
    """Warmup progress in [0, 1] for lbi < W (the caller handles lbi >= W and lbi < 0)."""
    w = max(2, int(warmup_num_steps))
    x = lbi.astype(jnp.float32)
    if warmup_type == "log":
        return jnp.log(jnp.maximum(x + 1.0, 1.0)) / math.log(w)
    return x / w


# --------------------------------------------------------------------------- schedules


def warmup_lr(count, warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3,
              warmup_num_steps: int = 1000, warmup_type: str = "log",
              last_batch_iteration: int = -1) -> jax.Array:
    """WarmupLR: min -> max over ``max(2, warmup_num_steps)`` steps ("log" or "linear"), then max."""
    lbi = _lbi(count, last_batch_iteration)
    w = max(2, int(warmup_num_steps))
    gamma = jnp.where(lbi < w, _warmup_gamma(lbi, w, warmup_type), 1.0)
    lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma
    return jnp.where(lbi < 0, jnp.float32(warmup_min_lr), lr)


def warmup_decay_lr(count, total_num_steps: int, warmup_min_lr: float = 0.0,
                    warmup_max_lr: float = 1e-3, warmup_num_steps: int = 1000,
                    warmup_type: str = "log", last_batch_iteration: int = -1) -> jax.Array:
    """WarmupDecayLR: WarmupLR, then linear decay to ``warmup_min_lr`` at ``total_num_steps``."""
    lbi = _lbi(count, last_batch_iteration)
    w = max(2, int(warmup_num_steps))
    decay = jnp.maximum(0.0, (total_num_steps - lbi.astype(jnp.float32)) / max(1, total_num_steps - w))
    gamma = jnp.where(lbi < w, _warmup_gamma(lbi, w, warmup_type), decay)
    lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma
    return jnp.where(lbi < 0, jnp.float32(warmup_min_lr), lr)


def warmup_cosine_lr(count, base_lr: float, total_num_steps: int, warmup_min_ratio: float = 0.0,
                     warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4,
                     warmup_type: str = "log", last_batch_iteration: int = -1) -> jax.Array:
    """WarmupCosineLR: a ratio of ``base_lr``; warmup from ``warmup_min_ratio`` to 1, then a
    cosine down to ``cos_min_ratio`` at ``total_num_steps``. The first step (lbi -1) gets 0."""
    lbi = _lbi(count, last_batch_iteration)
    w = max(2, int(warmup_num_steps))
    warm = warmup_min_ratio + _warmup_gamma(lbi, w, warmup_type) * (1.0 - warmup_min_ratio)
    progress = jnp.minimum(1.0, (lbi - w + 1).astype(jnp.float32) / max(1, total_num_steps - w))
    cos = cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + jnp.cos(jnp.pi * progress)) / 2.0
    ratio = jnp.where(lbi < w, warm, jnp.maximum(0.0, cos))
    return base_lr * jnp.where(lbi < 0, 0.0, ratio)


def _onecycle_scale(lbi: jax.Array, first: float, second: float) -> jax.Array:
    """Triangle in [0, 1]: up over ``first`` steps, down over ``second`` steps."""
    total = first + second
    ratio = first / total
    b = (lbi + 1).astype(jnp.float32) / total
    x = 1.0 + b - jnp.floor(1.0 + b)
    return jnp.where(x <= ratio, x / ratio, (x - 1.0) / (ratio - 1.0))


def _decay_interval(lbi: jax.Array, total: float, decay_step_size: float) -> jax.Array:
    return (lbi.astype(jnp.float32) - total + 1.0) / decay_step_size


def onecycle_lr(count, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                decay_step_size: int = 0, last_batch_iteration: int = -1) -> jax.Array:
    """OneCycle learning rate: min -> max -> min over one cycle, then ``min / (1 + rate * t)``."""
    lbi = _lbi(count, last_batch_iteration)
    first = float(cycle_first_step_size)
    second = first if cycle_second_step_size is None else float(cycle_second_step_size)
    cycle = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * _onecycle_scale(lbi, first, second)
    if math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0):
        after = jnp.float32(cycle_min_lr)
    else:
        after = cycle_min_lr / (1.0 + decay_lr_rate * _decay_interval(lbi, first + second, decay_step_size))
    return jnp.where(lbi < first + second, cycle, after)


def onecycle_momentum(count, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                      decay_mom_rate: float = 0.0, cycle_first_step_size: int = 2000,
                      cycle_second_step_size: Optional[int] = None, decay_step_size: int = 0,
                      last_batch_iteration: int = -1) -> jax.Array:
    """OneCycle momentum (Adam's beta1), cycled inversely to the lr: max -> min -> max, then
    ``max * (1 + decay_mom_rate * t)``. DeepSpeed also sets beta2 to 0.99 while cycling."""
    lbi = _lbi(count, last_batch_iteration)
    first = float(cycle_first_step_size)
    second = first if cycle_second_step_size is None else float(cycle_second_step_size)
    cycle = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * _onecycle_scale(lbi, first, second)
    if math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0):
        after = jnp.float32(cycle_max_mom)
    else:
        after = cycle_max_mom * (1.0 + decay_mom_rate * _decay_interval(lbi, first + second, decay_step_size))
    return jnp.where(lbi < first + second, cycle, after)


def lr_range_test(count, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                  lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                  last_batch_iteration: int = -1) -> jax.Array:
    """LRRangeTest: ``min_lr * (1 + rate * (lbi + 1) / step_size)`` (floored when staircase)."""
    lbi = _lbi(count, last_batch_iteration)
    interval = (lbi + 1).astype(jnp.float32) / lr_range_test_step_size
    if lr_range_test_staircase:
        interval = jnp.floor(interval)
    return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)


# --------------------------------------------------------------------------- the JSON block

_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
           "warmup_type": "log", "last_batch_iteration": -1}
_ONECYCLE_MOM = ("cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")

# DeepSpeed's parameters and defaults per schedule type (None for warmup_max_lr: the optimizer lr)
SCHEDULE_DEFAULTS: dict[str, dict] = {
    "WarmupLR": dict(_WARMUP),
    "WarmupDecayLR": {"total_num_steps": REQUIRED, **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 1e-4, "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None,
                 "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
                 "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
                    "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
                    "last_batch_iteration": -1},
}

_BOOLS = {"cycle_momentum", "lr_range_test_staircase"}
_INTS_MIN = {"warmup_num_steps": 0, "total_num_steps": 1, "cycle_first_step_size": 1,
             "cycle_second_step_size": 1, "cycle_first_stair_count": 0, "cycle_second_stair_count": 0,
             "decay_step_size": 0, "lr_range_test_step_size": 1, "last_batch_iteration": -1}
_FRACTIONS = {"warmup_min_ratio", "cos_min_ratio", "cycle_min_mom", "cycle_max_mom"}
_NULLABLE = {"warmup_max_lr", "cycle_second_step_size", "cycle_second_stair_count"}


def _bad(key: str, value, expected: str, fix: str) -> ConfigError:
    return ConfigError(f"scheduler.params.{key}={value!r} is invalid: expected {expected}. Fix: {fix}")


def _check_param(key: str, value):
    """Validate one scheduler parameter by name; returns it normalised (ints as int)."""
    if value is None and key in _NULLABLE:
        return None
    if key == "warmup_type":
        if value not in ("log", "linear"):
            raise _bad(key, value, '"log" or "linear"', 'use "linear" for a straight ramp')
        return value
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise _bad(key, value, "true or false", f'write "{key}": true or false')
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, value, "a number", "write a JSON number (or \"auto\" where supported)")
    if key in _INTS_MIN:
        if not float(value).is_integer() or value < _INTS_MIN[key]:
            raise _bad(key, value, f"an integer >= {_INTS_MIN[key]}", "write a whole number of steps")
        return int(value)
    if value < 0 or (key in _FRACTIONS and value > 1):
        expected = "a number in [0, 1]" if key in _FRACTIONS else "a number >= 0"
        raise _bad(key, value, expected, "learning rates, rates and ratios are non-negative")
    return float(value)


def resolve_scheduler(scheduler: dict, base_lr: float) -> dict:
    """Validate a ``{"type", "params"}`` block; return it with every default filled in."""
    if not isinstance(scheduler, dict):
        raise ConfigError(f"scheduler={scheduler!r} is invalid: expected an object "
                          '{"type": ..., "params": {...}}. Fix: see the DeepSpeed scheduler docs')
    for key in scheduler:
        if key not in ("type", "params"):
            raise ConfigError(f'Unknown key "scheduler.{key}". {_did_you_mean(key, ("type", "params"))}')
    kind = scheduler.get("type")
    if kind not in SCHEDULE_DEFAULTS:
        raise ConfigError(f"scheduler.type={kind!r} is not a DeepSpeed schedule. "
                          f"{_did_you_mean(str(kind), SCHEDULE_DEFAULTS)}")
    params = scheduler.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"scheduler.params={params!r} is invalid: expected an object")
    defaults = SCHEDULE_DEFAULTS[kind]
    for key in params:
        if key not in defaults:
            raise ConfigError(f'Unknown key "scheduler.params.{key}" for {kind}. '
                              f"{_did_you_mean(key, defaults)}")
    resolved = {}
    for key, default in defaults.items():
        if default is REQUIRED and key not in params:
            raise ConfigError(f"scheduler.params.{key} is missing: {kind} needs it. "
                              f'Fix: add "{key}": <number> (or "auto" with training arguments)')
        resolved[key] = _check_param(key, params.get(key, default))
    if "warmup_max_lr" in resolved and resolved["warmup_max_lr"] is None:
        resolved["warmup_max_lr"] = float(base_lr)
    return {"type": kind, "params": resolved}


def _did_you_mean(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    if close:
        return f'Did you mean "{close[0]}"?'
    return f"Known: {', '.join(sorted(known))}."


_LR_FUNCTIONS = {"WarmupLR": warmup_lr, "WarmupDecayLR": warmup_decay_lr,
                 "WarmupCosineLR": warmup_cosine_lr, "OneCycle": onecycle_lr,
                 "LRRangeTest": lr_range_test}
_UNUSED = {"OneCycle": ("cycle_first_stair_count", "cycle_second_stair_count") + _ONECYCLE_MOM}


def from_deepspeed(scheduler: Optional[dict], base_lr: float) -> Callable[[jax.Array], jax.Array]:
    """The learning rate as a function of the number of applied optimizer steps.

    ``scheduler`` is DeepSpeed's ``{"type": ..., "params": {...}}`` block (``None``: constant
    ``base_lr``); ``base_lr`` is the optimizer's lr (used by WarmupCosineLR and as WarmupLR's
    default ``warmup_max_lr``). For OneCycle's momentum use :func:`onecycle_momentum_from_deepspeed`.
    """
    if scheduler is None:
        return lambda count: jnp.full((), base_lr, jnp.float32)
    resolved = resolve_scheduler(scheduler, base_lr)
    kind, params = resolved["type"], dict(resolved["params"])
    for key in _UNUSED.get(kind, ()):
        params.pop(key)
    if kind == "WarmupCosineLR":
        params["base_lr"] = float(base_lr)
    return functools.partial(_LR_FUNCTIONS[kind], **params)


def onecycle_momentum_from_deepspeed(scheduler: dict) -> Optional[Callable[[jax.Array], jax.Array]]:
    """OneCycle's beta1 schedule, or None when the block is not OneCycle or cycle_momentum is off."""
    if scheduler is None or scheduler.get("type") != "OneCycle":
        return None
    params = resolve_scheduler(scheduler, 0.0)["params"]
    if not params["cycle_momentum"]:
        return None
    keep = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "cycle_first_step_size",
            "cycle_second_step_size", "decay_step_size", "last_batch_iteration")
    return functools.partial(onecycle_momentum, **{k: params[k] for k in keep})
