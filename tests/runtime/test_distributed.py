"""Multi-process runs: 2 processes x 4 CPU devices against 1 x 8, checkpoints across process counts,
the launcher's failure handling, start-up errors, and the environment each launcher sets."""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests._dist_worker import (
    ROWS,
    STAGES,
    STEPS,
    config,
    flat_params,
    logical_opt,
    train_all,
    tx,
)
from tests.helpers import batches, init_params, loss_fn, max_rel_err
from safetensors.numpy import load_file

import zerojax as zj
from zerojax.runtime import _distributed as dist
from zerojax.runtime import _launch as launch
from zerojax.checkpoint import CheckpointManager, consolidate

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_dist_worker.py")
LAUNCH = [sys.executable, "-m", "zerojax", "launch"]  # as users start it (zerojax/__main__.py)
LAUNCHER_VARS = ("ZEROJAX_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_")


def child_env(**extra) -> dict:
    """This environment without any launcher's variables (the child states its own device count)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


# ------------------------------------------------------------- 2 processes x 4 against 1 x 8
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2 x 4 run of every stage (a launched pair) and the same in this process on 8 devices.

    The pair trains while this process does; it then restores the checkpoint this process saved,
    and saves its own.
    """
    root = tmp_path_factory.mktemp("dist")
    one = str(root / "one")
    with open(root / "pair.log", "w+") as log:
        pair = subprocess.Popen(LAUNCH + ["--nproc", "2", "--devices-per-proc", "4", "--init-timeout", "120",
                                          WORKER, "train", str(root), one],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
        try:
            reference = train_all(zj.make_mesh(8), batches(STEPS, batch_size=ROWS))
            with CheckpointManager(one) as mngr:
                mngr.save(STEPS, reference[3][1], data_state={"saved_by": 1})
            with open(one + ".done", "w"):
                pass
            pair.wait(timeout=300)
        finally:
            if pair.poll() is None:
                pair.kill()
                pair.wait()
        log.seek(0)
        output = log.read()
    assert pair.returncode == 0, output
    with open(root / "result.json") as f:
        info = json.load(f)
    return root, reference, dict(np.load(root / "result.npz")), info


def test_pair_is_two_processes_of_four_devices(runs):
    info = runs[3]
    assert (info["process_count"], info["device_count"], info["source"]) == (2, 8, "zerojax")


def test_shard_batch_puts_each_process_rows_in_order(runs):
    """Process 0 gave rows 0-15, process 1 rows 16-31: the global batch is the original one."""
    arrays = runs[2]
    want = batches(STEPS, batch_size=ROWS)[0]
    for k, v in want.items():
        np.testing.assert_array_equal(arrays[f"batch/{k}"], v)


@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_match_one_process(runs, stage):
    _, reference, arrays, _ = runs
    losses, state = reference[stage]
    np.testing.assert_allclose(arrays[f"s{stage}/losses"], losses, rtol=1e-6)
    want = flat_params(state)
    got = {k: arrays[f"s{stage}/params/{k}"] for k in want}
    assert max_rel_err(got, want) < 1e-6
    # and training moved the params: the comparison is not between two initial states
    start = flat_params(zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx(), mesh=zj.make_mesh(8)))
    assert max_rel_err(got, start) > 1e-3


def test_memory_report_counts_every_process(runs):
    _, reference, _, info = runs
    report = zj.memory_report(reference[3][1])  # one process, 8 devices: the same layout
    got = info["report"]
    assert got["devices"] == 8 and got["total"] == report.total_bytes() and got["max"] == report.max_bytes()
    per_process = {int(p): b for p, b in got["per_process"].items()}
    assert sorted(per_process) == [0, 1] and sum(per_process.values()) == got["total"]
    assert per_process[0] == sum(report.per_device[d]["device"] for d in got["mine"])
    assert len(got["mine"]) == 4 and got["process_index"] == 0
    # in one process: all of it is this process's
    assert report.process_bytes() == report.total_bytes() and list(report.per_process) == [0]


