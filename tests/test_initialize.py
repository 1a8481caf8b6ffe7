"""zj.initialize: DeepSpeed configs in, a state and a step out, trained against plain optax (or
the written-out mixed-precision reference) and the schedules of REFERENCE.md section 5 (the
first step runs at lbi = -1)."""
import importlib.util
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests import broken
from tests.helpers import (DynamicScale, batches, init_params, loss_fn, max_rel_err, mixed_reference_run,
                           reference_run, reference_train)
from zerojax import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "ds_configs"
CONFIGS = ["zero1", "zero2", "zero3_offload", "auto_template"]
HIDDEN = 20  # fills the "auto" bucket sizes: persistence threshold 10 * 20 = 200 elements
CLIP = 0.05  # gradient_clipping "auto" <- max_grad_norm: below every step's norm (0.17-0.36), so it clips
# 8 devices x 2 per device x 2 micro-batches = 32 samples per optimizer step
ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2, max_steps=20,
            warmup_steps=3, max_grad_norm=CLIP)


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0))


def train(state, step, data):
    losses, metrics = [], []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
    return state, losses, metrics


pytestmark = pytest.mark.filterwarnings("ignore::zerojax.IgnoredKeysWarning")  # steps_per_print


# --------------------------------------------------------------------------- example configs
def check_example_config(name, params):
    args = zj.TrainingArgs(**ARGS)
    config = zj.ZeroConfig.from_deepspeed(EXAMPLES / f"{name}.json", args, world_size=8, hidden_size=HIDDEN)
    state, step = zj.initialize(params, loss_fn, config, training_args=args)
    assert state.plan.config.train_batch_size == 32 and state.plan.config.stage == config.stage
    data = batches(6, batch_size=32)
    state, losses, metrics = train(state, step, data)
    ref = reference_run(params, zj.optimizer_from_config(config), data, clip=config.gradient_clipping)
    assert config.gradient_clipping == CLIP  # "auto" <- max_grad_norm
    err = max_rel_err(state.full_params(), ref.params)
    assert err < 1e-5, f"{name}: params differ from plain optax by {err:.2e}"
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    assert min(ref.norms) > CLIP
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], ref.norms, rtol=1e-5)
    assert all(np.isfinite(list(m.values())).all() for m in metrics)
    assert not any(m["skipped"] for m in metrics)


@pytest.mark.parametrize("name", CONFIGS)
def test_example_configs_train_like_plain_optax(name, params):
    check_example_config(name, params)


def test_example_config_check_catches_an_inverted_clip_coefficient(monkeypatch, params):
    broken.invert_clipping(monkeypatch)
    with pytest.raises(AssertionError, match="params differ"):
        check_example_config("zero2", params)


def check_mixed_precision_config(name, precision, params):
    args = zj.TrainingArgs(**ARGS, **{precision: True})
    path = EXAMPLES / f"{name}.json"
    # the path itself, resolved by initialize at the mesh's data size
    state, step = zj.initialize(params, loss_fn, path, training_args=args, hidden_size=HIDDEN)
    config = state.plan.config
    assert config.precision == precision
    data = batches(8, batch_size=32)
    state, losses, metrics = train(state, step, data)
    scaler = None
    if precision == "fp16":  # the file's dynamic loss scale, with DeepSpeed's defaults for what it leaves out
        block = json.loads(path.read_text())["fp16"]
        scaler = DynamicScale(2.0 ** block.get("initial_scale_power", 16), block.get("loss_scale_window", 1000),
                              block.get("hysteresis", 2), block.get("min_loss_scale", 1))
    ref = mixed_reference_run(params, zj.optimizer_from_config(config), data, precision, n=8,
                              gas=ARGS["gradient_accumulation_steps"], stage=config.stage, clip=CLIP, scaler=scaler,
                              offload=config.offload_optimizer is not None)
    assert [bool(m["skipped"]) for m in metrics] == ref.skipped
    assert [m["loss_scale"] for m in metrics] == ref.scales
    applied = [i for i, skipped in enumerate(ref.skipped) if not skipped]
    assert len(applied) >= 4
    err = max_rel_err(state.full_params(jnp.float32), ref.params)
    assert err < 1e-5, f"{name}/{precision}: params differ from the casting reference by {err:.2e}"
    np.testing.assert_allclose([losses[i] for i in applied], [ref.losses[i] for i in applied], rtol=1e-5)
    assert min(ref.norms[i] for i in applied) > CLIP
    np.testing.assert_allclose([metrics[i]["grad_norm"] for i in applied], [ref.norms[i] for i in applied],
                               rtol=1e-5)


