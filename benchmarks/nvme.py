"""NVMe optimizer store: peak host memory stays below the state size; step throughput.

    python benchmarks/nvme.py --dir /nvme/scratch            # 50M params, 600 MB of state
    python benchmarks/nvme.py --n 200000000 --sub-group 8388608

The store keeps fp32 master, m and v (12 bytes per parameter) in files and streams
them through three sub-group buffers. After ``init`` the peak resident set size is reset
(/proc/self/clear_refs, checked to have taken effect) and the growth of the peak over the
steps is reported next to the state size; where the kernel's peak cannot be reset, the growth
is that of the RSS sampled every millisecond during the steps (and the report says so); gradients and the 16-bit params output are allocated before the reset,
as they live in host memory in ZeRO-Infinity anyway. Throughput counts the state read
and written per step (24 bytes per parameter). When the state fits in RAM the reads may
be served from the page cache; ``--drop-page-cache`` (default on) asks the kernel to evict
the pages after use, but only a state larger than RAM measures the drive alone.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import jax.numpy as jnp
import numpy as np

from zerojax.offload._host_adam import HostAdamW
from zerojax.offload._nvme import NvmeOptimizerStore


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; True only when it really did."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # a kernel that accepts the write but keeps the old peak has not reset it
    return status_kib("VmHWM") <= status_kib("VmRSS") + 1024


class RssSampler:
    """The largest resident set size seen by polling /proc/self/statm every ``interval`` seconds
    (a spike shorter than the interval can be missed)."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.peak = interval, 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000_000)
    ap.add_argument("--sub-group", type=int, default=2_000_000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the drive (default: a temp dir)")
    ap.add_argument("--no-fsync", action="store_true")
    ap.add_argument("--keep-page-cache", action="store_true")
    args = ap.parse_args()
    n, state_bytes = args.n, 12 * args.n
    root = tempfile.mkdtemp(prefix="zerojax-nvme-", dir=args.dir)
    print(f"params: {n:,}   state: {state_bytes / 2**20:.0f} MiB (x2 slots on disk)   "
          f"sub_group_size: {args.sub_group:,}   dir: {root}   fsync: {not args.no_fsync}")
    try:
        rng = np.random.default_rng(0)
        grads = (rng.standard_normal(n, dtype=np.float32) * 1e-2).astype(jnp.bfloat16)
        out16 = np.zeros(n, jnp.bfloat16)
        opt = HostAdamW(lr=1e-4, weight_decay=0.01)
        store = NvmeOptimizerStore(root, n, args.sub_group, optimizer=opt,
                                   fsync=not args.no_fsync,
                                   drop_page_cache=not args.keep_page_cache)
        params = rng.standard_normal(n, dtype=np.float32)
        t = time.perf_counter()
        store.init(params)
        print(f"init: {time.perf_counter() - t:.2f} s")
        del params  # the full fp32 params only exist before init

        reset_ok = reset_peak_rss()
        base_rss = status_kib("VmRSS") * 1024
        times = []
        with RssSampler() as sampler:
            for k in range(args.steps):
                t = time.perf_counter()
                store.step(grads, count=k + 1, out16=out16)
                times.append(time.perf_counter() - t)
        sampled = sampler.peak - base_rss
        # the kernel's peak when it could be reset; otherwise the sampled one (the old peak,
        # from before the steps, says nothing about them)
        growth = status_kib("VmHWM") * 1024 - base_rss if reset_ok else sampled
        how = ("kernel peak (VmHWM) after a reset" if reset_ok else
               "sampled every 1 ms: the kernel's peak could not be reset, a shorter spike may be missed")
        best = min(times)
        print(f"step times: {', '.join(f'{x:.2f}' for x in times)} s")
        print(f"NVMe step throughput: {n / best / 1e6:8.1f} M params/s   "
              f"state I/O {24 * n / best / 1e9:6.2f} GB/s (read + write)")
        print(f"peak RSS growth during steps: {growth / 2**20:8.1f} MiB   "
              f"(state size {state_bytes / 2**20:.0f} MiB, ratio {growth / state_bytes:.2f}; {how}; "
              f"sampled peak growth {sampled / 2**20:.1f} MiB)")
        print(f"expected host buffers: {3 * 12 * args.sub_group / 2**20:.0f} MiB (3 sub-group "
              f"buffers) + HostAdamW scratch")
        print(f"peak RSS below state size: {growth < state_bytes}")

        p, m, v = store.read("master"), store.read("m"), store.read("v")
        opt.step(p, grads, m, v, count=args.steps + 1)  # first touch of the pages
        t = time.perf_counter()
        opt.step(p, grads, m, v, count=args.steps + 2)
        print(f"in-memory HostAdamW for comparison: {n / (time.perf_counter() - t) / 1e6:8.1f} "
              "M params/s")
        store.close()
        opt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
