"""ZeRO++ at stage 3 on 8 devices seen as 2 nodes x 4, against plain references.

hpZ changes only where the backward gathers read from: it equals stage 3 exactly. qwZ's
gradient is the plain gradient at the weights as they arrive (each device's row quantized in
blocks, written out here in numpy from the documented format), and its loss is within the
first-order bound of the weights' quantization error. qgZ's gradient is within the bound of its
two hops: every device's gradient off by at most max|g| / (2 qmax) in the first, every node's
fp32 sum by at most max|sum| / (2 qmax) in the second.
"""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, device_micro_batches, init_params, loss_fn, max_rel_err
from zerojax.checkpoint import CheckpointManager
from zerojax._errors import ConfigError, IgnoredKeysWarning, NonFiniteError
from zerojax.models import gpt
from zerojax.stages import _collectives as C
from zerojax.stages import _quantize as Q
from zerojax.stages._zeropp import Wire, secondary_bytes
from zerojax.tools._compiled import collectives as parse_collectives
from zerojax.tools._compiled import replica_groups

N, K = 8, 4  # devices, devices per node
ALL = dict(quantized_weights=True, hpz_partition_size=K, quantized_gradients=True)
TINY = gpt.GPTConfig(vocab=128, n_layer=2, d_model=32, n_head=4, seq_len=8)


def config(**kw):
    kw.setdefault("param_persistence_threshold", 0)
    # no param kept gathered from its forward to its backward use: the backward pass gathers
    # again, from hpZ's secondary partition where it is on (under the default distance a model
    # this small is never gathered again, and hpZ has nothing to serve)
    kw.setdefault("max_reuse_distance", 0)
    return zj.ZeroConfig(stage=3, **kw)


def run(params, tx, data, cfg, loss=loss_fn):
    state = zj.shard_train_state(params, tx, config=cfg)
    step = zj.make_train_step(loss, state)
    metrics = []
    for b in data:
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
    return state, metrics


# a GPT's init in one program (op by op, the stacked layers' init compiled some 60 small programs)
gpt_init = jax.jit(gpt.init_params, static_argnums=0)


def gpt_batches(steps, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, TINY.vocab, (rows, TINY.seq_len + 1)).astype(np.int32)} for _ in range(steps)]


