"""The pipelined gradient: a schedule of ticks run inside one body manual over "pipe" and data.

Each device is one (stage, data rank) pair. It keeps its stage's layers (params["blocks"]
split over "pipe" along the layer axis) and, replicated over "pipe", the embed (used on the
first stage) and the head (on the last). At every tick of the schedule
(:mod:`zerojax.pipeline._schedule`) a stage runs what its row of the tables says, each under
a ``lax.cond`` (the stages of one program take different branches):

    forward   its layers on the input of micro-batch i (the first stage embeds the batch first)
    backward  of micro-batch j: the same forward again under ``jax.vjp``, then its transpose
              with the gradient the stage below sent (the last stage: with the head's loss),
              accumulated in fp32

then one ``ppermute`` sends every activation a stage down and every input gradient a stage
up. A stage keeps only the inputs of its micro-batches in flight (``schedule.slots`` of
them: 2 P - 1 for 1F1B, P for 1F1B-serial); the activations inside a stage live only during its backward (and, with
``activation_checkpoint_interval``, only every k layers' inputs then).

After the last tick the embed's and head's gradients are summed over "pipe" (only the first
and last stage hold them), and every gradient is reduced over the data axis as ZeRO stage 1
does: reduce-scattered once per step into the partitions the optimizer state has (stage 2
reduces the same way: a stage's accumulated gradient is whole until then). Stage 3 stores
the params partitioned and all-gathers them once per step, before the first tick.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax._compat import shard_map
from zerojax.pipeline._model import PipelineModel
from zerojax.pipeline._schedule import NONE, Schedule
from zerojax._plan import PIPE, ZeroPlan
from zerojax._remat import config_scope
from zerojax.stages import _collectives as C

__all__ = ["manual_spec", "pipeline_grads_fn"]


def manual_spec(spec: P, manual) -> P:
    """``spec`` with only the mesh axes in ``manual`` (the others stay automatic in the body)."""
    def keep(e):
        names = e if isinstance(e, tuple) else (e,)
        names = tuple(x for x in names if x is not None and x in manual)
        return None if not names else names[0] if len(names) == 1 else names
    return P(*(keep(e) for e in spec))


def pipeline_grads_fn(model: PipelineModel, plan: ZeroPlan, schedule: Schedule):
    """(params, batch, scale) -> (grads, loss, ran): the gradients of ``scale`` x the mean loss in
    ``plan.grad_shardings`` (fp32), the mean loss, and what each stage ran at each tick
    (i32[P, ticks, 2]: forward, backward; counted by the executed program)."""
    data, n, stages = plan.data_axis, plan.n, plan.mesh.shape[PIPE]
    gas = plan.config.gradient_accumulation_steps
    manual = (PIPE, data)
    f32 = jnp.float32
    fwd_table = jnp.asarray(schedule.fwd)
    bwd_table = jnp.asarray(schedule.bwd)
    slots = schedule.slots
    down = [(i, i + 1) for i in range(stages - 1)]
    up = [(i + 1, i) for i in range(stages - 1)]

    def send(x, perm):
        return jax.lax.ppermute(x, PIPE, perm) if perm else jnp.zeros_like(x)

    def body(params, batch, scale):
        stage = jax.lax.axis_index(PIPE)
        first, last = stage == 0, stage == stages - 1
        params = plan.map(lambda lay, x: C.gather(x, lay, data) if lay.params_partitioned else x, params)
        pe, pb, ph = params["embed"], params["blocks"], params["head"]
        mbs = jax.tree_util.tree_map(lambda x: x.reshape((gas, x.shape[0] // gas) + x.shape[1:]), batch)

        def micro_batch(m):
            return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, m, keepdims=False), mbs)

        h_like = jax.eval_shape(model.embed, pe, micro_batch(0))
        zeros_h = jnp.zeros(h_like.shape, h_like.dtype)

        def forward(pe, pb, x, mb):
            h = jax.lax.cond(first, lambda: model.embed(pe, mb).astype(h_like.dtype), lambda: x)
            return model.run_blocks(pb, h)

        def full(pe, pb, ph, x, mb):
            h = forward(pe, pb, x, mb)
            return h, jax.lax.cond(last, lambda: model.head(ph, h, mb).astype(f32), lambda: f32(0.0))

        # the cotangent of the loss: the mean over devices and micro-batches, folded into the scale
        loss_cotangent = scale / f32(n * gas)

        def tick(carry, t):
            buf, recv_h, recv_g, acc, loss_sum = carry
            # the activation the stage above sent after the last tick goes to its micro-batch's slot
            above = jnp.maximum(stage - 1, 0)
            came = fwd_table[jnp.maximum(t - 1, 0), above]
            arrived = (t > 0) & (stage > 0) & (came != NONE)
            slot = jnp.maximum(came, 0) % slots
            kept = jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)
            buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(arrived, recv_h, kept), slot, 0)
            f_m, b_m = fwd_table[t, stage], bwd_table[t, stage]

            def fwd(_):
                m = jnp.maximum(f_m, 0)
                return forward(pe, pb, jax.lax.dynamic_index_in_dim(buf, m % slots, keepdims=False), micro_batch(m))

            def bwd(acc):
                m = jnp.maximum(b_m, 0)
                x, mb = jax.lax.dynamic_index_in_dim(buf, m % slots, keepdims=False), micro_batch(m)
                (_, loss), pullback = jax.vjp(lambda a, b, c, xx: full(a, b, c, xx, mb), pe, pb, ph, x)
                ge, gb, gh, gx = pullback((recv_g, loss_cotangent.astype(f32)))
                acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(f32), acc, (ge, gb, gh))
                return gx.astype(h_like.dtype), acc, loss

            # the last stage's forward is the one its backward recomputes: nothing to send on
            h_out = jax.lax.cond((f_m != NONE) & ~last, fwd, lambda _: zeros_h, None)
            g_out, acc, loss = jax.lax.cond(b_m != NONE, bwd, lambda acc: (zeros_h, acc, f32(0.0)), acc)
            ran = jnp.stack([f_m != NONE, b_m != NONE]).astype(jnp.int32)
            return (buf, send(h_out, down), send(g_out, up), acc, loss_sum + loss), ran

        acc0 = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, f32), (pe, pb, ph))
        buf0 = jnp.zeros((slots,) + h_like.shape, h_like.dtype)
        carry0 = (buf0, zeros_h, zeros_h, acc0, f32(0.0))
        (_, _, _, (ge, gb, gh), loss_sum), ran = jax.lax.scan(tick, carry0, jnp.arange(schedule.ticks))

        if stages > 1:  # the embed's gradient lives on the first stage, the head's on the last
            ge, gh = jax.lax.psum((ge, gh), PIPE)
        grads = {"embed": ge, "blocks": gb, "head": gh}
        cdt = plan.compute_dtype

        def reduce(lay, g):  # over data, in the gradient dtype, into the optimizer's partitions
            if n == 1:
                return g
            g = g.astype(cdt)
            g = C.reduce_scatter(g, lay, data) if plan.grad_partitioned(lay) else jax.lax.psum(g, data)
            return g.astype(f32)

        grads = plan.map(reduce, grads)
        loss = jax.lax.psum(loss_sum, (PIPE, data)) / f32(n * gas)
        return grads, loss, ran[None]

    param_specs = plan.map(lambda lay: manual_spec(lay.spec(lay.params_partitioned, data), manual))
    grad_specs = plan.map(lambda lay: manual_spec(lay.spec(plan.grad_partitioned(lay), data), manual))

    def run(params, batch, scale):
        batch_specs = jax.tree_util.tree_map(lambda _: P(data), batch)
        # zj.remat in the model (and the checkpoint interval) follows the config's activation_checkpointing
        return shard_map(config_scope(body, plan.config.activation_checkpointing), plan.mesh, in_specs=(param_specs, batch_specs, P()),
                         out_specs=(grad_specs, P(), P(PIPE)), manual_axes=set(manual))(params, batch, scale)

    return run
