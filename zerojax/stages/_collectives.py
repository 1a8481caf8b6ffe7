"""Per-leaf collectives used inside bodies that are manual over the data axis.

Each function takes a local value and the leaf's ``LeafLayout``; padding makes every split
dimension divide the device count, and is added or removed here and nowhere else.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import zerojax._placement as placement
from zerojax._compat import shard_map
from zerojax._plan import LeafLayout, ZeroPlan
from zerojax._precision import sum_of_squares


def local_shape(lay: LeafLayout, n: int):
    """Shape of one device's shard of the partitioned storage of ``lay``."""
    s = list(lay.storage_shape)
    s[lay.axis] //= n
    return tuple(s)


# A leaf split along a later axis (GPT-2's tied table, split along its width) travels with
# that axis moved to the front, so each device's block is contiguous: collectives along an
# inner axis get a copy of the whole leaf from the CPU compiler, where the moves cost a
# shard-sized copy and a transpose of the whole that a consuming matmul absorbs (stage 3 on
# vocab 50257 x d 128: 852 -> 789 ms per step in one side-by-side run).
def gather(x, lay: LeafLayout, axis_name: str):
    """Local shard -> the whole (unpadded) leaf on every device: one all-gather."""
    moved = jax.lax.all_gather(jnp.moveaxis(x, lay.axis, 0), axis_name, axis=0, tiled=True)
    return placement.unpad(jnp.moveaxis(moved, 0, lay.axis), lay)


def reduce_scatter(g, lay: LeafLayout, axis_name: str):
    """Whole local gradient -> this device's shard of the sum over devices: one reduce-scatter."""
    g = jnp.moveaxis(placement.pad(g, lay), lay.axis, 0)
    return jnp.moveaxis(jax.lax.psum_scatter(g, axis_name, scatter_dimension=0, tiled=True), 0, lay.axis)


def local_slice(x, lay: LeafLayout, n: int, index):
    """Whole leaf (same on every device) -> the shard of the device at ``index`` (its
    ``axis_index``); no communication."""
    x = placement.pad(x, lay)
    chunk = x.shape[lay.axis] // n
    # the start is never negative: no wrap-around arithmetic for the compiler to see
    return jax.lax.dynamic_slice_in_dim(x, index * chunk, chunk, axis=lay.axis, allow_negative_indices=False)


def local_slices(xs, lays, axis_name: str, n: int):
    """:func:`local_slice` of each of ``xs``, from one ``axis_index`` (not one device-id
    computation per leaf)."""
    index = jax.lax.axis_index(axis_name)
    return [local_slice(x, lay, n, index) for x, lay in zip(xs, lays)]


def on_selected(plan: ZeroPlan, tree, select, fn):
    """``fn(lays, leaves) -> leaves`` applied to the leaves ``select(lay)`` picks, all at once
    (so it may bucket them); the other leaves are returned untouched."""
    lays = plan.leaves
    leaves = plan.treedef.flatten_up_to(tree)
    picked = [i for i, lay in enumerate(lays) if select(lay)]
    if not picked:
        return tree
    for i, x in zip(picked, fn([lays[i] for i in picked], [leaves[i] for i in picked])):
        leaves[i] = x
    return plan.treedef.unflatten(leaves)


def _map_selected(plan: ZeroPlan, tree, select, body, in_partitioned: bool, out_partitioned: bool):
    """Run ``body(lays, locals)`` in a data-manual region on the leaves ``select`` picks; other
    leaves never enter it and keep their layouts."""
    axis = plan.data_axis

    def run(lays, leaves):
        return shard_map(lambda xs: body(lays, xs), plan.mesh,
                         in_specs=([lay.data_spec(in_partitioned, axis) for lay in lays],),
                         out_specs=[lay.data_spec(out_partitioned, axis) for lay in lays],
                         manual_axes={axis})(leaves)

    return on_selected(plan, tree, select, run)


