"""benchmarks/compile_time.py --breakdown reads two things: the op counts of an optimized module
and XLA's own pass timing. Both readers, on a real compiled program and on XLA's log format."""
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax._compat import shard_map

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import compile_time  # noqa: E402

LOG = """\
I1204 16:54:09.587038 10106 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_small: simplification
I1204 16:54:09.587137 10106 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 900 us (900 us) (cumulative: 1 ms, max: 1 ms, #called: 1)
I1204 16:54:09.587153 10106 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_train_step: simplification
I1204 16:54:09.587163 10106 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 1.5 ms (1500 us) (cumulative: 2 ms, max: 1 ms, #called: 2)
I1204 16:54:09.587171 10106 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_train_step: fusion
I1204 16:54:09.587180 10106 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 500 us (500 us) (cumulative: 2 ms, max: 1 ms, #called: 3)
I1204 16:54:09.587190 10106 hlo_pass_pipeline.cc:176] HLO pass: fusion time: 2.0 ms (2000 us) (cumulative: 4 ms, max: 2 ms, #called: 4)
I1204 16:54:11.858276 10133 cpu_compiler.cc:2094] Compiling [jit_train_step] for CPU using JIT time: 2.51 s (2506037 us) (cumulative: 4 s, max: 2.51 s, #called: 18)
"""


def test_pass_times_reads_the_biggest_program_and_sums_each_pass():
    passes = compile_time.pass_times(LOG)
    assert passes == {"algsimp": 0.002, "fusion": 0.002, "(codegen: LLVM + machine code)": 2.506037}
    assert compile_time.pass_times("no XLA log here") == {}


def test_hlo_counts_of_a_compiled_program_with_a_collective():
    mesh = zj.make_mesh()

    def body(x):
        return jax.lax.psum(jnp.sin(x) * 2.0, "data")

    fn = jax.jit(shard_map(body, mesh, in_specs=(P("data"),), out_specs=P()))
    text = fn.lower(jnp.arange(8.0 * mesh.size)).compile().as_text()
    counts = compile_time.hlo_counts(text)
    assert counts["collectives"] == 1 and counts["custom_calls"] == 0
    assert counts["instructions"] >= 4 and 1 <= counts["fusions"] < counts["instructions"]
    # the control: a module with no collective counts none
    plain = compile_time.hlo_counts(jax.jit(lambda x: jnp.sin(x) * 2.0).lower(jnp.ones(8)).compile().as_text())
    assert plain["collectives"] == 0


def test_phase_slopes_are_seconds_per_added_layer():
    rows = {f"loop-{n}-{name}": {"trace_s": 0.2 + per * n} for n in (4, 8, 16) for name, per in (("ddp", 0.05), ("s3", 0.1))}
    slopes = compile_time.phase_slopes(rows, "loop", [4, 8, 16], ["ddp", "s3"], "trace_s")
    assert abs(slopes["ddp"] - 0.05) < 1e-9 and abs(slopes["s3"] - 0.1) < 1e-9


def test_kernel_counts_read_the_kernels_xla_compiles_for_a_program():
    x = jnp.ones((72, 40), jnp.float32)
    one = compile_time.kernel_counts(jax.jit(lambda a: jnp.sin(a) * 2.0).lower(x))
    # the same elementwise loop, a transpose of another shape and a reduction: kernels of their own
    three = compile_time.kernel_counts(jax.jit(lambda a: (jnp.sin(a) * 2.0, a.T * 3.0, jnp.exp(a).sum(0))).lower(x))
    assert one["kernels"] >= 1 and one["object_kb"] > 0
    assert three["kernels"] >= one["kernels"] + 2 and three["object_kb"] > one["object_kb"]
    if "llvm_ir_kb" in one:  # an XLA that dumps the kernels' LLVM IR (up to jax 0.11): one module a kernel
        assert 0 < one["llvm_ir_kb"] < three["llvm_ir_kb"]
    # a program of other shapes compiles kernels of its own (the suite's persistent compilation
    # cache holds none of it yet), as many as the first
    other = compile_time.kernel_counts(jax.jit(lambda a: jnp.sin(a) * 2.0).lower(jnp.ones((56, 24), jnp.float32)))
    assert other["kernels"] == one["kernels"]


def test_paired_ratios_pair_each_stage_with_its_baseline_in_the_same_round():
    # round 2 is slow for everyone (the machine drifted): per-round pairs cancel it, while the
    # ratio of the medians would not
    times = {"ddp": [(2.0, 0), (6.0, 0), (2.2, 0)], "s1": [(2.2, 0), (6.6, 0), (2.2, 0)],
             "fsdp": [(4.0, 0), (4.0, 0), (4.0, 0)], "s3": [(3.0, 0), (5.0, 0), (4.4, 0)]}
    paired = compile_time.paired_ratios(times)
    assert set(paired) == {"s1", "s3"}  # stages without their baseline in the run are left out
    assert paired["s1"] == pytest.approx({"median": 1.1, "low": 1.0, "high": 1.1})
    assert paired["s3"] == pytest.approx({"median": 1.1, "low": 0.75, "high": 1.25})


def test_linearized_alone_counts_the_primitives_linearized_one_by_one_and_restores_jax():
    from jax._src.interpreters import ad

    rule = ad.fallback_linearize_rule

    def f(x):
        return jax.lax.sin(x) * 2.0  # primitives bound directly: each linearized on its own

    with compile_time.linearized_alone() as seen:
        jax.make_jaxpr(jax.grad(f))(1.0)
    assert "mul" in seen
    assert ad.fallback_linearize_rule is rule
    with compile_time.linearized_alone() as none:
        jax.make_jaxpr(f)(1.0)  # no gradient: nothing linearized
    assert none == []
