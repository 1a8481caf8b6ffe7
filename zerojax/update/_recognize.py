"""What an optax transformation is, decided once for every backend.

``recognize(tx)`` returns an :class:`Optimizer` when ``tx`` is one of the element-wise
optimizers zerojax can run outside optax's own ``update`` (on the host, over files, in a
gated pass or a fused kernel):

* ``"adam"``: ``optax.adam`` / ``optax.adamw`` (any bias-corrected ``scale_by_adam``
  followed by decoupled weight decay and the learning rate);
* ``"sgd"``: ``optax.sgd`` with or without momentum, Nesterov or not;
* ``"lion"``: ``optax.lion``.

Each either has constant settings, read off by probing the transformation, or is
``optax.inject_hyperparams`` of one (settings and schedules read from its state each
step). Whatever the candidate, its update is checked against ``tx.update`` on probe values
(ordinary and extreme ones: a global clip or a trust ratio downstream shows there) with
:func:`rule`, the one element-wise statement of each optimizer; anything that does not
agree to 1e-6 is not recognised. A backend that needs a recognised optimizer refuses the
rest with :func:`refuse`, naming the optimizer and the path: no backend runs one
optimizer in place of another.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax._compat import Tracer, probe_jit
from zerojax._errors import OptimizerError
from zerojax.update._memo import _Remembered, per_transformation, transformation_key  # noqa: F401 - kept here too

__all__ = ["Optimizer", "StepSettings", "describe", "direction", "init_shape", "node_of", "recognize", "recognize_with_pass", "refuse", "rule",
           "settings_of", "with_node"]

# the state node of each kind's stateful transformation and the moments it holds
_NODES = {"adam": (optax.ScaleByAdamState, ("mu", "nu")), "sgd": (optax.TraceState, ("trace",)),
          "lion": (optax.ScaleByLionState, ("mu",))}
_DEFAULTS = {"adam": {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0, "weight_decay": 0.0},
             "sgd": {"momentum": 0.0},
             "lion": {"b1": 0.9, "b2": 0.99, "weight_decay": 0.0}}


@dataclass(frozen=True)
class Optimizer:
    """A recognised optimizer: its ``kind``, whether its settings are ``injected`` (read from
    the state each step) or ``constants``, the per-element state it keeps (``slots``: ``mu``,
    ``nu`` for Adam; ``trace`` for SGD with momentum; ``mu`` for Lion) and, for SGD, whether
    the momentum is Nesterov's."""
    kind: str
    constants: Optional[dict] = field(default=None, compare=False)
    injected: bool = False
    nesterov: bool = False
    slots: tuple = ()

    @property
    def name(self) -> str:
        base = {"adam": "Adam/AdamW", "sgd": "SGD", "lion": "Lion"}[self.kind]
        if self.kind == "sgd" and self.slots:
            base += " with Nesterov momentum" if self.nesterov else " with momentum"
        return ("injected " if self.injected else "") + base


# ------------------------------------------------------------------ the element-wise rule


def rule(opt: Optimizer, hp: dict, count, p, g, slots, xp=jnp):
    """One update of ``opt`` with settings ``hp`` (see :meth:`StepSettings.peek`), element-wise
    on arrays of one shape: ``(new_p, new_slots)``. ``count`` is the 1-based number of this
    applied update (Adam's bias correction); ``xp`` is ``jax.numpy`` or ``numpy`` (the host
    paths). The arithmetic is optax's, term for term: settings stay the Python floats (constant
    settings) or fp32 scalars (injected ones) optax computes with."""
    lr = hp["learning_rate"]
    if opt.kind == "adam":
        b1, b2, eps, eps_root, wd = (hp[k] for k in ("b1", "b2", "eps", "eps_root", "weight_decay"))
        m, v = slots
        m = (1 - b1) * g + b1 * m
        v = (1 - b2) * (g * g) + b2 * v
        n = xp.asarray(count, xp.int32)  # a float setting to the power of an int32 count, as optax
        u = (m / (1 - b1 ** n).astype(m.dtype)) / (xp.sqrt(v / (1 - b2 ** n).astype(v.dtype) + eps_root) + eps)
        if _nonzero(wd):
            u = u + wd * p
        return p + (-lr) * u, (m, v)
    if opt.kind == "lion":
        b1, b2, wd = hp["b1"], hp["b2"], hp["weight_decay"]
        (m,) = slots
        u = xp.sign((1 - b1) * g + b1 * m)
        m = (1 - b2) * g + b2 * m
        if _nonzero(wd):
            u = u + wd * p
        return p + (-lr) * u, (m,)
    if not slots:  # plain SGD
        return p + (-lr) * g, ()
    (t,) = slots
    mom = hp["momentum"]
    t = g + mom * t
    u = g + mom * t if opt.nesterov else t
    return p + (-lr) * u, (t,)


