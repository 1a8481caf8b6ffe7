"""AdamW on the host: in place over flat fp32 buffers, one pass, compiled or numpy.

With ZeRO-Offload the fp32 master weights and both Adam moments live in host memory
and the update runs on the CPU. ``HostAdamW`` computes ``optax.adamw`` (bias-corrected
moments, decoupled weight decay ``-lr * (mhat / (sqrt(vhat) + eps) + wd * p)``, equal up
to fp32 rounding) over flat buffers it updates in place::

    opt = HostAdamW(lr=1e-3, weight_decay=0.01)
    p, m, v = host_zeros(n), host_zeros(n), host_zeros(n)    # writable numpy arrays
    p16 = host_zeros(n, jnp.bfloat16)
    p[:] = initial_params
    opt.step(p, grads_bf16, m, v, count=1, grad_scale=1 / loss_scale, out16=p16)

The update is memory-bound: one pass reads p, g, m, v and writes p, m, v, 28 bytes per
parameter with fp32 grads, and each byte should cross the memory bus once. (XLA:CPU
compiles ``optax.adamw`` + ``apply_updates`` into three loops moving 40, so at equal
memory bandwidth one pass is at most 40/28 = 1.43x faster.) ``step`` picks one of two
ways from where the buffers live:

- **Compiled** (params, m, v and ``out16`` from ``host_zeros``, or from
  ``FlatLayout.empty``/``flatten``): their memory is owned by jax arrays on the CPU
  backend and lent to numpy. With fp32 or bfloat16 gradients and copies, the native kernel
  (:mod:`zerojax.kernels._native`, C++ built at first use like DeepSpeed's CPU Adam) does
  the whole step in one pass on ``num_threads`` threads, writing into the donated buffers;
  it runs at the machine's streaming bandwidth. Otherwise (float16, ``native=False``, no
  compiler) one XLA program walks the buffers in blocks of
  ``block_elements``: each block of p, g, m and v is read from memory once, in one pass
  that writes p, then m and v are updated while their blocks are in cache, each written
  back into the same memory (the arrays are donated and XLA reuses them; 16-bit data stay
  uint16 bits inside XLA; 512-bit vectors where XLA offers them). Gradients are read where
  they are, any numpy array, without a copy (XLA:CPU reads host memory in place from a
  64-byte aligned address; the few elements before it go through the numpy path).
  XLA runs this loop on one core (it does not split in-place block updates across
  threads), so meanwhile the other ``num_threads - 1`` threads update the last blocks
  on the numpy path. How many is adapted from step to step: it pays when cores are
  free, and when other work keeps them busy the steps run on XLA alone.
- **numpy** (any other buffers): XLA cannot write into memory it does not own (a donated
  array wrapping numpy memory is copied, not reused), so the update runs as numpy ufuncs
  with ``out=`` over cache-sized chunks (``chunk_elements``) in per-thread scratch, one
  contiguous slice per thread of a persistent pool (numpy releases the GIL inside ufunc
  loops). Several passes per chunk, all in cache: about twice the CPU time per element
  of the compiled loop.

Both widen 16-bit gradients and narrow the 16-bit copy of the params (round to nearest
even, as numpy's casts) in the same pass. ``FlatLayout`` (:mod:`zerojax.offload._flat`)
packs a whole params tree into one contiguous buffer per dtype and hands the leaves back as
zero-copy views, so the optimizer sees a single flat buffer; ``host_zeros`` is in
:mod:`zerojax.offload._host_buffers` and the thread split in :mod:`zerojax.offload._threads`.
"""
from __future__ import annotations

import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerojax._errors import ConfigError
from zerojax.kernels import _native as native
from zerojax.offload._host_buffers import (
    BF16,
    F16,
    F32,
    U16,
    cpu_device,
    host_buffer_of,
    host_zeros,
)
from zerojax.offload._threads import ThreadSplit

__all__ = ["HostAdamW"]

# Thread slices start on 64-byte boundaries so every chunk stays SIMD-aligned.
_ALIGN = 16
# XLA:CPU reads a numpy buffer in place only from a 64-byte aligned address.
_XLA_ALIGN_BYTES = 64
# Block offsets inside the compiled program are int32.
_MAX_COMPILED_ELEMENTS = 2**31 - 1


