"""Deprecated: moved to :mod:`zerojax.tools.planning`."""
from zerojax._shim import moved

moved(__name__, "zerojax.tools.planning")
