"""NVMe offload on several processes: each process keeps its own devices' partitions of the
optimizer state (and with ZeRO-Infinity its rows of the params) in its own store, its node's
drive, as DeepSpeed's ranks do. 2 processes x 4 devices train as 1 x 8, and a checkpoint of
either restores on the other, the NVMe stores rewritten to its step."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import _nvme_dist_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "_nvme_dist_worker.py")
LAUNCH = [sys.executable, "-m", "zerojax", "launch", "--nproc", "2", "--devices-per-proc", "4", "--init-timeout", "120"]

pytestmark = pytest.mark.slow  # two launched pairs of processes per case: about 25 s each


def pair(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROJAX_", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                                    "MASTER_", "SLURM_"))}
    env["JAX_PLATFORMS"] = "cpu"
    # the pair compiles afresh: on jax 0.12.1 a two-process job whose programs come from a warm
    # persistent compilation cache (the suite's) was seen to hang
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    p = subprocess.run(LAUNCH + [WORKER, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def result(out):
    got = np.load(os.path.join(out, "result.npz"))
    return got["losses"], {k: got[k] for k in got.files if k.startswith("params/")}


@pytest.mark.parametrize("stage", [2, 3, "infinity"])
def test_two_processes_of_four_devices_equal_one_of_eight_and_checkpoints_move_between_them(tmp_path, stage):
    dirs = {name: tmp_path / name for name in ("one", "two", "one_from_two", "two_from_one",
                                               "nv_one", "nv_two", "nv_a", "nv_b")}
    for d in dirs.values():
        d.mkdir()
    ck_one, ck_two = tmp_path / "ck_one", tmp_path / "ck_two"
    # 1 x 8 here (saving its step 2), 2 x 4 launched (saving its own)
    worker.main(str(dirs["one"]), stage, str(dirs["nv_one"]), str(ck_one))
    pair(dirs["two"], stage, dirs["nv_two"], ck_two)
    want_losses, want = result(dirs["one"])
    losses, got = result(dirs["two"])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    # each process kept its own store, of its own partitions
    stores = sorted(os.listdir(dirs["nv_two"]))
    assert stores == ["zerojax_optimizer_p0", "zerojax_optimizer_p1"]

    # the pair's checkpoint resumed on one process, and the one process's on a pair
    worker.main(str(dirs["one_from_two"]), stage, str(dirs["nv_a"]), str(ck_two), "resume")
    pair(dirs["two_from_one"], stage, dirs["nv_b"], ck_one, "resume")
    for name in ("one_from_two", "two_from_one"):
        losses, got = result(dirs[name])
        np.testing.assert_allclose(losses, want_losses[worker.STEPS // 2:], rtol=1e-6, err_msg=name)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=f"{name}: {k}")
