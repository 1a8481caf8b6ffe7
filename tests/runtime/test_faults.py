"""Production faults: a stuck step is caught and named (the watchdog, the ledger, the launcher's
verdict), a preempted job saves and resumes to the same params as an uninterrupted run.

The runs are tests/_fault_worker.py, a plain training script that resumes from its latest
checkpoint; the faults are injected from outside its training code."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.runtime import _ledger, _watchdog as wd
from zerojax.runtime._watched_step import WatchedStep
from tests import _fault_worker as worker

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_fault_worker.py")
LAUNCH = [sys.executable, "-m", "zerojax", "launch", "--nproc", "2", "--devices-per-proc", "4", "--init-timeout", "120"]
STEPS = 8


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROJAX_", "DEEPSPEED_TIMEOUT"))}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def run(cmd, timeout=240, **env):
    start = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run's final params, trained here on 8 devices (the same global batches)."""
    state = zj.shard_train_state(worker.init, optax.adamw(1e-2), mesh=zj.make_mesh(8),
                                 config=zj.ZeroConfig(stage=2, step_timeout=0), rng=jax.random.PRNGKey(0))
    step = zj.make_train_step(worker.loss_fn, state)
    for i in range(STEPS):
        state, _ = step(state, worker.global_batch(i))
    return {k: np.asarray(v) for k, v in state.full_params().items()}


def assert_equal_to(reference, path):
    got = np.load(path)
    for k, v in reference.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------------------------ the ledger
def test_ledger_file_is_read_back_while_the_process_lives(tmp_path):
    path = str(tmp_path / "process3.ledger")
    ledger = _ledger.Ledger(path, process=3)
    for n in range(1, 300):  # more than the ring holds: the oldest go
        ledger.record("step called", n)
        ledger.record("dispatched", n, "x" * 40)
    header, events = _ledger.read_ledger(path)
    assert header["process"] == 3 and header["pid"] == os.getpid()
    assert len(events) == 256 and events[-1].event == "dispatched" and events[-1].step == 299
    assert events[-1].detail == "x" * 31  # details are cut to the slot
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert ledger.events() == events


def _events(*pairs):
    return [_ledger.Event(i + 1, 1000.0 + i, step, name) for i, (step, name) in enumerate(pairs)]


def test_the_process_that_never_entered_the_step_is_named():
    ledgers = {0: _events((4, "result ready"), (5, "batch check")),
               1: _events((4, "dispatched"), (4, "result ready")),
               2: _events((5, "batch check"), (5, "batch placed"), (5, "step called"), (5, "dispatched"))}
    late, lines, verdicts = _ledger.behind(ledgers, now=1010.0)
    assert late == [0, 1]
    assert verdicts[1] == "process 1 is behind: it never entered step 5"
    assert "process 0 is behind: it is still placing step 5's batch" in verdicts[0]
    assert lines[2].startswith("process 2: waiting for step 5's result")


def test_no_process_is_named_when_all_are_inside_the_same_step():
    ledgers = {p: _events((5, "step called"), (5, "dispatched")) for p in range(2)}
    assert _ledger.behind(ledgers)[0] == []


# ------------------------------------------------------------------------------------ deadlines
def test_timeouts_come_from_the_config_deepspeed_or_hugging_face(monkeypatch):
    assert wd.resolve_timeouts(None, None, environ={}) == (1800.0, 3600.0)
    assert wd.resolve_timeouts(None, None, environ={"DEEPSPEED_TIMEOUT": "5"}) == (300.0, 600.0)
    assert wd.resolve_timeouts(40, 90, environ={"DEEPSPEED_TIMEOUT": "5"}) == (40.0, 90.0)
    with pytest.raises(zj.ConfigError, match="DEEPSPEED_TIMEOUT"):
        wd.resolve_timeouts(None, None, environ={"DEEPSPEED_TIMEOUT": "half an hour"})
    cfg = zj.ZeroConfig.from_deepspeed({"train_batch_size": 8}, world_size=8,
                                       training_args=zj.TrainingArgs(per_device_train_batch_size=1, ddp_timeout=600))
    assert cfg.step_timeout == 600.0
    with pytest.raises(zj.ConfigError, match="step_timeout"):
        zj.ZeroConfig(step_timeout=-1)
    with pytest.raises(zj.ConfigError, match="preemption_signal"):
        zj.ZeroConfig(preemption_signal="SIGKILL")
    assert zj.ZeroConfig(preemption_signal="usr1").preemption_signal == "SIGUSR1"
    assert wd.env_signal({"ZEROJAX_PREEMPTION_SIGNAL": "USR1"}) == "SIGUSR1"
    with pytest.raises(zj.ConfigError, match="ZEROJAX_PREEMPTION_SIGNAL='USR3'"):
        wd.env_signal({"ZEROJAX_PREEMPTION_SIGNAL": "USR3"})


