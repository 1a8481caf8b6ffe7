"""CheckpointManager (asynchronous saves over Orbax's manager, the best or newest steps kept,
the 16-bit safetensors copy after a save) and ``restore`` of a step onto any mesh, stage and
offload setting. The on-disk format is described in :mod:`zerojax.checkpoint.format`."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint.export import consolidate
from zerojax.checkpoint.format import (
    DATA,
    META,
    SAFETENSORS_16BIT,
    STATE,
    logical_tree,
    relayout,
    restore_spec,
    verify,
)
from zerojax.checkpoint.steps import complete, pick_step, read_meta, read_state
from zerojax.errors import ConfigError
from zerojax.state import TrainState

__all__ = ["CheckpointManager", "restore"]


def restore(directory: str, target: TrainState, step: int | None = None):
    """Read step ``step`` (default: the newest complete one) into ``target``'s mesh, stage and layout.

    ``target`` is a TrainState or ``zj.abstract_train_state(...)``. Returns (state, data_state).
    """
    directory = os.path.abspath(os.fspath(directory))
    step = pick_step(directory, step)
    step_dir = os.path.join(directory, str(step))
    meta = read_meta(step_dir)
    item, restore_args, opt, homes = restore_spec(meta, target)
    restored = read_state(step_dir, item, restore_args)
    state, sums = relayout(restored, target, opt, homes)
    verify(meta, sums, step_dir)
    data_path = os.path.join(step_dir, DATA, "metadata")
    data_state = {}
    if os.path.isfile(data_path):
        with open(data_path) as f:
            data_state = json.load(f)
    return state, data_state


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
            raise ConfigError(f"best_mode={best_mode!r}: use 'min' or 'max'")
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
            raise ConfigError(f"save(step={step}) needs metrics[{self.best_metric!r}]: the manager keeps the best "
                             f"steps by it (best_metric={self.best_metric!r})")
        self._finish_16bit()
        tree, meta = logical_tree(state)
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(tree), META: ocp.args.JsonSave(meta),
                                     DATA: ocp.args.JsonSave(dict(data_state or {}))})
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
                consolidate(self.directory, os.path.join(step_dir, SAFETENSORS_16BIT), dtype=dtype,
                            step=step, progress=False)

    def wait_until_finished(self) -> None:
        self._mngr.wait_until_finished()
        self._finish_16bit()

    def restore(self, target: TrainState, step: int | None = None):
        """(state, data_state) of ``step`` (default: the newest complete step) laid out like ``target``."""
        self.wait_until_finished()
        return restore(self.directory, target, step)

    def all_steps(self) -> list[int]:
        return [s for s in self._mngr.all_steps() if complete(os.path.join(self.directory, str(s)))]

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
