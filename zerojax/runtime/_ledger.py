"""The ledger: the last events of a process's steps in a fixed-size ring, in memory or in a
memory-mapped file the launcher reads even when the process is blocked or dead; where a
process's ledger and stack dumps are written; and the launcher's verdict from every process's
ledger (which process is behind).

The watchdog that writes the ledger is :mod:`zerojax.runtime._watchdog`.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import threading
import time
from typing import Optional

__all__ = ["Event", "Ledger", "behind", "ledger_path", "read_ledger"]

# ----------------------------------------------------------------------------------------- ledger
EVENTS = ("step called", "batch check", "batch placed", "dispatched", "host update", "result ready", "compile begun",
          "compiled", "save begun", "save committed", "preemption notice", "preemption save", "closed",
          "stuck")
_CODE = {name: i + 1 for i, name in enumerate(EVENTS)}
_MAGIC = b"ZJLEDGR1"
_HEADER = struct.Struct("<8sqqd")  # magic, process index, pid, the step deadline in force (s)
_RECORD = struct.Struct("<QdqB31s")  # sequence number, wall time, step, event, detail
_SLOT, _SLOTS, _HEAD = 64, 256, 64
_SIZE = _HEAD + _SLOT * _SLOTS


@dataclasses.dataclass(frozen=True)
class Event:
    seq: int
    time: float  # wall clock (time.time())
    step: int  # the step the event belongs to: the state's step after it (1-based); 0: before any
    event: str
    detail: str = ""

    def line(self, now: Optional[float] = None) -> str:
        ago = f"  ({now - self.time:7.1f} s ago)" if now is not None else ""
        at = time.strftime("%H:%M:%S", time.localtime(self.time)) + f".{int(self.time * 1000) % 1000:03d}"
        detail = f"  {self.detail}" if self.detail else ""
        return f"{at}{ago}  step {self.step:>6}  {self.event}{detail}"


class Ledger:
    """The last :data:`_SLOTS` events of this process in a fixed-size ring: in memory, or in a
    memory-mapped file (``path``) that another process can read while this one is blocked or
    after it died. Recording one event packs 64 bytes into the ring: no system call, no device
    synchronisation."""

    def __init__(self, path: Optional[str] = None, process: int = 0):
        self.path = path
        self._lock = threading.Lock()
        self._seq = 0
        if path:
            with open(path, "w+b") as f:
                f.truncate(_SIZE)
                self.buf = mmap.mmap(f.fileno(), _SIZE)
        else:
            self.buf = bytearray(_SIZE)
        self.process = process
        self.set_deadline(0.0)

    def set_deadline(self, seconds: float) -> None:
        self.buf[:_HEADER.size] = _HEADER.pack(_MAGIC, self.process, os.getpid(), float(seconds))

    def record(self, event: str, step: int = 0, detail: str = "") -> None:
        code = _CODE[event]
        raw = detail.encode("utf-8", "replace")[:31]
        with self._lock:
            self._seq += 1
            off = _HEAD + (self._seq % _SLOTS) * _SLOT
            self.buf[off:off + _RECORD.size] = _RECORD.pack(self._seq, time.time(), int(step), code, raw)

    def events(self) -> list[Event]:
        return _parse(bytes(self.buf))


def _parse(raw: bytes) -> list[Event]:
    out = []
    for i in range(_SLOTS):
        off = _HEAD + i * _SLOT
        seq, when, step, code, detail = _RECORD.unpack_from(raw, off)
        if seq and 0 < code <= len(EVENTS):
            out.append(Event(seq, when, step, EVENTS[code - 1], detail.rstrip(b"\0").decode("utf-8", "replace")))
    return sorted(out, key=lambda e: e.seq)


def read_ledger(path: str) -> tuple[dict, list[Event]]:
    """A ledger file's header (``process``, ``pid``, ``deadline``) and its events, oldest first."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < _SIZE or raw[:8] != _MAGIC:
        raise ValueError(f"{path} is not a zerojax ledger")
    _, process, pid, deadline = _HEADER.unpack_from(raw, 0)
    return {"process": process, "pid": pid, "deadline": deadline}, _parse(raw)


def ledger_path(directory: str, process: int) -> str:
    return os.path.join(directory, f"process{process}.ledger")


def stuck_path(directory: str, process: int) -> str:
    return os.path.join(directory, f"process{process}.stuck.txt")


def stacks_path(directory: str, process: int) -> str:
    return os.path.join(directory, f"process{process}.stacks.txt")


# ------------------------------------------------------------------------------- the launcher's view
_ORDER = {"batch check": 0, "batch placed": 1, "step called": 2, "dispatched": 3, "host update": 3,
          "result ready": 4}  # how far into step N a process got


def _position(events: list[Event]) -> tuple[int, int, Optional[Event]]:
    """(step, phase, the event): how far a process got."""
    last = None
    for e in events:
        if e.event in _ORDER:
            last = e
    if last is None:
        return (0, _ORDER["result ready"], None)
    return (last.step, _ORDER[last.event], last)


def _where(last: Optional[Event]) -> str:
    if last is None:
        return "never entered a step"
    return {"batch check": f"placing step {last.step}'s batch (checking every process's rows together)",
            "batch placed": f"about to call step {last.step} (its batch placed)",
            "step called": f"inside step {last.step} (called, not yet dispatched)",
            "dispatched": f"waiting for step {last.step}'s result (dispatched)",
            "host update": f"waiting for step {last.step}'s result (host update done)",
            "result ready": f"between steps: step {last.step} finished, step {last.step + 1} not begun"}[last.event]


def behind(ledgers: dict[int, list[Event]], now: Optional[float] = None) -> tuple[list[int], list[str], list[str]]:
    """Which processes are behind, from every process's ledger: (their indices, one line per
    process saying where it is, one verdict line per process behind).

    A process is behind when it got less far than the furthest one: a smaller step, or the same
    step in an earlier phase (called < dispatched < result ready). When every process got as far,
    none is named (the stall is inside the step on all of them: their stacks tell where)."""
    now = time.time() if now is None else now
    pos = {p: _position(ev) for p, ev in ledgers.items()}
    if not pos:
        return [], [], []
    top = max((s, r) for s, r, _ in pos.values())
    late = sorted(p for p, (s, r, _) in pos.items() if (s, r) < top)
    lines, verdicts = [], []
    for p in sorted(pos):
        s, r, last = pos[p]
        since = f" (its last step event {now - last.time:.1f} s ago)" if last else ""
        lines.append(f"process {p}: {_where(last)}{since}")
        if p in late:
            if r == _ORDER["result ready"]:
                verdicts.append(f"process {p} is behind: it never entered step {s + 1}"
                                + ("" if s + 1 == top[0] else f" (the others are at step {top[0]})"))
            else:
                verdicts.append(f"process {p} is behind: it is still {_where(last)}, while the others are "
                                + (f"further in step {s}" if s == top[0] else f"at step {top[0]}"))
    return late, lines, verdicts
