"""Stage 3's trace of the user's loss: ``jax.numpy``'s calls stay calls while the loss is traced,
so the replay under the gradient reuses JAX's linearization of each call's program, layer after
layer, as a plain ``jit`` trace does. The step's program is the same as with every call inlined."""
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import jaxpr_as_fun

import zerojax as zj
from zerojax._compat import inlined_call, make_jaxpr_keeping_calls
from zerojax.models.gpt import GPTConfig, init_params, loss_fn
from zerojax.stages import _stage3

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import compile_time  # noqa: E402  (the benchmark's counter of primitives linearized one by one)


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2) + jnp.linalg.norm(w)


def _prims(closed):
    return [e.primitive.name for e in closed.jaxpr.eqns]


def test_jax_numpy_calls_stay_calls_in_the_loss_and_nowhere_else():
    w, x = jnp.ones((8, 4)), jnp.ones((2, 8))
    before = _prims(jax.make_jaxpr(_loss)(w, x))
    kept, shape = make_jaxpr_keeping_calls(_loss, w, x)
    assert shape.shape == () and shape.dtype == jnp.float32
    calls = [e for e in kept.jaxpr.eqns if inlined_call(e.primitive, e.params)]
    assert calls, _prims(kept)  # jax.numpy's calls (norm, mean...) kept
    # the calls' own programs are inlined as usual (JAX caches them for every later trace)
    for e in calls:
        assert not any(inlined_call(i.primitive, i.params) for i in e.params["jaxpr"].jaxpr.eqns)
    # JAX's staging is back: the same function traced again inlines every call, as before
    assert _prims(jax.make_jaxpr(_loss)(w, x)) == before
    assert not any(inlined_call(e.primitive, e.params) for e in jax.make_jaxpr(_loss)(w, x).jaxpr.eqns)
    # the kept jaxpr computes the same value
    assert np.allclose(jaxpr_as_fun(kept)(w, x)[0], _loss(w, x))


def _gpt(layers):
    cfg = GPTConfig(vocab=4096, n_layer=layers, d_model=32, n_head=4, seq_len=16)  # the table is split
    params = init_params(cfg, jax.random.PRNGKey(0))
    batch = {"tokens": np.random.default_rng(0).integers(0, cfg.vocab, (16, cfg.seq_len + 1), dtype=np.int32)}
    return cfg, params, batch


def _stage3_trace(layers, persistence=None):
    cfg, params, batch = _gpt(layers)
    extra = {} if persistence is None else {"param_persistence_threshold": persistence}
    state = zj.shard_train_state(params, optax.adamw(1e-3), mesh=zj.make_mesh(),
                                 config=zj.ZeroConfig(stage=3, **extra))
    return zj.make_train_step(loss_fn(cfg), state).jitted.trace(state, batch)


def _linearized_alone(trace):
    """Primitives JAX linearizes one by one (not through a call's cached linearization) while
    ``trace()`` runs; every call's program is linearized once beforehand."""
    trace()
    with compile_time.linearized_alone() as seen:
        trace()
    return len(seen)


@pytest.mark.parametrize("persistence", [None, 0])
def test_stage3_replay_linearizes_no_more_per_layer_than_plain_jit(persistence):
    """Each added layer costs the stage-3 trace no more linearizations than it costs plain jit's
    gradient of the same loss. Layer params whole (DeepSpeed's persistence threshold): with
    every call inlined, each primitive of a layer was linearized anew, 78 a layer against 16.
    Every param split (threshold 0): each use site's derivative and its shard's stop_gradient
    were linearized anew, 48 a layer."""

    def plain(layers):
        cfg, params, batch = _gpt(layers)
        return lambda: jax.jit(jax.value_and_grad(loss_fn(cfg))).trace(params, batch)

    plain_growth = _linearized_alone(plain(4)) - _linearized_alone(plain(2))
    assert plain_growth > 0  # the counter sees JAX's one-by-one linearizations
    s3 = [_linearized_alone(lambda n=n: _stage3_trace(n, persistence)) for n in (2, 4)]
    assert s3[1] - s3[0] <= plain_growth + 4, (s3, plain_growth)


@pytest.mark.parametrize("scan", [False, True])
def test_stage3_program_is_the_one_every_call_inlined_gives(monkeypatch, scan):
    """Keeping the calls changes how the loss is traced, not the step: the lowered program equals
    the one traced with every call inlined, prefetched gathers and their grouping included."""
    cfg, params, batch = _gpt(3)
    cfg = GPTConfig(vocab=cfg.vocab, n_layer=3, d_model=cfg.d_model, n_head=4, seq_len=cfg.seq_len, scan=scan)
    params = init_params(cfg, jax.random.PRNGKey(0))

    def lowered():
        state = zj.shard_train_state(params, optax.adamw(1e-3), mesh=zj.make_mesh(),
                                     config=zj.ZeroConfig(stage=3, param_persistence_threshold=0))
        text = zj.make_train_step(loss_fn(cfg), state).jitted.trace(state, batch).lower().as_text()
        return re.sub(r"#loc\d*|loc\([^)]*\)", "", text)

    kept = lowered()
    monkeypatch.setattr(_stage3, "make_jaxpr_keeping_calls",
                        lambda fn, *args: jax.make_jaxpr(fn, return_shape=True)(*args))
    assert kept == lowered()
    assert "all_gather" in kept


def test_a_staging_rule_that_fails_falls_back_to_the_plain_trace(monkeypatch):
    """On a JAX whose staging the kept calls do not fit, the loss is traced as usual (every call
    inlined), the value is the same, and JAX's own rule is back afterwards."""
    from jax._src.interpreters import partial_eval as pe

    import zerojax._compat as compat

    rule = pe.custom_staging_rules[compat._jit_p()]

    def broken(primitive, params):
        raise RuntimeError("a staging this JAX does not have")

    monkeypatch.setattr(compat, "inlined_call", broken)
    w, x = jnp.ones((8, 4)), jnp.ones((2, 8))
    closed, _ = make_jaxpr_keeping_calls(_loss, w, x)
    assert _prims(closed) == _prims(jax.make_jaxpr(_loss)(w, x))
    assert np.allclose(jaxpr_as_fun(closed)(w, x)[0], _loss(w, x))
    assert pe.custom_staging_rules[compat._jit_p()] is rule
