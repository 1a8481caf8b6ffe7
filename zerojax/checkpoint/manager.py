"""Checkpoints that restore onto any mesh size, any stage and any offload setting.

    mngr = zj.checkpoint.CheckpointManager("/ckpt", max_to_keep=3, best_metric="loss")
    mngr.save(step, state, metrics={"loss": 1.7}, data_state={"epoch": 2})   # asynchronous
    ...
    state, data_state = mngr.restore(zj.abstract_train_state(init_fn, tx, mesh=mesh, config=config))
    zj.checkpoint.consolidate("/ckpt", "model.safetensors", dtype="bfloat16")

What is stored. Every parameter is stored as its fp32 value (the master copy when there is one)
and every optimizer leaf that mirrors a parameter (Adam's moments and the like) likewise, in the
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
                                      dicts keyed by the tree path's parts ("opt_state/0/mu/emb")
        zerojax/metadata              JSON: format, logical shape and dtype per leaf, per-leaf
                                      checksums, and the saving run's stage / mesh / process
                                      count / precision
        data_state/metadata           JSON: the user's data_state dict ({} when none)
        model_16bit.safetensors       only with ZeroConfig(gather_16bit_weights_on_model_save=True)

To read it without zerojax: ``ocp.PyTreeCheckpointer().restore(DIR/<step>/state)`` and slice each
array to the ``shape`` recorded for it in ``zerojax/metadata``.

Crash safety. A step that is not complete (a leftover temporary directory from a killed save,
or a step directory without its metadata) is skipped with a warning naming it; restore takes
the newest complete step. Every leaf carries a checksum of its logical values, checked on
restore, so a damaged or missing data file is an error, never zeros.

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

import json
import math
import os
import re
import struct as _struct
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.errors import CheckpointError
from zerojax.plan import LeafLayout, ZeroPlan, path_str
from zerojax.state import TrainState, state_shardings

FORMAT = 1
_STATE, _META, _DATA = "state", "zerojax", "data_state"
_SAFETENSORS_16BIT = "model_16bit.safetensors"
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


# ------------------------------------------------------------------------- tree helpers
def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _disk_split(plan: ZeroPlan, lay: LeafLayout) -> bool:
    """A param-like leaf is split over the data axis on disk (and while read) when it can be."""
    return lay.axis is not None and plan.n > 1


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


def _scaler_dict(loss_scale) -> dict:
    return dict(loss_scale._asdict())


# -------------------------------------------------------------------------------- save
def logical_tree(state: TrainState):
    """(tree, metadata) written for ``state``: see the module docstring. Leaves stay split."""
    plan = state.plan
    homes = state_shardings(plan, state.tx)
    # the fp32 master when the state has one (not when the step keeps it: NVMe, ZenFlow)
    with_master = state.master is not None
    src, src_homes = (state.master, homes.master) if with_master else (state.params, homes.params)
    opt = _opt_entries(plan, state.opt_state)
    opt_homes = jax.tree_util.tree_leaves(homes.opt_state)

    def build(src, opt_leaves, step, loss_scale, rng):
        src = ZeroPlan.fetch(src, src_homes)
        params, sums = {}, {}
        for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(src)):
            logical = plan.unpad(x, lay).astype(jnp.float32)
            params[lay.path] = plan.pad(logical, lay) if _disk_split(plan, lay) else logical
            sums["params/" + lay.path] = _checksum(logical)
        opt_out = {}
        for (path, _, lay), x, home in zip(opt, opt_leaves, opt_homes):
            if home.memory_kind not in (None, "device"):
                x = jax.device_put(x, _device(home))
            if lay is not None:
                logical = plan.unpad(x, lay)
                x = plan.pad(logical, lay) if _disk_split(plan, lay) else logical
            else:
                logical = x
            opt_out[path] = x
            sums["opt_state/" + path] = _checksum(logical)
        tree = {"params": params, "opt_state": opt_out, "step": step,
                "loss_scale": _scaler_dict(loss_scale), "rng": rng}
        # fresh buffers: the step donates the state while the write may still be reading
        return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree), sums

    rep = NamedSharding(plan.mesh, P())
    opt_out_sh = {}
    for (path, x, lay), home in zip(opt, opt_homes):
        opt_out_sh[path] = _disk_sharding(plan, lay) if lay is not None else _device(home)
    out_sh = ({"params": {lay.path: _disk_sharding(plan, lay) for lay in plan.leaves},
               "opt_state": opt_out_sh, "step": rep,
               "loss_scale": {k: rep for k in _scaler_dict(state.loss_scale)}, "rng": rep}, rep)
    opt_leaves = [x for _, x, _ in opt]
    flat, sums = jax.jit(build, out_shardings=out_sh)(src, opt_leaves, state.step, state.loss_scale, state.rng)
    meta = {
        "format": FORMAT,
        "saved_with": {"stage": plan.stage, "devices": plan.n, "processes": jax.process_count(),
                       "precision": plan.config.precision},
        "params": {lay.path: {"shape": list(lay.shape), "dtype": np.dtype(lay.dtype).name} for lay in plan.leaves},
        "opt_state": {path: {"shape": list(lay.shape if lay is not None else x.shape),
                             "dtype": np.dtype(x.dtype).name, "mirrors": None if lay is None else lay.path}
                      for path, x, lay in opt},
        "checksums": {k: int(v) for k, v in jax.device_get(sums).items()},
    }
    tree = dict(flat, params=_nest(flat["params"]), opt_state=_nest(flat["opt_state"]))
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
            "the checkpoint does not match the target state:\n" + "\n".join(problems) +
            "\nBuild the target from the same model and optimizer that were saved "
            "(zj.abstract_train_state(init_fn, tx, mesh=..., config=...)).")


def _restore_spec(meta: dict, target: TrainState):
    """(item, restore_args, relayout inputs) for reading the checkpoint straight into the target's mesh."""
    plan = target.plan
    homes = state_shardings(plan, target.tx)
    opt = _opt_entries(plan, target.opt_state)
    _check_target(meta, plan, opt)
    rep = NamedSharding(plan.mesh, P())

    def sds(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)

    params = {lay.path: sds(_disk_shape(plan, lay), "float32", _disk_sharding(plan, lay)) for lay in plan.leaves}
    opt_items = {}
    for (path, x, lay), home in zip(opt, jax.tree_util.tree_leaves(homes.opt_state)):
        dtype = meta["opt_state"][path]["dtype"]
        if lay is not None:
            opt_items[path] = sds(_disk_shape(plan, lay), dtype, _disk_sharding(plan, lay))
        else:
            opt_items[path] = sds(x.shape, dtype, _device(home))
    scaler = {k: sds(v.shape, v.dtype, rep) for k, v in _scaler_dict(target.loss_scale).items()}
    item = {"params": _nest(params), "opt_state": _nest(opt_items), "step": sds((), "int32", rep),
            "loss_scale": scaler, "rng": sds(target.rng.shape, target.rng.dtype, rep)}
    restore_args = jax.tree_util.tree_map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False), item)
    return item, restore_args, opt, homes


