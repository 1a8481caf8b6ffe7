"""ZenFlow: importance-aware optimizer offload that keeps the device busy.

With ``zero_optimization.zenflow`` (and ``offload_optimizer.device = "cpu"``) the step splits
the AdamW update between the device and the host (REFERENCE.md §8):

* every 2-D weight ``W[in, out]`` (Flax/JAX layout: row ``i`` holds the weights reading input
  feature ``i``, DeepSpeed's "column" of its ``[out, in]`` weights) is scored per input feature
  by the L1 norm of its reduced gradient; the top ``topk_ratio`` features are *important*.
  Only the scores (one number per feature) cross devices to pick them, never the gradient;
* every step the device updates the important rows with a small AdamW whose fp32 copy and
  moments exist only for them, and every other (1-D, stacked) param with a full AdamW;
* the host accumulates every element's gradient (fp32) and every ``update_interval`` steps
  runs AdamW (``HostAdamW``, multi-threaded, in place) on the fp32 master, then writes the
  result back to the device except for the important rows, which keep the device's fresher
  values;
* with ``overlap_step`` the host update runs on a background thread while the device computes
  the next interval (two gradient accumulators), never more than one update in flight, so no
  weight is more than ``2·update_interval − 1`` steps stale (asserted every step);
* ``update_interval: "auto"`` fires the host update when, for at least ``auto_ratio`` of the
  2-D weights, the unimportant gradient mass accumulated since the last update, divided by
  ``(1 − k)·10``, reaches the important mass of one step (its running mean since the last
  update), divided by ``k·10``; it also fires after ``AUTO_MAX_INTERVAL`` steps at the latest,
  so it can never stall, and every division is guarded;
* reselection (``select_strategy`` step / epoch / auto with ``select_interval``) first
  applies any accumulated gradients, then re-syncs the host master from the device weights
  and resets the device moments. ``full_warm_up_rounds`` steps of plain offloaded AdamW
  (host update every step) come first.

Counters are Python integers: nothing saturates.

    state = zj.shard_train_state(params, optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
                                 config=zj.ZeroConfig(stage=2, offload_optimizer="cpu",
                                                      zenflow={"topk_ratio": 0.1, "update_interval": 4}))
    step = zj.make_train_step(loss_fn, state)       # a ZenFlowStep
    for batch in data:
        state, metrics = step(state, batch)
    step.end_epoch()                                 # for select_strategy epoch / auto
    step.finish(state)                               # waits for the host, applies pending grads

A checkpoint of the state the step returned holds the step's own state too (accumulators, a host
update in flight, selection, counters) and a step built from the restored state goes on exactly:
see :mod:`zerojax.checkpoint._zenflow_state`.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax.config._checks import zenflow_block
from zerojax._contract import StepBase, check_state
from zerojax._errors import ConfigError, StateError
from zerojax.offload._engines import attach
from zerojax.offload._flat import FlatLayout
from zerojax.offload._host_buffers import host_zeros
from zerojax.offload._host_rule import HostOptimizer
from zerojax.stages._gradients import grads_fn
from zerojax._state import TrainState
from zerojax.update._pipeline import check_gradients, step_metrics
from zerojax.update._recognize import StepSettings, direction, recognize, refuse

AUTO_MAX_INTERVAL = 64  # "auto" fires at least this often
_TICKS = itertools.count()  # orders the engines' steps (a checkpoint reads the latest engine of a step)


def _accumulate(acc: np.ndarray, g: np.ndarray) -> None:
    """``acc += g`` in fp32, in place. bfloat16 is widened by a bit shift (exact, and far faster
    than a generic dtype cast)."""
    if g.dtype == jnp.bfloat16:
        wide = np.left_shift(g.view(np.uint16).astype(np.uint32), 16).view(np.float32)
        np.add(acc, wide, out=acc)
    else:
        np.add(acc, g, out=acc, casting="same_kind")


def split_leaves(plan, k: float) -> tuple[list, list, list]:
    """(2-D weights, other leaves, selected rows per 2-D weight) of a plan, as leaf indices: the
    2-D weights get the selective treatment, every other leaf is updated on the device."""
    mat = [i for i, lay in enumerate(plan.leaves) if len(lay.shape) == 2 and lay.shape[0] > 1]
    vec = [i for i in range(len(plan.leaves)) if i not in mat]
    return mat, vec, [max(1, math.ceil(k * plan.leaves[i].shape[0])) for i in mat]


def zenflow_settings(block: Optional[dict]) -> dict:
    """The zenflow block with defaults filled in and checked (DeepSpeed's rules, as for a
    DeepSpeed config file)."""
    return zenflow_block({} if block is None else block)


class ZenFlowStep(StepBase):
    """The train step for a ZenFlow config; ``state, metrics = step(state, batch)``.

    It implements :class:`zerojax._contract.Step`. A step whose loss or gradients hold inf/nan
    changes nothing (no device update, no gradient reaches the host, the schedule stays) and
    reports ``skipped``; under fp32 it raises ``NonFiniteError`` carrying the returned state.
    Beyond the common metrics: ``staleness`` (steps since every weight last reflected every
    gradient) and ``host_updates``.

    Attributes worth reading: ``host_updates`` (count), ``selections`` (count),
    ``max_staleness`` (largest steps any weight lagged), ``bytes_to_host`` / ``bytes_to_device``
    (host↔device traffic so far), ``important`` (path -> selected input-feature indices).
    """

    def __init__(self, loss_fn: Callable, state: TrainState, has_aux: bool = False, check_errors: bool = True):
        plan = state.plan
        self.check_errors = check_errors
        cfg = plan.config
        if cfg.offload_optimizer != "cpu":
            raise ConfigError("zenflow needs offload_optimizer='cpu' (the host runs the bulk of the update). "
                              'Fix: set offload_optimizer="cpu" / "offload_optimizer": {"device": "cpu"}')
        if cfg.stage not in (1, 2, 3):
            raise ConfigError(f"zenflow works with ZeRO stages 1, 2 and 3, not {cfg.stage}. Fix: set stage=2")
        if cfg.precision == "fp16":
            raise ConfigError("zenflow with precision='fp16' is not supported (its loss scaler would have to skip "
                              "host updates). Fix: use bf16")
        self.plan, self.z = plan, zenflow_settings(cfg.zenflow)
        opt = recognize(state.tx)
        if opt is None:
            raise refuse(state.tx, "zenflow")
        self.settings = StepSettings(state.tx, opt)
        hp = self.settings.peek()
        self.k = float(self.z["topk_ratio"])
        self.interval = self.z["update_interval"]
        self.overlap = bool(self.z["overlap_step"])
        cdt = plan.compute_dtype
        self.cdt = cdt
        self.mat, self.vec, self.topk = split_leaves(plan, self.k)
        # the optimizer without its learning rate, which is applied per step (schedules): the
        # user's optimizer is this direction followed by scaling with -lr
        self.dev_tx = direction(opt, hp)
        cores = os.cpu_count() or 1
        threads = max(1, round(cores * float(self.z["pt_reserved_cores_perc"])))
        self.host_opt = HostOptimizer(opt, hp, num_threads=threads)
        # one host worker runs, in order, every gradient's accumulation and every host update, so
        # the device's next steps are dispatched while the host is busy (a FIFO: an update sees
        # exactly the gradients accumulated before it)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="zenflow-host")
        self._lr_now = float(hp["learning_rate"])

        # ---- host buffers (fp32, logical shapes of the 2-D weights, one flat buffer each)
        self.layout = FlatLayout.from_tree([jax.ShapeDtypeStruct(plan.leaves[i].shape, np.float32) for i in self.mat])
        total = self.layout.total
        # buffers XLA can update in place: the host AdamW runs as one compiled pass over them
        self.master = host_zeros(total, np.float32)
        self._master_from(state.params)
        self.m = host_zeros(total, np.float32)
        self.v = host_zeros(total, np.float32)
        self.acc = [np.zeros(total, np.float32) for _ in range(2 if self.overlap else 1)]
        self.acc_steps = [0] * len(self.acc)
        self.cur = 0  # the accumulator the device's gradients go to
        self.out16 = host_zeros(total, jnp.dtype(cdt)) if cdt != jnp.float32 else None
        # ---- device state: fp32 copies + moments of the selected rows, and of the other leaves
        self.dev = None
        # ---- bookkeeping (Python ints)
        self.steps = 0
        self.host_count = 0
        self.host_updates = 0
        self.selections = 0
        self.since_select = 0
        self.epochs_since_select = 0
        self.reflected = 0  # every weight reflects the gradients of steps <= this one
        self.max_staleness = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self._pending: Optional[Future] = None
        self._unimp = np.zeros(len(self.mat))
        self._imp_sum = np.zeros(len(self.mat))
        self._mass_steps = 0
        self.auto_fired = 0
        self.important = {}
        self.count_base = 0  # applied updates before this engine's first step (a restored run's)
        self.state_step: Optional[int] = None  # the TrainState step this engine's state belongs to
        self.resumed_at: Optional[int] = None  # a restore loaded the state of this step: the next one given
        self.closed = False
        self._build(loss_fn, has_aux)
        # checkpoints: a save finds this engine by its plan; a restore's engine state is taken up here
        attach(self, state.params)

    # ------------------------------------------------------------------ helpers
    def _master_from(self, params) -> None:
        """The host master of the 2-D weights := the device's params (widened to fp32)."""
        logical = placement.params_logical(self.plan, params)
        self.layout.fill(self.master, [logical[i] for i in self.mat])

    def _build(self, loss_fn, has_aux):
        plan, cdt, mat, vec = self.plan, self.cdt, self.mat, self.vec
        compute_grads = grads_fn(loss_fn, plan, has_aux)
        tx, topk, cfg = self.dev_tx, self.topk, plan.config
        masses = self.interval == "auto"
        f32 = jnp.float32
        rep = NamedSharding(plan.mesh, P())

        shardings = plan.param_shardings

        def init_dev(params):
            leaves = placement.params_logical(plan, placement.fetch(params, shardings))
            vec_master = [leaves[i].astype(f32) for i in vec]
            return {"idx": [jnp.zeros((k,), jnp.int32) for k in topk],
                    "sel": [jnp.zeros((k,) + plan.leaves[i].shape[1:], f32) for i, k in zip(mat, topk)],
                    "sel_opt": tx.init([jnp.zeros((k,) + plan.leaves[i].shape[1:], f32) for i, k in zip(mat, topk)]),
                    "vec": vec_master, "vec_opt": tx.init(vec_master)}

        def descend(ps, updates, lr):
            return jax.tree_util.tree_map(lambda p, u: p + u * (-lr), ps, updates)

        def device_step(params, dev, batch, rng, lr, reselect: bool, warm: bool):
            # offload_param: the params' home is host memory; they are read and updated here on
            # the device, and out_shardings puts them back
            params = placement.fetch(params, shardings)
            leaves = placement.params_logical(plan, params)
            g_st, loss = compute_grads(params, batch, f32(1.0), rng)
            checked = check_gradients(cfg, plan.treedef.flatten_up_to(placement.to_update(plan, g_st)), loss)
            g = [x / checked.coef for x in checked.grads]
            idx, sel, sel_opt = dev["idx"], dev["sel"], dev["sel_opt"]
            if reselect:
                # one score per input feature crosses devices, not the gradient
                idx = [jax.lax.top_k(jax.lax.with_sharding_constraint(jnp.sum(jnp.abs(g[i]), axis=1), rep), k)[1]
                       for i, k in zip(mat, topk)]
                idx = [jnp.sort(ix) for ix in idx]
                sel = [leaves[i].astype(f32)[ix] for i, ix in zip(mat, idx)]
                sel_opt = tx.init(sel)
            g_sel = [g[i][ix] for i, ix in zip(mat, idx)]
            out = list(leaves)
            if not warm:
                upd, sel_opt = tx.update(g_sel, sel_opt, sel)
                sel = descend(sel, upd, lr)
                for i, ix, s in zip(mat, idx, sel):
                    out[i] = leaves[i].at[ix].set(s.astype(cdt))
            vec_g = [g[i] for i in vec]
            upd, vec_opt = tx.update(vec_g, dev["vec_opt"], dev["vec"])
            vec_master = descend(dev["vec"], upd, lr)
            for i, x in zip(vec, vec_master):
                out[i] = x.astype(cdt)
            metrics = {"loss": loss, "checked": checked._replace(grads=None)}
            if masses:  # Zen-auto's gradient masses: two passes over the gradients, only when read
                imp = jnp.stack([jnp.sum(jnp.abs(x)) for x in g_sel]) if mat else jnp.zeros((0,))
                tot = jnp.stack([jnp.sum(jnp.abs(g[i])) for i in mat]) if mat else jnp.zeros((0,))
                metrics.update(imp=imp, unimp=tot - imp)
            new_params = placement.params_stored(plan, out)
            new_dev = {"idx": idx, "sel": sel, "sel_opt": sel_opt, "vec": vec_master, "vec_opt": vec_opt}
            # a non-finite step changes nothing; a select (not lax.cond) keeps the update in place
            apply = ~checked.skip
            keep = functools.partial(jax.tree_util.tree_map, lambda o, n: jnp.where(apply, n, o))
            new_params, new_dev = keep(params, new_params), keep(dev, new_dev)
            host_grads = [jnp.where(apply, g[i], 0).astype(cdt) for i in mat]
            return new_params, new_dev, host_grads, metrics

        def merge(params, host_params, idx, keep_selected: bool):
            leaves = placement.params_logical(plan, placement.fetch(params, shardings))
            out = list(leaves)
            for j, i in enumerate(mat):
                new = host_params[j].astype(cdt)
                out[i] = new.at[idx[j]].set(leaves[i][idx[j]]) if keep_selected else new
            return placement.params_stored(plan, out)

        self._init_dev = jax.jit(init_dev)
        self._device_step = jax.jit(device_step, static_argnames=("reselect", "warm"), donate_argnums=(0, 1),
                                    out_shardings=(shardings, None, None, None))
        self._merge = jax.jit(merge, static_argnames=("keep_selected",), donate_argnums=(0,),
                              out_shardings=shardings)

    # ------------------------------------------------------------------ host side
    def _host_update(self, acc_i: int, through: int, lr: float) -> tuple:
        """AdamW on the host over the mean gradient of the accumulator; runs on a worker thread
        with ``overlap_step``. Returns the updated weights (compute dtype) and ``through``."""
        n = self.acc_steps[acc_i]
        self.host_count += 1
        self.host_opt.step(self.master, self.acc[acc_i], self.m, self.v, count=self.host_count,
                           lr=lr, grad_scale=1.0 / n, out16=self.out16)
        result = (self.out16 if self.out16 is not None else self.master).copy()
        self.acc[acc_i][...] = 0
        self.acc_steps[acc_i] = 0
        return result, through

    def _accumulate_grads(self, acc_i: int, grads) -> None:
        for view, g in zip(self.layout.views(self.acc[acc_i]), grads):
            _accumulate(view, np.asarray(g))

    def _drain(self) -> None:
        """Wait until the host worker has done everything submitted so far."""
        self._executor.submit(lambda: None).result()

    def _apply(self, params, result):
        flat, through = result
        keep_selected = self.selections > 0  # during warm-up nothing is selected yet
        host_params = self.layout.views(flat)
        self.bytes_to_device += flat.nbytes
        params = self._merge(params, host_params, self.dev["idx"], keep_selected=keep_selected)
        self.reflected = max(self.reflected, through)
        self.host_updates += 1
        return params

    def _wait_pending(self, params):
        if self._pending is not None:
            result = self._pending.result()
            self._pending = None
            params = self._apply(params, result)
        return params

    def _launch(self, params, sync: bool):
        """Start a host update over the current accumulator (at most one in flight)."""
        params = self._wait_pending(params)
        assert self._pending is None, "two host updates in flight"
        acc_i = self.cur
        if self.acc_steps[acc_i] == 0:
            return params
        through = self.steps
        if sync:
            update = self._executor.submit(self._host_update, acc_i, through, self._lr_now)
            params = self._apply(params, update.result())
        else:
            self._pending = self._executor.submit(self._host_update, acc_i, through, self._lr_now)
            self.cur = 1 - self.cur  # the device's next gradients go to the other accumulator
        self._unimp[:] = 0
        self._imp_sum[:] = 0
        self._mass_steps = 0
        return params

    def _auto_fires(self) -> bool:
        if self.acc_steps[self.cur] >= AUTO_MAX_INTERVAL:
            return True
        if self._mass_steps == 0 or not self.mat:
            return False
        imp_mean = self._imp_sum / self._mass_steps
        lhs = self._unimp / ((1.0 - self.k) * 10.0)
        rhs = imp_mean / (self.k * 10.0)
        ok = np.where(rhs > 0, lhs >= rhs, lhs > 0)
        return bool(np.mean(ok) >= self.z["auto_ratio"])

    def _reselect_due(self) -> bool:
        if self.selections == 0:
            return True
        strategy, interval = self.z["select_strategy"], self.z["select_interval"]
        if interval == "auto":  # strategy auto: once per epoch
            return self.epochs_since_select >= 1
        if strategy == "epoch":
            return self.epochs_since_select >= interval
        return self.since_select >= interval

    def belongs_to(self, at: int) -> None:
        """This engine's state is now that of TrainState step ``at`` (what a checkpoint checks)."""
        self.state_step, self._ckpt_tick = at, next(_TICKS)

    def end_epoch(self) -> None:
        """Tell ZenFlow an epoch ended (select_strategy 'epoch' and 'auto' reselect per epoch)."""
        self.epochs_since_select += 1

    # ------------------------------------------------------------------ the step
    def _variant(self) -> tuple[bool, bool]:
        """(warm, reselect) of the next step."""
        warm = self.steps < self.z["full_warm_up_rounds"]
        return warm, not warm and self._reselect_due()

    def lower(self, state: TrainState, batch):
        """The jax Lowered of the device program the next step runs (nothing is updated)."""
        return self.trace(state, batch).lower()

    def trace(self, state: TrainState, batch):
        """The jax Traced of the device program the next step runs (nothing is updated):
        ``.lower(lowering_platforms=("cuda",))`` lowers it for another platform."""
        self._check(state, batch)
        warm, reselect = self._variant()
        dev = self.dev if self.dev is not None else self._init_dev(state.params)
        rng = jax.random.fold_in(state.rng, state.step)
        return self._device_step.trace(state.params, dev, batch, rng,
                                       jnp.float32(self.settings.peek()["learning_rate"]),
                                       reselect=reselect, warm=warm)

    def __call__(self, state: TrainState, batch):
        self._check(state, batch)
        at = int(state.step)
        if self.resumed_at is not None and at != self.resumed_at:
            raise StateError(f"this ZenFlow step holds the optimizer state restored for step {self.resumed_at}, "
                             f"but the state given is at step {at}: it would train on another step's moments. "
                             "Fix: step the state the restore returned")
        self.resumed_at = None
        params = state.params
        if self.dev is None:
            self.dev = self._init_dev(params)
        warm, reselect = self._variant()
        if reselect:
            # no gradient is dropped: pending and accumulated ones are applied first, then the
            # host master is re-synced from the device weights and the device moments restart
            params = self._launch(params, sync=True)  # waits for the pending update first
            self._drain()
            self.cur = 0
            self._master_from(params)
            self.bytes_to_host += self.layout.total * jnp.dtype(self.cdt).itemsize
            self.reflected = self.steps
            self.selections += 1
            self.since_select = 0
            self.epochs_since_select = 0
        rng = jax.random.fold_in(state.rng, state.step)
        hp = self.settings.peek()
        lr = float(hp["learning_rate"])
        params, self.dev, grads, metrics = self._device_step(params, self.dev, batch, rng, jnp.float32(lr),
                                                             reselect=reselect, warm=warm)
        self.belongs_to(at + 1)
        if bool(metrics["checked"].skip):  # nothing changed: no gradient goes to the host
            new_state = state.replace(step=state.step + 1, params=params)
            out = self._metrics(metrics, lr)
            self._report(new_state, out)
            return new_state, out
        self.host_opt.use(self.settings.next())
        self._lr_now = lr
        self.steps += 1
        self.since_select += 1
        # the full gradient goes to the host (in the compute dtype) and is accumulated in fp32
        # on the host worker, so this thread goes on to dispatch the next device step
        self.bytes_to_host += sum(int(g.nbytes) for g in grads)
        self._executor.submit(self._accumulate_grads, self.cur, grads)
        self.acc_steps[self.cur] += 1
        if self.interval == "auto":  # Zen-auto reads the step's masses (waits for the device)
            self._imp_sum += np.asarray(metrics["imp"], np.float64)
            self._unimp += np.asarray(metrics["unimp"], np.float64)
            self._mass_steps += 1
        if warm:
            params = self._launch(params, sync=True)
            self.reflected = self.steps
        else:
            if self.interval == "auto":
                due = self._auto_fires()
                self.auto_fired += int(due)
            else:
                due = self.acc_steps[self.cur] >= self.interval
            if due:
                params = self._launch(params, sync=not self.overlap)
        staleness = self.steps - self.reflected
        self.max_staleness = max(self.max_staleness, staleness)
        if self.interval != "auto":
            bound = 2 * self.interval - 1 if self.overlap else self.interval - 1
            assert staleness <= bound, f"zenflow: weights {staleness} steps stale, bound {bound}"
        self.important = {self.plan.leaves[i].path: ix for i, ix in zip(self.mat, self.dev["idx"])}
        new_state = state.replace(step=state.step + 1, params=params)
        out = self._metrics(metrics, lr, staleness=staleness)
        self._report(new_state, out)
        return new_state, out

    def _metrics(self, metrics, lr: float, staleness: Optional[int] = None) -> dict:
        return step_metrics(self.plan.config, metrics["loss"], metrics["checked"], lr,
                            staleness=self.steps - self.reflected if staleness is None else staleness,
                            host_updates=self.host_updates)

    def finish(self, state: TrainState) -> TrainState:
        """Wait for the host, apply every accumulated gradient, and return the up-to-date state
        (call before evaluating; a checkpoint needs no finish, it saves what is pending)."""
        check_state(self.plan, state)
        params = self._launch(state.params, sync=True)  # waits for the pending update first
        self._drain()
        self.reflected = self.steps
        return state.replace(params=params)

    def close(self) -> None:
        self.closed = True
        self._executor.shutdown(wait=True)
        self.host_opt.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


__all__ = ["ZenFlowStep", "split_leaves", "zenflow_settings", "AUTO_MAX_INTERVAL"]
