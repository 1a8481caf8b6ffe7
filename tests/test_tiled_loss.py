"""zj.tiled_cross_entropy: the loss and its gradients equal the plain full-logits computation,
and the compiled gradient never holds the whole logits."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax import _compat
from zerojax.tools import _gpu

B, S, D, V = 2, 24, 16, 64


def plain(hidden, w, labels, ignore_index=-100):
    """optax's cross-entropy on the whole [B, S, V] logits, averaged over the kept labels."""
    logits = jnp.einsum("bsd,dv->bsv", hidden.astype(jnp.float32), w.astype(jnp.float32))
    keep = labels != ignore_index
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, labels, 0))
    return jnp.sum(jnp.where(keep, per_token, 0.0)) / jnp.sum(keep)


def inputs(seq=S, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    hidden = jax.random.normal(k[0], (B, seq, D))
    w = jax.random.normal(k[1], (D, V)) * 0.3
    labels = jax.random.randint(k[2], (B, seq), 0, V)
    return hidden, w, labels


def value_and_grads(fn, hidden, w, labels):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(hidden, w, labels)


def assert_matches(hidden, w, labels, chunk_size, **kw):
    got, (gh, gw) = value_and_grads(lambda h, w, y: zj.tiled_cross_entropy(h, w, y, chunk_size=chunk_size, **kw),
                                    hidden, w, labels)
    want, (wh, ww) = value_and_grads(lambda h, w, y: plain(h, w, y, **kw), hidden, w, labels)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gh, wh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, ww, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(gh).max()) > 0 and float(jnp.abs(gw).max()) > 0


def test_value_and_gradients_equal_the_full_logits_loss_with_ignored_labels():
    hidden, w, labels = inputs()
    labels = labels.at[0, 3].set(-100).at[1, 10:14].set(-100)
    labels = labels.at[:, 8:16].set(-100)  # the second chunk of 8 holds no kept label at all
    assert_matches(hidden, w, labels, chunk_size=8)


def test_a_sequence_the_chunk_does_not_divide_is_padded_with_ignored_labels():
    hidden, w, labels = inputs(seq=21, seed=1)  # 21 = 2 chunks of 8 + 5
    labels = labels.at[1, 20].set(7)
    assert_matches(hidden, w, labels.at[0, 0].set(5), chunk_size=8, ignore_index=5)


def test_bf16_inputs_give_fp32_logits():
    hidden, w, labels = inputs(seed=2)
    hb, wb = hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got, gh = jax.jit(jax.value_and_grad(lambda h: zj.tiled_cross_entropy(h, wb, labels, chunk_size=8)))(hb)
    assert got.dtype == jnp.float32 and gh.dtype == jnp.bfloat16
    # the plain loss of the same bf16 values, computed in fp32: equal up to the summation order
    np.testing.assert_allclose(got, jax.jit(plain)(hb, wb, labels), rtol=1e-6)


def test_no_kept_label_gives_zero_loss_and_zero_gradients():
    hidden, w, labels = inputs()
    loss, (gh, gw) = value_and_grads(lambda h, w, y: zj.tiled_cross_entropy(h, w, y, chunk_size=8),
                                     hidden, w, jnp.full_like(labels, -100))  # the same program as above
    assert float(loss) == 0.0 and not np.any(gh) and not np.any(gw)


def test_the_gradient_never_holds_the_whole_logits():
    # logits dominate: [2, 256, 2048] fp32 is 4 MiB, one chunk of 32 tokens 0.5 MiB
    b, s, d, v = 2, 256, 32, 2048
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    hidden, w = jax.random.normal(k[0], (b, s, d)), jax.random.normal(k[1], (d, v))
    labels = jax.random.randint(k[2], (b, s), 0, v)

    def temp_bytes(fn):
        compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(hidden, w, labels).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = b * s * v * 4
    full = temp_bytes(plain)
    tiled = temp_bytes(lambda h, w, y: zj.tiled_cross_entropy(h, w, y, chunk_size=32))
    assert full >= logits_bytes  # the check can see the logits when they are there
    assert tiled < logits_bytes / 2 and tiled < full / 4, (tiled, full)


@pytest.mark.skipif(_compat.cuda_plugin() is None, reason="JAX's CUDA plugin is not installed")
def test_the_gradient_never_holds_the_whole_logits_on_xla_gpu():
    """The same gradients compiled by XLA:GPU for one compile-only H100 (as zj.plan_step compiles):
    temporaries 8.4 MB for the whole logits, 1.1 MB in chunks of 32 (XLA:CPU: 8.4 and 1.4 MB)."""
    b, s, d, v = 2, 256, 32, 2048
    shapes = (jax.ShapeDtypeStruct((b, s, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
              jax.ShapeDtypeStruct((b, s), jnp.int32))
    gpu = _gpu.target_devices("h100", 1)

    def temp_bytes(fn):
        lowered = jax.jit(jax.grad(fn, argnums=(0, 1))).trace(*shapes).lower(lowering_platforms=("cuda",))
        return _gpu.compile_for_devices(lowered, gpu).memory_analysis().temp_size_in_bytes

    logits_bytes = b * s * v * 4
    full = temp_bytes(plain)
    tiled = temp_bytes(lambda h, w, y: zj.tiled_cross_entropy(h, w, y, chunk_size=32))
    assert full >= logits_bytes
    assert tiled < logits_bytes / 2 and tiled < full / 4, (tiled, full)


@pytest.mark.parametrize("args, kw, words", [
    ((jnp.zeros((2, 8)), jnp.zeros((8, 4)), jnp.zeros((2, 8), jnp.int32)), {}, "hidden must be"),
    ((jnp.zeros((2, 8, 4)), jnp.zeros((5, 4)), jnp.zeros((2, 8), jnp.int32)), {}, "head_weight must be"),
    ((jnp.zeros((2, 8, 4)), jnp.zeros((4, 6)), jnp.zeros((2, 8))), {}, "labels must be integers"),
    ((jnp.zeros((2, 8, 4)), jnp.zeros((4, 6)), jnp.zeros((2, 8), jnp.int32)), {"chunk_size": 0}, "chunk_size=0"),
])
def test_bad_arguments_are_named(args, kw, words):
    with pytest.raises(zj.ConfigError, match=words):
        zj.tiled_cross_entropy(*args, **kw)
