"""The one schema table: ZeroConfig's fields, their DeepSpeed keys, defaults, checks and rules,
used by both ZeroConfig(...) and the DeepSpeed reader, with one message per rule."""
import dataclasses
import re
import warnings

import pytest

from zerojax import ConfigError, ZeroConfig
from zerojax.config import _schema as schema
from zerojax.config._keys import OFFLOAD_OPTIMIZER, OFFLOAD_PARAM, TOP, ZERO
from zerojax._errors import IgnoredKeysWarning
from zerojax._precision import LossScaler

B = {"train_batch_size": 8}


def load(cfg, **kw) -> ZeroConfig:
    return ZeroConfig.from_deepspeed({**B, **cfg}, world_size=1, **kw)


def test_every_field_is_in_the_table_with_the_dataclass_default():
    fields = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    assert set(fields) == set(schema.FIELDS)
    assert fields == {name: spec.default for name, spec in schema.FIELDS.items()}
    assert "contiguous_gradients" not in fields  # XLA owns gradient buffers: no such knob


def test_deepspeed_defaults_differ_only_where_documented():
    differ = {n for n, s in schema.FIELDS.items() if s.ds_default != s.default}
    assert differ == {"gradient_clipping", "offload_optimizer", "offload_param"}
    assert schema.FIELDS["gradient_clipping"].ds_default == 1.0 and ZeroConfig().gradient_clipping == 0.0
    # an absent key reads as DeepSpeed's default
    assert load({}).gradient_clipping == 1.0 and load({}).offload_optimizer is None


def test_loss_scaler_defaults_are_the_fp16_fields_defaults():
    scaler = LossScaler()
    for f in dataclasses.fields(LossScaler):
        if f.name in schema.FIELDS:
            assert schema.FIELDS[f.name].default == getattr(scaler, f.name)
    assert ZeroConfig().loss_scaler == scaler


def test_every_key_table_entry_that_sets_a_field_names_a_field_with_that_key():
    for block, table in (("", TOP), ("zero_optimization", ZERO),
                         ("zero_optimization.offload_optimizer", OFFLOAD_OPTIMIZER),
                         ("zero_optimization.offload_param", OFFLOAD_PARAM)):
        for key, entry in table.items():
            if entry.field in schema.FIELDS and entry.field not in ("optimizer", "scheduler"):
                path = f"{block}.{key}" if block else key
                assert path in schema.FIELDS[entry.field].keys, path


# one valid non-default value per DeepSpeed key that sets a field, and what the field becomes
KEY_VALUES = {
    "zero_optimization.stage": (2, 2),
    "tensor_parallel.autotp_size": (2, 2),
    "sequence_parallel_size": (2, 2),
    "seq_parallel_communication_data_type": ("bf16", "bf16"),
    "tensor_parallel.vocab_parallel_lm_head": (True, True),
    "zero_optimization.reduce_scatter": (False, False),
    "zero_optimization.reduce_bucket_size": (1e6, 1_000_000),
    "zero_optimization.allgather_bucket_size": (0, 0),
    "zero_optimization.overlap_comm": (True, True),
    "zero_optimization.stage3_prefetch_bucket_size": (0, 0),
    "zero_optimization.prefetch_bucket_size": (7, 7),
    "zero_optimization.stage3_param_persistence_threshold": (0, 0),
    "zero_optimization.param_persistence_threshold": (11, 11),
    "zero_optimization.stage3_max_live_parameters": (0, 0),
    "zero_optimization.max_live_parameters": (13, 13),
    "zero_optimization.stage3_max_reuse_distance": (0, 0),
    "zero_optimization.max_reuse_distance": (17, 17),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (True, True),
    "zero_optimization.gather_16bit_weights_on_model_save": (True, True),
    "zero_optimization.sub_group_size": (0, 0),
    "zero_optimization.offload_optimizer.device": ("cpu", "cpu"),
    "zero_optimization.offload_param.device": ("cpu", "cpu"),
    "zero_optimization.offload_optimizer.nvme_path": ("/nvme", "/nvme"),
    "zero_optimization.offload_param.nvme_path": ("/nvme", "/nvme"),
    "zero_optimization.offload_param.buffer_count": (4, 4),
    "zero_optimization.offload_param.buffer_size": (1e6, 10**6),
    "zero_optimization.offload_param.max_in_cpu": (2e6, 2 * 10**6),
    "zero_optimization.offload_optimizer.pin_memory": (False, False),
    "zero_optimization.offload_param.pin_memory": (False, False),
    "zero_optimization.offload_optimizer.ratio": (0.25, 0.25),
    "zero_optimization.zero_quantized_weights": (True, True),
    "zero_optimization.zero_hpz_partition_size": (1, 1),
    "zero_optimization.zero_quantized_gradients": (True, True),
    "fp16.loss_scale": (128, 128.0),
    "fp16.initial_scale_power": (8, 8),
    "fp16.loss_scale_window": (10, 10),
    "fp16.hysteresis": (3, 3),
    "fp16.consecutive_hysteresis": (True, True),
    "fp16.min_loss_scale": (4, 4.0),
    "bf16.check_grad_overflow": (False, False),
    "bf16.bf16_master_weights_and_grads": (True, "bfloat16"),
    "bf16.bf16_optimizer_states": (True, "bfloat16"),
    "gradient_accumulation_steps": (2, 2),
    "gradient_clipping": (0.5, 0.5),
    "train_micro_batch_size_per_gpu": (4, 4),
    "train_batch_size": (8, 8),
    "activation_checkpointing": ({"cpu_checkpointing": True},
                                 {"cpu_checkpointing": True, "partition_activations": False,
                                  "contiguous_memory_optimization": False, "number_checkpoints": None,
                                  "synchronize_checkpoint_boundary": False, "profile": False}),
}


