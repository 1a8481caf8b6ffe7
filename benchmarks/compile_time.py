"""The wait before the first step: zerojax's stages against the plain jit a JAX user writes.

First step = build the step, trace, lower, compile and run it once (the state is built before
the clock starts, for every contender alike). Contenders, on 8 simulated devices, a GPT with
d 128, vocab 8192, AdamW fp32, batch 16 x 64:

* ``ddp`` / ``fsdp``: ``jax.jit`` of value_and_grad + the optax update, params and state donated,
  replicated (DDP) or split along their largest dimension the device count divides (GSPMD FSDP);
* ``s0``-``s3``: ``zj.make_train_step`` at zerojax's defaults (DeepSpeed's).

Every (model, layer count) is measured in ``--rounds`` interleaved rounds (every other round in
reverse order), with every compiled program (``jax.clear_caches()``) and zerojax's per-optimizer checks
forgotten before each measurement, so each one starts as a new process would; the median is reported
(``--fresh``: each measurement runs in a process of its own instead, a user's new process exactly;
slower, by the imports and the state each child builds outside the clock). Beneath each row, the
median of the per-round ratios (a stage over its baseline measured next to it in the same round,
so the machine's drift between rounds cancels) with their lowest and highest. Goals: stages 0-2 <= 1.2x DDP, stage 3 <= 1.2x FSDP, at every
layer count, Python loop and ``lax.scan``; the seconds each added layer costs (a least-squares
slope over the layer counts) no steeper than plain jit's.

Two more figures, each from its own processes or loop:

* ``--cache``: JAX's persistent compilation cache. A fresh process builds and runs the first step
  of stage 3 (and of plain FSDP) with an empty cache directory, then another with the same
  directory: the warm first step over the cold one (goal <= 0.3x).
* ``--recompiles``: 20 steps of stage 2 with a checkpoint save every 5, a restore and ``finish()``;
  the backend compiles counted after the first step (goal: 0).

* ``--trace``: instead of the table, the Python trace of each contender's step alone, in this
  process (least CPU seconds over ``--rounds``, garbage collector paused), the primitives JAX
  linearizes one by one in it, and the seconds per added layer (goal: stage 3's no steeper than
  FSDP's). ``--persistence 0`` splits every param of stage 3 (DeepSpeed's
  ``stage3_param_persistence_threshold``; at d 128 its default keeps each layer's params whole).

* ``--breakdown``: instead of the table, each contender's first step in a fresh process, in its
  phases (building the step, Python trace, lowering, XLA compile, first run), the op counts of the
  optimized module (instructions, fusions, collectives, custom calls), the kernels XLA's CPU backend
  compiles for it and their LLVM IR size (from XLA's dump of one more, untimed compile: figures that
  do not move between runs, unlike the seconds) and XLA's slowest passes on
  the step, read from XLA's own pass timing (``TF_CPP_VMODULE=hlo_pass_pipeline=1,cpu_compiler=1``).

    python benchmarks/compile_time.py                        # layers 4 8 16 32, loop and scan
    python benchmarks/compile_time.py --breakdown --layers 4 8 --kinds loop
    python benchmarks/compile_time.py --layers 4 8 --kinds loop
    python benchmarks/compile_time.py --fresh --layers 4 8 --kinds loop --no-cache --no-recompiles
    python benchmarks/compile_time.py --trace --layers 4 8 16 --kinds loop --contenders fsdp s3 --rounds 5
    python benchmarks/compile_time.py --smoke                # tiny shapes, the loop only: the script runs
"""
import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" or os.environ.get("ZJ_COMPILE_CHILD") or os.environ.get("ZJ_BREAKDOWN_CHILD"):
    from _common import simulate_devices

    simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax._compat import count_compiles  # noqa: E402
from zerojax.models.gpt import GPTConfig, loss_fn  # noqa: E402

GOAL = 1.2
BASELINE = {"s0": "ddp", "s1": "ddp", "s2": "ddp", "s3": "fsdp"}


def make_tx():
    return optax.adamw(1e-4, weight_decay=0.01)


