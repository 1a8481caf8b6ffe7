"""Which group of a partitioned optimizer (``optax.partition``, ``optax.multi_transform``,
``optax.contrib.muon``) updates each leaf, read from the masks of its state: the plan keeps
each group's leaves together, and Muon's matrices apart from the leaves its Adam updates."""
from __future__ import annotations

from typing import Optional

import jax
import optax

__all__ = ["partition_groups"]


def _partition_node(state):
    """The first ``optax.partition`` / ``multi_transform`` state in ``state``, else None."""
    if isinstance(getattr(state, "inner_states", None), dict):
        return state
    children = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else ()
    for child in children:
        found = _partition_node(child)
        if found is not None:
            return found
    return None


def _masked_tree(state, treedef):
    """The first subtree of ``state`` with the params' structure (masked leaves as leaves)."""
    is_masked = lambda x: isinstance(x, optax.MaskedNode)
    if jax.tree_util.tree_structure(state, is_leaf=is_masked) == treedef:
        return state
    children = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else ()
    for child in children:
        found = _masked_tree(child, treedef)
        if found is not None:
            return found
    return None


def partition_groups(tx, params) -> Optional[list]:
    """For a partitioned optimizer (``optax.partition``, ``optax.multi_transform``,
    ``optax.contrib.muon``, injected or not): the label of the group updating each leaf of
    ``params`` (flatten order), read from the masks of its state; None for any other
    optimizer, or where a leaf's group cannot be read (a group with no per-leaf state)."""
    try:
        state = jax.eval_shape(tx.init, params)
    except Exception:  # noqa: BLE001 - an init that cannot run on shapes: no groups to show
        return None
    node = _partition_node(state)
    if node is None:
        return None
    treedef = jax.tree_util.tree_structure(params)
    labels = [None] * treedef.num_leaves
    for label, inner in node.inner_states.items():
        tree = _masked_tree(getattr(inner, "inner_state", inner), treedef)
        if tree is None:
            continue
        leaves = treedef.flatten_up_to(tree)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, optax.MaskedNode):
                labels[i] = label
    return labels if all(x is not None for x in labels) else None
