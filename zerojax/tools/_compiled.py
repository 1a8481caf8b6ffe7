"""What the compiler made of a step: collectives per step (comm_report) and peak memory.

Both read the compiled per-device program, so they show what will run, not what was meant::

    print(zj.comm_report(step, state, batch))   # kinds, counts, bytes per device vs ZeRO theory
    print(zj.peak_memory(step, state, batch))   # arguments + outputs + temporaries - aliased

Collective volume follows the ZeRO paper's accounting: an all-gather moves its whole output, a
reduce-scatter its whole input and an all-reduce twice its buffer (reduce-scatter + all-gather);
collectives inside loops (``lax.scan`` over micro-batches or layers) count once per iteration.
Each collective is also counted by the devices that talk in it (its replica groups): *inside a
node* when every group lies within one node of the data axis (``node_size`` consecutive data
indices, as :func:`zerojax.stages._zeropp.node_size` sees them), else *across nodes*; and by
what a device sends in a ring over a group of ``g``: ``(g - 1) / g`` of the counted volume
(a collective-permute: all of it)::

    r = zj.comm_report(step, state, batch, node_size=4)
    r.volume("all-gather", span="across")             # bytes of all-gathers spanning nodes
    r.volume(span="across", float_width=2, sent=True)  # floats priced at 2 bytes, ring sends
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from typing import Dict, Optional

import numpy as np

from zerojax._errors import ConfigError
from zerojax.stages._reuse import kept_leaves
from zerojax.stages._zeropp import node_size as plan_node_size

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_FLOATS = ("bf16", "f16", "f32", "f64", "f8e4m3fn", "f8e5m2")
SPANS = ("inside", "across")
# per (kind, span): count, bytes, elements, float elements, float bytes, and the same four
# volumes as a device sends them in a ring ((g - 1) / g of the counted volume)
_FIELDS = 9


def _array_bytes(type_str: str):
    """[(elements, bytes, is_float)] of every array in an HLO type string."""
    out = []
    for dtype, dims in _ARRAY.findall(type_str):
        if dtype not in _BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append((n, n * _BYTES[dtype], dtype in _FLOATS))
    return out


def _top_level(type_str: str) -> list:
    """The elements of an HLO tuple type (``(a, (b, c))`` -> ``["a", "(b, c)"]``); a non-tuple
    type is its own one element."""
    t = type_str.strip()
    if not t.startswith("("):
        return [t]
    parts, depth, cur = [], 0, []
    for ch in t[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [x.strip() for x in parts if x.strip()]


def _async_results(type_str: str, kind: str) -> str:
    """The part of an async collective's start type that is the collective's result: XLA types an
    all-gather-, reduce-scatter- or all-to-all-start ``((operands...), (results...))`` (or
    ``(operand, result)``), a collective-permute-start ``(operand, result, context...)``, and an
    all-reduce-start as its result."""
    parts = _top_level(type_str)
    if kind == "all-reduce" or len(parts) < 2:
        return type_str
    return parts[1]


def _iota_groups(shape: str, dims: str, perm: Optional[str]):
    """``[G,S]<=[dims]T(perm)``: iota over dims, transposed by perm, reshaped to G x S."""
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    g = [int(d) for d in shape.split(",")]
    return ids.reshape(g[0], -1).tolist() if len(g) > 1 else [ids.reshape(-1).tolist()]


def replica_groups(line: str) -> Optional[list]:
    """The device groups of one collective's HLO line (lists of device ids), None when the
    line names none (every device in one group). A collective-permute's source/target pairs
    are its groups."""
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[0-9,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        return _iota_groups(m.group(1), m.group(2), m.group(3))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (p.split("=") for p in m.group(1).split(",")))
        names = list(sizes)
        inner = [a.strip("' ") for a in m.group(2).split(",") if a.strip()]
        ids = np.arange(math.prod(sizes.values())).reshape([sizes[a] for a in names])
        ids = np.moveaxis(ids, [names.index(a) for a in inner], list(range(len(names) - len(inner), len(names))))
        return ids.reshape(-1, math.prod(sizes[a] for a in inner)).tolist()
    return None


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


def _vector():
    return [0] * _FIELDS


@dataclasses.dataclass
class _Comp:
    own: Dict[tuple, list] = dataclasses.field(default_factory=lambda: defaultdict(_vector))  # (kind, span)
    largest_all_reduce: int = 0
    calls: list = dataclasses.field(default_factory=list)  # (multiplier or 'branch', [callees])


def _span(groups: Optional[list], node_of) -> str:
    """'inside' when every group's devices share a node, else 'across'."""
    if node_of is None:
        return "inside"
    if groups is None:
        groups = [list(range(node_of.size))]
    return "inside" if all(len({int(node_of[d]) for d in g}) <= 1 for g in groups if g) else "across"


