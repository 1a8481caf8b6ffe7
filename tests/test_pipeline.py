"""PipelineModel over a "pipe" mesh axis against plain optax on ``pipe.loss`` (tiny GPT, fp32)."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.runtime._watched_step import WatchedStep
from tests.helpers import run_benchmark
from zerojax.models.gpt import GPTConfig
from zerojax.models.gpt_pipeline import gpt_pipeline, init_pipeline_params
from zerojax.pipeline._schedule import NONE, SCHEDULES, check, make_schedule, theory_idle_fraction

CFG = GPTConfig(vocab=32, n_layer=4, d_model=16, n_head=2, seq_len=4)
PARAMS = init_pipeline_params(CFG, jax.random.PRNGKey(0))


def batches(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, CFG.vocab, (size, CFG.seq_len + 1)).astype(np.int32)} for _ in range(n)]


@functools.cache
def reference(interval, steps, size, clip=0.0):
    """Plain optax (AdamW 1e-3, every test's optimizer) on ``pipe.loss`` over ``batches(steps,
    size)``, one device; DeepSpeed's clipping written out. ``pipe.loss`` runs the blocks plainly (a
    lax.scan, remat every ``interval`` layers) whatever the schedule, so the tests that train on
    the same batches share one reference (host arrays); each compares its own pipeline run to it."""
    pipe, tx = gpt_pipeline(CFG, activation_checkpoint_interval=interval), optax.adamw(1e-3)

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(pipe.loss)(p, b)
        norm = optax.tree.norm(g)
        if clip:
            g = jax.tree_util.tree_map(lambda x: x / jnp.maximum(1.0, (norm + 1e-6) / clip), g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, norm

    p, s, losses, norms = PARAMS, tx.init(PARAMS), [], []
    for b in batches(steps, size):
        p, s, loss, norm = step(p, s, b)
        losses.append(float(loss))
        norms.append(float(norm))
    return jax.device_get(p), losses, norms


def run(pipe, tx, data, shape, **config):
    mesh = zj.make_mesh(shape, ("pipe", "data"))
    state = zj.shard_train_state(PARAMS, tx, mesh=mesh, config=zj.ZeroConfig(**config))
    step = zj.make_train_step(pipe, state)
    assert isinstance(step, WatchedStep)  # the pipeline engine's step is watched like every other
    out = []
    for b in data:
        state, m = step(state, b)
        out.append({k: float(v) for k, v in m.items()})
    return state, out


def assert_close_params(state, ref, tol=1e-5):
    got = state.full_params()
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=0, err_msg=jax.tree_util.keystr(path))


def local_layers(x):
    return {s.data.shape[0] for s in x.addressable_shards}


# ------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("stages,micro", [(1, 3), (2, 4), (4, 2), (4, 8), (3, 16)])
def test_schedule_is_valid_and_its_bubble_is_the_theory(name, stages, micro):
    s = make_schedule(name, stages, micro)
    check(s)
    assert abs(s.idle_fraction() - theory_idle_fraction(stages, micro)) < 1e-12
    for st in range(stages):
        assert sorted(s.fwd[s.fwd[:, st] != NONE, st]) == list(range(micro))
        assert sorted(s.bwd[s.bwd[:, st] != NONE, st]) == list(range(micro))


def test_1f1b_keeps_the_bubble_when_a_backward_costs_more():
    """Fused ticks (a forward and a backward each) never wait on a neighbour's longer backward;
    the serial order does, and keeps fewer inputs for it; GPipe keeps all M."""
    fused, serial = make_schedule("1f1b", 4, 8), make_schedule("1f1b-serial", 4, 8)
    assert abs(fused.idle_fraction(3.0) - theory_idle_fraction(4, 8)) < 1e-12
    assert serial.idle_fraction(3.0) > 0.4
    assert (fused.in_flight(), serial.in_flight(), make_schedule("gpipe", 4, 8).in_flight()) == (7, 4, 8)
    stage0 = [("F" if f != NONE else "") + ("B" if b != NONE else "")
              for f, b in zip(serial.fwd[:, 0], serial.bwd[:, 0])]
    assert [x for x in stage0 if x] == ["F"] * 4 + ["B", "F"] * 4 + ["B"] * 4  # DeepSpeed's TrainSchedule order


def test_check_catches_a_broken_schedule():
    s = make_schedule("1f1b", 2, 4)
    s.fwd[[1, 2], 1] = s.fwd[[2, 1], 1]  # stage 1 forwards micro-batch 1 before stage 0 sent it
    with pytest.raises(AssertionError):
        check(s)


# --------------------------------------------------------------------- parity with optax
@pytest.mark.slow
@pytest.mark.parametrize("shape,stage,micro", [((2, 4), 1, 4), ((4, 2), 2, 8)])
def test_gpt_pipeline_equals_plain_optax(shape, stage, micro):
    pipe, tx = gpt_pipeline(CFG), optax.adamw(1e-3)
    data = batches(3, shape[1] * micro * 2)
    ref, losses, norms = reference(0, 3, shape[1] * micro * 2)
    state, hist = run(pipe, tx, data, shape, stage=stage, gradient_accumulation_steps=micro)
    np.testing.assert_allclose([h["loss"] for h in hist], losses, atol=1e-5, rtol=0)
    np.testing.assert_allclose([h["grad_norm"] for h in hist], norms, rtol=1e-5)
    # AdamW moves each param up to 1e-3 a step; 3e-5 is 3% of one step (a near-zero gradient's
    # rounding, which the pipeline's reduction order changes, becomes up to 1.2e-5 through Adam)
    assert_close_params(state, ref, tol=3e-5)
    p = shape[0]
    assert all(abs(h["pipeline_idle"] - theory_idle_fraction(p, micro)) < 1e-6 for h in hist)
    # each device holds only its stage's L / P layers, of the params and of the optimizer state
    for x in jax.tree_util.tree_leaves(state.params["blocks"]):
        assert local_layers(x) == {CFG.n_layer // p}
    mu = state.opt_state[0].mu["blocks"]["mlp"]["fc"]["kernel"]  # (L, d, 4d): layers over pipe, d over data
    want = (CFG.n_layer // p, CFG.d_model // shape[1], 4 * CFG.d_model)
    assert {s.data.shape for s in mu.addressable_shards} == {want}
    emb = state.opt_state[0].mu["embed"]["wte"]  # replicated over pipe, split over data
    assert {s.data.shape[0] for s in emb.addressable_shards} == {CFG.vocab // shape[1]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-serial"])
def test_stage3_clipping_other_schedules_and_activation_checkpoints_equal_plain_optax(schedule):
    pipe, tx = gpt_pipeline(CFG, schedule=schedule, activation_checkpoint_interval=1), optax.adamw(1e-3)
    data = batches(2, 4 * 4 * 2)
    ref, losses, norms = reference(1, 2, 4 * 4 * 2, clip=0.5)
    assert min(norms) > 0.5  # the clipping acts
    state, hist = run(pipe, tx, data, (2, 4), stage=3, gradient_accumulation_steps=4, gradient_clipping=0.5,
                      param_persistence_threshold=0)
    np.testing.assert_allclose([h["loss"] for h in hist], losses, atol=1e-5, rtol=0)
    assert_close_params(state, ref)
    qkv = state.params["blocks"]["attn"]["qkv"]["kernel"]  # (L, d, 3d): layers over pipe, d over data
    assert {s.data.shape for s in qkv.addressable_shards} == {(2, CFG.d_model // 4, 3 * CFG.d_model)}


@pytest.mark.slow
def test_fp16_loss_scaler_skips_like_the_plain_step():
    """fp16 with a scale that overflows at first: the pipeline skips and halves the scale on the
    same steps as zerojax's data-parallel step on the same loss, and trains to the same losses."""
    pipe, tx = gpt_pipeline(CFG), optax.adamw(1e-3)
    data = batches(3, 4 * 2 * 2)
    config = dict(stage=1, gradient_accumulation_steps=2, precision="fp16", initial_scale_power=24, hysteresis=1)
    _, hist = run(pipe, tx, data, (2, 4), **config)
    plain = zj.shard_train_state(PARAMS, tx, mesh=zj.make_mesh(4), config=zj.ZeroConfig(**config))
    step, want = zj.make_train_step(pipe.loss, plain), []
    for b in data:
        plain, m = step(plain, b)
        want.append({k: float(v) for k, v in m.items()})
    assert [h["skipped"] for h in hist] == [w["skipped"] for w in want] and hist[0]["skipped"]
    assert [h["loss_scale"] for h in hist] == [w["loss_scale"] for w in want]
    np.testing.assert_allclose([h["loss"] for h in hist], [w["loss"] for w in want], atol=5e-3)


