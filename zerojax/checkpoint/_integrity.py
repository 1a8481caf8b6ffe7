"""Checksums of the JSON files in a checkpoint step, and reading them back verified.

The arrays carry per-leaf checksums in ``zerojax/metadata``; this module covers the JSON files
themselves. ``zerojax/metadata`` holds a digest of its own content (``"checksum"``) and one of
the data state (``"files"``), each a SHA-256 of the canonical JSON text (sorted keys, no
spaces), so a truncated file, a flipped byte or one changed digit is a CheckpointError naming
the file, never a wrong ``{"batch": 7}``.
"""
from __future__ import annotations

import hashlib
import json
import os

from zerojax._errors import CheckpointError

__all__ = ["DATA_FILE", "META_FILE", "digest", "load_json", "portable", "seal", "verify_data", "verify_meta"]

META_FILE = os.path.join("zerojax", "metadata")
DATA_FILE = os.path.join("data_state", "metadata")
_SELF = "checksum"


def portable(obj, what: str):
    """``obj`` as it reads back from JSON (tuples become lists, keys strings), or a
    CheckpointError naming what cannot be written."""
    try:
        return json.loads(json.dumps(obj, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} cannot be written as JSON ({e}). Fix: pass plain dicts, lists, "
                              "strings, numbers and booleans (convert numpy/jax values with int() / float())") from None


def digest(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def seal(meta: dict, data_state) -> dict:
    """``meta`` with the digests of the data state and of itself."""
    out = portable(dict(meta, files={DATA_FILE.replace(os.sep, "/"): digest(data_state)}), "the metadata")
    out[_SELF] = digest(out)
    return out


def load_json(path: str):
    """The JSON value of the file ``path``; a CheckpointError names the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing (deleted, or the save never finished).") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e.strerror or e}.") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is damaged: it is not valid JSON ({type(e).__name__}: {e}); "
                              f"{len(data)} bytes (truncated or overwritten).") from None


def verify_meta(meta, path: str) -> dict:
    """``meta`` read from ``path``, its own digest checked (format 2 onwards)."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path} is damaged: a JSON object was expected, "
                              f"it holds a {type(meta).__name__}.")
    if meta.get("format", 1) >= 2:
        want = meta.get(_SELF)
        body = {k: v for k, v in meta.items() if k != _SELF}
        if want != digest(body):
            raise CheckpointError(f"checkpoint file {path} is damaged: its content does not match the checksum "
                                  "written with it.")
    return meta


def verify_data(meta: dict, data_state, path: str):
    """The data state read from ``path``, checked against the digest in the metadata."""
    want = meta.get("files", {}).get(DATA_FILE.replace(os.sep, "/"))
    if meta.get("format", 1) >= 2 and want != digest(data_state):
        raise CheckpointError(f"checkpoint file {path} is damaged: the data state read does not match the checksum "
                              "in zerojax/metadata (a changed value, such as one digit).")
    if not isinstance(data_state, dict):
        raise CheckpointError(f"checkpoint file {path} is damaged: a JSON object was expected, "
                              f"it holds a {type(data_state).__name__}.")
    return data_state
