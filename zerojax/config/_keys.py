"""DeepSpeed 0.19.8's config keys, block by block, and what zerojax does with each.

A :class:`Key` is honoured (it sets a ZeroConfig field, or a block zerojax reads), ignored
(zerojax has no such mechanism: warned by name when it is not at DeepSpeed's default) or
refused (ConfigError, with the zerojax way to get the same result). The keys that set a
ZeroConfig field come from :data:`zerojax.config._schema.FIELDS`, so their defaults and checks
are written once::

    ZERO["stage3_max_live_parameters"].field      # "max_live_parameters"
    ZERO["contiguous_gradients"].why               # why zerojax does without it
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

from zerojax.config._schema import FIELDS, NONTRAINABLE, Invalid, boolean, choice, integer, number, optional, string

__all__ = ["ACTIVATION_CHECKPOINTING", "BF16", "DEPRECATED_ZERO", "FP16", "Key", "MONITORS", "OFFLOAD_OPTIMIZER", "OFFLOAD_PARAM", "OPTIMIZERS",
           "REFUSED_OPTIMIZERS", "TENSOR_PARALLEL", "TOP", "ZENFLOW", "ZERO", "is_off"]

REMOVED = "was removed from DeepSpeed (0.19.8 refuses it)"


def is_off(value) -> bool:
    """An optional block left off: absent, empty, {"enabled": false} or every value empty/false."""
    if value in (None, False, {}):
        return True
    if isinstance(value, dict):
        return value.get("enabled") is False or not any(value.values())
    return False


@dataclasses.dataclass(frozen=True)
class Key:
    """One DeepSpeed key.

    ``default``: DeepSpeed's. ``check``: validates the JSON value (None: any). ``field``: the
    ZeroConfig field it sets (the key is honoured). ``why``: for an ignored or refused key,
    why, and for a refused one the fix. ``removed``: refused whenever present (DeepSpeed
    removed it and refuses it too); ``refused``: refused unless at its default (or off).
    ``stage3``: DeepSpeed reads it only at ZeRO stage 3. ``on_off``: a block whose default is
    off (see :func:`is_off`); ``off`` overrides that test.
    """

    default: Any = None
    check: Optional[Callable] = None
    field: Optional[str] = None
    why: str = ""
    removed: bool = False
    refused: bool = False
    stage3: bool = False
    on_off: bool = False
    off: Optional[Callable] = None
    subkeys: tuple = ()  # a block DeepSpeed checks strictly: any other key in it is an error

    def at_default(self, value) -> bool:
        if self.off is not None:
            return self.off(value)
        if self.on_off:
            return is_off(value)
        if isinstance(value, bool) != isinstance(self.default, bool):
            return False
        return value == self.default

    @property
    def honoured(self) -> bool:
        return self.field is not None


def _fields_under(block: str) -> dict:
    """The keys of ``block`` that set a ZeroConfig field, from the schema."""
    out = {}
    for spec in FIELDS.values():
        for path in spec.keys:
            parent, _, key = path.rpartition(".")
            if parent == block:
                out[key] = Key(spec.key_default, spec.ds_check, spec.name)
    return out


def _ignored(default, check, why, **kw) -> Key:
    return Key(default, check, why=why, **kw)


def _both(key, default, check, why, **kw) -> dict:
    return {f"stage3_{key}": _ignored(default, check, why, **kw), key: _ignored(default, check, why, **kw)}


_XLA_SCHEDULES = "XLA schedules the collectives of the compiled step"
_TORCH_HOOKS = "a PyTorch module-hook detail; zerojax's stage 3 gathers inside the compiled step"

# --------------------------------------------------------------------------- zero_optimization
ZERO: dict = {
    **_fields_under("zero_optimization"),
    "contiguous_gradients": _ignored(True, boolean, "XLA owns the gradient buffers, which are already "
                                     "contiguous; false has no zerojax equivalent"),
    "use_multi_rank_bucket_allreduce": _ignored(True, boolean, _XLA_SCHEDULES),
    "allgather_partitions": _ignored(True, boolean, "zerojax always all-gathers updated partitions"),
    "compute_grad_norm": _ignored(True, boolean, "zerojax computes the norm when clipping or reporting it"),
    "load_from_fp32_weights": _ignored(True, boolean, "zerojax checkpoints hold the fp32 master weights"),
    "elastic_checkpoint": _ignored(False, boolean, "zerojax checkpoints restore onto any mesh"),
    "ignore_unused_parameters": _ignored(True, boolean, "JAX gives unused parameters zero gradients"),
    "legacy_stage1": _ignored(False, boolean, "zerojax has one stage-1 implementation"),
    "round_robin_gradients": _ignored(False, boolean, "a CPU-offload copy schedule; " + _XLA_SCHEDULES),
    "parameter_alignment": _ignored(False, boolean, "XLA lays out the buffers"),
    "enable_sanity_checks": _ignored(False, boolean, "a DeepSpeed debugging aid"),
    "save_muon_momentum_buffer_in_memory": _ignored(False, boolean, "a DeepSpeed stage-3 Muon buffer placement; "
                                                    "zerojax keeps Muon's momentum with its optimizer state"),
    "memory_efficient_linear": _ignored(True, boolean, _TORCH_HOOKS, stage3=True),
    "pipeline_loading_checkpoint": _ignored(False, boolean, "a DeepSpeed pipeline-engine detail", stage3=True),
    "override_module_apply": _ignored(True, boolean, _TORCH_HOOKS, stage3=True),
    "log_trace_cache_warnings": _ignored(False, boolean, _TORCH_HOOKS, stage3=True),
    "leaf_module": _ignored({}, None, _TORCH_HOOKS, on_off=True, stage3=True),
    **_both("model_persistence_threshold", sys.maxsize, integer(0), _TORCH_HOOKS, stage3=True),
    **_both("module_granularity_threshold", 0, integer(), _TORCH_HOOKS, stage3=True),
    **_both("use_all_reduce_for_fetch_params", False, boolean, _TORCH_HOOKS, stage3=True),
    **_both("allgather_sequential", False, boolean, _TORCH_HOOKS, stage3=True),
    "zero_quantized_nontrainable_weights": _ignored(False, boolean, NONTRAINABLE, stage3=True),
    **{k: Key(removed=True, why=f"MiCS sharding {REMOVED}. Fix: remove it (ZeRO stage 3 shards over the "
                                "whole data axis)") for k in ("mics_shard_size", "mics_hierarchical_params_gather")},
    "zeropp_loco_param": Key(removed=True, why=f"LoCo-ZeRO++ {REMOVED}. Fix: remove it"),
}
# deprecated spelling -> (the key that replaces it, what it becomes)
DEPRECATED_ZERO = {
    "cpu_offload": ("offload_optimizer", '"offload_optimizer": {"device": "cpu"}'),
    "cpu_offload_param": ("offload_param", '"offload_param": {"device": "cpu"}'),
    "cpu_offload_use_pin_memory": ("pin_memory", '"pin_memory" inside offload_optimizer and offload_param'),
    "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save",
                                                 '"stage3_gather_16bit_weights_on_model_save"'),
}
ZERO_BLOCKS = ("offload_optimizer", "offload_param", "zenflow")

_NVME_BUFFERS = "zerojax's NVMe store sizes its own buffers"
OFFLOAD_OPTIMIZER: dict = {
    **_fields_under("zero_optimization.offload_optimizer"),
    "buffer_count": _ignored(4, integer(0), _NVME_BUFFERS),
    "pipeline_read": _ignored(False, boolean, _NVME_BUFFERS),
    "pipeline_write": _ignored(False, boolean, _NVME_BUFFERS),
    "fast_init": _ignored(False, boolean, _NVME_BUFFERS),
    "super_offload": _ignored(False, boolean, "a DeepSpeed Superchip CPU-Adam mode"),
    "cpuadam_cores_perc": _ignored(0.8, number(0, 1), "the host update uses XLA's CPU threads"),
}
OFFLOAD_PARAM: dict = _fields_under("zero_optimization.offload_param")


def _auto_or_int(v):
    return v if v == "auto" else integer()(v)


ZENFLOW: dict = {  # DeepSpeed's ZenFlowConfig; the block is kept whole as ZeroConfig.zenflow
    "topk_ratio": Key(0.1, number(0, 1, lo_open=True, hi_open=True), "zenflow"),
    "select_strategy": Key("auto", choice("auto", "step", "epoch"), "zenflow"),
    "select_interval": Key("auto", _auto_or_int, "zenflow"),
    "update_interval": Key("auto", _auto_or_int, "zenflow"),
    "overlap_step": Key(False, boolean, "zenflow"),
    "offload": Key(False, boolean, "zenflow"),
    "auto_ratio": Key(0.99, number(0, 1, lo_open=True), "zenflow"),
    "full_warm_up_rounds": Key(0, integer(0), "zenflow"),
    "pt_reserved_cores_perc": Key(0.5, number(0, 1), "zenflow"),
}

# --------------------------------------------------------------------------- activation_checkpointing
# DeepSpeed's runtime/activation_checkpointing/config.py; the block is kept resolved as
# ZeroConfig.activation_checkpointing and read by zj.remat (zerojax._remat) while a step is traced
ACTIVATION_CHECKPOINTING: dict = {
    "cpu_checkpointing": Key(False, boolean, "activation_checkpointing"),
    # DeepSpeed splits the checkpoints over the model-parallel ranks: with one (no AutoTP) there is
    # nothing to split, as in DeepSpeed; with tensor_parallel.autotp_size > 1 it is refused
    # (checks.activation_checkpointing_block)
    "partition_activations": Key(False, boolean, "activation_checkpointing"),
    "contiguous_memory_optimization": _ignored(False, boolean, "DeepSpeed copies the checkpoints into one "
                                               "preallocated buffer against fragmentation; XLA assigns every buffer "
                                               "of the compiled step ahead of time, so nothing fragments"),
    "number_checkpoints": _ignored(None, optional(integer(1)), "the size of contiguous_memory_optimization's "
                                   "buffer, which zerojax does not allocate"),
    "synchronize_checkpoint_boundary": _ignored(False, boolean, "there is no device stream to synchronize: the "
                                                "compiled step runs its checkpoints in program order"),
    "profile": _ignored(False, boolean, "the checkpoints run inside one compiled step, where zerojax cannot time "
                        "them one by one; use wall_clock_breakdown or jax.profiler"),
}

# --------------------------------------------------------------------------- fp16 / bf16
FP16: dict = {
    **_fields_under("fp16"),
    "auto_cast": _ignored(False, boolean, "zerojax casts the params to the compute dtype; inputs stay as given"),
    "fp16_master_weights_and_grads": _ignored(False, boolean, "zerojax keeps fp32 master weights"),
}
BF16: dict = {
    **_fields_under("bf16"),
    "immediate_grad_update": _ignored(False, boolean, "zerojax reduces the gradients inside the step"),
}

# --------------------------------------------------------------------------- optimizer
def _betas(v):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise Invalid("a list of two numbers [beta1, beta2]")
    return [number(0, 1, hi_open=True)(b) for b in v]


def _p(default, check) -> Key:
    return Key(default, check, "optimizer")


_EPS = _p(1e-8, number(0, lo_open=True))
_ADAM = {"lr": _p(1e-3, number(0)), "betas": _p([0.9, 0.999], _betas), "eps": _EPS, "weight_decay": _p(0.0, number(0)),
         "adam_w_mode": _p(True, boolean), "bias_correction": _p(True, boolean), "torch_adam": _p(False, boolean),
         "amsgrad": _p(False, boolean)}
OPTIMIZERS = {  # lower-case type -> (name, params); DeepSpeed's defaults
    "adam": ("Adam", _ADAM),
    "adamw": ("AdamW", _ADAM),
    "lamb": ("Lamb", {"lr": _p(1e-3, number(0)), "betas": _p([0.9, 0.999], _betas), "eps": _EPS,
                      "weight_decay": _p(0.0, number(0)), "bias_correction": _p(True, boolean),
                      "max_coeff": _p(10.0, number(0)), "min_coeff": _p(0.01, number(0))}),
    "lion": ("Lion", {"lr": _p(1e-3, number(0)), "betas": _p([0.9, 0.99], _betas), "weight_decay": _p(0.0, number(0))}),
    "adagrad": ("Adagrad", {"lr": _p(1e-2, number(0)), "eps": _p(1e-10, number(0, lo_open=True)),
                            "weight_decay": _p(0.0, number(0)), "initial_accumulator_value": _p(0.0, number(0))}),
    "sgd": ("SGD", {"lr": _p(1e-3, number(0)), "momentum": _p(0.0, number(0, 1)), "dampening": _p(0.0, number(0)),
                    "weight_decay": _p(0.0, number(0)), "nesterov": _p(False, boolean)}),
    # DeepSpeed's MuonWithAuxAdam: "lr" serves both groups unless muon_lr / adam_lr replace it
    # (no lr at all: 0.02 for Muon, 3e-4 for Adam); weight_decay serves both groups
    "muon": ("Muon", {"lr": _p(None, optional(number(0))), "muon_lr": _p(None, optional(number(0))),
                      "adam_lr": _p(None, optional(number(0))), "momentum": _p(0.95, number(0, 1, hi_open=True)),
                      "weight_decay": _p(0.0, number(0)), "betas": _p([0.9, 0.95], _betas),
                      "eps": _p(1e-10, number(0, lo_open=True)), "ns_method": _p("gram", choice("gram", "standard"))}),
}
_COMPRESSED = ("compresses DeepSpeed's gradient all-reduce to 1 bit after a warmup; zerojax runs full-width "
               "collectives")
REFUSED_OPTIMIZERS = {  # lower-case type -> (what it is, the zerojax alternative)
    "onebitadam": ("1-bit Adam " + _COMPRESSED, '"type": "AdamW" (optax.adamw)'),
    "zerooneadam": ("0/1 Adam " + _COMPRESSED, '"type": "AdamW" (optax.adamw)'),
    "onebitlamb": ("1-bit LAMB " + _COMPRESSED, '"type": "Lamb" (optax.lamb with a trust-ratio clip)'),
    "muadam": ("muP Adam (DeepSpeed's mup wrapper)", '"type": "AdamW", with muP scaling in the model init and '
               "per-layer learning rates via optax.multi_transform"),
    "muadamw": ("muP AdamW (DeepSpeed's mup wrapper)", '"type": "AdamW", with muP scaling in the model init and '
                "per-layer learning rates via optax.multi_transform"),
    "musgd": ("muP SGD (DeepSpeed's mup wrapper)", '"type": "SGD", with muP scaling in the model init'),
}

# --------------------------------------------------------------------------- tensor_parallel (AutoTP)
def _inner_tp_off(value) -> bool:  # the inference block {"tp_size": 1, ...}: off at one rank
    return is_off(value) or isinstance(value, dict) and set(value) <= {"tp_size", "enabled", "tp_grain_size"} \
        and (value.get("tp_size") or 1) <= 1


_NOT_AUTOTP = "a DeepSpeed inference or injection setting; zerojax's AutoTP splits by layer name (zerojax._autotp)"
TENSOR_PARALLEL: dict = {
    **_fields_under("tensor_parallel"),  # autotp_size, vocab_parallel_lm_head
    "dtype": _ignored(None, None, "the precision comes from the fp16/bf16 blocks", off=lambda v: True),
    "tp_overlap_comm": _ignored(False, boolean, _XLA_SCHEDULES),
    "vocab_parallel_ce_backend": _ignored(None, None, "XLA partitions the cross-entropy of a vocabulary-parallel head",
                                          off=lambda v: True),
    **{k: Key(None, refused=True, off=_inner_tp_off, why=f"{_NOT_AUTOTP}. Fix: use autotp_size, or remove it")
       for k in ("tensor_parallel", "tp")},
    **{k: Key(None, refused=True, on_off=True, why=f"{_NOT_AUTOTP}. Fix: remove it")
       for k in ("injection_policy_tuple", "partition_config", "preset_model", "keep_module_on_host",
                 "replace_with_kernel_inject", "kernel_inject")},
}

# --------------------------------------------------------------------------- top level
_MONITOR = "not one of zerojax's monitors (zerojax.monitor): log the step's metrics with your own tool"
_NOT_HERE = "a DeepSpeed engine feature zerojax does not have"


def _any_bool(value) -> bool:  # either value is what zerojax does
    return isinstance(value, bool)


# --------------------------------------------------------------------------- monitors
# read by zerojax.monitor (Monitors.from_deepspeed); "field" names that reader
_MON = "zerojax.monitor"
_PER_MODULE = "a per-module PyTorch detail; XLA's cost analysis covers the whole compiled step"


def _names(value):
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise Invalid('a list of collective names, e.g. ["all_reduce", "all_gather"]')
    return value


def _monitor_block(**keys) -> dict:
    return {k: (v if isinstance(v, Key) else Key(v[0], v[1], _MON)) for k, v in keys.items()}


_PATHS = {"enabled": (False, boolean), "output_path": ("", string), "job_name": ("DeepSpeedJobName", string)}
MONITORS: dict = {
    "steps_per_print": Key(10, integer(1), _MON),
    "wall_clock_breakdown": Key(False, boolean, _MON),
    "tensorboard": _monitor_block(**_PATHS),
    "csv_monitor": _monitor_block(**_PATHS),
    "wandb": _monitor_block(enabled=(False, boolean), group=(None, optional(string)), team=(None, optional(string)),
                            project=("deepspeed", string)),
    "comms_logger": _monitor_block(enabled=(False, boolean), verbose=(False, boolean), prof_all=(True, boolean),
                                   prof_ops=([], _names),
                                   debug=_ignored(False, boolean, "zerojax's comms report has no debug mode")),
    "flops_profiler": _monitor_block(
        enabled=(False, boolean), profile_step=(1, integer(0)), output_file=(None, optional(string)),
        detailed=_ignored(True, boolean, _PER_MODULE), module_depth=_ignored(-1, integer(), _PER_MODULE),
        top_modules=_ignored(1, integer(), _PER_MODULE),
        recompute_fwd_factor=_ignored(0.0, number(0), "XLA counts the recomputation the compiled step does")),
}
_MONITOR_KEY = Key(why=f"read by {_MON}")  # TOP's entry for each: read_top hands them to checks.read_monitors

_FIELD_KEYS = {spec.keys[0]: Key(spec.key_default, spec.ds_check, spec.name)
               for spec in FIELDS.values() if len(spec.keys) == 1 and "." not in spec.keys[0]
               and spec.keys[0] not in ("optimizer", "scheduler")}
TOP: dict = {
    **_FIELD_KEYS,
    # blocks with readers of their own
    **{k: Key(field=k) for k in ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler")},
    **{k: _MONITOR_KEY for k in MONITORS},
    "memory_breakdown": _ignored(False, boolean, "use zj.memory_report / zj.estimate"),
    "dump_state": _ignored(False, boolean, _MONITOR),
    "prescale_gradients": _ignored(False, boolean, "zerojax averages in fp32 inside the reduction"),
    "gradient_predivide_factor": _ignored(1.0, number(), "zerojax averages in fp32 inside the reduction"),
    "gradient_allreduce_op": Key("mean", choice("mean", "sum"), refused=True,
                                 why="zerojax averages gradients over the data axis (DeepSpeed's \"mean\"). "
                                     "Fix: remove it, and scale the loss or the learning rate by the world size "
                                     "to get DeepSpeed's \"sum\""),
    "communication_data_type": _ignored(None, optional(string), "zerojax reduces gradients in their compute "
                                        "dtype and accumulates in fp32"),
    "zero_allow_untested_optimizer": _ignored(False, boolean, "every optax optimizer works with every stage",
                                              off=_any_bool),
    "zero_force_ds_cpu_optimizer": _ignored(True, boolean, "the host update runs the optax optimizer itself",
                                            off=_any_bool),
    "disable_allgather": _ignored(False, boolean, _XLA_SCHEDULES),
    "dataloader_drop_last": _ignored(False, boolean, "zerojax has no data loader"),
    "data_parallel_size": _ignored(None, None, "the mesh's data axis gives the data-parallel size"),
    "use_data_before_expert_parallelism": _ignored(False, boolean, "zerojax has no expert parallelism"),
    "disable_python_gc": _ignored(False, boolean, _NOT_HERE),
    "managed_gradient_accumulation": _ignored(True, boolean, "the step accumulates gradients itself"),
    "log_level": _ignored(None, None, _MONITOR),
    "vocabulary_size": _ignored(None, None, _NOT_HERE),
    "allgather_size": _ignored(None, None, 'read only with the deprecated "zero_optimization": true form'),
    "comet": Key(refused=True, on_off=True, subkeys=(
        "enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name", "experiment_key",
        "online", "mode"), why="zerojax has no Comet monitor (its comet_ml client is not one of zerojax's extras). "
                               'Fix: remove "comet" or set "enabled": false, and log with "tensorboard", "wandb" or '
                               '"csv_monitor"'),
    "timers": _ignored(None, None, "zerojax times steps with wall_clock_breakdown", on_off=True),
    "activation_checkpointing": Key(field="activation_checkpointing"),  # read by checks.activation_checkpointing_block
    "autotuning": _ignored(None, None, "use zj.autotune", on_off=True),
    "checkpoint": _ignored(None, None, "zerojax's CheckpointManager has its own options", on_off=True),
    "datastates_ckpt": _ignored(None, None, "zerojax's CheckpointManager writes asynchronously", on_off=True),
    "aio": _ignored(None, None, "zerojax's NVMe store does its own I/O", on_off=True),
    # the block is read by zj.pipeline.pipeline_options (zerojax/pipeline/_config.py), not by ZeroConfig
    "pipeline": _ignored(None, None, "ZeroConfig does not read it: pass zj.pipeline.pipeline_options(config) to "
                         "zj.PipelineModel (docs/pipeline.md)", on_off=True),
    "hybrid_engine": _ignored(None, None, _NOT_HERE, on_off=True, subkeys=(
        "enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
        "tp_gather_partition_size", "enable_cuda_graph")),
    "compile": _ignored(None, None, "the step is always compiled by XLA", on_off=True, subkeys=(
        "deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
        "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
        "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes")),
    "weight_quantization": _ignored(None, None, _NOT_HERE, on_off=True),
    "data_types": _ignored(None, None, "ZeroConfig.precision sets the dtypes", on_off=True),
    "torch_autocast": _ignored(None, None, "ZeroConfig.precision sets the dtypes", on_off=True),
    "data_efficiency": _ignored(None, None, _NOT_HERE, on_off=True),
    "expert_parallel": _ignored(None, None, "zerojax has no expert parallelism", on_off=True),
    "tensor_parallel": Key(field="tensor_parallel"),  # read by checks.tensor_parallel_fields (AutoTP)
    **{k: Key(removed=True, why=f"{what} {REMOVED}. Fix: remove \"{k}\"") for k, what in (
        ("nebula", "Nebula checkpointing"), ("compression_training", "the compression library"),
        ("amp", "NVIDIA Apex AMP (use bf16 or fp16)"), ("quantize_training", "Mixture-of-Quantization"),
        ("sparse_gradients", "sparse embedding-gradient compression"),
        ("eigenvalue", "eigenvalue-based Mixture-of-Quantization"), ("sparse_attention", "Sparse Attention"),
        ("elasticity", "elastic training (set the batch keys directly)"), ("graph_harvesting", "graph harvesting"),
        ("curriculum_learning", "top-level curriculum_learning"),
        ("progressive_layer_drop", "Progressive Layer Dropping"))},
}
