"""Host buffers that jax owns and lends to numpy, so XLA can update them in place.

``host_zeros(n, dtype)`` is a zeroed, writable, flat numpy array whose memory is a jax array
on the CPU backend; ``HostAdamW``'s compiled step donates that jax array and XLA writes the
result into the same memory, which the numpy views keep seeing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._errors import ConfigError

__all__ = ["HostBuffer", "cpu_device", "host_buffer_of", "host_or_numpy", "host_zeros", "release", "storage_kind"]

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(jnp.bfloat16)
U16 = np.dtype(np.uint16)  # raw bfloat16 bits


def storage_kind(dtype) -> str | None:
    dt = np.dtype(dtype)
    return {F32: "f32", BF16: "bf16", U16: "bf16", F16: "f16"}.get(dt)


class HostBuffer:
    """Owns one jax array on the CPU backend and lends its memory to numpy.

    numpy reads the address through ``__array_interface__``, and every numpy array
    viewing the memory keeps this object (hence the jax array) alive through its
    ``base`` chain. The compiled step donates ``array`` and keeps the result, which XLA
    wrote into the same memory; ``ptr`` never changes. 16-bit buffers are uint16 to
    XLA (``kind`` says which format the bits hold): XLA:CPU would otherwise widen a
    whole bfloat16 buffer to fp32 around every block update.
    """

    def __init__(self, array: jax.Array, kind: str):
        self.array, self.kind = array, kind
        self.ptr = array.unsafe_buffer_pointer()
        self.nbytes = int(array.nbytes)
        self.__array_interface__ = {"data": (self.ptr, False), "shape": tuple(array.shape),
                                    "typestr": np.dtype(array.dtype).str, "version": 3}


def cpu_device():
    return jax.devices("cpu")[0]


def host_zeros(n: int, dtype: Any = np.float32) -> np.ndarray:
    """A zeroed, writable, flat numpy array whose memory jax owns (on the CPU backend).

    ``HostAdamW.step`` updates params, m, v (and ``out16``) allocated here with its
    compiled path, in place; to numpy they are ordinary arrays (slices, views, pickling
    and ``np.copyto`` work as usual). The memory lives as long as any array viewing it.
    Only the optimizer's compiled step hands the underlying jax array to XLA; do not
    write into the buffer while a ``step`` on it is running.

    ``dtype``: float32, bfloat16, float16 or uint16 (bfloat16 bits). Works when the
    default backend is a GPU: the buffer is placed on ``jax.devices("cpu")[0]``.
    """
    dt = np.dtype(dtype)
    kind = storage_kind(dt)
    if kind is None:
        raise ConfigError(f"host_zeros: dtype {dt} is not supported; use float32, bfloat16, "
                        "float16 or uint16.")
    # jnp.zeros, not device_put of a numpy array: device_put may wrap the numpy memory
    # without copying, and XLA does not write in place into memory it does not own.
    array = jnp.zeros((int(n),), F32 if kind == "f32" else U16, device=cpu_device())
    return np.asarray(HostBuffer(array, kind)).view(dt)


def host_buffer_of(a: np.ndarray) -> HostBuffer | None:
    """The ``HostBuffer`` whose whole memory ``a`` covers exactly, if any."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, HostBuffer) and a.ctypes.data == base.ptr and a.nbytes == base.nbytes:
        return base
    return None


def host_or_numpy(n: int, dtype) -> np.ndarray:
    if storage_kind(dtype) is not None and np.dtype(dtype) != U16:
        try:
            return host_zeros(n, dtype)
        except RuntimeError:  # no CPU backend in this process
            pass
    return np.zeros(n, dtype)


def _libc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return None


_TRIM = _libc_trim()


def release() -> None:
    """Hand the pages of freed host buffers back to the system. glibc serves allocations below
    its mmap threshold (which grows to 32 MiB once such a buffer is freed) from heaps it keeps,
    so without this the process's resident size keeps every buffer a loop of reads ever made."""
    if _TRIM is not None:
        _TRIM(0)
