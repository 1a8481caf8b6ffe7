"""Parameters updated per second: HostAdamW vs jax.jit(optax.adamw) on one CPU device.

    python benchmarks/host_adam.py                 # 50M fp32 params
    python benchmarks/host_adam.py --sweep         # also try chunk sizes and thread counts

Both sides update 50M fp32 params with weight decay; the jax side donates params and
optimizer state (its output tree is exactly its donated input tree, so every donated
buffer is reused). Runs alternate between the two so background load hits both alike;
the figure is the median of the repetitions. Bytes per second count the 28 bytes a
single pass must move per parameter (read p, g, m, v; write p, m, v) and are printed
next to this machine's streaming bandwidth, measured in the same run with a
multi-threaded numpy copy (bytes read + written per second).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from zerojax.offload.host_adam import HostAdamW  # noqa: E402

BYTES_PER_PARAM = 28
LR, WD = 1e-3, 0.01


def copy_bandwidth(n: int, opt: HostAdamW) -> float:
    """Bytes read + written per second by a copy split across the optimizer's threads."""
    src = np.random.default_rng(1).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    k = opt.num_threads
    cuts = [n * i // k for i in range(k + 1)]

    def part(i):
        np.copyto(dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]])

    pool = opt._pool  # reuse the same threads the optimizer runs on
    times = []
    for _ in range(6):
        t = time.perf_counter()
        if pool is None:
            part(0)
        else:
            list(pool.map(part, range(k)))
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / statistics.median(times[1:])


def make_jax_step(n: int):
    tx = optax.adamw(LR, weight_decay=WD)

    def step(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    fn = jax.jit(step, donate_argnums=(0, 2))
    params = {"w": jnp.asarray(np.random.default_rng(2).standard_normal(n, dtype=np.float32))}
    grads = {"w": jnp.asarray(np.random.default_rng(3).standard_normal(n, dtype=np.float32))}
    state = [params, tx.init(params)]

    def run():
        state[0], state[1] = fn(state[0], grads, state[1])
        jax.block_until_ready(state)

    run()  # compile
    return run


def time_host(opt: HostAdamW, n: int, grad_dtype=np.float32, out16=False):
    rng = np.random.default_rng(4)
    p = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32).astype(grad_dtype)
    m, v = np.zeros_like(p), np.zeros_like(p)
    o16 = np.empty(n, jnp.bfloat16) if out16 else None
    count = [0]

    def run():
        count[0] += 1
        opt.step(p, g, m, v, count[0], out16=o16)

    run()  # fault in pages
    return run


def median_time(fn, reps: int) -> float:
    return statistics.median(timed(fn)[0] for _ in range(reps))


def timed(fn):
    """(wall seconds, CPU seconds of the whole process) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000_000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    n = args.n

    opt = HostAdamW(LR, weight_decay=WD, num_threads=args.threads, chunk_elements=args.chunk)
    print(f"params: {n:,} fp32   host threads: {opt.num_threads}   chunk: {opt.chunk_elements}"
          f"   jax {jax.__version__} on {jax.devices()[0]}   load average: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.sweep:
        for threads in sorted({1, 2, opt.num_threads, 2 * opt.num_threads}):
            for chunk in (16384, 32768, 65536, 131072, 262144):
                with HostAdamW(LR, weight_decay=WD, num_threads=threads,
                               chunk_elements=chunk) as o:
                    t = median_time(time_host(o, n), 5)
                print(f"  sweep threads={threads:2d} chunk={chunk:7d}: {n / t / 1e6:8.1f} M params/s")

    bw = copy_bandwidth(n, opt)
    host, xla = time_host(opt, n), make_jax_step(n)
    t_host, t_jax = [], []
    for _ in range(args.reps):  # interleaved so background load hits both alike
        t_host.append(timed(host))
        t_jax.append(timed(xla))
    th, tj = (statistics.median(w for w, _ in t) for t in (t_host, t_jax))
    ch, cj = (statistics.median(c for _, c in t) for t in (t_host, t_jax))
    host_rate, jax_rate = n / th, n / tj
    print(f"streaming bandwidth (numpy copy, {opt.num_threads} threads): {bw / 1e9:7.2f} GB/s")
    print(f"HostAdamW            : {host_rate / 1e6:8.1f} M params/s   "
          f"{host_rate * BYTES_PER_PARAM / 1e9:6.2f} GB/s  ({th * 1e3:.1f} ms/step)")
    print(f"jax.jit(optax.adamw) : {jax_rate / 1e6:8.1f} M params/s   "
          f"{jax_rate * BYTES_PER_PARAM / 1e9:6.2f} GB/s  ({tj * 1e3:.1f} ms/step)")
    print(f"ratio HostAdamW / jax: {host_rate / jax_rate:.2f}x   (goal >= 1.5x)")
    print(f"per CPU-second (robust to other load): HostAdamW {n / ch / 1e6:.1f} M params, "
          f"jax {n / cj / 1e6:.1f} M params; cores busy during a step: HostAdamW "
          f"{ch / th:.2f}, jax {cj / tj:.2f}")

    for label, gdt, o16 in [("bf16 grads + bf16 out16", jnp.bfloat16, True),
                            ("fp32 grads + bf16 out16", np.float32, True)]:
        t = median_time(time_host(opt, n, gdt, o16), 5)
        print(f"HostAdamW {label}: {n / t / 1e6:8.1f} M params/s")
    opt.close()


if __name__ == "__main__":
    main()