def _record(own, kind: str, line: str, arrays, node_of):
    groups = replica_groups(line)
    g = max((len(x) for x in groups), default=1) if groups else (node_of.size if node_of is not None else 0)
    if kind == "collective-permute":
        share = 1.0
    else:
        share = (g - 1) / g if g else 1.0
    mult = 1
    if kind == "reduce-scatter":
        mult = _group_size(line)
    elif kind == "all-reduce":
        mult = 2
    elems = sum(a[0] for a in arrays) * mult
    nbytes = sum(a[1] for a in arrays) * mult
    f_elems = sum(a[0] for a in arrays if a[2]) * mult
    f_bytes = sum(a[1] for a in arrays if a[2]) * mult
    v = own[(kind, _span(groups, node_of))]
    for i, x in enumerate((1, nbytes, elems, f_elems, f_bytes, nbytes * share, elems * share, f_elems * share,
                           f_bytes * share)):
        v[i] += x


def _parse(hlo: str, node_of=None):
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
            # an async start carries its operands beside its results: count the results, as for a
            # synchronous collective (every one of a combined, variadic collective's)
            arrays = _array_bytes(_async_results(c.group(2), kind) if c.group(4) else c.group(2))
            if kind == "all-reduce":
                cur.largest_all_reduce = max(cur.largest_all_reduce, max((a[0] for a in arrays), default=0))
            _record(cur.own, kind, line, arrays, node_of)
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
    out = (defaultdict(_vector), 0)
    if comp is None:
        memo[name] = out
        return out
    totals = defaultdict(_vector)
    largest = comp.largest_all_reduce
    for kind, vals in comp.own.items():
        for i, v in enumerate(vals):
            totals[kind][i] += v
    for mult, callees in comp.calls:
        subs = [_totals(comps, c, memo) for c in callees]
        if mult == "branch":  # exclusive branches: count the heaviest
            subs = [max(subs, key=lambda s: sum(v[1] for v in s[0].values()))] if subs else []
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
    """Collectives of one compiled step, per device: ``kinds[kind] = (count, bytes, elements)``;
    ``spans[(kind, span)]`` the same split by span, 'inside' a node or 'across' nodes.

    ``ratio`` compares *elements* with ZeRO's theory, so it holds whatever width the backend
    moves them in (the CPU backend widens 16-bit collectives to f32; GPUs move them as is).
    Quantized collectives (ZeRO++) move bytes: there :meth:`volume` with ``float_width`` prices
    the float collectives at the width the step means them in.
    """

    kinds: Dict[str, tuple]
    largest_all_reduce: int  # elements of the biggest all-reduce buffer
    theory_elements: Optional[float] = None
    theory_label: str = ""
    spans: Dict[tuple, tuple] = dataclasses.field(default_factory=dict)  # (kind, span) -> _FIELDS numbers
    node_size: Optional[int] = None  # data-axis devices per node the spans were counted with

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

    def volume(self, kind=None, span: Optional[str] = None, float_width: Optional[int] = None,
               sent: bool = False) -> float:
        """Bytes per device per step of the collectives of ``kind`` (a name or a tuple of names;
        None: all) over ``span`` ('inside', 'across'; None: both). ``float_width``: float
        elements priced at that many bytes each (2 for a 16-bit step on a backend that widens
        them); ``sent``: what a device sends in a ring over its group, ``(g - 1) / g`` of it."""
        kinds = (kind,) if isinstance(kind, str) else kind
        if span is not None and span not in SPANS:
            raise ConfigError(f"span must be one of {SPANS} or None, got {span!r}")
        total = 0.0
        for (k, sp), v in self.spans.items():
            if (kinds is not None and k not in kinds) or (span is not None and sp != span):
                continue
            nbytes, f_elems, f_bytes = (v[5], v[7], v[8]) if sent else (v[1], v[3], v[4])
            total += nbytes if float_width is None else nbytes - f_bytes + f_elems * float_width
        return total

    def __str__(self) -> str:
        split = self.node_size is not None and any(sp == "across" for _, sp in self.spans)
        head = f"{'collective':<20}{'count':>8}{'M elements':>12}{'MiB/device':>12}"
        if split:
            head += f"{'inside node':>13}{'across nodes':>14}"
        lines = [head]
        mib = 2**20
        for kind in _KINDS:
            if kind in self.kinds:
                c, b, e = self.kinds[kind]
                row = f"{kind:<20}{c:>8}{e / 1e6:>12.3f}{b / mib:>12.3f}"
                if split:
                    row += f"{self.volume(kind, 'inside') / mib:>13.3f}{self.volume(kind, 'across') / mib:>14.3f}"
                lines.append(row)
        row = f"{'total':<20}{'':>8}{self.total_elements / 1e6:>12.3f}{self.total_bytes / mib:>12.3f}"
        if split:
            row += f"{self.volume(span='inside') / mib:>13.3f}{self.volume(span='across') / mib:>14.3f}"
        lines.append(row)
        if split:
            lines.append(f"(nodes of {self.node_size} consecutive data-axis devices)")
        if self.theory_elements:
            lines.append(f"theory {self.theory_label} = {self.theory_elements / 1e6:.3f} M elements -> "
                         f"ratio {self.ratio:.3f}")
        return "\n".join(lines)


