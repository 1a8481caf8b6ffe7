"""A GPT-2-style decoder in plain JAX: params are a dict tree, the loss a pure function.

    cfg = GPTConfig(vocab=50257, n_layer=12, d_model=768, n_head=12, seq_len=1024)  # GPT-2 small
    params = init_params(cfg, jax.random.PRNGKey(0))
    loss = loss_fn(cfg)(params, {"tokens": int32[B, seq_len + 1]})
    loss = loss_fn(cfg)(params, {"inputs": int32[B, seq_len], "labels": int32[B, seq_len]})

``scan=True`` stacks the blocks (every block leaf gains a leading n_layer dim) and runs them
with ``lax.scan``; ``scan=False`` keeps a list of blocks and a Python loop.

Each block goes through ``zj.remat(..., when_configured=True)``: trained by a zerojax step whose
config has DeepSpeed's ``activation_checkpointing`` block, the blocks are checkpointed (their
inputs in host memory with ``"cpu_checkpointing": true``); without the block nothing changes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from zerojax._remat import remat
from zerojax._ulysses import ulysses_attention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    seq_len: int = 1024
    scan: bool = False
    attn_chunk: Optional[int] = None  # query rows attended at a time (zj.ulysses_attention; None chooses)

    @property
    def n_params(self) -> int:
        d = self.d_model
        block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return self.vocab * d + self.seq_len * d + self.n_layer * block + 2 * d


GPT2_SMALL = GPTConfig()


def _block_init(cfg: GPTConfig, key):
    d = cfg.d_model
    k = jax.random.split(key, 4)
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layer)
    return {
        "ln1": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
        "attn": {
            "qkv": {"kernel": jax.random.normal(k[0], (d, 3 * d)) * std, "bias": jnp.zeros((3 * d,))},
            "proj": {"kernel": jax.random.normal(k[1], (d, d)) * proj_std, "bias": jnp.zeros((d,))},
        },
        "ln2": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
        "mlp": {
            "fc": {"kernel": jax.random.normal(k[2], (d, 4 * d)) * std, "bias": jnp.zeros((4 * d,))},
            "proj": {"kernel": jax.random.normal(k[3], (4 * d, d)) * proj_std, "bias": jnp.zeros((d,))},
        },
    }


def init_params(cfg: GPTConfig, key):
    k_wte, k_wpe, k_blocks = jax.random.split(key, 3)
    keys = jax.random.split(k_blocks, cfg.n_layer)
    if cfg.scan:
        blocks = jax.vmap(lambda k: _block_init(cfg, k))(keys)
    else:
        blocks = [_block_init(cfg, k) for k in keys]
    return {
        "wte": jax.random.normal(k_wte, (cfg.vocab, cfg.d_model)) * 0.02,
        "wpe": jax.random.normal(k_wpe, (cfg.seq_len, cfg.d_model)) * 0.01,
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones((cfg.d_model,)), "bias": jnp.zeros((cfg.d_model,))},
    }


def _layer_norm(x, p):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _dense(x, p):
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)


def _block(cfg: GPTConfig, x, p):
    b, t, d = x.shape
    h = cfg.n_head
    qkv = _dense(_layer_norm(x, p["ln1"]), p["attn"]["qkv"])
    q, k, v = jnp.split(qkv.reshape(b, t, 3, h, d // h), 3, axis=2)
    # [b, t, heads, head_dim]; over a "seq" mesh axis, all-to-all to a head split and back
    y = ulysses_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], causal=True, chunk=cfg.attn_chunk).reshape(b, t, d)
    x = x + _dense(y, p["attn"]["proj"])
    m = jax.nn.gelu(_dense(_layer_norm(x, p["ln2"]), p["mlp"]["fc"]))
    return x + _dense(m, p["mlp"]["proj"])


def hidden_states(cfg: GPTConfig, params, tokens):
    """tokens int[B, T] -> the final layer-normed hidden states [B, T, d_model]."""
    t = tokens.shape[1]
    dtype = params["wte"].dtype
    x = params["wte"][tokens] + params["wpe"][:t].astype(dtype)
    # checkpointed only when the step's config has an activation_checkpointing block
    block = remat(functools.partial(_block, cfg), params_argnums=(1,), when_configured=True)
    if cfg.scan:
        x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
    else:
        for p in params["blocks"]:
            x = block(x, p)
    return _layer_norm(x, params["ln_f"])


def forward(cfg: GPTConfig, params, tokens):
    """tokens int[B, T] -> logits float32[B, T, vocab]; dtype follows the params."""
    x = hidden_states(cfg, params, tokens)
    return (x @ params["wte"].T.astype(x.dtype)).astype(jnp.float32)


def loss_fn(cfg: GPTConfig):
    """Next-token cross-entropy on ``batch["tokens"]`` (int[B, T + 1]), or on ``batch["inputs"]`` and
    ``batch["labels"]`` (int[B, T] each, shifted already: the form sequence parallelism splits)."""

    def loss(params, batch):
        if "inputs" in batch and "labels" in batch:
            inputs, targets = batch["inputs"], batch["labels"]
        else:  # a batch with neither form names the usual one in its KeyError
            inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        logits = forward(cfg, params, inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    return loss
