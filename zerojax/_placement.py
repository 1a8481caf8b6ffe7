"""Moving trees between the layouts a :class:`~zerojax._plan.ZeroPlan` decides.

The plan says where each leaf lives and how it is split (storage: padded, partitioned over the
data axis, in device or host memory); this module moves trees between that storage and the
layouts the step computes in:

    to_update / to_storage          partitioned, padded storage <-> the user's logical shapes
    opt_to_update / opt_to_storage  the same for an optimizer state (per-param leaves only)
    fetch / put_back                host-memory homes <-> device memory, inside jit
    params_logical / params_stored  stored params <-> leaves in the user's shapes
    share / merge, opt_share / opt_merge   the host and device sides of a split optimizer state
    pad / unpad                     one leaf along its split axis

Every function takes the plan first and reads only its decisions.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from zerojax._plan import DEVICE, LeafLayout, ZeroPlan

__all__ = ["fetch", "merge", "opt_merge", "opt_share", "opt_sides", "opt_to_storage", "opt_to_update", "pad",
           "params_logical", "params_stored", "put_back", "share", "to_storage", "to_update", "unpad"]


def pad(x, lay: LeafLayout):
    """One leaf padded along its split axis to the stored size."""
    if lay.pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[lay.axis] = (0, lay.pad)
    return jnp.pad(x, widths)


def unpad(x, lay: LeafLayout):
    """One stored leaf cut back to the user's shape."""
    if lay.pad == 0 or x.shape[lay.axis] == lay.shape[lay.axis]:
        return x
    return jax.lax.slice_in_dim(x, 0, lay.shape[lay.axis], axis=lay.axis)


# ------------------------------------------------ storage <-> update layout
def _to_update(plan: ZeroPlan, lay: Optional[LeafLayout], x):
    if x is None or lay is None or not plan.opt_partitioned(lay):
        return x
    # XLA splits the logical (unpadded) shape with the same tile size: no data moves
    return jax.lax.with_sharding_constraint(unpad(x, lay), plan.update_sharding(lay))


def _to_storage(plan: ZeroPlan, lay: Optional[LeafLayout], x):
    if x is None or lay is None or not plan.opt_partitioned(lay):
        return x
    return pad(x, lay)


def to_update(plan: ZeroPlan, tree):
    """Params-structured tree in partitioned storage (padded) -> logical update layout.

    The optimizer always sees the user's shapes, so per-leaf means (Adafactor, block RMS
    clipping) are exact even where storage is padded."""
    return plan.map(lambda lay, x: _to_update(plan, lay, x), tree)


def to_storage(plan: ZeroPlan, tree):
    """The inverse of :func:`to_update`."""
    return plan.map(lambda lay, x: _to_storage(plan, lay, x), tree)


def opt_to_update(plan: ZeroPlan, opt_state):
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    lays = plan.opt_leaf_layouts(opt_state, stored=True)
    return treedef.unflatten([_to_update(plan, lay, x) for lay, x in zip(lays, leaves)])


def opt_to_storage(plan: ZeroPlan, opt_state):
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    lays = plan.opt_leaf_layouts(opt_state, stored=False)
    return treedef.unflatten([_to_storage(plan, lay, x) for lay, x in zip(lays, leaves)])


# ------------------------------------------------------------- memory kinds
def fetch(tree, shardings):
    """Leaves stored in host memory -> device memory, same partitioning (inside jit)."""
    def one(x, s):
        if x is None or s.memory_kind in (None, DEVICE):
            return x
        return jax.device_put(x, s.with_memory_kind(DEVICE))
    return jax.tree_util.tree_map(one, tree, shardings, is_leaf=lambda x: x is None)


def put_back(tree, shardings):
    """Leaves whose home is host memory -> back to it (inside jit)."""
    def one(x, s):
        if x is None or s.memory_kind in (None, DEVICE):
            return x
        return jax.device_put(x, s)
    return jax.tree_util.tree_map(one, tree, shardings, is_leaf=lambda x: x is None)


def params_logical(plan: ZeroPlan, params) -> list:
    """Stored params -> their leaves in the user's (unpadded) shapes, in flatten order."""
    return [unpad(x, lay) if lay.params_partitioned else x
            for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(params))]


def params_stored(plan: ZeroPlan, leaves):
    """Leaves in the user's shapes (flatten order) -> the params tree in storage layout."""
    return plan.treedef.unflatten([pad(x, lay) if lay.params_partitioned else x
                                   for lay, x in zip(plan.leaves, leaves)])


# ------------------------------------------------ the two sides of a split optimizer state
def share(plan: ZeroPlan, tree, host: bool):
    """A params-structured tree with the other side's leaves replaced by None (optax's idiom
    for params it does not update)."""
    return plan.map(lambda lay, x: x if plan.opt_on_host(lay) == host else None, tree)


def merge(plan: ZeroPlan, host_tree, device_tree):
    """The two sides of :func:`share` put back together."""
    return plan.map(lambda lay, h, d: h if plan.opt_on_host(lay) else d, host_tree, device_tree)


def opt_sides(plan: ZeroPlan, opt_state) -> list:
    """Per optimizer leaf: True (host side), False (device side) or None (no param owns it)."""
    return [None if lay is None else plan.opt_on_host(lay) for lay in plan.opt_leaf_owners(opt_state)]


def opt_share(plan: ZeroPlan, opt_state, host: bool):
    """``opt_state`` with the other side's per-param leaves replaced by None; the leaves no
    param owns (counts, schedule state) are kept on both sides."""
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    sides = opt_sides(plan, opt_state)
    return treedef.unflatten([x if side is None or side == host else None for x, side in zip(leaves, sides)])


def opt_merge(plan: ZeroPlan, like, host_state, device_state):
    """The two sides of :func:`opt_share` of ``like`` put back together; the leaves no param
    owns come from the host side (their home is host memory)."""
    treedef = jax.tree_util.tree_structure(like)
    sides = opt_sides(plan, like)
    h, d = treedef.flatten_up_to(host_state), treedef.flatten_up_to(device_state)
    return treedef.unflatten([dx if side is False else hx for hx, dx, side in zip(h, d, sides)])
