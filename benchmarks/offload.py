"""Optimizer and param offload: device and host bytes per device against ZeRO-Offload's
expectation, and the step time of offload relative to keeping everything on the device.

Memory (GPT-2-small shape, bf16, 8 simulated devices, states really built and measured
with zj.memory_report): with optimizer offload only the 16-bit params stay on the device,
2Ψ in stages 1–2 and 2Ψ/N in stage 3; the fp32 master and Adam moments (12Ψ/N) are on the
host. With param offload too (stage 3) nothing persistent stays on the device.

Step time (a smaller GPT, bf16, same batch for every row): on this machine "device" and
"host" are the same CPU, so the ratio measures the cost of the host update and the
transfers' bookkeeping, not PCIe.

    python benchmarks/offload.py [--steps 5] [--skip-memory] [--skip-time]
    python benchmarks/offload.py --skip-memory --skip-time --optimizer-bound   # goal <= 1.10x

Optimizer-bound (``--optimizer-bound``): one device, 50M fp32 params in 4096-wide rows and a
loss that costs next to nothing (benchmarks/vs_plain_jax.py's optimizer-bound model), so the
update dominates: make_train_step at stage 1 with offload_optimizer="cpu" against the same
step without offload, in interleaved rounds (medians); goal: offload <= 1.10x.
"""
import argparse
import gc
import time

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPT2_SMALL, GPTConfig, init_params, loss_fn  # noqa: E402

CASES = [  # (stage, offload_optimizer, offload_param)
    (1, None, None), (1, "cpu", None),
    (2, None, None), (2, "cpu", None),
    (3, None, None), (3, "cpu", None), (3, "cpu", "cpu"),
]
HOST = "pinned_host"


def expected(stage, opt, param, psi, n):
    """(device bytes, host bytes) per device for bf16 params and an fp32 AdamW state."""
    params = 2 * psi / n if stage == 3 else 2 * psi
    states = 12 * psi / n  # fp32 master + two moments, partitioned from stage 1
    device = (0 if param else params) + (0 if opt else states)
    host = (params if param else 0) + (states if opt else 0)
    return device, host


def label(stage, opt, param):
    return f"stage {stage} " + ("+ optimizer and params on host" if param else "+ optimizer on host" if opt
                                else "on device")


TOLERANCE = 0.01  # measured within 1% of the expectation, either side


def memory(cfg, mesh):
    n, psi = mesh.shape["data"], cfg.n_params
    print(f"GPT-2 small, {psi:,} params, bf16, {n} devices: stored bytes per device (max over devices)")
    print(f"{'case':<42} {'device MiB':>10} {'expected':>9} {'ratio':>7}   {'host MiB':>9} {'expected':>9} {'ratio':>7}")
    ratios, strays = [], []
    for stage, opt, param in CASES:
        config = zj.ZeroConfig(stage=stage, precision="bf16", offload_optimizer=opt, offload_param=param,
                               param_persistence_threshold=0)
        state = zj.shard_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-4), mesh=mesh, config=config)
        report = zj.memory_report(state)
        # model states only: the step counter, key and loss scaler are a few bytes
        dev = sum(kinds.get("device", 0) for part, kinds in report.by_part.items() if part != "other")
        host = sum(kinds.get(HOST, 0) for kinds in report.by_part.values())
        want_dev, want_host = expected(stage, opt, param, psi, n)

        def ratio(got, want):
            return "-" if want == 0 else f"{got / want:.4f}"

        for got, want in ((dev, want_dev), (host, want_host)):
            if want:
                ratios.append(got / want)
            elif got > TOLERANCE * (want_dev + want_host):  # nothing expected there: at most 1% of the row
                strays.append(f"{label(stage, opt, param)}: {got / 2**20:.2f} MiB where none is expected")
        print(f"{label(stage, opt, param):<42} {dev / 2**20:>10.2f} {want_dev / 2**20:>9.2f} {ratio(dev, want_dev):>7}"
              f"   {host / 2**20:>9.2f} {want_host / 2**20:>9.2f} {ratio(host, want_host):>7}", flush=True)
        del state
        gc.collect()
    lo, hi = min(ratios), max(ratios)
    ok = 1 - TOLERANCE <= lo and hi <= 1 + TOLERANCE and not strays
    print(f"measured/expected from {lo:.4f} to {hi:.4f} (goal: within [{1 - TOLERANCE:.2f}, {1 + TOLERANCE:.2f}], and "
          f"at most 1% of a row's expected bytes where nothing is expected) -> {'met' if ok else 'NOT met'}")
    for line in strays:
        print("  " + line)