# ------------------------------------------------------------------ the references
def _device_blocks(lay, w, block, dtype):
    """A partitioned leaf as qwZ cuts it: padded, split into its N device rows, each row in
    blocks of min(block, row). Returns the blocks [N, nb, b] and a function mapping per-element
    values [N, nb * b] back to the leaf's logical shape."""
    widths = [(0, 0)] * w.ndim
    widths[lay.axis] = (0, lay.pad)
    padded = np.pad(np.asarray(w, dtype), widths)
    # device d's row: its shard (the d-th slice along the split dim), flat in row-major order
    before = int(np.prod(padded.shape[:lay.axis]))
    rows = padded.reshape(before, N, -1).swapaxes(0, 1).reshape(N, -1)
    c = rows.shape[1]
    b = min(block, c)
    nb = -(-c // b)
    x = np.pad(rows, [(0, 0), (0, nb * b - c)]).reshape(N, nb, b)

    def back(values):
        out = values.reshape(N, -1)[:, :c].reshape(N, before, -1).swapaxes(0, 1).reshape(padded.shape)
        return out[tuple(slice(0, s) for s in lay.shape)]

    return x, back


def quantized_weights(params, plan, block):
    """The weights as qwZ delivers them: each partitioned leaf padded, cut into its n device
    rows, every row quantized to 8 bits in blocks of min(block, row) with scale max|block|/127."""
    def one(lay, w):
        if not lay.params_partitioned:
            return np.asarray(w, np.float32)
        x, back = _device_blocks(lay, w, block, np.float32)
        amax = np.abs(x).max(-1, keepdims=True)
        ratio = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.clip(np.round(x * ratio), -127, 127)
        return back((q * (amax / np.float32(127))).astype(np.float32))
    return plan.map(one, params)


def weight_bound(params, plan, block):
    """Per element: half a quantization step of its block (max|block| / 254), 0 where not quantized."""
    return plan.map(lambda lay, w: _block_half_step(lay, w, block), params)


def _block_half_step(lay, w, block):
    if not lay.params_partitioned:
        return np.zeros_like(np.asarray(w, np.float64))
    x, back = _device_blocks(lay, w, block, np.float64)
    return back(np.repeat(np.abs(x).max(-1) / 254, x.shape[-1], axis=1))


def device_grads(params, batch, gas, loss=loss_fn):
    """[device][micro-batch] -> gradient of that micro-batch's mean loss (plain JAX, fp32)."""
    grad = jax.jit(jax.grad(loss))
    return [[jax.device_get(grad(params, mb)) for mb in dev] for dev in device_micro_batches(batch, N, gas)]


def qgz_bound(per_dev, plan, bits):
    """Per leaf, a bound on |qgZ's reduced gradient - the exact one| after the division by N·gas.

    Hop 1 quantizes every device's gradient (blocks inside one leaf, or inside one bucket of
    the leaves kept whole): off by at most max|g_d| / (2 qmax). Hop 2 quantizes each node's
    fp32 sum of the dequantized values: off by at most its own max / (2 qmax)."""
    qm = 2 * Q.qmax(bits)
    lays = plan.leaves
    treedef = plan.treedef
    gas = len(per_dev[0])
    whole = [i for i, lay in enumerate(lays) if not lay.params_partitioned]
    total = np.zeros(len(lays))
    for i in range(gas):
        flat = [[np.asarray(x, np.float64) for x in treedef.flatten_up_to(dev[i])] for dev in per_dev]
        m = np.array([[np.abs(g[j]).max() for j in range(len(lays))] for g in flat])  # device x leaf
        if whole:  # a bucket's blocks may span its leaves: their common max bounds them all
            m[:, whole] = m[:, whole].max(axis=1, keepdims=True)
        hop1 = m / qm
        for j in range(len(lays)):
            for node in range(N // K):
                members = range(node * K, (node + 1) * K)
                part = np.abs(sum(flat[d][j] for d in members)).max() + hop1[list(members), j].sum()
                total[j] += hop1[list(members), j].sum() + part / qm
        if whole:
            total[whole] = total[whole].max()
    return treedef.unflatten(list(total / (N * gas)))


LR = 1000.0  # large, so that the update dominates the params and (p0 - p1) / LR keeps its digits


def recovered_grads(p0, p1):
    """The gradient an SGD step of learning rate LR applied."""
    return jax.tree_util.tree_map(lambda a, b: (np.asarray(a, np.float64) - np.asarray(b, np.float64)) / LR, p0, p1)


def mean_grad(per_dev):
    n = len(per_dev) * len(per_dev[0])
    return jax.tree_util.tree_map(lambda *g: sum(np.asarray(x, np.float64) for x in g) / n,
                                  *[g for dev in per_dev for g in dev])


def assert_within(got, want, bound, slack=1e-6):
    for g, w, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                       jax.tree_util.tree_leaves(bound)):
        err = np.abs(np.asarray(g) - np.asarray(w))
        assert np.all(err <= np.asarray(b) + slack * (np.abs(w).max() + 1e-12)), (err.max(), np.max(b))


# ------------------------------------------------------------------------------ hpZ
@pytest.mark.parametrize("model", ["small", "gpt_scan", "gpt_sliced"])
def test_hpz_alone_equals_stage3_exactly(model):
    if model == "small":
        params, data, loss, extra = init_params(jax.random.PRNGKey(0)), batches(3), loss_fn, {}
    else:
        cfg = TINY if model == "gpt_sliced" else gpt.GPTConfig(**{**TINY.__dict__, "scan": True})
        params, data, loss = gpt_init(cfg, jax.random.PRNGKey(0)), gpt_batches(3), gpt.loss_fn(cfg)
        # sliced: params above 8 buckets of 256 elements are gathered slice by slice in their matmuls
        extra = {"prefetch_bucket_size": 256} if model == "gpt_sliced" else {}
    # the GPTs train with SGD momentum: their two programs (hpZ's and stage 3's) may be fused
    # differently, and Adam would turn the last-bit rounding of a near-zero gradient (a bias) into
    # a whole step (5e-4 relative with XLA's CPU loop emitters); SGD keeps a rounding a rounding
    tx = optax.adam(1e-2) if model == "small" else optax.sgd(1e-2, momentum=0.9)
    base, mb = run(params, tx, data, config(gradient_accumulation_steps=2, **extra), loss)
    hpz, mh = run(params, tx, data, config(gradient_accumulation_steps=2, hpz_partition_size=K, **extra), loss)
    assert max_rel_err(hpz.full_params(), base.full_params()) <= 1e-6
    np.testing.assert_allclose([m["loss"] for m in mh], [m["loss"] for m in mb], rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------ qwZ
def test_qwz_gradient_is_the_plain_gradient_at_the_weights_as_gathered():
    params, data = init_params(jax.random.PRNGKey(1)), batches(1)
    cfg = config(quantized_weights=True, quantization_block_size=16)
    state, [m] = run(params, optax.sgd(LR), data, cfg)
    plan = state.plan
    wq = quantized_weights(params, plan, 16)
    assert max_rel_err(wq, params) > 1e-4  # the weights do change on the wire
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))  # one program, not one per primitive
    want_loss, want_g = value_and_grad(wq, data[0])
    assert abs(float(m["loss"]) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    got_g = recovered_grads(params, state.full_params())
    assert max_rel_err(got_g, want_g) <= 1e-5
    # the stored params moved from the exact weights, not from the quantized ones
    assert max_rel_err(state.full_params(), jax.tree_util.tree_map(lambda p, g: p - LR * g, params, want_g)) <= 1e-6
    # and the loss is within the first-order bound of the weights' error
    exact_loss, g = value_and_grad(params, data[0])
    first_order = sum(float(np.sum(np.abs(np.asarray(a)) * b)) for a, b in
                      zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(weight_bound(params, plan, 16))))
    assert 0 < abs(float(m["loss"]) - float(exact_loss)) <= 2 * first_order