MIXED = [("zero1", "fp16"), ("zero2", "bf16"), ("zero3_offload", "bf16"), ("zero3_offload", "fp16"),
         ("auto_template", "fp16")]


@pytest.mark.parametrize("name,precision", MIXED)
def test_example_configs_train_in_mixed_precision(name, precision, params):
    check_mixed_precision_config(name, precision, params)


@pytest.mark.parametrize("name,precision", [("zero3_offload", "bf16")])
def test_mixed_precision_config_check_catches_an_update_without_master(monkeypatch, name, precision, params):
    broken.update_without_master(monkeypatch)
    with pytest.raises(AssertionError, match="params differ"):
        check_mixed_precision_config(name, precision, params)


def test_offload_configs_train_with_state_in_host_memory(params):
    args = zj.TrainingArgs(**ARGS)
    state, step = zj.initialize(params, loss_fn, EXAMPLES / "zero3_offload.json", training_args=args,
                                hidden_size=HIDDEN)
    state, losses, _ = train(state, step, batches(2, batch_size=32))
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves((state.master, state.opt_state[-1]))
             if x.ndim}
    assert kinds == {"pinned_host"} and all(map(math.isfinite, losses))


def test_offload_keys_are_accepted(params):
    args = zj.TrainingArgs(**ARGS)
    state, _ = zj.initialize(params, loss_fn, EXAMPLES / "zero3_offload.json", training_args=args,
                             hidden_size=HIDDEN)
    config = state.plan.config
    assert (config.stage, config.offload_optimizer, config.offload_param) == (3, "cpu", "cpu")
    assert config.gather_16bit_weights_on_model_save and config.param_persistence_threshold == 10 * HIDDEN


# --------------------------------------------------------------------------- learning rate
# REFERENCE.md section 5, indexed by lbi = 0, 1, ...; the k-th step (k = 0, 1, ...) runs at lbi = k - 1
WARMUP_LINEAR = [0.10, 0.11, 0.12, 0.13, 0.14, 0.15, 0.16, 0.17, 0.18, 0.19, 0.20, 0.20]
WARMUP_LOG = [0.1, 0.130103, 0.147712, 0.160206, 0.169897, 0.177815, 0.18451, 0.190309, 0.195424, 0.2]
WARMUP_DECAY_LOG = WARMUP_LOG + [0.2, 0.19, 0.18, 0.17, 0.16, 0.15, 0.14, 0.13, 0.12, 0.11, 0.1, 0.1]
SCHEDULES = {
    "WarmupLR-linear": ({"type": "WarmupLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2,
                                                        "warmup_num_steps": 10, "warmup_type": "linear"}},
                        WARMUP_LINEAR),
    "WarmupDecayLR-log": ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2,
                                                               "warmup_num_steps": 10, "total_num_steps": 20}},
                          WARMUP_DECAY_LOG),
}


def ds_config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.2}}, "zero_optimization": {"stage": 2}, **extra}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_reported_learning_rate_follows_the_deepspeed_schedule(name, params):
    scheduler, by_lbi = SCHEDULES[name]
    state, step = zj.initialize(params, loss_fn, ds_config(scheduler=scheduler))
    data = batches(1, batch_size=32) * (len(by_lbi) + 1)
    _, _, metrics = train(state, step, data)
    lrs = [m["learning_rate"] for m in metrics]
    np.testing.assert_allclose(lrs, [0.1] + by_lbi, rtol=1e-5, atol=1e-7)  # lbi -1: warmup_min_lr


def with_poison(batch, value):
    return {**batch, "poison": np.full((32,), value, np.float32)}


