"""Achieved bandwidth of the fused AdamW kernel as a fraction of the device's copy bandwidth.

    python benchmarks/fused_adam.py            # GPU: 256M params; CPU: small, interpret mode
    python benchmarks/fused_adam.py --sweep    # also try block sizes and warp counts

Bytes moved per parameter: read master, m, v (fp32) and the gradient, write master, m,
v and the 16-bit params (28 bytes with bf16 grads). The copy bandwidth is measured in
the same run by a jitted copy of an fp32 buffer with as many elements (bytes read +
written per second). The same step through ``jax.jit(optax.adamw)`` is timed too.
Goal on an H200: fused / copy >= 0.85. On CPU the kernel runs in Pallas interpret mode,
so the figure says nothing about the kernel; it only checks that the script runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from zerojax.kernels._fused_adam import fused_adamw

LR, WD = 1e-3, 0.01


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(n: int, reps: int) -> float:
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(jnp.copy)
    return 2 * 4 * n / median_time(lambda: copy(x).block_until_ready(), reps)


def time_fused(n: int, grad_dtype, reps: int, **kw) -> float:
    key = jax.random.key(0)
    state = [jax.random.normal(key, (n,), jnp.float32), jnp.zeros((n,), jnp.float32),
             jnp.zeros((n,), jnp.float32)]
    grads = (jax.random.normal(jax.random.key(1), (n,), jnp.float32) * 1e-2).astype(grad_dtype)
    count = [0]

    def run():
        count[0] += 1
        out = fused_adamw(*state, grads, count[0], LR, weight_decay=WD, **kw)
        state[:] = out[:3]
        jax.block_until_ready(out)

    return median_time(run, reps)


def time_optax(n: int, grad_dtype, reps: int) -> float:
    tx = optax.adamw(LR, weight_decay=WD)

    def step(params, grads, opt_state):
        updates, opt_state = tx.update(grads.astype(jnp.float32), opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, params.astype(jnp.bfloat16)

    fn = jax.jit(step, donate_argnums=(0, 2))
    params = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    grads = jnp.ones((n,), grad_dtype)
    state = [params, tx.init(params)]

    def run():
        state[0], state[1], p16 = fn(state[0], grads, state[1])
        jax.block_until_ready(p16)

    return median_time(run, reps)


def main():
    on_cpu = jax.default_backend() == "cpu"
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=(1 << 16) if on_cpu else (1 << 28))
    ap.add_argument("--reps", type=int, default=3 if on_cpu else 20)
    ap.add_argument("--block-size", type=int, default=4096)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    n, gdt = args.n, jnp.bfloat16
    bytes_moved = n * (3 * 4 + jnp.dtype(gdt).itemsize + 3 * 4 + 2)

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})   jax {jax.__version__}"
          f"   params: {n:,}   grads: {jnp.dtype(gdt).name}   bytes/param: {bytes_moved // n}")
    if on_cpu:
        print("NOTE: CPU backend: the kernel runs in Pallas interpret mode; the bandwidth "
              "fraction below is only meaningful on a GPU.")
    copy_bw = copy_bandwidth(n, args.reps)
    print(f"copy bandwidth (jitted copy of {n:,} fp32): {copy_bw / 1e9:9.1f} GB/s")

    if args.sweep and not on_cpu:
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                t = time_fused(n, gdt, args.reps, block_size=block, num_warps=warps)
                bw = bytes_moved / t
                print(f"  sweep block_size={block:6d} num_warps={warps:2d}: {bw / 1e9:8.1f} GB/s"
                      f"  ({bw / copy_bw:.3f} of copy)")

    t = time_fused(n, gdt, args.reps, block_size=args.block_size, num_warps=args.num_warps)
    bw = bytes_moved / t
    print(f"fused_adamw (block_size={args.block_size}, num_warps={args.num_warps}): "
          f"{bw / 1e9:9.1f} GB/s   {n / t / 1e9:7.2f} G params/s   {t * 1e3:8.2f} ms/step")
    print(f"fused / copy bandwidth: {bw / copy_bw:.3f}   (goal on H200 >= 0.85)")
    to = time_optax(n, gdt, args.reps)
    print(f"jax.jit(optax.adamw)+bf16 cast: {n / to / 1e9:7.2f} G params/s   {to * 1e3:8.2f} ms/step"
          f"   fused speed-up: {to / t:.2f}x")


if __name__ == "__main__":
    main()
