"""Compiled per-device peak memory of ZeRO stages 1-3 relative to stage 0.

GPT-2-small shape (vocab 50257, 12 layers, d 768, tied embedding), fp32 by default (the CPU
backend widens 16-bit collectives and scatters to f32, which would inflate a bf16 figure here),
on 8 simulated devices, with the layers as a Python loop and under lax.scan; compiled from abstract shapes
(XLA's memory analysis: arguments + outputs + temporaries - aliased). Small activations:
one sequence of 32 tokens per device. Stage 3 runs twice: with DeepSpeed's default
``max_reuse_distance`` (1e9 elements: a model this size stays gathered from each param's forward
to its backward use, as under DeepSpeed, so its peak holds the whole gathered model) and with
``max_reuse_distance=0`` ("3 lean": gathered again for the backward pass, ZeRO's 3Ψ). Goal, for
the lean run: stage 3 <= 0.20x stage 0, and stage 3's peak <= its model states (params, gradients, optimizer state: 1/N each, from the ZeRO formula, not
from the program measured) + 3 blocks' gathered params + the activations. The stage-3 runs use DeepSpeed's "auto" prefetch bucket (0.9 * d^2
elements), so the tied embedding (73 buckets) is gathered and reduced in slices, never whole;
a block's matrices (3-5 buckets) are gathered whole. "3 sliced" is the lean run with
``max_live_parameters`` of one bucket, under which every matmul param above it (the block
matrices too) is gathered slice by slice: whole against sliced gathers, side by side.

    python benchmarks/peak_memory.py [--layers 12] [--seq 128] [--optimizer sgd]
    python benchmarks/peak_memory.py --layers 2 --d 96 --vocab 1000 --seq 16 --no-scan   # tiny
    python benchmarks/peak_memory.py --shape findings [--breakdown] [--target h100]
    python benchmarks/peak_memory.py --target h100 [--no-scan]   # XLA:GPU, 8 compile-only H100s

``--target h100`` (or ``h200``, ``a100``; needs JAX's CUDA plugin) compiles every step with XLA's
GPU compiler for 8 compile-only GPUs of that kind (``zj.plan_step``) instead of XLA:CPU.

``--shape findings``: 12 layers, d 256, 4 heads, vocab 8192, context 64, 32 tokens a device (batch
8 x 33), every param partitioned (``param_persistence_threshold=0``), the auto bucket; stage 0,
stage 3 at the default distance and at ``max_reuse_distance=0``, Python loop and ``lax.scan``.
``--breakdown`` dumps each stage-3 step's optimized HLO (``--xla_dump_to``) and prints what is
alive at its peak: gathered param buckets (forward or backward), pieces cut from them, gradients
on their way to a reduce-scatter, the rest (``_live.py``).
"""
import argparse
import functools
import os
import sys
import tempfile

from _common import simulate_devices

DUMP = None
if "--breakdown" in sys.argv:
    DUMP = tempfile.mkdtemp(prefix="peak_memory_hlo_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=jit_train_step").strip()
