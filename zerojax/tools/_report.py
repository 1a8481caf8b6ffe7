"""memory_report: bytes per device per memory kind, read from the arrays' real shards.

In a multi-process run the report covers every device of every process without communicating:
this process's devices are read from the arrays' real (addressable) shards, the other processes'
from the arrays' shardings, which say exactly what each device holds.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import jax

from zerojax.stages._zeropp import secondary_bytes


@dataclasses.dataclass
class MemoryReport:
    """Stored bytes per device and memory kind.

    per_device[device_id][memory_kind]  every device of the mesh, of every process
    by_part[part][memory_kind]          the most loaded device's bytes of each part
    process_of[device_id]               the process holding the device (empty: all in one process)
    process_index                       the process that made the report

        report.max_bytes("device")      # the most loaded device
        report.process_bytes("device")  # this process's devices together
        report.total_bytes("device")    # every device of every process
    """

    per_device: dict[int, dict[str, int]]
    by_part: dict[str, dict[str, int]]
    process_of: dict[int, int] = dataclasses.field(default_factory=dict)
    process_index: int = 0
    # device bytes per device the step holds beyond the stored state by design, not counted
    # above: "hpz secondary" (ZeRO++ hpZ's secondary partitions, forward to backward)
    in_step: dict[str, int] = dataclasses.field(default_factory=dict)

    def max_bytes(self, kind: str = "device") -> int:
        """Bytes of ``kind`` on the most loaded device."""
        return max((d.get(kind, 0) for d in self.per_device.values()), default=0)

    def total_bytes(self, kind: str = "device") -> int:
        """Bytes of ``kind`` on all devices of all processes."""
        return sum(d.get(kind, 0) for d in self.per_device.values())

    def devices_of(self, process: int | None = None) -> dict[int, dict[str, int]]:
        """``per_device`` restricted to the devices of ``process`` (default: this process)."""
        process = self.process_index if process is None else process
        return {dev: kinds for dev, kinds in self.per_device.items() if self.process_of.get(dev, 0) == process}

    def process_bytes(self, kind: str = "device", process: int | None = None) -> int:
        """Bytes of ``kind`` on the devices of ``process`` together (default: this process)."""
        return sum(d.get(kind, 0) for d in self.devices_of(process).values())

    @property
    def processes(self) -> list:
        return sorted(set(self.process_of.values()) or {0})

    @property
    def per_process(self) -> dict[int, dict[str, int]]:
        """Bytes per process and memory kind (the sum over its devices)."""
        return {p: {k: self.process_bytes(k, p) for k in self.kinds} for p in self.processes}

    @property
    def kinds(self):
        return sorted({k for d in self.per_device.values() for k in d})

    def __str__(self) -> str:
        kinds = self.kinds
        lines = ["memory per device (MiB): " + ", ".join(
            f"{k} max {self.max_bytes(k) / 2**20:.2f}" for k in kinds)]
        for part, d in self.by_part.items():
            lines.append(f"  {part:<10} " + "  ".join(f"{k}: {d.get(k, 0) / 2**20:.2f}" for k in kinds))
        for part, nbytes in self.in_step.items():
            lines.append(f"  inside the step, not stored: {part} device: {nbytes / 2**20:.2f}")
        if len(self.processes) > 1:
            for p in self.processes:
                mark = " (this one)" if p == self.process_index else ""
                lines.append(f"  process {p}{mark}, {len(self.devices_of(p))} devices: " + "  ".join(
                    f"{k} {self.process_bytes(k, p) / 2**20:.2f}" for k in kinds))
            lines.append(f"  all {len(self.processes)} processes: " + "  ".join(
                f"{k} {self.total_bytes(k) / 2**20:.2f}" for k in kinds))
        return "\n".join(lines)


def _shard_nbytes(x: jax.Array):
    """(device, bytes) for every device holding part of ``x``: real shards here, the layout elsewhere."""
    here = {shard.device: shard.data.nbytes for shard in x.addressable_shards}
    yield from here.items()
    if x.is_fully_addressable:
        return
    for dev, index in x.sharding.devices_indices_map(tuple(x.shape)).items():
        if dev not in here:
            elements = math.prod(len(range(*s.indices(n))) for s, n in zip(index, x.shape))
            yield dev, elements * x.dtype.itemsize


def _account(tree, part, per_device, by_part_dev, process_of):
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        kind = getattr(x.sharding, "memory_kind", None) or "device"
        for dev, nbytes in _shard_nbytes(x):
            per_device[dev.id][kind] += nbytes
            by_part_dev[part][dev.id, kind] += nbytes
            process_of[dev.id] = dev.process_index


def memory_report(state) -> MemoryReport:
    """Stored bytes of a TrainState (params, master, optimizer state, the rest) per device.

        print(zj.memory_report(state))
    """
    per_device = defaultdict(lambda: defaultdict(int))
    by_part_dev = defaultdict(lambda: defaultdict(int))
    process_of: dict = {}
    parts = {"params": state.params, "master": state.master, "optimizer": state.opt_state,
             "other": (state.step, state.loss_scale, state.rng)}
    for part, tree in parts.items():
        _account(tree, part, per_device, by_part_dev, process_of)
    by_part = {}
    for part, d in by_part_dev.items():
        kinds = defaultdict(int)
        for (dev, kind), nbytes in d.items():
            kinds[kind] = max(kinds[kind], nbytes)
        by_part[part] = dict(kinds)
    extra = secondary_bytes(state.plan)
    return MemoryReport({dev: dict(k) for dev, k in per_device.items()}, by_part, process_of, jax.process_index(),
                        {"hpz secondary": extra} if extra else {})
