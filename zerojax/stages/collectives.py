"""Per-leaf collectives used inside bodies that are manual over the data axis.

Each function takes a local value and the leaf's ``LeafLayout``; padding makes every split
dimension divide the device count, and is added or removed here and nowhere else.
"""
from __future__ import annotations

import jax

from zerojax._compat import shard_map
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


def _data_specs(plan: ZeroPlan, partitioned):
    return plan.map(lambda lay: lay.data_spec(partitioned(lay), plan.data_axis))


def split_tree(plan: ZeroPlan, tree, select):
    """Whole leaves (identical on every device) -> each device's partition, for the leaves
    ``select(lay)`` picks; others pass through. Purely local: no communication, and unlike a
    sharding constraint it leaves the caller's whole arrays unconstrained."""
    axis, n = plan.data_axis, plan.n
    if not any(select(lay) for lay in plan.leaves):
        return tree

    def body(t):
        return plan.map(lambda lay, x: local_slice(x, lay, axis, n) if select(lay) else x, t)

    return shard_map(body, plan.mesh, in_specs=(_data_specs(plan, lambda lay: False),),
                     out_specs=_data_specs(plan, select), manual_axes={axis})(tree)


def gather_tree(plan: ZeroPlan, tree, select, dtype=None):
    """Partitions -> whole leaves on every device (one all-gather each, in ``dtype`` when
    given, so 16-bit params travel in 16 bits) for the leaves ``select(lay)`` picks."""
    axis = plan.data_axis

    def cast(x):
        return x if dtype is None else x.astype(dtype)

    def body(t):
        return plan.map(lambda lay, x: gather(cast(x), lay, axis) if select(lay) else cast(x), t)

    return shard_map(body, plan.mesh, in_specs=(_data_specs(plan, select),),
                     out_specs=_data_specs(plan, lambda lay: False), manual_axes={axis})(tree)
