"""benchmarks/checkpoint.py --smoke runs and prints the 1st and 3rd save next to the disk speed.

The smoke run saves a one-layer state three times, restores it onto another mesh, repeats the
saves as its "small state" at the same shape, and consolidates the checkpoint in one child
process (its own baseline: the default run's second, tiny one is skipped). ``--memory --smoke``
restores a state whose largest leaf is 4x the smallest budget in fresh processes, cold and after a
tiny warm-up restore, and prints each growth against state + budget + chunk."""
import json

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow
def test_checkpoint_benchmark_smoke_prints_first_and_third_save():
    out = run_benchmark("checkpoint.py", "--smoke")
    assert "1st" in out and "3rd/1st" in out and "disk write" in out, out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["save_1st_s"] > 0 and figures["save_3rd_s"] > 0 and figures["disk_write_GBps"] > 0


@pytest.mark.slow
def test_checkpoint_benchmark_memory_smoke_prints_the_bound_per_budget():
    out = run_benchmark("checkpoint.py", "--smoke", "--memory")
    assert "state + budget + chunk" in out and "largest leaf / 4" in out, out
    rows = json.loads(out.strip().splitlines()[-1])["restore_memory"]
    assert set(rows) == {"whole state at once", "default, 1 GiB", "16 KiB"}
    assert all(set(row) == {"cold", "warm"} and row["cold"]["growth_MB"] > 0 for row in rows.values())
