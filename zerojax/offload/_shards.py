"""ShardLayout: this process's part of every leaf, packed into one flat host buffer.

On several processes each keeps the optimizer state of its own devices' partitions (as each of
DeepSpeed's ranks keeps its own partition on its own node's drive). The state is laid out in the
plan's update layout (``plan.master_shardings``: a leaf split over the data axis, padded, or a
small leaf whole on every device); this process's part of a leaf is the distinct shards its
devices hold, in the order of their position, each flattened::

    layout = ShardLayout.of(plan)
    layout.fill(flat, grads)                  # the local shards of global arrays -> flat
    params = layout.arrays(flat16, dtype)     # flat -> global arrays of the update layout

A leaf kept whole (not split) is in every process's buffer once: every process updates it alike.
The update is element-wise, so the layout is only a container.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

__all__ = ["ShardLayout"]


def _key(index: tuple, shape: tuple) -> tuple:
    """A shard's index as ((start, stop) per dimension), open ends closed with ``shape``."""
    return tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index))


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Per leaf: its global shape, sharding, and its distinct local shards as (index, offset, shape)."""

    shapes: tuple
    shardings: tuple
    parts: tuple  # per leaf: ((index key, offset, shard shape), ...), offsets into the flat buffer
    total: int

    @classmethod
    def of(cls, plan) -> "ShardLayout":
        """The plan's update layout (its fp32 master's shapes and shardings, in device memory)."""
        return cls.over([plan.master_shape(lay) for lay in plan.leaves],
                        plan.treedef.flatten_up_to(plan.master_shardings))

    @classmethod
    def over(cls, leaf_shapes, leaf_shardings) -> "ShardLayout":
        """This process's shards of leaves of these global shapes and shardings."""
        shapes, shardings, parts, off = [], [], [], 0
        for shape, s in zip(leaf_shapes, leaf_shardings):
            shape = tuple(shape)
            if s.memory_kind not in (None, "device"):
                s = s.with_memory_kind("device")
            seen, mine = set(), []
            for _, index in sorted(s.addressable_devices_indices_map(shape).items(),
                                   key=lambda kv: _key(kv[1], shape)):
                k = _key(index, shape)
                if k in seen:
                    continue
                seen.add(k)
                sub = tuple(b - a for a, b in k)
                mine.append((k, off, sub))
                off += math.prod(sub)
            shapes.append(shape)
            shardings.append(s)
            parts.append(tuple(mine))
        return cls(tuple(shapes), tuple(shardings), tuple(parts), off)

    def fill(self, flat: np.ndarray, leaves) -> np.ndarray:
        """The local shards of ``leaves`` (global arrays of this layout) into ``flat``."""
        for i, arr in enumerate(leaves):
            self.fill_leaf(flat, i, arr)
        return flat

    def fill_leaf(self, flat: np.ndarray, i: int, arr) -> None:
        """:meth:`fill` of leaf ``i`` alone."""
        where = {k: (o, sub) for k, o, sub in self.parts[i]}
        done = set()
        for shard in arr.addressable_shards:
            k = _key(shard.index, self.shapes[i])
            if k in done or k not in where:
                continue
            done.add(k)
            o, sub = where[k]
            np.copyto(flat[o:o + math.prod(sub)], np.asarray(shard.data).reshape(-1), casting="same_kind")

    def views(self, flat: np.ndarray, i: int) -> list:
        """Leaf ``i``'s local shards as views of ``flat``: [(index key, view)]."""
        return [(k, flat[o:o + math.prod(sub)].reshape(sub)) for k, o, sub in self.parts[i]]

    def arrays(self, flat: np.ndarray, dtype=None) -> list:
        """Global arrays of the update layout whose local shards are ``flat``'s (cast to ``dtype``)."""
        out = []
        for i, (shape, s) in enumerate(zip(self.shapes, self.shardings)):
            local = dict(self.views(flat, i))
            bufs = [jax.device_put(np.asarray(local[_key(index, shape)], dtype), d)
                    for d, index in s.addressable_devices_indices_map(shape).items()]
            out.append(jax.make_array_from_single_device_arrays(shape, s, bufs))
        return out
