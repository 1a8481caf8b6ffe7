"""What to monitor: DeepSpeed's monitor blocks as frozen dataclasses, from Python or a file.

    monitors = Monitors(csv=CSVMonitor("runs", "exp1"), tensorboard=TensorBoardMonitor("runs", "exp1"),
                        steps_per_print=10)
    monitors = Monitors.from_deepspeed("ds_config.json")     # its csv_monitor, tensorboard, wandb, ... blocks
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Union

from zerojax.config._checks import read_block, read_monitors
from zerojax.config._deepspeed import _load
from zerojax.config._keys import TOP
from zerojax.config._verdicts import Verdicts
from zerojax._errors import ConfigError

__all__ = ["CSVMonitor", "CommsLogger", "FlopsProfiler", "Monitors", "TensorBoardMonitor", "WandbMonitor"]

JOB_NAME = "DeepSpeedJobName"  # DeepSpeed's default job_name


def _need(ok: bool, what: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{what}. Fix: {fix}")


@dataclasses.dataclass(frozen=True)
class _LogDirMonitor:
    """A writer of files under DeepSpeed's ``output_path/job_name/``."""

    output_path: str = ""
    job_name: str = JOB_NAME

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path, self.job_name)


@dataclasses.dataclass(frozen=True)
class CSVMonitor(_LogDirMonitor):
    """One CSV file per tag under ``output_path/job_name/`` (DeepSpeed's ``csv_monitor``):
    ``Train_Samples_train_loss.csv`` with the rows ``step,train_loss`` (step = samples seen)."""


@dataclasses.dataclass(frozen=True)
class TensorBoardMonitor(_LogDirMonitor):
    """A TensorBoard event file under ``output_path/job_name/`` (DeepSpeed's ``tensorboard``),
    written with tensorboardX (``pip install 'zerojax[tensorboard]'``)."""


@dataclasses.dataclass(frozen=True)
class WandbMonitor:
    """A Weights & Biases run (DeepSpeed's ``wandb``: project, group, team), written with the
    wandb client (``pip install 'zerojax[wandb]'``). ``dir`` and ``mode`` ("online",
    "offline", "disabled") are passed to ``wandb.init``; None leaves them to wandb
    (``WANDB_DIR``, ``WANDB_MODE``)."""

    project: str = "deepspeed"
    group: Optional[str] = None
    team: Optional[str] = None
    dir: Optional[str] = None
    mode: Optional[str] = None


# DeepSpeed's names of collectives (torch.distributed's) -> the HLO kinds of zj.comm_report
OP_KINDS = {
    "all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce", "inference_all_reduce": "all-reduce",
    "all_gather": "all-gather", "all_gather_into_tensor": "all-gather", "all_gather_coalesced": "all-gather",
    "allgather_fn": "all-gather", "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_fn": "reduce-scatter", "all_to_all": "all-to-all", "all_to_all_single": "all-to-all",
    "send": "collective-permute", "recv": "collective-permute", "isend": "collective-permute",
    "irecv": "collective-permute",
}


@dataclasses.dataclass(frozen=True)
class CommsLogger:
    """The collectives of the compiled step per kind, with counts and sizes (DeepSpeed's
    ``comms_logger``). ``verbose``: print them when the step is first run, else when the step
    is closed (DeepSpeed's ``log_summary``). ``prof_all=False`` keeps only ``prof_ops``
    (DeepSpeed's names, e.g. "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")."""

    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "prof_ops", tuple(self.prof_ops))
        bad = [op for op in self.prof_ops if op not in OP_KINDS]
        _need(not bad, f"comms_logger.prof_ops names {bad}, which are not DeepSpeed collectives",
              f"use names among {sorted(OP_KINDS)}")

    def kinds(self) -> Optional[set]:
        """The HLO kinds to report (None: all)."""
        return None if self.prof_all else {OP_KINDS[op] for op in self.prof_ops}


@dataclasses.dataclass(frozen=True)
class FlopsProfiler:
    """FLOPs and bytes of the compiled step from XLA's cost analysis, and the FLOP/s it
    achieved, at the step with index ``profile_step`` (DeepSpeed's ``flops_profiler``;
    0-based as DeepSpeed counts, so the default 1 skips the compiling step). The summary is
    printed, or written to ``output_file``."""

    profile_step: int = 1
    output_file: Optional[str] = None

    def __post_init__(self):
        _need(isinstance(self.profile_step, int) and self.profile_step >= 0,
              f"flops_profiler.profile_step={self.profile_step!r} is invalid: expected an integer >= 0",
              "use 1 (the step after the compiling one)")


