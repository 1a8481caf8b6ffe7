"""initialize: a DeepSpeed config and a model in, a sharded state and a jitted step out.

The counterpart of ``deepspeed.initialize``::

    state, step = zj.initialize(init_fn, loss_fn, "ds_config.json",
                                training_args=zj.TrainingArgs(per_device_train_batch_size=4, bf16=True,
                                                              max_steps=1000, warmup_steps=100))
    for batch in batches:                 # each batch: train_batch_size samples (the global batch)
        state, metrics = step(state, batch)

Where DeepSpeed returns an engine, zerojax returns data and a function: ``state`` (a
:class:`~zerojax._state.TrainState`) holds params, optimizer state and loss scaler; ``step`` runs
one optimizer step on a *global* batch, i.e. ``train_batch_size`` = micro batch x
gradient_accumulation_steps x data devices samples, and splits it over devices and micro-batches
itself.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from zerojax.config import ZeroConfig
from zerojax.config._deepspeed import optimizer_from_config, resolve_batch
from zerojax.config._schedules import from_deepspeed as schedule_from_deepspeed
from zerojax._contract import Step, StepWrapper
from zerojax._errors import ConfigError
from zerojax._autotp import mesh_for
from zerojax.monitor import Monitors, monitors_for
from zerojax._plan import ZeroPlan, path_str
from zerojax._state import TrainState, shard_train_state
from zerojax._step import make_train_step

__all__ = ["GlobalBatchStep", "check_global_batch", "initialize", "linear_schedule_with_warmup"]

_NO_OPTIMIZER = (
    "The config has no optimizer block and no training_args were given, so there is no optimizer to "
    'build. Fix: add an "optimizer" block to the config, e.g. "optimizer": {"type": "AdamW", "params": '
    '{"lr": 3e-4, "weight_decay": 0.01}}, or pass training_args=zj.TrainingArgs(learning_rate=...) '
    "(Hugging Face's AdamW), or pass your own optax optimizer as optimizer=."
)


class GlobalBatchStep(StepWrapper):
    """Any :class:`~zerojax._contract.Step` (whatever path the config chose) that also checks
    each batch holds ``train_batch_size`` samples, the global batch the config describes,
    before running. Every other attribute is the wrapped step's (``.plan``, ``.jitted`` on the
    device path, ``.end_epoch()`` on ZenFlow, ``.master()`` on NVMe)."""

    def __init__(self, step: Step, train_batch_size: Optional[int]):
        self.step = step
        self.train_batch_size = train_batch_size

    @classmethod
    def wrap(cls, step: Step, train_batch_size: Optional[int]) -> "GlobalBatchStep":
        return cls(step, train_batch_size)

    @property
    def plan(self) -> ZeroPlan:
        return self.step.plan

    def __call__(self, state: TrainState, batch):
        check_global_batch(self.plan, self.train_batch_size, batch)
        return self.step(state, batch)

    def lower(self, state, batch):
        check_global_batch(self.plan, self.train_batch_size, batch)
        return self.step.lower(state, batch)



def check_global_batch(plan: ZeroPlan, train_batch_size: Optional[int], batch) -> None:
    """Raise a ValueError naming the leaf unless every batch leaf has ``train_batch_size`` rows."""
    if train_batch_size is None:
        return
    cfg = plan.config
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(getattr(x, "shape", ()))
        if shape and shape[0] == train_batch_size:
            continue
        got = f"leading dimension {shape[0]}" if shape else "no leading dimension"
        raise ConfigError(
            f"batch leaf {path_str(path) or '<root>'!r} has {got}, but the step takes the global batch of "
            f"train_batch_size = {train_batch_size} samples (train_micro_batch_size_per_gpu "
            f"{cfg.train_micro_batch_size_per_gpu} x gradient_accumulation_steps "
            f"{cfg.gradient_accumulation_steps} x {plan.n} data devices). Fix: pass batches whose leading "
            f"dimension is {train_batch_size}, or change the batch keys of the config."
        )


# --------------------------------------------------------------------------- config
def _data_size(mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise ConfigError(f"the mesh has axes {tuple(mesh.axis_names)} but no data axis {axis!r}, which ZeRO "
                         f"partitions over. Fix: build it with zj.make_mesh(...) or name one axis {axis!r}")
    return int(mesh.shape[axis])


def _resolve_config(config, mesh, training_args, hidden_size) -> ZeroConfig:
    if isinstance(config, ZeroConfig):
        return _check_batch_keys(config, _data_size(mesh, config.data_axis))
    if isinstance(config, (dict, str, os.PathLike)):
        world = _data_size(mesh, ZeroConfig.data_axis)
        return ZeroConfig.from_deepspeed(config, training_args=training_args, world_size=world,
                                         hidden_size=hidden_size)
    raise ConfigError(f"config must be a ZeroConfig, a dict or the path of a DeepSpeed JSON file, "
                    f"got {type(config).__name__}")


def _check_batch_keys(config: ZeroConfig, world: int) -> ZeroConfig:
    """A ZeroConfig built by hand or for another mesh: apply DeepSpeed's batch rule at ``world``."""
    tb, mb = config.train_batch_size, config.train_micro_batch_size_per_gpu
    if tb is None and mb is None:
        return config
    try:
        tb, mb, gas = resolve_batch(tb, mb, config.gradient_accumulation_steps, world)
    except ConfigError as e:
        raise ConfigError(f"{e}\n(the mesh's data axis {config.data_axis!r} has {world} devices; a config "
                          "resolved with from_deepspeed for another world_size needs resolving again)") from None
    return config.replace(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas)


