"""The checkpoint format: checkpoints that restore onto any mesh size, any stage and any offload
setting.

    mngr = zj.checkpoint.CheckpointManager("/ckpt", max_to_keep=3, best_metric="loss")
    mngr.save(step, state, metrics={"loss": 1.7}, data_state={"epoch": 2})   # asynchronous
    ...
    state, data_state = mngr.restore(zj.abstract_train_state(init_fn, tx, mesh=mesh, config=config))
    zj.checkpoint.consolidate("/ckpt", "model.safetensors", dtype="bfloat16")

What is stored. Every parameter is stored as its fp32 value (the master copy when there is one)
and every optimizer leaf that mirrors a parameter (Adam's moments and the like) likewise (bf16
model states are widened on save and rounded to the target's dtypes on restore), in the
user's logical shape except for one thing: a leaf that the saving mesh splits over the data axis
is written split, with its split dimension zero-padded to a multiple of the data-axis size (jax
cannot lay out an array whose dimension does not divide the devices, so the unpadded leaf could
not stay split while it is written, and gathering it whole would put a whole leaf on one host).
The logical shapes are in the metadata and restore reads exactly the logical region: Orbax
truncates or zero-pads a stored array to the shape asked for, so a target with another mesh,
another split dimension or no split reads what it needs straight from disk. Nothing depends
on the stage, the compute dtype or the offload setting of the run that saved.

On-disk layout (plain Orbax; ``orbax.checkpoint`` alone restores it)::

    DIR/<step>/                       an Orbax CheckpointManager step (written to a temporary
                                      directory and renamed when complete)
        state/                        PyTree item (OCDBT): {"params": {...}, "opt_state": {...},
                                      "step": i32[], "loss_scale": {...}, "rng": u32[2]}; nested
                                      dicts keyed by the tree path's parts ("opt_state/0/mu/emb");
                                      a ZenFlow run's engine under "zenflow" (_zenflow_state.py)
        zerojax/metadata              JSON: format, logical shape and dtype per leaf, per-leaf
                                      checksums, the saving run's stage / mesh / process
                                      count / precision, the data state's digest ("files")
                                      and its own ("checksum"): see integrity.py
        data_state/metadata           JSON: the user's data_state dict ({} when none)
        model_16bit.safetensors       only with ZeroConfig(gather_16bit_weights_on_model_save=True)

To read it without zerojax, in any process (any device count), restore every leaf as a numpy
array and slice each to the ``shape`` recorded for it in ``zerojax/metadata`` (a plain
``PyTreeCheckpointer().restore(path)`` needs the saving run's device count)::

    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(f"{DIR}/{step}/state").item_metadata.tree
    args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = ckptr.restore(f"{DIR}/{step}/state", args=ocp.args.PyTreeRestore(restore_args=args))
    shapes = json.load(open(f"{DIR}/{step}/zerojax/metadata"))   # ["params"][path]["shape"]

Crash safety. A step that is not complete (a leftover temporary directory from a killed save,
or a step directory without its metadata) is skipped with a warning naming it; restore takes
the newest complete step (or, with ``step="latest_intact"``, the newest step that verifies).
Every leaf carries a checksum of its logical values, checked on restore, and the JSON files
carry digests, so a damaged or missing file is a CheckpointError naming it, never zeros or a
wrong data state. A failed save (a full disk) is a CheckpointError naming the step and the
cause; the manager goes on from the complete steps on disk (see manager.py).

Several processes (``zj.distributed.initialize()``). Every process calls ``save`` and ``restore``
with the same step; each writes and reads only the shards of its own devices, so the directory
must be one that every process sees (a shared filesystem or an object store). A checkpoint
written by any number of processes restores with any other number, as it does onto any mesh.
``consolidate`` reads leaf by leaf in the one process that calls it, without waiting for the
others; the 16-bit copy below is written by process 0.

``gather_16bit_weights_on_model_save``: after a save's asynchronous write has finished (at
``wait_until_finished()``, the next ``save`` or ``close()``), the manager streams the params
into ``DIR/<step>/model_16bit.safetensors`` (the compute dtype, or bfloat16 under fp32).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
import zerojax.checkpoint._pieces as _pieces
from zerojax._errors import CheckpointError
from zerojax._plan import LeafLayout, ZeroPlan, path_str
from zerojax._state import TrainState, state_shardings
from zerojax.checkpoint._tree import (DATA, FORMAT, META, MISMATCH, READABLE_FORMATS, SAFETENSORS_16BIT,  # noqa: F401
                                      STATE, lookup, nest, verify)
from zerojax.checkpoint._outside import check_outside_target, keeps_outside, outside_tree, restore_outside
from zerojax.checkpoint._zenflow_state import KEY as ENGINE
from zerojax.checkpoint._zenflow_state import keeps_engine, restore_zenflow, zenflow_tree
from zerojax.offload._nvme_step import placeholders

__all__ = ["FORMAT", "logical_tree"]



# ------------------------------------------------------------------------- tree helpers
def _disk_split(plan: ZeroPlan, lay: LeafLayout) -> bool:
    """A param-like leaf is split over the data axis on disk (and while read) when it can be."""
    return lay.axis is not None and (plan.n > 1 or bool(lay.extra))


def _disk_shape(plan: ZeroPlan, lay: LeafLayout):
    return lay.storage_shape if _disk_split(plan, lay) else lay.shape


def _disk_sharding(plan: ZeroPlan, lay: LeafLayout) -> NamedSharding:
    return NamedSharding(plan.mesh, lay.spec(_disk_split(plan, lay), plan.data_axis))


def _device(s: NamedSharding) -> NamedSharding:
    return s if s.memory_kind in (None, "device") else s.with_memory_kind("device")


def _checksum(x) -> jax.Array:
    """Sum of the values' bit patterns, wrapping in uint32: order-free, so it is the same on any mesh."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_ or x.dtype.itemsize == 1:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.sum(bits.reshape(-1), dtype=jnp.uint32)