def _nonzero(x) -> bool:
    # a traced setting (injected, inside a jitted check) may be anything: optax adds it
    return isinstance(x, Tracer) or bool(x)


# ------------------------------------------------------------------ finding the node


def _is_empty(x) -> bool:
    return isinstance(x, optax.EmptyState)


def _inner(opt_state):
    """(inner chain state, injected hyperparams or None)."""
    hp = getattr(opt_state, "hyperparams", None)
    if hp is not None and hasattr(opt_state, "inner_state"):
        return opt_state.inner_state, hp
    return opt_state, None


def _node_kind(chain):
    """The kind whose node heads ``chain`` with only stateless transformations after it, ("sgd",
    None) for a chain of stateless ones only, else None."""
    if not isinstance(chain, tuple) or not chain:
        return None
    if all(map(_is_empty, chain)):
        return "sgd", None
    if not all(map(_is_empty, chain[1:])):
        return None
    for kind, (cls, _) in _NODES.items():
        if isinstance(chain[0], cls):
            return kind, chain[0]
    return None


def node_of(opt_state, kind: str):
    """The state node of ``kind`` in ``opt_state`` (bare chain or injected), else None."""
    chain, _ = _inner(opt_state)
    found = _node_kind(chain)
    return found[1] if found is not None and found[0] == kind else None


def with_node(opt_state, node):
    """``opt_state`` with its chain's first state replaced by ``node``."""
    chain, hp = _inner(opt_state)
    chain = (node,) + tuple(chain[1:])
    return opt_state._replace(inner_state=chain) if hp is not None else chain


# ------------------------------------------------------------------ settings


def settings_of(opt: Optimizer, hp) -> dict:
    """The full settings of one step: the constants, or the injected ``hp`` with optax's
    defaults for what it does not inject."""
    if not opt.injected:
        return dict(opt.constants)
    out = dict(_DEFAULTS[opt.kind])
    for k, v in hp.items():
        if k in out or k == "learning_rate":
            out[k] = v
    out.setdefault("learning_rate", hp["learning_rate"])
    if opt.kind == "sgd" and out.get("momentum") is None:
        out["momentum"] = 0.0
    return out


def _numeric(hp) -> dict:
    """The numeric scalars of injected hyperparameters (concrete or traced), as they are."""
    return {k: v for k, v in hp.items()
            if isinstance(v, (int, float, np.ndarray, np.generic, jax.Array)) and jnp.ndim(v) == 0
            and jnp.issubdtype(jnp.result_type(v), jnp.number)}


def _scalars(hp) -> dict:
    """The numeric scalars of injected hyperparameters, as the fp32 numpy scalars optax holds."""
    return {k: np.asarray(v)[()] for k, v in _numeric(hp).items()}


def init_shape(tx):
    """The abstract initial state of ``tx`` for one fp32 leaf ``"x"`` of 6 elements: enough to
    see what the optimizer's state is without running (or compiling) anything."""
    return jax.eval_shape(tx.init, {"x": jax.ShapeDtypeStruct((6,), jnp.float32)})


def shadow_json(tree) -> list:
    """A (one-element shadow) optimizer state's leaves as JSON-ready ``[dtype, value]`` pairs, the
    form :meth:`StepSettings.set_shadow` reads back."""
    return [[np.dtype(x.dtype).name, np.asarray(x).tolist()] for x in jax.tree_util.tree_leaves(tree)]


