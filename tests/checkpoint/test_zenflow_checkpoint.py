"""Checkpoints of ZenFlow runs hold the engine's state (host master and moments, accumulated
gradients, a host update in flight, the device's selected rows and 1-D leaves, schedule and
counters): 5 steps, save, restore into a new step, 5 more equal 10 straight, bit for bit; a
state of another step than its engine's is refused by name; the checkpoint is the format every
tier writes, so it moves to the device tier and back."""
import json
import os

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
import zerojax._placement as placement
from zerojax.checkpoint import CheckpointManager
from tests.helpers import batches, init_params, loss_fn

DATA = batches(10, batch_size=16)


def adamw():
    # injected settings under a schedule: a resume takes the schedule up where it was
    return optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 1e-3, 10),
                                                 weight_decay=0.1)


def config(block=None, precision="bf16"):
    if block is None:  # the device tier
        return zj.ZeroConfig(stage=2, precision=precision)
    return zj.ZeroConfig(stage=2, precision=precision, offload_optimizer="cpu", zenflow=block,
                         param_persistence_threshold=0)


def fresh(block=None, precision="bf16"):
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config(block, precision))


def restored(mngr, block=None, precision="bf16"):
    target = zj.abstract_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config(block, precision))
    return mngr.restore(target)[0]


def weights(state):
    """The state's weights as fp32 numpy leaves (the device tier's fp32 master where it has one)."""
    if state.master is not None:
        return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(jax.device_get(state.full_params()))]
    return [np.asarray(x, np.float32) for x in placement.params_logical(state.plan, state.params)]


def logical(state, x, path):
    """A stored optimizer leaf mirroring the param ``path`` in the param's logical shape."""
    lay = next(lay for lay in state.plan.leaves if lay.path == path)
    return np.asarray(x if tuple(x.shape) == tuple(lay.shape) else placement.unpad(x, lay))


def train(step, state, data):
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def engine_meta(mngr, step):
    with open(os.path.join(mngr.directory, str(step), "zerojax", "metadata")) as f:
        return json.load(f)["zenflow"]


def resume_case(tmp_path, block, straight_run: bool):
    """(max |diff| of the resumed run's weights against the straight run's, the engine's saved
    entry). The run saves at step 5 and goes on to 10 (with ``straight_run``, a run without a save
    is the reference too); the checkpoint is restored into that run's live step, and into a new one."""
    state = fresh(block)
    step = zj.make_train_step(loss_fn, state)
    state, losses = train(step, state, DATA[:5])
    mngr = CheckpointManager(tmp_path / "ckpt")
    mngr.save(5, state)
    in_flight = step._pending is not None  # a host update in flight stays in flight (not applied by the save)
    state, more = train(step, state, DATA[5:])
    state = step.finish(state)
    want = weights(state)
    # a live target: its open step goes on from the checkpoint, and the state of step 10 is refused
    back, _ = mngr.restore(state)
    with pytest.raises(zj.StateError, match="restored for step 5.*at step 10"):
        step(state, DATA[0])
    back, _ = train(step, back, DATA[5:])
    assert max_diff(weights(step.finish(back)), want) == 0.0
    step.close()
    if straight_run:
        state = fresh(block)
        with zj.make_train_step(loss_fn, state) as step:
            state, straight = train(step, state, DATA)
            assert max_diff(weights(step.finish(state)), want) == 0.0 and straight == losses + more

    back = restored(mngr, block)  # a new step, as a new process builds it
    with zj.make_train_step(loss_fn, back) as step:
        back, resumed = train(step, back, DATA[5:])
        assert resumed == more
        got = weights(step.finish(back))
    meta = engine_meta(mngr, 5)
    assert in_flight == (meta["pending"] is not None)
    return max_diff(got, want), meta


def test_update_interval_2_resumes_exactly_and_a_state_of_another_step_is_refused(tmp_path):
    block = {"update_interval": 2, "topk_ratio": 0.2, "select_strategy": "step", "select_interval": 4}
    diff, meta = resume_case(tmp_path, block, straight_run=False)
    assert diff == 0.0
    assert meta["acc_steps"] == [1] and meta["host_updates"] == 2  # gradients accumulated but not applied

    # the engine moved on to step 6: the state of step 5 is not saved with it
    state = fresh(block)
    with zj.make_train_step(loss_fn, state) as step:
        state, _ = train(step, state, DATA[:2])
        _, _ = step(state, DATA[2])
        mngr = CheckpointManager(tmp_path / "other")
        with pytest.raises(zj.CheckpointError, match=r"at step 2, .*optimizer state of step 3.*Fix:"):
            mngr.save(2, state)
    assert mngr.all_steps() == []


