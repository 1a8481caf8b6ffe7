"""Every optimizer on every update path: equal to plain optax, or refused by name.

A table of optax optimizers × zerojax's update paths, 3 fp32 steps each on the awkward model
of :mod:`tests.helpers`. Each cell either trains to within 1e-6 of unsharded optax (ZenFlow:
of its own numpy reference run with that optimizer) or raises a ``zj.ZeroJaxError`` that
names the optimizer and the path. No cell may train another optimizer: that is exactly what
the 1e-6 comparison catches. The quick tier runs one row per path and one column per
optimizer (the diagonal); the rest of the table is slow.
"""
import jax
import numpy as np
import optax
import optax.contrib
import pytest

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.update._recognize import describe
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_train
from tests.offload.zenflow_reference import SGD, AdamW, Lion, ZenFlowReference
import zerojax._placement as placement

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "inject_adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "sgd": lambda: optax.sgd(5e-2),
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9),
    "nesterov": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.05),
    # update takes extra arguments (grad_fn), not the loss: given none, as by a plain optax loop
    "sam": lambda: optax.contrib.sam(optax.sgd(5e-2), optax.sgd(1e-2), sync_period=2),
}

# the element-wise optimizers the host loops (NVMe, ZenFlow) reproduce; the fused kernel runs Adam(W)
ELEMENTWISE = {"adam", "adamw", "inject_adam", "sgd", "sgd_momentum", "nesterov", "lion", "inject_schedule"}
# (an injected Adam whose record has no weight_decay is refused by the fused kernel, which reads all five)
FUSED = {"adam", "adamw", "inject_schedule"}
# Adam in the kernels that fold the bias corrections into the step size (the native host kernel of
# the NVMe and ZenFlow host updates, the fused Pallas kernel) rounds differently from optax's
# three-pass arithmetic: after 3 steps within 1e-5, not 1e-6. Everything else is to 1e-6.
FOLDED = {("nvme", "adam"), ("nvme", "adamw"), ("nvme", "inject_schedule"), ("zenflow", "adam"),
          ("zenflow", "adamw"), ("zenflow", "inject_adam"), ("zenflow", "inject_schedule"), ("fused", "adam"),
          ("fused", "adamw"), ("fused", "inject_schedule"), ("nvme", "inject_adam")}

PATHS = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "fused": dict(stage=2),
    "cpu_offload": dict(stage=2, offload_optimizer="cpu"),
    "partial_offload": dict(stage=3, offload_optimizer="cpu", offload_ratio=0.5),
    "param_offload": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
    "nvme": dict(stage=2, offload_optimizer="nvme"),
    "zenflow": dict(stage=2, offload_optimizer="cpu",
                    zenflow={"topk_ratio": 0.3, "update_interval": 2, "select_strategy": "step",
                             "select_interval": 100, "overlap_step": False}),
    "zero_optimizer": dict(stage=2),
    "zero_optimizer_offload": dict(stage=2, offload_optimizer="cpu"),
}

STEPS = 3
OPTS, NAMES = list(OPTIMIZERS), list(PATHS)
QUICK = {(NAMES[i], OPTS[i % len(OPTS)]) for i in range(len(NAMES))} | {
    ("nvme", "lion"), ("zenflow", "sgd_momentum"), ("nvme", "adafactor"), ("fused", "lion"),
    ("partial_offload", "clip_adamw"), ("zero_optimizer_offload", "adam")}
CELLS = [pytest.param(path, opt, marks=() if (path, opt) in QUICK else pytest.mark.slow) for path in NAMES
         for opt in OPTS]


# what each refusal names: the path's setting
SETTING = {"nvme": "offload_optimizer='nvme'", "zenflow": "zenflow", "fused": "fused_adam",
           "partial_offload": "offload_ratio"}


def _expect_refusal(path, opt):
    if path == "partial_offload":  # a global clip inside the optimizer mixes the host and device sides
        return opt == "clip_adamw"
    if path in ("nvme", "zenflow"):
        return opt not in ELEMENTWISE
    if path == "fused":
        return opt not in FUSED
    return False


def _zero_optimizer_run(path, tx_fn, params, data):
    tx = zj.zero_optimizer(tx_fn(), config=zj.ZeroConfig(**PATHS[path]))
    state = tx.init(params)
    # the loop's params come back from the step replicated on the mesh: they start there. From
    # init_params' single-device arrays the first call compiled the same program a second time
    # (the compiled HLO differs only in source-line metadata; jit's cache keys the two layouts apart)
    params = jax.device_put(params, NamedSharding(zj.make_mesh(), P()))

    @jax.jit
    def step(p, s, b):
        g = jax.grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for b in data:
        params, state = step(params, state, b)
    return params


