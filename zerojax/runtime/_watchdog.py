"""The step watchdog, the ledger and preemption: a stuck process is named and ended, a preempted one saves.

Every step ``zj.make_train_step`` builds (on device, host offload, NVMe, ZenFlow, pipeline) is a
:class:`~zerojax.runtime._watched_step.WatchedStep`. It writes each step's events to this
process's :class:`~zerojax.runtime._ledger.Ledger` (step called, dispatched, result ready;
compiles, checkpoint saves, preemption) and a thread of the process's :class:`Watchdog` checks
them against a deadline::

    step called ... dispatched ... result ready         (a second thread polls for the result:
                                                         the caller's thread is never synchronised)

* The first step, and any compile (from JAX's own monitoring events), has ``first_step_timeout``.
* Later steps have ``step_timeout`` (DeepSpeed's ``DEEPSPEED_TIMEOUT`` minutes, Hugging Face's
  ``ddp_timeout`` seconds, default 1800 s) until :data:`WARM_STEPS` steps are measured, then
  ``min(step_timeout, max(FLOOR, FACTOR x the median step time))``.
* A checkpoint save (``CheckpointManager.save`` and waiting for a write) has ``step_timeout``.
* Between steps there is no deadline (evaluation, logging and data loading are the script's), as
  PyTorch's collective watchdog has none: a process stuck there holds the others inside their
  step, whose deadlines pass, and the launcher reads its ledger.

When a deadline passes, the watchdog's thread (which does not need the main thread: that one
may be blocked inside XLA) writes every thread's Python stack and the ledger to one file per
process, prints a short diagnosis and ends the process with :data:`STUCK_EXIT` (124).

Preemption: SIGTERM, or the signal ``ZeroConfig.preemption_signal`` names (SLURM's
``--signal=USR1@60``), makes the step finish the step it is in and save a checkpoint through the
open :class:`zerojax.checkpoint.CheckpointManager` at one step every process agrees on (JAX's
preemption sync point where ``jax.distributed`` is up, the next step in one process), wait until
it is committed and exit with :data:`PREEMPTED_EXIT` (75, EX_TEMPFAIL: try again).

Under ``zerojax launch`` (``ZEROJAX_WATCHDOG_DIR`` set) the ledger is a memory-mapped file the
launcher reads even when the process is blocked or dead, SIGUSR2 dumps every thread's stack into
the process's stacks file, and the launcher names the process that is behind.

This module holds the watchdog, its deadlines and the preemption signals; the ledger and the
launcher's reading of it are :mod:`zerojax.runtime._ledger`, the step wrapper and the
checkpoint managers it saves through :mod:`zerojax.runtime._watched_step`.
"""
from __future__ import annotations

import atexit
import collections
import faulthandler
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Optional

from zerojax._compat import distributed_is_initialized
from zerojax.runtime._ledger import Ledger, ledger_path, stacks_path, stuck_path

__all__ = ["DEFAULT_STEP_TIMEOUT", "FACTOR", "FLOOR", "PREEMPTED_EXIT", "STUCK_EXIT", "WARM_STEPS", "WATCHDOG_DIR",
           "Watchdog", "record", "resolve_timeouts", "watchdog"]

STUCK_EXIT = 124  # the watchdog ended a process whose step (or save) passed its deadline
PREEMPTED_EXIT = 75  # a preemption signal came; a checkpoint was committed (sysexits' EX_TEMPFAIL)
WATCHDOG_DIR = "ZEROJAX_WATCHDOG_DIR"  # where ledgers and stack dumps go (the launcher sets it)
PREEMPTION_SIGNAL = "ZEROJAX_PREEMPTION_SIGNAL"  # a signal besides SIGTERM that means preemption
DEFAULT_STEP_TIMEOUT = 1800.0  # seconds: DeepSpeed's DEEPSPEED_TIMEOUT default (30 minutes), HF's ddp_timeout
FACTOR = 20.0  # a measured step's deadline: FACTOR x the median step time ...
FLOOR = 120.0  # ... but never below FLOOR seconds (nor above step_timeout)
WARM_STEPS = 3  # steps measured before the deadline tightens
EXIT_GRACE = 60.0  # seconds a preempted process has to unwind after its checkpoint is committed


