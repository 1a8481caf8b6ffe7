"""The live ZenFlow engines of each plan, and the engine state a restore left for the next one.

A checkpoint of a ZenFlow run reads the engine that trained the state (a ZenFlowStep accepts only
states of its own plan, so the plan finds it); a restore onto a plan with no engine yet leaves the
state here with the function that loads it, and the ZenFlowStep built next takes it up
(:mod:`zerojax.checkpoint._zenflow_state`). Weak references: a dropped plan or step leaves nothing.
"""
from __future__ import annotations

import weakref

__all__ = ["attach", "engines", "leave", "pending"]

_LIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # plan -> WeakSet of ZenFlowSteps
_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # plan -> (engine state, load)


def attach(step, params) -> None:
    """Registers a new ZenFlowStep under its plan and loads a restore's engine state into it."""
    _LIVE.setdefault(step.plan, weakref.WeakSet()).add(step)
    entry = _PENDING.pop(step.plan, None)
    if entry is not None:
        payload, load = entry
        load(step, payload, params)


def engines(plan) -> list:
    """The live ZenFlowSteps of ``plan``."""
    return list(_LIVE.get(plan, ()))


def leave(plan, payload, load) -> None:
    """Keeps a restore's engine state for the next ZenFlowStep of ``plan``: ``load(step, payload, params)``."""
    _PENDING[plan] = (payload, load)


def pending(plan):
    """The engine state a restore left for ``plan`` (None: none)."""
    entry = _PENDING.get(plan)
    return None if entry is None else entry[0]
