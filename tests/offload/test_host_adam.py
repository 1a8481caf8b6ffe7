"""HostAdamW against optax.adamw (numpy and compiled paths), host buffers, FlatLayout."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zerojax._errors import ConfigError
from zerojax.kernels import _native as native
from zerojax.offload._flat import FlatLayout
from zerojax.offload._host_adam import HostAdamW, _narrow, _widen
from zerojax.offload._host_buffers import host_zeros
from zerojax.offload._threads import ThreadSplit

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


def adam_problem(n, gdtype, scale, wd, place=lambda g: g):
    """Start params and 5 gradients (``gdtype``; uint16: bfloat16 bits), each put where ``place``
    says, and optax's (p, m, v) after those 5 steps."""
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = []
    for _ in range(5):
        g = (rng.standard_normal(n) * 0.1).astype(np.float32)
        g = g.astype(BF16).view(np.uint16) if gdtype == np.uint16 else g.astype(gdtype)
        grads.append(place(g))
    ref_grads = [g.view(BF16) if g.dtype == np.uint16 else g for g in grads]
    return p0, grads, optax_reference(p0, ref_grads, scale, LR, B1, B2, EPS, wd)


def assert_matches(p, m, v, out16, odtype, reference):
    p_ref, m_ref, v_ref = reference
    assert_close(p, p_ref)
    assert_close(m, m_ref)
    assert_close(v, v_ref)
    if out16 is not None:  # the 16-bit copy is the new params rounded to nearest even
        want = p.astype(BF16 if odtype in (BF16, np.uint16) else np.float16)
        np.testing.assert_array_equal(out16.view(np.uint16), want.view(np.uint16))


