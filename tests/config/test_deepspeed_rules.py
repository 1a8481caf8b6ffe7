"""The DeepSpeed reader follows DeepSpeed 0.19.8's own rules (REFERENCE.md section 9): deprecated
aliases, unknown and removed keys, bounds, stage-3-only keys, "auto" as the Trainer and
accelerate fill it, optimizers and blocks zerojax refuses."""
import warnings

import pytest

import zerojax as zj
from zerojax import ConfigError, TrainingArgs, ZeroConfig
from zerojax.config import _schema as schema
from zerojax._errors import IgnoredKeysWarning

B = {"train_batch_size": 8}


def load(cfg, args=None, hidden=None) -> ZeroConfig:
    return ZeroConfig.from_deepspeed({**B, **cfg}, training_args=args, world_size=1, hidden_size=hidden)


def quiet(cfg, **kw) -> ZeroConfig:
    """Load with every warning an error: the config must read silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load(cfg, **kw)


def ignored_text(cfg, **kw):
    with pytest.warns(IgnoredKeysWarning) as record:
        config = load(cfg, **kw)
    texts = [str(w.message) for w in record if issubclass(w.category, IgnoredKeysWarning)]
    assert len(texts) == 1, texts
    return config, texts[0]


# --------------------------------------------------------------------------- deprecated aliases
@pytest.mark.parametrize("zo,new_key,check", [
    ({"stage": 2, "cpu_offload": True}, "offload_optimizer",
     lambda c: c.offload_optimizer == "cpu"),
    ({"stage": 2, "cpu_offload": False}, "offload_optimizer", lambda c: c.offload_optimizer is None),
    ({"stage": 3, "cpu_offload_param": True}, "offload_param", lambda c: c.offload_param == "cpu"),
    ({"stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": False},
     "pin_memory", lambda c: (c.offload_optimizer, c.offload_param, c.pin_memory) == ("cpu", "cpu", False)),
    ({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}, "stage3_gather_16bit_weights_on_model_save",
     lambda c: c.gather_16bit_weights_on_model_save is True),
])
def test_deprecated_zero_keys_are_read_with_a_warning_naming_the_new_key(zo, new_key, check):
    with pytest.warns(zj.DeprecatedKeyWarning) as record:
        config = load({"zero_optimization": zo})
    assert check(config)
    assert any(new_key in str(w.message) and "deprecated" in str(w.message) for w in record)


def test_bare_zero_optimization_true_is_stage_1_with_allgather_size_as_the_bucket():
    with pytest.warns(zj.DeprecatedKeyWarning, match="deprecated form"):
        config = load({"zero_optimization": True, "allgather_size": 1234})
    assert (config.stage, config.allgather_bucket_size) == (1, 1234)
    with pytest.warns(zj.DeprecatedKeyWarning):
        assert load({"zero_optimization": False}).stage == 0


@pytest.mark.parametrize("zo,match", [
    ({"cpu_offload": True, "offload_optimizer": {"device": "cpu"}, "stage": 2},
     "cpu_offload and zero_optimization.offload_optimizer are both given"),
    ({"stage3_gather_fp16_weights_on_model_save": True, "gather_16bit_weights_on_model_save": False},
     "are both given"),
    ({"stage": 2, "cpu_offload_use_pin_memory": False, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
     "cpu_offload_use_pin_memory=False disagrees with zero_optimization.offload_optimizer.pin_memory=True"),
    ({"cpu_offload": "yes"}, r"zero_optimization\.cpu_offload='yes' is invalid: expected true or false"),
])
def test_deprecated_keys_that_clash_are_refused(zo, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zj.DeprecatedKeyWarning)
        with pytest.raises(ConfigError, match=match):
            load({"zero_optimization": zo})


# --------------------------------------------------------------------------- unknown and removed keys
def test_unknown_top_level_keys_are_warned_with_a_hint_only_for_near_misses():
    cfg = {"train_batch_sizee": 8, "gradient_cliping": 1.0, "comms_config": {"x": 1}, "log": {"level": "info"},
           "fp32": {"enabled": True}, "_comment": "not read", "__note": 3}
    _, text = ignored_text(cfg)
    assert 'train_batch_sizee: not a DeepSpeed key; DeepSpeed ignores it, and so does zerojax. Did you mean ' \
           '"train_batch_size"?' in text
    assert 'gradient_cliping' in text and 'Did you mean "gradient_clipping"?' in text
    for key in ("comms_config", "log", "fp32"):
        line = next(line for line in text.splitlines() if line.lstrip(" -").startswith(f"{key}:"))
        assert "Did you mean" not in line, line
    assert "comet" not in text and "_comment" not in text and "__note" not in text


def test_unknown_keys_inside_known_blocks_stay_errors_with_a_hint():
    for cfg, match in [({"zero_optimization": {"overlap_com": True}}, 'zero_optimization.overlap_com".*"overlap_comm"'),
                       ({"bf16": {"enable": True}}, 'Unknown key "bf16.enable". Did you mean "enabled"'),
                       ({"compile": {"disable": False}}, 'Unknown key "compile.disable"'),
                       ({"tensorboard": {"enabled": False, "output": "x"}}, 'Unknown key "tensorboard.output"')]:
        with pytest.raises(ConfigError, match=match):
            load(cfg)


@pytest.mark.parametrize("key", ["sparse_attention", "progressive_layer_drop", "compression_training",
                                 "quantize_training", "eigenvalue", "elasticity", "curriculum_learning", "nebula",
                                 "amp", "sparse_gradients", "graph_harvesting"])
def test_blocks_deepspeed_removed_are_refused_as_removed(key):
    with pytest.raises(ConfigError) as info:
        load({key: {"enabled": False}})
    assert f"{key}: " in str(info.value) and "was removed from DeepSpeed" in str(info.value)
    assert "Did you mean" not in str(info.value)


@pytest.mark.parametrize("key", ["mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"])
def test_zero_keys_deepspeed_removed_are_refused(key):
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}: .*was removed from DeepSpeed"):
        load({"zero_optimization": {"stage": 3, key: 8}})


def test_every_problem_is_in_one_error():
    cfg = {"zero_optimization": {"stage": 5, "stagee": 1}, "fp16": {"hysteresis": 0}, "sparse_attention": {}}
    with pytest.raises(ConfigError) as info:
        load(cfg)
    text = str(info.value)
    assert "has 4 problems" in text
    for part in ("zero_optimization.stage=5", 'zero_optimization.stagee"', "fp16.hysteresis=0", "sparse_attention"):
        assert part in text, part


# --------------------------------------------------------------------------- stage-3-only keys, ZeRO++
def test_stage3_only_keys_below_stage_3_are_warned_by_name_and_dropped():
    zo = {"stage": 2, "stage3_max_live_parameters": 5, "prefetch_bucket_size": 7,
          "stage3_model_persistence_threshold": 3, "offload_param": {"device": "cpu"},
          "offload_optimizer": {"device": "cpu"}}
    config, text = ignored_text({"zero_optimization": zo})
    for key in ("stage3_max_live_parameters=5", "prefetch_bucket_size=7", "stage3_model_persistence_threshold=3",
                "offload_param.device='cpu'"):
        assert key in text, key
    assert text.count("only applies at ZeRO stage 3") == 3 and "needs ZeRO stage 3" in text
    assert (config.max_live_parameters, config.prefetch_bucket_size, config.offload_param) == \
        (1_000_000_000, 50_000_000, None)
    assert config.offload_optimizer == "cpu"
    # the same keys at stage 3 are honoured, silently (model_persistence_threshold aside)
    zo3 = {**zo, "stage": 3}
    zo3.pop("stage3_model_persistence_threshold")
    c3 = quiet({"zero_optimization": zo3})
    assert (c3.max_live_parameters, c3.prefetch_bucket_size, c3.offload_param) == (5, 7, "cpu")


def test_default_valued_stage3_keys_below_stage_3_are_silent():
    quiet({"zero_optimization": {"stage": 1, "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e7,
                                 "offload_param": {"device": "none"}}})


@pytest.mark.parametrize("key,value,field", [("zero_quantized_weights", True, "quantized_weights"),
                                             ("zero_quantized_gradients", True, "quantized_gradients"),
                                             ("zero_hpz_partition_size", 8, "hpz_partition_size")])
def test_zeropp_keys_are_honoured_at_stage_3_and_warned_below(key, value, field):
    assert getattr(quiet({"zero_optimization": {"stage": 3, key: value}}), field) == value
    config, text = ignored_text({"zero_optimization": {"stage": 2, key: value}})
    assert f"zero_optimization.{key}={value!r} (ZeroConfig.{field}) only applies at ZeRO stage 3" in text
    assert getattr(config, field) == schema.FIELDS[field].default


def test_quantized_nontrainable_weights_is_warned_as_not_honoured():
    _, text = ignored_text({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}})
    assert "zero_optimization.zero_quantized_nontrainable_weights=True: zerojax has no frozen leaves" in text
    quiet({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": False}})


def test_contiguous_gradients_false_is_warned_and_true_is_silent():
    _, text = ignored_text({"zero_optimization": {"stage": 2, "contiguous_gradients": False}})
    assert "zero_optimization.contiguous_gradients=False: XLA owns the gradient buffers" in text
    quiet({"zero_optimization": {"stage": 2, "contiguous_gradients": True}})
    with pytest.raises(ConfigError, match="contiguous_gradients=1 is invalid: expected true or false"):
        load({"zero_optimization": {"contiguous_gradients": 1}})


def test_sub_group_size_0_is_accepted_but_not_with_nvme_offload(tmp_path):
    assert quiet({"zero_optimization": {"stage": 3, "sub_group_size": 0}}).sub_group_size == 0
    with pytest.raises(ConfigError, match=r"zero_optimization\.sub_group_size=0 \(ZeroConfig\.sub_group_size\) with "
                                          r"zero_optimization\.offload_optimizer\.device 'nvme'"):
        load({"zero_optimization": {"stage": 3, "sub_group_size": 0,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}})


# --------------------------------------------------------------------------- refused settings
@pytest.mark.parametrize("name,instead", [("OneBitAdam", '"AdamW"'), ("onebitlamb", '"Lamb"'),
                                          ("ZeroOneAdam", '"AdamW"'), ("MuSGD", '"SGD"')])
def test_deepspeed_only_optimizers_are_refused_by_name_with_the_alternative(name, instead):
    with pytest.raises(ConfigError) as info:
        load({"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    text = str(info.value)
    assert f"optimizer.type={name!r} is not available in zerojax" in text and instead in text


def test_autotp_is_read_and_inference_only_settings_are_refused():
    assert quiet({"tensor_parallel": {"autotp_size": 2}}).autotp_size == 2  # zerojax._autotp; tests/test_autotp.py
    assert quiet({"tensor_parallel": {"autotp_size": 1}}).autotp_size == 1
    with pytest.raises(ConfigError) as info:
        load({"tensor_parallel": {"tp": {"tp_size": 2}}})
    text = str(info.value)
    assert "tensor_parallel.tp" in text and "autotp_size" in text


def test_gradient_allreduce_op_sum_is_refused():
    with pytest.raises(ConfigError, match=r"gradient_allreduce_op='sum' is not supported: zerojax averages"):
        load({"gradient_allreduce_op": "sum"})
    quiet({"gradient_allreduce_op": "mean"})


def test_settings_zerojax_behaves_as_for_any_value_are_silent():
    quiet({"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False})


# --------------------------------------------------------------------------- "auto" as the integrations fill it
def test_accelerate_gather_16bit_auto_is_filled_from_zero3_save_16bit_model_or_false():
    zo = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}
    assert quiet({"zero_optimization": zo}).gather_16bit_weights_on_model_save is False
    args = TrainingArgs(per_device_train_batch_size=8, zero3_save_16bit_model=True)
    assert quiet({"zero_optimization": zo}, args=args).gather_16bit_weights_on_model_save is True
    assert quiet({"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": "auto"}},
                 args=TrainingArgs(per_device_train_batch_size=8)).gather_16bit_weights_on_model_save is False


def test_accelerate_plugin_auto_keys_are_filled_from_training_args():
    zo = {"stage": "auto", "offload_optimizer": {"device": "auto", "nvme_path": "auto"},
          "offload_param": {"device": "auto", "nvme_path": "auto"}}
    args = TrainingArgs(per_device_train_batch_size=8, zero_stage=3, offload_optimizer_device="nvme",
                        offload_optimizer_nvme_path="/nvme", offload_param_device="cpu", offload_param_nvme_path="/nvme")
    c = quiet({"zero_optimization": zo}, args=args)
    assert (c.stage, c.offload_optimizer, c.offload_param, c.nvme_path) == (3, "nvme", "cpu", "/nvme")
    with pytest.raises(ConfigError, match=r'zero_optimization\.stage is "auto" but training_args has no zero_stage'):
        load({"zero_optimization": {"stage": "auto"}}, args=TrainingArgs(per_device_train_batch_size=8))
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage=2 but training_args\.zero_stage=3"):
        load({"zero_optimization": {"stage": 2}}, args=TrainingArgs(per_device_train_batch_size=8, zero_stage=3))


def test_stage3_hidden_size_autos_below_stage_3_keep_deepspeeds_default_as_hugging_face_does():
    zo = {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
          "stage3_param_persistence_threshold": "auto"}
    c = quiet({"zero_optimization": zo}, hidden=10)
    assert (c.reduce_bucket_size, c.prefetch_bucket_size, c.param_persistence_threshold) == (100, 50_000_000, 100_000)
    c3 = quiet({"zero_optimization": {**zo, "stage": 3}}, hidden=10)
    assert (c3.prefetch_bucket_size, c3.param_persistence_threshold) == (90, 100)


def test_auto_in_a_key_zerojax_ignores_is_deepspeeds_default_and_silent():
    quiet({"zero_optimization": {"stage": 2, "round_robin_gradients": "auto"}, "steps_per_print": "auto"})


def test_absent_batch_keys_keep_the_batch_rule_and_are_checked_against_training_args():
    # as the Trainer and accelerate: an absent key is not filled, so the batch rule derives it
    args = TrainingArgs(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert quiet({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, args=args).train_batch_size == 8
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=1 \(absent: derived by the batch rule\) but "
                                          r"training_args.gradient_accumulation_steps=2"):
        ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 4}, training_args=args, world_size=1)
    with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu"):
        ZeroConfig.from_deepspeed({"gradient_accumulation_steps": 2}, training_args=args, world_size=1)