def test_overlap_step_resumes_with_the_host_update_in_flight(tmp_path):
    block = {"update_interval": 2, "topk_ratio": 0.2, "overlap_step": True, "select_strategy": "step",
             "select_interval": 8}
    diff, meta = resume_case(tmp_path, block, straight_run=True)
    assert diff == 0.0
    assert meta["pending"] is not None and meta["pending"]["through"] == 4  # saved, applied after the resume


def test_warm_up_and_reselection_resume_between_reselections(tmp_path):
    block = {"update_interval": 2, "topk_ratio": 0.2, "full_warm_up_rounds": 1, "select_strategy": "step",
             "select_interval": 4}
    diff, meta = resume_case(tmp_path, block, straight_run=False)
    assert diff == 0.0
    assert meta["selections"] == 1 and meta["since_select"] == 4  # the next reselection comes after the resume


def test_update_interval_auto_resumes_exactly(tmp_path):
    diff, meta = resume_case(tmp_path, {"update_interval": "auto", "topk_ratio": 0.2}, straight_run=False)
    assert diff == 0.0
    assert meta["_mass_steps"] > 0  # the masses since the last update travel with it


def test_checkpoints_move_between_zenflow_and_the_device_tier(tmp_path):
    block = {"update_interval": 2, "topk_ratio": 0.2, "select_strategy": "step", "select_interval": 4}
    # a fresh ZenFlow state saves before any step: the params and a fresh optimizer state
    mngr = CheckpointManager(tmp_path / "fresh")
    mngr.save(0, fresh(block, "fp32"))
    back = restored(mngr, None, "fp32")
    assert max_diff(weights(back), weights(fresh(None, "fp32"))) == 0.0
    assert all(float(np.abs(x).max()) == 0 for x in jax.tree_util.tree_leaves(jax.device_get(back.opt_state))
               if np.ndim(x) > 0)

    # a ZenFlow run's checkpoint onto the device tier: its weights, the 1-D leaves' moments, the schedule
    state = fresh(block, "fp32")
    with zj.make_train_step(loss_fn, state) as step:
        state, _ = train(step, state, DATA[:5])
        mngr = CheckpointManager(tmp_path / "zen")
        mngr.save(5, state)
        saved = weights(state)
        bias_mu = np.asarray(step.dev["vec_opt"][0].mu[0])  # dense/bias, the first 1-D leaf
    device = restored(mngr, None, "fp32")
    assert max_diff(weights(device), saved) == 0.0
    node = device.opt_state.inner_state[0]
    assert int(node.count) == 5 and np.array_equal(logical(device, node.mu["dense"]["bias"], "dense/bias"), bias_mu)
    step = zj.make_train_step(loss_fn, device)
    device, losses = train(step, device, DATA[5:])
    assert all(np.isfinite(losses)) and max_diff(weights(device), saved) > 1e-4

    # onto a ZenFlow target whose engine differs (more rows selected): a new engine, named
    other = dict(block, topk_ratio=0.5)
    with pytest.warns(zj.ZeroJaxWarning, match=r"does not fit the target \(it selects"):
        zen = restored(mngr, other, "fp32")
    with zj.make_train_step(loss_fn, zen) as step:
        assert step.host_count == 5 and step.selections == 0
        zen, m = step(zen, DATA[5])
        assert np.isfinite(float(m["loss"]))

    # a device run's checkpoint onto ZenFlow: the host's moments and the 1-D leaves from its Adam state
    state = fresh(None, "fp32")
    step = zj.make_train_step(loss_fn, state)
    state, _ = train(step, state, DATA[:5])
    mngr = CheckpointManager(tmp_path / "device")
    mngr.save(5, state)
    node = state.opt_state.inner_state[0]
    saved = weights(state)
    want_mu = {k: logical(state, node.mu["dense"][k], "dense/" + k) for k in ("bias", "kernel")}
    zen = restored(mngr, block, "fp32")
    with zj.make_train_step(loss_fn, zen) as step:
        assert step.host_count == 5 and step.state_step == 5
        mat = [state.plan.leaves[i].path for i in step.mat]
        kernel = step.layout.views(step.m)[mat.index("dense/kernel")]
        assert np.array_equal(kernel, want_mu["kernel"])
        assert np.array_equal(np.asarray(step.dev["vec_opt"][0].mu[0]), want_mu["bias"])
        zen, m = step(zen, DATA[5])
        assert float(m["learning_rate"]) == pytest.approx(float(optax.linear_schedule(1e-2, 1e-3, 10)(5)))
        zen, losses = train(step, zen, DATA[6:])
        assert all(np.isfinite(losses)) and max_diff(weights(step.finish(zen)), saved) > 1e-4
