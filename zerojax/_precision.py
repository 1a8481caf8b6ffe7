"""Mixed precision: dtypes per precision mode and DeepSpeed's dynamic loss scaler.

The loss scaler is functional and jittable: ``init() -> LossScalerState`` and
``update(state, overflow) -> LossScalerState``. Its semantics follow DeepSpeed's
``DynamicLossScaler`` (hysteresis, window, minimum-scale error)::

    scaler = LossScaler(initial_scale_power=8, loss_scale_window=2, hysteresis=2)
    s = scaler.init()
    s = scaler.update(s, overflow=jnp.bool_(True))   # scale 256, hysteresis 1
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

PRECISIONS = ("fp32", "bf16", "fp16")

_COMPUTE_DTYPE = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def compute_dtype(precision: str):
    """The dtype params are stored and used in for compute under ``precision``."""
    return _COMPUTE_DTYPE[precision]


class LossScalerState(NamedTuple):
    scale: jax.Array  # f32[] current loss scale
    hysteresis: jax.Array  # i32[] overflows still tolerated before the scale drops
    last_overflow_iter: jax.Array  # i32[] iteration of the last overflow (-1: none yet)
    iter: jax.Array  # i32[] number of updates seen
    at_minimum: jax.Array  # bool[] an overflow arrived while already at min_loss_scale


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """DeepSpeed's dynamic loss scaler (keys named as in its ``fp16`` block).

    ``loss_scale > 0`` gives a static scale that never changes (overflowing steps are
    still skipped). With ``loss_scale == 0`` the scale starts at ``2**initial_scale_power``.
    """

    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    loss_scale: float = 0.0
    scale_factor: float = 2.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    def init(self) -> LossScalerState:
        scale = 2.0 ** self.initial_scale_power if self.dynamic else self.loss_scale
        return LossScalerState(
            scale=jnp.asarray(scale, jnp.float32),
            hysteresis=jnp.asarray(self.hysteresis, jnp.int32),
            last_overflow_iter=jnp.asarray(-1, jnp.int32),
            iter=jnp.asarray(0, jnp.int32),
            at_minimum=jnp.asarray(False),
        )

    def update(self, state: LossScalerState, overflow) -> LossScalerState:
        overflow = jnp.asarray(overflow, bool)
        if not self.dynamic:
            return state._replace(
                last_overflow_iter=jnp.where(overflow, state.iter, state.last_overflow_iter),
                iter=state.iter + 1,
            )
        min_scale = jnp.float32(self.min_loss_scale)
        exhausted = (self.hysteresis == 1) | (state.hysteresis == 1)
        at_min = overflow & exhausted & (state.scale <= min_scale)
        # overflow branch
        o_scale = jnp.where(exhausted, jnp.maximum(state.scale / self.scale_factor, min_scale), state.scale)
        o_hyst = jnp.where(exhausted, state.hysteresis, state.hysteresis - 1)
        # clean branch
        stable = state.iter - state.last_overflow_iter - 1
        grow = (stable > 0) & (stable % self.loss_scale_window == 0)
        c_scale = jnp.where(grow, state.scale * self.scale_factor, state.scale)
        refill = grow | self.consecutive_hysteresis
        c_hyst = jnp.where(refill, jnp.int32(self.hysteresis), state.hysteresis)
        return LossScalerState(
            scale=jnp.where(overflow, o_scale, c_scale),
            hysteresis=jnp.where(overflow, o_hyst, c_hyst),
            last_overflow_iter=jnp.where(overflow, state.iter, state.last_overflow_iter),
            iter=state.iter + 1,
            at_minimum=state.at_minimum | at_min,
        )


def step_is_finite(norm, loss) -> jax.Array:
    """True when a step's loss and gradients hold no inf or nan, read from the gradients'
    ``global_norm`` (one pass over them: any inf or nan makes the norm inf or nan)."""
    return jnp.isfinite(norm) & jnp.isfinite(loss)


def global_norm(tree) -> jax.Array:
    """L2 norm over every leaf of ``tree``, accumulated in float32. Any inf or nan in a leaf
    makes it inf or nan, so ``isfinite(global_norm(g))`` is the overflow check too.

    Each leaf's sum of squares is a dot product of the leaf with itself: one read, and no
    squared copy that the compiler could share with an optimizer's own ``g ** 2`` (and then
    keep in memory as a whole-size buffer)."""
    return jnp.sqrt(total_sum_of_squares(jax.tree_util.tree_leaves(tree)))


# Leaves of fewer elements are summed together (see total_sum_of_squares).
SMALL_LEAF = 1 << 14


def total_sum_of_squares(leaves) -> jax.Array:
    """The float32 sum of every leaf's squared elements (0 for none; inf or nan if any is).

    Each leaf of at least :data:`SMALL_LEAF` elements is its own :func:`sum_of_squares`; the
    smaller ones (biases, norm scales) are flattened into one vector first, whose sum is one
    reduction. A reduction over a small leaf is several kernels for XLA's CPU backend (the
    squares, then a windowed and a final sum; a large one is a single library kernel), compiled
    once per small leaf shape, while the one copy of the small leaves costs next to nothing."""
    leaves = list(leaves)
    small = [x for x in leaves if x.size < SMALL_LEAF]
    parts = [sum_of_squares(x) for x in leaves if x.size >= SMALL_LEAF]
    if len(small) > 1:
        parts.append(sum_of_squares(jnp.concatenate([jnp.ravel(x.astype(jnp.float32)) for x in small])))
    else:
        parts += [sum_of_squares(x) for x in small]
    return sum(parts, jnp.float32(0.0))


def sum_of_squares(x) -> jax.Array:
    """The sum of ``x``'s squared elements in float32 (inf or nan if any element is)."""
    # contracted over every dim as it lies: flattening a leaf split along a later dim first
    # would make the compiler gather the whole leaf
    x = x.astype(jnp.float32)
    dims = tuple(range(x.ndim))
    return jax.lax.dot_general(x, x, ((dims, dims), ((), ())), precision=jax.lax.Precision.HIGHEST)
