"""ZeRO-Infinity's run: a GPT whose params and optimizer state live on NVMe trains, and what its
steps cost next to the bytes they move through the disk.

    python benchmarks/bigger_than_memory.py                       # 8 layers, d 512: ~0.5 GB a slot
    python benchmarks/bigger_than_memory.py --layers 48 --d 2048 --dir /nvme/scratch
    python benchmarks/bigger_than_memory.py --smoke               # tiny, seconds: the script runs
    sudo python benchmarks/bigger_than_memory.py --layers 24 --d 1024 --seq 32 --batch 4 --steps 19 \
        --devices 4 --buckets auto --memory-limit 2.6             # the job capped at 2.6 GiB (cgroup)
    sudo python benchmarks/bigger_than_memory.py --layers 24 --d 1024 --seq 32 --batch 4 --steps 5 \
        --devices 4 --buckets auto --memory-limit 2.6 --checkpoint-at 3   # saved and resumed under the cap

Stage 3 (``max_reuse_distance: 0``), bf16, AdamW, ``offload_param`` and ``offload_optimizer`` both ``"nvme"`` on 8 simulated
devices: the 16-bit params, fp32 master and both moments (14 bytes a param, in two slots) live in
files. Before every step the files' pages are dropped from the page cache, so the step reads from
the drive where the kernel allows it. Printed:

* the state on disk against this machine's memory, and the loss of each step (it must fall);
* the peak resident set during the steps, the NVMe run alone in the process (above the process
  after its imports), against the state on disk and the machine's memory (goal: <= 0.5x the
  machine), and how much of it the simulated devices' compiled peak accounts for (GPU memory on a
  GPU, not the host's);
* per step: bytes read and written, the time the drive needs for them at its own measured
  sequential speed (a plain write with fsync and a read of a file of the same size, same
  directory, cache dropped), the compute time (the same model and batch at stage 3 with
  everything in memory, timed in rounds interleaved with the NVMe steps; ``--no-compare`` skips
  it for a state that does not fit) and the step time against the two summed (goal: within 1.5x).

``--memory-limit GIB`` runs the same training in a child process whose memory the kernel caps
(a memory cgroup: v1's ``memory.limit_in_bytes`` or v2's ``memory.max``; needs root), so the
simulated devices' memory, the host buffers, the page cache of the store's files and the runtime
all count against the limit, as on a machine of that size. It prints the training state (fp32
master, both moments and the 16-bit params: 14 bytes a param) against the limit (goal >= 1.5x),
the loss of every step, and the largest memory the group was charged; and, phase by phase (the
imports, the params made, the step made with its store written, the first step, each step), the
group's peak charge in the phase (cgroup v1), its charge after it as anonymous memory and page
cache, and the process's peak resident set in the phase.

``--checkpoint-at K`` saves the state after step K (``zj.CheckpointManager``: an NVMe run's save
streams the store's committed slot and returns once it is on disk); after the straight run, its
step is closed and its store deleted, and a new run resumes from the checkpoint as a job would:
``zj.abstract_train_state`` over a fresh ``nvme_path``, ``mngr.restore`` (which writes the store),
``zj.make_train_step``, the remaining steps. Printed: the checkpoint's size on disk, the save and
restore seconds with the peaks in each (the group's under ``--memory-limit``, in the same child and
cgroup), and the resumed steps' losses next to the straight run's (they must be equal). ``--smoke``
saves after step 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import tempfile
import time

CGROUP_ENV = "ZEROJAX_BTM_CGROUP"  # the child joins this group's cgroup.procs before anything else
PEAK_ENV = "ZEROJAX_BTM_PEAK"  # a file where the child keeps the group's peak over the phases it reset

if __name__ == "__main__":
    if os.environ.get(CGROUP_ENV):
        with open(os.path.join(os.environ[CGROUP_ENV], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    import sys

    from _common import simulate_devices

    simulate_devices(int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8)


def _cgroup(limit: int):
    """(group directory, its peak-usage file, its limit-hit file) of a fresh memory cgroup capped
    at ``limit`` bytes: cgroup v1's memory controller where mounted, else v2."""
    name = f"zerojax-btm-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1) and os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
        path = os.path.join(v1, name)
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        return path, "memory.max_usage_in_bytes", "memory.failcnt"
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        path = os.path.join("/sys/fs/cgroup", name)
        os.mkdir(path)
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(limit))
        return path, "memory.peak", "memory.events"
    raise SystemExit("--memory-limit needs a memory cgroup (v1 at /sys/fs/cgroup/memory or v2 at /sys/fs/cgroup)")