def node_map(mesh, data_axis: str, node_size: int) -> np.ndarray:
    """Device id in the compiled program (its position in the mesh) -> its node: the data-axis
    index // ``node_size``."""
    coords = np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)
    return coords[mesh.axis_names.index(data_axis)] // max(1, int(node_size))


def collectives(hlo_text: str, node_of: Optional[np.ndarray] = None, node_size: Optional[int] = None) -> CommReport:
    """Collectives per step of a compiled HLO module (text); with ``node_of`` (device id ->
    node, :func:`node_map`) each is counted inside a node or across nodes."""
    comps, entry = _parse(hlo_text, node_of)
    totals, largest = _totals(comps, entry, {})
    kinds: Dict[str, list] = {}
    for (kind, _), v in totals.items():
        if v[0]:
            k = kinds.setdefault(kind, [0, 0, 0])
            for i in range(3):
                k[i] += v[i]
    spans = {key: tuple(v) for key, v in totals.items() if v[0]}
    return CommReport({k: tuple(v) for k, v in kinds.items()}, largest, spans=spans,
                      node_size=node_size if node_of is not None else None)


def theory_elements(plan, gas: int = 1) -> tuple:
    """ZeRO's per-device volume per optimizer step, in elements.

    stages 0 and 1 reduce once per step (2Ψ); stage 2 reduce-scatters each micro-batch and
    gathers once ((GAS + 1)Ψ); stage 3 gathers for the forward pass and reduce-scatters, per
    micro-batch, and gathers again for the backward pass the params not kept from their forward
    use (``max_reuse_distance``, ``max_live_parameters``: :func:`zerojax.stages._reuse.kept_leaves`):
    3Ψ·GAS when none is kept, 2Ψ·GAS when all are.
    """
    psi = sum(lay.size for lay in plan.leaves)
    if plan.stage == 3:
        again = psi - sum(lay.size for lay, k in zip(plan.leaves, kept_leaves(plan)) if k)
        factor = gas * (2 + again / psi) if psi else 0
        label = f"{3 * gas}Ψ" if again == psi else f"{2 * gas}Ψ" if again == 0 else f"{factor:.2f}Ψ"
        return factor * psi, label
    factor = {0: 2, 1: 2, 2: gas + 1}[plan.stage]
    label = {0: "2Ψ", 1: "2Ψ", 2: f"{gas + 1}Ψ"}[plan.stage]
    return factor * psi, label


