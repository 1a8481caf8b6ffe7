"""optimizer.params.bias_correction: false (Adam, AdamW, Lamb) against a numpy reference of
DeepSpeed's fused kernels: m, v are the raw moving averages, update = m / (sqrt(v) + eps)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zerojax import ZeroConfig, optimizer_from_config
from zerojax.config._optimizers import scale_by_adam_uncorrected

PARAMS = {"w": np.array([[0.5, -1.0, 0.3], [2.0, 0.25, -0.7]], np.float32), "b": np.array([0.1, -0.2], np.float32)}
LR, B1, B2, EPS, WD, STEPS = 0.01, 0.8, 0.95, 1e-6, 0.1, 5


def grads(i):
    return {k: np.sin(v * (i + 1)).astype(np.float32) + 0.1 for k, v in PARAMS.items()}


def reference(kind: str, bias_correction: bool, max_coeff=10.0, min_coeff=0.01):
    """numpy: torch Adam (L2 on the gradient), AdamW (decoupled decay) or DeepSpeed's Lamb."""
    p = {k: v.astype(np.float64) for k, v in PARAMS.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t in range(1, STEPS + 1):
        for k in p:
            g = grads(t - 1)[k].astype(np.float64)
            if kind == "adam":
                g = g + WD * p[k]
            m[k] = B1 * m[k] + (1 - B1) * g
            v2[k] = B2 * v2[k] + (1 - B2) * g * g
            mh, vh = (m[k] / (1 - B1 ** t), v2[k] / (1 - B2 ** t)) if bias_correction else (m[k], v2[k])
            u = mh / (np.sqrt(vh) + EPS)
            if kind in ("adamw", "lamb"):
                u = u + WD * p[k]
            if kind == "lamb":
                wn, un = np.linalg.norm(p[k]), np.linalg.norm(u)
                u = u * (np.clip(wn / un, min_coeff, max_coeff) if wn > 0 and un > 0 else 1.0)
            p[k] = p[k] - LR * u
    return p


def run(block):
    tx = optimizer_from_config(ZeroConfig.from_deepspeed({"train_batch_size": 8, "optimizer": block}, world_size=1))
    params = jax.tree.map(jnp.asarray, PARAMS)
    state = tx.init(params)
    for i in range(STEPS):
        updates, state = tx.update(jax.tree.map(jnp.asarray, grads(i)), state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("kind,block", [
    ("adamw", {"type": "AdamW"}),
    ("adamw", {"type": "Adam"}),
    ("adam", {"type": "Adam", "params": {"adam_w_mode": False}}),
    ("lamb", {"type": "Lamb"}),
])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_bias_correction_matches_the_numpy_reference(kind, block, bias_correction):
    params = {"lr": LR, "betas": [B1, B2], "eps": EPS, "weight_decay": WD, "bias_correction": bias_correction,
              **block.get("params", {})}
    got = run({"type": block["type"], "params": params})
    want = reference(kind, bias_correction)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-5, atol=1e-6)


def test_without_bias_correction_the_first_step_is_scaled_by_one_minus_b1_over_sqrt_one_minus_b2():
    def first_step(bias_correction):
        block = {"type": "AdamW", "params": {"lr": LR, "bias_correction": bias_correction}}
        tx = optimizer_from_config(ZeroConfig.from_deepspeed({"train_batch_size": 8, "optimizer": block},
                                                             world_size=1))
        params = jax.tree.map(jnp.asarray, PARAMS)
        updates, _ = tx.update(jax.tree.map(jnp.asarray, grads(0)), tx.init(params), params)
        return updates

    on, off = first_step(True), first_step(False)
    for k in PARAMS:  # DeepSpeed's defaults b1 0.9, b2 0.999; |g| >> eps
        np.testing.assert_allclose(np.asarray(off[k]) / np.asarray(on[k]), 0.1 / np.sqrt(0.001), rtol=1e-4)


def test_the_uncorrected_transformation_state_and_jit():
    tx = scale_by_adam_uncorrected(B1, B2, EPS)
    g = jax.tree.map(jnp.asarray, grads(0))
    updates, state = jax.jit(tx.update)(g, tx.init(g))
    assert int(state.count) == 1
    for k in g:  # one step from zero moments: m = (1-b1) g, v = (1-b2) g^2
        want = (1 - B1) * np.asarray(g[k]) / (np.sqrt((1 - B2) * np.asarray(g[k]) ** 2) + EPS)
        np.testing.assert_allclose(np.asarray(updates[k]), want, rtol=1e-6)