class Contender:
    """A state built outside the clock; ``first_step()`` times building the step + its first call."""

    def __init__(self, name, mesh, cfg, **zero):
        from vs_plain_jax import Plain, gpt_params

        self.name, self.cfg = name, cfg
        params = gpt_params(cfg)
        self.loss = loss_fn(cfg)
        if name in ("ddp", "fsdp"):
            self.plain = Plain(name, mesh, params, self.loss, make_tx)
        else:
            self.plain = None
            self.state = zj.shard_train_state(params, make_tx(), mesh=mesh,
                                              config=zj.ZeroConfig(stage=int(name[1]), **zero))
        jax.block_until_ready(self.plain.params if self.plain else self.state)

    def first_step(self, batch) -> tuple:
        """(wall seconds, CPU seconds of this process) of building the step and its first call.
        The CPU seconds (every thread's, ``time.process_time``) are the work itself: the time a
        shared machine takes the CPU away counts in the wall seconds only."""
        from vs_plain_jax import plain_step

        t, cpu = time.perf_counter(), time.process_time()
        if self.plain:
            p = self.plain
            fn = plain_step(self.loss, *p.shardings, p.batch_sh, make_tx)
            p.params, p.opt_state, value = fn(p.params, p.opt_state, batch)
        else:
            step = zj.make_train_step(self.loss, self.state)
            self.state, metrics = step(self.state, batch)
            value = metrics["loss"]
        jax.block_until_ready(value)
        return time.perf_counter() - t, time.process_time() - cpu

    def jitted(self, batch) -> tuple:
        """A newly built step's jitted function and its arguments (zerojax: make_train_step, its
        optimizer recognition included)."""
        from vs_plain_jax import plain_step

        if self.plain:
            p = self.plain
            return plain_step(self.loss, *p.shardings, p.batch_sh, make_tx), (p.params, p.opt_state, batch)
        return zj.make_train_step(self.loss, self.state).jitted, (self.state, batch)

    def trace(self, batch) -> None:
        """Build the step and trace it (Python only: no lowering, no compile)."""
        fn, call_args = self.jitted(batch)
        fn.trace(*call_args)

    def phases(self, batch) -> dict:
        """The first step in its phases, each timed: building the step (zerojax: make_train_step,
        its optimizer recognition included), Python trace, lowering to StableHLO, XLA compile, the
        first run; and the optimized module's op counts."""
        clock = [time.perf_counter()]

        def lap():
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        fn, call_args = self.jitted(batch)
        out = {"build_s": lap()}
        traced = fn.trace(*call_args)
        out["trace_s"] = lap()
        lowered = traced.lower()
        out["lower_s"] = lap()
        compiled = lowered.compile()
        out["compile_s"] = lap()
        jax.block_until_ready(compiled(*call_args))
        out["run_s"] = lap()
        out.update(hlo_counts(compiled.as_text()))
        # compiled once more, untimed, to read its kernels; XLA's pass log of that compile comes
        # after the mark, and pass_times reads the log before it
        print(KERNELS_MARK, file=sys.stderr, flush=True)
        out.update(kernel_counts(lowered))
        return out


OPCODE = re.compile(r"(?<![\w.\-])([a-z][a-z0-9\-]*)\(")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def hlo_counts(text: str) -> dict:
    """Op counts of an optimized HLO module: every instruction (fused computations' included),
    the fusions, the collectives (async starts counted once) and the custom calls."""
    ops = []
    for line in text.splitlines():
        line = line.strip()
        if " = " not in line or line.startswith(("HloModule", "//")):
            continue
        # "name = f32[8,16]{1,0} add(a, b), ...": the opcode is the first word followed by "("
        match = OPCODE.search(line.split(" = ", 1)[1])
        if match:
            ops.append(match.group(1))
    return {
        "instructions": len(ops),
        "fusions": sum(op == "fusion" for op in ops),
        "collectives": sum(op.removesuffix("-start") in COLLECTIVES for op in ops),
        "custom_calls": sum(op == "custom-call" for op in ops),
    }