def _config_with(path: str, value) -> dict:
    cfg = {"zero_optimization": {"stage": 3}}
    if path.startswith("fp16."):
        cfg["fp16"] = {"enabled": True}
    if path.startswith("bf16."):
        cfg["bf16"] = {"enabled": True}
    if path == "bf16.bf16_optimizer_states":  # DeepSpeed requires the bf16 master with it
        cfg["bf16"]["bf16_master_weights_and_grads"] = True
    if ".offload_" in path:
        block = path.split(".")[1]
        cfg["zero_optimization"][block] = {"device": "cpu"}
    if path == "gradient_accumulation_steps":
        cfg.update(train_micro_batch_size_per_gpu=4)
    *parents, key = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    node[key] = value
    return cfg


@pytest.mark.parametrize("path", sorted(KEY_VALUES))
def test_each_deepspeed_key_sets_its_field(path):
    value, want = KEY_VALUES[path]
    field = next(n for n, s in schema.FIELDS.items() if path in s.keys)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ZeroConfig.from_deepspeed({**B, **_config_with(path, value)}, world_size=1)
    assert getattr(config, field) == want and type(getattr(config, field)) is type(want)


def test_the_table_of_key_values_covers_every_key():
    keys = {k for n, s in schema.FIELDS.items() if n not in ("precision", "optimizer", "scheduler", "zenflow")
            for k in s.keys}
    assert keys == set(KEY_VALUES)


# --------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("key", ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                 "stage3_max_live_parameters", "stage3_max_reuse_distance", "allgather_bucket_size",
                                 "zero_hpz_partition_size"])
def test_deepspeed_ge_0_bounds_accept_0_and_refuse_negatives(key):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)
        load({"zero_optimization": {"stage": 3, key: 0}})
        with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}=-1 .*expected an integer >= 0"):
            load({"zero_optimization": {"stage": 3, key: -1}})


def test_reduce_bucket_size_is_gt_0():
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_size=0 \(ZeroConfig\.reduce_bucket_size\)"
                                          r" is invalid: expected an integer >= 1"):
        load({"zero_optimization": {"reduce_bucket_size": 0}})
    with pytest.raises(ConfigError, match=r"ZeroConfig\.reduce_bucket_size=0 is invalid"):
        ZeroConfig(reduce_bucket_size=0)


def test_zero_is_a_valid_bound_for_zeroconfig_too():
    c = ZeroConfig(stage=3, max_live_parameters=0, prefetch_bucket_size=0, param_persistence_threshold=0,
                   max_reuse_distance=0, allgather_bucket_size=0)
    assert (c.max_live_parameters, c.prefetch_bucket_size, c.allgather_bucket_size) == (0, 0, 0)


def test_values_are_checked_and_normalised():
    c = ZeroConfig(reduce_bucket_size=5e8, gradient_clipping=1, offload_optimizer="none", stage=1)
    assert c.reduce_bucket_size == 500_000_000 and type(c.reduce_bucket_size) is int
    assert c.gradient_clipping == 1.0 and type(c.gradient_clipping) is float and c.offload_optimizer is None
    for bad, match in [(dict(stage=True), "ZeroConfig.stage=True is invalid"),
                       (dict(reduce_bucket_size=2.5), "ZeroConfig.reduce_bucket_size=2.5 is invalid: expected an integer"),
                       (dict(data_axis=""), "ZeroConfig.data_axis=''"),
                       (dict(optimizer=[1]), "ZeroConfig.optimizer=\\[1\\] is invalid: expected a dict")]:
        with pytest.raises(ConfigError, match=match):
            ZeroConfig(**bad)