LR, B1, B2, EPS = 1e-2, 0.9, 0.99, 1e-8

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
    p0, grads, reference = adam_problem(n, gdtype, scale, wd)
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    out16 = None if odtype is None else np.full(n, 7, np.dtype(odtype))
    with HostAdamW(LR, B1, B2, EPS, wd, num_threads=threads, chunk_elements=chunk) as opt:
        for k, g in enumerate(grads):
            opt.step(p, g, m, v, count=k + 1, grad_scale=scale, out16=out16)
    assert_matches(p, m, v, out16, odtype, reference)


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
    ({"params": np.zeros(8, np.float64)}, "params must be float32"),
    ({"m": np.zeros(9, np.float32)}, "m must be a flat contiguous array of 8"),
    ({"grads": np.zeros(8, np.int32)}, "grads has dtype int32"),
    ({"out16": np.zeros(8, np.float32)}, "out16 has dtype float32"),
    ({"v": np.zeros((2, 4), np.float32)}, "v must be a flat contiguous"),
    ({"count": 0}, "count=0 must be >= 1"),
    ({"m": np.asarray(jnp.zeros(8, jnp.float32))}, "m is read-only"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    args = {"params": np.zeros(8, np.float32), "grads": np.zeros(8, np.float32),
            "m": np.zeros(8, np.float32), "v": np.zeros(8, np.float32), "count": 1}
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


def test_leaf_source_reads_in_order_and_lets_go_of_passed_leaves():
    """FlatLayout.source: [a:b] copies those elements one leaf at a time; with once=True each leaf
    is let go once the reads have passed it; host_copy does not cache the host copy on the array."""
    from zerojax.offload._flat import host_copy

    leaves = [jnp.arange(5, dtype=jnp.float32), jnp.arange(3, dtype=jnp.float32) + 10, jnp.ones((2, 2), jnp.float32)]
    layout = FlatLayout.from_tree([jax.ShapeDtypeStruct(x.shape, np.float32) for x in leaves])
    whole = np.concatenate([np.asarray(x).reshape(-1) for x in leaves])
    src = layout.source(list(leaves), np.float32, once=True)
    np.testing.assert_array_equal(src[0:4], whole[0:4])
    assert src.leaves[0] is not None
    np.testing.assert_array_equal(src[4:9], whole[4:9])  # passes leaf 0 and 1
    assert src.leaves[0] is None and src.leaves[1] is None and src.leaves[2] is not None
    np.testing.assert_array_equal(src[9:12], whole[9:12])
    with pytest.raises(ValueError, match="read past"):
        src[0:2]
    again = layout.source(leaves, np.float32)  # not once: any order, nothing let go
    np.testing.assert_array_equal(again[6:12], whole[6:12])
    np.testing.assert_array_equal(again[0:3], whole[0:3])
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(host_copy(x), np.arange(8.0))
    assert getattr(x, "_npy_value", None) is None


# -- compiled path (host_zeros buffers) ----------------------------------------------------

def _spy_numpy_path(monkeypatch):
    """Records the (lo, hi) ranges the numpy path updates."""
    ranges = []
    run = HostAdamW._run

    def spy(self, tid, lo, hi, *args):
        ranges.append((lo, hi))
        return run(self, tid, lo, hi, *args)

    monkeypatch.setattr(HostAdamW, "_run", spy)
    return ranges


def _grads_buffer(g, where):
    """g placed in a host buffer, a 64-byte aligned numpy array, or one that is not."""
    if where == "host":
        out = host_zeros(g.size, g.dtype)
    else:
        raw = np.empty(g.nbytes + 256, np.uint8)
        skip = (-raw.ctypes.data) % 64 + (0 if where == "aligned" else 3 * g.itemsize)
        out = raw[skip:skip + g.nbytes].view(g.dtype)
    out[...] = g
    return out


def host_problem(monkeypatch, n, gdtype, scale, wd, odtype, where):
    """``adam_problem`` with p, m, v (and the 16-bit copy) in host buffers, the gradients placed
    by ``_grads_buffer``, and the numpy path's ranges recorded."""
    p0, grads, reference = adam_problem(n, gdtype, scale, wd, place=lambda g: _grads_buffer(g, where))
    p, m, v = host_zeros(n), host_zeros(n), host_zeros(n)
    p[:] = p0
    out16 = None if odtype is None else host_zeros(n, odtype)
    return p, m, v, out16, grads, reference, _spy_numpy_path(monkeypatch)


COMPILED_CASES = [
    # n, wd, grad_scale, grads dtype, out16 dtype, block, grads placement
    (1000, 0.0, 1.0, np.float32, None, 256, "host"),
    (1237, 0.01, 1.0, np.float32, None, 100, "unaligned"),
    (1237, 0.1, 0.125, np.float32, BF16, 128, "aligned"),
    (999, 0.01, 3.0, BF16, BF16, 64, "unaligned"),
    (777, 0.0, 0.5, np.uint16, np.uint16, 4096, "host"),
    (517, 0.01, 2.0, np.float16, np.float16, 48, "unaligned"),
    (5, 0.01, 1.0, np.float32, BF16, 16, "host"),
]


@pytest.mark.parametrize("n,wd,scale,gdtype,odtype,block,where", COMPILED_CASES)
def test_compiled_step_matches_optax_adamw(monkeypatch, n, wd, scale, gdtype, odtype, block,
                                           where):
    p, m, v, out16, grads, reference, ranges = host_problem(monkeypatch, n, gdtype, scale, wd, odtype, where)
    address = p.ctypes.data
    with HostAdamW(LR, B1, B2, EPS, wd, num_threads=1, block_elements=block, native=False) as opt:
        for k, g in enumerate(grads):
            opt.step(p, g, m, v, count=k + 1, grad_scale=scale, out16=out16)
    # XLA updated the whole blocks from the gradients' first 64-byte aligned element on;
    # the numpy path only the remainder and the elements before that start.
    head = min((-grads[0].ctypes.data) % 64 // grads[0].itemsize, n)
    assert (head > 0) == (where == "unaligned")
    rest = head + (n - head) // block * block
    per_step = ([(rest, n)] if rest < n else []) + ([(0, head)] if head else [])
    assert ranges == per_step * 5
    assert p.ctypes.data == address
    assert_matches(p, m, v, out16, odtype, reference)


NATIVE_CASES = [
    # n, wd, grad_scale, grads dtype, out16 dtype, threads, grads placement
    (1000, 0.0, 1.0, np.float32, None, 1, "host"),
    (200_003, 0.01, 1.0, np.float32, None, 2, "unaligned"),
    (150_001, 0.1, 0.125, np.float32, BF16, 3, "aligned"),
    (131_075, 0.01, 3.0, BF16, BF16, 2, "unaligned"),
    (777, 0.0, 0.5, np.uint16, np.uint16, 2, "host"),
]


@pytest.mark.parametrize("n,wd,scale,gdtype,odtype,threads,where", NATIVE_CASES)
def test_native_step_matches_optax_adamw(monkeypatch, n, wd, scale, gdtype, odtype, threads, where):
    """The native kernel does the whole step (no element on the numpy path), in place, on
    1-3 threads (the larger cases split across them), with optax's numbers."""
    assert native.available(), "the native kernel must build here (g++ and jaxlib's FFI headers)"
    p, m, v, out16, grads, reference, ranges = host_problem(monkeypatch, n, gdtype, scale, wd, odtype, where)
    address = p.ctypes.data
    with HostAdamW(LR, B1, B2, EPS, wd, num_threads=threads) as opt:
        for k, g in enumerate(grads):
            opt.step(p, g, m, v, count=k + 1, grad_scale=scale, out16=out16)
    assert ranges == []
    assert p.ctypes.data == address
    assert_matches(p, m, v, out16, odtype, reference)


def test_native_kernel_leaves_float16_to_the_block_loop(monkeypatch):
    """float16 gradients or copies are not the kernel's: XLA's block loop takes them (its
    numpy remainder shows), with optax's numbers."""
    n, block = 517, 48
    p, m, v, out16, grads, reference, ranges = host_problem(monkeypatch, n, np.float16, 2.0, 0.01, np.float16, "host")
    with HostAdamW(LR, B1, B2, EPS, 0.01, num_threads=1, block_elements=block) as opt:
        for k, g in enumerate(grads):
            opt.step(p, g, m, v, count=k + 1, grad_scale=2.0, out16=out16)
    assert ranges == [(n // block * block, n)] * 5
    assert_matches(p, m, v, out16, np.float16, reference)


def test_compiled_step_split_with_the_numpy_path(monkeypatch):
    """XLA takes the first blocks while numpy threads take the last ones."""
    n, block = 10_000, 512
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [(rng.standard_normal(n) * 0.1).astype(np.float32) for _ in range(3)]
    p_ref, m_ref, v_ref = optax_reference(p0, gs, 1.0, 1e-2, 0.9, 0.999, 1e-8, 0.01)
    p, m, v, o16 = host_zeros(n), host_zeros(n), host_zeros(n), host_zeros(n, BF16)
    p[:] = p0
    ranges = _spy_numpy_path(monkeypatch)
    with HostAdamW(1e-2, weight_decay=0.01, num_threads=3, chunk_elements=256,
                   block_elements=block, native=False) as opt:
        monkeypatch.setattr(opt._split, "share", lambda: 0.5)
        for k, g in enumerate(gs):
            g_host = host_zeros(n)
            g_host[:] = g
            opt.step(p, g_host, m, v, count=k + 1, out16=o16)
    whole = n // block
    start = (whole - round(0.5 * whole)) * block
    cut = start + (n - start) // 2 // 16 * 16  # two helper threads
    assert sorted(ranges) == sorted([(start, cut), (cut, n)] * 3)  # two threads a step: in either order
    assert_close(p, p_ref)
    assert_close(m, m_ref)
    assert_close(v, v_ref)
    np.testing.assert_array_equal(o16.view(np.uint16), p.astype(BF16).view(np.uint16))


def test_split_controller_follows_throughput():
    assert ThreadSplit(0).share() == 0.0
    split = ThreadSplit(1)
    assert split.share() == 0.0  # first an XLA-only step to measure
    split.record(0.0, 1.0, 0.1, True, 900, 100)
    share = split.share()
    assert share == pytest.approx(1 / 3)
    # XLA finished last (0.7 s), numpy had done its third in 0.5 s: give numpy more.
    split.record(share, 0.7, 0.5, True, 600, 300)
    target = (300 / 0.5) / (300 / 0.5 + 600 / 0.7)
    assert target > 1 / 3 and split.fraction == pytest.approx(0.5 * (1 / 3 + target))
    assert split.rate[True] > split.rate[False]
    uses = [split.share() > 0 for _ in range(32)]
    assert uses.count(False) == 2 and not uses[13] and not uses[29]  # retries every 16th step
    split.record(0.0, 0.5, 0.01, True, 1000, 0)  # XLA alone got much faster
    split.record(0.0, 0.5, 0.01, True, 1000, 0)
    assert split.share() == 0.0
    split.fraction = 0.4
    split.record(0.4, 1.0, 1.0, False, 600, 400)  # XLA waited for numpy: shift back
    assert split.fraction == pytest.approx(0.5 * (0.4 + 0.32))


def test_compiled_and_numpy_paths_agree_and_buffers_update_in_place():
    n = 50_000
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [(rng.standard_normal(n) * 0.1).astype(np.float32) for _ in range(3)]
    gs[1][:7] = [np.inf, -np.inf, np.nan, 1e30, -1e30, 0.0, 1e-30]  # g*g overflows from 1e30
    results = []
    for compiled, use_native in ((False, False), (True, False), (True, True)):
        p, m, v = host_zeros(n), host_zeros(n), host_zeros(n)
        p[:] = p0
        o16 = host_zeros(n, BF16)
        view = p.reshape(100, 500)[3]  # a view taken before the steps
        before = view.copy()
        with HostAdamW(1e-3, weight_decay=0.1, compiled=compiled, block_elements=4096,
                       native=use_native) as opt, np.errstate(over="ignore", invalid="ignore"):
            for k, g in enumerate(gs):
                opt.step(p, g, m, v, count=k + 1, out16=o16)
        assert not np.array_equal(view, before)
        np.testing.assert_array_equal(view, p[1500:2000])
        results.append((p, m, v, o16))
    (p_np, m_np, v_np, _), *compiled_runs = results
    for p_c, m_c, v_c, o_c in compiled_runs:  # XLA's block loop, then the native kernel
        assert np.isnan(p_c[:3]).all() and np.isfinite(p_c[3:]).all()
        for a, b in ((p_c, p_np), (m_c, m_np), (v_c, v_np)):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            assert_close(np.nan_to_num(a), np.nan_to_num(b))
        # 16-bit copy rounds like numpy, NaN included (canonical quiet NaN, sign kept).
        np.testing.assert_array_equal(o_c.view(np.uint16), p_c.astype(BF16).view(np.uint16))


def test_plain_numpy_buffers_and_mixed_buffers_take_the_numpy_path(monkeypatch):
    n = 3000
    rng = np.random.default_rng(2)
    g = rng.standard_normal(n).astype(np.float32)
    ranges = _spy_numpy_path(monkeypatch)
    opt = HostAdamW(num_threads=1, chunk_elements=4096)
    p, m, v = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    opt.step(p, g, m, v, count=1)
    assert ranges == [(0, n)]
    ranges.clear()
    hp, hm, hv = host_zeros(n), host_zeros(n), host_zeros(n)
    opt.step(hp, g, hm, hv, count=1, out16=np.zeros(n, BF16))  # out16 not a host buffer
    opt.step(hp[:-1], g[:-1], hm[:-1], hv[:-1], count=1)  # part of a host buffer
    opt.step(hp, g, hm, hv, count=1, out16=host_zeros(n, np.float16).view(BF16))  # wrong kind
    assert ranges == [(0, n), (0, n - 1), (0, n)]
    ranges.clear()
    HostAdamW(compiled=False, num_threads=1).step(hp, g, hm, hv, count=1)
    assert ranges == [(0, n)]


def test_host_zeros():
    for dtype in (np.float32, BF16, np.float16, np.uint16):
        x = host_zeros(100, dtype)
        assert x.dtype == np.dtype(dtype) and x.shape == (100,) and x.flags.writeable
        assert x.ctypes.data % 64 == 0 and not x.any()
    with pytest.raises(ConfigError, match="not supported"):
        host_zeros(10, np.float64)
    x = host_zeros(1000)
    tail = x[500:]
    del x
    gc.collect()
    tail[:] = 2.0  # the slice keeps the memory alive
    assert float(tail.sum()) == 1000.0
    bufs = FlatLayout.from_tree({"w": np.ones((4, 8), np.float32)}).flatten(
        {"w": np.ones((4, 8), np.float32)})
    master = bufs["float32"]
    p16 = host_zeros(32, BF16)
    m, v = host_zeros(32), host_zeros(32)
    HostAdamW(lr=0.5).step(master, np.ones(32, np.float32), m, v, count=1, out16=p16)
    np.testing.assert_allclose(master, 0.5, rtol=1e-6)  # 1 - lr * sign(g)
    np.testing.assert_array_equal(p16.astype(np.float32), 0.5)


def test_compiled_16bit_rounding_matches_numpy_casts():
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 6e-8,
                         3.4028235e38, 3.3961776e38, 65504.0, 65520.0, 1.0 + 2.0**-8,
                         1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, -(1.0 + 2.0**-11)], np.float32)
    bits = np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0x3F808000, 0x3F818000], np.uint32)
    x = np.concatenate([specials, bits.view(np.float32),
                        np.random.default_rng(3).standard_normal(4096).astype(np.float32)])
    cpu = jax.devices("cpu")[0]
    for kind, dtype in (("bf16", BF16), ("f16", np.float16)):
        got = np.asarray(jax.jit(lambda a, k=kind: _narrow(a, k))(jax.device_put(x, cpu)))
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(dtype).view(np.uint16)
        number = ~np.isnan(want.view(dtype))  # infinities included
        np.testing.assert_array_equal(got[number], want[number])
        np.testing.assert_array_equal(np.isnan(got.view(dtype)), ~number)
        if kind == "bf16":  # NaN: numpy's canonical quiet NaN, sign kept
            np.testing.assert_array_equal(got, want)
        back = np.asarray(jax.jit(lambda a, k=kind: _widen(a, k))(jax.device_put(want, cpu)))
        np.testing.assert_array_equal(back, want.view(dtype).astype(np.float32))


