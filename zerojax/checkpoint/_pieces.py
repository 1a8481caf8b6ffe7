"""One stored array read in pieces, for a leaf larger than the restore budget and for
consolidation: tensorstore reads boxes of the array (each at most ``piece_bytes``, aligned to the
stored chunks where they allow it) and every box goes straight into the destination, a device
shard of the restored leaf or the consolidated file, before the next one is read. The host then
holds one box (and the one stored chunk tensorstore decodes it from) beside the destination,
never the whole leaf twice.

    store = open_array(state_dir, "params/emb", context())
    for box in boxes(lo, hi, itemsize, piece_bytes, align=chunk_shape(store)):
        piece = read_box(store, box)        # a numpy array of the box's shape

Arrays are written in chunks of at most :data:`CHUNK_BYTES` (Orbax's ``chunk_byte_size``) so
that reading any box decodes at most one such chunk beyond the box itself.
"""
from __future__ import annotations

import functools
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from zerojax._compat import shard_map
from zerojax._errors import CheckpointError
from zerojax._plan import path_str
from zerojax.offload._host_buffers import release  # noqa: F401  (used as _pieces.release)

__all__ = ["CHUNK_BYTES", "MIN_PIECE", "boxes", "build_leaf", "chunk_shape", "context", "host_checksums",
           "np_checksum", "open_array", "read_box", "read_pieces", "read_tree", "release", "unreadable"]

# the largest stored chunk (bytes) a save writes: a restore in pieces decodes one at a time
CHUNK_BYTES = 8 << 20
# pieces are never smaller than this, whatever the budget: smaller reads cost more than they save
MIN_PIECE = 64 << 10


def context() -> ts.Context:
    """One tensorstore context per restore or consolidation: Orbax's file concurrency, and an OCDBT
    node cache of one chunk's size (Orbax's default keeps up to 100 MB of nodes beside the pieces,
    which a read that visits every key once does not need)."""
    return ts.Context({"file_io_concurrency": {"limit": 128}, "cache_pool#ocdbt": {"total_bytes_limit": CHUNK_BYTES}})


def _layout(state_dir: str) -> tuple[bool, bool]:
    """(OCDBT, zarr3) of a stored PyTree item, from Orbax's own metadata file."""
    try:
        with open(os.path.join(state_dir, "_METADATA"), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {os.path.join(state_dir, '_METADATA')} ({type(e).__name__}: {e}); the "
                              "step is incomplete or damaged. Restore another step.") from None
    return bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False))


def open_array(state_dir: str, key: str, ctx: ts.Context):
    """The tensorstore array of the leaf ``key`` ("params/emb", "opt_state/0/mu/emb")."""
    use_ocdbt, use_zarr3 = _layout(state_dir)
    info = ocp.type_handlers.ParamInfo(name=key.replace("/", "."), parent_dir=pathlib.Path(state_dir),
                                       is_ocdbt_checkpoint=use_ocdbt, use_zarr3=use_zarr3, ts_context=ctx)
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
    try:
        return ts.open(spec, open=True, read=True, context=ctx).result()
    except Exception as e:  # tensorstore raises ValueError / OSError for a missing or damaged array
        raise unreadable(key, os.path.dirname(state_dir), e) from e


def unreadable(key: str, step_dir: str, e: BaseException) -> CheckpointError:
    """The error for a stored array tensorstore could not open or read (a missing or damaged
    chunk: tensorstore raises ValueError or OSError)."""
    return CheckpointError(f"cannot read {key} of checkpoint {step_dir}: {type(e).__name__}: {e}")


def chunk_shape(store) -> tuple[int, ...]:
    return tuple(store.chunk_layout.read_chunk.shape)


def read_box(store, box: tuple[slice, ...]) -> np.ndarray:
    """The values of ``box`` (one slice per dimension) as a fresh numpy array."""
    return store[box].read().result()


