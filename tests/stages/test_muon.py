"""Owner-computed Newton–Schulz (zerojax.stages._muon): a recognised optax.contrib.muon trains
equal to one-device optax at stages 1–3 with gradient accumulation, its step holds a fixed
number of collectives (all-to-alls per matrix shape, none per Newton–Schulz matmul), and a
Muon-like transformation it does not recognise keeps running through optax."""
import functools
import os
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax._plan import path_str
from zerojax._state import unshard_params
from zerojax.config._optimizers import muon_dimension_numbers, optimizer_from_config
from zerojax.stages import _muon_owners
from zerojax.stages._muon import _nodes, muon_recipe
from zerojax.stages._muon_owners import _newton_schulz, _owners, balance, ns_flops
from zerojax.tools._compiled import collectives
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_run


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Each compiled CPU program holds memory maps until JAX's caches let it go, and this file's
    recognition probes and owner programs fill those caches: past 65530 maps (Linux's default
    vm.max_map_count) the next compile segfaults. Past 30000 the caches are cleared (the
    persistent compilation cache still serves the programs)."""
    yield
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return
    if maps > 30000:
        jax.clear_caches()


def _ds(stage, gas):
    zero = {"stage": stage, **({"param_persistence_threshold": 0} if stage == 3 else {})}
    return {"train_micro_batch_size_per_gpu": 4 // gas, "gradient_accumulation_steps": gas,
            "zero_optimization": zero, "optimizer": {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.01}}}


def _reference_tx():
    return optax.contrib.muon(0.02, beta=0.95, eps=1e-10, weight_decay=0.01, adam_b1=0.9, adam_b2=0.95,
                              adam_weight_decay=0.01, muon_weight_dimension_numbers=muon_dimension_numbers())


def _optax_trajectory(tx, loss, params, data):
    """One-device optax, one jitted step: [(params, optimizer state) after each batch of ``data``]."""
    @jax.jit
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

    out, p, s = [], params, tx.init(params)
    for b in data:
        p, s = step(p, s, b)
        out.append((p, s))
    return out


@functools.lru_cache(maxsize=None)
def _muon_trajectory():
    return _optax_trajectory(_reference_tx(), loss_fn, init_params(jax.random.PRNGKey(0)), batches(10))


def _muon_reference(steps):
    """DeepSpeed's Muon (:func:`_reference_tx`) in one-device optax on the small model, from
    ``init_params(PRNGKey(0))`` over the first ``steps`` of ``batches(10)`` (``batches(6)`` is
    their first 6): (params, optimizer state). Computed once for every test that trains the small
    model with it; each test compares its own zerojax run against it."""
    return _muon_trajectory()[steps - 1]


@functools.lru_cache(maxsize=None)
def _deepspeed_muon_run(stage):
    """zj.initialize with DeepSpeed's Muon at ``stage`` with accumulation 2, 10 steps: (whether
    Muon was recognised, the params after, the collectives of its compiled step). The step is
    compiled once (``lower().compile()``, which its first call reuses): the accumulation test
    checks its training, the offload test compares the offloaded step's collectives with it."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    state, step = zj.initialize(params, loss_fn, _ds(stage, 2))
    recognised = muon_recipe(state.plan, state.tx) is not None
    kinds = collectives(step.lower(state, data[0]).compile().as_text())
    for b in data:
        state, _ = step(state, b)
    return recognised, unshard_params(state), kinds


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_muon_on_owners_equals_optax_with_accumulation(stage):
    recognised, got, _ = _deepspeed_muon_run(stage)
    assert recognised
    assert max_rel_err(got, _muon_reference(10)[0]) < 1e-5


