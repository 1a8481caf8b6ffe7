"""A small model with awkward shapes (nothing divides 8 evenly everywhere) and its plain reference."""
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax._compat import count_compiles  # noqa: F401 - the tests' compile counter
from zerojax.runtime._launch import with_device_count, without_device_count

VOCAB, EMB, HID, OUT = 67, 12, 20, 5


def child_env(devices=None, **extra) -> dict:
    """The environment of a JAX process the suite starts: this one's, with the suite's XLA flags
    (its faster compile) but not its device count, which the child sets itself or takes from
    ``devices``; on the CPU."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = without_device_count(flags) if devices is None else with_device_count(flags, devices)
    return env


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
# A benchmark's --smoke figures mean nothing, so its child compiles with XLA's older CPU emitters
# (--xla_cpu_use_fusion_emitters=false), which compile these programs about twice as fast; the
# suite's own processes set the same flag (tests/conftest.py), so this matters for a child
# started with ZEROJAX_TEST_FAST_COMPILE=0 or its own XLA_FLAGS.
SMOKE_FLAGS = ("--xla_cpu_use_fusion_emitters=false"
               if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("ZEROJAX_TEST_XLA_FLAGS", "").split()
               else "")  # where this XLA knows the flag (tests/conftest.py)


def run_benchmark(script: str, *args: str, timeout: float = 600) -> str:
    """Run ``benchmarks/<script> *args`` in a child JAX process (:func:`child_env` plus
    :data:`SMOKE_FLAGS`), assert it succeeded and return its stdout."""
    import subprocess
    import sys

    env = child_env()
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {SMOKE_FLAGS}".strip()
    root = os.path.dirname(BENCH)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], cwd=BENCH, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def init_params(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "emb": jax.random.normal(k1, (VOCAB, EMB)) * 0.3,
        "dense": {"kernel": jax.random.normal(k2, (EMB, HID)) * 0.3, "bias": jnp.zeros((HID,))},
        "odd": jax.random.normal(k3, (7, 3)) * 0.3,
        "out": jax.random.normal(k4, (HID, OUT)) * 0.3,
    }


def loss_fn(params, batch):
    x = params["emb"][batch["tok"]].mean(1)
    h = jnp.tanh(x @ params["dense"]["kernel"].astype(x.dtype) + params["dense"]["bias"].astype(x.dtype))
    logits = (h @ params["out"].astype(x.dtype)).astype(jnp.float32)
    reg = 1e-3 * jnp.sum(params["odd"].astype(jnp.float32) ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean() + reg


def batches(n_steps, batch_size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tok": rng.integers(0, VOCAB, (batch_size, 4)).astype(np.int32),
             "y": rng.integers(0, OUT, (batch_size,)).astype(np.int32)} for _ in range(n_steps)]


class Reference(NamedTuple):
    params: Any
    losses: list
    norms: list  # the global gradient norm of every step, before clipping
    skipped: list  # steps whose gradients overflowed (not applied)
    scales: list  # the loss scale each step ran with


def clip_grads(g, clip):
    """DeepSpeed's clipping, written out: divide by max(1, (norm + 1e-6) / clip)."""
    norm = optax.tree.norm(g)
    if not clip:
        return g, norm
    coef = jnp.maximum(1.0, (norm + 1e-6) / clip)
    return jax.tree_util.tree_map(lambda x: x / coef, g), norm


def reference_run(params, tx, data, clip=0.0, loss=None) -> Reference:
    """Plain single-device optax in fp32: the numbers a ZeRO run must reproduce (``loss``: the
    model's loss, default this module's)."""
    state = tx.init(params)
    losses, norms = [], []
    value_and_grad = jax.value_and_grad(loss or loss_fn)

    @jax.jit
    def step(p, s, b):
        loss, g = value_and_grad(p, b)
        g, norm = clip_grads(g, clip)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, norm

    for b in data:
        params, state, loss, norm = step(params, state, b)
        losses.append(float(loss))
        norms.append(float(norm))
    return Reference(params, losses, norms, [False] * len(losses), [1.0] * len(losses))


def reference_train(params, tx, data, clip=0.0):
    """Plain single-device optax: (final params, losses)."""
    ref = reference_run(params, tx, data, clip)
    return ref.params, ref.losses


# ------------------------------------------------------------------ mixed precision
def device_micro_batches(batch, n: int, gas: int):
    """The rows each device sees, micro-batch by micro-batch: device d holds the d-th contiguous
    1/n of the global batch and splits it into ``gas`` contiguous micro-batches."""
    rows = len(next(iter(batch.values())))
    per, micro = rows // n, rows // n // gas
    return [[{k: v[d * per + i * micro:d * per + (i + 1) * micro] for k, v in batch.items()} for i in range(gas)]
            for d in range(n)]


def sum_over_devices(parts, dtype):
    """The data-parallel sum of per-device 16-bit gradients as this (CPU) backend's collectives
    form it: float16 added device after device in float16; bfloat16 summed in float32 and
    rounded once; float32 added device after device. Returns ``dtype`` values."""
    parts = [np.asarray(x) for x in parts]
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
        return sum(x.astype(np.float32) for x in parts).astype(dtype)
    acc = parts[0].astype(dtype)
    for x in parts[1:]:
        acc = (acc.astype(np.float32) + x.astype(np.float32)).astype(dtype)
    return acc


class DynamicScale:
    """DeepSpeed's dynamic loss scale (REFERENCE.md section 4), written out for the references."""

    def __init__(self, scale, window=1000, hysteresis=2, min_scale=1.0):
        self.scale, self.window, self.hysteresis, self.min_scale = float(scale), window, hysteresis, min_scale
        self.left, self.iter, self.last_overflow = hysteresis, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iter
        else:
            stable = self.iter - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= 2
                self.left = self.hysteresis
        self.iter += 1


