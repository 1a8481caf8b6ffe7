"""HostAdamW against optax.adamw, and FlatLayout round trips."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zerojax.offload.host_adam import FlatLayout, HostAdamW

BF16 = np.dtype(jnp.bfloat16)


def optax_reference(p0, grads_seq, scale, lr, b1, b2, eps, wd):
    """Plain optax.adamw on fp32 gradients that were multiplied by ``scale``."""
    tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    p = jnp.asarray(p0)
    state = tx.init(p)
    for g in grads_seq:
        g32 = jnp.asarray(np.asarray(g).astype(np.float32)) * jnp.float32(scale)
        u, state = tx.update(g32, state, p)
        p = optax.apply_updates(p, u)
    adam = state[0]
    return np.asarray(p), np.asarray(adam.mu), np.asarray(adam.nu)


def assert_close(actual, expected, rtol=1e-6):
    # Relative to each element, with a floor for elements that cancel to ~0.
    floor = 1e-6 * float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=floor)


CASES = [
    # n, wd, grad_scale, grads dtype, out16 dtype, threads, chunk
    (1000, 0.0, 1.0, np.float32, None, 1, 256),
    (1237, 0.01, 1.0, np.float32, None, 3, 64),
    (1237, 0.1, 0.125, np.float32, BF16, 2, 128),
    (999, 0.01, 3.0, BF16, BF16, 2, 64),
    (777, 0.0, 0.5, np.uint16, np.uint16, 4, 32),
    (517, 0.01, 2.0, np.float16, np.float16, 2, 48),
    (5, 0.01, 1.0, np.float32, BF16, 4, 16),
]


@pytest.mark.parametrize("n,wd,scale,gdtype,odtype,threads,chunk", CASES)
def test_matches_optax_adamw(n, wd, scale, gdtype, odtype, threads, chunk):
    rng = np.random.default_rng(n)
    lr, b1, b2, eps = 1e-2, 0.9, 0.99, 1e-8
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = []
    for _ in range(5):
        g = (rng.standard_normal(n) * 0.1).astype(np.float32)
        if gdtype == np.uint16:
            grads.append(g.astype(BF16).view(np.uint16))
        else:
            grads.append(g.astype(gdtype))
    ref_grads = [g.view(BF16) if g.dtype == np.uint16 else g for g in grads]
    p_ref, m_ref, v_ref = optax_reference(p0, ref_grads, scale, lr, b1, b2, eps, wd)

    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    out16 = None if odtype is None else np.full(n, 7, np.dtype(odtype))
    with HostAdamW(lr, b1, b2, eps, wd, num_threads=threads, chunk_elements=chunk) as opt:
        for k, g in enumerate(grads):
            opt.step(p, g, m, v, count=k + 1, grad_scale=scale, out16=out16)
    assert_close(p, p_ref)
    assert_close(m, m_ref)
    assert_close(v, v_ref)
    if out16 is not None:
        want = p.astype(BF16 if odtype in (BF16, np.uint16) else np.float16)
        got = out16.view(BF16) if odtype == np.uint16 else out16
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_learning_rate_override_and_thread_count_do_not_change_bits():
    rng = np.random.default_rng(0)
    n = 3001
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [(rng.standard_normal(n) * 0.1).astype(np.float32) for _ in range(3)]
    results = []
    for threads, chunk in [(1, 4096), (3, 64), (2, 112)]:
        p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        opt = HostAdamW(lr=123.0, weight_decay=0.05, num_threads=threads, chunk_elements=chunk)
        for k, g in enumerate(gs):
            opt.step(p, g, m, v, count=k + 1, lr=1e-3 * (k + 1))
        opt.close()
        results.append((p, m, v))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    p_ref, _, _ = optax_reference(p0, gs[:1], 1.0, 1e-3, 0.9, 0.999, 1e-8, 0.05)
    p1, m1, v1 = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    HostAdamW(lr=1e-3, weight_decay=0.05, num_threads=1).step(p1, gs[0], m1, v1, count=1)
    assert_close(p1, p_ref)


@pytest.mark.parametrize("bad,match", [
    (dict(params=np.zeros(8, np.float64)), "params must be float32"),
    (dict(m=np.zeros(9, np.float32)), "m must be a flat contiguous array of 8"),
    (dict(grads=np.zeros(8, np.int32)), "grads has dtype int32"),
    (dict(out16=np.zeros(8, np.float32)), "out16 has dtype float32"),
    (dict(v=np.zeros((2, 4), np.float32)), "v must be a flat contiguous"),
    (dict(count=0), "count=0 must be >= 1"),
    (dict(m=np.asarray(jnp.zeros(8, jnp.float32))), "m is read-only"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    args = dict(params=np.zeros(8, np.float32), grads=np.zeros(8, np.float32),
                m=np.zeros(8, np.float32), v=np.zeros(8, np.float32), count=1)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        HostAdamW(num_threads=1).step(**args)


def test_flat_layout_round_trip_and_views():
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": [jnp.ones((4,), jnp.bfloat16), np.full((1, 2), 5.0, np.float32)]}
    layout = FlatLayout.from_tree(tree)
    bufs = layout.flatten(tree)
    assert sorted(bufs) == ["bfloat16", "float32"]
    assert bufs["float32"].size == 8 and bufs["bfloat16"].size == 4
    back = layout.unflatten(bufs)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(x), y)
        assert np.asarray(x).shape == y.shape
    bufs["float32"][:] += 1  # views share memory with the buffer
    np.testing.assert_array_equal(back["a"], tree["a"] + 1)

    master = FlatLayout.from_tree(tree, dtype=np.float32)
    assert master.sizes == {"float32": 12}
    flat = master.flatten(tree)["float32"]
    np.testing.assert_array_equal(flat[6:10], np.ones(4))
    with pytest.raises(ValueError, match="rebuild the layout"):
        layout.flatten({"a": np.zeros((3, 2)), "b": tree["b"]})