class Phases:
    """Where a limited job's memory goes, phase by phase: at each :meth:`mark` the cgroup's peak
    charge since the last mark (v1's ``memory.max_usage_in_bytes``, reset at each mark), its
    charge now split as ``memory.stat`` does (anonymous rss, page cache, of which mapped and
    dirty), and the process's peak resident set since the last mark (VmHWM, reset likewise)."""

    def __init__(self, group: str | None, verbose: bool = True):
        self.verbose = verbose
        self.group = group if group and os.path.exists(os.path.join(group, "memory.max_usage_in_bytes")) else None
        self.peak = 0  # the group's peak over every phase so far (each mark resets the kernel's)
        self._reset()

    def _read(self, name: str) -> str:
        with open(os.path.join(self.group, name)) as f:
            return f.read()

    def _reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        except OSError:
            pass
        if self.group:
            with open(os.path.join(self.group, "memory.max_usage_in_bytes"), "w") as f:
                f.write("0")

    def mark(self, phase: str) -> tuple:
        """Prints the phase's line; returns (the process's peak RSS, the group's peak or None) in it."""
        g = 2**30
        peak = None
        with open("/proc/self/status") as f:
            st = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmHWM", "VmRSS")}
        line = f"[memory] {phase}: process peak RSS {st['VmHWM'] / g:.2f} GiB (now {st['VmRSS'] / g:.2f})"
        if self.group:
            stat = {k: int(v) for k, v in (x.split() for x in self._read("memory.stat").splitlines())}
            peak = int(self._read("memory.max_usage_in_bytes"))
            self.peak = max(self.peak, peak)
            if os.environ.get(PEAK_ENV):
                with open(os.environ[PEAK_ENV], "w") as f:
                    f.write(str(self.peak))
            line += (f"; cgroup peak {peak / g:.2f} GiB, now "
                     f"{int(self._read('memory.usage_in_bytes')) / g:.2f} = rss {stat['rss'] / g:.2f} + cache "
                     f"{stat['cache'] / g:.2f} (mapped {stat['mapped_file'] / g:.2f}, dirty {stat['dirty'] / g:.2f})")
        if self.verbose:
            print(line, flush=True)
        self._reset()
        return st["VmHWM"], peak


def run_limited(args) -> int:
    """The training in a child process capped at ``args.memory_limit`` GiB; prints the group's peak."""
    import subprocess
    import sys

    limit = int(args.memory_limit * 2**30)
    try:
        path, peak_file, events_file = _cgroup(limit)
    except PermissionError as e:
        raise SystemExit(f"--memory-limit: cannot create a memory cgroup ({e}); run as root") from e
    argv = list(sys.argv[1:])
    i = argv.index("--memory-limit")
    del argv[i:i + 2]
    phase_peaks = os.path.join(tempfile.gettempdir(), f"zerojax-btm-peak-{os.getpid()}")
    env = dict(os.environ, **{CGROUP_ENV: path, PEAK_ENV: phase_peaks})
    print(f"the job runs in the memory cgroup {path}, capped at {limit / 2**30:.2f} GiB", flush=True)
    try:
        rc = subprocess.call([sys.executable, os.path.abspath(__file__), *argv, "--limited", str(limit)], env=env)
        with open(os.path.join(path, peak_file)) as f:
            peak = int(f.read())
        if os.path.exists(phase_peaks):  # the phases' peaks, from before the child's last reset
            with open(phase_peaks) as f:
                peak = max(peak, int(f.read() or 0))
        with open(os.path.join(path, events_file)) as f:
            events = f.read().strip().replace("\n", ", ")
        print(f"cgroup: peak charged {peak / 2**30:.2f} GiB = {peak / limit:.2f}x the limit of {limit / 2**30:.2f} GiB "
              f"(page cache included; {events_file}: {events}); the job exited with {rc}", flush=True)
        return rc
    finally:
        os.rmdir(path)
        if os.path.exists(phase_peaks):
            os.unlink(phase_peaks)


