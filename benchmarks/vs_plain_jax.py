"""zerojax against the JAX a user would write instead, side by side in one run.

The alternatives, written the way a JAX user would:

* plain DDP: ``jax.jit`` of value_and_grad + the optax update, params and optimizer state
  replicated, the batch split over the devices, params and state donated (outputs in the
  same order as the inputs);
* plain FSDP (GSPMD): the same function with every leaf split along its largest dimension
  that the device count divides (replicated when none does).

zerojax runs at its defaults (DeepSpeed's); stage 3 once more with
``param_persistence_threshold: 0`` (``s3p0``: every param partitioned, the small ones too),
the setting closest to FSDP and the slower of the two on these CPU devices; and stage 3 with the
values Hugging Face's integration writes for a config's "auto" (``s3auto``: prefetch bucket
0.9 * d^2, persistence threshold 10 * d), the stage-3 setting of most public configs.

Same model, batch, optimizer (AdamW, fp32) and devices for every contender. Each step is
compiled first, then the contenders are timed in interleaved rounds (machine noise hits them
alike) and the median ms per step is compared. Goals: stage 0 <= 1.02x DDP, stages 1-2 <=
0.90x DDP, stage 3 <= 1.0x FSDP and <= 1.10x stage 0; one device, optimizer-bound 50M
params: stage 0 <= 1.05x jit(optax).

    python benchmarks/vs_plain_jax.py                    # the two small GPT shapes + optimizer-bound
    python benchmarks/vs_plain_jax.py --shapes gpt2-small
    python benchmarks/vs_plain_jax.py --smoke            # tiny shapes, for the test suite
"""
import argparse
import functools
import statistics
import time

from _common import simulate_devices

simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402

SHAPES = {
    "vocab50257-d128": dict(vocab=50257, n_layer=4, d_model=128, n_head=4),
    "vocab8192-d256": dict(vocab=8192, n_layer=4, d_model=256, n_head=4),
    # Llama's 32000 with one added token (a pad), as fine-tuning configs often have: odd, like GPT-2's
    "vocab32001-d160": dict(vocab=32001, n_layer=4, d_model=160, n_head=4),
    # peak_memory.py's model for the lean stage-3 figure (0.155x stage 0's compiled peak)
    "vocab8192-d256-12l": dict(vocab=8192, n_layer=12, d_model=256, n_head=8),
    "gpt2-small": dict(vocab=50257, n_layer=12, d_model=768, n_head=12),
    "smoke": dict(vocab=517, n_layer=1, d_model=32, n_head=2),
}
GOALS = {"s0/ddp": 1.02, "s1/ddp": 0.90, "s2/ddp": 0.90, "s3/fsdp": 1.0, "s3/s0": 1.10, "s3p0/fsdp": 1.0,
         "s3p0/s0": 1.10, "s3auto/fsdp": 1.0, "s3lean/fsdp": 1.0}


OPTIMIZERS = {"adamw": lambda: optax.adamw(1e-4, weight_decay=0.01),
              # no gated pass for these: the overflow skip is a select over the state
              "lion": lambda: optax.lion(1e-5, weight_decay=0.01),
              "sgd-momentum": lambda: optax.sgd(1e-3, momentum=0.9)}
tx = OPTIMIZERS["adamw"]  # the GPT cases' optimizer


