"""AdamW as a native CPU kernel: one pass over p, g, m, v, split across threads.

DeepSpeed's CPU Adam is a C++ op built at first use; this is zerojax's: ``host_adamw.cc``
(next to this file) is an XLA FFI handler that jax calls inside a compiled CPU program
(``jax.ffi.ffi_call``), so the buffers it updates are jax arrays, donated and written in
place, and the call composes with ``jit``, ``shard_map`` and memory kinds like any other op.
Each element of p, g, m and v is read from memory once and each result written once (28
bytes per fp32 parameter), on all the cores it is given; XLA's own compilation of the same
update runs three loops (40 bytes) on one core once the buffers are updated in place.

The source is compiled on first use with the system C++ compiler (``$CXX``, else ``c++``/
``g++``; ``-O3 -march=native``) against the FFI headers jaxlib ships, into a cache directory
(``$ZEROJAX_CACHE``, else ``$XDG_CACHE_HOME/zerojax`` or ``~/.cache/zerojax``; the temporary
directory where that is not writable) keyed by the
source, the jaxlib version and this CPU's instruction-set flags, then loaded and registered
once per process. Without a compiler (or with ``ZEROJAX_NATIVE=0``) :func:`available` is
False, a ``NativeKernelWarning`` says why once, and the callers keep their XLA paths.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._errors import ConfigError, NativeKernelWarning

__all__ = ["NativeKernelWarning", "adamw_scalars", "adamw_updates", "available", "host_adamw", "default_threads"]

TARGET = "zerojax_host_adamw"
SOURCE = Path(__file__).with_name("host_adamw.cc")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w"]
_lock = threading.Lock()


def default_threads() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _cache_dir() -> Path:
    if os.environ.get("ZEROJAX_CACHE"):
        return Path(os.environ["ZEROJAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zerojax"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> Path:
    """The compiled library's path (building it if the cache lacks it); raises on failure."""
    import jaxlib

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, jaxlib.__version__.encode(), _cpu_flags().encode(),
                                     " ".join(_FLAGS).encode(), cxx.encode()])).hexdigest()[:16]
    name = f"host_adamw-{key}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"zerojax-{os.getuid()}"):
        if (folder / name).exists():
            return folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:  # a read-only home: build under the temporary directory
            continue
    out = folder / name
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders each land a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _load() -> str | None:
    """Registers the kernel; returns None when it runs, else why it does not."""
    if os.environ.get("ZEROJAX_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by ZEROJAX_NATIVE=0"
    try:
        with _lock:
            lib = ctypes.CDLL(str(_build()))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ZerojaxHostAdamW), platform="cpu")
    except Exception as e:  # no compiler, headers of another layout, a failed load
        return f"{type(e).__name__}: {e}"
    return None


def available(warn: bool = True) -> bool:
    """Whether the native kernel is built and registered (builds it on the first call)."""
    why = _load()
    if why is not None and warn and not why.startswith("disabled"):
        _warn_once(why)
    return why is None


@functools.cache
def _warn_once(why: str) -> None:
    warnings.warn(f"zerojax: the native host AdamW kernel is unavailable ({why}); the host update "
                  "runs as XLA compiles it (about 1.5x slower). Set ZEROJAX_NATIVE=0 to silence this.",
                  NativeKernelWarning, stacklevel=3)