class StepSettings:
    """The settings each applied step of a recognised ``tx`` uses, on the host: the constants,
    or the injected hyperparameters followed through a one-element shadow of its state
    (schedules advance once per applied step, as optax's count does)."""

    def __init__(self, tx, opt: Optimizer):
        self.opt = opt
        self._ahead = None
        self._shadow = None
        if opt.injected:
            zero = jnp.zeros((1,), jnp.float32)
            self._shadow = tx.init(zero)
            self._advance = probe_jit(lambda s: tx.update(zero, s, zero)[1])

    def peek(self) -> dict:
        """The settings of the next applied step (a skipped step leaves them where they were)."""
        if self._shadow is None:
            return dict(self.opt.constants)
        if self._ahead is None:
            self._ahead = self._advance(self._shadow)
        return settings_of(self.opt, _scalars(self._ahead.hyperparams))

    def next(self) -> dict:
        """This step's settings; advances the schedule by one applied step."""
        hp = self.peek()
        if self._shadow is not None:
            self._shadow, self._ahead = self._ahead, None
        return hp

    def shadow_leaves(self) -> Optional[list]:
        """The shadow state's leaves as JSON-ready ``[dtype, value]`` pairs (None: constant
        settings), so a resumed run takes up the schedule where it was (:meth:`set_shadow`)."""
        return None if self._shadow is None else shadow_json(self._shadow)

    def set_shadow(self, leaves: Optional[list]) -> None:
        """Takes up the schedule from :meth:`shadow_leaves` of another run of the same ``tx``."""
        if self._shadow is None or leaves is None:
            return
        treedef = jax.tree_util.tree_structure(self._shadow)
        self._shadow = treedef.unflatten([jnp.asarray(np.asarray(v, dt)) for dt, v in leaves])
        self._ahead = None

    @property
    def shadow(self):
        """The one-element shadow of the optimizer state at the applied steps so far (None:
        constant settings)."""
        return self._shadow


# ------------------------------------------------------------------ probing constant settings


def _updater(tx, kind):
    """``(g, p, moments) -> tx.update(g, state, p)`` as numpy, one jitted program: the state is
    ``tx.init(p)`` with ``kind``'s moments replaced by ``moments`` (a dict of arrays, or None),
    held behind an optimization barrier so nothing in it is folded at compile time (the update's
    arithmetic is what it is on any state). Probing compiles this one program, not one per
    operation, and calls of one shape reuse it."""

    @probe_jit
    def run(g, p, moments):
        state = tx.init(p)
        if moments:
            state = with_node(state, node_of(state, kind)._replace(**{k: {"x": v} for k, v in moments.items()}))
        return tx.update(g, jax.lax.optimization_barrier(state), p)

    return lambda g, p, moments=None: jax.device_get(run(g, p, moments or {}))


def _run_update(tx, kind, g, p, moments=None):
    return _updater(tx, kind)(g, p, moments)


def _probe_adam(tx) -> Optional[dict]:
    t, big = 1e-8, 1e3
    # [0]: the learning rate; [1]: against [0], the weight decay; [2]: against [0], eps;
    # [3]: a zero gradient, so the decay alone (when eps > 0 keeps the Adam term at 0)
    p = {"x": np.array([0.0, big, 0.0, big], np.float32)}
    g = {"x": np.array([1.0, 1.0, t, 0.0], np.float32)}
    u, after = _run_update(tx, "adam", g, p)
    node = node_of(after, "adam")
    b1 = 1.0 - float(node.mu["x"][0])
    b2 = 1.0 - float(node.nu["x"][0])
    one = np.float32(1)  # the bias corrections at count 1 as optax computes them, in fp32
    mhat = np.asarray(np.asarray(node.mu["x"]) / (one - np.float32(b1)), np.float64)
    root = np.sqrt(np.asarray(np.asarray(node.nu["x"]) / (one - np.float32(b2)), np.float64))
    u = np.asarray(u["x"], np.float64)
    if not np.all(np.isfinite(u[:3])) or u[0] == 0 or u[2] == 0:
        return None
    r = u[2] / u[0]
    eps = (mhat[2] * root[0] - r * mhat[0] * root[2]) / (r * mhat[0] - mhat[2])
    lr = -u[0] / (mhat[0] / (root[0] + eps))
    if np.isfinite(u[3]):  # exact to an ulp or two: the decay is all of this update
        wd = -u[3] / lr / big
    else:  # eps = 0: the zero gradient's Adam term is 0/0; the decay next to the Adam term
        wd = (-u[1] / lr - mhat[1] / (root[1] + eps)) / big
    return {"learning_rate": _snap(lr), "b1": b1, "b2": b2, "eps": _snap(eps), "eps_root": 0.0,
            "weight_decay": _snap(wd)}


def _snap(x: float, ulps: int = 4) -> float:
    """The fp32 setting a probe reads as ``x``: optax multiplies by these as fp32, and a probe's
    own rounding leaves it a few ulps off, so of the fp32 values within ``ulps`` of ``x`` the
    one with the shortest decimal form (the number a user writes: 0.1, 3e-4), nearest on a tie
    (a weight decay that is not there reads as ~1e-19)."""
    if abs(x) < 1e-15:
        return 0.0
    near = np.float32(x)
    cands = [near]
    up, down = near, near
    for _ in range(ulps):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        cands += [up, down]
    return float(min(cands, key=lambda c: (len(str(c).lstrip("-")), abs(float(c) - x))))


