"""visualize: the ZeRO picture (params / gradients / optimizer states per device), from real shardings.

Each column is one kind of state, drawn as ``width`` cells; the state is ordered the way ZeRO
partitions it, so the i-th 1/N of a column is what data-parallel rank i owns (every leaf
contributes its i-th chunk to that stretch). A cell shows what the device holds there:

    █  stored in this device's memory
    ·  held by other devices only
    H  stored in this device's host memory (offload)

    print(zj.visualize(state))            # a TrainState: its arrays' real shardings
    print(zj.visualize(plan, tx, width=32))  # a ZeroPlan: the shardings it would create

Gradients are transient (they exist inside the step); they are drawn as the step accumulates
them in fp32: whole on every device at stages 0-1, partitioned from stage 2 (and wherever
params are partitioned), then reduce-scattered to ``plan.grad_shardings`` for the update.
"""
from __future__ import annotations

from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

import numpy as np
from jax.sharding import NamedSharding

from zerojax._errors import ConfigError
from zerojax._plan import ZeroPlan
from zerojax.tools._estimate import (
    Stored,
    memory_kind,
    mesh_device_ids,
    plan_arrays,
    shard_bytes,
    state_arrays,
)

HERE, ELSEWHERE, HOST = "█", "·", "H"
LEGEND = (f"{HERE} stored on this device   {ELSEWHERE} held by other devices only   "
          f"{HOST} in this device's host memory (offload)")
GRAD_NOTE = ("* gradients are transient: the step's fp32 accumulators, not part of the stored state")
COLUMNS = ("params", "gradients*", "optimizer states")


def grad_arrays(plan: ZeroPlan) -> List[Stored]:
    """The step's gradient accumulators (fp32): local to each device's partition where the step
    reduces per micro-batch (stage 2) or the params are partitioned (stage 3), whole otherwise."""
    out = []
    for lay in plan.leaves:
        split = lay.params_partitioned or (plan.stage >= 2 and plan.grad_partitioned(lay))
        if split:
            out.append(Stored(lay.storage_shape, np.dtype(np.float32), plan.grad_sharding(lay)))
        else:
            out.append(Stored(lay.shape, np.dtype(np.float32),
                              NamedSharding(plan.mesh, lay.spec(False, plan.data_axis))))
    return out


def _axes(entry) -> Tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


