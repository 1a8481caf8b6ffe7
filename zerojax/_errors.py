"""Every error and warning zerojax raises, under one base class each.

    try:
        state, metrics = step(state, batch)
    except zj.ZeroJaxError as e:       # any zerojax error; the step's kind carries .state
        state = e.state or state

Each message names the key, leaf, file or option at fault and the fix. An error raised by a
step carries the state the step returned (unchanged where the update was skipped) as
``.state``, passed through the constructor, so nothing the user had is lost.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "AutoTPCoverageWarning", "AutotuneError", "BatchError", "CheckpointError", "ConfigError", "DeprecatedKeyWarning", "DistributedError",
    "HostUpdateWarning",
    "IgnoredKeysWarning", "LaunchError", "LossScaleError", "NativeKernelWarning", "NonFiniteError", "NvmeError",
    "OptimizerError", "StateError", "StepOptionError", "ZeroJaxError", "ZeroJaxWarning",
]


class ZeroJaxError(Exception):
    """The base of every zerojax error. ``state``: the TrainState to continue from, where the
    error is raised after a step (None elsewhere)."""

    def __init__(self, *args: Any, state: Any = None):
        super().__init__(*args)
        self.state = state


class ZeroJaxWarning(UserWarning):
    """The base of every zerojax warning."""


class ConfigError(ZeroJaxError, ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


class StepOptionError(ConfigError):
    """``make_train_step`` was asked for an option the chosen update path cannot honour."""


class OptimizerError(ConfigError):
    """An update path cannot run this optimizer exactly; the message names the optimizer and the path."""


class BatchError(ZeroJaxError, ValueError):
    """A batch does not fit the step: a leaf whose leading dimension does not split over the data
    devices and micro-batches, or a leaf with no leading dimension; the message names the leaf."""


class StateError(ZeroJaxError, ValueError):
    """A state does not fit the step or the plan: not a TrainState, another plan's state, or params
    whose tree or shapes changed; the message names what differs and how to rebuild it."""


class NonFiniteError(ZeroJaxError, FloatingPointError):
    """fp32 training met an inf/nan loss or gradient; the state was left unchanged (``.state``)."""


class LossScaleError(ZeroJaxError, RuntimeError):
    """An fp16 overflow happened at the minimum loss scale; ``.state`` holds the returned state."""


class CheckpointError(ZeroJaxError, ValueError):
    """A checkpoint cannot be written, found, read or verified; the message names the path."""


class DistributedError(ZeroJaxError, RuntimeError):
    """A multi-process run cannot start: bad environment, called too late, or peers not reachable."""


class LaunchError(ZeroJaxError, ValueError):
    """The launch cannot start: a bad hostfile, address or option."""


class AutotuneError(ConfigError):
    """No candidate fits the budget; ``.result`` holds the table (``best`` is None)."""

    result: Any = None


class NvmeError(ZeroJaxError, OSError):
    """An NVMe offload directory cannot be used or an I/O on it failed.

    The message names the path, what went wrong and what to do about it; ``errno``
    carries the underlying error number when there is one.
    """

    def __init__(self, path: str, problem: str, fix: str, errno: int = 0, *, state: Any = None):
        OSError.__init__(self, errno, problem, str(path))
        self.state = state
        self.path, self.problem, self.fix = str(path), problem, fix

    def __str__(self) -> str:
        return f"NVMe offload path {self.path!r}: {self.problem}. Fix: {self.fix}"


class AutoTPCoverageWarning(ZeroJaxWarning):
    """AutoTP splits some weights over "model" and leaves others whole; the message lists each
    weight it leaves whole (2-D and up) with the reason, once."""


class IgnoredKeysWarning(ZeroJaxWarning):
    """A DeepSpeed config key zerojax reads but cannot honour; the message names each key."""


class NativeKernelWarning(ZeroJaxWarning):
    """The native host AdamW kernel could not be built or loaded; the XLA host loop runs instead."""


class DeprecatedKeyWarning(ZeroJaxWarning, FutureWarning):
    """A DeepSpeed config key in a deprecated spelling, read as DeepSpeed reads it; the message
    names the key to write instead. (A FutureWarning: it is meant for the user of the file.)"""


class HostUpdateWarning(ZeroJaxWarning):
    """optimizer offload could not run this optimizer's update on the host (it runs on the device)."""


class PipelineKeyWarning(IgnoredKeysWarning):
    """A key of DeepSpeed's "pipeline" block that has no meaning for zj.PipelineModel; the message names it."""
