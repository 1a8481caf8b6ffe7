"""Params or an init function? One rule for every entry point that takes either
(``shard_train_state``, ``abstract_train_state``, ``zj.estimate``, ``zj.initialize``).

The rule, in order:

1. ``zj.init_fn(f)``: an init function, whatever ``f`` is.
2. A plain Python function, a bound method, a ``functools.partial`` (``jax.tree_util.Partial``
   included), a builtin: an init function.
3. A pytree whose leaves are all arrays (``jax.Array``, numpy arrays, ``ShapeDtypeStruct``):
   params, even when it is callable. Equinox modules are callable pytrees: ``eqx.nn.Linear(2, 4)``
   and the array half of ``eqx.partition(model, eqx.is_array)`` are params, never called.
4. Any other callable without array leaves (a jitted function, a callable object): an init function.
5. Anything else, a pytree with a leaf that is not an array (a whole Equinox model holding its
   activation functions or a dropout rate), is a ConfigError naming the first such leaf.

Deciding by ``callable(...)`` alone would call an Equinox model on the PRNG key and take its
output for the params.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import jax

from zerojax._errors import ConfigError
from zerojax._plan import path_str

__all__ = ["InitFn", "check_params", "init_fn", "split_params_or_init"]

_FUNCTION_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType,
                   functools.partial)

_NOT_AN_ARRAY = """{where}: param {name!r} is a {kind}, not an array (the leaf at {path}). zerojax trains a pytree of arrays
(params) or calls an init function; a tree holding other leaves (a whole Equinox model, with its
activation functions, dropout rates or flags) is neither. Split the arrays off and rebuild the
model inside the loss:

    params, static = eqx.partition(model, eqx.is_array)     # or eqx.filter(model, eqx.is_array)
    state = zj.shard_train_state(params, tx, mesh=mesh, config=config)
    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        ...

An init function that zerojax should call is passed as a plain function or wrapped: zj.init_fn(f)."""


class InitFn:
    """An init function marked as one: ``zj.init_fn(f)``; calling it calls ``f(rng)``."""

    def __init__(self, fn: Callable[[jax.Array], Any]):
        if not callable(fn):
            raise ConfigError(f"zj.init_fn expects a function rng -> params, got a {type(fn).__name__}")
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, rng):
        return self.fn(rng)

    def __repr__(self) -> str:
        return f"zj.init_fn({self.fn!r})"


def init_fn(fn: Callable[[jax.Array], Any]) -> InitFn:
    """Mark ``fn(rng) -> params`` as an init function, so zerojax calls it even when it is a
    pytree (an Equinox module's method, a callable pytree holding arrays).

        state = zj.shard_train_state(zj.init_fn(make_params), optax.adam(1e-3), mesh=mesh)
    """
    return fn if isinstance(fn, InitFn) else InitFn(fn)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _first_non_array(tree):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_array(leaf):
            return path, leaf
    return None


def check_params(tree, where: str) -> None:
    """Raise the ConfigError of rule 5 when a leaf of ``tree`` is not an array."""
    bad = _first_non_array(tree)
    if bad is None:
        return
    path, leaf = bad
    kind = "function" if callable(leaf) else f"{type(leaf).__name__} ({leaf!r})"
    raise ConfigError(_NOT_AN_ARRAY.format(where=where, name=path_str(path), kind=kind,
                                           path=jax.tree_util.keystr(path) or "the root"))


def split_params_or_init(params_or_init, where: str = "params_or_init") -> tuple[Optional[Callable], Any]:
    """(init function, None) or (None, params) for ``params_or_init`` by the module's rule."""
    if isinstance(params_or_init, InitFn):
        return params_or_init.fn, None
    if isinstance(params_or_init, _FUNCTION_TYPES):
        return params_or_init, None
    leaves = jax.tree_util.tree_leaves(params_or_init)
    if callable(params_or_init) and not any(_is_array(x) for x in leaves):
        return params_or_init, None
    check_params(params_or_init, where)
    return None, params_or_init


def abstract_params(params_or_init, rng=None, where: str = "params_or_init"):
    """The params' shapes and dtypes: ``jax.eval_shape`` of the init function, or the params
    themselves; either way checked to be a tree of arrays."""
    fn, params = split_params_or_init(params_or_init, where)
    if fn is None:
        return params

    def arrays_only(key):  # checked while traced: eval_shape cannot return a function leaf
        out = fn(key)
        check_params(out, f"{where} (the tree the init function returned)")
        return out

    return jax.eval_shape(arrays_only, jax.random.PRNGKey(0) if rng is None else rng)
