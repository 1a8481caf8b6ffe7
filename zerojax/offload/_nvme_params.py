"""Params on NVMe (ZeRO-Infinity, ``offload_param="nvme"``): where each device's part of each
param sits in the files, and the reader that brings it into the step.

The 16-bit params live in the NVMe optimizer store's slots (:class:`NvmeOptimizerStore` with
``params_dtype``), in the store's flat order. That order is the *disk layout* of each leaf: a
param split over the data axis is kept as its stored (padded) array with the split dimension
moved first, so each device's 1/N is one contiguous range of the file (DeepSpeed's
bandwidth-centric partitioning: every device reads only its own part, the stage-3 all-gather
assembles the whole param); a param kept whole (below ``param_persistence_threshold``) is
kept in its own shape. The fp32 master and Adam moments use the same order, which an
elementwise update does not mind, so gradients are flattened the same way.

Inside the step the stage-3 replay reads each device's part where it gathers the param
(:class:`NvmeSource`: a host callback after the activation of the moment, again for the backward
pass where it gathers the param again); a reader thread reads ahead in the order the previous
step asked for them, into a host
buffer bounded by ``offload_param``'s ``buffer_count`` x ``buffer_size`` elements (and
``max_in_cpu``), so the reads overlap the step's compute. Between steps nothing of the params
stays in host or device memory.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._errors import ConfigError
from zerojax._plan import LeafLayout, ZeroPlan
from zerojax.offload._flat import FlatLayout
from zerojax.offload._host_buffers import release
from zerojax.offload._shards import ShardLayout
from zerojax.stages._collectives import local_shape

__all__ = ["DiskLayout", "NvmeSource", "ParamReader"]


@functools.lru_cache(maxsize=64)
def _to_front(axis: int, sharding):
    """A program moving ``axis`` first, its result laid out as ``sharding``."""
    return jax.jit(lambda x: jnp.moveaxis(x, axis, 0), out_shardings=sharding)


@dataclasses.dataclass(frozen=True)
class DiskLayout:
    """Per leaf of ``plan``: its shape on disk, and each device's range of it.

    A process's store holds the rows of its own devices (data-axis indices ``first`` to
    ``first + count - 1``) of each split leaf and every leaf kept whole: on one process, everything.
    """

    plan: ZeroPlan
    shapes: tuple  # per leaf: the disk shape
    flat: FlatLayout  # offsets of this process's part of each leaf (its rows) in one flat buffer
    first: int = 0  # this process's first data-axis index
    count: int = 0  # its devices on the data axis

    @classmethod
    def of(cls, plan: ZeroPlan) -> "DiskLayout":
        shapes = tuple(cls._shape(lay) for lay in plan.leaves)
        mine = local_devices(plan)
        first, count = mine[0], len(mine)
        if mine != list(range(first, first + count)):
            raise ConfigError(f"offload_param='nvme': this process's devices sit at data-axis indices {mine}, not one "
                              "run of them, so its rows of each param are not one range of its store. Fix: build the "
                              "mesh with zj.make_mesh() (each process's devices side by side)")
        rows = [(s[0] // plan.n * count,) + s[1:] if lay.params_partitioned else s
                for lay, s in zip(plan.leaves, shapes)]
        flat = FlatLayout.from_tree([jax.ShapeDtypeStruct(r, np.float32) for r in rows])
        return cls(plan, shapes, flat, first, count)

    @staticmethod
    def _shape(lay: LeafLayout) -> tuple:
        if not lay.params_partitioned:
            return tuple(lay.shape)
        s = tuple(lay.storage_shape)
        return (s[lay.axis],) + s[:lay.axis] + s[lay.axis + 1:]

    def to_disk(self, lay: LeafLayout, stored):
        """A leaf in the plan's storage layout (padded where split) -> its disk shape."""
        return jnp.moveaxis(stored, lay.axis, 0) if lay.params_partitioned else stored

    def local_shape(self, i: int) -> tuple:
        """What one device reads of leaf ``i``: its 1/N rows, or the whole leaf."""
        s = self.shapes[i]
        if not self.plan.leaves[i].params_partitioned:
            return s
        return (s[0] // self.plan.n,) + s[1:]

    def local_range(self, i: int, device: int) -> tuple:
        """(first element, element count) in this process's store of leaf ``i``'s part for
        data-axis index ``device`` (one of this process's)."""
        size = math.prod(self.local_shape(i))
        off = self.flat.offsets[i]
        return (off + (device - self.first) * size, size) if self.plan.leaves[i].params_partitioned else (off, size)

    def sharding(self, i: int):
        """Leaf ``i``'s disk shape split over the data axis on its first dimension (or whole)."""
        lay, mesh = self.plan.leaves[i], self.plan.mesh
        spec = P(self.plan.data_axis) if lay.params_partitioned else P()
        return NamedSharding(mesh, spec)

    @functools.cached_property
    def shards(self) -> ShardLayout:
        """This process's rows as shards of the disk layout (each leaf split on its first dimension):
        the same elements in the same order as :attr:`flat`, so global arrays of the disk layout
        fill this process's store and come back from it through :class:`ShardLayout`."""
        return ShardLayout.over(self.shapes, [self.sharding(i) for i in range(len(self.plan.leaves))])

    def in_disk_order(self, i: int, x):
        """Leaf ``i`` as a global array of the plan's storage layout (split on its own axis) ->
        the disk layout (split dimension first), moved on the devices."""
        lay = self.plan.leaves[i]
        return _to_front(lay.axis, self.sharding(i))(x) if lay.params_partitioned else x

    def storage_sharding(self, i: int):
        """Leaf ``i`` in the plan's storage layout: split over the data axis on its own axis (or whole)."""
        lay = self.plan.leaves[i]
        return NamedSharding(self.plan.mesh, lay.spec(lay.params_partitioned, self.plan.data_axis))

    def from_local(self, i: int, local):
        """A device's part as read (disk order) -> the shard the stage-3 step works on."""
        lay = self.plan.leaves[i]
        return jnp.moveaxis(local, 0, lay.axis) if lay.params_partitioned else local


class ParamReader:
    """Each device's part of each param, read from the store's committed slot.

    :meth:`begin` starts a thread reading ahead through ``order`` (the requests of a step: pairs
    of leaf index and data-axis device index, a pair again where the backward pass reads the
    param again) while the buffered bytes stay within ``budget``; :meth:`get` hands over a
    buffered part or reads it now. :meth:`end` stops the thread and drops what is left, so
    nothing is held between steps, and takes the requests the step made, in order, as the next
    step's ``order``. ``reads`` counts the parts handed over, ``ahead`` those already read then.
    """

    def __init__(self, store, disk: DiskLayout, dtype, order: Sequence[tuple], budget: int):
        self.store, self.disk, self.dtype = store, disk, np.dtype(dtype)
        self.order, self.budget = list(order), max(0, int(budget))
        self._cv = threading.Condition()
        self._ready: dict = {}  # key -> parts read ahead, not handed over yet
        self._used: dict = {}  # key -> parts handed over this step
        self._held = 0
        self._stop = True
        self._asked: list = []
        self._thread: Optional[threading.Thread] = None
        self.reads = self.ahead = 0
        self.error: Optional[BaseException] = None  # the first failed read of the step

    def _read(self, key) -> np.ndarray:
        i, d = key
        start, size = self.disk.local_range(i, d)
        out = np.empty(self.disk.local_shape(i), self.dtype)
        assert out.size == size
        return self.store.read_params(start, out)

    def begin(self) -> None:
        self.end()
        with self._cv:
            self._ready, self._used, self._held, self._stop, self._asked = {}, {}, 0, False, []
            self.error = None
        if self.budget and self.order:
            self._thread = threading.Thread(target=self._ahead, name="nvme-params", daemon=True)
            self._thread.start()

    def _ahead(self) -> None:
        seen: dict = {}
        for key in self.order:
            k = seen[key] = seen.get(key, 0) + 1  # this is the key's k-th request of the step
            size = math.prod(self.disk.local_shape(key[0])) * self.dtype.itemsize
            with self._cv:
                # wait for room (a part larger than the budget is read when the buffer is empty)
                self._cv.wait_for(lambda: self._stop or self._used.get(key, 0) >= k or self._held == 0
                                  or self._held + size <= self.budget)
                if self._stop:
                    return
                if self._used.get(key, 0) >= k:  # asked for already: read then
                    continue
            try:
                x = self._read(key)
            except Exception:  # the step's own read reports the error where it is needed
                return
            with self._cv:
                if self._stop:
                    return
                if self._used.get(key, 0) < k:
                    self._ready.setdefault(key, []).append(x)
                    self._held += x.nbytes
                    self._cv.notify_all()

    def get(self, i, device) -> np.ndarray:
        key = (int(i), int(device))
        with self._cv:
            parts = self._ready.get(key)
            x = parts.pop(0) if parts else None
            self._used[key] = self._used.get(key, 0) + 1
            self._asked.append(key)
            if x is not None:
                self._held -= x.nbytes
                self.ahead += 1
            self._cv.notify_all()
        self.reads += 1
        if x is not None:
            return x
        try:
            return self._read(key)
        except BaseException as e:  # raised inside XLA's callback: kept so the step can raise it as it is
            self.error = self.error or e
            raise

    def end(self) -> None:
        with self._cv:
            self._stop = True
            self._ready.clear()
            self._held = 0
            if self._asked:
                self.order, self._asked = self._asked, []
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        release()  # the parts read this step, freed once the step copied them: back to the system


def local_devices(plan: ZeroPlan) -> list:
    """The data-axis indices of this process's devices."""
    axis_pos = plan.mesh.axis_names.index(plan.data_axis)
    here = jax.process_index()
    out = set()
    for idx, dev in np.ndenumerate(plan.mesh.devices):
        if dev.process_index == here:
            out.add(idx[axis_pos])
    return sorted(out)


class NvmeSource:
    """What the data-parallel gradient's body (manual over the data axis) takes the params from
    when they live on NVMe.

    ``params()``: the params tree to differentiate: a param kept whole is read from the files
    there and then (it is small: below ``param_persistence_threshold``), a partitioned one is a
    zero placeholder of its shard's shape that nothing reads. ``sources``: leaf path ->
    ``read(placeholder, anchor)``, which the stage-3 replay calls at each point it needs the
    shard: a host callback reads this device's part after ``anchor`` (the activation of the
    moment), so each param is read where it is used, forward and again backward, and the
    placeholder takes the shard's gradient.
    """

    def __init__(self, disk: DiskLayout, reader: ParamReader, dtype):
        self.disk, self.reader, self.dtype = disk, reader, dtype
        self.sources = {lay.path: self._reader_of(i) for i, lay in enumerate(disk.plan.leaves)
                        if lay.params_partitioned}

    def _fetch(self, i: int, after):
        want = jax.ShapeDtypeStruct(self.disk.local_shape(i), self.dtype)
        dev = jax.lax.axis_index(self.disk.plan.data_axis)
        local = jax.pure_callback(lambda d, _after, _i=i: self.reader.get(_i, d), want, dev, after)
        return self.disk.from_local(i, local)

    def _reader_of(self, i: int):
        @jax.custom_vjp
        def read(placeholder, after):
            return self._fetch(i, after)

        def fwd(placeholder, after):
            return self._fetch(i, after), after

        def bwd(after, ct):
            return ct, jnp.zeros_like(after)

        read.defvjp(fwd, bwd)

        def source(placeholder, anchor):
            after = jnp.float32(0) if anchor is None else \
                jax.lax.stop_gradient(jnp.ravel(anchor)[0]).astype(jnp.float32)
            return read(placeholder, after)

        return source

    def params(self):
        plan = self.disk.plan
        leaves = []
        for i, lay in enumerate(plan.leaves):
            if lay.params_partitioned:
                leaves.append(jnp.zeros(local_shape(lay, plan.n), self.dtype))
            else:
                leaves.append(self._fetch(i, jnp.float32(0)))
        return plan.treedef.unflatten(leaves)

    __call__ = params
