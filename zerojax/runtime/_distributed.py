"""Multi-process training: start-up from a launcher's environment, and the global batch.

    import zerojax as zj

    zj.distributed.initialize()        # first, before jax is used; a no-op under a plain `python train.py`
    mesh = zj.make_mesh()              # every device of every process
    state = zj.shard_train_state(init_fn, tx, mesh=mesh, config=config)
    step = zj.make_train_step(loss_fn, state)
    for local_batch in loader:         # this process's rows only
        state, metrics = step(state, zj.distributed.shard_batch(local_batch, mesh))

Where the processes are described, first match wins:

    zerojax launch   ZEROJAX_COORDINATOR (host:port), ZEROJAX_NUM_PROCESSES, ZEROJAX_PROCESS_ID,
                     ZEROJAX_LOCAL_RANK
    torchrun         MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK; torchrun's own store holds
                     MASTER_PORT, so the coordinator listens on MASTER_PORT + 1 (JAX_COORDINATOR_PORT
                     sets another)
    SLURM (srun)     SLURM_NTASKS (or SLURM_STEP_NUM_TASKS) > 1, SLURM_PROCID, SLURM_LOCALID; jax's own
                     SLURM detection finds the coordinator (the step's first node; JAX_COORDINATOR_PORT
                     sets the port)

``ZEROJAX_LOCAL_DEVICES=K`` gives each process K devices: on the CPU, K simulated devices; on GPUs,
devices LOCAL_RANK*K to LOCAL_RANK*K + K - 1 of its host. Without it, each process of a
multi-process run uses the GPU of its local rank (one process per GPU) and, on the CPU, jax's
default device count. ``ZEROJAX_INIT_TIMEOUT`` (seconds, default 300) bounds the wait for the
coordinator and for the other processes.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._compat import backends_are_initialized, distributed_is_initialized
from zerojax._errors import BatchError, ConfigError, DistributedError
from zerojax._mesh import DATA
from zerojax._plan import path_str
from zerojax.runtime import _watchdog

COORDINATOR = "ZEROJAX_COORDINATOR"
NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
PROCESS_ID = "ZEROJAX_PROCESS_ID"
LOCAL_RANK = "ZEROJAX_LOCAL_RANK"
LOCAL_DEVICES = "ZEROJAX_LOCAL_DEVICES"
INIT_TIMEOUT = "ZEROJAX_INIT_TIMEOUT"
DEFAULT_TIMEOUT = 300.0

__all__ = ["DistributedError", "ProcessEnv", "initialize", "process_env", "shard_batch"]


_TOO_LATE = """\
zerojax.runtime._distributed.initialize() ran after jax had already started ({what}), so this
process can no longer join a {n}-process run or choose its device count ({source} environment).
Call it first, right after the imports:

    import zerojax as zj
    zj.distributed.initialize()     # before zj.make_mesh(), jax.devices() or any jax array
"""


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """This process's place in a run, as read from the environment (``process_env()``)."""

    source: str  # "zerojax", "torchrun" or "slurm"
    num_processes: int
    process_id: int
    coordinator: str | None  # host:port; None where jax's cluster detection finds it (SLURM)
    local_rank: int | None = None  # index of this process among those of its host
    local_devices: int | None = None  # devices per process (ZEROJAX_LOCAL_DEVICES)

    @property
    def local_device_ids(self) -> list | None:
        """The GPUs of this host this process uses (jax's ``local_device_ids``); the CPU ignores it."""
        if self.local_rank is None or self.num_processes == 1 and self.local_devices is None:
            return None
        k = self.local_devices or 1
        return list(range(self.local_rank * k, (self.local_rank + 1) * k))


# --------------------------------------------------------------------------- environment
def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env.get(name)
    try:
        value = int(str(text).strip())
    except ValueError:
        raise DistributedError(f"{name}={text!r} is not a whole number; set it to an integer >= {minimum}") from None
    if value < minimum:
        raise DistributedError(f"{name}={value}: must be >= {minimum}")
    return value


def _require(env: Mapping[str, str], names, source: str, hint: str) -> None:
    missing = [n for n in names if not env.get(n)]
    if missing:
        present = ", ".join(f"{n}={env[n]}" for n in names if env.get(n))
        raise DistributedError(f"incomplete {source} environment: {', '.join(missing)} not set "
                               f"(found {present or 'none of the others'}). {hint}")


