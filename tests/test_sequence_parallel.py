"""Ulysses sequence parallelism: sequence_parallel_size builds a ("data", "seq") mesh, the batch's
dim 1 is split over "seq", and zj.ulysses_attention attends over the whole sequence by an
all-to-all to a head split. A GPT trained at N = 2 and 4 matches N = 1 and plain optax in loss,
grad norm and params; GQA heads are split or repeated; bad sizes are refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax._ulysses import attention
from zerojax.models import gpt

CFG = gpt.GPTConfig(vocab=64, n_layer=2, d_model=32, n_head=4, seq_len=16, scan=True)
STEPS, LR, TOL = 3, 1e-2, 3e-5


def batch(step):
    rng = np.random.default_rng(step)
    toks = rng.integers(0, CFG.vocab, (8, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "labels": toks[:, 1:]}


_RUNS = {}


def train_zero(n, stage, loss=None):
    """(metrics per step, final params, mesh, step, state); the GPT runs are shared by the tests."""
    key = (n, stage) if loss is None else None
    if key in _RUNS:
        return _RUNS[key]
    params = gpt.init_params(CFG, jax.random.PRNGKey(0))
    state, step = zj.initialize(params, loss or gpt.loss_fn(CFG),
                                zj.ZeroConfig(stage=stage, sequence_parallel_size=n), optimizer=optax.adamw(LR))
    out = []
    for i in range(STEPS):
        state, metrics = step(state, batch(i))
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    run = out, jax.device_get(state.params), state.plan.mesh, step, state
    if key is not None:
        _RUNS[key] = run
    return run


@pytest.fixture(scope="module")
def plain():
    loss = gpt.loss_fn(CFG)
    params = gpt.init_params(CFG, jax.random.PRNGKey(0))
    tx = optax.adamw(LR)
    opt = tx.init(params)

    @jax.jit
    def one(params, opt, b):
        value, g = jax.value_and_grad(loss)(params, b)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, value, optax.tree.norm(g)

    out = []
    for i in range(STEPS):
        params, opt, value, norm = one(params, opt, batch(i))
        out.append((float(value), float(norm)))
    return out, jax.device_get(params)


def close(a, b):
    (ma, pa), (mb, pb) = a, b
    np.testing.assert_allclose(np.asarray(ma), np.asarray(mb), rtol=TOL, atol=TOL)
    for x, y in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("n,stage", [(2, 1), (4, 3)])
def test_gpt_matches_plain_optax(plain, n, stage):
    metrics, params, mesh, _, _ = train_zero(n, stage)
    assert dict(mesh.shape) == {"data": 8 // n, "seq": n}
    close((metrics, params), plain)


@pytest.mark.slow  # zerojax at N = 1 against plain optax is every stage test's check; here for the set
def test_gpt_n1_matches_plain_optax(plain):
    metrics, params, mesh, _, _ = train_zero(1, 1)
    assert "seq" not in mesh.axis_names
    close((metrics, params), plain)


def test_the_step_splits_the_sequence_and_all_to_alls():
    """The compiled step holds all-to-alls (ulysses_attention's) over groups of 4 devices."""
    _, _, _, step, state = train_zero(4, 3)
    text = step.lower(state, batch(0)).compile().as_text()
    # one all-to-all per q, k, v and output per layer forward, as many backward (fused or not)
    assert text.count("all-to-all(") >= 4 * CFG.n_layer or "all-to-all-start" in text
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in text or "replica_groups=[2,4]" in text


@pytest.mark.slow  # 25 s: a second GPT program at N = 4; the quick tier keeps the Ulysses runs
def test_model_without_ulysses_attention_trains_equal(plain):
    """GSPMD gathers what a plain attention needs: still the same numbers under "seq"."""
    def plain_loss(params, b):
        x = params["wte"][b["inputs"]] + params["wpe"][: b["inputs"].shape[1]]
        for i in range(CFG.n_layer):
            p = jax.tree_util.tree_map(lambda a: a[i], params["blocks"])
            x = _block_plain(x, p)
        x = gpt._layer_norm(x, params["ln_f"])
        logp = jax.nn.log_softmax((x @ params["wte"].T).astype(jnp.float32), -1)
        return -jnp.take_along_axis(logp, b["labels"][..., None], -1).mean()

    metrics, params, _, _, _ = train_zero(2, 1, loss=plain_loss)
    close((metrics, params), plain)


def _block_plain(x, p):
    b, t, d = x.shape
    h = CFG.n_head
    qkv = gpt._dense(gpt._layer_norm(x, p["ln1"]), p["attn"]["qkv"]).reshape(b, t, 3, h, d // h)
    y = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True).reshape(b, t, d)
    x = x + gpt._dense(y, p["attn"]["proj"])
    return x + gpt._dense(jax.nn.gelu(gpt._dense(gpt._layer_norm(x, p["ln2"]), p["mlp"]["fc"])), p["mlp"]["proj"])


# --------------------------------------------------------------------------- attention alone
def reference(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v with a causal mask, kv heads repeated to q's, in numpy."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = np.tril(np.ones((q.shape[1], q.shape[1]), bool))
    if mask is not None:
        keep = keep & mask
    s = np.where(keep, s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", s / s.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("kv_heads,n", [(2, 2), (1, 4), (4, 4)])
def test_ulysses_attention_gqa(kv_heads, n):
    mesh = zj.make_mesh((8 // n, n), ("data", "seq"))
    ks = jax.random.split(jax.random.PRNGKey(kv_heads + n), 3)
    q = jax.random.normal(ks[0], (4, 16, 4, 8))
    k, v = (jax.random.normal(key, (4, 16, kv_heads, 8)) for key in ks[1:])
    mask = np.random.default_rng(0).random((4, 1, 16, 16)) > 0.2
    mask[..., 0] = True  # every query keeps one key
    split = NamedSharding(mesh, P("data", "seq"))

    def f(q, k, v, m):
        out = zj.ulysses_attention(q, k, v, causal=True, mask=m)
        return out, jax.grad(lambda q: zj.ulysses_attention(q, k, v, causal=True, mask=m).sum())(q)

    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        args = [jax.device_put(a, split) for a in (q, k, v)]
        jitted = jax.jit(f)
        out, grad = jitted(*args, mask)
        text = jitted.lower(*args, mask).compile().as_text()
    assert "all-to-all" in text
    np.testing.assert_allclose(out, reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda q: attention(q, k, v, causal=True, mask=mask).sum())(q)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_no_seq_axis_is_plain_attention():
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(key, (2, 8, 4, 8)) for key in ks)
    np.testing.assert_allclose(zj.ulysses_attention(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- refusals
def _under_seq(n, fn):
    mesh = zj.make_mesh((8 // n, n), ("data", "seq"))
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        return jax.jit(fn).lower()


def test_refuses_query_heads_not_dividing():
    q = jnp.zeros((2, 16, 6, 8))
    with pytest.raises(zj.ZeroJaxError, match="6 query heads.*sequence_parallel_size=4"):
        _under_seq(4, lambda: zj.ulysses_attention(q, q, q))


def test_refuses_kv_heads_neither_dividing():
    q, kv = jnp.zeros((2, 16, 12, 8)), jnp.zeros((2, 16, 3, 8))
    with pytest.raises(zj.ZeroJaxError, match="3 key/value heads"):
        _under_seq(4, lambda: zj.ulysses_attention(q, kv, kv))


def test_refuses_sequence_not_dividing():
    params = gpt.init_params(CFG, jax.random.PRNGKey(0))
    state, step = zj.initialize(params, gpt.loss_fn(CFG), zj.ZeroConfig(stage=1, sequence_parallel_size=4),
                                optimizer=optax.adamw(LR))
    b = {k: v[:, :14] for k, v in batch(0).items()}
    with pytest.raises(zj.ZeroJaxError, match=r"\['inputs'\] has sequence length 14.*sequence_parallel_size=4"):
        step(state, b)


def test_refuses_size_not_dividing_world():
    params = gpt.init_params(CFG, jax.random.PRNGKey(0))
    with pytest.raises(zj.ZeroJaxError, match="sequence_parallel_size=3 does not divide the 8 devices"):
        zj.initialize(params, gpt.loss_fn(CFG), zj.ZeroConfig(sequence_parallel_size=3), optimizer=optax.sgd(0.1))
    with pytest.raises(zj.ZeroJaxError, match="sequence_parallel_size=3 does not divide"):
        zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 3})


def test_given_mesh_must_have_the_seq_axis():
    params = gpt.init_params(CFG, jax.random.PRNGKey(0))
    with pytest.raises(zj.ZeroJaxError, match="sequence_parallel_size=2 needs a mesh with a 'seq' axis of 2"):
        zj.initialize(params, gpt.loss_fn(CFG), zj.ZeroConfig(sequence_parallel_size=2), mesh=zj.make_mesh(),
                      optimizer=optax.sgd(0.1))


def test_deepspeed_key_is_honoured():
    cfg = zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2})
    assert cfg.sequence_parallel_size == 2
    # DeepSpeed's data-parallel size is world / sequence_parallel_size: 8 / 2 devices x 1
    assert cfg.train_batch_size in (None, 4)
