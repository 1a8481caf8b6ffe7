"""Device meshes: the data axis ZeRO partitions over, plus any model-parallel axes."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import Mesh

from zerojax._compat import mesh_from_devices
from zerojax._errors import ConfigError

DATA = "data"
MODEL = "model"  # the tensor-parallel (AutoTP) axis
SEQ = "seq"  # the sequence-parallel (Ulysses) axis


def make_mesh(
    shape: Union[None, int, Sequence[int], Mapping[str, int]] = None,
    axis_names: Optional[Sequence[str]] = None,
    devices=None,
) -> Mesh:
    """Build a mesh over ``devices`` (default: all devices).

    >>> make_mesh()                              # ('data',) over every device
    >>> make_mesh(4)                             # ('data',) over the first 4 devices
    >>> make_mesh((4, 2), ("data", "model"))     # data x tensor parallel
    >>> make_mesh({"data": 4, "model": 2})
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(shape, Mapping):
        axis_names, shape = tuple(shape.keys()), tuple(shape.values())
    elif shape is None:
        shape = (len(devices),)
    elif isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if axis_names is None:
        if len(shape) != 1:
            raise ConfigError(f"make_mesh{shape}: name the axes, e.g. make_mesh({shape}, ('data', 'model'))")
        axis_names = (DATA,)
    axis_names = tuple(axis_names)
    if len(axis_names) != len(shape):
        raise ConfigError(f"make_mesh: {len(shape)} axis sizes {shape} but {len(axis_names)} names {axis_names}")
    count = int(np.prod(shape))
    if count > len(devices):
        raise ConfigError(
            f"make_mesh{shape} needs {count} devices but only {len(devices)} exist. On a CPU, simulate more with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax is imported)."
        )
    return mesh_from_devices(np.asarray(devices[:count]).reshape(shape), axis_names)