def test_without_a_compiler_the_kernel_is_refused_with_a_warning_and_xla_runs(monkeypatch):
    """No C++ compiler: available() is False with a NativeKernelWarning naming why, HostAdamW
    takes XLA's block loop (its numpy remainder shows) and still matches optax."""
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native._load.cache_clear()
    native._warn_once.cache_clear()
    try:
        with pytest.warns(native.NativeKernelWarning, match="no C.. compiler"):
            assert not native.available()
        n, block = 300, 64
        p, m, v, _, grads, reference, ranges = host_problem(monkeypatch, n, np.float32, 1.0, 0.01, None, "host")
        with HostAdamW(LR, B1, B2, EPS, 0.01, num_threads=1, block_elements=block) as opt:
            for k, g in enumerate(grads):
                opt.step(p, g, m, v, count=k + 1)
        assert ranges == [(n // block * block, n)] * 5
        assert_matches(p, m, v, None, None, reference)
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
        assert native.available()


@pytest.mark.parametrize("moments", [False, True])
def test_native_skipped_step_touches_nothing(moments):
    """apply=False (an overflowed fp16 step): params and moments stay bit for bit, the non-finite
    gradients are not read, and in moments mode the updates made from them are zeros; apply=True
    with the same call moves them."""
    rng = np.random.default_rng(7)
    p, m = (jnp.asarray(rng.standard_normal(1000, dtype=np.float32)) for _ in range(2))
    v = jnp.asarray(rng.random(1000, dtype=np.float32))
    g = jnp.full((1000,), np.nan, jnp.float32).at[::3].set(np.inf)

    @jax.jit
    def step(apply, g):
        s = native.adamw_scalars(3, 1e-2, 0.9, 0.999, 1e-8, 0.1, apply=apply)
        out, mu, nu, _ = native.host_adamw(s, [p], [g], [m], [v], moments=moments)
        if moments:
            out = [native.adamw_updates(s, p, mu[0], nu[0])]
        return out[0], mu[0], nu[0]

    out, mu, nu = step(False, g)
    np.testing.assert_array_equal(np.asarray(out), np.zeros(1000) if moments else np.asarray(p))
    np.testing.assert_array_equal(np.asarray(mu), np.asarray(m))
    np.testing.assert_array_equal(np.asarray(nu), np.asarray(v))
    out, mu, nu = step(True, jnp.ones(1000, jnp.float32))
    assert not np.array_equal(np.asarray(mu), np.asarray(m)) and np.isfinite(np.asarray(out)).all()


def test_native_moments_mode_writes_the_moments_only_and_its_updates_apply_to_the_params_mode():
    """moments=True: the kernel writes m' and v' (bit for bit the params mode's) and no params;
    adamw_updates then makes optax's updates from them with the same scalars, and params + updates
    is the params mode's p' to a few ulps (the kernel writes decay p - d, the apply p + (-d - lr_wd p)),
    fp32 and bf16 gradients."""
    rng = np.random.default_rng(11)
    p, m, g = (jnp.asarray(rng.standard_normal(5000, dtype=np.float32)) for _ in range(3))
    v = jnp.asarray(rng.random(5000, dtype=np.float32))
    s = native.adamw_scalars(4, 1e-2, 0.9, 0.999, 1e-8, 0.1)
    for grads in (g, g.astype(jnp.bfloat16)):
        first, mu, nu, _ = jax.jit(lambda s, g: native.host_adamw(s, [p], [g], [m], [v], moments=True))(s, grads)
        want_p, want_m, want_v, _ = jax.jit(lambda s, g: native.host_adamw(s, [p], [g], [m], [v]))(s, grads)
        assert first is None
        np.testing.assert_array_equal(np.asarray(mu[0]), np.asarray(want_m[0]))
        np.testing.assert_array_equal(np.asarray(nu[0]), np.asarray(want_v[0]))
        new_p = jax.jit(lambda s, p, m, v: p + native.adamw_updates(s, p, m, v))(s, p, mu[0], nu[0])
        np.testing.assert_allclose(np.asarray(new_p), np.asarray(want_p[0]), rtol=1e-6, atol=1e-9)
    with pytest.raises(ConfigError, match="out16 is for params mode"):
        native.host_adamw(s, [p], [g], [m], [v], [p.astype(jnp.bfloat16)], moments=True)
