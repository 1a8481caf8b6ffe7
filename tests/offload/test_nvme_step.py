"""offload_optimizer="nvme" in the training step: equal to the in-memory host optimizer bitwise,
equal to plain optax, and clear errors for a bad path or a failing disk."""
import errno
import os

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import broken
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_run
import zerojax._placement as placement
from zerojax.offload import _nvme as nvme
from zerojax.offload._nvme_step import HostLoopStep


def adamw():
    schedule = optax.linear_schedule(1e-2, 1e-3, 4)  # followed step by step on the host
    return optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1)


def nvme_state(path, stage=2, precision="fp32", **kw):
    config = zj.ZeroConfig(stage=stage, precision=precision, offload_optimizer="nvme", nvme_path=str(path),
                           sub_group_size=100, param_persistence_threshold=0, **kw)
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config)


def logical(state):
    plan = state.plan
    return plan.map(lambda lay, x: placement.unpad(x, lay) if lay.params_partitioned else x, state.params)


CLIP = 0.05  # below every step's gradient norm (0.17-0.36 here): it clips every step


def check_nvme_training(path, stage):
    data = batches(4)
    ref = reference_run(init_params(jax.random.PRNGKey(0)), adamw(), data, clip=CLIP)
    state = nvme_state(path, stage=stage, gradient_clipping=CLIP)
    assert state.master is None and state.opt_state is None  # nothing of the optimizer in memory
    step = zj.make_train_step(loss_fn, state)
    assert isinstance(step.step, HostLoopStep)  # inside the watchdog's wrapper
    norms = []
    try:
        for b in data:
            state, m = step(state, b)
            norms.append(float(m["grad_norm"]))
    finally:
        step.close()
    # HostAdamW folds the bias corrections into one step size: a few ulps from optax's rounding
    err = max_rel_err(logical(state), ref.params)
    assert err < 3e-6, f"params differ from the clipped reference by {err:.2e}"
    assert min(ref.norms) > CLIP
    np.testing.assert_allclose(norms, ref.norms, rtol=1e-5)
    assert os.path.exists(path / "zerojax_optimizer_p0" / "COMMITTED")


@pytest.mark.parametrize("stage", [1, 3])
def test_nvme_training_equals_plain_optax(tmp_path, stage):
    check_nvme_training(tmp_path, stage)


def test_nvme_clipping_check_catches_an_inverted_coefficient(tmp_path, monkeypatch):
    broken.invert_clipping(monkeypatch)
    with pytest.raises(AssertionError, match="params differ"):
        check_nvme_training(tmp_path, 1)


def test_nvme_equals_in_memory_host_optimizer_bitwise(tmp_path):
    data = batches(4)
    runs = {}
    for store in ("nvme", "memory"):
        (tmp_path / store).mkdir()
        state = nvme_state(tmp_path / store, precision="bf16")
        step = HostLoopStep(loss_fn, state, store=store)
        for b in data:
            state, _ = step(state, b)
        runs[store] = ([np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)], step.master())
        step.close()
    for a, b in zip(runs["nvme"][0], runs["memory"][0]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    assert np.array_equal(runs["nvme"][1], runs["memory"][1])


def test_bad_nvme_path_fails_before_any_step(tmp_path):
    with pytest.raises(nvme.NvmeError, match="does not exist|no such|missing"):
        zj.make_train_step(loss_fn, nvme_state(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(nvme.NvmeError, match="not a directory"):
        zj.make_train_step(loss_fn, nvme_state(tmp_path / "file"))


def test_disk_full_mid_run_is_a_clear_error_and_keeps_the_last_state(tmp_path, monkeypatch):
    state = nvme_state(tmp_path)
    step = zj.make_train_step(loss_fn, state)
    data = batches(3)
    state, _ = step(state, data[0])
    before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(state.params)]
    committed = step.master().copy()
    real = os.pwrite

    def full(fd, buf, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(nvme.NvmeError, match="space"):
        step(state, data[1])
    monkeypatch.setattr(os, "pwrite", real)
    # the caller's state and the store's last committed step are intact; training resumes
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree_util.tree_leaves(state.params)))
    assert np.array_equal(step.master(), committed)
    state, m = step(state, data[1])
    assert np.isfinite(float(m["loss"]))
    step.close()
