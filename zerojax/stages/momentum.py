"""SGD with momentum in one elementwise pass whose overflow skip is a coefficient (see
:mod:`zerojax.stages.adam`): on a skipped step the momentum becomes 1, the gradient zeros and
the step size 0, so the trace and the params stay exactly as they were.

For ``optax.sgd(lr, momentum)`` with constant settings (read off by probing) and
``optax.inject_hyperparams(optax.sgd)``; each is checked against its own ``tx.update`` first.
Nesterov momentum, weight decay chains and schedules outside ``inject_hyperparams`` keep the
general select path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax.stages.adam import agrees_with_optax, find_node, replace_adam_node, scalar_step, select_scalars, zero_unless

__all__ = ["MomentumRecipe", "gated_momentum", "momentum_recipe"]

_HP_KEYS = ("learning_rate", "momentum")


def _node(opt_state):
    return find_node(opt_state, optax.TraceState, _HP_KEYS)


@dataclass(frozen=True)
class MomentumRecipe:
    """Settings as ``constants``, or (None) read from the injected hyperparameters each step."""
    constants: Optional[dict] = None


def gated_momentum(recipe: MomentumRecipe, tx, params, grads, opt_state, apply):
    """``(params, opt_state)`` after one SGD-momentum update where ``apply`` is true, exactly
    unchanged where it is false (``grads`` may then be non-finite). optax's arithmetic:
    ``t' = g + momentum * t``, ``p' = p - lr * t'``."""
    node = _node(opt_state)
    hp, before, after = scalar_step(tx, opt_state, node, ("trace",))
    hp = recipe.constants if recipe.constants is not None else hp
    keep = jnp.where(apply, hp["momentum"], jnp.float32(1.0))
    step = jnp.where(apply, -hp["learning_rate"], 0.0)

    def leaf(p, g, t):
        t = zero_unless(apply, g) + keep * t
        return (p + step * t).astype(p.dtype), t

    out = jax.tree_util.tree_map(leaf, params, grads, node.trace)
    pick = lambda i: jax.tree_util.tree_map(lambda _, o: o[i], params, out)  # noqa: E731
    scalars = select_scalars(apply, after, before)
    return pick(0), replace_adam_node(scalars, _node(scalars)._replace(trace=pick(1)))


def _probe_constants(tx) -> Optional[dict]:
    """lr and momentum of a bare chain from one update: ``g = [1, 0]`` on a trace ``[0, 1]``
    gives the trace ``[1, momentum]`` and the updates ``-lr`` times it."""
    p = {"x": jnp.zeros((2,), jnp.float32)}
    state = tx.init(p)
    state = replace_adam_node(state, _node(state)._replace(trace={"x": jnp.array([0.0, 1.0], jnp.float32)}))
    u, after = tx.update({"x": jnp.array([1.0, 0.0], jnp.float32)}, state, p)
    trace = np.asarray(_node(after).trace["x"], np.float64)
    lr = -float(np.asarray(u["x"], np.float64)[0]) / trace[0]
    return {"learning_rate": float(np.float32(lr)), "momentum": float(np.float32(trace[1]))}


def _verified(recipe: MomentumRecipe, tx) -> bool:
    rng = np.random.default_rng(0)
    for scale in (1.0, 1e-10):  # ordinary, and gradients that vanish next to the trace
        params = {"x": jnp.asarray(rng.normal(size=6) * 1e-5, jnp.float32)}
        grads = {"x": jnp.asarray(rng.normal(size=6) * scale, jnp.float32)}
        state = tx.init(params)
        node = _node(state)
        if node is None or node.trace["x"].dtype != jnp.float32:
            return False
        state = replace_adam_node(state, node._replace(trace={"x": jnp.asarray(rng.normal(size=6), jnp.float32)}))
        if not agrees_with_optax(tx, lambda *a: gated_momentum(recipe, tx, *a), params, grads, state):
            return False
    return True


def momentum_recipe(tx) -> Optional[MomentumRecipe]:
    """A :class:`MomentumRecipe` when ``tx`` is an SGD with momentum this module reproduces
    exactly (checked on probes), else None."""
    try:
        return _cached(tx)
    except TypeError:  # unhashable transformation
        return _recipe(tx)


@functools.lru_cache(maxsize=256)
def _cached(tx):
    return _recipe(tx)


def _recipe(tx) -> Optional[MomentumRecipe]:
    try:
        state = tx.init({"x": jnp.zeros((2,), jnp.float32)})
        if _node(state) is None:
            return None
        injected = getattr(state, "hyperparams", None) is not None
        recipe = MomentumRecipe(None if injected else _probe_constants(tx))
        return recipe if _verified(recipe, tx) else None
    except Exception:  # noqa: BLE001 - an optimizer the probes cannot drive keeps the general path
        return None
