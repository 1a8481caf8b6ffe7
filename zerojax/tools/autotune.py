"""autotune: the fastest ZeRO configuration that fits a device memory budget.

    result = zj.autotune(init_fn, loss_fn, lambda mb: {"tokens": jax.ShapeDtypeStruct((mb, 1025), jnp.int32)},
                         devices=64, budget="80GiB", config=zj.ZeroConfig(precision="bf16"))
    print(result)                      # every candidate: stage, offload, micro-batch, peak, fits, time
    result.best.config                 # the recommendation as a ZeroConfig
    result.deepspeed_config()          # ... and as a DeepSpeed JSON dict

    python -m zerojax.tools.autotune --model gpt2-small --devices 64 --budget 80GiB

The candidates are ZeRO stages x offload choices (none, the optimizer to the CPU, optimizer and
params to the CPU for stage 3) x micro-batch sizes. Whether a candidate fits is never guessed:
``zj.plan_step`` compiles its step for N devices and the compiled peak per device is compared
with the budget. The fitting candidates are ranked by throughput (samples per second), measured
by a few real steps each with ``timed=True`` when this process has the N devices, and otherwise
estimated by :class:`CostModel`.

How the search spends compilations (each one is the real step, seconds to minutes for a large
model), as DeepSpeed's autotuner does, which stops exploring a stage once a lower one fits:

* configurations are visited in the cost model's order: no offload, then optimizer offload, then
  optimizer + param offload, and stages 0, 1, 2, 3 within each. At an equal micro-batch an
  earlier configuration never moves more data (the same compute, no more collective volume, no
  more host traffic), so a configuration is compiled only at micro-batches larger than the
  largest one an earlier configuration fits;
* within a configuration, the largest fitting micro-batch is found by bisection: the peak
  grows with the micro-batch, so the candidates below a fitting one fit and those above a
  failing one do not. The table says which rows were settled this way, without compiling.

``exhaustive=True`` compiles every candidate. ``timed=True`` compiles each configuration's
micro-batches in increasing order until one exceeds the budget and times every fitting one.

Where the step is compiled for the CPU (simulated devices, always the case when this process
has fewer than N devices) every memory kind shares one address space, so the compiled peak
includes the state that offloading keeps in host memory; that host-resident state (``zj.estimate``
of the candidate) is subtracted to give the device peak. Accelerator compilers account host
memory separately, and their peak is taken as is.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.config import ZeroConfig
from zerojax.errors import AutotuneError, ConfigError
from zerojax.mesh import make_mesh
from zerojax.stages.gradients import loss_arity
from zerojax.state import shard_train_state
from zerojax.step import make_train_step
from zerojax.tools.planning import Ref, StepPlan, gpt_sizes, named_gpt, plan_step, resolve

# ``python -m zerojax.tools.autotune`` runs this module as __main__ after ``import zerojax`` has imported it
# once (the package exports ``autotune``); runpy warns about exactly that, harmlessly here
warnings.filterwarnings("ignore", message="'zerojax.tools.autotune' found in sys.modules", category=RuntimeWarning)

__all__ = ["AutotuneError", "AutotuneResult", "CostModel", "Row", "autotune", "parse_bytes"]

# offload choice -> (offload_optimizer, offload_param), in the order the search visits them
OFFLOADS = {"none": (None, None), "optimizer": ("cpu", None), "optimizer+param": ("cpu", "cpu")}

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


def parse_bytes(value: Union[int, float, str]) -> int:
    """``80 * 2**30``, ``"80GiB"``, ``"80 GB"``, ``"512MiB"`` -> bytes."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"budget={value!r} must be a positive number of bytes, e.g. 80 * 2**30 or '80GiB'")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{value!r} is not an amount of memory: write e.g. '80GiB', '40GB', '512MiB' or a "
                          "number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def _size(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


