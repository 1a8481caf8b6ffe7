"""The DeepSpeed JSON writer: a candidate's ZeroConfig as the keys DeepSpeed reads."""
from __future__ import annotations

from typing import Any, Dict

from zerojax.config import ZeroConfig

__all__ = ["deepspeed_dict"]


def deepspeed_dict(config: ZeroConfig) -> dict:
    """The batch, precision, clipping and zero_optimization keys of ``config`` as DeepSpeed JSON."""
    zero: Dict[str, Any] = {"stage": config.stage}
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(config, key)
        if device is not None:
            zero[key] = {"device": device, "pin_memory": config.pin_memory}
            if config.nvme_path:
                zero[key]["nvme_path"] = config.nvme_path
    out = {"train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
           "gradient_accumulation_steps": config.gradient_accumulation_steps,
           "train_batch_size": config.train_batch_size,
           "gradient_clipping": config.gradient_clipping, "zero_optimization": zero}
    if config.precision == "bf16":
        out["bf16"] = {"enabled": True}
    elif config.precision == "fp16":
        out["fp16"] = {"enabled": True, "initial_scale_power": config.initial_scale_power,
                       "loss_scale_window": config.loss_scale_window, "hysteresis": config.hysteresis,
                       "min_loss_scale": config.min_loss_scale}
    return {k: v for k, v in out.items() if v is not None}


