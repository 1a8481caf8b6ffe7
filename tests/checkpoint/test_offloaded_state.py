"""Checkpoints of runs whose optimizer state lives outside the TrainState (the NVMe store, with
and without the params): the checkpoint holds the whole training state, in the format every
tier writes, so 5 steps, save, restore and 5 more equal 10 straight, on a fresh nvme_path, on
the same one after its store trained on, and on another tier, both ways; a state of another
step than its store's is refused by name, never mixed."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.checkpoint import CheckpointManager
from tests.helpers import batches, init_params, loss_fn

DATA = batches(10, batch_size=16)


def adamw():
    # injected settings under a schedule: a resume must take the schedule up where it was
    return optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 1e-3, 10),
                                                 weight_decay=0.1)


def config(tier, path=None, precision="bf16"):
    if tier == "nvme":
        return zj.ZeroConfig(stage=2, precision=precision, offload_optimizer="nvme", nvme_path=str(path),
                             sub_group_size=300)
    if tier == "infinity":
        return zj.ZeroConfig(stage=3, precision=precision, offload_optimizer="nvme", offload_param="nvme",
                             nvme_path=str(path), sub_group_size=300, param_persistence_threshold=16)
    if tier == "cpu":
        return zj.ZeroConfig(stage=2, precision=precision, offload_optimizer="cpu")
    return zj.ZeroConfig(stage=1, precision=precision)


def params_of(step, state):
    """The trained params as fp32 numpy leaves: the master where the tier keeps one."""
    if hasattr(step, "full_params"):
        if state.plan.config.offload_param == "nvme":  # the files hold 16-bit params; the master is flat
            return jax.tree_util.tree_leaves(step.layout.views(step.master()))
        return jax.tree_util.tree_leaves(step.full_params(np.float32))
    return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(jax.device_get(state.full_params()))]


def logical(step, state):
    if state.plan.config.offload_param == "nvme":  # the master's leaves are in the files' layout
        return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(step.full_params(np.float32))]
    return params_of(step, state)


def train(state, data):
    step = zj.make_train_step(loss_fn, state)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, step, losses


def fresh(tier, path=None, precision="bf16"):
    if path is not None:
        os.makedirs(path, exist_ok=True)
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config(tier, path, precision))


def restored(mngr, tier, path=None, step=None, precision="bf16"):
    if path is not None:
        os.makedirs(path, exist_ok=True)
    target = zj.abstract_train_state(init_params(jax.random.PRNGKey(0)), adamw(),
                                     config=config(tier, path, precision))
    return mngr.restore(target, step=step)[0]


def close(a, b, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("tier", ["nvme", "infinity"])
def test_a_resumed_nvme_run_equals_the_straight_run(tmp_path, tier):
    straight, step, want_losses = train(fresh(tier, tmp_path / "straight"), DATA)
    want = params_of(step, straight)
    step.close()

    state, step, losses = train(fresh(tier, tmp_path / "run"), DATA[:5])
    mngr = CheckpointManager(tmp_path / "ckpt")
    mngr.save(5, state)
    # the checkpoint alone restores anywhere: the run's directory goes on past the saved step
    moved_on, _ = step(state, DATA[5])
    with pytest.raises(zj.CheckpointError, match=r"step 5 .*holds the optimizer state of step 6"):
        mngr.save(50, state)  # the state of step 5 with the store of step 6: never mixed
    with pytest.raises(zj.StateError, match=r"at step 5.*holds the optimizer state of step 6.*Fix: restore"):
        step(state, DATA[5])
    step.close()

    # a fresh nvme_path, and the run's own path, whose store is rewound to step 5
    for path in (tmp_path / "fresh", tmp_path / "run"):
        state, step, more = train(restored(mngr, tier, path), DATA[5:])
        assert losses + more == want_losses
        close(params_of(step, state), want)
        step.close()

    # the step that trained on past the save goes on from the restored store at its next call
    state, step, _ = train(fresh(tier, tmp_path / "live"), DATA[:5])
    live = CheckpointManager(tmp_path / "ckpt_live")
    live.save(5, state)
    later, _ = step(state, DATA[5])
    back, _ = live.restore(later)  # the live state as the target: the step's own plan
    for b in DATA[5:]:
        back, _ = step(back, b)
    close(params_of(step, back), want)
    with pytest.raises(zj.StateError, match="at step 6"):
        step(later, DATA[6])  # that state's store step was rewritten by the restore
    step.close()


@pytest.mark.parametrize("tier", ["nvme", "infinity"])
def test_checkpoints_move_between_nvme_and_the_other_tiers(tmp_path, tier):
    # fp32: under bf16 the NVMe store's master starts from the bf16 params (as DeepSpeed's does), the
    # other tiers' from the fp32 ones, so only fp32 runs of the two tiers are the same run
    straight, step, _ = train(fresh("cpu", precision="fp32"), DATA)
    want = params_of(step, straight)

    # an NVMe run's checkpoint resumed on the device and with its state in host memory
    state, step, _ = train(fresh(tier, tmp_path / "run", "fp32"), DATA[:5])
    mngr = CheckpointManager(tmp_path / "from_nvme")
    mngr.save(5, state)
    step.close()
    for other in ("cpu", "device"):
        state, step, _ = train(restored(mngr, other, precision="fp32"), DATA[5:])
        close(params_of(step, state), want, atol=1e-6)  # the host's and XLA's Adam round alike to ~1 ulp

    # and the other way: an on-device run's checkpoint resumed with its state on NVMe
    state, step, _ = train(fresh("device", precision="fp32"), DATA[:5])
    mngr = CheckpointManager(tmp_path / "to_nvme")
    mngr.save(5, state)
    state, step, _ = train(restored(mngr, tier, tmp_path / "restored", precision="fp32"), DATA[5:])
    close(logical(step, state), want, atol=1e-6)
    step.close()


def test_a_fresh_nvme_state_saves_before_any_step_and_a_stale_directory_is_not_read(tmp_path):
    """At step 0 the checkpoint holds what the store starts from (the params, zero moments),
    whatever another run left in nvme_path."""
    state, step, _ = train(fresh("nvme", tmp_path / "run", "fp32"), DATA[:2])
    step.close()
    state = fresh("nvme", tmp_path / "run", "fp32")  # the same directory, a store of step 2 in it
    mngr = CheckpointManager(tmp_path / "ckpt")
    mngr.save(0, state)
    back = restored(mngr, "device", precision="fp32")
    close(params_of(None, back), params_of(None, fresh("device", precision="fp32")), atol=0)
    moments = [x for x in jax.tree_util.tree_leaves(jax.device_get(back.opt_state)) if np.ndim(x) > 0]
    assert moments and all(float(np.abs(x).max()) == 0 for x in moments)


def test_consolidating_a_zero_infinity_checkpoint_gives_the_trained_params(tmp_path):
    """The params live in the store's files between steps; the checkpoint's consolidated copy is the
    store's fp32 master, as the step reads it back."""
    from safetensors.numpy import load_file

    state, step, _ = train(fresh("infinity", tmp_path / "run"), DATA[:3])
    mngr = CheckpointManager(tmp_path / "ckpt")
    mngr.save(3, state)
    out = zj.checkpoint.consolidate(str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"), progress=False)
    got = load_file(out)
    trained = step.full_params(np.float32)
    step.close()
    assert sorted(got) == sorted(".".join(str(getattr(k, "key", k)) for k in path)
                                 for path, _ in jax.tree_util.tree_flatten_with_path(trained)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(trained)[0]:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        # the 16-bit params the step trains with are the consolidated fp32 master, rounded
        np.testing.assert_array_equal(got[name].astype(jnp.bfloat16).astype(np.float32), leaf, err_msg=name)


def test_the_save_writes_the_store_where_it_lies_not_a_copy_in_memory(tmp_path):
    """Orbax copies every numpy leaf before writing it; the store's master and moments reach it as
    views of the committed slot whose copy is the view, so the save never holds them in memory."""
    import tracemalloc

    def init(rng):
        return {"w": jax.random.normal(rng, (512, 1024)) * 0.02, "b": jnp.zeros((1024,))}

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"]) ** 2)

    os.makedirs(tmp_path / "nv")
    state = zj.shard_train_state(init, optax.adamw(1e-3), rng=jax.random.PRNGKey(0),
                                 config=zj.ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path / "nv")))
    step = zj.make_train_step(loss, state)
    state, _ = step(state, {"x": jnp.ones((16, 512))})
    stored = 3 * 4 * (512 * 1024 + 1024)  # the fp32 master and both moments
    with CheckpointManager(tmp_path / "ck") as mngr:
        tracemalloc.start()
        try:
            mngr.save(1, state)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < stored / 3, f"the save held {peak / 2**20:.1f} MiB for {stored / 2**20:.1f} MiB of stored state"
    with CheckpointManager(tmp_path / "ck") as mngr:  # and what it wrote is the state
        back = mngr.restore(zj.abstract_train_state(init, optax.adamw(1e-3), config=config("cpu")))[0]
    np.testing.assert_array_equal(np.asarray(back.full_params()["w"], np.float32),
                                  np.asarray(step.full_params(np.float32)["w"]))
