"""Train a small GPT from a DeepSpeed JSON config, on 8 simulated CPU devices.

The config's "auto" values come from Hugging Face-style training arguments, as with
DeepSpeed's Hugging Face integration; the data are synthetic token sequences (counting with a
random start and stride), which a small model learns in a few dozen steps.

    python examples/train_ds_config.py                                     # ZeRO-2, fp32, 60 steps
    python examples/train_ds_config.py --config examples/ds_configs/zero1.json --bf16 --steps 60
    zerojax config check examples/ds_configs/zero2.json --world-size 8 \\
        --training-args '{"per_device_train_batch_size": 2, "max_steps": 30}'    # a verdict per key (--json: the resolved config)
"""
import argparse
import functools
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs", "zero2.json")


def synthetic_tokens(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    """Rows ``start, start + stride, start + 2 * stride, ...`` modulo ``vocab``."""
    start = rng.integers(0, vocab, (batch, 1))
    stride = rng.integers(1, 8, (batch, 1))
    return ((start + stride * np.arange(length)) % vocab).astype(np.int32)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="DeepSpeed JSON config (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=2, help="per_device_train_batch_size")
    p.add_argument("--grad-acc", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=5, help="warmup_steps")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    args = p.parse_args(argv)

    model = GPTConfig(vocab=128, n_layer=2, d_model=64, n_head=4, seq_len=32)
    training_args = zj.TrainingArgs(
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_acc,
        learning_rate=args.lr, weight_decay=0.01, warmup_steps=args.warmup, max_steps=args.steps,
        bf16=args.bf16, fp16=args.fp16)
    # the config's "auto" values are filled from training_args; world size = the mesh's data axis
    state, step = zj.initialize(functools.partial(init_params, model), loss_fn(model), args.config,
                                mesh=zj.make_mesh(), training_args=training_args, hidden_size=model.d_model)
    config = state.plan.config
    print(f"ZeRO-{config.stage}, {config.precision}, {config.optimizer['type'] if config.optimizer else 'AdamW'}, "
          f"{(config.scheduler or {}).get('type', 'linear')} schedule; global batch {config.train_batch_size} = "
          f"{config.train_micro_batch_size_per_gpu} x {config.gradient_accumulation_steps} grad-acc x "
          f"{state.plan.n} devices; {model.n_params:,} params")

    rng = np.random.default_rng(0)
    losses, start = [], time.perf_counter()
    for i in range(args.steps):
        # the step takes the global batch and splits it over devices and micro-batches itself
        batch = {"tokens": synthetic_tokens(rng, config.train_batch_size, model.seq_len + 1, model.vocab)}
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if i % 5 == 0 or i == args.steps - 1:
            skipped = "  (overflow: skipped)" if bool(metrics["skipped"]) else ""
            print(f"step {i:4d}  loss {losses[-1]:.4f}  lr {float(metrics['learning_rate']):.2e}  "
                  f"loss_scale {float(metrics['loss_scale']):g}{skipped}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s (first step includes compilation)")
    return losses


if __name__ == "__main__":
    main()
