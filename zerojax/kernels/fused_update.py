"""The fused AdamW update of the device step: the Pallas kernel over each partition."""
from __future__ import annotations

import jax.numpy as jnp
import optax

from zerojax._compat import shard_map
from zerojax.kernels.fused_adam import fused_adamw
from zerojax.plan import ZeroPlan

__all__ = ["fused_adam_ok", "fused_adamw_update"]

def _adam_node(opt_state):
    """The ScaleByAdamState inside an ``inject_hyperparams(optax.adamw)`` state, else None."""
    hp = getattr(opt_state, "hyperparams", None)
    inner = getattr(opt_state, "inner_state", None)
    if not isinstance(hp, dict) or not {"learning_rate", "b1", "b2", "eps", "weight_decay"} <= set(hp):
        return None
    if not isinstance(inner, tuple) or not inner or not isinstance(inner[0], optax.ScaleByAdamState):
        return None
    if any(not isinstance(x, optax.EmptyState) for x in inner[1:]):
        return None
    return inner[0]


def fused_adam_ok(opt_state) -> bool:
    """Whether the fused kernel computes this optimizer's update (eps_root must be 0)."""
    if _adam_node(opt_state) is None:
        return False
    eps_root = opt_state.hyperparams.get("eps_root", 0.0)
    try:
        return float(eps_root) == 0.0
    except TypeError:  # abstract state (planning): the structure is what counts
        return True


def fused_adamw_update(plan: ZeroPlan, tx, master, opt_state, grads, block_size: int = 4096):
    """AdamW through the Pallas kernel (``zerojax.offload.fused_adamw``): one pass per leaf over
    this device's partition of the fp32 master, both moments and the gradient, in storage
    layout (padding stays zero), writing the compute-dtype params in the same pass.
    Returns ``(params_c, master, opt_state)``; the state's counts and hyperparameters (a
    schedule's next value) come from running ``tx`` on a scalar-sized copy of the state."""
    adam = _adam_node(opt_state)
    axis = plan.data_axis
    # counts, hyperparameters and schedules advance exactly as optax's would, on scalars
    zeros = plan.map(lambda lay: jnp.zeros((), jnp.float32))
    tiny = opt_state._replace(inner_state=(adam._replace(mu=zeros, nu=zeros),) + tuple(opt_state.inner_state[1:]))
    _, new_tiny = tx.update(zeros, tiny, zeros)
    hp = new_tiny.hyperparams  # the values used for this step
    count = adam.count + 1
    specs = plan.map(lambda lay: lay.data_spec(plan.opt_partitioned(lay), axis))
    cdt = plan.compute_dtype
    interpret = plan.mesh.devices.flat[0].platform == "cpu"

    def body(p, m, v, g):
        def one(p, m, v, g):
            shape = p.shape
            out = fused_adamw(p.reshape(-1), m.reshape(-1), v.reshape(-1), g.reshape(-1), count,
                              hp["learning_rate"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"],
                              out_dtype=cdt, block_size=block_size, interpret=interpret)
            return tuple(x.reshape(shape) for x in out)

        flat = [plan.treedef.flatten_up_to(t) for t in (p, m, v, g)]
        outs = [one(*xs) for xs in zip(*flat)]
        return tuple(plan.treedef.unflatten([o[i] for o in outs]) for i in range(4))

    sm = shard_map(body, plan.mesh, in_specs=(specs,) * 4, out_specs=(specs,) * 4, manual_axes={axis})
    master, mu, nu, params_c = sm(master, adam.mu, adam.nu, grads)
    new_adam = new_tiny.inner_state[0]._replace(mu=mu, nu=nu)
    new_state = new_tiny._replace(inner_state=(new_adam,) + tuple(new_tiny.inner_state[1:]))
    return params_c, master, new_state
