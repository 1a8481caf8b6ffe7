"""Models written as JAX-native zoos write them (tunix's Qwen3 / Llama3, MaxText, gemma): einsum
attention weights with a heads dimension, GQA, a tied embedding, RMSNorm, a SwiGLU MLP, and the
zoo's own ('fsdp', 'tp') annotations.

AutoTP splits every attention projection by heads (q/k/v column parallel, the output projection
row parallel) and trains like plain optax; kv heads that do not divide the TP size stay whole and
are named; the model's own annotations train through ``zj.nnx_params(model, rules=...)``; an
annotation axis no rule maps is refused with the way out."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests.helpers import reference_run
from zerojax._autotp import autotp_leaves

VOCAB, D, HEADS, HEAD_DIM, FF, LAYERS, SEQ = 32, 16, 4, 8, 32, 2, 8
LR, STEPS = 1e-2, 3
OPTIMIZER = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}


def _param(rngs, shape, names, scale=0.2):
    init = nnx.with_partitioning(nnx.initializers.normal(scale), names)
    return nnx.Param(init(rngs.params(), shape))


class Einsum(nnx.Module):
    def __init__(self, spec, shape, names, rngs):
        self.spec = spec
        self.w = _param(rngs, shape, names)

    def __call__(self, x):
        return jnp.einsum(self.spec, x, self.w[...])


class RMSNorm(nnx.Module):
    def __init__(self, dim, rngs):
        self.w = nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("tp",))(rngs.params(), (dim,)))

    def __call__(self, x):
        return self.w[...] * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Attention(nnx.Module):
    def __init__(self, kv_heads, rngs):
        self.kv_heads = kv_heads
        self.q_proj = Einsum("BTD,DNH->BTNH", (D, HEADS, HEAD_DIM), ("fsdp", "tp", None), rngs)
        self.k_proj = Einsum("BSD,DKH->BSKH", (D, kv_heads, HEAD_DIM), ("fsdp", "tp", None), rngs)
        self.v_proj = Einsum("BSD,DKH->BSKH", (D, kv_heads, HEAD_DIM), ("fsdp", "tp", None), rngs)
        self.o_proj = Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), ("tp", None, "fsdp"), rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.kv_heads, HEADS // self.kv_heads, HEAD_DIM)  # GQA groups
        k, v = self.k_proj(x), self.v_proj(x)
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) * HEAD_DIM ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, t, HEADS, HEAD_DIM))


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = Einsum("BTD,DF->BTF", (D, FF), ("fsdp", "tp"), rngs)
        self.up_proj = Einsum("BTD,DF->BTF", (D, FF), ("fsdp", "tp"), rngs)
        self.down_proj = Einsum("BTF,FD->BTD", (FF, D), ("tp", "fsdp"), rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, kv_heads, rngs):
        self.input_layernorm = RMSNorm(D, rngs)
        self.attn = Attention(kv_heads, rngs)
        self.post_attention_layernorm = RMSNorm(D, rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, x):
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ZooLM(nnx.Module):
    """A tiny decoder in tunix's style; the embedding is tied to the output head."""

    def __init__(self, kv_heads=2, seed=0):
        rngs = nnx.Rngs(seed)
        self.embedder = nnx.Module()
        self.embedder.input_embedding = _param(rngs, (VOCAB, D), ("tp", "fsdp"), scale=1.0)
        self.layers = nnx.List([Block(kv_heads, rngs) for _ in range(LAYERS)])
        self.final_norm = RMSNorm(D, rngs)

    def __call__(self, ids):
        table = self.embedder.input_embedding[...]
        x = table[ids]
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x) @ table.T


def build(kv_heads=2):
    with nnx.use_eager_sharding(False):
        return ZooLM(kv_heads)


def lm_loss(merge):
    def loss_fn(params, batch):
        logits = merge(params)(batch["ids"])[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()
    return loss_fn


def batches(n=STEPS, size=8, seed=0):
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, VOCAB, (size, SEQ)).astype(np.int32)} for _ in range(n)]


def reference(loss_fn, params, data):
    """Plain optax on one device, fp32, no clipping."""
    tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    return reference_run(jax.device_put(params, jax.devices()[0]), tx, data, loss=loss_fn).params