def mixed_reference_run(params, tx, data, precision, *, n=8, gas=1, stage=0, scale=1.0, clip=0.0,
                        scaler=None, offload=False, master_dtype=jnp.float32, opt_dtype=jnp.float32) -> Reference:
    """Mixed-precision data parallelism written out plainly, on one device.

    An fp32 master, cast to the compute dtype for every forward; each device's gradient of its
    micro-batch's mean loss times ``scale / (n * gas)`` (the loss scale with the mean over
    devices and micro-batches folded in), in the compute dtype; the micro-batch gradients
    accumulated in fp32 and summed over devices in the compute dtype (once per step at stages
    0-1, after every micro-batch from stage 2), then divided by the scale in fp32; DeepSpeed's
    clipping on that fp32 gradient; fp32 optax on the master. ``offload``: the optimizer runs on
    the host, which receives the (still scaled) gradient rounded to the compute dtype; the norm
    and the clip coefficient come from the fp32 gradient before that. ``scaler``: a
    :class:`DynamicScale` (an overflow skips the update); otherwise the scale is static and an
    overflow is an error. ``master_dtype`` / ``opt_dtype`` bfloat16: the master (the params, then)
    and the optimizer's float arrays are stored in bf16, widened to fp32 for every update and
    rounded to nearest after it.
    """
    cdt = jnp.dtype({"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[precision])
    f32 = jnp.float32
    master = jax.tree_util.tree_map(lambda x: jnp.asarray(x, f32).astype(master_dtype), params)
    treedef = jax.tree_util.tree_structure(master)

    def arrays_to(tree, dtype):
        return jax.tree_util.tree_map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x, tree)

    opt_state = arrays_to(tx.init(arrays_to(master, f32)), opt_dtype)

    @jax.jit
    def device_grads(master, micro, scale):
        p16 = jax.tree_util.tree_map(lambda x: x.astype(cdt), master)

        def scaled(p, b):
            loss = loss_fn(p, b).astype(f32)
            return loss * scale, loss

        return [[jax.grad(scaled, has_aux=True)(p16, b) for b in dev] for dev in micro]

    @jax.jit
    def update(master, opt_state, g):
        wide = arrays_to(master, f32)
        u, opt_state = tx.update(g, arrays_to(opt_state, f32), wide)
        return arrays_to(optax.apply_updates(wide, u), master_dtype), arrays_to(opt_state, opt_dtype)

    out = Reference(None, [], [], [], [])
    for batch in data:
        s = scaler.scale if scaler is not None else float(scale)
        per_dev = jax.device_get(device_grads(master, device_micro_batches(batch, n, gas), f32(s) / f32(n * gas)))
        grads = [[treedef.flatten_up_to(g) for g, _ in dev] for dev in per_dev]
        leaves = []
        for j in range(treedef.num_leaves):
            if stage >= 2:  # reduced after every micro-batch, accumulated in fp32
                acc = np.zeros(np.shape(grads[0][0][j]), np.float32)
                for i in range(gas):
                    acc = acc + sum_over_devices([dev[i][j] for dev in grads], cdt).astype(np.float32)
            else:  # accumulated in fp32 on each device, reduced once in the compute dtype
                local = []
                for dev in grads:
                    acc = np.zeros(np.shape(dev[0][j]), np.float32)
                    for i in range(gas):
                        acc = acc + dev[i][j].astype(np.float32)
                    local.append(acc.astype(cdt))
                acc = sum_over_devices(local, cdt).astype(np.float32)
            leaves.append(acc)
        loss = sum(float(l) for dev in per_dev for _, l in dev) / (n * gas)
        finite = all(np.isfinite(x).all() for x in leaves) and np.isfinite(loss)
        if scaler is not None:
            scaler.update(not finite)
        elif not finite:
            raise AssertionError(f"the static loss scale {s} overflows: choose a smaller one")
        g, norm = clip_grads(treedef.unflatten([jnp.asarray(x / np.float32(s)) for x in leaves]), clip)
        if offload:  # the host's gradient: rounded to the compute dtype while still scaled
            coef = np.float32(max(1.0, (float(norm) + 1e-6) / clip)) if clip else np.float32(1.0)
            g = treedef.unflatten([jnp.asarray(x.astype(cdt).astype(np.float32) / np.float32(s) / coef)
                                   for x in leaves])
        out.losses.append(loss)
        out.norms.append(float(norm))
        out.skipped.append(not finite)
        out.scales.append(s)
        if finite:
            master, opt_state = update(master, opt_state, g)
    return out._replace(params=master)


def max_rel_err(got, want):
    """Largest per-leaf max|got - want| / max|want|."""
    errs = jax.tree_util.tree_map(
        lambda a, b: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - b)) / (jnp.max(jnp.abs(b)) + 1e-30)),
        got, want)
    return max(jax.tree_util.tree_leaves(errs))


# every kind of optax transformation a ZeRO wrapper must handle
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adam": lambda: optax.adam(1e-2),
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "chain_clip_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(0.05),  # below every step's norm: it clips
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10))),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "lamb": lambda: optax.lamb(1e-2),
}


def sub_jaxprs(value):
    """The programs held in one equation parameter (a jaxpr, a closed jaxpr, or a tuple of them)."""
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
        yield value.jaxpr
    elif hasattr(value, "eqns"):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from sub_jaxprs(v)


def walk(jaxpr):
    """Every equation of ``jaxpr`` and of the programs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in sub_jaxprs(value):
                yield from walk(inner)
