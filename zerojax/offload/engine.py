"""Deprecated: moved to :mod:`zerojax.offload.nvme_step`."""
from zerojax._shim import moved

moved(__name__, "zerojax.offload.nvme_step")
