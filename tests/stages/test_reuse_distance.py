"""``max_reuse_distance`` (DeepSpeed's stage3_max_reuse_distance): a stage-3 param used again
within that many elements of other params' fetches keeps its gathered copy; farther away the
forward pass gathers it again. The numbers never change; the compiled gathers do."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import max_rel_err

D_IN, D = 48, 32
LAYERS = 4


def _twice_loss(params, batch):
    """``w`` is used at the first layer and again (transposed) at the last: ``v`` in between."""
    h = jnp.tanh(batch["x"] @ params["w"])
    h = jnp.tanh(h @ params["v"])
    return jnp.mean((h @ params["w"].T - batch["y"]) ** 2)


def _scan_loss(params, batch):
    """``w`` used before and after a scan over LAYERS stacked layers of D x D."""
    h = jnp.tanh(batch["x"] @ params["w"])
    h, _ = jax.lax.scan(lambda c, layer: (jnp.tanh(c @ layer), None), h, params["layers"])
    return jnp.mean((h @ params["w"].T - batch["y"]) ** 2)


def _params(kind):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    w = jax.random.normal(k1, (D_IN, D)) * 0.3
    if kind == "twice":
        return {"w": w, "v": jax.random.normal(k2, (D, D)) * 0.3}
    return {"w": w, "layers": jax.random.normal(k2, (LAYERS, D, D)) * 0.3}


LOSSES = {"twice": _twice_loss, "scan": _scan_loss}
BETWEEN = {"twice": D * D, "scan": LAYERS * D * D}  # elements of other params between w's two uses


def _config(distance, gas=1):
    return zj.ZeroConfig(stage=3, param_persistence_threshold=0, max_reuse_distance=distance,
                         gradient_accumulation_steps=gas)


def _data(steps=4, batch=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(batch, D_IN)).astype(np.float32),
             "y": rng.normal(size=(batch, D_IN)).astype(np.float32)} for _ in range(steps)]


@pytest.mark.parametrize("kind", ["twice", "scan"])
@pytest.mark.parametrize("distance", [0, 10**9], ids=["regather", "reuse"])
def test_numerics_match_plain_optax_whether_reused_or_gathered_again(kind, distance):
    loss, params, data, tx = LOSSES[kind], _params(kind), _data(), optax.adam(1e-2)
    p, s = params, tx.init(params)
    for b in data:
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        p = optax.apply_updates(p, u)
    state = zj.shard_train_state(params, tx, config=_config(distance, gas=2))
    assert all(lay.params_partitioned for lay in state.plan.leaves)
    step = zj.make_train_step(loss, state)
    for b in data:
        state, _ = step(state, b)
    assert max_rel_err(state.full_params(), p) < 1e-6


def _report(kind, distance, **config):
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params(kind))
    state = zj.abstract_train_state(shapes, optax.sgd(0.1), config=_config(distance).replace(**config))
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _data(1)[0])
    return zj.comm_report(zj.make_train_step(LOSSES[kind], state), state, batch)


@pytest.mark.parametrize("kind", ["twice", "scan"])
def test_gathered_again_exactly_when_the_distance_is_exceeded(kind):
    between = BETWEEN[kind]
    total = sum(x.size for x in jax.tree_util.tree_leaves(_params(kind)))
    at_limit = _report(kind, between)       # exactly `between` elements apart: still reused
    regather = _report(kind, between - 1)   # one element farther than allowed: gathered again
    # one more forward all-gather, of w (D_IN x D fp32), and nothing else changes
    count, nbytes, elements = regather.kinds["all-gather"]
    assert count == at_limit.count("all-gather") + 1, (at_limit, regather)
    assert elements - at_limit.kinds["all-gather"][2] == D_IN * D
    assert nbytes - at_limit.kinds["all-gather"][1] == D_IN * D * 4
    # both uses' cotangents still meet: one reduce-scatter per param either way
    assert {k: v for k, v in regather.kinds.items() if k != "all-gather"} == \
        {k: v for k, v in at_limit.kinds.items() if k != "all-gather"}
    # within the default distance nothing is gathered twice, forward or backward: each param once
    reuse = _report(kind, 10**9)
    assert reuse.kinds["all-gather"][2] == total
    assert reuse.kinds["reduce-scatter"] == regather.kinds["reduce-scatter"]
    # distance 0: every param gathered again for the backward pass (w there once: the first
    # layer's derivative does not read it), and w again in the forward pass
    assert _report(kind, 0).kinds["all-gather"][2] == 2 * total + D_IN * D


def _gathered(distance, **config):
    return _report("twice", distance, **config).kinds["all-gather"][2]


def test_kept_for_backward_by_deepspeeds_rule():
    """A param stays gathered from its forward to its backward use when fewer than
    ``max_reuse_distance`` elements are fetched in between: the rest of the forward pass and the
    backward pass of that rest, twice what follows its use. Here v's backward use is 2 * w away
    (w's second use, forward and backward), w's second use's 0; the first layer's backward
    does not read w."""
    w, v = D_IN * D, D * D
    assert _gathered(2 * w + 1) == w + v  # everything kept: each param gathered once
    assert _gathered(2 * w) == w + v + v  # v gathered again for the backward pass
    assert _gathered(1) == (w + v + w) + v  # w also gathered again in the forward pass (v > 1)
    # at most max_live_parameters elements kept, the nearest uses first: w's second use fits,
    # v then does not; w's first use would hold the copy already kept
    assert _gathered(10**9, max_live_parameters=w + v - 1) == w + v + v
    assert _gathered(10**9, max_live_parameters=w + v) == w + v
