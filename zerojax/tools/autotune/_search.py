"""The search: compile candidates with ``plan_step`` in the cost model's order, bisect each
configuration's micro-batches, time the fitting ones when asked, and rank them (see the
package docstring)."""
from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.config import ZeroConfig
from zerojax._errors import AutotuneError, ConfigError
from zerojax._mesh import make_mesh
from zerojax._state import shard_train_state
from zerojax._step import make_train_step
from zerojax.tools.autotune._candidates import OFFLOADS, candidate_rows, check_choices
from zerojax.tools.autotune._cost import CostModel, step_flops
from zerojax.tools.autotune._table import AutotuneResult, Row
from zerojax.tools.autotune._units import parse_bytes, size_text
from zerojax.tools._gpu import gpu_target
from zerojax.tools._planning import Ref, gpt_sizes, named_gpt, plan_step, resolve

__all__ = ["autotune"]

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


def _exceeds(micro_batch: int) -> str:
    return (f"not compiled: micro-batch {micro_batch} already exceeds the budget "
            "(the peak grows with the micro-batch)")


class _Search:
    """Compiles candidates with plan_step and fills their rows."""

    def __init__(self, init_fn, loss_fn, batch_fn, shapes, tx, devices, budget, host_budget, cost_model,
                 has_aux, param_specs, timeout, verbose, target=None):
        self.target = target
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
            self._flops[mb] = step_flops(self.loss_fn, self.shapes, self.batch_fn(mb), self.has_aux)
        return self._flops[mb]

    def compile(self, row: Row) -> bool:
        rows = self.devices * row.gradient_accumulation_steps
        batch = _global_batch(self.batch_fn(row.micro_batch), rows)
        self.log(f"autotune: compiling stage {row.stage}, offload {row.offload}, micro-batch {row.micro_batch} "
                 f"x GAS {row.gradient_accumulation_steps} on {self.devices} devices ...")
        plan = plan_step(self.shapes, self.loss_fn, batch, devices=self.devices, config=row.config, tx=self.tx,
                         param_specs=self.param_specs, has_aux=self.has_aux, timeout=self.timeout, target=self.target)
        self.compilations += 1
        row.plan, row.peak_bytes, row.host_bytes = plan, plan.device_peak_bytes, plan.stored_host_bytes
        over = []
        if row.peak_bytes > self.budget:
            over.append(f"peak {size_text(row.peak_bytes)} > budget {size_text(self.budget)}")
        if self.host_budget is not None and row.host_bytes > self.host_budget:
            over.append(f"host {size_text(row.host_bytes)} > host budget {size_text(self.host_budget)}")
        row.fits = not over
        row.reason = "; ".join(over) if over else "fits"
        itemsize = 4 if row.config.precision == "fp32" else 2
        row.est_seconds = self.cost.seconds(self.flops(row.micro_batch), row.gradient_accumulation_steps,
                                            plan.collective_elements, itemsize, row.host_bytes)
        self.log(f"autotune:   peak {size_text(row.peak_bytes)} per device -> {row.reason}")
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
    target: Optional[str] = None,
) -> AutotuneResult:
    """Recommend the fastest stage, offload choice and micro-batch that fit ``budget`` per device.

    ``init_fn(rng) -> params`` (or a params tree of shapes) and ``loss_fn(params, batch)`` as for
    ``zj.plan_step`` (importable by reference when this process has fewer than ``devices`` devices);
    ``batch_fn(micro_batch)`` returns one device's micro-batch: a tree of ``jax.ShapeDtypeStruct``
    or arrays with that many rows (arrays are used by timed runs, shapes become zeros there).
    ``model="gpt2-small"`` (or another of ``zerojax.tools._planning.gpt_sizes()``) stands for all three.

    ``budget`` (bytes or ``"80GiB"``) defaults to the memory of this process's first device when
    the backend reports it; ``host_budget`` bounds the offloaded bytes per device. ``config``
    carries everything but the stage and offload (precision, clipping, buckets, gradient
    accumulation); ``train_batch_size`` instead fixes the global batch, the gradient accumulation
    then following each micro-batch. ``micro_batches`` defaults to the powers of two up to
    ``max_micro_batch``. ``timed=True`` ranks by real steps (``warmup`` then ``steps`` timed, the
    median kept), which needs ``devices`` devices in this process. See the module docstring for
    the search and :class:`CostModel` for the ranking without timing.

    ``target="h100"`` (or ``"h200"``, ``"a100"``) compiles every candidate with XLA's GPU compiler
    for ``devices`` compile-only GPUs of that kind (``zj.plan_step(..., target=...)``), so the
    peaks compared with the budget are XLA:GPU's; ``budget`` then defaults to that GPU's memory.

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
                          "shapes, or model='gpt2-small' (see zerojax.tools._planning.gpt_sizes())")
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config={config!r} is not a ZeroConfig: pass zj.ZeroConfig(precision=...) with the "
                          "settings every candidate shares")
    devices = len(jax.devices()) if devices is None else int(devices)
    if devices < 1:
        raise ConfigError(f"devices={devices!r} must be >= 1")
    if target is not None:
        target = gpu_target(target).name
        if timed:
            raise ConfigError(f"timed=True runs real steps, and target={target!r} compiles for compile-only GPUs: "
                              "pass one or the other")
    if budget is None:
        budget = gpu_target(target).memory_bytes if target is not None else _default_budget()
    else:
        budget = parse_bytes(budget)
    host_budget = None if host_budget is None else parse_bytes(host_budget)
    if micro_batches is None:
        if max_micro_batch < 1:
            raise ConfigError(f"max_micro_batch={max_micro_batch!r} must be >= 1")
        micro_batches = [2**i for i in range(int(math.log2(max_micro_batch)) + 1)]
    stages, offloads, micro_batches = check_choices(stages, offloads, micro_batches)
    if timed and len(jax.devices()) < devices:
        raise ConfigError(f"timed=True runs real steps on {devices} devices but this process has "
                          f"{len(jax.devices())}: run it where the devices are, or rank by the cost model "
                          "(timed=False)")
    tx = Ref("optax:adamw", 1e-4) if tx is None else tx
    resolved_init = resolve(init_fn)
    shapes = jax.eval_shape(resolved_init, jax.random.PRNGKey(0)) if callable(resolved_init) else resolved_init
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))

    search = _Search(init_fn, loss_fn, batch_fn, shapes, tx, devices, budget, host_budget,
                     cost_model or CostModel(), has_aux, param_specs, timeout, verbose, target)
    table = candidate_rows(config, devices, stages, offloads, micro_batches, train_batch_size)
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
        return (f"no candidate could be compiled for a budget of {size_text(budget)}: every micro-batch in "
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
    return _NO_FIT.format(budget=size_text(budget), devices=devices, peak=size_text(low.peak_bytes),
                          where=f"stage {low.stage}, offload {low.offload}, micro-batch {low.micro_batch}",
                          fixes="\n".join(f"  - {f};" for f in fixes)[:-1] + ".")


