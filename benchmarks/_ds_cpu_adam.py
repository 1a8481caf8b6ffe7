"""DeepSpeed's CPU Adam on one flat fp32 parameter, timed step by step on request.

Run by ``benchmarks/host_adam.py --vs-deepspeed PYTHON`` with the python of an environment
that has torch and deepspeed; it imports only those (and the standard library). Protocol on
stdin/stdout, one line each:

    parent -> "step"      child runs one ``DeepSpeedCPUAdam.step()`` and answers
    child  -> "<wall seconds> <process CPU seconds>"
    parent -> "quit" (or end of input)

The first line the child prints is "ready <threads> <torch version> <deepspeed version>",
after building the op (DeepSpeed JIT-compiles it on first use) and one warm-up step.

    python benchmarks/_ds_cpu_adam.py --n 52428800 --lr 1e-3 --weight-decay 0.01
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50 * 2**20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    args = ap.parse_args()

    import torch
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    gen = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(args.n, generator=gen, dtype=torch.float32))
    p.grad = torch.randn(args.n, generator=gen, dtype=torch.float32)
    opt = DeepSpeedCPUAdam([p], lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=args.weight_decay, adamw_mode=True)
    opt.step()  # builds/loads the op, allocates and faults in the moments
    out = sys.stdout
    threads = os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())
    print(f"ready {threads} {torch.__version__} {deepspeed.__version__}", file=out, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd != "step":
            break
        w, c = time.perf_counter(), time.process_time()
        opt.step()
        print(f"{time.perf_counter() - w:.6f} {time.process_time() - c:.6f}", file=out, flush=True)


if __name__ == "__main__":
    main()