def kernel_counts(lowered) -> dict:
    """The machine-code kernels XLA's CPU backend compiles for ``lowered`` (each a module of its
    own for LLVM, identical fusions compiled once), the size of their object code and, where this
    XLA dumps it (up to jax 0.11), of their optimized LLVM IR, read from XLA's dump of one more
    compile of the same program. Unlike seconds, these do not move between runs: a kernel more is
    about 10-15 ms more to compile on this machine. Empty off CPU, and where the program comes from
    a compilation cache (nothing is compiled then)."""
    if jax.default_backend() != "cpu":
        return {}
    with tempfile.TemporaryDirectory() as dump:
        lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        files = lambda suffix: [os.path.join(dump, f) for f in os.listdir(dump) if suffix(f)]  # noqa: E731
        objects = files(lambda f: ".obj-file." in f and f.endswith(".o"))
        if not objects:  # read back from JAX's persistent compilation cache (JAX decides once a process
            return {}    # whether it reads the cache, and a dump directory is not part of its key)
        kb = lambda paths: sum(map(os.path.getsize, paths)) / 1024  # noqa: E731
        out = {"kernels": len(objects), "object_kb": kb(objects)}
        ir = files(lambda f: f.endswith(".ir-with-opt.ll"))
        if ir:
            out["llvm_ir_kb"] = kb(ir)
        return out


def forget() -> None:
    """Drop every compiled program and what zerojax remembers per optimizer (its recognition
    and the gated passes' checks): the next first step starts as in a new process."""
    from zerojax.stages import _adam, _momentum
    from zerojax.update import _recognize

    jax.clear_caches()
    _recognize._cache.cache_clear()
    _adam.adam_recipe.cache_clear()
    _momentum.momentum_recipe.cache_clear()


def gpt_config(layers: int, kind: str, vocab: int, d: int, seq: int) -> GPTConfig:
    """The benchmark's GPT: ``layers`` layers of width ``d``, 4 heads, as a Python loop or under
    ``lax.scan`` (``kind``)."""
    return GPTConfig(vocab=vocab, n_layer=layers, d_model=d, n_head=4, seq_len=seq, scan=kind == "scan")


def batch_for(cfg, n_rows):
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, cfg.vocab, (n_rows, cfg.seq_len + 1), dtype=np.int32)}


def slope(xs, ys) -> float:
    """Least-squares seconds per added layer."""
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0]) if len(xs) > 1 else float("nan")


def paired_ratios(times: dict) -> dict:
    """Each zerojax stage's first step over its plain baseline's *in the same round* (the two run
    next to each other, so the machine's drift between rounds cancels): the median of those
    per-round ratios and their lowest and highest. ``times``: contender -> [(wall, cpu), ...],
    one entry a round."""
    out = {}
    for k, b in BASELINE.items():
        if k in times and b in times:
            per = sorted(z[0] / p[0] for z, p in zip(times[k], times[b]))
            out[k] = {"median": statistics.median(per), "low": per[0], "high": per[-1]}
    return out


