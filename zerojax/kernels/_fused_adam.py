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
nothing is padded or copied. On CPU the kernel runs in Pallas interpret mode (for
tests); on GPU it is lowered through Triton.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zerojax._errors import ConfigError

__all__ = ["fused_adamw", "adamw_reference_math"]

# Runtime scalars travel as one small fp32 vector (a power of two long, as Triton block
# shapes must be): grad_scale, 1-b1, b1, 1-b2, b2, bc1, bc2, eps, wd, -lr, padding.
_N_SCALARS = 16
_N_USED = 10


def _triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """Triton compiler params, wherever this jax keeps them (the one version bridge).

    Passing them also pins the Triton backend: recent jax lowers ``pallas_call`` on GPU
    through Mosaic GPU unless Triton params are given.
    """
    try:
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):
        pass
    try:  # older jax releases
        from jax.experimental.pallas import gpu as plgpu
        return plgpu.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):
        return None


def adamw_reference_math(p, m, v, g, hp):
    """The update of one block, shared by the kernel and the ragged tail.

    ``hp`` is the tuple of fp32 scalars ``_pack`` lays out. Written in optax's order of
    operations so results agree with ``optax.adamw`` to within a few ulp (the compiler
    may still contract a multiply-add).
    """
    scale, one_m_b1, b1, one_m_b2, b2, bc1, bc2, eps, wd, neg_lr = hp
    g = g.astype(jnp.float32) * scale
    m = one_m_b1 * g + b1 * m
    v = one_m_b2 * (g * g) + b2 * v
    u = (m / bc1) / (jnp.sqrt(v / bc2) + eps)
    u = u + wd * p
    p = p + u * neg_lr
    return p, m, v


def _kernel(hp_ref, p_ref, m_ref, v_ref, g_ref, p_out, m_out, v_out, p16_out):
    hp = tuple(hp_ref[i] for i in range(_N_USED))
    p, m, v = adamw_reference_math(p_ref[...], m_ref[...], v_ref[...], g_ref[...], hp)
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


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_size", "interpret",
                                             "num_warps", "num_stages"),
                   donate_argnums=(0, 1, 2))
def _fused_adamw(master, m, v, grads, count, lr, b1, b2, eps, weight_decay, grad_scale,
                 *, out_dtype, block_size, interpret, num_warps, num_stages):
    n = master.shape[0]
    hp = _pack(count, lr, b1, b2, eps, weight_decay, grad_scale)
    n_full = (n // block_size) * block_size
    if n_full:
        big = pl.BlockSpec(block_shape=(block_size,), index_map=lambda i: (i,))
        hp_spec = pl.BlockSpec(block_shape=(_N_SCALARS,), index_map=lambda i: (0,))
        master, m, v, p16 = pl.pallas_call(
            _kernel,
            grid=(n_full // block_size,),
            in_specs=[hp_spec, big, big, big, big],
            out_specs=[big, big, big, big],
            out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32)] * 3
            + [jax.ShapeDtypeStruct((n,), out_dtype)],
            # master, m, v are rewritten in place; elements past the last whole block
            # keep their old value until the tail update below.
            input_output_aliases={1: 0, 2: 1, 3: 2},
            interpret=interpret,
            # Without them this jax lowers GPU kernels through Mosaic GPU, which this
            # flat 1-D kernel is not written for.
            compiler_params=_triton_compiler_params(num_warps, num_stages)
            if not interpret and jax.default_backend() != "tpu" else None,
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
      block_size: elements per kernel program; a power of two for Triton.
      interpret: run the kernel in Pallas interpret mode; default: on a CPU backend.
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
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _fused_adamw(master, m, v, grads, count, lr, b1, b2, eps, weight_decay,
                        grad_scale, out_dtype=jnp.dtype(out_dtype), block_size=int(block_size),
                        interpret=bool(interpret), num_warps=int(num_warps),
                        num_stages=int(num_stages))