# ------------------------------------------------------------------------------ qgZ
@pytest.mark.parametrize("bits,gas,threshold", [(4, 1, 0), (4, 2, 100), (8, 2, 0)])
def test_qgz_gradient_within_the_two_hop_bound(bits, gas, threshold):
    params, data = init_params(jax.random.PRNGKey(2)), batches(1)
    cfg = config(quantized_gradients=True, quantized_gradients_bits=bits, devices_per_node=K,
                 gradient_accumulation_steps=gas, param_persistence_threshold=threshold, quantization_block_size=32)
    state, _ = run(params, optax.sgd(LR), data, cfg)
    if threshold:
        assert not all(lay.params_partitioned for lay in state.plan.leaves)  # the bucketed path too
    per_dev = device_grads(params, data[0], gas)
    got, want = recovered_grads(params, state.full_params()), mean_grad(per_dev)
    assert max_rel_err(got, want) > 1e-5  # quantization did act
    assert_within(got, want, qgz_bound(per_dev, state.plan, bits))


def test_all_three_within_the_bounds_with_accumulation():
    params, data = init_params(jax.random.PRNGKey(3)), batches(1)
    cfg = config(gradient_accumulation_steps=2, quantization_block_size=32, **ALL)
    state, [m] = run(params, optax.sgd(LR), data, cfg)
    wq = quantized_weights(params, state.plan, 32)  # forward and backward both see these weights
    per_dev = device_grads(wq, data[0], 2)
    assert_within(recovered_grads(params, state.full_params()), mean_grad(per_dev),
                  qgz_bound(per_dev, state.plan, 4))
    loss = jax.jit(loss_fn)
    assert abs(float(m["loss"]) - float(np.mean([loss(wq, mb) for dev in device_micro_batches(data[0], N, 2)
                                                  for mb in dev]))) <= 1e-6


