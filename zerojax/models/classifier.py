"""A GPT text classifier: the GPT of :mod:`zerojax.models.gpt` with a linear head on its final
hidden state, mean-pooled over the sequence's tokens::

    backbone = gpt.init_params(model_config(), jax.random.PRNGKey(0))   # or a pretrained one
    params = init_classifier(backbone, num_classes, jax.random.PRNGKey(seed))
    state = zj.shard_train_state(params, tx, mesh=mesh, config=config)
    step = zj.make_train_step(loss_fn, state)
    accuracy(state.full_params(), heldout)

Layout: every 2-D weight is ``[in, out]``, applied as ``x @ kernel`` (``attn.qkv``,
``attn.proj``, ``mlp.fc``, ``mlp.proj`` of each block and ``head.kernel``), except the two
tables indexed by id: ``wte`` ``[vocab, d_model]`` (the word embedding, which the classifier
does not use as an output layer) and ``wpe`` ``[seq_len, d_model]``. Params:
``{"backbone": <gpt params>, "head": {"kernel": [d_model, num_classes], "bias": [num_classes]}}``;
the GPT's configuration is read from the params' shapes (heads of width ``HEAD_DIM``), so
``loss_fn`` and ``accuracy`` need nothing else. Data and batches: ``{"tokens": int32[N, seq_len]``
(0-padded), ``"length": int32[N]``, ``"label": int32[N]}``.

``examples/finetune_classifier.py`` fine-tunes it on a task that ships with Python (which
standard-library package a docstring paragraph comes from): the data are built in
``examples/classifier_data.py``, the backbone's pretraining and the fine-tuning loop are in
``examples/classifier_training.py``.
"""
from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax._errors import ConfigError
from zerojax.models import gpt
from zerojax.models.gpt import GPTConfig

VOCAB = 2048  # the backbone's default vocabulary (the task's: its most frequent words and the reserved ids)
SEQ_LEN = 48  # the backbone's default tokens per sequence
HEAD_DIM = 32

Data = Dict[str, np.ndarray]  # {"tokens": int32[N, T], "length": int32[N], "label": int32[N]}


def model_config(d_model: int = 96, n_layer: int = 3, seq_len: int = SEQ_LEN, vocab_size: int = VOCAB) -> GPTConfig:
    """The backbone's GPTConfig: heads of width HEAD_DIM."""
    if d_model % HEAD_DIM:
        raise ConfigError(f"d_model={d_model} must be a multiple of HEAD_DIM={HEAD_DIM}")
    return GPTConfig(vocab=vocab_size, n_layer=n_layer, d_model=d_model, n_head=d_model // HEAD_DIM,
                     seq_len=seq_len)


def config_of(backbone) -> GPTConfig:
    """The GPTConfig of a backbone params tree (heads of width HEAD_DIM)."""
    vocab, d = backbone["wte"].shape
    scan = isinstance(backbone["blocks"], dict)
    n_layer = backbone["blocks"]["ln1"]["scale"].shape[0] if scan else len(backbone["blocks"])
    return GPTConfig(vocab=vocab, n_layer=n_layer, d_model=d, n_head=d // HEAD_DIM,
                     seq_len=backbone["wpe"].shape[0], scan=scan)


def hidden_states(backbone, tokens):
    """tokens int[B, T] -> the final layer-normed hidden states [B, T, d_model]."""
    return gpt.hidden_states(config_of(backbone), backbone, tokens)


def logits(params, batch):
    """Class logits float32[B, num_classes]: the head on the mean hidden state of the paragraph's
    tokens (attention is causal, so the padding after them changes nothing before it)."""
    h = hidden_states(params["backbone"], batch["tokens"]).astype(jnp.float32)
    mask = (jnp.arange(h.shape[1])[None, :] < batch["length"][:, None]).astype(jnp.float32)
    pooled = (h * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1.0)
    head = params["head"]
    return pooled @ head["kernel"].astype(jnp.float32) + head["bias"].astype(jnp.float32)


def loss_fn(params, batch):
    """Mean cross-entropy of the labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, batch), batch["label"]).mean()


_predict = jax.jit(lambda params, batch: jnp.argmax(logits(params, batch), axis=-1))


def predict(params, data: Data, batch_size: int = 256) -> np.ndarray:
    """Predicted labels int[N], in chunks of ``batch_size``, on one device."""
    # params sharded over a mesh would make every chunk a program replicated on all its devices
    params = jax.device_put(jax.device_get(params), jax.devices()[0])
    n, out = len(data["label"]), []
    batch_size = max(1, min(batch_size, n))
    for i in range(0, n, batch_size):
        # the last chunk is padded to batch_size rows, so every chunk runs the one compiled program
        chunk = {k: np.resize(data[k][i:i + batch_size], (batch_size,) + data[k].shape[1:])
                 for k in ("tokens", "length", "label")}
        out.append(np.asarray(_predict(params, chunk))[:min(batch_size, n - i)])
    return np.concatenate(out) if out else np.zeros((0,), np.int32)


def accuracy(params, data: Data, batch_size: int = 256) -> float:
    """Fraction of ``data`` whose predicted label is its label."""
    if not len(data["label"]):
        raise ConfigError("accuracy of an empty data set")
    return float(np.mean(predict(params, data, batch_size) == data["label"]))


def init_classifier(backbone, num_classes: int, rng) -> dict:
    """``{"backbone": backbone, "head": ...}``, the head drawn from N(0, 0.02^2)."""
    d = backbone["wte"].shape[1]
    kernel = jax.random.normal(rng, (d, num_classes), jnp.float32) * 0.02
    return {"backbone": backbone, "head": {"kernel": kernel, "bias": jnp.zeros((num_classes,), jnp.float32)}}


__all__ = ["HEAD_DIM", "SEQ_LEN", "VOCAB", "Data", "accuracy", "config_of", "hidden_states", "init_classifier",
           "logits", "loss_fn", "model_config", "predict"]
