"""AdamW's settings and learning rate for the steps that update on the host (ZenFlow, NVMe)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.errors import ConfigError
from zerojax.stages.update import find_hyperparams
from zerojax.state import TrainState

__all__ = ["LearningRate", "adamw_hyperparams"]


def adamw_hyperparams(state: TrainState) -> dict:
    """AdamW's settings for ZenFlow: from the DeepSpeed optimizer block, or from the state of an
    ``optax.inject_hyperparams(optax.adamw)`` transformation."""
    block = state.plan.config.optimizer
    if block:
        if block.get("type", "").lower() not in ("adam", "adamw"):
            raise ConfigError(f"zenflow and nvme offload update with AdamW; optimizer.type is {block.get('type')!r}. "
                              'Fix: use "type": "AdamW"')
        p = block.get("params", {})
        b1, b2 = p.get("betas", (0.9, 0.999))
        return {"lr": float(p.get("lr", 1e-3)), "b1": float(b1), "b2": float(b2), "eps": float(p.get("eps", 1e-8)),
                "weight_decay": float(p.get("weight_decay", 0.0))}
    # the step keeps the optimizer state itself (ZenFlow, NVMe): read a fresh one of a dummy param
    found = find_hyperparams(state.tx.init(jnp.zeros((1,), jnp.float32)))
    if found is None:
        raise ConfigError(
            "this step runs AdamW on the host (zenflow, offload_optimizer='nvme') and needs its settings: build the state with "
            "tx=optax.inject_hyperparams(optax.adamw)(learning_rate=..., weight_decay=...) or give the "
            'DeepSpeed block optimizer={"type": "AdamW", "params": {...}} in the config.')
    get = lambda k, d: float(np.asarray(found[k])) if k in found else d  # noqa: E731
    return {"lr": get("learning_rate", 1e-3), "b1": get("b1", 0.9), "b2": get("b2", 0.999),
            "eps": get("eps", 1e-8), "weight_decay": get("weight_decay", 1e-4)}


class LearningRate:
    """The learning rate of each step: the schedule of an ``inject_hyperparams`` optimizer,
    followed through a one-element shadow of its state, or the constant from the config."""

    def __init__(self, state: TrainState, constant: float):
        self.constant = constant
        self._shadow = self._ahead = None
        if not state.plan.config.optimizer:
            try:
                shadow = state.tx.init(jnp.zeros((1,), jnp.float32))
            except Exception:  # noqa: BLE001 - an optimizer that cannot init a tiny tree: constant
                shadow = None
            if find_hyperparams(shadow) is not None:
                self._shadow = shadow
                zero = jnp.zeros((1,), jnp.float32)
                self._advance = jax.jit(lambda s: state.tx.update(zero, s, zero)[1])

    def peek(self) -> float:
        """The learning rate the next applied step uses, without advancing the schedule (a
        step that is then skipped for inf/nan gradients leaves it where it was)."""
        if self._shadow is None:
            return self.constant
        if self._ahead is None:
            self._ahead = self._advance(self._shadow)
        return float(find_hyperparams(self._ahead)["learning_rate"])

    def next(self) -> float:
        """This step's learning rate (advances the schedule by one step)."""
        lr = self.peek()
        if self._shadow is not None:
            self._shadow, self._ahead = self._ahead, None
        return lr
