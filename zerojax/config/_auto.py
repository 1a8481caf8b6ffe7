"""Filling DeepSpeed's "auto" values the way Hugging Face's Trainer and accelerate do.

``training_args`` carries Hugging Face ``TrainingArguments`` names (and, optionally,
accelerate's DeepSpeed-plugin names ``zero_stage``, ``offload_optimizer_device``, ...,
``zero3_save_16bit_model``); ``hidden_size`` fills the bucket sizes. Only "auto" is filled,
as those integrations do (an absent key keeps DeepSpeed's default or derivation); with training
arguments, every explicit value that disagrees with them, and every absent one whose default
does, is collected, so one error lists every mismatch::

    cfg = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW",
           "params": {"lr": "auto"}}}
    missing, mismatches = fill_auto(cfg, Context(TrainingArgs(learning_rate=3e-4), world=8), verdicts)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from zerojax.config._keys import OPTIMIZERS
from zerojax.config._schema import Invalid, did_you_mean, integer
from zerojax.config._verdicts import Verdicts
from zerojax._errors import ConfigError

__all__ = ["FILLS", "Context", "Fill", "TrainingArgs", "args_value", "fill_auto", "fillable"]


@dataclasses.dataclass(frozen=True)
class TrainingArgs:
    """The Hugging Face ``TrainingArguments`` fields that fill DeepSpeed's "auto" values.

    Defaults are Hugging Face's. Any object with these attributes works in their place.
    ``max_steps=-1`` means unknown: "auto" total_num_steps then needs an explicit number.
    The next six are accelerate's DeepSpeed-plugin settings (None: not given); they fill
    "auto" in ``zero_optimization``. ``ddp_timeout`` (Hugging Face's, in seconds; None: not
    given) becomes ``ZeroConfig.step_timeout``, the step watchdog's deadline.
    """

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_steps: int = -1
    fp16: bool = False
    bf16: bool = False
    zero_stage: Optional[int] = None
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_nvme_path: Optional[str] = None
    zero3_save_16bit_model: Optional[bool] = None
    ddp_timeout: Optional[float] = None  # seconds; the step watchdog's deadline (None: DEEPSPEED_TIMEOUT or 1800)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainingArgs":
        """Build from a dict (e.g. parsed JSON); a misspelt name is a ConfigError."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(f'Unknown training argument "{key}". {did_you_mean(key, names)}')
        return cls(**values)


@dataclasses.dataclass
class Context:
    args: Any = None  # training_args, or None
    world: int = 1
    hidden: Optional[int] = None
    cfg: dict = dataclasses.field(default_factory=dict)  # the config being filled


class _Need(Exception):
    """The value that fills an "auto" key is not available; the argument says what to pass."""


def _arg(name):
    def get(ctx: Context):
        if ctx.args is None:
            raise _Need(f"no training_args were given: pass training_args with {name} "
                        "(e.g. TrainingArgs(...)) or write a value")
        if getattr(ctx.args, name, None) is None:
            raise _Need(f"training_args has no {name}: add it or write a value")
        return getattr(ctx.args, name)
    return get


def _train_batch(ctx: Context):
    if ctx.args is not None:
        return ctx.world * _arg("per_device_train_batch_size")(ctx) * _arg("gradient_accumulation_steps")(ctx)
    try:
        micro = integer(1)(ctx.cfg.get("train_micro_batch_size_per_gpu"))
        gas = integer(1)(ctx.cfg.get("gradient_accumulation_steps", 1))
    except Invalid:
        raise _Need("train_micro_batch_size_per_gpu / gradient_accumulation_steps are not numbers and no "
                    "training_args were given: pass training_args=TrainingArgs(per_device_train_batch_size=...)")
    return ctx.world * micro * gas


def _total_steps(ctx: Context):
    steps = _arg("max_steps")(ctx)
    if steps <= 0:
        raise _Need(f"training_args.max_steps={steps!r} does not give the number of training steps: "
                    "pass max_steps=N or write the number")
    return int(steps)


def _warmup(ctx: Context):
    steps, ratio = _arg("warmup_steps")(ctx), _arg("warmup_ratio")(ctx)
    if steps and steps > 0:
        return int(steps)
    return math.ceil(_total_steps(ctx) * ratio) if ratio and ratio > 0 else 0


def _hidden(fn):
    def get(ctx: Context):
        if ctx.hidden is None:
            raise _Need("no hidden_size was given: pass hidden_size=<the model's hidden size> or write a number")
        return fn(ctx.hidden)
    return get


@dataclasses.dataclass(frozen=True)
class Fill:
    """One key "auto" can stand for. ``get(ctx)`` gives its value or raises _Need;
    ``compare``: an explicit value must agree with it; ``fallback``: the value when the source
    is not given (DeepSpeed's default) instead of an error; ``stage3``: Hugging Face fills it
    only at ZeRO stage 3 (below, "auto" leaves DeepSpeed's default)."""

    path: str
    source: str
    get: Callable
    compare: bool = True
    fallback: Any = None
    stage3: bool = False