# ------------------------------------------------------------------------------------ timeouts
def resolve_timeouts(step_timeout: Optional[float], first_step_timeout: Optional[float],
                     environ=None) -> tuple[float, float]:
    """(step deadline, first-step deadline) in seconds; 0 turns the watchdog off.

    ``step_timeout`` None: ``DEEPSPEED_TIMEOUT`` (minutes) from the environment, else
    :data:`DEFAULT_STEP_TIMEOUT`. ``first_step_timeout`` None: twice the step deadline."""
    environ = os.environ if environ is None else environ
    if step_timeout is None:
        minutes = environ.get("DEEPSPEED_TIMEOUT")
        step_timeout = DEFAULT_STEP_TIMEOUT
        if minutes not in (None, ""):
            try:
                step_timeout = float(minutes) * 60.0
            except ValueError:
                from zerojax._errors import ConfigError

                raise ConfigError(f"DEEPSPEED_TIMEOUT={minutes!r} in the environment is not a number of minutes. "
                                  "Fix: export DEEPSPEED_TIMEOUT=30 (or unset it)") from None
    step_timeout = float(step_timeout)
    first = 2.0 * step_timeout if first_step_timeout is None else float(first_step_timeout)
    return step_timeout, first


# ------------------------------------------------------------------------------------- watchdog
class Watchdog:
    """One per process: the ledger, the deadline thread, the result waiter, preemption."""

    def __init__(self):
        import jax

        self.process = jax.process_index()
        self.directory = os.environ.get(WATCHDOG_DIR) or None
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
        self.ledger = Ledger(ledger_path(self.directory, self.process) if self.directory else None, self.process)
        self._lock = threading.Lock()
        self.timeout, self.first_timeout = DEFAULT_STEP_TIMEOUT, 2 * DEFAULT_STEP_TIMEOUT
        self.calls = 0  # the number of the last step called (every process calls them in the same order)
        self.first: Optional[int] = None  # the state's step when this process called its first step
        self.inflight: collections.deque = collections.deque()  # (step, monotonic time called)
        self.last_ready: Optional[float] = None
        self.durations: collections.deque = collections.deque(maxlen=32)
        self.armed: dict = {}  # what -> (step, monotonic start, limit): compile, batch, save, exit
        self.compiled_at: Optional[float] = None  # when the last compile ended (a step's clock restarts)
        self.ready_queue: collections.deque = collections.deque()
        self._ready_event = threading.Event()
        self.notice: Optional[int] = None  # the preemption signal received (one process)
        self.notice_at: Optional[float] = None  # when it came (monotonic)
        self.last_called: Optional[float] = None  # when the last step was called (monotonic)
        self.in_call = False  # the main thread is inside a step call (its check for a notice is still to come)
        self.distributed = distributed_is_initialized()
        self.enabled = False
        self._stacks = None
        self._threads_started = False
        self._stopping = False
        self._waiter: Optional[threading.Thread] = None

    # ---------------------------------------------------------------------- configuration
    def configure(self, timeout: float, first_timeout: float) -> None:
        with self._lock:
            self.timeout, self.first_timeout = float(timeout), float(first_timeout)
            self.enabled = self.timeout > 0
        if self.enabled:
            self._start()

    def _start(self) -> None:
        if self._threads_started:
            return
        self._threads_started = True
        threading.Thread(target=self._watch, name="zerojax-watchdog", daemon=True).start()
        self._waiter = threading.Thread(target=self._wait_results, name="zerojax-step-results", daemon=True)
        self._waiter.start()
        atexit.register(self._stop_waiting)
        _listen_to_compiles(self)
        if self.directory and hasattr(signal, "SIGUSR2") and _main_thread():
            try:  # the launcher asks for every thread's stack with SIGUSR2, even while XLA holds this process
                self._stacks = open(stacks_path(self.directory, self.process), "w")
                faulthandler.register(signal.SIGUSR2, file=self._stacks, all_threads=True, chain=False)
            except (OSError, ValueError, RuntimeError):
                pass

    # ------------------------------------------------------------------------------ events
    def record(self, event: str, step: int = 0, detail: str = "") -> None:
        self.ledger.record(event, step, detail)

    def called(self, state=None) -> int:
        """Step ``n`` begins: the step's number is the state's step after it (1-based, DeepSpeed's
        ``global_steps``), read from the state once, on the first call (the state is ready then)."""
        if self.calls == 0 and self.first is None:
            try:
                self.calls = self.first = int(getattr(state, "step", 0))
            except (TypeError, ValueError):
                self.first = 0
        with self._lock:
            self.calls += 1
            n = self.calls
            self.last_called = time.monotonic()
            self.in_call = True
            self.inflight.append((n, self.last_called))
        self.ledger.record("step called", n)
        return n

    def dispatched(self, n: int, result: Any, detail: str = "") -> None:
        self.ledger.record("dispatched", n, detail)
        self.in_call = False
        self.disarm("compile")
        self.ready_queue.append((n, result))
        self._ready_event.set()

    def failed(self, n: int) -> None:
        """The step raised: it is not in flight any more (the error is the caller's)."""
        with self._lock:
            if self.inflight and self.inflight[-1][0] == n:  # the step just called: the usual case
                self.inflight.pop()
            else:
                self.inflight = collections.deque(x for x in self.inflight if x[0] != n)
            self.in_call = False
        self.disarm("compile")

    def _ready(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            called = None
            while self.inflight and self.inflight[0][0] <= n:  # results come in the order steps were called
                s, t = self.inflight.popleft()
                called = t if s == n else called
            if called is not None and n > (self.first or 0) + 1:
                self.durations.append(now - max(called, self.last_ready or called))
            self.last_ready = now
        self.ledger.record("result ready", n)

    def _wait_results(self) -> None:
        """Note each step's result as it becomes ready, polling (every 20 ms while steps are in
        flight): a thread blocked inside XLA's wait when the interpreter exits would abort it."""
        while not self._stopping:
            self._ready_event.wait(0.02 if self.ready_queue else 1.0)
            self._ready_event.clear()
            while self.ready_queue and not self._stopping:
                n, result = self.ready_queue[0]
                if not _is_ready(result):
                    break
                self.ready_queue.popleft()
                self._ready(n)

    def _stop_waiting(self) -> None:
        """At exit: the result thread stops (it is never inside XLA then)."""
        self._stopping = True
        self._ready_event.set()
        if self._waiter is not None:
            self._waiter.join(timeout=2.0)

    # ------------------------------------------------------------------------ deadlines
    def deadline(self) -> float:
        """The deadline a step that is not the first has now."""
        with self._lock:
            if len(self.durations) < WARM_STEPS:
                return self.timeout
            return min(self.timeout, max(FLOOR, FACTOR * statistics.median(self.durations)))

    def arm(self, what: str, step: int, limit: Optional[float] = None) -> None:
        with self._lock:
            self.armed[what] = (step, time.monotonic(), self.timeout if limit is None else limit)

    def disarm(self, what: str) -> None:
        with self._lock:
            if self.armed.pop(what, None) is not None and what == "compile":
                self.compiled_at = time.monotonic()

    def overdue(self, now: Optional[float] = None) -> Optional[dict]:
        """What has passed its deadline, or None."""
        now = time.monotonic() if now is None else now
        if not self.enabled:
            return None
        with self._lock:
            armed, inflight = dict(self.armed), list(self.inflight)
            clocks = [t for t in (self.last_ready, self.compiled_at) if t is not None]
            first = self.first_timeout
        for what, (step, start, limit) in armed.items():
            if what == "compile" and not inflight:
                continue  # a trace outside any step (eval_shape, the user's own jit): no deadline between steps
            if limit > 0 and now - start > limit:
                return {"what": what, "step": step, "waited": now - start, "limit": limit}
        if inflight and "compile" not in armed:  # a compile inside a step has the compile's deadline
            n, called = inflight[0]
            start = max([called] + clocks)
            opening = n == (self.first or 0) + 1
            limit = first if opening else self.deadline()
            if now - start > limit:
                return {"what": "the first step" if opening else "step", "step": n, "waited": now - start,
                        "limit": limit}
        return None

    def _watch(self) -> None:
        while True:
            with self._lock:
                poll = min(1.0, max(0.05, (self.timeout or 1.0) / 20))
            time.sleep(poll)
            late = self.overdue()
            if late is not None:
                self.fire(late)
            if self.unanswered():
                self.give_up_preemption()
            self.ledger.set_deadline(self.deadline() if self.enabled else 0.0)

    @property
    def exit_grace(self) -> float:
        """Seconds a process has to unwind once it is to exit after a preemption notice."""
        return min(EXIT_GRACE, self.timeout or EXIT_GRACE)

    def unanswered(self, now: Optional[float] = None) -> bool:
        """A preemption notice came to this (single) process and no step has begun in the
        ``min(EXIT_GRACE, step_timeout)`` seconds since: the script is not training any more."""
        now = time.monotonic() if now is None else now
        with self._lock:
            notice_at, last, in_call = self.notice_at, self.last_called, self.in_call
        if self.notice is None or notice_at is None or self.distributed or in_call:
            return False
        return (last is None or last < notice_at) and now - notice_at > self.exit_grace

    def give_up_preemption(self) -> None:  # pragma: no cover - ends the process (tested in a child process)
        """End the process as the signal would have without zerojax's handler (code 128 + signal)."""
        name = signal.Signals(self.notice).name
        self.ledger.record("preemption notice", self.calls, f"{name}: no step")
        try:
            sys.stderr.write(f"zerojax: {name} received, but no training step began in the "
                             f"{self.exit_grace:.0f} s since, so nothing was saved; "
                             f"exiting with code {128 + self.notice} as {name} would\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(128 + self.notice)

    def fire(self, late: dict) -> None:  # pragma: no cover - ends the process (tested in child processes)
        what = late["what"]
        phase = {"compile": "compiling", "save": "a checkpoint save", "exit": "exiting after a preemption save",
                 "batch": "placing the batch: every process's rows checked together"}.get(what, "waiting for its result")
        msg = (f"zerojax watchdog: process {self.process} stuck in step {late['step']} ({phase}) for "
               f"{late['waited']:.1f} s, over its deadline of {late['limit']:.1f} s")
        self.ledger.record("stuck", late["step"], f"{what} {late['waited']:.0f}s")
        directory = self.directory or tempfile.mkdtemp(prefix="zerojax-watchdog-")
        path = stuck_path(directory, self.process)
        try:
            with open(path, "w") as f:
                f.write(msg + "\n\n")
                f.write(f"ledger (the last events of process {self.process}, pid {os.getpid()}):\n")
                now = time.time()
                for e in self.ledger.events():
                    f.write("  " + e.line(now) + "\n")
                f.write("\nevery thread's Python stack (most recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            path = f"(not written: {e})"
        code = PREEMPTED_EXIT if what == "exit" else STUCK_EXIT  # after a committed preemption save: still 75
        try:
            sys.stderr.write(f"{msg}; every thread's stack and the ledger: {path}; exiting with code {code}\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(code)

    # ---------------------------------------------------------------------- preemption
    def install_signals(self, extra: Optional[str]) -> None:
        """Take SIGTERM (where JAX's distributed runtime does not already) and ``extra`` as a
        preemption notice. A handler the script installed itself is left alone."""
        if not _main_thread():
            return
        names = ["SIGTERM"] + ([extra] if extra and extra != "SIGTERM" else [])
        for name in names:
            sig = getattr(signal, name)
            if signal.getsignal(sig) not in (signal.SIG_DFL, None) and not getattr(signal.getsignal(sig),
                                                                                    "_zerojax", False):
                continue
            if self.distributed and sig == signal.SIGTERM:
                continue  # JAX's preemption notifier holds SIGTERM and starts the sync-point protocol
            signal.signal(sig, _handler)

    def preempted(self, n: int) -> bool:
        """Whether every process is to save now, after its step ``n``."""
        if self.distributed:
            from jax.experimental import multihost_utils

            try:
                return bool(multihost_utils.reached_preemption_sync_point(n))
            except RuntimeError:  # the preemption service is off: one process's notice is its own
                return self.notice is not None
        return self.notice is not None


def env_signal(environ=None) -> Optional[str]:
    """The preemption signal ZEROJAX_PREEMPTION_SIGNAL names ("USR1" or "SIGUSR1"), as "SIGUSR1"."""
    from zerojax._errors import ConfigError
    from zerojax.config._schema import Invalid, signal_name

    value = (os.environ if environ is None else environ).get(PREEMPTION_SIGNAL, "")
    if not value:
        return None
    try:
        return signal_name(value)
    except Invalid as e:
        raise ConfigError(f"{PREEMPTION_SIGNAL}={value!r} in the environment: use {e}. Fix: export "
                          f"{PREEMPTION_SIGNAL}=USR1 (or unset it)") from None


def _handler(signum, _frame):
    dog = _WATCHDOG
    if dog is None:
        return
    dog.ledger.record("preemption notice", dog.calls, signal.Signals(signum).name)
    dog.notice_at = time.monotonic()
    dog.notice = signum
    if dog.distributed and signum != signal.SIGTERM:  # JAX's notifier agrees on the step with the other processes
        os.kill(os.getpid(), signal.SIGTERM)


_handler._zerojax = True  # type: ignore[attr-defined]


def _is_ready(result) -> bool:
    """Whether a step's result (a jax array, or anything else: ready) is computed; never blocks."""
    is_ready = getattr(result, "is_ready", None)
    if not callable(is_ready):
        return True
    try:
        return bool(is_ready())
    except Exception:  # noqa: BLE001 - deleted or failed: the step is over either way
        return True


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_LISTENING: list = []


def _listen_to_compiles(dog: Watchdog) -> None:
    """A compile (found from JAX's tracing event, ended by its compile or cache-hit event) gets
    the first step's deadline."""
    if _LISTENING:
        return
    import jax

    from zerojax._compat import CACHE_HIT_EVENT, COMPILE_EVENT, TRACE_EVENTS

    def on_duration(event, duration, **kwargs):
        d = _WATCHDOG
        if d is None or not d.enabled:
            return
        if event == TRACE_EVENTS[0]:
            d.arm("compile", d.calls, d.first_timeout)
            d.record("compile begun", d.calls, str(kwargs.get("fun_name", ""))[:31])
        elif event == COMPILE_EVENT:
            d.disarm("compile")
            d.record("compiled", d.calls, f"{duration:.1f}s")

    def on_event(event, **kwargs):
        if event == CACHE_HIT_EVENT and _WATCHDOG is not None:
            _WATCHDOG.disarm("compile")

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    _LISTENING.append((on_duration, on_event))


_WATCHDOG: Optional[Watchdog] = None
_CREATE = threading.Lock()


def watchdog() -> Watchdog:
    """This process's watchdog (made on first use)."""
    global _WATCHDOG
    with _CREATE:
        if _WATCHDOG is None:
            _WATCHDOG = Watchdog()
        return _WATCHDOG


def record(event: str, step: Optional[int] = None, detail: str = "") -> None:
    """Add an event to this process's ledger, if it has a watchdog (nothing is made for it)."""
    dog = _WATCHDOG
    if dog is not None:
        dog.record(event, _step_of(dog, event) if step is None else step, detail)


def _step_of(dog: Watchdog, what: str) -> int:
    """The step an event or an armed block belongs to: a batch is placed for the step to come,
    anything else belongs to the last step called."""
    return dog.calls + (what in ("batch", "batch check", "batch placed"))


class armed:
    """``with armed("save"):`` the block has ``step_timeout`` on this process's watchdog (when it has one)."""

    def __init__(self, what: str):
        self.what = what
        self.dog = _WATCHDOG

    def __enter__(self):
        if self.dog is not None and self.dog.enabled:
            self.dog.arm(self.what, _step_of(self.dog, self.what))
        return self

    def __exit__(self, *exc):
        if self.dog is not None:
            self.dog.disarm(self.what)
