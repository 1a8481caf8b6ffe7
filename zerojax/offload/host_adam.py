"""AdamW on the host: multi-threaded, chunked and in place over flat fp32 buffers.

With ZeRO-Offload the fp32 master weights and both Adam moments live in host memory
and the update runs on the CPU. ``HostAdamW`` computes exactly ``optax.adamw``
(bias-corrected moments, decoupled weight decay ``-lr * (mhat / (sqrt(vhat) + eps) +
wd * p)``) over flat buffers it updates in place::

    opt = HostAdamW(lr=1e-3, weight_decay=0.01)
    p = np.zeros(n, np.float32); m = np.zeros_like(p); v = np.zeros_like(p)
    p16 = np.empty(n, jnp.bfloat16)
    opt.step(p, grads_bf16, m, v, count=1, grad_scale=1 / loss_scale, out16=p16)

Why it is shaped this way: the update is memory-bound (28 bytes per parameter: read p,
g, m, v; write p, m, v), so each cache-sized chunk of every buffer is read from memory
once and all arithmetic on it happens while it is still in cache, through numpy ufuncs
with ``out=`` into per-thread scratch (no allocation per step). numpy releases the GIL
inside ufunc loops, so a persistent thread pool, one contiguous slice per thread, runs
the chunks on all cores. 16-bit gradients are widened and the 16-bit copy of the params
is narrowed chunk by chunk, inside the same pass.

``FlatLayout`` packs a whole params tree into one contiguous buffer per dtype and hands
the leaves back as zero-copy views, so the optimizer sees a single flat buffer.
"""
from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FlatLayout", "HostAdamW"]

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_BF16 = np.dtype(jnp.bfloat16)
_U16 = np.dtype(np.uint16)  # raw bfloat16 bits
# Thread slices start on 64-byte boundaries so every chunk stays SIMD-aligned.
_ALIGN = 16


def _kind16(a: np.ndarray, name: str) -> str:
    if a.dtype == _F32 and name == "grads":
        return "f32"
    if a.dtype in (_BF16, _U16):
        return "bf16"
    if a.dtype == _F16:
        return "f16"
    allowed = "float32, bfloat16, float16 or uint16" if name == "grads" else \
        "bfloat16, float16 or uint16 (bfloat16 bits)"
    raise TypeError(f"HostAdamW: {name} has dtype {a.dtype}; expected {allowed}.")


def _check_flat(a: Any, name: str, n: int, dtype: Optional[np.dtype] = None,
                writable: bool = False) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"HostAdamW: {name} must be a numpy array (got {type(a).__name__}); "
                        "convert a jax array with np.asarray and keep the result.")
    if a.ndim != 1 or a.size != n or not a.flags.c_contiguous:
        raise ValueError(f"HostAdamW: {name} must be a flat contiguous array of {n} elements, "
                         f"got shape {a.shape} (contiguous={a.flags.c_contiguous}); "
                         "pass x.reshape(-1) of a contiguous buffer.")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"HostAdamW: {name} must be {dtype}, got {a.dtype}.")
    if writable and not a.flags.writeable:
        raise ValueError(f"HostAdamW: {name} is read-only (np.asarray of a jax array is); "
                         "updates happen in place, so pass a writable copy (np.array(x)).")


