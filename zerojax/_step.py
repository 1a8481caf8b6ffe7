"""make_train_step: the one entry point to every update path, and the step contract.

The path follows from the state's config:

    ZeroConfig(zenflow={...})                 offload.zenflow.ZenFlowStep     importance-aware host offload
    ZeroConfig(offload_optimizer="nvme")      offload.nvme_step.HostLoopStep  optimizer state in files
    anything else                             stages.device_step.TrainStep    one jitted program (stages 0–3,
                                                                              offload to host memory, fused Adam)
    a zj.PipelineModel instead of a loss      pipeline.engine.PipelineStep    stages over the mesh's "pipe" axis

Each implements :class:`zerojax._contract.Step`: ``step(state, batch) -> (state, metrics)``,
``lower``, ``finish`` and ``close``, with the same metric keys and errors. An option a path
cannot honour is a :class:`~zerojax._errors.StepOptionError` naming it, never dropped.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax._contract import METRIC_KEYS, Step, StepBase
from zerojax._errors import OptimizerError, StepOptionError
from zerojax.kernels._fused_update import fused_adam_ok
from zerojax.monitor import Monitors, monitored
from zerojax.offload._nvme_step import HostLoopStep
from zerojax.offload._zenflow import ZenFlowStep
from zerojax.pipeline import PipelineModel, make_pipeline_step
from zerojax.runtime._watched_step import watched
from zerojax.stages._device_step import TrainStep, build_device_step
from zerojax.stages._update import takes_value
from zerojax._state import TrainState
from zerojax.update._recognize import describe

__all__ = ["METRIC_KEYS", "Step", "StepBase", "TrainStep", "make_train_step"]


def _path_name(state: TrainState) -> str:
    cfg = state.plan.config
    if cfg.zenflow:
        return "zenflow"
    if cfg.offload_optimizer == "nvme":
        return "nvme"
    return "device"


def _check_extra_args(state: TrainState) -> None:
    """An optimizer whose ``update`` takes extra arguments gets the step's loss as ``value=``
    where it accepts it (:func:`zerojax.stages._update.takes_value`), nothing else. One that
    needs more (a line search's ``value_fn`` and ``grad``, Sophia's ``obj_fn``, sam's
    ``grad_fn`` in opaque mode: a function of the params), or a chain that both reads the loss
    and holds a part refusing ``value=`` (sam), is refused by name here, before anything is
    traced for the step."""
    tx = state.tx
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
        return
    plan = state.plan
    extra = {"value": np.float32(0.0)} if takes_value(tx) else {}  # numpy: nothing compiled to read a signature

    def probe(params):
        jax.eval_shape(lambda p: tx.update(p, tx.init(p), p, **extra), params)

    try:  # a one-leaf tree first: tracing the update over the whole model costs a trace of it
        probe({"x": jax.ShapeDtypeStruct((6,), jnp.float32)})
        return
    except Exception:  # noqa: BLE001 - a mask or a partition may need the model's own tree
        pass
    try:
        probe(plan.treedef.unflatten([jax.ShapeDtypeStruct(lay.shape, jnp.float32) for lay in plan.leaves]))
    except Exception as e:  # noqa: BLE001 - whatever it lacks, the step cannot give it
        if extra and isinstance(e, TypeError) and "'value'" in str(e):
            raise OptimizerError(
                f"this optimizer ({describe(tx)}) cannot be given the loss: its update takes value= (a part of it "
                f"reads the loss, or it is a chain, which hands value= to every part taking extra arguments), but a "
                f"part refuses it: {type(e).__name__}: {e}. optax.contrib.sam takes grad_fn only, so a chain of it "
                "and reduce_on_plateau, polyak_sgd or momo has no update call that serves both. Fix: drop one of "
                "the two, or wrap the part that refuses value= so its update drops it: "
                "optax.GradientTransformationExtraArgs(t.init, lambda u, s, p=None, value=None, **kw: "
                "t.update(u, s, p, **kw))") from e
        given = "value=<the loss>" if extra else "no extra arguments"
        raise OptimizerError(
            f"this optimizer ({describe(tx)}) needs more than the loss in update(): calling it with "
            f"{given} fails with {type(e).__name__}: {e}. make_train_step passes the loss as value= to an update "
            "that accepts it (optax.contrib.reduce_on_plateau, polyak_sgd and momo train; optax.contrib.sam, whose "
            "update takes grad_fn only, trains given nothing); line searches (value_fn, grad), Sophia (obj_fn) and sam in opaque mode (grad_fn) "
            "need a function of the params, which it does not pass. Fix: use an optimizer without those "
            "arguments (sam with opaque_mode=False)") from e


def make_train_step(loss_fn: Callable, state: TrainState, *, has_aux: bool = False, donate: bool = True,
                    check_errors: bool = True, fused_adam: bool = False, fused_block_size: int = 4096,
                    monitors: Optional[Monitors] = None) -> Step:
    """Build the step for ``state``'s plan; it implements :class:`zerojax._contract.Step`.

    ``loss_fn(params, batch) -> loss`` (or ``loss_fn(params, batch, rng)``, given a key unique
    to the step, device and micro-batch). The batch's leading dimension is the global batch:
    data devices x gradient_accumulation_steps x micro-batch.

        step = zj.make_train_step(loss_fn, state)
        state, metrics = step(state, batch)

    ``donate``: the jitted path donates the state's buffers (read only the returned state);
    the host paths (NVMe, ZenFlow) never donate, so ``donate=True`` costs them nothing and
    ``donate=False`` is honoured trivially. ``check_errors``: raise ``NonFiniteError`` /
    ``LossScaleError`` on the host when a step reports one (every path).

    ``fused_adam``: update with the Pallas AdamW kernel (one in-place pass per leaf over the
    master, both moments and the gradient, writing the 16-bit params too) instead of optax's
    separate loops; needs ``optax.inject_hyperparams(optax.adamw)``. Off by default; lowered
    for CPU it runs in interpret mode (for tests), lowered for a GPU as a GPU kernel (Triton on
    JAX 0.10, Mosaic GPU from 0.11), whatever machine traces the step. The host paths update on the
    host, so ``fused_adam=True`` with them is an error naming the option.

    ``monitors``: a :class:`zerojax.monitor.Monitors` (CSV, TensorBoard, wandb, progress lines,
    timings, comms and FLOPs reports); the step is then wrapped in a
    :class:`~zerojax.monitor.MonitoredStep`, whatever its path.

    Every step is watched (:mod:`zerojax.runtime._watchdog`): a step that passes
    ``ZeroConfig.step_timeout`` ends the process with code 124 after writing every thread's stack
    and the ledger of its last events; SIGTERM (or ``ZeroConfig.preemption_signal``) saves a
    checkpoint through the open ``zj.CheckpointManager`` after the step and exits with code 75.
    ``step_timeout=0`` turns both off.
    """
    if monitors is not None:
        return monitored(make_train_step(loss_fn, state, has_aux=has_aux, donate=donate, check_errors=check_errors,
                                         fused_adam=fused_adam, fused_block_size=fused_block_size), monitors)
    return watched(_path_step(loss_fn, state, has_aux, donate, check_errors, fused_adam, fused_block_size),
                   state.plan.config)


def _path_step(loss_fn, state, has_aux, donate, check_errors, fused_adam, fused_block_size) -> Step:
    """The step of the path ``state``'s plan and ``loss_fn`` choose (unwatched)."""
    _check_extra_args(state)
    if isinstance(loss_fn, PipelineModel):  # a pipeline over the mesh's "pipe" axis (zerojax.pipeline)
        return make_pipeline_step(loss_fn, state, donate=donate, check_errors=check_errors, has_aux=has_aux,
                                  fused_adam=fused_adam, fused_block_size=None if fused_block_size == 4096
                                  else fused_block_size)
    path = _path_name(state)
    if path != "device":
        if fused_adam:
            raise StepOptionError(
                f"fused_adam=True: the {path} path updates the optimizer state on the host, where the GPU kernel "
                "does not run. Fix: drop fused_adam, or train without "
                + ("the zenflow block" if path == "zenflow" else "offload_optimizer='nvme'"))
        if fused_block_size != 4096:
            raise StepOptionError(f"fused_block_size={fused_block_size} only applies with fused_adam=True on the "
                                  "on-device path. Fix: drop fused_block_size")
        if path == "zenflow":
            return ZenFlowStep(loss_fn, state, has_aux, check_errors=check_errors)
        return HostLoopStep(loss_fn, state, has_aux, store="nvme", check_errors=check_errors)
    low = state.plan.config.master_weights_dtype or state.plan.config.optimizer_state_dtype
    if fused_adam and low:
        raise StepOptionError(f"fused_adam=True: the fused kernel updates an fp32 master and fp32 moments, but this "
                              f"state keeps them in {low} (ZeroConfig.master_weights_dtype / optimizer_state_dtype). "
                              "Fix: drop fused_adam (optax's update computes in fp32 and stores bf16), or keep fp32 "
                              "states")
    # opt-in until the kernel's GPU lowering is measured inside the step on a GPU
    if fused_adam and not fused_adam_ok(state.tx):
        raise StepOptionError(f"fused_adam=True: the fused kernel computes Adam/AdamW (optax.adam / optax.adamw with "
                              "constant settings, or optax.inject_hyperparams of them, with bias correction, no mask, "
                              f"eps_root=0 and fp32 moments) and the given optimizer is {describe(state.tx)}. Fix: drop "
                              "fused_adam (every optax optimizer runs on the device path), or use Adam/AdamW")
    return build_device_step(loss_fn, state, has_aux=has_aux, donate=donate, check_errors=check_errors,
                             fused_adam=fused_adam, fused_block_size=fused_block_size)
