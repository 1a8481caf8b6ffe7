"""make_train_step: one jitted ZeRO optimizer step with explicit collectives.

Inside a body that is manual over the data axis each device runs the user's loss on its
part of the batch, micro-batch by micro-batch (``lax.scan``). The gradient reduction is the
stage's:

    stage 0  local accumulation, one all-reduce per optimizer step           2Ψ
    stage 1  local accumulation, one reduce-scatter per optimizer step       Ψ
    stage 2  a reduce-scatter per micro-batch into the local partition       GAS·Ψ
    stage 3  params all-gathered per micro-batch; the gather's transpose is
             a reduce-scatter per micro-batch                                GAS·(Ψ + Ψ)

followed in stages 1–2 by one all-gather of the updated 16-bit params (Ψ). Loss scaling,
overflow skipping, DeepSpeed's clipping coefficient and the optax update run on the
partitioned gradients, so each device updates only its 1/N of the optimizer state.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._compat import compute_on_host, same_memory_space, shard_map, to_device_memory
from zerojax.plan import DEVICE, ZeroPlan
from zerojax.precision import LossScaleError, global_norm, tree_all_finite
from zerojax.stages import collectives as C
from zerojax.stages.stage3 import gathered_loss
from zerojax.state import TrainState, state_shardings

OK, NON_FINITE, SCALE_AT_MIN = 0, 1, 2


class HostUpdateWarning(UserWarning):
    """optimizer offload could not run this optimizer's update on the host (it runs on the device)."""


class NonFiniteError(FloatingPointError):
    """fp32 training met an inf/nan loss or gradient; the state was left unchanged."""


def find_hyperparams(opt_state):
    """The first ``optax.inject_hyperparams`` record (with a learning rate) in ``opt_state``, else None."""
    hp = getattr(opt_state, "hyperparams", None)
    if isinstance(hp, dict) and "learning_rate" in hp:
        return hp
    children = opt_state if isinstance(opt_state, (tuple, list)) else (
        opt_state.values() if isinstance(opt_state, dict) else ())
    return next((found for found in map(find_hyperparams, children) if found is not None), None)


def find_learning_rate(opt_state):
    """The learning rate recorded by ``optax.inject_hyperparams`` in ``opt_state``, else nan."""
    hp = find_hyperparams(opt_state)
    return jnp.float32(jnp.nan) if hp is None else jnp.asarray(hp["learning_rate"], jnp.float32)


def _loss_arity(loss_fn) -> int:
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return 3 if len(positional) >= 3 else 2