def test_a_scheduler_drives_both_learning_rates_on_owners():
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    ds = {**_ds(2, 1), "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 3, "total_num_steps": 10}}}
    state, step = zj.initialize(params, loss_fn, ds)
    assert muon_recipe(state.plan, state.tx) is not None
    lrs = []
    for b in data:
        state, metrics = step(state, b)
        lrs.append(float(metrics["learning_rate"]))
    assert len(set(lrs)) > 3  # the schedule moved
    ref = reference_run(params, optimizer_from_config(zj.ZeroConfig.from_deepspeed(ds, world_size=8)), data)
    assert max_rel_err(unshard_params(state), ref.params) < 1e-5


def _stacked_params(key):
    k = jax.random.split(key, 4)
    return {"emb": jax.random.normal(k[0], (40, 16)) * 0.3,
            "layers": {"a": jax.random.normal(k[1], (3, 16, 24)) * 0.3, "b": jax.random.normal(k[2], (3, 24, 16)) * 0.3,
                       "g": jnp.ones((3, 16))},
            "mix": jax.random.normal(k[3], (16, 24)) * 0.3}


def _stacked_loss(p, batch):
    h = p["emb"][batch["tok"]].mean(1)
    for i in range(3):
        h = h + jnp.tanh(h @ p["layers"]["a"][i]) @ p["layers"]["b"][i] * p["layers"]["g"][i]
    h = h + jnp.tanh(h @ p["mix"]) @ p["layers"]["b"][0]
    return jnp.mean((h - batch["y"][:, None]) ** 2)


def test_stacked_leaves_share_stacks_with_2d_ones_and_match_optax():
    params = _stacked_params(jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    data = [{"tok": rng.integers(0, 40, (32, 4)).astype(np.int32), "y": rng.standard_normal(32).astype(np.float32)}
            for _ in range(10)]
    tx = optax.inject_hyperparams(optax.contrib.muon, static_args=("muon_weight_dimension_numbers",))(
        learning_rate=0.01, weight_decay=0.01, muon_weight_dimension_numbers=muon_dimension_numbers())
    state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=1))
    assert muon_recipe(state.plan, tx) is not None
    step = zj.make_train_step(_stacked_loss, state)
    for b in data:
        state, _ = step(state, b)
    ref = optax.contrib.muon(0.01, weight_decay=0.01, muon_weight_dimension_numbers=muon_dimension_numbers())
    p, _ = _optax_trajectory(ref, _stacked_loss, params, data)[-1]
    assert max_rel_err(unshard_params(state), p) < 1e-5


def test_a_bare_optax_muon_is_read_from_its_parts_and_runs_on_owners():
    params, data = init_params(jax.random.PRNGKey(0)), batches(6)
    make = lambda: optax.contrib.muon(0.02, beta=0.9, weight_decay=0.01, adam_b1=0.8)  # noqa: E731
    state = zj.shard_train_state(params, make(), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2))
    recipe = muon_recipe(state.plan, state.tx)
    assert recipe is not None and dict(recipe.constants)["adam_b1"] == pytest.approx(0.8)
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    assert max_rel_err(unshard_params(state), reference_run(params, make(), data).params) < 1e-5


@pytest.mark.parametrize("make", [
    lambda: optax.contrib.muon(optax.linear_schedule(0.02, 0.0, 10)),  # a schedule outside inject_hyperparams
    lambda: optax.inject_hyperparams(optax.contrib.muon, static_args=("nesterov",))(learning_rate=0.02,
                                                                                   nesterov=False),
    lambda: optax.inject_hyperparams(optax.contrib.muon, static_args=("ns_steps",))(learning_rate=0.02, ns_steps=3),
], ids=["schedule", "no-nesterov", "3-iterations"])
def test_muon_like_transformations_not_recognised_run_through_optax(make):
    params, data = init_params(jax.random.PRNGKey(0)), batches(4)
    state = zj.shard_train_state(params, make(), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=1))
    assert muon_recipe(state.plan, state.tx) is None
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    assert max_rel_err(unshard_params(state), reference_run(params, make(), data).params) < 1e-5


