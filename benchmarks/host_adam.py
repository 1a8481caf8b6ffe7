"""Parameters updated per second: HostAdamW vs jax.jit(optax.adamw) on one CPU device.

    python benchmarks/host_adam.py                 # 50M fp32 params
    python benchmarks/host_adam.py --sweep         # also block sizes, chunk sizes, threads
    python benchmarks/host_adam.py --vs-deepspeed /path/to/venv/bin/python   # and DeepSpeed's CPU Adam

Both sides update 50M fp32 params with fp32 gradients and weight decay, on the CPU
backend whatever the default backend is. The jax side is ``optax.adamw(...).update`` plus
``optax.apply_updates`` under ``jax.jit`` on one CPU device, params and optimizer state
donated; the script checks in the compiled program that every donated buffer is aliased
to its output. HostAdamW runs on ``host_zeros`` buffers (its compiled in-place path, with
all threads and with one); its numpy path (plain numpy buffers) is timed too. Runs
alternate between all candidates so background load hits them alike; figures are medians.

Bytes per second: HostAdamW moves 28 bytes per parameter (read p, g, m, v; write p, m,
v; each once). The jit baseline's traffic is what XLA's cost analysis counts for its
compiled program (40 bytes: it runs three loops). Both are printed next to the machine's
streaming bandwidth, measured in the same run: a numpy copy and a numpy in-place update
(``a += b``) over 200 MB arrays, bytes read + written per second, with one thread and
with all of them; the best of the four is the figure.

``--vs-deepspeed PYTHON``: the python of an environment with torch and deepspeed (this script
installs nothing). In the same interleaved rounds it times ``DeepSpeedCPUAdam.step()`` on the
same number of fp32 params (AdamW mode, same lr, betas, eps and weight decay) in a subprocess
of that python (``benchmarks/_ds_cpu_adam.py``, which imports only torch and deepspeed and
times each step itself), and ``zj.zero_optimizer(optax.adamw(...), offload_optimizer="cpu")``:
its jitted ``update`` on a one-device CPU mesh, gradients and state donated (as inside a
training step, where the gradients are temporaries and the state is replaced; a fresh copy
of the gradients is made before each timed call), and the loop a user writes around it:
``jax.jit`` of ``update`` and ``optax.apply_updates`` with params and state donated, the
gradients not donated (and, beside it, donated). Printed: each median and the ratio
"DeepSpeed CPU Adam time / zerojax time" (goal >= 1.0) for HostAdamW and for zero_optimizer.
DeepSpeed's C++ op is built by DeepSpeed at its first use (a compiler and ninja in that
environment); ``--ds-threads`` sets its OMP_NUM_THREADS (default: DeepSpeed's own choice), and
its OpenMP threads wait passively between steps (OMP_WAIT_POLICY=PASSIVE unless set), so they
do not spin on the cores the next candidate runs on.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax as zj
from zerojax.kernels import _native as native
from zerojax.offload._host_adam import HostAdamW
from zerojax.offload._host_buffers import host_zeros

DS_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ds_cpu_adam.py")

BYTES_PER_PARAM = 28
LR, WD = 1e-3, 0.01


def bandwidth_probes(n: int, threads: int) -> dict:
    """name -> run(): each returns the bytes it read + wrote."""
    a = np.random.default_rng(1).random(n, dtype=np.float32)
    b, c = np.ones_like(a), np.empty_like(a)
    pool = ThreadPoolExecutor(threads)

    def split(fn, k):
        cuts = [n * i // k // 16 * 16 for i in range(k)] + [n]
        list(pool.map(lambda i: fn(cuts[i], cuts[i + 1]), range(k)))

    def copy(lo, hi):
        np.copyto(c[lo:hi], a[lo:hi])

    def update(lo, hi):
        np.add(c[lo:hi], b[lo:hi], out=c[lo:hi])

    probes = {}
    for k in sorted({1, threads}):
        probes[f"copy, {k} thread{'s' * (k > 1)}"] = (lambda k=k: split(copy, k), 8 * n)
        probes[f"a += b, {k} thread{'s' * (k > 1)}"] = (lambda k=k: split(update, k), 12 * n)
    return probes


def make_jax_step(n: int):
    tx = optax.adamw(LR, weight_decay=WD)

    def step(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    cpu = jax.devices("cpu")[0]
    params = {"w": jax.device_put(np.random.default_rng(2).standard_normal(n, dtype=np.float32),
                                  cpu) + 0}
    grads = {"w": jax.device_put(np.random.default_rng(3).standard_normal(n, dtype=np.float32),
                                 cpu) + 0}
    state = [params, jax.device_put(tx.init(params), cpu)]
    fn = jax.jit(step, donate_argnums=(0, 2))
    compiled = fn.lower(state[0], grads, state[1]).compile()
    # Every donated buffer (params, mu, nu, count) must come back as its own output.
    donated = sum(x.nbytes for x in jax.tree.leaves((state[0], state[1])))
    aliased = compiled.memory_analysis().alias_size_in_bytes
    header = compiled.as_text().split("\n", 1)[0]
    pairs = re.findall(r"\{(\d+)\}: \((\d+), \{\}", header)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    info = {"aliased": aliased, "donated": donated, "pairs": pairs,
            "bytes_per_param": cost["bytes accessed"] / n}

    def run():
        state[0], state[1] = compiled(state[0], grads, state[1])
        jax.block_until_ready(state)

    run()
    return run, info


def make_host_step(opt: HostAdamW, n: int, grad_dtype=np.float32, out16=False, host=True):
    rng = np.random.default_rng(4)
    alloc = host_zeros if host else (lambda k, dt=np.float32: np.zeros(k, dt))
    p, m, v = alloc(n), alloc(n), alloc(n)
    p[:] = rng.standard_normal(n, dtype=np.float32)
    g = alloc(n, grad_dtype)
    g[:] = rng.standard_normal(n, dtype=np.float32).astype(grad_dtype)
    o16 = alloc(n, jnp.bfloat16) if out16 else None
    count = [0]

    def run():
        count[0] += 1
        opt.step(p, g, m, v, count[0], out16=o16)

    run()  # compile, fault in pages
    return run


class DeepSpeedStep:
    """DeepSpeed's CPU Adam in a subprocess of another python; each call runs one step there
    and returns the (wall, CPU) seconds the child measured around ``optimizer.step()``."""

    def __init__(self, python: str, n: int, threads: int | None = None):
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        # GNU OpenMP's threads otherwise spin after each step and slow whatever runs next on
        # the same cores (measured: about 15% on the next candidate; DeepSpeed's own step is
        # not slower with passive waiting)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.proc = subprocess.Popen(
            [python, DS_DRIVER, "--n", str(n), "--lr", str(LR), "--weight-decay", str(WD)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self._reply("ready")
        if line is None:
            raise RuntimeError(f"{DS_DRIVER} under {python} did not start (exit code {self.proc.wait()}); "
                               "run it by hand to see why (it needs torch and deepspeed there)")
        self.threads, self.versions = line[1], f"torch {line[2]}, deepspeed {line[3]}"

    def _reply(self, first=None):
        """The child's next protocol line, split (its libraries may log to stdout as well)."""
        for text in self.proc.stdout:
            words = text.split()
            if first is not None and words and words[0] == first:
                return words
            if first is None and len(words) == 2 and all(w.replace(".", "", 1).isdigit() for w in words):
                return words
        return None

    def __call__(self):
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if reply is None:
            raise RuntimeError(f"DeepSpeed's step stopped (exit code {self.proc.wait()})")
        return float(reply[0]), float(reply[1])

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def make_zero_optimizer_step(n: int):
    """zj.zero_optimizer(optax.adamw, offload_optimizer="cpu") on a one-device CPU mesh: the jitted
    update of n fp32 params, gradients and state donated; each call times one update."""
    cpu = jax.devices("cpu")[0]
    mesh = zj.make_mesh(1, devices=[cpu])
    tx = zj.zero_optimizer(optax.adamw(LR, weight_decay=WD), mesh=mesh,
                           config=zj.ZeroConfig(stage=1, offload_optimizer="cpu"))
    rng = np.random.default_rng(5)
    params = {"w": jax.device_put(rng.standard_normal(n, dtype=np.float32), cpu) + 0}
    grads = {"w": jax.device_put(rng.standard_normal(n, dtype=np.float32), cpu) + 0}
    state = [tx.init(params)]
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state[0])}
    update = jax.jit(tx.update, donate_argnums=(0, 1))

    def run():
        g = jax.tree.map(lambda x: x + 0, grads)  # the donated gradients: a fresh copy, not timed
        jax.block_until_ready(g)
        w, c = time.perf_counter(), time.process_time()
        u, state[0] = update(g, state[0], params)
        jax.block_until_ready((u, state[0]))
        return time.perf_counter() - w, time.process_time() - c

    run()  # compile
    return run, kinds


