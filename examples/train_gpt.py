"""Train a small GPT on real text with ZeRO over 8 simulated devices.

The corpus is the source of Python's own standard library (present on every machine),
read as bytes: a 256-token vocabulary and no download.

    python examples/train_gpt.py                                   # ZeRO-2, bf16, 200 steps
    python examples/train_gpt.py --stage 3 --precision fp32 --steps 100
    python examples/train_gpt.py --stage 2 --grad-accum 4 --precision fp16
    python examples/train_gpt.py --stage 3 --offload-optimizer cpu --offload-param cpu
    python examples/train_gpt.py --zeropp                          # ZeRO-3 + qwZ, hpZ (2 nodes x 4), qgZ
    python examples/train_gpt.py --stage 3 --qwz --hpz 4 --qgz --qgz-bits 8
    python examples/train_gpt.py --bf16-states                     # bf16 master + moments: 6 bytes/param
    python examples/train_gpt.py --bf16-states --stochastic-rounding
    python examples/train_gpt.py --stage 2 --offload-optimizer nvme --nvme-path /local/nvme
    python examples/train_gpt.py --deepspeed-config examples/ds_configs/zero3_offload.json

With ``--deepspeed-config`` the JSON decides the stage, offload, precision blocks and optimizer,
its "auto" values filled from this script's options (--batch, --grad-accum, --lr, --clip,
--steps, --precision) as DeepSpeed's Hugging Face integration fills them; a value written in the
file that disagrees with an option is an error naming both.
"""
import argparse
import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig, init_params, loss_fn  # noqa: E402

STDLIB_FILES = ("argparse.py", "textwrap.py", "difflib.py", "inspect.py", "typing.py", "dataclasses.py",
                "functools.py", "pathlib.py", "shutil.py", "tarfile.py", "zipfile.py", "subprocess.py")


def load_corpus() -> np.ndarray:
    root = os.path.dirname(os.__file__)
    chunks = []
    for name in STDLIB_FILES:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                chunks.append(f.read())
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8).astype(np.int32)
    if data.size < 100_000:
        sys.exit(f"corpus too small ({data.size} bytes) under {root}")
    return data


def sample_batch(rng, data, batch, seq):
    starts = rng.integers(0, data.size - seq - 1, batch)
    tokens = np.stack([data[s:s + seq + 1] for s in starts])
    # shifted before any split: with --seq-parallel the sequence dim is split over "seq"
    return {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}