simulate_devices(8)
if "--target" in sys.argv:  # compiling for compile-only GPUs in this process: JAX on the CPU only
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.tools._compiled import PeakMemory  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--no-scan", action="store_true", help="only the Python-loop model")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--shape", choices=("findings",), help="a named shape (see above)")
    ap.add_argument("--breakdown", action="store_true", help="what is alive at each stage-3 peak")
    ap.add_argument("--reduce-bucket", type=int, default=None, help="reduce_bucket_size (default: DeepSpeed's 5e8; "
                    "XLA:GPU bounds its collective combiners by it)")
    ap.add_argument("--target", default=None, help="compile with XLA's GPU compiler for 8 "
                    "compile-only GPUs of this kind (h100, h200, a100; needs JAX's CUDA plugin)")
    args = ap.parse_args()
    if args.shape == "findings":
        return findings(args.breakdown, args.target)
    mesh = zj.make_mesh()
    n = mesh.shape["data"]
    mib = 2**20
    tx = optax.adamw(1e-4) if args.optimizer == "adamw" else optax.sgd(1e-4)
    for scan in (False,) if args.no_scan else (False, True):
        cfg = GPTConfig(vocab=args.vocab, n_layer=args.layers, d_model=args.d, n_head=args.heads, seq_len=args.seq, scan=scan)
        batch = {"tokens": jax.ShapeDtypeStruct((n, cfg.seq_len + 1), np.int32)}
        where = f"XLA:GPU for 8 compile-only {args.target} GPUs" if args.target else f"{n} devices"
        print(f"GPT {cfg.n_params / 1e6:.1f}M params, {'lax.scan' if scan else 'Python loop'}, {args.optimizer}, {args.precision}, "
              f"{where}, {args.seq} tokens per device")
        print(f"{'stage':>8} {'peak MiB':>9} {'vs stage 0':>10} {'stored MiB':>11} {'temporaries MiB':>16}")
        peaks = {}
        bucket = int(0.9 * args.d**2)  # DeepSpeed's "auto" prefetch bucket: 0.9 * hidden^2 elements
        for stage in (0, 1, 2, 3, "3 lean", "3 sliced"):
            lean = {"max_reuse_distance": 0} if str(stage).startswith("3 ") else {}
            if stage == "3 sliced":  # max_live_parameters of one bucket: block matrices sliced too
                lean["max_live_parameters"] = bucket
            rb = {} if args.reduce_bucket is None else {"reduce_bucket_size": args.reduce_bucket}
            config = zj.ZeroConfig(stage=3 if lean else stage, precision=args.precision,
                                   prefetch_bucket_size=bucket, **lean, **rb)
            if args.target:
                p = zj.plan_step(functools.partial(init_params, cfg), loss_fn(cfg), batch, devices=n, config=config,
                                 tx=tx, target=args.target)
                peak = PeakMemory(p.argument_bytes, p.output_bytes, p.temp_bytes, p.alias_bytes)
            else:
                state = zj.abstract_train_state(lambda k: init_params(cfg, k), tx, mesh=mesh, config=config)
                step = zj.make_train_step(loss_fn(cfg), state)
                peak = zj.peak_memory(step, state, batch)
            peaks[stage] = peak
            stored = zj.estimate(jax.eval_shape(lambda k: init_params(cfg, k), jax.random.PRNGKey(0)), mesh, config, tx=tx)
            print(f"{str(stage):>8} {peak.peak / mib:>9.1f} {peak.peak / peaks[0].peak:>9.3f}x "
                  f"{stored.max_bytes('device') / mib:>11.1f} {peak.temp / mib:>16.1f}", flush=True)
        d = args.d
        width = 4 if args.precision == "fp32" else 2
        # model states from the ZeRO formula (REFERENCE.md section 1), each 1/N at stage 3:
        # params and gradients in the compute dtype, K optimizer bytes per param (fp32: the params
        # are the master, AdamW adds m and v; 16-bit: a 4-byte master too); plus the batch
        k = (8 if args.optimizer == "adamw" else 0) + (0 if args.precision == "fp32" else 4)
        states = (width + width + k) * cfg.n_params / n + (cfg.seq_len + 1) * 4
        layer = (12 * d * d + 13 * d) * width
        acts = args.seq * cfg.vocab * 4 * 3 + args.layers * args.seq * d * 4 * 16
        bound = states + 3 * layer + acts
        lean = peaks["3 lean"]
        print(f"stage 3 lean peak {lean.peak / mib:.1f} MiB vs model states {states / mib:.1f} "
              f"(({width} + {width} + {k}) bytes x {cfg.n_params:,} params / {n}; the compiled arguments hold "
              f"{lean.argument / mib:.1f}) + 3 blocks' params {3 * layer / mib:.1f} + activations "
              f"{acts / mib:.1f} = {bound / mib:.1f} MiB -> "
              f"{'within' if lean.peak <= bound else 'ABOVE'} the bound ({lean.peak / bound:.2f}x)")
        print(f"goal: stage 3 lean <= 0.20x stage 0 -> {lean.peak / peaks[0].peak:.3f}x; at the default "
              f"distance {peaks[3].peak / peaks[0].peak:.3f}x; block matrices sliced too (max_live_parameters "
              f"{bucket:,}) {peaks['3 sliced'].peak / peaks[0].peak:.3f}x\n")


