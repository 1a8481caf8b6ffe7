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
(:func:`adam_recipe`): ``optax.adam`` / ``optax.adamw`` with constant settings (read off
by probing the transformation), and ``optax.inject_hyperparams`` of them, which is what
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
import numpy as np
import optax

from zerojax._compat import same_memory_space

__all__ = ["AdamRecipe", "adam_node", "adam_recipe", "find_node", "gated_adam", "replace_adam_node", "scalar_step",
           "select_scalars", "step_hyperparams", "zero_unless", "agrees_with_optax"]

_HP_KEYS = ("learning_rate", "b1", "b2", "eps", "weight_decay")


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


def adam_node(opt_state) -> Optional[optax.ScaleByAdamState]:
    """The ScaleByAdamState of a ``chain(scale_by_adam, <stateless>...)`` state, bare or inside
    ``optax.inject_hyperparams`` (with Adam's settings injected); None for anything else."""
    return find_node(opt_state, optax.ScaleByAdamState, _HP_KEYS)


def replace_adam_node(opt_state, node):
    """``opt_state`` with the state of its chain's first transformation replaced by ``node``."""
    if getattr(opt_state, "hyperparams", None) is not None:
        return opt_state._replace(inner_state=(node,) + tuple(opt_state.inner_state[1:]))
    return (node,) + tuple(opt_state[1:])


def scalar_step(tx, opt_state, node, moments):
    """``(hyperparams, before, after)`` for one update of ``opt_state`` without touching the
    moments (``node``'s fields named in ``moments``): ``tx`` runs on a copy whose moments are
    scalars (``before``), so counts, injected hyperparameters and schedules advance (``after``)
    exactly as optax's would. ``hyperparams`` (None unless injected) are the values this step
    uses."""
    zeros = jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.float32), getattr(node, moments[0]))
    before = replace_adam_node(opt_state, node._replace(**{m: zeros for m in moments}))
    _, after = tx.update(zeros, before, zeros)
    return getattr(after, "hyperparams", None), before, after


def step_hyperparams(tx, opt_state):
    """:func:`scalar_step` of an Adam state."""
    return scalar_step(tx, opt_state, adam_node(opt_state), ("mu", "nu"))


def select_scalars(apply, after, before):
    """The scalars (counts, hyperparameters) of ``after`` where ``apply``, else ``before``'s."""
    return jax.tree_util.tree_map(lambda new, old: jnp.where(apply, same_memory_space(new, old), old), after, before)


def zero_unless(apply, g):
    """``g``, or zeros where ``apply`` is false (typed in ``g``'s memory space: on the host too)."""
    return jnp.where(apply, g, same_memory_space(jnp.zeros((), g.dtype), g))


@dataclass(frozen=True)
class AdamRecipe:
    """How to run ``tx`` as a gated pass: its settings are ``constants`` or, when None, read from
    the injected hyperparameters of the state each step."""
    constants: Optional[dict] = None


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

    def leaf(p, g, m, v):
        g = zero_unless(apply, g)
        m = take1 * g + keep1 * m
        v = take2 * (g ** 2) + keep2 * v
        u = (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype) + eps_root) + eps)
        u = u + wd * p
        return (p + step * u).astype(p.dtype), m, v

    out = jax.tree_util.tree_map(leaf, params, grads, node.mu, node.nu)
    pick = lambda i: jax.tree_util.tree_map(lambda _, o: o[i], params, out)  # noqa: E731
    # the scalars (counts, hyperparameters) advance only on an applied step
    scalars = select_scalars(apply, after, before)
    return pick(0), replace_adam_node(scalars, adam_node(scalars)._replace(mu=pick(1), nu=pick(2)))


# ------------------------------------------------------------------ recognising


