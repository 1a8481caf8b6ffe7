"""Shared set-up for the benchmark scripts: simulated devices before jax is imported, and the
interleaved timing of steps side by side."""
import os
import sys


def simulate_devices(n: int = 8) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def time_interleaved(runs: dict, batch, rounds: int, steps: int) -> None:
    """Time each contender's ``steps`` steps per round, ``rounds`` rounds, the order reversed every
    other round so machine noise hits them alike. ``runs``: name -> [step, state, times]; the
    seconds per step of each round are appended to ``times`` and the state carried on."""
    import time

    import jax

    for r in range(rounds):
        order = list(runs.items())
        for _, run in order if r % 2 == 0 else order[::-1]:
            step, state, times = run
            t0 = time.perf_counter()
            for _ in range(steps):
                state, m = step(state, batch)
            jax.block_until_ready((state, m))
            times.append((time.perf_counter() - t0) / steps)
            run[1] = state
