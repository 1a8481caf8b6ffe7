"""The values of the stage-3 replay (:mod:`zerojax.stages._stage3`): a stored shard and its lazy
gathered form, and the points where a gather is issued (a use site). The operations that read a
large param in part (matmuls in slices, sharded embedding lookups) without gathering it whole
are :mod:`zerojax.stages._stage3_large`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from zerojax._compat import Tracer, to_device_memory
from zerojax._plan import LeafLayout
from zerojax.stages import _collectives as C
from zerojax.stages._reuse import Fetches
from zerojax.stages._zeropp import Wire

MARK = "zerojax_gather"


def gather(tree):
    """Mark where a stage-3 step should gather ``tree``'s params (the identity otherwise)."""
    return jax.tree_util.tree_map(lambda x: checkpoint_name(x, MARK), tree)


def _tie(x, anchor):
    """``x`` made to depend on ``anchor`` without changing its value."""
    return x if anchor is None else _tied(x, anchor)


@functools.partial(jax.jit, inline=True)  # a call: traced and linearized once per pair of types
def _tied(x, anchor):
    a = jnp.ravel(anchor)[0] if anchor.ndim else anchor
    if not jnp.issubdtype(x.dtype, jnp.floating):  # integers (quantized rows): ``0 * a`` would fold
        return jax.lax.optimization_barrier((x, a))[0]
    if not jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.float32)
    return x + jnp.zeros((), x.dtype) * jax.lax.stop_gradient(a).astype(x.dtype)


def _bring(base: "Base", shard, anchor):
    """The shard ``shard`` of ``base``'s param in device memory, after ``anchor``: moved from host
    memory (offloaded params), or read from the files where the params live on NVMe
    (``base.source``: ``shard`` is then a placeholder of its shape, and the read depends on
    ``anchor``, so it happens where the step needs the param, not at its start)."""
    if base.source is None:
        return _tie(to_device_memory(shard), anchor)
    return base.source(shard, anchor)


def _gather_again(full, base: "Base", anchor):
    """``full`` gathered anew from ``base``'s shard (after ``anchor``): the forward pass moves the
    param again instead of keeping ``full`` alive; the cotangent is handed to ``full``, so all
    uses' cotangents still meet before the param's one reduction."""
    lay, wire = base.lay, base.wire

    def gathered(full, shard, anchor):  # ``full`` is not read: only its cotangent matters
        return wire.gather_values(_bring(base, shard, anchor), lay)[0]

    again = jax.custom_vjp(gathered)
    again.defvjp(lambda *args: (gathered(*args), None), lambda _, ct: (ct, None, None))
    return again(full, base.shard, anchor)


class Base:
    """A partitioned param not gathered yet: its local shard, layout and forward gather."""

    __slots__ = ("shard", "lay", "full", "secondary", "wire", "fetches", "last_use", "kept", "stacked", "source")

    def __init__(self, shard, lay: LeafLayout, wire: Wire, fetches: Optional[Fetches] = None, stacked=None,
                 source: Optional[Callable] = None):
        self.shard, self.lay, self.full, self.secondary, self.wire = shard, lay, None, None, wire
        # params on NVMe: ``source(placeholder, anchor)`` reads this device's shard from the files
        self.source = source
        # one layer of a loop: (the loop's stacked shards, this iteration's index), ``shard`` being
        # that slice of them
        self.stacked = stacked
        self.fetches = Fetches(math.inf) if fetches is None else fetches
        self.last_use = None  # Fetches.count after the last use of ``full``; None: not used yet
        self.kept = None  # the gathered copy held for the backward pass, once one use keeps it

    @property
    def axis_name(self) -> str:
        return self.wire.axis_name

    @property
    def residual(self):
        """What the backward pass gathers the param from: the hpZ secondary partition (kept
        from the forward gather), else the shard itself; in a loop over stacked layers, the
        stacked shards and the iteration's index, so that the loop saves an index per iteration
        for its backward pass, not a copy of every layer's shard (:meth:`shard_of`)."""
        if self.secondary is not None:
            return self.secondary
        return self.shard if self.stacked is None else self.stacked

    def shard_of(self, residual):
        """The shard (or secondary partition) :attr:`residual` holds."""
        if self.secondary is None and self.stacked is not None:
            stacked, index = residual
            return jax.lax.dynamic_index_in_dim(stacked, index, 0, keepdims=False)
        return residual

    def gather_forward(self, anchor):
        if self.full is None:
            # the gather's transpose is the gradient reduction: all use sites' cotangents are
            # summed first, so a tied param is reduced once
            # an offloaded shard comes from host memory just before its gather
            self.full, self.secondary = _shared(_one_gather, self.wire, self.lay)(
                _bring(self, self.shard, anchor))
        return self.full

    def fetch(self, anchor):
        """The whole param at a use site: the gathered copy, or a new gather when more than
        ``max_reuse_distance`` elements of params were used since the copy's last use."""
        if self.full is not None and self.last_use is not None \
                and self.fetches.count - self.last_use > self.fetches.limit:
            self.full = _gather_again(self.full, self, anchor)
            self.last_use = None
        return self.gather_forward(anchor)


