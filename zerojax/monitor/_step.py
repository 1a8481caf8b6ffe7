"""MonitoredStep: any :class:`~zerojax._contract.Step` with monitors, without stalling it.

The wrapper runs the step it holds (on device, host offload, NVMe, ZenFlow: every path alike),
starts copying the step's metrics to the host (``copy_to_host_async``) and hands them to a
writer thread, which waits for them and writes them: the caller's thread never waits on a
metric, so the next step is dispatched at once, and the writers' own costs (a wandb
``log`` is milliseconds) run beside the step. ``finish`` and ``close`` wait until everything
handed over is written::

    step = MonitoredStep(zj.make_train_step(loss_fn, state), Monitors(csv=CSVMonitor("runs")))
    for batch in batches:
        state, metrics = step(state, batch)
    step.close()                      # writes the last step, closes the files

Events follow DeepSpeed's names and x-axis, samples seen after the step (``global_samples``):
``Train/Samples/train_loss``, ``Train/Samples/lr``, ``Train/Samples/loss_scale`` (fp16) and,
with ``wall_clock_breakdown``, ``Train/Samples/elapsed_time_ms_train_batch``.
"""
from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Optional

import jax
import numpy as np

from zerojax._contract import Step, StepWrapper
from zerojax._errors import ConfigError
from zerojax.monitor._config import Monitors
from zerojax.monitor._reports import FlopsProfile, comms_summary
from zerojax.monitor._writers import open_writers
from zerojax.tools._compiled import comm_report

__all__ = ["MonitoredStep", "monitored"]

_KEYS = ("loss", "learning_rate", "loss_scale", "skipped")


@dataclasses.dataclass
class _Pending:
    """One step's metrics on their way to the host."""

    step: int  # 1-based: steps done after it (DeepSpeed's global_steps)
    samples: int  # samples seen after it (DeepSpeed's global_samples)
    arrays: dict
    started: float
    dispatched: float
    done: Optional[float] = None  # when its metrics were ready (wall_clock_breakdown only)


def _samples_in(batch) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    return int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "shape", ()) else 0


