"""Muon with owner-computed Newton–Schulz: each Muon matrix is orthogonalised whole, once per
optimizer step, by one device of the data axis (stages 0–3).

Through optax's own update on partitioned state, XLA splits every Newton–Schulz matmul of a
sharded leaf over the devices, one collective per matmul (an 8-layer model at stage 1: 323
collectives moving 8.9x the params' bytes, against AdamW's 3 and 2.0x). Here:

* the momentum stays in the optimizer state's partitioned layout (1/N of each matrix a device)
  and is updated there, element-wise, with optax's formulas (no communication);
* the Muon matrices of one shape (a 2D leaf, or each ``[m, n]`` slice of a stacked leaf) are
  stacked, the stack cut into N blocks of ``ceil(k / N)`` slots and split over the data axis by
  block: each device receives its matrices whole (one all-to-all per shape), runs Newton–Schulz
  on them (optax's ``orthogonalize_via_newton_schulz``, batched), and the orthogonalised
  updates return to the partitioned layout (one all-to-all back);
* a shape with fewer matrices than slots leaves some slots empty (zero matrices, not
  iterated): which owners get a shape's matrices is chosen over all shapes by cost
  (:func:`~zerojax.stages._muon_owners.balance`), so that a shape with 3 matrices on 8 devices
  lands on owners other shapes leave light; each device runs its own branch (``lax.switch`` on
  its index);
* the width scaling, weight decay and learning rate, and the whole AdamW group, run element-wise
  on the partitions; the updated params are gathered as for any optimizer (stages 1–2).

With ``offload_optimizer="cpu"`` the state's home is host memory (:func:`muon_offloaded_update`):
the step brings the Muon leaves' momentum partitions to the device for this update and writes
them back (``placement.fetch`` / ``put_back``), so the Newton–Schulz iterations never run inside
a host computation, while the AdamW group is updated by a host computation, its moments staying
in host memory.

At stage 0 (the state replicated) each device orthogonalises its 1/N of each stack and one
all-gather per shape shares the results.

The collectives do not grow with the iterations, and the all-to-alls move about 2Ψ_muon/N per
device. The optimizer is recognised from its state (``optax.contrib.muon`` under
``optax.inject_hyperparams``: the settings are read from the state each step; DeepSpeed's
``"type": "Muon"`` builds one) and the update checked against ``tx.update`` on probe values
before it is used; anything else, or one that does not agree, keeps running through optax.

Which owner orthogonalises which matrices, and the program that takes them there and back, are
:mod:`zerojax.stages._muon_owners`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax._placement as placement
from zerojax._compat import compute_on_host, same_memory_space
from zerojax._low_precision import round_master
from zerojax._plan import DEVICE
from zerojax.stages._muon_owners import _owners, orthogonalise
from zerojax.update._groups import partition_groups

try:  # optax's own iteration, so the numbers are optax's
    from optax.contrib._muon import MuonState, orthogonalize_via_newton_schulz
except ImportError:  # pragma: no cover - an optax without it: Muon runs through optax's update
    MuonState = orthogonalize_via_newton_schulz = None

__all__ = ["MuonRecipe", "muon_offloaded_update", "muon_recipe", "muon_update", "muon_updates"]

# optax.contrib.muon's defaults, for the settings an injected one does not hold
_DEFAULTS = {"beta": 0.95, "eps": 1e-8, "weight_decay": 0.0, "adam_b1": 0.9, "adam_b2": 0.999, "adam_eps_root": 0.0,
             "adam_weight_decay": 0.0, "adam_learning_rate": None}


@dataclasses.dataclass(frozen=True)
class MuonRecipe:
    """A recognised ``optax.contrib.muon``: which leaves (flatten order) are Muon's, and the
    proxy params (same structure and ranks, tiny shapes) its scalars advance on."""
    muon: tuple  # bool per leaf
    proxy: tuple  # ShapeDtypeStruct per leaf
    constants: Optional[tuple] = None  # the settings of a bare optax.contrib.muon, as (name, value) pairs


# ------------------------------------------------------------------ the state's parts


def _parts(opt_state):
    """(hyperparams or None, partition state) of an injected or bare optax.contrib.muon state."""
    hp = getattr(opt_state, "hyperparams", None)
    if hp is not None:
        return hp, opt_state.inner_state
    return None, opt_state


def _nodes(opt_state):
    """(MuonState, ScaleByAdamState) of the state, or None where it is not optax.contrib.muon's."""
    _, part = _parts(opt_state)
    inner = getattr(part, "inner_states", None)
    if not isinstance(inner, dict) or set(inner) != {"muon", "adam"}:
        return None
    muon, adam = (getattr(inner[k], "inner_state", None) for k in ("muon", "adam"))
    empty = lambda xs: all(isinstance(x, optax.EmptyState) for x in xs)  # noqa: E731
    if not (isinstance(muon, tuple) and len(muon) == 4 and MuonState is not None and isinstance(muon[0], MuonState)
            and empty(muon[1:])):
        return None
    if not (isinstance(adam, tuple) and len(adam) == 3 and isinstance(adam[0], optax.ScaleByAdamState)
            and empty(adam[1:])):
        return None
    return muon[0], adam[0]