# the settings of each element-wise optimizer above, for ZenFlow's numpy reference
ZENFLOW_REFERENCE = {
    "adam": (lambda s: AdamW(s, 0.9, 0.999, 1e-8, 0.0), lambda c: 1e-2),
    "adamw": (lambda s: AdamW(s, 0.9, 0.999, 1e-8, 0.1), lambda c: 1e-2),
    "inject_adam": (lambda s: AdamW(s, 0.9, 0.999, 1e-8, 0.0), lambda c: 1e-2),
    "sgd": (lambda s: SGD(s), lambda c: 5e-2),
    "sgd_momentum": (lambda s: SGD(s, 0.9), lambda c: 5e-2),
    "nesterov": (lambda s: SGD(s, 0.9, nesterov=True), lambda c: 5e-2),
    "lion": (lambda s: Lion(s, 0.9, 0.99, 0.1), lambda c: 1e-3),
    "inject_schedule": (lambda s: AdamW(s, 0.9, 0.999, 1e-8, 0.05),
                        lambda c: float(optax.linear_schedule(1e-2, 1e-3, 3)(c))),
}


# plain optax's final params per optimizer: every path's cell compares against the same run (params
# and data are the same in every cell), so each optimizer's reference is computed once per process
_REFERENCE = {}


def _plain_reference(opt, params, data):
    if opt not in _REFERENCE:
        _REFERENCE[opt] = reference_train(params, OPTIMIZERS[opt](), data)[0]
    return _REFERENCE[opt]


_GRAD = jax.jit(jax.grad(loss_fn))  # one program for every ZenFlow cell's reference, not one per primitive


def _zenflow_reference(opt_name, params, data):
    make, lr_fn = ZENFLOW_REFERENCE[opt_name]
    z = PATHS["zenflow"]["zenflow"]
    ref = ZenFlowReference(params, _GRAD, lr_fn, make=make, topk_ratio=z["topk_ratio"],
                           update_interval=z["update_interval"], overlap=False,
                           select_interval=z["select_interval"])
    for b in data:
        ref.step(b)
    ref.finish()
    return ref.params()


@pytest.mark.parametrize("path,opt", CELLS)
def test_cell(path, opt, tmp_path):
    params = init_params(jax.random.PRNGKey(0))
    data = batches(STEPS)
    if path.startswith("zero_optimizer"):
        got = _zero_optimizer_run(path, OPTIMIZERS[opt], params, data)
        want = _plain_reference(opt, params, data)
        assert max_rel_err(got, want) < 1e-6
        return
    kwargs = dict(PATHS[path])
    if path == "nvme":
        kwargs["nvme_path"] = str(tmp_path)
    if _expect_refusal(path, opt):  # refused where the path first meets the optimizer
        with pytest.raises(zj.ZeroJaxError) as caught:
            state = zj.shard_train_state(params, OPTIMIZERS[opt](), config=zj.ZeroConfig(**kwargs))
            zj.make_train_step(loss_fn, state, fused_adam=path == "fused")
        message = str(caught.value)
        assert SETTING[path] in message
        assert describe(OPTIMIZERS[opt]()) in message  # the optimizer, by name
        return
    state = zj.shard_train_state(params, OPTIMIZERS[opt](), config=zj.ZeroConfig(**kwargs))
    step = zj.make_train_step(loss_fn, state, fused_adam=path == "fused")
    for b in data:
        state, _ = step(state, b)
    state = step.finish(state)
    step.close()
    got = placement.params_logical(state.plan, state.params)
    got = jax.tree_util.tree_unflatten(state.plan.treedef, [np.asarray(x) for x in got])  # host-memory params too
    if path == "zenflow":
        want = _zenflow_reference(opt, params, data)
    else:
        want = _plain_reference(opt, params, data)
    assert max_rel_err(got, want) < (1e-5 if (path, opt) in FOLDED else 1e-6), f"{path} × {opt}"


def test_no_cell_trains_another_optimizer_on_the_host():
    """The host loops' recognition on a pair that share Adam's state but not its update: a
    chained global clip after AdamW (its extreme probes clip) is refused, not run as AdamW."""
    from zerojax.update._recognize import recognize

    assert recognize(optax.chain(optax.adamw(1e-3), optax.clip_by_global_norm(1e-3))) is None
    assert recognize(optax.adam(1e-3, nesterov=True)) is None
    assert recognize(optax.adamw(1e-3)).kind == "adam"
    assert np.isclose(recognize(optax.lion(1e-3, b1=0.8)).constants["b1"], 0.8, atol=1e-6)