# --------------------------------------------------------------------------- optimizer
def _arg(args, name: str):
    if not hasattr(args, name):
        raise ConfigError(f"training_args has no attribute {name!r}, which the AdamW built from the training "
                          "arguments needs. Fix: pass zj.TrainingArgs(...) or add the attribute")
    return getattr(args, name)


def linear_schedule_with_warmup(learning_rate: float, warmup_steps: int, max_steps: int) -> Callable:
    """Hugging Face's default ("linear") schedule as a function of the applied-step count:
    ``lr * count / warmup`` during warmup, then linear decay to 0 at ``max_steps``
    (constant ``lr`` after warmup when ``max_steps <= 0``)."""

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        warm = c / max(1, warmup_steps)
        after = jnp.maximum(0.0, (max_steps - c) / max(1, max_steps - warmup_steps)) if max_steps > 0 else 1.0
        return learning_rate * jnp.where(c < warmup_steps, warm, after)

    return schedule


def _adamw_from_training_args(args, scheduler: Optional[dict]) -> optax.GradientTransformation:
    """Hugging Face's default optimizer: AdamW from learning_rate, adam_beta1/2, adam_epsilon,
    weight_decay; the config's scheduler block when there is one, else the linear schedule."""
    lr = float(_arg(args, "learning_rate"))
    if scheduler is not None:
        schedule = schedule_from_deepspeed(scheduler, lr)
    else:
        max_steps = int(_arg(args, "max_steps"))
        warmup = int(_arg(args, "warmup_steps"))
        ratio = float(_arg(args, "warmup_ratio"))
        if warmup <= 0 and ratio > 0:
            if max_steps <= 0:
                raise ConfigError(f"training_args.warmup_ratio={ratio} needs max_steps to count the warmup "
                                  "steps. Fix: pass max_steps=N or warmup_steps=N")
            warmup = math.ceil(max_steps * ratio)
        schedule = linear_schedule_with_warmup(lr, warmup, max_steps)
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, b1=float(_arg(args, "adam_beta1")), b2=float(_arg(args, "adam_beta2")),
        eps=float(_arg(args, "adam_epsilon")), weight_decay=float(_arg(args, "weight_decay")))


def _optimizer(config: ZeroConfig, training_args, optimizer, muon_params=None) -> optax.GradientTransformation:
    if muon_params is not None and (optimizer is not None or config.optimizer is None):
        raise ConfigError("muon_params= chooses the Muon leaves of the config's \"type\": \"Muon\" optimizer. "
                          "Fix: drop it, or pass optax.contrib.muon(..., muon_weight_dimension_numbers=...) as "
                          "optimizer=")
    if optimizer is not None:
        if config.optimizer is not None:
            raise ConfigError("an optimizer was passed and the config has an optimizer block too. Fix: remove "
                              'the "optimizer" block or do not pass optimizer=')
        if config.scheduler is not None:
            raise ConfigError("the config's scheduler block cannot drive an optimizer passed as optimizer=. "
                              "Fix: build the schedule into it, e.g. optax.adamw(zerojax.config._schedules."
                              "from_deepspeed(block, base_lr)), and remove the \"scheduler\" block")
        return optimizer
    if config.optimizer is not None:
        return optimizer_from_config(config, muon_params)
    if training_args is None:
        raise ConfigError(_NO_OPTIMIZER)
    return _adamw_from_training_args(training_args, config.scheduler)


