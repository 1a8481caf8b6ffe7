"""zj.zero_optimizer with offload_optimizer="cpu": state in host memory, update on the host,
numbers equal to plain optax; the offload settings it cannot honour are refused by name."""
import os
import subprocess
import sys
import warnings

import jax
import optax
import pytest

import zerojax as zj
from tests.helpers import OPTIMIZERS, batches, clip_grads, init_params, loss_fn, max_rel_err
from zerojax._errors import ConfigError, HostUpdateWarning, IgnoredKeysWarning
from zerojax.kernels import _native as native

STEPS = 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_updates(make_tx, params, data, clip=0.0):
    """Plain single-device optax: the updates of every step and the final params."""
    tx = make_tx()
    state = tx.init(params)
    out = []
    for b in data:
        g, _ = clip_grads(jax.grad(loss_fn)(params, b), clip)
        u, state = tx.update(g, state, params)
        out.append(u)
        params = optax.apply_updates(params, u)
    return out, params


def run(tx, params, data, jitted: bool):
    """The caller's loop around zero_optimizer: per-step updates, final params, final state."""
    state = tx.init(params)

    def step(p, s, b):
        u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return u, optax.apply_updates(p, u), s

    step = jax.jit(step) if jitted else step
    got = []
    for b in data:
        u, params, state = step(params, state, b)
        got.append(u)
    return got, params, state


HOST_RTOL = 4e-6  # see test_offloaded_updates_equal_optax


def kinds(state):
    return {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(state)}


def mirrors(state):
    return [x for x in jax.tree_util.tree_leaves(state) if x.size >= 8]


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum", "lion"])
def test_offloaded_updates_equal_optax(opt, stage, jitted):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(STEPS)
    want, want_params = reference_updates(OPTIMIZERS[opt], params, data)
    tx = zj.zero_optimizer(OPTIMIZERS[opt](), config=zj.ZeroConfig(stage=stage, offload_optimizer="cpu"))
    assert kinds(tx.init(params).inner) == {"pinned_host"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostUpdateWarning)  # these run on the host, no fallback
        got, got_params, state = run(tx, params, data, jitted)
    # HOST_RTOL: the host update is compiled by XLA's CPU backend, whose instruction choice
    # (fused multiply-adds, vector width) follows the machine's CPU, so an element may differ
    # from the device program's by a few float32 ulps (1.3e-6 of the leaf's largest value on an
    # AVX2 machine); a wrong bias correction, rate or decay is off by 1e-3 or more
    for i, (u, w) in enumerate(zip(got, want)):
        assert max_rel_err(u, w) < HOST_RTOL, (opt, stage, i)
        assert kinds(u) == {"device"}, (opt, stage, i)  # the updates came back to the device
    assert max_rel_err(got_params, want_params) < HOST_RTOL
    assert kinds(state.inner) == {"pinned_host"}
    # still partitioned: every leaf that mirrors a param is split 8 ways
    for x in mirrors(state.inner):
        assert x.addressable_shards[0].data.size * 8 == x.size, (opt, x.shape)


def test_unpinned_host_memory_is_warned_and_pinned_used():
    """A jitted program cannot return unpinned host memory (the value would silently land in
    device memory): pin_memory=False is warned by name and the state is pinned."""
    params = init_params(jax.random.PRNGKey(0))
    data = batches(2)
    want, _ = reference_updates(OPTIMIZERS["adamw"], params, data)
    config = zj.ZeroConfig(stage=1, offload_optimizer="cpu", pin_memory=False)
    with pytest.warns(IgnoredKeysWarning, match="pin_memory=False"):
        tx = zj.zero_optimizer(OPTIMIZERS["adamw"](), config=config)
    got, _, state = run(tx, params, data, True)
    assert kinds(state.inner) == {"pinned_host"}
    assert max_rel_err(got[-1], want[-1]) < HOST_RTOL


def test_without_offload_state_stays_on_device():
    """Control for the memory-kind checks above."""
    params = init_params(jax.random.PRNGKey(0))
    tx = zj.zero_optimizer(OPTIMIZERS["adamw"](), config=zj.ZeroConfig(stage=1))
    _, _, state = run(tx, params, batches(1), True)
    assert kinds(state.inner) == {"device"}


def host_marks(tx, params, data):
    state = tx.init(params)
    g = jax.grad(loss_fn)(params, data[0])
    return jax.jit(tx.update).lower(g, state, params).as_text().count('_xla_compute_type = "host"')