def step_time(steps: int, mesh):
    cfg = GPTConfig(vocab=4096, n_layer=4, d_model=256, n_head=8, seq_len=128)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab, (16, cfg.seq_len + 1)).astype(np.int32)}
    print(f"\nstep time, GPT {cfg.n_params / 1e6:.1f}M params, bf16, batch 16 x {cfg.seq_len}, {steps} timed steps")
    base = {}
    for stage, opt, param in CASES:
        config = zj.ZeroConfig(stage=stage, precision="bf16", offload_optimizer=opt, offload_param=param)
        state = zj.shard_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-4), mesh=mesh, config=config)
        step = zj.make_train_step(loss_fn(cfg), state)
        state, m = step(state, batch)  # compile
        jax.block_until_ready(m["loss"])
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready((state.params, m["loss"]))
            times.append(time.perf_counter() - t)
        ms = 1e3 * float(np.median(times))
        if opt is None:
            base[stage] = ms
        print(f"{label(stage, opt, param):<42} {ms:>8.1f} ms/step   {ms / base[stage]:.2f}x of stage {stage} on device",
              flush=True)
        del state, step
        gc.collect()


def optimizer_bound(args):
    """One device, ~50M fp32 params, a cheap loss: make_train_step with and without optimizer offload."""
    mesh = zj.make_mesh(1)
    n_params = args.opt_params
    widths = [4096] * (n_params // 4096 // 4096) + [n_params % (4096 * 4096) // 4096 or 1]
    key = jax.random.PRNGKey(0)

    def init(_):
        return {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (rows, 4096)) * 0.02
                for i, rows in enumerate(widths)}

    def loss(params, batch):
        return sum(jnp.vdot(p[0], batch["x"][0]) for p in params.values()) / len(params)

    batch = {"x": np.ones((1, 4096), np.float32)}
    steps = {}
    for name, opt in (("device", None), ("offload", "cpu")):
        config = zj.ZeroConfig(stage=1, offload_optimizer=opt)
        state = zj.shard_train_state(init, optax.adamw(1e-4, weight_decay=0.01), mesh=mesh, config=config)
        steps[name] = [zj.make_train_step(loss, state), state]
    for entry in steps.values():  # compile, warm up
        entry[1], m = entry[0](entry[1], batch)
        jax.block_until_ready((entry[1].params, m["loss"]))
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, entry in steps.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                entry[1], m = entry[0](entry[1], batch)
            jax.block_until_ready((entry[1].params, entry[1].opt_state, m["loss"]))
            times[name].append((time.perf_counter() - t) / args.steps)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    total = sum(r * 4096 for r in widths)
    ratio = ms["offload"] / ms["device"]
    print(f"\noptimizer-bound: one device, {total / 1e6:.1f}M fp32 params, AdamW, stage 1: "
          f"device {ms['device']:.1f} ms/step, offload_optimizer='cpu' {ms['offload']:.1f} ms/step -> "
          f"{ratio:.2f}x (goal <= 1.10x) {'ok' if ratio <= 1.10 else 'MISSED'}")
    return ratio


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--optimizer-bound", action="store_true",
                    help="one device, 50M fp32 params: offload_optimizer='cpu' against no offload")
    ap.add_argument("--opt-params", type=int, default=50 * 2**20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    mesh = zj.make_mesh()
    if not args.skip_memory:
        memory(GPT2_SMALL, mesh)
    if not args.skip_time:
        step_time(args.steps, mesh)
    if args.optimizer_bound:
        optimizer_bound(args)


if __name__ == "__main__":
    main()
