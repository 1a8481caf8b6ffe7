"""Read a DeepSpeed JSON config into a ZeroConfig, the way DeepSpeed and its Hugging Face
integration read it.

    config = ZeroConfig.from_deepspeed("ds_config.json", training_args=TrainingArgs(bf16=True),
                                       world_size=8, hidden_size=4096)
    tx = optimizer_from_config(config)

Rules (DeepSpeed's unless said otherwise):

* ``"auto"`` is filled from ``training_args`` (Hugging Face names) and ``hidden_size``; an
  "auto" whose source is missing is an error naming the key and what to pass. Every explicit
  value that disagrees with the training arguments is collected and reported in one error.
  zerojax goes one step further than Hugging Face: a key left *absent* whose DeepSpeed default
  (or derived batch value) disagrees with the training arguments is reported too.
* Batch keys: any two of train_batch_size, train_micro_batch_size_per_gpu and
  gradient_accumulation_steps give the third (floor division), then the product is checked.
* ``gradient_clipping`` absent means 1.0 (DeepSpeed's default); ``ZeroConfig``'s own default
  is 0.0 (off), so ``ZeroConfig()`` and ``from_deepspeed({...})`` differ there on purpose.
* A misspelt key anywhere is an error with a "did you mean" hint. Keys DeepSpeed knows but
  zerojax has no mechanism for are accepted; those set to a non-default value are listed in one
  :class:`IgnoredKeysWarning` (a default value changes nothing, so it is not reported).

This module holds the entry points, "auto" filling and the batch rule; the key tables and
block readers are in ``zerojax.config.checks``, the optax optimizers in ``zerojax.config.optimizers``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import warnings
from typing import Optional

import jax

from zerojax.config import schedules
from zerojax.config.checks import (_ON_OFF, _OPTIMIZERS, _TOP_HANDLED, _TOP_IGNORED, _did_you_mean, _int, _Invalid, _num, _optimizer_block, _precision_fields, _value, _zero_fields)
from zerojax.config.optimizers import optimizer_from_config as optimizer_from_config
from zerojax.errors import ConfigError, IgnoredKeysWarning

__all__ = ["IgnoredKeysWarning", "TrainingArgs", "deepspeed_fields", "optimizer_from_config",
           "resolve_batch"]


@dataclasses.dataclass(frozen=True)
class TrainingArgs:
    """The Hugging Face ``TrainingArguments`` fields that fill DeepSpeed's "auto" values.

    Defaults are Hugging Face's. Any object with these attributes works in their place.
    ``max_steps=-1`` means unknown: "auto" total_num_steps then needs an explicit number.
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

    @classmethod
    def from_dict(cls, values: dict) -> "TrainingArgs":
        """Build from a dict (e.g. parsed JSON); a misspelt name is a ConfigError."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(f'Unknown training argument "{key}". {_did_you_mean(key, names)}')
        return cls(**values)


# --------------------------------------------------------------------------- "auto"
class _Need(Exception):
    """The value that fills an "auto" key is not available; the argument says what to pass."""


def _arg(name):
    def get(ctx):
        if ctx["args"] is None:
            raise _Need(f"no training_args were given: pass training_args with {name} "
                        "(e.g. TrainingArgs(...)) or write a value")
        if not hasattr(ctx["args"], name):
            raise _Need(f"training_args has no attribute {name}: add it or write a value")
        return getattr(ctx["args"], name)
    return get


def _train_batch(ctx):
    if ctx["args"] is not None:
        return ctx["world"] * _arg("per_device_train_batch_size")(ctx) * _arg("gradient_accumulation_steps")(ctx)
    try:
        micro = _int(1)(ctx["cfg"].get("train_micro_batch_size_per_gpu"))
        gas = _int(1)(ctx["cfg"].get("gradient_accumulation_steps", 1))
    except _Invalid:
        raise _Need("train_micro_batch_size_per_gpu / gradient_accumulation_steps are not numbers and no "
                    "training_args were given: pass training_args=TrainingArgs(per_device_train_batch_size=...)")
    return ctx["world"] * micro * gas


def _total_steps(ctx):
    steps = _arg("max_steps")(ctx)
    if steps is None or steps <= 0:
        raise _Need(f"training_args.max_steps={steps!r} does not give the number of training steps: "
                    "pass max_steps=N or write the number")
    return int(steps)


def _warmup(ctx):
    steps, ratio = _arg("warmup_steps")(ctx), _arg("warmup_ratio")(ctx)
    if steps and steps > 0:
        return int(steps)
    return math.ceil(_total_steps(ctx) * ratio) if ratio and ratio > 0 else 0


def _hidden(fn):
    def get(ctx):
        if ctx["hidden"] is None:
            raise _Need("no hidden_size was given: pass hidden_size=<the model's hidden size> "
                        "or write a number")
        return fn(ctx["hidden"])
    return get


_HF = "training_args."
_FILLS = [  # (path, source, getter, compare with explicit values)
    ("train_micro_batch_size_per_gpu", _HF + "per_device_train_batch_size", _arg("per_device_train_batch_size"), True),
    ("gradient_accumulation_steps", _HF + "gradient_accumulation_steps", _arg("gradient_accumulation_steps"), True),
    ("train_batch_size", "world_size*per_device_train_batch_size*gradient_accumulation_steps", _train_batch, True),
    ("gradient_clipping", _HF + "max_grad_norm", _arg("max_grad_norm"), True),
    ("optimizer.params.lr", _HF + "learning_rate", _arg("learning_rate"), True),
    ("optimizer.params.betas", "[adam_beta1, adam_beta2]",
     lambda c: [_arg("adam_beta1")(c), _arg("adam_beta2")(c)], True),
    ("optimizer.params.eps", _HF + "adam_epsilon", _arg("adam_epsilon"), True),
    ("optimizer.params.weight_decay", _HF + "weight_decay", _arg("weight_decay"), True),
    ("scheduler.params.warmup_min_lr", "0", lambda c: 0.0, False),
    ("scheduler.params.warmup_max_lr", _HF + "learning_rate", _arg("learning_rate"), True),
    ("scheduler.params.total_num_steps", _HF + "max_steps", _total_steps, True),
    ("scheduler.params.warmup_num_steps", _HF + "warmup_steps (or warmup_ratio*max_steps)", _warmup, True),
    ("fp16.enabled", _HF + "fp16", _arg("fp16"), True),
    ("bf16.enabled", _HF + "bf16", _arg("bf16"), True),
    ("zero_optimization.reduce_bucket_size", "hidden_size**2", _hidden(lambda h: h * h), False),
    *[(f"zero_optimization.{k}", "0.9*hidden_size**2", _hidden(lambda h: int(0.9 * h * h)), False)
      for k in ("stage3_prefetch_bucket_size", "prefetch_bucket_size")],
    *[(f"zero_optimization.{k}", "10*hidden_size", _hidden(lambda h: 10 * h), False)
      for k in ("stage3_param_persistence_threshold", "param_persistence_threshold")],
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
        spec = _OPTIMIZERS.get(str(cfg["optimizer"].get("type", "")).lower())
        key = path.rsplit(".", 1)[1]
        if spec and key in spec[1]:
            return spec[1][key][0]
    return None


def _fill_auto(cfg: dict, ctx: dict) -> tuple[list, list]:
    """Replace "auto" in place; return (missing-source errors, mismatches with training_args)."""
    missing, mismatches = [], []
    if isinstance(cfg.get("optimizer"), dict):  # absent params still have DeepSpeed's defaults
        cfg["optimizer"].setdefault("params", {})
    for path, source, get, compare in _FILLS:
        block, key = _node(cfg, path)
        if block is None:
            if ctx["args"] is not None and path.split(".")[0] in ("fp16", "bf16") and \
                    getattr(ctx["args"], path.split(".")[0], False):
                mismatches.append(f'{path.split(".")[0]} block is absent (off) but {source}=True; '
                                  f'add "{path.split(".")[0]}": {{"enabled": "auto"}}')
            continue
        if block.get(key) == "auto":
            try:
                block[key] = get(ctx)
            except _Need as need:
                missing.append(f'{path} is "auto" but {need}')
            continue
        if not compare or ctx["args"] is None:
            continue
        value = block[key] if key in block else _absent_default(cfg, path)
        if value is None:
            continue
        try:
            wanted = get(ctx)
        except _Need:
            continue
        if not _same(value, wanted):
            absent = "" if key in block else " (absent: DeepSpeed's default)"
            mismatches.append(f"{path}={value!r}{absent} but {source}={wanted!r}")
    return missing, mismatches


def _reject_leftover_auto(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}.{key}" if path else key
            if sub != "zero_optimization.zenflow":  # zenflow's "auto" values are its own settings
                _reject_leftover_auto(value, sub)
    elif node == "auto":
        fillable = ", ".join(sorted({p for p, *_ in _FILLS}))
        raise ConfigError(f'{path} is "auto", but "auto" can only be filled for: {fillable}. '
                          f"Fix: write a value for {path}")


# --------------------------------------------------------------------------- batch
def resolve_batch(train_batch_size, micro_batch, grad_acc, world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's batch rule: returns (train_batch_size, micro batch per device, grad-acc steps).

    Any two of the three give the third by floor division; train_batch_size alone gives
    grad_acc 1; the micro batch alone gives grad_acc 1. Then tb == micro * grad_acc * world.
    """
    given = {"train_batch_size": train_batch_size, "train_micro_batch_size_per_gpu": micro_batch,
             "gradient_accumulation_steps": grad_acc}
    for key, value in given.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value!r} is invalid: it has to be greater than 0. Fix: use a positive integer")
    tb, mb, ga, w = train_batch_size, micro_batch, grad_acc, world_size
    if tb is not None and mb is not None and ga is None:
        ga = tb // mb // w
    elif tb is not None and ga is not None and mb is None:
        mb = tb // w // ga
    elif mb is not None and ga is not None and tb is None:
        tb = mb * ga * w
    elif tb is not None and mb is None and ga is None:
        ga, mb = 1, tb // w
    elif mb is not None and tb is None and ga is None:
        tb, ga = mb * w, 1
    elif tb is None and mb is None:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided. "
                          'Fix: add "train_micro_batch_size_per_gpu": "auto" (filled from training_args) '
                          "or a number")
    for key, value, text in (("train_batch_size", tb, "Train batch size"),
                             ("train_micro_batch_size_per_gpu", mb, "Micro batch size per gpu"),
                             ("gradient_accumulation_steps", ga, "Gradient accumulation steps")):
        if value <= 0:
            raise ConfigError(f"{key}={value} (derived with floor division at world_size {w}): {text}: {value} "
                              "has to be greater than 0. Fix: make train_batch_size at least "
                              "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size")
    if tb != mb * ga * w:
        raise ConfigError("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
                          f"* gradient_acc_step * world_size {tb} != {mb} * {ga} * {w}. Fix: set one of "
                          "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps "
                          'to "auto" or remove it so it is derived')
    return tb, mb, ga


