"""A Pallas AdamW kernel: one pass over flat buffers, master/m/v updated in place.

The device-side counterpart of ``HostAdamW``. Per element it reads the fp32 master
weight, both moments and the gradient (any float dtype), and writes the three fp32
buffers back into the same memory (``input_output_aliases``) plus the 16-bit copy of
the params the forward pass uses: 30 bytes per parameter with fp32 grads, 28 with
16-bit ones, whatever the compiler's fusion decisions (XLA on CPU, for one, splits
``optax.adamw`` + ``apply_updates`` into three loops that move 40)::

    master, m, v, p16 = fused_adamw(master, m, v, grads, count=step, lr=1e-3,
                                    weight_decay=0.01, grad_scale=clip / loss_scale)

``master``, ``m`` and ``v`` are donated: the arrays passed in must not be used again.
The arithmetic follows optax's order of operations (``optax.adamw``, ``eps_root=0``),
with the gradient first multiplied by ``grad_scale`` (loss-scale unscaling times the
clipping coefficient). Every scalar, ``count`` and ``lr`` included, is a runtime input,
so schedules and a changing loss scale never recompile the kernel.

Sizes that are not a multiple of ``block_size``: the kernel covers the whole blocks
and the last partial block (fewer than ``block_size`` elements) is computed by the
same math in plain jnp and written with an in-place ``dynamic_update_slice``, so
nothing is padded or copied.

Which kernel runs follows the platform the program is lowered for, not the machine it is
traced on (``jax.lax.platform_dependent``: every branch is traced, only the target's is
lowered): Pallas interpret mode on CPU (for tests), a GPU kernel on CUDA (Triton on JAX
0.10; from JAX 0.11, whose Triton backend is deprecated, JAX's default Mosaic GPU, see
:func:`zerojax._compat.pallas_gpu_backend`), Triton on ROCm and Mosaic on TPU. A step traced
on a CPU machine and lowered for ``("cuda",)`` therefore holds the GPU kernel.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zerojax._errors import ConfigError

__all__ = ["fused_adamw", "adamw_reference_math"]

# Runtime scalars travel as one small fp32 vector, 128 bytes (a power of two long, as Triton
# block shapes must be; Mosaic GPU copies multiples of 128 bytes): grad_scale, 1-b1, b1, 1-b2,
# b2, bc1, bc2, eps, wd, -lr, padding.
_N_SCALARS = 32
_N_USED = 10
# Mosaic GPU copies at most 256 elements along a dimension: its kernel's block
_MOSAIC_BLOCK = 256


def _sqrt_by_rsqrt(x):
    """sqrt for a Mosaic GPU kernel, whose lowering has rsqrt but no sqrt (x >= 0 here)."""
    return jnp.where(x > 0, x * jax.lax.rsqrt(x), jnp.zeros_like(x))


def adamw_reference_math(p, m, v, g, hp, sqrt=jnp.sqrt):
    """The update of one block, shared by the kernel and the ragged tail.

    ``hp`` is the tuple of fp32 scalars ``_pack`` lays out. Written in optax's order of
    operations so results agree with ``optax.adamw`` to within a few ulp (the compiler
    may still contract a multiply-add). ``sqrt``: the Mosaic GPU kernel passes
    :func:`_sqrt_by_rsqrt`.
    """
    scale, one_m_b1, b1, one_m_b2, b2, bc1, bc2, eps, wd, neg_lr = hp
    g = g.astype(jnp.float32) * scale
    m = one_m_b1 * g + b1 * m
    v = one_m_b2 * (g * g) + b2 * v
    u = (m / bc1) / (sqrt(v / bc2) + eps)
    u = u + wd * p
    p = p + u * neg_lr
    return p, m, v


def _kernel(hp_ref, p_ref, m_ref, v_ref, g_ref, p_out, m_out, v_out, p16_out, *, sqrt=jnp.sqrt):
    hp = tuple(hp_ref[i] for i in range(_N_USED))
    p, m, v = adamw_reference_math(p_ref[...], m_ref[...], v_ref[...], g_ref[...], hp, sqrt)
    p_out[...] = p
    m_out[...] = m
    v_out[...] = v
    p16_out[...] = p.astype(p16_out.dtype)


def _pack(count, lr, b1, b2, eps, weight_decay, grad_scale):
    """The scalar vector, each entry computed exactly as optax computes it."""
    f32 = jnp.float32
    count = jnp.asarray(count, jnp.int32)
    # optax: bias_correction = 1 - decay**count in fp32; the moment is divided by it.
    bc1 = 1 - jnp.asarray(b1, f32) ** count
    bc2 = 1 - jnp.asarray(b2, f32) ** count
    # 1 - b1 is formed before the cast, as optax does with a Python float decay.
    used = [grad_scale, 1 - b1, b1, 1 - b2, b2, bc1, bc2, eps, weight_decay, -lr]
    return jnp.stack([jnp.asarray(x, f32) for x in used]
                     + [jnp.zeros((), f32)] * (_N_SCALARS - _N_USED))


def _kernel_kinds(num_warps: int, num_stages: int) -> dict:
    """Per lowering platform, how the kernel is built: ``(block cap, compiler params, sqrt)``;
    ``"interpret"`` for Pallas interpret mode."""
    from zerojax._compat import mosaic_gpu_params, pallas_gpu_backend, triton_params

    triton = (None, triton_params(num_warps, num_stages), jnp.sqrt)
    mosaic = (_MOSAIC_BLOCK, mosaic_gpu_params(), _sqrt_by_rsqrt)
    return {"cuda": triton if pallas_gpu_backend() == "triton" else mosaic,
            "rocm": triton,  # Mosaic GPU is NVIDIA-only
            "tpu": (None, None, jnp.sqrt)}


def _update(hp, master, m, v, grads, *, out_dtype, block_size, kind):
    """The whole update of one buffer with one kind of kernel (see :func:`_kernel_kinds`)."""
    n = master.shape[0]
    interpret = kind == "interpret"
    cap, params, sqrt = (None, None, jnp.sqrt) if interpret else kind
    block_size = min(block_size, cap) if cap else block_size
    n_full = (n // block_size) * block_size
    if n_full:
        big = pl.BlockSpec(block_shape=(block_size,), index_map=lambda i: (i,))
        hp_spec = pl.BlockSpec(block_shape=(_N_SCALARS,), index_map=lambda i: (0,))
        master, m, v, p16 = pl.pallas_call(
            functools.partial(_kernel, sqrt=sqrt),
            grid=(n_full // block_size,),
            in_specs=[hp_spec, big, big, big, big],
            out_specs=[big, big, big, big],
            out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 3
            + [jax.ShapeDtypeStruct((n,), out_dtype)],
            # master, m, v are rewritten in place; elements past the last whole block
            # keep their old value until the tail update below.
            input_output_aliases={1: 0, 2: 1, 3: 2},
            interpret=interpret,
            # the backend's params pick it (Triton where the flat 1-D kernel is written for
            # it, see zerojax._compat.pallas_gpu_backend)
            compiler_params=params,
            name="fused_adamw",
        )(hp, master, m, v, grads)
    else:
        p16 = jnp.zeros((n,), out_dtype)
    if n_full < n:
        tp, tm, tv = adamw_reference_math(master[n_full:], m[n_full:], v[n_full:],
                                          grads[n_full:], tuple(hp[:_N_USED]))
        master = jax.lax.dynamic_update_slice(master, tp, (n_full,))
        m = jax.lax.dynamic_update_slice(m, tm, (n_full,))
        v = jax.lax.dynamic_update_slice(v, tv, (n_full,))
        p16 = jax.lax.dynamic_update_slice(p16, tp.astype(out_dtype), (n_full,))
    return master, m, v, p16


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_size", "interpret",
                                             "num_warps", "num_stages"),
                   donate_argnums=(0, 1, 2))
def _fused_adamw(master, m, v, grads, count, lr, b1, b2, eps, weight_decay, grad_scale,
                 *, out_dtype, block_size, interpret, num_warps, num_stages):
    hp = _pack(count, lr, b1, b2, eps, weight_decay, grad_scale)
    kw = dict(out_dtype=out_dtype, block_size=block_size)
    if interpret:
        return _update(hp, master, m, v, grads, kind="interpret", **kw)
    built = {}  # one branch per kind of kernel (platform_dependent joins identical branches)
    branches = {name: built.setdefault(id(kind), functools.partial(_update, kind=kind, **kw))
                for name, kind in _kernel_kinds(num_warps, num_stages).items()}
    if interpret is None:  # follow the lowering platform: interpret mode on CPU and elsewhere
        interp = functools.partial(_update, kind="interpret", **kw)
        return jax.lax.platform_dependent(hp, master, m, v, grads, cpu=interp, default=interp, **branches)
    # compiled for whatever platform it is lowered for (no Pallas backend for CPU)
    return jax.lax.platform_dependent(hp, master, m, v, grads, default=branches["tpu"], **branches)


def fused_adamw(master: jax.Array, m: jax.Array, v: jax.Array, grads: jax.Array,
                count, lr, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, grad_scale=1.0, *,
                out_dtype: Any = jnp.bfloat16, block_size: int = 4096,
                interpret: Optional[bool] = None, num_warps: int = 4,
                num_stages: int = 2):
    """One fused AdamW step. Returns ``(master, m, v, params16)``.

    Args:
      master, m, v: flat fp32 arrays of one size ``n``; donated and updated in place.
      grads: flat array of size ``n``, fp32 or 16-bit.
      count: 1-based number of this step (optax's count after its increment).
      lr, b1, b2, eps, weight_decay: as ``optax.adamw``; Python or traced scalars.
      grad_scale: multiplies the gradient first (``clip_coef / loss_scale``).
      out_dtype: dtype of ``params16``, the rounded copy of the new master weights.
      block_size: elements per kernel program; a power of two for Triton (Mosaic GPU's kernel
        takes at most 256).
      interpret: True: Pallas interpret mode; False: the compiled kernel for the platform the
        program is lowered for; None (default): interpret mode when lowered for CPU, the
        compiled kernel when lowered for a GPU or TPU, whatever machine traces it.
      num_warps, num_stages: Triton launch parameters (ignored when interpreting).
    """
    if block_size < 8 or block_size & (block_size - 1):
        raise ConfigError(f"fused_adamw: block_size={block_size} must be a power of two >= 8 "
                         "(Triton block shapes are powers of two).")
    n = master.shape[0] if master.ndim == 1 else -1
    for name, x in (("master", master), ("m", m), ("v", v), ("grads", grads)):
        if x.ndim != 1 or x.shape[0] != n:
            raise ConfigError(f"fused_adamw: {name} has shape {x.shape}; every buffer must be "
                             f"flat with the size of master ({master.shape}). Flatten with "
                             "FlatLayout or x.reshape(-1).")
        if name != "grads" and x.dtype != jnp.float32:
            raise ConfigError(f"fused_adamw: {name} must be float32, got {x.dtype}.")
    if not jnp.issubdtype(grads.dtype, jnp.floating):
        raise ConfigError(f"fused_adamw: grads must be a float array, got {grads.dtype}.")
    return _fused_adamw(master, m, v, grads, count, lr, b1, b2, eps, weight_decay,
                        grad_scale, out_dtype=jnp.dtype(out_dtype), block_size=int(block_size),
                        interpret=None if interpret is None else bool(interpret), num_warps=int(num_warps),
                        num_stages=int(num_stages))