def _with_nodes(opt_state, muon_node, adam_node):
    hp, part = _parts(opt_state)
    inner = dict(part.inner_states)
    inner["muon"] = inner["muon"]._replace(inner_state=(muon_node,) + tuple(inner["muon"].inner_state[1:]))
    inner["adam"] = inner["adam"]._replace(inner_state=(adam_node,) + tuple(inner["adam"].inner_state[1:]))
    part = part._replace(inner_states=inner)
    return opt_state._replace(inner_state=part) if hp is not None else part


def _settings(hp, recipe=None) -> dict:
    if hp is None:
        return dict(recipe.constants)
    s = dict(_DEFAULTS)
    s.update({k: v for k, v in hp.items() if k in _DEFAULTS or k == "learning_rate"})
    if s["adam_learning_rate"] is None:
        s["adam_learning_rate"] = s["learning_rate"]
    return s


# ------------------------------------------------------------------ the update


def _proxy_tree(treedef, recipe: MuonRecipe, fill):
    return treedef.unflatten([fill(p) for p in recipe.proxy])


def _advance_scalars(tx, recipe: MuonRecipe, treedef, opt_state, muon_node, adam_node):
    """``(settings this step uses, state after)`` with the moments left as before: ``tx`` runs
    on proxy params (the params' structure, tiny leaves), so counts, injected hyperparameters
    and schedules advance exactly as optax's would."""
    zeros = lambda p: jnp.zeros(p.shape, p.dtype)  # noqa: E731
    proxy = _proxy_tree(treedef, recipe, zeros)
    fresh_muon, fresh_adam = _nodes(jax.eval_shape(tx.init, proxy))
    like = lambda tree: jax.tree_util.tree_map(zeros, tree)  # noqa: E731
    before = _with_nodes(opt_state, muon_node._replace(mu=like(fresh_muon.mu)),
                         adam_node._replace(mu=like(fresh_adam.mu), nu=like(fresh_adam.nu)))
    _, after = tx.update(proxy, before, proxy)
    hp = getattr(after, "hyperparams", None)
    return _settings(hp, recipe), after


def _bias_corrected(x, decay, count):
    return x / (1 - decay ** count).astype(x.dtype)


def _adamw(g, p, mu, nu, s, a_count):
    """One AdamW leaf as optax.contrib.muon's AdamW group updates it (Nesterov), element-wise:
    ``(update, mu, nu)``; ``a_count`` is the group's count after this step."""
    b1, b2 = s["adam_b1"], s["adam_b2"]
    mu = (1 - b1) * g + b1 * mu
    nu = (1 - b2) * g ** 2 + b2 * nu
    mu_hat = b1 * _bias_corrected(mu, b1, optax.safe_increment(a_count)) + (1 - b1) * _bias_corrected(g, b1, a_count)
    u = mu_hat / (jnp.sqrt(_bias_corrected(nu, b2, a_count) + s["adam_eps_root"]) + s["eps"])
    u = u + s["adam_weight_decay"] * p
    return -s["adam_learning_rate"] * u, mu, nu


