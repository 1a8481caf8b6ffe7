"""Consolidation: one checkpoint step's full params written to one file on this host, leaf by
leaf (safetensors, or a plain Orbax PyTree), each leaf checked against its checksum."""
from __future__ import annotations

import json
import math
import os
import struct as _struct

import jax.numpy as jnp
import numpy as np

import zerojax.checkpoint._pieces as _pieces
from zerojax.checkpoint._format import _GROUP_SHARE, RESTORE_BUDGET, STATE, nest
from zerojax.checkpoint._steps import checkpointer, pick_step, read_meta
from zerojax._errors import CheckpointError, ConfigError

__all__ = ["consolidate"]

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def _safetensors_name(path: str) -> str:
    return path.replace("/", ".")


def consolidate(checkpoint_dir, out, dtype: str = "float32", format: str = "safetensors",
                step: int | None = None, progress: bool = True, budget: int | None = None) -> str:
    """Write the full params of one checkpoint step to ``out`` on this host, one leaf at a time.

    ``format="safetensors"``: tensors named by tree path joined with "." (``blocks.0.attn.qkv.kernel``);
    each leaf is streamed from the checkpoint into the file in pieces of at most a quarter of
    ``budget`` (default 1 GiB, as for restore), so the host holds about one piece and one stored
    chunk, whatever the largest leaf. ``format="orbax"``: a plain Orbax PyTree of the params (this
    path holds the whole params tree in host memory). Returns ``out``. In a multi-process run one
    process may call it alone (``if jax.process_index() == 0``): it waits for no other.
    """
    from tqdm.auto import tqdm

    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"dtype={dtype!r}: use one of {sorted(_SAFETENSORS_DTYPES)}")
    if format not in ("safetensors", "orbax"):
        raise ConfigError(f"format={format!r}: use 'safetensors' or 'orbax'")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ConfigError(f"consolidate(budget={budget!r}): use a positive number of bytes, e.g. 1 << 30")
    piece = max((RESTORE_BUDGET if budget is None else budget) // _GROUP_SHARE, _pieces.MIN_PIECE)
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    step = pick_step(checkpoint_dir, step)
    step_dir = os.path.join(checkpoint_dir, str(step))
    meta = read_meta(step_dir)
    np_dtype = np.dtype(jnp.dtype(dtype))
    leaves = list(meta["params"].items())
    bar = tqdm(leaves, desc=f"consolidate step {step}", unit="leaf", disable=not progress)

    ctx = _pieces.context()

    def pieces(path, info):
        """The leaf's pieces in ``np_dtype``; its checksum is checked after the last one."""
        values, checksum = _pieces.read_pieces(os.path.join(step_dir, STATE), "params/" + path, info["shape"],
                                               piece, ctx)
        for _, x in values:
            yield x.astype(np_dtype, copy=False)  # no copy when the dtype is already right
        if checksum() != meta["checksums"]["params/" + path]:
            raise CheckpointError(f"checkpoint {step_dir} is damaged: params/{path} does not match its checksum")

    def read(path, info):
        return np.concatenate([x.reshape(-1) for x in pieces(path, info)]).reshape(info["shape"])

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
        try:
            for path, info in bar:  # safetensors data follow the header in its key order
                for x in pieces(path, info):  # row-major boxes: the leaf's bytes in order
                    f.write(np.ascontiguousarray(x).view(np.uint8).reshape(-1).data)
                    del x
                    _pieces.release()
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.close()
            os.remove(tmp)
            raise
    os.replace(tmp, out)
    return out
