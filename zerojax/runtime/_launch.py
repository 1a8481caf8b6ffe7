"""``zerojax launch``: start the processes of a multi-process run, relay their output, stop them together.

    zerojax launch --nproc 2 --devices-per-proc 4 train.py --steps 100    # one host: 2 processes x 4 devices
    zerojax launch --hostfile hosts train.py --steps 100                  # several hosts, over ssh
    python -m zerojax launch ...                                          # the same

Each process gets ZEROJAX_COORDINATOR, ZEROJAX_NUM_PROCESSES, ZEROJAX_PROCESS_ID, ZEROJAX_LOCAL_RANK,
ZEROJAX_LOCAL_WORLD_SIZE and, with ``--devices-per-proc K``, ZEROJAX_LOCAL_DEVICES=K (plus the
simulated CPU device count in XLA_FLAGS); the script calls ``zj.distributed.initialize()``. On one
host the coordinator is 127.0.0.1 on a free port unless ``--coordinator HOST:PORT`` says otherwise.

Hostfile (DeepSpeed's format): one ``host slots=K`` per line, K processes on that host (``--nproc``
overrides K); ``#`` starts a comment. Ranks are numbered host by host in file order and the
coordinator is the first host (port 29500, or a free one when that host is this one). Hosts other
than this one are started with ``ssh HOST 'cd CWD && env ... PYTHON SCRIPT ARGS'``: the same
Python and working directory must exist there (a shared filesystem), ssh must log in without a
password, and the variables ZEROJAX_*, JAX_*, XLA_*, NCCL_* and PYTHONPATH of this environment
travel along. A remote process is sent SIGTERM, then SIGKILL after the grace period, when its ssh
connection closes (the launcher stopped or died); a local one dies with the launcher.

Every output line is prefixed with ``[rank R]``. When a process exits with a non-zero code the
others get SIGTERM, then SIGKILL after ``--grace`` seconds, and the launcher prints that rank's
last lines and exits non-zero. Ctrl-C is forwarded to every process. The exit code is 0 only
when every process succeeded.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from zerojax._compat import backends_are_initialized
from zerojax._errors import ConfigError, DistributedError, LaunchError
from zerojax.runtime._distributed import COORDINATOR, INIT_TIMEOUT, LOCAL_DEVICES, LOCAL_RANK, NUM_PROCESSES, PROCESS_ID, split_address
from zerojax.runtime._ledger import behind, ledger_path, read_ledger
from zerojax.runtime._watchdog import PREEMPTED_EXIT, STUCK_EXIT, WATCHDOG_DIR, env_signal

LOCAL_WORLD_SIZE = "ZEROJAX_LOCAL_WORLD_SIZE"
RESTART = "ZEROJAX_RESTART"  # 0 on the first start of the job, K on its K-th restart (--max-restarts)
DEFAULT_PORT = 29500
TAIL_LINES = 20
FORWARDED_PREFIXES = ("ZEROJAX_", "JAX_", "XLA_", "NCCL_")
FORWARDED_NAMES = ("PYTHONPATH",)
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}

# On a remote host: run the program with stdin closed; once the ssh connection's stdin reaches EOF
# (the launcher closed it, or is gone) send it SIGTERM, then SIGKILL after GRACE seconds (jax's
# distributed runtime takes SIGTERM as a preemption notice and keeps running). The exit code is
# the program's.
_REMOTE_WRAPPER = ('exec 3<&0; "$@" </dev/null 3<&- & p=$!; '
                   '(cat <&3 >/dev/null 2>&1; kill -TERM $p 2>/dev/null; sleep GRACE; kill -KILL $p 2>/dev/null) '
                   '>/dev/null 2>&1 & w=$!; exec 3<&-; wait $p; rc=$?; kill $w 2>/dev/null; exit $rc')


def _prctl():
    """libc's prctl, looked up in the launcher (the child only calls it: nothing to lock after fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_launcher() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The child is killed when the launcher dies, even by SIGKILL (it has a session of its own)."""
    _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


