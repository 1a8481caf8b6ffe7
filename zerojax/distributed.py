"""Deprecated: moved to :mod:`zerojax.runtime.distributed`."""
from zerojax._shim import moved

moved(__name__, "zerojax.runtime.distributed")
