"""The train step for ``offload_optimizer="nvme"``: AdamW over a state kept in files.

(A recognised ``optax.contrib.muon`` keeps its momentum in the same files and orthogonalises on
the device's owners between reading it and the pass over the files: :mod:`zerojax.offload._nvme_muon`.)

ZeRO-Infinity's data flow: the jitted device part computes the reduced gradients (in the
compute dtype), the host streams the fp32 master and Adam moments from ``nvme_path`` through
``NvmeOptimizerStore`` sub-group by sub-group (reads ahead, writes behind, crash-safe commits)
and writes the updated 16-bit params, which go back to the device in the plan's layout. Host
memory holds the flat gradient and params buffers and three sub-groups of state, never the
whole state, so a state larger than host memory trains.

``MemoryAdamW`` is the same step with the state in host memory (``HostAdamW`` over flat
buffers); the NVMe step's results equal it bitwise.

With ``offload_param="nvme"`` (ZeRO-Infinity) the 16-bit params live in the same files
(:mod:`zerojax.offload._nvme_params`): each device reads its part of each param inside the step,
the store writes the updated params beside the optimizer state, and the TrainState the step
returns holds the params' shapes only (``jax.ShapeDtypeStruct``); :meth:`HostLoopStep.full_params`
reads them back.
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax.runtime import _watchdog
from zerojax._contract import StepBase
from zerojax._errors import ConfigError, StateError
from zerojax.offload._flat import FlatLayout, host_copy
from zerojax.offload._host_buffers import release
from zerojax.offload._host_rule import HostOptimizer
from zerojax.offload._nvme import NvmeOptimizerStore, _validate_dir
from zerojax.offload._nvme_muon import MuonHost
from zerojax.offload._nvme_params import DiskLayout, NvmeSource, ParamReader, local_devices
from zerojax.offload._shards import ShardLayout
from zerojax.stages._gradients import grads_fn
from zerojax.stages._muon import muon_recipe
from zerojax._state import TrainState, params_held
from zerojax.update._pipeline import check_gradients, step_metrics
from zerojax.update._recognize import StepSettings, recognize, refuse


def store_path(cfg) -> str:
    """This process's store directory under ``cfg.nvme_path``."""
    return os.path.join(cfg.nvme_path, f"zerojax_optimizer_p{jax.process_index()}")


def store_layout(plan):
    """(flat layout of the store's elements, the params' disk layout or None, the dtype of the
    params region or None): with ``offload_param="nvme"`` each leaf in its disk layout (split
    dimension first, padded) and the 16-bit params beside the state; else the user's shapes."""
    cdt = plan.compute_dtype
    if plan.config.offload_param == "nvme":  # (on several processes, each holds its own devices' rows)
        disk = DiskLayout.of(plan)
        return disk.flat, disk, (jnp.dtype(cdt) if cdt != jnp.float32 else None)
    if jax.process_count() > 1:  # each process its own devices' partitions
        return ShardLayout.of(plan), None, None
    return FlatLayout.from_tree([jax.ShapeDtypeStruct(lay.shape, np.float32) for lay in plan.leaves]), None, None


def placeholders(plan):
    """What ``state.params`` holds when the params live in files (``offload_param="nvme"``): their
    stored shapes, dtypes and shardings, no data."""
    return plan.treedef.unflatten([
        jax.ShapeDtypeStruct(plan.param_shape(lay), plan.compute_dtype, sharding=s)
        for lay, s in zip(plan.leaves, plan.treedef.flatten_up_to(plan.param_shardings))])


class MemoryAdamW:
    """The store interface over host-memory buffers: init / step / read_master / close."""

    def __init__(self, num_elements: int, optimizer: HostOptimizer):
        self.optimizer = optimizer
        self.master = np.zeros(num_elements, np.float32)
        self.m = np.zeros(num_elements, np.float32)
        self.v = np.zeros(num_elements, np.float32)

    def init(self, params_flat: np.ndarray) -> None:
        np.copyto(self.master, params_flat, casting="same_kind")
        self.m[...] = 0
        self.v[...] = 0

    def step(self, grads_flat, count: int, lr=None, grad_scale: float = 1.0, out16=None) -> None:
        self.optimizer.step(self.master, grads_flat, self.m, self.v, count, lr=lr, grad_scale=grad_scale,
                            out16=out16)

    def read_master(self, out=None):
        return self.master if out is None else np.copyto(out, self.master) or out

    def close(self) -> None:
        self.optimizer.close()


