"""Checkpoints of ZenFlow runs: the engine's state travels with the TrainState.

A ZenFlow step (``ZeroConfig(zenflow={...}, offload_optimizer="cpu")``) keeps the optimizer state
outside the TrainState: the host's fp32 master and moments of the 2-D weights, the gradients
accumulated for the next host update, a host update in flight (``overlap_step``), the device's
selected rows (their fp32 copies and moments), the other leaves' fp32 copies and moments, the
schedule's position and the counters. A checkpoint of a ZenFlow state holds all of it, in two
parts of the same step:

* the one format every tier writes (:mod:`._format`): ``params`` are the fp32 values of the
  state's weights and ``opt_state`` the tree ``tx.init`` builds for the model, so any tier
  restores it. ZenFlow's state maps onto it only approximately: a weight's fp32 value is the
  engine's fp32 copy of it where that copy rounds to the weight the state holds (the selected
  rows' device copies, the 1-D leaves' device copies, the host master elsewhere), else the
  weight widened; the moments are the host's moments of the 2-D weights with the selected rows'
  device moments written over them, and the 1-D leaves' device moments; the count is the applied
  steps. The gradients accumulated but not yet applied by a host update, and a host update
  computed but not yet written back, are not part of a plain optimizer state: another tier
  resumes without them.
* ``zenflow/...`` arrays in the same state item and a ``zenflow`` entry in ``zerojax/metadata``
  (counters, schedule, the step the state belongs to), covered by the per-leaf checksums and
  the metadata's digest: the engine's exact state, which only a ZenFlow target reads. So 5
  steps, save, restore, 5 more steps equal 10 straight, bit for bit.

Saving: a ZenFlowStep registers itself under its plan; the save finds the step that last
returned a state of this step number, waits until its host worker has done everything
submitted (a host update in flight is waited for, not applied: its result is saved and applied
after the resume at the step the straight run applies it) and reads its buffers; the manager's
write is synchronous, as the next step changes them. A state of another step than the engine's
is refused by name; a state at step 0 that no step has trained saves its params and a fresh
optimizer state.

Restoring onto a ZenFlow target: the params go to the devices as on any tier; the engine's
state is handed to the ZenFlowStep of the target's plan (an open step of a live target's plan
takes it at once; otherwise ``zj.make_train_step(loss_fn, restored)`` takes it up). A checkpoint
of another tier, or of a ZenFlow run whose engine does not fit the target (another
``topk_ratio``, ``overlap_step`` or model), starts a new engine from the checkpoint's fp32
params, carrying its moments and count to the host's moments of the 2-D weights and to the
device's 1-D leaves, and the schedule's position; selection, warm-up and accumulation start as
in a new run. Until a step takes it up, the restored state's plan holds the engine's state (as
the live step would).
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import zerojax._placement as placement
import zerojax.checkpoint._pieces as _pieces
from zerojax._errors import CheckpointError, ZeroJaxWarning
from zerojax._plan import ZeroPlan, path_str
from zerojax._state import TrainState
from zerojax.offload._engines import engines, leave
from zerojax.offload._engines import pending as pending_state

__all__ = ["keeps_engine", "restore_zenflow", "zenflow_tree"]

KEY = "zenflow"  # the state item's subtree and the metadata's entry
VERSION = 1
_COUNTERS = ("steps", "host_count", "host_updates", "selections", "since_select", "epochs_since_select",
             "reflected", "max_staleness", "bytes_to_host", "bytes_to_device", "_mass_steps", "auto_fired",
             "count_base")
_SLOT_BUFFERS = ("m", "v")  # the host buffers of the optimizer's slots, in order



def keeps_engine(plan: ZeroPlan) -> bool:
    """Whether a ZenFlow step keeps this plan's optimizer state."""
    return bool(plan.config.zenflow) and plan.config.offload_optimizer == "cpu"


@dataclass
class Snapshot:
    """An engine's exact state: JSON-ready values and named numpy arrays."""
    info: dict
    arrays: dict


@dataclass
class Seed:
    """What a new engine takes from the one checkpoint format: fp32 params and slots per leaf,
    the applied-update count and the injected settings' shadow leaves."""
    state_step: int
    params: list
    slots: list
    count: int
    settings: Optional[list] = None