def native_calls(tx, params, data):
    state = tx.init(params)
    g = jax.grad(loss_fn)(params, data[0])
    return jax.jit(tx.update).lower(g, state, params).as_text().count(native.TARGET)


def test_update_is_computed_on_the_host(monkeypatch):
    """On this CPU mesh an offloaded Adam runs in the native host kernel (one call per update);
    other optimizers, and Adam without the kernel, run under compute_on("device_host")."""
    params = init_params(jax.random.PRNGKey(0))
    data = batches(1)
    config = zj.ZeroConfig(stage=2, offload_optimizer="cpu")
    offloaded = zj.zero_optimizer(optax.adamw(1e-2), config=config)
    on_device = zj.zero_optimizer(optax.adamw(1e-2), config=zj.ZeroConfig(stage=2))
    momentum = zj.zero_optimizer(OPTIMIZERS["sgd_momentum"](), config=config)
    assert native_calls(offloaded, params, data) == 1 and host_marks(offloaded, params, data) == 0
    assert native_calls(momentum, params, data) == 0 and host_marks(momentum, params, data) >= 1
    assert native_calls(on_device, params, data) == 0 and host_marks(on_device, params, data) == 0
    monkeypatch.setattr(native, "available", lambda warn=True: False)
    without = zj.zero_optimizer(optax.adamw(1e-2), config=config)
    assert native_calls(without, params, data) == 0 and host_marks(without, params, data) >= 1


NATIVE_OPTIMIZERS = {
    "adam": OPTIMIZERS["adam"],
    "inject_hyperparams": OPTIMIZERS["inject_hyperparams"],  # what DeepSpeed's blocks build
    "injected_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, STEPS), b1=0.8, weight_decay=0.05),
}


@pytest.mark.parametrize("opt", sorted(NATIVE_OPTIMIZERS))
def test_native_host_update_equals_optax(opt):
    """The native kernel's Adam variants (no weight decay; injected settings; a schedule read each
    step) give plain optax's updates, step after step on the same params and gradients. (The
    kernel folds the bias corrections into two scalars, as DeepSpeed's CPU Adam does: a few
    fp32 ulps per element.)"""
    params = init_params(jax.random.PRNGKey(0))
    ref_tx = NATIVE_OPTIMIZERS[opt]()
    tx = zj.zero_optimizer(NATIVE_OPTIMIZERS[opt](), config=zj.ZeroConfig(stage=2, offload_optimizer="cpu"))
    assert native_calls(tx, params, batches(1)) == 1
    ref_state, state = ref_tx.init(params), tx.init(params)
    update = jax.jit(tx.update)
    for i, b in enumerate(batches(STEPS)):
        g = jax.grad(loss_fn)(params, b)
        want, ref_state = ref_tx.update(g, ref_state, params)
        got, state = update(g, state, params)
        assert max_rel_err(got, want) < 1e-6, (opt, i)
        params = optax.apply_updates(params, want)
    assert kinds(state.inner) == {"pinned_host"}


def test_users_loop_applies_the_host_update_in_place_without_a_buffer_for_the_updates():
    """The loop a user writes: jit of update and optax.apply_updates, params and state donated, the
    gradients an argument kept by the caller. The native kernel writes the moments in place and
    the updates are made where the apply reads them (one pass writing the params in place), so
    the program needs no buffer of the params' size: no copy of the gradients for the kernel to
    write updates over, no updates materialised. Numbers: plain optax's."""
    mesh = zj.make_mesh(1, devices=jax.devices()[:1])
    n = 1 << 16
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (n,)) * 0.3}
    grads = [{"w": jax.random.normal(jax.random.PRNGKey(1 + i), (n,))} for i in range(3)]
    tx = zj.zero_optimizer(optax.adamw(1e-2, weight_decay=0.1), mesh=mesh,
                           config=zj.ZeroConfig(stage=1, offload_optimizer="cpu"))
    ref_tx = optax.adamw(1e-2, weight_decay=0.1)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    step = jax.jit(step, donate_argnums=(0, 1))
    compiled = step.lower(params, state, grads[0]).compile()
    assert compiled.as_text().count(native.TARGET) == 1
    assert compiled.memory_analysis().temp_size_in_bytes < n * 4 // 4
    want, ref_state = params, ref_tx.init(params)
    for g in grads:
        u, ref_state = ref_tx.update(g, ref_state, want)
        want = optax.apply_updates(want, u)
        params, state = step(params, state, g)
    assert max_rel_err(params, want) < HOST_RTOL
    assert kinds(state.inner) == {"pinned_host"}