def _batch_value(cfg, key):
    if key not in cfg:
        return None
    try:
        return _int()(cfg[key])
    except _Invalid:
        raise ConfigError(f"{key}={cfg[key]!r} is invalid: expected a positive integer. "
                          f'Fix: write a number or "auto"') from None


# --------------------------------------------------------------------------- entry points
def _load(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        raw = copy.deepcopy(path_or_dict)
    else:
        try:
            with open(os.fspath(path_or_dict)) as f:
                raw = json.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read DeepSpeed config {path_or_dict!r}: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path_or_dict}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object, got {type(raw).__name__}")
    if "bfloat16" in raw:  # DeepSpeed's older spelling of bf16
        if "bf16" in raw:
            raise ConfigError("bfloat16 and bf16 are both given; they are the same block. Fix: keep bf16")
        raw["bf16"] = raw.pop("bfloat16")
    return raw


def _check_top(raw: dict, ignored: list) -> None:
    known = [*_TOP_HANDLED, *_TOP_IGNORED]
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f'Unknown key "{key}". {_did_you_mean(key, known)}')
        default = _TOP_IGNORED.get(key, value)
        if default is _ON_OFF:
            off = value in ({}, None, False) or (isinstance(value, dict) and value.get("enabled") is False)
            if not off:
                ignored.append(f"{key}={value!r}")
        elif value != default:
            ignored.append(f"{key}={value!r}")