def _optimizer(tx, doing: str):
    from zerojax.update._recognize import recognize

    opt = recognize(tx)
    if opt is None:
        raise CheckpointError(f"{doing}: ZenFlow runs Adam/AdamW, SGD or Lion from optax, not this optimizer, so "
                              "its state has no ZenFlow checkpoint. Fix: use optax.adamw (or adam, sgd, lion), bare or "
                              "under optax.inject_hyperparams")
    return opt


def _views(flat: np.ndarray, shapes) -> list:
    """The 2-D weights' leaves in a flat host buffer, as the engine lays them out."""
    from zerojax.offload._flat import FlatLayout

    return FlatLayout.from_tree([jax.ShapeDtypeStruct(s, np.float32) for s in shapes]).views(flat)


def _setting(v):
    """A host setting as JSON: Python numbers stay Python numbers (numpy's promotion treats them
    differently from numpy scalars), numpy scalars keep their dtype."""
    if isinstance(v, (bool, int, float)):
        return ["py", v]
    a = np.asarray(v)
    return [a.dtype.name, a.item()]


def _unsetting(pair):
    dt, v = pair
    return v if dt == "py" else np.asarray(v, dt)[()]


# ------------------------------------------------------------------------- live engines
def _engines(plan: ZeroPlan) -> list:
    return engines(plan)


def _snapshot(step) -> Snapshot:
    """The engine's state once its host worker is idle: a host update in flight is waited for,
    its result kept unapplied."""
    if not step.closed:
        step._drain()
    pending = None if step._pending is None else step._pending.result()
    arrays = {"master": step.master, "m": step.m, "v": step.v}
    arrays.update({f"acc/{i}": a for i, a in enumerate(step.acc)})
    if pending is not None:
        arrays["pending"] = np.asarray(pending[0], np.float32)
    dev = jax.device_get(step.dev)
    arrays.update({"dev/" + path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(dev)[0]})
    info = {"version": VERSION, "state_step": step.state_step, "mat": list(step.mat), "topk": list(step.topk),
            "optimizer": step.settings.opt.name, "update_interval": step.interval, "acc_steps": list(step.acc_steps), "cur": step.cur,
            "pending": None if pending is None else {"through": int(pending[1]),
                                                     "dtype": np.dtype(pending[0].dtype).name},
            "unimp": [float(x) for x in step._unimp], "imp_sum": [float(x) for x in step._imp_sum],
            "lr_now": float(step._lr_now), "settings": step.settings.shadow_leaves(),
            "host_settings": {k: _setting(v) for k, v in step.host_opt.settings.items()},
            **{k: int(getattr(step, k)) for k in _COUNTERS}}
    return Snapshot(info, arrays)


def _source(state: TrainState, doing: str):
    """The engine state belonging to ``state``: a Snapshot, or a Seed."""
    plan, at = state.plan, int(state.step)
    held = [e for e in _engines(plan) if e.state_step is not None]
    match = [e for e in held if e.state_step == at]
    if match:
        return _snapshot(max(match, key=lambda e: e._ckpt_tick))
    pending = pending_state(plan)
    pending_at = None if pending is None else (pending.state_step if isinstance(pending, Seed)
                                               else pending.info["state_step"])
    if pending_at == at:
        return pending
    if held or pending is not None:
        steps = sorted({e.state_step for e in held} | ({pending_at} if pending is not None else set()))
        raise CheckpointError(
            f"{doing}: this state is at step {at}, but its ZenFlow step holds the optimizer state of step "
            f"{', '.join(map(str, steps))}: a checkpoint would mix two steps. Fix: save the state the step returned "
            "last, before the next step")
    if at == 0:  # nothing trained it: the params and what a new engine starts from
        leaves = [np.asarray(x, np.float32) for x in placement.params_logical(plan, state.params)]
        opt = _optimizer(state.tx, doing)
        return Seed(0, leaves, [[np.zeros(x.shape, np.float32) for x in leaves] for _ in opt.slots], 0)
    raise CheckpointError(
        f"{doing}: this state is at step {at} and no ZenFlow step holds its optimizer state (the step that trained "
        "it was dropped, or the state was built elsewhere), so a checkpoint would lose the moments. Fix: save while "
        "the ZenFlowStep that returned the state is alive")


