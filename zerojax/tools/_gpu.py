"""GPUs zerojax can compile for without one: XLA's target description of each, its peaks, and
the compile-only devices JAX builds from it.

XLA compiles for a GPU it cannot see when it is given the GPU's ``GpuTargetConfigProto``
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT,
topology="1x<hosts>x<gpus per host>")``): the devices it returns cannot run anything, but a
step lowered and compiled for them is the program XLA:GPU would run, with its scheduled
collectives, its kernels and its memory analysis. It needs JAX's CUDA plugin (``jax[cuda12]`` or
``jax[cuda13]`` at the installed jax's version; the plugin and its PJRT library alone serve) and a process whose JAX
platforms are ``cpu`` (on a machine without a driver the plugin's start-up check fails
otherwise); :func:`zerojax.plan_step` starts such a process itself where this one is not.

The target files are XLA's own (``zerojax/tools/gpu_targets``); the peaks beside them are the
vendors' dense tensor-core figures, which XLA's files give for some GPUs only.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import re
from typing import Dict, Optional

import jax

from zerojax._compat import compile_lowered_for, cuda_plugin, gpu_topology, known_compile_options
from zerojax._errors import ConfigError, ZeroJaxError

GPUS_PER_HOST = 8  # an HGX/DGX node: the topology puts N GPUs on N / 8 hosts


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU to compile for. ``flops``: dense tensor-core peak per dtype ("fp32" is TF32, which
    XLA:GPU's default matmul precision uses for fp32 dots); bandwidths in bytes per second, one
    direction: ``link`` a GPU's NVLink to the others of its node, ``network`` its share of the
    node's network to other nodes."""

    name: str
    file: str
    title: str
    flops: Dict[str, float]
    link: float
    network: float

    @functools.cached_property
    def config_text(self) -> str:
        return importlib.resources.files("zerojax.tools").joinpath("gpu_targets", self.file).read_text()

    def _field(self, name: str) -> float:
        m = re.search(rf"^\s*{name}:\s*([0-9.e+]+)", self.config_text, re.M)
        if m is None:  # pragma: no cover - every packaged file has both fields
            raise ZeroJaxError(f"{self.file} has no {name}")
        return float(m.group(1))

    @property
    def memory_bytes(self) -> int:
        """The device memory XLA's description gives (what the allocator can hand out)."""
        return int(self._field("device_memory_size"))

    @property
    def hbm_bandwidth(self) -> float:
        return self._field("memory_bandwidth")

    def peak_flops(self, precision: str) -> float:
        return self.flops["fp32" if precision == "fp32" else "bf16"]


_H100_FLOPS = {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}
TARGETS: Dict[str, GpuTarget] = {
    "h100": GpuTarget("h100", "h100_sxm.txtpb", "NVIDIA H100 SXM 80 GB", _H100_FLOPS, link=450e9, network=50e9),
    "h200": GpuTarget("h200", "h200.txtpb", "NVIDIA H200 SXM 141 GB", _H100_FLOPS, link=450e9, network=50e9),
    "a100": GpuTarget("a100", "a100_sxm_80.txtpb", "NVIDIA A100 SXM 80 GB",
                      {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, link=300e9, network=25e9),
}
_ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "h100-80gb": "h100", "h200-141gb": "h200",
            "a100-80gb": "a100", "a100_sxm_80": "a100", "a100-sxm-80gb": "a100"}


def gpu_target(name) -> GpuTarget:
    """The :class:`GpuTarget` called ``name`` ("h100", "h200", "a100", or a listed alias)."""
    if isinstance(name, GpuTarget):
        return name
    key = str(name).lower()
    key = _ALIASES.get(key, key)
    if key not in TARGETS:
        raise ConfigError(f"target={name!r} is not a GPU zerojax can compile for; choose one of "
                          f"{', '.join(sorted(TARGETS))} (aliases: {', '.join(sorted(_ALIASES))})")
    return TARGETS[key]


def install_command() -> str:
    """The pip command that installs JAX's CUDA plugin at this jax's version: the plugin and its
    PJRT library are all XLA:GPU needs to compile (about 0.5 GB; ``jax[cuda12]`` adds the CUDA
    libraries a GPU runs with, about 5 GB more)."""
    v = jax.__version__
    return (f'pip install "jax-cuda12-plugin=={v}" "jax-cuda12-pjrt=={v}" (or the cuda13 pair where no cuda12 '
            f'plugin of jax {v} exists)')


def missing_plugin(target) -> ZeroJaxError:
    """The error for compiling for ``target`` where JAX's CUDA plugin is not installed."""
    target = gpu_target(target)
    return ZeroJaxError(
        f"compiling for target={target.name!r} needs JAX's CUDA plugin (XLA's GPU compiler and ptxas), and "
        f"this environment has none. Fix: {install_command()}; then run with JAX_PLATFORMS=cpu on a "
        "machine without a GPU (zerojax.plan_step starts such a process itself)")


