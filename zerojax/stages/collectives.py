"""Per-leaf collectives used inside bodies that are manual over the data axis.

Each function takes a local value and the leaf's ``LeafLayout``; padding makes every split
dimension divide the device count, and is added or removed here and nowhere else.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.plan import LeafLayout, ZeroPlan


def local_shape(lay: LeafLayout, n: int):
    """Shape of one device's shard of the partitioned storage of ``lay``."""
    s = list(lay.storage_shape)
    s[lay.axis] //= n
    return tuple(s)


def gather(x, lay: LeafLayout, axis_name: str):
    """Local shard -> the whole (unpadded) leaf on every device: one all-gather."""
    full = jax.lax.all_gather(x, axis_name, axis=lay.axis, tiled=True)
    return ZeroPlan.unpad(full, lay)


def reduce_scatter(g, lay: LeafLayout, axis_name: str):
    """Whole local gradient -> this device's shard of the sum over devices: one reduce-scatter."""
    g = ZeroPlan.pad(g, lay)
    return jax.lax.psum_scatter(g, axis_name, scatter_dimension=lay.axis, tiled=True)


def local_slice(x, lay: LeafLayout, axis_name: str, n: int):
    """Whole leaf (same on every device) -> this device's shard; no communication."""
    x = ZeroPlan.pad(x, lay)
    chunk = x.shape[lay.axis] // n
    start = jax.lax.axis_index(axis_name) * chunk
    return jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=lay.axis)


def all_reduce(g, axis_name: str):
    return jax.lax.psum(g, axis_name)
