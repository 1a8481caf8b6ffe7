"""AdamW in one elementwise pass whose overflow skip is a coefficient, not a select.

A skipped step must leave params and moments exactly as they were. Written as
``where(skip, old, new)`` over the state, XLA recomputes the new moments inside the params'
fusion from the old ones while another fusion overwrites them in place, so it copies every
moment first: on an optimizer-bound model that doubles the step. Here the skip enters the
coefficients instead: on a skipped step ``b1``, ``b2`` become 1, their complements and the
step size 0, and the gradient is replaced by zeros, so ``m' = m``, ``v' = v`` and
``p' = p`` exactly, with the same fusions as an unguarded update. On an applied step the
arithmetic is optax's, term for term.

It applies to the optimizers whose state and update it can prove it reproduces
(:func:`adam_recipe`): ``optax.adam`` / ``optax.adamw`` with constant settings (as the one
recognition, :mod:`zerojax.update._recognize`, reads them), and ``optax.inject_hyperparams`` of them, which is what
the DeepSpeed ``Adam``/``AdamW`` blocks build (settings and schedules read from the state
each step). Each candidate is checked against its own ``tx.update`` on probe values,
extreme ones included, before it is used; anything else keeps the general select path.
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

__all__ = ["AdamRecipe", "adam_node", "adam_recipe", "gated_adam", "step_hyperparams"]

_HP_KEYS = ("learning_rate", "b1", "b2", "eps", "weight_decay")


def adam_node(opt_state) -> Optional[optax.ScaleByAdamState]:
    """The ScaleByAdamState of a ``chain(scale_by_adam, <stateless>...)`` state, bare or inside
    ``optax.inject_hyperparams`` (with Adam's settings injected); None for anything else."""
    return find_node(opt_state, optax.ScaleByAdamState, _HP_KEYS)


def step_hyperparams(tx, opt_state):
    """:func:`scalar_step` of an Adam state."""
    return scalar_step(tx, opt_state, adam_node(opt_state), ("mu", "nu"))


@dataclass(frozen=True)
class AdamRecipe:
    """How to run ``tx`` as a gated pass: its settings are ``constants`` or, when None, read from
    the injected hyperparameters of the state each step."""
    constants: Optional[dict] = None


@functools.partial(jax.jit, static_argnames="known")
def _adam_leaf(p, g, m, v, c, known=None):
    """One leaf's gated AdamW update, ``c`` its step's scalars (``known``: the step's flag when
    it is known while tracing). Jitted so that it is traced once per leaf shape and dtype: a
    model's layers share their shapes, and the step's trace inlines it."""
    g = gated_gradient(c["apply"] if known is None else known, g)
    m = c["take1"] * g + c["keep1"] * m
    v = c["take2"] * (g ** 2) + c["keep2"] * v
    u = (m / c["bc1"].astype(m.dtype)) / (jnp.sqrt(v / c["bc2"].astype(v.dtype) + c["eps_root"]) + c["eps"])
    u = u + c["wd"] * p
    return (p + c["step"] * u).astype(p.dtype), m, v


def gated_adam(recipe: AdamRecipe, tx, params, grads, opt_state, apply):
    """``(params, opt_state)`` after one AdamW update where ``apply`` (a traced bool) is true,
    exactly unchanged where it is false; ``grads`` may be non-finite when it is false.

    Elementwise over whatever layout the trees share (partitioned, padded storage: zero
    padding stays zero)."""
    hp, before, after = step_hyperparams(tx, opt_state)
    hp = recipe.constants if recipe.constants is not None else hp
    lr, b1, b2, eps, wd = (hp[k] for k in _HP_KEYS)
    eps_root = hp.get("eps_root", 0.0)
    node = adam_node(opt_state)
    count = optax.safe_increment(node.count)  # bias correction as if applied: finite either way
    one = jnp.float32(1.0)
    keep1, keep2 = jnp.where(apply, b1, one), jnp.where(apply, b2, one)
    take1, take2 = jnp.where(apply, 1 - b1, 0.0), jnp.where(apply, 1 - b2, 0.0)
    step = jnp.where(apply, -lr, 0.0)
    bc1, bc2 = 1 - b1 ** count, 1 - b2 ** count

    c = dict(apply=apply, take1=take1, keep1=keep1, take2=take2, keep2=keep2, step=step, bc1=bc1, bc2=bc2,
             eps=eps, eps_root=eps_root, wd=wd)
    known = known_flag(apply)
    out = jax.tree_util.tree_map(lambda p, g, m, v: _adam_leaf(p, g, m, v, c, known=known), params, grads, node.mu,
                                 node.nu)
    new_p, mu, nu = (unzip_leaves(params, out, i) for i in range(3))
    # the scalars (counts, hyperparameters) advance only on an applied step
    scalars = select_scalars(apply, after, before)
    return new_p, replace_node(scalars, adam_node(scalars)._replace(mu=mu, nu=nu))


# ------------------------------------------------------------------ recognising


@per_transformation
def adam_recipe(tx) -> Optional[AdamRecipe]:
    """An :class:`AdamRecipe` when ``tx`` is an Adam/AdamW (as :func:`zerojax.update._recognize.recognize`
    finds it) that this pass reproduces exactly (checked on the recognition's probes, extreme
    ones included, in the same program), else None (the caller keeps the general path).
    Remembered per transformation."""

    def gated(opt):
        if opt.kind != "adam":
            return None
        recipe = AdamRecipe(opt.constants)
        return lambda *a: gated_adam(recipe, tx, *a)

    opt, exact = recognize_with_pass(tx, gated)
    return AdamRecipe(opt.constants) if exact else None
