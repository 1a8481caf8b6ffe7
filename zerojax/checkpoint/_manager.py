"""CheckpointManager (asynchronous saves over Orbax's manager, the best or newest steps kept,
the 16-bit safetensors copy after a save) and ``restore`` of a step onto any mesh, stage and
offload setting. The on-disk format is described in :mod:`zerojax.checkpoint._format`.

The manager's truth is the directory: the steps it lists are the complete steps on disk, so a
save that fails (a full disk, a lost mount) costs that step only. The error is a
CheckpointError naming the step directory and the cause, the state in memory is untouched, the
partial directory is removed, and the steps saved before stay listed, restorable and subject
to ``max_to_keep``.
"""
from __future__ import annotations

import errno as _errno
import os
import re
import shutil
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint._export import consolidate
from zerojax.checkpoint._format import (DATA, META, MISMATCH, SAFETENSORS_16BIT, STATE, logical_tree,
                                       restore_state, verify)
from zerojax.checkpoint._integrity import portable, seal
from zerojax.checkpoint._outside import keeps_outside
from zerojax.checkpoint._zenflow_state import keeps_engine
from zerojax.checkpoint._pieces import CHUNK_BYTES
from zerojax.checkpoint._steps import _scan, partial_dirs, pick_step, read_data, read_meta, read_state
from zerojax._errors import CheckpointError, ConfigError, ZeroJaxError, ZeroJaxWarning
from zerojax._state import TrainState, check_params_held
from zerojax.runtime import _watchdog, _watched_step

__all__ = ["LATEST_INTACT", "CheckpointManager", "intact_steps", "restore"]

LATEST_INTACT = "latest_intact"


def _restore_step(directory: str, target: TrainState, step: int, budget: int | None = None):
    step_dir = os.path.join(directory, str(step))
    meta = read_meta(step_dir)
    data_state = read_data(step_dir, meta)
    state, sums = restore_state(step_dir, meta, target, lambda *a: read_state(*a), budget)
    verify(meta, sums, step_dir)
    return state, data_state


def _mismatch(e: CheckpointError) -> bool:
    """The target does not match the checkpoint (every other CheckpointError of a restore is a
    step that cannot be read or verified)."""
    return str(e).startswith(MISMATCH)


def intact_steps(directory) -> list[int]:
    """The complete steps whose metadata and data state verify against their checksums (the
    arrays are verified when a step is restored)."""
    directory = os.path.abspath(os.fspath(directory))
    good = []
    for step in _scan(directory, warn=False):
        step_dir = os.path.join(directory, str(step))
        try:
            read_data(step_dir, read_meta(step_dir))
        except CheckpointError:
            continue
        good.append(step)
    return good


def restore(directory: str, target: TrainState, step: int | str | None = None, *, budget: int | None = None):
    """Read a step into ``target``'s mesh, stage and layout. Returns (state, data_state).

    ``step``: a step number; None, the newest complete step; ``"latest_intact"``, the newest
    step that verifies (metadata, data state and every array against its checksum), skipping
    damaged newer steps with a ZeroJaxWarning naming each. ``target`` is a TrainState or
    ``zj.abstract_train_state(...)``. A damaged step is a CheckpointError naming the file and
    the steps that are still intact.

    ``budget``: the host bytes per process the read may use beside the restored state (default
    1 GiB): the state is read in groups of leaves (a param with the optimizer leaves that mirror
    it) of a quarter of it, each laid out before the next is read, so the host's memory grows by
    the restored state plus about the budget, not by two or three copies of the state. A leaf
    larger than a group (with its mirrors) is read in pieces of at most a quarter of the budget,
    each written into the leaf's device shards before the next is read, so the bound holds
    whatever the largest array (plus one stored chunk, at most 8 MiB in steps this version
    writes). An abstract target (``zj.abstract_train_state``) holds nothing beside it; a live
    target keeps its own arrays until it is dropped.
    """
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise CheckpointError(f"restore(budget={budget!r}): use a positive number of bytes, e.g. 1 << 30")
    if target is None or not isinstance(target, TrainState):
        raise CheckpointError(f"restore needs a target TrainState (zj.abstract_train_state(params_or_init, tx, "
                              f"mesh=..., config=...)), got {type(target).__name__}")
    directory = os.path.abspath(os.fspath(directory))
    if step == LATEST_INTACT:
        return _restore_latest_intact(directory, target, budget)
    step = pick_step(directory, step)
    try:
        return _restore_step(directory, target, step, budget)
    except CheckpointError as e:
        if _mismatch(e):
            raise  # no other step helps
        others = [s for s in intact_steps(directory) if s != step]
        hint = (f" Intact steps (metadata and data state verified): {others}; restore one with step=N or "
                f"step={LATEST_INTACT!r}." if others else " No other step in the directory is intact.")
        raise CheckpointError(str(e) + hint) from e