def first_step_table(args) -> dict:
    mesh = zj.make_mesh()
    results = {}
    for kind in args.kinds:
        seconds = {name: [] for name in args.contenders}
        cpu_seconds = {name: [] for name in args.contenders}
        for layers in args.layers:
            cfg = gpt_config(layers, kind, args.vocab, args.d, args.seq)
            batch = batch_for(cfg, args.batch)
            # --fresh: each first step in a process of its own; else in this one, caches forgotten
            contenders = {k: None if args.fresh else Contender(k, mesh, cfg) for k in args.contenders}
            times = {k: [] for k in contenders}
            for r in range(args.rounds):
                for k in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
                    if args.fresh:
                        out = fresh_first_step(k, layers, kind, args)
                        times[k].append((out["first_step_s"], out["cpu_s"]))
                        continue
                    forget()
                    times[k].append(contenders[k].first_step(batch))
            del contenders
            med = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
            cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
            for k in med:
                seconds[k].append(med[k])
                cpu_seconds[k].append(cpu[k])
            ratios = {k: med[k] / med[b] for k, b in BASELINE.items() if k in med and b in med}
            cpu_ratios = {k: cpu[k] / cpu[b] for k, b in BASELINE.items() if k in cpu and b in cpu}
            paired = paired_ratios(times)
            results[f"{kind}-{layers}"] = {"seconds": med, "ratios": ratios, "cpu_seconds": cpu,
                                           "cpu_ratios": cpu_ratios, "paired": paired}
            print(f"{kind:>4} {layers:>3} layers  " + "  ".join(f"{k} {v:6.2f} s" for k, v in med.items()) + "   " +
                  "  ".join(f"{k}/{BASELINE[k]} {v:.2f}{'' if v <= GOAL else ' MISSED'}" for k, v in ratios.items()),
                  flush=True)
            print(f"{'':>4} {'cpu':>10}  " + "  ".join(f"{k} {v:6.2f} s" for k, v in cpu.items()) + "   " +
                  "  ".join(f"{k}/{BASELINE[k]} {v:.2f}" for k, v in cpu_ratios.items()), flush=True)
            if args.rounds > 1:
                print(f"{'':>4} {'per round':>10}  " + "  ".join(
                    f"{k}/{BASELINE[k]} {p['median']:.2f} ({p['low']:.2f}-{p['high']:.2f})" for k, p in paired.items()),
                    flush=True)
        for label, key, table in (("seconds", "slope", seconds), ("cpu seconds", "cpu-slope", cpu_seconds)):
            if len(args.layers) < 2:  # one layer count: no slope to fit
                break
            slopes = {k: slope(args.layers, v) for k, v in table.items()}
            results[f"{kind}-{key}"] = slopes
            print(f"{kind:>4} {label} per added layer  " + "  ".join(f"{k} {v:.3f}" for k, v in slopes.items()) +
                  "   " + "  ".join(f"{k}/{BASELINE[k]} {slopes[k] / slopes[BASELINE[k]]:.2f}"
                                    for k in BASELINE if k in slopes and BASELINE[k] in slopes), flush=True)
    return results


@contextlib.contextmanager
def linearized_alone():
    """Counts the primitives JAX linearizes one by one (tracing each one's JVP rule) inside the
    block, where a call's cached linearization does not cover them; ``[]`` where this JAX has
    no such rule to count."""
    try:
        from jax._src.interpreters import ad

        rule = ad.fallback_linearize_rule
    except (ImportError, AttributeError):  # pragma: no cover - a JAX that linearizes differently
        yield []
        return
    seen = []

    def counted(prim, *args, **kwargs):
        seen.append(prim.name)
        return rule(prim, *args, **kwargs)

    ad.fallback_linearize_rule = counted
    try:
        yield seen
    finally:
        ad.fallback_linearize_rule = rule


def trace_table(args) -> dict:
    """The Python trace alone, in this process: each contender's step built and traced
    ``--rounds`` times at each layer count, every (layer count, contender) pair once a round in
    alternating order (the garbage collector run before and paused during each trace), in CPU
    seconds. The least is reported: the trace is the same Python work every time, and what lies
    above the least is the machine's (a shared machine's speed drifts over minutes, which the
    interleaving spreads over every cell alike). Also the primitives linearized one by one (a
    deterministic count), and the seconds per added layer."""
    zero = {} if args.persistence is None else {"param_persistence_threshold": args.persistence}
    mesh = zj.make_mesh()
    print(f"trace of the step (CPU seconds, least of {args.rounds} interleaved rounds, gc paused), GPT d {args.d}, "
          f"vocab {args.vocab}" + (f", zerojax param_persistence_threshold {args.persistence}" if zero else ""),
          flush=True)
    out = {}
    for kind in args.kinds:
        cells = {}
        for layers in args.layers:
            cfg = gpt_config(layers, kind, args.vocab, args.d, args.seq)
            for k in args.contenders:
                cells[(layers, k)] = (Contender(k, mesh, cfg, **zero), batch_for(cfg, args.batch))
        times, counts = {c: [] for c in cells}, {}
        for r in range(max(args.rounds, 2) + 1):  # the first round warms JAX's caches (not counted)
            for c in (list(cells) if r % 2 == 0 else list(cells)[::-1]):
                contender, batch = cells[c]
                gc.collect()
                gc.disable()
                try:
                    with linearized_alone() as seen:
                        t = time.process_time()
                        contender.trace(batch)
                        spent = time.process_time() - t
                finally:
                    gc.enable()
                if r:
                    times[c].append(spent)
                    counts[c] = len(seen)
        del cells
        for layers in args.layers:
            out[f"{kind}-{layers}"] = {"seconds": {k: min(times[(layers, k)]) for k in args.contenders},
                                       "linearized_alone": {k: counts[(layers, k)] for k in args.contenders}}
            print(f"{kind:>4} {layers:>3} layers  " + "  ".join(
                f"{k} {min(times[(layers, k)]):5.2f} s ({counts[(layers, k)]})" for k in args.contenders), flush=True)
        if len(args.layers) > 1:
            per = {k: slope(args.layers, [min(times[(n, k)]) for n in args.layers]) for k in args.contenders}
            out[f"{kind}-slope"] = per
            print(f"{kind:>4} trace seconds per added layer  " + "  ".join(f"{k} {v:.3f}" for k, v in per.items()) +
                  "   " + "  ".join(f"{k}/{b} {per[k] / per[b]:.2f}" for k, b in BASELINE.items()
                                    if k in per and b in per and per[b] > 0), flush=True)
    return out