def _update(tx, recipe: MuonRecipe, grads, opt_state, params, owners=None, n: int = 1,
            elsewhere: frozenset = frozenset()):
    """``(updates, new opt_state)`` of optax.contrib.muon on logical trees, with the
    Newton–Schulz iterations run on stacks of whole matrices (on their owners: ``owners``)."""
    treedef = jax.tree_util.tree_structure(params)
    muon_node, adam_node = _nodes(opt_state)
    s, after = _advance_scalars(tx, recipe, treedef, opt_state, muon_node, adam_node)
    g_leaves, p_leaves = treedef.flatten_up_to(grads), treedef.flatten_up_to(params)
    mu_leaves = treedef.flatten_up_to(muon_node.mu)
    amu_leaves, anu_leaves = treedef.flatten_up_to(adam_node.mu), treedef.flatten_up_to(adam_node.nu)
    beta = s["beta"]
    m_count = optax.safe_increment(muon_node.count)
    a_count = optax.safe_increment(adam_node.count)
    bc = _bias_corrected
    new_mu, new_amu, new_anu = list(mu_leaves), list(amu_leaves), list(anu_leaves)
    updates = [None] * len(g_leaves)
    # Muon: momentum and Nesterov's corrected mix on the partitions, element-wise
    hats = {}
    for i, (g, m, muon) in enumerate(zip(g_leaves, mu_leaves, recipe.muon)):
        if not muon:
            continue
        m = (1 - beta) * g + beta * m
        new_mu[i] = m
        hats[i] = beta * bc(m, beta, optax.safe_increment(m_count)) + (1 - beta) * bc(g, beta, m_count)
    # Newton–Schulz on stacks of same-shape matrices, each whole on its owner
    for i, u in orthogonalise(hats, muon_node.ns_coeffs, s["eps"], owners, n).items():
        u = u + s["weight_decay"] * p_leaves[i]
        updates[i] = -s["learning_rate"] * u
    # AdamW (Nesterov, as optax.contrib.muon builds it) on the partitions; the leaves in
    # ``elsewhere`` are left to the caller (zero updates here, their moments as they came)
    for i, (g, p, muon) in enumerate(zip(g_leaves, p_leaves, recipe.muon)):
        if muon:
            continue
        if i in elsewhere:
            updates[i] = jnp.zeros_like(g)
            continue
        updates[i], new_amu[i], new_anu[i] = _adamw(g, p, amu_leaves[i], anu_leaves[i], s, a_count)
    after_muon, after_adam = _nodes(after)
    new_state = _with_nodes(after, after_muon._replace(mu=treedef.unflatten(new_mu)),
                            after_adam._replace(mu=treedef.unflatten(new_amu), nu=treedef.unflatten(new_anu)))
    return treedef.unflatten(updates), new_state


# ------------------------------------------------------------------ recognition


def _proxy_shape(shape) -> tuple:
    if len(shape) >= 2:
        return (1,) * (len(shape) - 2) + (3, 5) if shape[-2] <= shape[-1] else (1,) * (len(shape) - 2) + (5, 3)
    return (2,) * len(shape)


def _probe_shape(shape) -> tuple:
    if len(shape) >= 2:
        return (2,) * (len(shape) - 2) + ((4, 6) if shape[-2] <= shape[-1] else (6, 4))
    return (3,) * len(shape)


def _agrees(tx, recipe: MuonRecipe, treedef) -> bool:
    """``_update`` against ``tx.update`` over 3 steps of random probe values (matrices of a
    shape unlike the proxies', so the Newton–Schulz iterations and the width scaling show)."""
    rng = np.random.default_rng(0)
    shapes = [_probe_shape(p.shape) for p in recipe.proxy]
    params = treedef.unflatten([jnp.asarray(rng.standard_normal(s), p.dtype) for s, p in zip(shapes, recipe.proxy)])
    if partition_groups(tx, params) != partition_groups(tx, _proxy_tree(treedef, recipe, lambda p: p)):
        return False
    mine = theirs = tx.init(params)
    for _ in range(3):
        g = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
        u1, mine = _update(tx, recipe, g, mine, params)
        u2, theirs = tx.update(g, theirs, params)
        for a, b in zip(jax.tree_util.tree_leaves((u1, mine)), jax.tree_util.tree_leaves((u2, theirs))):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-7):
                return False
        params = optax.apply_updates(params, u2)
    return True