def _opt_entries(plan: ZeroPlan, opt_state) -> list[tuple[str, Any, LeafLayout | None]]:
    """(path, stored leaf, mirrored param layout or None) for every optimizer leaf."""
    flat = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    lays = plan.opt_leaf_layouts(opt_state, stored=True)
    return [(path_str(p), x, lay) for (p, x), lay in zip(flat, lays)]


def _disk_dtype(x, lay: LeafLayout | None) -> str:
    """An optimizer leaf's dtype on disk: float32 for a float leaf mirroring a param (bf16
    moments are widened on save and rounded again on restore into a bf16-state target)."""
    if lay is not None and jnp.issubdtype(x.dtype, jnp.floating):
        return "float32"
    return np.dtype(x.dtype).name


def _scaler_dict(loss_scale) -> dict:
    return dict(loss_scale._asdict())


# ----------------------------------------------------------------- compiled programs
# A save or restore runs one jitted program per state layout. They are kept here, keyed by the
# layout, so a steady-state save costs the copy and the write rather than a fresh trace and
# compile (a new closure per call would miss jax's own cache every time).
_PROGRAMS: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()
_MAX_PROGRAMS = 32
program_misses = 0  # programs built (cache misses), read by the tests


def layout_key(plan: ZeroPlan, opt_state) -> tuple:
    """What a save or restore program depends on: the plan's mesh, config and leaf layouts and
    the optimizer state's structure, shapes and dtypes (the memory kinds follow from them)."""
    avals = tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in jax.tree_util.tree_leaves(opt_state))
    key = (plan.mesh, plan.config, tuple(plan.leaves), plan.treedef, jax.tree_util.tree_structure(opt_state), avals)
    try:
        hash(key)
    except TypeError:  # a config holding dicts (a DeepSpeed optimizer block): its text stands for it
        key = (plan.mesh, repr(plan.config)) + key[2:]
    return key


def cached_program(key, make):
    global program_misses
    program = _PROGRAMS.get(key)
    if program is None:
        program_misses += 1
        program = _PROGRAMS[key] = make()
        while len(_PROGRAMS) > _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
    return program


def sums_on_host(plan: ZeroPlan) -> bool:
    """Whether a save or restore sums the checksums with numpy rather than in its program: on CPU
    devices, whose arrays are host memory already, numpy sums them many times faster than XLA:CPU
    reduces them on each simulated device (the padding of a split dimension is zeros, so a padded
    array sums to its logical values' checksum). An accelerator sums its shards in the program."""
    return all(d.platform == "cpu" for d in plan.mesh.devices.flat)


