"""Deprecated: moved to :mod:`zerojax.offload.zenflow`."""
from zerojax._shim import moved

moved(__name__, "zerojax.offload.zenflow")
