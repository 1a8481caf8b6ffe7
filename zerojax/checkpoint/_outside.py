"""Checkpoints of a run whose optimizer state the step keeps outside the TrainState.

With ``offload_optimizer="nvme"`` (and ZeRO-Infinity's ``offload_param="nvme"``) the fp32 master,
the optimizer's moments and the 16-bit params live in the NVMe store's files under
``nvme_path``; the TrainState holds the params (or only their shapes) and no optimizer state. A
checkpoint of such a run is still the one format every run writes (:mod:`._format`): the params
as their fp32 master values and the optimizer state as the tree ``tx.init`` builds, its moments
read from the store, its count and injected settings from the store's marker. So a checkpoint
of an NVMe run restores onto the device, CPU offload or NVMe, on any mesh and stage, and the
other way round.

Saving streams from the store: the committed slot is memory-mapped, each leaf a view of it,
and the write reads them from the files (the page cache, not the process's memory, holds
what is read). The store must hold the state's own step (its marker records the TrainState
steps its committed state belongs to); a state of another step is refused by name.

Restoring onto a target that keeps its optimizer state in the store reads the params to the
devices as any restore does (nothing, with the params on NVMe too) and streams the master, the
moments and the 16-bit params into the store's free slot, piece by piece, then commits it as
the checkpoint's step. A store that trained on past that step is rewound to it; the step built
next (or the one already built, at its next call) goes on from there.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

import zerojax._placement as placement
import zerojax.checkpoint._pieces as _pieces
from zerojax._errors import CheckpointError
from zerojax._plan import ZeroPlan, path_str
from zerojax._state import TrainState, params_held
from zerojax.offload._shards import ShardLayout

__all__ = ["format_leaves", "keeps_outside", "outside_tree", "restore_outside"]

_SLOT_REGIONS = ("m", "v")  # the store's regions holding the optimizer's slots, in order
_PIECE = 64 << 20  # bytes a piece of a leaf moved between a checkpoint and the store


def keeps_outside(plan: ZeroPlan) -> bool:
    """Whether the step keeps this plan's optimizer state outside the TrainState (NVMe)."""
    return plan.config.offload_optimizer == "nvme" and not plan.config.zenflow


# --------------------------------------------------------------------- the tree tx.init builds
def _recognized(plan: ZeroPlan, tx, doing: str):
    from zerojax.update._recognize import recognize

    opt = recognize(tx)
    if opt is None:
        raise CheckpointError(
            f"{doing}: this run's optimizer keeps its state in the NVMe store in a layout of its own (Muon), which a "
            "checkpoint does not read yet. Fix: checkpoint a Muon run with offload_optimizer 'cpu' or on the device")
    return opt


def _shadow(tx, opt, settings, count: int):
    """The optimizer state of a one-element param at ``count`` applied updates: the injected
    settings recorded by the store (``settings``), else ``tx.init`` with the node's count set."""
    from zerojax.update._recognize import StepSettings, node_of, with_node

    st = StepSettings(tx, opt)
    if st.shadow is not None:
        st.set_shadow(settings)
        return st.shadow
    shadow = tx.init(jnp.zeros((1,), jnp.float32))
    node = node_of(shadow, opt.kind) if opt.slots else None
    if node is not None and hasattr(node, "count"):
        shadow = with_node(shadow, node._replace(count=jnp.asarray(count, node.count.dtype)))
    return shadow


def _full_tree(plan: ZeroPlan, tx, opt, shadow, slot_trees):
    """``shadow`` with the optimizer node's slots replaced by params-shaped trees, checked
    against the structure ``tx.init`` builds for the model."""
    from zerojax.update._recognize import node_of, with_node

    tree = shadow
    if opt.slots:
        node = node_of(shadow, opt.kind)
        tree = with_node(shadow, node._replace(**dict(zip(opt.slots, slot_trees))))
    want = jax.tree_util.tree_structure(jax.eval_shape(tx.init, plan.abstract_master()))
    if jax.tree_util.tree_structure(tree) != want:
        raise CheckpointError(
            f"the optimizer's state ({opt.name}) does not have the structure optax builds for it, so its checkpoint "
            "could not be read by another tier. Fix: use optax's adam/adamw, sgd or lion, bare or under "
            "optax.inject_hyperparams, with offload_optimizer 'nvme'")
    return tree


