"""ZeRO-Infinity's run: a GPT whose params and optimizer state live on NVMe trains, and what its
steps cost next to the bytes they move through the disk.

    python benchmarks/bigger_than_memory.py                       # 8 layers, d 512: ~0.5 GB a slot
    python benchmarks/bigger_than_memory.py --layers 48 --d 2048 --dir /nvme/scratch
    python benchmarks/bigger_than_memory.py --smoke               # tiny, seconds: the script runs

Stage 3, bf16, AdamW, ``offload_param`` and ``offload_optimizer`` both ``"nvme"`` on 8 simulated
devices: the 16-bit params, fp32 master and both moments (14 bytes a param, in two slots) live in
files. Before every step the files' pages are dropped from the page cache, so the step reads from
the drive where the kernel allows it. Printed:

* the state on disk against this machine's memory, and the loss of each step (it must fall);
* per step: bytes read and written, the time the drive needs for them at its own measured
  sequential speed (a plain write with fsync and a read of a file of the same size, same
  directory, cache dropped), the compute time (the same model and batch at stage 3 with
  everything in memory, timed interleaved with the NVMe steps) and the step time against the two
  summed (goal: within 1.5x);
* the peak resident set growth during the steps, and that growth less what the simulated devices
  hold (the compiled device part's per-device peak x devices: on a GPU that memory is not the
  host's), against the state on disk and the machine's memory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

if __name__ == "__main__":
    from _common import simulate_devices

    simulate_devices(8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="a directory on the drive (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="2 layers of d 64, 2 steps")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.d, args.vocab, args.seq, args.steps = 2, 64, 256, 16, 2

    import jax
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.models import gpt
    from checkpoint import disk_speed, drop_cache
    from nvme import RssSampler

    cfg = gpt.GPTConfig(vocab=args.vocab, n_layer=args.layers, d_model=args.d, n_head=max(1, args.d // 64),
                        seq_len=args.seq)
    root = tempfile.mkdtemp(dir=args.dir, prefix="zj-btm-")
    nvme = os.path.join(root, "nvme")
    os.makedirs(nvme)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (args.batch, cfg.seq_len + 1)).astype(np.int32)
    batch = {"tokens": tokens}
    loss_fn = gpt.loss_fn(cfg)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4, weight_decay=0.01)
    common = dict(stage=3, precision="bf16", param_persistence_threshold=0)
    try:
        params = gpt.init_params(cfg, jax.random.PRNGKey(0))
        mem = zj.ZeroConfig(**common)
        base = zj.shard_train_state(params, tx, config=mem)
        in_memory = zj.make_train_step(loss_fn, base)
        config = zj.ZeroConfig(**common, offload_optimizer="nvme", offload_param="nvme", nvme_path=nvme,
                               sub_group_size=1 << 22)
        state = zj.shard_train_state(params, tx, config=config)
        del params
        step = zj.make_train_step(loss_fn, state)
        n = step.layout.total  # elements on disk, padding included
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        slot = 14 * n
        print(f"GPT {cfg.n_layer} layers, d {cfg.d_model}, vocab {cfg.vocab}: {cfg.n_params / 1e6:.1f}M params; "
              f"on disk {slot / 2**30:.2f} GiB a slot (x2 slots) = {slot / machine:.3f}x this machine's "
              f"{machine / 2**30:.1f} GiB")
        compiled = step.lower(state, batch).compile().memory_analysis()
        per_dev = compiled.argument_size_in_bytes + compiled.output_size_in_bytes + compiled.temp_size_in_bytes \
            - compiled.alias_size_in_bytes
        devices_bytes = per_dev * state.plan.n
        # first steps: compile both, and the NVMe step writes the params to their files
        state, _ = step(state, batch)
        base, _ = in_memory(base, batch)
        jax.block_until_ready(base)
        write_bw, read_bw = disk_speed(root, int(min(slot, 1 << 30)))
        io_read = io_write = 14 * n  # params (2 B) + master, m, v (12 B) read; the same written
        times, compute, losses, mem_losses = [], [], [], []
        with RssSampler(0.002) as rss:
            start = rss.rss()
            for _ in range(args.steps):
                drop_cache(nvme)
                t = time.perf_counter()
                state, m = step(state, batch)
                losses.append(float(m["loss"]))
                times.append(time.perf_counter() - t)
                t = time.perf_counter()
                base, mb = in_memory(base, batch)
                mem_losses.append(float(mb["loss"]))
                compute.append(time.perf_counter() - t)
        grow = rss.peak - start
        step.close()
        print("losses: " + ", ".join(f"{x:.4f}" for x in losses)
              + ("  (falling)" if losses[-1] < losses[0] else "  (NOT falling)")
              + "; in memory: " + ", ".join(f"{x:.4f}" for x in mem_losses))
        med, comp = float(np.median(times)), float(np.median(compute))
        io = io_read / (read_bw * 1e9) + io_write / (write_bw * 1e9)
        print(f"disk: write {write_bw:.2f} GB/s, read {read_bw:.2f} GB/s (plain sequential, cache dropped)")
        print(f"per step: read {io_read / 1e9:.3f} GB, written {io_write / 1e9:.3f} GB -> {io:.2f} s at the disk's "
              f"speed; compute (same step in memory) {comp:.2f} s")
        print(f"step {med:.2f} s = {med / (io + comp):.2f}x (bytes / bandwidth + compute)   [goal <= 1.5x]   "
              f"steps: {', '.join(f'{x:.2f}' for x in times)}")
        print(f"peak RSS growth during the steps {grow / 2**30:.2f} GiB = {grow / slot:.2f}x the state on disk, "
              f"{grow / machine:.3f}x the machine; of the process's memory the simulated devices use up to "
              f"{devices_bytes / 2**30:.2f} GiB (compiled per-device peak x {state.plan.n}), GPU memory on a GPU")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
