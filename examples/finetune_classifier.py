"""Fine-tune a pretrained small GPT to tell which standard-library package a docstring or comment
comes from, with ZeRO over 8 simulated devices.

The task ships with Python (see classifier_data.py): prose from the library's own sources,
labelled by package, split into train and held-out sets. The model is zerojax.models.classifier;
its backbone is pretrained once as a language model on other modules' prose (a few minutes,
classifier_training.py) and cached in --cache-dir.

    python examples/finetune_classifier.py                      # ZeRO-2, fp32, 4 epochs
    python examples/finetune_classifier.py --stage 3 --precision bf16 --seed 1
"""
import argparse
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import classifier  # noqa: E402

# the task's data and training recipe, next to this script (its directory is on sys.path)
import classifier_data  # noqa: E402
import classifier_training as training  # noqa: E402


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--epochs", type=int, default=training.EPOCHS)
    ap.add_argument("--batch", type=int, default=training.BATCH_SIZE, help="global batch (examples per step)")
    ap.add_argument("--lr", type=float, default=training.LEARNING_RATE)
    ap.add_argument("--seed", type=int, default=0, help="head initialisation and data order")
    ap.add_argument("--cache-dir", default=os.path.join("~", ".cache", "zerojax"),
                    help="where the pretrained backbone is kept (default: %(default)s)")
    args = ap.parse_args(argv)

    train, heldout, num_classes, vocab = classifier_data.load_task()
    cfg = classifier.model_config()
    t0 = time.perf_counter()
    backbone = training.pretrained_params(args.cache_dir, cfg, verbose=True)
    params = classifier.init_classifier(backbone, num_classes, jax.random.PRNGKey(args.seed))
    mesh = zj.make_mesh()
    steps = training.steps_per_epoch(train, args.batch) * args.epochs
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"task: {num_classes} packages ({', '.join(classifier_data.PACKAGES)}), {len(train['label'])} train / "
          f"{len(heldout['label'])} held-out paragraphs, {len(vocab)}-word vocabulary, chance "
          f"{1 / num_classes:.0%} | backbone ready in {time.perf_counter() - t0:.1f}s")
    print(f"GPT classifier {n_params / 1e6:.2f}M params | {len(mesh.devices.flat)} devices | ZeRO stage "
          f"{args.stage} | {args.precision} | {args.epochs} epochs x {steps // args.epochs} steps of {args.batch}")

    config = zj.ZeroConfig(stage=args.stage, precision=args.precision, gradient_clipping=1.0)
    bar = tqdm(total=steps, desc="fine-tune", unit="step")

    def progress(i, metrics):
        bar.update(1)
        if i % 10 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", lr=f"{float(metrics['learning_rate']):.1e}")

    state, losses, seconds = training.finetune(params, train, training.adamw(steps, args.lr), mesh=mesh,
                                                 config=config, epochs=args.epochs, batch_size=args.batch,
                                                 seed=args.seed, callback=progress)
    bar.close()
    report = zj.memory_report(state)
    parts = ", ".join(f"{k} {v.get('device', 0) / 2**20:.2f}" for k, v in report.by_part.items())
    print(f"memory per device: {report.max_bytes('device') / 2**20:.2f} MiB stored ({parts} MiB)")
    timed = steps - 1  # the first step, which compiles, is not timed
    rate = args.batch * timed / seconds if seconds else float("nan")
    tokens = rate * train["tokens"].shape[1]
    final = float(np.mean(losses[-10:]))
    acc = classifier.accuracy(state.full_params(), heldout)
    print(f"loss {losses[0]:.3f} -> {final:.3f} | {rate:,.0f} examples/s ({tokens:,.0f} tokens/s) | "
          f"held-out accuracy {acc:.1%} (chance {1 / num_classes:.0%})")
    return acc


if __name__ == "__main__":
    main()
