"""What is alive at a compiled step's peak: read from XLA's dump of one module (``--xla_dump_to``
with ``--xla_dump_hlo_as_text``): its buffer assignment (the temporaries' values), its live
ranges (each value's first and last step in the schedule) and its optimized HLO (what each value
is). Used by ``peak_memory.py --breakdown``."""
import collections
import glob
import os
import re


def _one(pattern):
    found = sorted(glob.glob(pattern))
    return found[-1] if found else None


def _temp_values(path):
    """(name, bytes, offset) of the values placed in the preallocated temporary buffer."""
    out, in_temp = [], False
    for line in open(path):
        if line.startswith("allocation"):
            in_temp = "preallocated-temp" in line
            continue
        if in_temp:
            m = re.match(r"\s*value: <\d+ (\S+)(?: \(phi\))? @\S+> \(size=(\d+),offset=(\d+)\)", line)
            if m:
                name = m.group(1)
                out.append((name if "{" in name else name + "{}", int(m.group(2)), int(m.group(3))))
    return out


def _live_ranges(path):
    seq, ranges, mode = {}, {}, None
    for line in open(path):
        if "InstructionSequence" in line:
            mode = "seq"
            continue
        if "BufferLiveRange" in line:
            mode = "ranges"
            continue
        if mode == "seq":
            m = re.match(r"\s*(\d+):(\S+)", line)
            if m:
                seq[int(m.group(1))] = m.group(2)
        elif mode == "ranges":
            m = re.match(r"\s*(\S+):(\d+)-(\d+)", line)
            if m:
                ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return seq, ranges


def _instructions(path):
    out = {}
    for line in open(path):
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) ([\w\-]+)\((.*)", line)
        if m:
            meta = re.search(r'op_name="([^"]*)"', line)
            args = re.findall(r"%([\w.\-]+)", m.group(4).split("), ")[0])
            out[m.group(1)] = (m.group(3), meta.group(1) if meta else "", args)
    return out


def kind_of(name, instrs):
    """A value's kind at the peak: a gathered param bucket (forward or backward), a piece cut from
    one, a gradient on its way to the reduce-scatter, or anything else (activations...)."""
    op, meta, args = instrs.get(name.split("{")[0], ("?", "", []))
    backward = "transpose(" in meta
    if op == "all-gather":
        return "gathered params, backward (all-gather)" if backward else "gathered params, forward (all-gather)"
    # an operand that is an all-gather, or a tuple or bitcast of one (a conditional's operands)
    inputs = list(args)
    for a in args:
        if instrs.get(a, ("",))[0] in ("tuple", "bitcast"):
            inputs += instrs[a][2]
    from_gather = any(instrs.get(a, ("",))[0] == "all-gather" for a in inputs)
    if (op == "fusion" and "dynamic_slice" in meta or op == "conditional") and from_gather:
        return "params cut from gathered buckets"
    if op in ("reduce-scatter",):
        return "reduce-scatter outputs"
    if backward and ("concatenate" in meta or "pad" in meta):
        return "gradients laid out for the reduce-scatter"
    return "activations, gradients, other"


def breakdown(dump_dir, module_re="jit_train_step"):
    """{"peak": bytes of temporaries live together at the worst step, "kinds": {kind: [count, bytes]},
    "forward_gathers": (first step, last step, bytes) of each live forward gather (one per bucket),
    "at": the step's instruction} for the newest dumped module matching ``module_re``."""
    prefix = _one(os.path.join(dump_dir, f"*{module_re}.cpu_after_optimizations.txt"))
    if prefix is None:
        return None
    base = prefix[: -len(".txt")]
    values = _temp_values(base + "-buffer-assignment.txt")
    seq, ranges = _live_ranges(base + "-live-range.txt")
    instrs = _instructions(prefix)
    # values that share a buffer while both are live (a conditional's outputs and its branch's
    # results, a tuple's elements) are one buffer: merged, named by the value of the widest range
    spans = collections.defaultdict(list)
    for name, size, offset in values:
        if name in ranges:
            spans[offset, size].append((*ranges[name], name))
    buffers = []
    for (_, size), items in spans.items():
        items.sort()
        s, e, name = items[0]
        for s2, e2, name2 in items[1:]:
            if s2 <= e:
                if e2 - s2 > e - s:
                    name = name2
                e = max(e, e2)
            else:
                buffers.append((name, size, s, e))
                s, e, name = s2, e2, name2
        buffers.append((name, size, s, e))
    events = collections.Counter()
    for _, size, s, e in buffers:
        events[s] += size
        events[e + 1] -= size
    cur, best, t_best = 0, -1, 0
    for t in range(max(seq) + 2):
        cur += events.get(t, 0)
        if cur > best:
            best, t_best = cur, t
    kinds = collections.defaultdict(lambda: [0, 0])
    fwd = []
    for name, size, s, e in buffers:
        if s <= t_best <= e:
            k = kind_of(name, instrs)
            kinds[k][0] += 1
            kinds[k][1] += size
            if k.endswith("forward (all-gather)"):
                fwd.append((s, e, size))
    # where the backward pass starts: the split of the schedule with the most transposing ops (JAX's
    # op names) after it and the fewest forward ops, of those named, after it
    score, top, back = 0, 0, None
    for t in sorted(seq, reverse=True):
        meta = instrs.get(seq[t], ("", "", []))[1]
        if "jvp(" in meta:
            score += 1 if "transpose(" in meta else -1
            if score > top:
                top, back = score, t
    return {"peak": best, "backward_from": back, "kinds": dict(kinds), "at": seq.get(t_best, "?"), "step": t_best,
            "steps": max(seq) + 1,
            "forward_gathers": sorted(fwd)}


def report(b, mib=2**20):
    if b is None:
        return "  (no dump found)"
    lines = [f"  temporaries live together at step {b['step']} of {b['steps']} ({b['at']}): {b['peak'] / mib:.1f} MiB"]
    for k, (count, size) in sorted(b["kinds"].items(), key=lambda kv: -kv[1][1]):
        lines.append(f"    {k:45s} {count:5d} buffers {size / mib:7.1f} MiB")
    fwd = b["forward_gathers"]
    if fwd:
        lines.append(f"    forward gathers live: {len(fwd)} buckets, {sum(x for *_, x in fwd) / mib:.1f} MiB; "
                     f"issued at steps {fwd[0][0]}-{fwd[-1][0]}, last read at steps "
                     f"{min(e for _, e, _ in fwd)}-{max(e for _, e, _ in fwd)}")
        if b["backward_from"] is not None:
            held = [x for _, e, x in fwd if e >= b["backward_from"]]
            lines.append(f"    of them read in the backward pass (from step {b['backward_from']}): "
                         f"{len(held)} buckets, "
                         f"{sum(held) / mib:.1f} MiB")
    return "\n".join(lines)
