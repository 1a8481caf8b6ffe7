"""ZeroConfig's schema: every field once, with its DeepSpeed key(s), its defaults, its check,
and the rules between fields.

``ZeroConfig.__post_init__`` validates with it and the DeepSpeed reader reads with it, so a
rule has one message whichever way a value came in. Read from a file, the message names the
DeepSpeed key path and the field; built by hand, the field::

    validate({"stage": 2, "offload_param": "cpu"})
    # ConfigError: ZeroConfig.offload_param='cpu' needs ZeRO stage 3 (ZeroConfig.stage is 2): ...
    validate(values, paths={"offload_param": "zero_optimization.offload_param.device", ...})
    # ConfigError: zero_optimization.offload_param.device='cpu' (ZeroConfig.offload_param) needs ...

A check is ``check(value) -> normalised value`` and raises :class:`Invalid` saying what was
expected.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import warnings
from typing import Any, Callable, Mapping, Optional

from zerojax._errors import ConfigError, IgnoredKeysWarning
from zerojax._precision import PRECISIONS, LossScaler

__all__ = ["FIELDS", "LOW_PRECISION", "NONTRAINABLE", "PARAM_NVME", "RULES", "ZEROPP", "FieldSpec", "Invalid", "Rule",
           "invalid_message", "subject", "validate"]


# --------------------------------------------------------------------------- value checks
class Invalid(Exception):
    """A value failed a check; the argument says what was expected."""


def boolean(v):
    if not isinstance(v, bool):
        raise Invalid("true or false")
    return v


def integer(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                or not float(v).is_integer():
            raise Invalid("an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise Invalid(f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
        return int(v)
    return check


def number(lo=None, hi=None, lo_open=False, hi_open=False):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise Invalid("a finite number")
        if lo is not None and (v < lo or (lo_open and v == lo)) or \
                hi is not None and (v > hi or (hi_open and v == hi)):
            raise Invalid(f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
                          if hi is not None else f"a number {'>' if lo_open else '>='} {lo}")
        return float(v)
    return check


def choice(*options):
    def check(v):
        if v not in options or isinstance(v, bool):
            raise Invalid(f"one of {', '.join(map(repr, options))}")
        return v
    return check


def string(v):
    if not isinstance(v, str):
        raise Invalid("a string")
    return v


def name(v):
    if not isinstance(v, str) or not v:
        raise Invalid("a non-empty string")
    return v


def mapping(v):
    if not isinstance(v, dict):
        raise Invalid("a dict (a JSON object)")
    return v


def optional(check):
    return lambda v: None if v is None else check(v)


def state_dtype(v):
    """A model-state dtype: None (or "float32") keeps fp32; "bfloat16" stores bf16."""
    if v is None or v == "float32":
        return None
    if v != "bfloat16":
        raise Invalid("None, 'float32' or 'bfloat16'")
    return v


def bf16_flag(v):
    """A DeepSpeed bf16 switch read into a state dtype: true -> "bfloat16", false -> None."""
    return "bfloat16" if boolean(v) else None


def device(v):
    """An offload device: "none" (or None) means no offload and is normalised to None."""
    if v is None or v == "none":
        return None
    if v not in ("cpu", "nvme"):
        raise Invalid("one of 'none', 'cpu', 'nvme'")
    return v


def signal_name(v):
    """A signal by name ("SIGUSR1" or "USR1"), normalised to "SIGUSR1"."""
    import signal as _signal

    if not isinstance(v, str) or not v:
        raise Invalid("a signal name such as 'SIGUSR1'")
    full = v.upper() if v.upper().startswith("SIG") else "SIG" + v.upper()
    if full in ("SIGKILL", "SIGSTOP", "SIGUSR2") or not isinstance(getattr(_signal, full, None), _signal.Signals):
        raise Invalid("a signal a process can catch, such as 'SIGUSR1' (not SIGKILL, SIGSTOP or SIGUSR2, "
                      "which the watchdog uses for stack dumps)")
    return full


def did_you_mean(key: str, known, fallback: bool = True) -> str:
    """A hint naming the closest known key; without one, the known keys (or "" if not ``fallback``)."""
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.5)
    if close:
        return f'Did you mean "{close[0]}"?'
    return f"Known keys: {', '.join(sorted(known))}." if fallback else ""


def _edits(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and adjacent swaps turning ``a`` into ``b``."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def typo_of(key: str, known) -> Optional[str]:
    """The known key ``key`` is a typo of, if any: a few edits away (one for short keys, up to
    three for long ones), nothing for keys under 5 characters. Stricter than :func:`did_you_mean`,
    for keys that are not errors: a hint must not point an unrelated key at a real one."""
    key = str(key)
    if len(key) < 5:
        return None
    budget = 1 if len(key) < 8 else 2 if len(key) < 15 else 3
    scored = sorted((_edits(key.lower(), k.lower()), k) for k in known)
    return scored[0][1] if scored and scored[0][0] <= budget else None


# --------------------------------------------------------------------------- fields
_SAME = object()


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One ZeroConfig field.

    ``keys``: the DeepSpeed key paths that set it ("block.key"; the first is the canonical
    spelling, the rest are accepted spellings). ``key_check``: the check of those keys' JSON
    values where it differs from the field's (``fp16.enabled`` is a bool, precision a name).
    ``deepspeed_default``: DeepSpeed's default where it differs from ZeroConfig's;
    ``deepspeed_key_default``: the keys' JSON default where that differs again.
    ``stage3_only``: DeepSpeed reads it only with ZeRO stage 3.
    """

    name: str
    default: Any
    check: Callable
    fix: str
    keys: tuple = ()
    key_check: Optional[Callable] = None
    deepspeed_default: Any = _SAME
    deepspeed_key_default: Any = _SAME
    stage3_only: bool = False
    doc: str = ""

    @property
    def ds_default(self):
        return self.default if self.deepspeed_default is _SAME else self.deepspeed_default

    @property
    def key_default(self):
        return self.ds_default if self.deepspeed_key_default is _SAME else self.deepspeed_key_default

    @property
    def ds_check(self) -> Callable:
        return self.key_check or self.check