def can_compile_here() -> bool:
    """Whether this process can build compile-only GPU devices: the CUDA plugin is installed and
    JAX's platforms are restricted to the CPU (else the plugin wants a driver)."""
    platforms = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "") or "").split(",")
    return cuda_plugin() is not None and platforms == ["cpu"]


def topology_name(gpus: int) -> str:
    """XLA's "partitions x hosts x GPUs per host" for ``gpus`` GPUs in nodes of 8."""
    gpus = int(gpus)
    per_host = min(gpus, GPUS_PER_HOST)
    if gpus < 1 or gpus % per_host:
        raise ConfigError(f"{gpus} GPUs do not fill nodes of {GPUS_PER_HOST}: use 1-8 GPUs, or a multiple of "
                          f"{GPUS_PER_HOST}")
    return f"1x{gpus // per_host}x{per_host}"


def target_devices(target, gpus: int):
    """``gpus`` compile-only devices of ``target``, in nodes of 8 (a list, node by node)."""
    target = gpu_target(target)
    topology = topology_name(gpus)
    if cuda_plugin() is None:
        raise missing_plugin(target)
    try:
        topo = gpu_topology(target.config_text, topology)
    except NotImplementedError as e:  # the plugin did not register: JAX's platforms are not cpu-only
        raise ZeroJaxError(
            f"JAX could not build compile-only {target.name} devices here ({e}): the CUDA plugin registers for "
            "compiling without a GPU only where JAX's platforms are the CPU. Fix: start the process with "
            "JAX_PLATFORMS=cpu, or call zerojax.plan_step(..., target=...), which does") from None
    devices = list(topo.devices)
    if len(devices) != gpus:  # pragma: no cover - XLA's topology gives what was asked
        raise ZeroJaxError(f"topology {topology} gave {len(devices)} devices, not {gpus}")
    return devices


# XLA:GPU keeps the kernels it builds (LLVM's PTX and ptxas's cubin: most of a small step's compile,
# ptxas alone runs once per kernel) in a file it reads before each compile and adds to after
# (``xla_gpu_kernel_cache_file``). The programs a plan, an autotune search or a benchmark compiles
# for one GPU share most of their kernels (a stage-0 step after a stage-3 one of the same GPT: 3 s
# of compiling instead of 17 here), so every compile for compile-only GPUs goes through one such
# file per GPU kind: in a directory of this process's own, removed at its exit, or in
# ZEROJAX_GPU_KERNEL_CACHE (a directory kept; one process at a time writes it); "0" turns it off.
KERNEL_CACHE_ENV = "ZEROJAX_GPU_KERNEL_CACHE"


@functools.cache
def _own_kernel_directory() -> str:
    """This process's kernel cache directory, made on first use and removed at exit."""
    import atexit
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="zerojax-gpu-kernels-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def kernel_cache_file(device) -> Optional[str]:
    """The kernel cache file for compiles for ``device``'s kind (see above), or None where off."""
    directory = os.environ.get(KERNEL_CACHE_ENV, "") or _own_kernel_directory()
    if directory == "0":
        return None
    os.makedirs(directory, exist_ok=True)
    # kernels are looked up by the fused computation, not by the GPU they were built for
    kind = re.sub(r"[^A-Za-z0-9]+", "-", f"{device.device_kind}-{getattr(device, 'compute_capability', '')}").strip("-")
    return os.path.join(directory, f"{kind}.kernels")


def compile_for_devices(lowered, devices, options=None):
    """:func:`zerojax._compat.compile_lowered_for` (``lowered`` compiled for ``devices``,
    compile-only GPUs) with the kernel cache of their kind."""
    path = kernel_cache_file(devices[0])
    options = dict(options or {})
    if path is not None and "xla_gpu_kernel_cache_file" not in options:
        options.update(known_compile_options({"xla_gpu_kernel_cache_file": path}))
    return compile_lowered_for(lowered, devices, options)


def compile_for_target(lowered, mesh, target, options=None):
    """XLA:GPU's program of ``lowered`` for as many compile-only GPUs of ``target`` as ``mesh`` (a
    mesh of this process's CPU devices) has, laid out as the mesh. ``lowered``: a step traced over
    ``mesh`` and lowered for CUDA there (``traced.lower(lowering_platforms=("cuda",))``), so that
    its memory kinds hold. ``options``: XLA options by name (the step's
    ``compiler_options(plan, "gpu")``)."""
    import numpy as np

    gpus = np.array(target_devices(target, mesh.devices.size)).reshape(mesh.devices.shape)
    return compile_for_devices(lowered, list(gpus.flat), options)


__all__ = ["GpuTarget", "KERNEL_CACHE_ENV", "TARGETS", "can_compile_here", "compile_for_devices", "compile_for_target",
           "gpu_target", "install_command", "kernel_cache_file", "missing_plugin", "target_devices", "topology_name"]
