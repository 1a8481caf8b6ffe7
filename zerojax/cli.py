"""The ``zerojax`` command.

    zerojax config check ds_config.json --world-size 8 --hidden-size 4096 \\
        --training-args '{"per_device_train_batch_size": 4, "bf16": true}'

prints the resolved ZeroConfig (every field, "auto" filled) as JSON, or the errors (exit code 2).

Adding a command: write ``_add_<group>_<name>(subparsers)`` that adds its parser and sets
``func`` (a function of the parsed arguments returning the exit code), then list it under its
group in ``_COMMANDS``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from typing import Callable, Optional, Sequence

from zerojax.config import ConfigError


def _training_args(text: Optional[str]):
    """A TrainingArgs from a JSON file path or an inline JSON object."""
    from zerojax.deepspeed import TrainingArgs

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


def _run_config_check(args: argparse.Namespace) -> int:
    from zerojax.config import ZeroConfig

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


def _add_config_check(sub) -> None:
    p = sub.add_parser("check", help="resolve a DeepSpeed JSON config and print it, or its errors")
    p.add_argument("config", help="path to the DeepSpeed JSON config")
    p.add_argument("--world-size", type=int, default=None,
                   help="data-parallel size (default: the number of local JAX devices)")
    p.add_argument("--hidden-size", type=int, default=None, help='fills "auto" bucket sizes')
    p.add_argument("--training-args", default=None,
                   help="Hugging Face training arguments as a JSON file or inline JSON object")
    p.set_defaults(func=_run_config_check)


# group -> (help, [functions adding one subcommand each])
_COMMANDS: dict[str, tuple[str, list[Callable]]] = {
    "config": ("DeepSpeed JSON configs", [_add_config_check]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerojax", description="ZeRO data parallelism for JAX")
    groups = parser.add_subparsers(dest="group", required=True)
    for group, (help_text, adders) in _COMMANDS.items():
        gp = groups.add_parser(group, help=help_text)
        sub = gp.add_subparsers(dest="command", required=True)
        for add in adders:
            add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 errors)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