# ------------------------------------------------------------------------------ cost model
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Estimated seconds of one optimizer step, for ranking candidates that are not run.

    step = compute + collectives + offload traffic, none of them overlapped:

    * compute = GAS x (flops of one micro-batch / ``device_flops`` + ``micro_batch_latency``):
      the flops are the matrix-multiply flops of ``value_and_grad(loss_fn)`` on one device's
      micro-batch, counted from its jaxpr (a ``lax.scan`` body times its length); the fixed
      latency per micro-batch is why larger micro-batches have higher throughput;
    * collectives = the compiled step's collective elements per device x the bytes they travel
      in (2 under bf16/fp16, else 4) / ``link_bandwidth``; ZeRO's volumes make this grow with
      the stage (2Ψ for stages 0 and 1, (GAS + 1)Ψ for 2, 3Ψ·GAS for 3);
    * offload = 2 x host-resident bytes per device / ``host_bandwidth``: offloaded state is
      fetched to the device and written back every step.

    The defaults describe one current data-centre GPU; pass your hardware's figures.
    """

    device_flops: float = 200e12  # sustained matrix-multiply FLOP/s of one device
    micro_batch_latency: float = 2e-3  # fixed seconds per micro-batch (launches, small ops)
    link_bandwidth: float = 100e9  # bytes/s a device moves in collectives
    host_bandwidth: float = 20e9  # bytes/s between a device and host memory

    def seconds(self, flops: float, gas: int, collective_elements: float, comm_itemsize: int,
                host_bytes: float) -> float:
        compute = gas * (flops / self.device_flops + self.micro_batch_latency)
        collectives = collective_elements * comm_itemsize / self.link_bandwidth
        return compute + collectives + 2 * host_bytes / self.host_bandwidth


def _matmul_flops(jaxpr) -> float:
    """Matrix-multiply and convolution flops of a jaxpr (2 per multiply-add); scan bodies count
    ``length`` times, the costliest ``cond`` branch once, ``while`` bodies once."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
        elif name == "conv_general_dilated":
            rhs, spec = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[d] for d in spec[1:])
        subs = [s.jaxpr if hasattr(s, "consts") else s for v in eqn.params.values()
                for s in (v if isinstance(v, (tuple, list)) else (v,)) if hasattr(s, "eqns") or hasattr(s, "consts")]
        if not subs:
            continue
        counts = [_matmul_flops(s) for s in subs]
        if name == "cond":
            total += max(counts)
        else:
            total += sum(counts) * (eqn.params["length"] if name == "scan" else 1)
    return total


def _step_flops(loss_fn, shapes, micro_batch, has_aux: bool) -> float:
    """Flops of value_and_grad(loss_fn) on one device's micro-batch (shapes only)."""
    loss = resolve(loss_fn)
    args = (jax.random.PRNGKey(0),) if loss_arity(loss) == 3 else ()
    closed = jax.make_jaxpr(jax.value_and_grad(lambda p, b: loss(p, b, *args), has_aux=has_aux))(shapes, micro_batch)
    return _matmul_flops(closed.jaxpr)


# ------------------------------------------------------------------------------ the table
@dataclasses.dataclass
class Row:
    """One candidate: a stage, an offload choice and a micro-batch per device."""

    stage: int
    offload: str  # "none" | "optimizer" | "optimizer+param"
    micro_batch: int
    gradient_accumulation_steps: int
    devices: int
    config: ZeroConfig  # the candidate's full config, batch keys included
    peak_bytes: Optional[int] = None  # compiled peak per device, device memory (None: not compiled)
    host_bytes: Optional[int] = None  # offloaded state per device in host memory (None: not compiled)
    fits: Optional[bool] = None  # None: not settled (a configuration earlier in the order fits)
    est_seconds: Optional[float] = None  # per optimizer step, CostModel
    measured_seconds: Optional[float] = None  # per optimizer step, median of the timed steps
    reason: str = ""
    plan: Optional[StepPlan] = dataclasses.field(default=None, repr=False)

    @property
    def samples_per_step(self) -> int:
        return self.devices * self.gradient_accumulation_steps * self.micro_batch

    @property
    def seconds(self) -> Optional[float]:
        """The ranking's time per step: measured when timed, else estimated."""
        return self.measured_seconds if self.measured_seconds is not None else self.est_seconds

    @property
    def samples_per_second(self) -> Optional[float]:
        return None if not self.seconds else self.samples_per_step / self.seconds

    @property
    def compiled(self) -> bool:
        return self.plan is not None


