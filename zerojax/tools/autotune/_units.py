"""Amounts of memory: parsing a budget ("80GiB") and printing a byte count."""
from __future__ import annotations

import re
from typing import Optional, Union

import numpy as np

from zerojax._errors import ConfigError

__all__ = ["parse_bytes", "size_text"]

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


def parse_bytes(value: Union[int, float, str]) -> int:
    """``80 * 2**30``, ``"80GiB"``, ``"80 GB"``, ``"512MiB"`` -> bytes."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"budget={value!r} must be a positive number of bytes, e.g. 80 * 2**30 or '80GiB'")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{value!r} is not an amount of memory: write e.g. '80GiB', '40GB', '512MiB' or a "
                          "number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def size_text(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"

