"""Params on NVMe (ZeRO-Infinity, offload_param="nvme" with offload_optimizer="nvme"): the same
training as with the params in host memory, nothing of the params kept in memory between steps,
DeepSpeed's ZeRO-Infinity file through zj.initialize, and a damaged params file as a named error."""
import os

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
import zerojax._placement as placement
from tests.helpers import batches, init_params, loss_fn, max_rel_err


def adamw():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 1e-3, 4),
                                                 weight_decay=0.1)


def run(path, param, precision="fp32", gas=1, steps=4):
    """(params after ``steps`` as numpy leaves, losses, the step's reader or None)."""
    path.mkdir(exist_ok=True)
    config = zj.ZeroConfig(stage=3, precision=precision, offload_optimizer="nvme", offload_param=param,
                           nvme_path=str(path), sub_group_size=100, param_persistence_threshold=64,
                           gradient_accumulation_steps=gas, gradient_clipping=0.05)
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config)
    losses = []
    with zj.make_train_step(loss_fn, state) as step:
        for b in batches(steps):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        if param == "nvme":
            leaves = state.plan.treedef.flatten_up_to(state.params)
            assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # shapes only, no data
            params = step.full_params()
            reader = step.reader
        else:
            params = placement.params_logical(state.plan, state.params)
            params = state.plan.treedef.unflatten([np.asarray(x) for x in params])
            reader = None
    return jax.tree_util.tree_leaves(params), losses, reader, state


@pytest.mark.parametrize("precision,gas", [("fp32", 1), ("fp32", 2), ("bf16", 1)])
def test_nvme_params_train_as_params_in_host_memory(tmp_path, precision, gas):
    want, want_losses, _, _ = run(tmp_path / "cpu", "cpu", precision, gas)
    got, losses, reader, state = run(tmp_path / "nvme", "nvme", precision, gas)
    assert losses == want_losses
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=0, atol=1e-6)
    # each device read its own part of each param at least once a step; the reader ran ahead
    n_leaves = len(state.plan.leaves)
    assert reader.reads >= 4 * n_leaves * state.plan.n
    assert reader.ahead > 0
    # the params went to files: the slots hold them beside the 12 bytes of optimizer state
    store = os.path.join(tmp_path / "nvme", "zerojax_optimizer_p0")
    if precision == "bf16":
        n = reader.disk.flat.total
        assert os.path.getsize(os.path.join(store, "slot0.bin")) == 14 * n


def bf16_nvme_state(tmp_path):
    (tmp_path / "a").mkdir()
    config = zj.ZeroConfig(stage=3, precision="bf16", offload_optimizer="nvme", offload_param="nvme",
                           nvme_path=str(tmp_path / "a"), param_persistence_threshold=0)
    return zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config)


def test_params_are_read_from_the_files_not_from_memory(tmp_path):
    """Corrupting the committed params on disk changes the next step's loss: the step reads them."""
    state = bf16_nvme_state(tmp_path)
    data = batches(2)
    with zj.make_train_step(loss_fn, state) as step:
        state, _ = step(state, data[0])
        store = step.store
        region = 12 * store.num_elements  # the bf16 params follow master, m and v
        with open(os.path.join(store.path, f"slot{store._slot}.bin"), "r+b") as f:
            f.seek(region)
            f.write(np.full(store.num_elements, 0, np.uint16).tobytes())  # every param 0.0
        _, m = step(state, data[1])
    ref = loss_fn(jax.tree_util.tree_map(lambda x: x * 0, init_params(jax.random.PRNGKey(0))), data[1])
    np.testing.assert_allclose(float(m["loss"]), float(ref), rtol=1e-2)


def test_a_damaged_params_file_is_a_named_error(tmp_path):
    state = bf16_nvme_state(tmp_path)
    data = batches(2)
    with zj.make_train_step(loss_fn, state) as step:
        state, _ = step(state, data[0])
        committed = step.store.committed_count
        slot = os.path.join(step.store.path, f"slot{step.store._slot}.bin")
        os.truncate(slot, 12 * step.store.num_elements + 8)  # the params region cut short
        with pytest.raises(zj.NvmeError, match="reading the params failed") as info:
            step(state, data[1])
        assert slot.rsplit("/", 2)[0] in str(info.value) and "Fix" in str(info.value)
        assert step.store.committed_count == committed  # nothing was committed over it


