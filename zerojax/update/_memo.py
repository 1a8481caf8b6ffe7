"""Remembering what was learnt of an optax transformation, per transformation.

``optax.adamw(1e-3)`` made twice is two objects (each call makes new closures) built by the same
code from equal values; :func:`transformation_key` gives both one hashable key, so what zerojax
learns of one (its recognition in :mod:`zerojax.update._recognize`, a gated pass's check on the
probes) serves the other. :func:`per_transformation` remembers a function of a transformation
under that key (or by identity where there is none).
"""
from __future__ import annotations

import collections
import enum
import functools
import sys
import types
from typing import Optional

import jax
import numpy as np

from zerojax._compat import Tracer

__all__ = ["per_transformation", "transformation_key"]

_ATOMS = (type(None), bool, int, float, complex, str, bytes, type, np.dtype, np.generic, enum.Enum)
_SMALL = 4096  # elements: an array in a closure (a mask, a table of rates) is read up to this size


def transformation_key(tx):
    """A hashable key that two transformations share when the same code built them from equal
    values: ``optax.adamw(1e-3)`` made twice (each call makes new closures, so the two are
    different objects). What zerojax learns of one (its recognition, a gated pass's check on the
    probes) then serves the other. The key reads the closures' module, code, captured values and
    defaults, and plain objects' fields, recursively; it raises TypeError where it cannot read
    something (a traced or large array, an object without fields, a closure reaching itself),
    and the caller then remembers ``tx`` itself, by identity."""
    return _structure(tx, set())


def _structure(obj, seen: set):
    if isinstance(obj, _ATOMS):
        return type(obj), obj
    if id(obj) in seen:
        raise TypeError("a closure that reaches itself")
    seen = seen | {id(obj)}
    if isinstance(obj, (tuple, list)):  # a NamedTuple (GradientTransformation, a state) keeps its type
        return type(obj), tuple(_structure(o, seen) for o in obj)
    if isinstance(obj, dict):
        return type(obj), tuple((_structure(k, seen), _structure(v, seen)) for k, v in obj.items())
    if isinstance(obj, functools.partial):
        return (functools.partial, _structure(obj.func, seen), _structure(obj.args, seen),
                _structure(obj.keywords, seen))
    if isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(_structure(cell.cell_contents, seen))
            except ValueError:  # a cell not yet filled
                cells.append(None)
        return (obj.__module__, obj.__code__, tuple(cells), _structure(obj.__defaults__, seen),
                _structure(obj.__kwdefaults__, seen))
    if isinstance(obj, (np.ndarray, jax.Array)):
        if isinstance(obj, Tracer) or obj.size > _SMALL or obj.dtype == object:
            raise TypeError("a traced or large array")
        obj = np.asarray(obj)
        return np.ndarray, obj.shape, obj.dtype.str, obj.tobytes()
    # a module-level function or object (jnp.sqrt, a jitted helper): the name it is found under
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str) and sys.modules.get(module) is not None:
        found = sys.modules[module]
        for part in name.split("."):
            found = getattr(found, part, None)
        if found is obj:
            return "global", module, name
    if isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, types.ModuleType):
        return type(obj), _structure(vars(obj), seen)  # a plain object (optax's WrappedSchedule): its fields
    raise TypeError(f"cannot key a {type(obj).__name__}")


class _Remembered:
    """What was learnt per transformation, the last 256: keyed by :func:`transformation_key`,
    or by the transformation itself where it has none (an unhashable one is probed each time).
    A caller takes :meth:`key` once and reads and writes under it."""

    def __init__(self, size: int = 256):
        self._found, self._size = collections.OrderedDict(), size

    @staticmethod
    def key(tx):
        try:
            return "structure", transformation_key(tx)
        except (TypeError, ValueError):
            return "identity", tx

    def get(self, key):
        """``(known, what was remembered)``."""
        try:
            if key in self._found:
                self._found.move_to_end(key)
                return True, self._found[key]
        except TypeError:
            pass
        return False, None

    def put(self, key, found) -> None:
        try:
            self._found[key] = found
        except TypeError:
            return
        while len(self._found) > self._size:
            self._found.popitem(last=False)

    def cache_clear(self) -> None:
        self._found.clear()


def per_transformation(fn, memory: Optional[_Remembered] = None):
    """``fn(tx)`` remembered per transformation, in ``memory`` (a :class:`_Remembered` of its own
    by default)."""
    memory = _Remembered() if memory is None else memory

    @functools.wraps(fn)
    def remembered(tx):
        key = memory.key(tx)
        known, found = memory.get(key)
        if not known:
            found = fn(tx)
            memory.put(key, found)
        return found

    remembered.cache_clear = memory.cache_clear
    return remembered