# ----------------------------------------------------------------------------- saving
def _dev_slot(arrays: dict, group: str, slot: str, j: int):
    """The device's ``slot`` of leaf ``j`` in the optimizer state ``group`` (sel_opt, vec_opt)."""
    for key, x in arrays.items():
        parts = key.split("/")
        if parts[:2] == ["dev", group] and slot in parts[2:-1] and parts[-1] == str(j):
            return x
    raise CheckpointError(f"the ZenFlow engine state has no {slot} for {group} leaf {j}")


def _format_inputs(plan: ZeroPlan, opt, snap: Snapshot, state: TrainState):
    """(fp32 params, slots, count, settings) of the one format, from an engine's state."""
    info, a = snap.info, snap.arrays
    mat = info["mat"]
    vec = [i for i in range(len(plan.leaves)) if i not in mat]
    shapes = [plan.leaves[i].shape for i in mat]
    cand, slots = [None] * len(plan.leaves), [[None] * len(plan.leaves) for _ in opt.slots]
    selected = info["selections"] > 0  # during warm-up nothing is selected yet
    masters = _views(a["master"], shapes)
    moments = [_views(a[b], shapes) for b in _SLOT_BUFFERS[:len(opt.slots)]]
    for j, i in enumerate(mat):
        cand[i] = masters[j].copy()
        for k in range(len(opt.slots)):
            slots[k][i] = moments[k][j].copy()
        if selected:
            ix = a[f"dev/idx/{j}"]
            cand[i][ix] = a[f"dev/sel/{j}"]
            for k, s in enumerate(opt.slots):
                slots[k][i][ix] = _dev_slot(a, "sel_opt", s, j)
    for j, i in enumerate(vec):
        cand[i] = a[f"dev/vec/{j}"]
        for k, s in enumerate(opt.slots):
            slots[k][i] = np.asarray(_dev_slot(a, "vec_opt", s, j), np.float32)
    cdt = jnp.dtype(plan.compute_dtype)
    held = [np.asarray(x) for x in placement.params_logical(plan, state.params)]
    # the engine's fp32 copy where it is the state's weight, else the weight itself
    params = [np.where(c.astype(cdt) == p, c, p.astype(np.float32)) for c, p in zip(cand, held)]
    return params, slots, info["count_base"] + info["steps"], info["settings"]


