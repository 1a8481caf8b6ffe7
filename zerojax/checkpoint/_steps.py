"""The steps on disk: which are complete (an interrupted save is skipped with a warning), the
partial directories failed or killed saves leave, and reading one step's metadata, data state
and state item (the JSON files verified against their checksums)."""
from __future__ import annotations

import os
import re
import warnings

import jax
import orbax.checkpoint as ocp

from zerojax.checkpoint._pieces import read_tree
from zerojax.checkpoint._tree import FORMAT, META, READABLE_FORMATS, STATE
from zerojax.checkpoint._integrity import DATA_FILE, META_FILE, load_json, verify_data, verify_meta
from zerojax._errors import CheckpointError, ZeroJaxWarning

__all__ = ["checkpointer", "complete", "partial_dirs", "pick_step", "read_data", "read_meta", "read_state"]

_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


def complete(step_dir: str) -> bool:
    return (os.path.isfile(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
            and os.path.isfile(os.path.join(step_dir, STATE, "_METADATA"))
            and os.path.isfile(os.path.join(step_dir, META, "metadata")))


def _scan(directory: str, warn: bool = True) -> list[int]:
    """Complete steps in ``directory``, warning about every incomplete one found."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist (or is not a directory). "
                              "Fix: check the path, or save a step there first")
    steps = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if not os.path.isdir(full):
            continue
        if _TMP.match(name):
            if warn:
                warnings.warn(f"skipping incomplete checkpoint {full} (a save that never finished)", ZeroJaxWarning,
                              stacklevel=3)
        elif name.isdigit():
            if complete(full):
                steps.append(int(name))
            elif warn:
                warnings.warn(f"skipping incomplete checkpoint {full} (its metadata is missing)", ZeroJaxWarning,
                              stacklevel=3)
    return sorted(steps)


def pick_step(directory: str, step: int | None) -> int:
    steps = _scan(directory)
    if step is None:
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {directory!r}")
        return steps[-1]
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointError(f"step={step!r}: pass a step number, None (the newest complete step) or "
                              "'latest_intact' (the newest step that verifies)")
    if step not in steps:
        raise CheckpointError(f"no complete checkpoint for step {step} in {directory!r}; complete steps: {steps}")
    return step


def partial_dirs(directory: str) -> list[str]:
    """The temporary directories of saves that never finished (failed or killed) in ``directory``."""
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if _TMP.match(n) and os.path.isdir(os.path.join(directory, n)))


def read_meta(step_dir: str) -> dict:
    path = os.path.join(step_dir, META_FILE)
    meta = verify_meta(load_json(path), path)
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{step_dir}: checkpoint format {meta.get('format')!r}, this zerojax reads "
                              f"{list(READABLE_FORMATS)} (writes {FORMAT})")
    return meta


def read_data(step_dir: str, meta: dict) -> dict:
    """The step's data state, checked against its digest in ``meta``; {} for an old step without one."""
    path = os.path.join(step_dir, DATA_FILE)
    if meta.get("format", 1) < 2 and not os.path.isfile(path):
        return {}
    return verify_data(meta, load_json(path), path)


def _this_process_only() -> ocp.options.MultiprocessingOptions:
    """Orbax options for work one process does alone (consolidation): no barrier with the others."""
    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def checkpointer(this_process_only: bool):
    if not this_process_only or jax.process_count() == 1:
        return ocp.PyTreeCheckpointer()
    options = _this_process_only()
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=options),
                            multiprocessing_options=options)


def read_state(step_dir: str, item, restore_args, this_process_only: bool = False):
    """Read the state item; every process together, or (``this_process_only``) this one alone.
    In a single process tensorstore reads it directly (:func:`read_tree`)."""
    if jax.process_count() == 1:
        return read_tree(os.path.join(step_dir, STATE), item, restore_args)
    try:
        return checkpointer(this_process_only).restore(
            os.path.join(step_dir, STATE),
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
    except Exception as e:  # tensorstore/orbax raise many types; name the step and keep the cause
        raise CheckpointError(f"cannot read checkpoint {step_dir}: {type(e).__name__}: {e}") from e