# ------------------------------------------------------------------------------ hostfile
def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """``host slots=K`` lines (DeepSpeed's format) -> hosts in file order; ``#`` starts a comment."""
    hosts, seen = [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{source}, line {number} ({raw.strip()!r})"
        slots = 1
        for extra in parts[1:]:
            key, sep, value = extra.partition("=")
            if key != "slots" or not sep:
                raise LaunchError(f"{where}: unknown field {extra!r}; write 'HOST slots=K'")
            if not value.isdigit() or int(value) < 1:
                raise LaunchError(f"{where}: slots={value!r} must be a whole number >= 1")
            slots = int(value)
        if parts[0] in seen:
            raise LaunchError(f"{where}: host {parts[0]!r} is listed twice; give it one line with its slots")
        seen.add(parts[0])
        hosts.append(Host(parts[0], slots))
    if not hosts:
        raise LaunchError(f"{source} lists no hosts; write one 'HOST slots=K' per line")
    return hosts


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (run without ssh)."""
    if host in _LOOPBACK or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_address(text: str) -> str:
    try:
        split_address(text, "--coordinator")
    except DistributedError:
        raise LaunchError(f"--coordinator {text!r} is not an address: write HOST:PORT, e.g. 10.0.0.1:29500") from None
    return text


# ------------------------------------------------------------------------------ the plan
@dataclasses.dataclass(frozen=True)
class Rank:
    rank: int
    host: str
    local_rank: int
    env: dict  # the variables this rank gets on top of the launcher's environment
    argv: list  # the command (an ssh command for a remote host)
    remote: bool = False


def without_device_count(xla_flags: str) -> str:
    """XLA_FLAGS without its simulated CPU device count (the other flags kept, in order)."""
    return " ".join(re.sub(r"--xla_force_host_platform_device_count=\S*", "", xla_flags).split())


def with_device_count(xla_flags: str, count: int) -> str:
    """XLA_FLAGS with the simulated CPU device count set to ``count`` (replacing any inherited one)."""
    return " ".join(without_device_count(xla_flags).split() + [f"--xla_force_host_platform_device_count={count}"])


def forwarded_env(environ) -> dict:
    """The launcher's variables that travel to remote hosts."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def remote_shell(env: dict, argv: Sequence[str], cwd: str, grace: float = 5.0) -> str:
    """The shell command run on a remote host (what ssh is given)."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    program = " ".join(shlex.quote(a) for a in argv)
    wrapper = _REMOTE_WRAPPER.replace("GRACE", f"{max(0.0, float(grace)):g}")
    return f"cd {shlex.quote(cwd)} && exec env {exports} sh -c {shlex.quote(wrapper)} sh {program}"


def remote_command(host: str, env: dict, argv: Sequence[str], cwd: str, ssh: str = "ssh",
                   grace: float = 5.0) -> list:
    return shlex.split(ssh) + ["-o", "BatchMode=yes", host, remote_shell(env, argv, cwd, grace)]


def plan_ranks(script: str, script_args: Sequence[str], *, nproc: int | None = None,
               devices_per_proc: int | None = None, coordinator: str | None = None,
               hosts: list[Host] | None = None, init_timeout: float | None = None,
               python: str = sys.executable, cwd: str | None = None, ssh: str = "ssh", grace: float = 5.0,
               environ=None, extra_env: dict | None = None) -> list[Rank]:
    """Every rank's host, environment and command (nothing is started)."""
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    hosts = hosts or [Host("localhost", nproc or 1)]
    counts = [nproc or h.slots for h in hosts]
    local = [is_local(h.name) for h in hosts]
    if coordinator is None:
        if all(local):
            coordinator = f"127.0.0.1:{free_port()}"
        else:  # the first host, by a name the others can resolve
            first = hosts[0].name if hosts[0].name not in _LOOPBACK else socket.gethostname()
            coordinator = f"{first}:{free_port() if local[0] else DEFAULT_PORT}"
    coordinator = _check_address(coordinator)
    world = sum(counts)
    argv = [python, "-u", script, *script_args]
    ranks, rank = [], 0
    for host, count, here in zip(hosts, counts, local):
        for local_rank in range(count):
            env = {COORDINATOR: coordinator, NUM_PROCESSES: str(world), PROCESS_ID: str(rank),
                   LOCAL_RANK: str(local_rank), LOCAL_WORLD_SIZE: str(count), "PYTHONUNBUFFERED": "1",
                   **(extra_env or {})}
            if devices_per_proc:
                env[LOCAL_DEVICES] = str(devices_per_proc)
                env["XLA_FLAGS"] = with_device_count(environ.get("XLA_FLAGS", ""), devices_per_proc)
            if init_timeout:
                env[INIT_TIMEOUT] = str(init_timeout)
            if here:
                ranks.append(Rank(rank, host.name, local_rank, env, list(argv)))
            else:
                full = dict(forwarded_env(environ), **env)
                ranks.append(Rank(rank, host.name, local_rank, env,
                                  remote_command(host.name, full, argv, cwd, ssh, grace), remote=True))
            rank += 1
    return ranks


# --------------------------------------------------------------------------- supervision
def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Child:
    def __init__(self, rank: Rank, out: IO[str], lock: threading.Lock):
        env = dict(os.environ)
        if not rank.remote:
            env.update(rank.env)
        self.rank = rank
        self.tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        # A session of its own: a terminal's Ctrl-C reaches it once, through the launcher. The
        # preexec function only calls a C function looked up beforehand (no lock, import or I/O
        # another thread could hold across the fork); it is skipped in a process running jax's
        # own threads (launch.main called from a training process), where forking is unsafe.
        tie = _PRCTL is not None and not backends_are_initialized()
        self.proc = subprocess.Popen(rank.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE if rank.remote else subprocess.DEVNULL,
                                     start_new_session=True,
                                     preexec_fn=_die_with_launcher if tie else None)  # noqa: PLW1509
        self.reader = threading.Thread(target=self._relay, args=(out, lock), daemon=True)
        self.reader.start()

    def _relay(self, out: IO[str], lock: threading.Lock) -> None:
        prefix = f"[rank {self.rank.rank}] "
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.tail.append(line)
            with lock:
                out.write(prefix + line + "\n")
                out.flush()
        self.proc.stdout.close()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        if self.rank.remote and sig != signal.SIGINT and self.proc.stdin:
            try:  # the remote wrapper turns EOF into SIGTERM
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_for_exit(children: list[_Child], seconds: float) -> None:
    """Wait until every child has exited, or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(children: list[_Child], grace: float) -> None:
    """SIGTERM every running child, SIGKILL what is left after ``grace`` seconds, reap them all."""
    for c in children:
        c.signal(signal.SIGTERM)
    _wait_for_exit(children, grace)
    for c in children:
        c.signal(signal.SIGKILL)
    for c in children:
        c.proc.wait()


def supervise(ranks: list[Rank], grace: float = 5.0, out: IO[str] | None = None,
              err: IO[str] | None = None, watchdog_dir: str | None = None, interrupted: list | None = None,
              preempt_grace: float = 120.0) -> int:
    """Start ``ranks``, relay their output and wait; returns 0 only when every rank succeeded.

    ``watchdog_dir``: where the ranks' ledgers and stack dumps are (ZEROJAX_WATCHDOG_DIR); when a
    rank's watchdog ends it (exit code 124) the others are asked for their stacks and the
    launcher says which process is behind. ``interrupted`` receives the signals the launcher
    itself was sent (forwarded to every rank)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    lock = threading.Lock()
    children: list[_Child] = []
    interrupted = [] if interrupted is None else interrupted

    def forward(signum, _frame):
        interrupted.append(signum)
        for c in children:
            c.signal(signum if len(interrupted) == 1 else signal.SIGKILL)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, *_extra_signals()):
            handlers[s] = signal.signal(s, forward)
    try:
        for r in ranks:
            children.append(_Child(r, out, lock))
        return _wait(children, grace, interrupted, err, lock, watchdog_dir, preempt_grace)
    finally:
        if any(c.proc.poll() is None for c in children):
            _stop(children, grace)
        for c in children:
            c.reader.join(timeout=2.0)
            if c.proc.stdin:
                c.proc.stdin.close()
        for s, h in handlers.items():
            signal.signal(s, h)