def _layer_params(layers, d=32):
    rng = np.random.default_rng(0)
    return {f"l{i}": {"a": (rng.standard_normal((d, 4 * d)) / np.sqrt(d)).astype(np.float32),
                      "b": (rng.standard_normal((4 * d, d)) / np.sqrt(4 * d)).astype(np.float32),
                      "g": np.ones((d,), np.float32)} for i in range(layers)}


def _layer_loss(p, batch):
    h = batch["x"]
    for i in range(len(p)):
        h = (h + jnp.tanh(h @ p[f"l{i}"]["a"]) @ p[f"l{i}"]["b"]) * p[f"l{i}"]["g"]
    return jnp.mean(h ** 2)


@functools.lru_cache(maxsize=None)
def _layer_txs():
    """The Muon (inject_hyperparams, lr 1e-3) and AdamW of the collectives test, one object each
    for both stages: the Muon recognition (cached per transformation and param shapes) then runs
    once for the 24 leaves (and once for the momentum-share test's shapes)."""
    return (("muon", optax.inject_hyperparams(optax.contrib.muon)(learning_rate=1e-3)),
            ("adamw", optax.adamw(1e-3)))


@pytest.mark.parametrize("stage", [1, 3])
def test_collectives_do_not_follow_the_iterations_and_bytes_stay_within_adamws_plus_the_muon_params(stage):
    params = _layer_params(8)
    batch = {"x": np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)}
    config = zj.ZeroConfig(stage=stage, param_persistence_threshold=0)
    reports = {}
    for name, tx in _layer_txs():
        state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(), config=config)
        step = zj.make_train_step(_layer_loss, state)
        reports[name] = collectives(step.lower(state, batch).compile().as_text())
    muon, adamw = reports["muon"], reports["adamw"]
    count = lambda r: sum(v[0] for v in r.kinds.values())  # noqa: E731
    # two matrix shapes: one all-to-all to the owners and one back for each, whatever the iterations
    assert muon.count("all-to-all") == 4
    assert count(muon) - muon.count("all-to-all") <= count(adamw)
    muon_bytes = 4 * sum(x.size for x in jax.tree_util.tree_leaves(params) if x.ndim == 2)
    assert muon.total_bytes <= adamw.total_bytes + 1.0 * muon_bytes


# ------------------------------------------------------------------ offload_optimizer="cpu"


def _offloaded(ds, **offload):
    ds = {**ds, "zero_optimization": {**ds["zero_optimization"], "offload_optimizer": {"device": "cpu", **offload}}}
    return ds


def _moment_kinds(opt_state):
    """The memory kinds of the Muon momentum and the AdamW group's moments, by group."""
    parts = opt_state.inner_state.inner_states
    muon, adam = parts["muon"].inner_state[0], parts["adam"].inner_state[0]
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(tree)}  # noqa: E731
    return {"muon": kinds(muon.mu), "adam": kinds((adam.mu, adam.nu))}


@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_muon_keeps_its_state_on_the_host_and_orthogonalises_on_owners(stage):
    """Muon with offload_optimizer cpu: the momentum and the AdamW moments live in pinned host
    memory between steps, the momentum is updated on the device and orthogonalised on owners
    (the collectives of the step without offload: all-to-alls, none per Newton–Schulz matmul),
    the AdamW group on the host, and the params equal one-device optax's."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    state, step = zj.initialize(params, loss_fn, _offloaded(_ds(stage, 2)))
    assert state.plan.host_update and muon_recipe(state.plan, state.tx) is not None
    lowered = step.lower(state, data[0])
    assert '_xla_compute_type = "host"' in lowered.as_text()  # the AdamW group
    want = _deepspeed_muon_run(stage)[2]  # the same config's step without offload
    got = collectives(lowered.compile().as_text())
    assert got.count("all-to-all") > 0 and {k: v[0] for k, v in got.kinds.items()} == {
        k: v[0] for k, v in want.kinds.items()}
    for b in data:
        state, _ = step(state, b)
    assert _moment_kinds(state.opt_state) == {"muon": {"pinned_host"}, "adam": {"pinned_host"}}
    assert max_rel_err(unshard_params(state), _muon_reference(10)[0]) < 1e-5


@pytest.mark.slow
def test_partially_offloaded_muon_keeps_each_side_and_equals_optax():
    """offload_ratio 0.5 at stage 3: each leaf's state stays on its side (no HostUpdateWarning),
    the update runs on owners and equals optax."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, step = zj.initialize(params, loss_fn, _offloaded(_ds(3, 1), ratio=0.5))
        assert state.plan.partial_offload and muon_recipe(state.plan, state.tx) is not None
        for b in data:
            state, _ = step(state, b)
    on_host = {lay.path for lay in state.plan.leaves if state.plan.opt_on_host(lay)}
    assert on_host and len(on_host) < len(state.plan.leaves)
    parts = state.opt_state.inner_state.inner_states
    for name, group in (("muon", parts["muon"].inner_state[0].mu), ("adam", parts["adam"].inner_state[0].mu)):
        for path, x in jax.tree_util.tree_flatten_with_path(group)[0]:
            want = "pinned_host" if path_str(path) in on_host else "device"
            assert x.sharding.memory_kind == want, (name, path_str(path))
    assert max_rel_err(unshard_params(state), _muon_reference(6)[0]) < 1e-5


