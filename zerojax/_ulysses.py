"""Ulysses sequence parallelism: attention over a sequence split on the mesh's "seq" axis.

With ``sequence_parallel_size`` N (``ZeroConfig`` or the DeepSpeed key), the step's mesh is
``("data", "seq")``: each batch leaf's dimension 1 is split over N devices. Everything but
attention is per token, so GSPMD runs it on the local slice; attention needs the whole sequence.
:func:`ulysses_attention` turns the sequence split into a head split with one all-to-all per
tensor (q, k, v), attends over the whole sequence for H/N heads, and turns the output back with
one more all-to-all (4·s·h/N elements per device per layer)::

    def attend(q, k, v):                       # [batch, seq, heads, head_dim]
        return zj.ulysses_attention(q, k, v, causal=True)

Without a "seq" axis (or with one of size 1) it is plain attention, so a model written with it
runs unchanged anywhere.
"""
from __future__ import annotations

import contextvars
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._compat import shard_map
from zerojax._errors import ConfigError
from zerojax._mesh import SEQ
from zerojax._remat import traced_with

__all__ = ["AUTO_CHUNK", "COMM_DTYPES", "SEQ", "attention", "comm_scope", "seq_size", "ulysses_attention"]

# seq_parallel_comm_dtype's names (DeepSpeed's seq_parallel_communication_data_type values)
COMM_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# the comm dtype of the step being traced (None: outside a step, or its inputs' own)
_COMM: contextvars.ContextVar = contextvars.ContextVar("zerojax_seq_comm_dtype", default=None)

def seq_size() -> int:
    """The size of the automatic "seq" axis of the mesh being traced under (1 when none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not getattr(mesh, "axis_names", ()) or SEQ not in mesh.axis_names:
        return 1
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    if "Manual" in str(types.get(SEQ, "")):
        return 1  # already inside a body manual over "seq": the caller split it by hand
    return int(dict(mesh.shape)[SEQ])


# the query rows above which attention runs a chunk of queries at a time (auto chunk)
AUTO_CHUNK = 512


def _chunk_rows(sq: int, chunk: Optional[int]) -> int:
    """The query rows of one chunk: ``chunk`` as given, or, when None, the whole sequence up to
    :data:`AUTO_CHUNK` rows and past it the sequence in equal chunks of at most that many."""
    if chunk is None:
        return sq if sq <= AUTO_CHUNK else -(-sq // -(-sq // AUTO_CHUNK))
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"attention: chunk={chunk!r} is not a positive number of query rows. Fix: pass an "
                         f"int >= 1, or chunk=None to choose ({AUTO_CHUNK} rows at most per chunk)")
    return min(chunk, sq)


def _whole(q, k, v, causal, mask, bias, q_offset):
    """Attention for every query at once: the scores [batch, heads, q, k] exist whole."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    qg = q.reshape(b, sq, hk, g, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = scores.reshape(b, h, sq, k.shape[1])
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    neg = jnp.finfo(jnp.float32).min
    if causal:
        rows = jnp.arange(sq)[:, None] + q_offset
        cols = jnp.arange(k.shape[1])[None, :]
        scores = jnp.where(cols <= rows, scores, neg)
    if mask is not None:
        scores = jnp.where(mask, scores, neg)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    probs = probs.reshape(b, hk, g, sq, k.shape[1])
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, sq, h, d).astype(q.dtype)


