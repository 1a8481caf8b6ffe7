"""Deprecated: moved to :mod:`zerojax.tools.visualize`."""
from zerojax._shim import moved

moved(__name__, "zerojax.tools.visualize", call="visualize")
