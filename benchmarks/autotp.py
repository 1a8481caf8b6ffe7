"""AutoTP (TP 2 x DP 4) against plain ZeRO data parallelism (DP 8), stage by stage, in one run.

A Hugging Face FlaxLlamaForCausalLM (random init, nothing downloaded) on 8 devices. For each
ZeRO stage 1, 2, 3 both layouts train the same global batch through ``zj.initialize``: DP 8 on
``zj.make_mesh()``, and ``"tensor_parallel": {"autotp_size": 2}`` on the (data 4, model 2) mesh it
builds. Printed side by side: stored bytes on the most loaded device (params + master +
optimizer state, ``zj.memory_report``) and the median step time over interleaved rounds (every
run takes one round in turn, so machine noise hits them alike).

DeepSpeed's claim to compare with: "AutoTP + ZeRO-1 achieves ZeRO-3-like memory savings":
at stage 1 the projections' params are split over "model", and their optimizer state over
both axes. On simulated CPU devices step times say little about accelerators.

    python benchmarks/autotp.py [--hidden 256] [--layers 4] [--rounds 5] [--steps 3]
    python benchmarks/autotp.py --smoke [--stages 1]   # tiny shapes, one round
"""
import argparse
import statistics
import time
import warnings

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402


def llama(args):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=2 * max(32, args.seq) + 1)  # odd: never the head dim,
    # which Flax Llama (transformers 4.57) cannot init with (a rotary shape mismatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers: Flax classes end with v5
        model = transformers.FlaxLlamaForCausalLM(cfg, seed=0)
    params = jax.tree_util.tree_map(np.asarray, model.params)

    def loss_fn(p, batch):
        logits = model(batch["ids"], params=p).logits[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    return params, loss_fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2, help="micro batch per data-parallel rank at DP 8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per round")
    ap.add_argument("--stages", default="1,2,3", help="ZeRO stages to compare, e.g. 1,3")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.seq, args.rounds, args.steps = 32, 1, 64, 8, 1, 1

    params, loss_fn = llama(args)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    global_batch = 8 * args.micro
    batch = {"ids": np.random.default_rng(0).integers(0, args.vocab, (global_batch, args.seq)).astype(np.int32)}
    print(f"Llama {n_params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers), 8 devices, fp32, "
          f"global batch {global_batch} x {args.seq}")

    stages = [int(s) for s in args.stages.split(",")]
    runs = {}
    for stage in stages:
        for tp in (1, 2):
            cfg = {"train_batch_size": global_batch, "gradient_clipping": 1.0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                   "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0}
                                                            if stage == 3 else {})}}
            if tp > 1:
                cfg["tensor_parallel"] = {"autotp_size": tp}
            state, step = zj.initialize(params, loss_fn, cfg)
            state, _ = step(state, batch)  # compile
            jax.block_until_ready(state)
            runs[stage, tp] = [state, step, [], zj.memory_report(state).max_bytes("device")]
    for _ in range(args.rounds):
        for run in runs.values():
            state, step, times, _ = run
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, _ = step(state, batch)
            jax.block_until_ready(state)
            times.append((time.perf_counter() - t0) / args.steps)
            run[0] = state

    print(f"{'stage':>5} | {'DP 8 MiB/dev':>12} {'TP2xDP4 MiB/dev':>15} {'ratio':>6} | "
          f"{'DP 8 ms':>8} {'TP2xDP4 ms':>10} {'ratio':>6}")
    for stage in stages:
        (_, _, t_dp, b_dp), (_, _, t_tp, b_tp) = runs[stage, 1], runs[stage, 2]
        ms_dp, ms_tp = statistics.median(t_dp) * 1e3, statistics.median(t_tp) * 1e3
        print(f"{stage:>5} | {b_dp / 2**20:>12.3f} {b_tp / 2**20:>15.3f} {b_tp / b_dp:>5.2f}x | "
              f"{ms_dp:>8.1f} {ms_tp:>10.1f} {ms_tp / ms_dp:>5.2f}x")
    print(f"medians of {args.rounds} interleaved rounds of {args.steps} steps; bytes: params + master + optimizer "
          "state on the most loaded device")


if __name__ == "__main__":
    main()