def _by_rows(x, sq: int, n: int, c: int, fill):
    """A [.., q or 1, k] mask or bias as n chunks of c rows on a leading axis (None: rows broadcast)."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if x.shape[2] == 1:
        return None
    x = jnp.pad(x, [(0, 0), (0, 0), (0, n * c - sq), (0, 0)], constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[:2] + (n, c) + x.shape[3:]), 2, 0)


def attention(q, k, v, causal: bool = True, mask=None, bias=None, q_offset: int = 0,
              chunk: Optional[int] = None):
    """softmax(q k^T / sqrt(d) + bias) v over [batch, seq, heads, head_dim], the softmax in fp32.

    k and v may have fewer heads (GQA/MQA): query head i reads kv head i // (heads / kv_heads).
    ``mask``: bool, broadcastable to [batch, heads, q_len, k_len], True where a query may attend.
    ``bias``: added to the scores, broadcastable the same way. ``q_offset``: the position of the
    first query (the causal mask compares it with the key positions 0..k_len-1).

    ``chunk``: how many query rows attend at a time. The scores of one chunk,
    [batch, heads, chunk, k_len] in fp32, are all that exists of them, in the forward pass and
    the backward pass (which computes a chunk's scores again from q, k and v instead of keeping
    them), so memory grows linearly with the sequence. None (the default) attends whole up to
    :data:`AUTO_CHUNK` query rows and past that in equal chunks of at most that many; a chunk
    that does not divide the queries pads the last one (the padding is dropped). The values
    are those of the whole computation::

        out = attention(q, k, v, chunk=256)     # q: [2, 4096, 8, 64] -> 16 chunks of 256 rows
    """
    sq = q.shape[1]
    c = _chunk_rows(sq, chunk)
    if c >= sq:
        return _whole(q, k, v, causal, mask, bias, q_offset)
    n = -(-sq // c)
    qs = jnp.pad(q, [(0, 0), (0, n * c - sq), (0, 0), (0, 0)])
    qs = jnp.moveaxis(qs.reshape((q.shape[0], n, c) + q.shape[2:]), 1, 0)  # [n, b, c, h, d]
    ms = None if mask is None else _by_rows(mask, sq, n, c, True)
    bs = None if bias is None else _by_rows(bias, sq, n, c, 0)
    starts = jnp.arange(n) * c + q_offset

    # prevent_cse=False: inside a scan nothing can merge the recomputation with the forward
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(q, start, m, b):
        return _whole(q, k, v, causal, mask if m is None else m, bias if b is None else b, start)

    def body(_, xs):
        qc, start, m, b = xs
        return None, one(qc, start, m, b)

    _, out = jax.lax.scan(body, None, (qs, starts, ms, bs))
    out = jnp.moveaxis(out, 0, 1).reshape((q.shape[0], n * c) + q.shape[2:])
    return out[:, :sq]


def _check_heads(h: int, hk: int, n: int) -> int:
    """How many times each kv head is repeated (1: the kv heads split over "seq" as they are)."""
    if h % n:
        raise ConfigError(f"ulysses_attention: {h} query heads do not divide over sequence_parallel_size={n} "
                          f"(each device attends for heads / {n} heads). Fix: use a sequence_parallel_size that "
                          f"divides {h}")
    if h % hk:
        raise ConfigError(f"ulysses_attention: {h} query heads are not a multiple of {hk} key/value heads. Fix: "
                          "give k and v a head count that divides q's")
    if hk % n == 0:
        return 1
    if n % hk == 0:
        return n // hk  # as DeepSpeed: each device gets one copy of its kv head
    raise ConfigError(f"ulysses_attention: {hk} key/value heads neither divide over nor divide "
                      f"sequence_parallel_size={n}. Fix: use a sequence_parallel_size that {hk} divides or that "
                      f"divides {hk}")


def comm_scope(fn: Callable, dtype: Optional[str]) -> Callable:
    """``fn`` (a loss) that traces with ``dtype`` (the config's ``seq_parallel_comm_dtype``) as the
    type every :func:`ulysses_attention` it calls carries over its all-to-alls."""

    return traced_with(_COMM, dtype, fn)


def _wire_dtype(comm_dtype: Optional[str]):
    """The dtype the all-to-alls carry q, k, v and the output in (None: their own)."""
    name = _COMM.get() if comm_dtype is None else comm_dtype
    if name is None or name == "fp32":
        return None  # an all-to-all moves values without adding them: a wider type changes none
    if name not in COMM_DTYPES:
        raise ConfigError(f"ulysses_attention: comm_dtype={name!r} is not one of {sorted(COMM_DTYPES)}. Fix: "
                          "use \"bf16\" or \"fp16\" to halve the all-to-all bytes, \"fp32\" to keep the inputs' type")
    return COMM_DTYPES[name]


def ulysses_attention(q, k, v, causal: bool = True, mask=None, bias=None, chunk: Optional[int] = None,
                      comm_dtype: Optional[str] = None):
    """Attention over q, k, v of [batch, seq, heads, head_dim] whose seq may be split over "seq".

    Under a mesh with a "seq" axis of N > 1 (the step of ``sequence_parallel_size`` N): all-to-all
    from the sequence split to a head split, attention over the whole sequence for heads / N
    heads (the causal mask from global positions), all-to-all back. Query heads must divide N
    (:class:`~zerojax.ConfigError` otherwise); key/value heads must divide N, or N divide by them
    (they are then repeated, as DeepSpeed does). ``mask`` (bool, True = attend) and ``bias`` are
    given whole, broadcastable to [batch, heads, seq, seq]. Elsewhere it is :func:`attention`.

    ``chunk``: query rows attended at a time (:func:`attention`; None chooses). ``comm_dtype``:
    "bf16" or "fp16" carries q, k, v and the output over the all-to-alls in that type (cast back
    after); "fp32" leaves them as they are; None reads the step's config
    (``seq_parallel_comm_dtype``, DeepSpeed's ``seq_parallel_communication_data_type``).
    """
    wire = _wire_dtype(comm_dtype)
    n = seq_size()
    if n == 1:
        return attention(q, k, v, causal=causal, mask=mask, bias=bias, chunk=chunk)
    h, hk = q.shape[2], k.shape[2]
    rep = _check_heads(h, hk, n)
    if q.shape[1] % n:
        raise ConfigError(f"ulysses_attention: sequence length {q.shape[1]} does not divide over "
                          f"sequence_parallel_size={n}. Fix: pad the sequence to a multiple of {n}")
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    mesh = jax.sharding.get_abstract_mesh()
    split = P(None, SEQ)
    q, k, v = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, split)) for x in (q, k, v))
    extras = [x for x in (mask, bias) if x is not None]

    def a2a(x, split_axis, concat_axis):
        y = x if wire is None else x.astype(wire)
        return jax.lax.all_to_all(y, SEQ, split_axis, concat_axis, tiled=True).astype(x.dtype)

    def body(q, k, v, *extra):
        # [b, s/N, H, d] -> [b, s, H/N, d]: scatter heads, gather the sequence
        q, k, v = (a2a(x, 2, 1) for x in (q, k, v))
        extra = list(extra)
        idx = jax.lax.axis_index(SEQ)

        def heads_of(x):  # the local heads of a [.., heads or 1, q, k] mask or bias
            x = jnp.asarray(x)
            if x.ndim == 4 and x.shape[1] > 1:
                per = x.shape[1] // n
                return jax.lax.dynamic_slice_in_dim(x, idx * per, per, axis=1)
            return x

        m = heads_of(extra.pop(0)) if mask is not None else None
        bi = heads_of(extra.pop(0)) if bias is not None else None
        out = attention(q, k, v, causal=causal, mask=m, bias=bi, chunk=chunk)
        return a2a(out, 1, 2)

    specs = (split, split, split) + tuple(P() for _ in extras)
    return shard_map(body, mesh, in_specs=specs, out_specs=split, manual_axes={SEQ})(q, k, v, *extras)