def poisoned_loss(params, batch):
    return loss_fn(params, batch) * jnp.mean(batch["poison"])


def test_fp16_overflow_skips_the_step_and_does_not_advance_the_schedule(params):
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10,
                                                "warmup_type": "linear"}}
    fp16 = {"enabled": True, "initial_scale_power": 8}
    cfg = ds_config(scheduler=scheduler, fp16=fp16)
    b = batches(1, batch_size=32)[0]
    clean, poison = with_poison(b, 1.0), with_poison(b, np.inf)

    state, step = zj.initialize(params, poisoned_loss, cfg)
    _, _, ref = train(state, step, [clean] * 5)
    ref_lrs = [m["learning_rate"] for m in ref]
    np.testing.assert_allclose(ref_lrs, [0.0, 0.0, 0.01, 0.02, 0.03], atol=1e-7)

    state, step = zj.initialize(params, poisoned_loss, cfg)
    state, _, first = train(state, step, [clean] * 3)
    before = state.full_params()
    state, skipped = step(state, poison)
    assert bool(skipped["skipped"]) and not np.isfinite(float(skipped["loss"]))
    assert int(state.step) == 4  # the global step counter advances, the schedule does not
    assert max_rel_err(state.full_params(), before) == 0.0
    state, _, after = train(state, step, [clean] * 2)
    assert not any(m["skipped"] for m in first + after)
    # the clean step after the overflow runs at the lr the skipped step would have had
    np.testing.assert_allclose([m["learning_rate"] for m in after], ref_lrs[3:5], atol=1e-7)


# --------------------------------------------------------------------------- the global batch
def test_batch_must_hold_train_batch_size_samples(params):
    state, step = zj.initialize(params, loss_fn, ds_config())
    assert state.plan.config.train_batch_size == 32
    for size in (16, 64):  # 64 would split evenly over devices and micro-batches: still wrong
        with pytest.raises(ValueError, match=f"'tok' has leading dimension {size}.*train_batch_size = 32"):
            step(state, batches(1, batch_size=size)[0])
    state, metrics = step(state, batches(1, batch_size=32)[0])  # the state was not consumed
    assert np.isfinite(float(metrics["loss"]))


def test_world_size_is_the_data_axis_of_the_mesh(params):
    mesh = zj.make_mesh({"data": 4, "model": 2})
    cfg = {**ds_config(), "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    args = zj.TrainingArgs(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.0,
                           learning_rate=0.2)
    state, step = zj.initialize(params, loss_fn, cfg, mesh=mesh, training_args=args)
    assert state.plan.config.train_batch_size == 4 * 3 * 2
    state, metrics = step(state, batches(1, batch_size=24)[0])
    assert np.isfinite(float(metrics["loss"]))
    with pytest.raises(ValueError, match="no data axis 'data'"):
        zj.initialize(params, loss_fn, cfg, mesh=zj.make_mesh((8,), ("batch",)), training_args=args)


def test_zero_config_is_checked_against_the_mesh(params):
    config = zj.ZeroConfig(stage=1, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    state, _ = zj.initialize(params, loss_fn, config, optimizer=optax.adam(1e-3))
    assert state.plan.config.train_batch_size == 32
    for_four = zj.ZeroConfig.from_deepspeed(ds_config(), world_size=4)
    with pytest.raises(ConfigError, match="(?s)train_batch_size is not equal.*has 8 devices"):
        zj.initialize(params, loss_fn, for_four)


# --------------------------------------------------------------------------- the optimizer
def test_without_optimizer_block_training_args_give_hugging_face_adamw(params):
    args = zj.TrainingArgs(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2,
                           adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1,
                           max_grad_norm=CLIP, warmup_steps=2, max_steps=6)
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "param_persistence_threshold": 0}}
    state, step = zj.initialize(params, loss_fn, cfg, training_args=args)
    data = batches(6, batch_size=32)
    state, losses, metrics = train(state, step, data)
    # warmup 0 -> lr over 2 steps, then linear decay to 0 at step 6
    schedule = optax.join_schedules([optax.linear_schedule(0.0, 1e-2, 2), optax.linear_schedule(1e-2, 0.0, 4)], [2])
    np.testing.assert_allclose([m["learning_rate"] for m in metrics], [0, 5e-3, 1e-2, 7.5e-3, 5e-3, 2.5e-3],
                               atol=1e-9)
    tx = optax.adamw(schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    ref = reference_run(params, tx, data, clip=CLIP)
    assert max_rel_err(state.full_params(), ref.params) < 1e-5
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    assert min(ref.norms) > CLIP
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], ref.norms, rtol=1e-5)


