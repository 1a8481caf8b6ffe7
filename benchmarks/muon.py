"""Muon's step under ZeRO: collectives, bytes, FLOPs and step time against plain jit.

    python benchmarks/muon.py [--layers 8 --d 256 --batch 64 --rounds 5 --steps 3] [--smoke]

The model: ``layers`` blocks of ``{"a": [d, 4d], "b": [4d, d]}`` (``h = h + tanh(h @ a) @ b``)
and smaller ``{"c": [d, d/4], "e": [d/4, d]}`` matrices, each block scaled by a ``g: [d]`` gain
(AdamW's leaves under Muon), fp32 on 8 simulated devices. Contenders:

* ``zj-muon-s1`` / ``zj-muon-s3``: ``optax.contrib.muon`` at ZeRO stage 1 / 3: recognised,
  Newton–Schulz on whole matrices, each on one owner (zerojax.stages._muon);
* ``zj-optax-s1`` / ``zj-optax-s3``: the same with its lr as a constant schedule, which zerojax
  does not read: updated through optax on the partitioned state (the baseline);
* ``zj-adamw-s1`` / ``zj-adamw-s3``: ``optax.adamw`` at the same stages;
* ``zj-adamw-s0`` / ``zj-muon-s0`` / ``zj-optax-s0``: the same three at stage 0 (replicated
  state: on owners each device orthogonalises 1/N of the matrices and all-gathers the results;
  through optax every device orthogonalises every matrix);
* ``zj-adamw-off-s1`` / ``zj-muon-off-s1`` / ``zj-optax-off-s1``: the stage 1 three with
  ``offload_optimizer="cpu"`` (AdamW in the host kernel; Muon's momentum fetched for the
  update on owners and the AdamW group on the host; through optax: the whole update in a
  host computation);
* ``zo-muon-s1`` / ``zo-optax-s1``: ``zj.zero_optimizer(optax.contrib.muon(...))`` at stage 1
  in the caller's own jitted loop (params replicated): recognised, on owners / through optax;
* ``fsdp-muon``: ``optax.contrib.muon`` under plain ``jax.jit``, every leaf split along its
  largest dimension (GSPMD's FSDP);
* ``ddp-muon``: the same with every leaf replicated.

First the per-device goals (:func:`per_device_goals`): each device's bytes of Muon momentum
(from the state's shards) against 4 Psi_muon / N, within one matrix; and the Newton–Schulz FLOPs
per device of the owner program alone (compiled, XLA's cost analysis) against the same
iterations on one device over N, goal <= 1.15x, on the model and on shapes with fewer matrices
than devices (unbalanced: every owner running every slot of its blocks, padding included).

For each contender, from the compiled step: the collectives (count, by kind) and their bytes per device
(ring volume from the result shapes, :func:`zerojax.tools._compiled.collectives`) over 4 x
params (the fp32 params' bytes), the per-device FLOPs of XLA's cost analysis; then the step time,
the median over ``rounds`` interleaved rounds of ``steps`` steps each. ``--smoke``: one small
layer, one round of one step.
"""
import argparse
import functools
import os
import math
import statistics
import sys
import time
import types

from _common import simulate_devices