def test_a_state_without_params_is_refused_where_arrays_are_needed(tmp_path):
    # (a checkpoint of it reads the params from the store: tests/checkpoint/test_offloaded_state.py)
    (tmp_path / "a").mkdir()
    config = zj.ZeroConfig(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=str(tmp_path / "a"))
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config)
    with zj.make_train_step(loss_fn, state) as step:
        state, _ = step(state, batches(1)[0])
        with pytest.raises(zj.StateError, match=r"step.full_params\(\)"):
            state.full_params()


def test_deepspeed_zero_infinity_config_trains(tmp_path):
    """DeepSpeed's ZeRO-Infinity example (both offload blocks on NVMe, its buffer keys and aio)."""
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "zero_optimization": {
              "stage": 3,
              "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4,
                                    "fast_init": False},
              "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 5,
                                "buffer_size": 1e8, "max_in_cpu": 1e9},
              "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
              "stage3_param_persistence_threshold": 0},
          "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                  "overlap_events": True}}
    state, step = zj.initialize(init_params(jax.random.PRNGKey(0)), loss_fn, ds, mesh=zj.make_mesh())
    assert state.plan.config.offload_param == "nvme"
    losses = []
    with step:
        for b in batches(3, batch_size=step.train_batch_size):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        params = step.full_params()
    assert int(state.step) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype(np.float32)}
    assert os.path.exists(os.path.join(nvme, "zerojax_optimizer_p0", "COMMITTED"))


def gpt_run(path, param, scan, steps=2):
    from zerojax.models import gpt

    path.mkdir(exist_ok=True)
    cfg = gpt.GPTConfig(vocab=128, n_layer=3, d_model=32, n_head=2, seq_len=8, scan=scan)
    config = zj.ZeroConfig(stage=3, offload_optimizer="nvme", offload_param=param, nvme_path=str(path),
                           param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=1000)
    # SGD with momentum (an update the NVMe step runs too): Adam would turn the key bias's gradient,
    # zero up to rounding, into steps of either sign, and the comparison would measure that
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    state = zj.shard_train_state(gpt.init_params(cfg, jax.random.PRNGKey(0)), tx, config=config)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab, (16, cfg.seq_len + 1)).astype(np.int32)}
    with zj.make_train_step(gpt.loss_fn(cfg), state) as step:
        losses = []
        for _ in range(steps):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        if param == "nvme":
            return jax.tree_util.tree_leaves(step.full_params()), losses, step.reader, state
        params = [np.asarray(x) for x in placement.params_logical(state.plan, state.params)]
        return params, losses, None, state


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_nvme_params_are_read_where_the_gpt_uses_them(tmp_path, scan):
    """A GPT as a Python loop and as a lax.scan over stacked layers, with every param gathered again
    for the backward pass (max_reuse_distance 0): equal to the params in host memory, and in the
    loop the backward pass reads params from the files again."""
    want, want_losses, _, _ = gpt_run(tmp_path / "cpu", "cpu", scan)
    got, losses, reader, state = gpt_run(tmp_path / "nvme", "nvme", scan)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert max_rel_err(got, want) < 1e-6
    once = len(state.plan.leaves) * state.plan.n * 2  # each device's part of each param, once a step
    if scan:  # the stacked layers are read where the loop starts, then sliced inside it
        assert reader.reads >= once
    else:  # and again for the backward pass, where it reads the param (a bias's gradient does not)
        assert once < reader.reads < 2 * once


@pytest.mark.parametrize("zeropp", [dict(hpz_partition_size=2), dict(quantized_weights=True)], ids=["hpz", "qwz"])
def test_nvme_params_with_zeropp_equal_params_in_host_memory(tmp_path, zeropp):
    """ZeRO++'s gathers read the NVMe shard like any other (hpZ's backward pass regathers from its
    secondary partition, which it keeps, and reads nothing again)."""
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    out = {}
    for param in ("cpu", "nvme"):
        (tmp_path / param).mkdir()
        config = zj.ZeroConfig(stage=3, offload_optimizer="nvme", offload_param=param, nvme_path=str(tmp_path / param),
                               param_persistence_threshold=0, **zeropp)
        state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx, config=config)
        with zj.make_train_step(loss_fn, state) as step:
            for b in batches(3):
                state, m = step(state, b)
            out[param] = (step.full_params() if param == "nvme" else
                          state.plan.treedef.unflatten([np.asarray(x) for x in
                                                        placement.params_logical(state.plan, state.params)]),
                          float(m["loss"]))
    np.testing.assert_allclose(out["nvme"][1], out["cpu"][1], rtol=1e-6)
    assert max_rel_err(out["nvme"][0], out["cpu"][0]) < 1e-6