def boxes(lo, hi, itemsize: int, piece_bytes: int, align=None):
    """Boxes (tuples of slices) covering the region [lo, hi), in row-major order, each of at most
    ``piece_bytes`` (a single element may be larger). The first dimension is cut where a box can
    still hold whole rows, at multiples of ``align`` (the stored chunk shape) when a box holds a
    whole chunk of rows; a row larger than a piece is cut along the next dimension, and so on.
    Consecutive boxes are consecutive in the region's row-major order."""
    lo, hi = tuple(int(v) for v in lo), tuple(int(v) for v in hi)
    ndim = len(lo)
    if any(h <= a for a, h in zip(lo, hi)):
        return
    if ndim == 0:
        yield ()
        return

    def rest(k):
        return tuple(slice(lo[i], hi[i]) for i in range(k, ndim))

    def cut(prefix, k):
        inner = itemsize * math.prod(hi[i] - lo[i] for i in range(k + 1, ndim))  # one index of dim k
        if inner * (hi[k] - lo[k]) <= piece_bytes:
            yield prefix + rest(k)
            return
        if inner > piece_bytes and k < ndim - 1:  # one index of dimension k is too large: cut below it
            for i in range(lo[k], hi[k]):
                yield from cut(prefix + (slice(i, i + 1),), k + 1)
            return
        step = max(1, piece_bytes // inner)
        if align is not None and 0 < align[k] <= step:
            step -= step % align[k]
        a = lo[k]
        while a < hi[k]:
            b = min(hi[k], (a // step + 1) * step)
            yield prefix + (slice(a, b),) + rest(k + 1)
            a = b

    yield from cut((), 0)


def read_pieces(state_dir: str, key: str, shape, piece_bytes: int, ctx):
    """The logical values of the stored leaf ``key`` (``shape``: its logical shape) as
    ``(box, numpy piece)`` pairs, row-major boxes of at most ``piece_bytes`` aligned to the stored
    chunks, and a function returning the checksum of the pieces yielded so far. A missing or
    damaged chunk is a CheckpointError naming the leaf."""
    store = open_array(state_dir, key, ctx)
    shape = tuple(shape)
    total = [0]

    def pieces():
        try:
            for box in boxes((0,) * len(shape), shape, 4, piece_bytes, chunk_shape(store) if shape else None):
                x = read_box(store, box)
                total[0] = (total[0] + np_checksum(x)) % (1 << 32)
                yield box, x
        except CheckpointError:
            raise
        except Exception as e:  # tensorstore raises ValueError / OSError for a damaged or missing chunk
            raise unreadable(key, os.path.dirname(state_dir), e) from e

    return pieces(), lambda: total[0]


def read_tree(state_dir: str, item: dict, restore_args: dict) -> dict:
    """What Orbax's PyTree restore of ``item`` (nested dicts of leaves, ``restore_args`` their
    ``ArrayRestoreArgs``) gives, read by tensorstore directly in one process: every leaf's read
    is issued before the first is waited on (Orbax reads a few shards at a time, at half the
    disk's speed with the page cache dropped), each array is padded with zeros or cut to the
    global shape asked (Orbax's ``strict=False``), cast to the dtype asked and put on its
    sharding. A missing or damaged array is a CheckpointError naming the leaf."""
    ctx = context()
    args, treedef = jax.tree_util.tree_flatten_with_path(restore_args)
    keys = [path_str(path) for path, _ in args]
    reads = []
    for key, (_, arg) in zip(keys, args):
        store = open_array(state_dir, key, ctx)
        try:
            region = tuple(slice(0, min(a, b)) for a, b in zip(store.shape, arg.global_shape))
            dest = np.empty([r.stop for r in region], store.dtype.numpy_dtype)
            reads.append((dest, ts.array(dest, copy=False, write=True).write(store[region])))
        except Exception as e:  # tensorstore raises ValueError / OSError
            raise unreadable(key, os.path.dirname(state_dir), e) from e
    out = []
    for key, (_, arg), (data, done) in zip(keys, args, reads):
        try:
            done.result()
        except Exception as e:  # a missing or damaged chunk
            raise unreadable(key, os.path.dirname(state_dir), e) from e
        if data.shape != tuple(arg.global_shape):  # the stored region, zeros past it
            data = np.pad(data, [(0, g - n) for g, n in zip(arg.global_shape, data.shape)])
        out.append(jax.device_put(data.astype(arg.dtype, copy=False), arg.sharding))
        del data
    return jax.tree_util.tree_unflatten(treedef, out)


def np_checksum(x: np.ndarray) -> int:
    """The checkpoint's per-leaf checksum (format._checksum) of some of a leaf's values, on the
    host: the sum of their bit patterns, wrapping in uint32, so the sums of pieces add up."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_ or x.dtype.itemsize == 1:
        return int(x.astype(np.uint32).sum(dtype=np.uint32))
    if x.dtype.itemsize == 2:
        return int(x.view(np.uint16).sum(dtype=np.uint32))
    return int(x.view(np.uint32).sum(dtype=np.uint32))


def host_checksums(arrays: dict) -> dict:
    """The checksum (format._checksum) of each jax array in ``arrays``, summed by numpy over its
    distinct shards (zero-copy views of CPU devices' buffers) and over every process."""
    keys = list(arrays)
    partial = np.zeros(len(keys), np.uint32)
    for k, key in enumerate(keys):
        x = arrays[key]
        first = _first_holders(x.sharding, x.shape)
        total = 0
        for shard in x.addressable_shards:
            if shard.device in first:
                total += np_checksum(np.asarray(shard.data))
        partial[k] = total % (1 << 32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        partial = np.asarray(multihost_utils.process_allgather(partial)).sum(axis=0, dtype=np.uint32)
    return {key: int(v) for key, v in zip(keys, partial)}


@functools.partial(jax.jit, donate_argnums=0)
def _put(buf, piece, starts):
    """``piece`` written into ``buf`` at ``starts``, in place (``buf`` is donated)."""
    return jax.lax.dynamic_update_slice(buf, piece.astype(buf.dtype), starts)


def _bounds(index, shape):
    lo = tuple(0 if s.start is None else s.start for s in index)
    hi = tuple(d if s.stop is None else s.stop for s, d in zip(index, shape))
    return lo, hi


def _first_holders(sharding, shape) -> set:
    """The devices that count each distinct shard once (the first holder of each index, in the
    sharding's device order: the same in every process)."""
    seen, first = set(), set()
    for dev, index in sharding.devices_indices_map(tuple(shape)).items():
        key = _bounds(index, shape)
        if key not in seen:
            seen.add(key)
            first.add(dev)
    return first


def _global_sum(sharding, partial: dict) -> jax.Array:
    """The uint32 sum over every process of the per-device ``partial`` sums, replicated."""
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    mesh = Mesh(np.array(devices), ("i",))
    local = [jax.device_put(np.array([partial.get(d, 0) % (1 << 32)], np.uint32), d)
             for d in devices if d.process_index == jax.process_index()]
    parts = jax.make_array_from_single_device_arrays((len(devices),), NamedSharding(mesh, P("i")), local)
    return _sum(parts, NamedSharding(mesh, P()))


@functools.partial(jax.jit, static_argnums=1)
def _sum(parts, out):
    return jax.lax.with_sharding_constraint(jnp.sum(parts, dtype=jnp.uint32), out)


@functools.lru_cache(maxsize=64)
def _put_all(sharding: NamedSharding):
    """``piece`` written into every device's shard of ``buf`` at the same local ``starts``, in
    place: one program for the whole mesh (a program per device costs a compile each)."""
    body = lambda buf, piece, starts: jax.lax.dynamic_update_slice(buf, piece.astype(buf.dtype), starts)
    spec = sharding.spec
    return jax.jit(shard_map(body, sharding.mesh, in_specs=(spec, spec, P()), out_specs=spec), donate_argnums=0)


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype: str, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def build_leaf(store, logical_shape, shape, dtype, sharding, piece_bytes: int, checksum: bool):
    """The leaf read from ``store`` laid out as ``shape`` / ``dtype`` / ``sharding`` (zeros past
    ``logical_shape``: the padding of a split dimension), box by box. Returns (array, checksum of
    the logical values as a replicated uint32 scalar, or None).

    When every device holds a shard of one shape in device memory (a NamedSharding: what a
    restore target uses), each step reads the same local box of every device's shard and writes
    them all with one program; otherwise (host memory, uneven shards) one device shard is built
    at a time and moved to its memory once complete."""
    shape, logical_shape = tuple(shape), tuple(logical_shape)
    itemsize = np.dtype(store.dtype.numpy_dtype).itemsize
    bounds = {dev: _bounds(index, shape) for dev, index in sharding.addressable_devices_indices_map(shape).items()}
    first = _first_holders(sharding, shape) if checksum else set()
    local = {tuple(h - a for a, h in zip(lo, hi)) for lo, hi in bounds.values()}
    sums: dict = {}
    if (isinstance(sharding, NamedSharding) and len(local) == 1 and sharding.memory_kind in (None, "device")
            and len(shape) > 0):
        out = _build_whole_mesh(store, logical_shape, shape, dtype, sharding, piece_bytes, itemsize, bounds,
                                local.pop(), first, sums)
    else:
        out = _build_by_device(store, logical_shape, shape, dtype, sharding, piece_bytes, itemsize, bounds,
                               first, sums)
    return out, (_global_sum(sharding, sums) if checksum else None)


def _read_part(store, logical_shape, region, box_shape, dtype):
    """``region`` (global slices) of the stored leaf as an array of ``box_shape``: the part past
    ``logical_shape`` (split-dimension padding) is zeros."""
    cut = tuple(slice(r.start, min(r.stop, n)) for r, n in zip(region, logical_shape))
    if any(c.stop <= c.start for c in cut):
        return np.zeros(box_shape, dtype)
    x = read_box(store, cut)
    if x.shape != tuple(box_shape):
        full = np.zeros(box_shape, x.dtype)
        full[tuple(slice(0, n) for n in x.shape)] = x
        x = full
    return x


def _build_whole_mesh(store, logical_shape, shape, dtype, sharding, piece_bytes, itemsize, bounds, local,
                      first, sums):
    counts = tuple(n // m for n, m in zip(shape, local))  # shards along each dimension
    buf = _zeros(shape, np.dtype(dtype).name, sharding)()
    put = _put_all(sharding)
    # the boxes of all local devices are in host memory together: each is a share of a piece
    per_device = max(piece_bytes // max(1, len(bounds)), MIN_PIECE // 16)
    for box in boxes((0,) * len(shape), local, itemsize, per_device, chunk_shape(store)):
        box_shape = tuple(b.stop - b.start for b in box)
        parts, read = [], {}
        for dev, (lo, _) in bounds.items():
            if lo not in read:  # replicas of one shard read it once
                region = tuple(slice(a + b.start, a + b.stop) for a, b in zip(lo, box))
                read[lo] = _read_part(store, logical_shape, region, box_shape, store.dtype.numpy_dtype)
            if dev in first:
                sums[dev] = (sums.get(dev, 0) + np_checksum(read[lo])) % (1 << 32)
            parts.append(jax.device_put(read[lo], dev))
        del read
        piece = jax.make_array_from_single_device_arrays(
            tuple(n * c for n, c in zip(box_shape, counts)), sharding, parts)
        del parts
        buf = put(buf, piece, tuple(np.int32(b.start) for b in box))
        del piece
        release()
    return buf


def _build_by_device(store, logical_shape, shape, dtype, sharding, piece_bytes, itemsize, bounds, first, sums):
    kind = sharding.memory_kind
    shards = []
    for dev, (lo, hi) in bounds.items():
        buf = jnp.zeros(tuple(h - a for a, h in zip(lo, hi)), dtype, device=SingleDeviceSharding(dev))
        cut_hi = tuple(min(h, n) for h, n in zip(hi, logical_shape))
        for box in boxes(lo, cut_hi, itemsize, piece_bytes, chunk_shape(store)):
            piece = read_box(store, box)
            if dev in first:
                sums[dev] = (sums.get(dev, 0) + np_checksum(piece)) % (1 << 32)
            buf = _put(buf, jax.device_put(piece, dev), tuple(np.int32(s.start - a) for s, a in zip(box, lo)))
            del piece
            release()
        if kind not in (None, "device"):
            buf = jax.device_put(buf, SingleDeviceSharding(dev, memory_kind=kind))
        shards.append(buf)
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)
