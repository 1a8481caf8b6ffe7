"""The Pallas fused AdamW (interpret mode on CPU) against optax.adamw."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import broken
from tests.helpers import (
    batches,
    init_params,
    loss_fn,
    max_rel_err,
    mixed_reference_run,
    reference_run,
)
from zerojax.kernels._fused_adam import fused_adamw


def optax_run(p0, grads, scale, lr, b1, b2, eps, wd):
    tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    p = jnp.asarray(p0)
    state = tx.init(p)
    for g in grads:
        u, state = tx.update(g.astype(jnp.float32) * jnp.float32(scale), state, p)
        p = optax.apply_updates(p, u)
    return np.asarray(p), np.asarray(state[0].mu), np.asarray(state[0].nu)


def assert_close(actual, expected, rtol=1e-6):
    floor = 1e-6 * float(np.max(np.abs(expected)))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=floor)


@pytest.mark.parametrize("n,block,wd,scale,gdtype,out_dtype", [
    (1024, 256, 0.0, 1.0, jnp.float32, jnp.bfloat16),      # whole blocks only
    (1000, 128, 0.01, 0.25, jnp.float32, jnp.bfloat16),    # ragged last block
    (777, 64, 0.1, 4.0, jnp.bfloat16, jnp.float16),        # 16-bit grads
    (50, 64, 0.01, 0.5, jnp.float16, jnp.bfloat16),        # smaller than one block
])
def test_matches_optax_adamw(n, block, wd, scale, gdtype, out_dtype):
    rng = np.random.default_rng(n)
    lr, b1, b2, eps = 1e-2, 0.9, 0.99, 1e-8
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [jnp.asarray((rng.standard_normal(n) * 0.1).astype(np.float32)).astype(gdtype)
             for _ in range(4)]
    p_ref, m_ref, v_ref = optax_run(p0, grads, scale, lr, b1, b2, eps, wd)

    master = jnp.asarray(p0)
    m, v = jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.float32)
    for k, g in enumerate(grads):
        master, m, v, p16 = fused_adamw(master, m, v, g, count=k + 1, lr=lr, b1=b1, b2=b2,
                                        eps=eps, weight_decay=wd, grad_scale=scale,
                                        out_dtype=out_dtype, block_size=block)
    assert_close(master, p_ref)
    assert_close(m, m_ref)
    assert_close(v, v_ref)
    assert p16.dtype == out_dtype
    np.testing.assert_array_equal(np.asarray(p16), np.asarray(master.astype(out_dtype)))


def test_traced_scalars_inside_jit_do_not_recompile_per_value():
    n = 300
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(n).astype(np.float32)
    g = jnp.asarray(rng.standard_normal(n).astype(np.float32))

    traces = []

    @jax.jit
    def step(master, m, v, count, lr, scale):
        traces.append(1)
        return fused_adamw(master, m, v, g, count, lr, weight_decay=0.01, grad_scale=scale,
                           block_size=128)

    master, m, v = jnp.asarray(p0), jnp.zeros(n), jnp.zeros(n)
    tx = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.01)
    p_ref, st = jnp.asarray(p0), tx.init(jnp.asarray(p0))
    for k in range(3):
        lr = float(optax.linear_schedule(1e-2, 1e-3, 3)(k))
        master, m, v, _ = step(master, m, v, jnp.int32(k + 1), jnp.float32(lr), jnp.float32(0.5))
        u, st = tx.update(g * 0.5, st, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
    assert len(traces) == 1
    assert_close(master, np.asarray(p_ref))


def test_rejects_mismatched_buffers():
    x = jnp.zeros(16)
    with pytest.raises(ValueError, match="every buffer must be flat"):
        fused_adamw(x, jnp.zeros(8), jnp.zeros(16), x, 1, 1e-3)
    with pytest.raises(zj.ConfigError, match="m must be float32"):
        fused_adamw(x, jnp.zeros(16, jnp.bfloat16), jnp.zeros(16), x, 1, 1e-3)
    with pytest.raises(ValueError, match="power of two"):
        fused_adamw(x, jnp.zeros(16), jnp.zeros(16), x, 1, 1e-3, block_size=100)


def test_lowers_to_a_single_triton_kernel_for_gpu_without_a_gpu():
    """Catches Triton-lowering breakage (e.g. after a jax upgrade) on a CPU-only machine."""
    from zerojax.kernels import _fused_adam as fa
    try:
        jax.jit(jnp.sin).trace(jnp.zeros(3)).lower(lowering_platforms=("cuda",))
    except Exception as e:  # this jaxlib cannot lower for GPU at all
        pytest.skip(f"no GPU lowering in this jaxlib: {e}")
    from zerojax._compat import pallas_call_lowers_for_cuda
    if not pallas_call_lowers_for_cuda("triton"):
        pytest.skip("this JAX lowers a Triton pallas_call only where it sees a GPU (jax 0.12)")
    n = 10_000  # two whole blocks of 4096 and a ragged tail
    f32, bf16 = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.bfloat16)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)

    def step(master, m, v, g, lr, scale):
        return fa._fused_adamw(master, m, v, g, 3, lr, 0.9, 0.999, 1e-8, 0.01, scale,
                               out_dtype=jnp.dtype(jnp.bfloat16), block_size=4096,
                               interpret=False, num_warps=4, num_stages=2)

    text = jax.jit(step).trace(f32, f32, f32, bf16, scalar, scalar).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "grid_x = 2" in text


CLIP = 0.05  # below every step's gradient norm (0.17-0.36 on these batches): it clips every step
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 4)


def fused_tx():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.1)


def check_fused_step(stage, precision):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(4)
    if precision == "fp32":
        ref, tol = reference_run(params, fused_tx(), data, clip=CLIP), 1e-6
    else:
        ref, tol = mixed_reference_run(params, fused_tx(), data, precision, stage=stage, clip=CLIP), 1e-5
    config = zj.ZeroConfig(stage=stage, precision=precision, gradient_clipping=CLIP, param_persistence_threshold=0)
    state = zj.shard_train_state(params, fused_tx(), config=config)
    # small blocks so the kernel (not only its ragged tail) runs on these small leaves
    step = zj.make_train_step(loss_fn, state, fused_adam=True, fused_block_size=16)
    norms = []
    for b in data:
        state, m = step(state, b)
        norms.append(float(m["grad_norm"]))
    err = max_rel_err(state.full_params(jnp.float32), ref.params)
    assert err < tol, f"params differ from the reference by {err:.2e}"
    assert min(ref.norms) > CLIP
    np.testing.assert_allclose(norms, ref.norms, rtol=1e-5)
    assert int(state.opt_state.count) == 4
    # the last update ran at the schedule's value for count 3: 1e-2 + (1e-3 - 1e-2) * 3 / 4
    assert float(state.opt_state.hyperparams["learning_rate"]) == pytest.approx(3.25e-3, rel=1e-6)


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_the_step_updates_with_the_fused_kernel_like_the_reference(stage, precision):
    check_fused_step(stage, precision)


def test_fused_step_check_catches_an_inverted_clip_coefficient(monkeypatch):
    broken.invert_clipping(monkeypatch)
    with pytest.raises(AssertionError, match="params differ"):
        check_fused_step(1, "fp32")


def test_fused_step_needs_adam():
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.sgd(1e-2), config=zj.ZeroConfig(stage=2))
    with pytest.raises(zj.StepOptionError, match="computes Adam/AdamW"):
        zj.make_train_step(loss_fn, state, fused_adam=True)


def lower_kernel_for(platform, n=10_000, block=4096, interpret=None):
    from zerojax.kernels import _fused_adam as fa
    f32, bf16 = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.bfloat16)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)

    def step(master, m, v, g, lr, scale):
        return fa._fused_adamw(master, m, v, g, 3, lr, 0.9, 0.999, 1e-8, 0.01, scale,
                               out_dtype=jnp.dtype(jnp.bfloat16), block_size=block,
                               interpret=interpret, num_warps=4, num_stages=2)

    return jax.jit(step).trace(f32, f32, f32, bf16, scalar, scalar).lower(
        lowering_platforms=(platform,)).as_text()


def test_the_default_follows_the_lowering_platform_not_the_machine():
    """interpret=None: traced here, the CUDA lowering holds the GPU kernel, the CPU one none."""
    try:
        cuda = lower_kernel_for("cuda", n=9_000)
    except Exception as e:  # this jaxlib cannot lower for GPU at all
        pytest.skip(f"no GPU lowering in this jaxlib: {e}")
    from zerojax._compat import pallas_gpu_backend
    target = {"triton": "xla.gpu.triton", "mosaic_gpu": "mosaic_gpu"}[pallas_gpu_backend()]
    assert cuda.count(target) == 1
    cpu = lower_kernel_for("cpu", n=9_000)
    assert "xla.gpu.triton" not in cpu and "mosaic_gpu" not in cpu and "custom_call" not in cpu


def test_lowers_through_mosaic_gpu_where_jax_makes_it_the_default(monkeypatch):
    """JAX 0.11 deprecates Triton: the kernel then goes through Mosaic GPU (256-element blocks,
    sqrt as x * rsqrt(x)); lowered here on this JAX's Mosaic GPU by picking that branch."""
    import warnings

    import zerojax._compat as compat
    try:
        jax.jit(jnp.sin).trace(jnp.zeros(3)).lower(lowering_platforms=("cuda",))
    except Exception as e:
        pytest.skip(f"no GPU lowering in this jaxlib: {e}")
    if not compat.pallas_call_lowers_for_cuda("mosaic_gpu"):
        pytest.skip("no Mosaic GPU pallas_call in this jax (from jax 0.12 Mosaic GPU kernels have their own API)")
    monkeypatch.setattr(compat, "pallas_gpu_backend", lambda: "mosaic_gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # pallas_call for Mosaic GPU, on JAX 0.10
        text = lower_kernel_for("cuda", n=1_000, block=512)  # capped to 256: three blocks and a tail
    assert text.count("mosaic_gpu") >= 1 and "xla.gpu.triton" not in text


def test_mosaic_sqrt_matches_sqrt_at_zero_and_beyond():
    from zerojax.kernels._fused_adam import _sqrt_by_rsqrt
    x = jnp.asarray([0.0, 1e-30, 1e-8, 0.25, 2.0, 1e8], jnp.float32)
    np.testing.assert_allclose(np.asarray(_sqrt_by_rsqrt(x)), np.sqrt(np.asarray(x)), rtol=1e-6)