def read_config(path: str) -> dict:
    """A DeepSpeed JSON as a dict ({} when it cannot be read: zj.initialize then says what is wrong
    with the file)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def config_sequence_parallel(raw: dict):
    """A DeepSpeed config's sequence_parallel_size (None when it has none)."""
    value = raw.get("sequence_parallel_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def config_precision(raw: dict) -> str:
    """The precision a DeepSpeed config asks for: its enabled fp16/bf16 block, bf16 where one says
    "auto" (filled from the training arguments, which then ask for bf16), fp32 without either."""
    enabled = {name: (raw.get(name) or {}).get("enabled") if isinstance(raw.get(name), dict) else None
               for name in ("fp16", "bf16")}
    for name, value in enabled.items():
        if value is True:
            return name
    return "bf16" if "auto" in enabled.values() else "fp32"


def build(args, cfg, mesh):
    """(state, step, global batch) from the options, or from the DeepSpeed config file."""
    n = dict(mesh.shape)["data"]  # data-parallel groups (devices / --seq-parallel)
    init = lambda k: init_params(cfg, k)  # noqa: E731
    micro, rem = divmod(args.batch, n * args.grad_accum)
    if rem or micro < 1:
        sys.exit(f"error: --batch {args.batch} must be a multiple of {n} devices x --grad-accum {args.grad_accum}")
    warmup = max(1, args.steps // 10)
    if args.deepspeed_config:
        given = [f"--{k.replace('_', '-')}" for k in ("stage", "offload_optimizer", "offload_param", "nvme_path", "hpz",
                                                      "devices_per_node") if getattr(args, k) is not None]
        given += [f"--{k}" for k in ("qwz", "qgz", "zeropp") if getattr(args, k)]
        given += [f"--{k.replace('_', '-')}" for k in ("bf16_states", "stochastic_rounding") if getattr(args, k)]
        if given:
            sys.exit(f"error: {', '.join(given)} and --deepspeed-config both set ZeRO options: write them in "
                     f"{args.deepspeed_config} (zero_optimization) or drop --deepspeed-config")
        training_args = zj.TrainingArgs(
            per_device_train_batch_size=micro, gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
            weight_decay=0.1, max_grad_norm=args.clip, warmup_steps=warmup, max_steps=args.steps,
            bf16=args.precision == "bf16", fp16=args.precision == "fp16")
        try:
            state, step = zj.initialize(init, loss_fn(cfg), args.deepspeed_config, mesh=mesh,
                                        training_args=training_args, hidden_size=cfg.d_model,
                                        rng=jax.random.PRNGKey(args.seed))
        except zj.ConfigError as e:
            sys.exit(f"error: {args.deepspeed_config}: {e}")
        return state, step, state.plan.config.train_batch_size
    try:
        # stage 3 keeps leaves under 10 x d_model elements whole (DeepSpeed's "auto"), so this small
        # model's matrices are partitioned too
        zeropp = dict(quantized_weights=args.qwz or args.zeropp, quantized_gradients=args.qgz or args.zeropp,
                      hpz_partition_size=args.hpz or (4 if args.zeropp else 1), quantized_gradients_bits=args.qgz_bits,
                      devices_per_node=args.devices_per_node)
        default_stage = 3 if args.qwz or args.qgz or args.zeropp or args.hpz else 2  # ZeRO++ is a stage-3 feature
        # low-precision model states: the bf16 params as their own master, and (all) bf16 moments
        states = dict(master_weights_dtype="bfloat16" if args.bf16_states else None,
                      optimizer_state_dtype="bfloat16" if args.bf16_states == "all" else None,
                      stochastic_rounding=args.stochastic_rounding)
        config = zj.ZeroConfig(stage=default_stage if args.stage is None else args.stage, precision=args.precision,
                               gradient_accumulation_steps=args.grad_accum, gradient_clipping=args.clip,
                               offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
                               nvme_path=args.nvme_path, param_persistence_threshold=10 * cfg.d_model, **zeropp,
                               sequence_parallel_size=args.seq_parallel, **states)
    except zj.ConfigError as e:
        sys.exit(f"error: {e}")
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1)
    try:
        state = zj.shard_train_state(init, tx, mesh=mesh, config=config, rng=jax.random.PRNGKey(args.seed))
    except zj.ConfigError as e:  # e.g. --hpz that does not divide the device count
        sys.exit(f"error: {e}")
    return state, zj.make_train_step(loss_fn(cfg), state), args.batch


def describe_memory(report) -> str:
    lines = []
    for kind in report.kinds:
        parts = ", ".join(f"{part} {v[kind] / 2**20:.2f}" for part, v in report.by_part.items() if v.get(kind))
        lines.append(f"{kind} {report.max_bytes(kind) / 2**20:.2f} MiB ({parts})")
    lines += [f"{part} inside the step {nbytes / 2**20:.2f} MiB" for part, nbytes in report.in_step.items()]
    return "; ".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                    help="default bf16 (fp32 with --seq-parallel on CPU devices, where XLA cannot compile a "
                         "bf16 step over a 'seq' axis), or what --deepspeed-config enables")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per optimizer step)")
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (micro-batches per step)")
    ap.add_argument("--offload-optimizer", default=None, choices=["cpu", "nvme"],
                    help="keep the optimizer state (and fp32 master params) in host memory or on NVMe")
    ap.add_argument("--offload-param", default=None, choices=["cpu"], help="keep stage-3 params in host memory")
    ap.add_argument("--nvme-path", default=None, help="directory for --offload-optimizer nvme")
    ap.add_argument("--deepspeed-config", default=None, metavar="PATH.json",
                    help="read stage, offload, precision and optimizer from a DeepSpeed JSON config")
    ap.add_argument("--qwz", action="store_true", help="ZeRO++ qwZ: stage-3 weight gathers in 8 bits")
    ap.add_argument("--hpz", type=int, default=None, metavar="K",
                    help="ZeRO++ hpZ: backward gathers inside nodes of K devices (the 8 devices as 8/K nodes x K)")
    ap.add_argument("--qgz", action="store_true", help="ZeRO++ qgZ: gradients reduced in --qgz-bits, two hops")
    ap.add_argument("--qgz-bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--devices-per-node", type=int, default=None,
                    help="nodes for qgZ's two hops without hpZ (default: --hpz, else one node)")
    ap.add_argument("--zeropp", action="store_true", help="all three: --qwz --hpz 4 --qgz (stage 3 by default)")
    ap.add_argument("--bf16-states", nargs="?", const="all", default=None, choices=["master", "all"],
                    help="bf16 model states (bf16 only): 'master' keeps no fp32 master (the bf16 params are it), "
                         "'all' (the default of the flag) also stores Adam's moments in bf16")
    ap.add_argument("--stochastic-rounding", action="store_true",
                    help="round the bf16 master update stochastically (needs --bf16-states)")
    ap.add_argument("--seq", "--seq-len", dest="seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--seq-parallel", type=int, default=None, metavar="N",
                    help="Ulysses sequence parallelism: each sequence split over N devices (a ('data', 'seq') mesh); "
                         "with --deepspeed-config, the file's sequence_parallel_size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--scan", action="store_true", help="stack the layers and run them with lax.scan")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    raw = read_config(args.deepspeed_config) if args.deepspeed_config else {}
    in_file = config_sequence_parallel(raw)
    if in_file is not None and args.seq_parallel not in (None, in_file):
        ap.error(f"--seq-parallel {args.seq_parallel} but {args.deepspeed_config} has sequence_parallel_size "
                 f"{in_file}: set it in one place")
    args.seq_parallel = args.seq_parallel or in_file or 1
    if args.precision is None:
        cpu_seq = args.seq_parallel > 1 and jax.devices()[0].platform == "cpu"
        args.precision = (config_precision(raw) if args.deepspeed_config
                          else "fp32" if cpu_seq else "bf16")

    data = load_corpus()
    split = int(data.size * 0.95)
    train, held_out = data[:split], data[split:]
    cfg = GPTConfig(vocab=256, n_layer=args.layers, d_model=args.d_model, n_head=4, seq_len=args.seq, scan=args.scan)
    world = jax.device_count()
    if args.seq_parallel < 1 or world % args.seq_parallel or args.seq % args.seq_parallel:
        sys.exit(f"error: --seq-parallel {args.seq_parallel} must divide the {world} devices and --seq-len {args.seq}")
    mesh = zj.make_mesh() if args.seq_parallel == 1 else zj.make_mesh(
        (world // args.seq_parallel, args.seq_parallel), ("data", "seq"))
    state, step, batch = build(args, cfg, mesh)
    config = state.plan.config
    eval_loss = jax.jit(lambda p, b: loss_fn(cfg)(p, b))

    offload = ", ".join(f"{k} -> {getattr(config, k)}" for k in ("offload_optimizer", "offload_param")
                        if getattr(config, k)) or "no offload"
    zpp = [name for name, on in (("qwZ", config.quantized_weights), (f"hpZ {config.hpz_partition_size}",
                                                                     config.hpz_partition_size > 1),
                                 (f"qgZ {config.quantized_gradients_bits}-bit", config.quantized_gradients)) if on]
    if zpp and config.stage == 3:
        offload += " | ZeRO++ " + ", ".join(zpp)
    if config.master_weights_dtype:
        offload += (f" | bf16 master{' + bf16 moments' if config.optimizer_state_dtype else ''}"
                    f"{', stochastic rounding' if config.stochastic_rounding else ''}")
    n, gas = dict(mesh.shape)["data"], config.gradient_accumulation_steps
    print(f"GPT {cfg.n_params / 1e6:.2f}M params | {n} devices | ZeRO stage {config.stage} | {config.precision} | "
          f"{offload} | global batch {batch} = {n} devices x {gas} grad-accum x {batch // n // gas} micro-batch | "
          f"{len(data) / 1e6:.1f} MB of text")
    print(f"memory per device: {describe_memory(zj.memory_report(state))}")

    rng = np.random.default_rng(args.seed)
    tokens_per_step = batch * args.seq
    bar = tqdm(range(args.steps), desc="train", unit="step")
    t0, first_loss = None, None
    for i in bar:
        state, m = step(state, sample_batch(rng, train, batch, args.seq))
        if i == 0:
            jax.block_until_ready(state)
            t0 = time.perf_counter()  # exclude compilation
            first_loss = float(m["loss"])
        if i % 10 == 0 or i == args.steps - 1:
            rate = tokens_per_step * i / (time.perf_counter() - t0) if i else 0.0
            shown = {"loss": f"{float(m['loss']):.3f}", "tok_s": f"{rate:,.0f}", "skipped": int(m["skipped"])}
            if "learning_rate" in m:  # the NVMe-offload step does not report it
                shown["lr"] = f"{float(m['learning_rate']):.1e}"
            bar.set_postfix(shown)
    bar.close()
    elapsed = time.perf_counter() - t0
    params = state.full_params()
    eval_rng = np.random.default_rng(1234)
    held = np.mean([float(eval_loss(params, sample_batch(eval_rng, held_out, 32, args.seq))) for _ in range(4)])
    rate = tokens_per_step * (args.steps - 1) / elapsed if args.steps > 1 else float("nan")
    step_ms = 1e3 * elapsed / (args.steps - 1) if args.steps > 1 else float("nan")
    print(f"loss {first_loss:.3f} -> {float(m['loss']):.3f} (held-out {held:.3f}, uniform {np.log(256):.3f}) | "
          f"{rate:,.0f} tokens/s | {step_ms:.1f} ms/step")
    return float(held)


if __name__ == "__main__":
    main()