def _kind16(a: np.ndarray, name: str) -> str:
    if a.dtype == F32 and name == "grads":
        return "f32"
    if a.dtype in (BF16, U16):
        return "bf16"
    if a.dtype == F16:
        return "f16"
    allowed = "float32, bfloat16, float16 or uint16" if name == "grads" else \
        "bfloat16, float16 or uint16 (bfloat16 bits)"
    raise ConfigError(f"HostAdamW: {name} has dtype {a.dtype}; expected {allowed}.")



def _check_flat(a: Any, name: str, n: int, dtype: np.dtype | None = None,
                writable: bool = False) -> None:
    if not isinstance(a, np.ndarray):
        raise ConfigError(f"HostAdamW: {name} must be a numpy array (got {type(a).__name__}); "
                        "convert a jax array with np.asarray and keep the result.")
    if a.ndim != 1 or a.size != n or not a.flags.c_contiguous:
        raise ConfigError(f"HostAdamW: {name} must be a flat contiguous array of {n} elements, "
                         f"got shape {a.shape} (contiguous={a.flags.c_contiguous}); "
                         "pass x.reshape(-1) of a contiguous buffer.")
    if dtype is not None and a.dtype != dtype:
        raise ConfigError(f"HostAdamW: {name} must be {dtype}, got {a.dtype}.")
    if writable and not a.flags.writeable:
        raise ConfigError(f"HostAdamW: {name} is read-only (np.asarray of a jax array is); "
                         "updates happen in place, so pass a writable copy (np.array(x)).")



def _widen(g: jax.Array, kind: str) -> jax.Array:
    """fp32 values of a block of gradients (fp32, or 16-bit formats as uint16 bits)."""
    if kind == "f32":
        return g
    if kind == "bf16":  # exact: the bf16 bits are the high half of the fp32 word
        return lax.bitcast_convert_type(g.astype(jnp.uint32) << 16, jnp.float32)
    return lax.bitcast_convert_type(g, jnp.float16).astype(jnp.float32)


def _narrow(x: jax.Array, kind: str) -> jax.Array:
    """uint16 bits of fp32 ``x`` rounded to nearest even, as numpy/ml_dtypes round."""
    if kind == "f16":
        return lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = ((bits >> 16) & 0x8000) | 0x7FC0  # canonical quiet NaN, sign kept
    return jnp.where(jnp.isnan(x), nan, rounded).astype(jnp.uint16)


@functools.cache
def _vector_options() -> dict:
    """XLA:CPU options for the compiled step: 512-bit vectors where this XLA accepts the option
    (on CPUs without them LLVM splits each into two 256-bit halves)."""
    opts = {"xla_cpu_prefer_vector_width": 512}
    try:
        jax.jit(lambda x: x + 1, compiler_options=opts).lower(
            jax.ShapeDtypeStruct((8,), jnp.float32)).compile()
    except Exception:  # an XLA without the option: its defaults
        return {}
    return opts


@functools.cache
def _compiled_step(head: int, block: int, gkind: str, okind: str | None):
    """The jitted in-place step: (p, g, m, v, out16, scalars, blocks) -> (p, m, v, out16).

    p, m, v (and out16, uint16 bits) are donated and updated in place over the elements
    ``[head, head + blocks * block)``, ``blocks`` being a run-time value; element i of p
    pairs with element ``i - head`` of g (fp32 or uint16 bits). The caller updates the
    rest on the numpy path.
    """

    def update_block(p, g, m, v, o, s, at):
        def blk(x, i=at):
            return lax.dynamic_slice(x, (i,), (block,))

        gb = _widen(blk(g, at - head), gkind)
        # Same operations, in the same order, as the numpy path (HostAdamW._run). The p
        # update goes first and reads all four blocks from memory in one pass (with the new
        # moments computed in registers); the moment updates then find their blocks in cache.
        m_new = blk(m) * s[0] + gb * s[1]
        v_new = blk(v) * s[2] + (gb * gb) * s[3]
        p = lax.dynamic_update_slice(
            p, blk(p) * s[6] - m_new / (jnp.sqrt(v_new) + s[4]) * s[5], (at,))
        # Each update is a fusion that reads its buffer's block before writing it, which XLA
        # does in place. The moments are written by their own fusions, after p's: their
        # coefficients are second copies of the same values (s[8:12]), so XLA does not merge
        # them with p's and materialise the moments in between, and a term that is zero at
        # run time (s[7] is 0) reads the new p, so they run after the p update has read the
        # old moments. (The block offset must be a run-time value too: with a constant one
        # XLA loops over the whole buffer.)
        after_p = jnp.where(s[7] > 1, lax.dynamic_index_in_dim(p, at, keepdims=False), 0.0)
        m = lax.dynamic_update_slice(m, blk(m) * s[8] + gb * s[9] + after_p, (at,))
        v = lax.dynamic_update_slice(v, blk(v) * s[10] + (gb * gb) * s[11] + after_p, (at,))
        if o is not None:
            o = lax.dynamic_update_slice(o, _narrow(blk(p), okind), (at,))
        return p, m, v, o

    def step(p, g, m, v, o, s, blocks):
        return lax.fori_loop(
            0, blocks,
            lambda i, c: update_block(c[0], g, c[1], c[2], c[3], s, head + i * block),
            (p, m, v, o))

    return jax.jit(step, donate_argnums=(0, 2, 3) if okind is None else (0, 2, 3, 4),
                   compiler_options=_vector_options())