def test_checkpoint_saved_by_one_process_restores_in_two(runs):
    _, reference, arrays, info = runs
    state = reference[3][1]
    assert info["restored"] == {"step": STEPS, "data_state": {"saved_by": 1}}
    for k, v in flat_params(state).items():
        np.testing.assert_array_equal(arrays[f"restored/params/{k}"], v)
    for i, v in enumerate(logical_opt(state)):
        np.testing.assert_array_equal(arrays[f"restored/opt/{i}"], v)


@pytest.mark.parametrize("n,stage", [(8, 1), (4, 3)])
def test_checkpoint_saved_by_two_processes_restores_in_one(runs, n, stage):
    root, _, arrays, _ = runs
    target = zj.abstract_train_state(init_params(jax.random.PRNGKey(0)), tx(), mesh=zj.make_mesh(n),
                                     config=config(stage))
    restored, data_state = CheckpointManager(root / "two").restore(target)
    assert int(restored.step) == STEPS and data_state == {"saved_by": 2}
    for k, v in flat_params(restored).items():
        np.testing.assert_array_equal(v, arrays[f"s3/params/{k}"])
    # training continues from it
    step = zj.make_train_step(loss_fn, restored)
    restored, _ = step(restored, batches(1, batch_size=ROWS, seed=7)[0])
    assert int(restored.step) == STEPS + 1


def test_consolidate_a_two_process_checkpoint(runs, tmp_path):
    root, _, arrays, _ = runs
    got = load_file(consolidate(root / "two", str(tmp_path / "m.safetensors"), progress=False))
    want = {k[len("s3/params/"):].replace("/", "."): v for k, v in arrays.items() if k.startswith("s3/params/")}
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
    # the 16-bit copy was written by process 0 alone while process 1 went on
    copy = load_file(str(root / "two" / str(STEPS) / "model_16bit.safetensors"))
    np.testing.assert_array_equal(copy["out"], np.asarray(jnp.asarray(want["out"], jnp.bfloat16)))


def test_uneven_rows_across_processes_is_an_error(runs):
    assert "different numbers of rows (process 0: 4 rows, process 1: 8 rows)" in runs[3]["uneven"]


# ------------------------------------------------------------------------------ failures
def _reader(proc, lines):
    for line in proc.stdout:
        lines.append(line)


@contextlib.contextmanager
def _launched_until_ready(args, timeout, poll):
    """``zerojax launch ARGS``, entered once both ranks print READY: (process, output lines so
    far, still growing). On exit the launcher is killed if still running and its output closed."""
    proc = subprocess.Popen(LAUNCH + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(), cwd=ROOT)
    lines: list = []
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while sum("READY" in line for line in lines) < 2:
            if proc.poll() is not None or time.monotonic() >= deadline:
                raise AssertionError("".join(lines))
            time.sleep(poll)
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        time.sleep(0.2)
        proc.stdout.close()


