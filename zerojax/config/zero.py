"""ZeroConfig: every knob of the engine in one frozen dataclass.

Field names follow DeepSpeed's JSON keys (without the ``stage3_`` prefix) so a DeepSpeed
user recognises them; ``ZeroConfig.from_deepspeed`` reads such a file directly::

    config = ZeroConfig(stage=2, precision="bf16", gradient_accumulation_steps=4,
                        gradient_clipping=1.0)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from zerojax.config.deepspeed import deepspeed_fields
from zerojax.errors import ConfigError
from zerojax.precision import PRECISIONS, LossScaler


OFFLOAD_DEVICES = (None, "none", "cpu", "nvme")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    # --- partitioning ---------------------------------------------------------------
    stage: int = 0
    data_axis: str = "data"
    # --- precision ------------------------------------------------------------------
    precision: str = "fp32"  # fp32 | bf16 | fp16
    # fp16 loss scaling (DeepSpeed's fp16 block)
    loss_scale: float = 0.0  # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    # bf16: skip steps whose gradients hold inf/nan
    check_grad_overflow: bool = True
    # --- the step -------------------------------------------------------------------
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0  # 0 disables
    train_micro_batch_size_per_gpu: Optional[int] = None
    train_batch_size: Optional[int] = None
    # --- collectives (elements) -----------------------------------------------------
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: Optional[bool] = None  # None: True for stage 3, else False
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    gather_16bit_weights_on_model_save: bool = False
    sub_group_size: int = 1_000_000_000
    # --- offload --------------------------------------------------------------------
    offload_optimizer: Optional[str] = None  # None | "cpu" | "nvme"
    offload_param: Optional[str] = None  # stage 3 only
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    offload_ratio: float = 1.0
    # --- what a DeepSpeed file carried beyond the engine (resolved blocks) -----------
    optimizer: Optional[dict] = None
    scheduler: Optional[dict] = None
    zenflow: Optional[dict] = None

    def __post_init__(self):
        # normalise "none" to None so comparisons elsewhere stay simple
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) == "none":
                object.__setattr__(self, key, None)
        _validate(self)

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


def _err(key: str, value, expected: str, fix: str) -> ConfigError:
    return ConfigError(f"ZeroConfig.{key}={value!r} is invalid: expected {expected}. Fix: {fix}")


def _validate(c: ZeroConfig) -> None:
    if c.stage not in (0, 1, 2, 3) or isinstance(c.stage, bool):
        raise _err("stage", c.stage, "one of 0, 1, 2, 3", "pick a ZeRO stage: 0 replicates, 1 partitions "
                   "optimizer state, 2 also gradients, 3 also parameters")
    if c.precision not in PRECISIONS:
        raise _err("precision", c.precision, f"one of {PRECISIONS}", 'use precision="bf16" for mixed precision')
    if not isinstance(c.gradient_accumulation_steps, int) or c.gradient_accumulation_steps < 1:
        raise _err("gradient_accumulation_steps", c.gradient_accumulation_steps, "an int >= 1",
                   "set it to the number of micro-batches per optimizer step")
    if c.gradient_clipping < 0:
        raise _err("gradient_clipping", c.gradient_clipping, "a float >= 0 (0 disables clipping)", "use 0 or a positive norm")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                "sub_group_size"):
        if getattr(c, key) < 1:
            raise _err(key, getattr(c, key), "a positive number of elements", "use e.g. 5e8")
    if c.param_persistence_threshold < 0:
        raise _err("param_persistence_threshold", c.param_persistence_threshold, "an int >= 0",
                   "use 0 to partition every parameter")
    if c.loss_scale < 0:
        raise _err("loss_scale", c.loss_scale, "0 (dynamic) or a positive static scale", "use 0")
    if c.loss_scale_window < 1 or c.hysteresis < 1 or c.min_loss_scale <= 0:
        raise _err("loss_scale_window/hysteresis/min_loss_scale",
                   (c.loss_scale_window, c.hysteresis, c.min_loss_scale), "window >= 1, hysteresis >= 1, min > 0",
                   "use DeepSpeed's defaults 1000, 2, 1")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(c, key) not in OFFLOAD_DEVICES:
            raise _err(key, getattr(c, key), 'None, "cpu" or "nvme"', f'use {key}="cpu"')
    if c.offload_param is not None and c.stage != 3:
        raise _err("offload_param", c.offload_param, "offload_param only with stage 3",
                   "set stage=3 or offload only the optimizer (offload_optimizer)")
    if c.offload_optimizer is not None and c.stage == 0:
        raise _err("offload_optimizer", c.offload_optimizer, "stage 1, 2 or 3 for optimizer offload",
                   "set stage=1 or higher")
    if "nvme" in (c.offload_optimizer, c.offload_param) and not c.nvme_path:
        raise _err("nvme_path", c.nvme_path, "a directory when offloading to nvme", "set nvme_path='/local/nvme'")
    if not 0 < c.offload_ratio <= 1:
        raise _err("offload_ratio", c.offload_ratio, "a fraction in (0, 1]", "use 1.0")
    if c.offload_ratio < 1 and c.stage != 3:
        raise _err("offload_ratio", c.offload_ratio, "ratio < 1 only with stage 3", "use ratio 1.0 or stage 3")


def config_from_deepspeed(path_or_dict, training_args=None, world_size=None, hidden_size=None) -> ZeroConfig:
    """``ZeroConfig.from_deepspeed`` as a function: a DeepSpeed JSON config (path or dict) in,
    "auto" filled from ``training_args``; ConfigError naming the key, IgnoredKeysWarning for
    settings zerojax accepts but cannot honour."""
    return ZeroConfig.from_deepspeed(path_or_dict, training_args=training_args, world_size=world_size,
                                     hidden_size=hidden_size)