@pytest.mark.parametrize("scan", [True, False])
def test_gpt_bf16_accumulation_all_three_tracks_stage3(scan):
    cfg = gpt.GPTConfig(**{**TINY.__dict__, "scan": scan})
    params, data, loss = gpt_init(cfg, jax.random.PRNGKey(0)), gpt_batches(4), gpt.loss_fn(cfg)
    common = dict(precision="bf16", gradient_accumulation_steps=2)
    tx = optax.adamw(3e-3)
    base, mb = run(params, tx, data, config(**common), loss)
    zpp, mz = run(params, tx, data, config(**common, **ALL), loss)
    assert not any(m["skipped"] for m in mz)
    # the first loss sees only qwZ: within its first-order bound plus bf16's rounding of the loss
    w = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), params)
    g = jax.jit(jax.grad(loss))(w, data[0])
    bound = weight_bound(w, zpp.plan, zpp.plan.config.quantization_block_size)
    first_order = sum(float(np.sum(np.abs(np.asarray(a)) * b)) for a, b in
                      zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(bound)))
    l0, z0 = float(mb[0]["loss"]), float(mz[0]["loss"])
    assert abs(z0 - l0) <= 2 * first_order + 2**-7 * l0
    # then training follows the unquantized run within the 3% the ZeRO++ quality goal allows
    for a, b in zip(mb[1:], mz[1:]):
        assert abs(float(b["loss"]) - float(a["loss"])) <= 0.03 * float(a["loss"])


# --------------------------------------------------------------- non-finite gradients
def _linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_non_finite_gradient_on_one_device_is_still_an_overflow(precision):
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (64, 48)) * 0.1}
    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    x[5, 3] = np.inf  # device 2's rows only
    extra = {"hysteresis": 1} if precision == "fp16" else {}  # the first overflow halves the scale
    state = zj.shard_train_state(params, optax.sgd(0.1), config=config(precision=precision, **ALL, **extra))
    step = zj.make_train_step(_linear_loss, state)
    before = jax.device_get(state.full_params())
    state_scale = float(state.loss_scale.scale)
    if precision == "fp32":
        with pytest.raises(NonFiniteError) as e:
            step(state, {"x": x})
        after = e.value.state
    else:  # bf16 skips the step; fp16 also halves its loss scale
        after, m = step(state, {"x": x})
        assert bool(m["skipped"])
        if precision == "fp16":
            assert float(after.loss_scale.scale) < float(state_scale)
    np.testing.assert_array_equal(jax.device_get(after.full_params())["w"], before["w"])


# ---------------------------------------------------------------- offload, checkpoints
def test_offload_changes_nothing():
    params, data = init_params(jax.random.PRNGKey(4)), batches(2)
    tx = optax.adam(1e-2)
    plain, _ = run(params, tx, data, config(**ALL))
    off, _ = run(params, tx, data, config(offload_optimizer="cpu", offload_param="cpu", **ALL))
    assert max_rel_err(off.full_params(), plain.full_params()) <= 1e-6


def test_checkpoint_round_trip_holds_exact_values_and_resumes_bitwise(tmp_path):
    params, data = init_params(jax.random.PRNGKey(5)), batches(4)
    cfg, tx = config(precision="bf16", **ALL), optax.adamw(1e-2)
    # the straight run, saved after its second step: one step program, not a second run of two
    # steps compiled again for the half
    half = zj.shard_train_state(params, tx, config=cfg)
    first = zj.make_train_step(loss_fn, half)
    for b in data[:2]:
        half, _ = first(half, b)
    stored = jax.device_get(half.params)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(2, half)
        mgr.wait_until_finished()
        target = zj.shard_train_state(params, tx, config=cfg)
        resumed, _ = mgr.restore(target)
    straight = half  # goes on, uninterrupted (the step donates it: nothing else reads it after this)
    for b in data[2:]:
        straight, _ = first(straight, b)
    # nothing quantized went in: the params come back as stored, in their 16-bit dtype
    for a, b in zip(jax.tree_util.tree_leaves(stored), jax.tree_util.tree_leaves(jax.device_get(resumed.params))):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a, b)
    step = zj.make_train_step(loss_fn, resumed)
    for b in data[2:]:
        resumed, _ = step(resumed, b)
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(straight.full_params(jnp.float32))),
                    jax.tree_util.tree_leaves(jax.device_get(resumed.full_params(jnp.float32)))):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------- the compiled step