def _save_program(plan: ZeroPlan, tx, with_master: bool, opt, scaler_keys, checksums: bool = True):
    """The jitted state -> (logical tree, checksums) of a save; closes over layouts only. Without
    ``checksums`` the program returns {} for them (the host sums the tree: see logical_tree)."""
    homes = state_shardings(plan, tx)
    src_homes = homes.master if with_master else homes.params
    opt_meta = [(path, lay) for path, _, lay in opt]
    opt_homes = jax.tree_util.tree_leaves(homes.opt_state)

    def build(src, opt_leaves, step, loss_scale, rng):
        src = placement.fetch(src, src_homes)
        params, sums = {}, {}
        for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(src)):
            logical = placement.unpad(x, lay).astype(jnp.float32)
            params[lay.path] = placement.pad(logical, lay) if _disk_split(plan, lay) else logical
            sums["params/" + lay.path] = _checksum(logical)
        opt_out = {}
        for (path, lay), x, home in zip(opt_meta, opt_leaves, opt_homes):
            if home.memory_kind not in (None, "device"):
                x = jax.device_put(x, _device(home))
            if lay is not None:
                logical = placement.unpad(x, lay)
                if jnp.issubdtype(logical.dtype, jnp.floating):  # fp32 logical values, as the params
                    logical = logical.astype(jnp.float32)
                x = placement.pad(logical, lay) if _disk_split(plan, lay) else logical
            else:
                logical = x
            opt_out[path] = x
            sums["opt_state/" + path] = _checksum(logical)
        tree = {"params": params, "opt_state": opt_out, "step": step,
                "loss_scale": _scaler_dict(loss_scale), "rng": rng}
        # fresh buffers: the step donates the state while the write may still be reading
        return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree), (sums if checksums else {})

    rep = NamedSharding(plan.mesh, P())
    opt_out_sh = {path: _disk_sharding(plan, lay) if lay is not None else _device(home)
                  for (path, lay), home in zip(opt_meta, opt_homes)}
    out_sh = ({"params": {lay.path: _disk_sharding(plan, lay) for lay in plan.leaves},
               "opt_state": opt_out_sh, "step": rep, "loss_scale": {k: rep for k in scaler_keys}, "rng": rep}, rep)
    return jax.jit(build, out_shardings=out_sh)


# -------------------------------------------------------------------------------- save
def logical_tree(state: TrainState, doing: str = "save"):
    """(tree, metadata) written for ``state``: see the module docstring. Leaves stay split."""
    plan = state.plan
    if keeps_outside(plan) or keeps_engine(plan):  # the NVMe store's files, ZenFlow's buffers
        return _outside_logical_tree(state, doing)
    # the fp32 master when the state has one (not when the step keeps it: NVMe, ZenFlow)
    with_master = state.master is not None
    opt = _opt_entries(plan, state.opt_state)
    on_host = sums_on_host(plan)
    key = ("save", with_master, on_host, tuple(_scaler_dict(state.loss_scale))) + layout_key(plan, state.opt_state)
    program = cached_program(key, lambda: _save_program(plan, state.tx, with_master, opt,
                                                        tuple(_scaler_dict(state.loss_scale)), not on_host))
    src = state.master if with_master else state.params
    opt_leaves = [x for _, x, _ in opt]
    flat, sums = program(src, opt_leaves, state.step, state.loss_scale, state.rng)
    if on_host:
        sums = _pieces.host_checksums({**{"params/" + k: v for k, v in flat["params"].items()},
                                       **{"opt_state/" + k: v for k, v in flat["opt_state"].items()}})
    meta = _metadata(plan, {path: {"shape": list(lay.shape if lay is not None else x.shape),
                                   "dtype": _disk_dtype(x, lay), "mirrors": None if lay is None else lay.path}
                            for path, x, lay in opt}, sums)
    tree = dict(flat, params=nest(flat["params"]), opt_state=nest(flat["opt_state"]))
    return tree, meta


def _metadata(plan: ZeroPlan, opt_meta: dict, sums, **saved_with) -> dict:
    """The step's metadata (see the module docstring): the saving run, every leaf's logical shape
    and dtype (``opt_meta``: the optimizer's), and the checksums."""
    return {
        "format": FORMAT,
        "saved_with": {"stage": plan.stage, "devices": plan.n, "processes": jax.process_count(),
                       "precision": plan.config.precision, **saved_with},
        "params": {lay.path: {"shape": list(lay.shape), "dtype": np.dtype(lay.dtype).name} for lay in plan.leaves},
        "opt_state": opt_meta,
        "checksums": {k: int(v) for k, v in jax.device_get(sums).items()},
    }


