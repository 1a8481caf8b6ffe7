"""Consolidation: one checkpoint step's full params written to one file on this host, leaf by
leaf (safetensors, or a plain Orbax PyTree), each leaf checked against its checksum."""
from __future__ import annotations

import json
import math
import os
import struct as _struct

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint._format import lookup, nest
from zerojax.checkpoint._steps import checkpointer, pick_step, read_meta, read_state
from zerojax._errors import CheckpointError, ConfigError

__all__ = ["consolidate"]

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def _safetensors_name(path: str) -> str:
    return path.replace("/", ".")


def _read_leaf(step_dir: str, path: str, shape) -> np.ndarray:
    """One param leaf into host memory as numpy (no device copy), sliced to its logical ``shape``."""
    item = {"params": nest({path: 0})}
    args = {"params": nest({path: ocp.RestoreArgs(restore_type=np.ndarray)})}
    x = lookup(read_state(step_dir, item, args, this_process_only=True)["params"], path)
    if tuple(x.shape) != tuple(shape):  # split dimension padded by the saving mesh
        x = x[tuple(slice(0, s) for s in shape)]
    return np.ascontiguousarray(x)


def _np_checksum(x: np.ndarray) -> int:
    """``_checksum`` on the host, without a temporary copy (fp32 leaves)."""
    return int(x.view(np.uint32).sum(dtype=np.uint32))


def consolidate(checkpoint_dir, out, dtype: str = "float32", format: str = "safetensors",
                step: int | None = None, progress: bool = True) -> str:
    """Write the full params of one checkpoint step to ``out`` on this host, one leaf at a time.

    ``format="safetensors"``: tensors named by tree path joined with "." (``blocks.0.attn.qkv.kernel``);
    peak memory stays near the largest leaf. ``format="orbax"``: a plain Orbax PyTree of the params
    (this path holds the whole params tree in host memory). Returns ``out``. In a multi-process
    run one process may call it alone (``if jax.process_index() == 0``): it waits for no other.
    """
    from tqdm.auto import tqdm

    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"dtype={dtype!r}: use one of {sorted(_SAFETENSORS_DTYPES)}")
    if format not in ("safetensors", "orbax"):
        raise ConfigError(f"format={format!r}: use 'safetensors' or 'orbax'")
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    step = pick_step(checkpoint_dir, step)
    step_dir = os.path.join(checkpoint_dir, str(step))
    meta = read_meta(step_dir)
    np_dtype = np.dtype(jnp.dtype(dtype))
    leaves = list(meta["params"].items())
    bar = tqdm(leaves, desc=f"consolidate step {step}", unit="leaf", disable=not progress)

    def read(path, info):
        x = _read_leaf(step_dir, path, info["shape"])
        got = _np_checksum(x)
        if got != meta["checksums"]["params/" + path]:
            raise CheckpointError(f"checkpoint {step_dir} is damaged: params/{path} does not match its checksum")
        return x.astype(np_dtype, copy=False)  # no copy when the dtype is already right

    if format == "orbax":
        tree = nest({path: read(path, info) for path, info in bar})
        checkpointer(this_process_only=True).save(os.path.abspath(os.fspath(out)), tree, force=True)
        return out

    header, offset = {}, 0
    for path, info in leaves:
        nbytes = math.prod(info["shape"]) * np_dtype.itemsize
        header[_safetensors_name(path)] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": info["shape"],
                                           "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "np", "step": str(step)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(out)}.tmp{os.getpid()}"  # processes consolidating side by side do not collide
    with open(tmp, "wb") as f:
        f.write(_struct.pack("<Q", len(blob)))
        f.write(blob)
        for path, info in bar:  # safetensors data follow the header in its key order
            arr = read(path, info)
            f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
            del arr  # one leaf at a time
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