def plain_step(loss, params_sh, opt_sh, batch_sh, make_tx=tx):
    """The user's jitted step: params and optimizer state donated, outputs in input order."""
    opt = make_tx()

    @functools.partial(jax.jit, in_shardings=(params_sh, opt_sh, batch_sh), out_shardings=(params_sh, opt_sh, None),
                       donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def fsdp_spec(x, n: int) -> P:
    """Split along the largest dimension that ``n`` divides; replicate when none does."""
    dims = [i for i in np.argsort(x.shape)[::-1] if x.shape[i] % n == 0 and x.shape[i] >= n]
    if not dims:
        return P()
    spec = [None] * x.ndim
    spec[dims[0]] = "data"
    return P(*spec)


def host_params(init):
    """The params ``init()`` makes, computed once and held in host memory. Every contender is
    placed from these (the same values for all), and none compiles the initialiser again: a
    GPT's per-leaf random draws cost about as much to compile as a small step."""
    return jax.device_get(jax.jit(init)())


@functools.lru_cache(maxsize=1)
def gpt_params(cfg: GPTConfig):
    """A GPT's params in host memory (:func:`host_params`), made once per config."""
    return host_params(functools.partial(init_params, cfg, jax.random.PRNGKey(0)))


class Plain:
    """The plain-jit contender, placed from ``params`` (a host tree, :func:`host_params`)."""

    def __init__(self, mode, mesh, params, loss, make_tx=tx):
        n = mesh.shape["data"]
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        opt_shapes = jax.eval_shape(make_tx().init, shapes)
        if mode == "ddp":
            spec = lambda x: P()  # noqa: E731
        else:
            spec = lambda x: fsdp_spec(x, n) if hasattr(x, "shape") and x.ndim else P()  # noqa: E731
        params_sh = jax.tree_util.tree_map(lambda x: NamedSharding(mesh, spec(x)), shapes)
        opt_sh = jax.tree_util.tree_map(lambda x: NamedSharding(mesh, spec(x)), opt_shapes)
        self.batch_sh = NamedSharding(mesh, P("data"))
        self.params = jax.device_put(params, params_sh)
        self.opt_state = jax.jit(make_tx().init, out_shardings=opt_sh)(self.params)
        self.fn = plain_step(loss, params_sh, opt_sh, self.batch_sh, make_tx)
        self.shardings = (params_sh, opt_sh)

    def park(self):  # to host memory (numpy), freeing the devices' buffers
        self.host = jax.device_get((self.params, self.opt_state))
        self.params = self.opt_state = None

    def unpark(self):
        self.params, self.opt_state = jax.device_put(self.host, self.shardings)
        self.host = None

    def run(self, batch):
        self.params, self.opt_state, value = self.fn(self.params, self.opt_state, batch)
        return value

    def ready(self):
        jax.block_until_ready((self.params, self.opt_state))


class Zero:
    """A zerojax contender, placed from ``params`` (a host tree, :func:`host_params`)."""

    def __init__(self, stage, mesh, params, loss, make_tx=tx, **settings):
        config = zj.ZeroConfig(stage=stage, **settings)
        self.state = zj.shard_train_state(params, make_tx(), mesh=mesh, config=config)
        self.step = zj.make_train_step(loss, self.state)
        self.shardings = self.state.shardings

    def park(self):
        self.host = jax.device_get(self.state)
        self.state = None

    def unpark(self):
        self.state = jax.device_put(self.host, self.shardings)
        self.host = None

    def run(self, batch):
        self.state, m = self.step(self.state, batch)
        return m["loss"]

    def ready(self):
        jax.block_until_ready(self.state)


def time_all(contenders, batch, rounds, steps, warmup=1, swap=False):
    """Median seconds per step of each contender, in interleaved rounds, every other round in
    reverse order (so no contender always follows the same one). With ``swap`` only the
    contender being timed holds device memory: the others wait parked in host memory (moving
    them is not timed)."""
    def turn(c, n):
        if swap:
            c.unpark()
        t0 = time.perf_counter()
        for _ in range(n):
            c.run(batch)
        c.ready()
        took = time.perf_counter() - t0
        if swap:
            c.park()
        return took

    for c in contenders.values():  # compile and warm up
        turn(c, warmup)
    times = {k: [] for k in contenders}
    for r in range(rounds):
        for k in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
            times[k].append(turn(contenders[k], steps) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def report(title, ms, ratios):
    print(f"\n{title}")
    print("  " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ms.items()))
    for name, (value, goal) in ratios.items():
        verdict = "ok" if value <= goal else "MISSED"
        print(f"  {name:>11} {value:6.3f}x   goal <= {goal:.2f}x   {verdict}")


RATIOS = {"s0/ddp": ("s0", "ddp"), "s1/ddp": ("s1", "ddp"), "s2/ddp": ("s2", "ddp"), "s3/fsdp": ("s3", "fsdp"),
          "s3/s0": ("s3", "s0"), "s3p0/fsdp": ("s3p0", "fsdp"), "s3p0/s0": ("s3p0", "s0"),
          "s3auto/fsdp": ("s3auto", "fsdp"), "s3lean/fsdp": ("s3lean", "fsdp")}
ALL = ["ddp", "fsdp", "s0", "s1", "s2", "s3", "s3p0", "s3auto", "s3lean"]


def build(name, mesh, params, loss, d_model):
    """``ddp``/``fsdp``: plain jit; ``s0``-``s3``: zerojax at its defaults (DeepSpeed's);
    ``s3p0``: stage 3 with ``param_persistence_threshold: 0``, every param partitioned (no
    small param kept whole), the setting closest to FSDP; ``s3auto``: stage 3 with a config's
    "auto" bucket and threshold as Hugging Face fills them in; ``s3lean``: stage 3 at
    ``max_reuse_distance: 0`` under the "auto" bucket (0.9 * d^2), peak_memory.py's lean run."""
    if name in ("ddp", "fsdp"):
        return Plain(name, mesh, params, loss)
    settings = {}
    # a config's "auto" values, filled in by zerojax's own reading of them, as zj.initialize does
    auto = zj.ZeroConfig.from_deepspeed(
        {"train_micro_batch_size_per_gpu": 1,
         "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                               "stage3_param_persistence_threshold": "auto"}},
        world_size=mesh.shape["data"], hidden_size=d_model)
    if name == "s3p0":
        settings = {"param_persistence_threshold": 0}
    elif name == "s3auto":
        settings = {"prefetch_bucket_size": auto.prefetch_bucket_size,
                    "param_persistence_threshold": auto.param_persistence_threshold}
    elif name == "s3lean":
        settings = {"max_reuse_distance": 0, "prefetch_bucket_size": auto.prefetch_bucket_size}
    return Zero(int(name[1]), mesh, params, loss, **settings)


def gpt_case(name, args):
    """Every contender in one set of interleaved rounds; with ``--pairs`` each ratio is timed on
    its own pair, still side by side in interleaved rounds. GPT-2 small (always in pairs): a
    replicated 124M-param AdamW state is 1.5 GB per simulated device, so two of them do not fit
    in 24 GiB together; in the pairs holding one the contender not being timed waits in host
    memory."""
    cfg = GPTConfig(seq_len=args.seq, **SHAPES[name])
    swap = name == "gpt2-small"
    # GPT-2 small: on 8 simulated devices one replicated AdamW state alone (12 GB, its gradients
    # and the update's temporaries) exhausts 24 GiB, so it runs on 4 (--gpt2-devices)
    mesh = zj.make_mesh(args.gpt2_devices if swap else None)
    n = mesh.shape["data"]
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab, (args.batch, cfg.seq_len + 1), dtype=np.int32)}
    params = gpt_params(cfg)
    loss = loss_fn(cfg)
    wanted = {k: RATIOS[k] for k in args.ratios}
    names = [k for k in ALL if any(k in pair for pair in wanted.values())]
    groups = [list(pair) for pair in wanted.values()] if args.pairs or swap else [names]
    ms, ratios = {}, {}
    shared = {}  # --smoke: a contender is built (and compiled) once and serves every pair it is in
    for group in groups:
        # park only where a replicated AdamW state (plain DDP, stage 0) would not fit beside another
        parked = swap and bool({"ddp", "s0"} & set(group))
        contenders = {}
        for k in group:
            if getattr(args, "smoke", False):
                contenders[k] = shared.get(k) or shared.setdefault(k, build(k, mesh, params, loss, cfg.d_model))
            else:
                contenders[k] = build(k, mesh, params, loss, cfg.d_model)
            if parked:
                contenders[k].park()
        got = time_all(contenders, batch, args.rounds, args.steps, swap=parked)
        del contenders
        for key, (a, b) in wanted.items():
            if a in got and b in got and key not in ratios:
                ratios[key] = got[a] / got[b]
        for k, v in got.items():
            ms.setdefault(k, v)
    report(f"GPT {name}: {cfg.n_params / 1e6:.1f}M params, {n} devices, batch {args.batch} x {cfg.seq_len}, "
           "AdamW fp32" + (" (each ratio from its own pair)" if len(groups) > 1 else ""), ms,
           {k: (v, GOALS[k]) for k, v in ratios.items()})
    return ratios