def split_address(text: str, name: str) -> tuple[str, str]:
    """``host:port`` -> (host, port); a DistributedError naming ``name`` when it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{name}={text!r} is not an address: write host:port, e.g. 10.0.0.1:29500")
    return host, port


def _address(text: str, name: str) -> str:
    return ":".join(split_address(text.strip(), name))


def _check_rank(source: str, rank_name: str, rank: int, size_name: str, size: int) -> None:
    if rank >= size:
        raise DistributedError(f"{rank_name}={rank} but {size_name}={size} ({source}): process ids run 0..{size - 1}")


def process_env(environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
    """Read the run's description from ``environ`` (default ``os.environ``); None for a plain process.

    ``zerojax launch``'s variables first, then torchrun's, then SLURM's (only with more than one
    task): see the module docstring. Inconsistent or partial settings raise DistributedError
    naming the variables.
    """
    env = os.environ if environ is None else environ
    local_devices = _int(env, LOCAL_DEVICES, 1) if env.get(LOCAL_DEVICES) else None
    if any(env.get(n) for n in (COORDINATOR, NUM_PROCESSES, PROCESS_ID)):
        _require(env, (COORDINATOR, NUM_PROCESSES, PROCESS_ID), "zerojax launch",
                 "Start the processes with `zerojax launch`, or set all three variables.")
        n, pid = _int(env, NUM_PROCESSES, 1), _int(env, PROCESS_ID, 0)
        _check_rank("zerojax launch", PROCESS_ID, pid, NUM_PROCESSES, n)
        local_rank = _int(env, LOCAL_RANK, 0) if env.get(LOCAL_RANK) else None
        return ProcessEnv("zerojax", n, pid, _address(env[COORDINATOR], COORDINATOR), local_rank, local_devices)
    if env.get("WORLD_SIZE") or env.get("MASTER_ADDR"):
        _require(env, ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"), "torchrun",
                 "Start the processes with torchrun (or set all four variables).")
        n, pid = _int(env, "WORLD_SIZE", 1), _int(env, "RANK", 0)
        _check_rank("torchrun", "RANK", pid, "WORLD_SIZE", n)
        host = env["MASTER_ADDR"].strip()
        if ":" in host and not host.startswith("["):  # an IPv6 address
            host = f"[{host}]"
        # torchrun's own store listens on MASTER_PORT: the coordinator takes the next port
        port = env.get("JAX_COORDINATOR_PORT") or str(_int(env, "MASTER_PORT", 1) + 1)
        coordinator = _address(f"{host}:{port}", "MASTER_ADDR:MASTER_PORT + 1 (or JAX_COORDINATOR_PORT)")
        local_rank = _int(env, "LOCAL_RANK", 0) if env.get("LOCAL_RANK") else None
        return ProcessEnv("torchrun", n, pid, coordinator, local_rank, local_devices)
    tasks = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if env.get("SLURM_PROCID") and env.get(tasks) and _int(env, tasks, 1) > 1:
        _require(env, ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_LOCALID"), "SLURM",
                 "Start one process per task with srun (inside sbatch or salloc).")
        n, pid = _int(env, tasks, 1), _int(env, "SLURM_PROCID", 0)
        _check_rank("SLURM", "SLURM_PROCID", pid, tasks, n)
        return ProcessEnv("slurm", n, pid, None, _int(env, "SLURM_LOCALID", 0), local_devices)
    if local_devices is not None:
        return ProcessEnv("zerojax", 1, 0, None, None, local_devices)
    return None


# ----------------------------------------------------------------------------- start-up
def _timeout(env: Mapping[str, str], timeout: float | None) -> float:
    if timeout is None:
        text = env.get(INIT_TIMEOUT)
        if not text:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(text)
        except ValueError:
            raise DistributedError(f"{INIT_TIMEOUT}={text!r} is not a number of seconds") from None
    if not timeout > 0:
        raise DistributedError(f"initialization timeout {timeout!r}: give a positive number of seconds")
    return float(timeout)


def _configure_devices(spec: ProcessEnv) -> None:
    """CPU settings that must be in place before jax creates its backends."""
    if spec.num_processes > 1 and os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo") == "gloo":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    if spec.local_devices is not None:
        jax.config.update("jax_num_cpu_devices", spec.local_devices)


def _wait_for_coordinator(spec: ProcessEnv, deadline: float, timeout: float) -> None:
    """Poll the coordinator's port (jax would abort the process, without a word, when it is not there)."""
    host, port = split_address(spec.coordinator, "coordinator")
    host = host.strip("[]")
    error: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            error = e
        if left <= 0:
            raise DistributedError(
                f"process {spec.process_id} of {spec.num_processes} cannot reach the coordinator at "
                f"{spec.coordinator} ({spec.source} environment); gave up after {timeout:g} s ({error}). "
                f"Check that process 0 is running, that this host can reach that address and port "
                f"(host name, firewall), and that every process was given the same address; wait longer "
                f"with {INIT_TIMEOUT}=<seconds>.")
        time.sleep(min(0.25, max(0.0, left)))