# --------------------------------------------------------------------------- one rule, one message
RULE_CASES = [  # (ZeroConfig kwargs, DeepSpeed zero_optimization block, field at fault, key path)
    (dict(stage=0, offload_optimizer="cpu"), {"stage": 0, "offload_optimizer": {"device": "cpu"}},
     "offload_optimizer", "zero_optimization.offload_optimizer.device"),
    (dict(stage=1, offload_optimizer="nvme"), {"stage": 1, "offload_optimizer": {"device": "nvme"}},
     "nvme_path", "zero_optimization.offload_optimizer.nvme_path"),
    (dict(stage=3, offload_optimizer="nvme"), {"stage": 3, "offload_optimizer": {"device": "nvme"}},
     "nvme_path", "zero_optimization.offload_optimizer.nvme_path"),
    # params on NVMe live in the NVMe optimizer's files: refused by name without it
    (dict(stage=3, offload_param="nvme"), {"stage": 3, "offload_param": {"device": "nvme"}},
     "offload_param", "zero_optimization.offload_param.device"),
    (dict(stage=3, offload_param="nvme", offload_optimizer="cpu", nvme_path="/x"),
     {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"},
      "offload_optimizer": {"device": "cpu"}},
     "offload_param", "zero_optimization.offload_param.device"),
    (dict(stage=2, offload_optimizer="cpu", offload_ratio=0.5),
     {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "offload_ratio",
     "zero_optimization.offload_optimizer.ratio"),
    (dict(stage=2, offload_optimizer="nvme", nvme_path="/x", sub_group_size=0),
     {"stage": 2, "sub_group_size": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
     "sub_group_size", "zero_optimization.sub_group_size"),
]


def _core(message: str) -> str:
    """The message with every field name and DeepSpeed key path replaced by <F>: what is left
    is the rule's own wording, the value and the fix."""
    message = re.sub(r"ZeroConfig\.\w+", "<F>", message)
    for path in sorted({p for s in schema.FIELDS.values() for p in s.keys if "." in p}, key=len, reverse=True):
        message = message.replace(path, "<F>")
    return re.sub(r"^(<F>=\S+) \(<F>\)", r"\1", message)


@pytest.mark.parametrize("kwargs,zo,field,path", RULE_CASES, ids=[c[2] + str(i) for i, c in enumerate(RULE_CASES)])
def test_a_rule_has_one_message_from_zeroconfig_and_from_a_file(kwargs, zo, field, path):
    with pytest.raises(ConfigError) as direct:
        ZeroConfig(**kwargs)
    with pytest.raises(ConfigError) as read:
        load({"zero_optimization": zo})
    direct, read = str(direct.value), str(read.value)
    assert direct.startswith(f"ZeroConfig.{field}=")
    assert read.startswith(f"{path}=") and f"(ZeroConfig.{field})" in read
    assert "Fix: " in direct and direct.split("Fix: ")[1] == read.split("Fix: ")[1]
    assert _core(direct) == _core(read)


def test_offload_param_below_stage_3_is_an_error_by_hand_and_ignored_from_a_file_with_the_same_words():
    with pytest.raises(ConfigError) as direct:
        ZeroConfig(stage=2, offload_param="cpu")
    with pytest.warns(IgnoredKeysWarning) as record:
        c = load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu", "pin_memory": False}}})
    assert c.offload_param is None and c.pin_memory is True  # the whole block is ignored, as in DeepSpeed
    text = str(record[0].message)
    assert "zero_optimization.offload_param.device='cpu' (ZeroConfig.offload_param) needs ZeRO stage 3" in text
    assert "DeepSpeed ignores it there" in text
    assert str(direct.value).split("Fix: ")[1] in text
    assert "needs ZeRO stage 3 (ZeroConfig.stage is 2): parameters are offloaded only with ZeRO-3" in str(direct.value)


def test_offload_param_nvme_needs_the_nvme_optimizer_and_says_so():
    for make in (lambda: ZeroConfig(stage=3, offload_param="nvme", nvme_path="/x"),
                 lambda: ZeroConfig(stage=3, offload_param="cpu").replace(offload_param="nvme", nvme_path="/x")):
        with pytest.raises(ConfigError) as direct:
            make()
        assert str(direct.value).startswith("ZeroConfig.offload_param='nvme' needs offload_optimizer \"nvme\"")
        assert 'Fix: set offload_optimizer to "nvme"' in str(direct.value)
    with pytest.raises(ConfigError) as read:
        load({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    assert "zero_optimization.offload_param.device='nvme' (ZeroConfig.offload_param)" in str(read.value)
    # ZeRO-Infinity's config (both on NVMe) is accepted, with DeepSpeed's read-ahead keys
    cfg = load({"zero_optimization": {"stage": 3,
                                      "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 4,
                                                        "buffer_size": 1e6, "max_in_cpu": 2e6},
                                      "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
    assert (cfg.offload_param, cfg.offload_optimizer, cfg.offload_param_buffer_count,
            cfg.offload_param_buffer_size, cfg.offload_param_max_in_cpu) == ("nvme", "nvme", 4, 10**6, 2 * 10**6)


def test_fp16_and_bf16_together_is_one_message_naming_both_keys():
    with pytest.raises(ConfigError, match=r"fp16\.enabled and bf16\.enabled are both true \(ZeroConfig\.precision\)"):
        load({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_stage3_tuning_fields_are_allowed_by_hand_below_stage_3():
    assert ZeroConfig(stage=2, max_live_parameters=5).max_live_parameters == 5
