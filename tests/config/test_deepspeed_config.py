"""Reading DeepSpeed JSON configs: REFERENCE.md section 3 (batch rules, "auto", defaults, errors)."""
import dataclasses
import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerojax import ConfigError, ZeroConfig, schedules
from zerojax._cli import main
from zerojax.config._deepspeed import IgnoredKeysWarning, TrainingArgs, optimizer_from_config, resolve_batch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ds_configs"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load(cfg, args=None, world=1, hidden=None) -> ZeroConfig:
    return ZeroConfig.from_deepspeed(cfg, training_args=args, world_size=world, hidden_size=hidden)


# --------------------------------------------------------------------------- batch rules
@pytest.mark.parametrize("triple", [(32, 16, 1), (32, 8, 2)])
def test_valid_batch_triples_and_every_subset(triple):
    for mask in range(1, 8):
        given_ = {k: v for i, (k, v) in enumerate(zip(BATCH_KEYS, triple)) if mask >> i & 1}
        if set(given_) == {"gradient_accumulation_steps"}:
            continue
        c = load(given_, world=2)
        got = (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)
        if len(given_) >= 2:
            assert got == triple, given_
        assert got[0] == got[1] * got[2] * 2


@pytest.mark.parametrize("triple", [(33, 17, 2), (32, 18, 1)])
def test_inconsistent_batch_triples(triple):
    with pytest.raises(ConfigError, match="train_batch_size is not equal to micro_batch_per_gpu"):
        load(dict(zip(BATCH_KEYS, triple)), world=2)


def test_train_batch_size_alone_world_one():
    c = load({"train_batch_size": 64})
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (64, 64, 1)


@pytest.mark.parametrize("cfg", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_needs_train_or_micro(cfg):
    with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu"):
        load(cfg)


def test_derived_zero_is_an_error():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=0"):
        resolve_batch(4, 8, None, 1)


def test_world_size_defaults_to_device_count():
    c = ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 2})
    assert c.train_batch_size == 2 * jax.device_count()


positive = st.integers(1, 64)


@settings(max_examples=200, deadline=None)
@given(micro=positive, gas=st.integers(1, 16), world=st.integers(1, 16), mask=st.integers(1, 7))
def test_property_subsets_of_a_valid_triple_resolve_to_it(micro, gas, world, mask):
    triple = (micro * gas * world, micro, gas)
    args = [v if mask >> i & 1 else None for i, v in enumerate(triple)]
    if args[0] is None and args[1] is None:
        with pytest.raises(ConfigError):
            resolve_batch(*args, world)
        return
    tb, mb, ga = resolve_batch(*args, world)
    assert tb == mb * ga * world
    if sum(a is not None for a in args) >= 2:
        assert (tb, mb, ga) == triple


@settings(max_examples=300, deadline=None)
@given(tb=st.none() | st.integers(1, 512), mb=st.none() | positive, ga=st.none() | st.integers(1, 16),
       world=st.integers(1, 16))
def test_property_any_input_resolves_consistently_or_raises(tb, mb, ga, world):
    try:
        out = resolve_batch(tb, mb, ga, world)
    except ConfigError:
        if tb is not None and mb is not None and ga is not None:
            assert tb != mb * ga * world
        return
    assert out[0] == out[1] * out[2] * world and min(out) > 0
    for given_value, value in zip((tb, mb, ga), out):
        assert given_value is None or given_value == value


# --------------------------------------------------------------------------- defaults and mapping
def test_defaults_from_a_minimal_config():
    c = load({"train_batch_size": 8})
    assert c.stage == 0 and c.precision == "fp32" and c.gradient_clipping == 1.0
    assert c.overlap_comm is False and c.reduce_bucket_size == 500_000_000 and c.offload_optimizer is None
    assert c.optimizer is None and c.scheduler is None and ZeroConfig().gradient_clipping == 0.0


