"""Checkpoints with Orbax: sharded save, restore onto any mesh, stage and offload setting,
consolidation into one file (see :mod:`zerojax.checkpoint._format` for the on-disk format).

    format.py   the on-disk layout, metadata, checksums, logical_tree and the relayout for restore
    pieces.py   a stored array read box by box (leaves larger than the restore budget, consolidation)
    integrity.py the digests of the JSON files (metadata, data state) and reading them verified
    steps.py    which steps on disk are complete; reading a step's metadata, data state and state
    export.py   consolidate: the params of one step into one safetensors or Orbax file
    manager.py  CheckpointManager (its truth is the directory: failed saves cost one step),
                restore (a step, the newest complete one or the newest intact one), intact_steps
"""
from zerojax.checkpoint._export import consolidate as consolidate
from zerojax.checkpoint._format import FORMAT as FORMAT
from zerojax.checkpoint._format import logical_tree as logical_tree
from zerojax.checkpoint._manager import CheckpointManager as CheckpointManager
from zerojax.checkpoint._manager import intact_steps as intact_steps
from zerojax.checkpoint._manager import restore as restore
from zerojax._errors import CheckpointError as CheckpointError

__all__ = ["FORMAT", "CheckpointError", "CheckpointManager", "consolidate", "intact_steps", "logical_tree", "restore"]