class HostLoopStep(StepBase):
    """``state, metrics = step(state, batch)`` with the optimizer state outside the TrainState.

    ``store``: "nvme" (files under ``config.nvme_path``) or "memory". The step counter of the
    optimizer (for bias correction) counts applied updates; skipped (non-finite) steps do not
    advance it, and raise ``NonFiniteError`` under fp32 as the jitted step does.
    """

    def __init__(self, loss_fn: Callable, state: TrainState, has_aux: bool = False, store: str = "nvme",
                 check_errors: bool = True):
        plan = state.plan
        cfg = plan.config
        if cfg.precision == "fp16":
            raise ConfigError("offload_optimizer='nvme' with precision='fp16' is not supported. Fix: use bf16")
        self.plan, self.cfg, self.check_errors = plan, cfg, check_errors
        opt = recognize(state.tx)
        # optax.contrib.muon: its momentum in the store's m, Newton–Schulz on the device's owners
        self.muon = muon_recipe(plan, state.tx, host_loop=True) if opt is None else None
        if opt is None and self.muon is None:
            raise refuse(state.tx, f"offload_optimizer={cfg.offload_optimizer!r} (the host loop)")
        self.cdt = plan.compute_dtype
        # params on NVMe: the flat order is each leaf's disk layout (split dim first), else the user's shapes
        self.layout, self.disk, params16 = store_layout(plan)
        # several processes: each keeps its own devices' partitions in its own store (ShardLayout)
        self.shards = isinstance(self.layout, ShardLayout)
        self.processes = jax.process_count() > 1
        master_sh = [s.with_memory_kind("device") if s.memory_kind not in (None, "device") else s
                     for s in plan.treedef.flatten_up_to(plan.master_shardings)]
        self._to_master = jax.jit(  # the params as fp32 in the update layout (a ShardLayout's source)
            lambda p: plan.treedef.flatten_up_to(placement.to_storage(plan, plan.treedef.unflatten(
                [x.astype(jnp.float32) for x in placement.params_logical(plan, p)]))),
            out_shardings=master_sh)
        if self.processes and opt is None:
            raise ConfigError(f"Muon with offload_optimizer='nvme' runs in one process (this job has "
                              f"{jax.process_count()}). Fix: run one process per machine, or offload Muon's state "
                              "to 'cpu'")
        others = {a: k for a, k in plan.mesh.shape.items() if a != plan.data_axis and k > 1}
        if self.disk is not None and others:
            raise ConfigError(f"offload_param='nvme' splits each param over the data axis only; the mesh also splits "
                              f"over {others} (tensor, sequence or pipeline parallelism). Fix: use offload_param "
                              "'cpu' with those axes, or a mesh of the data axis alone")
        if self.disk is not None and self.muon is not None:
            raise ConfigError("offload_param='nvme' with Muon is not supported: Muon's host step keeps the params in "
                              "the user's shapes, not in the files' layout. Fix: use offload_param 'cpu' with Muon "
                              "(its momentum stays on NVMe)")
        if self.disk is not None and store != "nvme":
            raise ConfigError("offload_param='nvme' keeps the params in the NVMe optimizer store's files: "
                              "use store='nvme'")
        if self.muon is not None:
            self.settings = self.host_opt = MuonHost(plan, state.tx, self.muon, self.layout)
        else:
            self.settings = StepSettings(state.tx, opt)
            self.host_opt = HostOptimizer(opt, self.settings.peek())
        n = self.layout.total
        if store == "nvme":
            _validate_dir(cfg.nvme_path)  # missing / not a directory / not writable: a clear error now
            path = store_path(cfg)
            os.makedirs(path, exist_ok=True)
            self.store = NvmeOptimizerStore(path, n, int(min(cfg.sub_group_size, n)), optimizer=self.host_opt,
                                            params_dtype=params16)
        elif store == "memory":
            self.store = MemoryAdamW(n, self.host_opt)
        else:
            raise ConfigError(f"store={store!r}: expected 'nvme' or 'memory'")
        self.grads_dtype = jnp.dtype(self.cdt)
        # the flat gradients, where a step gathers them (several processes, Muon, the in-memory store);
        # the NVMe store of one process reads them leaf by leaf instead
        self.gathers = self.shards or self.processes or self.muon is not None or store != "nvme"
        self.grads = np.empty(n, self.grads_dtype) if self.gathers else None
        self.out16 = np.empty(n, jnp.dtype(self.cdt)) if self.cdt != jnp.float32 and self.disk is None else None
        self.count = 0
        self._at = self._generation = None  # the TrainState step and the marker the store holds
        source, self.reader = None, None
        at = int(state.step)
        if at == 0 and params_held(state.params):
            # a fresh state: the store starts from its params (a store left in the path by another run is replaced)
            start = self._params_source(state.params)
            if isinstance(self.store, NvmeOptimizerStore):
                self.store.init(start, self._extra(0))
                self._taken(0)
            else:
                self.store.init(start[0:n])
            del start
            release()
        else:  # a state a step returned, or a checkpoint restored: go on from what the store committed for it
            self._resume(state)
        if self.disk is not None:
            order = [(i, d) for i in range(len(plan.leaves)) for d in local_devices(plan)]
            budget = min(cfg.offload_param_buffer_count * cfg.offload_param_buffer_size, cfg.offload_param_max_in_cpu)
            self.reader = ParamReader(self.store, self.disk, self.cdt, order, budget * jnp.dtype(self.cdt).itemsize)
            source = NvmeSource(self.disk, self.reader, self.cdt)
        compute_grads = grads_fn(loss_fn, plan, has_aux, params_source=source)
        def device(params, batch, rng):
            g, loss = compute_grads(params, batch, jnp.float32(1.0), rng)
            checked = check_gradients(cfg, placement.to_update(plan, g), loss)
            leaves = [(x / checked.coef).astype(self.cdt) for x in plan.treedef.flatten_up_to(checked.grads)]
            if self.disk is not None:  # the gradients in the params' disk layout (zeros where padded)
                leaves = [self.disk.to_disk(lay, placement.pad(x, lay)) if lay.params_partitioned else x
                          for lay, x in zip(plan.leaves, leaves)]
            elif self.shards:  # the update layout: each process reads its own devices' partitions
                leaves = plan.treedef.flatten_up_to(placement.to_storage(plan, plan.treedef.unflatten(leaves)))
            return leaves, loss, checked._replace(grads=None)

        def place(leaves):
            if self.shards:  # update layout -> the params' layout
                leaves = [placement.unpad(x, lay) for lay, x in zip(plan.leaves, leaves)]
            return placement.params_stored(plan, [x.astype(self.cdt) for x in leaves])

        if self.shards:
            self._device = jax.jit(device, out_shardings=(master_sh, None, None))
        elif self.processes and self.disk is not None:  # each process reads its own rows of the gradients
            self._device = jax.jit(device, out_shardings=([self.disk.sharding(i) for i in range(len(plan.leaves))],
                                                          None, None))
        else:
            self._device = jax.jit(device)
        self._place = jax.jit(place, out_shardings=plan.param_shardings)

    # -- the store's committed state and the TrainState it belongs to ---------------------------
    def _extra(self, state_step: int, since: int | None = None) -> dict:
        """What the store's marker records beside the slot and count: the TrainState steps the
        committed state belongs to (``since`` to ``state_step``: skipped steps leave it as it was)
        and the optimizer's settings (a checkpoint of the run is written from the files and the
        marker alone: zerojax.checkpoint._outside)."""
        shadow = None if self.muon is not None else self.settings.shadow_leaves()
        return {"state_step": int(state_step), "since": int(state_step if since is None else since),
                "settings": shadow, "optimizer": "muon" if self.muon is not None else "optax"}

    def _taken(self, state_step: int) -> None:
        self._at, self._generation = state_step, self.store.marker["generation"]

    def _resume(self, state: TrainState) -> None:
        """Go on from the store's committed state, which must be ``state``'s step: a state of
        another step (an older one, while the store trained on; a checkpoint restored elsewhere)
        would mix the params of one step with the optimizer state of another."""
        at = int(state.step)
        marker = self.store.reload() if isinstance(self.store, NvmeOptimizerStore) else None
        held = None if marker is None else marker.get("state_step")
        if held is None or not marker.get("since", held) <= at <= held:
            what = (f"nothing committed" if marker is None else
                    f"the optimizer state of step {held}" if held is not None else "a state of unknown step")
            raise StateError(
                f"this state is at step {at}, and its optimizer state (offload_optimizer='nvme') lives in "
                f"{getattr(self.store, 'path', 'the store')}, which holds {what}: the two do not belong together. "
                "Fix: restore the step's checkpoint with zj.checkpoint.restore / CheckpointManager.restore onto a "
                "target with this nvme_path (that writes the store), or train on from the state the last step "
                "returned")
        if self.muon is not None and self._at is None:
            raise StateError("Muon with offload_optimizer='nvme' goes on only from the step object that trained "
                             "it: its settings are not recorded in the store. Fix: keep the step, or offload "
                             "Muon's state to 'cpu'")
        if self.muon is None:
            self.settings.set_shadow(marker.get("settings"))
        self.count = int(marker["count"])
        self._taken(at)

    def _sync(self, state: TrainState) -> None:
        """Before a step: the store must still hold this state's step (a restore may have
        rewritten it, or the state may be an older one)."""
        if not isinstance(self.store, NvmeOptimizerStore):
            return
        marker = self.store.reload()
        if marker is None or marker.get("generation") != self._generation or int(state.step) != self._at:
            self._resume(state)

    def _params_source(self, params):
        """The store's flat params (fp32) from the state's params: on several processes this
        process's partitions (:class:`ShardLayout`, or its rows of the disk layout) as one array;
        else a :meth:`FlatLayout.source` bringing one leaf to the host at a time, so the init never
        holds a whole copy of the model."""
        plan = self.plan
        leaves = plan.treedef.flatten_up_to(params)
        if self.disk is not None and self.processes:
            return self.disk.shards.fill(np.empty(self.layout.total, np.float32),
                                         [self.disk.in_disk_order(i, x) for i, x in enumerate(leaves)])
        if self.shards:
            return self.layout.fill(np.empty(self.layout.total, np.float32), self._to_master(params))

        def host(i, x):  # leaf i in the store's layout: split dimension first on disk, else the user's shape
            lay = plan.leaves[i]
            if not lay.params_partitioned:
                return host_copy(x)
            return np.moveaxis(host_copy(x), lay.axis, 0) if self.disk is not None else host_copy(placement.unpad(x, lay))

        return self.layout.source(leaves, np.float32, host)

    def _params_in(self, state: TrainState):
        return None if self.disk is not None else state.params

    def lower(self, state: TrainState, batch):
        """The jax Lowered of the device part (gradients, norm, clipping); the update runs on the host."""
        self._check(state, batch)
        return self._device.lower(self._params_in(state), batch, jax.random.fold_in(state.rng, state.step))

    def trace(self, state: TrainState, batch):
        """The jax Traced of the device part: ``.lower(lowering_platforms=("cuda",))`` lowers it for
        another platform than this machine's."""
        self._check(state, batch)
        return self._device.trace(self._params_in(state), batch, jax.random.fold_in(state.rng, state.step))

    def __call__(self, state: TrainState, batch):
        self._check(state, batch)
        self._sync(state)
        rng = jax.random.fold_in(state.rng, state.step)
        if self.reader is not None:
            self.reader.begin()
            try:
                grads, loss, checked = self._device(None, batch, rng)
                skip = bool(checked.skip)
            except Exception as e:
                if self.reader.error is not None:  # a failed read of the params' files (NvmeError)
                    raise self.reader.error from e
                raise
            finally:
                self.reader.end()
            state = state.replace(params=self.placeholders())
        else:
            grads, loss, checked = self._device(state.params, batch, rng)
            skip = bool(checked.skip)
        hp = self.settings.peek()  # what this step uses, or would have used where skipped
        if not skip:
            if self.processes and self.disk is not None:
                self.disk.shards.fill(self.grads, grads)
                flat_grads = self.grads
            elif self.gathers:
                self.layout.fill(self.grads, grads)
                flat_grads = self.grads
            else:  # one leaf on the host at a time, as the store's sub-groups ask for it; each
                # leaf's device buffer goes once the reads have passed it
                flat_grads = self.layout.source(grads, self.grads_dtype, once=True)
            del grads
            self.count += 1
            if self.muon is not None:  # the momentum read from the store, orthogonalised on owners
                m = self.store.read("m") if hasattr(self.store, "read") else self.store.m
                self.host_opt.prepare(flat_grads, m, self.count)
            else:
                self.host_opt.use(self.settings.next())
            # a failed write raises NvmeError here; the store keeps its last committed step and
            # the caller's state (not donated) is untouched
            self.store.step(flat_grads, self.count, lr=float(hp["learning_rate"]), out16=self.out16,
                            **self._commit_extra(int(state.step) + 1))
            del flat_grads  # the gradients' device buffers go before the params are placed
            _watchdog.record("host update", detail="nvme")
            if self.disk is None:
                flat = self.out16 if self.out16 is not None else self.store.read_master()
                leaves = self.layout.arrays(flat) if self.shards else self.layout.views(flat)
                state = state.replace(params=self._place(leaves))
        elif isinstance(self.store, NvmeOptimizerStore):  # no update: the committed state now belongs to the next step
            self.store.annotate(self._extra(int(state.step) + 1, self.store.marker.get("since")))
        if isinstance(self.store, NvmeOptimizerStore):
            self._taken(int(state.step) + 1)
        new_state = state.replace(step=state.step + 1)
        metrics = step_metrics(self.cfg, loss, checked, hp["learning_rate"])
        self._report(new_state, metrics)
        return new_state, metrics

    def _commit_extra(self, state_step: int) -> dict:
        return {"extra": self._extra(state_step)} if isinstance(self.store, NvmeOptimizerStore) else {}

    def placeholders(self):
        """What ``state.params`` holds when the params live in files (:func:`placeholders`)."""
        return placeholders(self.plan)

    def full_params(self, dtype=None):
        """The params as the user's tree (logical shapes, numpy), read from the files when
        they live there (``offload_param="nvme"``), else from the fp32 master in the store."""
        plan = self.plan
        if self.shards:  # every process's partitions, gathered on every process
            whole = jax.jit(lambda ls: [placement.unpad(x, lay) for lay, x in zip(plan.leaves, ls)],
                            out_shardings=NamedSharding(plan.mesh, P()))(self.layout.arrays(self.store.read_master()))
            leaves = [np.asarray(x.addressable_data(0)) for x in whole]
        elif self.disk is None:
            flat = self.store.read_master()
            leaves = jax.tree_util.tree_leaves(self.layout.views(flat))
        elif self.processes:  # every process's rows, gathered on every process
            flat = np.empty(self.layout.total, self.store.params_dtype or np.float32)
            self.store.read_params(0, flat)
            whole = jax.jit(lambda ls: [placement.unpad(self.disk.from_local(i, x), lay) if lay.params_partitioned else x
                                        for i, (lay, x) in enumerate(zip(plan.leaves, ls))],
                            out_shardings=NamedSharding(plan.mesh, P()))(self.disk.shards.arrays(flat))
            leaves = [np.asarray(x.addressable_data(0)) for x in whole]
        else:
            leaves = []
            for i, lay in enumerate(plan.leaves):
                whole = np.empty(self.disk.shapes[i], self.store.params_dtype or np.float32)
                self.store.read_params(self.disk.flat.offsets[i], whole)
                if lay.params_partitioned:
                    whole = np.moveaxis(whole, 0, lay.axis)[tuple(slice(0, d) for d in lay.shape)]
                leaves.append(whole)
        return plan.treedef.unflatten([np.asarray(x, dtype or lay.dtype) for lay, x in zip(plan.leaves, leaves)])

    def master(self) -> np.ndarray:
        """The fp32 master as one flat array (read from the store)."""
        return np.array(self.store.read_master())

    def close(self) -> None:
        self.store.close()
        self.host_opt.close()  # an NVMe store does not own it; closing twice is harmless


__all__ = ["HostLoopStep", "MemoryAdamW", "placeholders", "store_layout", "store_path"]
