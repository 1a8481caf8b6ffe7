"""The ``zerojax`` command (``python -m zerojax`` is the same: :mod:`zerojax.__main__`).

    zerojax config check ds_config.json --world-size 8 --hidden-size 4096 \\
        --training-args '{"per_device_train_batch_size": 4, "bf16": true}'

prints, for every key of the file, whether zerojax honours it, ignores it (warned when that
makes a difference) or refuses it, and why (exit code 2 if anything is refused); with
``--json``, the resolved ZeroConfig (every field, "auto" filled) as JSON, or the errors.

Adding a command: write ``_add_<group>_<name>(subparsers)`` that adds its parser and sets
``func`` (a function of the parsed arguments returning the exit code), then list it under its
group in ``_COMMANDS``. A command whose arguments all belong to another program (``launch``)
is listed in ``_PASSTHROUGH`` and receives the rest of the command line as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from zerojax.checkpoint import consolidate
from zerojax.config import ZeroConfig
from zerojax.config._deepspeed import TrainingArgs, key_report
from zerojax._errors import ConfigError, ZeroJaxError
from zerojax.tools._estimate import estimate_tables, zero_paper_bytes
from zerojax.tools._gpu import TARGETS
from zerojax.tools._planning import Ref, gpt_sizes, named_gpt, plan_step


def _training_args(text: Optional[str]):
    """A TrainingArgs from a JSON file path or an inline JSON object."""
    if text is None:
        return None
    try:
        if os.path.exists(text):
            with open(text) as f:
                values = json.load(f)
        else:
            values = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--training-args={text!r} is neither a readable JSON file nor inline JSON ({e})")
    if not isinstance(values, dict):
        raise ConfigError(f"--training-args must be a JSON object of TrainingArgs fields, got {values!r}")
    return TrainingArgs.from_dict(values)


def _print_resolved(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = ZeroConfig.from_deepspeed(args.config, training_args=_training_args(args.training_args),
                                               world_size=args.world_size, hidden_size=args.hidden_size)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(json.dumps(dataclasses.asdict(config), indent=2))
    return 0


def _run_config_check(args: argparse.Namespace) -> int:
    if args.json:
        return _print_resolved(args)
    rows = key_report(args.config, training_args=_training_args(args.training_args),
                      world_size=args.world_size, hidden_size=args.hidden_size)
    width = max((len(r.kind) for r in rows), default=0)
    for r in rows:
        value = f" = {json.dumps(r.value)}" if r.in_file else " (not in the file)"
        print(f"{r.kind:<{width}}  {r.path}{value}")
        print("\n".join(" " * (width + 4) + line for line in r.why.splitlines()))
    counts = {kind: sum(r.kind == kind for r in rows) for kind in ("honoured", "ignored", "warned-ignored", "refused")}
    print(", ".join(f"{n} {kind}" for kind, n in counts.items()))
    return 2 if counts["refused"] else 0


def _add_config_check(sub) -> None:
    p = sub.add_parser("check", help="say, for every key of a DeepSpeed JSON config, whether zerojax honours, "
                                     "ignores or refuses it (--json: print the resolved config)")
    p.add_argument("config", help="path to the DeepSpeed JSON config")
    p.add_argument("--json", action="store_true",
                   help="print the resolved ZeroConfig as JSON (warnings and errors on stderr) instead")
    p.add_argument("--world-size", type=int, default=None,
                   help="data-parallel size (default: the number of local JAX devices)")
    p.add_argument("--hidden-size", type=int, default=None, help='fills "auto" bucket sizes')
    p.add_argument("--training-args", default=None,
                   help="Hugging Face training arguments as a JSON file or inline JSON object")
    p.set_defaults(func=_run_config_check)


def _count_arg(text: str) -> int:
    """'7e9', '7B', '125M', '1.5T', '7_000_000' -> a parameter count."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    t = text.strip().replace("_", "").replace(",", "")
    try:
        value = float(t[:-1]) * scale[t[-1].upper()] if t and t[-1].upper() in scale else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count; write e.g. 7e9, 7B or 125M")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count must be positive")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return value


