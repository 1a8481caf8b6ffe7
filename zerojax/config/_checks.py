"""Reading DeepSpeed JSON blocks by the key tables of :mod:`zerojax.config._keys`.

Each reader records a verdict for every key it meets (honoured, ignored, warned or refused,
see :mod:`zerojax.config._verdicts`) and goes on after a refusal with DeepSpeed's default, so
one read reports every problem of a file::

    v = Verdicts()
    fields, paths = zero_fields({"stage": 2, "stagee": 1}, v)
    v.refused[0].why    # 'Unknown key "zero_optimization.stagee". Did you mean "stage"?'
"""
from __future__ import annotations

from typing import Optional

from zerojax.config._keys import (ACTIVATION_CHECKPOINTING, BF16, DEPRECATED_ZERO, FP16, MONITORS, OFFLOAD_OPTIMIZER, OFFLOAD_PARAM, OPTIMIZERS,
                                 REFUSED_OPTIMIZERS, TENSOR_PARALLEL, TOP, ZENFLOW, ZERO, ZERO_BLOCKS, Key)
from zerojax.config._schema import (FIELDS, LOW_PRECISION, Invalid, broken_rules, did_you_mean, invalid_message,
                                   precision_message, rule_message, typo_of)
from zerojax.config._verdicts import Verdicts

__all__ = ["activation_checkpointing_block", "optimizer_block", "precision_fields", "read_block", "read_monitors", "read_optimizer", "read_top",
           "tensor_parallel_fields", "upgrade_deprecated", "zenflow_block", "zero_fields"]

_DEFAULT_OK = "DeepSpeed's default; zerojax behaves the same"
_BLOCKS = ("zero_optimization", "fp16", "bf16")  # the optimizer and scheduler readers give their own
_DS_IGNORES = " DeepSpeed ignores it there, and so does zerojax."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _bad_value(full: str, value, entry: Key, expected: str) -> str:
    if entry.field in FIELDS and entry.check is FIELDS[entry.field].check:
        return invalid_message(entry.field, value, expected, full)
    return f"{full}={value!r} is invalid: expected {expected}. Fix: write a value like the default, {entry.default!r}"


def _stage3_message(full: str, value, stage: int) -> str:
    """The stage-3-only rule (see schema's ``_stage3_tuning``) for a key that sets no field."""
    return (f"{full}={value!r} only applies at ZeRO stage 3 (zero_optimization.stage is {stage})."
            f"{_DS_IGNORES} Fix: remove it, or set stage 3")


def read_block(block, table: dict, path: str, v: Verdicts, stage: Optional[int] = None, skip=()) -> dict:
    """The keys of ``block`` that passed their checks, {key: value}; a verdict for each key
    (unknown keys and bad values refused, with a hint; ignored keys warned when not at
    DeepSpeed's default; ``stage``, when known, decides the stage-3-only keys). Keys in
    ``skip`` are left to the caller."""
    if not isinstance(block, dict):
        v.refuse(path, f"{path}={block!r} is invalid: expected a JSON object. Fix: write {path} as {{...}}")
        return {}
    given = {}
    for key, value in block.items():
        if key in skip:
            continue
        full, entry = _join(path, key), table.get(key)
        if entry is None:
            v.refuse(full, f'Unknown key "{full}". {did_you_mean(key, [*table, *skip])}')
            continue
        if entry.removed:
            v.refuse(full, f"{full}: {entry.why}")
            continue
        if value == "auto" and not entry.honoured:
            v.ignore(full, '"auto" in a key zerojax does not read: DeepSpeed\'s default, as DeepSpeed drops it')
            continue
        if entry.check is not None:
            try:
                value = entry.check(value)
            except Invalid as e:
                v.refuse(full, _bad_value(full, value, entry, str(e)))
                continue
        if entry.subkeys and isinstance(value, dict):
            for odd in (k for k in value if k not in entry.subkeys):
                v.refuse(f"{full}.{odd}", f'Unknown key "{full}.{odd}" (DeepSpeed refuses it). '
                         f"{did_you_mean(odd, entry.subkeys)}")
        given[key] = value
        if entry.honoured:
            v.honour(full, f"-> ZeroConfig.{entry.field}" if entry.field in FIELDS else f"read by {entry.field}")
        elif entry.at_default(value):
            v.honour(full, _DEFAULT_OK)
        elif entry.refused:
            v.refuse(full, f"{full}={value!r} is not supported: {entry.why}")
        elif entry.stage3 and stage is not None and stage != 3:
            v.warn(full, _stage3_message(full, value, stage))
        else:
            v.warn(full, f"{full}={value!r}: {entry.why}")
    return given