def bucketed_all_reduce(values, lays, axis_name: str, bucket_size: int):
    """Sums over devices, one (multi-operand) all-reduce per bucket."""
    out = list(values)
    for group in buckets([lay.size for lay in lays], bucket_size):
        for i, x in zip(group, jax.lax.psum([values[i] for i in group], axis_name)):
            out[i] = x
    return out


def split_tree(plan: ZeroPlan, tree, select):
    """Whole leaves (identical on every device) -> each device's partition, for the leaves
    ``select(lay)`` picks; others pass through. Purely local: no communication, and unlike a
    sharding constraint it leaves the caller's whole arrays unconstrained."""
    axis, n = plan.data_axis, plan.n
    return _map_selected(plan, tree, select, lambda lays, xs: local_slices(xs, lays, axis, n),
                         False, True)


def gather_tree(plan: ZeroPlan, tree, select, dtype=None):
    """Partitions -> whole leaves on every device, in buckets of ``allgather_bucket_size``
    elements (in ``dtype`` when given, so 16-bit params travel in 16 bits), for the leaves
    ``select(lay)`` picks; the others are only cast."""
    axis = plan.data_axis
    if dtype is not None:
        tree = plan.map(lambda lay, x: x if select(lay) else x.astype(dtype), tree)
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    return _map_selected(plan, tree, select, lambda lays, xs: bucketed_gather(
        [cast(x) for x in xs], lays, axis, plan.n, int(plan.config.allgather_bucket_size)), True, False)


# ------------------------------------------------------------------------------ buckets
def buckets(sizes, limit: int):
    """Greedy groups of consecutive indices whose sizes add up to at most ``limit``
    (a single item larger than the limit is a bucket of its own)."""
    out, cur, total = [], [], 0
    for i, size in enumerate(sizes):
        if cur and total + size > limit:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += size
    if cur:
        out.append(cur)
    return out


def _split_view(lay: LeafLayout, n: int):
    """(before, inner): the storage seen as (before, n, inner), the split dim in the middle and
    each device's part of it with everything after it contiguous in ``inner``."""
    s, a = lay.storage_shape, lay.axis
    return math.prod(s[:a]), s[a] // n * math.prod(s[a + 1:])


def rows(x, lay: LeafLayout, n: int):
    """Whole leaf (unpadded or padded) -> (n, chunk): row d is device d's partition, flat in
    its own row-major order (so a shard and its row are one reshape apart). Only the dims
    before the split one are exchanged with the device axis: contiguous runs are moved, no
    element transpose. A bucket of one leaf (:func:`pack_rows`)."""
    return pack_rows([x], [lay], [0], n)


def shard_row(shard, lay: LeafLayout):
    """This device's shard -> its row of :func:`rows`."""
    return shard.reshape(-1)


def unrow(flat, lay: LeafLayout, n: int):
    """One device's flat partition (a row of :func:`rows`) -> its shard in the leaf's layout."""
    return flat.reshape(local_shape(lay, n))


def unrows(r, lay: LeafLayout):
    """All devices' rows (n, chunk) -> the whole (unpadded) leaf."""
    n = r.shape[0]
    before, inner = _split_view(lay, n)
    if before == 1:
        return placement.unpad(r.reshape(lay.storage_shape), lay)
    return placement.unpad(jnp.swapaxes(r.reshape(n, before, inner), 0, 1).reshape(lay.storage_shape), lay)


def bucket_members(values, lays, bucket_size: int):
    """Index lists, one per bucket: same dtype, at most ``bucket_size`` elements together."""
    for dtype in sorted({v.dtype for v in values}, key=str):
        idx = [i for i, v in enumerate(values) if v.dtype == dtype]
        for group in buckets([lays[i].size for i in idx], bucket_size):
            yield [idx[j] for j in group]


