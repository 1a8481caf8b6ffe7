"""Checkpoint throughput next to the disk's own speed, the cost of a steady-state save, and
consolidation's and restore's peak memory.

    python benchmarks/checkpoint.py                       # 32M params: 384 MB of fp32 state
    python benchmarks/checkpoint.py --width 4096 --dir /nvme/scratch
    python benchmarks/checkpoint.py --smoke               # tiny shapes, seconds: the script runs
    python benchmarks/checkpoint.py --layers 20           # 100M params: a 1.2 GB checkpoint
    python benchmarks/checkpoint.py --memory              # restore memory with the largest leaf 4x the budget
    python benchmarks/checkpoint.py --compress            # the same with zstd-compressed arrays

Save: ``CheckpointManager.save`` + ``wait_until_finished`` of a stage-3 bf16 AdamW state on 8
simulated devices (fp32 master + two moments are written), three times in a row into fresh
steps. The 1st save traces and compiles the save program; the 3rd reuses it, so it costs the
copy and the write only (goal: the 3rd at most a quarter of the 1st). Throughput: further saves
(call + wait, programs compiled) and restores onto a 4-device stage-2 mesh, in GB/s of checkpoint
bytes, next to numpy writing (with fsync) and reading a file of the same size in the same
directory, in ``--rounds`` rounds that interleave a save, a raw write, a restore and a raw read
(the order flipped every other round), so a busy machine slows both sides alike; the ratios
(goal: >= 0.8) are the rounds' medians. The raw read is numpy reading the file whole into fresh
memory, as a restore lands in fresh memory; the restore is also set against the file read again
in 64 MiB reads into one reused buffer (the disk's own pace, ``dd bs=64M``). Before each
read the page cache of the files is dropped (posix_fadvise DONTNEED), so reads come from the disk
where the kernel allows it.

Restore memory: a fresh process restores the checkpoint into an abstract stage-3 target with each
budget (``zj.checkpoint.restore(..., budget=)``; "whole state at once" is a budget larger than
the state, the read before budgets existed) and reports its RSS growth at the peak against the
restored state's own bytes. Goal: at most the state + the budget + one stored chunk (8 MiB),
whatever the largest leaf: ``--memory`` restores a model whose embedding is 4x the smallest
budget (width 4096, 2 layers: a 268 MB leaf, 64 MiB budget) and prints whether the bound holds,
in a fresh process and in one whose runtime a tiny restore warmed first (the runtime's one-time
growth, some 30-50 MB of threads and caches whatever the state, is then in the baseline).

Consolidation runs in a fresh process per measurement; its peak resident set (VmHWM)
minus that of consolidating a tiny checkpoint (imports, runtime, the same code path) is
reported against the largest leaf in fp32. The goal is at most 3x the largest leaf.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__":
    from _common import simulate_devices

    simulate_devices(8)


def drop_cache(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def disk_speed(directory: str, nbytes: int, chunked: bool = False):
    """(write, read) GB/s of a file of ``nbytes`` in ``directory``: numpy writes it (with fsync)
    and reads it back whole into fresh memory, its page cache dropped first. ``chunked``: a third
    figure, the same file read again cold in 64 MiB reads into one reused buffer (``dd bs=64M``:
    no fresh memory to fault in, so the disk's own pace)."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    path = os.path.join(directory, "raw.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data.data)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t) / 1e9
    del data
    drop_cache(path)
    t = time.perf_counter()
    back = np.fromfile(path, dtype=np.uint8)
    read = nbytes / (time.perf_counter() - t) / 1e9
    assert back.size == nbytes
    del back
    if chunked:
        drop_cache(path)
        buf, n = bytearray(64 << 20), 0
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        read64 = n / (time.perf_counter() - t) / 1e9
    os.remove(path)
    return (write, read, read64) if chunked else (write, read)


def model(width: int, layers: int):
    import jax

    def init(key):
        keys = jax.random.split(key, layers + 1)
        params = {"emb": jax.random.normal(keys[0], (4 * width, width)) * 0.02}
        for i in range(layers):
            params[f"layer{i}"] = {"kernel": jax.random.normal(keys[i + 1], (width, width)) * 0.02,
                                   "bias": jax.numpy.zeros((width,))}
        return params

    return init


# ru_maxrss survives fork + exec on Linux (a child would report this big parent's peak), so the
# child reads its own high-water mark, VmHWM, which a fresh address space starts from zero
CONSOLIDATE = """
import sys, time
from zerojax.checkpoint import consolidate
budget = int(sys.argv[3])
t = time.perf_counter()
consolidate(sys.argv[1], sys.argv[2], progress=False, **({"budget": budget} if budget else {}))
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(int(hwm) * 1024, time.perf_counter() - t)
"""


def consolidate_peak(ckpt: str, out: str, budget: int = 0):
    import zerojax

    # the child reads with the same zerojax as this process writes with
    root = os.path.dirname(os.path.dirname(os.path.abspath(zerojax.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", CONSOLIDATE, ckpt, out, str(budget)], env=env, check=True,
                         capture_output=True, text=True)
    peak, seconds = res.stdout.split()[-2:]
    return int(peak), float(seconds)


# a fresh process restores the checkpoint into an abstract target (nothing of the state held
# before) with a budget; a thread samples VmRSS every 2 ms; printed: the growth at the peak and
# the restored state's own bytes
RESTORE = """
import sys, threading, time
sys.path.insert(0, sys.argv[5])
import jax, optax
import zerojax as zj
from checkpoint import model
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]) * 1024
target = zj.abstract_train_state(model(int(sys.argv[2]), int(sys.argv[3])), optax.adamw(1e-3), mesh=zj.make_mesh(8),
                                 config=zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0))
budget = int(sys.argv[4])
if sys.argv[6]:  # warm the runtime first (Orbax's and tensorstore's threads and caches, jax's): a tiny restore
    small = zj.abstract_train_state(model(8, 1), optax.adamw(1e-3), mesh=zj.make_mesh(8),
                                    config=zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0))
    jax.block_until_ready(zj.checkpoint.restore(sys.argv[6], small)[0])
base = rss(); peak = [base]; done = []
def sample():
    while not done:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
state, _ = zj.checkpoint.restore(sys.argv[1], target, budget=budget if budget > 0 else None)
jax.block_until_ready(state)
seconds = time.perf_counter() - t
done.append(1); time.sleep(0.01)
own = sum(x.nbytes for x in jax.tree_util.tree_leaves((state.params, state.master, state.opt_state)))
print(peak[0] - base, own, seconds)
"""


def restore_peak(ckpt: str, width: int, layers: int, budget: int, warm: str = ""):
    """(RSS growth at the peak, the restored state's bytes, seconds) of a restore in a fresh process
    (after a restore of the tiny checkpoint ``warm``, when given)."""
    import zerojax

    root = os.path.dirname(os.path.dirname(os.path.abspath(zerojax.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    drop_cache(ckpt)
    res = subprocess.run([sys.executable, "-c", RESTORE, ckpt, str(width), str(layers), str(budget),
                          os.path.dirname(os.path.abspath(__file__)), warm], env=env, check=True, capture_output=True,
                         text=True)
    grow, own, seconds = res.stdout.split()[-3:]
    return int(grow), int(own), float(seconds)


def make_state(width: int, layers: int):
    import jax
    import optax

    import zerojax as zj

    state = zj.shard_train_state(model(width, layers), optax.adamw(1e-3), mesh=zj.make_mesh(8),
                                 config=zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0))
    # moments of a fresh AdamW are zeros, which compress to nothing: fill them like a trained state
    noise = jax.jit(lambda t: jax.tree_util.tree_map(
        lambda x: x + jax.random.normal(jax.random.PRNGKey(x.size), x.shape, x.dtype) * 1e-3
        if x.ndim and jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, t))
    state = state.replace(opt_state=noise(state.opt_state))
    jax.block_until_ready(state)
    return state


def manager(directory: str, compress: bool):
    import zerojax as zj

    # compress= only when asked: the script also measures versions without the option
    return zj.checkpoint.CheckpointManager(directory, max_to_keep=1, **({"compress": True} if compress else {}))


def save_checkpoint(directory: str, width: int, layers: int, saves: int = 3, compress: bool = False):
    """Save the same state ``saves`` times (steps 1, 2, ...); returns (state, seconds of each
    save + wait, blocking seconds of each save)."""
    state = make_state(width, layers)
    mngr = manager(directory, compress)
    seconds, blocking = [], []
    for k in range(saves):
        t = time.perf_counter()
        mngr.save(k + 1, state)
        blocking.append(time.perf_counter() - t)
        mngr.wait_until_finished()
        seconds.append(time.perf_counter() - t)
    mngr.close()
    return state, seconds, blocking


CHUNK = 8 << 20  # the largest stored chunk a save writes (zerojax.checkpoint._pieces.CHUNK_BYTES)


def memory_rows(ckpt: str, width: int, layers: int, budgets, nbytes: int, warm: str = "") -> dict:
    """Restore into a fresh process with each budget; print RSS growth against the bound. With
    ``warm`` (a tiny checkpoint), each budget is measured again in a process that restored it
    first, so the runtime's one-time growth (threads, caches) is in the baseline."""
    out = {}
    for name, b in budgets:
        budget = b or (1 << 30)
        row = {}
        for when, tiny in (("cold", ""), ("warm", warm)) if warm else (("cold", ""),):
            grow, own, secs = restore_peak(ckpt, width, layers, b, tiny)
            limit = own + budget + CHUNK
            row[when] = {"growth_MB": grow / 1e6, "state_MB": own / 1e6, "seconds": secs,
                         "growth_over_state": grow / own}
            bound = ""
            if budget < 1 << 40:
                row[when].update(bound_MB=limit / 1e6, bound_holds=grow <= limit)
                bound = (f"; bound state + budget + chunk {limit / 1e6:.0f} MB: "
                         f"{'holds' if grow <= limit else 'EXCEEDED'}")
            where = "fresh process" if when == "cold" else "after a tiny restore warmed the runtime"
            print(f"  restore memory, budget {name}: RSS grew {grow / 1e6:.0f} MB = {grow / own:.2f}x the restored "
                  f"state ({own / 1e6:.0f} MB){bound}; {nbytes / secs / 1e9:.2f} GB/s ({where}, cold cache)",
                  flush=True)
        out[name] = row if warm else row["cold"]
    return out


def memory_main(args) -> None:
    """--memory: the largest leaf (the embedding, 4 * width^2 fp32) is 4x the smallest budget."""
    width, layers = (64, 1) if args.smoke else (4096, 2)
    largest = 4 * width * width * 4
    small = max(largest // 4, 1)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        ckpt = os.path.join(root, "ckpt")
        state, _, _ = save_checkpoint(ckpt, width, layers, saves=1, compress=args.compress)
        del state
        nbytes = du(os.path.join(ckpt, "1"))
        print(f"checkpoint {nbytes / 1e6:.0f} MB, largest leaf {largest / 1e6:.0f} MB (width {width}, "
              f"{layers} layers); budgets down to {small / 2 ** 20:.3g} MiB = largest leaf / 4", flush=True)
        tiny = os.path.join(root, "tiny")
        save_checkpoint(tiny, 8, 1, saves=1, compress=args.compress)
        label = f"{small >> 20} MiB" if small >= 1 << 20 else f"{small >> 10} KiB"
        budgets = [("whole state at once", 1 << 40), ("default, 1 GiB", 0), (label, small)]
        rows = memory_rows(ckpt, width, layers, budgets, nbytes, warm=tiny)
        peak, cons_s = consolidate_peak(ckpt, os.path.join(root, "model.safetensors"), budget=small)
        base, _ = consolidate_peak(tiny, os.path.join(root, "tiny.safetensors"), budget=small)
        print(f"consolidate with budget {label}: peak RSS {(peak - base) / 1e6:.0f} MB above "
              f"baseline = {(peak - base) / largest:.2f}x the largest leaf ({largest / 1e6:.0f} MB) in {cons_s:.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"checkpoint_bytes": nbytes, "largest_leaf_MB": largest / 1e6, "restore_memory": rows,
                      "consolidate_peak_over_largest_leaf": (peak - base) / largest}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of save / raw disk / restore")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--memory", action="store_true", help="only restore memory, largest leaf 4x the budget")
    ap.add_argument("--compress", action="store_true", help="zstd-compressed arrays (CheckpointManager(compress=True))")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: check the script runs (figures mean nothing)")
    args = ap.parse_args()
    if args.smoke:
        args.width, args.layers, args.rounds = 16, 1, 1
    if args.memory:
        return memory_main(args)

    import statistics

    import jax
    import optax

    import zerojax as zj

    root = tempfile.mkdtemp(dir=args.dir)
    try:
        ckpt = os.path.join(root, "ckpt")
        state, saves_s, blocks = save_checkpoint(ckpt, args.width, args.layers, compress=args.compress)
        blocking = blocks[-1]
        nbytes = du(os.path.join(ckpt, str(len(saves_s))))
        target = zj.abstract_train_state(model(args.width, args.layers), optax.adamw(1e-3), mesh=zj.make_mesh(4),
                                         config=zj.ZeroConfig(stage=2, precision="bf16"))
        zj.checkpoint.restore(ckpt, target)  # compile, then time cold reads

        def save_once(step):
            mngr = manager(ckpt, args.compress)
            t = time.perf_counter()
            mngr.save(step, state)
            mngr.wait_until_finished()
            seconds = time.perf_counter() - t
            mngr.close()
            return seconds

        def restore_once():
            drop_cache(ckpt)
            t = time.perf_counter()
            restored, _ = zj.checkpoint.restore(ckpt, target)
            jax.block_until_ready(restored)
            return time.perf_counter() - t

        rounds = []  # per round: save, raw write, restore, raw read in GB/s
        for r in range(args.rounds):  # the order flips every other round: noise hits both sides alike
            step = len(saves_s) + r + 1
            if r % 2 == 0:
                save_s = save_once(step)
                disk_w, disk_r, disk_r64 = disk_speed(root, nbytes, chunked=True)
                restore_s = restore_once()
            else:
                restore_s = restore_once()
                disk_w, disk_r, disk_r64 = disk_speed(root, nbytes, chunked=True)
                save_s = save_once(step)
            rounds.append((nbytes / save_s / 1e9, disk_w, nbytes / restore_s / 1e9, disk_r, disk_r64))
        save_gbps, disk_w, restore_gbps, disk_r, disk_r64 = (statistics.median(x) for x in zip(*rounds))
        save_ratio = statistics.median(r[0] / r[1] for r in rounds)
        restore_ratio = statistics.median(r[2] / r[3] for r in rounds)
        restore_ratio64 = statistics.median(r[2] / r[4] for r in rounds)
        del state

        # the same three saves of a small state (2 layers of width 128), where the write is cheap
        # and what a save costs beyond it (a compile, before the programs were cached) shows;
        # --smoke: the state above again (its programs are compiled already)
        small_width, small_layers = (args.width, args.layers) if args.smoke else (128, 2)
        small = os.path.join(root, "small")
        _, small_s, small_b = save_checkpoint(small, small_width, small_layers, compress=args.compress)
        small_bytes = du(os.path.join(small, str(len(small_s))))

        budgets = [(name, b) for name, b in (("whole state at once", 1 << 40), ("default, 1 GiB", 0),
                                             ("256 MiB", 256 << 20), ("64 MiB", 64 << 20))
                   if not args.smoke or name.startswith("default")]
        print(f"checkpoint {nbytes / 1e6:.0f} MB (fp32 master + Adam moments, stage 3 bf16 on 8 devices"
              f"{', zstd' if args.compress else ''})")
        memory = memory_rows(ckpt, args.width, args.layers, budgets, nbytes)
        peak, cons_s = consolidate_peak(ckpt, os.path.join(root, "model.safetensors"))
        if args.smoke:  # the checkpoint is tiny already: it is its own baseline (one child process)
            base = peak
        else:
            tiny = os.path.join(root, "tiny")
            save_checkpoint(tiny, 8, 1, saves=1)
            base, _ = consolidate_peak(tiny, os.path.join(root, "tiny.safetensors"))
        largest = 4 * args.width * args.width * 4
        params_bytes = os.path.getsize(os.path.join(root, "model.safetensors"))
        figures = {
            "checkpoint_bytes": nbytes, "compress": args.compress, "rounds": rounds,
            "save_GBps": save_gbps, "save_over_disk_write": save_ratio, "save_blocking_s": blocking,
            "save_1st_s": saves_s[0], "save_3rd_s": saves_s[2], "save_3rd_over_1st": saves_s[2] / saves_s[0],
            "small_checkpoint_bytes": small_bytes, "small_save_1st_s": small_s[0], "small_save_3rd_s": small_s[2],
            "small_save_3rd_over_1st": small_s[2] / small_s[0],
            # what the training loop waits for: the call, before the asynchronous write
            "save_blocking_3rd_over_1st": blocks[2] / blocks[0], "small_save_blocking_3rd_over_1st": small_b[2] / small_b[0],
            "restore_GBps": restore_gbps, "restore_over_disk_read": restore_ratio,
            "restore_over_64MiB_reads": restore_ratio64,
            "disk_write_GBps": disk_w, "disk_read_GBps": disk_r, "disk_read_64MiB_GBps": disk_r64,
            "consolidate_s": cons_s, "consolidate_peak_minus_baseline_MB": (peak - base) / 1e6,
            "largest_leaf_MB": largest / 1e6, "params_MB": params_bytes / 1e6,
            "peak_over_largest_leaf": (peak - base) / largest,
            "restore_memory": memory,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"  save     1st {saves_s[0] * 1e3:.0f} ms (compiles)   3rd {saves_s[2] * 1e3:.0f} ms   "
          f"3rd/1st {figures['save_3rd_over_1st']:.2f} (goal <= 0.25)")
    print(f"  small state ({small_bytes / 1e6:.1f} MB, {small_layers} layer{'s' * (small_layers != 1)} "
          f"of width {small_width}): save 1st {small_s[0] * 1e3:.0f} ms   "
          f"3rd {small_s[2] * 1e3:.0f} ms   3rd/1st {figures['small_save_3rd_over_1st']:.2f} (goal <= 0.25)")
    print(f"  blocking part of the save (the loop waits; the write goes on in the background): 1st/3rd "
          f"{blocks[0] * 1e3:.0f}/{blocks[2] * 1e3:.0f} ms, 3rd/1st {figures['save_blocking_3rd_over_1st']:.2f}; "
          f"small state {small_b[0] * 1e3:.0f}/{small_b[2] * 1e3:.0f} ms, "
          f"3rd/1st {figures['small_save_blocking_3rd_over_1st']:.2f} (goal <= 0.25)")
    for k, (sv, dw, rs, dr, dr64) in enumerate(rounds):
        print(f"  round {k + 1}: save {sv:.2f} / disk write {dw:.2f} GB/s = {sv / dw:.2f}x   "
              f"restore {rs:.2f} / disk read {dr:.2f} GB/s = {rs / dr:.2f}x   "
              f"/ 64 MiB reads {dr64:.2f} GB/s = {rs / dr64:.2f}x")
    print(f"  save     {save_gbps:.2f} GB/s   disk write {disk_w:.2f} GB/s (numpy + fsync): "
          f"{save_ratio:.2f}x (median of {len(rounds)} rounds; goal >= 0.8)")
    print(f"  restore  {restore_gbps:.2f} GB/s onto 4 devices, stage 2   disk read {disk_r:.2f} GB/s: "
          f"{restore_ratio:.2f}x (goal >= 0.8); 64 MiB reads into one buffer {disk_r64:.2f} GB/s: "
          f"{restore_ratio64:.2f}x")
    print(f"consolidate {params_bytes / 1e6:.0f} MB of params in {cons_s:.1f} s: peak RSS "
          f"{(peak - base) / 1e6:.0f} MB above baseline ({base / 1e6:.0f} MB) = "
          f"{figures['peak_over_largest_leaf']:.2f}x the largest leaf ({largest / 1e6:.0f} MB; goal <= 3x)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