def test_training_args_adamw_follows_the_config_scheduler(params):
    scheduler, by_lbi = SCHEDULES["WarmupLR-linear"]
    cfg = {"train_batch_size": 32, "scheduler": scheduler}
    state, step = zj.initialize(params, loss_fn, cfg, training_args=zj.TrainingArgs(per_device_train_batch_size=4,
                                                                                     learning_rate=0.2,
                                                                                     warmup_steps=10))
    _, _, metrics = train(state, step, batches(1, batch_size=32) * 4)
    np.testing.assert_allclose([m["learning_rate"] for m in metrics], [0.1] + by_lbi[:3], rtol=1e-6)


def test_no_optimizer_anywhere_is_an_error(params):
    with pytest.raises(ConfigError, match='add an "optimizer" block.*training_args'):
        zj.initialize(params, loss_fn, {"train_batch_size": 32})
    with pytest.raises(ConfigError, match="warmup_ratio.*max_steps"):
        zj.initialize(params, loss_fn, {"train_batch_size": 32},
                      training_args=zj.TrainingArgs(per_device_train_batch_size=4, warmup_ratio=0.1))


def test_a_passed_optimizer(params):
    data = batches(3, batch_size=32)
    state, step = zj.initialize(params, loss_fn, {"train_batch_size": 32, "gradient_clipping": 0},
                                optimizer=optax.sgd(0.1))
    state, losses, _ = train(state, step, data)
    want, _ = reference_train(params, optax.sgd(0.1), data)
    assert max_rel_err(state.full_params(), want) < 1e-5
    with pytest.raises(ConfigError, match="optimizer block too"):
        zj.initialize(params, loss_fn, ds_config(), optimizer=optax.sgd(0.1))
    with pytest.raises(ConfigError, match="scheduler block"):
        zj.initialize(params, loss_fn, {"train_batch_size": 32, "scheduler": SCHEDULES["WarmupLR-linear"][0]},
                      optimizer=optax.sgd(0.1))


def test_bad_config_type():
    with pytest.raises(zj.ZeroJaxError, match="ZeroConfig, a dict or the path"):
        zj.initialize({}, loss_fn, 3)


def test_public_names():
    for name in ("initialize", "TrainingArgs", "optimizer_from_config", "IgnoredKeysWarning"):
        assert name in zj.__all__ and hasattr(zj, name)


# --------------------------------------------------------------------------- the example script
@pytest.mark.slow
def test_example_script_trains():
    spec = importlib.util.spec_from_file_location("train_ds_config", ROOT / "examples" / "train_ds_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(["--steps", "4", "--warmup", "1"])
    assert len(losses) == 4 and np.isfinite(losses).all() and losses[-1] < losses[0]


def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("raw,want", [({}, "fp32"), ({"bf16": {"enabled": False}}, "fp32"),
                                      ({"fp16": {"enabled": True}}, "fp16"), ({"bf16": {"enabled": True}}, "bf16"),
                                      ({"bf16": {"enabled": "auto"}}, "bf16"), ({"fp16": None}, "fp32")])
def test_the_example_trains_in_the_precision_its_deepspeed_file_asks_for(raw, want):
    # DeepSpeed trains in fp32 without an enabled fp16/bf16 block
    assert _train_gpt().config_precision(raw) == want


def test_the_example_refuses_two_sequence_parallel_sizes(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}))
    module = _train_gpt()
    assert module.config_sequence_parallel(module.read_config(str(path))) == 2
    assert module.read_config(str(tmp_path / "missing.json")) == {}
    with pytest.raises(SystemExit):
        module.main(["--deepspeed-config", str(path), "--seq-parallel", "4"])