def zenflow_tree(state: TrainState, doing: str):
    """(params, optimizer leaves, their metadata, checksums, engine entry, engine arrays) a save
    writes for a ZenFlow state."""
    from zerojax.checkpoint._outside import _checksum, format_leaves

    plan, tx = state.plan, state.tx
    opt = _optimizer(tx, doing)
    src = _source(state, doing)
    if isinstance(src, Seed):
        params, slots, count, settings = src.params, src.slots, src.count, src.settings
        info, arrays = None, {}
    else:
        params, slots, count, settings = _format_inputs(plan, opt, src, state)
        info = dict(src.info, arrays={k: {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
                                      for k, x in src.arrays.items()})
        arrays = src.arrays
    p, opt_flat, meta_opt, sums = format_leaves(plan, tx, opt, params, slots, settings, count)
    sums.update({f"{KEY}/{k}": _checksum(x) for k, x in arrays.items()})
    return p, opt_flat, meta_opt, sums, info, arrays


# ---------------------------------------------------------------------------- restoring
def _fits(info: dict, plan: ZeroPlan, tx, opt) -> str:
    """'' where the saved engine state fits a ZenFlow engine of ``plan``, else what differs."""
    from zerojax.offload._zenflow import split_leaves, zenflow_settings
    from zerojax.update._recognize import StepSettings

    z = zenflow_settings(plan.config.zenflow)
    mat, _, topk = split_leaves(plan, float(z["topk_ratio"]))
    n_acc = 2 if z["overlap_step"] else 1
    saved_acc = sum(1 for k in info["arrays"] if k.startswith("acc/"))
    if info.get("version") != VERSION:
        return f"its engine state has version {info.get('version')}, this zerojax reads {VERSION}"
    if info["optimizer"] != opt.name:
        return f"it was saved with {info['optimizer']}, the target runs {opt.name}"
    if info["mat"] != mat or info["topk"] != topk:
        return (f"it selects {info['topk']} rows of the 2-D weights {info['mat']}, the target "
                f"{topk} of {mat} (another topk_ratio or model)")
    if saved_acc != n_acc:
        return f"it has {saved_acc} gradient accumulators, the target {n_acc} (overlap_step differs)"
    if info["update_interval"] != z["update_interval"]:
        return f"it has update_interval {info['update_interval']!r}, the target {z['update_interval']!r}"
    shadow = StepSettings(tx, opt).shadow
    if (info["settings"] is None) != (shadow is None) or (
            shadow is not None and len(info["settings"]) != len(jax.tree_util.tree_leaves(shadow))):
        return "its optimizer's injected settings differ from the target's"
    return ""


def _read(state_dir: str, key: str, shape, dtype, ctx, sums: dict) -> np.ndarray:
    from zerojax.checkpoint._outside import _stream

    out = np.empty(tuple(shape), dtype)
    sums[key] = _stream(state_dir, key, tuple(shape), out, ctx)
    return out


def _read_seed(state_dir: str, meta: dict, target: TrainState, opt, at: int, sums: dict, mismatch: str) -> Seed:
    """A new engine's start from the one format: fp32 params, slots, count and settings."""
    from zerojax.checkpoint._outside import _slot_paths, check_outside_target, restored_settings

    plan, tx = target.plan, target.tx
    check_outside_target(meta, plan, tx, mismatch)
    mirrors, others = _slot_paths(plan, tx, opt)
    ctx = _pieces.context()
    count, settings = restored_settings(state_dir, tx, opt, others, at, sums, ctx)
    params = [_read(state_dir, "params/" + lay.path, lay.shape, np.float32, ctx, sums) for lay in plan.leaves]
    slots = [[None] * len(plan.leaves) for _ in opt.slots]
    for p, (k, i) in mirrors.items():
        slots[k][i] = _read(state_dir, "opt_state/" + p, plan.leaves[i].shape, np.float32, ctx, sums)
    return Seed(at, params, slots, count, settings)


def restore_zenflow(step_dir: str, meta: dict, target: TrainState, restore_params, mismatch: str):
    """(state, checksums) of a checkpoint step restored onto a ZenFlow target: the params via
    ``restore_params(meta)`` (the state's other leaves as on any tier), the engine's state handed
    to the target plan's ZenFlowStep (see the module docstring)."""
    from zerojax.checkpoint._tree import STATE

    plan = target.plan
    opt = _optimizer(target.tx, "restore")
    state, sums = restore_params({**meta, "opt_state": {}})
    at = int(state.step)
    state_dir = os.path.join(step_dir, STATE)
    info = meta.get(KEY)
    why = _fits(info, plan, target.tx, opt) if info is not None else "it holds no ZenFlow engine state"
    if info is not None and not why:
        ctx = _pieces.context()
        arrays = {k: _read(state_dir, f"{KEY}/{k}", spec["shape"], spec["dtype"], ctx, sums)
                  for k, spec in info["arrays"].items()}
        payload = Snapshot({k: v for k, v in info.items() if k != "arrays"}, arrays)
        if payload.info["state_step"] != at:
            raise CheckpointError(f"{step_dir}: its ZenFlow engine state belongs to step {payload.info['state_step']}, "
                                  f"its TrainState to step {at}. Fix: restore another step")
    else:
        if info is not None:
            warnings.warn(f"{step_dir}: the ZenFlow engine state saved with this step does not fit the target "
                          f"({why}); the engine starts anew from the checkpoint's params and moments",
                          ZeroJaxWarning, stacklevel=4)
        payload = _read_seed(state_dir, meta, target, opt, at, sums, mismatch)
    open_steps = [e for e in _engines(plan) if not e.closed]
    for e in open_steps:  # a live target's step goes on from the checkpoint at its next call
        _take(e, payload, state.params)
    if not open_steps:
        leave(plan, payload, _take)
    return state, sums


# ------------------------------------------------------------------ loading into an engine
def _take(step, payload, params) -> None:
    if not step.closed:
        step._drain()  # its own work in flight is superseded
    step._pending = None
    if isinstance(payload, Seed):
        _seed(step, payload, params)
    else:
        _load(step, payload, params)
    step.important = {step.plan.leaves[i].path: ix for i, ix in zip(step.mat, step.dev["idx"])}
    step.resumed_at = step.state_step


def _like(value: np.ndarray, x) -> jax.Array:
    """``value`` placed as the engine's own array ``x`` is: on x's devices, or, where the step made x
    from constants alone (one device, not committed to it), likewise uncommitted, so that it goes
    with the params' devices in the step."""
    if isinstance(x.sharding, jax.sharding.SingleDeviceSharding) and not getattr(x, "_committed", True):
        return jnp.asarray(value)
    return jax.device_put(value, x.sharding)


def _load(step, snap: Snapshot, params) -> None:
    info, a = snap.info, snap.arrays
    flat, treedef = jax.tree_util.tree_flatten_with_path(step._init_dev(params))
    bad = [path_str(p) for p, x in flat if ("dev/" + path_str(p)) not in a
           or a["dev/" + path_str(p)].shape != x.shape]
    if bad or len(a["master"]) != step.master.size:
        raise CheckpointError(f"the saved ZenFlow engine state does not fit this step ({', '.join(bad) or 'master'}). "
                              "Fix: build the step with the zenflow block and model that were saved")
    step.dev = treedef.unflatten([_like(np.asarray(a["dev/" + path_str(p)], x.dtype), x) for p, x in flat])
    for name in ("master", "m", "v"):
        np.copyto(getattr(step, name), a[name])
    for i, acc in enumerate(step.acc):
        np.copyto(acc, a[f"acc/{i}"])
    step.acc_steps, step.cur = list(info["acc_steps"]), int(info["cur"])
    if info["pending"] is not None:  # the host update in flight at the save, applied when the straight run does
        done = Future()
        done.set_result((a["pending"].astype(jnp.dtype(info["pending"]["dtype"])), info["pending"]["through"]))
        step._pending = done
    for k in _COUNTERS:
        setattr(step, k, int(info[k]))
    step._unimp = np.asarray(info["unimp"], np.float64)
    step._imp_sum = np.asarray(info["imp_sum"], np.float64)
    step.settings.set_shadow(info["settings"])
    step.host_opt.use({k: _unsetting(v) for k, v in info["host_settings"].items()})
    step._lr_now = float(info["lr_now"])
    step.belongs_to(int(info["state_step"]))


def _seed(step, seed: Seed, params) -> None:
    """A new engine's state from the one format (see the module docstring)."""
    opt = step.settings.opt
    mats = [seed.params[i] for i in step.mat]
    step.layout.fill(step.master, mats)
    for k in range(len(opt.slots)):
        step.layout.fill(getattr(step, _SLOT_BUFFERS[k]), [seed.slots[k][i] for i in step.mat])
    for acc in step.acc:
        acc[...] = 0
    step.acc_steps, step.cur = [0] * len(step.acc), 0
    for k in ("steps", "host_updates", "selections", "since_select", "epochs_since_select", "reflected",
              "max_staleness", "_mass_steps", "auto_fired"):
        setattr(step, k, 0)
    step._unimp[:] = 0
    step._imp_sum[:] = 0
    step.host_count = step.count_base = int(seed.count)
    fresh = step._init_dev(params)
    vec = [jax.device_put(seed.params[i], x.sharding) for i, x in zip(step.vec, fresh["vec"])]
    vec_opt = fresh["vec_opt"]
    if opt.slots:
        node = _node(vec_opt, opt.slots)
        if node is not None:
            put = {s: [jax.device_put(seed.slots[k][i], x.sharding) for i, x in zip(step.vec, getattr(node, s))]
                   for k, s in enumerate(opt.slots)}
            if hasattr(node, "count"):
                put["count"] = jnp.asarray(seed.count, node.count.dtype)
            vec_opt = _replace_node(vec_opt, node, node._replace(**put))
    step.dev = dict(fresh, vec=vec, vec_opt=vec_opt)
    step.settings.set_shadow(seed.settings)
    hp = step.settings.peek()
    step.host_opt.use(hp)
    step._lr_now = float(hp["learning_rate"])
    step.belongs_to(int(seed.state_step))


def _node(state, slots):
    """The first node of an optax state holding every one of ``slots``."""
    if all(hasattr(state, s) for s in slots) and hasattr(state, "_replace"):
        return state
    if isinstance(state, tuple):
        for child in state:
            found = _node(child, slots)
            if found is not None:
                return found
    return None


def _replace_node(state, old, new):
    if state is old:
        return new
    if isinstance(state, tuple) and not hasattr(state, "_replace"):
        return tuple(_replace_node(c, old, new) for c in state)
    return state
