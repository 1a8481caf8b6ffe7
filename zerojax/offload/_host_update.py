"""ZeRO-Offload inside the jitted step: the optimizer update computed on the host.

The (still loss-scaled) gradients travel to the host in the compute dtype, the host
(``compute_on("device_host")``) updates the fp32 master and moments that live in pinned host
memory, and sends back compute-dtype params, which the device then gathers (stages 1–2).
With ``offload_ratio`` < 1 the trees passed in hold only the host side's params (the others
are None, optax's idiom for params it leaves alone); the device updates those itself. On a
mesh of CPU devices an Adam/AdamW on fp32 states runs in the native host kernel instead
(:func:`native_host_apply_fn`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax._compat import same_memory_space, shard_map, to_device_memory
from zerojax.kernels import _native as native
from zerojax._plan import ZeroPlan
from zerojax.stages._adam import AdamRecipe, adam_node, step_hyperparams
from zerojax.stages._gated import gated_update, plan_recipe
from zerojax.stages._gating import replace_node, select_scalars
from zerojax.stages._update import optax_update

__all__ = ["host_apply_fn", "native_adam_pass", "native_host_apply_fn", "on_cpu_mesh"]


def on_cpu_mesh(plan: ZeroPlan) -> bool:
    """Whether every device of the plan's mesh is a CPU device (whose memory is the host's)."""
    return all(d.platform == "cpu" for d in plan.mesh.devices.flat)


def native_adam_pass(plan: ZeroPlan, tx, recipe, inner, params, grads, moment_specs=None, *, updates: bool,
                     grad_scale=1.0, apply=True):
    """One Adam/AdamW step in the native host kernel over each device's partition.

    ``inner``: the optax state, its scalar leaves (counts, injected hyperparameters) in device
    memory and its moments as stored (``moment_specs``: their specs, one per param; default
    the master's); ``params``,
    ``grads``: params-structured, split like the master. Returns the kernel's first results
    (the new params, or with ``updates`` optax's updates) and the
    new state: counts and hyperparameters advanced as optax's (kept where ``apply`` is false),
    the moments the kernel's."""
    hp, before, after = step_hyperparams(tx, inner)
    hp = recipe.constants if recipe.constants is not None else hp
    node = adam_node(inner)
    scalars = native.adamw_scalars(optax.safe_increment(node.count), hp["learning_rate"], hp["b1"], hp["b2"],
                                   hp["eps"], hp["weight_decay"], grad_scale=grad_scale,
                                   eps_root=hp.get("eps_root", 0.0), apply=apply)
    specs = [plan.master_sharding(lay).spec for lay in plan.leaves]
    moment_specs = specs if moment_specs is None else moment_specs
    # every device of a CPU mesh runs its program at once: share the cores between them
    threads = max(1, native.default_threads() // max(1, len(plan.mesh.local_devices)))

    def body(s, ps, gs, ms, vs):
        if not updates:
            first, ms, vs, _ = native.host_adamw(s, ps, gs, ms, vs, threads=threads)
            return first, ms, vs
        # the kernel writes the moments only; the updates are XLA ops on them, which the caller's
        # apply (params + updates) fuses into one pass that writes the params in place: no
        # buffer for the updates, and no copy of gradients the caller keeps (written over before)
        _, ms, vs, _ = native.host_adamw(s, ps, gs, ms, vs, moments=True, threads=threads)
        first = [native.adamw_updates(s, p, to_device_memory(m).reshape(p.shape), to_device_memory(v).reshape(p.shape))
                 for p, m, v in zip(ps, ms, vs)]
        return first, ms, vs

    flat, unflat = plan.treedef.flatten_up_to, plan.treedef.unflatten
    first, mu, nu = shard_map(body, plan.mesh, in_specs=(P(), specs, specs, moment_specs, moment_specs),
                              out_specs=(specs, moment_specs, moment_specs))(
        scalars, flat(params), flat(grads), flat(node.mu), flat(node.nu))
    scal = after if apply is True else select_scalars(apply, after, before)
    return unflat(first), replace_node(scal, adam_node(scal)._replace(mu=unflat(mu), nu=unflat(nu)))


def native_host_apply_fn(plan: ZeroPlan, tx):
    """``host_apply_fn``'s update in the native host kernel (:mod:`zerojax.kernels._native`), or
    None where it cannot run: a mesh of CPU devices, an Adam/AdamW on fp32 masters and moments
    that the gated pass recognises, 32- or bf16 compute dtype, the whole state on the host, and
    the kernel built. Called outside ``compute_on``: each device's partition of the master and
    moments (in host memory) is updated in place in one pass, the loss scale and clip
    coefficient folded into the kernel's scalars; a skipped step touches nothing."""
    recipe = None if plan.partial_offload else plan_recipe(plan, tx)
    if not isinstance(recipe, AdamRecipe) or not on_cpu_mesh(plan):
        return None
    if jnp.dtype(plan.compute_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) \
            or not native.available():
        return None

    def host_apply(grads, master, opt_state, scale, coef, skip, key=None, value=None):
        leaves, treedef = jax.tree_util.tree_flatten(opt_state)
        mirrors = plan.opt_leaf_layouts(opt_state, stored=True)
        inner = treedef.unflatten([x if lay is not None else to_device_memory(x) for x, lay in zip(leaves, mirrors)])
        new_master, new = native_adam_pass(plan, tx, recipe, inner, master, grads, updates=False,
                                           grad_scale=1.0 / (to_device_memory(scale) * coef), apply=~skip)
        new = jax.tree_util.tree_map(same_memory_space, new, opt_state)
        new_master = jax.tree_util.tree_map(same_memory_space, new_master, master)
        new_params = jax.tree_util.tree_map(lambda x: x.astype(plan.compute_dtype), new_master)
        return new_params, (new_master if plan.has_master else None), new

    return host_apply


def host_apply_fn(plan: ZeroPlan, tx):
    """The optimizer update as it runs on the host (``compute_on``): compute-dtype, loss-scaled
    gradients and the fp32 master/optimizer state in -> compute-dtype params, master, state out.
    With low-precision states the host keeps them in bf16 too (the bf16 params as the master,
    bf16 moments) and computes in fp32; ``key`` drives stochastic rounding."""
    f32 = jnp.float32
    # Adam/AdamW, SGD momentum on fp32 states: the gated pass (zerojax/stages/_gated.py), no select
    recipe = None if plan.partial_offload else plan_recipe(plan, tx)

    def host_apply(grads, master, opt_state, scale, coef, skip, key=None, value=None):
        grads = jax.tree_util.tree_map(lambda g: g.astype(f32) / scale / coef, grads)
        # values the optimizer makes from constants are typed as device values: home them
        home = functools.partial(jax.tree_util.tree_map, same_memory_space)
        if recipe is not None:
            new_master, new_opt = gated_update(recipe, tx, master, grads, opt_state, ~skip)
            new_master, new_opt = home(new_master, master), home(new_opt, opt_state)
        else:
            new_master, new_opt = optax_update(plan, tx, master, grads, opt_state, key, value)
            keep = functools.partial(jax.tree_util.tree_map, lambda o, n: jnp.where(skip, o, same_memory_space(n, o)))
            new_master, new_opt = keep(master, new_master), keep(opt_state, new_opt)
        new_params = jax.tree_util.tree_map(lambda x: x.astype(plan.compute_dtype), new_master)
        return new_params, (new_master if plan.has_master else None), new_opt

    return host_apply
