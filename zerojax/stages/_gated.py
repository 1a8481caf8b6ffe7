"""The gated update passes: optimizers whose overflow skip enters the coefficients instead of a
select over the state (Adam/AdamW: :mod:`zerojax.stages._adam`; SGD with momentum:
:mod:`zerojax.stages._momentum`; what they share: :mod:`zerojax.stages._gating`).
``gated_recipe(tx)`` is None for every other optimizer."""
from __future__ import annotations

from zerojax.stages._adam import AdamRecipe, adam_recipe, gated_adam
from zerojax.stages._momentum import gated_momentum, momentum_recipe

__all__ = ["gated_recipe", "gated_update", "plan_recipe"]


def gated_recipe(tx):
    """How to update ``tx`` as a gated pass, or None (the general select path)."""
    return adam_recipe(tx) or momentum_recipe(tx)


def plan_recipe(plan, tx):
    """The gated pass for ``tx`` on ``plan``'s states, or None: the passes compute on fp32 masters
    and moments, so low-precision model states keep the general path."""
    cfg = plan.config
    if cfg.master_weights_dtype or cfg.optimizer_state_dtype:
        return None
    return gated_recipe(tx)


def gated_update(recipe, tx, params, grads, opt_state, apply):
    """``(params, opt_state)`` updated where ``apply``, exactly unchanged where not."""
    update = gated_adam if isinstance(recipe, AdamRecipe) else gated_momentum
    return update(recipe, tx, params, grads, opt_state, apply)
