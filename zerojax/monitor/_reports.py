"""The comms logger and the FLOPs profiler: what the compiled step does, read from XLA.

Both read the compiled per-device program, as :func:`zerojax.comm_report` does, so they show
what runs rather than what was meant::

    text = comms_summary(zj.comm_report(step, state, batch))             # per kind: count, sizes
    profile = FlopsProfile.of(step, state, batch, seconds=0.012, step_index=1)
    print(profile)                                                         # flops, bytes, FLOP/s
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from zerojax._compat import cost_analysis
from zerojax.tools._compiled import CommReport

__all__ = ["FlopsProfile", "comms_summary"]

_RULE = "-" * 26


def comms_summary(report: CommReport, kinds: Optional[set] = None) -> str:
    """The collectives of one step per kind (count, elements, MiB per device), as
    :class:`~zerojax.tools._compiled.CommReport` holds them; ``kinds`` keeps only those."""
    if kinds is None:
        body = str(report)
    else:
        mib = 2**20
        lines = [f"{'collective':<20}{'count':>8}{'M elements':>12}{'MiB/device':>12}"]
        for kind, (count, nbytes, elems) in report.kinds.items():
            if kind in kinds:
                lines.append(f"{kind:<20}{count:>8}{elems / 1e6:>12.3f}{nbytes / mib:>12.3f}")
        body = "\n".join(lines)
    return (f"{_RULE} zerojax comms logger (the compiled step's collectives, per device per step) {_RULE}\n"
            f"{body}\n(XLA schedules these inside one program: their sizes are exact, their times are in a "
            "jax.profiler trace)")


@dataclasses.dataclass(frozen=True)
class FlopsProfile:
    """One step's cost from XLA's cost analysis of the compiled program (per device) and the
    step's measured wall time."""

    step_index: int  # 0-based, as DeepSpeed's profile_step
    flops: float  # per device, per step: forward, backward, reduction and update together
    bytes_accessed: float  # per device, per step
    seconds: float  # wall time of the profiled step, dispatch to metrics on the host
    params: int  # parameters of the model (all of them, not per device)
    devices: int

    @classmethod
    def of(cls, compiled, seconds: float, step_index: int, plan) -> "FlopsProfile":
        cost = cost_analysis(compiled)
        return cls(step_index, float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), seconds,
                   sum(lay.size for lay in plan.leaves), int(plan.mesh.devices.size))

    @property
    def flops_per_second(self) -> float:
        """Achieved FLOP/s per device."""
        return self.flops / self.seconds if self.seconds > 0 else float("nan")

    def __str__(self) -> str:
        return "\n".join([
            f"{_RULE} zerojax FLOPs profiler (XLA cost analysis of the compiled step) {_RULE}",
            f"Profile Summary at step {self.step_index}:",
            f"{'world size:':<40}{self.devices}",
            f"{'params (all devices):':<40}{_num(self.params)}",
            f"{'flops per device (fwd + bwd + update):':<40}{_num(self.flops)}",
            f"{'bytes accessed per device:':<40}{_num(self.bytes_accessed)}B",
            f"{'step latency:':<40}{self.seconds * 1e3:.2f} ms",
            f"{'FLOPS per device:':<40}{_num(self.flops_per_second)}",
        ])


def _num(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.2f} "
