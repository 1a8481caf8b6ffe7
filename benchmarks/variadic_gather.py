"""What stages 1-2 would compile with one all-gather of many operands per bucket, and whether
JAX's partitioner accepts one.

Stages 1 and 2 gather the updated params in buckets (``allgather_bucket_size``): each device's
shards of a bucket's leaves are packed into one flat row, one all-gather moves the rows, and
every leaf is then copied out of the gathered (devices, elements) buffer into its own array.
Those copies are one compiled kernel per leaf shape that plain DDP does not have (its gradient
all-reduces, combined by XLA into one of many operands, write every leaf in place), and on the
CPU backend each kernel more is compile time more. XLA's HLO has an all-gather of many operands
too: one collective per bucket that writes each gathered leaf into its own buffer. This script
measures what stage 1's step would compile with it, and whether the partitioner compiles it:

* **the partitioners**: a two-operand ``stablehlo.all_gather`` in a body manual over the data
  axis, compiled and run in a child process under Shardy (JAX's default) and under GSPMD: "runs"
  or the compiler's error (a child that aborts is a result here, not a crash of this script);
* **the step** (in a child process under GSPMD, where such an all-gather compiles): plain DDP,
  stage 1 as shipped and stage 1 with its bucketed all-gather replaced by one all-gather of
  many operands per bucket (``s1v``): kernels compiled, first step in paired rounds, and the
  params after the same steps (``s1v`` must equal ``s1``).

    python benchmarks/variadic_gather.py --layers 4 8 --kinds scan --rounds 4
    python benchmarks/variadic_gather.py --smoke

The all-gather of many operands is built here from JAX's internal lowering helpers (its public
``lax.all_gather`` binds one operand per collective); where this JAX has moved them, both
verdicts say "not built on this JAX" and the step is not measured.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

if __name__ == "__main__" or os.environ.get("ZJ_VARIADIC_CHILD"):
    from _common import simulate_devices

    simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

CHILD = "ZJ_VARIADIC_CHILD"


def variadic_all_gather():
    """``gather(xs, axis_name, n) -> [each x gathered along dim 0]`` through ONE all-gather of
    all of ``xs`` (tiled, dim 0), for bodies manual over ``axis_name``."""
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lax import parallel
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax._src.sharding_impls import ShardingContext, SPMDAxisContext

    prim = core.Primitive("zj_variadic_all_gather")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *xs, axis_name, n: [x.update(shape=(x.shape[0] * n,) + x.shape[1:]) for x in xs])

    def lower(ctx, *xs, axis_name, n):
        axis_ctx = ctx.module_context.axis_context
        extra = {}
        if isinstance(axis_ctx, (SPMDAxisContext, ShardingContext)):  # partitions, not replicas
            extra = {"channel_handle": hlo.ChannelHandle.get(mlir.COLLECTIVE_CHANNEL_ID, mlir.DEVICE_TO_DEVICE_TYPE),
                     "use_global_device_ids": ir.BoolAttr.get(True)}
        groups = parallel._replica_groups_hlo(parallel._replica_groups(axis_ctx, axis_name, None))
        types = [mlir.aval_to_ir_type(ctx.module_context, aval) for aval in ctx.avals_out]
        return hlo.AllGatherOp(types, list(xs), all_gather_dim=mlir.i64_attr(0), replica_groups=groups,
                               **extra).results

    mlir.register_lowering(prim, lower)
    return lambda xs, axis_name, n: prim.bind(*xs, axis_name=axis_name, n=n)


def variadic_bucketed_gather(gather):
    """A drop-in for ``zerojax.stages._collectives.bucketed_gather``: the same buckets, each one
    all-gather of its leaves' shards (split dim moved to the front, as the one-leaf gather does)."""
    import zerojax._placement as placement
    from zerojax.stages import _collectives as C

    def bucketed_gather(shards, lays, axis_name, n, bucket_size):
        out = [None] * len(shards)
        for members in C.bucket_members(shards, lays, bucket_size):
            moved = [jnp.moveaxis(shards[i], lays[i].axis, 0) for i in members]
            for i, full in zip(members, gather(moved, axis_name, n)):
                out[i] = placement.unpad(jnp.moveaxis(full, 0, lays[i].axis), lays[i])
        return out

    return bucketed_gather


# ---------------------------------------------------------------------------- child processes
def child_partitioner(name: str) -> None:
    """Compile and run a two-operand all-gather under partitioner ``name``; print JSON."""
    jax.config.update("jax_use_shardy_partitioner", name == "shardy")
    import zerojax as zj
    from jax.sharding import PartitionSpec as P

    from zerojax._compat import shard_map

    try:
        gather = variadic_all_gather()
    except Exception as e:  # noqa: BLE001 - this JAX moved the internals it is built from
        print(json.dumps({"runs": False, "error": f"not built on this JAX: {e!r}"[:300]}))
        return
    mesh = zj.make_mesh()
    n = mesh.shape["data"]

    def body(a, b):
        x, y = gather([a * 2, b * 2], "data", n)
        return x + 1, y + 1

    fn = jax.jit(shard_map(body, mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P())))
    a, b = np.arange(2.0 * n, dtype=np.float32).reshape(2 * n, 1), np.arange(3.0 * n, dtype=np.float32).reshape(n, 3)
    try:
        x, y = fn(a, b)
        ok = bool(np.array_equal(np.asarray(x), a * 2 + 1) and np.array_equal(np.asarray(y), b * 2 + 1))
        print(json.dumps({"runs": ok, "error": None if ok else "wrong values"}))
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the figure
        print(json.dumps({"runs": False, "error": str(e).strip().splitlines()[0][:300]}))


