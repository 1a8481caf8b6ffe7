"""Deprecated: moved to :mod:`zerojax.kernels.fused_adam`."""
from zerojax._shim import moved

moved(__name__, "zerojax.kernels.fused_adam")
