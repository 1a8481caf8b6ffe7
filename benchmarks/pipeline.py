"""Pipeline parallelism: the schedule's measured bubble, and P x D against D-way ZeRO.

1. Bubble. For P = 2, 4 stages and M = 4, 8, 16 micro-batches the pipelined gradient program
   runs on a (P, 8 / P) ("pipe", "data") mesh and returns what each stage ran at each tick
   (counted inside the executed program, not read from the table). The idle share of the
   stages' time, ticks in lockstep (a tick lasts as long as its busiest stage), is printed
   next to 1F1B's theory (P - 1) / (M + P - 1), with a backward costing a forward (the
   theory's assumption) and three (a recomputed forward plus the backward: what it costs
   here), for the 1F1B schedule (a forward and a backward per tick) and DeepSpeed's serial
   order (one op per tick; the weakest case).

2. Step time (interleaved rounds, medians) and per-device memory (stored state from
   zj.memory_report; the compiled step's peak from zj.peak_memory's sum) of a GPT as P x D
   pipelines (ZeRO-1 inside each stage) against 8-way ZeRO-1 and ZeRO-3 on the same 8
   devices and the same global batch. On simulated CPU devices the times share the host's
   cores: they show the per-step overhead of the schedule, not a GPU's overlap.

    python benchmarks/pipeline.py [--smoke] [--rounds 5]
    python benchmarks/pipeline.py --target h100   # section 2's peaks by XLA:GPU, 8 compile-only H100s

``--target h100`` (or ``h200``, ``a100``; needs JAX's CUDA plugin) compiles section 2's steps with
XLA's GPU compiler for 8 compile-only GPUs of that kind, as ``zj.plan_step(..., target=...)``
does, and prints their stored state and peaks (no step time; section 1 is not run).
"""
import argparse
import os
import statistics
import sys
import time

from _common import simulate_devices

simulate_devices(8)
if "--target" in sys.argv:  # compiling for compile-only GPUs in this process: JAX on the CPU only
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig  # noqa: E402
from zerojax.models.gpt_pipeline import gpt_pipeline, init_pipeline_params  # noqa: E402
from zerojax.pipeline._grads import pipeline_grads_fn  # noqa: E402
from zerojax.pipeline._schedule import idle_fraction, make_schedule, theory_idle_fraction  # noqa: E402

MIB = 2 ** 20


def tokens(cfg, size, seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, cfg.vocab, (size, cfg.seq_len + 1)).astype(np.int32)}