def _probe_sgd(tx) -> Optional[dict]:
    p = {"x": np.zeros((2,), np.float32)}
    if node_of(init_shape(tx), "sgd") is None:  # plain SGD: u = -lr g
        u, _ = _run_update(tx, "sgd", {"x": np.array([1.0, 2.0], np.float32)}, p)
        return {"learning_rate": _snap(-float(u["x"][0])), "momentum": 0.0}
    # trace [0, 1], gradient [1, 0]: the new trace is [1, m]; the update is -lr [1, m], or with
    # Nesterov's momentum -lr [1 + m, m^2]
    u, after = _run_update(tx, "sgd", {"x": np.array([1.0, 0.0], np.float32)}, p,
                           {"trace": np.array([0.0, 1.0], np.float32)})
    m = float(np.asarray(node_of(after, "sgd").trace["x"], np.float64)[1])
    u = np.asarray(u["x"], np.float64)
    if u[0] == 0:
        return None
    nesterov = m != 0 and abs(u[1] / u[0] - m) > abs(u[1] / u[0] - m * m / (1 + m))
    lr = -u[0] / (1 + m) if nesterov else -u[0]
    return {"learning_rate": _snap(lr), "momentum": float(np.float32(m)), "nesterov": nesterov}


def _probe_lion(tx) -> Optional[dict]:
    p = {"x": np.array([0.0, 1e3], np.float32)}
    u, after = _run_update(tx, "lion", {"x": np.array([1.0, 1.0], np.float32)}, p)
    b2 = 1.0 - float(node_of(after, "lion").mu["x"][0])
    u = np.asarray(u["x"], np.float64)
    lr = -u[0]
    if lr == 0:
        return None
    wd = (-u[1] / lr - 1.0) / 1e3
    # b1 enters through a sign only: find where sign((1 - b1) g + b1 m) flips for m = 1, g = -x,
    # x = b1 / (1 - b1), narrowing a grid of candidates four times (one program, compiled once)
    n = 63
    q, ones, update = {"x": np.zeros((n,), np.float32)}, {"mu": np.ones((n,), np.float32)}, _updater(tx, "lion")
    lo, hi = 0.0, 1.0
    for _ in range(4):
        b1s = np.linspace(lo, hi, n + 2)[1:-1]
        uu, _ = update({"x": np.asarray(-(b1s / (1 - b1s)), np.float32)}, q, ones)
        k = int((np.asarray(uu["x"]) < 0).sum())  # sign(c) > 0 -> update -lr: b1 > candidate's; k below b1
        lo, hi = (b1s[k - 1] if k else lo), (b1s[k] if k < n else hi)
    return {"learning_rate": _snap(lr), "b1": float(np.float32((lo + hi) / 2)), "b2": b2,
            "weight_decay": _snap(wd)}


_PROBES = {"adam": _probe_adam, "sgd": _probe_sgd, "lion": _probe_lion}


# ------------------------------------------------------------------ verification


def _probe_values(kind, slots, shape=(6,)):
    rng = np.random.default_rng(0)
    ordinary = [rng.normal(size=shape) * 1e-5, rng.normal(size=shape)]
    ordinary += [rng.normal(size=shape) * 0.1 if s != "nu" else rng.random(shape) * 0.01 + 1e-4 for s in slots]
    extreme = [rng.normal(size=shape) * 1e-5, rng.normal(size=shape) * 1e-10]
    extreme += [np.full(shape, 1.0) if s != "nu" else np.full(shape, 1e-20) for s in slots]
    huge = [rng.normal(size=shape), rng.normal(size=shape) * 1e4] + [rng.normal(size=shape) for _ in slots]
    for count, values in ((4, ordinary), (0, extreme), (1, huge)):
        yield count, [np.asarray(np.abs(a) if s == "nu" else a, np.float32)
                      for s, a in zip(("p", "g") + tuple(slots), values)]


def _close(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-6, atol=0))