def _probe_constants(tx) -> Optional[dict]:
    """Adam's settings of a bare chain, read off three probe elements after one update from zero
    moments: there ``u = -lr (m̂ / (sqrt(v̂) + eps) + wd p)`` with ``m̂``, ``v̂`` computed here in
    fp32 as optax computes them (bias correction rounding included)."""
    t, big = 1e-8, 1e3
    p = {"x": jnp.array([0.0, big, 0.0], jnp.float32)}
    g = {"x": jnp.array([1.0, 1.0, t], jnp.float32)}
    u, after = tx.update(g, tx.init(p), p)
    node = adam_node(after)
    b1 = 1.0 - float(node.mu["x"][0])
    b2 = 1.0 - float(node.nu["x"][0])
    one = jnp.int32(1)
    mhat = np.asarray(node.mu["x"] / (1 - b1 ** one).astype(jnp.float32), np.float64)
    root = np.sqrt(np.asarray(node.nu["x"] / (1 - b2 ** one).astype(jnp.float32), np.float64))
    u = np.asarray(u["x"], np.float64)
    if not np.all(np.isfinite(u)) or u[0] == 0 or u[2] == 0:
        return None
    r = u[2] / u[0]
    eps = (mhat[2] * root[0] - r * mhat[0] * root[2]) / (r * mhat[0] - mhat[2])
    lr = -u[0] / (mhat[0] / (root[0] + eps))
    wd = (-u[1] / lr - mhat[1] / (root[1] + eps)) / big
    # optax multiplies by these as fp32: the nearest fp32 is the user's number when the probe is
    # within half an ulp of it (a weight decay that is not there reads as ~1e-19)
    snap = lambda x: 0.0 if abs(x) < 1e-15 else float(np.float32(x))  # noqa: E731
    return {"learning_rate": snap(lr), "b1": b1, "b2": b2, "eps": snap(eps), "weight_decay": snap(wd)}


def _probes(shape=(6,)):
    """Probe states: ordinary values after four updates, and, at the first update, moments whose
    update is huge (a global clip or a trust ratio downstream of Adam shows)."""
    rng = np.random.default_rng(0)
    # params small next to the step, so an lr off by 1e-6 shows in the new params
    ordinary = [rng.normal(size=shape) * 1e-5, rng.normal(size=shape), rng.normal(size=shape) * 0.1,
                rng.random(shape) * 0.01 + 1e-4]
    extreme = [rng.normal(size=shape) * 1e-5, rng.normal(size=shape) * 1e-10, np.full(shape, 1.0),
               np.full(shape, 1e-20)]
    for count, values in ((4, ordinary), (0, extreme)):
        yield count, *(jnp.asarray(a, jnp.float32) for a in values)


def _verified(recipe: AdamRecipe, tx) -> bool:
    for count, p, g, m, v in _probes():
        params, grads = {"x": p}, {"x": g}
        state = tx.init(params)
        node = adam_node(state)
        if node is None or node.mu["x"].dtype != jnp.float32 or node.nu["x"].dtype != jnp.float32:
            return False
        state = replace_adam_node(state, node._replace(count=jnp.asarray(count, node.count.dtype), mu={"x": m},
                                                   nu={"x": v}))
        if hasattr(state, "count") and hasattr(state, "hyperparams"):
            state = state._replace(count=jnp.asarray(count, state.count.dtype))
        if not agrees_with_optax(tx, lambda *a: gated_adam(recipe, tx, *a), params, grads, state):
            return False
    return True


def agrees_with_optax(tx, gated, params, grads, state) -> bool:
    """Whether ``gated(params, grads, state, True)`` gives the params and state (every leaf) that
    ``tx.update`` and ``optax.apply_updates`` give, to 1e-6."""
    u, want = tx.update(grads, state, params)
    got_p, got = gated(params, grads, state, jnp.asarray(True))
    pairs = list(zip(jax.tree_util.tree_leaves((optax.apply_updates(params, u), want)),
                     jax.tree_util.tree_leaves((got_p, got))))
    if len(pairs) != len(jax.tree_util.tree_leaves((params, want))):
        return False
    for a, b in pairs:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-6, atol=0):
            return False
    return True


def adam_recipe(tx) -> Optional[AdamRecipe]:
    """An :class:`AdamRecipe` when ``tx`` is an Adam/AdamW this module reproduces exactly (checked
    on probes), else None (the caller keeps the general path). Remembered per transformation."""
    try:
        return _cached_recipe(tx)
    except TypeError:  # unhashable transformation: probe it again
        return _recipe(tx)


@functools.lru_cache(maxsize=256)
def _cached_recipe(tx) -> Optional[AdamRecipe]:
    return _recipe(tx)


def _recipe(tx) -> Optional[AdamRecipe]:
    try:
        state = tx.init({"x": jnp.zeros((6,), jnp.float32)})
        if adam_node(state) is None:
            return None
        injected = getattr(state, "hyperparams", None) is not None
        recipe = AdamRecipe(None if injected else _probe_constants(tx))
        if not injected and recipe.constants is None:
            return None
        return recipe if _verified(recipe, tx) else None
    except Exception:  # noqa: BLE001 - an optimizer the probes cannot drive keeps the general path
        return None
