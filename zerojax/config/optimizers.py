"""optax optimizers for DeepSpeed's ``optimizer`` block (names, params and defaults as DeepSpeed's).

    tx = optimizer_from_config(ZeroConfig.from_deepspeed("ds_config.json", ...))
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax

from zerojax.config import schedules
from zerojax.config.checks import _optimizer_block
from zerojax.errors import ConfigError

__all__ = ["optimizer_from_config"]


def _trust_ratio(min_coeff, max_coeff) -> optax.GradientTransformation:
    """Lamb's per-tensor ||w|| / ||update||, clipped to [min_coeff, max_coeff] (1 if a norm is 0)."""
    def update(updates, state, params=None):
        def one(u, p):
            w, n = jnp.linalg.norm(p.ravel()), jnp.linalg.norm(u.ravel())
            ratio = jnp.where((w > 0) & (n > 0), jnp.clip(w / jnp.where(n > 0, n, 1.0), min_coeff, max_coeff), 1.0)
            return u * ratio.astype(u.dtype)
        return jax.tree.map(one, updates, params), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _scale_by_adagrad(initial_accumulator_value, eps) -> optax.GradientTransformation:
    """torch's Adagrad: g / (sqrt(sum g^2) + eps)."""
    def init(params):
        return (jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value), params),)
    def update(updates, state, params=None):
        acc = jax.tree.map(lambda a, g: a + g * g, state[0], updates)
        return jax.tree.map(lambda g, a: g / (jnp.sqrt(a) + eps), updates, acc), (acc,)
    return optax.GradientTransformation(init, update)


def _adam(learning_rate, b1, b2, eps, weight_decay, decoupled):
    adam, decay = optax.scale_by_adam(b1, b2, eps), optax.add_decayed_weights(weight_decay)
    parts = (adam, decay) if decoupled else (decay, adam)  # AdamW vs torch Adam's L2 on the gradient
    return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


def _lamb(learning_rate, b1, b2, eps, weight_decay, min_coeff, max_coeff):
    return optax.chain(optax.scale_by_adam(b1, b2, eps), optax.add_decayed_weights(weight_decay),
                       _trust_ratio(min_coeff, max_coeff), optax.scale_by_learning_rate(learning_rate))


def _lion(learning_rate, b1, b2, weight_decay):
    return optax.lion(learning_rate, b1, b2, weight_decay=weight_decay)


def _adagrad(learning_rate, eps, weight_decay, initial_accumulator_value):
    return optax.chain(optax.add_decayed_weights(weight_decay), _scale_by_adagrad(initial_accumulator_value, eps),
                       optax.scale_by_learning_rate(learning_rate))


def _sgd(learning_rate, momentum, weight_decay, nesterov):
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(momentum, nesterov=nesterov),
                       optax.scale_by_learning_rate(learning_rate))


def optimizer_from_config(config: ZeroConfig) -> optax.GradientTransformation:
    """The optax optimizer for ``config.optimizer`` (DeepSpeed's names, params and defaults).

    Adam is AdamW (decoupled weight decay) unless ``adam_w_mode`` is false, which adds
    ``weight_decay * param`` to the gradient as torch's Adam does. The learning rate follows
    ``config.scheduler`` when there is one; OneCycle with ``cycle_momentum`` also cycles beta1
    and, as DeepSpeed does, sets beta2 to 0.99 (optimizers without betas skip it with a warning).
    No gradient clipping here: the engine clips with ``config.gradient_clipping``.

    Hyperparameters are injected (``optax.inject_hyperparams``), so after ``k`` updates
    ``opt_state.hyperparams["learning_rate"]`` holds the lr the k-th update used (after
    ``init``, the lr the first update will use). ``update`` needs ``params``.
    """
    if config.optimizer is None:
        raise ConfigError("ZeroConfig.optimizer is None: the DeepSpeed config had no optimizer block. "
                          'Fix: add "optimizer": {"type": "AdamW", "params": {...}} or build your own optax optimizer')
    block = _optimizer_block(config.optimizer, [])
    name, p = block["type"], dict(block["params"])
    lr = schedules.from_deepspeed(config.scheduler, p["lr"]) if config.scheduler else p["lr"]
    b1, b2 = p.get("betas", (None, None))
    momentum = schedules.onecycle_momentum_from_deepspeed(config.scheduler) if config.scheduler else None
    if momentum is not None and "betas" in p:
        b1, b2 = momentum, 0.99
    elif momentum is not None:
        warnings.warn(f"scheduler.params.cycle_momentum is disabled because {name} has no betas "
                      "(as in DeepSpeed). Set it to false to silence this warning", stacklevel=2)
    wd = p["weight_decay"]
    if name in ("Adam", "AdamW"):
        factory, kwargs = _adam, dict(b1=b1, b2=b2, eps=p["eps"], decoupled=name == "AdamW" or p["adam_w_mode"])
    elif name == "Lamb":
        factory, kwargs = _lamb, dict(b1=b1, b2=b2, eps=p["eps"], min_coeff=p["min_coeff"], max_coeff=p["max_coeff"])
    elif name == "Lion":
        factory, kwargs = _lion, dict(b1=b1, b2=b2)
    elif name == "Adagrad":
        factory, kwargs = _adagrad, dict(eps=p["eps"], initial_accumulator_value=p["initial_accumulator_value"])
    else:
        factory, kwargs = _sgd, dict(momentum=p["momentum"], nesterov=p["nesterov"])
    static = [k for k, v in kwargs.items() if isinstance(v, bool)]
    return optax.inject_hyperparams(factory, static_args=static)(learning_rate=lr, weight_decay=wd, **kwargs)
