"""DeepSpeed's bounds admit 0 for the stage-3 and bucket sizes; zerojax gives 0 DeepSpeed's
meaning (no prefetch, nothing kept beyond the parameter in use, one collective per leaf) and
trains to the same numbers as plain optax."""
import warnings

import jax
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn, max_rel_err, reference_train

ZEROS = {"stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0, "allgather_bucket_size": 0,
         "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


@pytest.mark.parametrize("zeros", [ZEROS, {"stage3_max_live_parameters": 0}], ids=["all", "max_live_parameters"])
def test_stage3_with_zero_bounds_trains_like_plain_optax(zeros):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = zj.ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 4,
                                               "zero_optimization": {"stage": 3, **zeros}}, world_size=8)
    assert config.max_live_parameters == 0
    params = init_params(jax.random.PRNGKey(0))
    tx = optax.adam(1e-2)
    want, _ = reference_train(params, tx, batches(3), clip=1.0)
    state = zj.shard_train_state(params, tx, config=config)
    step = zj.make_train_step(loss_fn, state)
    for b in batches(3):
        state, _ = step(state, b)
    assert max_rel_err(state.full_params(), want) < 1e-6
