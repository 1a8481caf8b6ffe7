"""Deprecated: moved to :mod:`zerojax.tools.autotune`; ``python -m zerojax.autotune`` still runs it."""
from zerojax._shim import moved

if __name__ == "__main__":
    import runpy

    runpy.run_module("zerojax.tools.autotune", run_name="__main__")
else:
    moved(__name__, "zerojax.tools.autotune", call="autotune")
