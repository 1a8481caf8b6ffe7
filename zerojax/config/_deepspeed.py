"""Read a DeepSpeed JSON config into a ZeroConfig, the way DeepSpeed 0.19.8 and its Hugging
Face integrations read it.

    config = ZeroConfig.from_deepspeed("ds_config.json", training_args=TrainingArgs(bf16=True),
                                       world_size=8, hidden_size=4096)
    tx = optimizer_from_config(config)

Rules (DeepSpeed's unless said otherwise):

* ``"auto"`` is filled from ``training_args`` (Hugging Face names, plus accelerate's plugin
  names for the ZeRO keys) and ``hidden_size``, as the Trainer and accelerate do (see
  :mod:`zerojax.config._auto`); an "auto" whose source is missing is an error naming the key
  and what to pass. Every explicit value that disagrees with the training arguments is
  collected into one error;
  zerojax goes one step further than Hugging Face and also reports a key left absent whose
  DeepSpeed default disagrees with them.
* Batch keys: any two of train_batch_size, train_micro_batch_size_per_gpu and
  gradient_accumulation_steps give the third (floor division), then the product is checked.
* ``gradient_clipping`` absent means 1.0 (DeepSpeed's default); ``ZeroConfig``'s own default
  is 0.0 (off), so ``ZeroConfig()`` and ``from_deepspeed({...})`` differ there on purpose.
* Top-level keys DeepSpeed does not know are warned (DeepSpeed ignores them), with a "did you
  mean" hint for a near-miss; keys starting with "_" are comments. Unknown keys inside a
  block are errors with a hint. Keys DeepSpeed removed are errors saying so.
* Deprecated spellings are read as DeepSpeed reads them, with a DeprecatedKeyWarning naming the
  new key. Stage-3-only keys below stage 3 are warned and dropped, as DeepSpeed ignores them.
* Keys zerojax has no mechanism for are accepted; those not at DeepSpeed's default are listed
  in one :class:`IgnoredKeysWarning`. Every problem of a file is reported in one ConfigError.

:func:`read_deepspeed` gives the verdict on every key (``zerojax config check`` prints them);
the key tables are in :mod:`zerojax.config._keys`, the block readers in
:mod:`zerojax.config._checks`, the fields and their rules in :mod:`zerojax.config._schema`.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Iterator, NamedTuple, Optional

import jax

from zerojax.config._schedules import resolve_scheduler
from zerojax.config._auto import Context, args_value, fill_auto, fillable
from zerojax.config._auto import TrainingArgs as TrainingArgs
from zerojax.config._checks import (activation_checkpointing_block, low_precision_rules, precision_fields, read_block, read_optimizer, read_top,
                                   tensor_parallel_fields, upgrade_deprecated, zero_fields)
from zerojax.config._keys import BF16, FP16, OFFLOAD_OPTIMIZER, OFFLOAD_PARAM, TOP, ZERO
from zerojax.config._optimizers import optimizer_from_config as optimizer_from_config
from zerojax.config._verdicts import Verdicts
from zerojax._errors import ConfigError, DeprecatedKeyWarning, IgnoredKeysWarning

__all__ = ["IgnoredKeysWarning", "KeyVerdict", "TrainingArgs", "deepspeed_fields", "key_report",
           "optimizer_from_config", "read_deepspeed", "resolve_batch"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


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


# --------------------------------------------------------------------------- reading
class _DuplicateKey(Exception):
    """A key given twice in one JSON object; ``path`` is its dotted path."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


