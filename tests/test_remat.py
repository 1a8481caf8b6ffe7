"""DeepSpeed's activation_checkpointing block and zj.remat: the example GPT checkpoints its blocks
when the block is in the config (and only then), training exactly as without it; with
cpu_checkpointing the saved inputs are typed as host memory in the step's program; the keys
without an effect in XLA are warned by name, partition_activations over a model axis refused."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax as zj
from tests.helpers import walk
from zerojax._remat import config_scope
from zerojax.models import gpt

CFG = gpt.GPTConfig(vocab=32, n_layer=2, d_model=16, n_head=2, seq_len=8, scan=True)
BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}  # SGD: no Adam amplifying rounding


def tokens(step):
    return {"tokens": np.random.default_rng(step).integers(0, CFG.vocab, (8, CFG.seq_len + 1)).astype(np.int32)}


def program(step, state, batch):
    return jax.make_jaxpr(step.step.jitted)(state, batch).jaxpr


def remats(jaxpr) -> int:
    return sum(eqn.primitive.name in ("remat2", "checkpoint") for eqn in walk(jaxpr))


def host_values(jaxpr) -> int:
    """Values the program places in host memory (what the offload policy saves there)."""
    return sum(getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
               for eqn in walk(jaxpr) for v in eqn.outvars)


def run(extra, stage=2, steps=3):
    config = {**BASE, "zero_optimization": {"stage": stage}, **extra}
    state, step = zj.initialize(gpt.init_params(CFG, jax.random.PRNGKey(0)), gpt.loss_fn(CFG), config)
    jaxpr = program(step, state, tokens(0))
    losses = []
    for i in range(steps):
        state, metrics = step(state, tokens(i))
        losses.append(float(metrics["loss"]))
    return losses, jaxpr, state


@pytest.fixture(scope="module")
def plain():
    return run({})


@pytest.mark.parametrize("block", [{}, {"cpu_checkpointing": True}], ids=["on", "cpu"])
def test_the_block_checkpoints_the_gpt_and_trains_as_without_it(plain, block):
    base_losses, base_jaxpr, base_state = plain
    losses, jaxpr, state = run({"activation_checkpointing": block})
    assert remats(base_jaxpr) == 0 and host_values(base_jaxpr) == 0  # no block: the GPT's program as before
    assert remats(jaxpr) > 0
    # cpu_checkpointing: each block's input is saved in host memory, and only then
    assert (host_values(jaxpr) > 0) == bool(block)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(state.full_params()), jax.tree_util.tree_leaves(base_state.full_params())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_stage3_replays_the_checkpointed_blocks(plain):
    losses, jaxpr, _ = run({"activation_checkpointing": {"cpu_checkpointing": True}}, stage=3, steps=2)
    assert remats(jaxpr) > 0 and host_values(jaxpr) > 0
    np.testing.assert_allclose(losses, plain[0][:2], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # about 20 s: a second GPT program at seq 2 beside the plain one
def test_a_deepspeed_file_with_sequence_parallelism_and_host_checkpoints_trains_as_without(plain, caplog):
    # the long-context file a DeepSpeed user brings: Ulysses over 2 devices, checkpoints on the host;
    # 2 samples x 4 data groups: the plain run's global batch of 8
    config = {**BASE, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "sequence_parallel_size": 2, "activation_checkpointing": {"cpu_checkpointing": True}}
    # the layers as a Python loop: on CPU devices XLA's runtime may start the all-to-alls inside a
    # scanned layer's loop and a collective outside it in a different order on different devices,
    # which deadlocks (3 copies of this test side by side with the layers scanned: 2 aborted)
    cfg = dataclasses.replace(CFG, scan=False)
    state, step = zj.initialize(gpt.init_params(cfg, jax.random.PRNGKey(0)), gpt.loss_fn(cfg), config)
    assert dict(state.plan.mesh.shape) == {"data": 4, "seq": 2}

    def split(i):  # the same tokens, shifted already: the form whose sequence dim is split over "seq"
        t = tokens(i)["tokens"]
        return {"inputs": t[:, :-1], "labels": t[:, 1:]}

    jaxpr = program(step, state, split(0))
    assert remats(jaxpr) > 0 and host_values(jaxpr) > 0
    assert sum(e.primitive.name == "all_to_all" for e in walk(jaxpr)) > 0
    losses = []
    with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
        for i in range(3):
            state, metrics = step(state, split(i))
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, plain[0], rtol=2e-5, atol=2e-5)
    # on CPU this program, read back from JAX's persistent cache, deadlocks: the step is not written
    if jax.config.jax_compilation_cache_dir:
        assert any("Not writing persistent cache entry" in r.getMessage() and "inf seconds" in r.getMessage()
                   for r in caplog.records)
    params = state.full_params()
    params["blocks"] = jax.tree_util.tree_map(lambda *layers: np.stack(layers), *params["blocks"])  # as scanned
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(plain[2].full_params())):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5)


def block_fn(params, x):
    return jnp.tanh(x @ params["w"]) @ params["w"].T + x


def test_remat_outside_a_step_is_jax_checkpoint_saving_the_inputs():
    params, x = {"w": jnp.ones((4, 4)) * 0.3}, jnp.arange(8.0).reshape(2, 4) / 8

    def loss(f):
        return lambda p, x: jnp.sum(f(p, f(p, x)) ** 2)

    want = jax.grad(loss(block_fn))(params, x)
    for f, n in ((zj.remat(block_fn), 2), (zj.remat(block_fn, when_configured=True), 0),
                 (zj.remat()(block_fn), 2)):
        jaxpr = jax.make_jaxpr(jax.grad(loss(f)))(params, x).jaxpr
        assert remats(jaxpr) == n and host_values(jaxpr) == 0
        np.testing.assert_allclose(jax.grad(loss(f))(params, x)["w"], want["w"], rtol=1e-6)
    # inside a step whose block asks for it: the activation (not the params) goes to the host
    scoped = config_scope(jax.grad(loss(zj.remat(block_fn))), {"cpu_checkpointing": True})
    jaxpr = jax.make_jaxpr(scoped)(params, x).jaxpr
    assert host_values(jaxpr) == 2  # one [2, 4] input per call, none for the [4, 4] params
    assert all(v.aval.shape == x.shape for e in walk(jaxpr) for v in e.outvars
               if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host)
    np.testing.assert_allclose(jax.jit(scoped)(params, x)["w"], want["w"], rtol=1e-6)


def test_pipeline_checkpoint_interval_follows_cpu_checkpointing():
    from zerojax.models.gpt_pipeline import gpt_pipeline, init_pipeline_params

    pipe = gpt_pipeline(CFG, activation_checkpoint_interval=1)
    params, batch = init_pipeline_params(CFG, jax.random.PRNGKey(0)), tokens(0)
    for block, hosted in ((None, False), ({"cpu_checkpointing": True}, True)):
        jaxpr = jax.make_jaxpr(config_scope(jax.grad(pipe.loss), block))(params, batch).jaxpr
        assert remats(jaxpr) > 0 and (host_values(jaxpr) > 0) == hosted


def test_partition_activations_is_refused_by_name_over_a_model_axis_only():
    block = {"activation_checkpointing": {"partition_activations": True}}
    # one model-parallel rank: nothing to split, in DeepSpeed as in zerojax
    assert zj.ZeroConfig.from_deepspeed({**BASE, **block}, world_size=8).activation_checkpointing[
        "partition_activations"] is True
    with pytest.raises(zj.ConfigError, match="activation_checkpointing.partition_activations=True is not supported "
                                             "with tensor_parallel.autotp_size=2.*Fix: .*cpu_checkpointing"):
        zj.ZeroConfig.from_deepspeed({**BASE, **block, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    with pytest.raises(zj.ConfigError, match="partition_activations"):
        zj.ZeroConfig(autotp_size=2, activation_checkpointing={"partition_activations": True})


@pytest.mark.parametrize("key, value", [("synchronize_checkpoint_boundary", True), ("profile", True),
                                        ("number_checkpoints", 4), ("contiguous_memory_optimization", True)])
def test_keys_without_an_effect_are_warned_by_name(key, value):
    with pytest.warns(zj.IgnoredKeysWarning, match=f"activation_checkpointing.{key}"):
        config = zj.ZeroConfig.from_deepspeed({**BASE, "activation_checkpointing": {key: value}}, world_size=8)
    assert config.activation_checkpointing[key] == value


def test_the_block_is_read_whole_and_checked():
    config = zj.ZeroConfig.from_deepspeed({**BASE, "activation_checkpointing": {"cpu_checkpointing": True}},
                                          world_size=8)
    assert config.activation_checkpointing == {
        "cpu_checkpointing": True, "partition_activations": False, "contiguous_memory_optimization": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}
    assert zj.ZeroConfig.from_deepspeed(BASE, world_size=8).activation_checkpointing is None
    with pytest.raises(zj.ConfigError, match='Unknown key "activation_checkpointing.cpu_checkpoint"'):
        zj.ZeroConfig.from_deepspeed({**BASE, "activation_checkpointing": {"cpu_checkpoint": True}}, world_size=8)
    with pytest.raises(zj.ConfigError, match="activation_checkpointing.cpu_checkpointing='yes'"):
        zj.ZeroConfig(activation_checkpointing={"cpu_checkpointing": "yes"})
    with pytest.raises(zj.ConfigError, match="params_argnums"):
        zj.remat(block_fn, params_argnums="0")