def test_muon_with_zenflow_is_refused_by_name():
    """ZenFlow updates AdamW-family state on the host: Muon is refused, named, with the
    offloads that run it."""
    ds = _offloaded(_ds(2, 1))
    ds["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1}
    with pytest.raises(zj.OptimizerError, match="zenflow") as e:
        zj.initialize(init_params(jax.random.PRNGKey(0)), loss_fn, ds)
    assert "does not run Muon (optax.contrib.muon" in str(e.value) and 'offload_optimizer "cpu" or "nvme"' in str(e.value)


def test_nvme_refuses_a_muon_it_does_not_recognise_by_name(tmp_path):
    """A Muon the NVMe loop cannot reproduce (its lr a schedule outside inject_hyperparams) is
    refused, named, with the ways to build one it runs."""
    tx = optax.contrib.muon(optax.linear_schedule(0.02, 0.0, 10))
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx, mesh=zj.make_mesh(),
                                 config=zj.ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)))
    with pytest.raises(zj.OptimizerError, match="nvme") as e:
        zj.make_train_step(loss_fn, state)
    assert "Muon (optax.contrib.muon" in str(e.value) and "inject_hyperparams" in str(e.value)


def _host_loop(step):
    """The NVMe host loop inside the step zj.initialize returns."""
    while not hasattr(step, "store"):
        step = step.step
    return step


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_muon_keeps_its_momentum_in_the_files_and_equals_optax(stage, tmp_path):
    """offload_optimizer nvme with DeepSpeed's Muon: the master, the Muon momentum and the AdamW
    moments live in the store's files; each step reads the momentum, orthogonalises on the
    device's owners and updates in one pass over the files. 10 steps equal one-device optax,
    params and momentum."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    ds = _ds(stage, 1)
    ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    state, step = zj.initialize(params, loss_fn, ds)
    loop = _host_loop(step)
    assert loop.muon is not None and state.plan.optimizer_state_outside
    for b in data:
        state, metrics = step(state, b)
    p, ref_state = _muon_reference(10)
    assert max_rel_err(unshard_params(state), p) < 1e-5
    assert float(metrics["learning_rate"]) == pytest.approx(0.02)
    m = state.plan.treedef.unflatten(jax.tree_util.tree_leaves(loop.layout.views(loop.store.read("m"))))
    want = _nodes(ref_state)[0].mu
    muon = {path_str(k) for k, x in jax.tree_util.tree_flatten_with_path(want)[0]}
    by_path = lambda tree: {path_str(k): np.asarray(x) for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]  # noqa: E731
                            if path_str(k) in muon}
    assert muon and max_rel_err(by_path(m), by_path(want)) < 1e-5
    assert any(f.startswith("slot") for _, _, files in os.walk(tmp_path) for f in files)


def test_an_overflowing_fp16_step_leaves_offloaded_muon_state_bitwise_unchanged():
    """The skip reaches both halves: the device's (Muon momentum, counts, master) and the host
    computation's (the AdamW group's moments and master)."""
    tx = optax.inject_hyperparams(optax.contrib.muon)(learning_rate=0.02, weight_decay=0.01)
    config = zj.ZeroConfig(stage=2, precision="fp16", offload_optimizer="cpu", initial_scale_power=100)
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx, mesh=zj.make_mesh(), config=config)
    step = zj.make_train_step(loss_fn, state)
    host = lambda s: [np.asarray(x) for x in jax.tree_util.tree_leaves((s.params, s.master, s.opt_state))]  # noqa: E731
    before = host(state)
    state, metrics = step(state, batches(1)[0])
    assert bool(metrics["skipped"])
    assert all(np.array_equal(a, b) for a, b in zip(before, host(state)))
    assert _moment_kinds(state.opt_state) == {"muon": {"pinned_host"}, "adam": {"pinned_host"}}


@pytest.mark.slow
@pytest.mark.parametrize("precision,stage,extra", [("bf16", 2, {}), ("fp16", 1, {}),
                                                   ("bf16", 3, {"offload_param": "cpu"})])
def test_offloaded_muon_in_mixed_precision_equals_muon_on_the_device(precision, stage, extra):
    """16-bit params over an fp32 master in host memory (and params offloaded at stage 3): the
    same params and master as Muon with its state on the device (bitwise under XLA's default
    flags; the tests' fast-compile flags fuse the two programs differently)."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(6)
    tx = optax.inject_hyperparams(optax.contrib.muon)(learning_rate=0.02, weight_decay=0.01)
    out = []
    for offload in ({}, {"offload_optimizer": "cpu", **extra}):
        state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(),
                                     config=zj.ZeroConfig(stage=stage, precision=precision, **offload))
        step = zj.make_train_step(loss_fn, state)
        for b in data:
            state, _ = step(state, b)
        out.append(state)
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(out[1].master)} == {"pinned_host"}
    host = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731
    assert max_rel_err(host(unshard_params(out[0])), host(unshard_params(out[1]))) < 1e-5
    assert max_rel_err(host(out[0].master), host(out[1].master)) < 1e-5


