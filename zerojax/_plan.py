"""ZeroPlan: the one object that decides where every leaf lives.

For a params tree (arrays or ``jax.ShapeDtypeStruct``), a mesh and a ``ZeroConfig`` the plan
holds, per leaf, a ``LeafLayout``: which dimension carries the data axis when the leaf is
partitioned, how much padding makes that dimension divide the device count, and whether
the leaf's params, gradients and optimizer state are partitioned at the chosen stage.
Everything else (state construction, the step, reports, checkpoints) reads the plan.

Partitioned storage is *near exact*: a leaf is split along the dimension that divides the
data-axis size (or needs the least padding), so at stage 3 a 50257 x 768 embedding on 8
devices is split along its 768 columns and nothing is replicated for not dividing. Below
stage 3 (only gradients and optimizer state split) contiguous shards win: the same table is
split along its rows, padded by 7.

    plan = ZeroPlan.create(params, mesh, ZeroConfig(stage=3, param_persistence_threshold=0))
    plan.param_shardings      # tree of NamedSharding, padded storage shapes in plan.storage_shapes
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.config import ZeroConfig
from zerojax._errors import ConfigError, IgnoredKeysWarning
from zerojax._compat import automatic
from zerojax._mesh import MODEL, SEQ
from zerojax._precision import compute_dtype

DEVICE = "device"
PIPE = "pipe"  # the mesh axis a PipelineModel's layers are split over (zerojax.pipeline)


def path_str(path) -> str:
    """'params/dense/kernel' for a jax tree path."""
    parts = []
    for k in path:
        if hasattr(k, "key"):
            parts.append(str(k.key))
        elif hasattr(k, "name"):
            parts.append(str(k.name))
        elif hasattr(k, "idx"):
            parts.append(str(k.idx))
        else:  # pragma: no cover
            parts.append(str(k))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter leaf lives. ``axis`` is None when it cannot be partitioned."""

    path: str
    shape: Tuple[int, ...]
    dtype: Any  # the user's dtype
    base_spec: Tuple[Any, ...]  # the user's model-parallel annotation, one entry per dim
    axis: Optional[int]  # dim that carries the data axis in partitioned storage
    padded: int  # size of ``axis`` after padding (== shape[axis] when it divides)
    params_partitioned: bool  # stage 3 and above the persistence threshold
    # mesh axes that split ``axis`` together with the data axis (data-major) in partitioned
    # storage: the sequence-parallel axis, and at stage 3 AutoTP's model axis for a leaf it
    # leaves whole. Bodies manual over the data axis see them as automatic axes.
    extra: Tuple[str, ...] = ()
    # the group of an optax.partition / multi_transform (optax.contrib.muon's "muon" or "adam")
    # that updates the leaf; None when the optimizer is not partitioned
    group: Optional[str] = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def pad(self) -> int:
        return 0 if self.axis is None else self.padded - self.shape[self.axis]

    @property
    def storage_shape(self) -> Tuple[int, ...]:
        if self.axis is None:
            return self.shape
        s = list(self.shape)
        s[self.axis] = self.padded
        return tuple(s)

    def spec(self, partitioned: bool, data_axis: str) -> P:
        """The full PartitionSpec: the user's annotation plus, if partitioned, the data axis."""
        entries = list(self.base_spec)
        if partitioned and self.axis is not None:
            entries[self.axis] = (data_axis,) + self.extra if self.extra else data_axis
        return P(*entries)

    def data_spec(self, partitioned: bool, data_axis: str) -> P:
        """The spec seen by a body that is manual over the data axis only."""
        entries = [None] * len(self.shape)
        if partitioned and self.axis is not None:
            entries[self.axis] = data_axis
        return P(*entries)


def _base_spec(leaf, user_spec, mesh: Mesh, data_axis: str, path: str) -> Tuple[Any, ...]:
    ndim = len(leaf.shape)
    spec = user_spec
    if spec is None:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == mesh.axis_names:
            spec = sharding.spec
    entries = list(spec) if spec is not None else []
    entries = entries + [None] * (ndim - len(entries))
    if len(entries) > ndim:
        raise ConfigError(f"param {path!r}: annotation {P(*entries)} has more entries than the leaf has dims {leaf.shape}")
    clean = []
    for e in entries:
        names = e if isinstance(e, tuple) else (e,)
        # the data axis is the plan's to place; the user's other axes are kept as given
        names = tuple(n for n in names if n is not None and n != data_axis)
        for n in names:
            if n not in mesh.axis_names:
                raise ConfigError(
                    f"param {path!r}: annotation uses mesh axis {n!r} but the mesh has {mesh.axis_names}. Fix: map "
                    f"the model's own axis names onto the mesh's with rules=, in zj.nnx_params(model, rules=[...]) "
                    f"or zj.linen_params(variables, rules=[...]): ({n!r}, 'model') splits that dim over the "
                    f"tensor-parallel axis (a 'tp' name), ({n!r}, None) leaves it to ZeRO, which partitions over "
                    f"{data_axis!r} itself (an 'fsdp' name); or build the mesh with a {n!r} axis")
        clean.append(None if not names else names[0] if len(names) == 1 else names)
    return tuple(clean)