def pieces(flat, sizes, axis: int = 0):
    """``flat`` cut along ``axis`` into consecutive pieces of ``sizes``.

    The offsets reach the slices through an optimization barrier, as values rather than
    constants. A slice at a constant offset is a kernel of its own for XLA's code generator, and
    so is every fusion it joins (each leaf's optimizer update), so the compile grew with the
    number of leaves rather than with the number of distinct leaf shapes: the CPU backend's
    code generation was most of stages 1-3's excess first-step time over plain jit's. Now
    pieces of one shape share their kernels (GPT, 2 layers, stage 1: 201 kernels to compile ->
    152, stage 0: 111; the step's time and memory unchanged), and on the CPU backend no kernel
    computes the offsets either (:func:`_offsets`)."""
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    return [jax.lax.dynamic_slice_in_dim(flat, start, size, axis=axis, allow_negative_indices=False)
            for start, size in zip(_offsets(starts), sizes)]


def _offsets(starts):
    """``starts`` as traced int32 scalars the compiler cannot fold into the slices that read them.

    Behind an optimization barrier each offset is still computed by a one-scalar kernel of its
    own on the CPU backend, which never fuses an index computation into the slice reading it:
    one kernel per leaf, about 9 ms of compile each (a 4-layer GPT's stage-1 step: 52 of its 179
    kernels). There the offsets are instead the outputs of one conditional whose predicate the
    barrier hides: outputs of a non-kernel op, buffers the slices read, so no kernel computes
    them (179 -> 128 kernels at 4 layers, 251 -> 152 at 8; DDP 112 and 136). Other backends
    keep the barrier (a conditional there waits on its predicate)."""
    values = lambda: [jnp.int32(start) for start in starts]  # noqa: E731
    return _per_backend(lambda: jax.lax.cond(jax.lax.optimization_barrier(jnp.asarray(True)), values, values),
                        lambda: jax.lax.optimization_barrier(values()))


def _per_backend(cpu, other, *args):
    """``cpu(*args)`` in a program lowered for the CPU, ``other(*args)`` in one lowered for
    another platform: the platform the step is compiled for, which is not this process's default
    backend where a CPU-only process compiles it for GPUs (:func:`zerojax.plan_step`'s
    ``target``). Only the branch of that platform is lowered."""
    return jax.lax.platform_dependent(*args, cpu=cpu, default=other)


def _row_groups(members, lays, n):
    """``members`` grouped by how many runs of their split dim's elements a device row holds
    (``before`` of :func:`_split_view`), in order of first appearance:
    ``[(before, [(index, inner), ...]), ...]``."""
    groups = {}
    for i in members:
        before, inner = _split_view(lays[i], n)
        groups.setdefault(before, []).append((i, inner))
    return list(groups.items())


def pack_rows(values, lays, members, n: int):
    """Whole leaves ``values[i]`` (``i`` in ``members``) -> one (n, total) buffer whose row d
    holds device d's partition of each of them: what a bucket's reduce-scatter sends.

    Leaves with the same ``before`` travel as one block: each is viewed as (before, n, inner)
    (a reshape), the views are concatenated along ``inner`` and the block's first two dims are
    swapped once, so a bucket of stacked leaves split along a later dim (a ``lax.scan`` model
    whose layer count the devices do not divide) costs one transpose, not one per leaf; leaves
    split along their first dim (``before`` 1) need none. The row's order is :func:`unpack_row`'s."""
    blocks = []
    for before, items in _row_groups(members, lays, n):
        parts = [placement.pad(values[i], lays[i]).reshape(before, n, inner) for i, inner in items]
        block = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
        # split along the first dim (with more than one element): the rows already
        blocks.append(block.reshape(n, -1) if before == 1 else jnp.swapaxes(block, 0, 1).reshape(n, -1))
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)


