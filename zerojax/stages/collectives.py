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


def _map_selected(plan: ZeroPlan, tree, select, body, in_partitioned: bool, out_partitioned: bool):
    """Run ``body(lay, local)`` in a data-manual region on the leaves ``select`` picks; other
    leaves never enter it (so their own layouts are left exactly as they are)."""
    axis = plan.data_axis
    lays = plan.leaves
    leaves = plan.treedef.flatten_up_to(tree)
    picked = [i for i, lay in enumerate(lays) if select(lay)]
    if not picked:
        return tree

    def spec(lay, partitioned):
        return lay.data_spec(partitioned, axis)

    def run(xs):
        return [body(lays[i], x) for i, x in zip(picked, xs)]

    out = shard_map(run, plan.mesh, in_specs=([spec(lays[i], in_partitioned) for i in picked],),
                    out_specs=[spec(lays[i], out_partitioned) for i in picked],
                    manual_axes={axis})([leaves[i] for i in picked])
    for i, x in zip(picked, out):
        leaves[i] = x
    return plan.treedef.unflatten(leaves)


def split_tree(plan: ZeroPlan, tree, select):
    """Whole leaves (identical on every device) -> each device's partition, for the leaves
    ``select(lay)`` picks; others pass through. Purely local: no communication, and unlike a
    sharding constraint it leaves the caller's whole arrays unconstrained."""
    axis, n = plan.data_axis, plan.n
    return _map_selected(plan, tree, select, lambda lay, x: local_slice(x, lay, axis, n), False, True)


def gather_tree(plan: ZeroPlan, tree, select, dtype=None):
    """Partitions -> whole leaves on every device (one all-gather each, in ``dtype`` when
    given, so 16-bit params travel in 16 bits) for the leaves ``select(lay)`` picks; the
    others are only cast."""
    axis = plan.data_axis
    if dtype is not None:
        tree = plan.map(lambda lay, x: x if select(lay) else x.astype(dtype), tree)
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    return _map_selected(plan, tree, select, lambda lay, x: gather(cast(x), lay, axis), True, False)