def test_zero_keys_map_onto_fields_with_both_spellings():
    zo = {"stage": 3, "reduce_bucket_size": 1e6, "allgather_bucket_size": 2e6, "overlap_comm": False,
          "reduce_scatter": False, "stage3_prefetch_bucket_size": 3e6,
          "param_persistence_threshold": 7, "stage3_max_live_parameters": 11, "max_reuse_distance": 13,
          "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 17}
    c = load({"train_batch_size": 8, "zero_optimization": zo})
    assert (c.stage, c.reduce_bucket_size, c.allgather_bucket_size, c.overlap_comm) == (3, 10**6, 2 * 10**6, False)
    assert (c.reduce_scatter, c.prefetch_bucket_size) == (False, 3 * 10**6)
    assert (c.param_persistence_threshold, c.max_live_parameters, c.max_reuse_distance) == (7, 11, 13)
    assert c.gather_16bit_weights_on_model_save and c.sub_group_size == 17
    assert load({"train_batch_size": 8, "zero_optimization": {"stage": 3}}).overlap_comm is True


def test_offload_blocks_map_onto_fields():
    zo = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": False,
                                            "ratio": 0.3, "buffer_count": 4},
          "offload_param": {"device": "cpu", "pin_memory": False}}
    c = load({"train_batch_size": 8, "zero_optimization": zo})
    assert (c.offload_optimizer, c.offload_param, c.nvme_path, c.pin_memory, c.offload_ratio) == \
        ("nvme", "cpu", "/nvme", False, 0.3)


def test_zenflow_block_is_kept_with_defaults():
    zo = {"stage": 2, "offload_optimizer": {"device": "cpu"},
          "zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8, "update_interval": 4}}
    z = load({"train_batch_size": 8, "zero_optimization": zo}).zenflow
    assert z["topk_ratio"] == 0.05 and z["select_interval"] == 8 and z["auto_ratio"] == 0.99
    assert z["overlap_step"] is False and z["full_warm_up_rounds"] == 0


def test_fp16_and_bf16_blocks():
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
            "consecutive_hysteresis": True, "min_loss_scale": 2}
    c = load({"train_batch_size": 8, "fp16": fp16})
    assert (c.precision, c.initial_scale_power, c.loss_scale_window, c.hysteresis) == ("fp16", 12, 500, 3)
    assert c.consecutive_hysteresis and c.min_loss_scale == 2.0 and c.loss_scale == 0.0
    c = load({"train_batch_size": 8, "bf16": {"enabled": True, "check_grad_overflow": False}})
    assert c.precision == "bf16" and c.check_grad_overflow is False
    assert load({"train_batch_size": 8, "bfloat16": {"enabled": True}}).precision == "bf16"


def test_ignored_keys_produce_one_warning_naming_all():
    cfg = {"train_batch_size": 8, "dump_state": True, "wall_clock_breakdown": False,
           "memory_breakdown": True,
           "zero_optimization": {"stage": 2, "round_robin_gradients": True, "zero_quantized_weights": False,
                                 "zero_hpz_partition_size": 8}}
    with pytest.warns(IgnoredKeysWarning) as record:
        load(cfg)
    assert len(record) == 1
    text = str(record[0].message)
    for key in ("dump_state", "memory_breakdown", "round_robin_gradients", "zero_hpz_partition_size"):
        assert key in text
    assert "wall_clock_breakdown" not in text and "zero_quantized_weights" not in text


def test_default_valued_ignored_keys_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load({"train_batch_size": 8, "wall_clock_breakdown": False, "tensorboard": {"enabled": False},
              "zero_optimization": {"round_robin_gradients": False, "contiguous_gradients": True,
                                    "allgather_partitions": True}})


# --------------------------------------------------------------------------- "auto"
AUTO_ALL = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
ARGS = TrainingArgs(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-4,
                    adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5,
                    warmup_ratio=0.1, max_steps=1000, bf16=True)


def test_auto_is_filled_from_training_args_and_hidden_size():
    c = load(AUTO_ALL, ARGS, world=8, hidden=100)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (64, 4, 2)
    assert c.gradient_clipping == 0.5 and c.precision == "bf16"
    assert c.optimizer["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                     "adam_w_mode": True, "bias_correction": True, "torch_adam": False,
                                     "amsgrad": False}
    p = c.scheduler["params"]
    assert (p["warmup_min_lr"], p["warmup_max_lr"], p["warmup_num_steps"], p["total_num_steps"]) == \
        (0.0, 3e-4, 100, 1000)
    assert (c.reduce_bucket_size, c.prefetch_bucket_size, c.param_persistence_threshold) == (10000, 9000, 1000)