def unpack_row(flat, lays, members, n: int) -> dict:
    """One device's row of :func:`pack_rows` (flat) -> ``{i: its shard of leaf i}``."""
    groups = _row_groups(members, lays, n)
    out = {}
    segments = pieces(flat, [before * sum(inner for _, inner in items) for before, items in groups])
    for (before, items), segment in zip(groups, segments):
        inners = [inner for _, inner in items]
        parts = pieces(segment, inners) if before == 1 else pieces(segment.reshape(before, -1), inners, axis=1)
        for (i, _), part in zip(items, parts):
            out[i] = unrow(part, lays[i], n)
    return out


def bucketed_reduce_scatter(grads, lays, axis_name: str, n: int, bucket_size: int, sumsq: list | None = None):
    """Whole local gradients -> this device's shards of their sums, one reduce-scatter per
    bucket of at most ``bucket_size`` elements (per dtype). With a list ``sumsq``, the float32
    sum of squares of this device's part of each bucket is appended to it (one reduction over
    the flat bucket, not one per leaf): together, this device's part of the shards' sum."""
    out = [None] * len(grads)
    for members in bucket_members(grads, lays, bucket_size):
        if len(members) == 1:
            out[members[0]] = reduce_scatter(grads[members[0]], lays[members[0]], axis_name)
            if sumsq is not None:
                sumsq.append(sum_of_squares(out[members[0]]))
            continue
        flat = jax.lax.psum_scatter(pack_rows(grads, lays, members, n), axis_name, scatter_dimension=0, tiled=True)
        if sumsq is not None:
            sumsq.append(sum_of_squares(flat))
        for i, shard in unpack_row(flat.reshape(-1), lays, members, n).items():
            out[i] = shard
    return out


def bucketed_all_reduce_slice(grads, lays, axis_name: str, n: int, bucket_size: int):
    """Whole local gradients -> this device's shards of their sums, like
    :func:`bucketed_reduce_scatter` but through one all-reduce per bucket of at most
    ``bucket_size`` elements, each device then keeping its own partition."""
    summed = bucketed_all_reduce(grads, lays, axis_name, bucket_size)
    return local_slices(summed, lays, axis_name, n)


def bucketed_gather(shards, lays, axis_name: str, n: int, bucket_size: int, apart: bool = False):
    """This device's shards -> whole (unpadded) leaves, one all-gather per bucket. ``apart``: each
    leaf cut from its bucket into a buffer of its own (:func:`own_buffers`), so that nothing that
    reads a leaf later keeps the whole bucket alive."""
    out = [None] * len(shards)
    for members in bucket_members(shards, lays, bucket_size):
        if len(members) == 1:
            out[members[0]] = gather(shards[members[0]], lays[members[0]], axis_name)
            continue
        flats = [shard_row(shards[i], lays[i]) for i in members]
        sizes = [f.size for f in flats]
        gathered = jax.lax.all_gather(jnp.concatenate(flats), axis_name, axis=0, tiled=False)  # (n, total)

        def cut(g, members=members, sizes=sizes):
            return [unrows(piece, lays[i]) for i, piece in zip(members, pieces(g, sizes, axis=1))]

        for i, x in zip(members, own_buffers(cut, gathered) if apart else cut(gathered)):
            out[i] = x
    return out


def own_buffers(fn, x):
    """``fn(x)`` (a list of arrays), each a buffer of its own that later readers cannot fuse back
    into a read of ``x``.

    A slice fused into its consumer reads the buffer it was cut from; when XLA recomputes that
    consumer later (the stage-3 backward pass recomputes GELU's input ``x @ w + b``, the bias a
    slice of a gathered bucket) the whole bucket stays alive until then. An optimization barrier
    separates them on most backends; the CPU backend expands barriers before fusing, and there
    the values are the outputs of a conditional whose predicate a barrier hides (as
    :func:`_offsets`)."""
    return list(_per_backend(lambda x: jax.lax.cond(jax.lax.optimization_barrier(jnp.asarray(True)), fn, fn, x),
                             lambda x: jax.lax.optimization_barrier(fn(x)), x))
