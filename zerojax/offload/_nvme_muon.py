"""Muon over the NVMe store: its momentum in the store's files, its Newton–Schulz on owners.

With ``offload_optimizer="nvme"`` the host loop (:class:`~zerojax.offload._nvme_step.HostLoopStep`)
keeps the fp32 master and two per-element slots, ``m`` and ``v``, in files. For a recognised
``optax.contrib.muon`` (:func:`zerojax.stages._muon.muon_recipe`) each step:

1. reads the committed ``m`` (the Muon leaves' momentum lives there), mixes it with the
   gradients as optax's Nesterov momentum does, and sends each device the block of the
   balanced stacks (:func:`zerojax.stages._muon_owners.balance`) whose matrices it orthogonalises
   whole; the results come back to host memory and are width-scaled there;
2. streams the store once, sub-group by sub-group, with :class:`MuonHost` as its optimizer: the
   Muon elements take the momentum update and ``master -= lr * (direction + wd * master)``; the
   AdamW group's elements take optax.contrib.muon's AdamW (Nesterov) in ``m`` and ``v``.

The settings (both learning rates, injected or scheduled) advance as optax's would, on proxy
params (:func:`zerojax.stages._muon._advance_scalars`). Host memory holds, beside the flat
gradient and params buffers, the momentum read in step 1 and the directions (one fp32 element
each), for the step's duration.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.offload._host_rule import _to_bf16_bits, _widen
from zerojax.stages._muon import MuonRecipe, _advance_scalars, _nodes, _proxy_tree
from zerojax.stages._muon_owners import _newton_schulz, _owners, _stack, _unstack, balance

__all__ = ["MuonHost"]


def _f32(x) -> np.float32:
    return np.float32(np.asarray(x))


def _corrected(x, decay: np.float32, count: int):
    return x / (np.float32(1) - decay ** np.float32(count))


class MuonHost:
    """A recognised Muon in the host loop: its settings, its Newton–Schulz on the device, and
    the element-wise rule the store runs on each sub-group (``HostOptimizer``'s ``step``, told
    the sub-group's ``offset`` in the flat state)."""

    takes_offset = True

    def __init__(self, plan, tx, recipe: MuonRecipe, layout):
        self.plan, self.tx, self.recipe, self.layout = plan, tx, recipe, layout
        self.mask = np.zeros(layout.total, bool)
        self.leaves = [i for i, m in enumerate(recipe.muon) if m]
        for view in (jax.tree_util.tree_leaves(layout.views(self.mask))[i] for i in self.leaves):
            view[...] = True
        self.direction = np.zeros(layout.total, np.float32)
        zeros = lambda p: jnp.zeros(p.shape, p.dtype)  # noqa: E731
        self._state = tx.init(_proxy_tree(plan.treedef, recipe, zeros))
        # optax's update on the proxies, jitted: run op by op it dispatches every Newton–Schulz
        # primitive of every proxy matrix, about a second a step (and at construction)
        self._advance_fn = jax.jit(lambda state: _advance_scalars(tx, recipe, plan.treedef, state, *_nodes(state)))
        coeffs = _nodes(self._state)[0].ns_coeffs
        self.settings = self.peek()
        # the Muon matrices in stacks of one shape, each device's block holding its matrices
        # (balance): a device receives its own block only, and sends back its results
        self.groups: dict = {}
        for i in self.leaves:
            self.groups.setdefault(tuple(layout.shapes[i][-2:]), []).append(i)
        counts = {key: sum(math.prod(layout.shapes[i][:-2]) for i in idx) for key, idx in self.groups.items()}
        self.per_device = balance(counts, plan.n)
        self.caps = {key: -(-k // plan.n) for key, k in counts.items()}
        self._owned = NamedSharding(plan.mesh, P(plan.data_axis))
        owners, per_device = _owners(plan, split=True), self.per_device

        def directions(stacks, eps):
            return _newton_schulz(stacks, coeffs, eps, owners, per_device)

        self._directions = jax.jit(directions, out_shardings=self._owned)

    def _advance(self):
        return self._advance_fn(self._state)

    def peek(self) -> dict:
        """The settings the next applied step uses (learning rates, betas, eps, decays)."""
        return {k: _f32(v) for k, v in self._advance()[0].items()}

    def prepare(self, grads_flat: np.ndarray, m_flat: np.ndarray, count: int) -> None:
        """Before the store's pass of update ``count``: advance the settings, and orthogonalise
        the Muon leaves' Nesterov-mixed momentum (from the committed ``m_flat``) on the device."""
        s, self._state = self._advance()
        self.settings = s = {k: _f32(v) for k, v in s.items()}
        beta = s["beta"]
        g_views = jax.tree_util.tree_leaves(self.layout.views(grads_flat))
        m_views = jax.tree_util.tree_leaves(self.layout.views(m_flat))
        hats = {}
        for i in self.leaves:
            g = _widen(np.asarray(g_views[i]))
            m = (1 - beta) * g + beta * m_views[i]
            hats[i] = beta * _corrected(m, beta, count + 1) + (1 - beta) * _corrected(g, beta, count)
        stacks = {key: jax.device_put(_stack([hats[i].reshape((-1,) + key) for i in idx], self.per_device, key,
                                             self.caps[key], xp=np), self._owned)
                  for key, idx in self.groups.items()}
        done = self._directions(stacks, jnp.float32(s["eps"])) if stacks else {}
        d_views = jax.tree_util.tree_leaves(self.layout.views(self.direction))
        for key, idx in self.groups.items():
            real = _unstack(np.asarray(done[key]), self.per_device, key, self.caps[key], xp=np)
            start = 0
            for i in idx:
                shape = self.layout.shapes[i]
                count_i = math.prod(shape[:-2])
                u = real[start:start + count_i].reshape(shape)
                start += count_i
                d_views[i][...] = u * np.sqrt(np.maximum(np.float32(1), np.float32(shape[-1] / shape[-2])))

    def step(self, params: np.ndarray, grads: np.ndarray, m: np.ndarray, v: np.ndarray, count: int, *,
             lr=None, grad_scale: float = 1.0, out16=None, offset: int = 0) -> None:
        """Update ``count`` of the sub-group at ``offset``, in place (``lr`` is ignored: the
        settings carry both groups' learning rates)."""
        s = self.settings
        k = params.size
        muon = self.mask[offset:offset + k]
        g = _widen(np.asarray(grads))
        if grad_scale != 1.0:
            g = g * np.float32(grad_scale)
        # Muon: the momentum, and the direction from the owners
        beta = s["beta"]
        m_muon = (1 - beta) * g + beta * m
        p_muon = params - s["learning_rate"] * (self.direction[offset:offset + k] + s["weight_decay"] * params)
        # the AdamW group (Nesterov), as optax.contrib.muon builds it
        b1, b2 = s["adam_b1"], s["adam_b2"]
        mu = (1 - b1) * g + b1 * m
        nu = (1 - b2) * g * g + b2 * v
        mu_hat = b1 * _corrected(mu, b1, count + 1) + (1 - b1) * _corrected(g, b1, count)
        u = mu_hat / (np.sqrt(_corrected(nu, b2, count) + s["adam_eps_root"]) + s["eps"])
        p_adam = params - s["adam_learning_rate"] * (u + s["adam_weight_decay"] * params)
        params[...] = np.where(muon, p_muon, p_adam)
        m[...] = np.where(muon, m_muon, mu)
        v[...] = np.where(muon, v, nu)
        if out16 is not None:
            out16[...] = _to_bf16_bits(params) if out16.dtype == np.uint16 else params.astype(out16.dtype)

    def use(self, settings) -> None:  # the host loop's interface; Muon advances its own settings
        pass

    def close(self) -> None:
        pass