def test_any_object_with_the_attributes_works_and_input_is_not_mutated():
    class Args:
        per_device_train_batch_size, gradient_accumulation_steps = 2, 1
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    assert load(cfg, Args(), world=4).train_batch_size == 8
    assert cfg["train_micro_batch_size_per_gpu"] == "auto"


def test_train_batch_auto_without_args_uses_config_values():
    c = load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
             world=4)
    assert c.train_batch_size == 24


def test_all_mismatches_are_reported_together():
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 2.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-8, "weight_decay": "auto"}}}
    with pytest.raises(ConfigError) as e:
        load(cfg, ARGS, world=1)
    text = str(e.value)
    for key in ("train_micro_batch_size_per_gpu=16", "gradient_clipping=2.0", "optimizer.params.lr=0.001",
                "optimizer.params.eps=1e-08", "gradient_accumulation_steps=1", "optimizer.params.betas",
                '"auto"'):
        assert key in text, key
    assert "weight_decay" not in text


def test_matching_explicit_values_are_accepted():
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
           "gradient_clipping": 0.5, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                     "weight_decay": 0.1}}}
    assert load(cfg, ARGS, world=2).train_batch_size == 16


# --------------------------------------------------------------------------- invalid configs
B = {"train_batch_size": 8}
Z3 = {"stage": 3}
CPU = {"device": "cpu"}
INVALID = [
    ({**B, "zero_optimization": {"overlap_com": True}}, None, None, 'zero_optimization.overlap_com.*"overlap_comm"'),
    ({**B, "fp16": {"enabled": True, "loss_scale_windw": 10}}, None, None,
     'fp16.loss_scale_windw.*"loss_scale_window"'),
    ({**B, "bf16": {"enable": True}}, None, None, 'bf16.enable.*"enabled"'),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}}, None, None,
     "offload_optimizer.pin_memroy"),
    ({**B, "zero_optimization": {**Z3, "offload_param": {"devce": "cpu"}}}, None, None,
     'offload_param.devce.*"device"'),
    ({**B, "optimizer": {"type": "Adam", "params": {"weight_decy": 0.1}}}, None, None,
     'optimizer.params.weight_decy.*"weight_decay"'),
    ({**B, "optimizer": {"type": "Adam", "paramz": {}}}, None, None, 'optimizer.paramz.*"params"'),
    ({**B, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, None, None,
     "scheduler.params.warmup_num_step"),
    ({**B, "scheduler": {"type": "WarmupLr"}}, None, None, 'scheduler.type.*"WarmupLR"'),
    ({**B, "optimizer": {"type": "Adamm"}}, None, None, "optimizer.type"),
    ({**B, "optimizer": {"type": "OneBitAdam"}}, None, None, "optimizer.type"),
    ({**B, "zero_optimization": {"stage": 4}}, None, None, "zero_optimization.stage=4"),
    ({**B, "zero_optimization": {"stage": "2"}}, None, None, "zero_optimization.stage='2'"),
    ({**B, "zero_optimization": {"reduce_bucket_size": -1}}, None, None, "zero_optimization.reduce_bucket_size"),
    ({**B, "zero_optimization": {"overlap_comm": "yes"}}, None, None, "zero_optimization.overlap_comm"),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": {**CPU, "ratio": 0.5}}}, None, None,
     "offload_optimizer.ratio.*stage 3"),
    ({**B, "zero_optimization": {**Z3, "offload_optimizer": {**CPU, "ratio": 1.5}}}, None, None,
     "offload_optimizer.ratio"),
    ({**B, "zero_optimization": {"offload_optimizer": CPU}}, None, None, "offload_optimizer.device"),
    ({**B, "zero_optimization": {**Z3, "offload_optimizer": {"device": "gpu"}}}, None, None,
     "offload_optimizer.device='gpu'"),
    ({**B, "zero_optimization": {**Z3, "offload_optimizer": {"device": "nvme"}}}, None, None,
     "offload_optimizer.nvme_path"),
    ({**B, "zero_optimization": {**Z3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}, None, None,
     r"offload_param\.device='nvme'.*needs offload_optimizer \"nvme\".*Fix: set offload_optimizer"),
    ({**B, "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": CPU}}, None, None,
     "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both given"),
    ({**B, "zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}, None, None,
     "prefetch_bucket_size"),
    ({**B, "zero_optimization": {"stage": "auto"}}, None, None, "zero_optimization.stage"),
    ({**B, "zero_optimization": 2}, None, None, "zero_optimization=2"),
    ({**B, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, None, None, "fp16.enabled and bf16.enabled"),
    ({**B, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, None, None, "bfloat16"),
    ({**B, "fp16": {"enabled": True, "hysteresis": 0}}, None, None, "fp16.hysteresis"),
    ({**B, "fp16": {"enabled": True, "initial_scale_power": 1.5}}, None, None, "fp16.initial_scale_power"),
    ({**B, "fp16": {"enabled": "yes"}}, None, None, "fp16.enabled"),
    ({**B, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, None, None,
     "optimizer.params.max_grad_norm.*gradient_clipping"),
    ({**B, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, None, None, "optimizer.params.betas"),
    ({**B, "optimizer": {"type": "AdamW", "params": {"eps": 0}}}, None, None, "optimizer.params.eps"),
    ({**B, "optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, None, None, "optimizer.params.lr"),
    ({**B, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, None, None,
     "optimizer.params.adam_w_mode"),
    ({**B, "optimizer": {"type": "SGD", "params": {"nesterov": True}}}, None, None, "optimizer.params.nesterov"),
    ({**B, "gradient_clipping": -1}, None, None, "gradient_clipping=-1"),
    ({**B, "gradient_clipping": "auto"}, None, None, 'gradient_clipping is "auto".*training_args'),
    ({"train_micro_batch_size_per_gpu": "auto"}, None, None, 'train_micro_batch_size_per_gpu is "auto".*training_args'),
    ({**B, "zero_optimization": {"reduce_bucket_size": "auto"}}, None, None,
     'zero_optimization.reduce_bucket_size is "auto".*hidden_size'),
    ({**B, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}, TrainingArgs(), None,
     "scheduler.params.total_num_steps.*max_steps"),
    ({**B, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, None, None,
     "scheduler.params.warmup_type"),
    ({**B, "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}}, None, None,
     "scheduler.params.cycle_min_lr"),
    ({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17, "gradient_accumulation_steps": 2}, None, None,
     "train_batch_size is not equal"),
    ({"train_micro_batch_size_per_gpu": 0}, None, None, "train_micro_batch_size_per_gpu=0"),
    ({"train_batch_size": 8.5}, None, None, "train_batch_size=8.5"),
    ({"train_micro_batch_size_per_gpu": 4}, TrainingArgs(per_device_train_batch_size=8), None,
     "train_micro_batch_size_per_gpu=4 but training_args.per_device_train_batch_size=8"),
    ({**B, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, TrainingArgs(per_device_train_batch_size=8),
     None, "optimizer.params.lr=0.001 but training_args.learning_rate"),
    ({**B, "optimizer": {"type": "AdamW"}}, TrainingArgs(per_device_train_batch_size=8), None,
     r"optimizer.params.lr=0.001 \(absent"),
    ({**B, "fp16": {"enabled": True}}, TrainingArgs(per_device_train_batch_size=8), None,
     "fp16.enabled=True but training_args.fp16=False"),
    (B, TrainingArgs(per_device_train_batch_size=8, bf16=True), None, "bf16 block is absent"),
    (B, TrainingArgs(per_device_train_batch_size=8, max_grad_norm=0.3), None, r"gradient_clipping=1.0 \(absent"),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": CPU, "zenflow": {"select_strategy": "step"}}},
     None, None, "zenflow.select_interval"),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": CPU,
                                 "zenflow": {"select_interval": 2, "update_interval": 4}}},
     None, None, "zenflow.select_interval=2 is smaller than update_interval=4"),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": CPU, "zenflow": {"topk_ratio": 1.0}}},
     None, None, "zenflow.topk_ratio"),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": CPU, "zenflow": {"update_interval": 0}}},
     None, None, "zenflow.update_interval"),
    ({**B, "zero_optimization": {"stage": 2, "zenflow": {}}}, None, None, "zenflow needs.*offload_optimizer"),
    ({**B, "zero_optimization": {"stage": 2, "offload_optimizer": CPU, "zenflow": {"topk": 0.1}}},
     None, None, 'zenflow.topk.*"topk_ratio"'),
]


@pytest.mark.parametrize("cfg,args,hidden,match", INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_configs(cfg, args, hidden, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)
        with pytest.raises(ConfigError, match=match):
            load(cfg, args, world=1, hidden=hidden)


def test_invalid_table_is_large_enough():
    assert len(INVALID) >= 30


# --------------------------------------------------------------------------- examples
@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3_offload", "auto_template"])
def test_example_configs_load(name):
    args = TrainingArgs(per_device_train_batch_size=2, gradient_accumulation_steps=2, bf16=True, max_steps=100,
                        warmup_steps=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = ZeroConfig.from_deepspeed(EXAMPLES / f"{name}.json", training_args=args, world_size=8, hidden_size=64)
    assert (c.train_batch_size, c.precision, c.optimizer["type"]) == (32, "bf16", "AdamW")
    assert c.scheduler["params"]["warmup_num_steps"] == 10
    assert [str(w.message) for w in caught if "steps_per_print" not in str(w.message)] == []
    stage = {"zero1": 1, "zero2": 2}.get(name, 3)
    assert c.stage == stage
    if name == "zero3_offload":
        assert (c.offload_optimizer, c.offload_param, c.gather_16bit_weights_on_model_save) == ("cpu", "cpu", True)
    if stage == 3:
        assert (c.reduce_bucket_size, c.prefetch_bucket_size, c.param_persistence_threshold) == (4096, 3686, 640)
    optimizer_from_config(c)  # builds


# --------------------------------------------------------------------------- optimizer
PARAMS = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.array([0.1, -0.2])}


def _grads(i):
    return jax.tree.map(lambda p: jnp.sin(p * (i + 1)) + 0.1, PARAMS)


def _run(tx, steps=4):
    params, state = PARAMS, tx.init(PARAMS)
    for i in range(steps):
        updates, state = tx.update(_grads(i), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _cfg(opt, scheduler=None):
    return load({**B, "optimizer": opt, **({"scheduler": scheduler} if scheduler else {})})


def _close(a, b, **kw):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **kw), a, b)


def test_adam_is_adamw_by_default():
    tx = optimizer_from_config(_cfg({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}))
    _close(_run(tx)[0], _run(optax.adamw(0.01, weight_decay=0.1))[0], rtol=1e-5)


def test_adam_w_mode_false_is_l2_on_the_gradient():
    cfg = _cfg({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}})
    got = _run(optimizer_from_config(cfg))[0]
    ref = optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01))
    _close(got, _run(ref)[0], rtol=1e-5)
    adamw = _run(optax.adamw(0.01, weight_decay=0.1))[0]
    assert not np.allclose(got["w"], adamw["w"])


def test_sgd_lion_lamb_adagrad_match_references():
    sgd = _cfg({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}})
    _close(_run(optimizer_from_config(sgd))[0], _run(optax.sgd(0.1, 0.9, nesterov=True))[0], rtol=1e-5)
    lion = _cfg({"type": "Lion", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1}})
    _close(_run(optimizer_from_config(lion))[0], _run(optax.lion(0.01, 0.9, 0.99, weight_decay=0.1))[0], rtol=1e-5)
    lamb = _cfg({"type": "Lamb", "params": {"lr": 0.01, "weight_decay": 0.01, "min_coeff": 0.0, "max_coeff": 1e9}})
    _close(_run(optimizer_from_config(lamb))[0], _run(optax.lamb(0.01, weight_decay=0.01))[0], rtol=1e-5)
    ada = _cfg({"type": "Adagrad", "params": {"lr": 0.1}})
    got, acc, p = _run(optimizer_from_config(ada), steps=2)[0], jax.tree.map(jnp.zeros_like, PARAMS), PARAMS
    for i in range(2):
        g = _grads(i)
        acc = jax.tree.map(lambda a, x: a + x * x, acc, g)
        p = jax.tree.map(lambda q, x, a: q - 0.1 * x / (jnp.sqrt(a) + 1e-10), p, g, acc)
    _close(got, p, rtol=1e-5)


