"""Pipeline schedules as tables of ticks: what each stage does at each tick.

At every tick each stage runs at most one forward (F) and at most one backward (B), each of
one micro-batch; after the tick, activations move one stage down and their gradients one
stage up. A schedule is two tables, ``fwd[tick, stage]`` and ``bwd[tick, stage]`` (the
micro-batch, or -1 for none), which the step executes as they are, so the idle time it
measures is the schedule's bubble.

    1f1b         one forward and one backward per tick: stage s runs forwards from tick s,
                 and from tick 2 (P - 1) - s the backward of the micro-batch that entered
                 2 (P - 1 - s) ticks before, in the same tick. No tick waits for work it does not
                 have: with F and B of equal cost the bubble is (P - 1) / (M + P - 1), and at most
                 2 (P - s) - 1 stage inputs are in flight on stage s.
    1f1b-serial  DeepSpeed's TrainSchedule order: a tick runs a forward OR a backward; stage s
                 runs P - s warm-up forwards, then alternates B and F, then the cool-down Bs. At
                 most P - s inputs in flight, but stages run in lockstep, so a stage doing a
                 forward waits for its neighbours' backwards: slower when B costs more than F.
    gpipe        every forward, then every backward; all M stage inputs kept.

    >>> s = make_schedule("1f1b", stages=2, micro_batches=4)
    >>> s.idle_fraction()
    0.2
"""
from __future__ import annotations

import dataclasses

import numpy as np

from zerojax._errors import ConfigError

__all__ = ["NONE", "SCHEDULES", "Schedule", "check", "make_schedule", "theory_idle_fraction"]

NONE = -1  # no op at this tick


def theory_idle_fraction(stages: int, micro_batches: int) -> float:
    """The bubble of 1F1B and GPipe: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def idle_fraction(fwd_ran, bwd_ran, backward_cost: float = 1.0) -> float:
    """The idle share of the stages' time when ticks run in lockstep: a tick lasts as long as
    its busiest stage (F costs 1, B ``backward_cost``); ``fwd_ran``, ``bwd_ran``: 0/1 per
    [tick, stage], from a table or counted by the executed step."""
    work = np.asarray(fwd_ran, np.float64) + backward_cost * np.asarray(bwd_ran, np.float64)
    total = work.max(axis=1).sum() * work.shape[1]
    return float(1.0 - work.sum() / total) if total else 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    name: str
    fwd: np.ndarray  # i32[ticks, stages] micro-batch forwarded at that tick, or NONE
    bwd: np.ndarray  # i32[ticks, stages] micro-batch backpropagated at that tick, or NONE
    slots: int  # stage inputs kept per stage: micro-batch m lives in slot m % slots

    @property
    def ticks(self) -> int:
        return self.fwd.shape[0]

    @property
    def stages(self) -> int:
        return self.fwd.shape[1]

    def idle_fraction(self, backward_cost: float = 1.0) -> float:
        return idle_fraction(self.fwd != NONE, self.bwd != NONE, backward_cost)

    def in_flight(self) -> int:
        """The most stage inputs any stage holds at once."""
        most = 0
        for st in range(self.stages):
            f = {int(m): t for t, m in enumerate(self.fwd[:, st]) if m != NONE}
            b = {int(m): t for t, m in enumerate(self.bwd[:, st]) if m != NONE}
            most = max(most, max(sum(f[m] <= t <= b[m] for m in f) for t in range(self.ticks)))
        return most


def _table(name: str, stages: int, micro_batches: int, t_fwd, t_bwd, slots: int) -> Schedule:
    ticks = 1 + max(t_bwd(s, m) for s in range(stages) for m in range(micro_batches))
    fwd = np.full((ticks, stages), NONE, np.int32)
    bwd = np.full((ticks, stages), NONE, np.int32)
    for s in range(stages):
        for m in range(micro_batches):
            for table, t in ((fwd, t_fwd(s, m)), (bwd, t_bwd(s, m))):
                assert table[t, s] == NONE, f"{name}: stage {s} has two ops of a kind at tick {t}"
                table[t, s] = m
    schedule = Schedule(name, fwd, bwd, slots)
    check(schedule)
    return schedule


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    p = stages
    return _table("1f1b", stages, micro_batches, lambda s, m: s + m, lambda s, m: m + 2 * (p - 1) - s,
                  min(2 * p - 1, micro_batches))


def one_f_one_b_serial(stages: int, micro_batches: int) -> Schedule:
    """Forwards of micro-batches 0..P-s-1 at ticks s + m (warm-up), later ones at 2 m + s,
    each right after the backward that frees its slot; backward of m at 2 P - 1 - s + 2 m."""
    p = stages
    sched = _table("1f1b-serial", stages, micro_batches, lambda s, m: s + m if m < p - s else 2 * m + s,
                   lambda s, m: 2 * p - 1 - s + 2 * m, min(p, micro_batches))
    assert not ((sched.fwd != NONE) & (sched.bwd != NONE)).any()
    return sched


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """All forwards (stage s, micro-batch m at s + m), then all backwards, last micro-batch first."""
    p, mb = stages, micro_batches
    return _table("gpipe", stages, micro_batches, lambda s, m: s + m,
                  lambda s, m: (mb + p - 2) + (p - 1 - s) + (mb - 1 - m), mb)


SCHEDULES = {"1f1b": one_f_one_b, "1f1b-serial": one_f_one_b_serial, "gpipe": gpipe}


def make_schedule(name: str, stages: int, micro_batches: int) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {name!r} is not known. Fix: use one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](stages, micro_batches)


FORWARD, BACKWARD = 0, 1


def check(s: Schedule) -> None:
    """The executor's assumptions, checked on the table: each micro-batch's forward and
    backward on each stage once; a forward after the stage above sent its activation; a
    backward exactly one tick after the stage below it (the gradient is not buffered), and on
    the last stage not before its own forward (the same tick is fine: a backward recomputes
    the forward from the stage input); a stage input's slot not overwritten before its
    backward has read it."""
    ticks, stages = s.fwd.shape
    t_of = {}
    for kind, table in ((FORWARD, s.fwd), (BACKWARD, s.bwd)):
        for t in range(ticks):
            for st in range(stages):
                if table[t, st] != NONE:
                    assert (kind, st, int(table[t, st])) not in t_of, "an op appears twice"
                    t_of[(kind, st, int(table[t, st]))] = t
    mbs = len(t_of) // (2 * stages)
    assert len(t_of) == 2 * stages * mbs, "a micro-batch is missing an op"
    for st in range(stages):
        held = {}  # slot -> micro-batch whose input it holds, until its backward
        events = []
        for m in range(mbs):
            f, b = t_of[(FORWARD, st, m)], t_of[(BACKWARD, st, m)]
            assert f <= b, f"stage {st} micro-batch {m}: backward before forward"
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