@dataclasses.dataclass
class AutotuneResult:
    """The recommendation (``best``), every candidate considered (``table``) and how they were ranked."""

    best: Optional[Row]  # None only on AutotuneError.result
    table: List[Row]
    budget: int
    host_budget: Optional[int]
    devices: int
    n_params: int
    ranked_by: str  # "measured time" | "the cost model"
    cost_model: CostModel
    seconds: float  # wall time of the search
    compilations: int

    def deepspeed_config(self, row: Optional[Row] = None) -> dict:
        """``row`` (default: the best) as a DeepSpeed JSON config, readable by ``ZeroConfig.from_deepspeed``."""
        row = row or self.best
        if row is None:
            raise ConfigError("no candidate fits the budget, so there is no configuration to write")
        return deepspeed_dict(row.config)

    def __str__(self) -> str:
        b = self.best
        precision = (b or self.table[0]).config.precision
        host = "" if self.host_budget is None else f" and {_size(self.host_budget)} host"
        n = self.compilations
        lines = [
            f"autotune: {self.n_params / 1e6:,.2f}M params on {self.devices} devices, budget {_size(self.budget)} "
            f"per device{host}, {precision}; ranked by {self.ranked_by}; {n} compilation{'s' * (n != 1)} in "
            f"{self.seconds:.1f}s",
            f"{'':2}{'stage':>5}  {'offload':<15}{'micro':>6}{'GAS':>5}{'peak/device':>13}{'host/device':>13}"
            f"{'fits':>6}{'est s/step':>12}{'measured':>10}{'samples/s':>12}  note",
        ]

        def num(x, fmt):
            return "-" if x is None else format(x, fmt)

        for r in self.table:
            mark = "*" if r is b else " "
            fits = {True: "yes", False: "no", None: "?"}[r.fits]
            lines.append(f"{mark} {r.stage:>5}  {r.offload:<15}{r.micro_batch:>6}{r.gradient_accumulation_steps:>5}"
                         f"{_size(r.peak_bytes):>13}{_size(r.host_bytes):>13}{fits:>6}{num(r.est_seconds, '.4g'):>12}"
                         f"{num(r.measured_seconds, '.4g'):>10}{num(r.samples_per_second, ',.1f'):>12}  {r.reason}")
        if b is None:
            lines.append("best: nothing fits")
        else:
            lines.append(f"best: stage {b.stage}, offload {b.offload}, micro-batch {b.micro_batch} x GAS "
                         f"{b.gradient_accumulation_steps} x {self.devices} devices, peak {_size(b.peak_bytes)} "
                         "per device")
        return "\n".join(lines)


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


# ------------------------------------------------------------------------------ the search
_NO_FIT = """\
no candidate fits the budget of {budget} per device on {devices} devices: the smallest peak compiled was \
{peak} ({where}).
Fix, cheapest first:
{fixes}"""


def _default_budget() -> int:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # backends without memory statistics raise various errors
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        raise ConfigError(f"the memory of this process's {jax.devices()[0].platform} devices is unknown, so there "
                          "is no default budget: pass budget=<bytes per device>, e.g. budget='80GiB'")
    return int(limit)


