"""plan_step compiles the real step from shapes: its figures are the compiled step's own."""
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from tests.helpers import init_params, loss_fn

import zerojax as zj
from zerojax.models import gpt
from zerojax.tools._planning import Ref, plan_step, resolve

TINY_GPT = gpt.GPTConfig(vocab=96, n_layer=2, d_model=32, n_head=4, seq_len=16, scan=True)


def test_in_process_plan_is_the_real_steps_peak_and_storage():
    config = zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0)
    batch = {"tok": jnp.zeros((16, 4), jnp.int32), "y": jnp.zeros((16,), jnp.int32)}
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    plan = plan_step(init_params, loss_fn, shapes, devices=8, config=config, tx=optax.adam(1e-2))
    assert not plan.subprocess and plan.devices == 8 and plan.mesh_shape == {"data": 8}

    state = zj.shard_train_state(init_params, optax.adam(1e-2), mesh=zj.make_mesh(), config=config)
    step = zj.make_train_step(loss_fn, state)
    real = zj.peak_memory(step, state, batch)
    assert (plan.peak_bytes, plan.temp_bytes, plan.argument_bytes) == (real.peak, real.temp, real.argument)
    assert plan.stored_bytes == zj.memory_report(state).max_bytes("device")
    assert plan.n_params == sum(x.size for x in jax.tree_util.tree_leaves(init_params(jax.random.PRNGKey(0))))
    assert plan.collective_bytes > 0 and plan.compile_seconds > 0
    assert "peak per device" in str(plan)


def test_subprocess_plans_more_devices_than_this_process_has():
    assert len(jax.devices()) < 16
    config = zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0)
    batch = {"tokens": jax.ShapeDtypeStruct((16, TINY_GPT.seq_len + 1), jnp.int32)}
    plan = plan_step(functools.partial(gpt.init_params, TINY_GPT), Ref("zerojax.models.gpt:loss_fn", TINY_GPT),
                     batch, devices=16, config=config, tx=Ref("optax:adamw", 1e-3))
    assert plan.subprocess and plan.devices == 16
    assert plan.n_params == TINY_GPT.n_params
    # the stored state is the estimator's for 16 devices, computed from shapes here
    want = zj.estimate(functools.partial(gpt.init_params, TINY_GPT), 16, config).max_bytes("device")
    assert plan.stored_bytes == want
    assert plan.peak_bytes >= plan.stored_bytes
    # stage 3: gathered for forward and backward, grads reduce-scattered (3 psi, a little padding aside)
    assert 0.9 < plan.collective_elements / plan.theory_elements < 1.1


def test_failing_child_raises_with_its_stderr():
    batch = {"wrong_key": jax.ShapeDtypeStruct((16, TINY_GPT.seq_len + 1), jnp.int32)}
    with pytest.raises(zj.ZeroJaxError, match=r"(?s)child process.*16 CPU devices.*KeyError: 'tokens'"):
        plan_step(functools.partial(gpt.init_params, TINY_GPT), Ref("zerojax.models.gpt:loss_fn", TINY_GPT),
                  batch, devices=16, config=zj.ZeroConfig(stage=3))


def test_closures_are_refused_before_starting_a_child():
    batch = {"tokens": jax.ShapeDtypeStruct((16, TINY_GPT.seq_len + 1), jnp.int32)}
    with pytest.raises(zj.ConfigError, match="loss_fn=.*cannot be sent.*zj.Ref"):
        plan_step(functools.partial(gpt.init_params, TINY_GPT), gpt.loss_fn(TINY_GPT), batch, devices=16)


def test_refs_and_mesh_shapes():
    assert resolve("optax:adamw") is optax.adamw
    assert resolve(Ref("zerojax.models.gpt:GPTConfig", d_model=8)).d_model == 8
    with pytest.raises(zj.ConfigError, match="no attribute"):
        resolve("optax:no_such_thing")
    with pytest.raises(zj.ConfigError, match="module:function"):
        resolve("optax")
    with pytest.raises(zj.ConfigError, match="holds 8 devices but devices=16"):
        plan_step(init_params, loss_fn, {}, devices=16, mesh_shape={"data": 4, "model": 2})
    with pytest.raises(zj.ConfigError, match="no 'data' axis"):
        plan_step(init_params, loss_fn, {}, mesh_shape={"model": 8})


def test_cli_plan_step_prints_the_plan(capsys):
    from zerojax._cli import main

    assert main(["plan", "step", "--model", "gpt2-small", "--devices", "8", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "123,677,952 params" in out and "on 8 devices" in out and "peak per device" in out
    assert "planned / paper = 1.0" in out
