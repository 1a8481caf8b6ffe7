"""A small model with awkward shapes (nothing divides 8 evenly everywhere) and its plain reference."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, EMB, HID, OUT = 67, 12, 20, 5


def init_params(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "emb": jax.random.normal(k1, (VOCAB, EMB)) * 0.3,
        "dense": {"kernel": jax.random.normal(k2, (EMB, HID)) * 0.3, "bias": jnp.zeros((HID,))},
        "odd": jax.random.normal(k3, (7, 3)) * 0.3,
        "out": jax.random.normal(k4, (HID, OUT)) * 0.3,
    }


def loss_fn(params, batch):
    x = params["emb"][batch["tok"]].mean(1)
    h = jnp.tanh(x @ params["dense"]["kernel"].astype(x.dtype) + params["dense"]["bias"].astype(x.dtype))
    logits = (h @ params["out"].astype(x.dtype)).astype(jnp.float32)
    reg = 1e-3 * jnp.sum(params["odd"].astype(jnp.float32) ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean() + reg


def batches(n_steps, batch_size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tok": rng.integers(0, VOCAB, (batch_size, 4)).astype(np.int32),
             "y": rng.integers(0, OUT, (batch_size,)).astype(np.int32)} for _ in range(n_steps)]


def reference_train(params, tx, data, clip=0.0):
    """Plain single-device optax: the numbers a ZeRO run must reproduce."""
    state = tx.init(params)
    losses = []

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        if clip:
            norm = optax.global_norm(g)
            coef = jnp.maximum(1.0, (norm + 1e-6) / clip)
            g = jax.tree_util.tree_map(lambda x: x / coef, g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    for b in data:
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
    return params, losses


def max_rel_err(got, want):
    """Largest per-leaf max|got - want| / max|want|."""
    errs = jax.tree_util.tree_map(
        lambda a, b: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - b)) / (jnp.max(jnp.abs(b)) + 1e-30)),
        got, want)
    return max(jax.tree_util.tree_leaves(errs))


# every kind of optax transformation a ZeRO wrapper must handle
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adam": lambda: optax.adam(1e-2),
    "sgd_momentum": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "chain_clip_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10))),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "lamb": lambda: optax.lamb(1e-2),
}
