"""Block-wise symmetric quantization of rows of values, and the byte payload that carries them.

A row of ``c`` values is cut into ``nb = ceil(c / b)`` blocks of ``b = min(block, c)`` values
(the last block padded with zeros). Each block keeps ``amax``, the largest magnitude in it, as
float32; its values become integers ``q = round(x * qmax / amax)`` in ``[-qmax, qmax]``
(``qmax`` = 127 for 8 bits, 7 for 4 bits) and come back as ``q * scale`` with
``scale = amax / qmax``, so every value is off by at most ``scale / 2``:

    |x - dequantize(quantize(x))| <= max|block| / (2 * qmax)

A block of zeros keeps ``amax = 0`` and comes back as exact zeros (as does every zero in any
block). A block holding inf or nan keeps a non-finite ``amax`` and comes back non-finite as a
whole, so an overflow survives the trip and is still seen by the step's finiteness check.

The payload of a row is one ``uint8`` vector: the integers (one byte each at 8 bits, two per
byte at 4 bits) followed by the block maxima, four bytes each. A collective moves it as it is;
:func:`decode` reverses :func:`encode` on any stack of rows (leading dims are kept).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax._errors import ConfigError

BITS = (4, 8)


def qmax(bits: int) -> int:
    """The largest integer magnitude of ``bits``-bit symmetric quantization (127 or 7)."""
    if bits not in BITS:
        raise ConfigError(f"quantization bits must be one of {BITS}, got {bits!r}")
    return 2 ** (bits - 1) - 1


def blocks(c: int, block: int) -> tuple:
    """(number of blocks, values per block) for a row of ``c`` values."""
    b = max(1, min(int(block), int(c)))
    return -(-int(c) // b), b


def _int_bytes(c: int, bits: int, block: int) -> int:
    nb, b = blocks(c, block)
    return nb * b if bits == 8 else -(-(nb * b) // 2)


def payload_size(c: int, bits: int, block: int) -> int:
    """Bytes of one row's payload: the integers, then four bytes per block maximum."""
    return _int_bytes(c, bits, block) + 4 * blocks(c, block)[0]


def quantize(x, bits: int, block: int):
    """Rows ``x[..., c]`` -> (``q`` int8[..., nb, b], ``amax`` float32[..., nb])."""
    c = x.shape[-1]
    nb, b = blocks(c, block)
    x = x.astype(jnp.float32)
    if nb * b != c:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * b - c)])
    x = x.reshape(x.shape[:-1] + (nb, b))
    amax = jnp.max(jnp.abs(x), axis=-1)  # inf or nan where the block holds one
    usable = jnp.isfinite(amax) & (amax > 0)
    ratio = jnp.where(usable, qmax(bits) / jnp.where(usable, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * ratio[..., None]), -qmax(bits), qmax(bits))
    q = jnp.where(usable[..., None], q, 0.0)
    return q.astype(jnp.int8), amax


def dequantize(q, amax, bits: int, c: int, dtype=jnp.float32):
    """(``q`` [..., nb, b], ``amax`` [..., nb]) -> rows [..., c] in ``dtype``."""
    scale = amax / qmax(bits)  # non-finite amax: the whole block comes back non-finite
    x = q.astype(jnp.float32) * scale[..., None]
    x = x.reshape(x.shape[:-2] + (-1,))[..., :c]
    return x.astype(dtype)


def _pack4(q):
    """int8 values in [-7, 7] [..., e] -> uint8 [..., ceil(e / 2)], two values per byte."""
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)  # 1..15
    if u.shape[-1] % 2:
        u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, 1)], constant_values=8)
    u = u.reshape(u.shape[:-1] + (-1, 2))
    return u[..., 0] | (u[..., 1] << 4)


def _unpack4(p, e: int):
    """uint8 [..., ceil(e / 2)] -> int8 [..., e]."""
    lo, hi = p & 15, p >> 4
    u = jnp.stack([lo, hi], axis=-1).reshape(p.shape[:-1] + (-1,))[..., :e]
    return (u.astype(jnp.int32) - 8).astype(jnp.int8)


def encode(x, bits: int, block: int):
    """Rows ``x[..., c]`` -> their payload uint8[..., payload_size(c, bits, block)]."""
    q, amax = quantize(x, bits, block)
    flat = q.reshape(q.shape[:-2] + (-1,))
    ints = jax.lax.bitcast_convert_type(flat, jnp.uint8) if bits == 8 else _pack4(flat)
    scales = jax.lax.bitcast_convert_type(amax, jnp.uint8)  # [..., nb, 4]
    return jnp.concatenate([ints, scales.reshape(scales.shape[:-2] + (-1,))], axis=-1)


def decode(payload, bits: int, block: int, c: int, dtype=jnp.float32):
    """A payload uint8[..., P] of rows of ``c`` values -> the rows [..., c] in ``dtype``."""
    nb, b = blocks(c, block)
    n_int = _int_bytes(c, bits, block)
    ints, scales = payload[..., :n_int], payload[..., n_int:]
    if bits == 8:
        q = jax.lax.bitcast_convert_type(ints, jnp.int8)
    else:
        q = _unpack4(ints, nb * b)
    q = q.reshape(q.shape[:-1] + (nb, b))
    amax = jax.lax.bitcast_convert_type(scales.reshape(scales.shape[:-1] + (nb, 4)), jnp.float32)
    return dequantize(q, amax, bits, c, dtype)


def wire_ratio(c: int, bits: int, block: int, itemsize: int) -> float:
    """Payload bytes of a row over the bytes of the same row in an ``itemsize``-byte dtype."""
    return payload_size(c, bits, block) / (c * itemsize) if c else 1.0


__all__ = ["BITS", "blocks", "decode", "dequantize", "encode", "payload_size", "qmax", "quantize", "wire_ratio"]