def test_killed_worker_stops_the_launch():
    args = ["--nproc", "2", "--devices-per-proc", "2", "--grace", "2", WORKER, "loop"]
    with _launched_until_ready(args, 120, 0.1) as (proc, lines):
        ready = [line for line in lines if line.startswith("[rank 1] READY")]
        assert ready and "sum 16.0" in ready[0], "".join(lines)  # 4 devices x 4 ones: a cross-process sum
        os.kill(int(ready[0].split()[3]), signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - killed
    text = "".join(lines)
    assert code != 0 and elapsed < 30, (code, elapsed, text)
    assert "rank 1 (host localhost) was killed by SIGKILL" in text, text
    assert "last" in text and "line(s) of rank 1" in text


def test_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    """Rank 0 ignores SIGTERM: the launcher escalates to SIGKILL after the grace period."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        rank = int(os.environ["ZEROJAX_PROCESS_ID"])
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("rank zero waits", flush=True)
            time.sleep(600)
        time.sleep(0.5)
        for i in range(30):
            print(f"line {i}")
        sys.exit(7)
    """))
    start = time.monotonic()
    proc = subprocess.run(LAUNCH + ["--nproc", "2", "--grace", "1", str(script)], capture_output=True, text=True,
                          env=child_env(), cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 7 and time.monotonic() - start < 30, proc.stderr
    assert "rank 1 (host localhost) exited with code 7; stopping the other 1 running rank(s)" in proc.stderr
    assert "  | line 29" in proc.stderr and "  | line 9" not in proc.stderr  # the last 20 lines
    assert "[rank 0] rank zero waits" in proc.stdout and "[rank 1] line 0" in proc.stdout


def test_ctrl_c_reaches_every_rank(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent("""
        import os, time
        try:
            print("READY", flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            print("INTERRUPTED", os.environ["ZEROJAX_PROCESS_ID"], flush=True)
            raise SystemExit(1)
    """))
    with _launched_until_ready(["--nproc", "2", str(script)], 60, 0.05) as (proc, lines):
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    text = "".join(lines)
    assert code == 128 + signal.SIGINT, text
    assert "[rank 0] INTERRUPTED 0" in text and "[rank 1] INTERRUPTED 1" in text, text


def test_unreachable_coordinator_fails_with_a_message():
    """Process 1 finds nobody at the address; process 0 waits for a peer that never comes."""
    port = launch.free_port()
    procs = {}
    for pid in (1, 0):
        env = child_env(ZEROJAX_COORDINATOR=f"127.0.0.1:{port if pid else launch.free_port()}",
                        ZEROJAX_NUM_PROCESSES="2", ZEROJAX_PROCESS_ID=str(pid), ZEROJAX_INIT_TIMEOUT="3")
        procs[pid] = subprocess.Popen([sys.executable, WORKER, "init"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env)
    start = time.monotonic()
    out = {pid: p.communicate(timeout=60)[0] for pid, p in procs.items()}
    assert time.monotonic() - start < 40
    assert procs[1].returncode != 0 and "PROCESSES" not in out[1]
    assert f"process 1 of 2 cannot reach the coordinator at 127.0.0.1:{port}" in out[1], out[1]
    assert "ZEROJAX_INIT_TIMEOUT" in out[1]
    assert procs[0].returncode == 1 and "not all 2 processes joined within 3 s" in out[0], out[0]


# ------------------------------------------------------------------ torchrun's variables, for real
def _port_pair() -> int:
    """A free port p whose successor is free too (torchrun's store at p, jax's coordinator at p + 1)."""
    for _ in range(50):
        port = launch.free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


RUN_WORKER = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def check_torchrun_start(prelude: str = "") -> None:
    """Two processes given only torchrun's variables (what torchrun sets) join one jax run."""
    port = _port_pair()
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in child_env().items() if k != "XLA_FLAGS"}  # one CPU device per process
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), ZEROJAX_INIT_TIMEOUT="60")
        procs.append(subprocess.Popen([sys.executable, "-c", prelude + RUN_WORKER, WORKER, "init"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT))
    out = []
    try:
        out = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, text) in enumerate(zip(procs, out)):
        assert p.returncode == 0, (rank, text)
        # the device count is global: both processes' devices, seen from each
        assert "PROCESSES 2 DEVICES 2 SOURCE torchrun" in text, (rank, text)


def test_torchrun_environment_starts_two_real_processes():
    check_torchrun_start()


def test_torchrun_check_catches_a_start_up_that_ignores_torchrun():
    ignore = ("import zerojax.runtime._distributed as d; real = d.process_env; "
              "d.process_env = lambda environ=None: None if 'RANK' in (environ or __import__('os').environ) "
              "else real(environ); ")
    with pytest.raises(AssertionError, match="PROCESSES 1"):
        check_torchrun_start(ignore)


# --------------------------------------------------------------------------- environment
def test_initialize_is_a_no_op_without_a_launcher(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("jax.distributed.initialize must not be called")

    monkeypatch.setattr(jax.distributed, "initialize", forbidden)
    assert dist.initialize(environ={}) is None
    assert dist.initialize(environ={"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_ID": "5"}) is None


ZJ = {"ZEROJAX_COORDINATOR": "10.0.0.1:1234", "ZEROJAX_NUM_PROCESSES": "4", "ZEROJAX_PROCESS_ID": "3",
      "ZEROJAX_LOCAL_RANK": "1", "ZEROJAX_LOCAL_DEVICES": "2"}
TORCHRUN = {"MASTER_ADDR": "node7", "MASTER_PORT": "29500", "WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1"}
SLURM = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "8", "SLURM_PROCID": "5",
         "SLURM_LOCALID": "1"}


