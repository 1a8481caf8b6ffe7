"""DeepSpeed's ``"optimizer": {"type": "Muon"}``: read by DeepSpeed's keys and defaults, built as
``optax.contrib.muon`` with DeepSpeed's ``use_muon`` rule by leaf path and shape, shown in
``plan.describe()``, overridable with ``muon_params=``, trained against one-device optax."""
import jax
import numpy as np
import optax
import optax.contrib
import pytest

import zerojax as zj
from zerojax._state import unshard_params
from zerojax.config._optimizers import muon_dimension_numbers, muon_rule, optimizer_from_config
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_run


def _ds(stage=1, gas=1, **params):
    return {"train_micro_batch_size_per_gpu": 4 // gas, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.01, **params}}}


def _reference_tx(rule=None, lr=0.02, adam_lr=0.02):
    return optax.contrib.muon(lr, beta=0.95, eps=1e-10, weight_decay=0.01, adam_b1=0.9, adam_b2=0.95,
                              adam_weight_decay=0.01, adam_learning_rate=adam_lr,
                              muon_weight_dimension_numbers=muon_dimension_numbers(rule))


def test_rule_is_deepspeeds_use_muon():
    assert muon_rule("blocks/0/mlp/fc/kernel", (8, 32))
    assert muon_rule("layers/attn/kernel", (4, 8, 32))  # a stack of matrices
    for path, shape in [("wte", (100, 8)), ("model/embed_tokens", (100, 8)), ("lm_head", (8, 100)),
                        ("ln_f/scale", (8,)), ("mlp/fc/bias", (32,)), ("head/kernel", (8, 10))]:
        assert not muon_rule(path, shape), path


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_muon_trains_like_optax(stage):
    params, data = init_params(jax.random.PRNGKey(0)), batches(10)
    state, step = zj.initialize(params, loss_fn, _ds(stage))
    table = state.plan.describe()
    assert "opt muon" in table and "opt adam" in table
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "opt adam" in rows["emb"] and "opt adam" in rows["dense/bias"] and "opt muon" in rows["dense/kernel"]
    for b in data:
        state, metrics = step(state, b)
    ref = reference_run(params, _reference_tx(), data)
    assert max_rel_err(unshard_params(state), ref.params) < 1e-5
    assert float(metrics["learning_rate"]) == pytest.approx(0.02)


def test_learning_rates_and_defaults():
    cfg = zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "Muon", "params": {"lr": 1e-3, "muon_lr": 0.05}}}, world_size=1)
    state = jax.eval_shape(optimizer_from_config(cfg).init, init_params(jax.random.PRNGKey(0)))
    assert cfg.optimizer["params"]["betas"] == [0.9, 0.95] and cfg.optimizer["params"]["eps"] == 1e-10
    tx = optimizer_from_config(cfg)
    hp = tx.init(init_params(jax.random.PRNGKey(0))).hyperparams
    assert float(hp["learning_rate"]) == pytest.approx(0.05) and float(hp["adam_learning_rate"]) == pytest.approx(1e-3)
    cfg = zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon"}},
                                       world_size=1)
    hp = optimizer_from_config(cfg).init(init_params(jax.random.PRNGKey(0))).hyperparams
    assert float(hp["learning_rate"]) == pytest.approx(0.02) and float(hp["adam_learning_rate"]) == pytest.approx(3e-4)
    assert state is not None


def test_muon_params_override():
    params, data = init_params(jax.random.PRNGKey(0)), batches(3)
    rule = lambda path, shape: path == "dense/kernel"  # noqa: E731
    state, step = zj.initialize(params, loss_fn, _ds(1), muon_params=rule)
    rows = {line.split()[0]: line for line in state.plan.describe().splitlines()[1:]}
    assert "opt muon" in rows["dense/kernel"] and "opt adam" in rows["out"] and "opt adam" in rows["odd"]
    for b in data:
        state, _ = step(state, b)
    ref = reference_run(params, _reference_tx(rule), data)
    assert max_rel_err(unshard_params(state), ref.params) < 1e-5
    with pytest.raises(zj.ConfigError, match="muon_params"):
        zj.initialize(params, loss_fn, {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"}},
                      muon_params=rule)
    with pytest.raises(zj.ConfigError, match="fewer than 2 dims"):
        zj.initialize(params, loss_fn, _ds(1), muon_params=lambda path, shape: True)


@pytest.mark.parametrize("key,value", [("ns_steps", 6), ("nesterov", False), ("max_grad_norm", 1.0)])
def test_keys_zerojax_cannot_honour_are_refused_by_name(key, value):
    with pytest.raises(zj.ConfigError, match=f"optimizer.params.{key}"):
        zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {
            "type": "Muon", "params": {key: value}}}, world_size=1)


def test_ns_method_both_values_and_a_bad_one():
    for method in ("gram", "standard"):
        zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {
            "type": "Muon", "params": {"ns_method": method}}}, world_size=1)
    with pytest.raises(zj.ConfigError, match="optimizer.params.ns_method"):
        zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "optimizer": {
            "type": "Muon", "params": {"ns_method": "polar"}}}, world_size=1)


def test_scheduler_drives_both_learning_rates():
    cfg = zj.ZeroConfig.from_deepspeed({
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Muon", "params": {"lr": 0.02}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02,
                                                      "warmup_num_steps": 4, "warmup_type": "linear"}}},
        world_size=1)
    tx = optimizer_from_config(cfg)
    params = init_params(jax.random.PRNGKey(0))
    s = tx.init(params)
    g = jax.tree_util.tree_map(np.ones_like, params)
    for _ in range(4):  # the warmup starts at 0
        _, s = tx.update(g, s, params)
    assert float(s.hyperparams["learning_rate"]) == float(s.hyperparams["adam_learning_rate"]) > 0