def _refuse_duplicates(pairs: list) -> dict:
    """``object_pairs_hook`` that refuses a key given twice in one object, as DeepSpeed does.

    Inner objects are built first, so a duplicate deeper down has already raised with its own
    key; the dotted path is completed on the way out by :func:`_parse`."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _dotted_path(text: str, key: str) -> str:
    """The dotted path of the first object in ``text`` that holds ``key`` twice (the keys of the
    enclosing objects, list indices as numbers), found by re-reading the text as key/value pairs."""
    decoder = json.JSONDecoder(object_pairs_hook=lambda pairs: pairs)
    path: list[str] = []

    def walk(node, prefix):
        if isinstance(node, list) and all(isinstance(p, tuple) and len(p) == 2 for p in node):
            seen = set()
            for k, v in node:
                if k in seen and k == key:
                    path.extend(prefix + [k])
                    return True
                seen.add(k)
                if walk(v, prefix + [k]):
                    return True
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if walk(v, prefix + [str(i)]):
                    return True
        return False

    try:
        walk(decoder.decode(text), [])
    except ValueError:
        pass
    return ".".join(path) or key


def _parse(text: str, where: str) -> dict:
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as e:
        raise ConfigError(f"Duplicate keys in DeepSpeed config {where}: {_dotted_path(text, e.path)!r} is given "
                          "twice in the same object; DeepSpeed refuses such a file. Fix: keep one of the two "
                          "entries") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None


def _load(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        raw, where = copy.deepcopy(path_or_dict), "the config dict"
    else:
        where = os.fspath(path_or_dict)
        try:
            with open(where, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read DeepSpeed config {where!r}: {e}") from None
        try:
            text = data.decode("utf-8-sig")  # a byte-order mark is tolerated, as json.load does
        except UnicodeDecodeError as e:
            raise ConfigError(f"DeepSpeed config {where!r} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                              f"{e.start} cannot be decoded ({e.reason}). Fix: save the file as UTF-8 (for example "
                              f"`iconv -f latin1 -t utf-8`)") from None
        raw, where = _parse(text, repr(where)), repr(where)
    if not isinstance(raw, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object, {where} holds a {type(raw).__name__}")
    return raw


def _check_int_arg(name, value, lo=1):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
        raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= {lo}")


_AUTO_TABLES = {"": TOP, "fp16": FP16, "bf16": BF16, "zero_optimization": ZERO,
                "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER,
                "zero_optimization.offload_param": OFFLOAD_PARAM}


def _leftover_auto(node: dict, path: str, v: Verdicts) -> None:
    """An "auto" nothing filled, in a key zerojax reads: refused, and removed so the readers go
    on with DeepSpeed's default (in a key zerojax ignores, "auto" is DeepSpeed's default)."""
    table = _AUTO_TABLES.get(path)
    for key in list(node):
        sub = f"{path}.{key}" if path else key
        value, entry = node[key], (table or {}).get(key)
        if sub == "zero_optimization.zenflow":
            continue  # zenflow's "auto" values are its own settings
        if table is not None and not isinstance(value, dict) and (entry is None or not entry.honoured):
            continue  # unknown or ignored keys: the readers give their verdicts
        if isinstance(value, dict):
            _leftover_auto(value, sub, v)
        elif value == "auto":
            del node[key]
            v.refuse(sub, f'{sub} is "auto", but "auto" can only be filled for: {fillable()}. '
                          f"Fix: write a value for {sub}")


def read_deepspeed(path_or_dict, training_args=None, world_size: Optional[int] = None,
                   hidden_size: Optional[int] = None) -> tuple[dict, Verdicts]:
    """ZeroConfig's fields from a DeepSpeed config, and the verdict on each of its keys.

    Never raises for a problem in the file (only for one it cannot read): refusals are
    verdicts, and the fields then hold DeepSpeed's defaults in their place."""
    world = jax.device_count() if world_size is None else world_size
    _check_int_arg("world_size", world)
    _check_int_arg("hidden_size", hidden_size)
    cfg, v = _load(path_or_dict), Verdicts()
    if "bfloat16" in cfg:  # DeepSpeed's older spelling of bf16
        if "bf16" in cfg:
            v.refuse("bfloat16", "bfloat16 and bf16 are both given; they are the same block. Fix: keep bf16")
            del cfg["bfloat16"]
        else:
            v.honour("bfloat16", "DeepSpeed's older spelling of bf16")
            cfg["bf16"] = cfg.pop("bfloat16")
    upgrade_deprecated(cfg, v)
    read_top(cfg, v)
    tp = tensor_parallel_fields(cfg.get("tensor_parallel"), v)
    sp = read_block({k: cfg[k] for k in ("sequence_parallel_size",) if k in cfg}, TOP, "", v)
    sp = sp.get("sequence_parallel_size", 1) if isinstance(sp.get("sequence_parallel_size", 1), int) else 1
    if world_size is None:  # DeepSpeed's data-parallel size is world / (autotp_size * sequence_parallel_size)
        if world % tp["autotp_size"]:
            v.refuse("tensor_parallel.autotp_size", f"tensor_parallel.autotp_size={tp['autotp_size']} does not "
                     f"divide the {world} devices. Fix: use a divisor of {world}")
        elif world % (tp["autotp_size"] * sp):
            v.refuse("sequence_parallel_size", f"sequence_parallel_size={sp} does not divide the "
                     f"{world // tp['autotp_size']} devices left by tensor_parallel.autotp_size={tp['autotp_size']}"
                     f" (world {world}). Fix: use a divisor of {world // tp['autotp_size']}")
        world = max(1, world // (tp["autotp_size"] * sp))
    missing, mismatches = fill_auto(cfg, Context(training_args, world, hidden_size, cfg), v)
    for path, message in missing:
        v.refuse(path, message)
    _leftover_auto(cfg, "", v)
    fields, paths = zero_fields(cfg.get("zero_optimization", {}), v)
    fields.update(tp)
    fields["sequence_parallel_size"] = sp
    comm = read_block({k: cfg[k] for k in ("seq_parallel_communication_data_type",) if k in cfg}, TOP, "", v)
    fields["seq_parallel_comm_dtype"] = comm.get("seq_parallel_communication_data_type", "fp32")
    precision, precision_paths = precision_fields(cfg, v)
    fields.update(precision)
    low_precision_rules(fields, {**paths, **precision_paths}, v)
    top = read_block({k: cfg[k] for k in ("gradient_clipping", *BATCH_KEYS) if k in cfg}, TOP, "", v)
    fields["gradient_clipping"] = top.get("gradient_clipping", 1.0)
    fields["activation_checkpointing"] = None  # absent (or null): zj.remat(..., when_configured=True) stays off
    if cfg.get("activation_checkpointing") is not None:
        fields["activation_checkpointing"] = activation_checkpointing_block(
            cfg["activation_checkpointing"], verdicts=v, autotp_size=tp["autotp_size"])
        v.honour("activation_checkpointing", "-> ZeroConfig.activation_checkpointing (read by zj.remat)")
    optimizer = read_optimizer(cfg["optimizer"], v) if cfg.get("optimizer") is not None else None
    scheduler = None
    if cfg.get("scheduler") is not None:
        try:
            scheduler = resolve_scheduler(cfg["scheduler"], optimizer["params"]["lr"] if optimizer else 1e-3)
            v.honour("scheduler", f"-> ZeroConfig.scheduler ({scheduler['type']})")
        except ConfigError as e:
            v.refuse("scheduler", str(e))
    batch = (None, None, 1)
    if not any(v.refused_under(k) for k in BATCH_KEYS):
        try:
            batch = resolve_batch(*(top.get(k) for k in BATCH_KEYS), world)
        except ConfigError as e:
            if not mismatches:  # the disagreement with training_args is the more useful message
                v.refuse(next((k for k in BATCH_KEYS if k in cfg), "train_batch_size"), str(e))
    if training_args is not None and not any(v.refused_under(k) for k in BATCH_KEYS):
        for key, value in zip(BATCH_KEYS, batch):
            if key in cfg or value is None:
                continue
            wanted, source = args_value(key, Context(training_args, world, hidden_size, cfg))
            if wanted is not None and value != wanted:
                mismatches.append(f"{key}={value} (absent: derived by the batch rule) but {source}={wanted}")
    if mismatches:
        v.refuse("training_args", "The DeepSpeed config disagrees with the training arguments:\n  - "
                 + "\n  - ".join(mismatches) + "\nFix: set these keys to \"auto\" (add them if absent) so they "
                 "are filled from the training arguments, or change the training arguments")
    fields.update(zip(BATCH_KEYS, batch))
    return dict(fields, optimizer=optimizer, scheduler=scheduler), v


def deepspeed_fields(path_or_dict, training_args=None, world_size: Optional[int] = None,
                     hidden_size: Optional[int] = None) -> dict:
    """Read a DeepSpeed JSON config (a path or a dict) into ZeroConfig's fields
    (``ZeroConfig.from_deepspeed`` builds the config from them).

    ``training_args`` (a :class:`TrainingArgs` or any object with those attributes) fills
    "auto" and is checked against explicit values; ``world_size`` is the data-parallel size
    (default ``jax.device_count()`` divided by ``tensor_parallel.autotp_size``); ``hidden_size``
    fills the bucket sizes set to "auto".
    Raises one ConfigError naming every refused key; warns (IgnoredKeysWarning, once, naming
    each key) about accepted-but-ignored keys and (DeprecatedKeyWarning) about deprecated ones.

    An absent ``gradient_clipping`` is DeepSpeed's default 1.0 here (``ZeroConfig``'s own
    default is 0.0, off); write ``"gradient_clipping": 0`` to disable clipping.
    """
    fields, v = read_deepspeed(path_or_dict, training_args, world_size, hidden_size)
    timeout = getattr(training_args, "ddp_timeout", None)  # Hugging Face's collective timeout, in seconds
    if timeout is not None:
        fields["step_timeout"] = timeout
    for message in v.deprecated:
        warnings.warn(message, DeprecatedKeyWarning, stacklevel=3)
    v.raise_refused()
    if v.warned:
        warnings.warn("zerojax accepts but ignores these DeepSpeed settings:\n  - "
                      + "\n  - ".join(r.why for r in v.warned), IgnoredKeysWarning, stacklevel=3)
    return fields


# --------------------------------------------------------------------------- the per-key report
def _leaves(node, path="") -> Iterator[tuple[str, object]]:
    for key, value in node.items():
        sub = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict) and value:
            yield from _leaves(value, sub)
        else:
            yield sub, value


