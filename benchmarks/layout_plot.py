"""Stored bytes per device by ZeRO stage and precision, GPT-2-small shape on 8 devices (a PNG).

Nothing is allocated: zj.estimate computes the plan's exact per-device bytes from the shapes
(it equals zj.memory_report of the real state). Every leaf is partitioned at stage 3
(param_persistence_threshold=0) so the figures compare with the formula. The bars split each
total into params, fp32 master and optimizer state; the ZeRO formula for the stored state
(P param bytes, K optimizer bytes per parameter, gradients excluded as they live inside the
step) is marked.

    python benchmarks/layout_plot.py [--out layout.png] [--devices 8]
"""
import argparse

from _common import simulate_devices

simulate_devices(1)  # shapes only: one CPU device is enough

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.tools._estimate import estimate, zero_paper_bytes  # noqa: E402
from zerojax.models.gpt import GPT2_SMALL, init_params  # noqa: E402

PRECISIONS = ("fp32", "bf16")
PARTS = (("params", "#4c72b0"), ("master", "#dd8452"), ("optimizer", "#55a868"))


def measure(devices: int):
    shapes = jax.eval_shape(lambda k: init_params(GPT2_SMALL, k), jax.random.PRNGKey(0))
    psi = GPT2_SMALL.n_params
    rows = []
    for precision in PRECISIONS:
        for stage in range(4):
            report = estimate(shapes, devices, zj.ZeroConfig(stage=stage, precision=precision,
                                                             param_persistence_threshold=0))
            parts = {name: report.by_part.get(name, {}).get("device", 0) for name, _ in PARTS}
            formula = zero_paper_bytes(psi, devices, stage, precision, include_grads=False)
            rows.append((precision, stage, report.max_bytes("device"), parts, formula))
    return psi, rows


def plot(rows, devices: int, psi: int, out: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.8))
    labels, x = [], 0
    for precision, stage, total, parts, formula in rows:
        bottom = 0.0
        for name, color in PARTS:
            mib = parts[name] / 2**20
            ax.bar(x, mib, bottom=bottom, color=color, label=name if x == 0 else None)
            bottom += mib
        ax.plot([x - 0.4, x + 0.4], [formula / 2**20] * 2, color="black", lw=1.5,
                label="ZeRO formula" if x == 0 else None)
        ax.text(x, total / 2**20, f"{total / 2**20:.0f}", ha="center", va="bottom", fontsize=8)
        labels.append(f"{precision}\nstage {stage}")
        x += 1
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("gradients live inside the step, not in the stored state: stages 1 and 2 store the same")
    ax.set_ylabel("stored bytes per device (MiB)")
    ax.set_title(f"GPT-2 small ({psi / 1e6:.0f}M params) on {devices} devices: params, master and "
                 "optimizer state per device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="layout.png")
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
    psi, rows = measure(args.devices)
    print(f"GPT-2 small: {psi:,} params, {args.devices} devices; stored bytes per device (max over devices)")
    print(f"{'precision':>9} {'stage':>5} {'params MiB':>11} {'master MiB':>11} {'optim MiB':>10} "
          f"{'total MiB':>10} {'formula MiB':>12} {'ratio':>7}")
    for precision, stage, total, parts, formula in rows:
        print(f"{precision:>9} {stage:>5} {parts['params'] / 2**20:>11.2f} {parts['master'] / 2**20:>11.2f} "
              f"{parts['optimizer'] / 2**20:>10.2f} {total / 2**20:>10.2f} {formula / 2**20:>12.2f} "
              f"{total / formula:>7.4f}")
    plot(rows, args.devices, psi, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