class _Mark:
    """A placeholder leaf: slot ``k`` of param ``i`` (``i`` None: the node's one-element slot)."""

    def __init__(self, k, i=None):
        self.k, self.i = k, i


def _slot_paths(plan: ZeroPlan, tx, opt):
    """({path: (slot index, param index)} of the optimizer leaves mirroring params, [paths of the
    others in flatten order]) of the tree ``tx.init`` builds for the model."""
    marks = [plan.treedef.unflatten([_Mark(k, i) for i in range(len(plan.leaves))]) for k in range(len(opt.slots))]
    tree = _full_tree(plan, tx, opt, _shadow(tx, opt, None, 0), marks)
    mirrors, others = {}, []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, _Mark):
            mirrors[path_str(p)] = (x.k, x.i)
        else:
            others.append(path_str(p))
    return mirrors, others


def _restored_shadow(tx, opt, values: list):
    """The one-element shadow whose leaves that mirror no param are ``values`` (flatten order):
    (shadow, applied-update count or None where the optimizer keeps none)."""
    from zerojax.update._recognize import node_of, with_node

    base = _shadow(tx, opt, None, 0)
    node = node_of(base, opt.kind) if opt.slots else None
    marked = with_node(base, node._replace(**{s: _Mark(k) for k, s in enumerate(opt.slots)})) if node else base
    leaves, treedef = jax.tree_util.tree_flatten(marked)
    it = iter(values)
    filled = treedef.unflatten([x if isinstance(x, _Mark) else jnp.asarray(next(it), x.dtype) for x in leaves])
    if node is None:
        return filled, None
    got = node_of(filled, opt.kind)
    shadow = with_node(filled, got._replace(**{s: getattr(node, s) for s in opt.slots}))
    return shadow, (int(got.count) if hasattr(got, "count") else None)


# ----------------------------------------------------------------------------------- saving
class StoreView(np.ndarray):
    """A leaf of the store's committed slot, memory-mapped, that the checkpoint writes from where
    it lies. Orbax copies every numpy leaf it is given before writing it (``copy.deepcopy``), which
    would hold the whole master and moments in memory at once; a copy of this view is the view.
    That is safe because a save of such a state waits for its write, and no step rewrites the
    committed slot before the step after next."""

    def __deepcopy__(self, memo):
        return self


def _leaf_view(plan: ZeroPlan, layout, disk, flat: np.ndarray, i: int) -> np.ndarray:
    """Leaf ``i`` of a store region in its logical shape: a view, nothing read."""
    lay = plan.leaves[i]
    off, shape = layout.offsets[i], layout.shapes[i]
    x = flat[off:off + math.prod(shape)].reshape(shape)
    if disk is not None and lay.params_partitioned:
        x = np.moveaxis(x, 0, lay.axis)[tuple(slice(0, d) for d in lay.shape)]
    return x.view(StoreView)


def _checksum(x: np.ndarray) -> int:
    """format._checksum of a (possibly memory-mapped) array, a piece at a time."""
    total = 0
    for box in _pieces.boxes((0,) * x.ndim, x.shape, x.dtype.itemsize, _PIECE):
        total += _pieces.np_checksum(x[box])
    return total % (1 << 32)


