"""Train a small GPT on real text with ZeRO over 8 simulated devices.

The corpus is the source of Python's own standard library (present on every machine),
read as bytes: a 256-token vocabulary and no download.

    python examples/train_gpt.py                      # ZeRO-2, bf16, 200 steps
    python examples/train_gpt.py --stage 3 --precision fp32 --steps 100
"""
import argparse
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402

STDLIB_FILES = ("argparse.py", "textwrap.py", "difflib.py", "inspect.py", "typing.py", "dataclasses.py",
                "functools.py", "pathlib.py", "shutil.py", "tarfile.py", "zipfile.py", "subprocess.py")


def load_corpus() -> np.ndarray:
    root = os.path.dirname(os.__file__)
    chunks = []
    for name in STDLIB_FILES:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                chunks.append(f.read())
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8).astype(np.int32)
    if data.size < 100_000:
        sys.exit(f"corpus too small ({data.size} bytes) under {root}")
    return data


def sample_batch(rng, data, batch, seq):
    starts = rng.integers(0, data.size - seq - 1, batch)
    return {"tokens": np.stack([data[s:s + seq + 1] for s in starts])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per optimizer step)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--scan", action="store_true", help="stack the layers and run them with lax.scan")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    data = load_corpus()
    split = int(data.size * 0.95)
    train, held_out = data[:split], data[split:]
    cfg = GPTConfig(vocab=256, n_layer=args.layers, d_model=args.d_model, n_head=4, seq_len=args.seq, scan=args.scan)
    mesh = zj.make_mesh()
    config = zj.ZeroConfig(stage=args.stage, precision=args.precision, gradient_accumulation_steps=args.grad_accum,
                           gradient_clipping=args.clip)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1)
    state = zj.shard_train_state(lambda k: init_params(cfg, k), tx, mesh=mesh, config=config,
                                 rng=jax.random.PRNGKey(args.seed))
    step = zj.make_train_step(loss_fn(cfg), state)
    eval_loss = jax.jit(lambda p, b: loss_fn(cfg)(p, b))

    report = zj.memory_report(state)
    parts = ", ".join(f"{k} {v.get('device', 0) / 2**20:.2f}" for k, v in report.by_part.items())
    print(f"GPT {cfg.n_params / 1e6:.2f}M params | {len(mesh.devices.flat)} devices | ZeRO stage {args.stage} | "
          f"{args.precision} | {len(data) / 1e6:.1f} MB of text")
    print(f"memory per device: {report.max_bytes('device') / 2**20:.2f} MiB stored ({parts} MiB)")

    rng = np.random.default_rng(args.seed)
    tokens_per_step = args.batch * args.seq
    bar = tqdm(range(args.steps), desc="train", unit="step")
    t0, first_loss = None, None
    for i in bar:
        state, m = step(state, sample_batch(rng, train, args.batch, args.seq))
        if i == 0:
            jax.block_until_ready(state)
            t0 = time.perf_counter()  # exclude compilation
            first_loss = float(m["loss"])
        if i % 10 == 0 or i == args.steps - 1:
            rate = tokens_per_step * i / (time.perf_counter() - t0) if i else 0.0
            bar.set_postfix(loss=f"{float(m['loss']):.3f}", lr=f"{float(m['learning_rate']):.1e}",
                            tok_s=f"{rate:,.0f}", skipped=int(m["skipped"]))
    bar.close()
    params = state.full_params()
    eval_rng = np.random.default_rng(1234)
    held = np.mean([float(eval_loss(params, sample_batch(eval_rng, held_out, 32, args.seq))) for _ in range(4)])
    elapsed = time.perf_counter() - t0
    print(f"loss {first_loss:.3f} -> {float(m['loss']):.3f} (held-out {held:.3f}, uniform {np.log(256):.3f}) | "
          f"{tokens_per_step * (args.steps - 1) / elapsed:,.0f} tokens/s")
    return float(held)


if __name__ == "__main__":
    main()
