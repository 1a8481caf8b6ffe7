"""Reading an optimizer's next counts and hyperparameters (zerojax.stages._gating.scalar_step)
costs the same to trace for any number of params, and gives what optax's own update gives,
a chain whose stateless part needs the params' own tree included."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax.stages._adam import adam_node, step_hyperparams


def params(n):
    return {f"w{i}": jnp.ones((3, 2)) * (i + 1) for i in range(n)}


def equations(tx, n):
    p = params(n)
    state = tx.init(p)
    return len(jax.make_jaxpr(lambda s: step_hyperparams(tx, s))(state).jaxpr.eqns)


def test_the_trace_does_not_grow_with_the_params():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-3, 0.0, 10), weight_decay=0.1)
    assert equations(tx, 2) == equations(tx, 40)


def check_against_optax(tx, n=5, steps=3):
    p = params(n)
    state = tx.init(p)
    g = jax.tree_util.tree_map(lambda x: x * 0.1, p)
    for _ in range(steps):
        hp, before, after = step_hyperparams(tx, state)
        _, want = tx.update(g, state, p)
        got_count, want_count = adam_node(after).count, adam_node(want).count
        assert int(got_count) == int(want_count)
        for k, v in (getattr(want, "hyperparams", None) or {}).items():
            np.testing.assert_array_equal(np.asarray(hp[k]), np.asarray(v), err_msg=k)
        state = want


def test_counts_and_scheduled_hyperparameters_follow_optax():
    check_against_optax(optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.cosine_decay_schedule(1e-2, 10), weight_decay=0.05))


def test_a_chain_that_needs_the_params_tree_still_reads_the_scalars():
    """A stateless part that maps over a tree of its own (per-param factors) refuses the one-leaf
    copy; the full-tree copy is used and the figures are still optax's."""
    factors = {k: float(i + 1) for i, k in enumerate(params(4))}

    def by_factor(updates, _params):
        return jax.tree_util.tree_map(lambda u, f: u * f, updates, factors)

    tx = optax.chain(optax.scale_by_adam(), optax.stateless(by_factor), optax.scale(-1e-3))
    assert adam_node(tx.init(params(4))) is not None  # the gated passes would take this chain
    check_against_optax(tx, n=4)