simulate_devices(8)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optax.contrib  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.stages._muon import _nodes  # noqa: E402
from zerojax.stages._muon_owners import _newton_schulz, _owners, balance, ns_flops  # noqa: E402
from zerojax.tools._compiled import collectives  # noqa: E402
from vs_plain_jax import fsdp_spec  # noqa: E402

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def make_params(layers: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = max(d // 4, 8)
    mat = lambda m, n: (rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32)  # noqa: E731
    return {f"l{i}": {"a": mat(d, 4 * d), "b": mat(4 * d, d), "c": mat(d, q), "e": mat(q, d),
                      "g": np.ones((d,), np.float32)} for i in range(layers)}


def loss_fn(params, batch):
    h = batch["x"]
    for name in sorted(params, key=lambda k: int(k[1:])):
        p = params[name]
        h = h + jnp.tanh(h @ p["a"]) @ p["b"]
        h = (h + jnp.tanh(h @ p["c"]) @ p["e"]) * p["g"]
    return jnp.mean((h - batch["y"]) ** 2)


@functools.cache
def muon():
    """optax.contrib.muon: recognised, Newton–Schulz on owners. One instance for every contender
    (a transformation is pure): zerojax recognises it once per params' shapes, not once per
    contender (each recognition runs both updates on probes, op by op: seconds)."""
    return optax.contrib.muon(1e-3)


def muon_through_optax():
    """The same numbers with the lr as a (constant) schedule, which zerojax does not read:
    updated through optax on the partitioned state, as every Muon was before."""
    return optax.contrib.muon(optax.constant_schedule(1e-3))


def adamw():
    return optax.adamw(1e-3)


class ZeroJax:
    def __init__(self, params, make_tx, stage, mesh, **config):
        self.state = zj.shard_train_state(params, make_tx(), mesh=mesh, config=zj.ZeroConfig(stage=stage, **config))
        self.step = zj.make_train_step(loss_fn, self.state)

    def compiled(self, batch):
        return self.step.lower(self.state, batch).compile()

    def run(self, batch):
        self.state, metrics = self.step(self.state, batch)
        return metrics["loss"]


class ZeroOpt:
    """``zj.zero_optimizer`` in the caller's own jitted loop: params replicated, the state split."""

    def __init__(self, params, make_tx, stage, mesh):
        self.tx = zj.zero_optimizer(make_tx(), mesh=mesh, config=zj.ZeroConfig(stage=stage))
        self.params = jax.device_put(params, NamedSharding(mesh, P()))
        self.opt_state = self.tx.init(self.params)
        self.batch_sh = NamedSharding(mesh, P("data"))

        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, s = self.tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        self.fn = jax.jit(step, donate_argnums=(0, 1))

    def compiled(self, batch):
        return self.fn.lower(self.params, self.opt_state, jax.device_put(batch, self.batch_sh)).compile()

    def run(self, batch):
        self.params, self.opt_state, loss = self.fn(self.params, self.opt_state, jax.device_put(batch, self.batch_sh))
        return loss


class Plain:
    def __init__(self, params, make_tx, mode, mesh):
        n = mesh.shape["data"]
        spec = (lambda x: P()) if mode == "ddp" else (lambda x: fsdp_spec(x, n) if x.ndim else P())
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        tx = make_tx()
        params_sh = jax.tree_util.tree_map(lambda x: NamedSharding(mesh, spec(x)), shapes)
        opt_sh = jax.tree_util.tree_map(lambda x: NamedSharding(mesh, spec(x)), jax.eval_shape(tx.init, shapes))
        self.params = jax.device_put(params, params_sh)
        self.opt_state = jax.jit(tx.init, out_shardings=opt_sh)(self.params)
        batch_sh = NamedSharding(mesh, P("data"))

        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        self.fn = jax.jit(step, in_shardings=(params_sh, opt_sh, batch_sh), out_shardings=(params_sh, opt_sh, None),
                          donate_argnums=(0, 1))

    def compiled(self, batch):
        return self.fn.lower(self.params, self.opt_state, batch).compile()

    def run(self, batch):
        self.params, self.opt_state, loss = self.fn(self.params, self.opt_state, batch)
        return loss


CONTENDERS = {  # AdamW first: the Muon rows compare their bytes with it
    "zj-adamw-s1": lambda p, m: ZeroJax(p, adamw, 1, m),
    "zj-adamw-s3": lambda p, m: ZeroJax(p, adamw, 3, m),
    "zj-muon-s1": lambda p, m: ZeroJax(p, muon, 1, m),
    "zj-muon-s3": lambda p, m: ZeroJax(p, muon, 3, m),
    "zj-optax-s1": lambda p, m: ZeroJax(p, muon_through_optax, 1, m),
    "zj-optax-s3": lambda p, m: ZeroJax(p, muon_through_optax, 3, m),
    "zj-adamw-s0": lambda p, m: ZeroJax(p, adamw, 0, m),
    "zj-muon-s0": lambda p, m: ZeroJax(p, muon, 0, m),
    "zj-optax-s0": lambda p, m: ZeroJax(p, muon_through_optax, 0, m),
    "zj-adamw-off-s1": lambda p, m: ZeroJax(p, adamw, 1, m, offload_optimizer="cpu"),
    "zj-muon-off-s1": lambda p, m: ZeroJax(p, muon, 1, m, offload_optimizer="cpu"),
    "zj-optax-off-s1": lambda p, m: ZeroJax(p, muon_through_optax, 1, m, offload_optimizer="cpu"),
    "zo-muon-s1": lambda p, m: ZeroOpt(p, muon, 1, m),
    "zo-optax-s1": lambda p, m: ZeroOpt(p, muon_through_optax, 1, m),
    "fsdp-muon": lambda p, m: Plain(p, muon, "fsdp", m),
    "ddp-muon": lambda p, m: Plain(p, muon, "ddp", m),
}


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def momentum_per_device(state) -> dict:
    """Bytes of Muon's momentum each device holds, from the state's shards."""
    per: dict = {}
    for x in jax.tree_util.tree_leaves(_nodes(state.opt_state)[0].mu):
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return per


def ns_program_flops(mesh, counts: dict, mode: str = "balanced") -> float:
    """Per-device FLOPs (XLA's cost analysis) of the owner Newton–Schulz program alone at stage 1
    for ``counts`` ``{(m, n): matrices}``: ``balanced`` (zerojax's), ``full`` (every owner runs
    every slot of its blocks, padding included, as before the balance) or ``one`` (the
    iterations on every matrix, on one device)."""
    n = mesh.shape["data"]
    coeffs = _nodes(optax.contrib.muon(1e-3).init({"w": jnp.zeros((4, 4))}))[0].ns_coeffs
    if mode == "one":
        stacks = {k: jax.ShapeDtypeStruct((c,) + k, jnp.float32) for k, c in counts.items()}
        fn = jax.jit(lambda st: _newton_schulz(st, coeffs, 1e-8, lambda run, x, _: run(x)))
        return flops(fn.lower(stacks).compile())
    per_device = balance(counts, n)
    if mode == "full":
        per_device = tuple({k: -(-c // n) for k, c in counts.items()} for _ in range(n))
    stacks = {k: jax.ShapeDtypeStruct((-(-c // n) * n,) + k, jnp.float32,
                                      sharding=NamedSharding(mesh, P("data"))) for k, c in counts.items()}
    plan = types.SimpleNamespace(data_axis="data", mesh=mesh, stage=1)
    fn = jax.jit(lambda st: _newton_schulz(st, coeffs, 1e-8, _owners(plan), per_device))
    return flops(fn.lower(stacks).compile())


def matrix_counts(params) -> dict:
    counts: dict = {}
    for x in jax.tree_util.tree_leaves(params):
        if x.ndim >= 2:
            key = tuple(x.shape[-2:])
            counts[key] = counts.get(key, 0) + math.prod(x.shape[:-2])
    return counts


def per_device_goals(mesh, params, state) -> None:
    """The per-device goals: Muon momentum bytes = 4 Psi_muon / N (within one matrix) on every
    device, and Newton–Schulz FLOPs per device <= 1.15 x total / N, on the model and on
    weakest-case shapes (fewer matrices of a shape than devices)."""
    n = mesh.shape["data"]
    mats = [x for x in jax.tree_util.tree_leaves(params) if x.ndim >= 2]
    want = 4 * sum(x.size for x in mats) / n
    one = 4 * max(x.shape[-1] * x.shape[-2] for x in mats)
    per = momentum_per_device(state)
    worst = max(abs(b - want) for b in per.values())
    print(f"Muon momentum per device (zj-muon-s1): {min(per.values()) / 1e6:.3f}-{max(per.values()) / 1e6:.3f} MB "
          f"on {len(per)} devices, 4 Psi_muon / N = {want / 1e6:.3f} MB, one matrix {one / 1e6:.3f} MB: "
          f"{'PASS' if len(per) == n and worst <= one else 'FAIL'} (|diff| <= one matrix)")
    d = params["l0"]["a"].shape[0]
    cases = {f"the model ({len(params)} layers)": matrix_counts(params),
             f"3 x [{d},{4 * d}]": {(d, 4 * d): 3},
             f"3 x [{d},{4 * d}] + 5 x [{4 * d},{d}]": {(d, 4 * d): 3, (4 * d, d): 5},
             "3 layers": {k: 3 for k in matrix_counts(params)}}
    print("Newton–Schulz FLOPs per device, stage 1: the owner program alone, compiled, against the same "
          "iterations on one device over N (goal <= 1.15x; floor: whole matrices on owners, the costliest "
          "matrix or total/N)")
    print(f"  {'case':<34} {'total/N':>9} {'unbalanced':>10} {'balanced':>9} {'x total/N':>9} {'floor':>6}  goal")
    for name, counts in cases.items():
        exact = sum(c * ns_flops(*k) for k, c in counts.items())
        floor = max(exact / n, max(ns_flops(*k) for k in counts)) / (exact / n)
        total = ns_program_flops(mesh, counts, "one")
        full, mine = ns_program_flops(mesh, counts, "full"), ns_program_flops(mesh, counts)
        ratio = mine / (total / n)
        verdict = "PASS" if ratio <= 1.15 else "FAIL" + (" (the floor)" if floor > 1.15 else "")
        print(f"  {name:<34} {total / n:>9.2e} {full:>10.2e} {mine:>9.2e} {ratio:>9.2f} {floor:>6.2f}  {verdict}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--contenders", nargs="*", default=list(CONTENDERS))
    ap.add_argument("--smoke", action="store_true", help="1 layer of d 64, one round of one step")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.d, args.batch, args.rounds, args.steps = 1, 64, 16, 1, 1
    mesh = zj.make_mesh()
    params = make_params(args.layers, args.d)
    psi = sum(x.size for x in jax.tree_util.tree_leaves(params))
    muon_psi = sum(x.size for x in jax.tree_util.tree_leaves(params) if x.ndim == 2)
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((args.batch, args.d)).astype(np.float32),
             "y": rng.standard_normal((args.batch, args.d)).astype(np.float32)}
    print(f"{args.layers} layers, d {args.d}, batch {args.batch}, {psi / 1e6:.2f}M params "
          f"({muon_psi / psi:.3f} of them in Muon's matrices), {mesh.shape['data']} devices, fp32")
    runners = {name: CONTENDERS[name](params, mesh) for name in args.contenders}
    per_device_goals(mesh, params, runners["zj-muon-s1"].state if "zj-muon-s1" in runners
                     else ZeroJax(params, muon, 1, mesh).state)
    head = (f"{'contender':<15} {'collectives':>11} {'bytes/4Psi':>10} {'-adamw':>7} {'FLOPs/dev':>10}  by kind   "
            "(-adamw: bytes over AdamW's at the same stage, in Muon params' bytes)")
    print(head)
    reports = {}
    for name, r in runners.items():
        c = r.compiled(batch)
        reports[name] = rep = collectives(c.as_text())
        kinds = ", ".join(f"{rep.count(k)} {k}" for k in KINDS if rep.count(k))
        count = sum(rep.count(k) for k in rep.kinds)
        adamw = reports.get("zj-adamw-" + name[-2:]) if name.startswith("zj-") else None
        over = f"{(rep.total_bytes - adamw.total_bytes) / (4 * muon_psi):>7.2f}" if adamw else f"{'':>7}"
        print(f"{name:<15} {count:>11} {rep.total_bytes / (4 * psi):>10.2f} {over} {flops(c):>10.2e}  {kinds or '-'}")
    times = {name: [] for name in runners}
    for r in runners.values():  # compile and warm up
        jax.block_until_ready(r.run(batch))
    for _ in range(args.rounds):
        for name, r in runners.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = r.run(batch)
            jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times["ddp-muon"]) if "ddp-muon" in times else None
    print(f"{'contender':<15} {'ms/step':>9} {'x ddp-muon':>11}   ({args.rounds} interleaved rounds of {args.steps})")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<15} {med * 1e3:>9.2f} {med / base if base else float('nan'):>11.2f}")


if __name__ == "__main__":
    main()