def outside_tree(state: TrainState, doing: str):
    """(tree, per-leaf metadata, checksums) a save writes for a state whose optimizer state is in
    the NVMe store: the params as the store's fp32 master, the optimizer state as ``tx.init``'s
    tree (the moments memory-mapped from the committed slot)."""
    from zerojax.offload._nvme import committed_regions, read_marker
    from zerojax.offload._nvme_step import store_layout, store_path

    plan, tx = state.plan, state.tx
    opt = _recognized(plan, tx, doing)
    path = store_path(plan.config)
    marker = read_marker(path) if os.path.isdir(path) else None
    at = int(state.step)
    layout, disk, _ = store_layout(plan)
    held = None if marker is None else marker.get("state_step")
    # several processes: each holds its own partitions (ShardLayout), or its rows of the params' disk layout
    shards = isinstance(layout, ShardLayout) or (disk is not None and jax.process_count() > 1)
    if held is not None and marker.get("since", held) <= at <= held:
        regions = committed_regions(path, marker)
        if shards:  # global arrays, each process's shards from its own store
            as_arrays = layout.arrays if disk is None else (lambda flat: _storage_order(disk, disk.shards.arrays(flat)))
            master = as_arrays(regions["master"])
            slots = [as_arrays(regions[r]) for r in _SLOT_REGIONS[:len(opt.slots)]]
        else:
            master = [_leaf_view(plan, layout, disk, regions["master"], i) for i in range(len(plan.leaves))]
            slots = [[_leaf_view(plan, layout, disk, regions[r], i) for i in range(len(plan.leaves))]
                     for r in _SLOT_REGIONS[:len(opt.slots)]]
        count, settings = int(marker["count"]), marker.get("settings")
    elif at == 0 and params_held(state.params):  # no step has run: what the step's store would start from
        if shards and disk is not None:  # the params as they are stored (stage 3), widened
            master = jax.jit(lambda p: [x.astype(jnp.float32) for x in plan.treedef.flatten_up_to(p)])(state.params)
            slots = [[jnp.zeros_like(x) for x in master] for _ in opt.slots]
        elif shards:
            master = jax.jit(lambda p: [placement.pad(x.astype(jnp.float32), lay) if plan.opt_partitioned(lay)
                                        else x.astype(jnp.float32) for lay, x in
                                        zip(plan.leaves, placement.params_logical(plan, p))],
                             out_shardings=list(layout.shardings))(state.params)
            slots = [[jnp.zeros_like(x) for x in master] for _ in opt.slots]
        else:
            master = [np.asarray(x, np.float32) for x in placement.params_logical(plan, state.params)]
            slots = [[np.zeros(lay.shape, np.float32) for lay in plan.leaves] for _ in opt.slots]
        count, settings = 0, None
    else:
        what = "nothing" if held is None else f"the optimizer state of step {held}"
        raise CheckpointError(
            f"{doing}: this state is at step {at} and its optimizer state lives in {path} "
            f"(offload_optimizer='nvme'), which holds {what}: a checkpoint would mix two steps. Fix: save the state "
            "the last step returned, before another step or a restore rewrites the store")
    return format_leaves(plan, tx, opt, master, slots, settings, count)