def _compiled(step, state, batch):
    return step.lower(state, batch).compile()


def comm_report(step, state, batch, node_size: Optional[int] = None) -> CommReport:
    """Collectives per optimizer step of ``step`` on (state, batch), next to ZeRO's theory, each
    counted inside a node or across nodes of ``node_size`` data-axis devices (default: the
    plan's, :func:`zerojax.stages._zeropp.node_size`)."""
    plan = state.plan
    k = plan_node_size(plan) if node_size is None else int(node_size)
    report = collectives(_compiled(step, state, batch).as_text(), node_map(plan.mesh, plan.data_axis, k), k)
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


_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def program_custom_calls(hlo_text: str) -> Counter:
    """The custom-call targets of a compiled HLO module (text), with their counts."""
    return Counter(_CUSTOM_CALL_TARGET.findall(hlo_text))


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9_\-]*)\((.*)$")
_ASYNC = re.compile(r"^(" + "|".join(_KINDS) + r")-start$")
# what does the work between a collective's start and its done: kernels and calls of computations
_COMPUTE = ("fusion", "custom-call", "convolution", "dot", "while", "call", "conditional", "sort", "scatter",
            "gather", "reduce", "reduce-window", "select-and-scatter")


@dataclasses.dataclass
class Overlap:
    """Asynchronous collectives of a scheduled program: ``kinds[kind] = (starts, overlapped)``,
    where a start is overlapped when the schedule puts compute (a kernel or a call) between it and
    its done. ``synchronous[kind]``: collectives of that kind the program runs without a
    start/done pair."""

    kinds: Dict[str, tuple]
    synchronous: Dict[str, int]

    @property
    def starts(self) -> int:
        return sum(v[0] for v in self.kinds.values())

    @property
    def overlapped(self) -> int:
        return sum(v[1] for v in self.kinds.values())

    def __str__(self) -> str:
        parts = [f"{k} {o}/{s}" for k, (s, o) in sorted(self.kinds.items())]
        sync = sum(self.synchronous.values())
        return (f"{self.overlapped} of {self.starts} async collectives overlap compute ({', '.join(parts) or 'none'})"
                + (f"; {sync} synchronous" if sync else ""))


def overlap(hlo_text: str) -> Overlap:
    """Which asynchronous collectives of a scheduled HLO module (``compiled.as_text()`` of an
    XLA:GPU program) have compute scheduled between their start and their done: the ones that can
    hide behind it. Counted per appearance in the module's text (a loop body's once)."""
    kinds: Dict[str, list] = {}
    synchronous: Dict[str, int] = defaultdict(int)
    open_starts: Dict[str, tuple] = {}
    for line in hlo_text.splitlines():
        if _HEADER.match(line) or line.strip() == "}":
            open_starts.clear()  # a new computation: its schedule is its own
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, op, rest = m.groups()
        start = _ASYNC.match(op)
        if start:
            open_starts[name] = (start.group(1), False)
            kinds.setdefault(start.group(1), [0, 0])[0] += 1
        elif op.endswith("-done") and op[:-5] in _KINDS:
            operand = re.match(r"\s*%?([\w.\-]+)", rest)
            begun = open_starts.pop(operand.group(1), None) if operand else None
            if begun is not None and begun[1]:
                kinds[begun[0]][1] += 1
        elif op in _KINDS:
            synchronous[op] += 1
        elif op in _COMPUTE:
            for key, (kind, _) in open_starts.items():
                open_starts[key] = (kind, True)
    return Overlap({k: tuple(v) for k, v in kinds.items()}, dict(synchronous))


__all__ = ["CommReport", "Overlap", "PeakMemory", "SPANS", "collectives", "comm_report", "node_map", "overlap", "peak_memory", "program_custom_calls",
           "replica_groups", "theory_elements"]