@functools.cache
def _native_step(threads: int, with16: bool):
    """The jitted native step: (p, g, m, v, out16, scalars) -> (p, m, v, out16), in place."""

    def step(p, g, m, v, o, s):
        (p,), (m,), (v,), o16 = native.host_adamw(s, [p], [g], [m], [v], None if o is None else [o],
                                                  threads=threads)
        return p, m, v, (o16[0] if with16 else None)

    return jax.jit(step, donate_argnums=(0, 2, 3, 4) if with16 else (0, 2, 3))


def _native_scalars(coefs) -> np.ndarray:
    """The native kernel's ten scalars (see ``native.adamw_scalars``) from ``_coefficients``."""
    return np.array(coefs[:7] + (0.0, 0.0, 1.0), F32)


def _kernel_scalars(coefs) -> np.ndarray:
    """The compiled step's scalars: AdamW's seven, a zero, the four moment ones again."""
    return np.array(coefs[:7] + (0.0,) + coefs[:4] + (0.0,) * 4, F32)


@functools.cache
def _in_place_ok() -> bool:
    """Whether this jax writes the compiled step's results into the donated memory."""
    bufs = [host_zeros(40) for _ in range(3)]
    holders = [host_buffer_of(b) for b in bufs]
    g = jnp.ones((40,), jnp.float32, device=cpu_device())
    s = jax.device_put(_kernel_scalars((1.0,) * 7), cpu_device())
    out = _compiled_step(0, 16, "f32", None)(holders[0].array, g, holders[1].array,
                                             holders[2].array, None, s, np.int32(2))
    jax.block_until_ready(out)
    in_place = all(o.unsafe_buffer_pointer() == h.ptr for o, h in zip(out, holders))
    for o, h in zip(out, holders):
        h.array = o
    # Only read the numpy views when XLA wrote into their memory.
    return in_place and bool(np.all(bufs[1][:32] == 1.0)) and not bufs[1][32:].any()



def _owned_grads(grads, gkind: str, owners):
    """The jax array of a ``host_zeros`` buffer holding exactly ``grads`` in their format (and
    not one of the buffers being updated), or None."""
    g_owner = host_buffer_of(grads)
    if g_owner is not None and g_owner.kind == gkind and all(g_owner is not o for o in owners):
        return g_owner.array
    return None


def _take_back(owners, out, who: str, fix: str) -> None:
    """Waits for the step's results and hands them to the buffers they were written into."""
    jax.block_until_ready(out)
    moved = False
    for owner, a in zip(owners, out):
        moved |= a.unsafe_buffer_pointer() != owner.ptr
        owner.array = a
    if moved:
        raise RuntimeError(f"HostAdamW: {who} did not update the host_zeros buffers in place; their "
                           f"numpy arrays are no longer valid. Use {fix}.")


