"""Ulysses sequence parallelism: sequence_parallel_size builds a ("data", "seq") mesh, the batch's
dim 1 is split over "seq", and zj.ulysses_attention attends over the whole sequence by an
all-to-all to a head split. A GPT trained at N = 2 and 4 matches N = 1 and plain optax in loss,
grad norm and params; GQA heads are split or repeated; bad sizes are refused by name."""
import functools
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests.helpers import child_env
from zerojax._ulysses import AUTO_CHUNK, attention
from zerojax.models import gpt

CFG = gpt.GPTConfig(vocab=64, n_layer=2, d_model=32, n_head=4, seq_len=16, scan=True)
STEPS, LR, TOL = 3, 1e-2, 3e-5


def batch(step):
    rng = np.random.default_rng(step)
    toks = rng.integers(0, CFG.vocab, (8, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "labels": toks[:, 1:]}


_RUNS = {}


def train_zero(n, stage, loss=None, cfg=CFG, tx=None):
    """(metrics per step, final params, mesh, step, state); the GPT runs are shared by the tests."""
    key = (n, stage, cfg, tx) if loss is None else None
    if key in _RUNS:
        return _RUNS[key]
    params = gpt.init_params(cfg, jax.random.PRNGKey(0))
    state, step = zj.initialize(params, loss or gpt.loss_fn(cfg),
                                zj.ZeroConfig(stage=stage, sequence_parallel_size=n), optimizer=tx or optax.adamw(LR))
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
    return plain_run(CFG)


def plain_run(cfg, tx=None):
    """(metrics per step, final params) of plain optax on one device's view of the same GPT."""
    loss = gpt.loss_fn(cfg)
    params = gpt.init_params(cfg, jax.random.PRNGKey(0))
    tx = tx or optax.adamw(LR)
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


@pytest.mark.slow  # about 30 s: two GPT programs over every device and their plain reference
@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_over_all_eight_devices_matches_plain_optax(stage):
    """N = 8: one data group, each sequence split over every device (a GPT with 8 heads). SGD with
    momentum: Adam turns the rounding of a near-zero gradient (summed in another order over 8
    shards) into a full step of lr, past 3e-5 in one element of thousands on this model; SGD keeps
    the params as exact as the gradients, so a wrong scale still shows in them (and in grad_norm)."""
    cfg = gpt.GPTConfig(vocab=64, n_layer=2, d_model=32, n_head=8, seq_len=16, scan=True)
    tx = optax.sgd(0.1, momentum=0.9)
    metrics, params, mesh, _, _ = train_zero(8, stage, cfg=cfg, tx=tx)
    assert dict(mesh.shape) == {"data": 1, "seq": 8}
    close((metrics, params), plain_run(cfg, tx))


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


@pytest.mark.parametrize("kv_heads,n,chunk", [(2, 2, 6), (1, 4, None), (4, 4, None)])
def test_ulysses_attention_gqa(kv_heads, n, chunk):
    mesh = zj.make_mesh((8 // n, n), ("data", "seq"))
    ks = jax.random.split(jax.random.PRNGKey(kv_heads + n), 3)
    q = jax.random.normal(ks[0], (4, 16, 4, 8))
    k, v = (jax.random.normal(key, (4, 16, kv_heads, 8)) for key in ks[1:])
    mask = np.random.default_rng(0).random((4, 1, 16, 16)) > 0.2
    mask[..., 0] = True  # every query keeps one key
    split = NamedSharding(mesh, P("data", "seq"))

    def f(q, k, v, m):
        # chunk 6: three chunks of the 16 queries, the last padded
        out = zj.ulysses_attention(q, k, v, causal=True, mask=m, chunk=chunk)
        return out, jax.grad(lambda q: zj.ulysses_attention(q, k, v, causal=True, mask=m, chunk=chunk).sum())(q)

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


# --------------------------------------------------------------------------- attention in chunks
def _inputs(b, s, h, hk, d, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return jax.random.normal(ks[0], (b, s, h, d)), *(jax.random.normal(x, (b, s, hk, d)) for x in ks[1:])


@pytest.mark.slow  # about 27 s on a loaded machine: three chunk sizes, values and gradients
def test_chunked_attention_equals_the_whole_in_values_and_gradients():
    """GQA, a causal mask from an offset, a user mask and a per-head bias; chunks that divide the
    40 queries and ones that do not (padded): values against numpy, gradients of q, k, v and the
    bias against the unchunked computation."""
    q, k, v = _inputs(2, 40, 4, 2, 8)
    rng = np.random.default_rng(1)
    mask = rng.random((2, 1, 40, 40)) > 0.3
    mask[..., 0] = True
    bias = jnp.asarray(rng.normal(size=(1, 4, 40, 40)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 40, 4, 8)), jnp.float32)  # a loss that weighs every output

    def loss(chunk, q, k, v, bias):
        return (attention(q, k, v, causal=True, mask=mask, bias=bias, q_offset=3, chunk=chunk) * w).sum()

    grads = jax.jit(jax.grad(functools.partial(loss, 40), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    # numpy: the causal mask with offset 3 lets query i see keys 0..i+3
    qn, kn, vn = (np.repeat(np.asarray(a, np.float64), 4 // a.shape[2], axis=2) for a in (q, k, v))
    sc = np.einsum("bqhd,bkhd->bhqk", qn, kn) / np.sqrt(8) + np.asarray(bias, np.float64)
    keep = (np.arange(40)[None, :] <= np.arange(40)[:, None] + 3) & mask
    sc = np.where(keep, sc, -np.inf)
    sc = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", sc / sc.sum(-1, keepdims=True), vn)
    for chunk in (8, 16, 7):  # 5 chunks; 3 chunks, the last padded by 8; 6 chunks, padded by 2
        out = jax.jit(lambda q, k, v, b: attention(q, k, v, mask=mask, bias=b, q_offset=3, chunk=chunk))(q, k, v, bias)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        got = jax.jit(jax.grad(functools.partial(loss, chunk), argnums=(0, 1, 2, 3)))(q, k, v, bias)
        for g, r in zip(got, grads):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_the_chunk_is_chosen_by_length():
    """Up to AUTO_CHUNK queries attend whole (the program of before, no loop); longer ones loop
    over equal chunks of at most AUTO_CHUNK rows."""
    def loop_lengths(s):
        q = jax.ShapeDtypeStruct((1, s, 2, 4), jnp.float32)
        jaxpr = jax.make_jaxpr(lambda q: attention(q, q, q))(q)
        return [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]

    assert loop_lengths(AUTO_CHUNK) == []
    assert loop_lengths(AUTO_CHUNK + 1) == [2]  # two chunks of 257 rows, one padded
    assert loop_lengths(4 * AUTO_CHUNK) == [4]


def test_chunked_gradient_never_holds_the_whole_scores():
    """The compiled gradient of attention over 2048 tokens: the scores alone are 64 MiB in fp32;
    unchunked, the program holds more than that, in chunks of 128 rows less than a third of it."""
    spec = jax.ShapeDtypeStruct((1, 2048, 4, 16), jnp.float32)
    scores = 4 * 2048 * 2048 * 4

    def temp(chunk):
        f = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v, chunk=chunk).sum(), argnums=(0, 1, 2)))
        return f.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes

    assert temp(2048) > scores
    assert temp(128) < scores / 3


def test_refuses_a_chunk_that_is_not_a_number_of_rows():
    q = jnp.zeros((1, 8, 2, 4))
    for bad in (0, -4, 2.5, True):
        with pytest.raises(zj.ZeroJaxError, match=r"chunk=.* is not a positive number of query rows"):
            attention(q, q, q, chunk=bad)


# --------------------------------------------------------------------------- the all-to-all's dtype
def _a2a_kinds(lowered):
    """The element types the all-to-alls of a lowered program carry. The program zerojax hands
    XLA, not the compiled one: XLA's CPU backend has no bf16 collectives and widens them to f32
    (a GPU's keeps them)."""
    return {kind for line in lowered.as_text().splitlines() if "stablehlo.all_to_all" in line
            for kind in re.findall(r"x([a-z]+[0-9]+)>", line.rsplit(" : ", 1)[-1])}


def test_comm_dtype_carries_the_all_to_alls_in_bf16():
    """comm_dtype="bf16": every all-to-all (forward and backward) moves bf16; the values are those
    of attention over q, k, v rounded to bf16, the output rounded again, and come back fp32."""
    mesh = zj.make_mesh((4, 2), ("data", "seq"))
    q, k, v = _inputs(4, 16, 4, 2, 8, seed=3)
    split = NamedSharding(mesh, P("data", "seq"))

    def f(q, k, v):
        out = zj.ulysses_attention(q, k, v, comm_dtype="bf16")
        return out, jax.grad(lambda q: zj.ulysses_attention(q, k, v, comm_dtype="bf16").sum())(q)

    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        args = [jax.device_put(a, split) for a in (q, k, v)]
        out, _ = jax.jit(f)(*args)
        lowered = jax.jit(f).lower(*args)
    assert _a2a_kinds(lowered) == {"bf16"}
    r = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    np.testing.assert_allclose(out, r(attention(r(q), r(k), r(v))), rtol=1e-6, atol=1e-6)
    assert out.dtype == jnp.float32


def test_the_deepspeed_comm_dtype_reaches_the_step():
    """seq_parallel_communication_data_type sets ZeroConfig.seq_parallel_comm_dtype, and the step's
    ulysses_attention carries its all-to-alls in it; "fp32" (the default) leaves them fp32."""
    cfg = zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                                        "seq_parallel_communication_data_type": "bf16"})
    assert cfg.seq_parallel_comm_dtype == "bf16"
    assert zj.ZeroConfig().seq_parallel_comm_dtype == "fp32"
    with pytest.raises(zj.ZeroJaxError, match="seq_parallel_communication_data_type='int8'.*'bf16'"):
        zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                      "seq_parallel_communication_data_type": "int8"})

    def loss(params, b):
        x = b["x"] @ params["w"]  # [batch, seq, 4 heads x 8]
        q = x.reshape(x.shape[0], x.shape[1], 4, 8)
        return zj.ulysses_attention(q, q, q).sum()

    params = {"w": jnp.ones((8, 32)) * 0.1}
    bt = {"x": np.random.default_rng(0).normal(size=(4, 16, 8)).astype(np.float32)}
    kinds = {}
    for dtype in ("fp32", "bf16"):
        config = zj.ZeroConfig(sequence_parallel_size=2, seq_parallel_comm_dtype=dtype)
        state, step = zj.initialize(params, loss, config, optimizer=optax.sgd(0.1))
        kinds[dtype] = _a2a_kinds(step.lower(state, bt))
    assert kinds == {"fp32": {"f32"}, "bf16": {"bf16"}}


# --------------------------------------------------------------------------- the benchmark
@pytest.mark.slow  # about 60 s: a fresh process compiling each contender
def test_long_context_smoke_prints_every_section():
    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    out = subprocess.run([sys.executable, str(bench / "long_context.py"), "--smoke"], cwd=bench, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for section in ("peak MiB per device", "a2a KiB/layer", "the longest sequence that fits", "plain: N=1",
                    "step time at seq"):
        assert section in out.stdout, out.stdout


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
