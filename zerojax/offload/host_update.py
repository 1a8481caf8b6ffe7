"""ZeRO-Offload inside the jitted step: the optimizer update computed on the host.

The (still loss-scaled) gradients travel to the host in the compute dtype, the host
(``compute_on("device_host")``) updates the fp32 master and moments that live in pinned host
memory, and sends back compute-dtype params, which the device then gathers (stages 1–2).
With ``offload_ratio`` < 1 the trees passed in hold only the host side's params (the others
are None, optax's idiom for params it leaves alone); the device updates those itself.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zerojax._compat import same_memory_space
from zerojax.plan import ZeroPlan
from zerojax.stages.gated import gated_update, plan_recipe
from zerojax.stages.update import optax_update

__all__ = ["host_apply_fn"]

def host_apply_fn(plan: ZeroPlan, tx):
    """The optimizer update as it runs on the host (``compute_on``): compute-dtype, loss-scaled
    gradients and the fp32 master/optimizer state in -> compute-dtype params, master, state out.
    With low-precision states the host keeps them in bf16 too (the bf16 params as the master,
    bf16 moments) and computes in fp32; ``key`` drives stochastic rounding."""
    f32 = jnp.float32
    # Adam/AdamW, SGD momentum on fp32 states: the gated pass (zerojax/stages/gated.py), no select
    recipe = None if plan.partial_offload else plan_recipe(plan, tx)

    def host_apply(grads, master, opt_state, scale, coef, skip, key=None):
        grads = jax.tree_util.tree_map(lambda g: g.astype(f32) / scale / coef, grads)
        # values the optimizer makes from constants are typed as device values: home them
        home = functools.partial(jax.tree_util.tree_map, same_memory_space)
        if recipe is not None:
            new_master, new_opt = gated_update(recipe, tx, master, grads, opt_state, ~skip)
            new_master, new_opt = home(new_master, master), home(new_opt, opt_state)
        else:
            new_master, new_opt = optax_update(plan, tx, master, grads, opt_state, key)
            keep = functools.partial(jax.tree_util.tree_map, lambda o, n: jnp.where(skip, o, same_memory_space(n, o)))
            new_master, new_opt = keep(master, new_master), keep(opt_state, new_opt)
        new_params = jax.tree_util.tree_map(lambda x: x.astype(plan.compute_dtype), new_master)
        return new_params, (new_master if plan.has_master else None), new_opt

    return host_apply
