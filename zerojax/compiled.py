"""Deprecated: moved to :mod:`zerojax.tools.compiled`."""
from zerojax._shim import moved

moved(__name__, "zerojax.tools.compiled")