def _restore_latest_intact(directory: str, target: TrainState, budget: int | None = None):
    complete = _scan(directory)
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {directory!r}")
    problems = []
    for step in reversed(complete):
        try:
            out = _restore_step(directory, target, step, budget)
        except CheckpointError as e:
            if _mismatch(e):
                raise
            problems.append(f"  step {step}: {e}")
            continue
        if problems:
            warnings.warn(f"restored step {step} of {directory}, the newest intact one; skipped damaged steps:\n"
                          + "\n".join(problems), ZeroJaxWarning, stacklevel=3)
        return out
    raise CheckpointError(f"no intact step in {directory}:\n" + "\n".join(problems))


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _cause(e: BaseException) -> str:
    """What went wrong, as an errno name where one can be found (ENOSPC: No space left on device)."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{_errno.errorcode.get(seen.errno, seen.errno)}: {os.strerror(seen.errno)}"
        m = _OS_ERROR_CODE.search(str(seen))
        if m:
            code = int(m.group(1))
            return f"{_errno.errorcode.get(code, code)}: {os.strerror(code)}"
        seen = seen.__cause__ or seen.__context__
    return f"{type(e).__name__}: {e}"


class CheckpointManager:
    """Asynchronous, mesh-independent checkpoints over ``orbax.checkpoint.CheckpointManager``.

    ``best_metric`` names a key of the ``metrics`` passed to ``save``; with ``max_to_keep`` the
    kept steps are then the best ones (Orbax's rule), otherwise the newest.

        mngr = CheckpointManager(path, max_to_keep=2)
        mngr.save(int(state.step), state, data_state={"epoch": 1})
        state, data_state = mngr.restore(abstract_state)                      # newest complete step
        state, data_state = mngr.restore(abstract_state, step="latest_intact")  # newest that verifies

    ``compress``: zstd-compress the arrays (Orbax's ``use_compression``). Off by default: trained
    fp32 values shrink by under a tenth while zstd costs a CPU core per few hundred MB/s, so a
    compressed save or restore runs at the compressor's speed, not the disk's. Either kind of
    step restores with any setting.

    A failed write (``save``, or ``wait_until_finished`` for an asynchronous one) raises a
    CheckpointError naming the step directory and the cause (``ENOSPC: No space left on
    device``); the manager then forgets the failed step, removes its partial directory and goes
    on from the complete steps on disk.
    """

    def __init__(self, directory, max_to_keep: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min", async_save: bool = True, preemption_data_state=None,
                 compress: bool = False):
        if best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode={best_mode!r}: use 'min' or 'max'")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ConfigError(f"max_to_keep={max_to_keep!r}: use a positive integer, or None to keep every step")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} is a file, not a directory. Fix: pass a "
                                  "directory path (it is created when missing)")
        self.best_metric = best_metric
        if not isinstance(compress, bool):
            raise ConfigError(f"compress={compress!r}: use True (zstd, smaller files, CPU-bound writes) or False")
        self.compress = compress
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            best_fn=(lambda m: float(m[best_metric])) if best_metric else None,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            create=True,
        )
        try:
            self._mngr = self._orbax_manager()
        except OSError as e:
            raise CheckpointError(f"cannot use checkpoint directory {self.directory}: {_cause(e)}") from e
        self._pending_16bit: list[tuple[int, str]] = []
        self._writing: int | None = None  # the step whose asynchronous write may still run
        if preemption_data_state is not None and not callable(preemption_data_state):
            raise ConfigError(f"preemption_data_state={preemption_data_state!r}: pass a function of the step "
                              "returning the data_state dict to save with a preemption checkpoint")
        self._preemption_data_state = preemption_data_state
        self.closed = False
        _watched_step.register_manager(self)  # a preemption signal saves through the manager opened last

    def _orbax_manager(self) -> ocp.CheckpointManager:
        handlers = {STATE: ocp.PyTreeCheckpointHandler(use_compression=self.compress),
                    META: ocp.JsonCheckpointHandler(), DATA: ocp.JsonCheckpointHandler()}
        return ocp.CheckpointManager(self.directory, options=self._options, item_handlers=handlers)

    # ---------------------------------------------------------------------------- writing
    def _failed(self, step: int, e: BaseException) -> CheckpointError:
        """Forget the failed step: a fresh Orbax manager reads the complete steps from disk (the
        old one dropped them from its list), and the partial directory goes."""
        old = self._mngr
        try:
            old.close()
        except Exception:  # it re-raises the same failure; the new manager is what matters
            pass
        self._mngr = self._orbax_manager()
        self._writing = None
        self._pending_16bit = [(s, d) for s, d in self._pending_16bit if s != step]
        removed = self._cleanup_after_failure()
        kept = self.all_steps()
        step_dir = os.path.join(self.directory, str(step))
        cause = _cause(e)
        fix = (f"free space on the disk of {self.directory} (or use another directory)" if "ENOSPC" in cause
               else f"check that {self.directory} is writable and reachable")
        return CheckpointError(
            f"checkpoint step {step} could not be written to {step_dir}: {cause}. The state in memory is "
            f"unchanged; {'the partial directory was removed; ' if removed else ''}complete steps on disk: {kept}. "
            f"Fix: {fix}, then save again")

    def _cleanup_after_failure(self, quiet_s: float = 0.2, limit_s: float = 5.0) -> list[str]:
        """Remove the partial directories until none reappears for ``quiet_s``: Orbax reports a
        failed write while its other writer threads of that save may still be finishing."""
        removed, quiet_since, start = [], time.monotonic(), time.monotonic()
        while time.monotonic() - start < limit_s:
            gone = self.cleanup()
            removed += [p for p in gone if p not in removed]
            if gone:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                break
            time.sleep(0.02)
        return removed

    def _guard(self, step: int | None, fn):
        try:
            return fn()
        except ZeroJaxError:
            raise
        except Exception as e:  # orbax and tensorstore raise ValueError, OSError, RuntimeError...
            if step is None:
                raise
            raise self._failed(step, e) from e

    def save(self, step: int, state: TrainState, metrics: dict | None = None,
             data_state: dict | None = None) -> bool:
        """Start writing ``state`` as ``step``; returns once the arrays are copied off the devices."""
        if self.best_metric and (metrics is None or self.best_metric not in metrics):
            raise ConfigError(f"save(step={step}) needs metrics[{self.best_metric!r}]: the manager keeps the best "
                              f"steps by it (best_metric={self.best_metric!r})")
        if data_state is not None and not isinstance(data_state, dict):
            raise CheckpointError(f"save(step={step}): data_state must be a dict, got {type(data_state).__name__}")
        step = int(step)
        if not keeps_outside(state.plan):  # (with the params on NVMe, the save reads them from the store)
            check_params_held(state, f"save(step={step})")
        data_state = portable(dict(data_state or {}), f"save(step={step}): data_state")
        self._settle(clean=True)  # the previous write first: its failure is its own, not this step's
        if step in self.all_steps():
            raise CheckpointError(f"save(step={step}): step {step} already exists in {self.directory}. Fix: save "
                                  "under a new step number, or delete that step's directory first")
        tree, meta = logical_tree(state, f"save(step={step})")
        meta = seal(meta, data_state)
        # stored chunks of a bounded size: a restore in pieces decodes one chunk beyond its piece
        chunks = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(tree, save_args=chunks), META: ocp.args.JsonSave(meta),
                                     DATA: ocp.args.JsonSave(data_state)})
        self._writing = step
        _watchdog.record("save begun", detail=f"step {step}")
        with _watchdog.armed("save"):
            saved = self._guard(step, lambda: self._mngr.save(step, args=args, metrics=metrics, force=True))
        if keeps_outside(state.plan) or keeps_engine(state.plan):
            # the write reads the NVMe store's committed slot, which the step after next rewrites, or
            # ZenFlow's host buffers, which the next step changes: it finishes before save returns
            self._settle()
        if saved and state.plan.config.gather_16bit_weights_on_model_save:
            cdt = np.dtype(state.plan.compute_dtype)
            self._pending_16bit.append((step, "bfloat16" if cdt.itemsize == 4 else cdt.name))
        return saved

    def _settle(self, clean: bool = False) -> None:
        """Wait for the write in flight; once it succeeded (or with ``clean``, before a new
        save), remove the partial directories of earlier failed or killed saves; then write
        the 16-bit copies."""
        with _watchdog.armed("save"):
            self._guard(self._writing, self._mngr.wait_until_finished)
        if self._writing is not None:
            _watchdog.record("save committed", detail=f"step {self._writing}")
        if self._writing is not None or clean:
            self._writing = None
            self.cleanup()
        self._finish_16bit()

    def _finish_16bit(self) -> None:
        if not self._pending_16bit:
            return
        pending, self._pending_16bit = self._pending_16bit, []
        if jax.process_index() != 0:
            return
        for step, dtype in pending:
            step_dir = os.path.join(self.directory, str(step))
            if os.path.isdir(step_dir):  # not already removed by max_to_keep
                out = os.path.join(step_dir, SAFETENSORS_16BIT)
                try:
                    consolidate(self.directory, out, dtype=dtype, step=step, progress=False)
                except OSError as e:
                    raise CheckpointError(f"the 16-bit copy {out} could not be written: {_cause(e)}") from e

    @property
    def writing(self) -> int | None:
        """The step whose asynchronous write may still be running (None: none)."""
        return self._writing

    def preemption_data_state(self, step: int) -> dict:
        """The data_state saved with a preemption checkpoint at ``step``: the manager's
        ``preemption_data_state(step)``, else ``{"preempted_at": step}``."""
        if self._preemption_data_state is None:
            return {"preempted_at": int(step)}
        data = self._preemption_data_state(int(step))
        if not isinstance(data, dict):
            raise CheckpointError(f"preemption_data_state({step}) returned {type(data).__name__}; it must return "
                                  "a dict (the data_state saved with the preemption checkpoint)")
        return data

    def wait_until_finished(self) -> None:
        """Block until the write in flight is on disk (a CheckpointError if it failed)."""
        self._settle()

    def cleanup(self) -> list[str]:
        """Remove the partial directories of saves that never finished (failed, or killed) and
        return their paths. The write in flight, if any, is left alone. Process 0 removes them
        (the others return [])."""
        if jax.process_index() != 0:
            return []
        busy = self._writing
        gone = []
        for path in partial_dirs(self.directory):
            if busy is not None and os.path.basename(path).split(".")[0] == str(busy):
                continue
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
        return gone

    # ---------------------------------------------------------------------------- reading
    def restore(self, target: TrainState, step: int | str | None = None, *, budget: int | None = None):
        """(state, data_state) of ``step`` laid out like ``target``: a step number, None (the
        newest complete step) or ``"latest_intact"`` (the newest step that verifies); ``budget``:
        the host bytes the read may use beside the restored state (see :func:`restore`)."""
        self.wait_until_finished()
        return restore(self.directory, target, step, budget=budget)

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first."""
        return _scan(self.directory, warn=False) if os.path.isdir(self.directory) else []

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        if not self.best_metric:
            return self.latest_step()
        best = self._mngr.best_step()
        return best if best in self.all_steps() else None

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            self.closed = True
            _watched_step.unregister_manager(self)
            self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
