"""The fused AdamW update of the device step: the Pallas kernel over each partition."""
from __future__ import annotations


from zerojax._compat import shard_map
from zerojax.kernels._fused_adam import fused_adamw
from zerojax._plan import ZeroPlan
from zerojax.stages._adam import adam_node, adam_recipe, step_hyperparams
from zerojax.stages._gating import replace_node

__all__ = ["fused_adam_ok", "fused_adamw_update"]

def fused_adam_ok(tx) -> bool:
    """Whether the fused kernel computes ``tx``'s update: a bias-corrected Adam/AdamW that
    :func:`zerojax.stages._adam.adam_recipe` reproduces (no mask, eps_root 0, fp32 moments)."""
    return adam_recipe(tx) is not None


def fused_adamw_update(plan: ZeroPlan, tx, recipe, master, opt_state, grads, block_size: int = 4096):
    """AdamW through the Pallas kernel (``zerojax.kernels._fused_adam.fused_adamw``; interpret mode
    or a GPU kernel as the platform the step is lowered for asks): one pass per leaf over
    this device's partition of the fp32 master, both moments and the gradient, in storage
    layout (padding stays zero), writing the compute-dtype params in the same pass.
    Returns ``(params_c, master, opt_state)``; the state's counts and hyperparameters (a
    schedule's next value) come from running ``tx`` on a scalar-sized copy of the state, the
    settings from ``recipe`` (:func:`zerojax.stages._adam.adam_recipe`)."""
    adam = adam_node(opt_state)
    axis = plan.data_axis
    hp, _, new_tiny = step_hyperparams(tx, opt_state)
    hp = recipe.constants if recipe.constants is not None else hp
    count = adam.count + 1
    specs = plan.map(lambda lay: lay.data_spec(plan.opt_partitioned(lay), axis))
    cdt = plan.compute_dtype

    def body(p, m, v, g):
        def one(p, m, v, g):
            shape = p.shape
            out = fused_adamw(p.reshape(-1), m.reshape(-1), v.reshape(-1), g.reshape(-1), count,
                              hp["learning_rate"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"],
                              out_dtype=cdt, block_size=block_size)
            return tuple(x.reshape(shape) for x in out)

        flat = [plan.treedef.flatten_up_to(t) for t in (p, m, v, g)]
        outs = [one(*xs) for xs in zip(*flat)]
        return tuple(plan.treedef.unflatten([o[i] for o in outs]) for i in range(4))

    sm = shard_map(body, plan.mesh, in_specs=(specs,) * 4, out_specs=(specs,) * 4, manual_axes={axis})
    master, mu, nu, params_c = sm(master, adam.mu, adam.nu, grads)
    return params_c, master, replace_node(new_tiny, adam_node(new_tiny)._replace(mu=mu, nu=nu))