def _report(**zpp):
    cfg = dataclasses.replace(TINY, n_layer=1)  # one block shows every collective; five settings compile
    state = zj.abstract_train_state(lambda k: gpt.init_params(cfg, k), optax.adamw(1e-3),
                                    config=config(precision="bf16", **zpp))
    batch = {"tokens": jax.ShapeDtypeStruct((N, cfg.seq_len + 1), np.int32)}
    return zj.comm_report(zj.make_train_step(gpt.loss_fn(cfg), state), state, batch, node_size=K), state


def test_compiled_collectives_follow_each_setting():
    base, state = _report()
    assert base.volume(span="inside") == 0  # plain stage 3: every collective spans the nodes
    ag = base.volume("all-gather", float_width=2)
    rows = [int(np.prod(C.local_shape(lay, N))) for lay in state.plan.leaves]
    table = next(r for r, lay in zip(rows, state.plan.leaves) if "wte" in lay.path)
    # every param gathered once in the forward pass, 16-bit, and the tied table again for the logits
    forward = 2 * N * (sum(rows) + table)
    hpz, _ = _report(hpz_partition_size=K)
    # the forward gathers still span the nodes; every backward gather stays inside one
    assert hpz.volume("all-gather", "across", float_width=2) == pytest.approx(forward, rel=1e-3)
    assert hpz.volume("all-gather", float_width=2) == pytest.approx(ag, rel=1e-3)
    assert hpz.volume("all-gather", "inside") > 0.3 * ag
    qw, _ = _report(quantized_weights=True)
    # 8-bit rows with a 4-byte maximum per block of 256, against 16-bit rows (tiny rows here: a
    # bias's 4-value row costs as much as in 16 bits, so the ratio is above a large model's 0.51)
    ratio = sum(Q.payload_size(c, 8, 256) for c in rows + [table]) / (2 * (sum(rows) + table))
    assert qw.volume("all-gather") / ag == pytest.approx(ratio, rel=0.02)
    assert qw.count("reduce-scatter") > 0
    qg, _ = _report(quantized_gradients=True, devices_per_node=K)
    assert qg.count("reduce-scatter") == 0 and qg.volume("all-to-all", "inside") > 0
    # the first hop sends each of K peers M = N/K rows, the second each of M nodes one row (4 bits)
    m = N // K
    hop1 = sum(K * Q.payload_size(m * c, 4, 256) for c in rows)
    hop2 = sum(m * Q.payload_size(c, 4, 256) for c in rows)
    assert qg.volume("all-to-all", "inside") == pytest.approx(hop1, rel=1e-3)
    assert qg.volume("all-to-all", "across") == pytest.approx(hop2, rel=1e-3)
    every, _ = _report(**ALL)
    assert every.volume(span="across", float_width=2) <= 0.35 * base.volume(span="across", float_width=2)


def test_the_step_gathers_weights_only_for_their_uses():
    """Outside the stage-3 gathers nothing is all-gathered (e.g. no gradient for its norm), so the
    ratios above compare the weights' gathers alone: stacked layers split along a later dim too."""
    cfg = gpt.GPTConfig(**{**TINY.__dict__, "scan": True})
    state = zj.abstract_train_state(lambda k: gpt.init_params(cfg, k), optax.adamw(1e-3),
                                    config=config(precision="bf16", max_reuse_distance=10**9))
    assert any(lay.axis not in (None, 0) and len(lay.shape) == 3 for lay in state.plan.leaves)
    batch = {"tokens": jax.ShapeDtypeStruct((N, cfg.seq_len + 1), np.int32)}
    r = zj.comm_report(zj.make_train_step(gpt.loss_fn(cfg), state), state, batch)
    rows = sum(int(np.prod(C.local_shape(lay, N))) for lay in state.plan.leaves)
    assert r.kinds["all-gather"][2] == N * rows  # each param once: kept from forward to backward


