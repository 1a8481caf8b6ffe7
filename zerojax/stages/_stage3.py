"""Stage 3: parameters gathered just in time, inside the user's (black-box) loss.

The loss is traced once with whole params, then re-played with each partitioned param
standing in as a *lazy* value (its local shard). Operations on params alone (a transpose, a
cast) stay lazy. At the first operation that meets an activation (a *use site*) the param is
all-gathered; a Python loop over layers therefore gathers layer by layer. In a ``lax.scan``
over stacked layers the per-layer slice stays lazy and is gathered inside the loop body;
nested ``jit`` calls are entered; a ``fori_loop``/``while_loop`` that takes one layer of a
stacked param with a dynamic slice is handled likewise. Anything else gathers at the use.

The loss is traced with ``jax.numpy``'s calls kept as calls
(:func:`zerojax._compat.make_jaxpr_keeping_calls`): replayed on plain values, a call is bound as
it is, and JAX linearizes its (cached) program once for all layers, as in a plain ``jit``
trace; replayed on a lazy value, its equations are evaluated in line. The step's program is
the one the inlined trace gives.

Each use site is a custom-VJP function. The backward pass gathers a param again right where
it is needed (and not at all where the derivative does not read it, e.g. an embedding lookup
or a bias add), unless the param is kept gathered from its forward use: DeepSpeed's
``stage3_max_reuse_distance`` rule over the fetch trace of the whole step, forward then
backward, which keeps a param whose backward use comes within ``max_reuse_distance`` elements
of params fetched in between (about twice what the forward pass uses after it), up to
``max_live_parameters`` kept elements. Under DeepSpeed's defaults (1e9 both) a model below
about 500M params is gathered once per micro-batch (2Ψ, like GSPMD FSDP, holding the gathered
params until their backward use); ``max_reuse_distance=0`` gathers every param again for the
backward pass (ZeRO's 3Ψ, with at most a few layers' params alive at a time). The gradient
leaves through the gather's transpose, one reduce-scatter per param however many times it is
used (tied embeddings included).

Gathers are tied to the activation of the moment (``shard + 0 * a``; the compiler may not drop
it), so they are neither hoisted out of the micro-batch loop nor merged with the backward
gathers. When a param is first needed, the gathers of the params used next (up to
``prefetch_bucket_size`` elements, counting those gathered already and not used yet) are issued
at the same point, ahead of the compute, as one all-gather of their shards laid end to end
(their gradients then leave in one reduce-scatter); each param leaves the bucket as a buffer of
its own (:func:`zerojax.stages._collectives.own_buffers`).
A param that may be read in part (rows of a lookup, one layer in a loop, slices of a large
matmul) is gathered on its own, so the compiler drops that gather when nothing reads it whole.

A param larger than ``max_live_parameters`` or than 8 prefetch buckets
(:class:`zerojax.stages._reuse.Slicing`) that meets an activation in a matmul is gathered
slice by slice inside a loop (forward and backward), and a row lookup in a table
split along its features moves only the rows (an all-to-all), as does a lookup in such a table
split along its rows (a reduce-scatter); a tied embedding is then never whole on a device, nor
is its gradient.

A param used again in the forward pass (a tied embedding, a weight applied twice) also keeps
its gathered copy when at most ``max_reuse_distance`` elements of other params were used since its
last use (DeepSpeed's ``stage3_max_reuse_distance``); farther away it is gathered again, so the
copy need not stay alive in between. Its cotangents still meet before the one reduce-scatter.
Loops count their body's params once per iteration (a ``while_loop`` once).

A model may mark a point itself with ``zj.gather(params)``: outside a stage-3 step it is the
identity; inside, the params are gathered there.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, jaxpr_as_fun

from zerojax._compat import Tracer, inlined_call, make_jaxpr_keeping_calls, primitives, scan_counts
from zerojax._plan import LeafLayout, ZeroPlan
from zerojax.stages._reuse import Fetches, Slicing
from zerojax.stages._stage3_large import _chunked_dot, _sharded_lookup
from zerojax.stages._stage3_values import (MARK, Base, Lazy, _anchor, _bind, _dims_after, _gather_together, _inner,
                                          _param, _use_site, eqn_key, gather, lazy_key)
from zerojax.stages._zeropp import Wire

__all__ = ["gather", "gathered_loss"]


class _Interpreter:
    def __init__(self, wire: Wire, prefetch: int, slicing: Slicing, reuse_distance: float = math.inf,
                 max_live: float = math.inf):
        self.wire = wire
        self.prefetch = prefetch
        self.slicing = slicing
        self.fetches = Fetches(reuse_distance, max_live)
        self.prims = primitives()
        # params an operation may read in part (rows of a lookup, one layer in a loop, a call's
        # own use sites): their prefetched gathers stay their own, which the compiler drops
        # when nothing reads the whole param
        self.partly_read = set()
        # the use sites' backward derivatives, one jitted function per structure of site
        self.programs = {}

    def base(self, shard, lay: LeafLayout, stacked=None, source=None) -> Lazy:
        return _param(Base(shard, lay, self.wire, self.fetches, stacked, source))

    def _loop_body(self, body: Callable, times: int) -> Callable:
        """``body`` counting the params it uses ``times`` over (once per iteration), however
        often the loop traces it."""
        before, fetches = self.fetches.count, self.fetches

        def counted(*args):
            start, repeat = fetches.count, fetches.repeat
            fetches.repeat = repeat * times
            try:
                out = body(*args)
            finally:
                fetches.repeat = repeat
            fetches.count = before + (fetches.count - start) * times
            return out

        return counted

    # ------------------------------------------------------------------ the replay
    def run(self, jaxpr, consts, args):
        env = {}
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        order = self._first_use_order(jaxpr, env)
        self._eval(jaxpr.eqns, env, order)
        outs = [_read(env, v) for v in jaxpr.outvars]
        return [self.materialize(x, None) if isinstance(x, Lazy) else x for x in outs]

    def _eval(self, eqns, env: dict, order: List[Base]) -> None:
        """``eqns`` evaluated into ``env``. A ``jax.numpy`` call (kept as a call while tracing the
        loss) on plain values is bound as the call, whose linearization JAX caches; on a lazy
        value, its equations are evaluated here, in line, as if it had been inlined."""
        for eqn in eqns:
            invals = [_read(env, v) for v in eqn.invars]
            if not any(isinstance(x, Lazy) for x in invals):
                outvals = _bind(eqn, invals)
            elif inlined_call(eqn.primitive, eqn.params):
                closed = eqn.params["jaxpr"]
                env.update(zip(closed.jaxpr.constvars, closed.consts))
                env.update(zip(closed.jaxpr.invars, invals))
                self._eval(closed.jaxpr.eqns, env, order)
                outvals = [_read(env, v) for v in closed.jaxpr.outvars]
            else:
                outvals = self._lazy_eqn(eqn, invals, order)
            for v, x in zip(eqn.outvars, outvals):
                env[v] = x

    def _first_use_order(self, jaxpr, env) -> List[Base]:
        """The partitioned params in the order the equations first read them (inside kept
        ``jax.numpy`` calls too); those read in part join ``partly_read``."""
        order = []

        def walk(eqns, sources):  # sources: the params each lazy input variable holds
            for eqn in eqns:
                if inlined_call(eqn.primitive, eqn.params):
                    inner = eqn.params["jaxpr"].jaxpr
                    walk(inner.eqns, {i: sources[v] for i, v in zip(inner.invars, eqn.invars)
                                      if not isinstance(v, Literal) and v in sources})
                    continue
                in_part = self._reads_in_part(eqn)
                for v in eqn.invars:
                    if isinstance(v, Literal) or v not in sources:
                        continue
                    for b in sources[v]:
                        if all(b is not c for c in order):
                            order.append(b)
                        if in_part:
                            self.partly_read.add(b)

        walk(jaxpr.eqns, {v: x.sources for v, x in env.items() if isinstance(x, Lazy)})
        return order

    def _reads_in_part(self, eqn) -> bool:
        p = eqn.primitive
        return (p is self.prims["scan"] or p is self.prims["while"] or p in self.prims["calls"]
                or p.name in ("gather", "dynamic_slice", "squeeze", "reshape"))

    def materialize(self, x: Lazy, anchor):
        """A lazy value as a plain (differentiable) value, through a use site of its own."""
        return _use_site(lambda vals: [vals[0]], [x], anchor, ("whole",), self.programs)[0]

    def _prefetch(self, invals, order: Sequence[Base], anchor):
        bases = [b for x in invals if isinstance(x, Lazy) for b in x.sources]
        if not bases or not order:
            return
        last = max((order.index(b) for b in bases if b in order), default=-1)
        # DeepSpeed's rule: params not yet gathered are added while fewer than the bucket's
        # elements are on the way, so the last one may overshoot it (a param larger than the
        # bucket is still fetched one ahead). On the way: gathered and not used since, whichever
        # use site issued them; counting only the ones issued here let every use site add a
        # bucket, and a layer with more use sites than buckets of params (biases and norms
        # partitioned) gathered several layers ahead of its compute
        budget, together = self.prefetch, []
        for nxt in order[last + 1:]:
            if budget <= 0:
                break
            if nxt.full is not None:
                if nxt.last_use is None:
                    budget -= nxt.lay.size
                continue
            budget -= nxt.lay.size
            if not self.slicing.sliced(nxt.lay.size) and nxt not in self.partly_read:
                together.append(nxt)
            else:  # may be read in slices or in part: a gather of its own, dropped if unread
                nxt.gather_forward(anchor)
        _gather_together(together, anchor)

    def _lazy_eqn(self, eqn, invals, order):
        prim = eqn.primitive
        anchor = _anchor(invals)
        if prim.name == "name" and eqn.params.get("name") == MARK:  # zj.gather: gather here
            return [self.materialize(invals[0], anchor)]
        if prim is self.prims["scan"]:
            return self._scan(eqn, invals, anchor)
        if prim is self.prims["while"]:
            return self._while(eqn, invals, anchor)
        if prim in self.prims["calls"]:
            closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            if closed is not None and hasattr(closed, "jaxpr"):
                return self.run(closed.jaxpr, closed.consts, invals)
        sliced = self._layer_slice(eqn, invals)
        if sliced is not None:
            return sliced
        if prim.multiple_results or any(not isinstance(x, Lazy) and not _is_literal_like(x) for x in invals):
            self._prefetch(invals, order, anchor)
            if prim.name == "dot_general":
                out = _chunked_dot(eqn, invals, self.slicing)
                if out is not None:
                    return out
            if prim.name == "gather":
                out = _sharded_lookup(eqn, invals, self.slicing)
                if out is not None:
                    return out
            key = eqn_key(eqn)
            return _use_site(lambda vals: _bind(eqn, vals), invals, anchor, key and ("eqn", key), self.programs)
        # params alone (transpose, cast, reshape...): stay lazy, computed at the use site
        bases = []
        for x in invals:
            if isinstance(x, Lazy):
                for b in x.sources:
                    if all(b is not c for c in bases):
                        bases.append(b)

        def fn(*fulls, _invals=tuple(invals), _bases=tuple(bases)):
            vals = [x.fn(*[fulls[_bases.index(s)] for s in x.sources]) if isinstance(x, Lazy) else x
                    for x in _invals]
            return _bind(eqn, vals)[0]

        return [Lazy(tuple(bases), fn, _dims_after(eqn, invals), lazy_key(eqn, invals, bases))]

    def _layer_slice(self, eqn, invals) -> Optional[list]:
        """One layer of a stacked param (dynamic_slice of size 1 on dim 0, then squeeze)."""
        x = invals[0]
        if not isinstance(x, Lazy) or not x.is_param:
            return None
        base = x.sources[0]
        lay = base.lay
        name = eqn.primitive.name
        if name == "dynamic_slice" and lay.axis != 0:
            sizes = tuple(eqn.params["slice_sizes"])
            if sizes[0] == 1 and sizes[1:] == lay.shape[1:]:
                local = jax.lax.dynamic_slice_in_dim(_held(base, _anchor(invals)), invals[1], 1, axis=0)
                return [self.base(local, dataclasses.replace(lay, shape=(1,) + lay.shape[1:]))]
        if name in ("squeeze", "reshape") and lay.shape and lay.shape[0] == 1 and lay.axis != 0:
            if tuple(eqn.outvars[0].aval.shape) == lay.shape[1:]:
                shard = _held(base, _anchor(invals))
                return [self.base(shard.reshape(shard.shape[1:]), _inner(lay))]
        return None

    def _plain(self, x, anchor):
        return self.materialize(x, anchor) if isinstance(x, Lazy) else x

    def _scan(self, eqn, invals, anchor):
        p = eqn.params
        nc, ncarry = scan_counts(p)
        consts = [self._plain(x, anchor) for x in invals[:nc]]
        carry = [self._plain(x, anchor) for x in invals[nc:nc + ncarry]]
        xs_in = invals[nc + ncarry:]
        layouts = {i: _inner(x.sources[0].lay) for i, x in enumerate(xs_in)
                   if isinstance(x, Lazy) and x.is_param and x.sources[0].lay.axis != 0}
        xs = [_held(x.sources[0], anchor) if i in layouts else self._plain(x, anchor) for i, x in enumerate(xs_in)]
        body = p["jaxpr"]
        # each layer's backward pass gathers its param again from the stacked shards (a constant
        # of the loop, which the loop's backward reads in place) at the iteration's index: saved
        # for the backward pass, a layer's shard would be stacked again, a copy of them all
        index = jnp.arange(p["length"], dtype=jnp.int32)

        def step(c, x):
            x, i = x[:-1], x[-1]
            x = [self.base(v, layouts[k], (xs[k], i)) if k in layouts else v for k, v in enumerate(x)]
            out = self.run(body.jaxpr, body.consts, consts + list(c) + x)
            return out[:ncarry], out[ncarry:]

        step = self._loop_body(step, p["length"])
        carry, ys = jax.lax.scan(step, carry, xs + [index], length=p["length"], reverse=p["reverse"],
                                 unroll=p["unroll"])
        return list(carry) + list(ys)

    def _while(self, eqn, invals, anchor):
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts = [self._plain(x, anchor) for x in invals[:cn]]
        body_in = invals[cn:cn + bn]
        init = [self._plain(x, anchor) for x in invals[cn + bn:]]
        keep = [isinstance(x, Lazy) and x.is_param for x in body_in]
        shards = [_held(x.sources[0], anchor) if k else self._plain(x, anchor) for x, k in zip(body_in, keep)]
        lays = [x.sources[0].lay if k else None for x, k in zip(body_in, keep)]
        cond_j, body_j = p["cond_jaxpr"], p["body_jaxpr"]

        def cond(c):
            return jaxpr_as_fun(cond_j)(*cond_consts, *c)[0]

        def body(c):
            consts = [self.base(s, lay) if lay is not None else s for s, lay in zip(shards, lays)]
            return self.run(body_j.jaxpr, body_j.consts, consts + list(c))

        return list(jax.lax.while_loop(cond, self._loop_body(body, 1), list(init)))


def _held(base: Base, anchor):
    """``base``'s shard as a value a loop can slice: the shard itself, or for a param on NVMe the
    device's part read from the files (the whole stacked param, once, where the loop starts)."""
    if base.source is None:
        return base.shard
    return base.source(base.shard, anchor)


