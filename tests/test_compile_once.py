"""The step's programs compile once per (state layout, batch shape): not again on the second
step, after an ahead-of-time ``step.lower(...).compile()``, a checkpoint save or restore, or
``finish()``. Compiles are counted with JAX's own monitoring event."""
import jax
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, count_compiles, init_params, loss_fn


def fresh(stage):
    return zj.shard_train_state(init_params, optax.adamw(1e-2, weight_decay=0.01), mesh=zj.make_mesh(),
                                config=zj.ZeroConfig(stage=stage), rng=jax.random.PRNGKey(0))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_ahead_of_time_program_is_the_one_the_step_runs(stage):
    state = fresh(stage)
    step = zj.make_train_step(loss_fn, state)
    batch = batches(1)[0]
    with count_compiles() as aot:
        step.lower(state, batch).compile()
    with count_compiles() as first_call:
        state, _ = step(state, batch)
        jax.block_until_ready(state)
    assert aot, "the ahead-of-time compile compiled nothing: the count cannot see compiles"
    assert first_call == [], f"the first call compiled again after lower().compile(): {first_call}"


def test_no_step_compiles_again_across_saves_a_restore_and_finish(tmp_path):
    state = fresh(2)
    step = zj.make_train_step(loss_fn, state)
    data = batches(11)
    state, _ = step(state, data[0])
    jax.block_until_ready(state)
    mngr = zj.checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    saves = []
    with count_compiles() as steps:
        for i, batch in enumerate(data[1:], start=1):
            state, _ = step(state, batch)
            if i % 3 == 0:
                with count_compiles() as save:
                    mngr.save(i, state)
                    mngr.wait_until_finished()
                saves.append(len(save))
        state, _ = mngr.restore(state)
        state, _ = step(step.finish(state), data[0])
        jax.block_until_ready(state)
    mngr.close()
    # the first save compiles its program once; later saves and every step reuse theirs
    assert saves[0] >= 1 and saves[1:] == [0] * (len(saves) - 1), saves
    step_compiles = [n for n in steps if "train_step" in n]
    assert step_compiles == [], f"the step compiled again: {steps}"


def test_a_new_batch_shape_compiles_once_more_and_only_once():
    """Negative control for the counts above: a change the program depends on is seen."""
    state = fresh(0)
    step = zj.make_train_step(loss_fn, state)
    small, big = batches(1, batch_size=16)[0], batches(1, batch_size=32)[0]
    state, _ = step(state, small)
    with count_compiles() as seen:
        for _ in range(3):
            state, _ = step(state, big)
        jax.block_until_ready(state)
    assert len([n for n in seen if "train_step" in n]) == 1, seen


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_building_a_step_compiles_only_the_optimizer_probes(stage):
    """make_train_step compiles nothing but optimizer recognition's two probe programs (run and
    both) for an optimizer it has not seen: no program for a constant made eagerly on a device
    (each is a compile in every new process, before the step's own)."""
    from zerojax.stages import _adam
    from zerojax.update import _recognize

    state = fresh(stage)
    jax.clear_caches()
    _recognize._cache.cache_clear()
    _adam.adam_recipe.cache_clear()
    with count_compiles() as seen:
        zj.make_train_step(loss_fn, state)
    assert seen, "nothing compiled: the recognition memory was not cleared, the count cannot fail"
    assert set(seen) <= {"jit(run)", "jit(both)", "jit(<lambda>)"}, seen