def _outside_logical_tree(state: TrainState, doing: str):
    plan = state.plan
    engine = None
    if keeps_engine(plan):  # ZenFlow: the one format, and the engine's exact state beside it
        params, opt_flat, meta_opt, sums, engine, arrays = zenflow_tree(state, doing)
    else:
        params, opt_flat, meta_opt, sums = outside_tree(state, doing)
    meta = _metadata(plan, meta_opt, sums, offload_optimizer=plan.config.offload_optimizer)
    tree = {"params": nest(params), "opt_state": nest(opt_flat), "step": state.step,
            "loss_scale": _scaler_dict(state.loss_scale), "rng": state.rng}
    if engine is not None:
        meta[ENGINE], tree[ENGINE] = engine, nest(arrays)
    return tree, meta


# ----------------------------------------------------------------------------- restore
def _check_target(meta: dict, plan: ZeroPlan, opt) -> None:
    problems = []
    for kind, want in (("params", {lay.path: lay.shape for lay in plan.leaves}),
                       ("opt_state", {p: (lay.shape if lay is not None else tuple(x.shape)) for p, x, lay in opt})):
        have = {k: tuple(v["shape"]) for k, v in meta[kind].items()}
        for k in sorted(set(want) - set(have)):
            problems.append(f"  {kind}/{k}: in the target {want[k]} but not in the checkpoint")
        for k in sorted(set(have) - set(want)):
            problems.append(f"  {kind}/{k}: in the checkpoint {have[k]} but not in the target")
        for k in sorted(set(have) & set(want)):
            if have[k] != tuple(want[k]):
                problems.append(f"  {kind}/{k}: checkpoint shape {have[k]}, target shape {tuple(want[k])}")
    if problems:
        raise CheckpointError(
            MISMATCH + ":\n" + "\n".join(problems) +
            "\nBuild the target from the same model and optimizer that were saved "
            "(zj.abstract_train_state(init_fn, tx, mesh=..., config=...)).")


def _flat_spec(meta: dict, target: TrainState):
    """What each leaf is read as (a ShapeDtypeStruct with the target's sharding), flat:
    ({"params": [...], "opt_state": [...], "step", "loss_scale", "rng"}, opt entries, homes)."""
    plan = target.plan
    homes = state_shardings(plan, target.tx)
    opt = _opt_entries(plan, target.opt_state)
    _check_target(meta, plan, opt)
    rep = NamedSharding(plan.mesh, P())

    def sds(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)

    params = [(lay.path, sds(_disk_shape(plan, lay), "float32", _disk_sharding(plan, lay))) for lay in plan.leaves]
    opt_items = []
    for (path, x, lay), home in zip(opt, jax.tree_util.tree_leaves(homes.opt_state)):
        dtype = meta["opt_state"][path]["dtype"]
        sharding = _disk_sharding(plan, lay) if lay is not None else _device(home)
        opt_items.append((path, sds(_disk_shape(plan, lay) if lay is not None else x.shape, dtype, sharding)))
    scaler = {k: sds(v.shape, v.dtype, rep) for k, v in _scaler_dict(target.loss_scale).items()}
    flat = {"params": params, "opt_state": opt_items, "step": sds((), "int32", rep), "loss_scale": scaler,
            "rng": sds(target.rng.shape, target.rng.dtype, rep)}
    return flat, opt, homes


def _item(flat: dict, param_ids, opt_ids, scalars: bool):
    """The Orbax item (nested) and restore args of some params, optimizer leaves and the scalars."""
    item = {}
    if param_ids:
        item["params"] = nest(dict(flat["params"][i] for i in param_ids))
    if opt_ids:
        item["opt_state"] = nest(dict(flat["opt_state"][j] for j in opt_ids))
    if scalars:
        item.update(step=flat["step"], loss_scale=flat["loss_scale"], rng=flat["rng"])
    restore_args = jax.tree_util.tree_map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False), item)
    return item, restore_args