def test_secondary_partition_in_memory_report_and_estimate():
    params = init_params(jax.random.PRNGKey(0))
    for zpp, width in (({"hpz_partition_size": K}, None), (ALL, 8)):
        cfg = config(precision="bf16", **zpp)
        state = zj.shard_train_state(params, optax.adam(1e-2), config=cfg)
        rows = [int(np.prod(C.local_shape(lay, N))) for lay in state.plan.leaves]
        per_row = [Q.payload_size(c, 8, 256) if width else 2 * c for c in rows]
        want = sum(per_row) * (N // K)
        assert secondary_bytes(state.plan) == want
        assert zj.memory_report(state).in_step == {"hpz secondary": want}
        assert zj.estimate(params, state.plan.mesh, cfg, optax.adam(1e-2)).in_step == {"hpz secondary": want}
        assert "hpz secondary" in str(zj.memory_report(state))
    plain = zj.shard_train_state(params, optax.adam(1e-2), config=config())
    assert zj.memory_report(plain).in_step == {}


def test_no_secondary_partition_for_params_kept_until_their_backward_use():
    """Under the default distance a model this small stays gathered from forward to backward:
    the backward pass gathers nothing, so hpZ holds no secondary partition; with a distance
    that keeps only the params used last, the others' partitions remain."""
    params = init_params(jax.random.PRNGKey(0))
    kept = config(precision="bf16", hpz_partition_size=K, max_reuse_distance=10**9)
    assert secondary_bytes(zj.ZeroPlan.create(params, zj.make_mesh(), kept)) == 0
    assert zj.estimate(params, zj.make_mesh(), kept, optax.adam(1e-2)).in_step == {}
    none = secondary_bytes(zj.ZeroPlan.create(params, zj.make_mesh(), config(precision="bf16", hpz_partition_size=K)))
    last = zj.ZeroPlan.create(params, zj.make_mesh(), config(precision="bf16", hpz_partition_size=K,
                                                             max_reuse_distance=1))
    assert 0 < secondary_bytes(last) < none  # the last leaf's distance is 0 < 1: kept


# ------------------------------------------------------------------------------ config
def test_partition_sizes_that_do_not_divide_the_data_axis_are_refused():
    params = init_params(jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match=r"hpz_partition_size=3 \(zero_optimization.zero_hpz_partition_size\)"):
        zj.shard_train_state(params, optax.sgd(0.1), config=config(hpz_partition_size=3))
    with pytest.raises(ConfigError, match="devices_per_node=3 does not divide"):
        zj.shard_train_state(params, optax.sgd(0.1), config=config(devices_per_node=3, quantized_gradients=True))
    with pytest.raises(ConfigError, match="disagrees with ZeroConfig.hpz_partition_size=4"):
        zj.shard_train_state(params, optax.sgd(0.1), config=config(devices_per_node=2, hpz_partition_size=4))


def test_keys_below_stage_3_are_warned_by_name_and_change_nothing():
    with pytest.warns(IgnoredKeysWarning, match="ZeroConfig.quantized_gradients=True only applies at ZeRO stage 3"):
        cfg = zj.ZeroConfig(stage=2, quantized_gradients=True)
    params = init_params(jax.random.PRNGKey(0))
    state = zj.shard_train_state(params, optax.sgd(0.1), config=cfg)
    assert Wire.of(state.plan).plain


def test_deepspeed_keys_set_the_fields():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = zj.ZeroConfig.from_deepspeed({"train_batch_size": 8, "zero_optimization": {
            "stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 4,
            "zero_quantized_gradients": True}})
    assert (cfg.quantized_weights, cfg.hpz_partition_size, cfg.quantized_gradients) == (True, 4, True)


def test_replica_groups_of_every_hlo_spelling_and_their_span():
    assert replica_groups("x = f32[8] all-gather(y), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}") == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups=[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("source_target_pairs={{0,1},{1,2}}") == [[0, 1], [1, 2]]
    assert replica_groups("replica_groups={}") is None
    hlo = "\n".join([
        "ENTRY %main (p: f32[4]) -> f32[8] {",
        "  %a = f32[8]{0} all-gather(f32[2]{0} %p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
        "  %b = u8[16]{0} all-to-all(u8[16]{0} %q), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
        "}"])
    r = parse_collectives(hlo, np.arange(8) // 4, 4)
    assert r.volume("all-gather", "inside") == 32 and r.volume("all-gather", "across") == 0
    assert r.volume("all-to-all", "across") == 16 and r.volume("all-to-all", "across", sent=True) == 8
    assert r.volume("all-gather", float_width=2) == 16
