"""The stage-3 replay's operations on a large param (:mod:`zerojax.stages._stage3`), which read
it in part instead of gathering it whole: a matmul over slices of the param
(:func:`_chunked_dot`), and the embedding lookups of a table split along its features
(:func:`_sharded_lookup`) or along its rows (:func:`_row_split_lookup`). The values they read
are :mod:`zerojax.stages._stage3_values`'.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from zerojax._compat import Tracer
from zerojax.stages._reuse import Slicing
from zerojax.stages._stage3_values import Base, Lazy, _bind, _bring, _is_float, _tie


# ---------------------------------------------------------------------------- large params
# A param larger than the slicing bound (:class:`Slicing`) is never whole on a device
# when its use allows: a matmul gathers it slice by slice, and a row lookup reads only the
# rows it needs. Both return the gradient of the local shard directly, reduce-scattered slice
# by slice, so no param-sized gradient is held through the backward pass.
def _keeping_inputs(forward: Callable, backward: Callable):
    """``forward`` as a custom-VJP function whose residuals are its own inputs."""
    f = jax.custom_vjp(forward)
    f.defvjp(lambda *args: (forward(*args), args), backward)
    return f


def _pad_to(x, axis: int, size: int):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _chunked_dot(eqn, invals, slicing: Slicing) -> Optional[list]:
    """A ``dot_general`` of an activation with one large param (or a transpose/cast of it),
    computed over slices of the param along one of its free axes, in a loop: each slice is
    gathered, used and dropped, forward and backward alike.

    The slices are taken along a free axis other than the one the param is split along, or,
    when the split axis is the only free one (a vocabulary table split along its rows and
    applied as ``x @ table.T``), along the split axis itself: slice ``j`` is the same rows
    of every device's shard, so its all-gather holds rows from each device's block, and
    their outputs land in each block's place."""
    pos = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    if len(pos) != 1 or len(invals) != 2:
        return None
    i = pos[0]
    lz, x = invals[i], invals[1 - i]
    if lz.dims is None or not _is_float(x) or not isinstance(x, Tracer):
        return None
    base = lz.sources[0]
    lay = base.lay
    (contract, batch) = eqn.params["dimension_numbers"]
    used = set(contract[i]) | set(batch[i])
    free = [a for a in range(len(lay.shape)) if lz.dims[a] not in used]
    if not slicing.sliced(lay.size) or not free:
        return None
    shard_shape, shard_dtype = base.shard.shape, base.shard.dtype
    strided = lay.axis in free and len(free) == 1  # the split axis is the only free one
    ca = lay.axis if strided else max((a for a in free if a != lay.axis), key=lambda a: lay.shape[a])
    span = shard_shape[ca] if strided else lay.shape[ca]  # the extent sliced: one device's block when strided
    blocks = lay.padded // span if strided else 1  # devices holding a block of the split axis
    k = -(-span // max(1, slicing.unit(lay.size) // (lay.size // lay.shape[ca]) // blocks))
    if k < 2:
        return None
    rows = -(-span // k)  # k balanced slices: the last overlaps the one before by < k rows
    # where the sliced axis lands in the output: batch dims, then lhs free, then rhs free
    ndims = [len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)]
    frees = [[d for d in range(ndims[j]) if d not in contract[j] and d not in batch[j]] for j in (0, 1)]
    out_axis = len(batch[0]) + (frees[0].index(lz.dims[ca]) if i == 0 else len(frees[0]) + frees[1].index(lz.dims[ca]))
    shape_c = list(lay.shape)
    shape_c[ca] = blocks * rows
    lay_c = dataclasses.replace(lay, shape=tuple(shape_c), padded=blocks * rows if strided else lay.padded)
    wire = base.wire

    def start(j):  # the last slice ends at the end of the span, overlapping the one before
        return jnp.minimum(j * rows, span - rows)

    def part(shard, j):
        return jax.lax.dynamic_slice_in_dim(shard, start(j), rows, axis=ca)

    def dot(xv, full):
        vals = [None, None]
        vals[i], vals[1 - i] = lz.fn(full), xv
        return _bind(eqn, vals)[0]

    def blocked(y):  # the output's sliced axis as (blocks, span): slice j is column range j of each block
        y = _pad_to(y, out_axis, blocks * span)
        return y.reshape(y.shape[:out_axis] + (blocks, span) + y.shape[out_axis + 1:])

    def unblocked(y, size):
        return y.reshape(y.shape[:out_axis] + (size,) + y.shape[out_axis + 2:])

    out_aval = eqn.outvars[0].aval
    at = out_axis + 1 if strided else out_axis  # the sliced axis of the (blocked) output

    # slices are written into whole-size buffers in place; overlapping rows get equal values;
    # with hpZ each slice's secondary partition is kept for the backward pass
    def run(shard, xv):
        def body(j, carry):
            out, secs = carry
            full, sec = wire.gather_values(part(shard, j), lay_c)
            y = dot(xv, full)
            if strided:
                y = y.reshape(y.shape[:out_axis] + (blocks, rows) + y.shape[out_axis + 1:])
            out = jax.lax.dynamic_update_slice_in_dim(out, y, start(j), at)
            if secs is not None:
                secs = jax.lax.dynamic_update_index_in_dim(secs, sec, j, 0)
            return out, secs

        secs = None
        if wire.hpz:
            sec = jax.eval_shape(lambda s: wire.gather_values(part(s, 0), lay_c)[1], shard)
            secs = jnp.zeros((k,) + sec.shape, sec.dtype)
        out0 = jnp.zeros(out_aval.shape, out_aval.dtype)
        out, secs = jax.lax.fori_loop(0, k, body, (blocked(out0) if strided else out0, secs))
        if strided:
            out = jax.lax.slice_in_dim(unblocked(out, blocks * span), 0, out_aval.shape[out_axis], axis=out_axis)
        return out, secs

    def fwd(shard, xv):
        out, secs = run(shard, xv)
        return out, (shard if secs is None else secs, xv)

    def bwd(res, ct):
        src, xv = res
        cts = blocked(ct) if strided else ct

        def body(j, carry):
            dx, dshard = carry
            ct_j = jax.lax.dynamic_slice_in_dim(cts, start(j), rows, axis=at)
            # rows the overlapping last slice shares with the one before were counted there
            fresh = jnp.arange(rows) + start(j) >= j * rows
            shape = [1] * ct_j.ndim
            shape[at] = rows
            ct_j = jnp.where(fresh.reshape(shape), ct_j, jnp.zeros((), ct_j.dtype))
            if strided:
                ct_j = unblocked(ct_j, blocks * rows)
            from_ = jax.lax.dynamic_index_in_dim(src, j, 0, keepdims=False) if wire.hpz else part(src, j)
            _, vjp = jax.vjp(dot, xv, wire.regather(_tie(from_, ct_j), lay_c, shard_dtype))
            dx_j, dfull = vjp(ct_j)
            piece = wire.reduce(dfull, lay_c).astype(shard_dtype)
            piece = piece + jax.lax.dynamic_slice_in_dim(dshard, start(j), rows, axis=ca)
            return dx + dx_j.astype(dx.dtype), jax.lax.dynamic_update_slice_in_dim(dshard, piece, start(j), ca)

        dx0 = jnp.zeros(xv.shape, jnp.promote_types(xv.dtype, jnp.float32))
        # the shard's gradient starts from -0.0, the exact additive identity, not from zeros: XLA
        # merges equal broadcasts, and a zeros of the shard's shape merged with the update's (the
        # gated gradient's select) became one buffer XLA:GPU filled here and held through the rest
        # of the backward pass for the update (a vocabulary table's shard: 1 MiB of a 12-layer
        # GPT's lean peak)
        dx, dshard = jax.lax.fori_loop(0, k, body, (dx0, jnp.full(shard_shape, -0.0, shard_dtype)))
        return dshard, dx.astype(xv.dtype)

    sliced = jax.custom_vjp(lambda shard, xv: run(shard, xv)[0])
    sliced.defvjp(fwd, bwd)
    base.fetches.used([base])
    return [sliced(_bring(base, base.shard, None), x)]


def _sharded_lookup(eqn, invals, slicing: Optional[Slicing] = None) -> Optional[list]:
    """Rows of a param split along its feature axis (an embedding lookup): every device looks
    up all devices' ids in its own columns and an all-to-all returns each device its rows; the
    backward pass sends the row gradients back and scatters them into the local shard. The
    traffic is activation-sized, and the whole table is neither gathered nor reduced. Used when
    a device looks up fewer rows than the table has. A table split along its rows takes
    :func:`_row_split_lookup` when stage 3 slices it (``slicing``), else it is gathered whole."""
    op, ids = invals
    if not isinstance(op, Lazy) or not op.is_param or isinstance(ids, Lazy) or not isinstance(ids, Tracer):
        return None
    base = op.sources[0]
    lay = base.lay
    dn = eqn.params["dimension_numbers"]
    sizes = tuple(eqn.params["slice_sizes"])
    if slicing is not None and slicing.sliced(lay.size):
        out = _row_split_lookup(eqn, base, ids)
        if out is not None:
            return out
    if (getattr(dn, "operand_batching_dims", ()) or lay.axis in dn.collapsed_slice_dims
            or lay.axis in dn.start_index_map or sizes[lay.axis] != lay.shape[lay.axis]):
        return None
    looked_up = math.prod(ids.shape[:-1])
    if looked_up >= math.prod(lay.shape[d] for d in dn.start_index_map):
        return None
    axis_name = base.axis_name
    kept = [a for a in range(len(lay.shape)) if a not in dn.collapsed_slice_dims]
    out_axis = dn.offset_dims[kept.index(lay.axis)]
    local_sizes = list(sizes)
    local_sizes[lay.axis] = base.shard.shape[lay.axis]
    params = dict(eqn.params, slice_sizes=tuple(local_sizes))

    def local(shard, all_ids):  # (n, ...) ids -> (n, ...) rows of this device's columns
        return jax.vmap(lambda j: eqn.primitive.bind(shard, j, **params))(all_ids)

    def forward(shard, all_ids):
        rows = jax.lax.all_to_all(local(shard, all_ids), axis_name, 0, out_axis + 1, tiled=True)
        return jax.lax.slice_in_dim(rows[0], 0, lay.shape[lay.axis], axis=out_axis)

    def bwd(res, ct):
        shard, all_ids = res
        ct = _pad_to(ct, out_axis, lay.padded)[None]
        parts = jax.lax.all_to_all(ct, axis_name, out_axis + 1, 0, tiled=True)
        _, vjp = jax.vjp(lambda s: local(s, all_ids), shard)
        return vjp(parts.astype(shard.dtype))[0], None

    all_ids = jax.lax.all_gather(ids, axis_name)
    base.fetches.used([base])
    return [_keeping_inputs(forward, bwd)(_bring(base, base.shard, None), all_ids)]


def _row_split_lookup(eqn, base: "Base", ids) -> Optional[list]:
    """Whole rows of a param split along its rows (``table[ids]``): every device looks up all
    devices' ids among its own rows (zeros for the rows it does not hold) and a reduce-scatter
    returns each device its rows, each the one device's that holds it plus zeros; the backward
    pass all-gathers the row gradients and each device scatters those of its rows into its
    shard. Activation-sized traffic, as the all-to-all of a table split along its features."""
    lay = base.lay
    dn = eqn.params["dimension_numbers"]
    sizes = tuple(eqn.params["slice_sizes"])
    if (getattr(dn, "operand_batching_dims", ()) or tuple(dn.start_index_map) != (lay.axis,)
            or lay.axis not in dn.collapsed_slice_dims or ids.shape[-1] != 1
            or any(sizes[a] != lay.shape[a] for a in range(len(sizes)) if a != lay.axis)
            or min(dn.offset_dims, default=ids.ndim - 1) < ids.ndim - 1):  # the ids' dims lead the output
        return None
    if math.prod(ids.shape[:-1]) >= lay.shape[lay.axis]:
        return None
    axis_name = base.axis_name
    block = base.shard.shape[lay.axis]

    def local(shard, all_ids):  # (n, ...) ids -> (n, ...) rows, zero where another device holds the row
        own = all_ids - jax.lax.axis_index(axis_name) * block
        held = (own >= 0) & (own < block)
        rows = eqn.primitive.bind(shard, jnp.clip(own, 0, block - 1), **eqn.params)
        return jnp.where(held.reshape(held.shape[:-1] + (1,) * (rows.ndim - held.ndim + 1)), rows,
                         jnp.zeros((), rows.dtype))

    def forward(shard, all_ids):
        rows = local(shard, all_ids.reshape((-1,) + all_ids.shape[2:]))
        rows = rows.reshape(all_ids.shape[:2] + rows.shape[1:])
        return jax.lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]

    def bwd(res, ct):
        shard, all_ids = res
        cts = jax.lax.all_gather(ct, axis_name)
        flat = all_ids.reshape((-1,) + all_ids.shape[2:])
        _, vjp = jax.vjp(lambda s: local(s, flat), shard)
        return vjp(cts.reshape((-1,) + cts.shape[2:]).astype(shard.dtype))[0], None

    all_ids = jax.lax.all_gather(ids, axis_name)
    base.fetches.used([base])
    return [_keeping_inputs(forward, bwd)(_bring(base, base.shard, None), all_ids)]
