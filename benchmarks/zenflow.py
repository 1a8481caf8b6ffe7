"""ZenFlow against plain optimizer offload: average step time and host<->device bytes per step.

Same model, batch and AdamW settings, side by side in one run (8 simulated devices, stage 2,
bf16). The model is a wide MLP with a small batch: the regime ZenFlow is for, where the
optimizer update, not the forward/backward, dominates a step (7B-parameter fine-tuning with
offload: 0.5 s of compute, 7 s of host AdamW). Plain offload (ZeRO-Offload) sends every 16-bit gradient to the host and every updated
16-bit param back, every step, and the device waits for the host's AdamW. ZenFlow updates the
top-k input rows of each 2-D weight on the device every step and hands the host the rest,
every ``update_interval`` steps, overlapped with the device's next interval.

Bytes: both counted the same way, from the arrays each moves and how often, over the timed
steps (all devices together): plain offload moves every param's 16-bit gradient down and its
16-bit value back up every step; ZenFlow moves the 2-D weights' 16-bit gradients down every
step, their 16-bit values up per host update and down per reselection (the step's own event
counts). Cross-checks printed beside them: for plain offload the operands and results of the
compiled step's host computation, for ZenFlow its byte counters.

On this machine the "device" and the host are the same two CPU cores, so overlap buys less
than on a GPU; the device idle fraction is reported only where a GPU is present.

    python benchmarks/zenflow.py [--steps 16] [--intervals 4 8] [--devices 8]
"""
import argparse
import re
import time

import sys

from _common import simulate_devices

# --devices N (read before jax starts): 1 isolates the optimizer's cost from the collectives
simulate_devices(int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402

WIDTH, LAYERS = 2048, 4


def init_mlp(key):
    keys = jax.random.split(key, LAYERS)
    return {f"layer{i}": {"w": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH), "b": jnp.zeros((WIDTH,))}
            for i, k in enumerate(keys)}


def mlp_loss(params, batch):
    x = batch["x"]
    for i in range(LAYERS):
        p = params[f"layer{i}"]
        x = jnp.tanh(x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype))
    return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)

_TENSOR = re.compile(r"tensor<([0-9x]*)x?(bf16|f16|f32)>")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4}


def _tensor_bytes(text: str) -> int:
    total = 0
    for dims, dt in _TENSOR.findall(text):
        total += int(np.prod([int(d) for d in dims.split("x") if d] or [1])) * _BYTES[dt]
    return total


def host_call_bytes(step, state, batch) -> tuple:
    """(bytes to the host, bytes back) of the compiled step's host update, from its signature."""
    text = step.lower(state, batch).as_text()
    call = next(line for line in text.splitlines() if "call @host_apply(" in line)
    ins, outs = call.split(" : (", 1)[1].split(") -> ", 1)
    n = len(state.plan.leaves)
    in_types = _TENSOR.findall(ins)[:n]  # the gradients; the master and moments already live there
    out_types = _TENSOR.findall(outs)[:n]  # the updated 16-bit params
    down = sum(_tensor_bytes(f"tensor<{d}x{t}>") for d, t in in_types)
    up = sum(_tensor_bytes(f"tensor<{d}x{t}>") for d, t in out_types)
    return down, up


def leaf_bytes(shapes, dtype) -> int:
    """Bytes of these leaves (shape-bearing objects) in ``dtype``."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(dtype).itemsize for x in jax.tree_util.tree_leaves(shapes))


def run(batches, zenflow, steps):
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4, weight_decay=0.01)
    config = zj.ZeroConfig(stage=2, precision="bf16", offload_optimizer="cpu", zenflow=zenflow)
    state = zj.shard_train_state(init_mlp, tx, config=config)
    step = zj.make_train_step(mlp_loss, state)
    for b in batches[:2]:  # compile (and, for ZenFlow, the first selection)
        state, m = step(state, b)
    jax.block_until_ready(state.params)
    shapes = jax.eval_shape(init_mlp, jax.random.PRNGKey(0))
    cdt = jnp.bfloat16
    events0 = (getattr(step, "host_updates", 0), getattr(step, "selections", 0))
    counters0 = (getattr(step, "bytes_to_host", 0), getattr(step, "bytes_to_device", 0))
    t0 = time.perf_counter()
    losses = []
    for b in batches[2:2 + steps]:
        state, m = step(state, b)
        losses.append(m["loss"])
    jax.block_until_ready((state.params, losses))
    dt = (time.perf_counter() - t0) / steps
    if zenflow:
        updates, selections = step.host_updates - events0[0], step.selections - events0[1]
        weights = leaf_bytes([x for x in jax.tree_util.tree_leaves(shapes) if x.ndim == 2], cdt)
        moved = (steps * weights + updates * weights + selections * weights) / steps
        counted = (step.bytes_to_host - counters0[0] + step.bytes_to_device - counters0[1]) / steps
        extra = (f"host updates {updates}, selections {selections}, max staleness {step.max_staleness}; "
                 f"its counters: {counted / 2**20:.2f} MiB/step")
        step.close()
    else:
        everything = leaf_bytes(shapes, cdt)
        moved = 2 * everything  # every gradient down, every param up, each step
        down, up = host_call_bytes(step, state, batches[0])
        extra = (f"{everything / 2**20:.2f} MiB grads down + {everything / 2**20:.2f} MiB params up; "
                 f"the compiled host call: {down / 2**20:.2f} + {up / 2**20:.2f} MiB")
    return dt, moved, float(np.mean([float(x) for x in losses[-4:]])), extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--intervals", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--devices", type=int, default=8, help="simulated devices (read before jax starts)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((args.batch, WIDTH)).astype(np.float32),
                "y": rng.uniform(-0.5, 0.5, (args.batch, WIDTH)).astype(np.float32)} for _ in range(args.steps + 2)]
    n_params = LAYERS * (WIDTH * WIDTH + WIDTH)
    print(f"MLP {LAYERS} x {WIDTH}x{WIDTH} ({n_params / 1e6:.1f}M params), bf16, stage 2, batch {args.batch}, "
          f"{jax.device_count()} devices, {args.steps} timed steps")
    base_t, base_b, base_loss, extra = run(batches, None, args.steps)
    print(f"{'plain offload':<34} {base_t * 1e3:8.1f} ms/step  {base_b / 2**20:8.2f} MiB/step  ({extra})", flush=True)
    for u in args.intervals:
        for overlap in (True,):
            z = {"topk_ratio": 0.1, "update_interval": u, "overlap_step": overlap, "select_strategy": "step",
                 "select_interval": 4 * u}
            t, b, loss, extra = run(batches, z, args.steps)
            print(f"{f'ZenFlow U={u} overlap={overlap}':<34} {t * 1e3:8.1f} ms/step  {b / 2**20:8.2f} MiB/step  "
                  f"time {t / base_t:.2f}x (goal <= 0.5)  bytes {b / base_b:.2f}x (goal <= 0.6)  ({extra})",
                  flush=True)
    if jax.devices()[0].platform == "gpu":  # pragma: no cover - only with a GPU
        print("device idle fraction: run with a GPU profiler trace; not measured on CPU")


if __name__ == "__main__":
    main()
