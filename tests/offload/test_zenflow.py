"""ZenFlow: config checks, column selection, the trajectory of a written-out numpy ZenFlow step
by step (overlap on and off, warm-up, reselection, a schedule, clipping) with its staleness,
Zen-auto, and equality with plain offloaded AdamW where the algorithm reduces to it."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import broken
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_train
from tests.offload.zenflow_reference import ZenFlowReference
import zerojax._placement as placement
from zerojax.offload._zenflow import AUTO_MAX_INTERVAL, ZenFlowStep, zenflow_settings


def adamw():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)


def zen_state(params, zenflow, stage=2, tx=None, **kw):
    config = zj.ZeroConfig(stage=stage, offload_optimizer="cpu", zenflow=zenflow, param_persistence_threshold=0, **kw)
    return zj.shard_train_state(params, tx or adamw(), config=config)


def logical_params(state):
    plan = state.plan
    return plan.map(lambda lay, x: placement.unpad(x, lay) if lay.params_partitioned else x, state.params)


@pytest.mark.parametrize("block,match", [
    ({"topk_ratio": 0.0}, "topk_ratio"),
    ({"topk_ratio": 1.0}, "topk_ratio"),
    ({"update_interval": 0}, "update_interval"),
    ({"select_strategy": "step"}, "select_interval='auto'"),
    ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "select_interval=2 is smaller"),
    ({"select_strategy": "often"}, "select_strategy"),
    ({"select_strategy": "epoch", "select_interval": 1, "update_interval": 4}, "select_interval=1 is smaller"),
    ({"select_interval": 0}, "select_interval=0"),
    ({"topk": 0.1}, "Unknown key"),
])
def test_bad_zenflow_settings(block, match):
    with pytest.raises(zj.ConfigError, match=match):
        zenflow_settings(block)


def test_zenflow_needs_host_offload_and_a_recognised_optimizer():
    params = init_params(jax.random.PRNGKey(0))
    on_device = zj.shard_train_state(params, adamw(), config=zj.ZeroConfig(stage=2, zenflow={"update_interval": 2}))
    with pytest.raises(zj.ConfigError, match="offload_optimizer='cpu'"):
        zj.make_train_step(loss_fn, on_device)
    opaque = zen_state(params, {"update_interval": 2}, tx=optax.adafactor(1e-2))
    with pytest.raises(zj.OptimizerError, match="zenflow runs the optimizer update outside optax"):
        zj.make_train_step(loss_fn, opaque)


@pytest.mark.parametrize("stage", [2])  # stages 1 and 3: against the numpy reference below
def test_update_every_step_without_overlap_equals_plain_offloaded_adamw(stage):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(5)
    want, _ = reference_train(params, adamw(), data)
    state = zen_state(params, {"update_interval": 1, "topk_ratio": 0.3, "select_strategy": "step",
                               "select_interval": 100}, stage=stage)
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    assert step.host_updates == 5 and step.max_staleness == 0
    assert max_rel_err(logical_params(state), want) < 1e-6
    step.close()


def test_all_columns_important_equals_plain_adamw():
    params = init_params(jax.random.PRNGKey(0))
    data = batches(5)
    want, _ = reference_train(params, adamw(), data)
    state = zen_state(params, {"update_interval": 3, "topk_ratio": 0.999, "select_strategy": "step",
                               "select_interval": 100})
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    # the device's AdamW updated every row every step; the host's results never overwrite them
    assert max_rel_err(logical_params(state), want) < 1e-6
    step.close()


def test_selection_picks_the_rows_with_the_largest_gradient_l1_norms():
    params = init_params(jax.random.PRNGKey(0))
    b = batches(1)[0]
    state = zen_state(params, {"update_interval": 2, "topk_ratio": 0.25, "select_strategy": "step",
                               "select_interval": 4})
    step = zj.make_train_step(loss_fn, state)
    state, _ = step(state, b)
    grads = jax.grad(loss_fn)(params, b)
    for path, g in [("emb", grads["emb"]), ("dense/kernel", grads["dense"]["kernel"]), ("out", grads["out"]),
                    ("odd", grads["odd"])]:
        scores = np.abs(np.asarray(g, np.float64)).sum(axis=1)
        k = int(np.ceil(0.25 * g.shape[0]))
        want = set(np.argsort(-scores, kind="stable")[:k].tolist())
        assert set(np.asarray(step.important[path]).tolist()) == want, path
    step.close()


# ------------------------------------------------------------- against the numpy ZenFlow
SCHEDULE = optax.linear_schedule(1e-2, 2e-3, 6)  # the host must use the lr of the step it follows
CASES = {  # (overlap_step, full_warm_up_rounds, gradient_clipping, stage)
    "sync": (False, 0, 0.0, 1),
    "overlap": (True, 0, 0.0, 3),
    "overlap-warm-up-clipped": (True, 1, 0.05, 2),  # 0.05: below every step's norm, it clips
}
_grad = jax.jit(jax.grad(loss_fn))


def check_against_reference(case, steps=6, interval=2):
    overlap, warm, clip, stage = CASES[case]
    params = init_params(jax.random.PRNGKey(0))
    block = {"update_interval": interval, "topk_ratio": 0.25, "overlap_step": overlap, "select_strategy": "step",
             "select_interval": 2 * interval, "full_warm_up_rounds": warm}
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.1)
    state = zen_state(params, block, stage=stage, tx=tx, gradient_clipping=clip)
    step = zj.make_train_step(loss_fn, state)
    ref = ZenFlowReference(params, _grad, SCHEDULE, topk_ratio=0.25, update_interval=interval, overlap=overlap,
                           select_interval=2 * interval, full_warm_up_rounds=warm, weight_decay=0.1, clip=clip)
    norms = []
    try:
        for t, b in enumerate(batches(steps)):
            state, m = step(state, b)
            want = ref.step(b)
            err = max_rel_err(logical_params(state), want)
            assert err < 1e-6, f"{case}: params differ from the reference after step {t + 1} by {err:.2e}"
            norms.append(float(m["grad_norm"]))
        state = step.finish(state)
        err = max_rel_err(logical_params(state), ref.finish())
        assert err < 1e-6, f"{case}: params differ from the reference after finish by {err:.2e}"
    finally:
        step.close()
    np.testing.assert_allclose(norms, ref.norms, rtol=1e-5)
    if clip:
        assert min(ref.norms) > clip
    assert ref.selections == 2 and ref.host_updates > 0
    # staleness measured row by row on the reference trajectory: the bound is reached, never exceeded
    bound = 2 * interval - 1 if overlap else interval - 1
    assert max(ref.staleness) == bound, ref.staleness
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_zenflow_follows_the_numpy_reference_step_by_step(case):
    check_against_reference(case)


def test_reference_check_catches_host_updates_landing_an_interval_late(monkeypatch):
    real = ZenFlowStep._apply

    def late(self, params, result):
        # each host result lands with the next update instead (its bookkeeping on time, so only
        # the comparison with the reference can tell)
        previous, self._late = getattr(self, "_late", None), result
        if previous is None:
            self.host_updates += 1
            self.reflected = max(self.reflected, result[1])
            return params
        return real(self, params, (previous[0], result[1]))

    monkeypatch.setattr(ZenFlowStep, "_apply", late)
    with pytest.raises(AssertionError, match="params differ"):
        check_against_reference("sync")


def test_reference_check_catches_an_inverted_clip_coefficient(monkeypatch):
    broken.invert_clipping(monkeypatch)
    with pytest.raises(AssertionError, match="params differ"):
        check_against_reference("overlap-warm-up-clipped")


@pytest.mark.parametrize("overlap,interval", [(True, 3), (False, 3), (True, 1)])
def test_staleness_bound(overlap, interval):
    """The step's own staleness metric agrees with the reference's row-by-row measure."""
    params = init_params(jax.random.PRNGKey(0))
    state = zen_state(params, {"update_interval": interval, "topk_ratio": 0.2, "overlap_step": overlap,
                               "select_strategy": "step", "select_interval": 50})
    step = zj.make_train_step(loss_fn, state)
    ref = ZenFlowReference(params, _grad, lambda count: 1e-2, topk_ratio=0.2, update_interval=interval,
                           overlap=overlap, select_interval=50, weight_decay=0.1)
    seen = []
    for b in batches(4 * interval + 2):
        state, m = step(state, b)
        ref.step(b)
        seen.append(m["staleness"])
    bound = 2 * interval - 1 if overlap else interval - 1
    assert max(ref.staleness) == bound and seen == ref.staleness
    state = step.finish(state)
    assert step.max_staleness == bound
    step.close()


def test_overlap_trains_and_finish_applies_every_gradient():
    params = init_params(jax.random.PRNGKey(0))
    data = batches(9)
    state = zen_state(params, {"update_interval": 2, "topk_ratio": 0.2, "overlap_step": True,
                               "select_strategy": "step", "select_interval": 4})
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    state = step.finish(state)
    assert step.acc_steps == [0, 0] and step._pending is None
    assert losses[-1] < losses[0]
    assert step.selections == 3  # steps 0, 4, 8
    step.close()


def test_zen_auto_fires_when_the_unimportant_mass_catches_up():
    # a linear loss: the gradient of row i is a_i everywhere, the same every step.
    # 20 rows, k = 0.1 -> rows 0 and 1 (a = 10) are important, 18 rows of a = 1 are not.
    # per step: important mass 2*4*10 = 80, unimportant 18*4*1 = 72. The trigger
    # unimp_acc / (0.9*10) >= 80 / (0.1*10) needs 72 s / 9 >= 80, i.e. s = 10 steps.
    a = np.ones((20, 1), np.float32)
    a[:2] = 10.0
    params = {"w": jnp.zeros((20, 4)), "b": jnp.zeros((4,))}

    def linear(p, batch):
        return jnp.sum(p["w"] * a) + jnp.sum(p["b"]) + 0.0 * jnp.sum(batch["x"])

    state = zen_state(params, {"update_interval": "auto", "topk_ratio": 0.1, "select_strategy": "step",
                               "select_interval": 1000})
    step = zj.make_train_step(linear, state)
    fired_at = []
    for i in range(25):
        before = step.host_updates
        state, _ = step(state, {"x": np.zeros((8, 1), np.float32)})
        if step.host_updates > before:
            fired_at.append(i + 1)
    assert fired_at == [10, 20]
    assert sorted(np.asarray(step.important["w"]).tolist()) == [0, 1]
    assert AUTO_MAX_INTERVAL > 10  # fired by the criterion, not the cap
    step.close()


def test_learning_rate_schedule_is_followed_on_device_and_host():
    params = init_params(jax.random.PRNGKey(0))
    data = batches(6)

    def tx():
        sched = optax.warmup_cosine_decay_schedule(0.0, 2e-2, 2, 6, 2e-3)
        return optax.inject_hyperparams(optax.adamw)(learning_rate=sched, weight_decay=0.1)

    want, _ = reference_train(params, tx(), data)
    state = zen_state(params, {"update_interval": 1, "topk_ratio": 0.3, "select_strategy": "step",
                               "select_interval": 100}, tx=tx())
    step = zj.make_train_step(loss_fn, state)
    lrs = []
    for b in data:
        state, m = step(state, b)
        lrs.append(m["learning_rate"])
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(2e-2)
    assert max_rel_err(logical_params(state), want) < 1e-6
    step.close()


def test_state_carries_only_params_and_checkpoints_round_trip(tmp_path):
    params = init_params(jax.random.PRNGKey(0))
    block = {"update_interval": 2, "topk_ratio": 0.2, "select_strategy": "step", "select_interval": 4}
    state = zen_state(params, block, precision="bf16")
    assert state.master is None and state.opt_state is None  # the step's host buffers hold them
    step = zj.make_train_step(loss_fn, state)
    for b in batches(3):
        state, _ = step(state, b)
    state = step.finish(state)
    step.close()
    manager = zj.CheckpointManager(str(tmp_path / "ckpt"))
    manager.save(3, state)
    manager.wait_until_finished()
    restored, _ = manager.restore(zen_state(params, block, precision="bf16"), 3)
    for a, b in zip(jax.tree_util.tree_leaves(restored.params), jax.tree_util.tree_leaves(state.params)):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    resumed = zj.make_train_step(loss_fn, restored)  # takes up the engine state saved with the step
    restored, m = resumed(restored, batches(4)[3])
    assert np.isfinite(float(m["loss"]))
    resumed.close()
