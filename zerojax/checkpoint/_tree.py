"""The names and small helpers every part of the checkpoint package shares (the format's version,
the step directory's items, the nested tree of a step's leaves, the checksum check), kept apart
from :mod:`._format` so that the tiers' own modules can use them without importing it."""
from __future__ import annotations

from typing import Any

import jax

from zerojax._errors import CheckpointError

__all__ = ["DATA", "FORMAT", "META", "MISMATCH", "READABLE_FORMATS", "SAFETENSORS_16BIT", "STATE", "lookup", "nest",
           "verify"]

FORMAT = 2  # 2: the JSON files are checksummed too (zerojax.checkpoint._integrity)
READABLE_FORMATS = (1, 2)
MISMATCH = "the checkpoint does not match the target state"
STATE, META, DATA = "state", "zerojax", "data_state"
SAFETENSORS_16BIT = "model_16bit.safetensors"


def nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def lookup(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def verify(meta: dict, sums, where: str) -> None:
    got = {k: int(v) for k, v in jax.device_get(sums).items()}
    bad = [k for k, v in got.items() if meta["checksums"].get(k) != v]
    if bad:
        raise CheckpointError(
            f"checkpoint {where} is damaged: the values read for {', '.join(bad)} do not match the checksums "
            "written at save time (a data file was truncated, replaced or deleted). Restore an older step.")