@dataclasses.dataclass(frozen=True)
class Monitors:
    """Everything zerojax can monitor about a run, as DeepSpeed's monitor keys name it.

    ``csv``, ``tensorboard``, ``wandb``: the writers (None: off), each given
    ``Train/Samples/train_loss``, ``Train/Samples/lr`` and, under fp16,
    ``Train/Samples/loss_scale`` once per step, keyed by samples seen.
    ``steps_per_print``: a progress line every that many steps (None: none).
    ``wall_clock_breakdown``: time every step (this synchronises each step, as DeepSpeed's
    timers do) and print the times. ``comms_logger``, ``flops_profiler``: reports on the
    compiled step. ``print_fn``: where lines go (default ``print``; e.g. a logger's ``info``).

        step = zj.make_train_step(loss_fn, state, monitors=Monitors(csv=CSVMonitor("runs")))
    """

    csv: Optional[CSVMonitor] = None
    tensorboard: Optional[TensorBoardMonitor] = None
    wandb: Optional[WandbMonitor] = None
    steps_per_print: Optional[int] = None
    wall_clock_breakdown: bool = False
    comms_logger: Optional[CommsLogger] = None
    flops_profiler: Optional[FlopsProfiler] = None
    print_fn: Callable[[str], None] = print

    def __post_init__(self):
        for name, cls in (("csv", CSVMonitor), ("tensorboard", TensorBoardMonitor), ("wandb", WandbMonitor),
                          ("comms_logger", CommsLogger), ("flops_profiler", FlopsProfiler)):
            value = getattr(self, name)
            _need(value is None or isinstance(value, cls), f"Monitors.{name}={value!r} is invalid",
                  f"pass a zerojax.monitor.{cls.__name__}(...) or None")
        spp = self.steps_per_print
        _need(spp is None or (isinstance(spp, int) and not isinstance(spp, bool) and spp >= 1),
              f"Monitors.steps_per_print={spp!r} is invalid: expected an integer >= 1 or None", "use 10")
        _need(isinstance(self.wall_clock_breakdown, bool),
              f"Monitors.wall_clock_breakdown={self.wall_clock_breakdown!r} is invalid", "use True or False")

    def check_packages(self) -> None:
        """A ConfigError naming the extra to install for a writer whose package is missing."""
        from zerojax.monitor._writers import check_packages

        check_packages(self)

    @property
    def writers(self) -> tuple:
        """The writer settings that are on."""
        return tuple(w for w in (self.csv, self.tensorboard, self.wandb) if w is not None)

    @property
    def active(self) -> bool:
        """Whether anything is monitored."""
        return bool(self.writers or self.steps_per_print or self.wall_clock_breakdown or self.comms_logger
                    or self.flops_profiler)

    @classmethod
    def from_deepspeed(cls, config: Union[dict, str, os.PathLike], **kw) -> "Monitors":
        """The monitors a DeepSpeed config turns on: its ``csv_monitor``, ``tensorboard``,
        ``wandb``, ``comms_logger`` and ``flops_profiler`` blocks (those with ``"enabled":
        true``), ``steps_per_print`` and ``wall_clock_breakdown``. A refused key (a typo in a
        block, ``comet`` on) is a ConfigError. ``kw``: further fields (e.g. ``print_fn``)."""
        v, raw = Verdicts(), _load(config)
        got = read_monitors(raw, v)
        if "comet" in raw:  # refused unless off
            read_block({"comet": raw["comet"]}, {"comet": TOP["comet"]}, "", v)
        v.raise_refused()
        path = {k: got[k] for k in ("tensorboard", "csv_monitor") if k in got}
        wandb, comms, flops = got.get("wandb"), got.get("comms_logger"), got.get("flops_profiler")
        fields = dict(
            csv=CSVMonitor(path["csv_monitor"]["output_path"], path["csv_monitor"]["job_name"])
            if "csv_monitor" in path else None,
            tensorboard=TensorBoardMonitor(path["tensorboard"]["output_path"], path["tensorboard"]["job_name"])
            if "tensorboard" in path else None,
            wandb=WandbMonitor(wandb["project"], wandb["group"], wandb["team"]) if wandb else None,
            steps_per_print=got.get("steps_per_print"),
            wall_clock_breakdown=got.get("wall_clock_breakdown", False),
            comms_logger=CommsLogger(comms["verbose"], comms["prof_all"], tuple(comms["prof_ops"])) if comms else None,
            flops_profiler=FlopsProfiler(flops["profile_step"], flops["output_file"]) if flops else None,
        )
        return cls(**{**fields, **kw})


def monitors_for(config, monitors: Optional[Monitors]) -> Optional[Monitors]:
    """The monitors ``zj.initialize`` runs: ``monitors=`` or the DeepSpeed file's, not both."""
    if monitors is not None and not isinstance(monitors, Monitors):
        raise ConfigError(f"monitors={monitors!r} is invalid. Fix: pass zerojax.monitor.Monitors(...) or None")
    from_file = Monitors.from_deepspeed(config) if isinstance(config, (dict, str, os.PathLike)) else None
    if from_file is not None and from_file.active:
        if monitors is not None and monitors.active:
            raise ConfigError("monitors= was passed and the DeepSpeed config turns monitors on too "
                              "(steps_per_print, wall_clock_breakdown or an enabled monitor block). Fix: keep one: "
                              "remove those keys from the config, or do not pass monitors=")
        monitors = from_file
    if monitors is None or not monitors.active:
        return None
    monitors.check_packages()  # before any state is built
    return monitors