# ------------------------------------------------------------------ stage 0


def test_stage_0_orthogonalises_each_matrix_once_and_equals_optax():
    """Stage 0 (every device holds the whole state): each device orthogonalises its 1/N of the
    matrices and one all-gather per matrix shape shares the results, instead of every device
    running the iterations on every matrix; 10 steps with accumulation equal optax's."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    state, step = zj.initialize(params, loss_fn, _ds(0, 2))
    assert muon_recipe(state.plan, state.tx) is not None
    shapes = {tuple(lay.shape[-2:]) for lay, m in zip(state.plan.leaves, muon_recipe(state.plan, state.tx).muon) if m}
    got = collectives(step.lower(state, data[0]).compile().as_text())
    assert got.count("all-gather") == len(shapes) and got.count("all-to-all") == 0
    for b in data:
        state, _ = step(state, b)
    assert max_rel_err(unshard_params(state), _muon_reference(10)[0]) < 1e-5


@pytest.mark.slow
def test_offloaded_muon_checkpoints_restore_on_the_device_and_offloaded(tmp_path):
    """Saved at stage 1 with the state in host memory, restored at stage 3 on the device and at
    stage 2 offloaded: both continue to one-device optax's params."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(6)
    state, step = zj.initialize(params, loss_fn, _offloaded(_ds(1, 1)))
    for b in data[:3]:
        state, _ = step(state, b)
    manager = zj.CheckpointManager(str(tmp_path))
    manager.save(3, state)
    manager.wait_until_finished()
    want = _muon_reference(6)[0]
    for ds in (_ds(3, 1), _offloaded(_ds(2, 1))):
        target, step = zj.initialize(params, loss_fn, ds)
        restored, _ = zj.checkpoint.restore(str(tmp_path), target)
        for b in data[3:]:
            restored, _ = step(restored, b)
        assert max_rel_err(unshard_params(restored), want) < 1e-5
    assert _moment_kinds(restored.opt_state) == {"muon": {"pinned_host"}, "adam": {"pinned_host"}}