def findings(show_breakdown: bool, target=None):
    """Stage 0 against stage 3 (default distance, distance 0) on FINDINGS' 12-layer d 256 GPT;
    with ``target``, compiled by XLA:GPU for 8 compile-only GPUs of that kind (zj.plan_step), once
    with DeepSpeed's default reduce bucket and once with Hugging Face's "auto" one (d^2)."""
    import _live

    mesh = zj.make_mesh()
    n = mesh.shape["data"]
    mb, d = 1e6, 256
    tx = optax.adamw(1e-4)
    bucket = int(0.9 * d**2)
    reduce_buckets = (None,) if target is None else (None, d * d)
    for scan, reduce_bucket in ((s, r) for s in (False, True) for r in reduce_buckets):
        cfg = GPTConfig(vocab=8192, n_layer=12, d_model=d, n_head=4, seq_len=64, scan=scan)
        batch = {"tokens": jax.ShapeDtypeStruct((n, 33), np.int32)}
        where = f"XLA:GPU for 8 compile-only {target} GPUs" if target else f"{n} devices"
        rb = {} if reduce_bucket is None else {"reduce_bucket_size": reduce_bucket}
        print(f"GPT {cfg.n_params / 1e6:.1f}M params, {'lax.scan' if scan else 'Python loop'}, adamw fp32, "
              f"param_persistence_threshold 0, prefetch bucket {bucket:,}, reduce bucket "
              f"{reduce_bucket or 'default (5e8)'}, {where}, 32 tokens per device")
        print(f"{'stage':>8} {'peak MB':>8} {'vs stage 0':>10} {'arguments MB':>13} {'temporaries MB':>15}")
        peaks = {}
        for stage in (0, 3, "3 lean"):
            extra = {"max_reuse_distance": 0} if stage == "3 lean" else {}
            config = zj.ZeroConfig(stage=3 if extra else stage, prefetch_bucket_size=bucket,
                                   param_persistence_threshold=0, **extra, **rb)
            if target:
                p = zj.plan_step(functools.partial(init_params, cfg), loss_fn(cfg), batch, devices=n, config=config,
                                 tx=tx, target=target)
                peak = peaks[stage] = PeakMemory(p.argument_bytes, p.output_bytes, p.temp_bytes, p.alias_bytes)
                print(f"{str(stage):>8} {peak.peak / mb:>8.1f} {peak.peak / peaks[0].peak:>9.3f}x "
                      f"{peak.argument / mb:>13.1f} {peak.temp / mb:>15.1f}   {p.overlapped[0]} of "
                      f"{p.overlapped[1]} async collectives overlap compute", flush=True)
                continue
            state = zj.abstract_train_state(lambda k: init_params(cfg, k), tx, mesh=mesh, config=config)
            step = zj.make_train_step(loss_fn(cfg), state)
            peak = peaks[stage] = zj.peak_memory(step, state, batch)
            print(f"{str(stage):>8} {peak.peak / mb:>8.1f} {peak.peak / peaks[0].peak:>9.3f}x "
                  f"{peak.argument / mb:>13.1f} {peak.temp / mb:>15.1f}", flush=True)
            if show_breakdown and stage != 0:
                print(_live.report(_live.breakdown(DUMP)), flush=True)
        print(f"goal: stage 3 at distance 0 <= 0.20x stage 0 -> {peaks['3 lean'].peak / peaks[0].peak:.3f}x\n")


if __name__ == "__main__":
    main()
