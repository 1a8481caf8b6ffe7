"""Cross-entropy of a language-model head without the whole ``[batch, seq, vocab]`` logits.

    loss = zj.tiled_cross_entropy(hidden, params["lm_head"], labels, chunk_size=1024)
    # hidden [B, S, D], lm_head [D, V], labels int[B, S] (-100: ignored)

At long sequences the logits are the largest tensor of a step: 32K tokens x a 128K vocabulary
in fp32 is 16 GiB, more than the whole model of a 7B network in bf16. Here the sequence is cut
into chunks of ``chunk_size`` tokens; a ``lax.scan`` computes each chunk's logits and loss and
keeps only the summed loss, and each chunk is a ``jax.checkpoint`` that saves nothing but its
inputs, so the backward pass computes a chunk's logits again instead of keeping them. At most
one chunk's logits (``B x chunk_size x V``) exist at a time, forward and backward (ALST's tiled
logits and loss, arXiv 2506.13996).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax._errors import ConfigError

__all__ = ["tiled_cross_entropy"]


def _check(hidden, head_weight, labels, chunk_size):
    if getattr(hidden, "ndim", None) != 3:
        raise ConfigError(f"tiled_cross_entropy: hidden must be [batch, seq, d_model], got shape "
                          f"{getattr(hidden, 'shape', type(hidden).__name__)}. Fix: pass the last hidden states "
                          "before the head, unflattened")
    b, s, d = hidden.shape
    if getattr(head_weight, "ndim", None) != 2 or head_weight.shape[0] != d:
        raise ConfigError(f"tiled_cross_entropy: head_weight must be [d_model={d}, vocab], got shape "
                          f"{getattr(head_weight, 'shape', None)}. Fix: pass the head's kernel, or "
                          "embedding.T for a tied embedding")
    if tuple(getattr(labels, "shape", ())) != (b, s) or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ConfigError(f"tiled_cross_entropy: labels must be integers of shape [batch, seq] = {(b, s)}, got "
                          f"{getattr(labels, 'dtype', None)}{tuple(getattr(labels, 'shape', ()))}. Fix: pass the "
                          "target token ids, already shifted, with ignore_index where no loss is wanted")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"tiled_cross_entropy: chunk_size={chunk_size!r} must be an int >= 1 (tokens of the "
                          "sequence per chunk). Fix: use e.g. 1024")


def tiled_cross_entropy(hidden, head_weight, labels, *, chunk_size: int = 1024, ignore_index: int = -100):
    """The mean cross-entropy of ``hidden @ head_weight`` against ``labels``, over the labels
    that are not ``ignore_index``, computed ``chunk_size`` tokens of the sequence at a time.

    ``hidden``: ``[batch, seq, d_model]``; ``head_weight``: ``[d_model, vocab]`` (bf16 or fp32;
    the logits are accumulated and the loss computed in fp32); ``labels``: int ``[batch, seq]``.
    Equal, value and gradients, to ``optax.softmax_cross_entropy_with_integer_labels`` on the
    full logits averaged over the kept labels. A sequence that ``chunk_size`` does not divide is
    padded to whole chunks with ignored labels (the padding adds nothing to the loss). With no
    label kept the loss is 0 (and so are the gradients), not 0/0.

    Peak memory of the logits: ``batch x min(chunk_size, seq) x vocab`` fp32 values, in the
    forward and in the backward pass (each chunk's logits are recomputed there). The price is
    one more ``hidden @ head_weight`` per chunk in the backward pass.
    """
    _check(hidden, head_weight, labels, chunk_size)
    b, s, d = hidden.shape
    chunk = min(chunk_size, s)
    n = -(-s // chunk)
    pad = n * chunk - s
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)), constant_values=ignore_index)
    # chunks on a leading axis for the scan: [n, batch, chunk, ...]
    hs = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)
    ys = labels.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint  # saves the chunk's inputs only: its logits are recomputed in the backward pass
    def chunk_loss(h, y, w):
        logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
        keep = y != ignore_index
        picked = jnp.take_along_axis(logits, jnp.where(keep, y, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(keep, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0))

    def body(total, xs):
        h, y = xs
        return total + chunk_loss(h, y, head_weight), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ys))
    kept = jnp.sum(labels != ignore_index)
    return total / jnp.maximum(kept, 1).astype(jnp.float32)