def train(params, loss_fn, stage, data, param_specs=None):
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0, "optimizer": OPTIMIZER,
           "tensor_parallel": {"autotp_size": 2}, "zero_optimization": zero}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zj.AutoTPCoverageWarning)
        state, step = zj.initialize(params, loss_fn, cfg, param_specs=param_specs)
    assert dict(state.plan.mesh.shape) == {"data": 4, "model": 2} and step.train_batch_size == 8
    with step:
        for b in data:
            state, _ = step(state, b)
    return state


def assert_equal_to_optax(state, loss_fn, params, data, tol=2e-5):
    want = reference(loss_fn, params, data)
    got = state.full_params(jnp.float32)
    moved = 0.0
    for (path, x), y, x0 in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want),
                                jax.tree_util.tree_leaves(params), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=0, atol=tol, err_msg=jax.tree_util.keystr(path))
        moved = max(moved, float(np.max(np.abs(y - np.asarray(x0)))))
    assert moved > 1e-3  # the params did move: the comparison means something


def rules_of(params, n=2):
    return {lay.path: (lay.rule, lay.dim) for lay in autotp_leaves(params, n)}


ATTENTION = {"q_proj": ("column", 1), "k_proj": ("column", 1), "v_proj": ("column", 1), "o_proj": ("row", 0)}


# --------------------------------------------------------------------------- the rules
def test_autotp_splits_every_attention_projection_by_heads_and_names_what_it_leaves_whole():
    params, _, _ = zj.nnx_params(build())
    got = rules_of(params)
    for i in range(LAYERS):
        for name, want in ATTENTION.items():
            assert got[f"layers/{i}/attn/{name}/w"] == want, name
        assert got[f"layers/{i}/mlp/gate_proj/w"] == ("column", 1)
        assert got[f"layers/{i}/mlp/down_proj/w"] == ("row", 0)
        assert got[f"layers/{i}/input_layernorm/w"] == ("replicated", None)
    assert got["embedder/input_embedding"] == ("replicated", None)
    vocab = {lay.path: (lay.rule, lay.dim) for lay in autotp_leaves(params, 2, vocab_parallel=True)}
    assert vocab["embedder/input_embedding"] == ("vocab", 0)  # tunix's and gemma's name for the table

    with pytest.warns(zj.AutoTPCoverageWarning) as caught:
        plan = zj.ZeroPlan.create(params, zj.autotp_mesh(2), zj.ZeroConfig(stage=3, autotp_size=2))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "embedder/input_embedding (32, 16)" in text  # the one weight left whole, named once
    assert text.count("embedder/input_embedding") == 1 and "attn" not in text and "/w (16,)" not in text
    lines = {line.split()[0]: line for line in plan.describe().splitlines()[1:]}
    assert "model on dim 1" in lines["layers/0/attn/k_proj/w/value"]
    assert "model on dim 0" in lines["layers/1/attn/o_proj/w/value"]
    assert lines["layers/0/attn/q_proj/w/value"].endswith("P(None, 'model', None)")


def test_gemma_and_maxtext_layouts_by_heads():
    """gemma keeps q as [heads, d_model, head_dim] and k/v stacked [2, kv_heads, d_model, head_dim];
    MaxText's DenseGeneral [d_model, heads, head_dim] with a [heads, head_dim] bias; heads are found
    against the output projection's d_model."""
    z = np.zeros
    gemma = {"attn": {"q_einsum": {"w": z((4, 16, 8))}, "kv_einsum": {"w": z((2, 2, 16, 8))},
                      "attn_vec_einsum": {"w": z((4, 8, 16))}}}
    got = rules_of(gemma)
    assert got == {"attn/q_einsum/w": ("column", 0), "attn/kv_einsum/w": ("column", 1),
                   "attn/attn_vec_einsum/w": ("row", 0)}
    # the same names with d_model first (as some ports write kv_einsum): found against d_model
    assert rules_of({"attn": {"kv_einsum": {"w": z((2, 16, 2, 8))}, "attn_vec_einsum": {"w": z((4, 8, 16))}}})[
        "attn/kv_einsum/w"] == ("column", 2)
    maxtext = {"self_attention": {"query": {"kernel": z((16, 4, 8)), "bias": z((4, 8))},
                                  "key": {"kernel": z((16, 2, 8))}, "out": {"kernel": z((4, 8, 16)), "bias": z(16)}}}
    assert rules_of(maxtext) == {"self_attention/query/kernel": ("column", 1),
                                 "self_attention/query/bias": ("column", 0),
                                 "self_attention/key/kernel": ("column", 1),
                                 "self_attention/out/kernel": ("row", 0),
                                 "self_attention/out/bias": ("replicated", None)}
    # "out" is a row rule for [heads, head_dim, d_model] weights only: a 2-D head named out stays whole
    assert rules_of({"out": {"kernel": z((16, 4))}})["out/kernel"] == ("replicated", None)


