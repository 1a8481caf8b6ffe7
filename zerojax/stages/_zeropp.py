"""ZeRO++ for stage 3: how partitioned params and their gradients travel.

The data axis of ``n`` devices is seen as ``n / k`` nodes of ``k`` consecutive devices (device
``d`` is local index ``d % k`` of node ``d // k``, as ranks are laid out by a launcher). Every
leaf is cut into ``n`` rows (:func:`zerojax.stages._collectives.rows`); device ``d`` stores row
``d`` (its primary partition).

qwZ (``quantized_weights``)
    A weight gather sends each row as 8-bit integers with a float32 maximum per block of
    ``quantization_block_size`` values (:mod:`zerojax.stages._quantize`) and dequantizes the
    gathered rows to the param dtype; about half the bytes of a 16-bit gather. Only the wire is
    quantized: the stored params and the fp32 master are untouched.
hpZ (``hpz_partition_size = k``)
    The forward gather reads the primary partitions of all ``n`` devices. From the gathered
    param each device keeps its secondary partition, the ``n / k`` consecutive rows
    ``[l·n/k, (l+1)·n/k)`` of its local index ``l`` (with qwZ, the gathered 8-bit rows
    themselves), until the backward pass; there the param is gathered again from the
    secondary partitions of the ``k`` devices of the node only. DeepSpeed refreshes its
    secondary copy from the forward gather in the same way. It costs ``1/k`` of the param per
    device (8-bit with qwZ) from the forward use to the backward use, and is never stored in
    the TrainState, so it is never donated or checkpointed.
qgZ (``quantized_gradients``)
    A gradient reduction sends, inside each node, every local peer the rows it will own after
    the hop as ``quantized_gradients_bits``-bit integers (an all-to-all), sums what arrives in
    float32, and sends the sums the same way across the nodes (an all-to-all among the devices
    of one local index); each device ends with the float32 sum of its own row. Errors do not
    compound: each hop quantizes values summed in full precision.

``Wire`` holds these settings; :mod:`zerojax.stages._stage3` calls its ``gather``, ``regather``
and ``reduce`` at every use site, and :mod:`zerojax.stages._gradients` its ``bucketed_reduce``
for the stage-3 leaves kept whole.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import numpy as np

from zerojax._plan import LeafLayout, ZeroPlan
from zerojax.stages import _collectives as C
from zerojax.stages import _quantize as Q
from zerojax.stages._reuse import kept_leaves

WEIGHT_BITS = 8


def node_size(plan: ZeroPlan) -> int:
    """Devices per node along the data axis: ``devices_per_node`` when given, else
    ``hpz_partition_size`` when above 1, else the devices of one process along the data axis
    (the whole axis in a single-process run)."""
    cfg = plan.config
    if cfg.devices_per_node:
        return int(cfg.devices_per_node)
    if cfg.hpz_partition_size > 1:
        return int(cfg.hpz_partition_size)
    devices = getattr(plan.mesh, "devices", None)
    if devices is None:  # an abstract mesh: no processes to read, the axis is one node
        return plan.n
    axis = plan.mesh.axis_names.index(plan.data_axis)
    procs = [d.process_index for d in np.moveaxis(devices, axis, 0).reshape(devices.shape[axis], -1)[:, 0]]
    k = next((i for i, p in enumerate(procs) if p != procs[0]), len(procs))
    return k if plan.n % k == 0 else 1


@dataclasses.dataclass(frozen=True)
class Wire:
    """How stage-3 params and gradients travel over the data axis (see the module docstring)."""

    axis_name: str
    n: int
    node: int = 1  # devices per node, k
    hpz: bool = False  # backward gathers from the secondary partition inside the node
    weight_bits: int = 0  # 8: qwZ; 0: weights travel in their dtype
    grad_bits: int = 0  # 4 or 8: qgZ; 0: one reduce-scatter
    block: int = 256  # values per quantization block

    @classmethod
    def of(cls, plan: ZeroPlan) -> "Wire":
        cfg = plan.config
        on = plan.stage == 3
        return cls(axis_name=plan.data_axis, n=plan.n, node=node_size(plan),
                   hpz=on and cfg.hpz_partition_size > 1,
                   weight_bits=WEIGHT_BITS if on and cfg.quantized_weights else 0,
                   grad_bits=int(cfg.quantized_gradients_bits) if on and cfg.quantized_gradients else 0,
                   block=int(cfg.quantization_block_size))

    @property
    def nodes(self) -> int:
        return self.n // self.node

    @property
    def quantized(self) -> bool:
        """qwZ or qgZ: params or gradients travel as integers (each param on its own wire)."""
        return bool(self.weight_bits or self.grad_bits)

    @property
    def plain(self) -> bool:
        """Stage 3 as without ZeRO++: one all-gather per gather, one reduce-scatter per reduction."""
        return not (self.hpz or self.quantized)

    def _groups(self, inside: bool) -> Optional[list]:
        """The data-axis indices that talk in one exchange: the devices of each node (``inside``)
        or the devices of each local index across the nodes; None when that is the whole axis."""
        k, m = self.node, self.nodes
        if (m if inside else k) == 1:
            return None
        if inside:
            return [[j * k + i for i in range(k)] for j in range(m)]
        return [[j * k + i for j in range(m)] for i in range(k)]

    def _local_index(self):
        return jax.lax.axis_index(self.axis_name) % self.node

    # ------------------------------------------------------------------ weights
    def _encode(self, x):
        return Q.encode(x, self.weight_bits, self.block)

    def _decode(self, payload, c: int, dtype):
        return Q.decode(payload, self.weight_bits, self.block, c, dtype)

    def _secondary(self, rows):
        """This device's secondary partition: rows [l·m, (l+1)·m) of all ``n`` rows."""
        m = self.nodes
        return jax.lax.dynamic_slice_in_dim(rows, self._local_index() * m, m, axis=0)

    def secondary_of(self, full, lay: LeafLayout):
        """hpZ: this device's secondary partition of a gathered (unquantized) leaf, a residual
        only (no gradient flows through it)."""
        return self._secondary(C.rows(jax.lax.stop_gradient(full), lay, self.n))

    def gather_values(self, shard, lay: LeafLayout):
        """This device's shard -> (the whole leaf, its secondary partition or None), read from
        the primary partitions of all devices. Not differentiable; :meth:`gather` is."""
        if self.weight_bits:
            row = C.shard_row(shard, lay)
            allp = jax.lax.all_gather(self._encode(row[None]), self.axis_name, axis=0, tiled=True)
            full = C.unrows(self._decode(allp, row.shape[0], shard.dtype), lay)
            return full, (self._secondary(allp) if self.hpz else None)
        full = C.gather(shard, lay, self.axis_name)
        return full, (self.secondary_of(full, lay) if self.hpz else None)

    def gather(self, shard, lay: LeafLayout):
        """:meth:`gather_values`, differentiable in ``shard``: the whole leaf's cotangent goes
        through :meth:`reduce` (with neither qwZ nor qgZ, through the all-gather's own
        transpose, a reduce-scatter)."""
        if not self.quantized:
            full = C.gather(shard, lay, self.axis_name)
            return full, (self.secondary_of(full, lay) if self.hpz else None)
        dtype = shard.dtype

        @jax.custom_vjp
        def through(s):
            return self.gather_values(s, lay)

        def fwd(s):
            return self.gather_values(s, lay), None

        def bwd(_, ct):  # the secondary partition's cotangent is zero: it is only ever a residual
            return (self.reduce(ct[0], lay).astype(dtype),)

        through.defvjp(fwd, bwd)
        return through(shard)

    def regather(self, residual, lay: LeafLayout, dtype):
        """The whole leaf again, for the backward pass: from the secondary partitions of the
        node's devices (hpZ), else from the primary partitions of all (``residual`` is the
        shard). Not differentiable."""
        if not self.hpz:
            return self.gather_values(residual, lay)[0]
        got = jax.lax.all_gather(residual, self.axis_name, axis=0, tiled=True,
                                 axis_index_groups=self._groups(inside=True))  # (n, ...) rows in order
        if self.weight_bits:
            got = self._decode(got, math.prod(C.local_shape(lay, self.n)), dtype)
        return C.unrows(got, lay)

    # ---------------------------------------------------------------- gradients
    def reduce_rows(self, rows):
        """(n, c) rows of a local gradient -> float32 (c,): the sum over devices of row d on
        device d, in two quantized all-to-all hops (inside the node, then across nodes)."""
        k, m = self.node, self.nodes
        bits, block = self.grad_bits, self.block
        n, c = rows.shape
        x = rows
        if k > 1:
            # peer i of the node receives rows {j·k + i}: the ones it gathers across nodes next
            send = rows.reshape(m, k, c).transpose(1, 0, 2).reshape(k, m * c)
            got = jax.lax.all_to_all(Q.encode(send, bits, block), self.axis_name, 0, 0, tiled=True,
                                     axis_index_groups=self._groups(inside=True))
            x = Q.decode(got, bits, block, m * c).sum(axis=0).reshape(m, c)
        if m > 1:
            got = jax.lax.all_to_all(Q.encode(x, bits, block), self.axis_name, 0, 0, tiled=True,
                                     axis_index_groups=self._groups(inside=False))
            x = Q.decode(got, bits, block, c).sum(axis=0, keepdims=True)
        return x[0]

    def reduce(self, g, lay: LeafLayout):
        """Whole local gradient -> this device's shard of the sum over devices (qgZ when on,
        else one reduce-scatter), in the gradient's dtype."""
        if not self.grad_bits:
            return C.reduce_scatter(g, lay, self.axis_name)
        return C.unrow(self.reduce_rows(C.rows(g, lay, self.n)), lay, self.n).astype(g.dtype)

    def bucketed_reduce(self, grads, lays, bucket_size: int):
        """Whole local gradients -> this device's shards of their sums (float32), one qgZ
        reduction per bucket of at most ``bucket_size`` elements (per dtype)."""
        out = [None] * len(grads)
        for members in C.bucket_members(grads, lays, bucket_size):
            flat = self.reduce_rows(C.pack_rows(grads, lays, members, self.n))
            for i, shard in C.unpack_row(flat, lays, members, self.n).items():
                out[i] = shard
        return out


def secondary_bytes(plan: ZeroPlan) -> int:
    """Bytes per device of the hpZ secondary partitions: ``n / k`` rows of each partitioned
    param (16-bit values, or their 8-bit payload with qwZ), held inside the step from the
    param's forward gather to its backward use; 0 without hpZ. A param kept gathered until its
    backward use (``max_reuse_distance``: :func:`zerojax.stages._reuse.kept_leaves`) needs none.
    Counted per whole leaf (a stacked layer gathered slice by slice differs by at most a block's
    padding per slice)."""
    if plan.stage != 3 or plan.config.hpz_partition_size <= 1:
        return 0
    wire = Wire.of(plan)
    itemsize = np.dtype(plan.compute_dtype).itemsize
    total = 0
    for lay, kept in zip(plan.leaves, kept_leaves(plan)):
        if lay.params_partitioned and not kept:
            c = math.prod(C.local_shape(lay, plan.n))
            row = Q.payload_size(c, wire.weight_bits, wire.block) if wire.weight_bits else c * itemsize
            total += wire.nodes * row
    return total


__all__ = ["WEIGHT_BITS", "Wire", "node_size", "secondary_bytes"]