def make_zero_optimizer_loop(n: int, donate_grads: bool):
    """The loop a user writes around zj.zero_optimizer(optax.adamw, offload_optimizer="cpu") on a
    one-device CPU mesh: ``jax.jit`` of ``tx.update`` and ``optax.apply_updates``, params and state
    donated, the gradients donated or not; each call times one step."""
    cpu = jax.devices("cpu")[0]
    mesh = zj.make_mesh(1, devices=[cpu])
    tx = zj.zero_optimizer(optax.adamw(LR, weight_decay=WD), mesh=mesh,
                           config=zj.ZeroConfig(stage=1, offload_optimizer="cpu"))
    rng = np.random.default_rng(6)
    carry = [{"w": jax.device_put(rng.standard_normal(n, dtype=np.float32), cpu) + 0}]
    grads = {"w": jax.device_put(rng.standard_normal(n, dtype=np.float32), cpu) + 0}
    carry.append(tx.init(carry[0]))

    def step(params, state, g):
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    fn = jax.jit(step, donate_argnums=(0, 1, 2) if donate_grads else (0, 1))

    def run():
        g = jax.tree.map(lambda x: x + 0, grads) if donate_grads else grads  # not timed
        jax.block_until_ready(g)
        w, c = time.perf_counter(), time.process_time()
        carry[0], carry[1] = fn(carry[0], carry[1], g)
        jax.block_until_ready(carry)
        return time.perf_counter() - w, time.process_time() - c

    run()  # compile
    return run