def test_clipping_with_offload():
    params = init_params(jax.random.PRNGKey(0))
    data = batches(3)
    want, _ = reference_updates(OPTIMIZERS["adamw"], params, data, clip=0.05)
    unclipped, _ = reference_updates(OPTIMIZERS["adamw"], params, data)
    assert max_rel_err(unclipped[1], want[1]) > 1e-3  # the clip bites
    config = zj.ZeroConfig(stage=2, offload_optimizer="cpu", gradient_clipping=0.05)
    got, _, _ = run(zj.zero_optimizer(OPTIMIZERS["adamw"](), config=config), params, data, True)
    for u, w in zip(got, want):
        # the clip scale is 0.05 / a global norm summed in an order each compiler picks; a one-ulp change in
        # it moves Adam's update by a few ulps (the unclipped run is 1e-3 away)
        assert max_rel_err(u, w) < 3e-6


def test_optimizer_that_cannot_run_on_the_host_is_updated_on_the_device():
    """adafactor makes device constants inside its update: a warning by name, the same numbers,
    and the state still in host memory between steps."""
    params = init_params(jax.random.PRNGKey(0))
    data = batches(3)
    _, want = reference_updates(OPTIMIZERS["adafactor"], params, data)
    tx = zj.zero_optimizer(OPTIMIZERS["adafactor"](), config=zj.ZeroConfig(stage=1, offload_optimizer="cpu"))
    with pytest.warns(HostUpdateWarning, match="offload_optimizer='cpu'"):
        _, got, state = run(tx, params, data, True)
    # its factored statistics sum over the 8 partitions in another order: compare the params
    assert max_rel_err(got, want) < 1e-6
    assert kinds(state.inner) == {"pinned_host"}


@pytest.mark.parametrize("kwargs,match", [
    (dict(offload_optimizer="nvme", nvme_path="/tmp"), r'offload_optimizer="nvme".*make_train_step.*zj\.initialize'),
    (dict(offload_optimizer="cpu", offload_ratio=0.5, stage=3), r"offload_ratio=0\.5.*make_train_step"),
])
def test_refused_offload_settings(kwargs, match):
    config = zj.ZeroConfig(**{"stage": 2, **kwargs})
    with pytest.raises(ConfigError, match=match):
        zj.zero_optimizer(optax.adamw(1e-2), config=config)


def test_offload_param_is_warned():
    config = zj.ZeroConfig(stage=3, offload_optimizer="cpu", offload_param="cpu")
    with pytest.warns(IgnoredKeysWarning, match="offload_param"):
        zj.zero_optimizer(optax.adamw(1e-2), config=config)


DONATING = r"""
import jax, jax.numpy as jnp, optax
import zerojax as zj
from tests.helpers import max_rel_err
from tests.test_optim import kinds

# shapes that divide the 8 devices: the stored moments have exactly the updates' shapes
params = {{"w": jax.random.normal(jax.random.PRNGKey(0), (16, 8)), "b": jnp.ones((8,))}}
xs = [jax.random.normal(jax.random.PRNGKey(i), (4, 16)) for i in range(1, 4)]

def loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

ref, ref_state = params, optax.adamw(1e-2).init(params)
for x in xs:
    u, ref_state = optax.adamw(1e-2).update(jax.grad(loss)(ref, x), ref_state, ref)
    ref = optax.apply_updates(ref, u)
tx = zj.zero_optimizer(optax.adamw(1e-2), mesh=zj.make_mesh({devices}),
                      config=zj.ZeroConfig(stage={stage}, offload_optimizer="cpu"))

def step(p, s, x):
    u, s = tx.update(jax.grad(loss)(p, x), s, p)
    return u, optax.apply_updates(p, u), s

step = jax.jit(step, donate_argnums=(1,))  # no out_shardings
state = tx.init(params)
for x in xs:
    u, params, state = step(params, state, x)
assert max_rel_err(params, ref) < 1e-6
assert kinds(state.inner) == {{"pinned_host"}}
print("DONATED-OK")
"""


@pytest.mark.parametrize("devices,stage", [(1, 1), (8, 2)])
def test_donated_state_in_callers_jit(devices, stage):
    """A caller's jit that donates the offloaded state (without out_shardings) must not pair the
    host buffers with the device updates (the runtime aborts the process on that): run apart."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", DONATING.format(stage=stage, devices=devices)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "DONATED-OK" in out.stdout, out.stderr[-3000:]
