"""Memory estimates: DeepSpeed's closed-form estimators and zerojax's exact, shape-only plan.

DeepSpeed's estimators (same names, arguments and formulas) answer "roughly how much CPU and
GPU memory does ZeRO-2/3 need for a model of P parameters":

    cpu, gpu = estimate_zero2_model_states_mem_needs(2851e6, num_gpus_per_node=8, cpu_offload=False)
    estimate_zero3_model_states_mem_needs_all_cold(2851e6, 32e6, num_gpus_per_node=8)  # prints a table

``estimate`` answers exactly what zerojax would store, per device and per memory kind, from the
shapes alone (nothing is allocated, any device count works):

    shapes = jax.eval_shape(lambda k: init_params(GPT2_SMALL, k), jax.random.PRNGKey(0))
    report = zj.estimate(shapes, 512, zj.ZeroConfig(stage=3, precision="bf16"))
    report.max_bytes("device")   # equals zj.memory_report(state) of the real state
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from zerojax._compat import abstract_mesh
from zerojax.config import ZeroConfig
from zerojax._errors import ConfigError
from zerojax._init_rule import abstract_params
from zerojax._low_precision import opt_storage_dtype
from zerojax._plan import ZeroPlan
from zerojax.stages._zeropp import secondary_bytes
from zerojax.tools._report import MemoryReport

GiB = 2**30


# --------------------------------------------------------------------- DeepSpeed's estimators
def _check_counts(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor,
                  largest_layer_params=None) -> None:
    if not total_params > 0:
        raise ConfigError(f"total_params={total_params!r} must be a positive parameter count, e.g. 7e9")
    if largest_layer_params is not None and not 0 < largest_layer_params <= total_params:
        raise ConfigError(f"largest_layer_params={largest_layer_params!r} must be in (0, total_params="
                          f"{total_params:g}]: pass the element count of the model's biggest layer")
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if not (isinstance(value, (int, np.integer)) and value >= 1):
            raise ConfigError(f"{name}={value!r} must be an int >= 1")
    if not additional_buffer_factor > 0:
        raise ConfigError(f"additional_buffer_factor={additional_buffer_factor!r} must be > 0 (DeepSpeed uses 1.5)")


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5) -> Tuple[int, int]:
    """(cpu_bytes, gpu_bytes) DeepSpeed estimates for ZeRO-2 model states.

    Offloaded optimizer: 16-bit params on the GPU (2P); the CPU holds the fp32 master, moments
    and gradients for every local process. Not offloaded: 16-bit params plus 1/G of
    (16-bit grads + 16 bytes of fp32 master and Adam moments).

        >>> cpu, gpu = estimate_zero2_model_states_mem_needs(2851e6, num_gpus_per_node=8)
        >>> round(cpu / 2**30, 2), round(gpu / 2**30, 2)
        (127.45, 5.31)
    """
    _check_counts(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5) -> Tuple[int, int, int]:
    """(cpu_bytes, gpu_bytes, largest_layer_memory) DeepSpeed estimates for ZeRO-3 model states.

    Every GPU needs the largest layer gathered in 16 bits with its 16-bit gradient (4L bytes).
    ``cpu_offload`` offloads the optimizer, ``cpu_offload_params`` also the params (only with
    ``cpu_offload``); ``zero_init`` means the model is created partitioned, so no process
    ever holds a full fp32 copy on the CPU.

        >>> cpu, gpu, _ = estimate_zero3_model_states_mem_needs(2851e6, 32e6, num_gpus_per_node=8)
        >>> round(cpu / 2**30, 2), round(gpu / 2**30, 2)
        (71.69, 0.12)
    """
    _check_counts(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor, largest_layer_params)
    if cpu_offload_params and not cpu_offload:
        raise ConfigError("cpu_offload_params=True needs cpu_offload=True: DeepSpeed offloads params only "
                          "together with the optimizer; set cpu_offload=True or cpu_offload_params=False")
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes  # the host state is partitioned over nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        host_factor = 18 if cpu_offload_params else 16  # + fp32->16-bit param copies when params live there
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        if zero_init:
            cpu_mem = total_params * host_factor * per_node * additional_buffer_factor
        else:  # every local process first builds the full fp32 model on the host
            cpu_mem = total_params * max(4 * num_gpus_per_node, host_factor * per_node) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu_mem = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


@dataclasses.dataclass(frozen=True)
class EstimateRow:
    cpu_bytes: int
    gpu_bytes: int
    options: Tuple[Tuple[str, Any], ...]  # (("offload_optimizer", "cpu"), ...)

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.options)
        return f" {self.cpu_bytes / GiB:8.2f}GiB | {self.gpu_bytes / GiB:7.2f}GiB | {opts}"


@dataclasses.dataclass(frozen=True)
class EstimateTable:
    """The rows of an ``..._all_cold`` estimate; ``str()`` is the table DeepSpeed prints."""

    header: str
    rows: Tuple[EstimateRow, ...]

    def __str__(self) -> str:
        return "\n".join([self.header, "   per CPU   |  per GPU   | options"] + [str(r) for r in self.rows])


def _hw_sw(num_gpus_per_node, num_nodes, model: str) -> str:
    nodes = f"{num_nodes} node" + ("s" if num_nodes > 1 else "")
    gpus = f"{num_gpus_per_node} GPU" + ("s" if num_gpus_per_node > 1 else "")
    return (f"Estimated memory for params, optimizer states and gradients:\n"
            f"HW: {nodes}, {gpus} per node.\nSW: model with {model}.")


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5, print_table=True) -> EstimateTable:
    """DeepSpeed's ZeRO-2 table for both offload choices, from a parameter count.

        estimate_zero2_model_states_mem_needs_all_cold(7e9, num_gpus_per_node=8)
    """
    rows = []
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                                         additional_buffer_factor)
        rows.append(EstimateRow(cpu, gpu, (("offload_optimizer", "cpu" if cpu_offload else "none"),)))
    model = f"{int(total_params / 1e6)}M total params"
    table = EstimateTable(_hw_sw(num_gpus_per_node, num_nodes, model), tuple(rows))
    if print_table:
        print(table)
    return table


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5,
                                                   print_table=True) -> EstimateTable:
    """DeepSpeed's ZeRO-3 table for every offload choice and zero_init, from parameter counts.

        estimate_zero3_model_states_mem_needs_all_cold(7e9, 131e6, num_gpus_per_node=8)
    """
    rows = []
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if cpu_offload_params and not cpu_offload:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload,
                    cpu_offload_params, zero_init, additional_buffer_factor)
                opts = (("offload_param", "cpu" if cpu_offload_params else "none"),
                        ("offload_optimizer", "cpu" if cpu_offload else "none"), ("zero_init", zero_init))
                rows.append(EstimateRow(cpu, gpu, opts))
    model = f"{int(total_params / 1e6)}M total params, {int(largest_layer_params / 1e6)}M largest layer params"
    table = EstimateTable(_hw_sw(num_gpus_per_node, num_nodes, model), tuple(rows))
    if print_table:
        print(table)
    return table


def _count(params) -> Tuple[int, int]:
    """(total, largest leaf) element counts of a tree of arrays or ShapeDtypeStructs."""
    sizes = [math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)]
    if not sizes:
        raise ConfigError("params has no array leaves: pass the model's params tree (or its jax.eval_shape)")
    return sum(sizes), max(sizes)


def estimate_zero2_model_states_mem_needs_all_live(params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5, print_table=True) -> EstimateTable:
    """The ZeRO-2 table for a params tree (arrays or ``jax.ShapeDtypeStruct``s)."""
    total, _ = _count(params)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor, print_table)


def estimate_zero3_model_states_mem_needs_all_live(params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5, print_table=True) -> EstimateTable:
    """The ZeRO-3 table for a params tree; the largest layer is the largest leaf (DeepSpeed: module)."""
    total, largest = _count(params)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor, print_table)


def zero_paper_bytes(total_params, num_devices, stage, precision="bf16", include_grads=True,
                     master_weights_dtype=None, optimizer_state_dtype=None) -> float:
    """Bytes per device of the ZeRO paper's model states (Rajbhandari et al. 2020) for Adam.

    Mixed precision: 2 bytes of params and of grads per parameter, K = 12 optimizer bytes (fp32
    master, m, v); ``precision="fp32"``: 4 + 4 and K = 8. Stage 1 partitions the optimizer
    states over ``num_devices``, stage 2 also the grads, stage 3 also the params.
    ``include_grads=False`` counts what a zerojax TrainState stores (grads live in the step).
    Low-precision states (bf16 only): ``master_weights_dtype="bfloat16"`` drops the fp32 master
    (the 16-bit params are it: K = 8), ``optimizer_state_dtype="bfloat16"`` halves the moments
    (K = 4); 16-bit grads stay 2 bytes. Per parameter, with grads: 16 / 12 / 8; stored: 14 / 10 / 6.

        >>> round(zero_paper_bytes(7.5e9, 64, 3) / 1e9, 1)
        1.9
    """
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage={stage!r} must be one of 0, 1, 2, 3")
    if not (isinstance(num_devices, (int, np.integer)) and num_devices >= 1):
        raise ConfigError(f"num_devices={num_devices!r} must be an int >= 1")
    low = {"master_weights_dtype": master_weights_dtype, "optimizer_state_dtype": optimizer_state_dtype}
    for name, value in low.items():
        if value not in (None, "float32", "bfloat16") or (value == "bfloat16" and precision != "bf16"):
            raise ConfigError(f"{name}={value!r} with precision={precision!r}: low-precision states are "
                              'None (fp32) or "bfloat16", with precision "bf16"')
    if optimizer_state_dtype == "bfloat16" and master_weights_dtype != "bfloat16":
        raise ConfigError('optimizer_state_dtype="bfloat16" needs master_weights_dtype="bfloat16" (as DeepSpeed\'s '
                          "bf16_optimizer_states needs bf16_master_weights_and_grads)")
    p = 4 if precision == "fp32" else 2
    g = p if include_grads else 0
    k = 8 if precision == "fp32" else 12
    k -= 4 if master_weights_dtype == "bfloat16" else 0  # the bf16 params are the master
    k -= 4 if optimizer_state_dtype == "bfloat16" else 0  # two bf16 moments instead of two fp32 ones
    n = num_devices
    params = p / n if stage >= 3 else p
    grads = g / n if stage >= 2 else g
    opt = k / n if stage >= 1 else k
    return (params + grads + opt) * total_params


def estimate_tables(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                    additional_buffer_factor=1.5) -> str:
    """Every stage and offload choice as text: the ZeRO paper's model, then DeepSpeed's tables."""
    devices = num_gpus_per_node * num_nodes
    lines = [f"ZeRO paper model (mixed-precision Adam: params + grads + optimizer states, no buffers), "
             f"per device over {devices} devices:"]
    formulas = ("(2 + 2 + 12)P", "2P + 2P + 12P/N", "2P + (2 + 12)P/N", "(2 + 2 + 12)P/N")
    for stage, f in enumerate(formulas):
        lines.append(f"  stage {stage}  {zero_paper_bytes(total_params, devices, stage) / GiB:9.2f}GiB   {f}")
    z2 = estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node, num_nodes,
                                                        additional_buffer_factor, print_table=False)
    z3 = estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node,
                                                        num_nodes, additional_buffer_factor, print_table=False)
    _, _, llm = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node,
                                                      num_nodes)
    lines += ["", "DeepSpeed estimate_zero2_model_states_mem_needs_all_cold (stage 2):", str(z2),
              "", "DeepSpeed estimate_zero3_model_states_mem_needs_all_cold (stage 3; largest layer working set "
              f"{llm / GiB:.2f}GiB):", str(z3)]
    return "\n".join(lines)


# -------------------------------------------------------------- exact, from the plan's shapes
class Stored(NamedTuple):
    """One stored (global) array: its shape, dtype and sharding."""

    shape: Tuple[int, ...]
    dtype: Any
    sharding: NamedSharding


def _abstract(tree) -> List[Stored]:
    return [Stored(tuple(x.shape), np.dtype(x.dtype), x.sharding) for x in jax.tree_util.tree_leaves(tree)
            if isinstance(x, jax.Array)]


def state_arrays(state) -> Dict[str, List[Stored]]:
    """The stored arrays of a real TrainState, grouped like ``memory_report``'s parts."""
    return {"params": _abstract(state.params), "master": _abstract(state.master),
            "optimizer": _abstract(state.opt_state),
            "other": _abstract((state.step, state.loss_scale, state.rng))}


