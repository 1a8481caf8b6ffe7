"""The optimizer update on partitioned storage, shared by every update path.

After the reduction each device holds the gradient of its 1/N of the state (stages 1–3);
``optax_update`` runs the user's optax transformation on the logical shapes of that
partition, and ``params_from_master`` all-gathers the updated 16-bit params once where
they are stored whole (the Ψ of stages 1–2).
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax._placement as placement
from zerojax._low_precision import opt_for_storage, opt_for_update, round_master
from zerojax._plan import ZeroPlan
from zerojax.stages import _collectives as C
from zerojax._state import TrainState

__all__ = ["master_view", "optax_update", "params_from_master", "takes_value"]


def _update_accepts(tx, **extra) -> bool:
    """Whether ``tx.update(g, tx.init(p), p, **extra)`` traces on a one-leaf tree."""
    probe = {"x": jax.ShapeDtypeStruct((6,), jnp.float32)}
    try:
        jax.eval_shape(lambda p: tx.update(p, tx.init(p), p, **extra), probe)
    except Exception:  # noqa: BLE001 - any failure: the call does not serve this transformation
        return False
    return True


@functools.lru_cache(maxsize=64)
def _opaque_takes_value(tx) -> bool:
    # refused only where value= is what breaks the update (else make_train_step's check reports it)
    # a numpy scalar: nothing is created (or compiled) on a device to read a signature
    return _update_accepts(tx, value=np.float32(0.0)) or not _update_accepts(tx)


def takes_value(tx) -> bool:
    """Whether a step passes its loss to ``tx.update`` as ``value=``.

    Only to a transformation taking extra arguments (optax's ``GradientTransformationExtraArgs``)
    whose update accepts ``value``: one that names it (reduce_on_plateau, momo) or takes any
    keyword (``**extra_args``: optax's ``chain`` and ``named_chain``, so polyak_sgd); not to one
    whose keywords are others only (``optax.contrib.sam``'s ``grad_fn``), which a plain optax
    loop calls without ``value`` and which would fail on it. A chain hides what its parts take
    and hands every keyword to every part taking extra arguments: one around sam gets no
    ``value=`` where its update fails with it on a one-leaf tree and traces without it.
    Decided from ``tx`` alone, so every path (``make_train_step``'s check, the on-device and
    host updates, the pipeline, ``zero_optimizer``) agrees."""
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
        return False
    try:
        parameters = inspect.signature(tx.update).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): as an opaque chain
        parameters = [inspect.Parameter("extra_args", inspect.Parameter.VAR_KEYWORD)]
    if any(p.name == "value" and p.kind != inspect.Parameter.VAR_KEYWORD for p in parameters):
        return True
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return False
    try:
        hash(tx)
    except TypeError:  # a transformation built from unhashable callables: probed on every call
        return _opaque_takes_value.__wrapped__(tx)
    return _opaque_takes_value(tx)


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


def optax_update(plan: ZeroPlan, tx, master, grads, opt_state, key=None, value=None):
    """``tx`` on the user's logical shapes (padding stripped, split over the data axis) from
    partitioned storage and back: ``(master, opt_state)`` updated, in storage layout.

    Low-precision states (:mod:`zerojax._low_precision`): a bf16 master and bf16 moments are
    widened to fp32 for the update, which computes in fp32; the new master is rounded back to
    bf16 (stochastically with ``stochastic_rounding``, from ``key``), the moments to nearest.

    ``value``: the step's loss, passed as ``update(..., value=loss)`` to a transformation whose
    update accepts it (:func:`takes_value`: reduce_on_plateau, polyak_sgd, momo)."""
    current = placement.to_update(plan, master)
    grads = placement.to_update(plan, grads)
    if plan.config.master_weights_dtype is not None:
        current = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), current)
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    extra = {"value": value} if value is not None and takes_value(tx) else {}
    updates, opt_state = tx.update(grads, opt_for_update(plan, placement.opt_to_update(plan, opt_state)), current,
                                   **extra)
    new = round_master(plan, optax.apply_updates(current, updates), key)
    return placement.to_storage(plan, new), placement.opt_to_storage(plan, opt_for_storage(plan, opt_state))