def test_kv_heads_that_do_not_divide_the_tp_size_stay_whole_and_are_named():
    params, _, _ = zj.nnx_params(build(kv_heads=1))  # multi-query: one kv head, TP 2
    leaves = {lay.path: lay for lay in autotp_leaves(params, 2)}
    k = leaves["layers/0/attn/k_proj/w"]
    assert (k.rule, k.dim) == ("replicated", None) and "1 kv heads (dim 1) do not divide autotp_size 2" in k.why
    assert (leaves["layers/0/attn/q_proj/w"].rule, leaves["layers/0/attn/o_proj/w"].rule) == ("column", "row")
    with pytest.warns(zj.AutoTPCoverageWarning, match=r"layers/0/attn/k_proj/w \(16, 1, 8\): .*kv heads") as caught:
        zj.ZeroPlan.create(params, zj.autotp_mesh(2), zj.ZeroConfig(stage=2, autotp_size=2))
    text = str(caught[0].message)
    assert all(f"layers/{i}/attn/{n}/w" in text for i in range(LAYERS) for n in ("k_proj", "v_proj"))


# --------------------------------------------------------------------------- the model's own annotations
def test_own_annotations_through_rules_and_the_unmapped_axis_error():
    model = build()
    params, raw, merge = zj.nnx_params(model)
    assert raw["layers"][0]["attn"]["q_proj"]["w"].get_value() == P("fsdp", "tp", None)
    with pytest.raises(zj.ConfigError, match=r"annotation uses mesh axis 'tp'.*rules=.*\('tp', 'model'\)"):
        zj.shard_train_state(params, optax.sgd(0.1), mesh=zj.autotp_mesh(2), config=zj.ZeroConfig(stage=3),
                             param_specs=raw)
    unmapped = r"param 'embedder/input_embedding/value' is annotated \('tp', 'fsdp'\).*no axis named 'fsdp'"
    with pytest.raises(zj.ConfigError, match=unmapped + r".*\('fsdp', None\)"):
        zj.nnx_params(model, rules=[("tp", "model")])
    _, specs, _ = zj.nnx_params(model, rules=[("tp", "model"), ("fsdp", None)])
    attn = specs["layers"][1]["attn"]
    assert attn["q_proj"]["w"].get_value() == P(None, "model", None)
    assert attn["o_proj"]["w"].get_value() == P("model", None, None)
    assert specs["embedder"]["input_embedding"].get_value() == P("model", None)
    state = zj.shard_train_state(params, optax.sgd(0.1), mesh=zj.autotp_mesh(2),
                                 config=zj.ZeroConfig(stage=3, param_persistence_threshold=0), param_specs=specs)
    q = state.params["layers"][0]["attn"]["q_proj"]["w"].get_value()
    assert q.sharding.spec[1] == "model" and "data" in q.sharding.spec  # ZeRO adds "data" on a free dim


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize("stage", [3, 2])  # the first case is the quick tier's (tests/conftest.py)
def test_autotp_trains_like_plain_optax(stage):
    model = build()
    params, _, merge = zj.nnx_params(model)
    loss_fn, data = lm_loss(merge), batches()
    state = train(params, loss_fn, stage, data)
    stored = {jax.tree_util.keystr(p, simple=True, separator="/"): x
              for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    for i in range(LAYERS):
        for name, (_, dim) in ATTENTION.items():
            x = stored[f"layers/{i}/attn/{name}/w/value"]
            assert x.sharding.spec[dim] == "model", name
            assert {s.data.shape[dim] for s in x.addressable_shards} == {x.shape[dim] // 2}, name
    assert_equal_to_optax(state, loss_fn, params, data)


@pytest.mark.slow
def test_mqa_and_own_annotations_train_like_plain_optax():
    model = build(kv_heads=1)
    params, _, merge = zj.nnx_params(model)
    loss_fn, data = lm_loss(merge), batches()
    assert_equal_to_optax(train(params, loss_fn, 3, data), loss_fn, params, data)

    model = build()
    params, specs, merge = zj.nnx_params(model, rules=[("tp", "model"), ("fsdp", None)])
    loss_fn = lm_loss(merge)
    assert_equal_to_optax(train(params, loss_fn, 3, data, param_specs=specs), loss_fn, params, data)
