"""Low-precision model states: bf16 params that are their own master, bf16 optimizer states,
and the stochastic rounding of the bf16 master update.

``ZeroConfig(master_weights_dtype="bfloat16")`` (DeepSpeed's ``bf16_master_weights_and_grads``)
keeps no fp32 master: the bf16 params are the master, the update computes in fp32 from them and
the result is rounded back to bf16. ``optimizer_state_dtype="bfloat16"`` (DeepSpeed's
``bf16_optimizer_states``) stores the optimizer leaves that mirror a param (Adam's moments) in
bf16; they are widened to fp32 for the update and rounded to nearest after it. Counts,
schedule state and statistics shaped unlike their param stay as the optimizer made them.

Round to nearest drops every update smaller than half a bf16 step of the weight (2^-8 relative),
so long runs with small learning rates stall. ``stochastic_rounding=True`` rounds the master
update up or down at random with the probabilities that make the expected stored value the
exact fp32 result: uniform random bits are added below the bf16 mantissa before truncating::

    y = stochastic_round(x, key)   # E[y] == x for every float32 x (bf16 has 16 fewer bits)

The key comes from the step's rng (``update_key``), one stream per param, drawn over the
param's logical shape, so a run is reproducible for a fixed rng on any mesh and any stage.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax._compat import same_memory_space
from zerojax._errors import ConfigError
from zerojax._plan import ZeroPlan

__all__ = ["ROUNDING_STREAM", "opt_for_storage", "opt_for_update", "opt_storage_dtype", "round_master",
           "stochastic_round", "update_key"]

DTYPES = {None: jnp.float32, "float32": jnp.float32, "bfloat16": jnp.bfloat16}

# the fold_in index of the rounding stream within a step's key (the gradient folds in the
# device index, which never reaches it)
ROUNDING_STREAM = 2**31 - 1


def opt_storage_dtype(plan: ZeroPlan):
    """The dtype optimizer leaves mirroring a param are stored in (float32 unless bf16 states)."""
    return DTYPES[plan.config.optimizer_state_dtype]


def _low_opt(plan: ZeroPlan) -> bool:
    return plan.config.optimizer_state_dtype is not None


def _cast_mirrors(plan: ZeroPlan, opt_state, dtype, stored: bool):
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)
    lays = plan.opt_leaf_layouts(opt_state, stored=stored)
    out = [x.astype(dtype) if lay is not None and jnp.issubdtype(x.dtype, jnp.floating) else x
           for x, lay in zip(leaves, lays)]
    return treedef.unflatten(out)


def opt_for_storage(plan: ZeroPlan, opt_state, stored: bool = False):
    """Optimizer state as the optimizer returns it -> the mirrored float leaves in their storage
    dtype (round to nearest); unchanged with fp32 states. ``stored``: the tree is in storage
    layout (padded) rather than the update layout."""
    if not _low_opt(plan):
        return opt_state
    return _cast_mirrors(plan, opt_state, opt_storage_dtype(plan), stored)


def opt_for_update(plan: ZeroPlan, opt_state, stored: bool = False):
    """Stored optimizer state -> the mirrored low-precision leaves widened to fp32 for the update."""
    if not _low_opt(plan):
        return opt_state
    return _cast_mirrors(plan, opt_state, jnp.float32, stored)


def stochastic_round(x, key, dtype=jnp.bfloat16):
    """``x`` (float32) rounded to bf16 at random, up with probability equal to the fraction of a
    bf16 step it lies above the value below: uniform bits added under the 16 bits bf16 keeps,
    then truncated. Unbiased (E[result] == x); nan stays nan, inf stays inf."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ConfigError(f"stochastic_round rounds float32 to bfloat16, not to {jnp.dtype(dtype).name}")
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # inside the host update the bits are typed as device values: moved to x's memory space
    noise = same_memory_space(jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF), bits)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    y = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    # a nan whose payload lies only in the dropped bits would truncate to inf
    y = jnp.where(jnp.isnan(x), x, y)
    return y.astype(jnp.bfloat16)  # exact: the low 16 bits are zero


def update_key(rng):
    """The rounding key of a step from the step's key (``fold_in(state.rng, state.step)``)."""
    return jax.random.fold_in(rng, ROUNDING_STREAM)


def round_master(plan: ZeroPlan, tree, key=None):
    """The fp32 result of the update (params-structured, update layout; None leaves pass) ->
    the master's storage dtype: unchanged with an fp32 master; bf16 rounded to nearest, or
    stochastically with ``stochastic_rounding`` (one stream per param, from ``key``)."""
    if plan.config.master_weights_dtype is None:
        return tree
    dtype = DTYPES[plan.config.master_weights_dtype]
    if not plan.config.stochastic_rounding:
        return jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)
    if key is None:
        raise ConfigError("stochastic_rounding needs the step's key: pass update_key(rng) to the update")
    index = {lay.path: i for i, lay in enumerate(plan.leaves)}
    return plan.map(lambda lay, x: None if x is None else stochastic_round(
        x, jax.random.fold_in(key, index[lay.path]), dtype), tree)