_Z, _OO, _OP = "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param"


def _both(key):  # "stage3_x" and plain "x" are both DeepSpeed spellings
    return (f"{_Z}.stage3_{key}", f"{_Z}.{key}")


_LS = {f.name: f.default for f in dataclasses.fields(LossScaler)}  # DeepSpeed's fp16 defaults, kept there
_STAGE_FIX = "pick a ZeRO stage: 0 replicates, 1 partitions optimizer state, 2 also gradients, 3 also parameters"
_ELEMENTS = "a number of elements, e.g. DeepSpeed's default {}"

FIELDS: dict[str, FieldSpec] = {f.name: f for f in (
    # partitioning
    FieldSpec("stage", 0, integer(0, 3), _STAGE_FIX, (f"{_Z}.stage",)),
    FieldSpec("data_axis", "data", name, "name the mesh axis the batch is split over, e.g. 'data'",
              doc="no DeepSpeed key: DeepSpeed's data-parallel group is every rank"),
    FieldSpec("autotp_size", 1, integer(1), "use 1 (off) or the devices of one tensor-parallel group, a divisor "
              "of the device count", ("tensor_parallel.autotp_size",), key_check=lambda v: max(1, integer(0)(v)),
              deepspeed_key_default=0, doc="AutoTP (zerojax._autotp): a ('data', 'model') mesh of world / autotp_size "
              "x autotp_size, projections split over 'model' by name; DeepSpeed's 0 reads as 1 (off)"),
    FieldSpec("sequence_parallel_size", 1, integer(1), "use 1 (off) or the devices of one sequence-parallel group, "
              "a divisor of the device count", ("sequence_parallel_size",),
              doc="Ulysses (zerojax._ulysses): a ('data', 'seq') mesh of world / sequence_parallel_size x "
              "sequence_parallel_size, each batch leaf's dim 1 split over 'seq'"),
    FieldSpec("seq_parallel_comm_dtype", "fp32", choice("fp32", "bf16", "fp16"), 'use "fp32" (the inputs\' own '
              'type), "bf16" or "fp16"', ("seq_parallel_communication_data_type",),
              doc="the type zj.ulysses_attention's all-to-alls carry q, k, v and the output in (cast back after); "
              "fp32 leaves them as they are"),
    FieldSpec("autotp_vocab_parallel", False, boolean, "use true or false", ("tensor_parallel.vocab_parallel_lm_head",),
              doc="AutoTP also splits the token embedding and lm_head along the vocabulary"),
    # precision
    FieldSpec("precision", "fp32", choice(*PRECISIONS), 'use "bf16" for mixed precision ("fp16" adds loss scaling)',
              ("fp16.enabled", "bf16.enabled"), key_check=boolean, deepspeed_key_default=False,
              doc="fp16.enabled -> 'fp16', bf16.enabled -> 'bf16', neither -> 'fp32'"),
    FieldSpec("loss_scale", _LS["loss_scale"], number(0), "use 0 (dynamic) or a positive static scale",
              ("fp16.loss_scale",)),
    FieldSpec("initial_scale_power", _LS["initial_scale_power"], integer(0, 127),
              "use DeepSpeed's 16 (the first scale is 2**16)", ("fp16.initial_scale_power",)),
    FieldSpec("loss_scale_window", _LS["loss_scale_window"], integer(1), "use DeepSpeed's 1000",
              ("fp16.loss_scale_window",)),
    FieldSpec("hysteresis", _LS["hysteresis"], integer(1), "use DeepSpeed's 2", ("fp16.hysteresis",)),
    FieldSpec("consecutive_hysteresis", _LS["consecutive_hysteresis"], boolean, "use true or false",
              ("fp16.consecutive_hysteresis",)),
    FieldSpec("min_loss_scale", _LS["min_loss_scale"], number(0, lo_open=True), "use DeepSpeed's 1",
              ("fp16.min_loss_scale",)),
    FieldSpec("check_grad_overflow", True, boolean, "use true or false", ("bf16.check_grad_overflow",)),
    # low-precision model states (DeepSpeed 0.18+; zerojax._low_precision)
    FieldSpec("master_weights_dtype", None, state_dtype, 'use None (an fp32 master copy) or "bfloat16" (the bf16 '
              "params are their own master)", ("bf16.bf16_master_weights_and_grads",), key_check=bf16_flag,
              deepspeed_key_default=False,
              doc="true -> 'bfloat16': no fp32 master; the update computes in fp32 and stores the bf16 params"),
    FieldSpec("optimizer_state_dtype", None, state_dtype, 'use None (fp32) or "bfloat16" (the moments in bf16)',
              ("bf16.bf16_optimizer_states",), key_check=bf16_flag, deepspeed_key_default=False,
              doc="true -> 'bfloat16': the optimizer leaves mirroring a param stored in bf16, updated in fp32"),
    FieldSpec("stochastic_rounding", False, boolean, "use true or false",
              doc="no DeepSpeed key: the bf16 master update rounds stochastically (unbiased) instead of to nearest"),
    # the step
    FieldSpec("gradient_accumulation_steps", 1, integer(1), "set it to the number of micro-batches per optimizer step",
              ("gradient_accumulation_steps",)),
    FieldSpec("gradient_clipping", 0.0, number(0), "use 0 (no clipping) or a positive norm", ("gradient_clipping",),
              deepspeed_default=1.0, doc="ZeroConfig() does not clip; an absent key in a DeepSpeed file means 1.0"),
    FieldSpec("train_micro_batch_size_per_gpu", None, optional(integer(1)), "use a positive integer",
              ("train_micro_batch_size_per_gpu",)),
    FieldSpec("train_batch_size", None, optional(integer(1)), "use a positive integer", ("train_batch_size",)),
    # collectives (elements)
    FieldSpec("reduce_scatter", True, boolean, "use true or false", (f"{_Z}.reduce_scatter",)),
    FieldSpec("reduce_bucket_size", 500_000_000, integer(1), "use " + _ELEMENTS.format("5e8"),
              (f"{_Z}.reduce_bucket_size",)),
    FieldSpec("allgather_bucket_size", 500_000_000, integer(0), "use " + _ELEMENTS.format("5e8"),
              (f"{_Z}.allgather_bucket_size",), doc="0: one all-gather per leaf"),
    FieldSpec("overlap_comm", None, optional(boolean), "use true or false (absent: true at stage 3, else false)",
              (f"{_Z}.overlap_comm",)),
    FieldSpec("prefetch_bucket_size", 50_000_000, integer(0), "use " + _ELEMENTS.format("5e7"),
              _both("prefetch_bucket_size"), stage3_only=True, doc="0: no prefetch"),
    FieldSpec("param_persistence_threshold", 100_000, integer(0), "use 0 to partition every parameter",
              _both("param_persistence_threshold"), stage3_only=True),
    FieldSpec("max_live_parameters", 1_000_000_000, integer(0), "use " + _ELEMENTS.format("1e9"),
              _both("max_live_parameters"), stage3_only=True,
              doc="0: nothing beyond the parameter in use, i.e. the smallest slices"),
    FieldSpec("max_reuse_distance", 1_000_000_000, integer(0), "use " + _ELEMENTS.format("1e9"),
              _both("max_reuse_distance"), stage3_only=True),
    FieldSpec("gather_16bit_weights_on_model_save", False, boolean, "use true or false",
              _both("gather_16bit_weights_on_model_save"),
              doc="zerojax writes the 16-bit model at every stage (DeepSpeed reads the key at stage 3)"),
    FieldSpec("sub_group_size", 1_000_000_000, integer(0), "use " + _ELEMENTS.format("1e9"),
              (f"{_Z}.sub_group_size",), doc="0 (DeepSpeed: one sub-group per parameter) is refused with NVMe offload"),
    # offload
    FieldSpec("offload_optimizer", None, device, 'use None, "cpu" or "nvme"', (f"{_OO}.device",),
              deepspeed_default="none"),
    FieldSpec("offload_param", None, device, 'use None, "cpu" or "nvme"', (f"{_OP}.device",),
              deepspeed_default="none", stage3_only=True,
              doc='"nvme" (ZeRO-Infinity) keeps the 16-bit params in the NVMe optimizer store\'s files: it needs '
                  'offload_optimizer "nvme"'),
    FieldSpec("offload_param_buffer_count", 5, integer(1), "use a count of buffers >= 1, e.g. 5",
              (f"{_OP}.buffer_count",),
              doc="with offload_param \"nvme\": buffer_count x buffer_size elements of params are read ahead "
                  "into host memory at most"),
    FieldSpec("offload_param_buffer_size", 100_000_000, integer(1), "use a number of elements >= 1, e.g. 1e8",
              (f"{_OP}.buffer_size",), doc="elements per read-ahead buffer (see buffer_count)"),
    FieldSpec("offload_param_max_in_cpu", 1_000_000_000, integer(0), "use a number of elements, e.g. 1e9",
              (f"{_OP}.max_in_cpu",),
              doc="caps the read-ahead (elements of params in host memory at once); 0 reads each part when asked"),
    FieldSpec("nvme_path", None, optional(string), 'set a directory on a local NVMe drive, e.g. "/local_nvme"',
              (f"{_OO}.nvme_path", f"{_OP}.nvme_path")),
    FieldSpec("pin_memory", True, boolean, "use true or false", (f"{_OO}.pin_memory", f"{_OP}.pin_memory")),
    FieldSpec("offload_ratio", 1.0, number(0, 1, lo_open=True), "use 1.0 (offload everything) or a fraction",
              (f"{_OO}.ratio",)),
    # the watchdog and preemption (zerojax.runtime._watchdog)
    FieldSpec("step_timeout", None, optional(number(0)), "use a number of seconds (0 turns the watchdog off)",
              doc="no DeepSpeed key: seconds a step may take before the watchdog dumps every stack and ends the "
                  "process with code 124; None: DEEPSPEED_TIMEOUT (minutes) from the environment, else 1800; "
                  "zj.initialize takes training_args.ddp_timeout; tightens to max(120 s, 20 x the median step) "
                  "after 3 steps; 0: off"),
    FieldSpec("first_step_timeout", None, optional(number(0)), "use a number of seconds",
              doc="no DeepSpeed key: the deadline of the first step and of any compile (None: 2 x step_timeout)"),
    FieldSpec("preemption_signal", None, optional(signal_name), "use a signal name such as 'SIGUSR1'",
              doc="no DeepSpeed key: a signal that, like SIGTERM, makes the step save a checkpoint and exit "
                  "with code 75 (SLURM's --signal=USR1@60); ZEROJAX_PREEMPTION_SIGNAL in the environment"),
    # blocks a DeepSpeed file carried beyond the engine, kept resolved
    FieldSpec("optimizer", None, optional(mapping), 'use {"type": "AdamW", "params": {...}}', ("optimizer",)),
    FieldSpec("scheduler", None, optional(mapping), 'use {"type": "WarmupLR", "params": {...}}', ("scheduler",)),
    FieldSpec("zenflow", None, optional(mapping), 'use {"topk_ratio": 0.1, "update_interval": 4}',
              (f"{_Z}.zenflow",)),
    FieldSpec("activation_checkpointing", None, optional(mapping), 'use None (off) or {"cpu_checkpointing": false}',
              ("activation_checkpointing",), doc="DeepSpeed's activation_checkpointing block, every key filled in (None: the block is absent); "
                  "zj.remat reads it while the step is traced"),
    # ZeRO++ (stage 3)
    FieldSpec("quantized_weights", False, boolean, "use true or false", (f"{_Z}.zero_quantized_weights",),
              stage3_only=True, doc="qwZ: stage-3 weight gathers travel in 8 bits, block-wise scaled"),
    FieldSpec("hpz_partition_size", 1, integer(0), "use the devices per node (1 or 0: off); it must divide the "
              "data-axis size", (f"{_Z}.zero_hpz_partition_size",), stage3_only=True,
              doc="hpZ: a secondary partition over the node's devices serves the backward gathers"),
    FieldSpec("quantized_gradients", False, boolean, "use true or false", (f"{_Z}.zero_quantized_gradients",),
              stage3_only=True, doc="qgZ: gradients reduced by quantized all-to-all, inside then across nodes"),
    FieldSpec("quantization_block_size", 256, integer(1), "use a positive number of values per block, e.g. 256",
              doc="no DeepSpeed key: values per quantization block (one float32 maximum each) for qwZ and qgZ"),
    FieldSpec("quantized_gradients_bits", 4, choice(4, 8), "use 4 (DeepSpeed's) or 8",
              doc="no DeepSpeed key: the width of qgZ's exchanges (DeepSpeed's is 4)"),
    FieldSpec("devices_per_node", None, optional(integer(1)), "use the devices of one node along the data axis",
              doc="no DeepSpeed key: nodes for qgZ's two hops and the comm report's spans (None: "
                  "hpz_partition_size when above 1, else one process's devices)"),
)}


