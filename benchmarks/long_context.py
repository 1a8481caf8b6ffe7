"""Ulysses sequence parallelism: how long a sequence fits per device at N = 8 against N = 1.

A small GPT (scan over its layers, fp32, AdamW, ZeRO stage 1) on 8 simulated devices, one
sequence per data-parallel group, compiled from abstract shapes. For each sequence length and
each of N = 1 (``("data",)``, every device its own sequence) and N = 8 (``("data", "seq")``, one
sequence over 8 devices), the compiled per-device peak (``compiled.memory_analysis()``: arguments
+ outputs + temporaries - aliased), plain and with the ``activation_checkpointing`` block
(``cpu_checkpointing``) and ``zj.tiled_cross_entropy``. Then: the longest sequence under a fixed
per-device budget at N = 8 against N = 1 (goal >= 6x); the all-to-all bytes of one layer read
from the compiled program (the scan's body: forward and backward) against the Ulysses paper's
4·s·h/P elements per pass, twice (the backward's all-to-alls carry the gradients of the forward's
four: goal <= 1.05); and step time at the smallest length, N = 8 beside
N = 1 (on a CPU the figure says little beyond "it runs").

    python benchmarks/long_context.py                    # lengths 256 .. 4096
    python benchmarks/long_context.py --smoke            # one length, a tiny model
    python benchmarks/long_context.py --target h100      # the peaks of XLA:GPU, 8 compile-only H100s

``--target h100`` (or ``h200``, ``a100``; needs JAX's CUDA plugin) compiles each step with XLA's
GPU compiler for 8 compile-only GPUs of that kind, as ``zj.plan_step(..., target=...)`` does: the
peaks are XLA:GPU's, in GPU memory only (the checkpointed activations XLA:CPU counts in the same
address space go to pinned host memory), and there is no step time.
"""
import argparse
import os
import re
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
from zerojax._autotp import mesh_for  # noqa: E402
from zerojax.models import gpt  # noqa: E402

MIB = 2**20
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def tiled_loss(cfg, chunk):
    def loss(params, batch):
        h = gpt.hidden_states(cfg, params, batch["inputs"])
        return zj.tiled_cross_entropy(h, params["wte"].T, batch["labels"], chunk_size=chunk)
    return loss


def build(cfg, n, lean, chunk):
    ckpt = {"activation_checkpointing": {"cpu_checkpointing": True}} if lean else {}
    config = zj.ZeroConfig(stage=1, sequence_parallel_size=n, **ckpt)
    mesh, tx = mesh_for(config), optax.adamw(1e-3)
    state = zj.abstract_train_state(lambda k: gpt.init_params(cfg, k), tx, mesh=mesh, config=config)
    loss = tiled_loss(cfg, chunk) if lean else gpt.loss_fn(cfg)
    return state, zj.make_train_step(loss, state), mesh, (tx, config)


def abstract_batch(mesh, seq):
    rows = dict(mesh.shape)["data"]
    spec = jax.ShapeDtypeStruct((rows, seq), np.int32)
    return {"inputs": spec, "labels": spec}