def _pipe_split(base: Tuple[Any, ...], shape, mesh: Mesh, path: str) -> Tuple[Any, ...]:
    """A pipeline's layers (the leaves under ``params["blocks"]``, stacked on a leading layer
    axis) are split over the mesh's "pipe" axis along that axis: each stage stores its L/P
    consecutive layers, and their gradients and optimizer state (zerojax.pipeline)."""
    if PIPE not in mesh.axis_names or path.split("/")[0] != "blocks":
        return base
    stages = mesh.shape[PIPE]
    if not shape or base[0] is not None or shape[0] % stages:
        raise ConfigError(
            f"param {path!r} (shape {tuple(shape)}, annotation {P(*base)}): the mesh's {PIPE!r} axis splits the "
            f"leading layer axis of every leaf under params['blocks'] into {stages} stages, so that axis must be "
            f"free and a multiple of {stages}. Fix: stack the blocks' leaves on a leading layer axis with a number "
            f"of layers divisible by {stages}, or build the mesh with another {PIPE!r} size")
    return (PIPE,) + tuple(base[1:])


# mesh axes that ZeRO's partitions also span, besides the data axis, when the mesh has them:
# DeepSpeed's sequence-parallel ranks hold distinct parts of every model state (ZeRO over
# data x seq); AutoTP's model ranks hold copies of the leaves it leaves whole, which stage 3
# splits over data x model
def _extra_axes(base_spec, mesh: Mesh, stage: int) -> Tuple[str, ...]:
    used = {n for e in base_spec if e is not None for n in (e if isinstance(e, tuple) else (e,))}
    axes = [SEQ] + ([MODEL] if stage == 3 and not used else [])
    return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1 and a not in used)


# at stages 1-2 a split that is not along the leading dim moves a strided slab in every
# reduce-scatter and all-gather (the CPU compiler adds a transpose copy to each); it is worth
# this much relative padding to keep shards contiguous
CONTIGUITY_WORTH = 0.01