def grads_fn(loss_fn: Callable, plan: ZeroPlan, has_aux: bool = False):
    """The data-parallel gradient computation: (params, batch, scale, rng) -> (grads, loss).

    ``grads`` are the mean over the global batch of d(scale·loss)/d(params), laid out as
    ``plan.grad_shardings`` (partitioned from stage 1) and in float32.
    """
    cfg, n, axis = plan.config, plan.n, plan.data_axis
    gas = cfg.gradient_accumulation_steps
    cdt = plan.compute_dtype
    takes_rng = _loss_arity(loss_fn) >= 3
    f32 = jnp.float32
    stage3_loss = gathered_loss(loss_fn, plan, takes_rng) if any(lay.params_partitioned for lay in plan.leaves) else None

    def per_micro(lay):  # reduce this leaf's gradient after every micro-batch?
        return not lay.params_partitioned and plan.stage >= 2 and plan.grad_partitioned(lay)

    def reduce_some(tree, select):
        """Reduce-scatter the leaves ``select`` picks, in buckets of reduce_bucket_size."""
        return C.on_selected(plan, tree, select, lambda lays, xs: C.bucketed_reduce_scatter(
            xs, lays, axis, n, int(cfg.reduce_bucket_size)))

    def all_reduce_some(tree, select):
        return C.on_selected(plan, tree, select, lambda lays, xs: C.bucketed_all_reduce(
            xs, lays, axis, int(cfg.reduce_bucket_size)))

    def acc_shape(lay):
        if lay.params_partitioned or per_micro(lay):
            return C.local_shape(lay, n)
        return lay.shape

    def body(params, batch, scale, rng):
        mbs = jax.tree_util.tree_map(lambda x: x.reshape((gas, x.shape[0] // gas) + x.shape[1:]), batch)

        def loss_of(p, mb, key):
            if stage3_loss is not None:
                out = stage3_loss(p, mb, key)
            else:
                out = loss_fn(p, mb, key) if takes_rng else loss_fn(p, mb)
            loss = out[0] if has_aux else out
            return loss.astype(f32) * scale, loss.astype(f32)

        def micro(carry, xs):
            acc, loss_sum = carry
            mb, i = xs
            key = jax.random.fold_in(jax.random.fold_in(rng, jax.lax.axis_index(axis)), i)
            g, loss = jax.grad(loss_of, has_aux=True)(params, mb, key)
            g = jax.tree_util.tree_map(to_device_memory, g)  # offloaded params' gradients
            g = reduce_some(g, per_micro)
            acc = jax.tree_util.tree_map(lambda a, x: a + x.astype(f32), acc, g)
            return (acc, loss_sum + loss), None

        acc0 = plan.map(lambda lay: jnp.zeros(acc_shape(lay), f32))
        (acc, loss_sum), _ = jax.lax.scan(micro, (acc0, jnp.zeros((), f32)), (mbs, jnp.arange(gas)))

        def at_end_rs(lay):  # stage 1: one reduce-scatter per optimizer step
            return not lay.params_partitioned and not per_micro(lay) and plan.grad_partitioned(lay)

        def at_end_ar(lay):  # stage 0 (and leaves that cannot be split): one all-reduce
            return not lay.params_partitioned and not per_micro(lay) and not plan.grad_partitioned(lay)

        # communicate in the gradient dtype
        grads = plan.map(lambda lay, a: a.astype(cdt) if at_end_rs(lay) or at_end_ar(lay) else a, acc)
        grads = reduce_some(grads, at_end_rs)
        grads = all_reduce_some(grads, at_end_ar)
        grads = jax.tree_util.tree_map(lambda g: g.astype(f32), grads)
        denom = f32(n * gas)
        grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
        return grads, jax.lax.psum(loss_sum, axis) / denom

    param_specs = plan.map(lambda lay: lay.data_spec(lay.params_partitioned, axis))
    grad_specs = plan.map(lambda lay: lay.data_spec(plan.grad_partitioned(lay), axis))

    def run(params, batch, scale, rng):
        batch_specs = jax.tree_util.tree_map(lambda _: P(axis), batch)
        sm = shard_map(body, plan.mesh, in_specs=(param_specs, batch_specs, P(), P()),
                       out_specs=(grad_specs, P()), manual_axes={axis})
        return sm(params, batch, scale, rng)

    return run


def _split_not_stored_split(plan: ZeroPlan):
    return lambda lay: plan.opt_partitioned(lay) and not lay.params_partitioned


def master_view(plan: ZeroPlan, state: TrainState):
    """The fp32 master in partitioned storage. Under fp32 it is derived from the params:
    a partitioned leaf is this device's slice of the (whole) params, no communication."""
    if plan.has_master:
        return state.master
    return C.split_tree(plan, state.params, _split_not_stored_split(plan))


def params_from_master(plan: ZeroPlan, master):
    """Updated master (fp32, or already cast to the compute dtype) -> compute params in their
    storage layout. Leaves stored whole but updated in partitions are all-gathered once, in
    the compute dtype (the Ψ of stages 1–2)."""
    return C.gather_tree(plan, master, _split_not_stored_split(plan), dtype=plan.compute_dtype)


def clip_coefficient(norm, clip: float):
    """DeepSpeed's: max(1, (norm + 1e-6) / clip); gradients are divided by it."""
    if not clip:
        return jnp.float32(1.0)
    return jnp.maximum(jnp.float32(1.0), (norm + 1e-6) / clip)


def optax_update(plan: ZeroPlan, tx, master, grads, opt_state):
    """``tx`` on the user's logical shapes (padding stripped, split over the data axis) from
    partitioned storage and back: ``(master, opt_state)`` updated, in storage layout."""
    current = plan.to_update(master)
    updates, opt_state = tx.update(plan.to_update(grads), plan.opt_to_update(opt_state), current)
    return plan.to_storage(optax.apply_updates(current, updates)), plan.opt_to_storage(opt_state)


def _host_apply_fn(plan: ZeroPlan, tx):
    """The optimizer update as it runs on the host (``compute_on``): compute-dtype, loss-scaled
    gradients and the fp32 master/optimizer state in -> compute-dtype params, master, state out."""
    f32 = jnp.float32

    def host_apply(grads, master, opt_state, scale, coef, skip):
        grads = jax.tree_util.tree_map(lambda g: g.astype(f32) / scale / coef, grads)
        new_master, new_opt = optax_update(plan, tx, master, grads, opt_state)
        keep = functools.partial(jax.tree_util.tree_map, lambda o, n: jnp.where(skip, o, same_memory_space(n, o)))
        new_master, new_opt = keep(master, new_master), keep(opt_state, new_opt)
        new_params = jax.tree_util.tree_map(lambda x: x.astype(plan.compute_dtype), new_master)
        return new_params, (new_master if plan.has_master else None), new_opt

    return host_apply


def _adam_node(opt_state):
    """The ScaleByAdamState inside an ``inject_hyperparams(optax.adamw)`` state, else None."""
    hp = getattr(opt_state, "hyperparams", None)
    inner = getattr(opt_state, "inner_state", None)
    if not isinstance(hp, dict) or not {"learning_rate", "b1", "b2", "eps", "weight_decay"} <= set(hp):
        return None
    if not isinstance(inner, tuple) or not inner or not isinstance(inner[0], optax.ScaleByAdamState):
        return None
    if any(not isinstance(x, optax.EmptyState) for x in inner[1:]):
        return None
    return inner[0]


def _fused_adam_ok(opt_state) -> bool:
    """Whether the fused kernel computes this optimizer's update (eps_root must be 0)."""
    if _adam_node(opt_state) is None:
        return False
    eps_root = opt_state.hyperparams.get("eps_root", 0.0)
    try:
        return float(eps_root) == 0.0
    except TypeError:  # abstract state (planning): the structure is what counts
        return True


def fused_adamw_update(plan: ZeroPlan, tx, master, opt_state, grads, block_size: int = 4096):
    """AdamW through the Pallas kernel (``zerojax.offload.fused_adamw``): one pass per leaf over
    this device's partition of the fp32 master, both moments and the gradient, in storage
    layout (padding stays zero), writing the compute-dtype params in the same pass.
    Returns ``(params_c, master, opt_state)``; the state's counts and hyperparameters (a
    schedule's next value) come from running ``tx`` on a scalar-sized copy of the state."""
    from zerojax.offload.fused_adam import fused_adamw

    adam = _adam_node(opt_state)
    axis = plan.data_axis
    # counts, hyperparameters and schedules advance exactly as optax's would, on scalars
    zeros = plan.map(lambda lay: jnp.zeros((), jnp.float32))
    tiny = opt_state._replace(inner_state=(adam._replace(mu=zeros, nu=zeros),) + tuple(opt_state.inner_state[1:]))
    _, new_tiny = tx.update(zeros, tiny, zeros)
    hp = new_tiny.hyperparams  # the values used for this step
    count = adam.count + 1
    specs = plan.map(lambda lay: lay.data_spec(plan.opt_partitioned(lay), axis))
    cdt = plan.compute_dtype
    interpret = plan.mesh.devices.flat[0].platform == "cpu"

    def body(p, m, v, g):
        def one(p, m, v, g):
            shape = p.shape
            out = fused_adamw(p.reshape(-1), m.reshape(-1), v.reshape(-1), g.reshape(-1), count,
                              hp["learning_rate"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"],
                              out_dtype=cdt, block_size=block_size, interpret=interpret)
            return tuple(x.reshape(shape) for x in out)

        flat = [plan.treedef.flatten_up_to(t) for t in (p, m, v, g)]
        outs = [one(*xs) for xs in zip(*flat)]
        return tuple(plan.treedef.unflatten([o[i] for o in outs]) for i in range(4))

    sm = shard_map(body, plan.mesh, in_specs=(specs,) * 4, out_specs=(specs,) * 4, manual_axes={axis})
    master, mu, nu, params_c = sm(master, adam.mu, adam.nu, grads)
    new_adam = new_tiny.inner_state[0]._replace(mu=mu, nu=nu)
    new_state = new_tiny._replace(inner_state=(new_adam,) + tuple(new_tiny.inner_state[1:]))
    return params_c, master, new_state


def _update_fn(loss_fn: Callable, plan: ZeroPlan, tx, has_aux: bool, fused_adam: bool = False,
               fused_block: int = 4096):
    cfg = plan.config
    scaler = cfg.loss_scaler
    fp16 = cfg.precision == "fp16"
    compute_grads = grads_fn(loss_fn, plan, has_aux)
    homes = state_shardings(plan, tx)

    host_apply = compute_on_host(_host_apply_fn(plan, tx)) if plan.host_update else None

    def on_host(state, scaled, scale, coef, skip):
        # ZeRO-Offload: the (still loss-scaled) gradients travel to the host in the compute
        # dtype, the host updates the fp32 master and moments and sends back compute-dtype
        # params, which the device then gathers (stages 1–2).
        to_host = plan.map(lambda lay, g: jax.device_put(g.astype(plan.compute_dtype), plan.master_sharding(lay)),
                           scaled)
        master = master_view(plan, state)
        if not plan.has_master:  # fp32: the device's params are the master
            master = plan.map(lambda lay, x: jax.device_put(x, plan.master_sharding(lay)), master)
        new_params, master, opt_state = host_apply(to_host, master, state.opt_state, scale, coef, skip)
        new_params = plan.map(lambda lay, x: jax.device_put(x, plan.master_sharding(lay).with_memory_kind(DEVICE)),
                              new_params)
        return params_from_master(plan, new_params), master, opt_state


    def on_device(state, grads, skip):
        # offloaded state is fetched from host memory for the update and put back after it
        state = state.replace(params=plan.fetch(state.params, homes.params),
                              master=plan.fetch(state.master, homes.master),
                              opt_state=plan.fetch(state.opt_state, homes.opt_state))

        def apply(_):
            if fused_adam:
                params_c, master, opt_state = fused_adamw_update(plan, tx, master_view(plan, state),
                                                                 state.opt_state, grads, fused_block)
                return params_from_master(plan, params_c), (master if plan.has_master else None), opt_state
            master, opt_state = optax_update(plan, tx, master_view(plan, state), grads, state.opt_state)
            return params_from_master(plan, master), (master if plan.has_master else None), opt_state

        # a select rather than lax.cond: it fuses into the update, which then writes the
        # donated buffers in place instead of keeping old and new state alive side by side
        old = (state.params, state.master, state.opt_state)
        params, master, opt_state = jax.tree_util.tree_map(lambda o, n: jnp.where(skip, o, n), old, apply(None))
        return params, plan.put_back(master, homes.master), plan.put_back(opt_state, homes.opt_state)

    def train_step(state: TrainState, batch):
        scale = state.loss_scale.scale if fp16 else jnp.float32(1.0)
        rng = jax.random.fold_in(state.rng, state.step)
        # offloaded stage-3 params stay in host memory: each shard is brought to the device
        # just before its gather, layer by layer; the rest are fetched now
        state = state.replace(params=plan.map(
            lambda lay, x, s: x if lay.params_partitioned else plan.fetch(x, s), state.params, homes.params))
        scaled, loss = compute_grads(state.params, batch, scale, rng)
        grads = jax.tree_util.tree_map(lambda g: g / scale, scaled)
        finite = tree_all_finite(grads) & jnp.isfinite(loss)
        norm = global_norm(grads)
        coef = clip_coefficient(norm, cfg.gradient_clipping)
        skip = ~finite
        if cfg.precision == "bf16" and not cfg.check_grad_overflow:
            skip = jnp.asarray(False)
        done = None
        if host_apply is not None:
            try:
                done = on_host(state, scaled, scale, coef, skip)
            except ValueError as e:  # raised while tracing, before anything runs
                if "memory_space" not in str(e):
                    raise
                warnings.warn(
                    f"offload_optimizer='cpu': this optimizer's update cannot be traced for the host ({e}); "
                    "its state stays in host memory between steps and is updated on the device instead. "
                    "optax.adam/adamw/sgd/lion (and the DeepSpeed Adam/AdamW configs) update on the host.",
                    HostUpdateWarning, stacklevel=2)
        if done is None:
            done = on_device(state, jax.tree_util.tree_map(lambda g: g / coef, grads), skip)
        params, master, opt_state = done
        params = plan.put_back(params, homes.params)
        loss_scale = scaler.update(state.loss_scale, ~finite) if fp16 else state.loss_scale
        error = jnp.int32(OK)
        if fp16:
            error = jnp.where(loss_scale.at_minimum & ~state.loss_scale.at_minimum, SCALE_AT_MIN, OK)
        elif cfg.precision == "fp32":
            error = jnp.where(finite, OK, NON_FINITE)
        new_state = state.replace(step=state.step + 1, params=params, master=master, opt_state=opt_state,
                                  loss_scale=loss_scale)
        metrics = {
            "loss": loss,
            "grad_norm": norm,
            "learning_rate": jax.device_put(find_learning_rate(opt_state), NamedSharding(plan.mesh, P())),
            "loss_scale": scale,
            "skipped": skip,
            "error": error,
        }
        return new_state, metrics

    return train_step


class TrainStep:
    """A jitted ZeRO step: ``state, metrics = step(state, batch)``; ``step.lower(state, batch)``.

    Calling it checks the batch and the state against the plan first (clear errors instead
    of traces from inside jax) and raises on the host for errors the step reports:
    ``NonFiniteError`` (fp32) and ``LossScaleError`` (fp16 overflow at the minimum scale);
    the exception's ``.state`` holds the returned (unchanged) state, so nothing is lost.
    """

    def __init__(self, jitted, plan: ZeroPlan, check_errors: bool = True):
        self.jitted = jitted
        self.plan = plan
        self.check_errors = check_errors

    def lower(self, state, batch):
        return self.jitted.lower(state, batch)

    def __call__(self, state: TrainState, batch):
        check_state(self.plan, state)
        check_batch(self.plan, batch)
        new_state, metrics = self.jitted(state, batch)  # ``state`` is donated: read only new_state now
        if self.check_errors:
            at = int(new_state.step) - 1
            code = int(metrics["error"])
            if code == NON_FINITE:
                err = NonFiniteError(
                    f"step {at}: the loss or a gradient is inf/nan under precision='fp32' "
                    f"(loss={float(metrics['loss'])}); the update was skipped and the state is unchanged "
                    "(see .state). Check the inputs, lower the learning rate or set gradient_clipping."
                )
                err.state = new_state
                raise err
            if code == SCALE_AT_MIN:
                err = LossScaleError(
                    f"step {at}: fp16 gradients overflowed with the loss scale already at its "
                    f"minimum ({self.plan.config.min_loss_scale}); DeepSpeed stops here too. Lower the "
                    "learning rate, lower min_loss_scale, or train in bf16. The state is in .state."
                )
                err.state = new_state
                raise err
        return new_state, metrics


def check_batch(plan: ZeroPlan, batch) -> None:
    need = plan.n * plan.config.gradient_accumulation_steps
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", ())
        if len(shape) == 0 or shape[0] % need:
            from zerojax.plan import path_str

            raise ValueError(
                f"batch leaf {path_str(path) or '<root>'!r} has leading dimension {shape[0] if shape else 'none'}, "
                f"which must be a multiple of data devices x gradient_accumulation_steps = {plan.n} x "
                f"{plan.config.gradient_accumulation_steps} = {need}. Pad or resize the global batch."
            )


def check_state(plan: ZeroPlan, state) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"expected a zerojax TrainState (from zj.shard_train_state), got {type(state).__name__}")
    if state.plan is not plan:
        raise ValueError("this step was made for another state's plan; build it with zj.make_train_step(loss_fn, state)")
    got = jax.tree_util.tree_structure(state.params)
    if got != plan.treedef:
        raise ValueError(
            "state.params no longer matches the plan's params tree: "
            f"expected {plan.treedef}, got {got}. Rebuild the state with zj.shard_train_state."
        )
    bad = []
    for lay, x in zip(plan.leaves, plan.treedef.flatten_up_to(state.params)):
        want = lay.storage_shape if lay.params_partitioned else lay.shape
        if tuple(x.shape) != want:
            bad.append(f"{lay.path}: shape {tuple(x.shape)}, expected {want}")
    if bad:
        raise ValueError("state.params leaves do not match the plan:\n  " + "\n  ".join(bad))


# XLA options that let collectives run asynchronously and overlap the compute around them
# (the GPU backend's latency-hiding scheduler, and loop pipelining that issues the next
# iteration's all-gather / reduce-scatter during the current one: prefetch across layers).
OVERLAP_OPTIONS = {
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
    },
}


def compiler_options(plan: ZeroPlan, platform: str):
    """XLA options for ``overlap_comm`` on ``platform`` (None where collectives are synchronous)."""
    if not plan.config.overlap:
        return None
    return OVERLAP_OPTIONS.get(platform)


def make_train_step(loss_fn: Callable, state: TrainState, *, has_aux: bool = False, donate: bool = True,
                    check_errors: bool = True, fused_adam: bool = False,
                    fused_block_size: int = 4096) -> TrainStep:
    """Build the jitted step for ``state``'s plan.

    ``loss_fn(params, batch) -> loss`` (or ``loss_fn(params, batch, rng)``, given a key unique
    to the step, device and micro-batch). The batch's leading dimension is the global batch:
    data devices x gradient_accumulation_steps x micro-batch. The state is donated.

        step = zj.make_train_step(loss_fn, state)
        state, metrics = step(state, batch)

    ``fused_adam``: update with the Pallas AdamW kernel (one in-place pass per leaf over the
    master, both moments and the gradient, writing the 16-bit params too) instead of optax's
    separate loops; needs ``optax.inject_hyperparams(optax.adamw)``. Off by default; on CPU it
    runs in interpret mode (for tests), on GPU through Triton.
    """
    plan = state.plan
    if plan.config.zenflow:
        from zerojax.zenflow import ZenFlowStep

        return ZenFlowStep(loss_fn, state, has_aux)
    if plan.config.offload_optimizer == "nvme":
        from zerojax.offload.engine import HostLoopStep

        return HostLoopStep(loss_fn, state, has_aux, store="nvme", check_errors=check_errors)
    # opt-in until the kernel's Triton lowering is measured inside the step on a GPU
    if fused_adam and not _fused_adam_ok(state.opt_state):
        raise ValueError("fused_adam=True needs tx=optax.inject_hyperparams(optax.adamw)(...) with no mask and "
                         "eps_root=0: the fused kernel updates AdamW's moments in place.")
    fn = _update_fn(loss_fn, plan, state.tx, has_aux, fused_adam, fused_block_size)
    shardings = state.shardings
    batch_sharding = NamedSharding(plan.mesh, P(plan.data_axis))
    rep = NamedSharding(plan.mesh, P())
    metric_sh = {k: rep for k in ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped", "error")}
    options = compiler_options(plan, plan.mesh.devices.flat[0].platform)
    jitted = jax.jit(
        fn,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, metric_sh),
        donate_argnums=(0,) if donate else (),
        **({"compiler_options": options} if options else {}),
    )
    return TrainStep(jitted, plan, check_errors)