def _extra_signals() -> list:
    """The preemption signal the ranks are told of (ZEROJAX_PREEMPTION_SIGNAL), forwarded like SIGTERM."""
    name = env_signal()
    sig = getattr(signal, name) if name else None
    return [sig] if sig is not None and sig not in (signal.SIGINT, signal.SIGTERM) else []


def _diagnose(children: list[_Child], stuck: _Child, watchdog_dir: str | None, say) -> None:
    """After a rank's watchdog ended it: ask the others for their stacks (SIGUSR2), read every
    rank's ledger and say where each process is and which is behind."""
    if not watchdog_dir:
        return
    for c in children:
        if c is not stuck and not c.rank.remote and c.proc.poll() is None and hasattr(signal, "SIGUSR2"):
            c.signal(signal.SIGUSR2)
    time.sleep(0.5)  # the stack dumps are written by the ranks' signal handlers
    ledgers = {}
    for c in children:
        path = ledger_path(watchdog_dir, c.rank.rank)
        try:
            ledgers[c.rank.rank] = read_ledger(path)[1]
        except (OSError, ValueError):
            say(f"process {c.rank.rank} left no ledger at {path}")
    late, lines, verdicts = behind(ledgers)
    say("where each process is, from its ledger:\n" + "\n".join(f"  | {line}" for line in lines))
    for v in verdicts:
        say(v)
    if not late and ledgers:
        say("no process is behind by its ledger: every one is inside the same step; their stacks tell where")
    files = sorted(f for f in os.listdir(watchdog_dir) if f.endswith(".txt")) if os.path.isdir(watchdog_dir) else []
    if files:
        say(f"stacks and ledgers in {watchdog_dir}: {', '.join(files)}")