def _again(base: "Base", residual, anchor):
    """The backward pass's shard from a use site's residual: the hpZ secondary partition as it is
    kept, else the shard brought over (or read from the files) again."""
    if base.source is not None and base.secondary is not None:
        return residual
    return _bring(base, base.shard_of(residual), anchor)


def _gather_together(bases: Sequence[Base], anchor) -> None:
    """Forward gathers issued at one point, as one all-gather of their shards laid end to end
    (per dtype; DeepSpeed's coalesced gather of a prefetch bucket): its transpose is then one
    reduce-scatter of their gradients (with hpZ each keeps its secondary partition). Quantized
    wires (qwZ, qgZ) gather param by param."""
    wire = bases[0].wire if bases else None
    if len(bases) < 2 or wire.quantized:
        for b in bases:
            b.gather_forward(anchor)
        return
    fulls = _shared(_bucket_gather, wire, *[b.lay for b in bases])(
        [_bring(b, b.shard, anchor) for b in bases])
    for b, full in zip(bases, fulls):
        b.full = full
        if wire.hpz:
            b.secondary = wire.secondary_of(full, b.lay)


def _shared(make: Callable, wire: Wire, *lays: LeafLayout) -> Callable:
    """``make(wire, *lays)``, a function of the params' shards, as one inlined ``jit`` per
    wire and layouts (without their names): a Python loop's layers share it, so JAX traces and
    differentiates it once, not at every layer."""
    try:
        return _shared_jit(make, wire, *[dataclasses.replace(lay, path="") for lay in lays])
    except TypeError:  # a layout that cannot be hashed: the function itself
        return make(wire, *lays)


@functools.lru_cache(maxsize=4096)
def _shared_jit(make: Callable, wire: Wire, *lays: LeafLayout) -> Callable:
    return jax.jit(make(wire, *lays), inline=True)


def _one_gather(wire: Wire, lay: LeafLayout) -> Callable:
    """A param's shard gathered whole (and its hpZ secondary partition)."""
    return lambda shard: wire.gather(shard, lay)


def _bucket_gather(wire: Wire, *lays: LeafLayout) -> Callable:
    """The shards of params with layouts ``lays`` gathered as one all-gather, laid end to end;
    their cotangents reduce-scattered as one."""

    # the reduce-scatter written out: as the transpose of the slices of one gathered buffer,
    # each param's cotangent would be padded to the whole buffer and summed
    # each param in a buffer of its own: a later read of one param (XLA recomputes GELU's input
    # ``x @ w + b`` in the backward pass) would otherwise hold the whole bucket until then
    @jax.custom_vjp
    def gathered(shards):
        return C.bucketed_gather(shards, lays, wire.axis_name, wire.n, math.inf, apart=True)

    scatter = _shared(_bucket_reduce, wire, *lays)  # run again at every layer's backward pass

    def reduced(_, cts):
        return (scatter(list(cts)),)

    gathered.defvjp(lambda shards: (gathered(shards), None), reduced)
    return gathered