def test_deadline_tightens_after_measured_steps_with_a_floor():
    dog = wd.Watchdog()  # not configured: no thread watches it (this test moves its clock by hand)
    dog.timeout, dog.first_timeout, dog.enabled = 1800.0, 3600.0, True
    assert dog.deadline() == 1800.0
    dog.durations.extend([0.5, 0.6, 0.4])
    assert dog.deadline() == wd.FLOOR  # 20 x 0.5 s is under the floor
    dog.durations.extend([30.0] * 10)
    assert dog.deadline() == wd.FACTOR * 30.0
    dog.durations.extend([500.0] * 30)
    assert dog.deadline() == 1800.0  # never above step_timeout
    # the first step of the process has the first step's deadline; a compile suspends a step's
    dog.first, now = 0, time.monotonic()
    dog.inflight.append((1, now - 3000.0))
    assert dog.overdue(now) is None
    dog.inflight[0] = (1, now - 4000.0)
    assert dog.overdue(now)["what"] == "the first step"
    dog.inflight[0] = (2, now - 1900.0)
    dog.arm("compile", 2, 3600.0)
    assert dog.overdue(now) is None
    dog.disarm("compile")
    assert dog.overdue(now) is None  # the step's clock restarted when its compile ended
    assert dog.overdue(now + 1801.0)["what"] == "step"
    # a trace that compiles nothing (jax.eval_shape) between steps leaves no deadline behind
    dog.inflight.clear()
    dog.arm("compile", 2, 3600.0)
    assert dog.overdue(time.monotonic() + 7200.0) is None
    dog.inflight.append((3, time.monotonic()))
    assert dog.overdue(time.monotonic() + 3601.0)["what"] == "compile"


def test_step_timeout_zero_turns_the_watchdog_off():
    state = zj.shard_train_state(worker.init, optax.sgd(0.1), mesh=zj.make_mesh(8),
                                 config=zj.ZeroConfig(step_timeout=0), rng=jax.random.PRNGKey(0))
    assert not isinstance(zj.make_train_step(worker.loss_fn, state), WatchedStep)
    on = zj.shard_train_state(worker.init, optax.sgd(0.1), mesh=zj.make_mesh(8), rng=jax.random.PRNGKey(0))
    step = zj.make_train_step(worker.loss_fn, on)
    assert isinstance(step, WatchedStep) and step.plan is on.plan  # the wrapped step's attributes