def fields_of(given: dict, path: str, v: Verdicts) -> tuple[dict, dict, set]:
    """The ZeroConfig fields the keys of block ``path`` set: (values, key paths, fields whose
    key was refused). An absent key gives DeepSpeed's default; two spellings of one field are
    refused."""
    values, paths, bad = {}, {}, set()
    for spec in FIELDS.values():
        here = [p.rpartition(".")[2] for p in spec.keys if p.rpartition(".")[0] == path]
        if not here:
            continue
        present = [k for k in here if k in given]
        if any(v.refused_under(_join(path, k)) for k in here):
            bad.add(spec.name)
        if len(present) > 1:
            v.refuse(_join(path, present[1]), f"{_join(path, present[1])} is given twice (also as "
                     f'"{present[0]}"): they are the same key (ZeroConfig.{spec.name}). Fix: keep one spelling')
            bad.add(spec.name)
        key = present[0] if present else here[0]
        values[spec.name] = given[key] if present else spec.ds_check(spec.key_default)
        paths[spec.name] = _join(path, key)
    return values, paths, bad


def read_top(cfg: dict, v: Verdicts) -> None:
    """Verdicts for the top-level keys; the blocks and the batch keys are read by their readers.
    Keys DeepSpeed does not know are warned (DeepSpeed ignores them), with a hint only for a
    near-miss of a known key; keys starting with "_" are comments."""
    read_monitors(cfg, v)
    for key, value in cfg.items():
        if key in MONITORS:
            continue
        if key in TOP and TOP[key].honoured:
            if key in _BLOCKS:
                v.honour(key, f"read by zerojax (the {key} block)")
            continue
        if str(key).startswith("_"):
            v.ignore(key, "a comment (keys starting with \"_\" are not read)")
            continue
        if key not in TOP:
            near = typo_of(key, [k for k in TOP if not TOP[k].removed])
            hint = f' Did you mean "{near}"?' if near else ""
            v.warn(key, f'{key}: not a DeepSpeed key; DeepSpeed ignores it, and so does zerojax.{hint}')
            continue
        read_block({key: value}, {key: TOP[key]}, "", v)


# --------------------------------------------------------------------------- monitors
_LENIENT = ("flops_profiler",)  # DeepSpeed reads these blocks key by key and ignores other keys


def read_monitors(cfg: dict, v: Verdicts) -> dict:
    """The monitor keys of a config (:data:`zerojax.config._keys.MONITORS`), checked: {key: value}
    for the plain keys, {block: every key with DeepSpeed's default filled in} for the blocks
    that are on. ``zerojax.monitor.Monitors.from_deepspeed`` builds the monitors from it."""
    out = {}
    for key, table in MONITORS.items():
        if key not in cfg:
            continue
        value = cfg[key]
        if value == "auto":  # nothing fills it: DeepSpeed's default, which zerojax leaves off
            v.ignore(key, '"auto" in a monitor key: DeepSpeed\'s default, as DeepSpeed drops it; nothing monitored')
            continue
        if isinstance(table, Key):
            out.update(read_block({key: value}, {key: table}, "", v))
            continue
        if isinstance(value, dict) and key in _LENIENT:
            for odd in [k for k in value if k not in table]:
                v.warn(f"{key}.{odd}", f"{key}.{odd}: not a key of DeepSpeed's {key} block; DeepSpeed ignores it, "
                       f"and so does zerojax. {did_you_mean(odd, table)}")
            value = {k: x for k, x in value.items() if k in table}
        given = read_block(value, table, key, v)
        if given.get("enabled") is True:
            out[key] = {k: given.get(k, entry.default) for k, entry in table.items()}
    return out


