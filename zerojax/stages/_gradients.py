"""The data-parallel gradient of every stage, with its explicit reduction.

Inside a body that is manual over the data axis each device runs the user's loss on its
part of the batch, micro-batch by micro-batch (``lax.scan``). The gradient reduction is the
stage's:

    stage 0  local accumulation, one all-reduce per optimizer step           2Ψ
    stage 1  local accumulation, one reduce-scatter per optimizer step       Ψ
    stage 2  a reduce-scatter per micro-batch into the local partition       GAS·Ψ
    stage 3  params all-gathered per micro-batch; the gather's transpose is
             a reduce-scatter per micro-batch                                GAS·(Ψ + Ψ)

With ``reduce_scatter=False`` (DeepSpeed's ``zero_optimization.reduce_scatter``) stages 1 and 2
all-reduce those gradients instead (same buckets, 2Ψ per reduction) and each device keeps its
own partition; stage 3 always reduce-scatters, as in DeepSpeed (ZeroPlan warns). With ZeRO++'s
``quantized_gradients`` stage 3 reduces through quantized all-to-all exchanges instead
(:mod:`zerojax.stages._zeropp`).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax._compat import shard_map, to_device_memory
from zerojax._errors import ConfigError
from zerojax._mesh import SEQ
from zerojax._plan import ZeroPlan
from zerojax._precision import total_sum_of_squares
from zerojax._remat import config_scope
from zerojax._ulysses import comm_scope
from zerojax.stages import _collectives as C
from zerojax.stages._stage3 import gathered_loss
from zerojax.stages._zeropp import Wire

__all__ = ["grads_fn", "loss_arity"]

def loss_arity(loss_fn) -> int:
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return 3 if len(positional) >= 3 else 2


def grads_fn(loss_fn: Callable, plan: ZeroPlan, has_aux: bool = False, with_sumsq: bool = False,
             params_source: Callable | None = None):
    """The data-parallel gradient computation: (params, batch, scale, rng) -> (grads, loss), or
    (grads, loss, sumsq) ``with_sumsq``.

    ``params_source`` (params on NVMe, :class:`zerojax.offload._nvme_params.NvmeSource`): called
    inside the body, per device, it gives the params to differentiate (placeholders for the
    partitioned ones), and its ``sources`` read each shard where the stage-3 replay uses it;
    ``params`` is then None.

    ``grads`` are the mean over the global batch of d(scale·loss)/d(params), laid out as
    ``plan.grad_shardings`` (partitioned from stage 1) and in float32; ``sumsq`` is their
    float32 sum of squares (the square of their global norm), taken where it is cheapest: over
    each reduce-scattered bucket as a whole where the gradients are reduced in buckets once
    (stage 1; stage 2 without accumulation), over each leaf otherwise.
    """
    cfg, n, axis = plan.config, plan.n, plan.data_axis
    gas = cfg.gradient_accumulation_steps
    cdt = plan.compute_dtype
    takes_rng = loss_arity(loss_fn) >= 3
    # zj.remat in the loss checkpoints as the config's activation_checkpointing block says
    loss_fn = config_scope(loss_fn, cfg.activation_checkpointing)
    # and zj.ulysses_attention carries its all-to-alls in the config's seq_parallel_comm_dtype
    loss_fn = comm_scope(loss_fn, cfg.seq_parallel_comm_dtype)
    f32 = jnp.float32
    sources = getattr(params_source, "sources", None)
    stage3_loss = gathered_loss(loss_fn, plan, takes_rng, sources) \
        if any(lay.params_partitioned for lay in plan.leaves) else None

    def per_micro(lay):  # reduce this leaf's gradient after every micro-batch?
        return not lay.params_partitioned and plan.stage >= 2 and plan.grad_partitioned(lay)

    # reduce_scatter=False: all-reduce, then keep the local partition (stage 3 ignores the key)
    scatter = C.bucketed_reduce_scatter if cfg.reduce_scatter or plan.stage == 3 else C.bucketed_all_reduce_slice
    wire = Wire.of(plan)
    # the plain bucketed reduce-scatter hands over each bucket's sum of squares as a whole
    bucket_sumsq = with_sumsq and n > 1 and scatter is C.bucketed_reduce_scatter and not wire.grad_bits
    if wire.grad_bits:  # ZeRO++ qgZ (stage 3): the leaves kept whole are reduced the same quantized way
        def scatter(xs, lays, axis_name, n, bucket_size):
            return wire.bucketed_reduce(xs, lays, bucket_size)

    def reduce_some(tree, select, sumsq=None):
        """Reduce the leaves ``select`` picks into this device's partitions, in buckets of
        reduce_bucket_size (appending the buckets' sums of squares to a list ``sumsq``, where
        ``bucket_sumsq``). One device: nothing to reduce (XLA would still copy the gradients);
        a leaf still split over another axis (sequence parallelism) is only padded to its storage."""
        if n == 1:
            return plan.map(lambda lay, x: placement.pad(x, lay) if select(lay) else x, tree)
        reduce = functools.partial(C.bucketed_reduce_scatter, sumsq=sumsq) if sumsq is not None and bucket_sumsq \
            else scatter
        return C.on_selected(plan, tree, select, lambda lays, xs: reduce(xs, lays, axis, n, int(cfg.reduce_bucket_size)))

    def all_reduce_some(tree, select):
        if n == 1:
            return tree
        return C.on_selected(plan, tree, select, lambda lays, xs: C.bucketed_all_reduce(
            xs, lays, axis, int(cfg.reduce_bucket_size)))

    def acc_shape(lay):
        if lay.params_partitioned or per_micro(lay):
            return C.local_shape(lay, n)
        return lay.shape

    denom = np.float32(n * gas)  # numpy: a constant of the trace, nothing made on a device now

    def body(params, batch, scale, rng):
        if params_source is not None:
            params = params_source()
        # offload_param: every param reaches the loss in device memory. A partitioned shard is
        # brought over just before its gather (stages/_stage3_values.py), layer by layer; a param
        # kept whole comes over here, once per step, outside the gradient (so its gradient is
        # made in device memory and no micro-batch moves it again)
        params = plan.map(lambda lay, x: x if lay.params_partitioned else to_device_memory(x), params)
        # the mean over devices and micro-batches is folded into the loss's scale, so no pass
        # over the gradients divides them afterwards
        grad_scale = scale / denom
        bucket_sq = []  # this device's sums of squares of the buckets reduced once (bucket_sumsq)

        def loss_of(p, mb, key):
            if stage3_loss is not None:
                out = stage3_loss(p, mb, key)
            else:
                out = loss_fn(p, mb, key) if takes_rng else loss_fn(p, mb)
            loss = out[0] if has_aux else out
            return loss.astype(f32) * grad_scale, loss.astype(f32)

        def micro_grads(mb, i):
            key = jax.random.fold_in(jax.random.fold_in(rng, jax.lax.axis_index(axis)), i)
            g, loss = jax.grad(loss_of, has_aux=True)(params, mb, key)
            g = jax.tree_util.tree_map(to_device_memory, g)  # offloaded params' gradients
            # without accumulation the per-micro-batch reduction is the last one (stage 2)
            return reduce_some(g, per_micro, bucket_sq if gas == 1 else None), loss

        if seq_n > 1:  # keep the sequence split inside the body ("seq" stays automatic here)
            batch = split_sequence(batch, jax.sharding.get_abstract_mesh(), None, seq_n)
        if gas == 1:  # one micro-batch: no fp32 accumulator, no pass that adds into one
            acc, loss_sum = micro_grads(batch, 0)
        else:
            mbs = jax.tree_util.tree_map(lambda x: x.reshape((gas, x.shape[0] // gas) + x.shape[1:]), batch)

            def micro(carry, xs):
                acc, loss_sum = carry
                g, loss = micro_grads(*xs)
                acc = jax.tree_util.tree_map(lambda a, x: a + x.astype(f32), acc, g)
                return (acc, loss_sum + loss), None

            acc0 = plan.map(lambda lay: jnp.zeros(acc_shape(lay), f32))
            (acc, loss_sum), _ = jax.lax.scan(micro, (acc0, jnp.zeros((), f32)), (mbs, jnp.arange(gas)))

        def at_end_rs(lay):  # stage 1: one reduce-scatter (or all-reduce) per optimizer step
            return not lay.params_partitioned and not per_micro(lay) and plan.grad_partitioned(lay)

        def at_end_ar(lay):  # stage 0 (and leaves that cannot be split): one all-reduce
            return not lay.params_partitioned and not per_micro(lay) and not plan.grad_partitioned(lay)

        # communicate in the gradient dtype
        grads = plan.map(lambda lay, a: a.astype(cdt) if at_end_rs(lay) or at_end_ar(lay) else a, acc)
        grads = reduce_some(grads, at_end_rs, bucket_sq)
        grads = all_reduce_some(grads, at_end_ar)
        grads = jax.tree_util.tree_map(lambda g: g.astype(f32), grads)
        loss = jax.lax.psum(loss_sum, axis) / denom
        if not with_sumsq:
            return grads, loss

        def in_buckets(lay):
            return bucket_sumsq and (at_end_rs(lay) or (gas == 1 and per_micro(lay)))

        lays, leaves = plan.leaves, plan.treedef.flatten_up_to(grads)
        # shards: this device's part of the sum (the psum adds the others'); whole leaves are
        # the same on every device and counted once
        per_leaf = [g for lay, g in zip(lays, leaves) if plan.grad_partitioned(lay) and not in_buckets(lay)]
        part = bucket_sq + ([total_sum_of_squares(per_leaf)] if per_leaf else [])
        whole_leaves = [g for lay, g in zip(lays, leaves) if not plan.grad_partitioned(lay)]
        whole = [total_sum_of_squares(whole_leaves)] if whole_leaves else []
        if part and n > 1:
            whole.append(jax.lax.psum(sum(part), axis))
        else:
            whole += part
        return grads, loss, sum(whole, f32(0.0))

    param_specs = plan.map(lambda lay: lay.data_spec(lay.params_partitioned, axis))
    grad_specs = plan.map(lambda lay: lay.data_spec(plan.grad_partitioned(lay), axis))

    seq_n = plan.mesh.shape.get(SEQ, 1)

    def run(params, batch, scale, rng):
        if seq_n > 1:  # sequence parallelism: dim 1 of each leaf of rank >= 2 split over "seq"
            batch = split_sequence(batch, plan.mesh, axis, seq_n)
        batch_specs = jax.tree_util.tree_map(lambda _: P(axis), batch)
        sm = shard_map(body, plan.mesh, in_specs=(None if params_source else param_specs, batch_specs, P(), P()),
                       out_specs=(grad_specs, P()) + ((P(),) if with_sumsq else ()), manual_axes={axis})
        return sm(params, batch, scale, rng)

    return run


def split_sequence(batch, mesh, data_axis: str, n: int):
    """``batch`` with dim 1 of every leaf of rank >= 2 split over the mesh's "seq" axis of ``n``
    (dim 0 over ``data_axis``; None inside the body manual over it); ConfigError naming the leaf whose length ``n`` does not divide."""
    def one(path, x):
        if getattr(x, "ndim", 0) < 2:
            return x
        if x.shape[1] % n:
            raise ConfigError(
                f"batch leaf {jax.tree_util.keystr(path) or '<batch>'} has sequence length {x.shape[1]} (dim 1 of "
                f"shape {tuple(x.shape)}), which sequence_parallel_size={n} does not divide. Fix: pad the sequence "
                f"to a multiple of {n} (labels with the ignore index)")
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(data_axis, SEQ)))
    return jax.tree_util.tree_map_with_path(one, batch)