def _relayout(restored: dict, target: TrainState, opt, homes):
    """Restored logical arrays -> the target's ZeRO layout, dtypes and memory kinds; plus checksums."""
    plan = target.plan
    cdt = plan.compute_dtype
    flat_params = {lay.path: _get(restored["params"], lay.path) for lay in plan.leaves}
    flat_opt = [_get(restored["opt_state"], p) for p, _, _ in opt]
    target_dtypes = [x.dtype for _, x, _ in opt]

    def build(flat_params, flat_opt, step, loss_scale, rng):
        sums = {}
        params, master = [], []
        for lay in plan.leaves:
            logical = plan.unpad(flat_params[lay.path], lay)
            sums["params/" + lay.path] = _checksum(logical)
            params.append(plan.pad(logical.astype(cdt), lay) if lay.params_partitioned else logical.astype(cdt))
            master.append(plan.pad(logical, lay) if plan.opt_partitioned(lay) else logical)
        opt_leaves = []
        for (path, _, lay), x, dt in zip(opt, flat_opt, target_dtypes):
            if lay is not None:
                x = plan.unpad(x, lay)
                sums["opt_state/" + path] = _checksum(x)
                x = plan.pad(x, lay) if plan.opt_partitioned(lay) else x
            else:
                sums["opt_state/" + path] = _checksum(x)
            opt_leaves.append(x.astype(dt))
        params = plan.treedef.unflatten(params)
        master = plan.treedef.unflatten(master) if target.master is not None else None
        opt_state = jax.tree_util.tree_structure(target.opt_state).unflatten(opt_leaves)
        scaler = type(target.loss_scale)(**loss_scale)
        return (step, params, master, opt_state, scaler, rng), sums

    # checksums replicated: every process reads them (another process's shard cannot be fetched)
    out_sh = ((homes.step, homes.params, homes.master, homes.opt_state, homes.loss_scale, homes.rng),
              NamedSharding(plan.mesh, P()))
    (step, params, master, opt_state, scaler, rng), sums = jax.jit(build, out_shardings=out_sh)(
        flat_params, flat_opt, restored["step"], restored["loss_scale"], restored["rng"])
    state = TrainState(step=step, params=params, master=master, opt_state=opt_state, loss_scale=scaler,
                       rng=rng, plan=plan, tx=target.tx)
    return state, sums