def _verified(opt: Optimizer, tx, gated=None) -> tuple:
    """``(rule_ok, gated_ok)``: ``tx``'s update against :func:`rule` on the probe values and,
    when ``gated`` (``(params, grads, state, apply) -> (params, state)``, a pass that claims to
    update as ``tx`` does) is given, that pass's params and state (every leaf: moments, counts,
    hyperparameters) against ``tx.update`` and ``optax.apply_updates``. Everything runs in one
    jitted program (the probes share its shapes): checking compiles once, not once per
    operation or per check."""
    slots = opt.slots
    shape = init_shape(tx)
    node = node_of(shape, opt.kind) if slots else None
    if slots and (node is None or any(getattr(node, s)["x"].dtype != jnp.float32 for s in slots)):
        return False, False
    set_count = bool(slots) and "count" in node._fields
    injected_count = getattr(shape, "hyperparams", None) is not None and "count" in shape._fields

    @probe_jit
    def both(count, p, g, moments):
        state = tx.init({"x": p})
        if slots:
            n = node_of(state, opt.kind)
            repl = {s: {"x": m} for s, m in zip(slots, moments)}
            if set_count:
                repl["count"] = count.astype(n.count.dtype)
            state = with_node(state, n._replace(**repl))
        if injected_count:
            state = state._replace(count=count.astype(state.count.dtype))
        u, after = tx.update({"x": g}, state, {"x": p})
        hp = settings_of(opt, _numeric(getattr(after, "hyperparams", {})))
        new_p, new_slots = rule(opt, hp, count + 1, p, g, tuple(moments))
        after_node = node_of(after, opt.kind) if slots else None
        applied = optax.apply_updates({"x": p}, u)
        checks = ((applied["x"], new_p), (tuple(getattr(after_node, s)["x"] for s in slots), new_slots))
        if gated is None:
            return checks, ()
        got = gated({"x": p}, {"x": g}, state, jnp.asarray(True))
        return checks, (jax.tree_util.tree_leaves((applied, after)), jax.tree_util.tree_leaves(got))

    rule_ok, gated_ok = True, gated is not None
    for count, (p, g, *moments) in _probe_values(opt.kind, slots):
        checks, pass_check = both(np.int32(count), p, g, tuple(moments))
        (want_p, got_p), (want_slots, got_slots) = checks
        rule_ok = rule_ok and _close(want_p, got_p) and all(_close(a, b) for a, b in zip(want_slots, got_slots))
        if gated_ok:
            want, got = pass_check
            gated_ok = len(want) == len(got) and all(_close(a, b) for a, b in zip(want, got))
    return rule_ok, gated_ok and rule_ok


def _candidates(tx):
    state = init_shape(tx)
    chain, hp = _inner(state)
    found = _node_kind(chain)
    if found is None:
        return
    kind, node = found
    injected = hp is not None
    if injected and not (isinstance(hp, dict) and "learning_rate" in hp):
        return
    slots = _NODES[kind][1] if node is not None else ()
    constants = None if injected else _PROBES[kind](tx)
    if not injected and constants is None:
        return
    if constants is not None and "nesterov" in constants:
        nesterovs = (constants.pop("nesterov"),)
    else:
        nesterovs = (False, True) if kind == "sgd" and node is not None else (False,)
    for nesterov in nesterovs:
        yield Optimizer(kind, constants, injected, nesterov, slots)


def _checked(opt: Optimizer, tx, make_gated) -> tuple:
    """:func:`_verified` with the pass ``make_gated(opt)`` builds (None: none to check); a pass
    that cannot even be traced on the probes does not agree, and the rule is checked alone."""
    gated = make_gated(opt) if make_gated is not None else None
    if gated is None:
        return _verified(opt, tx)
    try:
        return _verified(opt, tx, gated)
    except Exception:  # noqa: BLE001 - the pass does not fit this optimizer's state
        return _verified(opt, tx)[0], False


def _find(tx, make_gated=None) -> tuple:
    """``(optimizer or None, whether make_gated's pass agrees)``."""
    try:
        for opt in _candidates(tx):
            rule_ok, gated_ok = _checked(opt, tx, make_gated)
            if rule_ok:
                return opt, gated_ok
    except Exception:  # noqa: BLE001 - an optimizer the probes cannot drive is not recognised
        return None, False
    return None, False


def _recognize(tx) -> Optional[Optimizer]:
    return _find(tx)[0]


_cache = _Remembered()  # recognitions, shared by recognize and recognize_with_pass


@functools.partial(per_transformation, memory=_cache)
def recognize(tx) -> Optional[Optimizer]:
    """The :class:`Optimizer` ``tx`` is (checked against its own update), else None.
    Remembered per transformation."""
    return _recognize(tx)