def test_lamb_trust_ratio_is_clipped():
    lamb = _cfg({"type": "Lamb", "params": {"lr": 0.01, "max_coeff": 0.5, "min_coeff": 0.5}})
    got = _run(optimizer_from_config(lamb), steps=1)[0]
    ref = _run(optax.chain(optax.scale_by_adam(), optax.scale(0.5), optax.scale(-0.01)), steps=1)[0]
    _close(got, ref, rtol=1e-6)


def test_learning_rate_follows_the_scheduler_and_is_readable():
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_num_steps": 10, "warmup_type": "linear"}}
    cfg = _cfg({"type": "AdamW", "params": {"lr": 0.2}}, sched)
    tx = optimizer_from_config(cfg)
    state = tx.init(PARAMS)
    lrs = []
    for i in range(4):
        _, state = tx.update(_grads(i), state, PARAMS)
        lrs.append(float(state.hyperparams["learning_rate"]))
    expected = [float(schedules.warmup_lr(i, 0.0, 0.2, 10, "linear")) for i in range(4)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(0.02)


def test_onecycle_cycles_beta1_and_sets_beta2():
    sched = {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4}}
    tx = optimizer_from_config(_cfg({"type": "AdamW"}, sched))
    _, state = _run(tx, steps=3)
    assert float(state.hyperparams["b1"]) == pytest.approx(0.85)  # lbi 1: scale 0.5
    assert float(state.hyperparams["b2"]) == pytest.approx(0.99)
    with pytest.warns(UserWarning, match="cycle_momentum"):
        optimizer_from_config(_cfg({"type": "SGD"}, sched))