def _wait(children: list[_Child], grace: float, interrupted: list, err: IO[str], lock,
          watchdog_dir: str | None = None, preempt_grace: float = 120.0) -> int:
    def say(text):
        with lock:
            err.write(f"zerojax launch: {text}\n")
            err.flush()

    exits: queue.Queue = queue.Queue()  # children in the order they exit
    for c in children:
        threading.Thread(target=lambda c=c: (c.proc.wait(), exits.put(c)), daemon=True).start()
    running, stop_at = len(children), None
    while True:
        try:
            done = exits.get(timeout=0.1)
            running -= 1
        except queue.Empty:
            done = None
        if interrupted:
            if stop_at is None:
                wait = grace if interrupted[0] == signal.SIGINT else max(grace, preempt_grace)
                say(f"{signal.Signals(interrupted[0]).name} forwarded to every rank; waiting up to {wait:g} s "
                    "for them to stop" + ("" if interrupted[0] == signal.SIGINT else
                                          " (a preempted rank saves a checkpoint, then exits with code "
                                          f"{PREEMPTED_EXIT})"))
                stop_at = time.monotonic() + wait
            if running == 0 or time.monotonic() > stop_at:
                _stop(children, grace)
                codes = {c.proc.returncode for c in children}
                if codes == {0}:
                    say("every rank finished before the signal took effect")
                    return 0
                if codes == {PREEMPTED_EXIT}:
                    say(f"every rank saved its checkpoint and exited with code {PREEMPTED_EXIT} (preempted); run the "
                        "same command again to resume")
                    return PREEMPTED_EXIT
                return 128 + interrupted[0]
        elif done is not None and done.proc.returncode != 0:
            code = done.proc.returncode
            why = {STUCK_EXIT: " (its watchdog: a step passed its deadline)",
                   PREEMPTED_EXIT: " (preempted: a checkpoint was committed)"}.get(code, "")
            say(f"rank {done.rank.rank} (host {done.rank.host}) {_describe(code)}{why}; "
                f"stopping the other {running} running rank(s)")
            if code == STUCK_EXIT:
                _diagnose(children, done, watchdog_dir, say)
            elif code == PREEMPTED_EXIT:  # the others are saving the same step: let them finish
                _wait_for_exit(children, max(grace, 60.0))
            _stop(children, grace)
            done.reader.join(timeout=2.0)
            lines = "\n".join(f"  | {line}" for line in done.tail) or "  | (no output)"
            say(f"last {len(done.tail)} line(s) of rank {done.rank.rank}:\n{lines}")
            return code if code > 0 else 128 - code
        elif running == 0:
            return 0