def optimizer_bound_case(args):
    """One device, 50M fp32 params, a loss that costs next to nothing: the update dominates."""
    n_params = args.opt_params
    mesh = zj.make_mesh(1)
    widths = [4096] * (n_params // 4096 // 4096) + [n_params % (4096 * 4096) // 4096 or 1]
    key = jax.random.PRNGKey(0)

    def init():
        return {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (rows, 4096)) * 0.02
                for i, rows in enumerate(widths)}

    def loss(params, batch):  # batch["x"]: one row per device
        return sum(jnp.vdot(p[0], batch["x"][0]) for p in params.values()) / len(params)

    params = host_params(init)
    batch = {"x": np.ones((1, 4096), np.float32)}
    total = sum(r * 4096 for r in widths)
    for name in args.opt_tx:
        make_tx = OPTIMIZERS[name]
        contenders = {"jit": Plain("ddp", mesh, params, loss, make_tx), "s0": Zero(0, mesh, params, loss, make_tx)}
        ms = time_all(contenders, batch, args.rounds, args.steps)
        del contenders
        report(f"optimizer-bound: one device, {total / 1e6:.1f}M fp32 params, {name}", ms,
               {"s0/jit": (ms["s0"] / ms["jit"], 1.05)})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["vocab50257-d128", "vocab8192-d256"],
                    choices=[k for k in SHAPES if k != "smoke"])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--opt-params", type=int, default=50 * 2**20)
    ap.add_argument("--no-optimizer-bound", action="store_true")
    ap.add_argument("--opt-tx", nargs="*", default=["adamw", "lion", "sgd-momentum"], choices=list(OPTIMIZERS),
                    help="optimizers of the optimizer-bound case (AdamW has the gated pass; the others select)")
    ap.add_argument("--gpt2-devices", type=int, default=4, help="simulated devices for gpt2-small")
    ap.add_argument("--pairs", action="store_true", help="time each ratio on its own pair (less memory; "
                    "always on for gpt2-small)")
    ap.add_argument("--ratios", nargs="*", default=list(RATIOS), choices=list(RATIOS),
                    help="the ratios to time (default: all); only their contenders are built")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round, each contender built once "
                    "for every pair it is in (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:  # seconds, not minutes: tiny shapes, a row per device, one round, each contender compiled once
        args.shapes, args.seq, args.rounds, args.steps, args.opt_params = ["smoke"], 8, 1, 1, 4096 * 8
        args.batch = jax.device_count()
    for name in args.shapes:
        gpt_case(name, args)
    if not args.no_optimizer_bound:
        optimizer_bound_case(args)


if __name__ == "__main__":
    main()