def test_optimizer_defaults_are_deepspeed_defaults():
    assert _cfg({"type": "Lamb"}).optimizer["params"] == {
        "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
        "max_coeff": 10.0, "min_coeff": 0.01}
    assert _cfg({"type": "adam"}).optimizer["type"] == "Adam"
    with pytest.raises(ConfigError, match="ZeroConfig.optimizer is None"):
        optimizer_from_config(ZeroConfig())


def test_public_names_are_importable_from_zerojax_config():
    import zerojax
    from zerojax import config

    assert {"IgnoredKeysWarning", "TrainingArgs", "config_from_deepspeed", "optimizer_from_config",
            "resolve_batch"} <= set(config.__all__)
    for name in config.__all__:
        assert getattr(config, name).__name__.startswith(("zerojax", name))
    assert zerojax.optimizer_from_config is config.optimizer_from_config is optimizer_from_config


# --------------------------------------------------------------------------- command line (--json; the
# per-key report is tested in test_config_check.py)
def test_cli_prints_the_resolved_config(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(AUTO_ALL))
    args = json.dumps(dataclasses.asdict(ARGS))
    assert main(["config", "check", "--json", str(path), "--world-size", "8", "--hidden-size", "100",
                 "--training-args", args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {f.name for f in dataclasses.fields(ZeroConfig)}
    assert out["train_batch_size"] == 64 and out["reduce_bucket_size"] == 10000
    assert out["optimizer"]["params"]["lr"] == 3e-4 and '"auto"' not in json.dumps(out)  # no value left "auto"


def test_cli_reads_training_args_from_a_file_and_reports_warnings(tmp_path, capsys):
    (tmp_path / "args.json").write_text(json.dumps({"per_device_train_batch_size": 2}))
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "dump_state": True}))
    code = main(["config", "check", "--json", str(tmp_path / "ds.json"), "--world-size", "2",
                 "--training-args", str(tmp_path / "args.json")])
    captured = capsys.readouterr()
    assert code == 0 and json.loads(captured.out)["train_batch_size"] == 4
    assert "dump_state" in captured.err


@pytest.mark.parametrize("cfg,extra,match", [
    ({"train_batch_size": 8, "zero_optimization": {"stagee": 2}}, [], 'stagee.*"stage"'),
    ({"train_micro_batch_size_per_gpu": "auto"}, [], "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 8}, ["--training-args", '{"learning_rat": 1}'], '"learning_rate"'),
    ({"train_batch_size": 8}, ["--training-args", "{not json"], "--training-args"),
])
def test_cli_errors_exit_2(tmp_path, capsys, cfg, extra, match):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert main(["config", "check", "--json", str(path), "--world-size", "1", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and re.search(match, captured.err)


def test_cli_missing_file_and_bad_json(tmp_path, capsys):
    assert main(["config", "check", str(tmp_path / "nope.json")]) == 2
    (tmp_path / "bad.json").write_text("{")
    assert main(["config", "check", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