def child_step(spec: str) -> None:
    """Under GSPMD: DDP, stage 1 and stage 1 with the variadic gather: kernels, paired first
    steps, params after the same steps. Prints JSON."""
    jax.config.update("jax_use_shardy_partitioner", False)
    import compile_time as ct
    import zerojax as zj
    from zerojax.stages import _collectives as C

    layers, kind, vocab, d, seq, batch_rows, rounds = spec.split(",")
    cfg = ct.gpt_config(int(layers), kind, int(vocab), int(d), int(seq))
    batch = ct.batch_for(cfg, int(batch_rows))
    shipped, variadic = C.bucketed_gather, variadic_bucketed_gather(variadic_all_gather())
    names = ("ddp", "s1", "s1v")
    mesh = zj.make_mesh()
    contenders = {k: ct.Contender(k.rstrip("v"), mesh, cfg) for k in names}

    def use(k):
        C.bucketed_gather = variadic if k == "s1v" else shipped

    kernels = {}
    for k, c in contenders.items():
        use(k)
        ct.forget()
        fn, call_args = c.jitted(batch)
        kernels[k] = ct.kernel_counts(fn.trace(*call_args).lower())
    times = {k: [] for k in names}
    for r in range(int(rounds)):
        for k in (names if r % 2 == 0 else names[::-1]):
            use(k)
            ct.forget()
            times[k].append(contenders[k].first_step(batch))
    use("s1")
    leaves = [jax.tree_util.tree_leaves(contenders[k].state.params) for k in ("s1", "s1v")]
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(*leaves))
    pairs = {k: sorted(z[0] / p[0] for z, p in zip(times[k], times["ddp"])) for k in ("s1", "s1v")}
    print(json.dumps({"kernels": kernels, "times": times, "per_round": pairs, "params_max_diff": diff}))


def run_child(value: str, **env) -> dict:
    """One child process of this script (``value``: what it measures), ``env`` added to its
    environment; its JSON, or why it printed none."""
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=dict(os.environ, **{CHILD: value}, **env),
                         capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    if res.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return {"runs": False, "error": f"the process ended with code {res.returncode}: {tail}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--kinds", nargs="*", default=["scan", "loop"], choices=["loop", "scan"])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.kinds, args.d, args.vocab, args.seq, args.batch, args.rounds = [1], ["scan"], 32, 517, 8, 8, 1
    figures = {"partitioners": {}, "steps": {}}
    for name in ("shardy", "gspmd"):
        got = figures["partitioners"][name] = run_child(f"partitioner,{name}")
        print(f"all-gather of two operands under {name}: " + ("runs" if got["runs"] else f"fails: {got['error']}"),
              flush=True)
    if not figures["partitioners"]["gspmd"]["runs"]:
        print("no partitioner compiles it: the step is not measured")
        print(json.dumps(figures))
        return
    print(f"first step, GPT d {args.d}, vocab {args.vocab}, AdamW fp32, batch {args.batch} x {args.seq}, "
          f"{jax.device_count()} devices, GSPMD, {args.rounds} interleaved rounds; per-round ratios over DDP: "
          "median (lowest-highest)", flush=True)
    for kind in args.kinds:
        for layers in args.layers:
            spec = f"step,{layers},{kind},{args.vocab},{args.d},{args.seq},{args.batch},{args.rounds}"
            got = figures["steps"][f"{kind}-{layers}"] = run_child(spec)
            if "kernels" not in got:
                print(f"{kind:>4} {layers:>3} layers  failed: {got['error']}", flush=True)
                continue
            k = {name: v.get("kernels", 0) for name, v in got["kernels"].items()}
            per = {name: statistics.median(v) for name, v in got["per_round"].items()}
            print(f"{kind:>4} {layers:>3} layers  kernels ddp {k['ddp']} s1 {k['s1']} s1v {k['s1v']}   "
                  + "  ".join(f"{name}/ddp {per[name]:.2f} ({got['per_round'][name][0]:.2f}-"
                              f"{got['per_round'][name][-1]:.2f})" for name in per)
                  + f"   s1v params - s1 params: {got['params_max_diff']:.1e}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    if os.environ.get(CHILD, "").startswith("partitioner,"):
        child_partitioner(os.environ[CHILD].split(",", 1)[1])
    elif os.environ.get(CHILD, "").startswith("step,"):
        child_step(os.environ[CHILD].split(",", 1)[1])
    else:
        main()
