"""benchmarks/checkpoint.py --smoke runs and prints the 1st and 3rd save next to the disk speed."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import child_env

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_checkpoint_benchmark_smoke_prints_first_and_third_save():
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH.parent), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(BENCH / "checkpoint.py"), "--smoke"], cwd=BENCH, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1st" in out.stdout and "3rd/1st" in out.stdout and "disk write" in out.stdout, out.stdout
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["save_1st_s"] > 0 and figures["save_3rd_s"] > 0 and figures["disk_write_GBps"] > 0