def _get(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def _verify(meta: dict, sums, where: str) -> None:
    got = {k: int(v) for k, v in jax.device_get(sums).items()}
    bad = [k for k, v in got.items() if meta["checksums"].get(k) != v]
    if bad:
        raise CheckpointError(
            f"checkpoint {where} is damaged: the values read for {', '.join(bad)} do not match the checksums "
            "written at save time (a data file was truncated, replaced or deleted). Restore an older step.")


# ----------------------------------------------------------------------- step discovery
def _complete(step_dir: str) -> bool:
    return (os.path.isfile(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
            and os.path.isfile(os.path.join(step_dir, _STATE, "_METADATA"))
            and os.path.isfile(os.path.join(step_dir, _META, "metadata")))


def _scan(directory: str, warn: bool = True) -> list[int]:
    """Complete steps in ``directory``, warning about every incomplete one found."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    steps = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if not os.path.isdir(full):
            continue
        if _TMP.match(name):
            if warn:
                warnings.warn(f"skipping incomplete checkpoint {full} (a save that never finished)", stacklevel=3)
        elif name.isdigit():
            if _complete(full):
                steps.append(int(name))
            elif warn:
                warnings.warn(f"skipping incomplete checkpoint {full} (its metadata is missing)", stacklevel=3)
    return sorted(steps)


def _pick(directory: str, step: int | None) -> int:
    steps = _scan(directory)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {directory!r}")
        return steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"no complete checkpoint for step {step} in {directory!r}; complete steps: {steps}")
    return step


def _read_meta(step_dir: str) -> dict:
    with open(os.path.join(step_dir, _META, "metadata")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{step_dir}: checkpoint format {meta.get('format')!r}, this zerojax reads {FORMAT}")
    return meta


def _this_process_only() -> ocp.options.MultiprocessingOptions:
    """Orbax options for work one process does alone (consolidation): no barrier with the others."""
    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def _checkpointer(this_process_only: bool):
    if not this_process_only or jax.process_count() == 1:
        return ocp.PyTreeCheckpointer()
    options = _this_process_only()
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=options),
                            multiprocessing_options=options)


def _read_state(step_dir: str, item, restore_args, this_process_only: bool = False):
    """Read the state item; every process together, or (``this_process_only``) this one alone."""
    try:
        return _checkpointer(this_process_only).restore(
            os.path.join(step_dir, _STATE),
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
    except Exception as e:  # tensorstore/orbax raise many types; name the step and keep the cause
        raise CheckpointError(f"cannot read checkpoint {step_dir}: {type(e).__name__}: {e}") from e


def restore(directory: str, target: TrainState, step: int | None = None):
    """Read step ``step`` (default: the newest complete one) into ``target``'s mesh, stage and layout.

    ``target`` is a TrainState or ``zj.abstract_train_state(...)``. Returns (state, data_state).
    """
    directory = os.path.abspath(os.fspath(directory))
    step = _pick(directory, step)
    step_dir = os.path.join(directory, str(step))
    meta = _read_meta(step_dir)
    item, restore_args, opt, homes = _restore_spec(meta, target)
    restored = _read_state(step_dir, item, restore_args)
    state, sums = _relayout(restored, target, opt, homes)
    _verify(meta, sums, step_dir)
    data_path = os.path.join(step_dir, _DATA, "metadata")
    data_state = {}
    if os.path.isfile(data_path):
        with open(data_path) as f:
            data_state = json.load(f)
    return state, data_state


# ----------------------------------------------------------------------------- manager
class CheckpointManager:
    """Asynchronous, mesh-independent checkpoints over ``orbax.checkpoint.CheckpointManager``.

    ``best_metric`` names a key of the ``metrics`` passed to ``save``; with ``max_to_keep`` the
    kept steps are then the best ones (Orbax's rule), otherwise the newest.

        mngr = CheckpointManager(path, max_to_keep=2)
        mngr.save(int(state.step), state, data_state={"epoch": 1})
        state, data_state = mngr.restore(abstract_state)
    """

    def __init__(self, directory, max_to_keep: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min", async_save: bool = True):
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode={best_mode!r}: use 'min' or 'max'")
        self.directory = os.path.abspath(os.fspath(directory))
        self.best_metric = best_metric
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            best_fn=(lambda m: float(m[best_metric])) if best_metric else None,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)
        self._pending_16bit: list[tuple[int, str]] = []

    def save(self, step: int, state: TrainState, metrics: dict | None = None,
             data_state: dict | None = None) -> bool:
        """Start writing ``state`` as ``step``; returns once the arrays are copied off the devices."""
        if self.best_metric and (metrics is None or self.best_metric not in metrics):
            raise ValueError(f"save(step={step}) needs metrics[{self.best_metric!r}]: the manager keeps the best "
                             f"steps by it (best_metric={self.best_metric!r})")
        self._finish_16bit()
        tree, meta = logical_tree(state)
        args = ocp.args.Composite(**{_STATE: ocp.args.PyTreeSave(tree), _META: ocp.args.JsonSave(meta),
                                     _DATA: ocp.args.JsonSave(dict(data_state or {}))})
        saved = self._mngr.save(int(step), args=args, metrics=metrics, force=True)
        if saved and state.plan.config.gather_16bit_weights_on_model_save:
            cdt = np.dtype(state.plan.compute_dtype)
            self._pending_16bit.append((int(step), "bfloat16" if cdt.itemsize == 4 else cdt.name))
        return saved

    def _finish_16bit(self) -> None:
        if not self._pending_16bit:
            return
        self._mngr.wait_until_finished()
        pending, self._pending_16bit = self._pending_16bit, []
        if jax.process_index() != 0:
            return
        for step, dtype in pending:
            step_dir = os.path.join(self.directory, str(step))
            if os.path.isdir(step_dir):  # not already removed by max_to_keep
                consolidate(self.directory, os.path.join(step_dir, _SAFETENSORS_16BIT), dtype=dtype,
                            step=step, progress=False)

    def wait_until_finished(self) -> None:
        self._mngr.wait_until_finished()
        self._finish_16bit()

    def restore(self, target: TrainState, step: int | None = None):
        """(state, data_state) of ``step`` (default: the newest complete step) laid out like ``target``."""
        self.wait_until_finished()
        return restore(self.directory, target, step)

    def all_steps(self) -> list[int]:
        return [s for s in self._mngr.all_steps() if _complete(os.path.join(self.directory, str(s)))]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        return self._mngr.best_step() if self.best_metric else self.latest_step()

    def close(self) -> None:
        self.wait_until_finished()
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------- consolidate
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def _safetensors_name(path: str) -> str:
    return path.replace("/", ".")


def _read_leaf(step_dir: str, path: str, shape) -> np.ndarray:
    """One param leaf into host memory as numpy (no device copy), sliced to its logical ``shape``."""
    item = {"params": _nest({path: 0})}
    args = {"params": _nest({path: ocp.RestoreArgs(restore_type=np.ndarray)})}
    x = _get(_read_state(step_dir, item, args, this_process_only=True)["params"], path)
    if tuple(x.shape) != tuple(shape):  # split dimension padded by the saving mesh
        x = x[tuple(slice(0, s) for s in shape)]
    return np.ascontiguousarray(x)


def _np_checksum(x: np.ndarray) -> int:
    """``_checksum`` on the host, without a temporary copy (fp32 leaves)."""
    return int(x.view(np.uint32).sum(dtype=np.uint32))


def consolidate(checkpoint_dir, out, dtype: str = "float32", format: str = "safetensors",
                step: int | None = None, progress: bool = True) -> str:
    """Write the full params of one checkpoint step to ``out`` on this host, one leaf at a time.

    ``format="safetensors"``: tensors named by tree path joined with "." (``blocks.0.attn.qkv.kernel``);
    peak memory stays near the largest leaf. ``format="orbax"``: a plain Orbax PyTree of the params
    (this path holds the whole params tree in host memory). Returns ``out``. In a multi-process
    run one process may call it alone (``if jax.process_index() == 0``): it waits for no other.
    """
    from tqdm.auto import tqdm

    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(_SAFETENSORS_DTYPES)}")
    if format not in ("safetensors", "orbax"):
        raise ValueError(f"format={format!r}: use 'safetensors' or 'orbax'")
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    step = _pick(checkpoint_dir, step)
    step_dir = os.path.join(checkpoint_dir, str(step))
    meta = _read_meta(step_dir)
    np_dtype = np.dtype(jnp.dtype(dtype))
    leaves = list(meta["params"].items())
    bar = tqdm(leaves, desc=f"consolidate step {step}", unit="leaf", disable=not progress)

    def read(path, info):
        x = _read_leaf(step_dir, path, info["shape"])
        got = _np_checksum(x)
        if got != meta["checksums"]["params/" + path]:
            raise CheckpointError(f"checkpoint {step_dir} is damaged: params/{path} does not match its checksum")
        return x.astype(np_dtype, copy=False)  # no copy when the dtype is already right

    if format == "orbax":
        tree = _nest({path: read(path, info) for path, info in bar})
        _checkpointer(this_process_only=True).save(os.path.abspath(os.fspath(out)), tree, force=True)
        return out

    header, offset = {}, 0
    for path, info in leaves:
        nbytes = math.prod(info["shape"]) * np_dtype.itemsize
        header[_safetensors_name(path)] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": info["shape"],
                                           "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "np", "step": str(step)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(out)}.tmp{os.getpid()}"  # processes consolidating side by side do not collide
    with open(tmp, "wb") as f:
        f.write(_struct.pack("<Q", len(blob)))
        f.write(blob)
        for path, info in bar:  # safetensors data follow the header in its key order
            arr = read(path, info)
            f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
            del arr  # one leaf at a time
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
