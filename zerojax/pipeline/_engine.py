"""The step of a PipelineModel: pipelined gradients, then the update every on-device path runs.

    step = zj.make_train_step(pipe, state)     # state's mesh has a "pipe" axis
    state, metrics = step(state, batch)

The gradients come from :func:`zerojax.pipeline._grads.pipeline_grads_fn`, already in the
optimizer's partitions (layers over "pipe", ZeRO partitions over the data axis). The rest is
the shared update: the loss scale removed, one global norm over every stage's gradients
(:func:`zerojax.update._pipeline.check_gradients` on the sharded arrays: XLA sums over "pipe" and
data), DeepSpeed's clipping coefficient, the overflow skip, ``optax_update`` on each
device's partition, the 16-bit params gathered back over data, and the loss scaler.
Metrics: :data:`zerojax._contract.METRIC_KEYS` plus ``pipeline_idle``, the share of the
stages' time the executed schedule left idle, from the forwards and backwards each stage
counted at each tick (ticks in lockstep, a forward and a backward of equal cost).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._contract import METRIC_KEYS, JittedStep
from zerojax._errors import ConfigError, StepOptionError
from zerojax._low_precision import update_key
from zerojax.pipeline._grads import pipeline_grads_fn
from zerojax.pipeline._model import PipelineModel, check_params
from zerojax.pipeline._schedule import make_schedule
from zerojax._plan import PIPE, ZeroPlan
from zerojax.stages._update import master_view, optax_update, params_from_master, takes_value
from zerojax.update._pipeline import check_gradients, learning_rate, next_loss_scale, step_metrics
from zerojax._state import TrainState

__all__ = ["PipelineStep", "make_pipeline_step"]

PIPELINE_METRICS = METRIC_KEYS + ("pipeline_idle",)


def _check(model: PipelineModel, plan: ZeroPlan, options: dict) -> None:
    cfg = plan.config
    if PIPE not in plan.mesh.axis_names:
        raise ConfigError(f"a PipelineModel trains on a mesh with a {PIPE!r} axis, but this state's mesh has "
                          f"{plan.mesh.axis_names}. Fix: zj.make_mesh((P, D), ('{PIPE}', '{cfg.data_axis}')) "
                          "(P = 1 for no pipeline), then zj.shard_train_state on it")
    given = {k: v for k, v in options.items() if v}
    if given:
        named = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise StepOptionError(f"make_train_step(PipelineModel, ...): {named} is not supported by the "
                              "pipeline step. Fix: drop it")
    for what, on in (("offload_optimizer", cfg.offload_optimizer), ("offload_param", cfg.offload_param),
                     ("zenflow", cfg.zenflow)):
        if on:
            raise StepOptionError(f"ZeroConfig.{what}={on!r}: the pipeline step keeps every state in device memory. "
                                  f"Fix: drop {what}, or train without a PipelineModel")
    if cfg.master_weights_dtype is not None or cfg.optimizer_state_dtype is not None:
        raise StepOptionError("ZeroConfig.master_weights_dtype / optimizer_state_dtype: the pipeline step keeps "
                              "an fp32 master and fp32 optimizer state. Fix: drop them")
    layers = plan.treedef.flatten_up_to(plan.layouts)
    block_layers = {lay.shape[0] for lay in layers if lay.path.split("/")[0] == "blocks"}
    per_stage = next(iter(block_layers)) // plan.mesh.shape[PIPE]
    k = model.activation_checkpoint_interval
    if k and per_stage % k:
        raise ConfigError(f"activation_checkpoint_interval={k} does not divide the {per_stage} layers of each of "
                          f"the {plan.mesh.shape[PIPE]} pipeline stages. Fix: use a divisor of {per_stage}, or 0")


def lockstep_idle(ran):
    """The idle share of the stages' time from what they ran (i32[P, ticks, 2]), ticks in
    lockstep and a forward costing what a backward does (:func:`zerojax.pipeline._schedule.idle_fraction`)."""
    work = jnp.sum(ran, axis=-1).astype(jnp.float32)  # [P, ticks]
    return 1.0 - jnp.sum(work) / (jnp.sum(jnp.max(work, axis=0)) * work.shape[0])


def _step_fn(model: PipelineModel, plan: ZeroPlan, tx):
    cfg = plan.config
    fp16 = cfg.precision == "fp16"
    schedule = make_schedule(model.schedule, plan.mesh.shape[PIPE], cfg.gradient_accumulation_steps)
    grads_of = pipeline_grads_fn(model, plan, schedule)

    def train_step(state: TrainState, batch):
        scale = state.loss_scale.scale if fp16 else jnp.float32(1.0)
        key = update_key(jax.random.fold_in(state.rng, state.step))
        scaled, loss, ran = grads_of(state.params, batch, scale)
        checked = check_gradients(cfg, scaled, loss, scale)
        value = loss if takes_value(tx) else None
        master, opt_state = optax_update(plan, tx, master_view(plan, state),
                                         jax.tree_util.tree_map(lambda g: g / checked.coef, checked.grads),
                                         state.opt_state, key, value)
        new = (params_from_master(plan, master), master if plan.has_master else None, opt_state)
        old = (state.params, state.master, state.opt_state)
        params, master, opt_state = jax.tree_util.tree_map(lambda o, x: jnp.where(checked.skip, o, x), old, new)
        loss_scale = next_loss_scale(cfg, state.loss_scale, checked.finite)
        new_state = state.replace(step=state.step + 1, params=params, master=master, opt_state=opt_state,
                                  loss_scale=loss_scale)
        lr = jax.device_put(learning_rate(opt_state), NamedSharding(plan.mesh, P()))
        metrics = step_metrics(cfg, loss, checked, lr, scale, state.loss_scale, loss_scale,
                               pipeline_idle=lockstep_idle(ran))
        return new_state, metrics

    return train_step, schedule


class PipelineStep(JittedStep):
    """The jitted pipeline step (:class:`zerojax._contract.Step`): ``state, metrics = step(state, batch)``.
    ``schedule`` is the table it runs (:class:`zerojax.pipeline._schedule.Schedule`)."""

    def __init__(self, jitted, plan: ZeroPlan, schedule, check_errors: bool = True):
        super().__init__(jitted, plan, check_errors)
        self.schedule = schedule


def make_pipeline_step(model: PipelineModel, state: TrainState, *, donate: bool = True, check_errors: bool = True,
                       **options) -> PipelineStep:
    """The step of ``model`` for ``state`` (see :func:`zerojax.make_train_step`). ``options``: the
    other paths' options (has_aux, fused_adam, ...), refused by name when set."""
    plan = state.plan
    check_params(plan.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype)))
    _check(model, plan, options)
    fn, schedule = _step_fn(model, plan, state.tx)
    rep = NamedSharding(plan.mesh, P())
    jitted = jax.jit(fn, in_shardings=(state.shardings, NamedSharding(plan.mesh, P(plan.data_axis))),
                     out_shardings=(state.shardings, {k: rep for k in PIPELINE_METRICS}),
                     donate_argnums=(0,) if donate else ())
    return PipelineStep(jitted, plan, schedule, check_errors)