# ----------------------------------------------------------------------------------- cli
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerojax launch",
        description="Start N processes of a training script (on this host, or on the hosts of a hostfile over "
                    "ssh) with the environment zj.distributed.initialize() reads; prefix their output with the "
                    "rank; stop them all when one fails.")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes per host (default: the hostfile's slots, else 1)")
    p.add_argument("--devices-per-proc", type=int, default=None,
                   help="devices per process: simulated CPU devices, or GPUs local_rank*K.. on a GPU host")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0's coordinator (default: 127.0.0.1 and a free port when every "
                        f"process runs here; else the first host, port {DEFAULT_PORT} or a free one when it is "
                        "this host)")
    p.add_argument("--hostfile", default=None, help="lines 'HOST slots=K' (DeepSpeed's format)")
    p.add_argument("--init-timeout", type=float, default=None,
                   help="seconds a process waits for the coordinator and its peers (ZEROJAX_INIT_TIMEOUT; "
                        "default 300)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the processes (default 5)")
    p.add_argument("--ssh", default="ssh", help="the ssh command for remote hosts (default: ssh)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="start the whole job again up to K times after it failed (a rank stuck, killed or "
                        "crashed); the script resumes from its latest checkpoint. Not after a preemption "
                        f"(exit {PREEMPTED_EXIT}) or a signal to the launcher (default 0)")
    p.add_argument("--watchdog-dir", default=None,
                   help="where the ranks keep their ledgers and write stack dumps (ZEROJAX_WATCHDOG_DIR; default: "
                        "a new temporary directory, or .zerojax-watchdog/ under the working directory with remote "
                        "hosts)")
    p.add_argument("--preempt-grace", type=float, default=120.0,
                   help="seconds the ranks get to save and exit after SIGTERM reaches the launcher (default 120)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zerojax launch``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    for name in ("nproc", "devices_per_proc"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if args.grace < 0:
        parser.error(f"--grace {args.grace}: must be >= 0")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be >= 0")
    try:
        env_signal()  # a misspelt ZEROJAX_PREEMPTION_SIGNAL stops the launch before any rank starts
        hosts = None
        if args.hostfile:
            try:
                with open(args.hostfile) as f:
                    hosts = parse_hostfile(f.read(), args.hostfile)
            except OSError as e:
                raise LaunchError(f"cannot read --hostfile {args.hostfile!r}: {e}") from None
    except (ConfigError, LaunchError) as e:
        print(f"zerojax launch: error: {e}", file=sys.stderr)
        return 2
    remote = hosts is not None and not all(is_local(h.name) for h in hosts)
    root = args.watchdog_dir or (os.path.join(os.getcwd(), ".zerojax-watchdog", time.strftime("%Y%m%d-%H%M%S"))
                                 if remote else tempfile.mkdtemp(prefix="zerojax-launch-"))
    code = 0
    for attempt in range(args.max_restarts + 1):
        directory = os.path.join(root, f"attempt{attempt}")
        os.makedirs(directory, exist_ok=True)
        try:  # a fresh coordinator port each attempt: the last one's may still be held
            ranks = plan_ranks(args.script, args.script_args, nproc=args.nproc,
                               devices_per_proc=args.devices_per_proc, coordinator=args.coordinator, hosts=hosts,
                               init_timeout=args.init_timeout, ssh=args.ssh, grace=args.grace,
                               extra_env={WATCHDOG_DIR: directory, RESTART: str(attempt)})
        except LaunchError as e:
            print(f"zerojax launch: error: {e}", file=sys.stderr)
            return 2
        interrupted: list = []
        code = supervise(ranks, grace=args.grace, watchdog_dir=directory, interrupted=interrupted,
                         preempt_grace=args.preempt_grace)
        if code == 0 or interrupted or code == PREEMPTED_EXIT:
            return code
        if attempt < args.max_restarts:
            print(f"zerojax launch: the job failed (exit code {code}); starting it again (restart {attempt + 1} of "
                  f"{args.max_restarts}); it resumes from its latest checkpoint", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