# --------------------------------------------------------------------------- rules
@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule between fields. ``field`` is the one at fault; ``broken(values)`` says whether
    the rule is broken; ``text(values, name_of)`` completes the message after the field's
    value (``name_of(f)`` names another field the way the value came in).

    ``on_zeroconfig`` / ``on_deepspeed``: "error", or "allow" (ZeroConfig accepts it) /
    "ignore" (DeepSpeed reads the file but ignores the field there: the reader warns and
    drops it, as DeepSpeed does); "warn": accepted with an IgnoredKeysWarning naming it (the
    reader keeps the value).
    """

    field: str
    reads: tuple
    broken: Callable[[Mapping], bool]
    text: Callable[[Mapping, Callable], str]
    fix: str
    on_zeroconfig: str = "error"
    on_deepspeed: str = "error"


def _stage3_tuning(field: str, on_zeroconfig: str = "allow") -> Rule:
    return Rule(field, ("stage",), lambda v: v["stage"] != 3 and v[field] != FIELDS[field].default,
                lambda v, n: f"only applies at ZeRO stage 3 ({n('stage')} is {v['stage']})",
                "remove it, or set stage 3", on_zeroconfig=on_zeroconfig, on_deepspeed="ignore")


ZEROPP = ("quantized_weights", "hpz_partition_size", "quantized_gradients")
LOW_PRECISION = ("master_weights_dtype", "optimizer_state_dtype", "stochastic_rounding")


def _needs_bf16(field: str) -> Rule:
    return Rule(field, ("precision",), lambda v: v[field] is not None and v["precision"] != "bf16",
                lambda v, n: f"needs bf16 mixed precision ({n('precision')} gives {v['precision']!r}): only bf16 "
                             "model states are kept in 16 bits this way", 'set precision "bf16" (bf16.enabled true), '
                             "or remove it")


LOW_PRECISION_RULES = (
    Rule("master_weights_dtype", ("stage",), lambda v: v["master_weights_dtype"] is not None and v["stage"] == 0,
         lambda v, n: f"needs ZeRO stage 1, 2 or 3 ({n('stage')} is 0), as DeepSpeed's "
                      "bf16_master_weights_and_grads does", "set stage 1 or higher, or remove it"),
    _needs_bf16("master_weights_dtype"),
    _needs_bf16("optimizer_state_dtype"),
    Rule("optimizer_state_dtype", ("master_weights_dtype",),
         lambda v: v["optimizer_state_dtype"] is not None and v["master_weights_dtype"] is None,
         lambda v, n: f"needs bf16 master weights ({n('master_weights_dtype')} is off): bf16 optimizer states "
                      "require bf16_master_weights_and_grads, as in DeepSpeed",
         'also set master_weights_dtype "bfloat16" (bf16.bf16_master_weights_and_grads true), or remove it'),
    Rule("master_weights_dtype", ("offload_optimizer", "zenflow"),
         lambda v: v["master_weights_dtype"] is not None and (v["offload_optimizer"] == "nvme" or bool(v["zenflow"])),
         lambda v, n: "is not available with " + (f"{n('offload_optimizer')} 'nvme'" if v["offload_optimizer"] ==
                                                   "nvme" else n("zenflow")) +
                      ": that path keeps an fp32 master and fp32 moments of its own",
         'use offload_optimizer "cpu" (its host state is kept in bf16 too) or no offload, or remove it'),
    Rule("stochastic_rounding", ("master_weights_dtype",),
         lambda v: v["stochastic_rounding"] and v["master_weights_dtype"] is None,
         lambda v, n: f"has nothing to round: {n('master_weights_dtype')} is off, so the update is stored in the "
                      "fp32 master", 'set master_weights_dtype "bfloat16", or remove it'),
)
PARAM_NVME = ("needs offload_optimizer \"nvme\": the params live in the NVMe optimizer store's files, beside "
              "the fp32 master and Adam moments, and the store writes them back after each update")
NONTRAINABLE = ("zerojax has no frozen leaves to store quantized (every leaf of the params tree gets a gradient "
                "and an optimizer update), so every weight is stored at full width")


RULES: tuple = (
    Rule("offload_param", ("stage",), lambda v: v["offload_param"] is not None and v["stage"] != 3,
         lambda v, n: f"needs ZeRO stage 3 ({n('stage')} is {v['stage']}): parameters are offloaded only with ZeRO-3",
         "set stage 3, or remove offload_param and offload only the optimizer (offload_optimizer)",
         on_deepspeed="ignore"),
    Rule("offload_optimizer", ("stage",), lambda v: v["offload_optimizer"] is not None and v["stage"] == 0,
         lambda v, n: f"needs ZeRO stage 1, 2 or 3 ({n('stage')} is 0): offload moves the partitioned "
                      "optimizer state", "set stage to 1 or higher"),
    # ZeRO-Infinity's params on NVMe live in the NVMe optimizer store's slots (zerojax.offload._nvme_params)
    Rule("offload_param", ("offload_optimizer",),
         lambda v: v["offload_param"] == "nvme" and v["offload_optimizer"] != "nvme", lambda v, n: PARAM_NVME,
         'set offload_optimizer to "nvme" too (DeepSpeed\'s ZeRO-Infinity config), or use offload_param "cpu" '
         "(params in pinned host memory)"),
    Rule("nvme_path", ("offload_optimizer",),
         lambda v: not v["nvme_path"] and v["offload_optimizer"] == "nvme",
         lambda v, n: f"is missing: offloading to \"nvme\" ({n('offload_optimizer')}) needs a directory",
         'set nvme_path to a directory on a local NVMe drive, e.g. "/local_nvme"'),
    Rule("sub_group_size", ("offload_optimizer",),
         lambda v: v["sub_group_size"] == 0 and v["offload_optimizer"] == "nvme",
         lambda v, n: f"with {n('offload_optimizer')} 'nvme' has no zerojax counterpart: DeepSpeed then makes one "
                      "sub-group per parameter, while zerojax's NVMe store moves a flat range of elements at a time",
         "use a positive number of elements, e.g. DeepSpeed's default 1e9"),
    Rule("offload_ratio", ("stage",), lambda v: v["offload_ratio"] < 1 and v["stage"] != 3,
         lambda v, n: f"needs ZeRO stage 3 ({n('stage')} is {v['stage']}): partial optimizer offload "
                      "(ratio < 1) is a ZeRO-3 feature", "use ratio 1.0 or stage 3"),
    *(_stage3_tuning(f) for f in ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                                  "max_reuse_distance")),
    # ZeRO++ below stage 3: DeepSpeed reads the keys and ignores them; so does zerojax, warning
    *(_stage3_tuning(f, "warn") for f in ZEROPP),
    *LOW_PRECISION_RULES,
)


# --------------------------------------------------------------------------- messages
def subject(field: str, value, path: Optional[str] = None) -> str:
    """How a message names a value: the DeepSpeed key and the field, or the field alone."""
    return f"{path}={value!r} (ZeroConfig.{field})" if path else f"ZeroConfig.{field}={value!r}"


def invalid_message(field: str, value, expected: str, path: Optional[str] = None) -> str:
    return f"{subject(field, value, path)} is invalid: expected {expected}. Fix: {FIELDS[field].fix}"


def rule_message(rule: Rule, values: Mapping, paths: Optional[Mapping] = None, consequence: str = "") -> str:
    """The rule's one message; ``consequence`` (what happens instead of an error) goes before the fix."""
    paths = paths or {}

    def name_of(f):
        return paths.get(f) or f"ZeroConfig.{f}"

    text = f"{subject(rule.field, values[rule.field], paths.get(rule.field))} {rule.text(values, name_of)}"
    return f"{text}.{consequence} Fix: {rule.fix}"


