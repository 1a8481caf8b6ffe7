"""Deprecated: moved to :mod:`zerojax.tools.estimate`."""
from zerojax._shim import moved

moved(__name__, "zerojax.tools.estimate", call="estimate")