def save(zj, ckpt: str, state, mark) -> dict:
    """Saves ``state`` into ``ckpt`` (an NVMe run's save streams the store's committed slot and
    returns once it is on disk); returns its step, size, seconds and the phase's peaks."""
    from checkpoint import du

    at = int(state.step)
    t = time.perf_counter()
    with zj.CheckpointManager(ckpt) as mngr:
        mngr.save(at, state)
    seconds = time.perf_counter() - t
    rss, group = mark(f"the checkpoint of step {at} saved")
    return dict(at=at, bytes=du(ckpt), seconds=seconds, rss=rss, group=group)


def resume(args, zj, cfg, tx, config, loss_fn, batch, step, losses, saved, mark) -> None:
    """A new run from the checkpoint: the straight run's step closed and its store deleted, a
    target over a fresh ``nvme_path`` restored from the checkpoint (its store written from it),
    a step made over it and the remaining steps trained; prints their losses next to the
    straight run's."""
    import jax

    from checkpoint import drop_cache
    from zerojax.models import gpt

    nvme, ckpt = config.nvme_path, os.path.join(os.path.dirname(config.nvme_path), "ckpt")
    step.close()
    del step
    shutil.rmtree(nvme)
    gc.collect()
    mark("the straight run closed, its store deleted")
    fresh = os.path.join(os.path.dirname(nvme), "nvme-resumed")
    os.makedirs(fresh)
    config = dataclasses.replace(config, nvme_path=fresh)
    drop_cache(ckpt)
    t = time.perf_counter()
    target = zj.abstract_train_state(zj.init_fn(lambda key: gpt.init_params(cfg, key)), tx, config=config)
    with zj.CheckpointManager(ckpt) as mngr:
        state, _ = mngr.restore(target)
    seconds = time.perf_counter() - t
    rss, group = mark(f"the checkpoint restored into a fresh store ({fresh})")
    g = 2**30
    peaks = lambda r, c: f"peak RSS {r / g:.2f} GiB" + ("" if c is None else f", group peak {c / g:.2f} GiB")
    print(f"checkpoint of step {saved['at']}: {saved['bytes'] / 2**30:.3f} GiB on disk; save {saved['seconds']:.1f} s "
          f"({peaks(saved['rss'], saved['group'])}); restore {seconds:.1f} s into a fresh nvme_path, "
          f"cache dropped ({peaks(rss, group)})", flush=True)
    step = zj.make_train_step(loss_fn, state)
    state = state.replace(params=step.placeholders())
    gc.collect()
    mark("the step made over the restored store")
    more = []
    for _ in range(len(losses) - saved["at"]):
        drop_cache(fresh)
        t = time.perf_counter()
        state, m = step(state, batch)
        more.append(float(m["loss"]))
        if args.limited:
            print(f"resumed step {saved['at'] + len(more)}: loss {more[-1]:.4f}, {time.perf_counter() - t:.1f} s",
                  flush=True)
            mark(f"resumed step {saved['at'] + len(more)}")
    step.close()
    straight = losses[saved["at"]:]
    print(f"losses after the resume (steps {saved['at'] + 1}-{len(losses)}): " + ", ".join(f"{x:.4f}" for x in more))
    print(f"the straight run's steps {saved['at'] + 1}-{len(losses)}: " + ", ".join(f"{x:.4f}" for x in straight)
          + ("  (equal)" if more == straight else "  (NOT equal)"), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="a directory on the drive (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="2 layers of d 64, 2 steps")
    ap.add_argument("--no-compare", action="store_true",
                    help="no in-memory run (a model whose state does not fit in memory)")
    ap.add_argument("--devices", type=int, default=8, help="simulated devices (read before jax starts)")
    ap.add_argument("--buckets", choices=["deepspeed", "auto"], default="deepspeed",
                    help="auto: Hugging Face's 'auto' buckets for the model (prefetch 0.9 d^2, reduce d^2 elements) "
                         "and a parameter read-ahead of 4 layers, so the devices hold a few layers, not the model")
    ap.add_argument("--memory-limit", type=float, default=None,
                    help="GiB: run the training in a child process capped at this much memory (a cgroup; root)")
    ap.add_argument("--checkpoint-at", type=int, default=None, metavar="K",
                    help="save the state after step K (zj.CheckpointManager), then resume it as a new run would "
                         "(a fresh nvme_path) and train the remaining steps: their losses against the straight run's")
    ap.add_argument("--limited", type=int, default=None, help=argparse.SUPPRESS)  # the child: its cap in bytes
    args = ap.parse_args()
    if args.memory_limit is not None:
        raise SystemExit(run_limited(args))
    if args.limited:
        args.no_compare = True  # nothing else fits beside it
    if args.smoke:
        args.layers, args.d, args.vocab, args.seq, args.steps = 2, 64, 256, 16, 2
        args.checkpoint_at = args.checkpoint_at or 1
    if args.checkpoint_at is not None and not 1 <= args.checkpoint_at <= args.steps:
        raise SystemExit(f"--checkpoint-at: between 1 and --steps ({args.steps}): the run has {args.steps + 1} steps")

    import jax
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.models import gpt
    from checkpoint import disk_speed, drop_cache
    from nvme import RssSampler

    cfg = gpt.GPTConfig(vocab=args.vocab, n_layer=args.layers, d_model=args.d, n_head=max(1, args.d // 64),
                        seq_len=args.seq)
    root = tempfile.mkdtemp(dir=args.dir, prefix="zj-btm-")
    nvme = os.path.join(root, "nvme")
    os.makedirs(nvme)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (args.batch, cfg.seq_len + 1)).astype(np.int32)
    batch = {"tokens": tokens}
    loss_fn = gpt.loss_fn(cfg)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4, weight_decay=0.01)
    # max_reuse_distance 0: every param is gathered (and read) again for the backward pass, so the
    # device holds a few layers at a time, not the whole gathered model until its backward use
    common = dict(stage=3, precision="bf16", param_persistence_threshold=0, max_reuse_distance=0)
    read_ahead = {}
    if args.buckets == "auto":
        d2 = args.d * args.d
        common.update(prefetch_bucket_size=int(0.9 * d2), reduce_bucket_size=d2)
        read_ahead = dict(offload_param_buffer_count=4, offload_param_buffer_size=12 * d2)
    try:
        rss_base = RssSampler().rss()  # after the imports: jax and its runtime
        phases = Phases(os.environ.get(CGROUP_ENV), verbose=bool(args.limited))
        mark = phases.mark
        mark("the imports")
        config = zj.ZeroConfig(**common, **read_ahead, offload_optimizer="nvme", offload_param="nvme", nvme_path=nvme,
                               sub_group_size=1 << 22)
        # an init function: the params are created in their sharded layout, never whole on one device
        state = zj.shard_train_state(zj.init_fn(lambda key: gpt.init_params(cfg, key)), tx, config=config,
                                     rng=jax.random.PRNGKey(0))
        if args.limited:
            jax.block_until_ready(state)  # the init runs asynchronously: its memory belongs to this phase
        mark("the params made on the devices")
        step = zj.make_train_step(loss_fn, state)
        # the step wrote the params to the store's files: the state need not hold them on the
        # devices through the first step (the state a step returns holds their shapes only)
        state = state.replace(params=step.placeholders())
        gc.collect()
        mark("the step made: the store created, the params written to it")
        n = step.layout.total  # elements on disk, padding included
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        slot = 14 * n
        print(f"GPT {cfg.n_layer} layers, d {cfg.d_model}, vocab {cfg.vocab}: {cfg.n_params / 1e6:.1f}M params; "
              f"on disk {slot / 2**30:.2f} GiB a slot (x2 slots) = {slot / machine:.3f}x this machine's "
              f"{machine / 2**30:.1f} GiB", flush=True)
        if args.limited:
            print(f"training state (fp32 master, both moments, bf16 params: 14 bytes a param) {slot / 2**30:.2f} GiB "
                  f"= {slot / args.limited:.2f}x the job's memory limit of {args.limited / 2**30:.2f} GiB "
                  "[goal >= 1.5x]", flush=True)
        compiled = step.lower(state, batch).compile().memory_analysis() if not args.limited else None
        per_dev = 0 if compiled is None else (compiled.argument_size_in_bytes + compiled.output_size_in_bytes
                                              + compiled.temp_size_in_bytes - compiled.alias_size_in_bytes)
        devices_bytes = per_dev * state.plan.n
        # the first step compiles the device part
        state, m = step(state, batch)
        losses = [float(m["loss"])]
        gc.collect()
        mark("the first step (compile included)")
        ckpt = os.path.join(root, "ckpt")
        saved = save(zj, ckpt, state, mark) if args.checkpoint_at == 1 else None
        times, compute, mem_losses = [], [], []
        with RssSampler(0.002) as rss:  # the NVMe run alone: nothing else of the model in memory
            for _ in range(args.steps):
                drop_cache(nvme)
                t = time.perf_counter()
                state, m = step(state, batch)
                losses.append(float(m["loss"]))
                times.append(time.perf_counter() - t)
                if args.limited:
                    print(f"step {len(losses)}: loss {losses[-1]:.4f}, {times[-1]:.1f} s", flush=True)
                    mark(f"step {len(losses)}")
                if len(losses) == args.checkpoint_at:
                    saved = save(zj, ckpt, state, mark)
        grow = rss.peak - rss_base
        print("losses: " + ", ".join(f"{x:.4f}" for x in losses)
              + ("  (falling)" if losses[-1] < losses[0] else "  (NOT falling)"))
        if saved and args.checkpoint_at > 1:
            print(f"(the peak RSS below includes the save after step {args.checkpoint_at})")
        print(f"peak RSS during the steps {grow / 2**30:.2f} GiB above the process after its imports = "
              f"{grow / slot:.2f}x the state on disk, {grow / machine:.3f}x the machine [goal <= 0.5x the machine]; "
              f"of it the simulated devices' compiled peak x {state.plan.n}: {devices_bytes / 2**30:.2f} GiB, "
              "GPU memory on a GPU")
        write_bw, read_bw = disk_speed(root, int(min(slot, (64 << 20) if args.limited else 1 << 30)))
        io_read = io_write = 14 * n  # params (2 B) + master, m, v (12 B) read; the same written
        io = io_read / (read_bw * 1e9) + io_write / (write_bw * 1e9)
        print(f"disk: write {write_bw:.2f} GB/s, read {read_bw:.2f} GB/s (plain sequential, cache dropped)")
        if args.no_compare:
            print(f"per step: read {io_read / 1e9:.3f} GB, written {io_write / 1e9:.3f} GB -> {io:.2f} s at the "
                  f"disk's speed; step {float(np.median(times)):.2f} s")
            if saved:
                resume(args, zj, cfg, tx, config, loss_fn, batch, step, losses, saved, mark)
            return
        # compute: the same model and batch at stage 3 in memory, timed interleaved with the NVMe steps
        base = zj.shard_train_state(gpt.init_params(cfg, jax.random.PRNGKey(0)), tx, config=zj.ZeroConfig(**common))
        in_memory = zj.make_train_step(loss_fn, base)
        base, _ = in_memory(base, batch)
        jax.block_until_ready(base)
        times = []
        for r in range(args.steps):
            for which in (("nvme", "mem") if r % 2 == 0 else ("mem", "nvme")):
                if which == "nvme":
                    drop_cache(nvme)
                    t = time.perf_counter()
                    state, m = step(state, batch)
                    float(m["loss"])
                    times.append(time.perf_counter() - t)
                else:
                    t = time.perf_counter()
                    base, mb = in_memory(base, batch)
                    mem_losses.append(float(mb["loss"]))
                    compute.append(time.perf_counter() - t)
        step.close()
        med, comp = float(np.median(times)), float(np.median(compute))
        print(f"per step: read {io_read / 1e9:.3f} GB, written {io_write / 1e9:.3f} GB -> {io:.2f} s at the disk's "
              f"speed; compute (same step in memory) {comp:.2f} s")
        print(f"step {med:.2f} s = {med / (io + comp):.2f}x (bytes / bandwidth + compute)   [goal <= 1.5x]   "
              f"interleaved rounds: {', '.join(f'{x:.2f}' for x in times)} against "
              f"{', '.join(f'{x:.2f}' for x in compute)} in memory")
        if saved:
            del base, in_memory
            resume(args, zj, cfg, tx, config, loss_fn, batch, step, losses, saved, mark)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
