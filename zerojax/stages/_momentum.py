"""SGD with momentum in one elementwise pass whose overflow skip is a coefficient (see
:mod:`zerojax.stages._adam`): on a skipped step the momentum becomes 1, the gradient zeros and
the step size 0, so the trace and the params stay exactly as they were.

For ``optax.sgd(lr, momentum)`` with constant settings (as :mod:`zerojax.update._recognize`
reads them) and
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
import optax

from zerojax.stages._gating import (
    find_node,
    gated_gradient,
    known_flag,
    per_transformation,
    replace_node,
    scalar_step,
    select_scalars,
    unzip_leaves,
)
from zerojax.update._recognize import recognize_with_pass

__all__ = ["MomentumRecipe", "gated_momentum", "momentum_recipe"]

_HP_KEYS = ("learning_rate", "momentum")


def _node(opt_state):
    return find_node(opt_state, optax.TraceState, _HP_KEYS)


@dataclass(frozen=True)
class MomentumRecipe:
    """Settings as ``constants``, or (None) read from the injected hyperparameters each step."""
    constants: Optional[dict] = None


@functools.partial(jax.jit, static_argnames="known")
def _momentum_leaf(p, g, t, c, known=None):
    """One leaf's gated update, ``c`` its step's scalars (``known``: the step's flag when it is
    known while tracing); traced once per leaf shape and dtype."""
    t = c["take"] * gated_gradient(c["apply"] if known is None else known, g) + c["keep"] * t
    return (p + c["step"] * t).astype(p.dtype), t


def gated_momentum(recipe: MomentumRecipe, tx, params, grads, opt_state, apply):
    """``(params, opt_state)`` after one SGD-momentum update where ``apply`` is true, exactly
    unchanged where it is false (``grads`` may then be non-finite). optax's arithmetic:
    ``t' = g + momentum * t``, ``p' = p - lr * t'``."""
    node = _node(opt_state)
    hp, before, after = scalar_step(tx, opt_state, node, ("trace",))
    hp = recipe.constants if recipe.constants is not None else hp
    keep = jnp.where(apply, hp["momentum"], jnp.float32(1.0))
    step = jnp.where(apply, -hp["learning_rate"], 0.0)

    take = jnp.where(apply, jnp.float32(1.0), 0.0)  # 1 * g is g exactly

    c = dict(apply=apply, take=take, keep=keep, step=step)
    known = known_flag(apply)
    out = jax.tree_util.tree_map(lambda p, g, t: _momentum_leaf(p, g, t, c, known=known), params, grads, node.trace)
    new_p, trace = (unzip_leaves(params, out, i) for i in range(2))
    scalars = select_scalars(apply, after, before)
    return new_p, replace_node(scalars, _node(scalars)._replace(trace=trace))


@per_transformation
def momentum_recipe(tx) -> Optional[MomentumRecipe]:
    """A :class:`MomentumRecipe` when ``tx`` is an SGD with momentum this module reproduces
    exactly (checked on the recognition's probes, in the same program), else None."""

    def gated(opt):
        if opt.kind != "sgd" or opt.nesterov or not opt.slots:
            return None
        recipe = MomentumRecipe(opt.constants)
        return lambda *a: gated_momentum(recipe, tx, *a)

    opt, exact = recognize_with_pass(tx, gated)
    return MomentumRecipe(opt.constants) if exact else None
