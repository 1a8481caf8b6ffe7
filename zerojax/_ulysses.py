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

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._compat import shard_map
from zerojax._errors import ConfigError
from zerojax._mesh import SEQ

__all__ = ["SEQ", "attention", "seq_size", "ulysses_attention"]

def seq_size() -> int:
    """The size of the automatic "seq" axis of the mesh being traced under (1 when none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not getattr(mesh, "axis_names", ()) or SEQ not in mesh.axis_names:
        return 1
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    if "Manual" in str(types.get(SEQ, "")):
        return 1  # already inside a body manual over "seq": the caller split it by hand
    return int(dict(mesh.shape)[SEQ])


def attention(q, k, v, causal: bool = True, mask=None, bias=None, q_offset: int = 0):
    """softmax(q k^T / sqrt(d) + bias) v over [batch, seq, heads, head_dim], the softmax in fp32.

    k and v may have fewer heads (GQA/MQA): query head i reads kv head i // (heads / kv_heads).
    ``mask``: bool, broadcastable to [batch, heads, q_len, k_len], True where a query may attend.
    ``bias``: added to the scores, broadcastable the same way."""
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


def ulysses_attention(q, k, v, causal: bool = True, mask=None, bias=None):
    """Attention over q, k, v of [batch, seq, heads, head_dim] whose seq may be split over "seq".

    Under a mesh with a "seq" axis of N > 1 (the step of ``sequence_parallel_size`` N): all-to-all
    from the sequence split to a head split, attention over the whole sequence for heads / N
    heads (the causal mask from global positions), all-to-all back. Query heads must divide N
    (:class:`~zerojax.ConfigError` otherwise); key/value heads must divide N, or N divide by them
    (they are then repeated, as DeepSpeed does). ``mask`` (bool, True = attend) and ``bias`` are
    given whole, broadcastable to [batch, heads, seq, seq]. Elsewhere it is :func:`attention`.
    """
    n = seq_size()
    if n == 1:
        return attention(q, k, v, causal=causal, mask=mask, bias=bias)
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

    def body(q, k, v, *extra):
        # [b, s/N, H, d] -> [b, s, H/N, d]: scatter heads, gather the sequence
        q, k, v = (jax.lax.all_to_all(x, SEQ, 2, 1, tiled=True) for x in (q, k, v))
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
        out = attention(q, k, v, causal=causal, mask=m, bias=bi)
        return jax.lax.all_to_all(out, SEQ, 1, 2, tiled=True)

    specs = (split, split, split) + tuple(P() for _ in extras)
    return shard_map(body, mesh, in_specs=specs, out_specs=split, manual_axes={SEQ})(q, k, v, *extras)