def recognize_with_pass(tx, make_gated) -> tuple:
    """``(recognize(tx), exact)``: ``exact`` says whether the pass ``make_gated(opt)`` builds for
    the recognised optimizer (``(params, grads, state, apply) -> (params, state)``, or None when
    it has none for that optimizer) gives what ``tx.update`` and ``optax.apply_updates`` give on
    the probes, every leaf of the state to 1e-6. The pass is checked in the program that checks
    the recognition, so a step's build compiles one check, not two."""
    key = _cache.key(tx)
    known, opt = _cache.get(key)
    if known:
        return opt, opt is not None and _checked(opt, tx, make_gated)[1]
    opt, exact = _find(tx, make_gated)
    _cache.put(key, opt)
    return opt, exact


def describe(tx) -> str:
    """A name for ``tx`` in messages: the recognised optimizer, else its state's structure."""
    opt = recognize(tx)
    if opt is not None:
        return opt.name
    try:
        state = tx.init({"x": jnp.zeros((2,), jnp.float32)})
    except Exception:  # noqa: BLE001
        return type(tx).__name__
    names = [type(x).__name__ for x in jax.tree_util.tree_leaves(
        state, is_leaf=lambda x: isinstance(x, tuple) and hasattr(x, "_fields"))]
    if _holds(state, "MuonState"):
        return MUON
    inner = ", ".join(dict.fromkeys(n for n in names if n not in ("EmptyState", "ndarray", "ArrayImpl")))
    return f"an optimizer with state ({inner or 'none'})"


MUON = 'Muon (optax.contrib.muon; DeepSpeed\'s "type": "Muon")'


def _holds(state, name: str, depth: int = 0) -> bool:
    """Whether a node of type ``name`` sits anywhere in the optimizer state ``state``."""
    if type(state).__name__ == name:
        return True
    if depth > 12:
        return False
    children = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else ()
    return any(_holds(x, name, depth + 1) for x in children)


def refuse(tx, path: str, supported: str = "Adam/AdamW, SGD (momentum, Nesterov) and Lion") -> OptimizerError:
    """The error for a ``tx`` the ``path`` cannot run: names both and what it runs."""
    name = describe(tx)
    if name == MUON and "nvme" in path:
        return OptimizerError(
            f"{path} runs {name} where it recognises it: optax.contrib.muon with a fixed learning rate or "
            "under optax.inject_hyperparams, fp32 states, a data-only mesh, its update checked against optax's. "
            "This one it does not (a schedule outside inject_hyperparams, nesterov=False, another ns_steps or "
            "preconditioning, low-precision states, a tensor-parallel mesh). Fix: build it that way (DeepSpeed's "
            '"type": "Muon" does), or use offload_optimizer "cpu", where every optax.contrib.muon runs')
    if name == MUON:
        return OptimizerError(
            f"{path} does not run {name}: it reproduces {supported} on the host, outside optax, "
            "element-wise, and Muon's Newton–Schulz iterations need each matrix whole, on a device. Fix: "
            'use offload_optimizer "cpu" or "nvme" (zero_optimization.offload_optimizer.device), where Muon\'s '
            "momentum lives in host memory or in files and each matrix is orthogonalised on its owner, or keep "
            "the optimizer state on the device")
    return OptimizerError(
        f"{path} runs the optimizer update outside optax and reproduces {supported} (plain, or "
        f"optax.inject_hyperparams of them) exactly; the given optimizer is {describe(tx)}, which it does "
        "not reproduce (a decay mask, a schedule outside inject_hyperparams, a chained clip or another "
        "optimizer). Fix: use one of those, or train on the device path (no NVMe offload / ZenFlow) where "
        "every optax optimizer runs.")


def direction(opt: Optimizer, hp: dict) -> optax.GradientTransformation:
    """``opt`` without its learning rate, with the settings ``hp``: the update direction, for an
    engine that applies each step's learning rate itself (ZenFlow's device side)."""
    if opt.kind == "adam":
        return optax.chain(optax.scale_by_adam(hp["b1"], hp["b2"], hp["eps"], hp["eps_root"]),
                           optax.add_decayed_weights(hp["weight_decay"]))
    if opt.kind == "lion":
        return optax.chain(optax.scale_by_lion(hp["b1"], hp["b2"]), optax.add_decayed_weights(hp["weight_decay"]))
    if opt.slots:
        return optax.trace(hp["momentum"], opt.nesterov)
    return optax.identity()