def _check_int_arg(name, value, lo=1):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= {lo}")


def deepspeed_fields(path_or_dict, training_args=None, world_size: Optional[int] = None,
                     hidden_size: Optional[int] = None) -> dict:
    """Read a DeepSpeed JSON config (a path or a dict) into ZeroConfig's fields
    (``ZeroConfig.from_deepspeed`` builds the config from them).

    ``training_args`` (a :class:`TrainingArgs` or any object with those attributes) fills
    "auto" and is checked against explicit values; ``world_size`` is the data-parallel size
    (default ``jax.device_count()``); ``hidden_size`` fills the bucket sizes set to "auto".
    Raises ConfigError naming the key; warns (IgnoredKeysWarning) about accepted-but-ignored keys.

    An absent ``gradient_clipping`` is DeepSpeed's default 1.0 here (``ZeroConfig``'s own
    default is 0.0, off); write ``"gradient_clipping": 0`` to disable clipping.
    """
    world = jax.device_count() if world_size is None else world_size
    _check_int_arg("world_size", world)
    _check_int_arg("hidden_size", hidden_size)
    raw, ignored = _load(path_or_dict), []
    _check_top(raw, ignored)
    cfg = copy.deepcopy(raw)
    missing, mismatches = _fill_auto(cfg, {"args": training_args, "world": world, "hidden": hidden_size,
                                           "cfg": cfg})
    if missing:
        raise ConfigError("Cannot fill these \"auto\" values:\n  - " + "\n  - ".join(missing))
    _reject_leftover_auto(cfg)
    fields = _zero_fields(cfg.get("zero_optimization", {}), ignored)
    fields.update(_precision_fields(cfg, ignored))
    fields["gradient_clipping"] = _value("gradient_clipping", cfg.get("gradient_clipping", 1.0), _num(0), 1.0)
    optimizer = _optimizer_block(cfg["optimizer"], ignored) if cfg.get("optimizer") is not None else None
    base_lr = optimizer["params"]["lr"] if optimizer else 1e-3
    scheduler = schedules.resolve_scheduler(cfg["scheduler"], base_lr) if cfg.get("scheduler") is not None else None
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    try:
        batch = resolve_batch(*(_batch_value(cfg, k) for k in keys), world)
    except ConfigError:
        if mismatches:  # the disagreement with training_args is the more useful message
            batch = None
        else:
            raise
    if batch is not None and training_args is not None:
        fills = {path: (source, get) for path, source, get, _ in _FILLS}
        for key, value in zip(keys, batch):
            source, get = fills[key]
            if key not in raw:
                wanted = get({"args": training_args, "world": world, "hidden": hidden_size, "cfg": cfg})
                if value != wanted:
                    mismatches.append(f"{key}={value} (absent: derived by the batch rule) but {source}={wanted}")
    if mismatches:
        raise ConfigError("The DeepSpeed config disagrees with the training arguments:\n  - "
                          + "\n  - ".join(mismatches) + "\nFix: set these keys to \"auto\" (add them if absent) "
                          "so they are filled from the training arguments, or change the training arguments")
    if ignored:
        warnings.warn("zerojax accepts but ignores these DeepSpeed settings (no equivalent mechanism): "
                      + ", ".join(ignored), IgnoredKeysWarning, stacklevel=3)
    fields.update(zip(keys, batch))
    return dict(fields, optimizer=optimizer, scheduler=scheduler)