def precision_message(paths: Mapping) -> str:
    """fp16 and bf16 both enabled: the one rule of the two flags behind ZeroConfig.precision."""
    return (f"{paths.get('fp16', 'fp16.enabled')} and {paths.get('bf16', 'bf16.enabled')} are both true "
            "(ZeroConfig.precision): bfloat16 and fp16 modes cannot be simultaneously enabled. "
            "Fix: set one of them to false (bf16 needs no loss scaling)")


# --------------------------------------------------------------------------- validation
def check_field(field: str, value, path: Optional[str] = None):
    """The field's normalised value, or ConfigError naming it (and ``path``)."""
    try:
        return FIELDS[field].check(value)
    except Invalid as e:
        raise ConfigError(invalid_message(field, value, str(e), path)) from None


def broken_rules(values: Mapping, skip=()) -> list:
    """The rules ``values`` break, leaving out those reading a field in ``skip`` or one that
    ``values`` does not hold."""
    return [r for r in RULES if not {r.field, *r.reads} & set(skip) and {r.field, *r.reads} <= set(values)
            and r.broken(values)]


def validate(values: Mapping, paths: Optional[Mapping] = None) -> dict:
    """Every field of ``values`` checked and normalised, then every rule ZeroConfig enforces;
    raises ConfigError naming the field (and its DeepSpeed key from ``paths``) and the fix."""
    paths = paths or {}
    unknown = [k for k in values if k not in FIELDS]
    if unknown:
        raise ConfigError(f"ZeroConfig has no field {unknown[0]!r}. {did_you_mean(unknown[0], FIELDS)}")
    out = {k: check_field(k, v, paths.get(k)) for k, v in values.items()}
    merged = {**defaults(), **out}
    for rule in broken_rules(merged):
        if rule.on_zeroconfig == "error":
            raise ConfigError(rule_message(rule, merged, paths))
        if rule.on_zeroconfig == "warn":
            warnings.warn(rule_message(rule, merged, paths, consequence=" zerojax accepts and ignores it."),
                          IgnoredKeysWarning, stacklevel=4)
    return out


def defaults() -> dict:
    """ZeroConfig's own default of every field."""
    return {k: f.default for k, f in FIELDS.items()}