def _connect(spec: ProcessEnv, deadline: float, timeout: float) -> None:
    """jax.distributed.initialize, bounded: past the deadline the process exits with a message."""
    where = spec.coordinator or "the address found by jax's SLURM detection"
    if spec.process_id == 0:
        what = (f"process 0 started the coordinator at {where}, but not all {spec.num_processes} processes "
                f"joined within {timeout:g} s")
    else:
        what = (f"process {spec.process_id} of {spec.num_processes} reached the coordinator at {where}, but "
                f"the run did not assemble within {timeout:g} s")
    message = (f"zerojax.runtime._distributed.initialize: {what} ({spec.source} environment). Check that every process "
               f"was started with the same process count and a distinct process id, and that each can reach "
               f"the coordinator; wait longer with {INIT_TIMEOUT}=<seconds>.\n")
    left = max(1.0, deadline - time.monotonic())
    done = threading.Event()

    def watchdog():  # jax aborts the process (SIGABRT, no Python exception) when its own timeout passes
        if not done.wait(left):
            sys.stderr.write(message)
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watchdog, name="zerojax-init-watchdog", daemon=True).start()
    kwargs = {"num_processes": spec.num_processes, "process_id": spec.process_id,
              "local_device_ids": spec.local_device_ids, "initialization_timeout": int(left) + 10}
    if spec.coordinator is None:
        kwargs["cluster_detection_method"] = spec.source
    try:
        jax.distributed.initialize(spec.coordinator, **kwargs)
    except Exception as e:
        raise DistributedError(message.strip() + f" ({type(e).__name__}: {e})") from e
    finally:
        done.set()


