"""Partial optimizer offload (``offload_ratio`` < 1): can this optimizer be split by param?

With ``offload_optimizer="cpu"`` and ``offload_ratio`` r < 1 at stage 3 (DeepSpeed's
``zero_optimization.offload_optimizer.ratio``), the plan keeps the fp32 master and optimizer
state of some params in host memory and of the others in device memory
(:attr:`zerojax._plan.ZeroPlan.offloaded_paths`), and the step runs the optax update twice: on
the host for the host side's params, on the device for the rest. That equals one update of the
whole tree only when each param's update and state are computed from that param alone, plus
the leaves no param owns (step counts, schedule state) computed from neither: true of
``optax.adam``, ``adamw``, ``sgd`` (with momentum), ``lion``, ``lamb`` and ``adafactor`` (its
factored statistics belong to their param); false of global-norm clipping inside the
optimizer, ``apply_if_finite`` (one non-finite count for all params) and the like.

:func:`check_split` decides this from a dependency trace of ``tx.update`` on shapes (nothing
runs) and raises a ConfigError naming ``offload_ratio`` when the optimizer mixes params.
"""
from __future__ import annotations

import functools

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

import zerojax._placement as placement
from zerojax._errors import ConfigError
from zerojax.update._recognize import describe
from zerojax._plan import ZeroPlan, path_str

__all__ = ["check_split"]

_HOST, _DEV = 1, 2
_OWN = {0: "shared by every param", _HOST: "kept in host memory", _DEV: "kept in device memory"}
_OTHER = {_HOST: "params whose state is in host memory", _DEV: "params whose state is in device memory",
          _HOST | _DEV: "params on both sides"}

# primitives whose inner program is a plain function of its operands, traced through by _flow;
# any other primitive (loops and conditionals included) makes each output depend on every operand
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                    "custom_vjp_call_jaxpr", "checkpoint", "remat"})


def _inner(eqn):
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, ClosedJaxpr):
            sub = sub.jaxpr
        if isinstance(sub, Jaxpr) and len(sub.invars) == len(eqn.invars):
            return sub
    return None


def _flow(jaxpr: Jaxpr, masks: list) -> list:
    """For each output of ``jaxpr``, the bit-or of the masks of the inputs it depends on."""
    env = dict(zip(jaxpr.invars, masks))

    def read(v):
        return 0 if isinstance(v, Literal) else env.get(v, 0)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _inner(eqn)
        if sub is not None:
            outs = _flow(sub, ins)
        else:
            mixed = functools.reduce(lambda a, b: a | b, ins, 0)
            outs = [mixed] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _opt_masks(plan: ZeroPlan, opt_tree) -> list:
    return [0 if side is None else _HOST if side else _DEV for side in placement.opt_sides(plan, opt_tree)]


def check_split(plan: ZeroPlan, tx) -> None:
    """Raise ConfigError (naming ``offload_ratio``) when ``plan`` splits the optimizer state
    between host and device memory and ``tx`` cannot be split by param; else nothing."""
    if not plan.partial_offload:
        return
    master = plan.abstract_master()
    opt = jax.eval_shape(tx.init, master)
    sides = [_HOST if plan.opt_on_host(lay) else _DEV for lay in plan.leaves]
    closed, (_, new_opt) = jax.make_jaxpr(tx.update, return_shape=True)(master, opt, master)
    got = _flow(closed.jaxpr, sides + _opt_masks(plan, opt) + sides)
    want = sides + _opt_masks(plan, new_opt)
    names = ([f"the update of param {lay.path!r}" for lay in plan.leaves]
             + [f"the optimizer-state leaf {path_str(p)!r}" for p, _ in jax.tree_util.tree_flatten_with_path(new_opt)[0]])
    for name, g, w in zip(names, got, want):
        if g & ~w:
            raise ConfigError(
                f"ZeroConfig.offload_ratio={plan.config.offload_ratio!r} (zero_optimization.offload_optimizer.ratio) "
                f"keeps the optimizer state of some params in host memory and of the others on the device, "
                f"but this optimizer ({describe(tx)}) cannot be split by param: {name} ({_OWN[w]}) depends on "
                f"{_OTHER[g & ~w]}. "
                f"Each param's update and state must come from that param alone (optax.adam, adamw, sgd, lion); "
                f"global-norm clipping inside the optimizer, apply_if_finite and the like mix params. "
                f"Fix: use offload_ratio 1.0, or such an optimizer (clip with ZeroConfig.gradient_clipping "
                f"rather than optax.clip_by_global_norm)")