_HF, _Z = "training_args.", "zero_optimization"
FILLS = [
    Fill(f"{_Z}.stage", _HF + "zero_stage", _arg("zero_stage")),
    Fill("train_micro_batch_size_per_gpu", _HF + "per_device_train_batch_size", _arg("per_device_train_batch_size")),
    Fill("gradient_accumulation_steps", _HF + "gradient_accumulation_steps", _arg("gradient_accumulation_steps")),
    Fill("train_batch_size", "world_size*per_device_train_batch_size*gradient_accumulation_steps", _train_batch),
    Fill("gradient_clipping", _HF + "max_grad_norm", _arg("max_grad_norm")),
    Fill("optimizer.params.lr", _HF + "learning_rate", _arg("learning_rate")),
    Fill("optimizer.params.betas", "[adam_beta1, adam_beta2]",
         lambda c: [_arg("adam_beta1")(c), _arg("adam_beta2")(c)]),
    Fill("optimizer.params.eps", _HF + "adam_epsilon", _arg("adam_epsilon")),
    Fill("optimizer.params.weight_decay", _HF + "weight_decay", _arg("weight_decay")),
    Fill("scheduler.params.warmup_min_lr", "Hugging Face's constant", lambda c: 0.0, compare=False),
    Fill("scheduler.params.warmup_max_lr", _HF + "learning_rate", _arg("learning_rate")),
    Fill("scheduler.params.total_num_steps", _HF + "max_steps", _total_steps),
    Fill("scheduler.params.warmup_num_steps", _HF + "warmup_steps (or warmup_ratio*max_steps)", _warmup),
    Fill("fp16.enabled", _HF + "fp16", _arg("fp16")),
    Fill("bf16.enabled", _HF + "bf16", _arg("bf16")),
    Fill(f"{_Z}.reduce_bucket_size", "hidden_size**2", _hidden(lambda h: h * h), compare=False),
    *[Fill(f"{_Z}.{k}", "0.9*hidden_size**2", _hidden(lambda h: int(0.9 * h * h)), compare=False, stage3=True)
      for k in ("stage3_prefetch_bucket_size", "prefetch_bucket_size")],
    *[Fill(f"{_Z}.{k}", "10*hidden_size", _hidden(lambda h: 10 * h), compare=False, stage3=True)
      for k in ("stage3_param_persistence_threshold", "param_persistence_threshold")],
    *[Fill(f"{_Z}.{k}", _HF + "zero3_save_16bit_model", _arg("zero3_save_16bit_model"), fallback=False)
      for k in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save")],
    *[Fill(f"{_Z}.{block}.{key}", _HF + arg, _arg(arg))
      for block in ("offload_optimizer", "offload_param") for key, arg in
      (("device", f"{block}_device"), ("nvme_path", f"{block}_nvme_path"))],
]


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (not isinstance(a, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _node(cfg: dict, path: str):
    *parents, key = path.split(".")
    for p in parents:
        cfg = cfg.get(p) if isinstance(cfg, dict) else None
    return (cfg, key) if isinstance(cfg, dict) else (None, key)


def _absent_default(cfg: dict, path: str):
    """DeepSpeed's default for ``path`` when the key is absent but its block is present."""
    if path == "gradient_clipping":
        return 1.0
    if path in ("fp16.enabled", "bf16.enabled"):
        return False
    if path.startswith("optimizer.params.") and isinstance(cfg.get("optimizer"), dict):
        spec = OPTIMIZERS.get(str(cfg["optimizer"].get("type", "")).lower())
        key = path.rsplit(".", 1)[1]
        if spec and key in spec[1]:
            return spec[1][key].default
    return None


def _stage(cfg: dict):
    zo = cfg.get(_Z)
    stage = zo.get("stage", 0) if isinstance(zo, dict) else 0
    try:
        return integer(0, 3)(stage)
    except Invalid:
        return None


def fill_auto(cfg: dict, ctx: Context, v: Verdicts) -> tuple[list, list]:
    """Replace "auto" in ``cfg`` in place; return ((path, message) for each "auto" whose source
    is missing, mismatches with training_args).
    An "auto" that cannot be filled is removed, so the readers see DeepSpeed's default."""
    missing, mismatches = [], []
    if isinstance(cfg.get("optimizer"), dict):  # absent params still have DeepSpeed's defaults
        cfg["optimizer"].setdefault("params", {})
    for fill in FILLS:
        block, key = _node(cfg, fill.path)
        if block is None:
            head = fill.path.split(".")[0]
            if ctx.args is not None and head in ("fp16", "bf16") and getattr(ctx.args, head, False):
                mismatches.append(f'{head} block is absent (off) but {fill.source}=True; '
                                  f'add "{head}": {{"enabled": "auto"}}')
            continue
        if block.get(key) == "auto":
            if fill.stage3 and _stage(cfg) != 3:
                del block[key]
                v.ignore(fill.path, '"auto" below ZeRO stage 3: left at DeepSpeed\'s default, as Hugging Face does')
                continue
            try:
                block[key] = fill.get(ctx)
            except _Need as need:
                if fill.fallback is not None:
                    block[key] = fill.fallback
                    v.honour(fill.path, f'"auto": {fill.source} not given, DeepSpeed\'s default {fill.fallback!r}')
                    continue
                del block[key]
                missing.append((fill.path, f'{fill.path} is "auto" but {need}'))
                continue
            v.honour(fill.path, f'"auto": filled from {fill.source} = {block[key]!r}')
            continue
        if not fill.compare or ctx.args is None:
            continue
        value = block[key] if key in block else _absent_default(cfg, fill.path)
        if value is None:
            continue
        try:
            wanted = fill.get(ctx)
        except _Need:
            continue
        if not _same(value, wanted):
            absent = "" if key in block else " (absent: DeepSpeed's default)"
            mismatches.append(f"{fill.path}={value!r}{absent} but {fill.source}={wanted!r}")
    return missing, mismatches


def args_value(path: str, ctx: Context) -> tuple:
    """(the value the training arguments give for ``path``, where it comes from); the value is
    None when they do not give one."""
    fill = next(f for f in FILLS if f.path == path)
    try:
        return fill.get(ctx), fill.source
    except _Need:
        return None, fill.source


def fillable() -> str:
    return ", ".join(sorted({f.path for f in FILLS}))
