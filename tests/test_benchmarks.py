"""The benchmark scripts that need a GPU or a long run keep working: their --smoke modes run here
on tiny shapes (the figures mean nothing on the CPU; the scripts must not rot). Each runs in its
own process, as a user runs it, compiled with XLA's older CPU emitters (tests.helpers.SMOKE_FLAGS).

The smoke modes compile each contender once, at one GPT layer (compile_time: plain DDP and
stage 2 at 1 and 2 layers, for its slope) and one batch row per device; the two scripts share
vs_plain_jax's code, so gpu_check's smoke run times one of its ratios and one optimizer, and
vs_plain_jax's every ratio and every optimizer. compile_time's smoke counts recompiles over 4 steps with a save every 2, a restore and
finish(), and times the persistent cache cold and warm in two child processes (stage 3 only); its
--trace smoke traces FSDP's and stage 3's steps at 1 and 2 layers, in process."""
from tests.helpers import run_benchmark as run


def test_gpu_check_smoke_runs_every_section():
    out = run("gpu_check.py", "--smoke")
    assert "5 of 5 sections ran" in out
    assert "6. an all-gather of many operands under Shardy" in out
    for figure in ("fused / copy", "ZenFlow / plain offload", "offload / on device", "s3/s0", "s0/jit",
                   "stage 3 lean / stage 0"):
        assert figure in out, f"{figure!r} missing from:\n{out}"


def test_vs_plain_jax_smoke_prints_every_ratio_in_pairs():
    out = run("vs_plain_jax.py", "--smoke", "--pairs")
    assert "each ratio from its own pair" in out
    for figure in ("s0/ddp", "s1/ddp", "s2/ddp", "s3/fsdp", "s3/s0", "s3p0/fsdp", "s3p0/s0", "s3auto/fsdp", "s3lean/fsdp", "s0/jit"):
        assert f"{figure} " in out, f"{figure!r} missing from:\n{out}"
    for optimizer in ("adamw", "lion", "sgd-momentum"):
        assert f"fp32 params, {optimizer}" in out, f"optimizer-bound {optimizer} missing from:\n{out}"


def test_compile_time_smoke_prints_ratios_slopes_recompiles_and_the_cache():
    # one plain contender and one zerojax stage (the ratio, slope and phase code is shared by all):
    # the cache children build stage 3 whatever the contenders
    out = run("compile_time.py", "--smoke", "--contenders", "ddp", "s2")
    for figure in ("s2/ddp", "seconds per added layer", "recompiles of the step or of a saved layout: 0",
                   "persistent cache, s3", "warm/cold"):
        assert figure in out, f"{figure!r} missing from:\n{out}"


def test_compile_time_trace_smoke_prints_counts_and_the_slope_ratio():
    out = run("compile_time.py", "--trace", "--smoke", "--contenders", "fsdp", "s3")
    for figure in ("trace of the step", "trace seconds per added layer", "s3/fsdp"):
        assert figure in out, f"{figure!r} missing from:\n{out}"


def test_variadic_gather_smoke_reports_both_partitioners_and_an_equal_step():
    # Shardy's verdict on an all-gather of many operands is whatever this JAX says; where GSPMD
    # compiles it, stage 1 with it must leave the params exactly where stage 1 as shipped does
    out = run("variadic_gather.py", "--smoke")
    for partitioner in ("shardy", "gspmd"):
        assert f"all-gather of two operands under {partitioner}: " in out, out
    if "under gspmd: runs" in out:
        assert "s1v params - s1 params: 0.0e+00" in out, out


def test_muon_smoke_prints_every_contender():
    out = run("muon.py", "--smoke")
    for name in ("zj-adamw-s1", "zj-adamw-s3", "zj-muon-s1", "zj-muon-s3", "zj-optax-s1", "zj-optax-s3", "zj-adamw-s0",
                 "zj-muon-s0", "zj-optax-s0", "zj-adamw-off-s1", "zj-muon-off-s1", "zj-optax-off-s1", "zo-muon-s1",
                 "zo-optax-s1", "fsdp-muon", "ddp-muon"):
        rows = [line for line in out.splitlines() if line.startswith(f"{name} ")]
        assert len(rows) == 2, f"{name!r} missing from:\n{out}"  # the collectives table and the timings
    assert "bytes/4Psi" in out and "ms/step" in out
    # the per-device goals: momentum bytes and Newton–Schulz FLOPs, each with its verdict
    assert "Muon momentum per device" in out and "PASS (|diff| <= one matrix)" in out, out
    goals = [line for line in out.splitlines() if line.rstrip().endswith(("PASS", "FAIL (the floor)"))]
    assert len(goals) == 4 and goals[2].rstrip().endswith("PASS"), out  # 3 + 5 matrices: balanced


def test_bigger_than_memory_smoke_trains_and_prints_the_disk_figures():
    out = run("bigger_than_memory.py", "--smoke")
    assert "(falling)" in out, out
    for figure in ("on disk", "disk: write", "per step: read", "x (bytes / bandwidth + compute)", "peak RSS during the steps"):
        assert figure in out, f"{figure!r} missing from:\n{out}"
    # the smoke run saves after step 1, resumes on a fresh nvme_path and trains steps 2-3 again
    for figure in ("checkpoint of step 1: ", "GiB on disk; save ", "restore ", "losses after the resume (steps 2-3): "):
        assert figure in out, f"{figure!r} missing from:\n{out}"
    assert "the straight run's steps 2-3: " in out and "(equal)" in out, out


def test_gpu_plan_smoke_compiles_every_row_for_h100s():
    import pytest

    from zerojax._compat import cuda_plugin
    if cuda_plugin() is None:
        pytest.skip("JAX's CUDA plugin is not installed (docs/gpu-plan.md)")
    out = run("gpu_plan.py", "--smoke")
    for name in ("stage 0 bf16", "stage 3 bf16", "stage 3 fp32", "plain FSDP fp32"):
        rows = [line for line in out.splitlines() if line.strip().startswith(name)]
        assert len(rows) == 1 and " fits " in rows[0], out
    assert "stage 3 / stage 0 peak (bf16)" in out and "NVIDIA H100 SXM 80 GB" in out, out