def _choose_axis(shape, base_spec, n: int, stage: int = 3) -> Tuple[Optional[int], int]:
    """The free dim that needs the least relative padding to divide ``n``; among equals the
    earliest (contiguous shards), except that the leading axis of a 3-D or higher leaf (the
    layer axis of stacked weights, which ``lax.scan`` slices) is split only when nothing else
    divides as well. Below stage 3 only the gradients and the optimizer state are split, as
    flat as DeepSpeed's buffers: the leading dim wins unless it needs more than
    ``CONTIGUITY_WORTH`` more relative padding (a 50257-row table pads 7 rows instead of
    being split along its columns)."""
    best, best_key = None, None
    free = [d for d, size in enumerate(shape) if base_spec[d] is None and size != 0]
    for d in free:
        size = shape[d]
        padded = -(-size // n) * n
        if stage < 3:
            key = (padded / size + (0.0 if d == free[0] else CONTIGUITY_WORTH), d)
        else:
            key = (padded / size, d == 0 and len(shape) >= 3, d)
        if best_key is None or key < best_key:
            best, best_key = d, key
    if best is None:
        return None, 0
    return best, -(-shape[best] // n) * n


def _memory_kind(offloaded: bool, pin: bool) -> str:
    if not offloaded:
        return DEVICE
    return "pinned_host" if pin else "unpinned_host"


def _check_ratio(config: ZeroConfig) -> None:
    """offload_ratio < 1 splits the optimizer state between host and device memory: only the
    in-step host update (offload_optimizer="cpu", no ZenFlow) can update such a split."""
    r = config.offload_ratio
    if r >= 1:
        return
    if config.offload_optimizer != "cpu" or config.zenflow:
        where = ("ZenFlow keeps the optimizer state itself" if config.zenflow and config.offload_optimizer == "cpu"
                 else f"offload_optimizer={config.offload_optimizer!r}")
        raise ConfigError(
            f"ZeroConfig.offload_ratio={r!r} (zero_optimization.offload_optimizer.ratio) needs "
            f'offload_optimizer="cpu" without zenflow, but {where}: the ratio is the share of the optimizer '
            f'state kept in host memory. Fix: use offload_ratio 1.0, or offload_optimizer="cpu"')


def _check_nodes(config: ZeroConfig, n: int, data_axis: str) -> None:
    """ZeRO++ sees the data axis as nodes of consecutive devices: their size must divide it."""
    hpz, per_node = config.hpz_partition_size, config.devices_per_node
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    if config.stage == 3 and hpz > 1 and n % hpz:
        raise ConfigError(
            f"ZeroConfig.hpz_partition_size={hpz} (zero_optimization.zero_hpz_partition_size) does not divide the "
            f"{data_axis!r} axis size {n}: hpZ keeps each param's secondary partition over the {hpz} devices of a "
            f"node, the axis seen as nodes x devices. Fix: use the devices per node, a divisor of {n} "
            f"({', '.join(map(str, divisors))}), or 1 to turn hpZ off")
    if per_node is not None and n % per_node:
        raise ConfigError(
            f"ZeroConfig.devices_per_node={per_node} does not divide the {data_axis!r} axis size {n}. "
            f"Fix: use a divisor of {n} ({', '.join(map(str, divisors))}), or None")
    if config.stage == 3 and hpz > 1 and per_node is not None and per_node != hpz:
        raise ConfigError(
            f"ZeroConfig.devices_per_node={per_node} disagrees with ZeroConfig.hpz_partition_size={hpz} "
            "(zero_optimization.zero_hpz_partition_size): hpZ's partition size is the devices per node. "
            "Fix: leave devices_per_node None, or make them equal")


def host_share(sizes, ratio: float) -> list:
    """Which items go to the host so that their share of ``sum(sizes)`` comes close to ``ratio``
    with whole items: a greedy pass, largest first (ties in the given order), that takes an
    item when it brings the host total strictly closer to ``ratio * total``. Deterministic;
    ratio 1 takes everything. Greedy, so not always the closest subset: sizes 5, 4, 3, 3 at
    0.5 take 5 + 4 (0.6), where 4 + 3 would give 0.47."""
    if ratio >= 1:
        return [True] * len(sizes)
    target = ratio * sum(sizes)
    taken, host = [False] * len(sizes), 0
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if abs(host + sizes[i] - target) < abs(host - target):
            taken[i], host = True, host + sizes[i]
    return taken


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroPlan:
    """Per-leaf layouts of params, gradients and optimizer state for one stage."""

    mesh: Mesh
    config: ZeroConfig
    layouts: Any  # pytree of LeafLayout, the params' structure
    treedef: Any

    # ---------------------------------------------------------------------------- build
    @classmethod
    def create(cls, params, mesh: Mesh, config: ZeroConfig, param_specs=None) -> "ZeroPlan":
        mesh = automatic(mesh)  # a mesh of JAX's explicit axes is used through its automatic view
        data_axis = config.data_axis
        if data_axis not in mesh.axis_names:
            raise ConfigError(
                f"the mesh has axes {mesh.axis_names} but no {data_axis!r} axis to partition over. "
                f"Build it with zj.make_mesh() (a 1-D ('data',) mesh) or set ZeroConfig(data_axis=...) "
                f"to one of {mesh.axis_names}."
            )
        n = mesh.shape[data_axis]
        _check_ratio(config)
        _check_nodes(config, n, data_axis)
        if mesh.shape.get(SEQ, 1) > 1:  # XLA's CPU backend aborts on a bf16 step over ("data", "seq")
            from zerojax._autotp import check_cpu_precision
            check_cpu_precision(mesh, config, SEQ)
        if config.stage == 3 and not config.reduce_scatter:
            warnings.warn("zerojax accepts but ignores reduce_scatter=False (zero_optimization.reduce_scatter) "
                          "at stage 3, as DeepSpeed does: stage-3 gradients are always reduce-scattered. "
                          "Drop the key, or use stage 1 or 2 to all-reduce them", IgnoredKeysWarning, stacklevel=2)
        if config.autotp_size > 1:  # AutoTP: "model" splits by layer name, the user's annotations kept
            from zerojax._autotp import plan_specs
            param_specs = plan_specs(params, mesh, config, param_specs)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        if param_specs is not None:
            spec_leaves = treedef.flatten_up_to(param_specs)
        else:
            spec_leaves = [None] * len(leaves)
        layouts = []
        for (path, leaf), user_spec in zip(leaves, spec_leaves):
            name = path_str(path)
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise ConfigError(f"param {name!r} is a {type(leaf).__name__}, not an array; only arrays may be leaves")
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ConfigError(f"param {name!r} has dtype {leaf.dtype}; trainable params must be floating point")
            shape = tuple(int(s) for s in leaf.shape)
            base = _pipe_split(_base_spec(leaf, user_spec, mesh, data_axis, name), shape, mesh, name)
            extra = _extra_axes(base, mesh, config.stage) if config.stage >= 1 else ()
            split = n * math.prod(mesh.shape[a] for a in extra)
            axis, padded = _choose_axis(shape, base, split, config.stage)
            big = math.prod(shape) >= config.param_persistence_threshold
            layouts.append(
                LeafLayout(
                    path=name,
                    shape=shape,
                    dtype=np.dtype(leaf.dtype),
                    base_spec=base,
                    axis=axis,
                    padded=padded,
                    params_partitioned=config.stage == 3 and big and axis is not None and split > 1,
                    extra=extra if axis is not None and split > 1 else (),
                )
            )
        return cls(mesh=mesh, config=config, layouts=treedef.unflatten(layouts), treedef=treedef)

    def with_groups(self, groups) -> "ZeroPlan":
        """This plan with each leaf's optimizer group (a list in leaf order, or None: unchanged)."""
        if groups is None:
            return self
        layouts = [dataclasses.replace(lay, group=g) for lay, g in zip(self.leaves, groups)]
        return dataclasses.replace(self, layouts=self.treedef.unflatten(layouts))

    # ------------------------------------------------------------------------- basics
    @property
    def n(self) -> int:
        return self.mesh.shape[self.config.data_axis]

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def data_axis(self) -> str:
        return self.config.data_axis

    @property
    def leaves(self):
        return self.treedef.flatten_up_to(self.layouts)

    def map(self, fn, *trees):
        """tree_map over layouts and matching trees (trees must have the params' structure)."""
        flat = [self.treedef.flatten_up_to(t) for t in trees]
        return self.treedef.unflatten([fn(lay, *xs) for lay, *xs in zip(self.leaves, *flat)])

    @property
    def compute_dtype(self):
        return compute_dtype(self.config.precision)

    @property
    def has_master(self) -> bool:
        """A separate fp32 master copy exists only when params are kept in 16 bits and are not
        their own master (``ZeroConfig.master_weights_dtype="bfloat16"``: the bf16 params are)."""
        return self.config.precision != "fp32" and self.config.master_weights_dtype is None

    # whether each kind of state is partitioned, per leaf
    def opt_partitioned(self, lay: LeafLayout) -> bool:
        return self.stage >= 1 and lay.axis is not None and (self.n > 1 or bool(lay.extra))

    def grad_partitioned(self, lay: LeafLayout) -> bool:
        """Gradients as they reach the update (stage 1 reduce-scatters once per step)."""
        return self.opt_partitioned(lay)

    # ------------------------------------------------------------------ memory kinds
    @property
    def param_memory_kind(self) -> str:
        return _memory_kind(self.config.offload_param is not None, self.config.pin_memory)

    @property
    def optimizer_state_outside(self) -> bool:
        """Whether the step keeps the fp32 master and optimizer state itself (NVMe files,
        ZenFlow's host buffers), so the TrainState carries only the params."""
        return self.config.offload_optimizer == "nvme" or bool(self.config.zenflow)

    @property
    def state_has_master(self) -> bool:
        """Whether a TrainState of this plan carries an fp32 master (16-bit params, and the
        optimizer state not kept by the step itself)."""
        return self.has_master and not self.optimizer_state_outside

    @property
    def host_update(self) -> bool:
        """Whether the optimizer update runs on the host (ZeRO-Offload), not the device; with
        ``offload_ratio`` < 1, for the params in ``offloaded_paths`` only."""
        return self.config.offload_optimizer == "cpu" and bool(self.offloaded_paths)

    @property
    def opt_memory_kind(self) -> str:
        """The memory kind of offloaded optimizer state (and of the leaves no param owns: counts,
        schedule state); with ``offload_ratio`` < 1 only some params' state is offloaded
        (:meth:`opt_leaf_memory_kind`)."""
        return _memory_kind(self.config.offload_optimizer is not None, self.config.pin_memory)

    # ------------------------------------------------------ offload_ratio: the split
    def opt_elements(self, lay: LeafLayout) -> int:
        """Elements of one optimizer-state copy of ``lay`` (its fp32 master) on each device."""
        split = self.n * math.prod(self.mesh.shape[a] for a in lay.extra) if self.opt_partitioned(lay) else 1
        for entry in lay.base_spec:
            for name in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
                split *= self.mesh.shape[name]
        return -(-math.prod(self.master_shape(lay)) // split)

    @functools.cached_property
    def offloaded_paths(self) -> frozenset:
        """Paths of the params whose fp32 master and optimizer state live in host memory.

        ``offload_optimizer`` set and ``offload_ratio`` 1: every param. ``offload_ratio`` r < 1
        (stage 3, DeepSpeed's partial offload): the split is per leaf, whole leaves only,
        chosen by :func:`host_share` (greedy, largest leaf first) so that the host's share of
        the per-device optimizer-state elements comes close to r (``host_fraction`` is the
        share reached); the others stay in device memory and are updated there, in the same
        step. A ratio smaller than half the smallest leaf's share offloads nothing."""
        if self.config.offload_optimizer is None:
            return frozenset()
        lays = self.leaves
        taken = host_share([self.opt_elements(lay) for lay in lays], self.config.offload_ratio)
        return frozenset(lay.path for lay, t in zip(lays, taken) if t)

    def opt_on_host(self, lay: LeafLayout) -> bool:
        """Whether ``lay``'s master and optimizer state live (and are updated) on the host."""
        return lay.path in self.offloaded_paths

    def opt_leaf_memory_kind(self, lay: LeafLayout) -> str:
        return self.opt_memory_kind if self.opt_on_host(lay) else DEVICE

    @property
    def partial_offload(self) -> bool:
        """Whether the optimizer state is split: some params' state on the host, some on the device."""
        return 0 < len(self.offloaded_paths) < len(self.leaves)

    @property
    def host_fraction(self) -> float:
        """The host's share of the per-device optimizer-state elements (the realised offload ratio)."""
        sizes = [(self.opt_elements(lay), self.opt_on_host(lay)) for lay in self.leaves]
        total = sum(e for e, _ in sizes)
        return sum(e for e, h in sizes if h) / total if total else 0.0

    def _sharding(self, spec: P, kind: str) -> NamedSharding:
        if kind == DEVICE:
            return NamedSharding(self.mesh, spec)
        return NamedSharding(self.mesh, spec, memory_kind=kind)

    # ------------------------------------------------------------------ shardings
    def param_sharding(self, lay: LeafLayout) -> NamedSharding:
        return self._sharding(lay.spec(lay.params_partitioned, self.data_axis), self.param_memory_kind)

    def master_sharding(self, lay: LeafLayout) -> NamedSharding:
        """Where ``lay``'s fp32 master (and the optimizer state mirroring it) is stored."""
        return self._sharding(lay.spec(self.opt_partitioned(lay), self.data_axis), self.opt_leaf_memory_kind(lay))

    def grad_sharding(self, lay: LeafLayout) -> NamedSharding:
        return NamedSharding(self.mesh, lay.spec(self.grad_partitioned(lay), self.data_axis))

    @property
    def param_shardings(self):
        return self.map(self.param_sharding)

    @property
    def master_shardings(self):
        return self.map(self.master_sharding)

    @property
    def grad_shardings(self):
        return self.map(self.grad_sharding)

    # shapes of stored leaves
    def param_shape(self, lay: LeafLayout):
        return lay.storage_shape if lay.params_partitioned else lay.shape

    def master_shape(self, lay: LeafLayout):
        return lay.storage_shape if self.opt_partitioned(lay) else lay.shape

    def abstract_master(self):
        """ShapeDtypeStructs of the fp32 master tree as the optimizer sees it (logical shapes)."""
        return self.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, jnp.float32))

    def opt_leaf_layouts(self, opt_tree, stored: bool):
        """For each leaf of an optimizer state, the param layout it mirrors, or None.

        A leaf mirrors a param when its tree path ends with the param's path and its shape is
        the param's (``stored``: padded storage shape; else the logical shape). Moments and
        the like are stored exactly like the master; counts and factored statistics are not.
        """
        out = []
        for lay, leaf in zip(self.opt_leaf_owners(opt_tree), jax.tree_util.tree_leaves(opt_tree)):
            want = None if lay is None else self.master_shape(lay) if stored else lay.shape
            out.append(lay if want is not None and tuple(getattr(leaf, "shape", ())) == want else None)
        return out

    def opt_leaf_owners(self, opt_tree):
        """For each leaf of an optimizer state, the param whose tree path its path ends with (the
        longest such), whatever its shape, or None: moments, and per-param statistics such as
        adafactor's factored rows and columns, have an owner; step counts and schedule state not."""
        by_path = {lay.path: lay for lay in self.leaves}
        out = []
        for path, _ in jax.tree_util.tree_flatten_with_path(opt_tree)[0]:
            parts = path_str(path).split("/")
            out.append(next((by_path[p] for p in ("/".join(parts[i:]) for i in range(len(parts))) if p in by_path),
                            None))
        return out

    def opt_state_shardings(self, opt_shapes):
        """Shardings of an optimizer state whose logical shapes are ``opt_shapes``.

        Leaves that mirror a param are stored like its master; other leaves (counts, factored
        moments) are split along a dimension that divides the data axis when they are large,
        or replicated when small, in the memory kind of their owner's state
        (:meth:`opt_leaf_owners`; offloaded state's when no param owns them).
        """
        leaves, treedef = jax.tree_util.tree_flatten(opt_shapes)

        def place(lay, owner, leaf):
            if lay is not None:
                return self.master_sharding(lay)
            kind = self.opt_memory_kind if owner is None else self.opt_leaf_memory_kind(owner)
            shape = tuple(leaf.shape)
            if self.stage >= 1 and self.n > 1 and math.prod(shape) >= self.n * 64:
                for d, size in enumerate(shape):
                    if size % self.n == 0:
                        entries = [None] * len(shape)
                        entries[d] = self.data_axis
                        return self._sharding(P(*entries), kind)
            return self._sharding(P(), kind)

        layouts = self.opt_leaf_layouts(opt_shapes, stored=False)
        owners = self.opt_leaf_owners(opt_shapes)
        return treedef.unflatten([place(*x) for x in zip(layouts, owners, leaves)])

    # ------------------------------------------------ storage <-> update layout
    def update_sharding(self, lay: LeafLayout) -> NamedSharding:
        """Where a leaf lives while the optimizer updates it: logical shape, split like the master."""
        return NamedSharding(self.mesh, lay.spec(self.opt_partitioned(lay), self.data_axis))

    def describe(self) -> str:
        """A table: one line per leaf with its shape, split dim, padding and per-stage placement,
        and, for a partitioned optimizer (``optax.contrib.muon``, ``optax.partition``), the group
        that updates it (``opt muon`` / ``opt adam``)."""
        rows = [f"ZeroPlan stage {self.stage} over {self.n} devices ({self.config.precision})"]
        if self.config.offload_optimizer is not None:
            rows[0] += (f", optimizer state offloaded: {self.host_fraction:.3f} of its elements in host memory "
                        f"(offload_ratio {self.config.offload_ratio:g})")
        model_axes = [a for a in self.mesh.axis_names if a != self.data_axis and self.mesh.shape[a] > 1]
        for lay in self.leaves:
            where = "params split" if lay.params_partitioned else "params whole"
            split = "-" if lay.axis is None else f"dim {lay.axis}" + (f" +{lay.pad} pad" if lay.pad else "")
            opt = f"  opt state {'host' if self.opt_on_host(lay) else 'device'}" if self.config.offload_optimizer else ""
            tp = ""
            if model_axes:  # what the other mesh axes hold: a split, or the whole leaf on each device
                named = [e for e in lay.base_spec if e is not None]
                copies = [a for a in model_axes if not (lay.params_partitioned and a in lay.extra)]
                dims = ", ".join(f"{'/'.join(e) if isinstance(e, tuple) else e} on dim {d}"
                                 for d, e in enumerate(lay.base_spec) if e is not None)
                tp = (f"  {dims}  {P(*lay.base_spec)}" if named else f"  replicated on {'/'.join(copies)}" if copies
                      else f"  split over {' x '.join((self.data_axis,) + lay.extra)}")
            group = f"  opt {lay.group}" if lay.group is not None else ""
            rows.append(f"  {lay.path:<40} {str(lay.shape):<18} {split:<16} {where}{opt}{group}{tp}")
        return "\n".join(rows)
