"""The step contract: what every update path (on device, host offload, NVMe, ZenFlow, fused
Adam) implements and shares.

    state, metrics = step(state, batch)     # one optimizer step on the global batch
    step.lower(state, batch)                 # the jax Lowered of the step's device program
    state = step.finish(state)               # apply any update still in flight (ZenFlow)
    step.close()                             # release host threads, files and buffers

Every path returns the same metric keys (:data:`METRIC_KEYS`; a path may add its own, such
as ZenFlow's ``staleness``), checks the state and the batch before it runs, and raises the
same errors for what a step reports: :class:`~zerojax._errors.NonFiniteError` under fp32 and
:class:`~zerojax._errors.LossScaleError` when fp16 overflows at the minimum loss scale, each
carrying the returned state as ``.state``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping, Protocol, runtime_checkable

import jax

from zerojax._compat import not_persisted, persisting_breaks
from zerojax._errors import BatchError, LossScaleError, NonFiniteError, StateError
from zerojax._plan import ZeroPlan, path_str
from zerojax._state import TrainState

__all__ = ["JittedStep", "METRIC_KEYS", "NON_FINITE", "OK", "SCALE_AT_MIN", "Step", "StepBase", "StepWrapper",
           "check_batch", "check_state",
           "raise_for_error"]

# the error codes a step reports in metrics["error"]
OK, NON_FINITE, SCALE_AT_MIN = 0, 1, 2

# the metrics every path returns
METRIC_KEYS = ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped", "error")


@runtime_checkable
class Step(Protocol):
    """The interface of every step ``zj.make_train_step`` and ``zj.initialize`` return."""

    plan: ZeroPlan

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]: ...

    def lower(self, state: TrainState, batch: Any) -> Any: ...

    def finish(self, state: TrainState) -> TrainState: ...

    def close(self) -> None: ...


def raise_for_error(plan: ZeroPlan, new_state: TrainState, metrics: Mapping[str, Any]) -> None:
    """Raise the error a step reported in ``metrics["error"]``, carrying ``new_state``."""
    code = int(metrics["error"])
    if code == OK:
        return
    at = int(new_state.step) - 1
    if code == NON_FINITE:
        raise NonFiniteError(
            f"step {at}: the loss or a gradient is inf/nan under precision='fp32' "
            f"(loss={float(metrics['loss'])}); the update was skipped and the state is unchanged "
            "(see .state). Check the inputs, lower the learning rate or set gradient_clipping.", state=new_state)
    if code == SCALE_AT_MIN:
        raise LossScaleError(
            f"step {at}: fp16 gradients overflowed with the loss scale already at its "
            f"minimum ({plan.config.min_loss_scale}); DeepSpeed stops here too. Lower the "
            "learning rate, lower min_loss_scale, or train in bf16. The state is in .state.", state=new_state)
    raise ValueError(f"unknown step error code {code}")  # pragma: no cover


class StepBase:
    """What the paths share on the host: the checks before a step, the raising after it, and
    ``finish`` / ``close`` / ``with`` for paths that hold nothing in flight."""

    plan: ZeroPlan
    check_errors: bool = True

    def _check(self, state: TrainState, batch) -> None:
        check_state(self.plan, state)
        check_batch(self.plan, batch)

    def _report(self, new_state: TrainState, metrics: Mapping[str, Any]) -> None:
        if self.check_errors:
            raise_for_error(self.plan, new_state, metrics)

    def finish(self, state: TrainState) -> TrainState:
        """The state with every update applied; paths with nothing in flight return it as is."""
        check_state(self.plan, state)
        return state

    def close(self) -> None:
        """Release what the step holds (nothing on the jitted path)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()



class JittedStep(StepBase):
    """A step that is one jitted program (the on-device engine, the pipeline engine): each call
    checks the state and the batch against the plan, runs the program (``state`` may be donated:
    read only the returned state) and raises on the host what the step reported."""

    def __init__(self, jitted, plan: ZeroPlan, check_errors: bool = True):
        self.jitted = jitted
        self.plan = plan
        self.check_errors = check_errors
        self._compiling = not_persisted if persisting_breaks(plan) else contextlib.nullcontext

    def lower(self, state, batch):
        self._check(state, batch)
        return self.jitted.lower(state, batch)

    def trace(self, state, batch):
        """The jax ``Traced`` of the step's program: ``.lower(lowering_platforms=("cuda",))``
        lowers it for a platform other than this machine's (nothing is compiled or run)."""
        self._check(state, batch)
        return self.jitted.trace(state, batch)

    def __call__(self, state: TrainState, batch):
        self._check(state, batch)
        with self._compiling():
            new_state, metrics = self.jitted(state, batch)
        self._report(new_state, metrics)
        return new_state, metrics


class StepWrapper:
    """A step around another (``self.step``): ``finish`` and ``close`` go to it, it works as a
    context manager, and every attribute it does not define is the wrapped step's (``.plan``,
    ``.jitted``, ZenFlow's ``.end_epoch()``, NVMe's ``.master()``)."""

    step: Step

    # Step's members, defined here rather than left to __getattr__: from Python 3.12, isinstance
    # against a runtime-checkable Protocol looks members up statically (inspect.getattr_static)
    @property
    def plan(self) -> ZeroPlan:
        return self.step.plan

    def lower(self, state: TrainState, batch: Any) -> Any:
        return self.step.lower(state, batch)

    def finish(self, state: TrainState) -> TrainState:
        return self.step.finish(state)

    def close(self) -> None:
        self.step.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        if name == "step":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.step, name)


def check_batch(plan: ZeroPlan, batch) -> None:
    need = plan.n * plan.config.gradient_accumulation_steps
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", ())
        if len(shape) == 0 or shape[0] % need:
            raise BatchError(
                f"batch leaf {path_str(path) or '<root>'!r} has leading dimension {shape[0] if shape else 'none'}, "
                f"which must be a multiple of data devices x gradient_accumulation_steps = {plan.n} x "
                f"{plan.config.gradient_accumulation_steps} = {need}. Pad or resize the global batch."
            )


def check_state(plan: ZeroPlan, state) -> None:
    if not isinstance(state, TrainState):
        raise StateError(f"expected a zerojax TrainState (from zj.shard_train_state), got {type(state).__name__}")
    if state.plan is not plan:
        raise StateError("this step was made for another state's plan; build it with zj.make_train_step(loss_fn, state)")
    got = jax.tree_util.tree_structure(state.params)
    if got != plan.treedef:
        raise StateError(
            "state.params no longer matches the plan's params tree: "
            f"expected {plan.treedef}, got {got}. Rebuild the state with zj.shard_train_state."
        )
    bad = []
    for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(state.params)):
        want = lay.storage_shape if lay.params_partitioned else lay.shape
        if tuple(x.shape) != want:
            bad.append(f"{lay.path}: shape {tuple(x.shape)}, expected {want}")
    if bad:
        raise StateError("state.params leaves do not match the plan:\n  " + "\n  ".join(bad))