def _run_estimate_memory(args: argparse.Namespace) -> int:
    largest = args.largest_layer
    if largest is None:
        largest = max(1, int(args.params * 0.02))
        note = ("assumed 2% of the params, about a 7B transformer's embedding; "
                "pass --largest-layer N (elements of the biggest layer) for your model")
    elif largest > args.params:
        raise ConfigError(f"--largest-layer {largest:,} exceeds --params {args.params:,}: pass the element "
                          "count of the model's biggest layer")
    else:
        note = "given"
    print(f"Model: {args.params:,} params; largest layer {largest:,} params ({note}).")
    print(f"Hardware: {args.nodes} node(s) x {args.devices} device(s) per node.\n")
    print(estimate_tables(args.params, largest, args.devices, args.nodes, args.buffer_factor))
    return 0


def _add_estimate_memory(sub) -> None:
    p = sub.add_parser("memory", help="memory per device for every ZeRO stage and offload choice "
                                      "(DeepSpeed's estimators), from a parameter count")
    p.add_argument("--params", type=_count_arg, required=True, help="total parameters, e.g. 7e9 or 7B")
    p.add_argument("--largest-layer", type=_count_arg, default=None,
                   help="parameters of the largest layer (stage 3's gathered working set); default 2%% of --params")
    p.add_argument("--devices", type=_positive_int, default=1,
                   help="devices (GPUs) per node (DeepSpeed's num_gpus_per_node)")
    p.add_argument("--nodes", type=_positive_int, default=1, help="number of nodes")
    p.add_argument("--buffer-factor", type=float, default=1.5,
                   help="DeepSpeed's additional_buffer_factor for host memory")
    p.set_defaults(func=_run_estimate_memory)