# The host memory a restore may use beside the restored state, per process. The state is read in
# groups of leaves (each param with the optimizer leaves that mirror it) of a quarter of it, each
# laid out before the next is read: a group is held about four times over at the peak (the read
# buffer, its device copy, the laid-out leaves, the next group's read beginning), so the
# host holds the restored state plus about the budget, not two or three copies of the state.
# A leaf larger than a group is read in pieces of a group (in_pieces, _pieces.build_leaf) straight
# into its device shards, which hold a piece at most three times (the read, its device copy, the
# cast) beside one stored chunk.
RESTORE_BUDGET = 1 << 30
_GROUP_SHARE = 4


def read_groups(plan: ZeroPlan, opt, budget: int) -> list[tuple[list[int], list[int]]]:
    """(param indices, optimizer-leaf indices) per group, in the plan's order; the optimizer
    leaves that mirror no param (counts, scalars) are in the first group. A leaf larger than
    the budget is a group of its own."""
    mirrors: dict = collections.defaultdict(list)
    loose = []
    for j, (_, _, lay) in enumerate(opt):
        (mirrors[lay.path] if lay is not None else loose).append(j)
    per_process = max(1, jax.process_count())
    groups, cur, size = [], ([], list(loose)), 0
    for i, lay in enumerate(plan.leaves):
        nbytes = 4 * lay.size * (1 + len(mirrors[lay.path])) // per_process
        if cur[0] and size + nbytes > budget:
            groups.append(cur)
            cur, size = ([], []), 0
        cur[0].append(i)
        cur[1].extend(mirrors[lay.path])
        size += nbytes
    groups.append(cur)
    return groups


def in_pieces(plan: ZeroPlan, opt, group: int) -> tuple[set, set]:
    """(param indices, optimizer-leaf indices) read in pieces rather than by Orbax: a param whose
    bytes per process, with the optimizer leaves that mirror it, exceed a group (and the optimizer
    leaves that mirror it), and an optimizer leaf that mirrors no param and exceeds a group alone.
    Leaves under :data:`_pieces.MIN_PIECE` are always read whole."""
    per_process = max(1, jax.process_count())
    limit = max(group, _pieces.MIN_PIECE)
    mirrors: dict = collections.defaultdict(list)
    params, opt_ids = set(), set()
    for j, (_, x, lay) in enumerate(opt):
        if lay is not None:
            mirrors[lay.path].append(j)
        elif x.size * np.dtype(x.dtype).itemsize // per_process > limit:
            opt_ids.add(j)
    for i, lay in enumerate(plan.leaves):
        if 4 * lay.size * (1 + len(mirrors[lay.path])) // per_process > limit:
            params.add(i)
            opt_ids.update(mirrors[lay.path])
    return params, opt_ids


def _read_in_pieces(state_dir: str, key: str, logical_shape, dests, piece: int, ctx):
    """One stored leaf laid out as each of ``dests`` ((shape, dtype, sharding) each), read box by
    box (:mod:`zerojax.checkpoint._pieces`); returns (arrays, checksum). A later destination with
    the same shape and device shards as the first (the params of a stage-3 master) is cast from
    it on the devices instead of read again."""
    store = _pieces.open_array(state_dir, key, ctx)
    out, checksum = [], None
    try:
        for k, (shape, dtype, sharding) in enumerate(dests):
            if k and _same_shards(dests[0], (shape, dtype, sharding)):
                out.append(_cast_like(out[0], np.dtype(dtype).name, sharding))
                continue
            arr, s = _pieces.build_leaf(store, tuple(logical_shape), tuple(shape), dtype, sharding, piece,
                                        checksum=k == 0)
            out.append(arr)
            checksum = s if k == 0 else checksum
    except CheckpointError:
        raise
    except Exception as e:  # tensorstore raises ValueError / OSError for a damaged or missing chunk
        raise _pieces.unreadable(key, os.path.dirname(state_dir), e) from e
    return out, checksum


def _same_shards(a, b) -> bool:
    (shape_a, _, sh_a), (shape_b, _, sh_b) = a, b
    if tuple(shape_a) != tuple(shape_b) or sh_a.memory_kind != sh_b.memory_kind:
        return False
    return (sh_a.memory_kind in (None, "device")
            and sh_a.devices_indices_map(tuple(shape_a)) == sh_b.devices_indices_map(tuple(shape_b)))


