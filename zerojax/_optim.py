"""zero_optimizer: any optax transformation with its state partitioned over the data axis.

For users who keep their own training loop: the wrapper stores the inner optimizer's state
split over the data axis (stage >= 1), runs the inner update on each device's partition of
the gradients and params, and returns the whole updates::

    tx = zj.zero_optimizer(optax.adamw(1e-3), mesh=mesh, config=zj.ZeroConfig(stage=1))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)     # inside or outside jit
    params = optax.apply_updates(params, updates)

Gradient clipping from ``config.gradient_clipping`` uses DeepSpeed's coefficient. Precision,
loss scaling and gradient accumulation belong to ``make_train_step``; this wrapper leaves
dtypes as given. An inner update that reads the loss (reduce_on_plateau, polyak_sgd, momo) gets
it as ``tx.update(grads, opt_state, params, value=loss)``, as in optax; a function of the params
(a line search's ``value_fn``) cannot be called on a partition and is refused by name.

A recognised ``optax.contrib.muon`` (the update checked against optax's on probe values, see
:mod:`zerojax.stages._muon`) runs its Newton–Schulz iterations on whole matrices, each on one
owner of the data axis: one all-to-all per matrix shape to the owners and one back (stage 0:
one all-gather), instead of a collective per matmul of a partitioned leaf.

``offload_optimizer="cpu"`` (ZeRO-Offload): the state is stored in pinned host memory and the
update is computed on the host
(``compute_on("device_host")``): each device's partition of the gradients and params travels
to its host, and the updates come back to device memory before the gather. On a mesh of CPU
devices (whose memory is the host's) an Adam/AdamW that ``make_train_step``'s gated pass
recognises runs instead in the native host kernel (:mod:`zerojax.kernels._native`, as fast as
DeepSpeed's CPU Adam): one pass over each partition, the moments updated in place in host
memory and the updates written over the gradients. An optimizer
whose update cannot be traced for the host (it mixes host values with constants it makes on
the device: optax.adafactor, lamb, clip_by_global_norm) is updated on the device instead, with
a ``HostUpdateWarning``; its state still lives in host memory between steps. NVMe offload,
ZenFlow and ``offload_ratio`` < 1 keep optimizer state beside the step: they are
``make_train_step``'s (``zj.initialize``'s), and refused here.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax._autotp import mesh_for
from zerojax._compat import compute_on_host, same_memory_space, to_device_memory
from zerojax.config import ZeroConfig
from zerojax._errors import ConfigError, IgnoredKeysWarning, OptimizerError, StateError
from zerojax.kernels import _native as native
from zerojax.offload._host_update import native_adam_pass, on_cpu_mesh
from zerojax._plan import DEVICE, ZeroPlan
from zerojax.stages import _collectives as C
from zerojax.stages._adam import adam_recipe
from zerojax.stages._muon import muon_recipe, muon_updates
from zerojax.stages._update import takes_value
from zerojax.update._pipeline import clip_gradients, host_or_device
from zerojax.update._recognize import describe


class ZeroOptState(NamedTuple):
    inner: Any  # the wrapped optimizer's state, each leaf split like the param it mirrors


def _constrain(tree, shardings):
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, tree, shardings)


def _place(tree, shardings):
    # device_put, not a sharding constraint: it also moves leaves to their memory kind
    return jax.tree_util.tree_map(jax.device_put, tree, shardings)


def _check_tree(plan: ZeroPlan, tree, what: str):
    got = jax.tree_util.tree_structure(tree)
    if got != plan.treedef:
        raise StateError(f"zero_optimizer: {what} tree {got} does not match the params tree {plan.treedef} "
                         "given to init; pass grads/params with the same structure as at init.")


def _lift_rank(plan: ZeroPlan) -> int:
    """Leading unit axes on every offloaded state leaf: one more than any param has dims.

    A caller's ``jax.jit(..., donate_argnums=...)`` without ``out_shardings`` pairs each donated
    input with the first output of the same shape and dtype whatever its memory kind; the
    updates (device memory, the params' shapes) would take the donated moments' host buffers,
    which the runtime refuses. Lifted, no state leaf has the shape of any update, so donated
    state only pairs with the new state, in host memory, and is updated in place."""
    return 1 + max((len(lay.shape) for lay in plan.leaves), default=0)


def _check_offload(config: ZeroConfig) -> None:
    """Refuse, by name, the offload and low-precision-state settings that only make_train_step honours."""
    fix = "use zj.make_train_step (or zj.initialize with a DeepSpeed config), which keeps that state itself"
    if config.offload_optimizer == "nvme":
        raise ConfigError(
            'zero_optimizer: offload_optimizer="nvme" (zero_optimization.offload_optimizer.device) is not '
            "supported here: NVMe offload keeps the optimizer state in files that the step reads and writes "
            f'in sub-groups, outside the opt_state tree this wrapper returns. Fix: {fix}, or use '
            'offload_optimizer="cpu" for host memory')
    if config.zenflow:
        raise ConfigError(
            "zero_optimizer: zenflow (zero_optimization.zenflow) is not supported here: ZenFlow keeps its "
            f"optimizer state and split update beside the step. Fix: {fix}, or drop the zenflow block")
    low = [f"{k}={getattr(config, k)!r}" for k in ("master_weights_dtype", "optimizer_state_dtype",
                                                   "stochastic_rounding") if getattr(config, k)]
    if low:
        raise ConfigError(
            f"zero_optimizer: {', '.join(low)} (bf16.bf16_master_weights_and_grads / bf16_optimizer_states) is not "
            "supported here: this wrapper leaves dtypes as given and keeps no master. Fix: pass bf16 params and an "
            "optimizer with bf16 moments (optax.adamw(..., mu_dtype=jnp.bfloat16)) yourself, or use "
            "zj.make_train_step, which keeps low-precision states")
    if config.offload_optimizer is not None and config.offload_ratio < 1:
        raise ConfigError(
            f"zero_optimizer: offload_ratio={config.offload_ratio!r} (zero_optimization.offload_optimizer.ratio) "
            "is not supported here: this wrapper offloads the whole optimizer state. "
            f"Fix: use offload_ratio 1.0, or {fix}")
    if config.offload_optimizer == "cpu" and not config.pin_memory:
        warnings.warn(
            "zero_optimizer ignores pin_memory=False (zero_optimization.offload_optimizer.pin_memory): the "
            "state it returns from a jitted update is placed where the program's host values go, pinned host "
            "memory (a program cannot return unpinned memory). Drop the key, or use zj.make_train_step, whose "
            "step returns the state in unpinned host memory", IgnoredKeysWarning, stacklevel=3)
    if config.offload_param is not None:
        warnings.warn(
            f"zero_optimizer ignores offload_param={config.offload_param!r} (zero_optimization.offload_param): "
            "the params are the caller's, kept where the caller keeps them. Drop the key, or use "
            "zj.make_train_step to offload stage-3 params", IgnoredKeysWarning, stacklevel=3)


def zero_optimizer(tx: optax.GradientTransformation, *, mesh=None,
                   config: Optional[ZeroConfig] = None) -> optax.GradientTransformation:
    config = ZeroConfig(stage=1) if config is None else config
    mesh = mesh_for(config, mesh)  # as zj.initialize: built from autotp_size / sequence_parallel_size when None
    _check_offload(config)
    offload = config.offload_optimizer == "cpu"
    if offload:
        config = config.replace(pin_memory=True)
    # probed here, not while tracing the update (recognition runs the transformation eagerly)
    adam = adam_recipe(tx) if offload else None

    def plan_for(params) -> ZeroPlan:
        return ZeroPlan.create(params, mesh, config)

    def split(plan: ZeroPlan, tree):
        # each device's partition, sliced locally (no constraint on the caller's arrays), padded
        return C.split_tree(plan, tree, plan.opt_partitioned)

    def homes(plan: ZeroPlan):
        """Where each stored leaf of the inner state lives (offloaded: in host memory, lifted)."""
        logical = jax.eval_shape(tx.init, plan.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype)))
        shardings = plan.opt_state_shardings(logical)
        if not offload:
            return shardings
        k = _lift_rank(plan)
        return jax.tree_util.tree_map(lambda s: s.update(spec=P(*(None,) * k, *s.spec)), shardings)

    def store(plan: ZeroPlan, stored):
        # stored padded, split like the master, so any jit boundary accepts it; offloaded
        # state goes to (stays in) host memory, lifted (see _lift_rank)
        return ZeroOptState((_place if offload else _constrain)(stored, homes(plan)))

    def lift(plan: ZeroPlan, tree):
        k = _lift_rank(plan)
        return jax.tree_util.tree_map(lambda x: x.reshape((1,) * k + x.shape), tree)

    def init_fn(params):
        plan = plan_for(params)
        stored = placement.opt_to_storage(plan, tx.init(placement.to_update(plan, split(plan, params))))
        return store(plan, lift(plan, stored) if offload else stored)

    def device_update(plan: ZeroPlan, grads, inner, params, value=None):
        """Partitioned grads/params and the inner state, all padded -> padded updates and state;
        ``value`` (the loss, None when the inner update does not take it) passed on as given."""
        extra = {} if value is None else {"value": value}
        args = (placement.to_update(plan, grads), placement.opt_to_update(plan, inner), placement.to_update(plan, params))
        # a recognised optax.contrib.muon: Newton–Schulz on whole matrices, each on its owner (the
        # offloaded update keeps optax's: it runs on the host or, lifted, under vmap)
        muon = None if offload else muon_recipe(plan, tx)
        if muon is not None:
            new_updates, inner = muon_updates(plan, muon, tx, *args)
        else:
            new_updates, inner = tx.update(*args, **extra)
        return placement.to_storage(plan, new_updates), placement.opt_to_storage(plan, inner)

    def lifted_update(plan: ZeroPlan, grads, inner, params, value=None):
        """``device_update`` on the lifted state, under one ``vmap`` (of size 1) per lifted axis,
        mapped over the leaves that mirror a param: their new values come out lifted, with no
        reshape between the moments and their stored form, so XLA updates donated state in
        place (a reshape there makes it fuse the moments' update into the updates' and copy
        the old moments). The other leaves (counts, hyperparameters) enter unmapped."""
        k = _lift_rank(plan)
        leaves, treedef = jax.tree_util.tree_flatten(inner)
        lowered = [x.reshape(x.shape[k:]) for x in leaves]
        mirrors = plan.opt_leaf_layouts(treedef.unflatten(lowered), stored=True)
        args = treedef.unflatten([x if lay is not None else low for x, low, lay in zip(leaves, lowered, mirrors)])
        axes = treedef.unflatten([None if lay is None else 0 for lay in mirrors])
        update = functools.partial(device_update, plan, value=value)  # the loss: unmapped
        for _ in range(k):
            update = jax.vmap(update, in_axes=(0, axes, 0))
        new_updates, new = update(lift(plan, grads), args, lift(plan, params))
        return jax.tree_util.tree_map(lambda x: x.reshape(x.shape[k:]), new_updates), new

    def host_update(plan: ZeroPlan, value=None):
        def on_host(grads, inner, params):
            updates, new = lifted_update(plan, grads, inner, params, value)
            # values the optimizer makes from constants are typed as device values: home them
            return updates, jax.tree_util.tree_map(same_memory_space, new, inner)
        return compute_on_host(on_host)

    def native_recipe(plan: ZeroPlan, grads, params):
        """Adam's recipe when the native host kernel can run this update, else None: a mesh of
        CPU devices (their memory is the host's), an Adam/AdamW the gated pass reproduces, fp32
        grads and params, and the kernel built."""
        if not on_cpu_mesh(plan):
            return None
        if any(x.dtype != jnp.float32 for x in jax.tree_util.tree_leaves((grads, params))):
            return None
        return adam if adam is not None and native.available() else None

    def native_update(plan: ZeroPlan, recipe, grads, state: ZeroOptState, params):
        """The offloaded Adam update in the native kernel: one pass over each device's partition of
        the grads, params and host-resident moments (updated in place when donated), the updates
        written over the grads. The counts and hyperparameters (schedules) advance as optax's."""
        k = _lift_rank(plan)
        leaves, treedef = jax.tree_util.tree_flatten(state.inner)
        lowered = [x.reshape(x.shape[k:]) for x in leaves]
        mirrors = plan.opt_leaf_layouts(treedef.unflatten(lowered), stored=True)
        # the moments stay lifted, in host memory, for the kernel; the scalars step on the device
        inner = treedef.unflatten([x if lay is not None else to_device_memory(low)
                                   for x, low, lay in zip(leaves, lowered, mirrors)])
        lifted = [P(*(None,) * k, *plan.master_sharding(lay).spec) for lay in plan.leaves]
        us, new = native_adam_pass(plan, tx, recipe, inner, params, grads, lifted, updates=True)
        new_leaves = jax.tree_util.tree_leaves(new)
        stored = treedef.unflatten([x if lay is not None else x.reshape((1,) * k + x.shape)
                                    for x, lay in zip(new_leaves, mirrors)])
        return us, store(plan, stored)

    def offloaded_update(plan: ZeroPlan, grads, state: ZeroOptState, params, value=None):
        """The update on the host: partitions to host memory, updates back to device memory."""
        recipe = native_recipe(plan, grads, params)
        if recipe is not None:
            return native_update(plan, recipe, grads, state, params)
        to_host = plan.map(lambda lay, x: jax.device_put(x, plan.master_sharding(lay)), grads)
        params_host = plan.map(lambda lay, x: jax.device_put(x, plan.master_sharding(lay)), params)
        def on_host():
            updates, stored = host_update(plan, value)(to_host, state.inner, params_host)
            return plan.map(lambda lay, x: jax.device_put(
                x, plan.master_sharding(lay).with_memory_kind(DEVICE)), updates), stored

        def on_device():
            return lifted_update(plan, grads, jax.tree_util.tree_map(to_device_memory, state.inner), params, value)

        updates, stored = host_or_device(on_host, on_device, "zero_optimizer(offload_optimizer='cpu')", stacklevel=6)
        return updates, store(plan, stored)

    def update_fn(updates, state: ZeroOptState, params=None, value=None):
        if params is None:
            raise ConfigError("zero_optimizer.update needs params (the partition to update is cut from them)")
        plan = plan_for(params)
        _check_tree(plan, updates, "updates")
        grads = clip_gradients(config, split(plan, updates))  # padding adds zeros to the norm
        local_params = split(plan, params)
        if offload:
            new_updates, state = offloaded_update(plan, grads, state, local_params, value)
        else:
            new_updates, stored = device_update(plan, grads, state.inner, local_params, value)
            state = store(plan, stored)
        whole = C.gather_tree(plan, new_updates, plan.opt_partitioned)
        return whole, state

    # jit (inlined when the caller is already tracing) so the logical, possibly uneven
    # update layout only ever exists inside a compiled program
    jit_init = jax.jit(init_fn)
    jit_update = jax.jit(update_fn)

    def init(params):
        state = jit_init(params)
        if offload:
            # the jitted init returns host-memory leaves replicated (every device's share holding the
            # whole state) whatever the placement inside it: put them where the update stores them,
            # split over the data axis, so a caller's jitted step sees one layout from its first call
            state = store(plan_for(params), state.inner)
        return state

    def _value(extra_args):
        """The loss for an inner update that takes it (:func:`takes_value`); extra arguments are
        dropped for an inner optimizer without any, as optax's chain drops them."""
        if not isinstance(tx, optax.GradientTransformationExtraArgs):
            return None
        other = sorted(set(extra_args) - {"value"})
        if other:
            raise OptimizerError(
                f"zero_optimizer.update(..., {', '.join(f'{k}=' for k in other)}): the inner optimizer "
                f"({describe(tx)}) runs on each device's partition of the params, so a function of the params "
                "(a line search's value_fn, sam's grad_fn, Sophia's obj_fn) cannot be called from it; only value= "
                "(the loss) is passed on. Fix: pass only value=, or use an optimizer that needs no such argument")
        return extra_args.get("value") if takes_value(tx) else None

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ConfigError("zero_optimizer.update needs params (the partition to update is cut from them)")
        return jit_update(updates, state, params, _value(extra_args))

    return optax.GradientTransformationExtraArgs(init, update)