def _run_plan_step(args: argparse.Namespace) -> int:
    cfg, init_fn, loss_fn = named_gpt(args.model, args.seq_len)
    config = ZeroConfig(stage=args.stage, precision=args.precision, gradient_accumulation_steps=args.gas)
    rows = args.devices * args.gas * args.micro_batch
    batch = {"tokens": jax.ShapeDtypeStruct((rows, cfg.seq_len + 1), jnp.int32)}
    print(f"{args.model}: {cfg.n_params:,} params (d_model {cfg.d_model}, {cfg.n_layer} layers, seq {cfg.seq_len}); "
          f"stage {args.stage}, {args.precision}, micro-batch {args.micro_batch} x GAS {args.gas} per device",
          flush=True)
    try:
        plan = plan_step(init_fn, loss_fn, batch, devices=args.devices, config=config, tx=Ref("optax:adamw", 1e-4),
                         target=args.target)
    except (RuntimeError, ZeroJaxError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(plan)
    paper = zero_paper_bytes(cfg.n_params, args.devices, args.stage, args.precision, include_grads=False)
    print(f"  ZeRO paper, stored    {paper / 2**30:.2f} GiB (params + optimizer states; planned / paper = "
          f"{plan.stored_bytes / paper:.3f})")
    if args.fsdp:
        try:
            fsdp = plan_step(init_fn, loss_fn, batch, devices=args.devices, config=config,
                             tx=Ref("optax:adamw", 1e-4), target=args.target, plain="fsdp")
        except (RuntimeError, ZeroJaxError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(fsdp)
        print(f"  zerojax / plain FSDP  peak {plan.peak_bytes / fsdp.peak_bytes:.3f}x, stored "
              f"{plan.stored_bytes / fsdp.stored_bytes:.3f}x (FSDP in the params' dtype, fp32)")
    return 0


def _add_plan_step(sub) -> None:
    p = sub.add_parser("step", help="compile a GPT train step for N (simulated CPU, or --target GPU) devices and "
                                    "print its per-device peak, stored state and collectives")
    p.add_argument("--model", required=True, choices=sorted(gpt_sizes()))
    p.add_argument("--devices", "--gpus", dest="devices", type=_positive_int, required=True,
                   help="data-parallel devices N")
    p.add_argument("--fsdp", action="store_true",
                   help="also plan GSPMD's plain FSDP of the same model (fp32 params), side by side")
    p.add_argument("--target", default=None, choices=sorted(TARGETS),
                   help="compile with XLA's GPU compiler for N GPUs of this kind (needs JAX's CUDA plugin, "
                        "no GPU): adds fits-or-not, overlap and a roofline step time")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per device per micro-batch")
    p.add_argument("--gas", type=_positive_int, default=1, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="override the model's sequence length")
    p.set_defaults(func=_run_plan_step)


def _run_checkpoint_consolidate(args: argparse.Namespace) -> int:
    try:
        out = consolidate(args.checkpoint, args.out, dtype=args.dtype, format=args.format, step=args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _add_checkpoint_consolidate(sub) -> None:
    p = sub.add_parser("consolidate", help="write a checkpoint's full params to one file, leaf by leaf")
    p.add_argument("checkpoint", help="the CheckpointManager directory")
    p.add_argument("out", help="output path (a .safetensors file, or a directory for --format orbax)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--format", default="safetensors", choices=["safetensors", "orbax"])
    p.add_argument("--step", type=int, default=None, help="default: the newest complete step")
    p.set_defaults(func=_run_checkpoint_consolidate)


# group -> (help, [functions adding one subcommand each])
_COMMANDS: dict[str, tuple[str, list[Callable]]] = {
    "config": ("DeepSpeed JSON configs", [_add_config_check]),
    "estimate": ("memory estimates", [_add_estimate_memory]),
    "checkpoint": ("checkpoints", [_add_checkpoint_consolidate]),
    "plan": ("compile the real step for N simulated devices or N GPUs of a kind", [_add_plan_step]),
}


# commands whose arguments belong to another program: everything after the name is passed through
# (``zerojax launch --nproc 2 train.py --steps 10``); value: (help, "module:function(argv) -> exit code")
_PASSTHROUGH = {
    "launch": ("start N processes of a training script (one host, or a hostfile's hosts over ssh)",
               "zerojax.runtime._launch:main"),
}


# shorter spellings: ``zerojax consolidate CKPT OUT`` is ``zerojax checkpoint consolidate CKPT OUT``
_ALIASES = {"consolidate": ["checkpoint", "consolidate"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerojax", description="ZeRO data parallelism for JAX")
    groups = parser.add_subparsers(dest="group", required=True)
    parser.group_commands = {}
    for group, (help_text, adders) in _COMMANDS.items():
        gp = groups.add_parser(group, help=help_text)
        sub = gp.add_subparsers(dest="command", required=True)
        for add in adders:
            add(sub)
        parser.group_commands[group] = list(sub.choices)
    for name, (help_text, _) in _PASSTHROUGH.items():
        groups.add_parser(name, help=help_text, add_help=False)
    return parser


def _expand(parser, argv: Sequence[str]) -> list:
    """Aliases, and a group with a single command runs it without naming it
    (``zerojax estimate --params 7e9`` is ``zerojax estimate memory --params 7e9``)."""
    argv = list(argv)
    if argv and argv[0] in _ALIASES:
        argv = _ALIASES[argv[0]] + argv[1:]
    if argv and argv[0] in parser.group_commands:
        commands = parser.group_commands[argv[0]]
        if len(commands) == 1 and (len(argv) == 1 or argv[1] not in commands + ["-h", "--help"]):
            argv.insert(1, commands[0])
    return argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        import importlib

        module, _, function = _PASSTHROUGH[argv[0]][1].partition(":")
        return getattr(importlib.import_module(module), function)(argv[1:])
    parser = build_parser()
    args = parser.parse_args(_expand(parser, argv))
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