# ------------------------------------------------------------------ per-device shares


@pytest.mark.parametrize("stage", [1, 3])
def test_each_device_holds_a_1_over_n_share_of_the_muon_momentum(stage):
    """From the state's shards: every device holds 4 Psi_muon / N bytes of Muon momentum, within
    one matrix (the partitions' padding), and nothing of the AdamW leaves in it."""
    params = _layer_params(3, d=16)
    tx = _layer_txs()[0][1]  # one object for both stages: its recognition on these shapes runs once
    state = zj.shard_train_state(params, tx, mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=stage))
    assert muon_recipe(state.plan, tx) is not None
    mu = jax.tree_util.tree_leaves(_nodes(state.opt_state)[0].mu)
    assert sorted(x.shape for x in mu) == sorted(x.shape for x in jax.tree_util.tree_leaves(params) if x.ndim == 2)
    per = {}
    for x in mu:
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    n = state.plan.n
    want = 4 * sum(x.size for x in mu) / n
    assert len(per) == n and all(abs(b - want) <= 4 * 16 * 64 for b in per.values()), (per, want)


def _ns_flops_compiled(counts, per_device=None, one_device=False):
    """Per-device FLOPs of the owner Newton–Schulz program alone (stage 1) for ``counts``, or
    (``one_device``) of the iterations on every matrix on one device."""
    mesh = zj.make_mesh()
    n = mesh.devices.size
    coeffs = _nodes(optax.contrib.muon(1e-3).init({"w": jnp.zeros((4, 4))}))[0].ns_coeffs
    if one_device:
        stacks = {k: jax.ShapeDtypeStruct((c,) + k, jnp.float32) for k, c in counts.items()}
        fn = jax.jit(lambda st: _newton_schulz(st, coeffs, 1e-8, lambda run, x, _: run(x)))
    else:
        per_device = per_device or balance(counts, n)
        stacks = {k: jax.ShapeDtypeStruct((-(-c // n) * n,) + k, jnp.float32,
                                          sharding=NamedSharding(mesh, P("data"))) for k, c in counts.items()}
        plan = types.SimpleNamespace(data_axis="data", mesh=mesh, stage=1)
        fn = jax.jit(lambda st: _newton_schulz(st, coeffs, 1e-8, _owners(plan), per_device))
    cost = fn.lower(stacks).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def test_shapes_with_fewer_matrices_than_devices_are_balanced_over_the_owners():
    """3 matrices of one shape and 5 of another (as costly) on 8 devices: each owner runs the
    iterations on one real matrix (the compiled program's FLOPs per device within 1.15x of the
    iterations' on one device over N), where running every slot of each shape's blocks (padding
    included) costs 2x."""
    counts = {(16, 64): 3, (64, 16): 5}
    per_device = balance(counts, 8)
    assert sorted(sum(a.values()) for a in per_device) == [1] * 8
    assert sum(c * ns_flops(*k) for k, c in counts.items()) == 8 * ns_flops(16, 64)
    total = _ns_flops_compiled(counts, one_device=True)
    full = _ns_flops_compiled(counts, tuple({k: 1 for k in counts} for _ in range(8)))
    mine = _ns_flops_compiled(counts)
    assert full > 1.8 * total / 8  # the unbalanced program: two matrices per owner
    assert mine <= 1.15 * total / 8


def _balanced_loss(p, batch):
    h = batch["x"]
    for i in range(3):
        h = jnp.tanh(h @ p["a"][i]) @ p["b"][i]
    return jnp.mean((h @ p["b"][3:].sum(0).T - batch["y"]) ** 2) + jnp.mean(p["b"][4] ** 2)


def _balanced_setup():
    """(params, data, a maker of the Muon) of the balanced-owners test."""
    rng = np.random.default_rng(0)
    params = {"a": (rng.standard_normal((3, 16, 24)) * 0.3).astype(np.float32),
              "b": (rng.standard_normal((5, 24, 16)) * 0.3).astype(np.float32)}
    data = [{"x": rng.standard_normal((16, 16)).astype(np.float32), "y": rng.standard_normal((16, 24)).astype(np.float32)}
            for _ in range(10)]
    dims = muon_dimension_numbers()
    return params, data, lambda: optax.contrib.muon(0.02, weight_decay=0.01, muon_weight_dimension_numbers=dims)


@functools.lru_cache(maxsize=None)
def _balanced_reference():
    """One-device optax's params after the balanced test's 10 steps (computed once for both cases)."""
    params, data, make = _balanced_setup()
    return _optax_trajectory(make(), _balanced_loss, params, data)[-1][0]


@pytest.mark.parametrize("branches", [32, 1], ids=["a-branch-per-owner", "every-slot"])
def test_balanced_owners_train_like_optax(branches, monkeypatch):
    """The balanced assignment (3 matrices of one shape, 5 of another, each owner its own
    branch) trains equal to one-device optax over 10 steps; so does the program past its
    branch limit, where every owner iterates on every slot (the empty ones stay zero)."""
    monkeypatch.setattr(_muon_owners, "_MAX_BRANCHES", branches)
    params, data, make = _balanced_setup()
    state = zj.shard_train_state(params, make(), mesh=zj.make_mesh(), config=zj.ZeroConfig(stage=2))
    assert muon_recipe(state.plan, state.tx) is not None
    step = zj.make_train_step(_balanced_loss, state)
    for b in data:
        state, _ = step(state, b)
    assert max_rel_err(unshard_params(state), _balanced_reference()) < 1e-5


# ------------------------------------------------------------------ zj.zero_optimizer


def _zero_optimizer_muon():
    return optax.contrib.muon(0.02, weight_decay=0.01)


@functools.lru_cache(maxsize=None)
def _zero_optimizer_reference():
    """One-device optax's params after 10 steps of :func:`_zero_optimizer_muon` on the small
    model (computed once for the three stages)."""
    return _optax_trajectory(_zero_optimizer_muon(), loss_fn, init_params(jax.random.PRNGKey(0)), batches(10))[-1][0]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_optimizer_runs_muon_on_owners_and_equals_optax(stage):
    """zj.zero_optimizer(optax.contrib.muon(...)) in the caller's own jitted loop: the iterations
    on owners (one all-to-all per matrix shape each way at stages 1-3, one all-gather at stage 0;
    no all-reduce per Newton–Schulz matmul, which optax's update on the partitions makes), and
    10 steps equal one-device optax."""
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    mesh = zj.make_mesh()
    tx = zj.zero_optimizer(_zero_optimizer_muon(), mesh=mesh, config=zj.ZeroConfig(stage=stage))
    opt_state = tx.init(params)
    # the loop's params come back replicated on the mesh: they start there, so the program lowered
    # here is the one every step runs (from init_params' single-device arrays the first call
    # compiled it a second time: the same HLO but for source-line metadata, keyed apart by jit)
    params = jax.device_put(params, NamedSharding(mesh, P()))

    @jax.jit
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, u), s

    got = collectives(step.lower(params, opt_state, data[0]).compile().as_text())
    shapes = {x.shape for x in jax.tree_util.tree_leaves(params) if x.ndim == 2}  # Muon's leaves
    kind = "all-to-all" if stage else "all-gather"
    assert got.count(kind) == (2 if stage else 1) * len(shapes) and got.count("all-reduce") == 0, got.kinds
    p = params
    for b in data:
        p, opt_state = step(p, opt_state, b)
    assert max_rel_err(p, _zero_optimizer_reference()) < 1e-5