def _closure_constants(obj, out: dict, seen: set, depth: int = 0) -> dict:
    """Every number a transformation's update closes over, by name, depth first (the first
    of a name wins): what optax.contrib.muon's parts were built with."""
    if id(obj) in seen or depth > 8:
        return out
    seen.add(id(obj))
    fn = getattr(obj, "update", obj)
    if isinstance(obj, (tuple, list)):
        for x in obj:
            _closure_constants(x, out, seen, depth + 1)
        return out
    if isinstance(obj, dict):
        for x in obj.values():
            _closure_constants(x, out, seen, depth + 1)
        return out
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return out
    for name, cell in zip(code.co_freevars, cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.setdefault(name, float(value))
        elif callable(value) or isinstance(value, (tuple, list, dict)):
            _closure_constants(value, out, seen, depth + 1)
    return out


def _constant_settings(tx) -> Optional[tuple]:
    """The settings of a bare ``optax.contrib.muon`` (constants, a fixed learning rate), read
    from its parts' closures, or None; the update built from them is checked like any other."""
    found: dict = {}
    for code, cell in zip(getattr(tx.update, "__code__", None).co_freevars if hasattr(tx.update, "__code__") else (),
                          getattr(tx.update, "__closure__", None) or ()):
        if code == "transforms":
            found = cell.cell_contents
    if not isinstance(found, dict) or set(found) != {"muon", "adam"}:
        return None
    muon, adam = (_closure_constants(found[k], {}, set()) for k in ("muon", "adam"))
    try:
        s = {"learning_rate": -muon["step_size"], "beta": muon["beta"], "eps": muon["eps"],
             "weight_decay": muon.get("weight_decay", 0.0), "adam_b1": adam["b1"], "adam_b2": adam["b2"],
             "adam_eps_root": adam.get("eps_root", 0.0), "adam_weight_decay": adam.get("weight_decay", 0.0),
             "adam_learning_rate": -adam["step_size"]}
    except KeyError:  # a schedule (no step_size) or parts of another shape
        return None
    return tuple(sorted(s.items()))


def _recipe(tx, shapes) -> Optional[MuonRecipe]:
    if orthogonalize_via_newton_schulz is None:
        return None
    try:
        state = jax.eval_shape(tx.init, shapes)
    except Exception:  # noqa: BLE001 - an init that cannot run on shapes
        return None
    if _nodes(state) is None:
        return None
    hp = getattr(state, "hyperparams", None)
    constants = None
    if hp is None:
        constants = _constant_settings(tx)
        if constants is None:
            return None
    elif not isinstance(hp, dict) or "learning_rate" not in hp:
        return None
    groups = partition_groups(tx, shapes)
    if groups is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    recipe = MuonRecipe(tuple(g == "muon" for g in groups),
                        tuple(jax.ShapeDtypeStruct(_proxy_shape(x.shape), x.dtype) for x in leaves), constants)
    if partition_groups(tx, _proxy_tree(treedef, recipe, lambda p: p)) != groups:
        return None  # a rule that reads sizes: the proxies would change the groups
    try:
        # op by op with jit off: optax's Newton–Schulz loop (a fori_loop) then runs as Python
        # iterations of primitives compiled once per probe shape, where a jitted loop is a new
        # program to compile for every recognition (some 80 compiles, a second or more each time)
        with jax.ensure_compile_time_eval(), jax.disable_jit():
            ok = _agrees(tx, recipe, treedef)
    except Exception:  # noqa: BLE001 - a transformation the probes cannot drive is not recognised
        return None
    return recipe if ok else None


@functools.lru_cache(maxsize=32)
def _cached(tx, key):
    return _recipe(tx, key[1].unflatten([jax.ShapeDtypeStruct(s, d) for s, d in key[0]]))


def muon_recipe(plan, tx, host_loop: bool = False) -> Optional[MuonRecipe]:
    """The owner-computed Muon update for ``tx`` on ``plan``, or None (optax's own update runs):
    ``tx`` must be a recognised ``optax.contrib.muon``, the optimizer state in fp32 (partitioned
    at stages 1–3, replicated at stage 0: :func:`zerojax.stages._muon_owners._owners`), on the
    device or in host memory (``offload_optimizer="cpu"``, any ``offload_ratio``:
    :func:`muon_offloaded_update`), and every leaf on the data axis only (no tensor or sequence
    parallel split). ``host_loop``: for the NVMe step (:mod:`zerojax.offload._nvme_muon`), which
    keeps the state itself, on any number of devices."""
    cfg = plan.config
    if (plan.n < 2 and not host_loop) or cfg.master_weights_dtype or cfg.optimizer_state_dtype:
        return None
    if not host_loop and cfg.offload_optimizer is not None and (cfg.offload_optimizer != "cpu"
                                                                or plan.optimizer_state_outside):
        return None  # NVMe and ZenFlow keep the state themselves (NVMe asks with host_loop; ZenFlow refuses Muon)
    if any(lay.extra or any(e is not None for e in lay.base_spec) for lay in plan.leaves):
        return None
    shapes = [(lay.shape, np.dtype(lay.dtype)) for lay in plan.leaves]
    try:
        return _cached(tx, (tuple(shapes), plan.treedef))
    except TypeError:  # an unhashable transformation
        return _cached.__wrapped__(tx, (tuple(shapes), plan.treedef))


def muon_update(plan, recipe: MuonRecipe, tx, master, grads, opt_state, key=None):
    """``optax_update``'s contract (:func:`zerojax.stages._update.optax_update`) for a recognised
    Muon: ``(master, opt_state)`` updated, in storage layout."""
    current = placement.to_update(plan, master)
    grads = placement.to_update(plan, grads)
    state = placement.opt_to_update(plan, opt_state)
    updates, state = _update(tx, recipe, grads, state, current, _owners(plan), plan.n)
    updates = plan.map(lambda lay, u: jax.lax.with_sharding_constraint(u, plan.update_sharding(lay)), updates)
    new = round_master(plan, optax.apply_updates(current, updates), key)
    return placement.to_storage(plan, new), placement.opt_to_storage(plan, state)


def muon_updates(plan, recipe: MuonRecipe, tx, grads, opt_state, params):
    """``tx.update``'s contract on the update layout (:func:`zerojax._placement.to_update`) for a
    recognised Muon, the iterations on owners: ``(updates, opt_state)``, each update constrained
    to its partition (``zj.zero_optimizer``'s update without offload)."""
    updates, state = _update(tx, recipe, grads, opt_state, params, _owners(plan), plan.n)
    updates = plan.map(lambda lay, u: jax.lax.with_sharding_constraint(u, plan.update_sharding(lay)), updates)
    return updates, state


_ADAM_KEYS = ("adam_b1", "adam_b2", "adam_eps_root", "eps", "adam_weight_decay", "adam_learning_rate")


def _host_adamw(plan, s, a_count, grads, master, mu, nu, skip):
    """The AdamW group's leaves whose state lives in host memory, updated by a host computation
    (``compute_on``) on their stored partitions (element-wise, so the padding stays zero):
    ``(compute-dtype params, fp32 master, mu, nu)``, lists in the order given; a skipped step
    keeps them. The moments never leave host memory; the gradients go there and the updated
    params come back, as in the offloaded update of any other optimizer."""
    host = NamedSharding(plan.mesh, P(), memory_kind=plan.opt_memory_kind)
    scalars = {k: jax.device_put(jnp.asarray(s[k], jnp.float32), host) for k in _ADAM_KEYS}
    scalars["count"] = jax.device_put(a_count, host)

    def update(scalars, skip, gs, ps, mus, nus):
        out = ([], [], [], [])
        for g, p, m, v in zip(gs, ps, mus, nus):
            u, m2, v2 = _adamw(g, p, m, v, scalars, scalars["count"])
            keep = lambda old, new: jnp.where(skip, old, same_memory_space(new, old))  # noqa: E731
            new_p = keep(p, p + u)
            for bucket, x in zip(out, (same_memory_space(new_p.astype(plan.compute_dtype), p), new_p,
                                       keep(m, m2), keep(v, v2))):
                bucket.append(x)
        return out

    return compute_on_host(update)(scalars, jax.device_put(skip, host), grads, master, mu, nu)


def muon_offloaded_update(plan, recipe: MuonRecipe, tx, master, grads, opt_state, homes, skip):
    """A recognised Muon whose optimizer state lives in host memory (``offload_optimizer="cpu"``):
    ``(compute-dtype params, master, opt_state)`` in storage layout, the master and the state
    written back to their homes; ``skip`` keeps them.

    * the Muon leaves: their momentum (and every scalar of the state) is fetched to the device,
      updated there and orthogonalised on owners as in :func:`muon_update`, and put back;
    * the AdamW group's leaves whose state is in host memory are updated by a host computation
      (:func:`_host_adamw`), their moments read and written in place in host memory; those on
      the device side of an ``offload_ratio`` split are updated on the device.

    ``master``: the fp32 master in storage (in host memory) or, without one, the params' split
    on the device; ``grads``: unscaled and clipped, on the device."""
    lays = plan.leaves
    on_host = frozenset(i for i, (lay, muon) in enumerate(zip(lays, recipe.muon)) if not muon and plan.opt_on_host(lay))
    muon_node, adam_node = _nodes(opt_state)
    flat = plan.treedef.flatten_up_to
    amu, anu, masters, g_leaves = flat(adam_node.mu), flat(adam_node.nu), flat(master), flat(grads)

    def stand_in(i, x):  # a device stand-in for a leaf the host computation updates (never read)
        return jnp.zeros(x.shape, x.dtype) if i in on_host else x

    sub = lambda xs: [stand_in(i, x) for i, x in enumerate(xs)]  # noqa: E731
    dev_opt = _with_nodes(opt_state, muon_node, adam_node._replace(mu=plan.treedef.unflatten(sub(amu)),
                                                                   nu=plan.treedef.unflatten(sub(anu))))
    dev_opt = placement.fetch(dev_opt, homes.opt_state)
    dev_master = plan.treedef.unflatten([
        stand_in(i, x) if i in on_host else
        jax.device_put(x, plan.master_sharding(lay).with_memory_kind(DEVICE)) if plan.has_master else x
        for i, (lay, x) in enumerate(zip(lays, masters))])

    # the device: Muon on owners, the AdamW leaves kept in device memory
    current = placement.to_update(plan, dev_master)
    state = placement.opt_to_update(plan, dev_opt)
    updates, new_state = _update(tx, recipe, placement.to_update(plan, grads), state, current, _owners(plan), plan.n,
                                 elsewhere=on_host)
    updates = plan.map(lambda lay, u: jax.lax.with_sharding_constraint(u, plan.update_sharding(lay)), updates)
    new_master = placement.to_storage(plan, optax.apply_updates(current, updates))
    new_opt = placement.opt_to_storage(plan, new_state)
    new_master, new_opt = jax.tree_util.tree_map(lambda o, n: jnp.where(skip, o, n), (dev_master, dev_opt),
                                                 (new_master, new_opt))

    # the host: the AdamW leaves whose moments live there
    idx = sorted(on_host)
    new_master = flat(new_master)
    new_params = [x.astype(plan.compute_dtype) for x in new_master]
    new_muon, new_adam = _nodes(new_opt)
    new_amu, new_anu = flat(new_adam.mu), flat(new_adam.nu)
    if idx:
        s, _ = _advance_scalars(tx, recipe, plan.treedef, state, *_nodes(state))
        a_count = optax.safe_increment(_nodes(dev_opt)[1].count)
        to_host = lambda i, x: jax.device_put(x, plan.master_sharding(lays[i]))  # noqa: E731
        host_p = [masters[i] if plan.has_master else to_host(i, masters[i]) for i in idx]
        p16, p32, mu, nu = _host_adamw(plan, s, a_count, [to_host(i, g_leaves[i]) for i in idx], host_p,
                                       [amu[i] for i in idx], [anu[i] for i in idx], skip)
        for k, i in enumerate(idx):
            dev = plan.master_sharding(lays[i]).with_memory_kind(DEVICE)
            new_params[i] = jax.device_put(p16[k], dev)
            new_master[i], new_amu[i], new_anu[i] = p32[k], mu[k], nu[k]
    new_opt = _with_nodes(new_opt, new_muon, new_adam._replace(mu=plan.treedef.unflatten(new_amu),
                                                               nu=plan.treedef.unflatten(new_anu)))
    new_master = plan.treedef.unflatten(new_master)
    master_out = placement.put_back(new_master, homes.master) if plan.has_master else None
    return plan.treedef.unflatten(new_params), master_out, placement.put_back(new_opt, homes.opt_state)