def format_leaves(plan: ZeroPlan, tx, opt, master: list, slots: list, settings, count: int):
    """(params, optimizer leaves, their metadata, checksums) of the one format every tier writes,
    from the fp32 master's leaves, the optimizer's slots (one list of params-shaped numpy leaves
    per slot), the injected settings' shadow leaves (or None) and the applied-update count."""
    shadow = _shadow(tx, opt, settings, count)
    slot_trees = [plan.treedef.unflatten(leaves) for leaves in slots]
    tree = _full_tree(plan, tx, opt, shadow, slot_trees)
    mirrors, _ = _slot_paths(plan, tx, opt)
    # the slots as given (memory maps, or global arrays of several processes); the counts and settings on the host
    opt_flat = {path_str(p): (x if path_str(p) in mirrors else np.asarray(jax.device_get(x)))
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    params = {lay.path: x for lay, x in zip(plan.leaves, master)}
    meta_opt = {}
    for p, x in opt_flat.items():
        lay = plan.leaves[mirrors[p][1]] if p in mirrors else None
        meta_opt[p] = {"shape": list(lay.shape if lay is not None else x.shape), "dtype": np.dtype(x.dtype).name,
                       "mirrors": None if lay is None else lay.path}
    named = {**{"params/" + k: v for k, v in params.items()}, **{"opt_state/" + k: v for k, v in opt_flat.items()}}
    on_devices = {k: v for k, v in named.items() if isinstance(v, jax.Array)}  # summed over every process
    sums = {**_pieces.host_checksums(on_devices),
            **{k: _checksum(v) for k, v in named.items() if k not in on_devices}}
    return params, opt_flat, meta_opt, sums


# --------------------------------------------------------------------------------- restoring
def _stream(state_dir: str, key: str, logical_shape, dest: np.ndarray, ctx) -> int:
    """Copies the stored leaf ``key`` (its logical region) into ``dest`` piece by piece; returns
    the checksum of what was read."""
    pieces, checksum = _pieces.read_pieces(state_dir, key, logical_shape, _PIECE, ctx)
    for box, piece in pieces:
        dest[box] = piece
    return checksum()


def restored_settings(state_dir: str, tx, opt, others: list, at: int, sums: dict, ctx) -> tuple:
    """(applied-update count, injected settings as JSON or None) read from a checkpoint's optimizer
    leaves that mirror no param (``others``: their paths; a few scalars), their checksums added to
    ``sums``. Without a count in the optimizer's state it is the TrainState step ``at``."""
    from zerojax.update._recognize import StepSettings, shadow_json

    small = []
    for p in others:
        x = np.asarray(_pieces.open_array(state_dir, "opt_state/" + p, ctx).read().result())
        sums["opt_state/" + p] = _pieces.np_checksum(x)
        small.append(x)
    shadow, count = _restored_shadow(tx, opt, small)
    # injected settings: the schedule goes on from the restored ones
    settings = shadow_json(shadow) if StepSettings(tx, opt).shadow is not None else None
    return (int(at) if count is None else count), settings


def check_outside_target(meta: dict, plan: ZeroPlan, tx, mismatch: str) -> None:
    """The checkpoint's optimizer leaves against the tree ``tx.init`` builds for the target."""
    opt = _recognized(plan, tx, "restore")
    mirrors, others = _slot_paths(plan, tx, opt)
    have = {k: tuple(v["shape"]) for k, v in meta["opt_state"].items()}
    want = {p: tuple(plan.leaves[i].shape) for p, (_, i) in mirrors.items()}
    problems = [f"  opt_state/{k}: in the target {want[k]} but not in the checkpoint" for k in sorted(set(want) - set(have))]
    problems += [f"  opt_state/{k}: checkpoint shape {have[k]}, target shape {want[k]}"
                 for k in sorted(set(want) & set(have)) if have[k] != want[k]]
    problems += [f"  opt_state/{k}: in the target but not in the checkpoint" for k in others if k not in have]
    problems += [f"  opt_state/{k}: in the checkpoint {have[k]} but not in the target"
                 for k in sorted(set(have) - set(want) - set(others))]
    if problems:
        raise CheckpointError(mismatch + ":\n" + "\n".join(problems) +
                              "\nBuild the target from the same model and optimizer that were saved.")


def restore_outside(step_dir: str, meta: dict, target: TrainState, at: int) -> dict:
    """Streams a checkpoint's master, optimizer leaves (and, with the params on NVMe, the 16-bit
    params) into the target's NVMe store and commits them as TrainState step ``at``; returns
    the checksums of what it read."""
    from zerojax.offload._nvme import NvmeOptimizerStore, _validate_dir
    from zerojax.offload._nvme_step import store_layout, store_path
    from zerojax.checkpoint._tree import STATE

    plan, tx, cfg = target.plan, target.tx, target.plan.config
    opt = _recognized(plan, tx, "restore")
    mirrors, others = _slot_paths(plan, tx, opt)
    state_dir = os.path.join(step_dir, STATE)
    ctx = _pieces.context()
    sums: dict = {}
    count, settings = restored_settings(state_dir, tx, opt, others, at, sums, ctx)
    layout, disk, p16 = store_layout(plan)
    by_slot = {(k, i): p for p, (k, i) in mirrors.items()}
    if isinstance(layout, ShardLayout) or (disk is not None and jax.process_count() > 1):
        write = _shard_writer(step_dir, meta, plan, layout, disk, opt, by_slot, sums)  # each process its own part
    else:
        write = _writer(step_dir, meta, plan, layout, disk, opt, by_slot, sums, ctx)

    _validate_dir(cfg.nvme_path)
    path = store_path(cfg)
    os.makedirs(path, exist_ok=True)
    n = layout.total
    store = NvmeOptimizerStore(path, n, int(min(cfg.sub_group_size, n)), params_dtype=p16)
    try:
        store.load(write, count, {"state_step": int(at), "since": int(at), "settings": settings,
                                  "optimizer": "optax"})
    finally:
        store.close()
    return sums


def _writer(step_dir, meta, plan, layout, disk, opt, by_slot, sums, ctx):
    """``write(regions)`` streaming a checkpoint's leaves into one process's store of the whole state."""
    from zerojax.checkpoint._tree import STATE, verify

    state_dir = os.path.join(step_dir, STATE)

    def write(regions):
        for i, lay in enumerate(plan.leaves):
            for region, key in [("master", "params/" + lay.path)] + [
                    (_SLOT_REGIONS[k], "opt_state/" + by_slot[(k, i)]) for k in range(len(opt.slots))]:
                whole = _leaf_view(plan, layout, None, regions[region], i)  # disk order, padded
                if disk is not None and lay.params_partitioned:
                    whole[...] = 0  # the padding of a split leaf stays zero
                    dest = np.moveaxis(whole, 0, lay.axis)[tuple(slice(0, d) for d in lay.shape)]
                else:
                    dest = whole
                sums[key] = _stream(state_dir, key, tuple(lay.shape), dest, ctx)
                verify(meta, {key: sums[key]}, step_dir)  # a damaged leaf: nothing is committed
            if "params" in regions:  # ZeRO-Infinity's 16-bit params, rounded from the master
                src = _leaf_view(plan, layout, None, regions["master"], i)
                dst = _leaf_view(plan, layout, None, regions["params"], i)
                for box in _pieces.boxes((0,) * src.ndim, src.shape, 4, _PIECE):
                    dst[box] = src[box].astype(dst.dtype)
        for k in range(len(opt.slots), len(_SLOT_REGIONS)):  # a region the optimizer does not use
            regions[_SLOT_REGIONS[k]][...] = 0

    return write


def _storage_order(disk, arrays: list) -> list:
    """Global arrays of the params' disk layout (split dimension first) -> the plan's storage layout."""
    plan = disk.plan
    return jax.jit(lambda xs: [disk.from_local(i, x) for i, x in enumerate(xs)],
                   out_shardings=[disk.storage_sharding(i) for i in range(len(plan.leaves))])(arrays)


def _shard_writer(step_dir, meta, plan, layout, disk, opt, by_slot, sums):
    """``write(regions)`` reading each leaf (the param's master and the slots mirroring it) as global
    arrays (the update layout; with the params on NVMe, their storage layout), each process's shards
    into its own store."""
    import orbax.checkpoint as ocp

    from zerojax.checkpoint._tree import lookup, nest, verify
    from zerojax.checkpoint._steps import read_state
    from zerojax.offload._shards import _key

    def write(regions):
        for i, lay in enumerate(plan.leaves):
            keys = [("master", "params/" + lay.path)] + [
                (_SLOT_REGIONS[k], "opt_state/" + by_slot[(k, i)]) for k in range(len(opt.slots))]
            if disk is None:
                want = jax.ShapeDtypeStruct(layout.shapes[i], np.float32, sharding=layout.shardings[i])
            else:
                shape = lay.storage_shape if lay.params_partitioned else lay.shape
                want = jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=disk.storage_sharding(i))
            item = nest({key: want for _, key in keys})
            args = jax.tree_util.tree_map(lambda s: ocp.ArrayRestoreArgs(
                sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False), item)
            got = read_state(step_dir, item, args)
            arrays = {key: lookup(got, key) for _, key in keys}
            part = _pieces.host_checksums(arrays)  # the zero padding adds nothing to a checksum
            for region, key in keys:
                sums[key] = part[key]
                verify(meta, {key: part[key]}, step_dir)  # a damaged leaf: nothing is committed
                if disk is not None:
                    rows = disk.in_disk_order(i, arrays[key])
                    disk.shards.fill_leaf(regions[region], i, rows)
                    if region == "master" and "params" in regions:  # the 16-bit params, rounded from the master
                        disk.shards.fill_leaf(regions["params"], i, rows)
                    continue
                views = dict(layout.views(regions[region], i))
                for shard in arrays[key].addressable_shards:
                    k = _key(shard.index, layout.shapes[i])
                    if k in views:
                        views[k][...] = np.asarray(shard.data)
        for k in range(len(opt.slots), len(_SLOT_REGIONS)):
            regions[_SLOT_REGIONS[k]][...] = 0

    return write