def adamw_scalars(count, lr, b1, b2, eps, wd, grad_scale=1.0, eps_root=0.0, apply=True):
    """The kernel's ten fp32 scalars for step ``count`` (1-based), traced or not.

    Bias correction is folded into three of them, as ``HostAdamW`` does:
    ``mhat / (sqrt(vhat + eps_root) + eps)
    = (sqrt(bc2) / bc1) * m / (sqrt(v + eps_root * bc2) + eps * sqrt(bc2))``; ``grad_scale``
    multiplies the gradients (folded into the moments' coefficients). Where ``apply`` is false
    (a skipped fp16 step) the kernel leaves params and moments exactly as they were and never
    reads the gradients (non-finite then)."""
    f = jnp.float32
    # 1 - b in the precision b comes in, as optax does (a Python 0.999 gives exactly 1e-3, not
    # the fp32 difference 9.99987e-4)
    take1, take2 = 1 - b1, 1 - b2
    count = jnp.asarray(count, f)
    b1, b2, lr, eps, wd, s, er, take1, take2 = (jnp.asarray(x, f) for x in (
        b1, b2, lr, eps, wd, grad_scale, eps_root, take1, take2))
    bc1, bc2 = 1 - b1 ** count, 1 - b2 ** count
    root = jnp.sqrt(bc2)
    return jnp.stack([b1, take1 * s, b2, take2 * s * s, eps * root, lr * root / bc1,
                      1 - lr * wd, lr * wd, er * bc2, jnp.asarray(apply, f)]).astype(f)


def host_adamw(scalars, params, grads, mu, nu, out16=None, *, moments: bool = False, threads: int | None = None):
    """One AdamW step over lists of leaves with the native kernel (call where jax traces CPU code).

    Returns ``(new_params, mu, nu, out16)``, the params written over ``params``; with
    ``moments=True``, ``(None, mu, nu, None)``: the kernel writes the moments only and
    :func:`adamw_updates` makes optax's updates from them, where XLA can fuse that with the
    apply (``params + updates``). Each result is aliased to the operand it replaces, so a
    donated operand is updated in place (XLA copies one that is not donated). Leaves: fp32
    params and moments, fp32 or bfloat16 grads of the same size each; ``out16`` (params mode
    only): bfloat16 leaves receiving the new params.
    """
    why = _load()
    if why is not None:
        raise ConfigError(f"host_adamw: the native kernel is unavailable ({why}); check native.available() first")
    n = len(params)
    with16 = out16 is not None
    if with16 and moments:
        raise ConfigError("host_adamw: out16 is for params mode (moments=False)")
    operands, results, aliases = [scalars], [], {}
    per_arg = 5 if with16 else 4
    first = not moments  # the new params before the moments
    per_ret = (4 if with16 else 3) - moments
    for k in range(n):
        leaf = [params[k], grads[k], mu[k], nu[k]] + ([out16[k]] if with16 else [])
        base = 1 + per_arg * k
        operands += leaf
        outs = ([params[k]] if first else []) + [mu[k], nu[k]] + ([out16[k]] if with16 else [])
        results += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs]
        if first:
            aliases[base] = per_ret * k
        aliases[base + 2] = per_ret * k + first
        aliases[base + 3] = per_ret * k + first + 1
        if with16:
            aliases[base + 4] = per_ret * k + 3
    call = jax.ffi.ffi_call(TARGET, results, input_output_aliases=aliases, vmap_method="sequential")
    out = call(*operands, leaves=np.int64(n), moments=np.int64(moments), out16=np.int64(with16),
               threads=np.int64(threads or default_threads()))
    new_params = [out[per_ret * k] for k in range(n)] if first else None
    mu_new = [out[per_ret * k + first] for k in range(n)]
    nu_new = [out[per_ret * k + first + 1] for k in range(n)]
    o16 = [out[per_ret * k + 3] for k in range(n)] if with16 else None
    return new_params, mu_new, nu_new, o16


def adamw_updates(scalars, param, mu, nu):
    """optax's AdamW updates from the moments the kernel wrote (``moments=True``), with the
    kernel's scalars: ``-step m / (sqrt(v + root_hat) + eps_hat) - lr_wd p``, zeros for a
    skipped step (``apply`` 0). Traced as XLA ops, so a consumer of the updates
    (``optax.apply_updates``) fuses with it into one pass."""
    step, eps, lr_wd, root, apply = scalars[5], scalars[4], scalars[7], scalars[8], scalars[9]
    d = step * mu / (jnp.sqrt(nu + root) + eps)
    return jnp.where(apply != 0, -d - lr_wd * param, 0.0)