# --------------------------------------------------------------------------- deprecated keys
def upgrade_deprecated(cfg: dict, v: Verdicts) -> None:
    """DeepSpeed's deprecated ZeRO spellings rewritten in place to the current keys (each
    noted in ``v.deprecated``, for a DeprecatedKeyWarning naming the new key)."""
    zo = cfg.get("zero_optimization")
    if isinstance(zo, bool):
        new = {"stage": 1 if zo else 0}
        if zo and "allgather_size" in cfg:
            v.honour("allgather_size", "-> ZeroConfig.allgather_bucket_size (the deprecated form's bucket)")
            v.aliases["allgather_size"] = "allgather_size"
        if zo:
            new["allgather_bucket_size"] = cfg.pop("allgather_size", 500_000_000)
        v.deprecated.append(f'"zero_optimization": {str(zo).lower()} is DeepSpeed\'s deprecated form; read as '
                            f'"zero_optimization": {new}. Write the block that way')
        v.honour("zero_optimization", f"deprecated form, read as {new}")
        v.aliases["zero_optimization.stage"] = "zero_optimization"
        v.aliases["zero_optimization.allgather_bucket_size"] = "allgather_size" if "allgather_size" in v.aliases \
            else "zero_optimization"
        cfg["zero_optimization"] = new
        return
    if not isinstance(zo, dict):
        return
    path = "zero_optimization"
    for old, (new_key, text) in DEPRECATED_ZERO.items():
        if old not in zo:
            continue
        value, full = zo.pop(old), f"{path}.{old}"
        if not isinstance(value, bool):
            v.refuse(full, f"{full}={value!r} is invalid: expected true or false. Fix: use {text}")
            continue
        v.deprecated.append(f"{full} is deprecated in DeepSpeed: use {text} instead")
        if old in ("cpu_offload", "cpu_offload_param", "stage3_gather_fp16_weights_on_model_save"):
            target = {"cpu_offload": ("offload_optimizer",), "cpu_offload_param": ("offload_param",)}.get(
                old, ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"))
            clash = [k for k in target if k in zo]
            if clash:
                v.refuse(full, f"{full} and {path}.{clash[0]} are both given: the deprecated key and the one "
                         f"replacing it cannot be given together. Fix: keep only {path}.{clash[0]}")
                continue
            if target[0].startswith("offload"):
                if value:
                    zo[target[0]] = {"device": "cpu"}
            else:
                zo[target[0]] = value
            v.aliases[f"{path}.{target[0]}"] = full
            v.honour(full, f"deprecated spelling, read as {text}" + ("" if value or "gather" in old else
                                                                     " (false: nothing to offload)"))
            continue
        # cpu_offload_use_pin_memory: pin_memory of both offload blocks
        blocks = [b for b in ("offload_optimizer", "offload_param") if isinstance(zo.get(b), dict)]
        clash = [b for b in blocks if "pin_memory" in zo[b] and zo[b]["pin_memory"] != value]
        if clash:
            v.refuse(full, f"{full}={value} disagrees with {path}.{clash[0]}.pin_memory="
                     f"{zo[clash[0]]['pin_memory']!r}. Fix: remove {old}")
            continue
        for b in blocks:
            zo[b] = {**zo[b], "pin_memory": value}
            v.aliases.setdefault(f"{path}.{b}.pin_memory", full)
        v.honour(full, "deprecated spelling, read as pin_memory of " + (" and ".join(blocks) or
                                                                          "the offload blocks (none given)"))


# --------------------------------------------------------------------------- tensor_parallel
def tensor_parallel_fields(block, v: Verdicts) -> dict:
    """ZeroConfig's AutoTP fields from the tensor_parallel block (absent: off)."""
    path = "tensor_parallel"
    given = read_block(block, TENSOR_PARALLEL, path, v) if block is not None else {}
    return fields_of(given, path, v)[0]


# --------------------------------------------------------------------------- zero_optimization
def _try(check, value):
    try:
        return check(value)
    except Invalid:
        return None


# offload_param's own fields beside its device (NVMe params' read-ahead), dropped with the block
_PARAM_BUFFERS = ("offload_param_buffer_count", "offload_param_buffer_size", "offload_param_max_in_cpu")


def zero_fields(zo, v: Verdicts) -> tuple[dict, dict]:
    """ZeroConfig fields from the zero_optimization block: (values, the key path of each)."""
    path = "zero_optimization"
    if not isinstance(zo, dict):
        v.refuse(path, f"{path}={zo!r} is invalid: expected a JSON object. Fix: write {path} as {{...}}")
        zo = {}
    stage = _try(FIELDS["stage"].check, zo.get("stage", 0))
    fields, paths, bad = fields_of(read_block(zo, ZERO, path, v, stage=stage, skip=ZERO_BLOCKS), path, v)
    if fields["overlap_comm"] is None:
        fields["overlap_comm"] = fields["stage"] == 3
    blocks = {}  # name -> (its fields, their key paths, the keys given)
    for name, table in (("offload_optimizer", OFFLOAD_OPTIMIZER), ("offload_param", OFFLOAD_PARAM)):
        bpath = f"{path}.{name}"
        given = read_block(zo[name], table, bpath, v) if zo.get(name) is not None else {}
        values, where, refused = fields_of(given, bpath, v)
        blocks[name] = (values, where, given)
        own = ("offload_optimizer", "offload_ratio") if name == "offload_optimizer" else ("offload_param",) + _PARAM_BUFFERS
        for f in own:
            fields[f], paths[f] = values[f], where[f]
        bad |= refused & set(own)
    # what DeepSpeed reads but ignores at this stage: warned and dropped, as DeepSpeed does
    for rule in broken_rules(fields, skip=bad):
        if rule.on_deepspeed == "ignore":
            where = path + ".offload_param" if rule.field == "offload_param" else paths[rule.field]
            v.warn(where, rule_message(rule, fields, paths, consequence=_DS_IGNORES))
            fields[rule.field] = FIELDS[rule.field].default
            if rule.field == "offload_param":
                blocks["offload_param"] = ({}, {}, {})
                for f in _PARAM_BUFFERS:
                    fields[f] = FIELDS[f].default
    # nvme_path and pin_memory: one ZeroConfig field for both blocks, from the blocks in use
    active = [n for n in ("offload_optimizer", "offload_param") if fields[n] is not None]
    for key in ("nvme_path", "pin_memory"):
        given = {n: blocks[n][0][key] for n in active if key in blocks[n][2]}
        if len({repr(x) for x in given.values()}) > 1:
            v.refuse(f"{path}.offload_param.{key}", f"{path}.offload_param.{key}={given['offload_param']!r} differs "
                     f"from {path}.offload_optimizer.{key}={given['offload_optimizer']!r}: zerojax uses one {key} "
                     f"for both (ZeroConfig.{key}). Fix: make them equal")
        name = next(iter(given), next(iter(active), "offload_optimizer"))
        fields[key] = given[name] if given else FIELDS[key].default
        paths[key] = f"{path}.{name}.{key}"
    if fields["offload_optimizer"] == "nvme" and not fields["nvme_path"]:  # the one block that needs it
        paths["nvme_path"] = f"{path}.offload_optimizer.nvme_path"
    for rule in broken_rules(fields, skip=bad):
        if rule.on_deepspeed == "error":
            v.refuse(paths[rule.field], rule_message(rule, fields, paths))
    fields["zenflow"] = None
    if zo.get("zenflow") is not None:
        zpath = f"{path}.zenflow"
        if fields["offload_optimizer"] != "cpu":
            v.refuse(zpath, f"{zpath} needs {path}.offload_optimizer.device 'cpu' (got "
                     f"{fields['offload_optimizer'] or 'none'!r}). "
                     'Fix: add "offload_optimizer": {"device": "cpu"}')
        else:
            fields["zenflow"] = zenflow_block(zo["zenflow"], zpath, v)
            v.honour(zpath, "-> ZeroConfig.zenflow")
    return fields, paths


def zenflow_block(block, path: str = "zenflow", verdicts: Optional[Verdicts] = None) -> dict:
    """A zenflow block with every key filled in, checked by DeepSpeed's rules; the one check
    behind both ``ZeroConfig(zenflow=...)`` and a DeepSpeed file's block. Without
    ``verdicts``, a problem raises ConfigError."""
    v = Verdicts() if verdicts is None else verdicts
    before = len(v.refused)
    given = read_block(block, ZENFLOW, path, v)
    z = {k: given.get(k, e.default) for k, e in ZENFLOW.items()}
    sel, upd = z["select_interval"], z["update_interval"]
    if z["select_strategy"] != "auto" and sel == "auto":
        v.refuse(f"{path}.select_interval", f"{path}.select_interval='auto' only works with select_strategy "
                 f"'auto' (got {z['select_strategy']!r}). Fix: give select_interval a number of steps")
    for key, x in (("update_interval", upd), ("select_interval", sel)):
        if x != "auto" and x < 1:
            v.refuse(f"{path}.{key}", f"{path}.{key}={x} is invalid: expected an integer >= 1. Fix: use 4")
    if sel != "auto" and upd != "auto" and 1 <= sel < upd:
        v.refuse(f"{path}.select_interval", f"{path}.select_interval={sel} is smaller than update_interval={upd}: "
                 "columns must stay selected for at least one host update. Fix: make select_interval >= "
                 "update_interval")
    if verdicts is None and len(v.refused) > before:
        v.raise_refused()
    return z


# --------------------------------------------------------------------------- activation_checkpointing
def activation_checkpointing_block(block, path: str = "activation_checkpointing", verdicts: Optional[Verdicts] = None,
                                   autotp_size: int = 1) -> dict:
    """DeepSpeed's activation_checkpointing block with every key filled in (DeepSpeed's
    defaults), checked by :data:`zerojax.config._keys.ACTIVATION_CHECKPOINTING`; the one check
    behind ``ZeroConfig(activation_checkpointing=...)`` and a DeepSpeed file's block. Without
    ``verdicts``, a refused key raises ConfigError.

    ``partition_activations`` splits DeepSpeed's checkpoints over the model-parallel ranks: at
    one rank (``autotp_size`` 1) there is nothing to split, in DeepSpeed as here; over AutoTP's
    "model" axis zerojax does not split them, so it is refused."""
    v = Verdicts() if verdicts is None else verdicts
    before = len(v.refused)
    given = read_block(block, ACTIVATION_CHECKPOINTING, path, v)
    out = {k: given.get(k, e.default) for k, e in ACTIVATION_CHECKPOINTING.items()}
    if out["partition_activations"] and autotp_size > 1:
        v.refuse(f"{path}.partition_activations", f"{path}.partition_activations=True is not supported with "
                 f"tensor_parallel.autotp_size={autotp_size}: zerojax does not split the saved inputs of a "
                 "checkpointed block over the \"model\" axis (each model-parallel device keeps them whole). "
                 'Fix: set it to false; to take the checkpoints off the device, use "cpu_checkpointing": true '
                 "(pinned host memory)")
    if verdicts is None and len(v.refused) > before:
        v.raise_refused()
    return out


# --------------------------------------------------------------------------- fp16 / bf16
def precision_fields(cfg: dict, v: Verdicts) -> tuple[dict, dict]:
    """ZeroConfig.precision and the fp16 / bf16 settings: (values, key paths)."""
    read = {}
    for name, table in (("fp16", FP16), ("bf16", BF16)):
        read[name] = fields_of(read_block(cfg.get(name, {}), table, name, v), name, v)
    (f16, p16, _), (b16, pb, _) = read["fp16"], read["bf16"]
    on16, onb = f16.pop("precision"), b16.pop("precision")
    # the bf16 model-state switches are kept whatever the precision: their rules say when they apply
    low = {k: b16.pop(k) for k in LOW_PRECISION if k in b16}
    low_paths = {k: pb[k] for k in low}
    if on16 and onb:
        v.refuse("fp16.enabled", precision_message({"fp16": "fp16.enabled", "bf16": "bf16.enabled"}))
        return {"precision": "fp32"}, {"precision": "fp16.enabled"}
    if on16:
        return dict(f16, precision="fp16", **low), dict(p16, precision="fp16.enabled", **low_paths)
    if onb:
        return dict(b16, precision="bf16", **low), dict(pb, precision="bf16.enabled", **low_paths)
    return dict(low, precision="fp32"), dict(low_paths, precision="bf16.enabled")


def low_precision_rules(fields: dict, paths: dict, v: Verdicts) -> None:
    """The rules of the bf16 model-state switches, which read fields of other blocks (the stage,
    the offload device, the precision): refused with the DeepSpeed key paths."""
    for rule in broken_rules(fields):
        if rule.field in LOW_PRECISION and rule.on_deepspeed == "error":
            v.refuse(paths.get(rule.field, rule.field), rule_message(rule, fields, paths))


# --------------------------------------------------------------------------- optimizer
def read_optimizer(block, v: Verdicts) -> Optional[dict]:
    """An optimizer block checked by DeepSpeed's rules, as {"type": name, "params": every
    param with its default}; None when it is refused."""
    before = len(v.refused)
    table = {"type": Key(check=_type_name, field="optimizer"),
             "params": Key(field="optimizer"), "legacy_fusion": Key(False, None, why="a DeepSpeed fused-kernel switch")}
    given = read_block(block, table, "optimizer", v)
    if len(v.refused) > before:
        return None
    kind = given.get("type")
    if kind is None:
        v.refuse("optimizer.type", 'optimizer.type is missing. Fix: add "type": "AdamW" (or Adam, Lamb, Lion, '
                 "Adagrad, SGD)")
        return None
    if kind.lower() in REFUSED_OPTIMIZERS:
        what, instead = REFUSED_OPTIMIZERS[kind.lower()]
        v.refuse("optimizer.type", f"optimizer.type={kind!r} is not available in zerojax: {what}. Fix: use {instead}")
        return None
    if kind.lower() not in OPTIMIZERS:
        names = [n for n, _ in OPTIMIZERS.values()]
        v.refuse("optimizer.type", f"optimizer.type={kind!r} is not supported. {did_you_mean(kind, names)}")
        return None
    name, schema = OPTIMIZERS[kind.lower()]
    params = given.get("params", {})
    if isinstance(params, dict) and "max_grad_norm" in params:
        v.refuse("optimizer.params.max_grad_norm", "optimizer.params.max_grad_norm is not supported: DeepSpeed "
                 'clips gradients with the top-level key. Fix: remove it and set "gradient_clipping": <norm>')
        params = {k: x for k, x in params.items() if k != "max_grad_norm"}
    p = {k: e.default for k, e in schema.items()} | read_block(params, schema, "optimizer.params", v)
    if p.get("amsgrad") is True:
        v.refuse("optimizer.params.amsgrad", "optimizer.params.amsgrad=True is not supported: AMSGrad has no "
                 "zerojax counterpart (DeepSpeed's fused Adam refuses it too). Fix: remove amsgrad")
    if name == "AdamW" and not p["adam_w_mode"]:
        v.refuse("optimizer.params.adam_w_mode", "optimizer.params.adam_w_mode=false with type AdamW: AdamW "
                 'always decays weights decoupled. Fix: use "type": "Adam" with adam_w_mode false for L2 '
                 "regularisation")
    if name == "Lamb" and p["min_coeff"] > p["max_coeff"]:
        v.refuse("optimizer.params.min_coeff", f"optimizer.params.min_coeff={p['min_coeff']} is above max_coeff="
                 f"{p['max_coeff']}. Fix: use DeepSpeed's 0.01 and 10")
    if name == "SGD" and p["dampening"] != 0:
        v.refuse("optimizer.params.dampening", f"optimizer.params.dampening={p['dampening']} is not supported. "
                 "Fix: use 0")
    if name == "SGD" and p["nesterov"] and p["momentum"] == 0:
        v.refuse("optimizer.params.nesterov", "optimizer.params.nesterov=true needs a momentum > 0. Fix: set "
                 "momentum, e.g. 0.9")
    return None if len(v.refused) > before else {"type": name, "params": p}


def _type_name(t):
    if not isinstance(t, str):
        raise Invalid('an optimizer name such as "AdamW"')
    return t


def optimizer_block(block) -> dict:
    """:func:`read_optimizer` raising ConfigError for a refused block."""
    v = Verdicts()
    out = read_optimizer(block, v)
    v.raise_refused()
    return out