class MonitoredStep(StepWrapper):
    """``step`` (any :class:`~zerojax._contract.Step`) with ``monitors``; every other attribute
    is the wrapped step's. It implements the Step contract itself.

    What is measured, honestly: the forward pass, backward pass, gradient reduction and update
    are one compiled XLA program (on the host paths, one program plus the host update), so
    ``wall_clock_breakdown`` times ``train_batch`` (call to metrics on the host, the step
    synchronised as DeepSpeed's timers synchronise) and ``dispatch`` (the time the call held the
    host: checks, dispatch, and on the NVMe / ZenFlow paths the host update); the split inside
    the program is in a ``jax.profiler`` trace.
    """

    def __init__(self, step: Step, monitors: Monitors):
        if not isinstance(monitors, Monitors):
            raise ConfigError(f"monitors={monitors!r} is invalid. Fix: pass zerojax.monitor.Monitors(...)")
        self.step = step
        self.monitors = monitors
        self.lead = jax.process_index() == 0  # one process writes, as DeepSpeed's rank 0
        self.writers = open_writers(monitors) if self.lead else []
        self.fp16 = step.plan.config.precision == "fp16"
        self.comms = None  # the CommReport of the compiled step, once run
        self.flops: Optional[FlopsProfile] = None
        self.steps = 0
        self.samples = 0
        self.skipped = 0
        self._last_print = (0, 0, time.perf_counter())  # (step, samples, time) of the last progress line
        # seconds the monitors cost, summed over steps: wall time on the caller's thread (outside the
        # wrapped step's call; the one-time reports and wall_clock_breakdown's wait excluded) and CPU
        # time on the writer thread
        self.overhead = {"caller": 0.0, "writer": 0.0}
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None  # raised by the writer thread, re-raised here
        self._thread = threading.Thread(target=self._drain, name="zerojax-monitor", daemon=True)
        self._thread.start()

    @property
    def plan(self):
        return self.step.plan

    # ----------------------------------------------------------------- the contract
    def lower(self, state, batch):
        return self.step.lower(state, batch)

    def __call__(self, state, batch):
        entered = time.perf_counter()
        m = self.monitors
        first_comms = m.comms_logger is not None and self.comms is None
        if first_comms:
            self.comms = comm_report(self.step, state, batch)  # lowered before the state is donated
            if m.comms_logger.verbose:
                self._print(comms_summary(self.comms, m.comms_logger.kinds()))
        self._raise()
        profile = m.flops_profiler is not None and self.steps == m.flops_profiler.profile_step
        compiled = self.step.lower(state, batch).compile() if profile else None
        if profile:
            self._flush()  # nothing in flight: the profiled step is timed alone
        started = time.perf_counter()
        new_state, metrics = self.step(state, batch)
        dispatched = time.perf_counter()
        self.steps += 1
        self.samples += _samples_in(batch)
        arrays = {k: metrics[k] for k in _KEYS if k in metrics}
        for x in arrays.values():
            if hasattr(x, "copy_to_host_async"):
                x.copy_to_host_async()
        rec = _Pending(self.steps, self.samples, arrays, started, dispatched)
        waited = 0.0
        if m.wall_clock_breakdown or profile:
            jax.block_until_ready(arrays)
            rec.done = time.perf_counter()
            waited = rec.done - dispatched
        if profile:
            self.flops = FlopsProfile.of(compiled, rec.done - started, self.steps - 1, self.plan)
            self._report_flops()
        self._queue.put(rec)
        if not (profile or first_comms):  # the one-time reports are not per-step costs
            self.overhead["caller"] += (started - entered) + (time.perf_counter() - dispatched - waited)
        return new_state, metrics

    def finish(self, state):
        self._flush()
        return self.step.finish(state)

    def close(self) -> None:
        try:
            if self._thread.is_alive():
                self._queue.put(None)
                self._thread.join()
            self._raise()
            m = self.monitors
            if m.comms_logger is not None and self.comms is not None and not m.comms_logger.verbose:
                self._print(comms_summary(self.comms, m.comms_logger.kinds()))
        finally:
            for w in self.writers:
                w.close()
            self.writers = []
            self.step.close()


    # ----------------------------------------------------------------- writing
    def _flush(self) -> None:
        """Wait until every step handed to the writer thread is written."""
        if self._thread.is_alive():
            self._queue.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _drain(self) -> None:
        while True:
            rec = self._queue.get()
            try:
                if rec is None:
                    return
                if self._error is None:
                    self._write(rec)
            except BaseException as e:  # handed to the caller's thread at its next call
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, rec: _Pending) -> None:
        values = {k: float(np.asarray(x)) for k, x in rec.arrays.items()}  # waits for the step
        t0 = time.thread_time()
        try:
            self._write_values(rec, values)
        finally:
            self.overhead["writer"] += time.thread_time() - t0

    def _write_values(self, rec: _Pending, values: dict) -> None:
        self.skipped += int(bool(values.get("skipped", 0.0)))
        if not self.lead:
            return
        x = rec.samples
        events = [("Train/Samples/train_loss", values["loss"], x)]
        if math.isfinite(values.get("learning_rate", math.nan)):  # nan: an optimizer whose lr is not readable
            events.append(("Train/Samples/lr", values["learning_rate"], x))
        if self.fp16 and "loss_scale" in values:
            events.append(("Train/Samples/loss_scale", values["loss_scale"], x))
        if rec.done is not None and self.monitors.wall_clock_breakdown:
            batch_ms, dispatch_ms = (rec.done - rec.started) * 1e3, (rec.dispatched - rec.started) * 1e3
            events.append(("Train/Samples/elapsed_time_ms_train_batch", batch_ms, x))
            self._print(f"time (ms) | train_batch: {batch_ms:.2f} | dispatch: {dispatch_ms:.2f}")
        for w in self.writers:
            w.write(events)
        spp = self.monitors.steps_per_print
        if spp and rec.step % spp == 0:
            _, samples0, t0 = self._last_print
            now = time.perf_counter()
            rate = (rec.samples - samples0) / (now - t0) if now > t0 else float("nan")
            self._last_print = (rec.step, rec.samples, now)
            self._print(f"step={rec.step}, skipped={self.skipped}, lr=[{values.get('learning_rate', float('nan'))}], "
                        f"loss={values['loss']:.4f}, samples/sec={rate:.3f}")

    def _report_flops(self) -> None:
        if not self.lead:
            return
        out = self.monitors.flops_profiler.output_file
        if out:
            with open(out, "a") as f:
                f.write(str(self.flops) + "\n")
        else:
            self._print(str(self.flops))

    def _print(self, line: str) -> None:
        if self.lead:
            self.monitors.print_fn(line)


def monitored(step: Step, monitors: Optional[Monitors]) -> Step:
    """``step`` with ``monitors`` (``step`` itself when None or nothing is on)."""
    if monitors is None or not monitors.active:
        return step
    return MonitoredStep(step, monitors)