def bubble(cfg, stages_list, micro_list, schedules):
    params = init_pipeline_params(cfg, jax.random.PRNGKey(0))
    pipe = gpt_pipeline(cfg)
    print("1. idle share of the stages' time, measured from the ops each stage ran (ticks in lockstep)")
    print(f"{'P':>2} {'M':>3}  {'theory':>7}  " + "  ".join(f"{s + ' B=F':>15} {s + ' B=3F':>16}" for s in schedules))
    for p in stages_list:
        mesh = zj.make_mesh((p, 8 // p), ("pipe", "data"))
        for m in micro_list:
            state = zj.shard_train_state(params, optax.sgd(1e-3), mesh=mesh,
                                         config=zj.ZeroConfig(stage=1, gradient_accumulation_steps=m))
            row = []
            for name in schedules:
                run = jax.jit(pipeline_grads_fn(pipe, state.plan, make_schedule(name, p, m)))
                _, _, ran = run(state.params, tokens(cfg, (8 // p) * m), jnp.float32(1.0))
                ran = np.asarray(ran)  # [P, ticks, 2]
                fwd, bwd = ran[..., 0].T, ran[..., 1].T
                row.append(f"{idle_fraction(fwd, bwd):>15.4f} {idle_fraction(fwd, bwd, 3.0):>16.4f}")
            print(f"{p:>2} {m:>3}  {theory_idle_fraction(p, m):>7.4f}  " + "  ".join(row))


def contenders(cfg, micro):
    """name -> (mesh shape, axis names, ZeroConfig kwargs, use the pipeline)."""
    out = {f"pipe {p} x data {8 // p}, ZeRO-1": ((p, 8 // p), ("pipe", "data"), dict(stage=1), True) for p in (2, 4)}
    out["data 8, ZeRO-1"] = ((8,), ("data",), dict(stage=1), False)
    out["data 8, ZeRO-3"] = ((8,), ("data",), dict(stage=3, param_persistence_threshold=0), False)
    return out


def gpu_peak(step, state, batch, target):
    """The peak XLA:GPU plans for ``step`` on compile-only GPUs of ``target`` (as zj.plan_step compiles)."""
    from zerojax.stages._device_step import compiler_options
    from zerojax.tools._gpu import compile_for_target

    lowered = step.trace(state, batch).lower(lowering_platforms=("cuda",))
    m = compile_for_target(lowered, state.plan.mesh, target, compiler_options(state.plan, "gpu")).memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def versus(cfg, micro, rounds, target=None):
    params = init_pipeline_params(cfg, jax.random.PRNGKey(0))
    pipe, tx = gpt_pipeline(cfg), optax.adamw(1e-4)
    batch = tokens(cfg, 8 * micro, seed=1)  # the same global batch for everyone
    runs = {}
    for name, (shape, axes, config, pipelined) in contenders(cfg, micro).items():
        # the pipeline's micro-batches are its accumulation steps; ZeRO runs the whole local batch at once
        config = dict(config, gradient_accumulation_steps=micro if pipelined else 1)
        state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(shape, axes), config=zj.ZeroConfig(**config))
        step = zj.make_train_step(pipe if pipelined else pipe.loss, state, donate=False)
        if target:
            runs[name] = dict(peak=gpu_peak(step, state, batch, target), stored=zj.memory_report(state).max_bytes())
            continue
        compiled = step.lower(state, batch).compile()  # one compile for the peak and the runs
        m = compiled.memory_analysis()  # zj.peak_memory's sum
        peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        stored = zj.memory_report(state).max_bytes()
        _, metrics = compiled(state, batch)
        runs[name] = dict(step=compiled, state=state, peak=peak, stored=stored, times=[], loss=float(metrics["loss"]))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    if target:
        print(f"\n2. GPT {cfg.n_layer} layers, d {cfg.d_model}, vocab {cfg.vocab} ({n_params / 1e6:.2f} M params), "
              f"global batch {8 * micro} x {cfg.seq_len}, AdamW fp32, XLA:GPU for 8 compile-only {target} GPUs")
        print(f"{'':<28} {'stored MiB/device':>18} {'peak MiB/device':>16}")
        for name, r in runs.items():
            print(f"{name:<28} {r['stored'] / MIB:>18.3f} {r['peak'] / MIB:>16.3f}")
        return
    for _ in range(rounds):  # interleaved rounds
        for r in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(r["step"](r["state"], batch)[1])
            r["times"].append(time.perf_counter() - t0)
    print(f"\n2. GPT {cfg.n_layer} layers, d {cfg.d_model}, vocab {cfg.vocab} ({n_params / 1e6:.2f} M params), "
          f"global batch {8 * micro} x {cfg.seq_len}, AdamW fp32, 8 devices, {rounds} rounds")
    print(f"{'':<28} {'step ms (median)':>17} {'stored MiB/device':>18} {'peak MiB/device':>16} {'loss':>8}")
    for name, r in runs.items():
        print(f"{name:<28} {1e3 * statistics.median(r['times']):>17.1f} {r['stored'] / MIB:>18.3f} "
              f"{r['peak'] / MIB:>16.3f} {r['loss']:>8.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one case of each section (seconds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", default=None, help="section 2's peaks compiled by XLA:GPU for 8 compile-only GPUs "
                    "of this kind (h100, h200, a100; needs JAX's CUDA plugin)")
    args = ap.parse_args()
    if args.target:
        cfg = GPTConfig(vocab=32, n_layer=4, d_model=16, n_head=2, seq_len=4) if args.smoke else \
            GPTConfig(vocab=512, n_layer=8, d_model=128, n_head=4, seq_len=32)
        versus(cfg, 2 if args.smoke else 8, 0, args.target)
        return
    if args.smoke:
        cfg = GPTConfig(vocab=32, n_layer=4, d_model=16, n_head=2, seq_len=4)
        bubble(cfg, [2], [2], ["1f1b"])
        versus(cfg, 2, 1)
        return
    bubble(GPTConfig(vocab=64, n_layer=4, d_model=32, n_head=2, seq_len=8), [2, 4], [4, 8, 16],
           ["1f1b", "1f1b-serial"])
    versus(GPTConfig(vocab=512, n_layer=8, d_model=128, n_head=4, seq_len=32), 8, args.rounds)


if __name__ == "__main__":
    main()