class HostAdamW:
    """In-place AdamW over flat host buffers, equal to ``optax.adamw`` up to fp32 rounding.

    Args:
      lr, b1, b2, eps, weight_decay: as in ``optax.adamw`` (``eps_root=0``).
      num_threads: threads updating the buffers; defaults to the cores this process may
        run on. On the compiled path XLA is one of them and the others help on the
        numpy path.
      chunk_elements: elements per cache-resident chunk of the numpy path. Each thread
        touches about seven chunk-sized arrays at once, so 64K elements (256 KiB per
        array) keeps the working set in L2/L3 while amortising numpy's per-call overhead.
      compiled: use the compiled in-place step when params, m, v (and ``out16``) are
        ``host_zeros`` buffers (see the module docstring); False forces the numpy path.
      block_elements: elements per block of the compiled step: the block of every
        buffer is read from memory once, in one pass over all four, and stays in cache
        (L2) while m and v are written (32K elements: 128 KiB per fp32 buffer).
      native: on the compiled path, run the whole step in the native kernel
        (:mod:`zerojax.kernels._native`: one pass on ``num_threads`` threads) when it is
        built and the dtypes are fp32 or bfloat16; False keeps XLA's block loop.

    ``step`` is thread-safe only with respect to itself being called from one thread
    at a time; use one instance per caller thread otherwise.
    """

    def __init__(self, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, *,
                 num_threads: int | None = None, chunk_elements: int = 65536,
                 compiled: bool = True, block_elements: int = 32768, native: bool = True):
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"HostAdamW: b1={b1} and b2={b2} must lie in [0, 1).")
        if chunk_elements < _ALIGN or chunk_elements % _ALIGN:
            raise ConfigError(f"HostAdamW: chunk_elements={chunk_elements} must be a positive "
                             f"multiple of {_ALIGN}.")
        if block_elements < 1:
            raise ConfigError(f"HostAdamW: block_elements={block_elements} must be >= 1.")
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
        if num_threads < 1:
            raise ConfigError(f"HostAdamW: num_threads={num_threads} must be >= 1.")
        self.lr, self.b1, self.b2, self.eps = float(lr), float(b1), float(b2), float(eps)
        self.weight_decay = float(weight_decay)
        self.num_threads = int(num_threads)
        self.chunk_elements = int(chunk_elements)
        self.compiled = bool(compiled)
        self.block_elements = int(block_elements)
        self.native = bool(native)
        self._split = ThreadSplit(max(self.num_threads - 1, 0))
        self._compiled: set = set()
        c = self.chunk_elements
        # Per-thread scratch: two fp32 temporaries and one 32-bit word buffer used for
        # the widened gradient and for bit-level 16-bit conversions.
        self._scratch = [(np.empty(c, F32), np.empty(c, F32), np.empty(c, np.uint32))
                         for _ in range(self.num_threads)]
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="host-adamw") \
            if self.num_threads > 1 else None

    # -- public ------------------------------------------------------------------------
    def step(self, params: np.ndarray, grads: np.ndarray, m: np.ndarray, v: np.ndarray,
             count: int, *, lr: float | None = None, grad_scale: float = 1.0,
             out16: np.ndarray | None = None) -> None:
        """One AdamW step, updating ``params``, ``m`` and ``v`` in place.

        Runs compiled when params, m, v and ``out16`` (if given) are each a whole
        ``host_zeros`` buffer, otherwise on the numpy path; both give the same result
        up to fp32 rounding.

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
        _check_flat(params, "params", n, F32, writable=True)
        _check_flat(m, "m", n, F32, writable=True)
        _check_flat(v, "v", n, F32, writable=True)
        _check_flat(grads, "grads", n)
        gkind = _kind16(grads, "grads")
        okind = None
        if out16 is not None:
            _check_flat(out16, "out16", n, writable=True)
            okind = _kind16(out16, "out16")
        if int(count) < 1:
            raise ConfigError(f"HostAdamW: count={count} must be >= 1 (1 for the first step).")
        coefs = self._coefficients(int(count), self.lr if lr is None else float(lr),
                                   float(grad_scale))
        if self.compiled and self._step_compiled(params, grads, m, v, out16, gkind, okind,
                                                 coefs):
            return
        args = self._numpy_args(params, grads, m, v, out16, gkind, okind, coefs)
        self._run_parts([(i, lo, hi) for i, (lo, hi) in enumerate(self._partition(0, n))], args)

    def close(self) -> None:
        """Stops the worker threads (the instance can no longer step)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _numpy_args(self, params, grads, m, v, out16, gkind, okind, coefs):
        return (params, grads.view(U16) if gkind == "bf16" else grads, m, v,
                out16.view(BF16) if okind == "bf16" else out16, gkind, okind, coefs)

    def _run_parts(self, parts, args) -> None:
        """Runs (thread id, lo, hi) ranges of the numpy path, in the pool when several."""
        if len(parts) == 1 or self._pool is None:
            for tid, lo, hi in parts:
                self._run(tid, lo, hi, *args)
            return
        for f in [self._pool.submit(self._run, tid, lo, hi, *args) for tid, lo, hi in parts]:
            f.result()

    def _step_compiled(self, params, grads, m, v, out16, gkind, okind, coefs) -> bool:
        """Runs the step with the compiled kernel if the buffers allow it (returns True).

        XLA updates whole blocks from the gradients' first 64-byte aligned element on,
        on one core; meanwhile the other ``num_threads - 1`` threads update the last
        blocks and the remainder on the numpy path (``_split`` chooses how many), and
        the elements before the aligned start follow on the numpy path.
        """
        n = params.size
        if not 0 < n <= _MAX_COMPILED_ELEMENTS:
            return False
        owners = [host_buffer_of(a) for a in (params, m, v)]
        if out16 is not None:
            owners.append(host_buffer_of(out16))
            if owners[-1] is not None and owners[-1].kind != okind:
                return False
        if any(o is None for o in owners) or len({id(o) for o in owners}) != len(owners) \
                or not _in_place_ok():
            return False
        if self.native and gkind in ("f32", "bf16") and okind in (None, "bf16") and native.available():
            return self._step_native(owners, grads, gkind, okind, coefs)
        g, head = _owned_grads(grads, gkind, owners), 0
        if g is None:
            g_np = grads if gkind == "f32" else grads.view(U16)
            ptr, size = g_np.ctypes.data, g_np.itemsize
            if ptr % size:
                return False
            head = min((-ptr) % _XLA_ALIGN_BYTES // size, n)
            # device_put of an aligned numpy array wraps its memory: no copy.
            g = jax.device_put(g_np[head:], cpu_device()) if head < n else None
        block = self.block_elements
        whole = (n - head) // block
        helpers = self.num_threads - 1 if self._pool is not None else 0
        share = self._split.share() if helpers and whole else 0.0
        blocks = whole - round(share * whole)
        args = self._numpy_args(params, grads, m, v, out16, gkind, okind, coefs)
        key = (head, block, gkind, okind, n)
        timed = helpers and whole and key in self._compiled  # not a step that compiles
        start = time.perf_counter()
        out = None
        if blocks:
            s = jax.device_put(_kernel_scalars(coefs), cpu_device())
            fn = _compiled_step(head, block, gkind, okind)
            o16 = owners[3].array if out16 is not None else None
            out = fn(owners[0].array, g, owners[1].array, owners[2].array, o16, s,
                     np.int32(blocks))  # runs asynchronously
            out = [a for a in out if a is not None]
            self._compiled.add(key)
        rest = head + blocks * block
        try:
            if rest < n:  # the numpy path takes the remaining blocks while XLA runs
                parts = self._partition(rest, n, max(helpers, 1))
                self._run_parts([(i, lo, hi) for i, (lo, hi) in enumerate(parts)], args)
        finally:  # the buffers' memory now belongs to XLA's results: always take them back
            numpy_done = time.perf_counter()
            xla_last = out is not None and not all(a.is_ready() for a in out)
            if out is not None:
                _take_back(owners, out, "XLA", "compiled=False")
        if timed:
            self._split.record(share, time.perf_counter() - start, numpy_done - start,
                               xla_last, blocks * block, n - rest)
        if head:  # the elements before the gradients' aligned start
            self._run(0, 0, head, *args)
        return True

    def _step_native(self, owners, grads, gkind, okind, coefs) -> bool:
        """The whole step in the native kernel, on ``num_threads`` threads, in place."""
        g = _owned_grads(grads, gkind, owners)
        if g is None:  # wraps an aligned numpy array's memory, copies an unaligned one
            g = jax.device_put(grads if gkind == "f32" else grads.view(U16), cpu_device())
        s = jax.device_put(_native_scalars(coefs), cpu_device())
        with16 = okind is not None
        out = _native_step(self.num_threads, with16)(
            owners[0].array, g, owners[1].array, owners[2].array, owners[3].array if with16 else None, s)
        _take_back(owners, [a for a in out if a is not None], "the native kernel", "native=False")
        return True

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

    def _partition(self, lo: int, hi: int, parts: int | None = None) -> list:
        # Small ranges are not worth waking threads for: give each at least one chunk.
        n = hi - lo
        k = max(1, min(parts or self.num_threads, n // self.chunk_elements))
        cuts = [lo] + [lo + (n * i // k) // _ALIGN * _ALIGN for i in range(1, k)] + [hi]
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
                g = w.view(F32)
            else:
                g = w.view(F32)
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