def _cast_like(x, dtype: str, sharding):
    key = ("restore-cast", dtype, sharding, x.sharding)
    return cached_program(key, lambda: jax.jit(lambda a: a.astype(dtype), out_shardings=sharding))(x)


def restore_state(step_dir: str, meta: dict, target: TrainState, read, budget: int | None = None):
    """(state in the target's layout, checksums) of a checkpoint step, read group by group
    (:func:`read_groups`) with ``read(step_dir, item, restore_args)``; the leaves larger than a
    group (:func:`in_pieces`) are read box by box through tensorstore first. A target keeping
    its optimizer state in the NVMe store gets it there (:mod:`._outside`)."""
    if keeps_engine(target.plan):  # ZenFlow: the params here, the engine's state handed to its step
        return restore_zenflow(step_dir, meta, target, lambda m: _restore_state(step_dir, m, target, read, budget),
                               MISMATCH)
    if keeps_outside(target.plan):
        check_outside_target(meta, target.plan, target.tx, MISMATCH)
        on_disk = target.plan.config.offload_param == "nvme"  # ZeRO-Infinity: the params go to the store only
        state, sums = _restore_state(step_dir, {**meta, "opt_state": {}}, target, read, budget, with_params=not on_disk)
        sums.update(restore_outside(step_dir, meta, target, int(state.step)))
        return state, sums
    return _restore_state(step_dir, meta, target, read, budget)