def _bucket_reduce(wire: Wire, *lays: LeafLayout) -> Callable:
    """The cotangents of params with layouts ``lays``, reduce-scattered as one into their shards."""
    return lambda cts: C.bucketed_reduce_scatter(cts, list(lays), wire.axis_name, wire.n, math.inf)


@dataclasses.dataclass
class Lazy:
    """A value computed from params alone: ``fn(*whole params of sources)``."""

    sources: tuple  # Base, in order
    fn: Callable
    # for one source reached through shape-agnostic ops only (transposes, casts): the value's
    # axis for each of the param's axes, so ``fn`` may be applied to a slice of the param
    dims: Optional[tuple] = None
    # what ``fn`` computes, as a hashable structure (equal keys: the same computation of the
    # same-shaped params); None where it cannot be told
    key: Optional[tuple] = None

    @property
    def is_param(self) -> bool:
        """A param itself (not a transform of one)."""
        return self.fn is _identity


def _identity(full):
    return full


def _param(base: Base) -> Lazy:
    return Lazy((base,), _identity, tuple(range(len(base.lay.shape))), ("param",))


def eqn_key(eqn) -> Optional[tuple]:
    """An equation's primitive, params, output types and context (where it computes, its
    metadata), hashable; None where a param is not."""
    key = (eqn.primitive, tuple(sorted(eqn.params.items())), tuple(v.aval for v in eqn.outvars),
           getattr(eqn, "ctx", None))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def value_key(x) -> Optional[tuple]:
    """A constant folded into an equation (a Python or small numpy value), hashable."""
    if isinstance(x, (bool, int, float, complex)):
        return (type(x).__name__, x)
    if isinstance(x, (np.ndarray, np.generic)) and x.size <= 64:
        return (x.dtype.str, x.shape, x.tobytes())
    return None


def _lazy_part(x: Lazy, bases: Sequence[Base]) -> Optional[tuple]:
    """A lazy input's part of a key: its own key and where its sources sit among ``bases``."""
    if x.key is None:
        return None
    return x.key, tuple(next(k for k, b in enumerate(bases) if b is s) for s in x.sources)


def lazy_key(eqn, invals: list, bases: Sequence[Base]) -> Optional[tuple]:
    """``Lazy.key`` of ``eqn`` applied to ``invals`` (lazy values over ``bases``, constants)."""
    parts = [eqn_key(eqn)] + [_lazy_part(x, bases) if isinstance(x, Lazy) else value_key(x) for x in invals]
    return None if any(p is None for p in parts) else ("eqn",) + tuple(parts)


_SHAPE_AGNOSTIC = ("convert_element_type", "copy", "copy_p", "neg", "reduce_precision")


def _dims_after(eqn, invals) -> Optional[tuple]:
    """``Lazy.dims`` of ``eqn``'s output, when it keeps a one-param lazy value sliceable."""
    lazies = [x for x in invals if isinstance(x, Lazy)]
    if len(lazies) != 1 or len(invals) != 1 or lazies[0].dims is None or len(lazies[0].sources) != 1:
        return None
    dims = lazies[0].dims
    if eqn.primitive.name == "transpose":
        perm = tuple(eqn.params["permutation"])
        return tuple(perm.index(d) for d in dims)
    return dims if eqn.primitive.name in _SHAPE_AGNOSTIC else None


def _bind(eqn, invals):
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
        invals = list(subfuns) + list(invals)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def _derivative(apply, fulls, diffs, consts, ct):
    """The cotangents of ``apply(fulls, diffs, consts)``'s ``fulls`` and ``diffs`` for ``ct``."""
    _, vjp = jax.vjp(lambda f, d: apply(f, d, consts), fulls, diffs)
    return vjp(ct)


