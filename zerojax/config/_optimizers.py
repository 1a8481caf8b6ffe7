"""optax optimizers for DeepSpeed's ``optimizer`` block (names, params and defaults as DeepSpeed's).

    tx = optimizer_from_config(ZeroConfig.from_deepspeed("ds_config.json", ...))
"""
from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
import optax.contrib
from optax.contrib import MuonDimensionNumbers

from zerojax.config._schedules import from_deepspeed as schedule_from_deepspeed, onecycle_momentum_from_deepspeed
from zerojax.config._checks import optimizer_block
from zerojax._errors import ConfigError, IgnoredKeysWarning

__all__ = ["MUON_SKIP", "muon_dimension_numbers", "muon_rule", "optimizer_from_config", "scale_by_adam_uncorrected"]


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


class ScaleByAdamState(NamedTuple):
    count: jax.Array  # i32[] updates so far
    mu: optax.Updates  # first moment, the params' structure and dtypes
    nu: optax.Updates  # second moment


def scale_by_adam_uncorrected(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's direction without bias correction (DeepSpeed's ``bias_correction: false``):
    ``m / (sqrt(v) + eps)`` with ``m``, ``v`` the raw exponential moving averages."""
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return ScaleByAdamState(jnp.zeros([], jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return out, ScaleByAdamState(optax.safe_increment(state.count), mu, nu)

    return optax.GradientTransformation(init, update)


def _scale_by_adam(b1, b2, eps, bias_correction):
    return optax.scale_by_adam(b1, b2, eps) if bias_correction else scale_by_adam_uncorrected(b1, b2, eps)


def _adam(learning_rate, b1, b2, eps, weight_decay, decoupled, bias_correction=True):
    adam, decay = _scale_by_adam(b1, b2, eps, bias_correction), optax.add_decayed_weights(weight_decay)
    parts = (adam, decay) if decoupled else (decay, adam)  # AdamW vs torch Adam's L2 on the gradient
    return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


def _lamb(learning_rate, b1, b2, eps, weight_decay, min_coeff, max_coeff, bias_correction=True):
    return optax.chain(_scale_by_adam(b1, b2, eps, bias_correction), optax.add_decayed_weights(weight_decay),
                       _trust_ratio(min_coeff, max_coeff), optax.scale_by_learning_rate(learning_rate))


def _lion(learning_rate, b1, b2, weight_decay):
    return optax.lion(learning_rate, b1, b2, weight_decay=weight_decay)


def _adagrad(learning_rate, eps, weight_decay, initial_accumulator_value):
    return optax.chain(optax.add_decayed_weights(weight_decay), _scale_by_adagrad(initial_accumulator_value, eps),
                       optax.scale_by_learning_rate(learning_rate))


def _sgd(learning_rate, momentum, weight_decay, nesterov):
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(momentum, nesterov=nesterov),
                       optax.scale_by_learning_rate(learning_rate))


# words in a leaf's path that keep a matrix on AdamW: embeddings ("emb": DeepSpeed's "embed", GPT-2's
# wte / wpe) and the output head (DeepSpeed's "lm_head", any "head")
MUON_SKIP = ("emb", "wte", "wpe", "head")


def _path_str(path) -> str:
    """'h0/mlp/kernel': the spelling the plan's table prints (zerojax._plan.path_str, which this
    module cannot import without a cycle through zerojax.config)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def muon_rule(path: str, shape) -> bool:
    """DeepSpeed's ``use_muon``: a leaf of 2 or more dims whose path (as ``plan.describe()``
    prints it, e.g. ``blocks/0/mlp/fc/kernel``) has none of :data:`MUON_SKIP`; everything else
    (embeddings, the head, norms, biases, scalars) is updated by AdamW. A leaf of 3 or more
    dims is a stack of matrices over its leading dims (a scanned ``[layers, m, n]`` kernel):
    each ``[m, n]`` slice is orthogonalised on its own."""
    return len(shape) >= 2 and not any(w in path.lower() for w in MUON_SKIP)


def muon_dimension_numbers(rule: Optional[Callable] = None) -> Callable:
    """``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` for ``rule(path, shape) ->
    bool`` (default :func:`muon_rule`): for a Muon leaf, its last two dims are the matrix
    (reduction dim, output dim, as a ``x @ w`` kernel) and any leading dims stack matrices;
    None sends a leaf to AdamW."""
    rule = muon_rule if rule is None else rule

    def dims(params):
        def one(path, x):
            if not rule(_path_str(path), tuple(x.shape)):
                return None
            if x.ndim < 2:
                raise ConfigError(f"muon_params marks {_path_str(path)!r} of shape {tuple(x.shape)} for Muon, "
                                  "which orthogonalises matrices only. Fix: return False for leaves of fewer "
                                  "than 2 dims")
            return MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)
        return jax.tree_util.tree_map_with_path(one, params)
    return dims


