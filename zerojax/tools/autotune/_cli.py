"""The command line: ``python -m zerojax.tools.autotune --model gpt2-small --devices 64 --budget 80GiB``."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from zerojax.config import ZeroConfig
from zerojax._errors import AutotuneError, ConfigError
from zerojax.tools.autotune._candidates import OFFLOADS
from zerojax.tools.autotune._search import autotune
from zerojax.tools._gpu import TARGETS
from zerojax.tools._planning import gpt_sizes

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m zerojax.tools.autotune --model gpt2-small --devices 64 --budget 80GiB``"""
    p = argparse.ArgumentParser(prog="python -m zerojax.tools.autotune",
                                description="recommend the fastest ZeRO stage, offload choice and micro-batch "
                                            "that fit a device memory budget (compiling the real step for N "
                                            "simulated devices)")
    p.add_argument("--model", required=True, choices=sorted(gpt_sizes()))
    p.add_argument("--devices", type=int, required=True, help="data-parallel devices N")
    p.add_argument("--budget", default=None, help="device memory per device, e.g. 80GiB (default: this "
                                                  "process's device memory, when known)")
    p.add_argument("--host-budget", default=None, help="host memory per device for offloaded state")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated stages (default: %(default)s)")
    p.add_argument("--offloads", default=",".join(OFFLOADS), help="comma-separated offload choices among "
                                                                   f"{', '.join(OFFLOADS)} (default: all)")
    p.add_argument("--max-micro-batch", type=int, default=16, help="try powers of two up to this")
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length")
    p.add_argument("--exhaustive", action="store_true", help="compile every candidate")
    p.add_argument("--timed", action="store_true", help="rank by real steps (needs the devices here)")
    p.add_argument("--json", action="store_true", help="also print the recommendation as DeepSpeed JSON")
    p.add_argument("--target", default=None, choices=sorted(TARGETS),
                   help="compile with XLA's GPU compiler for N compile-only GPUs of this kind (needs JAX's CUDA "
                        "plugin); the budget defaults to its memory")
    args = p.parse_args(argv)
    try:
        result = autotune(model=args.model, devices=args.devices, budget=args.budget, host_budget=args.host_budget,
                          config=ZeroConfig(precision=args.precision, gradient_accumulation_steps=args.gas),
                          stages=[int(s) for s in args.stages.split(",")], offloads=args.offloads.split(","),
                          max_micro_batch=args.max_micro_batch, seq_len=args.seq_len, exhaustive=args.exhaustive,
                          timed=args.timed, verbose=True, target=args.target)
    except AutotuneError as e:
        if e.result is not None:
            print(e.result)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result)
    if args.json:
        print(json.dumps(result.deepspeed_config(), indent=2))
    return 0
