"""Collective bytes per device per optimizer step vs ZeRO's theory, from the compiled step.

GPT-2-small shape (vocab 50257, 12 layers, d 768, tied embedding) on 8 simulated devices,
compiled from abstract shapes (nothing allocated, nothing run). Theory, in the gradient
dtype: 2Ψ for stages 0-1, (GAS + 1)Ψ for stage 2, and for stage 3 2Ψ·GAS under DeepSpeed's default
``max_reuse_distance`` (a model this size stays gathered from forward to backward) and 3Ψ·GAS
with ``max_reuse_distance`` 0 (the "3 lean" rows: gathered again for the backward pass). Goal: ratio <= 1.02,
no all-reduce bigger than 1% of Ψ in stages 2-3, and stage 0/1 volume with 4 micro-batches
equal to the volume with one.

    python benchmarks/comm.py [--precision bf16] [--layers 12] [--scan]
"""
import argparse

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--scan", action="store_true")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="stage3_prefetch_bucket_size (default: DeepSpeed's auto, 0.9 * d^2)")
    args = ap.parse_args()
    prefetch = args.prefetch or int(0.9 * args.d**2)
    cfg = GPTConfig(vocab=50257, n_layer=args.layers, d_model=args.d, n_head=12, seq_len=args.seq, scan=args.scan)
    mesh = zj.make_mesh()
    n = mesh.shape["data"]
    psi = cfg.n_params
    print(f"GPT {psi / 1e6:.1f}M params ({'scan' if args.scan else 'python loop'}), {n} devices, {args.precision}")
    print(f"{'stage':>6} {'GAS':>4} {'all-gather':>16} {'reduce-scatter':>16} {'all-reduce':>16} {'all-to-all':>16} "
          f"{'MiB':>9} {'theory':>8} {'ratio':>6} {'max AR/Ψ':>9}")
    volume = {}
    for gas in (1, 4):
        batch = {"tokens": jax.ShapeDtypeStruct((n * gas, cfg.seq_len + 1), np.int32)}
        for stage in (0, 1, 2, 3, "3 lean"):
            lean = {"max_reuse_distance": 0} if stage == "3 lean" else {}
            config = zj.ZeroConfig(stage=3 if lean else stage, precision=args.precision, gradient_accumulation_steps=gas,
                                   prefetch_bucket_size=prefetch, **lean)
            state = zj.abstract_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-4), mesh=mesh, config=config)
            step = zj.make_train_step(loss_fn(cfg), state)
            r = zj.comm_report(step, state, batch)
            volume[stage, gas] = r.total_elements

            def cell(kind):
                c, _, e = r.kinds.get(kind, (0, 0, 0))
                return f"{c}x {e / psi:.3f}Ψ"

            print(f"{str(stage):>6} {gas:>4} {cell('all-gather'):>16} {cell('reduce-scatter'):>16} {cell('all-reduce'):>16} "
                  f"{cell('all-to-all'):>16} {r.total_bytes / 2**20:>9.1f} {r.theory_label:>8} {r.ratio:>6.3f} {r.largest_all_reduce / psi:>9.2e}",
                  flush=True)
    for stage in (0, 1):
        print(f"stage {stage}: volume with 4 micro-batches / with 1 = {volume[stage, 4] / volume[stage, 1]:.3f}")
    print("elements per collective kind in units of Ψ; MiB as compiled (the CPU backend widens 16-bit "
          "collectives to f32, GPUs move them in 16 bits); ratio = elements / theory")
    print("goal: ratio <= 1.02; max all-reduce <= 1e-2 Ψ in stages 2-3; stage 0/1 volume independent of GAS")


if __name__ == "__main__":
    main()