def _global_batch(micro, rows: int):
    """Per-device micro-batch leaves (arrays or ShapeDtypeStructs) -> global-batch leaves of ``rows`` rows."""
    def one(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype") or not len(x.shape):
            raise ConfigError(f"batch_fn must return a tree of arrays or jax.ShapeDtypeStruct with a leading "
                              f"micro-batch dimension, got a leaf {x!r}")
        return jax.ShapeDtypeStruct((x.shape[0] * rows,) + tuple(x.shape[1:]), x.dtype)
    return jax.tree_util.tree_map(one, micro)


def _concrete_batch(micro, copies: int):
    """Real data for timed steps: the micro-batch's arrays tiled, or zeros for shapes."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return np.zeros((x.shape[0] * copies,) + tuple(x.shape[1:]), x.dtype)
        return np.concatenate([np.asarray(x)] * copies, axis=0)
    return jax.tree_util.tree_map(one, micro)


def _named_model(model: str, seq_len: Optional[int]):
    sizes = gpt_sizes()
    if model not in sizes:
        raise ConfigError(f"model={model!r} is not a named model: choose one of {sorted(sizes)} or pass "
                          "init_fn, loss_fn and batch_fn")
    cfg, init_fn, loss_fn = named_gpt(model, seq_len)
    return init_fn, loss_fn, functools.partial(_token_batch, cfg.seq_len + 1)


def _token_batch(length: int, micro_batch: int):
    return {"tokens": jax.ShapeDtypeStruct((micro_batch, length), jnp.int32)}


def _candidates(base: ZeroConfig, devices: int, stages, offloads, micro_batches, train_batch_size) -> List[Row]:
    rows = []
    for offload in OFFLOADS:
        if offload not in offloads:
            continue
        for stage in stages:
            if (offload != "none" and stage == 0) or (offload == "optimizer+param" and stage != 3):
                continue
            opt, par = OFFLOADS[offload]
            for mb in micro_batches:
                gas, reason = base.gradient_accumulation_steps, ""
                if train_batch_size is not None:
                    gas, rem = divmod(train_batch_size, devices * mb)
                    if rem or gas < 1:
                        gas, reason = 1, (f"train_batch_size {train_batch_size} is not a multiple of {devices} "
                                          f"devices x micro-batch {mb}")
                cfg = base.replace(stage=stage, offload_optimizer=opt, offload_param=par,
                                   gradient_accumulation_steps=gas, train_micro_batch_size_per_gpu=mb,
                                   train_batch_size=devices * gas * mb)
                row = Row(stage, offload, mb, gas, devices, cfg, reason=reason)
                if reason:
                    row.fits = False
                rows.append(row)
    return rows


def _check_choices(stages, offloads, micro_batches) -> Tuple[tuple, tuple, tuple]:
    stages = tuple(sorted(set(int(s) for s in stages)))
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(f"stages={stages!r} must be a non-empty selection of 0, 1, 2, 3")
    offloads = tuple(offloads)
    unknown = [o for o in offloads if o not in OFFLOADS]
    if not offloads or unknown:
        raise ConfigError(f"offloads={offloads!r}: each must be one of {list(OFFLOADS)}")
    mbs = tuple(sorted(set(int(m) for m in micro_batches)))
    if not mbs or mbs[0] < 1:
        raise ConfigError(f"micro_batches={micro_batches!r} must be positive integers")
    return stages, offloads, mbs


def _exceeds(micro_batch: int) -> str:
    return (f"not compiled: micro-batch {micro_batch} already exceeds the budget "
            "(the peak grows with the micro-batch)")


class _Search:
    """Compiles candidates with plan_step and fills their rows."""

    def __init__(self, init_fn, loss_fn, batch_fn, shapes, tx, devices, budget, host_budget, cost_model,
                 has_aux, param_specs, timeout, verbose):
        self.init_fn, self.loss_fn, self.batch_fn, self.shapes, self.tx = init_fn, loss_fn, batch_fn, shapes, tx
        self.devices, self.budget, self.host_budget, self.cost = devices, budget, host_budget, cost_model
        self.has_aux, self.param_specs, self.timeout, self.verbose = has_aux, param_specs, timeout, verbose
        self.compilations = 0
        self._flops: Dict[int, float] = {}

    def log(self, text: str) -> None:
        if self.verbose:
            print(text, file=sys.stderr, flush=True)

    def flops(self, mb: int) -> float:
        if mb not in self._flops:
            self._flops[mb] = _step_flops(self.loss_fn, self.shapes, self.batch_fn(mb), self.has_aux)
        return self._flops[mb]

    def compile(self, row: Row) -> bool:
        rows = self.devices * row.gradient_accumulation_steps
        batch = _global_batch(self.batch_fn(row.micro_batch), rows)
        self.log(f"autotune: compiling stage {row.stage}, offload {row.offload}, micro-batch {row.micro_batch} "
                 f"x GAS {row.gradient_accumulation_steps} on {self.devices} devices ...")
        plan = plan_step(self.shapes, self.loss_fn, batch, devices=self.devices, config=row.config, tx=self.tx,
                         param_specs=self.param_specs, has_aux=self.has_aux, timeout=self.timeout)
        self.compilations += 1
        row.plan, row.peak_bytes, row.host_bytes = plan, plan.device_peak_bytes, plan.stored_host_bytes
        over = []
        if row.peak_bytes > self.budget:
            over.append(f"peak {_size(row.peak_bytes)} > budget {_size(self.budget)}")
        if self.host_budget is not None and row.host_bytes > self.host_budget:
            over.append(f"host {_size(row.host_bytes)} > host budget {_size(self.host_budget)}")
        row.fits = not over
        row.reason = "; ".join(over) if over else "fits"
        itemsize = 4 if row.config.precision == "fp32" else 2
        row.est_seconds = self.cost.seconds(self.flops(row.micro_batch), row.gradient_accumulation_steps,
                                            plan.collective_elements, itemsize, row.host_bytes)
        self.log(f"autotune:   peak {_size(row.peak_bytes)} per device -> {row.reason}")
        return row.fits

    def ascending(self, rows: List[Row], stop_at_failure: bool) -> None:
        failed = None
        for row in rows:
            if failed is not None and stop_at_failure:
                row.fits, row.reason = False, _exceeds(failed)
            elif not self.compile(row):
                failed = row.micro_batch

    def bisect(self, rows: List[Row]) -> None:
        lo, hi = 0, len(rows)  # rows[:lo] fit, rows[hi:] do not
        while lo < hi:
            mid = (lo + hi - 1) // 2  # the lower middle: after an earlier configuration, larger ones rarely fit
            if self.compile(rows[mid]):
                lo = mid + 1
            else:
                hi = mid
        for i, row in enumerate(rows):
            if not row.compiled and i < lo:
                row.fits, row.reason = True, (f"fits: micro-batch {rows[lo - 1].micro_batch} does (the peak grows "
                                              "with the micro-batch); not compiled")
            elif not row.compiled:
                row.fits, row.reason = False, _exceeds(rows[hi].micro_batch)

    def measure(self, row: Row, warmup: int, steps: int) -> None:

        self.log(f"autotune: timing stage {row.stage}, offload {row.offload}, micro-batch {row.micro_batch} ...")
        batch = _concrete_batch(self.batch_fn(row.micro_batch), self.devices * row.gradient_accumulation_steps)
        state = shard_train_state(resolve(self.init_fn), resolve(self.tx), mesh=make_mesh(self.devices),
                                  config=row.config, rng=jax.random.PRNGKey(0), param_specs=self.param_specs)
        step = make_train_step(resolve(self.loss_fn), state, has_aux=self.has_aux)
        for _ in range(warmup):
            state, metrics = step(state, batch)
        jax.block_until_ready((state.params, state.opt_state))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state.params, state.opt_state, metrics["loss"]))
            times.append(time.perf_counter() - t0)
        row.measured_seconds = statistics.median(times)
        del state, step


def autotune(
    init_fn: Union[Callable, str, Ref, None] = None,
    loss_fn: Union[Callable, str, Ref, None] = None,
    batch_fn: Optional[Callable[[int], Any]] = None,
    *,
    model: Optional[str] = None,
    devices: Optional[int] = None,
    budget: Union[int, str, None] = None,
    host_budget: Union[int, str, None] = None,
    config: Optional[ZeroConfig] = None,
    tx=None,
    stages: Sequence[int] = (0, 1, 2, 3),
    offloads: Sequence[str] = tuple(OFFLOADS),
    micro_batches: Optional[Sequence[int]] = None,
    max_micro_batch: int = 16,
    train_batch_size: Optional[int] = None,
    timed: bool = False,
    warmup: int = 2,
    steps: int = 5,
    exhaustive: bool = False,
    cost_model: Optional[CostModel] = None,
    seq_len: Optional[int] = None,
    param_specs=None,
    has_aux: bool = False,
    timeout: Optional[float] = None,
    verbose: bool = False,
) -> AutotuneResult:
    """Recommend the fastest stage, offload choice and micro-batch that fit ``budget`` per device.

    ``init_fn(rng) -> params`` (or a params tree of shapes) and ``loss_fn(params, batch)`` as for
    ``zj.plan_step`` (importable by reference when this process has fewer than ``devices`` devices);
    ``batch_fn(micro_batch)`` returns one device's micro-batch: a tree of ``jax.ShapeDtypeStruct``
    or arrays with that many rows (arrays are used by timed runs, shapes become zeros there).
    ``model="gpt2-small"`` (or another of ``zerojax.tools.planning.gpt_sizes()``) stands for all three.

    ``budget`` (bytes or ``"80GiB"``) defaults to the memory of this process's first device when
    the backend reports it; ``host_budget`` bounds the offloaded bytes per device. ``config``
    carries everything but the stage and offload (precision, clipping, buckets, gradient
    accumulation); ``train_batch_size`` instead fixes the global batch, the gradient accumulation
    then following each micro-batch. ``micro_batches`` defaults to the powers of two up to
    ``max_micro_batch``. ``timed=True`` ranks by real steps (``warmup`` then ``steps`` timed, the
    median kept), which needs ``devices`` devices in this process. See the module docstring for
    the search and :class:`CostModel` for the ranking without timing.

    Raises :class:`AutotuneError` (a ConfigError) when nothing fits, naming the smallest peak.

        result = zj.autotune(model="gpt2-small", devices=64, budget="80GiB")
        print(result); result.best.config
    """
    t_start = time.perf_counter()
    if model is not None:
        if init_fn is not None or loss_fn is not None or batch_fn is not None:
            raise ConfigError("pass either model= or init_fn, loss_fn and batch_fn, not both")
        init_fn, loss_fn, batch_fn = _named_model(model, seq_len)
        config = ZeroConfig(precision="bf16") if config is None else config
    elif init_fn is None or loss_fn is None or batch_fn is None:
        raise ConfigError("autotune needs init_fn, loss_fn and batch_fn(micro_batch) -> one device's micro-batch "
                          "shapes, or model='gpt2-small' (see zerojax.tools.planning.gpt_sizes())")
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config={config!r} is not a ZeroConfig: pass zj.ZeroConfig(precision=...) with the "
                          "settings every candidate shares")
    devices = len(jax.devices()) if devices is None else int(devices)
    if devices < 1:
        raise ConfigError(f"devices={devices!r} must be >= 1")
    budget = _default_budget() if budget is None else parse_bytes(budget)
    host_budget = None if host_budget is None else parse_bytes(host_budget)
    if micro_batches is None:
        if max_micro_batch < 1:
            raise ConfigError(f"max_micro_batch={max_micro_batch!r} must be >= 1")
        micro_batches = [2**i for i in range(int(math.log2(max_micro_batch)) + 1)]
    stages, offloads, micro_batches = _check_choices(stages, offloads, micro_batches)
    if timed and len(jax.devices()) < devices:
        raise ConfigError(f"timed=True runs real steps on {devices} devices but this process has "
                          f"{len(jax.devices())}: run it where the devices are, or rank by the cost model "
                          "(timed=False)")
    tx = Ref("optax:adamw", 1e-4) if tx is None else tx
    resolved_init = resolve(init_fn)
    shapes = jax.eval_shape(resolved_init, jax.random.PRNGKey(0)) if callable(resolved_init) else resolved_init
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))

    search = _Search(init_fn, loss_fn, batch_fn, shapes, tx, devices, budget, host_budget,
                     cost_model or CostModel(), has_aux, param_specs, timeout, verbose)
    table = _candidates(config, devices, stages, offloads, micro_batches, train_batch_size)
    groups: Dict[Tuple[int, str], List[Row]] = {}
    for row in table:
        groups.setdefault((row.stage, row.offload), []).append(row)
    frontier, frontier_at = 0, None
    for (stage, offload), rows in groups.items():
        rows = [r for r in rows if r.fits is None]  # rows with an impossible batch are settled
        if exhaustive or timed:
            search.ascending(rows, stop_at_failure=not exhaustive)
        else:
            for r in rows:
                if r.micro_batch <= frontier:
                    r.reason = (f"not compiled: stage {frontier_at[0]}, offload {frontier_at[1]} fits micro-batch "
                                f"{frontier} and moves no more data")
            search.bisect([r for r in rows if r.micro_batch > frontier])
        fitting = [r.micro_batch for r in rows if r.fits]
        if fitting and max(fitting) > frontier:
            frontier, frontier_at = max(fitting), (stage, offload)

    ranked = [r for r in table if r.fits and r.compiled]
    if not ranked:
        compiled = [r for r in table if r.compiled]
        err = AutotuneError(_no_fit_message(compiled, budget, devices, offloads, micro_batches))
        err.result = AutotuneResult(None, table, budget, host_budget, devices, n_params, "the cost model",
                                    search.cost, time.perf_counter() - t_start, search.compilations)
        raise err
    if timed:
        for r in ranked:
            search.measure(r, warmup, steps)
    best = max(ranked, key=lambda r: (r.samples_per_second, -r.stage, -list(OFFLOADS).index(r.offload)))
    return AutotuneResult(best, table, budget, host_budget, devices, n_params,
                          "measured time" if timed else "the cost model", search.cost,
                          time.perf_counter() - t_start, search.compilations)


def _no_fit_message(compiled: List[Row], budget: int, devices: int, offloads, micro_batches) -> str:
    if not compiled:
        return (f"no candidate could be compiled for a budget of {_size(budget)}: every micro-batch in "
                f"{list(micro_batches)} is incompatible with train_batch_size; pick micro-batches that divide it")
    low = min(compiled, key=lambda r: r.peak_bytes)
    fixes = []
    if micro_batches[0] > 1:
        fixes.append(f"a micro-batch below {micro_batches[0]}, with gradient accumulation for the same global batch")
    untried = [o for o in ("optimizer", "optimizer+param") if o not in offloads]
    if untried:
        fixes.append(f"offload: add {' and '.join(repr(o) for o in untried)} to offloads")
    fixes += [f"more devices: stages 1-3 divide the partitioned state by the device count (devices={2 * devices})",
              "a larger budget (budget=...), shorter sequences or a smaller model"]
    return _NO_FIT.format(budget=_size(budget), devices=devices, peak=_size(low.peak_bytes),
                          where=f"stage {low.stage}, offload {low.offload}, micro-batch {low.micro_batch}",
                          fixes="\n".join(f"  - {f};" for f in fixes)[:-1] + ".")


# ------------------------------------------------------------------------------ command line
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m zerojax.tools.autotune --model gpt2-small --devices 64 --budget 80GiB``"""
    p = argparse.ArgumentParser(prog="python -m zerojax.tools.autotune",
                                description="recommend the fastest ZeRO stage, offload choice and micro-batch "
                                            "that fit a device memory budget (compiling the real step for N "
                                            "simulated devices)")
    p.add_argument("--model", required=True, choices=sorted(gpt_sizes()))
    p.add_argument("--devices", type=int, required=True, help="data-parallel devices N")
    p.add_argument("--budget", default=None, help="device memory per device, e.g. 80GiB (default: this "
                                                  "process's device memory, when known)")
    p.add_argument("--host-budget", default=None, help="host memory per device for offloaded state")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated stages (default: %(default)s)")
    p.add_argument("--offloads", default=",".join(OFFLOADS), help="comma-separated offload choices among "
                                                                   f"{', '.join(OFFLOADS)} (default: all)")
    p.add_argument("--max-micro-batch", type=int, default=16, help="try powers of two up to this")
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length")
    p.add_argument("--exhaustive", action="store_true", help="compile every candidate")
    p.add_argument("--timed", action="store_true", help="rank by real steps (needs the devices here)")
    p.add_argument("--json", action="store_true", help="also print the recommendation as DeepSpeed JSON")
    args = p.parse_args(argv)
    import json

    try:
        result = autotune(model=args.model, devices=args.devices, budget=args.budget, host_budget=args.host_budget,
                          config=ZeroConfig(precision=args.precision, gradient_accumulation_steps=args.gas),
                          stages=[int(s) for s in args.stages.split(",")], offloads=args.offloads.split(","),
                          max_micro_batch=args.max_micro_batch, seq_len=args.seq_len, exhaustive=args.exhaustive,
                          timed=args.timed, verbose=True)
    except AutotuneError as e:
        if e.result is not None:
            print(e.result)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result)
    if args.json:
        print(json.dumps(result.deepspeed_config(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
