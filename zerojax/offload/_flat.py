"""FlatLayout: a params tree packed into one contiguous host buffer per dtype, the leaves
handed back as zero-copy views, so a host optimizer sees a single flat buffer."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._errors import ConfigError
from zerojax.offload._host_buffers import host_or_numpy

__all__ = ["FlatLayout", "host_copy"]


def host_copy(x) -> np.ndarray:
    """``x`` on the host as a fresh numpy array. A jax array's shards are copied one by one, so the
    copy is not cached on the array (``np.asarray`` of a sharded jax array keeps the host copy as
    long as the array lives: a whole model's worth while the params or gradients stream to the host)."""
    shards = getattr(x, "addressable_shards", None)
    if shards is None or not getattr(x, "is_fully_addressable", False):
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    for s in shards:
        out[s.index] = np.asarray(s.data)
    return out


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each leaf of a tree sits inside one flat buffer per dtype.

    Leaves keep their own dtype (or all are cast to ``dtype`` when given); leaves of
    one dtype are laid end to end in tree-flatten order::

        layout = FlatLayout.from_tree(params, dtype=np.float32)
        bufs = layout.flatten(params)            # {'float32': 1-D buffer}
        master = bufs["float32"]                 # what HostAdamW updates in place
        tree = layout.unflatten(bufs)            # zero-copy views shaped like params
    """

    treedef: Any
    shapes: tuple  # per leaf, in flatten order
    dtypes: tuple  # per leaf: dtype name of the buffer it lives in
    offsets: tuple  # per leaf: first element inside its dtype's buffer
    sizes: dict  # dtype name -> total elements of that buffer

    @classmethod
    def from_tree(cls, tree: Any, dtype: Any = None) -> FlatLayout:
        leaves, treedef = jax.tree.flatten(tree)
        shapes, dtypes, offsets, sizes = [], [], [], {}
        for leaf in leaves:
            src = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            dt = jnp.dtype(dtype if dtype is not None else src).name
            shape = tuple(np.shape(leaf))
            offsets.append(sizes.get(dt, 0))
            sizes[dt] = sizes.get(dt, 0) + math.prod(shape)
            shapes.append(shape)
            dtypes.append(dt)
        return cls(treedef, tuple(shapes), tuple(dtypes), tuple(offsets), sizes)

    def empty(self) -> dict:
        """Fresh zeroed buffers, one per dtype.

        float32, bfloat16 and float16 buffers come from ``host_zeros``, so ``HostAdamW``
        updates them with its compiled step; other dtypes are plain numpy arrays.
        """
        return {dt: host_or_numpy(n, jnp.dtype(dt)) for dt, n in self.sizes.items()}

    def flatten(self, tree: Any, out: dict | None = None) -> dict:
        """Copies the leaves of ``tree`` into (new or given) flat buffers."""
        leaves = self.treedef.flatten_up_to(tree)
        bufs = self.empty() if out is None else out
        for leaf, shape, dt, off in zip(leaves, self.shapes, self.dtypes, self.offsets):
            if tuple(np.shape(leaf)) != shape:
                raise ConfigError(f"FlatLayout.flatten: leaf has shape {np.shape(leaf)}, "
                                 f"layout expects {shape}; rebuild the layout for this tree.")
            size = math.prod(shape)
            np.copyto(bufs[dt][off:off + size], np.asarray(leaf).reshape(-1),
                      casting="same_kind")
        return bufs

    def unflatten(self, buffers: dict) -> Any:
        """The tree as zero-copy, reshaped views into ``buffers``."""
        return self.treedef.unflatten([self._leaf(buffers[dt], shape, off)
                                       for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets)])

    def views(self, flat: np.ndarray) -> Any:
        """For a layout of one dtype: the tree as zero-copy views into ``flat``, any buffer of
        ``total`` elements whatever its element type (the same offsets serve the fp32 state,
        the 16-bit gradients and the 16-bit params)."""
        if len(self.sizes) != 1 or flat.size != self.total:
            raise ConfigError(f"FlatLayout.views: needs a layout of one dtype (got {sorted(self.sizes)}) and a "
                             f"flat buffer of {self.total} elements (got {flat.size}).")
        return self.treedef.unflatten([self._leaf(flat, shape, off) for shape, off in zip(self.shapes, self.offsets)])

    def fill(self, flat: np.ndarray, leaves) -> np.ndarray:
        """Copies ``leaves`` (flatten order) into ``flat`` through :meth:`views`; returns ``flat``."""
        for view, leaf in zip(jax.tree.leaves(self.views(flat)), leaves):
            np.copyto(view, np.asarray(leaf), casting="same_kind")
        return flat

    def source(self, leaves, dtype, host=None, once: bool = False) -> "LeafSource":
        """A read-only flat view of ``leaves`` (flatten order, one dtype) whose ``[a:b]`` copies only
        those elements, bringing one leaf to the host at a time: the host never holds the whole
        flat buffer (the NVMe store reads its sub-groups in order). ``host(i, leaf)``: leaf ``i`` as
        a host array of its shape in this layout (default :func:`host_copy`). ``once``: the view is
        read once, in order, so it lets go of each leaf as soon as the reads have passed it (the
        gradients' device buffers, where it holds the last reference, go one by one)."""
        return LeafSource(self, list(leaves), np.dtype(dtype), host, once)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    @staticmethod
    def _leaf(buf: np.ndarray, shape, off: int) -> np.ndarray:
        return buf[off:off + math.prod(shape)].reshape(shape)


class LeafSource:
    """:meth:`FlatLayout.source`: ``shape``, ``ndim``, ``size``, ``dtype`` and ``[a:b]`` of the flat
    buffer the leaves would fill."""

    def __init__(self, layout: FlatLayout, leaves: list, dtype, host=None, once: bool = False):
        self.layout, self.leaves, self.dtype, self.once = layout, leaves, dtype, once
        self.host = host if host is not None else (lambda i, leaf: host_copy(leaf))
        self.size = layout.total
        self.shape, self.ndim = (self.size,), 1
        self._ends = np.cumsum([math.prod(s) for s in layout.shapes])
        self._held: dict = {}
        self._passed = 0  # once: the leaves before this one are let go

    def _leaf(self, i: int) -> np.ndarray:
        if i not in self._held:
            if self.once:
                if i < self._passed:
                    raise ValueError(f"LeafSource(once=True): leaf {i} was read past already")
                for j in range(self._passed, i):  # the reads have passed these
                    self.leaves[j] = None
                self._passed = i
            self._held = {i: np.ascontiguousarray(self.host(i, self.leaves[i])).reshape(-1)}
        return self._held[i]

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("LeafSource supports [a:b] only")
        start, b, _ = key.indices(self.size)
        out = np.empty(max(0, b - start), self.dtype)
        a, i = start, int(np.searchsorted(self._ends, start, side="right"))
        while a < b:
            off = int(self._ends[i]) - math.prod(self.layout.shapes[i])
            hi = min(b, int(self._ends[i]))
            np.copyto(out[a - start:hi - start], self._leaf(i)[a - off:hi - off], casting="same_kind")
            a, i = hi, i + 1
        return out
