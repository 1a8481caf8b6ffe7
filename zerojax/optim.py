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
dtypes as given.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import optax

from zerojax.config import ZeroConfig
from zerojax.mesh import make_mesh
from zerojax.plan import ZeroPlan
from zerojax.precision import global_norm
from zerojax.stages import collectives as C
from zerojax.stages.update import clip_coefficient


class ZeroOptState(NamedTuple):
    inner: Any  # the wrapped optimizer's state, each leaf split like the param it mirrors


def _constrain(tree, shardings):
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, tree, shardings)


def _check_tree(plan: ZeroPlan, tree, what: str):
    got = jax.tree_util.tree_structure(tree)
    if got != plan.treedef:
        raise ValueError(f"zero_optimizer: {what} tree {got} does not match the params tree {plan.treedef} "
                         "given to init; pass grads/params with the same structure as at init.")


def zero_optimizer(tx: optax.GradientTransformation, *, mesh=None,
                   config: Optional[ZeroConfig] = None) -> optax.GradientTransformation:
    mesh = make_mesh() if mesh is None else mesh
    config = ZeroConfig(stage=1) if config is None else config

    def plan_for(params) -> ZeroPlan:
        return ZeroPlan.create(params, mesh, config)

    def to_update_layout(plan: ZeroPlan, tree):
        # slice locally (no constraint on the caller's arrays), then view with logical shapes
        return plan.to_update(C.split_tree(plan, tree, plan.opt_partitioned))

    def store(plan: ZeroPlan, inner, logical_shapes):
        # stored padded, split like the master, so any jit boundary accepts it
        return ZeroOptState(_constrain(plan.opt_to_storage(inner), plan.opt_state_shardings(logical_shapes)))

    def init_fn(params):
        plan = plan_for(params)
        inner = tx.init(to_update_layout(plan, params))
        return store(plan, inner, jax.eval_shape(lambda: inner))

    def update_fn(updates, state: ZeroOptState, params=None):
        if params is None:
            raise ValueError("zero_optimizer.update needs params (the partition to update is cut from them)")
        plan = plan_for(params)
        _check_tree(plan, updates, "updates")
        grads = to_update_layout(plan, updates)
        if config.gradient_clipping:
            coef = clip_coefficient(global_norm(grads), config.gradient_clipping)
            grads = jax.tree_util.tree_map(lambda g: g / coef, grads)
        master = to_update_layout(plan, params)
        new_updates, inner = tx.update(grads, plan.opt_to_update(state.inner), master)
        whole = C.gather_tree(plan, plan.to_storage(new_updates), plan.opt_partitioned)
        return whole, store(plan, inner, jax.eval_shape(lambda: inner))

    # jit (inlined when the caller is already tracing) so the logical, possibly uneven
    # update layout only ever exists inside a compiled program
    jit_init = jax.jit(init_fn)
    jit_update = jax.jit(update_fn)

    def init(params):
        return jit_init(params)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("zero_optimizer.update needs params (the partition to update is cut from them)")
        return jit_update(updates, state, params)

    return optax.GradientTransformation(init, update)