CHILD = "ZJ_COMPILE_CHILD"
BREAKDOWN_CHILD = "ZJ_BREAKDOWN_CHILD"
KERNELS_MARK = "-- the step compiled again for its kernel count --"
PASS_LOG = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1,cpu_compiler=1"}
MODULE_LINE = re.compile(r"Running HLO pass pipeline on module (\S+): ")
PASS_LINE = re.compile(r"HLO pass: (\S+) time: .*?\((\d+) us\)")
CODEGEN_LINE = re.compile(r"Compiling \[(\S+)\] for \S+ using JIT time: .*?\((\d+) us\)")


def pass_times(log: str) -> dict:
    """XLA's own timing of the biggest program in a compile log (TF_CPP_VMODULE=hlo_pass_pipeline=1,
    cpu_compiler=1): seconds per HLO pass summed over its runs, and the backend's code generation."""
    per_module: dict = {}
    module = None
    for line in log.splitlines():
        if m := MODULE_LINE.search(line):
            module = m.group(1)
        elif (m := PASS_LINE.search(line)) and module:
            passes = per_module.setdefault(module, {})
            passes[m.group(1)] = passes.get(m.group(1), 0.0) + int(m.group(2)) / 1e6
        elif m := CODEGEN_LINE.search(line):
            per_module.setdefault(m.group(1), {})["(codegen: LLVM + machine code)"] = int(m.group(2)) / 1e6
    if not per_module:
        return {}
    return max(per_module.values(), key=lambda passes: sum(passes.values()))


def child_spec(name, layers, kind, args) -> str:
    """What a child process measures, as the one environment value it reads (:func:`child_contender`)."""
    return f"{name},{layers},{kind},{args.vocab},{args.d},{args.seq},{args.batch}"


def child_contender(variable: str):
    """In a fresh process: ``(name, contender, batch)`` from the :func:`child_spec` in ``variable``."""
    name, layers, kind, vocab, d, seq, batch_rows = os.environ[variable].split(",")
    cfg = gpt_config(int(layers), kind, int(vocab), int(d), int(seq))
    return name, Contender(name, zj.make_mesh(), cfg), batch_for(cfg, int(batch_rows))


def child_breakdown() -> None:
    """In a fresh process: one contender's first step in its phases, printed as JSON."""
    _, c, batch = child_contender(BREAKDOWN_CHILD)
    print(json.dumps(c.phases(batch)))