@pytest.mark.parametrize("env,want", [
    (ZJ, dist.ProcessEnv("zerojax", 4, 3, "10.0.0.1:1234", 1, 2)),
    (TORCHRUN, dist.ProcessEnv("torchrun", 16, 9, "node7:29501", 1, None)),
    ({**TORCHRUN, "MASTER_ADDR": "fe80::1"}, dist.ProcessEnv("torchrun", 16, 9, "[fe80::1]:29501", 1, None)),
    (SLURM, dist.ProcessEnv("slurm", 8, 5, None, 1, None)),
    ({**SLURM, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, dist.ProcessEnv("slurm", 2, 1, None, 1, None)),
    ({**SLURM, **TORCHRUN, **ZJ}, dist.ProcessEnv("zerojax", 4, 3, "10.0.0.1:1234", 1, 2)),  # zerojax's first
    ({**SLURM, **TORCHRUN}, dist.ProcessEnv("torchrun", 16, 9, "node7:29501", 1, None)),  # then torchrun's
    ({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}, dist.ProcessEnv("torchrun", 1, 0, "node7:29501", 1, None)),
    ({**TORCHRUN, "JAX_COORDINATOR_PORT": "4000"}, dist.ProcessEnv("torchrun", 16, 9, "node7:4000", 1, None)),
    ({"ZEROJAX_LOCAL_DEVICES": "8"}, dist.ProcessEnv("zerojax", 1, 0, None, None, 8)),
    ({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
    ({"PATH": "/bin"}, None),
])
def test_process_env(env, want):
    assert dist.process_env(env) == want


def test_local_device_ids():
    assert dist.process_env(ZJ).local_device_ids == [2, 3]  # local rank 1, 2 devices each
    assert dist.process_env(TORCHRUN).local_device_ids == [1]  # one device per process
    assert dist.process_env({"ZEROJAX_LOCAL_DEVICES": "8"}).local_device_ids is None


@pytest.mark.parametrize("env,needle", [
    ({"ZEROJAX_NUM_PROCESSES": "2", "ZEROJAX_PROCESS_ID": "0"}, "ZEROJAX_COORDINATOR not set"),
    ({**ZJ, "ZEROJAX_NUM_PROCESSES": "two"}, "ZEROJAX_NUM_PROCESSES='two' is not a whole number"),
    ({**ZJ, "ZEROJAX_PROCESS_ID": "4"}, "ZEROJAX_PROCESS_ID=4 but ZEROJAX_NUM_PROCESSES=4"),
    ({**ZJ, "ZEROJAX_COORDINATOR": "10.0.0.1"}, "ZEROJAX_COORDINATOR='10.0.0.1' is not an address"),
    ({**ZJ, "ZEROJAX_LOCAL_DEVICES": "0"}, "ZEROJAX_LOCAL_DEVICES=0: must be >= 1"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "incomplete torchrun environment: MASTER_PORT"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, "SLURM_STEP_NODELIST not set"),
])
def test_bad_environment_names_the_variable(env, needle):
    with pytest.raises(dist.DistributedError, match=re.escape(needle)):
        dist.process_env(env)


@pytest.fixture
def fake_jax(monkeypatch):
    """initialize() as if jax had not started yet, recording what it would do."""
    calls = {"config": [], "init": [], "waited": []}
    monkeypatch.setattr(dist, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(dist, "distributed_is_initialized", lambda: False)
    monkeypatch.setattr(dist.jax.config, "update", lambda name, value: calls["config"].append((name, value)))
    monkeypatch.setattr(dist.jax.distributed, "initialize",
                        lambda coordinator, **kw: calls["init"].append((coordinator, kw)))
    monkeypatch.setattr(dist, "_wait_for_coordinator", lambda spec, *a: calls["waited"].append(spec.coordinator))
    monkeypatch.delenv("JAX_CPU_COLLECTIVES_IMPLEMENTATION", raising=False)
    return calls


def test_initialize_from_torchrun(fake_jax):
    spec = dist.initialize(environ={**TORCHRUN, "ZEROJAX_INIT_TIMEOUT": "20"})
    assert spec.source == "torchrun"
    assert fake_jax["config"] == [("jax_cpu_collectives_implementation", "gloo")]
    assert fake_jax["waited"] == ["node7:29501"]  # rank 9 checks the coordinator is there first
    (coordinator, kw), = fake_jax["init"]
    assert coordinator == "node7:29501" and kw["num_processes"] == 16 and kw["process_id"] == 9
    assert kw["local_device_ids"] == [1] and 20 <= kw["initialization_timeout"] <= 40


def test_initialize_from_zerojax_sets_the_cpu_device_count(fake_jax):
    dist.initialize(environ={**ZJ, "ZEROJAX_PROCESS_ID": "0"})
    assert ("jax_num_cpu_devices", 2) in fake_jax["config"]
    assert fake_jax["waited"] == []  # process 0 is the coordinator
    assert fake_jax["init"][0][0] == "10.0.0.1:1234"


def test_initialize_from_slurm_uses_jax_detection(fake_jax):
    dist.initialize(environ=SLURM)
    (coordinator, kw), = fake_jax["init"]
    assert coordinator is None and kw["cluster_detection_method"] == "slurm"
    assert kw["num_processes"] == 8 and kw["process_id"] == 5


def test_initialize_single_process_only_sets_devices(fake_jax):
    assert dist.initialize(environ={**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0", "ZEROJAX_LOCAL_DEVICES": "3"})
    assert fake_jax["config"] == [("jax_num_cpu_devices", 3)] and fake_jax["init"] == []


def test_initialize_after_jax_started_is_a_clear_error():
    jax.devices()  # this process has long started its backends
    with pytest.raises(dist.DistributedError, match=r"(?s)after jax had already started.*before zj.make_mesh"):
        dist.initialize(environ=ZJ)
    with pytest.raises(dist.DistributedError, match="ZEROJAX_INIT_TIMEOUT='soon'"):
        dist.initialize(environ={**ZJ, "ZEROJAX_INIT_TIMEOUT": "soon"})


def test_shard_batch_in_one_process():
    mesh = zj.make_mesh(8)
    batch = {"tok": np.arange(32 * 4).reshape(32, 4), "y": np.arange(32)}
    out = dist.shard_batch(batch, mesh)
    assert out["tok"].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")), 2)
    np.testing.assert_array_equal(np.asarray(out["tok"]), batch["tok"])
    with pytest.raises(ValueError, match="leading dimensions disagree.*tok: 32, y: 30"):
        dist.shard_batch({"tok": batch["tok"], "y": np.arange(30)}, mesh)
    with pytest.raises(ValueError, match="12 rows on process 0, which holds 8 of the mesh's 8 'data' shards"):
        dist.shard_batch({"x": np.zeros((12, 2))}, mesh)
    with pytest.raises(ValueError, match="'y' is a scalar"):
        dist.shard_batch({"x": np.zeros((8, 2)), "y": np.float32(1)}, mesh)
    with pytest.raises(ValueError, match="no axis 'batch'"):
        dist.shard_batch(batch, mesh, data_axis="batch")


# ------------------------------------------------------------------------------ launcher
def test_hostfile():
    hosts = launch.parse_hostfile("# cluster\nnode-a slots=4\n\nnode-b slots=2  # half\nnode-c\n")
    assert hosts == [launch.Host("node-a", 4), launch.Host("node-b", 2), launch.Host("node-c", 1)]
    for text, needle in [("a slots=0", "slots='0'"), ("a gpus=2", "unknown field 'gpus=2'"),
                         ("a\na slots=2", "listed twice"), ("# empty\n", "lists no hosts")]:
        with pytest.raises(launch.LaunchError, match=needle):
            launch.parse_hostfile(text, "hosts.txt")


def test_remote_hosts_are_started_over_ssh():
    hosts = [launch.Host("node-a.invalid", 2), launch.Host("node-b.invalid", 2)]
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NCCL_DEBUG": "INFO", "HOME": "/root"}
    ranks = launch.plan_ranks("train.py", ["--steps", "3"], hosts=hosts, devices_per_proc=4, cwd="/work/dir",
                              python="/opt/py/bin/python", environ=environ)
    assert [(r.rank, r.host, r.local_rank, r.remote) for r in ranks] == [
        (0, "node-a.invalid", 0, True), (1, "node-a.invalid", 1, True),
        (2, "node-b.invalid", 0, True), (3, "node-b.invalid", 1, True)]
    r = ranks[2]
    assert r.env["ZEROJAX_COORDINATOR"] == "node-a.invalid:29500"  # the first host, torchrun's default port
    assert r.env["ZEROJAX_PROCESS_ID"] == "2" and r.env["ZEROJAX_NUM_PROCESSES"] == "4"
    assert r.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert r.argv[:4] == ["ssh", "-o", "BatchMode=yes", "node-b.invalid"]
    shell = r.argv[4]
    assert shell.startswith("cd /work/dir && exec env ") and "ZEROJAX_PROCESS_ID=2" in shell
    assert "NCCL_DEBUG=INFO" in shell and "HOME=" not in shell  # launcher variables travel, others do not
    assert shell.endswith("sh /opt/py/bin/python -u train.py --steps 3")


def test_remote_command_propagates_the_exit_code_and_stops_on_hangup(tmp_path):
    """The command ssh runs, run here by sh: exit code through, SIGTERM when its stdin closes."""
    code = "import os, sys; print(os.environ['ZEROJAX_PROCESS_ID'], os.getcwd()); sys.exit(3)"
    shell = launch.remote_shell({"ZEROJAX_PROCESS_ID": "5"}, [sys.executable, "-c", code], str(tmp_path))
    proc = subprocess.Popen(["sh", "-c", shell], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()  # stdin stays open, as ssh keeps it while the launcher runs
    assert proc.wait(timeout=60) == 3 and out.split() == ["5", str(tmp_path)]
    proc.stdin.close()
    proc.stdout.close()
    sleeper = launch.remote_shell({}, [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(600)"],
                                  str(tmp_path))
    proc = subprocess.Popen(["sh", "-c", sleeper], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    proc.stdin.close()  # what the launcher does to stop a remote rank (or what its exit does)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    proc.stdout.close()
    # a program that takes SIGTERM as a notice and keeps going (as jax's runtime does) is killed after the grace
    ignore = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
              "time.sleep(600)")
    stubborn = launch.remote_shell({}, [sys.executable, "-c", ignore], str(tmp_path), grace=0.5)
    proc = subprocess.Popen(["sh", "-c", stubborn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    proc.stdin.close()
    assert proc.wait(timeout=20) == 128 + signal.SIGKILL
    proc.stdout.close()


def test_hostfile_with_localhost_runs_here_through_the_cli(tmp_path, capsys):
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(*(os.environ.get(k) for k in ('ZEROJAX_PROCESS_ID', 'ZEROJAX_NUM_PROCESSES', "
                      "'ZEROJAX_LOCAL_RANK', 'ZEROJAX_LOCAL_DEVICES', 'ZEROJAX_COORDINATOR', 'XLA_FLAGS')))\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    from zerojax._cli import main

    assert main(["launch", "--hostfile", str(hostfile), "--devices-per-proc", "3", str(script)]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"[rank {rank}] "))
        pid, n, local, devices, coordinator, *flags = line.split(" ", 2)[2].split()
        assert (pid, n, local, devices) == (str(rank), "2", str(rank), "3")
        assert coordinator.startswith("127.0.0.1:")
        # the device count is replaced; the parent's other XLA flags travel unchanged
        others = [f for f in os.environ["XLA_FLAGS"].split() if "xla_force_host_platform_device_count" not in f]
        assert flags == others + ["--xla_force_host_platform_device_count=3"]
    assert main(["launch", "--hostfile", str(tmp_path / "missing"), str(script)]) == 2
    assert "cannot read --hostfile" in capsys.readouterr().err


def test_script_arguments_pass_through(tmp_path, capsys):
    script = tmp_path / "args.py"
    script.write_text("import sys\nprint(sys.argv[1:])\n")
    assert launch.main(["--nproc", "1", str(script), "--nproc", "5", "-h", "x"]) == 0
    assert "[rank 0] ['--nproc', '5', '-h', 'x']" in capsys.readouterr().out