def _read(env: dict, v):
    """A variable's value in ``env``, or a literal's own."""
    return v.val if isinstance(v, Literal) else env[v]


def _is_literal_like(x) -> bool:
    """Python scalars and numpy constants folded into the equation."""
    return not hasattr(x, "aval") or not isinstance(x, Tracer)


def gathered_loss(loss_fn: Callable, plan: ZeroPlan, takes_rng: bool, sources: Optional[dict] = None):
    """``loss(shards, micro_batch, key)`` for stage 3: the user's loss on just-in-time gathered
    params; gradients w.r.t. the shards come out reduced into each device's shard (a
    reduce-scatter, or ZeRO++'s quantized exchanges: :class:`zerojax.stages._zeropp.Wire`).

    ``sources`` (params on NVMe): leaf path -> ``read(placeholder, anchor)``; that leaf's entry of
    ``shards`` is then a placeholder of the shard's shape, and each use reads the shard."""
    sources = sources or {}
    wire = Wire.of(plan)
    prefetch = int(plan.config.prefetch_bucket_size)

    def whole(lay, x):  # abstract whole param, for tracing the user's loss
        return jax.ShapeDtypeStruct(lay.shape, x.dtype)

    def loss(shards, mb, key):
        extra = (key,) if takes_rng else ()
        closed, out_shape = make_jaxpr_keeping_calls(loss_fn, plan.map(whole, shards), mb, *extra)
        interp = _Interpreter(wire, prefetch, Slicing.of(plan.config), int(plan.config.max_reuse_distance),
                              int(plan.config.max_live_parameters))
        lazies = plan.map(lambda lay, x: interp.base(x, lay, source=sources.get(lay.path))
                          if lay.params_partitioned else x, shards)
        flat = jax.tree_util.tree_leaves((lazies, mb) + extra, is_leaf=lambda x: isinstance(x, Lazy))
        out = interp.run(closed.jaxpr, closed.consts, flat)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

    return loss
