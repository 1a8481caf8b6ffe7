"""ZenFlow's accuracy against on-device AdamW: fine-tune the same pretrained model on the task
that ships with the repo (examples/classifier_data.py: which standard-library package a docstring
paragraph comes from), same seeds, schedule and AdamW settings, and compare held-out accuracy.
Goal: ZenFlow within 1 point of AdamW (ZenFlow's claim is accuracy parity on GLUE).

The ZenFlow setting below is fixed: it was chosen (update_interval 2 rather than 4) on seeds 0-2
and this held-out set. The figure reported uses seeds that choice never saw (default 10-14)
and is the mean paired gap (AdamW minus ZenFlow, same seed) with its 95% confidence interval
(Student's t over the seeds). The task has one held-out split, so the held-out paragraphs are
those the choice was made on: only the seeds are fresh. The verdict: "within" when the upper
end of the interval is at most 1 point, "NOT within" when its lower end is above 1 point,
otherwise "inconclusive". ``--zenflow`` runs another setting, reported as exploratory.

    python benchmarks/zenflow_accuracy.py [--seeds 10 11 12 13 14] [--epochs 4] [--batch 16]
    python benchmarks/zenflow_accuracy.py --smoke      # a few steps per run: checks the script runs
"""
import argparse
import json
import os
import sys
import time

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import classifier  # noqa: E402

# the task's data and training recipe live with examples/finetune_classifier.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import classifier_data  # noqa: E402
import classifier_training as training  # noqa: E402

# DeepSpeed's defaults (selection once per epoch) with a host update every 2 steps; with 4,
# seeds 0-2 gave a mean gap of 0.95 points and a worst of 2.9. Chosen on seeds 0-2: fixed since.
ZENFLOW = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True, "select_strategy": "auto",
           "select_interval": "auto"}
SELECTION_SEEDS = (0, 1, 2)
FRESH_SEEDS = (10, 11, 12, 13, 14)
# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom, or that of the next smaller
    tabulated df (which errs wide)."""
    return T975[max(k for k in T975 if k <= df)]


def confidence_interval(gaps) -> tuple:
    """(mean, half width) of the 95% interval of the mean of ``gaps`` (n >= 2)."""
    gaps = np.asarray(gaps, np.float64)
    n = len(gaps)
    return float(gaps.mean()), t975(n - 1) * float(gaps.std(ddof=1)) / np.sqrt(n)


def finetune(params, train, heldout, *, zenflow, epochs, batch, seed, mesh, max_steps=None):
    steps = training.steps_per_epoch(train, batch) * epochs
    config = zj.ZeroConfig(stage=2, gradient_clipping=1.0, offload_optimizer="cpu" if zenflow else None,
                           zenflow=ZENFLOW if zenflow else None)
    state = zj.shard_train_state(params, training.adamw(steps), mesh=mesh, config=config,
                                 rng=jax.random.PRNGKey(seed))
    step = zj.make_train_step(classifier.loss_fn, state)
    per_epoch = training.steps_per_epoch(train, batch)
    losses, t0 = [], time.perf_counter()
    for i, b in enumerate(training.batches(train, batch, epochs, seed)):
        if max_steps is not None and i >= max_steps:
            break
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        if zenflow and (i + 1) % per_epoch == 0:
            step.end_epoch()
    if zenflow:
        state = step.finish(state)
        step.close()
    seconds = time.perf_counter() - t0
    acc = classifier.accuracy(state.full_params(), heldout)
    early = float(np.mean(losses[100:120])) if len(losses) >= 120 else float("nan")
    return acc, early, float(np.mean(losses[-10:])), seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=list(FRESH_SEEDS))
    ap.add_argument("--epochs", type=int, default=training.EPOCHS)
    # batch 16: 98 steps an epoch, so an update interval of 4 is a small part of the run
    # (at the example's batch of 64, 96 steps in all, ZenFlow lagged by 3-5 points)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--zenflow", type=json.loads, default=None, help="another zenflow block as JSON (exploratory)")
    ap.add_argument("--smoke", action="store_true", help="8 steps per run, 2 seeds: checks that the script runs")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "zerojax"))
    args = ap.parse_args()
    exploratory = bool(args.zenflow)
    if args.zenflow:
        ZENFLOW.clear()
        ZENFLOW.update(args.zenflow)
    max_steps = 8 if args.smoke else None
    seeds = args.seeds[:2] if args.smoke else args.seeds
    reused = sorted(set(seeds) & set(SELECTION_SEEDS))
    mesh = zj.make_mesh()
    train, heldout, num_classes, _ = classifier_data.load_task()
    backbone = training.pretrained_params(args.cache_dir)
    print(f"{len(train['label'])} training / {len(heldout['label'])} held-out paragraphs, {num_classes} classes, "
          f"{args.epochs} epochs, batch {args.batch}, stage 2 on {mesh.size} devices; ZenFlow {ZENFLOW}"
          + (f"; smoke run: {max_steps} steps per run" if args.smoke else ""))
    print(f"{'seed':>4} {'optimizer':<10} {'held-out acc':>12} {'loss @100-120':>14} {'final loss':>11} {'seconds':>8}")
    gaps = []
    for seed in seeds:
        params = classifier.init_classifier(backbone, num_classes, jax.random.PRNGKey(seed))
        accs = {}
        for name, zen in (("AdamW", False), ("ZenFlow", True)):
            acc, early, final, secs = finetune(params, train, heldout, zenflow=zen, epochs=args.epochs,
                                               batch=args.batch, seed=seed, mesh=mesh, max_steps=max_steps)
            accs[name] = acc
            print(f"{seed:>4} {name:<10} {acc:>11.1%} {early:>14.3f} {final:>11.3f} {secs:>8.0f}", flush=True)
        gaps.append(accs["AdamW"] - accs["ZenFlow"])
    if len(gaps) < 2:
        print(f"gap {gaps[0] * 100:+.2f} points (AdamW minus ZenFlow); one seed gives no interval")
        return
    mean, half = confidence_interval(gaps)
    lo, hi = mean - half, mean + half
    verdict = ("within 1 point" if hi <= 0.01 else "NOT within 1 point" if lo > 0.01
               else "inconclusive (the interval straddles 1 point)")
    caveats = [c for c in (
        "smoke run (not a result)" if args.smoke else "",
        "exploratory setting (not the fixed one)" if exploratory else "",
        f"seeds {reused} chose the setting" if reused else "",
        "fewer than 5 seeds" if len(gaps) < 5 else "") if c]
    print(f"ZenFlow's held-out accuracy vs AdamW's over {len(gaps)} seeds: mean gap {mean * 100:+.2f} points "
          f"(AdamW minus ZenFlow), 95% CI [{lo * 100:+.2f}, {hi * 100:+.2f}], worst {max(gaps) * 100:+.2f} -> "
          f"{verdict}" + (f" ({'; '.join(caveats)})" if caveats else ""))


if __name__ == "__main__":
    main()
