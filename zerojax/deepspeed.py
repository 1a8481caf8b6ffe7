"""Deprecated: moved to :mod:`zerojax.config`."""
from zerojax._shim import moved

moved(__name__, "zerojax.config")