@pytest.mark.slow
def test_pipe_data_model_mesh_with_tensor_parallel_blocks_equals_plain_optax():
    """2 x 2 x 2 ("pipe", "data", "model"): the MLP's kernels split over "model" by param_specs,
    the layers over "pipe"; the "model" axis stays automatic inside the pipeline body."""
    pipe, tx = gpt_pipeline(CFG), optax.adamw(1e-3)
    specs = jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec(), PARAMS)
    specs["blocks"]["mlp"]["fc"]["kernel"] = jax.sharding.PartitionSpec(None, None, "model")
    specs["blocks"]["mlp"]["proj"]["kernel"] = jax.sharding.PartitionSpec(None, "model", None)
    data = batches(2, 2 * 2 * 2)
    ref, losses, _ = reference(0, 2, 2 * 2 * 2)
    mesh = zj.make_mesh((2, 2, 2), ("pipe", "data", "model"))
    state = zj.shard_train_state(PARAMS, tx, mesh=mesh, param_specs=specs,
                                 config=zj.ZeroConfig(stage=1, gradient_accumulation_steps=2))
    step = zj.make_train_step(pipe, state)
    got = []
    for b in data:
        state, m = step(state, b)
        got.append(float(m["loss"]))
    np.testing.assert_allclose(got, losses, atol=1e-5, rtol=0)
    assert_close_params(state, ref)
    fc = state.params["blocks"]["mlp"]["fc"]["kernel"]
    assert {s.data.shape for s in fc.addressable_shards} == {(2, CFG.d_model, 4 * CFG.d_model // 2)}


# --------------------------------------------------------------- checkpoints and memory
@pytest.mark.slow
def test_checkpoint_restores_onto_another_pipe_size(tmp_path):
    pipe, tx = gpt_pipeline(CFG), optax.adamw(1e-3)
    data = batches(2, 8)  # 4 data devices x 2 micro-batches at pipe 2; the batches (and reference) of the TP test
    state, _ = run(pipe, tx, data[:1], (2, 4), stage=1, gradient_accumulation_steps=2)
    with zj.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, state)
        mngr.wait_until_finished()
        target = zj.abstract_train_state(PARAMS, tx, mesh=zj.make_mesh((4, 2), ("pipe", "data")),
                                         config=zj.ZeroConfig(stage=1, gradient_accumulation_steps=2))
        restored, _ = mngr.restore(target)
    for x in jax.tree_util.tree_leaves(restored.params["blocks"]):
        assert local_layers(x) == {1}
    assert_close_params(restored, state.full_params(), tol=0)
    _, losses, _ = reference(0, 2, 8)
    _, hist = zj.make_train_step(pipe, restored)(restored, data[1])
    assert abs(float(hist["loss"]) - losses[1]) < 1e-5


def test_memory_report_shows_each_stage_holding_its_layers():
    tx = optax.adamw(1e-3)
    block_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(PARAMS["blocks"]))
    other_bytes = sum(x.nbytes for k in ("embed", "head") for x in jax.tree_util.tree_leaves(PARAMS[k]))
    per_device = {}
    for p in (1, 2, 4):
        mesh = zj.make_mesh((p, 8 // p), ("pipe", "data"))
        state = zj.shard_train_state(PARAMS, tx, mesh=mesh, config=zj.ZeroConfig(stage=1))
        report = zj.memory_report(state)
        per_device[p] = report.max_bytes()
        params_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(state.params))
        assert params_bytes == block_bytes // p + other_bytes
    assert per_device[1] > per_device[2] > per_device[4]


# ------------------------------------------------------------------------ refusals, keys
def test_refusals_name_the_fix():
    pipe, tx = gpt_pipeline(CFG), optax.adamw(1e-3)
    data_only = zj.shard_train_state(PARAMS, tx, mesh=zj.make_mesh(8))
    with pytest.raises(zj.ConfigError, match="'pipe' axis"):
        zj.make_train_step(pipe, data_only)
    with pytest.raises(zj.ConfigError, match="multiple of 8"):
        zj.shard_train_state(PARAMS, tx, mesh=zj.make_mesh((8, 1), ("pipe", "data")))
    state = zj.shard_train_state(PARAMS, tx, mesh=zj.make_mesh((2, 4), ("pipe", "data")))
    with pytest.raises(zj.StepOptionError, match="has_aux"):
        zj.make_train_step(pipe, state, has_aux=True)
    with pytest.raises(zj.ConfigError, match="divide the 2 layers"):
        zj.make_train_step(gpt_pipeline(CFG, activation_checkpoint_interval=3), state)
    offloaded = zj.shard_train_state(PARAMS, tx, mesh=zj.make_mesh((2, 4), ("pipe", "data")),
                                     config=zj.ZeroConfig(stage=2, offload_optimizer="cpu"))
    with pytest.raises(zj.StepOptionError, match="offload_optimizer"):
        zj.make_train_step(pipe, offloaded)
    with pytest.raises(zj.ConfigError, match="exactly the keys"):
        pipe.loss({"blocks": PARAMS["blocks"]}, batches(1, 2)[0])
    with pytest.raises(zj.ConfigError, match="schedule"):
        gpt_pipeline(CFG, schedule="zigzag")


def test_deepspeed_pipeline_block():
    ds = {"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}
    assert zj.pipeline.pipeline_options(ds, stages=2) == {"activation_checkpoint_interval": 1}
    assert zj.pipeline.pipeline_options({}) == {"activation_checkpoint_interval": 0}
    with pytest.raises(zj.ConfigError, match="pipeline.stages=2"):
        zj.pipeline.pipeline_options(ds, stages=4)
    with pytest.raises(zj.ConfigError, match="pipeline.activation_checkpoint"):
        zj.pipeline.pipeline_options({"pipeline": {"activation_checkpoint_intervall": 1}})
    for key, value in (("seed_layers", True), ("partition", "type:Block"), ("pipe_partitioned", False),
                       ("grad_partitioned", False)):
        with pytest.warns(zj.PipelineKeyWarning, match=f"pipeline.{key}"):
            zj.pipeline.pipeline_options({"pipeline": {key: value}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zj.pipeline.pipeline_options({"pipeline": {"partition": "parameters", "stages": "auto"}})
    # ZeroConfig does not read the block: it says where it is read
    with pytest.warns(zj.IgnoredKeysWarning, match="pipeline_options"):
        zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, **ds})


@pytest.mark.slow
def test_benchmark_smoke_prints_both_sections():
    """benchmarks/pipeline.py --smoke in its own process: the 1F1B bubble at P = 2, M = 2 and one
    timed round of the four contenders (two pipelines, ZeRO-1 and ZeRO-3) on a 4-layer GPT."""
    out = run_benchmark("pipeline.py", "--smoke", timeout=900)
    assert "theory" in out and "0.3333" in out  # P = 2, M = 2
    for name in ("pipe 2 x data 4, ZeRO-1", "pipe 4 x data 2, ZeRO-1", "data 8, ZeRO-1", "data 8, ZeRO-3"):
        assert name in out
