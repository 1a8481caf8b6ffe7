"""Checkpoints with Orbax: sharded save, restore onto any mesh, stage and offload setting,
consolidation into one file (see :mod:`zerojax.checkpoint.manager` for the on-disk format)."""
from zerojax.checkpoint.manager import FORMAT as FORMAT
from zerojax.checkpoint.manager import CheckpointManager as CheckpointManager
from zerojax.checkpoint.manager import consolidate as consolidate
from zerojax.checkpoint.manager import logical_tree as logical_tree
from zerojax.checkpoint.manager import restore as restore
from zerojax.errors import CheckpointError as CheckpointError

__all__ = ["FORMAT", "CheckpointError", "CheckpointManager", "consolidate", "logical_tree", "restore"]