def breakdown_table(args) -> dict:
    """Where each contender's first step goes, each in a fresh process: build, trace, lower,
    compile, run; the optimized module's op counts; XLA's slowest passes on the step."""
    head = (f"{'model':>9} {'contender':>9} {'build':>6} {'trace':>6} {'lower':>6} {'compile':>7} {'run':>5} "
            f"{'instr':>6} {'fusion':>6} {'coll':>5} {'custom':>6} {'kernels':>7} {'IR KB':>6} {'obj KB':>6}  "
            "slowest XLA passes of the step (s)")
    print("breakdown of the first step (seconds; op counts of the optimized module; kernels compiled)\n" + head, flush=True)
    out = {}
    for kind in args.kinds:
        for layers in args.layers:
            for name in args.contenders:
                env = dict(os.environ, **PASS_LOG)
                env[BREAKDOWN_CHILD] = child_spec(name, layers, kind, args)
                res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, check=True,
                                     capture_output=True, text=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                passes = pass_times(res.stderr.split(KERNELS_MARK)[0])
                row["passes"] = dict(sorted(passes.items(), key=lambda kv: -kv[1])[:args.top_passes])
                row["hlo_passes_s"] = sum(v for k, v in passes.items() if not k.startswith("(codegen"))
                out[f"{kind}-{layers}-{name}"] = row
                print(f"{kind + ' ' + str(layers):>9} {name:>9} {row['build_s']:6.2f} {row['trace_s']:6.2f} "
                      f"{row['lower_s']:6.2f} {row['compile_s']:7.2f} {row['run_s']:5.2f} {row['instructions']:6d} "
                      f"{row['fusions']:6d} {row['collectives']:5d} {row['custom_calls']:6d} "
                      f"{row.get('kernels', 0):7d} {row.get('llvm_ir_kb', 0):6.0f} {row.get('object_kb', 0):6.0f}  "
                      f"HLO passes {row['hlo_passes_s']:.2f}; " +
                      ", ".join(f"{k} {v:.2f}" for k, v in row["passes"].items()), flush=True)
        if len(args.layers) > 1:
            for phase in ("trace_s", "compile_s"):
                per = phase_slopes(out, kind, args.layers, args.contenders, phase)
                print(f"{kind} {phase[:-2]} seconds per added layer  " + "  ".join(f"{k} {v:.3f}" for k, v in per.items())
                      + "   " + "  ".join(f"{k}/{b} {per[k] / per[b]:.2f}" for k, b in BASELINE.items()
                                        if k in per and b in per and per[b] > 0), flush=True)
    return out


def phase_slopes(rows: dict, kind: str, layers, contenders, phase: str) -> dict:
    """Seconds each added layer costs one phase of each contender's first step (least squares
    over the layer counts of a --breakdown)."""
    return {name: slope(layers, [rows[f"{kind}-{n}-{name}"][phase] for n in layers]) for name in contenders}


def child_first_step() -> None:
    """In a fresh process: one contender's first step (wall and CPU seconds), printed as JSON."""
    name, c, batch = child_contender(CHILD)
    wall, cpu = c.first_step(batch)
    print(json.dumps({"name": name, "first_step_s": wall, "cpu_s": cpu}))