# ``stop_gradient`` as a call: JAX linearizes it once per shard type, not at every use site
_no_gradient = jax.jit(jax.lax.stop_gradient, inline=True)


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _use_site(op: Callable[[list], list], invals: list, anchor, op_key: Optional[tuple] = None,
              programs: Optional[dict] = None):
    """Apply ``op`` (an equation, as a function of its input values) where some inputs are
    lazy: gathered once in the forward pass, gathered again in the backward pass.

    ``op_key`` tells what ``op`` computes (hashable; None: unknown). With it, the backward
    pass's derivative of ``op`` is one jitted function per structure of use site, kept in
    ``programs``: the use sites of a Python loop's layers share it, so JAX traces and
    differentiates it once for all of them instead of each primitive at each site anew."""
    bases: List[Base] = []
    for x in invals:
        if isinstance(x, Lazy):
            for b in x.sources:
                if all(b is not c for c in bases):
                    bases.append(b)
    lazy_pos = [i for i, x in enumerate(invals) if isinstance(x, Lazy)]
    other_pos = [i for i, x in enumerate(invals) if not isinstance(x, Lazy)]
    diff_pos = [i for i in other_pos if _is_float(invals[i])]
    const_pos = [i for i in other_pos if not _is_float(invals[i])]

    def apply(fulls, diffs, consts):
        vals = list(invals)
        for i in lazy_pos:
            lz = invals[i]
            vals[i] = lz.fn(*[fulls[next(k for k, b in enumerate(bases) if b is s)] for s in lz.sources])
        for i, v in zip(diff_pos, diffs):
            vals[i] = v
        for i, v in zip(const_pos, consts):
            vals[i] = v
        return op(vals)

    @jax.custom_vjp
    def site(fulls, shards, diffs, consts):
        return apply(fulls, diffs, consts)

    def fwd(fulls, shards, diffs, consts):
        # residuals: the gathered params and their shards (or hpZ secondary partitions) and the
        # activations; the backward pass reads the gathered params it keeps and gathers the others
        # again from their shards (what it does not read, the compiler drops after the forward use)
        return apply(fulls, diffs, consts), (fulls, shards, diffs, consts)

    def bwd(res, ct):
        held, shards, diffs, consts = res
        ct_anchor = next((c for c in ct if hasattr(c, "dtype") and _is_float(c)), None)
        wholes = [h if k else b.wire.regather(_again(b, s, ct_anchor), b.lay, b.shard.dtype)
                  for h, s, b, k in zip(held, shards, bases, kept())]
        if program is not None and all(_is_float(c) for c in ct):
            d_fulls, d_diffs = program(wholes, diffs, consts, list(ct))
        else:
            d_fulls, d_diffs = _derivative(apply, wholes, diffs, consts, ct)
        return d_fulls, [None] * len(shards), d_diffs, [None] * len(consts)

    site.defvjp(fwd, bwd)
    program = None
    lazy_parts = tuple(_lazy_part(invals[i], bases) for i in lazy_pos)
    if op_key is not None and programs is not None and None not in lazy_parts:
        key = (op_key, len(invals), tuple(lazy_pos), tuple(diff_pos), tuple(const_pos), len(bases), lazy_parts)
        # the first site of a structure lends its ``apply``: an equal key computes the same
        program = programs.get(key)
        if program is None:
            program = programs[key] = jax.jit(functools.partial(_derivative, apply), inline=True)
    fetches = bases[0].fetches
    fulls = [b.fetch(anchor) for b in bases]
    fetches.used(bases)
    at, sizes, decided = fetches.count, [b.lay.size * fetches.repeat for b in bases], []

    def kept():
        if not decided:  # a copy another use already keeps costs nothing more
            decided.extend(fetches.keep_for_backward(
                at, [0 if b.kept is f else n for b, f, n in zip(bases, fulls, sizes)]))
            for b, f, k in zip(bases, fulls, decided):
                if k:
                    b.kept = f
        return decided

    shards = [_no_gradient(b.residual) for b in bases]
    return site(fulls, shards, [invals[i] for i in diff_pos], [invals[i] for i in const_pos])


def _inner(lay: LeafLayout) -> LeafLayout:
    """Layout of one slice along dim 0 of a stacked param (split along a later dim)."""
    return dataclasses.replace(lay, path=lay.path + "[i]", shape=lay.shape[1:], base_spec=lay.base_spec[1:],
                               axis=lay.axis - 1)


def _anchor(vals):
    """An activation the current operation reads (floating point preferred, e.g. not token ids)."""
    arrays = [v for v in vals if not isinstance(v, Lazy) and isinstance(v, Tracer)]
    return next((v for v in arrays if _is_float(v)), arrays[0] if arrays else None)


