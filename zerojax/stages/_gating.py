"""What the gated update passes share (:mod:`zerojax.stages._adam`, :mod:`zerojax.stages._momentum`):
finding the one stateful transformation of a chain, bare or injected; advancing its scalars
(counts, hyperparameters, schedules) on an applied step only; the gradient zeroed on a skipped
one (a pass is checked against the optimizer's own ``tx.update`` where it is recognised:
:func:`zerojax.update._recognize.recognize_with_pass`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zerojax._compat import Tracer, same_memory_space
from zerojax.update._recognize import per_transformation  # noqa: F401 - remembered by structure
from zerojax.update._recognize import with_node as replace_node  # one home for the chain's first state

__all__ = ["find_node", "per_transformation", "replace_node", "scalar_step",
           "gated_gradient", "known_flag", "select_scalars", "unzip_leaves", "zero_unless"]


def _is_empty(x) -> bool:
    return isinstance(x, optax.EmptyState)


def _chain_of(chain, cls) -> bool:
    return isinstance(chain, tuple) and bool(chain) and isinstance(chain[0], cls) and all(map(_is_empty, chain[1:]))


def find_node(opt_state, cls, hp_keys):
    """The ``cls`` state of a ``chain(<cls's transformation>, <stateless>...)`` state, bare or
    inside ``optax.inject_hyperparams`` (with ``hp_keys`` injected); None for anything else."""
    hp = getattr(opt_state, "hyperparams", None)
    if hp is not None:
        inner = getattr(opt_state, "inner_state", None)
        if isinstance(hp, dict) and set(hp_keys) <= set(hp) and _chain_of(inner, cls):
            return inner[0]
        return None
    return opt_state[0] if _chain_of(opt_state, cls) else None


def scalar_step(tx, opt_state, node, moments):
    """``(hyperparams, before, after)`` for one update of ``opt_state`` without touching the
    moments (``node``'s fields named in ``moments``): ``tx`` runs on a copy whose moments are
    scalars (``before``), so counts, injected hyperparameters and schedules advance (``after``)
    exactly as optax's would. ``hyperparams`` (None unless injected) are the values this step
    uses.

    The copy's moments are one scalar leaf, not one per param: what the caller keeps from it
    (counts, hyperparameters) does not depend on the params' tree, and tracing the update over
    every param cost a tenth of a second or more in every step's trace (an 8-layer GPT: 0.27 s).
    A chain whose stateless part maps over a tree of its own (per-param factors) refuses the
    one-leaf tree; it then runs on scalars shaped like the params, as before.
    Callers replace the moments of ``before`` and ``after`` with their own."""
    try:
        return _scalar_step(tx, opt_state, node, moments, {"x": jnp.zeros((), jnp.float32)})
    except Exception:  # noqa: BLE001 - the params' own structure is needed: the full-tree copy below
        zeros = jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.float32), getattr(node, moments[0]))
        return _scalar_step(tx, opt_state, node, moments, zeros)


def _scalar_step(tx, opt_state, node, moments, zeros):
    before = replace_node(opt_state, node._replace(**{m: zeros for m in moments}))
    _, after = tx.update(zeros, before, zeros)
    return getattr(after, "hyperparams", None), before, after


def select_scalars(apply, after, before):
    """The scalars (counts, hyperparameters) of ``after`` where ``apply``, else ``before``'s."""
    return jax.tree_util.tree_map(lambda new, old: jnp.where(apply, same_memory_space(new, old), old), after, before)


def _zero(g):
    """A zero of ``g``'s dtype, typed in ``g``'s memory space (on the host too)."""
    return same_memory_space(jnp.zeros((), g.dtype), g)


def zero_unless(apply, g):
    """``g``, or zeros where ``apply`` is false."""
    return jnp.where(apply, g, _zero(g))


def known_flag(apply):
    """The step's flag as a Python bool where it is known while tracing (a pass's jitted leaf
    takes it as a static argument, since inside that jit every argument is traced), else None."""
    return None if isinstance(apply, Tracer) else bool(apply)


# |g| below this: g * g is a finite float32 (2**64 squared is 2**128, past float32's largest)
_SQUARE_FINITE = 2.0 ** 64


def gated_gradient(apply, g):
    """The gradient a gated pass multiplies by its step's coefficients (which are zero where the
    step is skipped). An applied float32 step's global norm (a float32 sum of the squares) was
    finite, so every ``g * g`` was too: this is ``g`` exactly. On a skipped step it is ``g`` with
    the elements whose squares are not finite (inf, nan, huge) zeroed, which a zero coefficient
    turns into exact zeros. Decided per element, not by a select on the step's flag: a select on
    a condition that is the same for every element is one LLVM unswitches, compiling each
    moment's loop twice (each gated Adam moment kernel was up to 3.8x the code of plain optax's).
    Other dtypes, and a flag known while tracing (bf16 without the overflow check applies
    every step, inf and nan included), keep :func:`zero_unless`."""
    if g.dtype != jnp.float32 or known_flag(apply) is not None:
        return zero_unless(apply, g)
    return jnp.where(jnp.abs(g) < _SQUARE_FINITE, g, _zero(g))


def unzip_leaves(like, out, i):
    """The ``i``-th of the tuples a leafwise map over ``like``'s structure returned, as a tree."""
    return jax.tree_util.tree_map(lambda _, o: o[i], like, out)