def all_to_all_bytes(text):
    """Bytes of the all-to-all results in the loop bodies of ``text`` (an HLO module), per device:
    with the layers scanned, one layer's forward and backward (the step's other all-to-alls, such
    as the optimizer's over "data" x "seq", are outside the loops)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    total, inside = 0, False
    for line in text.splitlines():
        if line and not line[0].isspace():  # a computation's header (or its closing brace)
            words = line.replace("ENTRY ", "").split()
            inside = bool(words) and words[0].lstrip("%") in bodies
            continue
        head, sep, _ = line.partition(" all-to-all(")
        if not inside or not sep or "=" not in head:
            continue  # the CPU backend writes a tiled all-to-all as a tuple of P pieces: every piece counts
        for kind, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", head.split("=", 1)[1]):
            total += _BYTES.get(kind, 4) * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
    return total


def measure(cfg, n, lean, seq, chunk, target=None):
    cfg = gpt.GPTConfig(**{**cfg.__dict__, "seq_len": seq})
    state, step, mesh, made = build(cfg, n, lean, chunk)
    if target:  # lowered over the CPU mesh for CUDA, compiled by XLA:GPU (as zj.plan_step does)
        from zerojax.stages._device_step import compiler_options
        from zerojax.tools._gpu import compile_for_target

        lowered = step.trace(state, abstract_batch(mesh, seq)).lower(lowering_platforms=("cuda",))
        compiled = compile_for_target(lowered, mesh, target, compiler_options(state.plan, "gpu"))
    else:
        compiled = step.lower(state, abstract_batch(mesh, seq)).compile()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return peak, (compiled, state, mesh, *made)


def step_time(cfg, seq, measured, steps=3):
    """Seconds per step of a step compiled by :func:`measure`, run on a real state."""
    cfg = gpt.GPTConfig(**{**cfg.__dict__, "seq_len": seq})
    step, abstract, mesh, tx, config = measured
    state = zj.shard_train_state(lambda k: gpt.init_params(cfg, k), tx, mesh=mesh, config=config,
                                 rng=jax.random.PRNGKey(0))
    # the same leaves under the compiled program's own tree (its plan object, not an equal one)
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), jax.tree_util.tree_leaves(state))
    rows = dict(mesh.shape)["data"]
    toks = np.random.default_rng(0).integers(0, cfg.vocab, (rows, seq + 1)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "labels": toks[:, 1:]}
    state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    return (time.perf_counter() - t0) / steps, float(m["loss"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one length, a tiny model (seconds)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="per-device budget (default: the N = 1 plain peak at the second length)")
    ap.add_argument("--chunk", type=int, default=128, help="tiled loss chunk (tokens)")
    ap.add_argument("--attn-chunk", type=int, default=None,
                    help="query rows attention takes at a time (default: zj.ulysses_attention chooses)")
    ap.add_argument("--target", default=None, help="compile with XLA's GPU compiler for 8 compile-only GPUs of "
                    "this kind (h100, h200, a100; needs JAX's CUDA plugin)")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.d, args.vocab, args.lengths = 2, 32, 64, [64]
    cfg = gpt.GPTConfig(vocab=args.vocab, n_layer=args.layers, d_model=args.d, n_head=args.heads,
                        seq_len=args.lengths[0], scan=True,
                        attn_chunk=args.attn_chunk)
    modes = [(False, "plain")] if args.smoke else [(False, "plain"), (True, "ckpt+cpu+tiled")]
    chunk = f"attention in chunks of {args.attn_chunk} queries" if args.attn_chunk else "attention chunk chosen"
    where = f"XLA:GPU for 8 compile-only {args.target} GPUs" if args.target else "8 devices"
    print(f"GPT {args.layers} layers, d {args.d}, {args.heads} heads, vocab {args.vocab}, {chunk}; {where}, "
          f"stage 1, fp32, AdamW, one sequence per data-parallel group; peak MiB per device")
    print(f"{'seq':>6} " + " ".join(f"{f'N={n} {name}':>22}" for _, name in modes for n in (1, 8))
          + ("" if args.target else f" {'a2a KiB/layer':>14} {'/ 2x4sh/P':>10}"))
    peaks, a2a, steps = {}, {}, {}
    for seq in args.lengths:
        row = []
        for lean, name in modes:
            for n in (1, 8):
                peak, measured = measure(cfg, n, lean, seq, args.chunk, args.target)
                peaks[(n, name, seq)] = peak
                row.append(f"{peak / MIB:>22.2f}")
                if n == 8 and not lean and not args.target:  # (XLA:GPU's all-to-alls are not read)
                    a2a[seq] = all_to_all_bytes(measured[0].as_text())  # the scan body: one layer, fwd and bwd
                if seq == args.lengths[0] and not lean:
                    steps[n] = measured  # timed below
        paper = 2 * 4 * seq * args.d * 4 / 8  # 4·s·h/P fp32 elements a pass, forward and backward, one layer
        a2a_text = "" if args.target else f" {a2a[seq] / 1024:>14.1f} {a2a[seq] / paper:>10.2f}"
        print(f"{seq:>6} " + " ".join(row) + a2a_text, flush=True)
    budget = args.budget_mib * MIB if args.budget_mib else peaks[(1, "plain", args.lengths[min(1, len(args.lengths) - 1)])]
    print(f"\nbudget {budget / MIB:.2f} MiB per device: the longest sequence that fits")
    for _, name in modes:
        fits = {n: max([s for s in args.lengths if peaks[(n, name, s)] <= budget], default=0) for n in (1, 8)}
        more = [s for s in args.lengths if peaks[(8, name, s)] <= budget] == args.lengths
        ratio = fits[8] / fits[1] if fits[1] else float("nan")
        print(f"  {name:>16}: N=1 {fits[1]}, N=8 {fits[8]}{'+' if more else ''} -> {ratio:.1f}x"
              f"{' (at least: the longest length tried fits)' if more else ''} (goal >= 6x)")
    if args.target:
        return
    seq = args.lengths[0]
    t1, l1 = step_time(cfg, seq, steps[1])
    t8, l8 = step_time(cfg, seq, steps[8])
    print(f"\nstep time at seq {seq}: N=1 {t1 * 1e3:.1f} ms ({1} sequence per device), N=8 {t8 * 1e3:.1f} ms "
          f"(one sequence over 8 devices) -> {t8 / t1:.2f}x; tokens per device per step: N=1 {seq}, N=8 {seq // 8}")


if __name__ == "__main__":
    main()
