"""The on-device step of stages 0–3: one jitted function with explicit collectives.

The gradient comes from :func:`zerojax.stages._gradients.grads_fn`; loss scaling, overflow
skipping, DeepSpeed's clipping coefficient and the optax update run on the partitioned
gradients, so each device updates only its 1/N of the optimizer state. With
``offload_optimizer="cpu"`` the update runs on the host inside the same program
(:mod:`zerojax.offload._host_update`); with ``offload_ratio`` < 1 (stage 3) only for the params
whose optimizer state the plan keeps in host memory, while the others are updated on the
device in the same step (:mod:`zerojax.offload._partial`); with ``fused_adam`` through the
Pallas kernel. A recognised ``optax.contrib.muon`` is updated on the device whatever the
state's home (:mod:`zerojax.stages._muon`): offloaded state is fetched and written back.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax._compat import compute_on_host, known_compile_options, lowered_on_cpu_as
from zerojax._contract import METRIC_KEYS, JittedStep
from zerojax.kernels._fused_update import fused_adamw_update
from zerojax._low_precision import update_key
from zerojax.offload._host_update import host_apply_fn, native_host_apply_fn
from zerojax.offload._partial import check_split
from zerojax._plan import DEVICE, ZeroPlan
from zerojax.stages._adam import adam_recipe
from zerojax.stages._gated import gated_update, plan_recipe
from zerojax.stages._gradients import grads_fn
from zerojax.stages._muon import muon_offloaded_update, muon_recipe, muon_update
from zerojax.stages._update import master_view, optax_update, params_from_master, takes_value
from zerojax._state import TrainState, state_shardings
from zerojax.update._pipeline import (
    check_gradients,
    host_or_device,
    learning_rate,
    next_loss_scale,
    step_metrics,
)


def _update_fn(loss_fn: Callable, plan: ZeroPlan, tx, has_aux: bool, fused_adam: bool = False,
               fused_block: int = 4096):
    cfg = plan.config
    fp16 = cfg.precision == "fp16"
    compute_grads = grads_fn(loss_fn, plan, has_aux, with_sumsq=True)
    homes = state_shardings(plan, tx)
    check_split(plan, tx)
    split = plan.partial_offload  # offload_ratio < 1: some params' state on the host, the rest here

    # optax.contrib.muon recognised: Newton–Schulz on whole matrices, one owner each (stages/_muon.py);
    # with offload_optimizer="cpu" its state stays in host memory and is fetched for the update
    muon = None if fused_adam else muon_recipe(plan, tx)
    host_apply = None
    # the native host kernel on CPU meshes, else the update under compute_on
    if plan.host_update and muon is None:
        host_apply = compute_on_host(host_apply_fn(plan, tx))
        native = native_host_apply_fn(plan, tx)
        if native is not None:  # a CPU-only custom call: the program lowered for a GPU keeps compute_on
            host_apply = lowered_on_cpu_as(native, host_apply)
    # Adam/AdamW, SGD momentum on fp32 states: one gated pass, no select over the state (stages/gated.py)
    recipe = adam_recipe(tx) if fused_adam else None
    gated = None if fused_adam else plan_recipe(plan, tx)

    def on_host(state, scaled, grads, scale, coef, skip, key, value):
        # ZeRO-Offload: the (still loss-scaled) gradients travel to the host in the compute
        # dtype, the host updates the fp32 master and moments and sends back compute-dtype
        # params, which the device then gathers (stages 1–2). With a split state only the
        # host side's leaves travel; the device side is updated here, in the same program.
        to_host = plan.map(lambda lay, g: jax.device_put(g.astype(plan.compute_dtype), plan.master_sharding(lay))
                           if plan.opt_on_host(lay) else None, scaled)
        master = master_view(plan, state)
        if not plan.has_master:  # fp32 or a bf16 master: the device's params are the master
            master = plan.map(lambda lay, x: jax.device_put(x, plan.master_sharding(lay)), master)
        host_master = placement.share(plan, master, True) if split else master
        host_opt = placement.opt_share(plan, state.opt_state, True) if split else state.opt_state
        new_params, new_master, opt_state = host_apply(to_host, host_master, host_opt, scale, coef, skip, key, value)
        new_params = plan.map(lambda lay, x: None if x is None else jax.device_put(
            x, plan.master_sharding(lay).with_memory_kind(DEVICE)), new_params)
        if split:
            dev_master, dev_opt = device_side(state, master, grads, coef, skip, key, value)
            new_params = placement.merge(plan, new_params, dev_master)
            new_master = placement.merge(plan, new_master, dev_master) if plan.has_master else None
            opt_state = placement.opt_merge(plan, state.opt_state, opt_state, dev_opt)
        return params_from_master(plan, new_params), new_master, opt_state

    def device_side(state, master, grads, coef, skip, key, value):
        # the device side of a split optimizer state: its master and moments never leave
        # device memory; the leaves no param owns (counts) are read from their home on the host
        master = placement.share(plan, master, False)
        opt_state = placement.fetch(placement.opt_share(plan, state.opt_state, False), homes.opt_state)
        grads = plan.map(lambda lay, g: None if plan.opt_on_host(lay) else g / coef, grads)
        new = optax_update(plan, tx, master, grads, opt_state, key, value)
        return jax.tree_util.tree_map(lambda o, n: jnp.where(skip, o, n), (master, opt_state), new)


    def muon_offloaded(state, grads, skip):
        # the Muon momentum is fetched and put back, the AdamW group's moments updated on the host
        params = placement.fetch(state.params, homes.params)
        master = state.master if plan.has_master else master_view(plan, state.replace(params=params))
        params_c, master, opt_state = muon_offloaded_update(plan, muon, tx, master, grads, state.opt_state, homes,
                                                            skip)
        return params_from_master(plan, params_c), master, opt_state

    def on_device(state, grads, skip, key, value):
        # offloaded state is fetched from host memory for the update and put back after it
        state = state.replace(params=placement.fetch(state.params, homes.params),
                              master=placement.fetch(state.master, homes.master),
                              opt_state=placement.fetch(state.opt_state, homes.opt_state))

        if gated is not None:
            master, opt_state = gated_update(gated, tx, master_view(plan, state), grads, state.opt_state, ~skip)
            return (params_from_master(plan, master), placement.put_back(master if plan.has_master else None, homes.master),
                    placement.put_back(opt_state, homes.opt_state))

        def apply(_):
            if fused_adam:
                params_c, master, opt_state = fused_adamw_update(plan, tx, recipe, master_view(plan, state),
                                                                 state.opt_state, grads, fused_block)
                return params_from_master(plan, params_c), (master if plan.has_master else None), opt_state
            if muon is not None:
                master, opt_state = muon_update(plan, muon, tx, master_view(plan, state), grads, state.opt_state, key)
                return params_from_master(plan, master), (master if plan.has_master else None), opt_state
            master, opt_state = optax_update(plan, tx, master_view(plan, state), grads, state.opt_state, key,
                                             value)
            return params_from_master(plan, master), (master if plan.has_master else None), opt_state

        # a select rather than lax.cond: it fuses into the update (on the CPU lax.cond copies
        # the whole state: 4.5x the step time of an optimizer-bound model)
        old = (state.params, state.master, state.opt_state)
        params, master, opt_state = jax.tree_util.tree_map(lambda o, n: jnp.where(skip, o, n), old, apply(None))
        return params, placement.put_back(master, homes.master), placement.put_back(opt_state, homes.opt_state)

    def train_step(state: TrainState, batch):
        scale = state.loss_scale.scale if fp16 else jnp.float32(1.0)
        rng = jax.random.fold_in(state.rng, state.step)
        key = update_key(rng)  # stochastic rounding of a bf16 master
        # offloaded stage-3 params stay in host memory: the gradient brings each to the device
        # where the loss first reads it (stages/_gradients.py), and the update fetches its own
        scaled, loss, sumsq = compute_grads(state.params, batch, scale, rng)
        checked = check_gradients(cfg, scaled, loss, scale if fp16 else None, sumsq)
        grads, coef, skip = checked.grads, checked.coef, checked.skip
        value = loss if takes_value(tx) else None  # reduce_on_plateau, polyak_sgd, momo read the loss
        def device():
            return on_device(state, jax.tree_util.tree_map(lambda g: g / coef, grads), skip, key, value)

        if muon is not None and plan.host_update:  # Muon's state in host memory, Newton–Schulz on owners
            done = muon_offloaded(state, jax.tree_util.tree_map(lambda g: g / coef, grads), skip)
        elif host_apply is not None:
            done = host_or_device(lambda: on_host(state, scaled, grads, scale, coef, skip, key, value), device,
                                  "offload_optimizer='cpu'")
        else:
            done = device()
        params, master, opt_state = done
        params = placement.put_back(params, homes.params)
        loss_scale = next_loss_scale(cfg, state.loss_scale, checked.finite)
        new_state = state.replace(step=state.step + 1, params=params, master=master, opt_state=opt_state,
                                  loss_scale=loss_scale)
        lr = jax.device_put(learning_rate(opt_state), NamedSharding(plan.mesh, P()))
        metrics = step_metrics(cfg, loss, checked, lr, scale, state.loss_scale, loss_scale)
        return new_state, metrics

    return train_step


class TrainStep(JittedStep):
    """The jitted on-device step (stages 0–3, optimizer offload to host memory, fused Adam):
    ``state, metrics = step(state, batch)``; ``step.lower(state, batch)``.

    Calling it checks the batch and the state against the plan first (clear errors instead
    of traces from inside jax) and raises on the host for errors the step reports:
    ``NonFiniteError`` (fp32) and ``LossScaleError`` (fp16 overflow at the minimum scale);
    the exception's ``.state`` holds the returned (unchanged) state, so nothing is lost.
    """


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


def combine_thresholds(plan: ZeroPlan) -> dict:
    """XLA:GPU's combiners merge independent collectives of a kind up to a threshold of their own
    (tens of MB by default), which undoes the step's buckets: at stage 3 the reduce-scatters of a
    backward pass became one at its end, holding every layer's gradient until then. Each combiner
    is bounded by the bucket the config gives it, in bytes of fp32 elements (DeepSpeed's bucket
    sizes count elements): ``reduce_bucket_size`` for reduce-scatters and all-reduces,
    ``prefetch_bucket_size`` (stage 3) or ``allgather_bucket_size`` for all-gathers. XLA measures
    a collective by its output, and a reduce-scatter's output is its input over the devices it
    scatters to: its threshold is the bucket's share of one device, so that the gradients it
    sends are at most one bucket (at ``n`` times the bucket, XLA:GPU merged two layers'
    reduce-scatters of a 12-layer GPT, holding both layers' gradients at once)."""
    c = plan.config
    gather = c.prefetch_bucket_size if c.stage == 3 else c.allgather_bucket_size
    return {"xla_gpu_reduce_scatter_combine_threshold_bytes": 4 * int(c.reduce_bucket_size) // max(1, plan.n),
            "xla_gpu_all_reduce_combine_threshold_bytes": 4 * int(c.reduce_bucket_size),
            "xla_gpu_all_gather_combine_threshold_bytes": 4 * int(gather)}


def compiler_options(plan: ZeroPlan, platform: str):
    """XLA options for ``platform``'s step (None where there are none): on a GPU, the collective
    combiners bounded by the config's buckets (:func:`combine_thresholds`) and, with
    ``overlap_comm``, the options that overlap collectives with compute."""
    if platform not in ("gpu", "cuda", "rocm"):
        return None
    options = combine_thresholds(plan)
    if plan.config.overlap:
        options.update(OVERLAP_OPTIONS["gpu"])
    return known_compile_options(options)


def build_device_step(loss_fn: Callable, state: TrainState, *, has_aux: bool = False, donate: bool = True,
                      check_errors: bool = True, fused_adam: bool = False, fused_block_size: int = 4096) -> TrainStep:
    """The jitted step for ``state``'s plan (see :func:`zerojax.make_train_step`)."""
    plan = state.plan
    fn = _update_fn(loss_fn, plan, state.tx, has_aux, fused_adam, fused_block_size)
    shardings = state.shardings
    batch_sharding = NamedSharding(plan.mesh, P(plan.data_axis))
    rep = NamedSharding(plan.mesh, P())
    metric_sh = {k: rep for k in METRIC_KEYS}
    options = compiler_options(plan, plan.mesh.devices.flat[0].platform)
    jitted = jax.jit(
        fn,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, metric_sh),
        donate_argnums=(0,) if donate else (),
        **({"compiler_options": options} if options else {}),
    )
    return TrainStep(jitted, plan, check_errors)
