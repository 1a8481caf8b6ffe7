"""Checks for DeepSpeed JSON values: the key tables (DeepSpeed's keys, defaults and value
checks per block) and the readers that turn one block into ZeroConfig fields.

A schema maps a key to ``(default, check)``; ``check(value)`` returns the normalised value
or raises :class:`_Invalid` saying what was expected, and :func:`_read_block` turns that into
a ConfigError naming the key's full path::

    _read_block({"stage": 2}, _ZERO, _ZERO_IGNORED, "zero_optimization", ignored=[])
"""
from __future__ import annotations

import difflib
import math
import sys
from typing import Optional
from zerojax.errors import ConfigError



# --------------------------------------------------------------------------- value checks
class _Invalid(Exception):
    """A value failed a check; the argument says what was expected."""


def _did_you_mean(key: str, known) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.5)
    return f'Did you mean "{close[0]}"?' if close else f"Known keys: {', '.join(sorted(known))}."


def _bool(v):
    if not isinstance(v, bool):
        raise _Invalid("true or false")
    return v


def _int(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
            raise _Invalid("an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _Invalid(f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
        return int(v)
    return check


def _num(lo=None, hi=None, lo_open=False, hi_open=False):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _Invalid("a finite number")
        if lo is not None and (v < lo or (lo_open and v == lo)) or \
                hi is not None and (v > hi or (hi_open and v == hi)):
            raise _Invalid(f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
                           if hi is not None else f"a number {'>' if lo_open else '>='} {lo}")
        return float(v)
    return check


def _choice(*options):
    def check(v):
        v = "none" if v is None else v
        if v not in options:
            raise _Invalid(f"one of {', '.join(map(repr, options))}")
        return v
    return check


def _str(v):
    if not isinstance(v, str):
        raise _Invalid("a string")
    return v


def _opt(check):
    return lambda v: None if v is None else check(v)


def _betas(v):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise _Invalid("a list of two numbers [beta1, beta2]")
    return [_num(0, 1, hi_open=True)(b) for b in v]


def _auto_or_int(v):
    return v if v == "auto" else _int()(v)


def _value(path: str, value, check, default):
    if value is None and default is None:
        return None
    try:
        return check(value)
    except _Invalid as e:
        raise ConfigError(f"{path}={value!r} is invalid: expected {e}. "
                          f"Fix: write a value like the default, {default!r}") from None


def _read_block(block, schema: dict, ignored: dict, path: str, ignored_out: list, extra=(), spelled=None) -> dict:
    """Check ``block``'s keys and values against ``schema`` ({key: (default, check)}); return
    every schema key with its value or default. Non-default ``ignored`` keys go to ignored_out.
    ``spelled`` maps a key to the spelling the user wrote, for messages."""
    if not isinstance(block, dict):
        raise ConfigError(f"{path}={block!r} is invalid: expected a JSON object. Fix: write {path} as {{...}}")
    known = [*schema, *ignored, *extra]
    for key in block:
        if key not in known:
            raise ConfigError(f'Unknown key "{path}.{key}". {_did_you_mean(key, known)}')
    spelled = spelled or {}
    out = {key: _value(f"{path}.{spelled.get(key, key)}", block.get(key, default), check, default)
           for key, (default, check) in schema.items()}
    for key, default in ignored.items():
        if key in block and block[key] != default:
            ignored_out.append(f"{path}.{spelled.get(key, key)}={block[key]!r}")
    return out


# --------------------------------------------------------------------------- schemas
_ON_OFF = object()  # ignored block: default when empty or {"enabled": false}

_TOP_HANDLED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "zero_optimization", "fp16", "bf16", "optimizer", "scheduler")
_TOP_IGNORED = {
    "steps_per_print": 10, "wall_clock_breakdown": False, "memory_breakdown": False, "dump_state": False,
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "communication_data_type": None,
    "zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True,
    "sparse_gradients": False, "disable_allgather": False, "dataloader_drop_last": False,
    "sequence_parallel_size": 1, "graph_harvesting": False, "use_data_before_expert_parallelism": False,
    **{k: _ON_OFF for k in (
        "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
        "activation_checkpointing", "autotuning", "elasticity", "data_efficiency", "curriculum_learning",
        "checkpoint", "aio", "nebula", "compression_training", "pipeline", "timers", "amp", "eigenvalue",
        "progressive_layer_drop", "hybrid_engine", "compile", "weight_quantization", "data_types",
        "torch_autocast")},
}

_ZERO = {
    "stage": (0, _int(0, 3)),
    "contiguous_gradients": (True, _bool),
    "reduce_scatter": (True, _bool),
    "reduce_bucket_size": (500_000_000, _int(1)),
    "allgather_bucket_size": (500_000_000, _int(1)),
    "overlap_comm": (None, _bool),
    "prefetch_bucket_size": (50_000_000, _int(1)),
    "param_persistence_threshold": (100_000, _int(0)),
    "max_live_parameters": (1_000_000_000, _int(1)),
    "max_reuse_distance": (1_000_000_000, _int(0)),
    "gather_16bit_weights_on_model_save": (False, _bool),
    "sub_group_size": (1_000_000_000, _int(1)),
}
_ZERO_ALIASES = {f"stage3_{k}": k for k in (
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "gather_16bit_weights_on_model_save", "model_persistence_threshold", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params")}
_ZERO_ALIASES["stage3_gather_fp16_weights_on_model_save"] = "gather_16bit_weights_on_model_save"
_ZERO_IGNORED = {
    "round_robin_gradients": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
    "mics_shard_size": -1, "mics_hierarchical_params_gather": False, "allgather_partitions": True,
    "load_from_fp32_weights": True, "elastic_checkpoint": False, "ignore_unused_parameters": True,
    "legacy_stage1": False, "use_multi_rank_bucket_allreduce": True, "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False, "override_module_apply": True, "log_trace_cache_warnings": False,
    "model_persistence_threshold": sys.maxsize, "module_granularity_threshold": 0,
    "use_all_reduce_for_fetch_params": False,
}
_ZERO_DEPRECATED = {
    "cpu_offload": 'use "offload_optimizer": {"device": "cpu"}',
    "cpu_offload_params": 'use "offload_param": {"device": "cpu"}',
    "cpu_offload_use_pin_memory": 'use "pin_memory" inside offload_optimizer / offload_param',
}
_DEVICE = ("none", _choice("none", "cpu", "nvme"))
_OFFLOAD_OPT = {"device": _DEVICE, "nvme_path": (None, _opt(_str)), "pin_memory": (True, _bool),
                "ratio": (1.0, _num(0, 1, lo_open=True))}
_OFFLOAD_OPT_IGNORED = {"buffer_count": 4, "pipeline_read": False, "pipeline_write": False, "fast_init": False}
_OFFLOAD_PARAM = {"device": _DEVICE, "nvme_path": (None, _opt(_str)), "pin_memory": (True, _bool)}
_OFFLOAD_PARAM_IGNORED = {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
_ZENFLOW = {
    "topk_ratio": (0.1, _num(0, 1, lo_open=True, hi_open=True)),
    "select_strategy": ("auto", _choice("auto", "step", "epoch")),
    "select_interval": ("auto", _auto_or_int), "update_interval": ("auto", _auto_or_int),
    "overlap_step": (False, _bool), "offload": (False, _bool), "auto_ratio": (0.99, _num(0, 1, lo_open=True)),
    "full_warm_up_rounds": (0, _int(0)), "pt_reserved_cores_perc": (0.5, _num(0, 1)),
}
_FP16 = {"enabled": (False, _bool), "loss_scale": (0.0, _num(0)), "initial_scale_power": (16, _int(0, 127)),
         "loss_scale_window": (1000, _int(1)), "hysteresis": (2, _int(1)),
         "consecutive_hysteresis": (False, _bool), "min_loss_scale": (1.0, _num(0, lo_open=True))}
_FP16_IGNORED = {"auto_cast": False, "fp16_master_weights_and_grads": False}
_BF16 = {"enabled": (False, _bool), "check_grad_overflow": (True, _bool)}
_BF16_IGNORED = {"immediate_grad_update": False}

_LR, _WD, _BETA = (1e-3, _num(0)), (0.0, _num(0)), ([0.9, 0.999], _betas)
_ADAM = {"lr": _LR, "betas": _BETA, "eps": (1e-8, _num(0, lo_open=True)), "weight_decay": _WD,
         "adam_w_mode": (True, _bool), "bias_correction": (True, _bool), "torch_adam": (False, _bool),
         "amsgrad": (False, _bool)}
_OPTIMIZERS = {  # lower-case type -> (name, params schema); DeepSpeed's defaults
    "adam": ("Adam", _ADAM),
    "adamw": ("AdamW", _ADAM),
    "lamb": ("Lamb", {"lr": _LR, "betas": _BETA, "eps": (1e-8, _num(0, lo_open=True)), "weight_decay": _WD,
                      "bias_correction": (True, _bool), "max_coeff": (10.0, _num(0)),
                      "min_coeff": (0.01, _num(0))}),
    "lion": ("Lion", {"lr": _LR, "betas": _BETA, "weight_decay": _WD}),
    "adagrad": ("Adagrad", {"lr": (1e-2, _num(0)), "eps": (1e-10, _num(0, lo_open=True)), "weight_decay": _WD,
                            "initial_accumulator_value": (0.0, _num(0))}),
    "sgd": ("SGD", {"lr": _LR, "momentum": (0.0, _num(0, 1)), "dampening": (0.0, _num(0)),
                    "weight_decay": _WD, "nesterov": (False, _bool)}),
}
_UNSUPPORTED_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd", "muon")


# --------------------------------------------------------------------------- blocks
def _zero_fields(zo, ignored: list) -> dict:
    """ZeroConfig fields from the zero_optimization block."""
    path = "zero_optimization"
    if not isinstance(zo, dict):
        raise ConfigError(f"{path}={zo!r} is invalid: expected a JSON object. Fix: write {path} as {{...}}")
    for key, fix in _ZERO_DEPRECATED.items():
        if key in zo:
            raise ConfigError(f"{path}.{key} is deprecated in DeepSpeed and not read by zerojax. Fix: {fix}")
    canon, spelled = {}, {}
    for key, value in zo.items():
        name = _ZERO_ALIASES.get(key, key)
        if name in canon:
            raise ConfigError(f'{path}.{key} is given twice (also as "{spelled[name]}"). Fix: keep one spelling')
        canon[name], spelled[name] = value, key
    blocks = ("offload_optimizer", "offload_param", "zenflow")
    extra = [*_ZERO_ALIASES, *blocks]
    fields = _read_block({k: v for k, v in canon.items() if k not in blocks}, _ZERO, _ZERO_IGNORED, path,
                         ignored, extra=extra, spelled=spelled)
    stage = fields["stage"]
    if fields["overlap_comm"] is None:
        fields["overlap_comm"] = stage == 3
    opt = _read_block(canon.get("offload_optimizer") or {}, _OFFLOAD_OPT, _OFFLOAD_OPT_IGNORED,
                      f"{path}.offload_optimizer", ignored)
    par = _read_block(canon.get("offload_param") or {}, _OFFLOAD_PARAM, _OFFLOAD_PARAM_IGNORED,
                      f"{path}.offload_param", ignored)
    if par["device"] != "none" and stage != 3:
        raise ConfigError(f"{path}.offload_param.device={par['device']!r} needs {path}.stage 3 (got {stage}): "
                          "DeepSpeed offloads parameters only with ZeRO-3. Fix: set stage 3, or remove "
                          "offload_param and offload only the optimizer (offload_optimizer)")
    if opt["ratio"] < 1 and stage != 3:
        raise ConfigError(f"{path}.offload_optimizer.ratio={opt['ratio']} needs {path}.stage 3 (got {stage}): "
                          "partial optimizer offload is a ZeRO-3 feature. Fix: use ratio 1.0 or stage 3")
    if opt["device"] != "none" and stage == 0:
        raise ConfigError(f"{path}.offload_optimizer.device={opt['device']!r} needs {path}.stage 1, 2 or 3 "
                          "(got 0). Fix: set stage to 1 or higher")
    for name, block in (("offload_optimizer", opt), ("offload_param", par)):
        if block["device"] == "nvme" and not block["nvme_path"]:
            raise ConfigError(f'{path}.{name}.nvme_path is missing: device "nvme" needs a directory. '
                              f'Fix: add "nvme_path": "/local_nvme"')
    for key in ("nvme_path", "pin_memory"):
        given = {n: b[key] for n, b in (("offload_optimizer", opt), ("offload_param", par))
                 if key in (canon.get(n) or {})}
        if len(set(map(repr, given.values()))) > 1:
            raise ConfigError(f"{path}.offload_param.{key}={given['offload_param']!r} differs from "
                              f"{path}.offload_optimizer.{key}={given['offload_optimizer']!r}: zerojax uses one "
                              f"{key} for both. Fix: make them equal")
    zenflow = None
    if canon.get("zenflow") is not None:
        zenflow = _zenflow(canon["zenflow"], opt["device"], ignored)
    nvme = opt["nvme_path"] or par["nvme_path"]
    pin = all(b["pin_memory"] for b in (opt, par))
    return dict(fields, offload_optimizer=None if opt["device"] == "none" else opt["device"],
                offload_param=None if par["device"] == "none" else par["device"], nvme_path=nvme,
                pin_memory=pin, offload_ratio=opt["ratio"], zenflow=zenflow)


def zenflow_block(block, path: str = "zenflow", ignored: Optional[list] = None) -> dict:
    """A zenflow block with every key filled in, checked by DeepSpeed's rules; the one check
    behind both ``ZeroConfig(zenflow=...)`` and a DeepSpeed file's block."""
    z = _read_block(block, _ZENFLOW, {}, path, [] if ignored is None else ignored)
    sel, upd = z["select_interval"], z["update_interval"]
    if z["select_strategy"] != "auto" and sel == "auto":
        raise ConfigError(f"{path}.select_interval='auto' only works with select_strategy 'auto' (got "
                          f"{z['select_strategy']!r}). Fix: give select_interval a number of steps")
    for key, v in (("update_interval", upd), ("select_interval", sel)):
        if v != "auto" and v < 1:
            raise ConfigError(f"{path}.{key}={v} is invalid: expected an integer >= 1. Fix: use 4")
    if sel != "auto" and upd != "auto" and sel < upd:
        raise ConfigError(f"{path}.select_interval={sel} is smaller than update_interval={upd}: columns must "
                          "stay selected for at least one host update. Fix: make select_interval >= update_interval")
    return z


def _zenflow(block, offload_device: str, ignored: list) -> dict:
    path = "zero_optimization.zenflow"
    if offload_device != "cpu":
        raise ConfigError(f"{path} needs zero_optimization.offload_optimizer.device 'cpu' (got {offload_device!r}). "
                          'Fix: add "offload_optimizer": {"device": "cpu"}')
    return zenflow_block(block, path, ignored)


def _precision_fields(cfg: dict, ignored: list) -> dict:
    fp16 = _read_block(cfg.get("fp16", {}), _FP16, _FP16_IGNORED, "fp16", ignored)
    bf16 = _read_block(cfg.get("bf16", {}), _BF16, _BF16_IGNORED, "bf16", ignored)
    if fp16["enabled"] and bf16["enabled"]:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be "
                          "simultaneously enabled. Fix: set one of them to false (bf16 needs no loss scaling)")
    if fp16["enabled"]:
        return dict(precision="fp16", **{k: v for k, v in fp16.items() if k != "enabled"})
    if bf16["enabled"]:
        return dict(precision="bf16", check_grad_overflow=bf16["check_grad_overflow"])
    return dict(precision="fp32")


def _optimizer_block(block, ignored: list) -> dict:
    """Validate an optimizer block; return {"type": name, "params": every param with defaults}."""
    block = _read_block(block, {"type": (None, _opt(_str))}, {"legacy_fusion": False}, "optimizer", ignored,
                        extra=("params",)) | {"params": block.get("params", {})}
    if block["type"] is None:
        raise ConfigError('optimizer.type is missing. Fix: add "type": "AdamW" (or Adam, Lamb, Lion, Adagrad, SGD)')
    kind = block["type"].lower()
    if kind in _UNSUPPORTED_OPTIMIZERS:
        raise ConfigError(f"optimizer.type={block['type']!r} (DeepSpeed's own optimizer) has no zerojax "
                          f"counterpart. Fix: use one of {', '.join(n for n, _ in _OPTIMIZERS.values())}, "
                          "or build your own optax optimizer")
    if kind not in _OPTIMIZERS:
        names = [n for n, _ in _OPTIMIZERS.values()]
        raise ConfigError(f"optimizer.type={block['type']!r} is not supported. {_did_you_mean(block['type'], names)}")
    name, schema = _OPTIMIZERS[kind]
    if isinstance(block["params"], dict) and "max_grad_norm" in block["params"]:
        raise ConfigError("optimizer.params.max_grad_norm is not supported: DeepSpeed clips gradients with the "
                          'top-level key. Fix: remove it and set "gradient_clipping": <norm>')
    p = _read_block(block["params"], schema, {}, "optimizer.params", ignored)
    unsupported = [("bias_correction", False, "bias correction is always on"),
                   ("amsgrad", True, "AMSGrad is not supported (DeepSpeed's fused Adam refuses it too)")]
    for key, bad, why in unsupported:
        if p.get(key) is bad:
            raise ConfigError(f"optimizer.params.{key}={bad} is not supported: {why}. Fix: remove {key}")
    if name == "AdamW" and not p["adam_w_mode"]:
        raise ConfigError("optimizer.params.adam_w_mode=false with type AdamW: AdamW always decays weights "
                          'decoupled. Fix: use "type": "Adam" with adam_w_mode false for L2 regularisation')
    if name == "Lamb" and p["min_coeff"] > p["max_coeff"]:
        raise ConfigError(f"optimizer.params.min_coeff={p['min_coeff']} is above max_coeff={p['max_coeff']}. "
                          "Fix: use DeepSpeed's 0.01 and 10")
    if name == "SGD" and p["dampening"] != 0:
        raise ConfigError(f"optimizer.params.dampening={p['dampening']} is not supported. Fix: use 0")
    if name == "SGD" and p["nesterov"] and p["momentum"] == 0:
        raise ConfigError("optimizer.params.nesterov=true needs a momentum > 0. Fix: set momentum, e.g. 0.9")
    return {"type": name, "params": p}