def initialize(*, timeout: float | None = None,
               environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
    """Join the multi-process run the environment describes; return its ProcessEnv (None: a plain process).

    Call it first, before any other use of jax. Without a launcher's variables it does nothing,
    so the same script runs as one process. On the CPU it selects the gloo cross-process
    collectives and sets this process's device count (``ZEROJAX_LOCAL_DEVICES``). ``timeout``
    (default ``ZEROJAX_INIT_TIMEOUT`` or 300 s) bounds the start-up: a process that cannot reach
    the coordinator raises DistributedError; one that reaches it but whose peers never all arrive
    prints why and exits with code 1.

        zj.distributed.initialize()
        if jax.process_index() == 0:
            print(f"{jax.process_count()} processes, {jax.device_count()} devices")
    """
    env = os.environ if environ is None else environ
    spec = process_env(env)
    if spec is None:
        return None
    timeout = _timeout(env, timeout)
    if distributed_is_initialized():
        if (jax.process_count(), jax.process_index()) == (spec.num_processes, spec.process_id):
            return spec  # a second call
        raise DistributedError(
            f"jax.distributed is already initialized as process {jax.process_index()} of {jax.process_count()}, "
            f"but the {spec.source} environment says process {spec.process_id} of {spec.num_processes}")
    if backends_are_initialized():
        if spec.num_processes == 1 and spec.local_devices in (None, jax.local_device_count()):
            return spec
        what = f"it has {jax.local_device_count()} devices in one process"
        raise DistributedError(_TOO_LATE.format(what=what, n=spec.num_processes, source=spec.source))
    try:
        _configure_devices(spec)
    except RuntimeError as e:  # jax refuses: its backends exist after all
        raise DistributedError(_TOO_LATE.format(what=str(e).split(".")[0], n=spec.num_processes,
                                                source=spec.source)) from e
    if spec.num_processes == 1:
        return spec
    deadline = time.monotonic() + timeout
    if spec.process_id != 0 and spec.coordinator is not None:
        _wait_for_coordinator(spec, deadline, timeout)
    _connect(spec, deadline, timeout)
    return spec


# ---------------------------------------------------------------------------- the batch
def _local_data_positions(mesh: Mesh, data_axis: str) -> list:
    """The data-axis positions held by this process's devices."""
    me = jax.process_index()
    axis = mesh.axis_names.index(data_axis)
    mine = np.vectorize(lambda d: d.process_index == me, otypes=[bool])(mesh.devices)
    return sorted({int(i) for i in np.argwhere(mine)[:, axis]})


def _check_processes(rows: int, signature: int, names: str) -> None:
    """Every process gives the same number of rows and the same leaves (one tiny all-gather)."""
    from jax.experimental import multihost_utils

    mine = np.array([rows, signature], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    if (every == mine).all():
        return
    per = ", ".join(f"process {i}: {int(r)} rows" for i, r in enumerate(every[:, 0]))
    if len(set(every[:, 1].tolist())) > 1:
        raise BatchError(f"shard_batch: the processes' batches differ in leaves, trailing shapes or dtypes "
                         f"(this process, {jax.process_index()}: {names}); {per}. Every process must build "
                         "the same batch structure.")
    raise BatchError(f"shard_batch: the processes give different numbers of rows ({per}); every process must "
                     "give the same number (drop or pad the last, short batch on every process alike).")


def shard_batch(local_batch, mesh: Mesh, data_axis: str = DATA, *, check: bool = True):
    """Each process's rows of a batch -> the global batch, split over the mesh's ``data_axis``.

    ``local_batch`` is a pytree of host arrays whose leading dimension is this process's rows;
    the global batch is every process's rows in process order, as the train step takes it. With
    one process it is a plain ``device_put``. ``check`` compares the row counts and leaves across
    processes first (one small all-gather) so an uneven last batch is an error rather than a hang.

        batch = zj.distributed.shard_batch({"tokens": tokens[rank::world]}, mesh)
    """
    if data_axis not in mesh.axis_names:
        raise ConfigError(f"shard_batch: the mesh has no axis {data_axis!r} (axes {mesh.axis_names}); "
                         "pass data_axis=")
    flat, treedef = jax.tree_util.tree_flatten_with_path(local_batch)
    if not flat:
        raise BatchError("shard_batch: the batch has no arrays")
    names = [path_str(p) or "<root>" for p, _ in flat]
    arrays = [np.asarray(x) for _, x in flat]
    for name, x in zip(names, arrays):
        if x.ndim == 0:
            raise BatchError(f"shard_batch: batch leaf {name!r} is a scalar; every leaf needs a leading batch "
                             "dimension")
    rows = {name: x.shape[0] for name, x in zip(names, arrays)}
    if len(set(rows.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in rows.items())
        raise BatchError(f"shard_batch: the batch leaves' leading dimensions disagree ({listing}); every leaf "
                         "needs the same number of rows")
    local_rows = arrays[0].shape[0]
    positions = _local_data_positions(mesh, data_axis)
    if not positions:
        raise ConfigError(f"shard_batch: process {jax.process_index()} has no device in the mesh; build the mesh "
                         "over every process's devices (zj.make_mesh())")
    if local_rows % len(positions):
        raise BatchError(
            f"shard_batch: {local_rows} rows on process {jax.process_index()}, which holds {len(positions)} of "
            f"the mesh's {mesh.shape[data_axis]} {data_axis!r} shards: give each process a multiple of "
            f"{len(positions)} rows")
    if check and jax.process_count() > 1:
        described = ", ".join(f"{n}: {x.shape[1:]} {x.dtype}" for n, x in zip(names, arrays))
        _watchdog.record("batch check", detail=f"{local_rows} rows")
        with _watchdog.armed("batch"):  # a collective: a process that never comes holds this one here
            _check_processes(local_rows, zlib.crc32(described.encode()) & 0x7FFFFFFF, described)
    sharding = NamedSharding(mesh, P(data_axis))
    placed = treedef.unflatten([jax.make_array_from_process_local_data(sharding, x) for x in arrays])
    _watchdog.record("batch placed", detail=f"{local_rows} rows")
    return placed
