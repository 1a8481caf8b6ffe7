"""Op kinds of each contender's optimized first-step module (deterministic: no clock).

    python benchmarks/hlo_ops.py --layers 2 --contenders ddp s0 s1 [--kinds select is-finite]

Prints one row per op kind with each contender's count (the kinds where they differ, or those
named), then the totals; where zerojax's step holds work plain jit's does not, this names it.
"""
import argparse
import collections
import json
import os
import sys

os.environ.setdefault("ZJ_COMPILE_CHILD", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this checkout's zerojax, not an installed one

import compile_time as ct  # noqa: E402  (simulates 8 devices on import)
import jax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import GPTConfig  # noqa: E402


def op_kinds(text: str) -> collections.Counter:
    counts = collections.Counter()
    for line in text.splitlines():
        line = line.strip()
        if " = " not in line or line.startswith(("HloModule", "//")):
            continue
        match = ct.OPCODE.search(line.split(" = ", 1)[1])
        if match:
            counts[match.group(1)] += 1
    return counts


def compiled_text(name, mesh, cfg, batch) -> str:
    from vs_plain_jax import plain_step

    c = ct.Contender(name, mesh, cfg)
    if c.plain:
        p = c.plain
        fn, args = plain_step(c.loss, *p.shardings, p.batch_sh, ct.make_tx), (p.params, p.opt_state, batch)
    else:
        fn, args = zj.make_train_step(c.loss, c.state).jitted, (c.state, batch)
    return fn.lower(*args).compile().as_text()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contenders", nargs="*", default=["ddp", "s0", "s1"])
    ap.add_argument("--kinds", nargs="*", default=None, help="op kinds to list (default: those that differ)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = GPTConfig(vocab=8192, n_layer=args.layers, d_model=128, n_head=4, seq_len=64)
    mesh = zj.make_mesh()
    batch = ct.batch_for(cfg, 16)
    counts = {}
    for name in args.contenders:
        ct.forget()
        counts[name] = op_kinds(compiled_text(name, mesh, cfg, batch))
    if args.json:
        print(json.dumps(counts))
        return
    kinds = args.kinds or sorted({k for c in counts.values() for k in c
                                  if len({c2.get(k, 0) for c2 in counts.values()}) > 1})
    print(f"{'op':<24}" + "".join(f"{n:>8}" for n in counts))
    for k in kinds:
        print(f"{k:<24}" + "".join(f"{c.get(k, 0):>8}" for c in counts.values()))
    print(f"{'instructions':<24}" + "".join(f"{sum(c.values()):>8}" for c in counts.values()))


if __name__ == "__main__":
    main()