def _muon_from_block(config, p, muon_params):
    """DeepSpeed's MuonWithAuxAdam as ``optax.contrib.muon`` (see :func:`optimizer_from_config`)."""
    muon_lr = next((x for x in (p["muon_lr"], p["lr"]) if x is not None), 0.02)
    adam_lr = next((x for x in (p["adam_lr"], p["lr"]) if x is not None), 3e-4)
    if config.scheduler:  # DeepSpeed's schedulers set every param group's lr to the one schedule
        for key in ("muon_lr", "adam_lr"):
            if p[key] is not None:
                warnings.warn(f"optimizer.params.{key}={p[key]} is replaced by the scheduler's learning rate "
                              "(DeepSpeed's schedulers set both Muon's and Adam's lr, as here). Remove it, or the "
                              "scheduler block, to silence this warning", IgnoredKeysWarning, stacklevel=3)
        muon_lr = adam_lr = schedule_from_deepspeed(config.scheduler, muon_lr)
        if onecycle_momentum_from_deepspeed(config.scheduler) is not None:
            raise ConfigError("scheduler.params.cycle_momentum cycles Adam's beta1, which zerojax's Muon does "
                              "not expose to a schedule. Fix: set cycle_momentum to false")
    b1, b2 = p["betas"]
    muon = optax.inject_hyperparams(optax.contrib.muon, static_args=("muon_weight_dimension_numbers", "nesterov"))
    return muon(learning_rate=muon_lr, adam_learning_rate=adam_lr, beta=p["momentum"], eps=p["eps"],
                weight_decay=p["weight_decay"], adam_b1=b1, adam_b2=b2, adam_weight_decay=p["weight_decay"],
                nesterov=True, muon_weight_dimension_numbers=muon_dimension_numbers(muon_params))


def optimizer_from_config(config: ZeroConfig, muon_params: Optional[Callable] = None) -> optax.GradientTransformation:
    """The optax optimizer for ``config.optimizer`` (DeepSpeed's names, params and defaults).

    Adam is AdamW (decoupled weight decay) unless ``adam_w_mode`` is false, which adds
    ``weight_decay * param`` to the gradient as torch's Adam does. ``bias_correction: false``
    (Adam, AdamW, Lamb) uses the raw moment averages, as DeepSpeed's fused kernels do. The learning rate follows
    ``config.scheduler`` when there is one; OneCycle with ``cycle_momentum`` also cycles beta1
    and, as DeepSpeed does, sets beta2 to 0.99 (optimizers without betas skip it with a warning).
    No gradient clipping here: the engine clips with ``config.gradient_clipping``.

    Hyperparameters are injected (``optax.inject_hyperparams``), so after ``k`` updates
    ``opt_state.hyperparams["learning_rate"]`` holds the lr the k-th update used (after
    ``init``, the lr the first update will use). ``update`` needs ``params``.

    Muon is ``optax.contrib.muon`` (Nesterov momentum ``momentum``, 5 Newton–Schulz
    iterations with the quintic coefficients, width scaling ``sqrt(max(1, fan_out / fan_in))``,
    decoupled ``weight_decay`` times the lr) for the leaves ``muon_params(path, shape)``
    chooses (default :func:`muon_rule`, DeepSpeed's ``use_muon``), AdamW with ``betas``,
    ``eps`` and ``weight_decay`` for the others. Its learning rate is ``muon_lr`` (else
    ``lr``, else 0.02), Adam's ``adam_lr`` (else ``lr``, else 3e-4); a scheduler drives both, as
    DeepSpeed's schedulers set every param group's lr. ``ns_method`` "gram" (DeepSpeed's
    default) and "standard" are the same iteration in exact arithmetic; zerojax computes the
    standard one. ``opt_state.hyperparams`` holds ``learning_rate`` (Muon's) and
    ``adam_learning_rate``. Differences from DeepSpeed's numerics: docs/differences.md.
    """
    if config.optimizer is None:
        raise ConfigError("ZeroConfig.optimizer is None: the DeepSpeed config had no optimizer block. "
                          'Fix: add "optimizer": {"type": "AdamW", "params": {...}} or build your own optax optimizer')
    block = optimizer_block(config.optimizer)
    name, p = block["type"], dict(block["params"])
    if name == "Muon":
        return _muon_from_block(config, p, muon_params)
    if muon_params is not None:
        raise ConfigError(f"muon_params= chooses the Muon leaves of a Muon optimizer, and the config's optimizer "
                          f"is {name}. Fix: drop muon_params, or set \"type\": \"Muon\"")
    lr = schedule_from_deepspeed(config.scheduler, p["lr"]) if config.scheduler else p["lr"]
    b1, b2 = p.get("betas", (None, None))
    momentum = onecycle_momentum_from_deepspeed(config.scheduler) if config.scheduler else None
    if momentum is not None and "betas" in p:
        b1, b2 = momentum, 0.99
    elif momentum is not None:
        warnings.warn(f"scheduler.params.cycle_momentum is disabled because {name} has no betas "
                      "(as in DeepSpeed). Set it to false to silence this warning", IgnoredKeysWarning, stacklevel=2)
    wd = p["weight_decay"]
    if name in ("Adam", "AdamW"):
        factory, kwargs = _adam, dict(b1=b1, b2=b2, eps=p["eps"], decoupled=name == "AdamW" or p["adam_w_mode"],
                                      bias_correction=p["bias_correction"])
    elif name == "Lamb":
        factory, kwargs = _lamb, dict(b1=b1, b2=b2, eps=p["eps"], min_coeff=p["min_coeff"], max_coeff=p["max_coeff"],
                                      bias_correction=p["bias_correction"])
    elif name == "Lion":
        factory, kwargs = _lion, dict(b1=b1, b2=b2)
    elif name == "Adagrad":
        factory, kwargs = _adagrad, dict(eps=p["eps"], initial_accumulator_value=p["initial_accumulator_value"])
    else:
        factory, kwargs = _sgd, dict(momentum=p["momentum"], nesterov=p["nesterov"])
    static = [k for k, v in kwargs.items() if isinstance(v, bool)]
    return optax.inject_hyperparams(factory, static_args=static)(learning_rate=lr, weight_decay=wd, **kwargs)