# --------------------------------------------------------------------------- entry point
def initialize(
    params_or_init_fn: Union[Any, Callable[[jax.Array], Any]],
    loss_fn: Callable,
    config: Union[ZeroConfig, dict, str, os.PathLike],
    mesh=None,
    training_args=None,
    hidden_size: Optional[int] = None,
    rng: Optional[jax.Array] = None,
    *,
    optimizer: Optional[optax.GradientTransformation] = None,
    param_specs=None,
    has_aux: bool = False,
    donate: bool = True,
    check_errors: bool = True,
    fused_adam: bool = False,
    monitors: Optional[Monitors] = None,
    muon_params: Optional[Callable[[str, tuple], bool]] = None,
) -> tuple[TrainState, GlobalBatchStep]:
    """Build ``(state, step)`` from a config, ready to train.

    ``config`` is a :class:`ZeroConfig`, a DeepSpeed config dict, or the path of a DeepSpeed
    JSON file; a dict or path is read with ``ZeroConfig.from_deepspeed(config, training_args,
    world_size=<size of the mesh's data axis>, hidden_size)``, so "auto" values are filled from
    ``training_args`` (:class:`~zerojax.config._deepspeed.TrainingArgs` or any object with those fields).
    ``mesh`` defaults to ``zj.make_mesh()`` (every device on the data axis), or with
    ``autotp_size`` N > 1 (``"tensor_parallel": {"autotp_size": N}``) to a ``("data", "model")``
    mesh of world / N x N (:mod:`zerojax._autotp`); a given mesh must then have a "model" axis of N.

    The optimizer, first match wins:

    1. ``optimizer=`` (any optax transformation; the config must then have no optimizer or
       scheduler block);
    2. the config's optimizer block, via :func:`~zerojax.config._deepspeed.optimizer_from_config`
       (with its scheduler block);
    3. ``training_args``: Hugging Face's AdamW (``learning_rate``, ``adam_beta1/2``,
       ``adam_epsilon``, ``weight_decay``; unlike Hugging Face's Trainer, weight decay applies to
       every leaf, biases and norms included). The lr follows the config's scheduler block if
       any, else Hugging Face's linear schedule: warmup from 0 over ``warmup_steps`` (or
       ``ceil(warmup_ratio * max_steps)``), then linear decay to 0 at ``max_steps`` (constant
       when ``max_steps <= 0``);
    4. otherwise a ConfigError saying to add an "optimizer" block or pass training_args.

    With ``"type": "Muon"``, ``muon_params(path, shape) -> bool`` chooses the leaves Muon
    updates (default :func:`zerojax.config._optimizers.muon_rule`: 2 or more dims, no
    embedding or head in the path); the others get AdamW. ``state.plan.describe()`` shows
    each leaf's choice.

    ``params_or_init_fn``, ``rng`` and ``param_specs`` are passed to
    :func:`~zerojax._state.shard_train_state`; ``loss_fn``, ``has_aux``, ``donate``,
    ``check_errors`` and ``fused_adam`` to :func:`~zerojax._step.make_train_step`, which picks the
    update path from the config (on device, offload, NVMe, ZenFlow). The monitors are
    ``monitors=`` or those the DeepSpeed file turns on (csv_monitor, tensorboard, wandb,
    steps_per_print, wall_clock_breakdown, comms_logger, flops_profiler; see
    :class:`zerojax.monitor.Monitors`), not both; the returned step
    implements :class:`zerojax.Step` whichever it is. The step takes the *global* batch: when the config
    sets ``train_batch_size`` every batch leaf must have that many rows (a ValueError names the
    expected leading dimension otherwise); metrics hold loss, grad_norm, learning_rate (the lr
    this step used; a skipped step does not advance the schedule), loss_scale and skipped.

        state, step = zj.initialize(params, loss_fn, {"train_micro_batch_size_per_gpu": 4,
                                    "zero_optimization": {"stage": 2},
                                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    """
    mesh = mesh_for(config, mesh)  # all devices on "data", or the AutoTP mesh when autotp_size > 1
    config, monitors = _resolve_config(config, mesh, training_args, hidden_size), monitors_for(config, monitors)
    tx = _optimizer(config, training_args, optimizer, muon_params)
    state = shard_train_state(params_or_init_fn, tx, mesh=mesh, config=config, rng=rng, param_specs=param_specs)
    step = make_train_step(loss_fn, state, has_aux=has_aux, donate=donate, check_errors=check_errors,
                           fused_adam=fused_adam, monitors=monitors)
    return state, GlobalBatchStep.wrap(step, config.train_batch_size)
