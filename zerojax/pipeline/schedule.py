"""Pipeline schedules as tables of ticks: what each stage does at each tick.

At every tick each stage runs at most one forward (F) or one backward (B) of one
micro-batch; after it, activations move one stage down and their gradients one stage up.
A schedule is two integer tables ``op[tick, stage]`` (IDLE, FORWARD, BACKWARD) and
``micro[tick, stage]`` that the step executes as they are, so the idle ticks it counts are
the schedule's bubble.

    1F1B (DeepSpeed's TrainSchedule): stage s runs P - s warm-up forwards, then alternates
        one backward and one forward, then the cool-down backwards. At most P - s
        micro-batches are in flight on stage s, so it keeps P stage inputs.
    GPipe: every forward, then every backward; it keeps all M stage inputs.

Both take 2 (M + P - 1) ticks with 2 M busy ones per stage: an idle fraction of
(P - 1) / (M + P - 1) when a forward and a backward take the same time.

    >>> s = one_f_one_b(stages=2, micro_batches=4)
    >>> s.idle_fraction
    0.2
"""
from __future__ import annotations

import dataclasses

import numpy as np

from zerojax.errors import ConfigError

__all__ = ["BACKWARD", "FORWARD", "IDLE", "SCHEDULES", "Schedule", "gpipe", "make_schedule", "one_f_one_b",
           "theory_idle_fraction"]

IDLE, FORWARD, BACKWARD = 0, 1, 2


def theory_idle_fraction(stages: int, micro_batches: int) -> float:
    """The bubble of 1F1B and GPipe: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    name: str
    op: np.ndarray  # i32[ticks, stages] IDLE / FORWARD / BACKWARD
    micro: np.ndarray  # i32[ticks, stages] the micro-batch of that op (0 when idle)
    slots: int  # stage inputs kept per stage: micro-batch m lives in slot m % slots

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    @property
    def stages(self) -> int:
        return self.op.shape[1]

    @property
    def idle_fraction(self) -> float:
        """Idle ticks over all ticks, all stages together (every tick counted alike)."""
        return float((self.op == IDLE).mean())


def _table(name: str, stages: int, micro_batches: int, t_fwd, t_bwd, slots: int) -> Schedule:
    ticks = 2 * (micro_batches + stages - 1)
    op = np.zeros((ticks, stages), np.int32)
    micro = np.zeros((ticks, stages), np.int32)
    for s in range(stages):
        for m in range(micro_batches):
            for t, kind in ((t_fwd(s, m), FORWARD), (t_bwd(s, m), BACKWARD)):
                if op[t, s] != IDLE:
                    raise AssertionError(f"{name}: stage {s} has two ops at tick {t}")  # pragma: no cover
                op[t, s], micro[t, s] = kind, m
    schedule = Schedule(name, op, micro, slots)
    check(schedule)
    return schedule


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """DeepSpeed's 1F1B. Stage s: forwards of micro-batches 0..P-s-1 at ticks s + m (warm-up),
    later ones at 2 m + s, each right after the backward that frees its slot; backward of m
    at 2 P - 1 - s + 2 m, one tick after the stage below it."""
    p = stages
    return _table("1f1b", stages, micro_batches, lambda s, m: s + m if m < p - s else 2 * m + s,
                  lambda s, m: 2 * p - 1 - s + 2 * m, min(p, micro_batches))


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: all forwards (stage s, micro-batch m at s + m), then all backwards, last
    micro-batch first; every stage input is kept until its backward."""
    p, mb = stages, micro_batches
    return _table("gpipe", stages, micro_batches, lambda s, m: s + m,
                  lambda s, m: (mb + p - 1) + (p - 1 - s) + (mb - 1 - m), mb)


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def make_schedule(name: str, stages: int, micro_batches: int) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {name!r} is not known. Fix: use one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](stages, micro_batches)


def check(s: Schedule) -> None:
    """The executor's assumptions, checked on the table: each micro-batch's forward and
    backward on each stage once; a forward after the stage above sent its activation; a
    backward exactly one tick after the stage below it (the gradient is not buffered), and on
    the last stage after its own forward; a stage input's slot not overwritten before its
    backward has read it."""
    ticks, stages = s.op.shape
    t_of = {}
    for t in range(ticks):
        for st in range(stages):
            if s.op[t, st] != IDLE:
                t_of[(int(s.op[t, st]), st, int(s.micro[t, st]))] = t
    mbs = len(t_of) // (2 * stages)
    assert len(t_of) == 2 * stages * mbs, "an op appears twice"
    for st in range(stages):
        held = {}  # slot -> micro-batch whose input it holds, until its backward
        events = []
        for m in range(mbs):
            f, b = t_of[(FORWARD, st, m)], t_of[(BACKWARD, st, m)]
            assert f < b, f"stage {st} micro-batch {m}: backward before forward"
            if st > 0:
                assert f > t_of[(FORWARD, st - 1, m)], f"stage {st} micro-batch {m}: forward before its input"
                events.append((t_of[(FORWARD, st - 1, m)] + 1, 0, m))  # arrives, written to its slot
            else:
                events.append((f, 0, m))
            events.append((b, 1, m))
            if st < stages - 1:
                assert b == t_of[(BACKWARD, st + 1, m)] + 1, f"stage {st} micro-batch {m}: gradient not on time"
        for t, kind, m in sorted(events):
            slot = m % s.slots
            if kind == 0:
                assert slot not in held, f"stage {st}: micro-batch {m} overwrites slot {slot} at tick {t}"
                held[slot] = m
            else:
                del held[slot]
