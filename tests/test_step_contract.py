"""The step contract, path by path: every update path that make_train_step and zj.initialize can
return implements zj.Step with the same metric keys, the same non-finite handling, lower, finish,
close, and a returned state that checkpoints and restores."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax._contract import StepWrapper
from zerojax.runtime._watched_step import WatchedStep
from tests.helpers import batches, init_params, loss_fn, max_rel_err

pytestmark = pytest.mark.filterwarnings("ignore::zerojax.IgnoredKeysWarning")

LR, WD = 1e-2, 0.01

# path -> (ZeroConfig fields, zero_optimization block, make_train_step options)
PATHS = {
    "stage0": (dict(stage=0), {"stage": 0}, {}),
    "stage1": (dict(stage=1), {"stage": 1}, {}),
    "stage2": (dict(stage=2), {"stage": 2}, {}),
    "stage3": (dict(stage=3, param_persistence_threshold=0), {"stage": 3, "stage3_param_persistence_threshold": 0},
               {}),
    "offload_optimizer": (dict(stage=2, offload_optimizer="cpu"),
                          {"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}),
    "offload_param": (dict(stage=3, offload_optimizer="cpu", offload_param="cpu", param_persistence_threshold=0),
                      {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                       "stage3_param_persistence_threshold": 0}, {}),
    "nvme": (dict(stage=2, offload_optimizer="nvme", nvme_path="NVME"),
             {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}, {}),
    "zenflow": (dict(stage=2, offload_optimizer="cpu", zenflow={"topk_ratio": 0.5, "update_interval": 2}),
                {"stage": 2, "offload_optimizer": {"device": "cpu"},
                 "zenflow": {"topk_ratio": 0.5, "update_interval": 2, "full_warm_up_rounds": 0}}, {}),
    "fused_adam": (dict(stage=2), {"stage": 2}, {"fused_adam": True}),
}
STEP_TYPES = {"nvme": "HostLoopStep", "zenflow": "ZenFlowStep"}


def weighted_loss(params, batch):
    """The helpers' loss times the batch's weight: a nan weight makes loss and gradients nan."""
    return loss_fn(params, batch) * jnp.mean(batch["w"])


def data(n, seed=0):
    out = batches(n, batch_size=32, seed=seed)
    for b in out:
        b["w"] = np.ones((32,), np.float32)
    return out


def poisoned(batch):
    return dict(batch, w=np.full_like(batch["w"], np.nan))


def fill(value, tmp_path):
    if isinstance(value, dict):
        return {k: fill(v, tmp_path) for k, v in value.items()}
    return str(tmp_path) if value == "NVME" else value


def build(path, via, tmp_path, precision="fp32"):
    fields, block, options = PATHS[path]
    tmp_path.mkdir(parents=True, exist_ok=True)
    params = init_params(jax.random.PRNGKey(0))
    if via == "make_train_step":
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=LR, weight_decay=WD)
        config = zj.ZeroConfig(precision=precision, **fill(fields, tmp_path))
        state = zj.shard_train_state(params, tx, config=config)
        step = zj.make_train_step(weighted_loss, state, **options)
    else:
        ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
              "zero_optimization": fill(block, tmp_path),
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
        if precision == "bf16":
            ds["bf16"] = {"enabled": True}
        state, step = zj.initialize(params, weighted_loss, ds, **options)
    return state, step


def full(state):
    return jax.tree_util.tree_map(np.asarray, state.full_params())


@pytest.mark.parametrize("via", ["make_train_step", "initialize"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_keeps_the_step_contract(path, via, tmp_path):
    state, step = build(path, via, tmp_path / "nvme")
    with step:
        assert isinstance(step, zj.Step)
        inner, wrappers = step, []
        while isinstance(inner, StepWrapper):  # zj.initialize's batch check and the watchdog wrap the path's step
            wrappers.append(type(inner))
            inner = inner.step
        assert WatchedStep in wrappers  # every path is watched
        assert type(inner).__name__ == STEP_TYPES.get(path, "TrainStep")
        good = data(4)
        lowered = step.lower(state, good[0])
        assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()

        state, m = step(state, good[0])
        assert set(zj.METRIC_KEYS) <= set(m), f"{path}: missing {set(zj.METRIC_KEYS) - set(m)}"
        assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
        assert float(m["learning_rate"]) == pytest.approx(LR)
        assert float(m["loss_scale"]) == 1.0 and not bool(m["skipped"]) and int(m["error"]) == 0

        # a nan step under fp32: NonFiniteError carrying the returned state, which is unchanged but
        # for the step counter; the schedule and the optimizer did not advance
        state = step.finish(state)  # ZenFlow applies its pending host update; the others return it as is
        before = full(state)
        with pytest.raises(zj.NonFiniteError) as info:
            step(state, poisoned(good[1]))
        assert isinstance(info.value, zj.ZeroJaxError)
        state = info.value.state
        assert int(state.step) == 2
        state = step.finish(state)
        assert max_rel_err(full(state), before) == 0.0

        # a wrong batch size is the same clear error on every path
        with pytest.raises(ValueError, match="leading dimension 12"):
            step(state, {k: v[:12] for k, v in good[2].items()})

        for b in good[2:]:
            state, m = step(state, b)
            assert not bool(m["skipped"])
        state = step.finish(state)
        assert int(state.step) == 4
        trained = full(state)
        assert max_rel_err(trained, before) > 1e-4  # it trained after the skipped step

    # the returned state checkpoints and restores
    mngr = zj.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(int(state.step), state)
    mngr.wait_until_finished()
    target = zj.abstract_train_state(init_params, state.tx, mesh=state.plan.mesh, config=state.plan.config)
    restored, _ = mngr.restore(target)
    mngr.close()
    assert max_rel_err(full(restored), trained) == 0.0
    assert int(restored.step) == 4


@pytest.mark.parametrize("path", ["stage2", "nvme", "zenflow"])
def test_bf16_skips_a_nonfinite_step_on_every_path(path, tmp_path):
    state, step = build(path, "make_train_step", tmp_path, precision="bf16")
    with step:
        good = data(2)
        state, _ = step(state, good[0])
        state = step.finish(state)
        before = full(state)
        state, m = step(state, poisoned(good[1]))
        assert bool(m["skipped"]) and int(m["error"]) == 0
        state = step.finish(state)
        assert max_rel_err(full(state), before) == 0.0


@pytest.mark.parametrize("path", ["nvme", "zenflow"])
def test_options_a_path_cannot_honour_are_errors_naming_them(path, tmp_path):
    fields, _, _ = PATHS[path]
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=LR)
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx,
                                 config=zj.ZeroConfig(**fill(fields, tmp_path)))
    with pytest.raises(zj.StepOptionError, match="fused_adam"):
        zj.make_train_step(weighted_loss, state, fused_adam=True)
    with pytest.raises(zj.StepOptionError, match="fused_block_size"):
        zj.make_train_step(weighted_loss, state, fused_block_size=1024)