def plan_arrays(plan: ZeroPlan, tx=None) -> Dict[str, List[Stored]]:
    """The arrays ``shard_train_state(..., tx)`` would store for ``plan``, from shapes alone."""
    tx = optax.adamw(1e-3) if tx is None else tx
    cdt = np.dtype(plan.compute_dtype)
    lays = plan.leaves
    params = [Stored(plan.param_shape(lay), cdt, plan.param_sharding(lay)) for lay in lays]
    master = ([Stored(plan.master_shape(lay), np.dtype(np.float32), plan.master_sharding(lay)) for lay in lays]
              if plan.has_master else [])
    opt_shapes = jax.eval_shape(tx.init, plan.abstract_master())
    leaves = jax.tree_util.tree_leaves(opt_shapes)
    shardings = jax.tree_util.tree_leaves(plan.opt_state_shardings(opt_shapes),
                                          is_leaf=lambda s: isinstance(s, NamedSharding))
    mirrors = plan.opt_leaf_layouts(opt_shapes, stored=False)
    low = plan.config.optimizer_state_dtype is not None  # the float leaves mirroring a param stored in bf16
    opt = [Stored(tuple(x.shape) if lay is None else plan.master_shape(lay),
                  np.dtype(opt_storage_dtype(plan) if low and lay is not None and jnp.issubdtype(x.dtype, jnp.floating)
                           else x.dtype), sh)
           for x, sh, lay in zip(leaves, shardings, mirrors)]
    rep = NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    other_shapes = (jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(plan.config.loss_scaler.init),
                    jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    other = [Stored(tuple(x.shape), np.dtype(x.dtype), rep) for x in jax.tree_util.tree_leaves(other_shapes)]
    return {"params": params, "master": master, "optimizer": opt, "other": other}


def memory_kind(sharding) -> str:
    return getattr(sharding, "memory_kind", None) or "device"


def mesh_device_ids(mesh) -> np.ndarray:
    """Device ids laid out like the mesh (0..n-1 in mesh order for an AbstractMesh)."""
    if isinstance(mesh, Mesh):
        return np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    sizes = tuple(mesh.shape.values())
    return np.arange(math.prod(sizes), dtype=np.int64).reshape(sizes)


def shard_elements(shape, sharding) -> np.ndarray:
    """Elements of a ``shape`` array each mesh position holds (an int array shaped like the mesh),
    tiled as jax tiles: ceil-sized blocks along each split dim, the last one short."""
    mesh = sharding.mesh
    names, sizes = tuple(mesh.axis_names), tuple(mesh.shape.values())
    coords = dict(zip(names, np.indices(sizes, dtype=np.int64)))
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    elements = np.ones(sizes, dtype=np.int64)
    for dim, entry in zip(shape, spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        count, index = 1, np.zeros(sizes, dtype=np.int64)
        for a in axes:  # the first named axis is the major one
            index = index * mesh.shape[a] + coords[a]
            count *= mesh.shape[a]
        chunk = -(-dim // count)
        elements = elements * np.clip(dim - index * chunk, 0, chunk)
    return elements


def shard_bytes(stored: Stored) -> np.ndarray:
    """Bytes each mesh position holds of ``stored`` (an int array shaped like the mesh)."""
    return shard_elements(stored.shape, stored.sharding) * np.dtype(stored.dtype).itemsize


def report_from_arrays(parts: Mapping[str, List[Stored]], mesh) -> MemoryReport:
    """A MemoryReport computed from shapes and shardings, as ``memory_report`` reads real shards."""
    ids = mesh_device_ids(mesh).ravel()
    per_device: Dict[int, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    by_part = {}
    for part, arrays in parts.items():
        totals: Dict[str, np.ndarray] = {}
        for a in arrays:
            kind = memory_kind(a.sharding)
            b = shard_bytes(a).ravel()
            totals[kind] = totals.get(kind, 0) + b
        for kind, b in totals.items():
            for dev, nbytes in zip(ids.tolist(), b.tolist()):
                per_device[dev][kind] += nbytes
        if totals:
            by_part[part] = {kind: int(b.max()) for kind, b in totals.items()}
    return MemoryReport({dev: dict(k) for dev, k in per_device.items()}, by_part)


def as_mesh(mesh_or_device_count, config: ZeroConfig):
    """A Mesh/AbstractMesh as given, or an AbstractMesh for a device count or {axis: size} mapping."""
    m = mesh_or_device_count
    if isinstance(m, (Mesh, AbstractMesh)):
        return m
    if isinstance(m, Mapping):
        return abstract_mesh(m.values(), m.keys())
    if isinstance(m, (int, np.integer)) and not isinstance(m, bool) and m >= 1:
        return abstract_mesh((m,), (config.data_axis,))
    raise ConfigError(f"mesh_or_device_count={m!r} is not a mesh: pass a jax Mesh (zj.make_mesh()), a device "
                      f"count such as 512, or axis sizes such as {{'data': 64, 'model': 8}}")


def estimate(params_or_shapes, mesh_or_device_count, config: Optional[ZeroConfig] = None, tx=None, *,
             param_specs=None) -> MemoryReport:
    """Exact stored bytes per device and memory kind of ``shard_train_state(params, tx, ...)``.

    Computed from shapes alone (``params_or_shapes`` may hold ``jax.ShapeDtypeStruct``s, or be
    ``init_fn(rng)``), for a real mesh or any device count; ``tx`` defaults to ``optax.adamw``.
    The result is a ``MemoryReport``, equal to ``zj.memory_report`` of the real state.

        report = zj.estimate(shapes, 64, zj.ZeroConfig(stage=2, precision="bf16"))
        print(report)                      # per part, MiB
        report.max_bytes("pinned_host")    # with offload_optimizer="cpu"

    With ``offload_ratio`` < 1 (stage 3) the report follows the plan's per-leaf split: the
    offloaded leaves' master and moments under "pinned_host", the others under "device".
    """
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config={config!r} is not a ZeroConfig: pass zj.ZeroConfig(stage=..., precision=...)")
    params_or_shapes = abstract_params(params_or_shapes, where="params_or_shapes")
    mesh = as_mesh(mesh_or_device_count, config)
    plan = ZeroPlan.create(params_or_shapes, mesh, config, param_specs=param_specs)
    report = report_from_arrays(plan_arrays(plan, tx), mesh)
    extra = secondary_bytes(plan)  # ZeRO++ hpZ: held inside the step, listed apart from the stored state
    if extra:
        report.in_step["hpz secondary"] = extra
    return report
