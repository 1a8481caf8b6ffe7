"""Old module paths kept working after the package was laid out by data flow.

A moved module leaves a two-line file at its old path::

    from zerojax._shim import moved
    moved(__name__, "zerojax.tools.estimate")

Importing the old path warns once (DeprecationWarning naming the new path) and every
attribute is read from the new module. Where the package also exports a function of the
module's old name (``zj.estimate``, ``zj.visualize``, ``zj.autotune``), the old module object
stays callable as that function, so ``import zerojax.estimate`` cannot shadow it.
"""
from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Optional

__all__ = ["moved"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return getattr(self, "__call_target__")(*args, **kwargs)


def moved(old: str, new: str, call: Optional[str] = None, stacklevel: int = 3) -> None:
    """Make module ``old`` (the caller, being imported) an alias of module ``new``."""
    warnings.warn(f"{old} has moved to {new}; import {new} instead (the old path will be removed)",
                  DeprecationWarning, stacklevel=stacklevel)
    target = importlib.import_module(new)
    shim = sys.modules[old]
    shim.__getattr__ = lambda name: getattr(target, name)
    shim.__dir__ = lambda: dir(target)
    shim.__all__ = list(getattr(target, "__all__", [n for n in vars(target) if not n.startswith("_")]))
    shim.__doc__ = f"Deprecated alias of :mod:`{new}`."
    if call is not None:
        shim.__class__ = _CallableModule
        shim.__call_target__ = getattr(target, call)
