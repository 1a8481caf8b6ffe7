"""Configuration: ZeroConfig, the DeepSpeed JSON reader, optimizers and LR schedules.

    config = zj.ZeroConfig(stage=2, precision="bf16")
    config = zj.ZeroConfig.from_deepspeed("ds_config.json", training_args=zj.TrainingArgs(...))
    tx = zj.optimizer_from_config(config)

Layered bottom-up: ``schedules``; ``schema`` (every ZeroConfig field once: its DeepSpeed
keys, defaults, check, and the rules between fields); ``keys`` (DeepSpeed 0.19.8's keys per
block: honoured, ignored or refused); ``verdicts`` (what a read decided per key); ``checks``
(the block readers); ``auto`` ("auto" filling, TrainingArgs); ``optimizers`` (optax from a
resolved block); ``deepspeed`` (a file into fields, and the per-key report); ``zero`` (the
dataclass, validated by the schema).
"""
from zerojax.config import _schedules as schedules
from zerojax.config._deepspeed import TrainingArgs as TrainingArgs
from zerojax.config._deepspeed import resolve_batch as resolve_batch
from zerojax.config._optimizers import optimizer_from_config as optimizer_from_config
from zerojax.config._zero import ZeroConfig as ZeroConfig
from zerojax.config._zero import config_from_deepspeed as config_from_deepspeed
from zerojax._errors import ConfigError as ConfigError
from zerojax._errors import IgnoredKeysWarning as IgnoredKeysWarning

__all__ = ["ConfigError", "IgnoredKeysWarning", "TrainingArgs", "ZeroConfig", "config_from_deepspeed",
           "optimizer_from_config", "resolve_batch", "schedules"]
