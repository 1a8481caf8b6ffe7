"""The GPT of :mod:`zerojax.models.gpt` as a :class:`zerojax.PipelineModel`.

Embed (token and position tables) on the first stage, the stacked blocks split over the
stages, and a head (final layer norm and its own output projection: the tables are not tied,
so no stage needs another's params) on the last::

    cfg = GPTConfig(vocab=64, n_layer=4, d_model=32, n_head=2, seq_len=8)
    pipe, params = gpt_pipeline(cfg), init_pipeline_params(cfg, jax.random.PRNGKey(0))
    loss = pipe.loss(params, {"tokens": int32[B, seq_len + 1]})
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.models import gpt
from zerojax.pipeline._model import PipelineModel

__all__ = ["gpt_pipeline", "init_pipeline_params"]


def init_pipeline_params(cfg: gpt.GPTConfig, key):
    """{"embed": {wte, wpe}, "blocks": stacked on n_layer, "head": {ln_f, out}}."""
    k_model, k_out = jax.random.split(key)
    full = gpt.init_params(gpt.GPTConfig(**{**cfg.__dict__, "scan": True}), k_model)
    out = jax.random.normal(k_out, (cfg.d_model, cfg.vocab)) * 0.02
    return {"embed": {"wte": full["wte"], "wpe": full["wpe"]}, "blocks": full["blocks"],
            "head": {"ln_f": full["ln_f"], "out": out}}


def gpt_pipeline(cfg: gpt.GPTConfig, **options) -> PipelineModel:
    """Next-token cross-entropy on ``batch["tokens"]`` (int[B, T + 1]); ``options`` go to PipelineModel."""

    def embed(p, batch):
        tokens = batch["tokens"][:, :-1]
        return p["wte"][tokens] + p["wpe"][: tokens.shape[1]].astype(p["wte"].dtype)

    def block(p, h):
        return gpt._block(cfg, h, p)

    def head(p, h, batch):
        h = gpt._layer_norm(h, p["ln_f"])
        logits = (h @ p["out"].astype(h.dtype)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1).mean()

    return PipelineModel(embed=embed, block=block, head=head, **options)
