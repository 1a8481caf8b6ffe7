"""What the compiler made of a step: collectives per step (comm_report) and peak memory.

Both read the compiled per-device program, so they show what will run, not what was meant::

    print(zj.comm_report(step, state, batch))   # kinds, counts, bytes per device vs ZeRO theory
    print(zj.peak_memory(step, state, batch))   # arguments + outputs + temporaries - aliased

Collective volume follows the ZeRO paper's accounting: an all-gather moves its whole output, a
reduce-scatter its whole input and an all-reduce twice its buffer (reduce-scatter + all-gather);
collectives inside loops (``lax.scan`` over micro-batches or layers) count once per iteration.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Dict, Optional

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _array_bytes(type_str: str):
    """[(elements, bytes)] of every array in an HLO type string."""
    out = []
    for dtype, dims in _ARRAY.findall(type_str):
        if dtype not in _BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append((n, n * _BYTES[dtype]))
    return out


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (p.split("=") for p in m.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    return 1


@dataclasses.dataclass
class _Comp:
    own: Dict[str, list] = dataclasses.field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    largest_all_reduce: int = 0
    calls: list = dataclasses.field(default_factory=list)  # (multiplier or 'branch', [callees])


def _parse(hlo: str):
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            cur = comps.setdefault(m.group(1), _Comp())
            if line.startswith("ENTRY"):
                entry = m.group(1)
            continue
        if cur is None or line.strip() == "}":
            continue
        c = _COLLECTIVE.match(line)
        if c:
            kind = c.group(3)
            arrays = _array_bytes(c.group(2))
            if c.group(4):  # async start: (operands, outputs) — the biggest buffer is the payload
                arrays = [max(arrays)] if arrays else []
            elems, nbytes = sum(a[0] for a in arrays), sum(a[1] for a in arrays)
            if kind == "reduce-scatter":
                g = _group_size(line)
                elems, nbytes = elems * g, nbytes * g
            elif kind == "all-reduce":
                cur.largest_all_reduce = max(cur.largest_all_reduce, max((a[0] for a in arrays), default=0))
                elems, nbytes = elems * 2, nbytes * 2
            cur.own[kind][0] += 1
            cur.own[kind][1] += nbytes
            cur.own[kind][2] += elems
        callees = [name for _, name in _CALLS.findall(line)]
        b = _BRANCHES.search(line)
        if b:
            cur.calls.append(("branch", [x.strip().lstrip("%") for x in b.group(1).split(",") if x.strip()]))
        if " while(" in line:
            t = _TRIP.search(line)
            cur.calls.append((int(t.group(1)) if t else 1, callees))
        elif callees:
            cur.calls.append((1, callees))
    return comps, entry


def _totals(comps, name, memo):
    if name in memo:
        return memo[name]
    comp = comps.get(name)
    out = (defaultdict(lambda: [0, 0, 0]), 0)
    if comp is None:
        memo[name] = out
        return out
    totals = defaultdict(lambda: [0, 0, 0])
    largest = comp.largest_all_reduce
    for kind, vals in comp.own.items():
        for i, v in enumerate(vals):
            totals[kind][i] += v
    for mult, callees in comp.calls:
        subs = [_totals(comps, c, memo) for c in callees]
        if mult == "branch":  # exclusive branches: count the heaviest
            subs = [max(subs, key=lambda s: sum(v[1] for v in s[0].values()), default=out)] if subs else []
            mult = 1
        for sub, sub_largest in subs:
            largest = max(largest, sub_largest)
            for kind, vals in sub.items():
                for i, v in enumerate(vals):
                    totals[kind][i] += mult * v
    memo[name] = (totals, largest)
    return memo[name]


@dataclasses.dataclass
class CommReport:
    """Collectives of one compiled step, per device: ``kinds[kind] = (count, bytes, elements)``.

    ``ratio`` compares *elements* with ZeRO's theory, so it holds whatever width the backend
    moves them in (the CPU backend widens 16-bit collectives to f32; GPUs move them as is).
    """

    kinds: Dict[str, tuple]
    largest_all_reduce: int  # elements of the biggest all-reduce buffer
    theory_elements: Optional[float] = None
    theory_label: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(v[1] for v in self.kinds.values())

    @property
    def total_elements(self) -> int:
        return sum(v[2] for v in self.kinds.values())

    @property
    def ratio(self) -> Optional[float]:
        return self.total_elements / self.theory_elements if self.theory_elements else None

    def count(self, kind: str) -> int:
        return self.kinds.get(kind, (0, 0, 0))[0]

    def __str__(self) -> str:
        lines = [f"{'collective':<20}{'count':>8}{'M elements':>12}{'MiB/device':>12}"]
        for kind in _KINDS:
            if kind in self.kinds:
                c, b, e = self.kinds[kind]
                lines.append(f"{kind:<20}{c:>8}{e / 1e6:>12.3f}{b / 2**20:>12.3f}")
        lines.append(f"{'total':<20}{'':>8}{self.total_elements / 1e6:>12.3f}{self.total_bytes / 2**20:>12.3f}")
        if self.theory_elements:
            lines.append(f"theory {self.theory_label} = {self.theory_elements / 1e6:.3f} M elements -> "
                         f"ratio {self.ratio:.3f}")
        return "\n".join(lines)


def collectives(hlo_text: str) -> CommReport:
    """Collectives per step of a compiled HLO module (text)."""
    comps, entry = _parse(hlo_text)
    totals, largest = _totals(comps, entry, {})
    return CommReport({k: tuple(v) for k, v in totals.items() if v[0]}, largest)


def theory_elements(plan, gas: int = 1) -> tuple:
    """ZeRO's per-device volume per optimizer step, in elements.

    stages 0 and 1 reduce once per step (2Ψ); stage 2 reduce-scatters each micro-batch and
    gathers once ((GAS + 1)Ψ); stage 3 gathers for forward and backward and reduce-scatters,
    per micro-batch (3Ψ·GAS).
    """
    psi = sum(lay.size for lay in plan.leaves)
    factor = {0: 2, 1: 2, 2: gas + 1, 3: 3 * gas}[plan.stage]
    label = {0: "2Ψ", 1: "2Ψ", 2: f"{gas + 1}Ψ", 3: f"{3 * gas}Ψ"}[plan.stage]
    return factor * psi, label


def _compiled(step, state, batch):
    return step.lower(state, batch).compile()


def comm_report(step, state, batch) -> CommReport:
    """Collectives per optimizer step of ``step`` on (state, batch), next to ZeRO's theory."""
    report = collectives(_compiled(step, state, batch).as_text())
    report.theory_elements, report.theory_label = theory_elements(state.plan, state.plan.config.gradient_accumulation_steps)
    return report


@dataclasses.dataclass
class PeakMemory:
    """Per-device bytes from XLA's memory analysis of the compiled step."""

    argument: int
    output: int
    temp: int
    alias: int
    host_temp: int = 0

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    def __str__(self) -> str:
        mib = 2**20
        return (f"peak {self.peak / mib:.2f} MiB per device = arguments {self.argument / mib:.2f} + outputs "
                f"{self.output / mib:.2f} + temporaries {self.temp / mib:.2f} - aliased {self.alias / mib:.2f}")


def peak_memory(step, state, batch) -> PeakMemory:
    """Per-device peak of the compiled step: arguments + outputs + temporaries - aliased."""
    m = _compiled(step, state, batch).memory_analysis()
    return PeakMemory(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                      m.alias_size_in_bytes, getattr(m, "host_temp_size_in_bytes", 0))


__all__ = ["CommReport", "PeakMemory", "collectives", "comm_report", "peak_memory", "theory_elements"]