class _Column:
    """One column (a list of arrays) laid out along [0, N·total) in integer units: region i
    (length ``total``) holds, leaf after leaf, every leaf's i-th data-axis chunk."""

    def __init__(self, arrays: Sequence[Stored], mesh, data_axis: str):
        self.mesh, self.data_axis = mesh, data_axis
        self.n = mesh.shape[data_axis]
        self.arrays = list(arrays)
        self.sizes = [int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in self.arrays]
        self.total = sum(self.sizes)
        names = tuple(mesh.axis_names)
        self.coords = dict(zip(names, np.indices(tuple(mesh.shape.values()), dtype=np.int64)))

    def _template(self, pos, own: bool) -> List[Tuple[Fraction, Fraction, str]]:
        """Intervals (start, end, mark) of one region as seen from mesh position ``pos``:
        the device's own region (own=True) or any other rank's region."""
        out, start = [], Fraction(0)
        for a, size in zip(self.arrays, self.sizes):
            used = [ax for e in a.sharding.spec for ax in _axes(e)]
            split = self.data_axis in used
            others = [ax for ax in used if ax != self.data_axis]
            count, index = 1, 0
            for ax in others:  # the device's block among the non-data blocks of this chunk
                index = index * self.mesh.shape[ax] + int(self.coords[ax][pos])
                count *= self.mesh.shape[ax]
            if own or not split:
                block = Fraction(size, count)
                mark = HOST if "host" in memory_kind(a.sharding) else HERE
                out.append((start + index * block, start + (index + 1) * block, mark))
            start += size
        return out

    def bar(self, pos, width: int) -> str:
        if self.total == 0:
            return " " * width
        mine = int(self.coords[self.data_axis][pos])
        own, other = self._template(pos, True), self._template(pos, False)
        cell = Fraction(self.n * self.total, width)
        chars = []
        for j in range(width):
            lo, hi = j * cell, (j + 1) * cell
            amount = {HERE: Fraction(0), HOST: Fraction(0)}
            for region in range(int(lo // self.total), min(self.n, -(-hi // self.total))):
                base = region * self.total
                for s, e, mark in (own if region == mine else other):
                    amount[mark] += max(Fraction(0), min(e + base, hi) - max(s + base, lo))
            amount[ELSEWHERE] = cell - amount[HERE] - amount[HOST]
            chars.append(max((HERE, HOST, ELSEWHERE), key=lambda m: amount[m]))  # ties: first wins
        return "".join(chars)

    def device_bytes(self, pos) -> Tuple[int, int]:
        """(device-memory bytes, host-memory bytes) this mesh position stores."""
        dev = host = 0
        for a in self.arrays:
            b = int(shard_bytes(a)[pos])
            if "host" in memory_kind(a.sharding):
                host += b
            else:
                dev += b
        return dev, host


def format_bytes(n: int) -> str:
    """'144 B', '1.50 KiB', '3.25 MiB', '1.17 GiB'."""
    if n < 1024:
        return f"{n} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if n < scale * 1024 or unit == "TiB":
            return f"{n / scale:.2f} {unit}"
    raise AssertionError  # pragma: no cover


def visualize(state_or_plan, tx=None, *, width: int = 16, max_devices: Optional[int] = 16) -> str:
    """The ZeRO layout picture as text: one row per device, a bar per kind of state.

    ``state_or_plan``: a TrainState (its arrays' shardings are drawn) or a ZeroPlan (the
    shardings ``shard_train_state`` would create with ``tx``, default ``optax.adamw``).
    Optimizer states include the fp32 master copy when the params are 16-bit. ``width``
    cells per bar (a multiple of the data-axis size keeps every rank's share whole);
    ``max_devices`` rows at most (None: all).

        print(zj.visualize(zj.ZeroPlan.create(params, zj.make_mesh(4), zj.ZeroConfig(stage=1))))
    """
    plan = getattr(state_or_plan, "plan", state_or_plan)
    if not isinstance(plan, ZeroPlan):
        raise ConfigError(f"visualize(state_or_plan={type(state_or_plan).__name__}): pass a zj.TrainState "
                        "(from zj.shard_train_state) or a zj.ZeroPlan (ZeroPlan.create(params, mesh, config))")
    if not isinstance(width, int) or width < 1:
        raise ConfigError(f"width={width!r} must be a positive int, e.g. width=32")
    if plan is state_or_plan:
        parts = plan_arrays(plan, tx)
    else:
        if tx is not None:
            raise ConfigError("tx is only for a ZeroPlan; a TrainState already holds its optimizer state")
        parts = state_arrays(state_or_plan)
    mesh = plan.mesh
    columns = [_Column(parts["params"], mesh, plan.data_axis), _Column(grad_arrays(plan), mesh, plan.data_axis),
               _Column(parts["master"] + parts["optimizer"], mesh, plan.data_axis)]
    ids = mesh_device_ids(mesh)
    positions = list(np.ndindex(ids.shape))
    shown = positions if max_devices is None else positions[:max_devices]
    label_w = max(len(f"dev {ids[p]}") for p in shown)
    col_w = [max(width, len(c)) for c in COLUMNS]
    over = f"{ids.size} devices" + (f" ({plan.n} on the {plan.data_axis!r} axis)" if ids.size != plan.n else "")
    lines = [f"ZeRO stage {plan.stage} over {over}, {plan.config.precision}: where each device's state lives, "
             f"1 cell = 1/{width} of a column",
             " " * label_w + "  " + "  ".join(c.ljust(w) for c, w in zip(COLUMNS, col_w)) + "  bytes on the device"]
    for p in shown:
        cells = "  ".join(col.bar(p, width).ljust(w) for col, w in zip(columns, col_w))
        sizes = []
        for name, col in zip(("params", "grads*", "optimizer"), columns):
            dev, host = col.device_bytes(p)
            sizes.append(f"{name} {format_bytes(dev)}" + (f" + host {format_bytes(host)}" if host else ""))
        lines.append(f"{f'dev {ids[p]}':<{label_w}}  {cells}  {', '.join(sizes)}")
    if len(shown) < len(positions):
        lines.append(f"... {len(positions) - len(shown)} more devices (max_devices=None shows all)")
    lines += [LEGEND, GRAD_NOTE]
    return "\n".join(lines)