class KeyVerdict(NamedTuple):
    path: str  # the key's path, e.g. "zero_optimization.offload_optimizer.device"
    value: object  # its value in the file (None for a row about a key the file leaves out)
    kind: str  # "honoured", "ignored" (no difference), "warned-ignored" or "refused"
    why: str
    in_file: bool


def key_report(path_or_dict, training_args=None, world_size: Optional[int] = None,
               hidden_size: Optional[int] = None) -> list[KeyVerdict]:
    """The verdict on every key of the file, in file order (a key inherits the verdict of its
    block where it has none of its own), then what the reader decided about keys the file
    leaves out (a batch key derived, a disagreement with training_args). Raises ConfigError
    only for a file it cannot read."""
    raw = _load(path_or_dict)
    _, v = read_deepspeed(raw, training_args, world_size, hidden_size)
    rows, shown, leaves = [], set(), list(_leaves(raw))
    for path, value in leaves:
        found = v.for_key(path)
        shown.update(id(r) for r in found)
        if not found:
            rows.append(KeyVerdict(path, value, "ignored", "not read by zerojax", True))
            continue
        whys = sorted(dict.fromkeys(r.why for r in found), key=lambda w: not w.startswith("->"))
        rows.append(KeyVerdict(path, value, found[0].kind, "; ".join(whys), True))
    for r in v:  # what the file leaves out: worth a row when it is not simply honoured
        inside = any(p == r.path or p.startswith(r.path + ".") for p, _ in leaves)
        if id(r) not in shown and not inside and r.kind != "honoured":
            rows.append(KeyVerdict(r.path, None, r.kind, r.why, False))
    return rows