# ------------------------------------------------------------------------------ one process
def test_stuck_step_dumps_stacks_and_ledger_and_exits_124(tmp_path):
    """A step that never finishes (a host callback in the loss sleeps): exit 124 soon after the
    deadline, with every thread's stack (the sleeping callback's frame) and the ledger on file."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "import optax, zerojax as zj\n"
        "from tests import _fault_worker as w\n"
        "def hang(i):\n"
        "    if int(i) == 4: time.sleep(600)\n"
        "def loss(p, b):\n"
        "    jax.debug.callback(hang, b['i'][0])\n"
        "    return w.loss_fn(p, b)\n"
        "state = zj.shard_train_state(w.init, optax.sgd(0.1), mesh=zj.make_mesh(8), rng=jax.random.PRNGKey(0),\n"
        "                             config=zj.ZeroConfig(step_timeout=3, first_step_timeout=120))\n"
        "step = zj.make_train_step(loss, state)\n"
        "for i in range(8):\n"
        "    state, m = step(state, dict(w.global_batch(i), i=jax.numpy.full((16,), i)))\n"
        "    print('step', i + 1, float(m['loss']), flush=True)\n")
    code, out, took = run([sys.executable, str(script)], timeout=120, ZEROJAX_WATCHDOG_DIR=str(tmp_path / "wd"))
    assert code == wd.STUCK_EXIT, out
    assert "zerojax watchdog: process 0 stuck in step 5 (waiting for its result)" in out, out
    assert "\nstep 4 " in out and "\nstep 5 " not in out
    dump = (tmp_path / "wd" / "process0.stuck.txt").read_text()
    assert "in hang" in dump  # the sleeping callback's frame
    assert re.search(r"step +5 +step called", dump) and re.search(r"step +4 +result ready", dump), dump
    assert took < 60


def test_sigterm_saves_the_step_and_a_second_start_resumes_to_the_same_params(tmp_path, reference):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "final.npz")
    at = random.Random().randint(1, STEPS - 2)
    code, log, _ = run([sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--save-every", "100",
                        "--term-at", str(at), "--out", out], timeout=120)
    assert code == wd.PREEMPTED_EXIT, log
    saved = at + 1  # one process: the step after the notice
    assert f"saved step {saved} to {ckpt} (committed)" in log, log
    assert zj.checkpoint.intact_steps(ckpt) == [saved]
    code, log, _ = run([sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--out", out], timeout=120)
    assert code == 0 and f"resumed from step {saved}" in log, log
    assert_equal_to(reference, out)


@pytest.mark.slow  # two launched jobs: about 30 s
def test_sigterm_to_an_nvme_run_saves_its_optimizer_state_and_the_restart_resumes_to_the_same_params(
        tmp_path, reference):
    """offload_optimizer='nvme': the preemption checkpoint holds the master and moments the store kept
    (a resume from zero moments ends far from the uninterrupted run)."""
    ckpt, out, nvme = str(tmp_path / "ckpt"), str(tmp_path / "final.npz"), tmp_path / "nvme"
    nvme.mkdir()
    args = [sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--out", out, "--nvme", str(nvme)]
    code, log, _ = run(args + ["--save-every", "100", "--term-at", "3"], timeout=120)
    assert code == wd.PREEMPTED_EXIT and "saved step 4" in log, log
    code, log, _ = run(args, timeout=120)
    assert code == 0 and "resumed from step 4" in log, log
    assert_equal_to(reference, out)  # the host's AdamW against the device's: within 1e-6


@pytest.mark.slow  # three launched jobs: about 40 s
def test_sigterm_to_a_zenflow_run_saves_its_engine_and_the_restart_resumes_exactly(tmp_path):
    """ZenFlow (a host update in flight between steps): the preemption checkpoint holds the engine's
    state, so the restarted job ends on the uninterrupted job's params."""
    ckpt, out, straight = str(tmp_path / "ckpt"), str(tmp_path / "final.npz"), str(tmp_path / "straight.npz")
    code, log, _ = run([sys.executable, WORKER, "--ckpt", str(tmp_path / "ref"), "--steps", str(STEPS),
                        "--save-every", "100", "--zenflow", "--out", straight], timeout=120)
    assert code == 0, log
    args = [sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--out", out, "--zenflow"]
    code, log, _ = run(args + ["--save-every", "100", "--term-at", "4"], timeout=120)
    assert code == wd.PREEMPTED_EXIT and "saved step 5" in log, log
    code, log, _ = run(args, timeout=120)
    assert code == 0 and "resumed from step 5" in log, log
    want = np.load(straight)
    assert_equal_to({k: want[k] for k in want.files}, out)


def test_the_named_preemption_signal_saves_like_sigterm(tmp_path):
    """SLURM's --signal=USR1@60: ZeroConfig.preemption_signal="SIGUSR1" makes SIGUSR1 a preemption notice."""
    ckpt = str(tmp_path / "ckpt")
    code, log, _ = run([sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--save-every", "100",
                        "--term-at", "2", "--signal", "SIGUSR1", "--preemption-signal", "USR1"], timeout=120)
    assert code == wd.PREEMPTED_EXIT, log
    assert "SIGUSR1 received (preemption): saved step 3" in log, log
    assert zj.checkpoint.intact_steps(ckpt) == [3]


def test_sigterm_to_a_process_that_no_longer_trains_still_ends_it(tmp_path):
    """A notice with no step to follow (the loop is over, the script evaluates or idles): the
    process ends with 143 as SIGTERM would, after min(60 s, step_timeout)."""
    script = tmp_path / "idle.py"
    script.write_text(
        "import os, signal, sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "import optax, zerojax as zj\n"
        "from tests import _fault_worker as w\n"
        "state = zj.shard_train_state(w.init, optax.sgd(0.1), mesh=zj.make_mesh(8), rng=jax.random.PRNGKey(0),\n"
        "                             config=zj.ZeroConfig(step_timeout=3))\n"
        "step = zj.make_train_step(w.loss_fn, state)\n"
        "state, m = step(state, w.global_batch(0))\n"
        "print('trained', float(m['loss']), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
        "print('still running', flush=True)\n")
    code, out, took = run([sys.executable, str(script)], timeout=120)
    assert code == 128 + signal.SIGTERM, out
    assert "no training step began in the 3 s since, so nothing was saved" in out and "still running" not in out
    assert took < 40


def test_sigterm_while_a_save_is_written_commits_it_and_saves_the_next(tmp_path, reference):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "final.npz")
    code, log, _ = run([sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--save-every", "4",
                        "--term-during-save", "4", "--out", out], timeout=120)
    assert code == wd.PREEMPTED_EXIT, log
    assert zj.checkpoint.intact_steps(ckpt) == [4, 5], log
    assert not [d for d in os.listdir(ckpt) if "tmp" in d]  # nothing half-written
    code, log, _ = run([sys.executable, WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--out", out], timeout=120)
    assert code == 0 and "resumed from step 5" in log, log
    assert_equal_to(reference, out)


# ---------------------------------------------------------------------------- two processes
def timed_lines(cmd, timeout=240):
    """Run ``cmd`` here with its output read line by line: (exit code, output, {line: seconds since start})."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, seen = [], {}
    try:
        for line in proc.stdout:
            lines.append(line)
            seen.setdefault(line.strip(), time.monotonic() - start)
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines), seen


def first(seen: dict, text: str) -> float:
    return min(t for line, t in seen.items() if text in line)


@pytest.mark.slow
def test_a_process_stuck_before_step_5_is_named_and_the_restarted_job_finishes(tmp_path, reference):
    """jax-ml/jax#38503: process 1 stops in step 5's iteration; process 0 waits in a collective.
    Every process of the stuck job is gone within the deadline + 30 s, the launcher names process
    1 and step 5, and with --max-restarts 1 the job resumes from step 4 and ends with the
    uninterrupted run's params."""
    ckpt, out, timeout = str(tmp_path / "ckpt"), str(tmp_path / "final.npz"), 8.0
    cmd = LAUNCH + ["--max-restarts", "1", "--watchdog-dir", str(tmp_path / "wd"), WORKER, "--ckpt", ckpt,
                    "--steps", str(STEPS), "--stall", "1:5", "--step-timeout", str(timeout),
                    "--first-step-timeout", "120", "--out", out]
    code, log, seen = timed_lines(cmd)
    assert code == 0, log
    assert "process 1 is behind: it never entered step 5" in log, log
    assert "restart 1 of 1" in log and "resumed from step 4" in log, log
    stalled = log.index("process 1 stalls in step 5")
    assert "exited with code 124" in log[stalled:], log
    # the stuck job's processes are all stopped before the launcher starts the job again
    assert first(seen, "restart 1 of 1") - first(seen, "stalls in step 5") < timeout + 30, log
    assert os.path.exists(tmp_path / "wd" / "attempt0" / "process0.stuck.txt")
    assert_equal_to(reference, out)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["step", "save"])
def test_sigterm_to_the_launcher_saves_one_agreed_step_and_the_job_resumes(tmp_path, reference, when):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "final.npz")
    at = random.Random().randint(1, 4) if when == "step" else 4  # 4 steps of 0.5 s left for the notice
    fault = ["--term-at", str(at), "--save-every", "100"] if when == "step" else ["--term-during-save", "4"]
    fault += ["--step-seconds", "0.5"]  # steps of milliseconds would end before the signal reaches the ranks
    code, log, _ = run(LAUNCH + [WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--out", out] + fault)
    assert code == wd.PREEMPTED_EXIT, log
    assert "every rank saved its checkpoint and exited with code 75" in log, log
    saved = int(re.search(r"saved step (\d+) to", log).group(1))
    assert saved > at and zj.checkpoint.intact_steps(ckpt)[-1] == saved, log
    if when == "save":
        assert 4 in zj.checkpoint.intact_steps(ckpt)
    assert not [d for d in os.listdir(ckpt) if "tmp" in d]
    code, log, _ = run(LAUNCH + [WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--out", out])
    assert code == 0 and f"resumed from step {saved}" in log, log
    assert_equal_to(reference, out)


@pytest.mark.slow  # a fresh process compiling the example GPT twice: about 8 s
def test_benchmark_smoke_prints_the_on_off_ratio():
    from tests.helpers import run_benchmark

    out = run_benchmark("watchdog.py", "--smoke")
    ratio = re.search(r"watchdog on / off: ([0-9.]+)x", out)
    assert ratio and float(ratio.group(1)) > 0, out
    assert re.search(r"the wrapper's own time on the caller's thread: [0-9.]+ us a step", out), out


@pytest.mark.slow
def test_slurm_style_usr1_reaches_every_rank_through_the_launcher(tmp_path):
    """ZEROJAX_PREEMPTION_SIGNAL=USR1: the launcher forwards SIGUSR1, each rank hands it to JAX's
    preemption notifier, and the ranks save one agreed step."""
    ckpt = str(tmp_path / "ckpt")
    code, log, _ = run(LAUNCH + [WORKER, "--ckpt", ckpt, "--steps", str(STEPS), "--save-every", "100",
                                 "--term-at", "2", "--signal", "SIGUSR1", "--step-seconds", "0.5"],
                       ZEROJAX_PREEMPTION_SIGNAL="USR1")
    assert code == wd.PREEMPTED_EXIT, log
    saved = int(re.search(r"SIGUSR1 received \(preemption\): saved step (\d+) to", log).group(1))
    assert saved > 2 and zj.checkpoint.intact_steps(ckpt) == [saved], log
