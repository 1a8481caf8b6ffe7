"""The writers: CSV files, a TensorBoard event file, a Weights & Biases run.

Each takes events ``(tag, value, samples)`` as DeepSpeed's monitors do, and lays them out
where and how DeepSpeed does (``output_path/job_name/``; the CSV file of a tag is the tag with
"/" and " " replaced by "_", its header ``step,<last part of the tag>``)::

    w = open_writers(Monitors(csv=CSVMonitor("runs", "exp1")))
    for x in w:
        x.write([("Train/Samples/train_loss", 2.31, 64)])
        x.close()
"""
from __future__ import annotations

import csv
import importlib
import os

from zerojax._errors import ConfigError

__all__ = ["CSVWriter", "TensorBoardWriter", "WandbWriter", "check_packages", "open_writers"]


def _import(module: str, block: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"the {block} monitor needs the {module} package, which is not installed ({e}). "
                          f"Fix: pip install 'zerojax[{extra}]', or turn the {block} block off") from None


class CSVWriter:
    """``<log_dir>/<tag with / -> _>.csv``, appended to, with DeepSpeed's header per file."""

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._files: dict = {}

    def write(self, events) -> None:
        for tag, value, step in events:
            f = self._files.get(tag)
            if f is None:
                name = tag.replace("/", "_").replace(" ", "_") + ".csv"
                f = self._files[tag] = open(os.path.join(self.log_dir, name), "a+", newline="")
                csv.writer(f).writerow(["step", tag.rsplit("/", 1)[-1]])
            csv.writer(f).writerow([step, value])
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class TensorBoardWriter:
    """A tensorboardX ``SummaryWriter`` on ``log_dir`` (it writes from its own thread)."""

    def __init__(self, log_dir: str):
        tbx = _import("tensorboardX", "tensorboard", "tensorboard")
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._w = tbx.SummaryWriter(logdir=log_dir)

    def write(self, events) -> None:
        for tag, value, step in events:
            self._w.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class WandbWriter:
    """A wandb run (``wandb.init(project, group, entity=team, dir, mode)``); each step's events
    are one ``run.log(..., step=samples)``."""

    def __init__(self, cfg):
        wandb = _import("wandb", "wandb", "wandb")
        kw = {k: v for k, v in (("dir", cfg.dir), ("mode", cfg.mode)) if v is not None}
        if cfg.dir is not None:
            os.makedirs(cfg.dir, exist_ok=True)
        self.run = wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team, reinit="create_new", **kw)

    def write(self, events) -> None:
        if not events:
            return
        self.run.log({tag: value for tag, value, _ in events}, step=int(events[0][2]))

    def close(self) -> None:
        self.run.finish()


def check_packages(monitors) -> None:
    """A ConfigError naming the extra to install when a writer's package is missing."""
    if monitors.tensorboard is not None:
        _import("tensorboardX", "tensorboard", "tensorboard")
    if monitors.wandb is not None:
        _import("wandb", "wandb", "wandb")


def open_writers(monitors) -> list:
    """The writers ``monitors`` turns on (a ConfigError naming the extra when a package is
    missing; nothing is opened then)."""
    check_packages(monitors)
    out = []
    if monitors.csv is not None:
        out.append(CSVWriter(monitors.csv.log_dir))
    if monitors.tensorboard is not None:
        out.append(TensorBoardWriter(monitors.tensorboard.log_dir))
    if monitors.wandb is not None:
        out.append(WandbWriter(monitors.wandb))
    return out