def timed(fn):
    """(wall seconds, CPU seconds of the whole process) of one call; a call that times itself
    returns that pair."""
    w, c = time.perf_counter(), time.process_time()
    own = fn()
    if own is not None:
        return own
    return time.perf_counter() - w, time.process_time() - c


def interleaved(cands: dict, reps: int) -> dict:
    out = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            out[k].append(timed(fn))
    return {k: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
            for k, t in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000_000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block", type=int, default=32768)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--vs-deepspeed", metavar="PYTHON", default=None,
                    help="python of an environment with torch and deepspeed: time DeepSpeedCPUAdam too")
    ap.add_argument("--ds-threads", type=int, default=None, help="OMP_NUM_THREADS for DeepSpeed's step")
    args = ap.parse_args()
    n = args.n

    opt = HostAdamW(LR, weight_decay=WD, num_threads=args.threads, block_elements=args.block)
    print(f"params: {n:,} fp32   HostAdamW native kernel: {native.available()}   block: {opt.block_elements}   threads: "
          f"{opt.num_threads}   jax {jax.__version__} on {jax.devices('cpu')[0]}   load average: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.sweep:
        for block in (8192, 16384, 32768, 65536, 262144):
            with HostAdamW(LR, weight_decay=WD, num_threads=1, block_elements=block) as o:
                w, _ = interleaved({"x": make_host_step(o, n)}, 5)["x"]
            print(f"  sweep compiled (XLA alone) block={block:8d}: {n / w / 1e6:8.1f} M params/s")
        for threads in sorted({1, opt.num_threads}):
            for chunk in (16384, 65536, 262144):
                with HostAdamW(LR, weight_decay=WD, num_threads=threads,
                               chunk_elements=chunk) as o:
                    w, _ = interleaved({"x": make_host_step(o, n, host=False)}, 5)["x"]
                print(f"  sweep numpy threads={threads:2d} chunk={chunk:7d}: "
                      f"{n / w / 1e6:8.1f} M params/s")

    jax_run, info = make_jax_step(n)
    probes = bandwidth_probes(n, opt.num_threads)
    loop = HostAdamW(LR, weight_decay=WD, num_threads=args.threads, block_elements=args.block, native=False)
    solo = HostAdamW(LR, weight_decay=WD, num_threads=1, block_elements=args.block, native=False)
    cands = {"host": make_host_step(opt, n), "jax": jax_run, "xla loop": make_host_step(loop, n),
             "numpy": make_host_step(opt, n, host=False), "xla only": make_host_step(solo, n)}
    cands.update({k: fn for k, (fn, _) in probes.items()})
    ds = None
    if args.vs_deepspeed:
        ds = DeepSpeedStep(args.vs_deepspeed, n, args.ds_threads)
        cands["deepspeed"] = ds
        cands["zero_optimizer"], zo_kinds = make_zero_optimizer_step(n)
        cands["user loop"] = make_zero_optimizer_loop(n, donate_grads=False)
        cands["user loop, grads donated"] = make_zero_optimizer_loop(n, donate_grads=True)
    res = interleaved(cands, args.reps)

    bw = {k: nbytes / res[k][0] for k, (_, nbytes) in probes.items()}
    best = max(bw, key=bw.get)
    rate = {k: n / res[k][0] for k in ("host", "jax", "xla loop", "numpy", "xla only")}
    ok = info["aliased"] == info["donated"] and len(info["pairs"]) == 4
    print(f"jit baseline: donated {info['donated'] / 1e6:.0f} MB, aliased to outputs "
          f"{info['aliased'] / 1e6:.0f} MB ({'all' if ok else 'NOT all'}; output<-param "
          f"{', '.join(f'{o}<-{i}' for o, i in info['pairs'])}); XLA counts "
          f"{info['bytes_per_param']:.1f} bytes moved per param")
    print("streaming bandwidth (bytes read + written): "
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items())
          + f" GB/s -> {bw[best] / 1e9:.1f} GB/s")
    for key, label in (("host", "HostAdamW (host_zeros)"), ("jax", "jax.jit(optax.adamw)  "),
                       ("xla loop", "  ... native=False     "), ("xla only", "  ... native=False, 1 thread"),
                       ("numpy", "HostAdamW (numpy bufs)")):
        line = (f"{label}: {rate[key] / 1e6:8.1f} M params/s  "
                f"{rate[key] * BYTES_PER_PARAM / 1e9:6.2f} GB/s at {BYTES_PER_PARAM} B/param")
        if key == "jax":
            line += (f"  ({rate[key] * info['bytes_per_param'] / 1e9:.2f} GB/s at its "
                     f"{info['bytes_per_param']:.0f} B/param)")
        print(line + f"  ({res[key][0] * 1e3:.1f} ms/step)")
    bound = info["bytes_per_param"] / BYTES_PER_PARAM
    print(f"ratio HostAdamW / jax: {rate['host'] / rate['jax']:.2f}x   (goal >= 1.5x; at equal "
          f"bandwidth the byte counts allow {bound:.2f}x)   numpy path / jax: "
          f"{rate['numpy'] / rate['jax']:.2f}x")
    split = loop._split
    print("HostAdamW(native=False)'s split between XLA (one core) and numpy threads: last rates "
          + ", ".join(f"{name} {split.rate[k] / 1e6:.0f} M params/s" for k, name in
                      ((False, "XLA alone"), (True, "split")) if split.rate[k])
          + f"; numpy share when split {split.fraction:.2f}")
    print(f"bandwidth used: HostAdamW {rate['host'] * BYTES_PER_PARAM / bw[best]:.0%}, jax "
          f"{rate['jax'] * info['bytes_per_param'] / bw[best]:.0%} of the streaming figure")
    print("per CPU-second (robust to other load): "
          + ", ".join(f"{k} {n / res[k][1] / 1e6:.0f} M params" for k in rate)
          + "; cores busy during a step: "
          + ", ".join(f"{k} {res[k][1] / res[k][0]:.2f}" for k in rate))

    if ds is not None:
        ds.close()
        dsw, dsc = res["deepspeed"]
        print(f"DeepSpeed CPU Adam ({ds.versions}, OMP threads {ds.threads}): {dsw * 1e3:.1f} ms/step  "
              f"{n / dsw / 1e6:.1f} M params/s  ({n / dsc / 1e6:.0f} M params per CPU-second)")
        for key, label in (("host", "HostAdamW (host_zeros)"),
                           ("zero_optimizer", "zero_optimizer offload_optimizer='cpu', jitted update"),
                           ("user loop", "zero_optimizer in jit(update + apply_updates), grads not donated"),
                           ("user loop, grads donated", "  ... the same, grads donated")):
            w, c = res[key]
            print(f"{label}: {w * 1e3:.1f} ms/step  {n / w / 1e6:.1f} M params/s  "
                  f"({n / c / 1e6:.0f} M params per CPU-second)   "
                  f"DeepSpeed CPU Adam time / zerojax time: {dsw / w:.2f} (goal >= 1.0); per CPU-second "
                  f"{dsc / c:.2f}")
        print(f"  (zero_optimizer's stored state is in {', '.join(sorted(zo_kinds))} memory)")

    variants = {"bf16 grads + bf16 out16 (28 B/param)": make_host_step(opt, n, jnp.bfloat16, True),
                "fp32 grads + bf16 out16 (30 B/param)": make_host_step(opt, n, np.float32, True)}
    for label, (w, _) in interleaved(variants, 5).items():
        nbytes = 28 if label.startswith("bf16") else 30
        print(f"HostAdamW {label}: {n / w / 1e6:8.1f} M params/s  {n * nbytes / w / 1e9:6.2f} GB/s")
    for o in (opt, loop, solo):
        o.close()


if __name__ == "__main__":
    main()
