"""memory_report: bytes per device per memory kind, read from the arrays' real shards."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Dict

import jax


@dataclasses.dataclass
class MemoryReport:
    """``per_device[device_id][memory_kind]`` and ``by_part[part][memory_kind]`` (max over devices)."""

    per_device: Dict[int, Dict[str, int]]
    by_part: Dict[str, Dict[str, int]]

    def max_bytes(self, kind: str = "device") -> int:
        """Bytes of ``kind`` on the most loaded device."""
        return max((d.get(kind, 0) for d in self.per_device.values()), default=0)

    def total_bytes(self, kind: str = "device") -> int:
        return sum(d.get(kind, 0) for d in self.per_device.values())

    @property
    def kinds(self):
        return sorted({k for d in self.per_device.values() for k in d})

    def __str__(self) -> str:
        kinds = self.kinds
        lines = ["memory per device (MiB): " + ", ".join(
            f"{k} max {self.max_bytes(k) / 2**20:.2f}" for k in kinds)]
        for part, d in self.by_part.items():
            lines.append(f"  {part:<10} " + "  ".join(f"{k}: {d.get(k, 0) / 2**20:.2f}" for k in kinds))
        return "\n".join(lines)


def _account(tree, part, per_device, by_part_dev):
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        kind = getattr(x.sharding, "memory_kind", None) or "device"
        for shard in x.addressable_shards:
            nbytes = shard.data.nbytes
            per_device[shard.device.id][kind] += nbytes
            by_part_dev[part][shard.device.id, kind] += nbytes


def memory_report(state) -> MemoryReport:
    """Stored bytes of a TrainState (params, master, optimizer state, the rest) per device.

        print(zj.memory_report(state))
    """
    per_device = defaultdict(lambda: defaultdict(int))
    by_part_dev = defaultdict(lambda: defaultdict(int))
    parts = {"params": state.params, "master": state.master, "optimizer": state.opt_state,
             "other": (state.step, state.loss_scale, state.rng)}
    for part, tree in parts.items():
        _account(tree, part, per_device, by_part_dev)
    by_part = {}
    for part, d in by_part_dev.items():
        kinds = defaultdict(int)
        for (dev, kind), nbytes in d.items():
            kinds[kind] = max(kinds[kind], nbytes)
        by_part[part] = dict(kinds)
    return MemoryReport({dev: dict(k) for dev, k in per_device.items()}, by_part)
