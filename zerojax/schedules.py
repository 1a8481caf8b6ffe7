"""Deprecated: moved to :mod:`zerojax.config.schedules`."""
from zerojax._shim import moved

moved(__name__, "zerojax.config.schedules")
