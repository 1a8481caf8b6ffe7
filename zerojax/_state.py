"""TrainState and shard_train_state: a model's params and optimizer state in ZeRO layout."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax._autotp import mesh_for
from zerojax._errors import StateError
from zerojax.config import ZeroConfig
from zerojax._init_groups import init_in_groups
from zerojax._init_rule import abstract_params, split_params_or_init
from zerojax._low_precision import opt_for_storage
from zerojax.offload._partial import check_split
from zerojax._plan import ZeroPlan
from zerojax.update._groups import partition_groups
from zerojax._precision import LossScalerState


@struct.dataclass
class TrainState:
    """Everything a ZeRO step reads and writes.

    params:     compute params (precision's dtype), split over the data axis in stage 3
    master:     fp32 master copy in the update layout (split from stage 1); None under fp32
                and with ``master_weights_dtype="bfloat16"``, where the params are the master
    opt_state:  the optax state of ``tx``, built on the master's update layout (the leaves
                mirroring a param in bf16 with ``optimizer_state_dtype="bfloat16"``)
    loss_scale: the dynamic loss scaler (fp16), carried but unused otherwise
    rng:        base PRNG key; each micro-batch on each device folds in its indices

    Offloaded (``offload_optimizer="cpu"``), master and opt_state live in host memory; with
    ``offload_ratio`` < 1 only the leaves of the params in ``plan.offloaded_paths`` do (and
    the leaves no param owns, such as counts), the others stay in device memory.
    """

    step: jax.Array  # i32[] optimizer steps taken, skipped ones included
    params: Any
    master: Any
    opt_state: Any
    loss_scale: LossScalerState
    rng: jax.Array
    plan: ZeroPlan = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def shardings(self) -> "TrainState":
        return state_shardings(self.plan, self.tx)

    def full_params(self, dtype=None):
        """The params as the user's tree (unpadded, logical shapes), from the master when there is one."""
        return unshard_params(self, dtype)


def _replicated(plan: ZeroPlan) -> NamedSharding:
    return NamedSharding(plan.mesh, P())


def state_shardings(plan: ZeroPlan, tx) -> TrainState:
    """The sharding of every leaf of a TrainState for ``plan`` and ``tx`` (a TrainState of shardings)."""
    rep = _replicated(plan)
    scaler = jax.tree_util.tree_map(lambda _: rep, jax.eval_shape(plan.config.loss_scaler.init))
    outside = plan.optimizer_state_outside  # the step keeps the master and moments itself
    return TrainState(
        step=rep,
        params=plan.param_shardings,
        master=plan.master_shardings if plan.state_has_master else None,
        opt_state=None if outside else plan.opt_state_shardings(jax.eval_shape(tx.init, plan.abstract_master())),
        loss_scale=scaler,
        rng=rep,
        plan=plan,
        tx=tx,
    )


def _build_fn(plan: ZeroPlan, tx):
    """full params (user layout) -> (params, master, opt_state) in ZeRO layout; traced under jit."""
    cdt = plan.compute_dtype

    def build(full):
        params = plan.map(lambda lay, x: placement.pad(x.astype(cdt), lay) if lay.params_partitioned else x.astype(cdt), full)
        if plan.optimizer_state_outside:  # the step creates the state (files, ZenFlow's buffers)
            out = (params, None, None)
        else:
            # the optimizer starts from the master's value: the bf16 params when they are the master
            own = plan.config.master_weights_dtype is not None
            master = plan.map(lambda lay, x: (x.astype(cdt) if own else x).astype(jnp.float32), full)
            opt_state = placement.opt_to_storage(plan, opt_for_storage(plan, tx.init(master)))
            out = (params, placement.to_storage(plan, master) if plan.state_has_master else None, opt_state)
        # fresh buffers: the caller's arrays must survive the steps, which donate the state
        return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), out)

    return build


