"""ZeroConfig: every knob of the engine in one frozen dataclass.

Field names follow DeepSpeed's JSON keys (without the ``stage3_`` prefix) so a DeepSpeed
user recognises them; ``ZeroConfig.from_deepspeed`` reads such a file directly::

    config = ZeroConfig(stage=2, precision="bf16", gradient_accumulation_steps=4,
                        gradient_clipping=1.0)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from zerojax.config._schema import defaults, validate
from zerojax.config._checks import activation_checkpointing_block
from zerojax.config._deepspeed import deepspeed_fields
from zerojax._precision import LossScaler

_D = defaults()  # the defaults live in zerojax.config._schema.FIELDS, with each field's check


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Every knob of the engine. Each field's DeepSpeed key, defaults (ZeroConfig's and
    DeepSpeed's where they differ), check and the rules between fields are in
    :data:`zerojax.config._schema.FIELDS` / ``RULES``; construction checks and normalises
    them (``"none"`` offload devices become None, integral floats such as ``5e8`` ints)."""

    # --- partitioning ---------------------------------------------------------------
    stage: int = _D["stage"]
    data_axis: str = _D["data_axis"]
    autotp_size: int = _D["autotp_size"]  # tensor-parallel devices on the "model" axis (zerojax._autotp); 1: off
    sequence_parallel_size: int = _D["sequence_parallel_size"]  # Ulysses devices on the "seq" axis; 1: off
    seq_parallel_comm_dtype: str = _D["seq_parallel_comm_dtype"]  # fp32 | bf16 | fp16: Ulysses' all-to-all type
    autotp_vocab_parallel: bool = _D["autotp_vocab_parallel"]  # AutoTP also splits embedding and lm_head
    # --- precision ------------------------------------------------------------------
    precision: str = _D["precision"]  # fp32 | bf16 | fp16
    # fp16 loss scaling (DeepSpeed's fp16 block)
    loss_scale: float = _D["loss_scale"]  # 0 = dynamic
    initial_scale_power: int = _D["initial_scale_power"]
    loss_scale_window: int = _D["loss_scale_window"]
    hysteresis: int = _D["hysteresis"]
    consecutive_hysteresis: bool = _D["consecutive_hysteresis"]
    min_loss_scale: float = _D["min_loss_scale"]
    # bf16: skip steps whose gradients hold inf/nan
    check_grad_overflow: bool = _D["check_grad_overflow"]
    # low-precision model states (DeepSpeed's bf16_master_weights_and_grads / bf16_optimizer_states)
    master_weights_dtype: Optional[str] = _D["master_weights_dtype"]  # None: fp32 master | "bfloat16": params are it
    optimizer_state_dtype: Optional[str] = _D["optimizer_state_dtype"]  # None: fp32 | "bfloat16": moments in bf16
    stochastic_rounding: bool = _D["stochastic_rounding"]  # the bf16 master update rounds stochastically
    # --- the step -------------------------------------------------------------------
    gradient_accumulation_steps: int = _D["gradient_accumulation_steps"]
    gradient_clipping: float = _D["gradient_clipping"]  # 0 disables (DeepSpeed's default is 1.0)
    train_micro_batch_size_per_gpu: Optional[int] = _D["train_micro_batch_size_per_gpu"]
    train_batch_size: Optional[int] = _D["train_batch_size"]
    # --- collectives (elements) -----------------------------------------------------
    reduce_scatter: bool = _D["reduce_scatter"]
    reduce_bucket_size: int = _D["reduce_bucket_size"]
    allgather_bucket_size: int = _D["allgather_bucket_size"]
    overlap_comm: Optional[bool] = _D["overlap_comm"]  # None: True for stage 3, else False
    prefetch_bucket_size: int = _D["prefetch_bucket_size"]
    param_persistence_threshold: int = _D["param_persistence_threshold"]
    max_live_parameters: int = _D["max_live_parameters"]
    max_reuse_distance: int = _D["max_reuse_distance"]
    gather_16bit_weights_on_model_save: bool = _D["gather_16bit_weights_on_model_save"]
    sub_group_size: int = _D["sub_group_size"]
    # --- offload --------------------------------------------------------------------
    offload_optimizer: Optional[str] = _D["offload_optimizer"]  # None | "cpu" | "nvme"
    offload_param: Optional[str] = _D["offload_param"]  # None | "cpu" | "nvme" (with offload_optimizer "nvme"); stage 3
    offload_param_buffer_count: int = _D["offload_param_buffer_count"]  # nvme params: read-ahead buffers
    offload_param_buffer_size: int = _D["offload_param_buffer_size"]  # elements each
    offload_param_max_in_cpu: int = _D["offload_param_max_in_cpu"]  # elements of params in host memory at most
    nvme_path: Optional[str] = _D["nvme_path"]
    pin_memory: bool = _D["pin_memory"]
    offload_ratio: float = _D["offload_ratio"]
    # --- production runs (zerojax.runtime._watchdog) ---------------------------------
    step_timeout: Optional[float] = _D["step_timeout"]  # None: DEEPSPEED_TIMEOUT minutes, else 1800 s; 0: off
    first_step_timeout: Optional[float] = _D["first_step_timeout"]  # None: 2 x step_timeout
    preemption_signal: Optional[str] = _D["preemption_signal"]  # besides SIGTERM, e.g. "SIGUSR1"
    # --- what a DeepSpeed file carried beyond the engine (resolved blocks) -----------
    optimizer: Optional[dict] = _D["optimizer"]
    scheduler: Optional[dict] = _D["scheduler"]
    zenflow: Optional[dict] = _D["zenflow"]
    # DeepSpeed's activation_checkpointing block, every key filled in (None: absent); read by zj.remat
    activation_checkpointing: Optional[dict] = _D["activation_checkpointing"]
    # --- ZeRO++ (stage 3; zerojax.stages._zeropp) ------------------------------------
    quantized_weights: bool = _D["quantized_weights"]  # qwZ: 8-bit weight gathers
    hpz_partition_size: int = _D["hpz_partition_size"]  # hpZ: devices per node (1: off)
    quantized_gradients: bool = _D["quantized_gradients"]  # qgZ: quantized two-hop gradient reduction
    quantization_block_size: int = _D["quantization_block_size"]  # values per block (one fp32 maximum each)
    quantized_gradients_bits: int = _D["quantized_gradients_bits"]  # 4 (DeepSpeed's) or 8
    devices_per_node: Optional[int] = _D["devices_per_node"]  # None: hpz_partition_size, else one process's

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in validate(values).items():
            object.__setattr__(self, key, value)
        if self.activation_checkpointing is not None:  # keys checked (and refused) as in a DeepSpeed file
            object.__setattr__(self, "activation_checkpointing",
                               activation_checkpointing_block(self.activation_checkpointing,
                                                              autotp_size=self.autotp_size))

    # ------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else bool(self.overlap_comm)

    @property
    def loss_scaler(self) -> LossScaler:
        return LossScaler(
            initial_scale_power=self.initial_scale_power,
            loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            min_loss_scale=self.min_loss_scale,
            loss_scale=self.loss_scale,
        )

    def replace(self, **changes: Any) -> "ZeroConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(cls, path_or_dict, training_args=None, world_size=None, hidden_size=None):
        """Read a DeepSpeed JSON config (path or dict), filling "auto" from training_args."""
        return cls(**deepspeed_fields(path_or_dict, training_args=training_args, world_size=world_size,
                                      hidden_size=hidden_size))


def config_from_deepspeed(path_or_dict, training_args=None, world_size=None, hidden_size=None) -> ZeroConfig:
    """``ZeroConfig.from_deepspeed`` as a function: a DeepSpeed JSON config (path or dict) in,
    "auto" filled from ``training_args``; ConfigError naming the key, IgnoredKeysWarning for
    settings zerojax accepts but cannot honour."""
    return ZeroConfig.from_deepspeed(path_or_dict, training_args=training_args, world_size=world_size,
                                     hidden_size=hidden_size)