def fresh_first_step(name, layers, kind, args, env=None) -> dict:
    """One contender's first step in a process of its own (as a user's new process pays it)."""
    env = dict(os.environ if env is None else env, **{CHILD: child_spec(name, layers, kind, args)})
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, check=True, capture_output=True,
                         text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def cache_figures(args) -> dict:
    layers = args.layers[0] if args.smoke else args.layers[len(args.layers) // 2]
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        for name in (("s3",) if args.smoke else ("s3", "fsdp")):
            runs = []
            for _ in ("cold", "warm"):
                runs.append(fresh_first_step(name, layers, "loop", args, env)["first_step_s"])
            out[name] = {"cold_s": runs[0], "warm_s": runs[1], "warm_over_cold": runs[1] / runs[0]}
            print(f"persistent cache, {name}, {layers} layers: cold {runs[0]:.2f} s  warm {runs[1]:.2f} s  "
                  f"warm/cold {runs[1] / runs[0]:.2f} (goal <= 0.30)", flush=True)
    return out


def recompile_figures(args, steps: int = 20, every: int = 5) -> dict:
    """Backend compiles after the first step, by phase: the step's own programs must not compile
    again; each checkpoint program (save, restore) compiles once per state layout. ``steps``
    steps with a save every ``every``."""
    cfg = gpt_config(args.layers[0], "loop", args.vocab, args.d, args.seq)
    batch = batch_for(cfg, args.batch)
    from vs_plain_jax import gpt_params

    state = zj.shard_train_state(gpt_params(cfg), make_tx(), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2))
    step = zj.make_train_step(loss_fn(cfg), state)
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    phases = {"steps": 0, "first save": 0, "later saves": 0, "restore": 0, "after restore and finish()": 0}
    with tempfile.TemporaryDirectory() as d:
        mngr = zj.checkpoint.CheckpointManager(d, max_to_keep=2)

        def phase(name, fn):
            with count_compiles() as seen:
                out = fn()
                jax.block_until_ready(out)
            phases[name] += len(seen)
            return out

        saves = 0
        for i in range(2, steps + 1):
            state, _ = phase("steps", lambda: step(state, batch))
            if i % every == 0:
                phase("later saves" if saves else "first save", lambda: mngr.save(i, state))
                saves += 1
        mngr.wait_until_finished()
        state, _ = phase("restore", lambda: mngr.restore(state))  # onto the live state's plan

        def after():
            s, _ = step(state, batch)
            return step(step.finish(s), batch)[0]

        state = phase("after restore and finish()", after)
        mngr.close()
    step_compiles = phases["steps"] + phases["later saves"] + phases["after restore and finish()"]
    print(f"compiles after the first step ({steps} steps, a save every {every}, a restore, finish()): " +
          ", ".join(f"{k} {v}" for k, v in phases.items()) +
          f"; recompiles of the step or of a saved layout: {step_compiles} (goal 0; the first save and the "
          "restore compile their program once per state layout)", flush=True)
    return {"phases": phases, "recompiles": step_compiles}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16, 32])
    ap.add_argument("--kinds", nargs="*", default=["loop", "scan"], choices=["loop", "scan"])
    ap.add_argument("--contenders", nargs="*", default=["ddp", "fsdp", "s0", "s1", "s2", "s3"],
                    choices=["ddp", "fsdp", "s0", "s1", "s2", "s3"])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-cache", action="store_true", help="skip the persistent-cache processes")
    ap.add_argument("--no-recompiles", action="store_true", help="skip the compile count over 20 steps")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round (checks the script runs)")
    ap.add_argument("--fresh", action="store_true",
                    help="each first step in a process of its own (as a new process pays it), not in this one")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the phases of each contender's first step, op counts and XLA's slowest passes")
    ap.add_argument("--top-passes", type=int, default=4, help="passes listed per contender in --breakdown")
    ap.add_argument("--trace", action="store_true",
                    help="only the Python trace of each contender's step, in this process (least CPU seconds "
                         "over --rounds, primitives linearized one by one, seconds per added layer)")
    ap.add_argument("--persistence", type=int, default=None,
                    help="zerojax's param_persistence_threshold (default DeepSpeed's 1e5; 0: every param split)")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.d, args.vocab, args.seq, args.batch, args.rounds = [1, 2], 32, 517, 8, 8, 1
        args.kinds = args.kinds[:1]
    if args.breakdown:
        print(json.dumps({"breakdown": breakdown_table(args)}))
        return
    if args.trace:
        print(json.dumps({"trace": trace_table(args)}))
        return
    print(f"first step (build + trace + lower + compile + run), GPT d {args.d}, vocab {args.vocab}, AdamW fp32, "
          f"batch {args.batch} x {args.seq}, {jax.device_count()} devices, median of {args.rounds} interleaved rounds"
          f"{', each in a fresh process' if args.fresh else ''}; "
          f"goal: zerojax / plain <= {GOAL}", flush=True)
    figures = {"first_step": first_step_table(args)}
    if not args.no_recompiles:
        # --smoke: 4 steps, a save every 2 (a first save and a later one)
        figures["recompiles"] = recompile_figures(args, *((4, 2) if args.smoke else ()))
    if not args.no_cache:
        figures["cache"] = cache_figures(args)
    print(json.dumps(figures))


if __name__ == "__main__":
    if os.environ.get(CHILD):
        child_first_step()
    elif os.environ.get(BREAKDOWN_CHILD):
        child_breakdown()
    else:
        main()