def _restore_state(step_dir: str, meta: dict, target: TrainState, read, budget: int | None = None,
                   with_params: bool = True):
    plan = target.plan
    flat, opt, homes = _flat_spec(meta, target)
    with_master = target.master is not None
    param_homes = plan.treedef.flatten_up_to(homes.params)
    master_homes = plan.treedef.flatten_up_to(homes.master) if with_master else [None] * len(plan.leaves)
    opt_homes = jax.tree_util.tree_leaves(homes.opt_state)
    params, master = [None] * len(plan.leaves), [None] * len(plan.leaves)
    opt_leaves, sums, scalars = [None] * len(opt), {}, None
    group = max(1, (RESTORE_BUDGET if budget is None else budget) // _GROUP_SHARE)
    on_host = sums_on_host(plan)
    big_params, big_opt = in_pieces(plan, opt, group)
    if not with_params:
        big_params = set()
    groups = [([i for i in pi if i not in big_params and with_params], [j for j in oi if j not in big_opt])
              for pi, oi in read_groups(plan, opt, group)]
    groups = [grp for g, grp in enumerate(groups) if g == 0 or grp[0] or grp[1]]
    if big_params or big_opt:
        piece = max(group, _pieces.MIN_PIECE)
        ctx, state_dir = _pieces.context(), os.path.join(step_dir, STATE)
        for i in sorted(big_params):
            lay = plan.leaves[i]
            dests = []
            if with_master:
                dests.append((plan.master_shape(lay), np.float32, master_homes[i]))
            dests.append((plan.param_shape(lay), plan.compute_dtype, param_homes[i]))
            out, sums["params/" + lay.path] = _read_in_pieces(state_dir, "params/" + lay.path, lay.shape, dests,
                                                              piece, ctx)
            master[i], params[i] = (out[0], out[1]) if with_master else (None, out[0])
        for j in sorted(big_opt):
            path, x, lay = opt[j]
            shape = plan.master_shape(lay) if lay is not None else tuple(x.shape)
            (opt_leaves[j],), sums["opt_state/" + path] = _read_in_pieces(
                state_dir, "opt_state/" + path, lay.shape if lay is not None else tuple(x.shape),
                [(shape, x.dtype, opt_homes[j])], piece, ctx)
    for g, (pi, oi) in enumerate(groups):
        item, restore_args = _item(flat, pi, oi, g == 0)
        restored = read(step_dir, item, restore_args)
        lays = [plan.leaves[i] for i in pi]
        opt_meta = [(opt[j][2], opt[j][1].dtype) for j in oi]
        key = ("restore", with_master, plan.mesh, plan.compute_dtype,
               tuple(dataclasses.replace(lay, path="") for lay in lays),
               tuple((None if lay is None else dataclasses.replace(lay, path=""), np.dtype(dt).name)
                     for lay, dt in opt_meta),
               tuple(param_homes[i] for i in pi), tuple(master_homes[i] for i in pi), tuple(opt_homes[j] for j in oi),
               on_host)
        program = cached_program(key, lambda: _restore_program(
            plan, lays, opt_meta, [param_homes[i] for i in pi], [master_homes[i] for i in pi],
            [opt_homes[j] for j in oi], with_master, not on_host))
        read_params = [lookup(restored["params"], lay.path) for lay in lays]
        read_opt = [lookup(restored["opt_state"], opt[j][0]) for j in oi]
        if on_host:  # the arrays read are zeros past the logical region, so they sum to its checksum
            # (summed before the program, which takes the arrays read as its own buffers)
            host = _pieces.host_checksums({**{("p", k): x for k, x in enumerate(read_params)},
                                           **{("o", k): x for k, x in enumerate(read_opt)}})
            host = ([host[("p", k)] for k in range(len(pi))], [host[("o", k)] for k in range(len(oi))])
        with warnings.catch_warnings():  # a padded leaf's buffer cannot become its output: copied
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            (p, m, o), s = program(read_params, read_opt)
        del read_params, read_opt
        if on_host:
            s = host
        for k, i in enumerate(pi):
            params[i], master[i] = p[k], m[k]
            sums["params/" + plan.leaves[i].path] = s[0][k]
        for k, j in enumerate(oi):
            opt_leaves[j] = o[k]
            sums["opt_state/" + opt[j][0]] = s[1][k]
        if g == 0:
            scalars = (restored["step"], restored["loss_scale"], restored["rng"])
        del restored  # this group's logical arrays go once its layout program has read them
    scaler_type = type(target.loss_scale)
    key = ("restore-scalars", scaler_type, homes.step, homes.rng) + tuple(jax.tree_util.tree_leaves(homes.loss_scale))
    place = cached_program(key, lambda: jax.jit(lambda st, ls, r: (st, scaler_type(**ls), r),
                                                out_shardings=(homes.step, homes.loss_scale, homes.rng)))
    step, scaler, rng = place(*scalars)
    state = TrainState(step=step, params=plan.treedef.unflatten(params) if with_params else placeholders(plan),
                       master=plan.treedef.unflatten(master) if with_master else None,
                       opt_state=jax.tree_util.tree_structure(target.opt_state).unflatten(opt_leaves),
                       loss_scale=scaler, rng=rng, plan=plan, tx=target.tx)
    return state, sums


def _restore_program(plan: ZeroPlan, lays, opt_meta, param_homes, master_homes, opt_homes, with_master: bool,
                     checksums: bool = True):
    """The jitted (a group's logical arrays) -> ((params, masters, optimizer leaves), checksums);
    closes over layouts only (no leaf names: identical layers share one program). Without
    ``checksums`` they are zeros (the host sums the arrays read: see restore_state)."""
    cdt = plan.compute_dtype
    _sum = _checksum if checksums else (lambda x: jnp.uint32(0))

    def build(flat_params, flat_opt):
        params, master, psums = [], [], []
        for lay, x in zip(lays, flat_params):
            logical = placement.unpad(x, lay)
            psums.append(_sum(logical))
            params.append(placement.pad(logical.astype(cdt), lay) if lay.params_partitioned else logical.astype(cdt))
            master.append((placement.pad(logical, lay) if plan.opt_partitioned(lay) else logical)
                          if with_master else None)
        opt_leaves, osums = [], []
        for (lay, dt), x in zip(opt_meta, flat_opt):
            if lay is not None:
                x = placement.unpad(x, lay)
                osums.append(_sum(x))
                x = placement.pad(x, lay) if plan.opt_partitioned(lay) else x
            else:
                osums.append(_sum(x))
            opt_leaves.append(x.astype(dt))
        return (params, master, opt_leaves), (psums, osums)

    # checksums replicated: every process reads them (another process's shard cannot be fetched)
    rep = NamedSharding(plan.mesh, P())
    out_sh = ((list(param_homes), list(master_homes), list(opt_homes)), ([rep] * len(lays), [rep] * len(opt_meta)))
    # the arrays read are the restore's own: each becomes its leaf's buffer where the layouts agree
    # (no second copy of the state in memory while it is placed)
    return jax.jit(build, out_shardings=out_sh, donate_argnums=(0, 1))