def shard_train_state(
    params_or_init: Union[Any, Callable[[jax.Array], Any]],
    tx: optax.GradientTransformation,
    *,
    mesh=None,
    config: Optional[ZeroConfig] = None,
    rng: Optional[jax.Array] = None,
    param_specs=None,
) -> TrainState:
    """Place params and a fresh optimizer state in the layout of ``config.stage``.

    ``params_or_init`` is a params tree (arrays, numpy arrays) or ``init_fn(rng) -> params``
    (a callable pytree of arrays, such as an Equinox module, is params; see
    :mod:`zerojax._init_rule`, and ``zj.init_fn(f)`` to mark an init function);
    with an init function the model is created directly in its sharded layout, so the whole
    model never has to exist on one device. ``param_specs`` (a tree of PartitionSpec) or the
    arrays' own NamedShardings give model-parallel annotations; the data axis is added on top.
    ``mesh=None`` builds the mesh ``zj.initialize`` would (:func:`zerojax._autotp.mesh_for`): every
    device on "data", or ``("data", "model")`` with ``config.autotp_size`` > 1, ``("data", "seq")``
    with ``config.sequence_parallel_size`` > 1; a given mesh must have those axes.

        state = zj.shard_train_state(params, optax.adamw(1e-3), mesh=zj.make_mesh(),
                                     config=zj.ZeroConfig(stage=2, precision="bf16"))
    """
    config = ZeroConfig() if config is None else config
    mesh = mesh_for(config, mesh)  # as zj.initialize: built from autotp_size / sequence_parallel_size when None
    rng = jax.random.PRNGKey(0) if rng is None else rng
    init_key, state_key = jax.random.split(rng)
    init_fn, _ = split_params_or_init(params_or_init)
    abstract = abstract_params(params_or_init, init_key)
    plan = ZeroPlan.create(abstract, mesh, config, param_specs=param_specs).with_groups(partition_groups(tx, abstract))
    check_split(plan, tx)
    build = _build_fn(plan, tx)
    sh = state_shardings(plan, tx)
    out_shardings = (sh.params, sh.master, sh.opt_state)
    if init_fn is not None:
        # in groups of leaves: the init's temporaries are a group's, not the whole model's
        params, master, opt_state = init_in_groups(lambda k: build(init_fn(k)), out_shardings, init_key)
    else:
        # Replicate onto the mesh first so arrays living elsewhere (numpy, another device) are accepted.
        in_tree = plan.map(lambda lay, x: jax.device_put(x, NamedSharding(mesh, lay.spec(False, plan.data_axis))),
                           params_or_init)
        params, master, opt_state = jax.jit(build, out_shardings=out_shardings)(in_tree)
    scaler = jax.device_put(config.loss_scaler.init(), sh.loss_scale)
    return TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), sh.step),
        params=params,
        master=master,
        opt_state=opt_state,
        loss_scale=scaler,
        rng=jax.device_put(state_key, sh.rng),
        plan=plan,
        tx=tx,
    )


def abstract_train_state(params_or_init, tx: optax.GradientTransformation, *, mesh=None,
                         config: Optional[ZeroConfig] = None, param_specs=None) -> TrainState:
    """The TrainState ``shard_train_state`` would build, as ShapeDtypeStructs with shardings.

    Nothing is allocated: use it to lower and compile a step (``step.lower(abstract, batch)``),
    for ``zj.comm_report``/``zj.peak_memory`` on models that do not fit this machine.
    """
    config = ZeroConfig() if config is None else config
    mesh = mesh_for(config, mesh)  # as zj.initialize: built from autotp_size / sequence_parallel_size when None
    abstract = abstract_params(params_or_init)
    plan = ZeroPlan.create(abstract, mesh, config, param_specs=param_specs).with_groups(partition_groups(tx, abstract))
    check_split(plan, tx)
    sh = state_shardings(plan, tx)
    abstract_full = plan.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype))
    params, master, opt_state = jax.eval_shape(_build_fn(plan, tx), abstract_full)
    scaler = jax.eval_shape(config.loss_scaler.init)

    def attach(tree, shardings):
        return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    return TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.step),
        params=attach(params, sh.params),
        master=attach(master, sh.master) if master is not None else None,
        opt_state=attach(opt_state, sh.opt_state),
        loss_scale=attach(scaler, sh.loss_scale),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sh.rng),
        plan=plan,
        tx=tx,
    )


def params_held(params) -> bool:
    """False where ``params`` holds only shapes (``jax.ShapeDtypeStruct``s: ``offload_param="nvme"``
    keeps the values in files between steps)."""
    return not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params))


def check_params_held(state: TrainState, doing: str) -> None:
    """A StateError where ``state.params`` holds only shapes (:func:`params_held`)."""
    if not params_held(state.params):
        raise StateError(f"{doing}: state.params holds only the params' shapes; with offload_param='nvme' the "
                         "params live in files under nvme_path. Fix: read them with step.full_params() (the step "
                         "that trains this state)")


def unshard_params(state: TrainState, dtype=None):
    """Logical params (unpadded) gathered by XLA; dtype defaults to the user's original dtypes."""
    check_params_held(state, "unshard_params")
    plan = state.plan
    master_layout = state.master is not None  # (fp32: no master; nvme, zenflow: the step keeps it)
    src = state.master if master_layout else state.params

    def one(lay, x):
        partitioned = plan.opt_partitioned(lay) if master_layout else lay.params_partitioned
        y = placement.unpad(x, lay) if partitioned else x
        return y.astype(dtype or lay.dtype)

    return jax.jit(lambda t: plan.map(one, t), out_shardings=plan.map(
        lambda lay: NamedSharding(plan.mesh, lay.spec(False, plan.data_axis))))(src)
