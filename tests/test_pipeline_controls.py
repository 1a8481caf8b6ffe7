"""The step pipeline's rules have one home each (zerojax.update._pipeline): break one there and
every path's check of it fails. Each test runs a path once as it is (it must pass) and once with
the rule broken (its check must then fail)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
import zerojax._placement as placement
from tests import broken
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_train
from tests.offload.zenflow_reference import ZenFlowReference

CLIP = 0.05  # below every step's norm: it clips
PATHS = {
    "device": (dict(stage=2), {}),
    "fused": (dict(stage=2), {"fused_adam": True}),
    "cpu_offload": (dict(stage=2, offload_optimizer="cpu"), {}),
    "nvme": (dict(stage=2, offload_optimizer="nvme"), {}),
    "zenflow": (dict(stage=2, offload_optimizer="cpu",
                     zenflow={"topk_ratio": 0.3, "update_interval": 1, "select_strategy": "step",
                              "select_interval": 100, "overlap_step": False}), {}),
}


def tx():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)


def _state(path, tmp_path, **extra):
    cfg, _ = PATHS[path]
    cfg = dict(cfg, **extra)
    if path == "nvme":
        cfg["nvme_path"] = str(tmp_path)
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx(), config=zj.ZeroConfig(**cfg))


def _logical(state):
    return jax.tree_util.tree_unflatten(state.plan.treedef,
                                        [np.asarray(x) for x in placement.params_logical(state.plan, state.params)])


def _clipped_run(path, tmp_path):
    state = _state(path, tmp_path, gradient_clipping=CLIP)
    step = zj.make_train_step(loss_fn, state, **PATHS[path][1])
    for b in batches(2):
        state, _ = step(state, b)
    state = step.finish(state)
    step.close()
    return _logical(state)


def _zero_optimizer_clipped():
    params = init_params(jax.random.PRNGKey(0))
    t = zj.zero_optimizer(tx(), config=zj.ZeroConfig(stage=2, gradient_clipping=CLIP))
    s = t.init(params)
    grad = jax.jit(jax.grad(loss_fn))  # the gradient in one program; zero_optimizer's update runs as before
    for b in batches(2):
        u, s = t.update(grad(params, b), s, params)
        params = optax.apply_updates(params, u)
    return params


@functools.cache
def _clip_reference(zenflow: bool):
    """What every path's clipped run must equal (host arrays), computed once for the twelve cases:
    plain optax with DeepSpeed's clipping written out (tests/helpers.py), or ZenFlow's own
    algorithm written out in numpy with the same clipping. Neither runs library code that the
    negative controls break, so a broken case compares against the same numbers."""
    params = init_params(jax.random.PRNGKey(0))
    if zenflow:
        ref = ZenFlowReference(params, jax.jit(jax.grad(loss_fn)), lambda c: 1e-2, topk_ratio=0.3, update_interval=1,
                               overlap=False, select_interval=100, weight_decay=1e-4, clip=CLIP)
        for b in batches(2):
            ref.step(b)
        ref.finish()
        return jax.device_get(ref.params())
    return jax.device_get(reference_train(params, tx(), batches(2), clip=CLIP)[0])


@pytest.mark.parametrize("path", list(PATHS) + ["zero_optimizer"])
@pytest.mark.parametrize("broken_clip", [False, True])
def test_clipping_has_one_home(path, broken_clip, tmp_path, monkeypatch):
    want = _clip_reference(path == "zenflow")  # ZenFlow: its own algorithm, written out in numpy
    if broken_clip:
        broken.invert_clipping(monkeypatch)
    got = _zero_optimizer_clipped() if path == "zero_optimizer" else _clipped_run(path, tmp_path)
    err = max_rel_err(got, want)
    if broken_clip:
        assert err > 1e-3, f"{path}: inverted clipping went unnoticed"
    else:
        assert err < 1e-5, f"{path}: {err}"


def nan_loss(params, batch):
    """The model's loss plus a term that is nan for a batch marked bad; its gradient stays finite."""
    return loss_fn(params, batch) + jnp.mean(batch["bad"])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("broken_skip", [False, True])
def test_skip_rule_has_one_home(path, broken_skip, tmp_path, monkeypatch):
    if broken_skip:
        broken.never_skip(monkeypatch)
    state = _state(path, tmp_path)
    step = zj.make_train_step(nan_loss, state, check_errors=False, **PATHS[path][1])
    b = dict(batches(1)[0])
    b["bad"] = np.full((len(b["y"]),), np.nan, np.float32)
    before = _logical(state)
    state, metrics = step(state, b)
    state = step.finish(state)
    step.close()
    after = _logical(state)
    moved = max_rel_err(after, before) > 0
    if broken_skip:
        assert moved and not bool(metrics["skipped"]), f"{path}: a broken skip rule went unnoticed"
    else:
        assert not moved and bool(metrics["skipped"]), f"{path}: a nan-loss step was applied"
