"""The step pipeline before and after the optimizer, written once for every engine.

    checked = check_gradients(cfg, scaled_grads, loss, scale)   # unscale, norm, finite, skip, clip
    ...the engine updates where its state lives, with checked.grads / checked.coef...
    loss_scale = next_loss_scale(cfg, state.loss_scale, checked.finite)
    metrics = step_metrics(cfg, loss, checked, lr, scale, state.loss_scale, loss_scale)

The on-device step (stages 0–3, optimizer offload to host memory, fused Adam), the NVMe step,
ZenFlow and ``zero_optimizer`` all call these, so DeepSpeed's rules (the overflow skip, the
loss-scale update, the clipping coefficient, the error codes and the metric keys) have one
home each. An engine supplies only where its state lives and when the update runs.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from zerojax._contract import METRIC_KEYS, NON_FINITE, OK, SCALE_AT_MIN
from zerojax._errors import HostUpdateWarning
from zerojax._precision import global_norm, step_is_finite

__all__ = ["Checked", "check_gradients", "clip_coefficient", "clip_gradients", "host_or_device", "learning_rate",
           "next_loss_scale", "skip_rule", "step_metrics"]


def clip_coefficient(norm, clip: float):
    """DeepSpeed's: max(1, (norm + 1e-6) / clip); gradients are divided by it."""
    if not clip:
        return jnp.float32(1.0)
    return jnp.maximum(jnp.float32(1.0), (norm + 1e-6) / clip)


def skip_rule(cfg, finite):
    """Whether a step is skipped (nothing updated, the schedule not advanced): when its loss or
    gradients hold inf/nan, except under bf16 with ``check_grad_overflow`` off, where DeepSpeed
    applies every step. ``finite`` is a traced bool or a Python bool."""
    if cfg.precision == "bf16" and not cfg.check_grad_overflow:
        return jnp.asarray(False) if isinstance(finite, jax.Array) else False
    return ~finite if isinstance(finite, jax.Array) else not finite


class Checked(NamedTuple):
    """The gradients after the pipeline's checks. ``grads``: unscaled, not yet clipped (divide
    by ``coef``); ``norm``: their global norm; ``finite``; ``skip``: the update must not apply."""
    grads: Any
    norm: jax.Array
    finite: jax.Array
    skip: jax.Array
    coef: jax.Array


def check_gradients(cfg, scaled_grads, loss, scale=None, sumsq=None) -> Checked:
    """Unscale (fp16's loss scale), take the global norm, check for inf/nan, apply the skip rule
    and compute the clipping coefficient (``cfg.gradient_clipping``). ``sumsq``: the scaled
    gradients' sum of squares where the engine already has it (stages 1-2 take it from the
    reduced buckets: one reduction a bucket instead of one a leaf); else it is taken here."""
    grads = scaled_grads if scale is None else jax.tree_util.tree_map(lambda g: g / scale, scaled_grads)
    if sumsq is None:
        norm = global_norm(grads)
    else:
        norm = jnp.sqrt(sumsq) if scale is None else jnp.sqrt(sumsq) / scale
    finite = step_is_finite(norm, loss)
    return Checked(grads, norm, finite, skip_rule(cfg, finite), clip_coefficient(norm, cfg.gradient_clipping))


def clip_gradients(cfg, grads):
    """``grads`` divided by DeepSpeed's clipping coefficient (unchanged without clipping)."""
    if not cfg.gradient_clipping:
        return grads
    coef = clip_coefficient(global_norm(grads), cfg.gradient_clipping)
    return jax.tree_util.tree_map(lambda g: g / coef, grads)


def host_or_device(on_host: Callable, on_device: Callable, path: str, stacklevel: int = 3):
    """``on_host()``, traced for the host; an optimizer whose update cannot be traced there (it
    mixes host values with constants it makes on the device: a ``ValueError`` while tracing,
    before anything runs) is updated by ``on_device()`` instead, with a ``HostUpdateWarning``
    naming ``path``. An error of the optimizer's own is raised again by ``on_device``, not lost."""
    try:
        return on_host()
    except ValueError as e:
        warnings.warn(
            f"{path}: this optimizer's update cannot be traced for the host ({e}); its state stays in host "
            "memory between steps and is updated on the device instead. optax.adam/adamw/sgd/lion (and the "
            "DeepSpeed Adam/AdamW configs) update on the host.", HostUpdateWarning, stacklevel=stacklevel)
        return on_device()


def next_loss_scale(cfg, loss_scale, finite):
    """The loss scaler's state after this step (fp16's dynamic scale; unchanged otherwise)."""
    if cfg.precision != "fp16":
        return loss_scale
    return cfg.loss_scaler.update(loss_scale, ~finite)


def _error(cfg, finite, before, after):
    if cfg.precision == "fp16":
        return jnp.where(after.at_minimum & ~before.at_minimum, SCALE_AT_MIN, OK).astype(jnp.int32)
    if cfg.precision == "fp32":
        return jnp.where(finite, OK, NON_FINITE).astype(jnp.int32)
    return jnp.int32(OK)


def learning_rate(opt_state):
    """The learning rate recorded by ``optax.inject_hyperparams`` in ``opt_state``, else nan."""
    hp = find_hyperparams(opt_state)
    return jnp.float32(jnp.nan) if hp is None else jnp.asarray(hp["learning_rate"], jnp.float32)


def find_hyperparams(opt_state):
    """The first ``optax.inject_hyperparams`` record (with a learning rate) in ``opt_state``, else None."""
    hp = getattr(opt_state, "hyperparams", None)
    if isinstance(hp, dict) and "learning_rate" in hp:
        return hp
    children = opt_state if isinstance(opt_state, (tuple, list)) else (
        opt_state.values() if isinstance(opt_state, dict) else ())
    return next((found for found in map(find_hyperparams, children) if found is not None), None)


def step_metrics(cfg, loss, checked: Checked, lr, scale=None, scaler_before=None, scaler_after=None,
                 **extra) -> dict:
    """The metrics every engine returns (:data:`zerojax._contract.METRIC_KEYS`, then ``extra``).
    ``lr``: the learning rate this step used or, when skipped, would have used."""
    out = {
        "loss": loss,
        "grad_norm": checked.norm,
        "learning_rate": jnp.asarray(lr, jnp.float32),
        "loss_scale": jnp.float32(1.0) if scale is None else scale,
        "skipped": jnp.asarray(checked.skip),
        "error": _error(cfg, jnp.asarray(checked.finite), scaler_before, scaler_after),
    }
    assert tuple(out) == METRIC_KEYS
    out.update(extra)
    return out
