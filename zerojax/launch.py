"""Deprecated: moved to :mod:`zerojax.runtime.launch`; ``python -m zerojax.launch`` still runs it."""
from zerojax._shim import moved

if __name__ == "__main__":
    import runpy

    runpy.run_module("zerojax.runtime.launch", run_name="__main__")
else:
    moved(__name__, "zerojax.runtime.launch")
