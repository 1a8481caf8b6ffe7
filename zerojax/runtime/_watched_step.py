"""The watched step: any step with its events in the ledger, its deadline watched by this
process's watchdog (:mod:`zerojax.runtime._watchdog`) and preemption honoured: after a
preemption notice the step is saved through the CheckpointManager opened last (the open
managers are registered here) and the process exits with ``PREEMPTED_EXIT``.
"""
from __future__ import annotations

import atexit
import signal
import sys
import weakref
from typing import Optional

from zerojax._contract import StepWrapper
from zerojax.runtime._watchdog import PREEMPTED_EXIT, env_signal, resolve_timeouts, watchdog

__all__ = ["WatchedStep", "watched"]


_MANAGERS: list = []  # weak references to the open CheckpointManagers, oldest first


def register_manager(mngr) -> None:
    _MANAGERS.append(weakref.ref(mngr))


def unregister_manager(mngr) -> None:
    _MANAGERS[:] = [r for r in _MANAGERS if r() is not None and r() is not mngr]


def open_manager():
    """The CheckpointManager opened last and not closed, or None."""
    for ref in reversed(_MANAGERS):
        m = ref()
        if m is not None and not getattr(m, "closed", False):
            return m
    return None


class WatchedStep(StepWrapper):
    """Any step, with its events in the ledger, its deadline watched and preemption honoured.

    Every other attribute is the wrapped step's (``.plan``, ``.jitted``, ZenFlow's
    ``.end_epoch()``, NVMe's ``.master()``)."""

    def __init__(self, step, timeout: float, first_timeout: float, preemption_signal: Optional[str] = None):
        self.step = step
        self.dog = watchdog()
        self.dog.configure(timeout, first_timeout)
        self.dog.install_signals(preemption_signal or env_signal())

    def __call__(self, state, batch):
        dog = self.dog
        n = dog.called(state)
        try:
            new_state, metrics = self.step(state, batch)
        except BaseException:
            dog.failed(n)
            raise
        dog.dispatched(n, metrics.get("loss") if isinstance(metrics, dict) else metrics)
        if dog.preempted(n):
            self._save_and_exit(n, new_state)
        return new_state, metrics

    def _save_and_exit(self, n: int, state) -> None:
        dog = self.dog
        name = signal.Signals(dog.notice).name if dog.notice else "SIGTERM"
        dog.notice = None  # handled: a script that catches the SystemExit and trains on is not stopped again
        mngr = open_manager()
        lead = dog.process == 0
        if mngr is None:
            if lead:
                print(f"zerojax: {name} received (preemption): no zj.CheckpointManager is open in this process, so "
                      f"nothing was saved after step {n}; exiting with code {PREEMPTED_EXIT}. Open a "
                      "CheckpointManager before the training loop to have the step saved", file=sys.stderr,
                      flush=True)
            raise SystemExit(PREEMPTED_EXIT)
        at = int(state.step)
        dog.record("preemption save", n, f"step {at} {name}")
        if at not in mngr.all_steps() and mngr.writing != at:
            mngr.save(at, state, data_state=mngr.preemption_data_state(at))
        mngr.wait_until_finished()
        if lead:
            print(f"zerojax: {name} received (preemption): saved step {at} to {mngr.directory} (committed); "
                  f"exiting with code {PREEMPTED_EXIT}. Run the same command again to resume from it",
                  file=sys.stderr, flush=True)
        # once the interpreter is exiting (not while a script that caught the SystemExit goes on), its
        # shutdown (jax.distributed's among it) gets EXIT_GRACE seconds before the process ends with 75
        atexit.register(dog.arm, "exit", n, dog.exit_grace)
        raise SystemExit(PREEMPTED_EXIT)

    def close(self) -> None:
        self.dog.record("closed", self.dog.calls)
        self.step.close()


def watched(step, config):
    """``step`` watched under ``config``'s deadlines (``step_timeout=0``: returned as it is)."""
    timeout, first = resolve_timeouts(getattr(config, "step_timeout", None),
                                      getattr(config, "first_step_timeout", None))
    if timeout <= 0:
        return step
    return WatchedStep(step, timeout, first, getattr(config, "preemption_signal", None))