class HostAdamW:
    """In-place AdamW over flat host buffers, equal to ``optax.adamw`` up to fp32 rounding.

    Args:
      lr, b1, b2, eps, weight_decay: as in ``optax.adamw`` (``eps_root=0``).
      num_threads: worker threads; defaults to the cores this process may run on.
      chunk_elements: elements per cache-resident chunk. Each thread touches about
        seven chunk-sized arrays at once, so 64K elements (256 KiB per array) keeps
        the working set in L2/L3 while amortising numpy's per-call overhead.

    ``step`` is thread-safe only with respect to itself being called from one thread
    at a time; use one instance per caller thread otherwise.
    """

    def __init__(self, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, *,
                 num_threads: Optional[int] = None, chunk_elements: int = 65536):
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"HostAdamW: b1={b1} and b2={b2} must lie in [0, 1).")
        if chunk_elements < _ALIGN or chunk_elements % _ALIGN:
            raise ValueError(f"HostAdamW: chunk_elements={chunk_elements} must be a positive "
                             f"multiple of {_ALIGN}.")
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
        if num_threads < 1:
            raise ValueError(f"HostAdamW: num_threads={num_threads} must be >= 1.")
        self.lr, self.b1, self.b2, self.eps = float(lr), float(b1), float(b2), float(eps)
        self.weight_decay = float(weight_decay)
        self.num_threads = int(num_threads)
        self.chunk_elements = int(chunk_elements)
        c = self.chunk_elements
        # Per-thread scratch: two fp32 temporaries and one 32-bit word buffer used for
        # the widened gradient and for bit-level 16-bit conversions.
        self._scratch = [(np.empty(c, _F32), np.empty(c, _F32), np.empty(c, np.uint32))
                         for _ in range(self.num_threads)]
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="host-adamw") \
            if self.num_threads > 1 else None

    # -- public ------------------------------------------------------------------------
    def step(self, params: np.ndarray, grads: np.ndarray, m: np.ndarray, v: np.ndarray,
             count: int, *, lr: Optional[float] = None, grad_scale: float = 1.0,
             out16: Optional[np.ndarray] = None) -> None:
        """One AdamW step, updating ``params``, ``m`` and ``v`` in place.

        Args:
          params, m, v: flat contiguous fp32 arrays of the same size.
          grads: flat array of that size: fp32, bfloat16, float16, or uint16 holding
            bfloat16 bits.
          count: 1-based number of this step (optax's ``count`` after its increment),
            used for bias correction.
          lr: learning rate for this step (a schedule's value); defaults to ``self.lr``.
          grad_scale: multiplies the gradients before use, e.g. ``clip_coef / loss_scale``.
          out16: optional flat bfloat16/float16/uint16(bf16 bits) array that receives the
            updated params, rounded to nearest even.
        """
        n = params.size if isinstance(params, np.ndarray) else -1
        _check_flat(params, "params", n, _F32, writable=True)
        _check_flat(m, "m", n, _F32, writable=True)
        _check_flat(v, "v", n, _F32, writable=True)
        _check_flat(grads, "grads", n)
        gkind = _kind16(grads, "grads")
        okind = None
        if out16 is not None:
            _check_flat(out16, "out16", n, writable=True)
            okind = _kind16(out16, "out16")
        if int(count) < 1:
            raise ValueError(f"HostAdamW: count={count} must be >= 1 (1 for the first step).")
        if gkind == "bf16":
            grads = grads.view(_U16)
        if okind == "bf16":
            out16 = out16.view(_BF16)
        coefs = self._coefficients(int(count), self.lr if lr is None else float(lr),
                                   float(grad_scale))
        parts = self._partition(n)
        args = (params, grads, m, v, out16, gkind, okind, coefs)
        if len(parts) == 1 or self._pool is None:
            for i, (lo, hi) in enumerate(parts):
                self._run(i, lo, hi, *args)
            return
        futures = [self._pool.submit(self._run, i, lo, hi, *args)
                   for i, (lo, hi) in enumerate(parts)]
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stops the worker threads (the instance can no longer step)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "HostAdamW":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _coefficients(self, count: int, lr: float, s: float):
        """Scalars folded so each chunk needs the fewest passes.

        mhat / (sqrt(vhat) + eps) = (sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2)),
        which removes two full passes (the divisions of m and v by bc1, bc2). The grad
        scale is folded into the moment coefficients instead of a pass over g.
        """
        b1, b2 = self.b1, self.b2
        bc1, bc2 = 1.0 - b1 ** count, 1.0 - b2 ** count
        f = np.float32
        return (f(b1), f((1.0 - b1) * s), f(b2), f((1.0 - b2) * s * s),
                f(self.eps * math.sqrt(bc2)), f(lr * math.sqrt(bc2) / bc1),
                f(1.0 - lr * self.weight_decay), self.weight_decay != 0.0)

    def _partition(self, n: int) -> list:
        # Small buffers are not worth waking threads for: give each at least one chunk.
        k = max(1, min(self.num_threads, n // self.chunk_elements))
        cuts = [0] + [(n * i // k) // _ALIGN * _ALIGN for i in range(1, k)] + [n]
        return [(cuts[i], cuts[i + 1]) for i in range(k) if cuts[i + 1] > cuts[i]]

    def _run(self, tid, lo, hi, params, grads, m, v, out16, gkind, okind, coefs):
        b1, c1, b2, c2, eps_hat, step_size, decay, has_wd = coefs
        t1_full, t2_full, w_full = self._scratch[tid]
        mul, add, sub, div, sqrt = np.multiply, np.add, np.subtract, np.divide, np.sqrt
        c = self.chunk_elements
        for a in range(lo, hi, c):
            b = min(a + c, hi)
            if b - a == c:
                t1, t2, w = t1_full, t2_full, w_full
            else:
                t1, t2, w = t1_full[:b - a], t2_full[:b - a], w_full[:b - a]
            p, mm, vv = params[a:b], m[a:b], v[a:b]
            if gkind == "f32":
                g = grads[a:b]
            elif gkind == "bf16":
                # bf16 -> f32 is exact: the bf16 bits are the high half of the f32 word.
                np.copyto(w, grads[a:b], casting="unsafe")
                np.left_shift(w, 16, out=w)
                g = w.view(_F32)
            else:
                g = w.view(_F32)
                np.copyto(g, grads[a:b], casting="same_kind")
            # m = b1*m + (1-b1)*s*g
            mul(g, c1, t1)
            mul(mm, b1, mm)
            add(mm, t1, mm)
            # v = b2*v + (1-b2)*s^2*g^2
            mul(g, g, t2)
            mul(t2, c2, t2)
            mul(vv, b2, vv)
            add(vv, t2, vv)
            # p = (1 - lr*wd)*p - step_size * m / (sqrt(v) + eps_hat)
            sqrt(vv, t2)
            add(t2, eps_hat, t2)
            div(mm, t2, t2)
            mul(t2, step_size, t2)
            if has_wd:
                mul(p, decay, p)
            sub(p, t2, p)
            if okind is not None:
                # numpy/ml_dtypes casts round to nearest even and keep NaN/Inf intact.
                np.copyto(out16[a:b], p, casting="same_kind")


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each leaf of a tree sits inside one flat buffer per dtype.

    Leaves keep their own dtype (or all are cast to ``dtype`` when given); leaves of
    one dtype are laid end to end in tree-flatten order::

        layout = FlatLayout.from_tree(params, dtype=np.float32)
        bufs = layout.flatten(params)            # {'float32': 1-D buffer}
        master = bufs["float32"]                 # what HostAdamW updates in place
        tree = layout.unflatten(bufs)            # zero-copy views shaped like params
    """

    treedef: Any
    shapes: tuple  # per leaf, in flatten order
    dtypes: tuple  # per leaf: dtype name of the buffer it lives in
    offsets: tuple  # per leaf: first element inside its dtype's buffer
    sizes: dict  # dtype name -> total elements of that buffer

    @classmethod
    def from_tree(cls, tree: Any, dtype: Any = None) -> "FlatLayout":
        leaves, treedef = jax.tree.flatten(tree)
        shapes, dtypes, offsets, sizes = [], [], [], {}
        for leaf in leaves:
            src = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            dt = jnp.dtype(dtype if dtype is not None else src).name
            shape = tuple(np.shape(leaf))
            offsets.append(sizes.get(dt, 0))
            sizes[dt] = sizes.get(dt, 0) + math.prod(shape)
            shapes.append(shape)
            dtypes.append(dt)
        return cls(treedef, tuple(shapes), tuple(dtypes), tuple(offsets), sizes)

    def empty(self) -> dict:
        """Fresh uninitialised buffers, one per dtype."""
        return {dt: np.empty(n, jnp.dtype(dt)) for dt, n in self.sizes.items()}

    def flatten(self, tree: Any, out: Optional[dict] = None) -> dict:
        """Copies the leaves of ``tree`` into (new or given) flat buffers."""
        leaves = self.treedef.flatten_up_to(tree)
        bufs = self.empty() if out is None else out
        for leaf, shape, dt, off in zip(leaves, self.shapes, self.dtypes, self.offsets):
            if tuple(np.shape(leaf)) != shape:
                raise ValueError(f"FlatLayout.flatten: leaf has shape {np.shape(leaf)}, "
                                 f"layout expects {shape}; rebuild the layout for this tree.")
            size = math.prod(shape)
            np.copyto(bufs[dt][off:off + size], np.asarray(leaf).reshape(-1),
                      casting="same_kind")
        return bufs

    def unflatten(self, buffers: dict) -> Any:
        """The tree as zero-copy, reshaped views into ``buffers``."""
        leaves = [buffers[dt][off:off + math.prod(shape)].reshape(shape)
                  for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets)]
        return self.treedef.unflatten(leaves)
