"""Deprecated: moved to :mod:`zerojax.tools.report`."""
from zerojax._shim import moved

moved(__name__, "zerojax.tools.report")
