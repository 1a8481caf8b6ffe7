"""Muon's owners: which device of the data axis orthogonalises which Muon matrices, and the
program that takes them there and back, for the update of :mod:`zerojax.stages._muon`.

:func:`balance` gives each shape's matrices to owners by their Newton–Schulz cost
(:func:`ns_flops`); :func:`orthogonalise` stacks the matrices of one shape in N blocks, one per
device (:func:`_stack`), runs optax's Newton–Schulz iterations on each block's real matrices
where their owner holds them (:func:`_owners`: an all-to-all there and one back at stages 1–3,
a local slice and one all-gather at stage 0; one ``lax.switch`` branch per distinct assignment,
:func:`_by_device`) and returns them unstacked (:func:`_unstack`), scaled by
``sqrt(max(1, fan_out / fan_in))``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._compat import shard_map

try:  # optax's own iteration, so the numbers are optax's
    from optax.contrib._muon import orthogonalize_via_newton_schulz
except ImportError:  # pragma: no cover - an optax without it: Muon runs through optax's update
    orthogonalize_via_newton_schulz = None

__all__ = ["balance", "ns_flops"]

_NS_STEPS = 5


def ns_flops(m: int, n: int, steps: int = _NS_STEPS) -> int:
    """The FLOPs of the Newton–Schulz iterations on one ``[m, n]`` matrix (the matmuls; the
    iteration works on the smaller Gram matrix, so ``m`` and ``n`` may come in either order)."""
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m ** 3)


def balance(counts: dict, n: int) -> tuple:
    """Which owner orthogonalises how many matrices of each shape: ``counts`` ``{(m, n): k}``
    -> one ``{(m, n): k_d}`` per device.

    Each shape's stack is cut into N equal blocks of ``ceil(k / N)`` slots (the all-to-all's
    unit); a device runs the iterations only on the real matrices of its blocks, so a device may
    hold fewer than its slots. Matrices go, the costliest shapes first, to the least loaded
    device with a free slot of their shape: a shape with fewer matrices than devices lands on
    the devices other shapes leave lightest, and no device does more than it would with every
    block full (``sum ceil(k / N) * flops``)."""
    load = [0] * n
    out = [dict.fromkeys(counts, 0) for _ in range(n)]
    for key in sorted(counts, key=lambda k: (-ns_flops(*k), k)):
        cap, cost = -(-counts[key] // n), ns_flops(*key)
        for _ in range(counts[key]):
            d = min((d for d in range(n) if out[d][key] < cap), key=lambda d: (load[d], d))
            out[d][key] += 1
            load[d] += cost
    return tuple(out)


def _patterns(per_device: tuple):
    """(distinct per-device assignments, each device's index among them)."""
    distinct, index = [], []
    for a in per_device:
        key = tuple(sorted(a.items()))
        if key not in distinct:
            distinct.append(key)
        index.append(distinct.index(key))
    return [dict(k) for k in distinct], index


def _newton_schulz(stacks, ns_coeffs, eps, owners, per_device=None):
    """{(m, n): [k, m, n]} -> the orthogonalised stacks; ``owners(run, stacks, per_device)``
    runs ``run`` on the stacks where their matrices' owners hold them (:func:`_owners`), or
    ``run(stacks)`` off the mesh. ``run(blocks, real)`` orthogonalises the first ``real[key]``
    matrices of each block and leaves the rest (padding) zero."""
    dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    ns = lambda x: orthogonalize_via_newton_schulz(x, ns_coeffs, _NS_STEPS, "frobenius", eps, dims)  # noqa: E731

    def run(blocks, real=None):
        out = {}
        for key, x in blocks.items():
            k = x.shape[0] if real is None else real[key]
            if k == x.shape[0]:
                out[key] = ns(x)
            elif k == 0:
                out[key] = jnp.zeros_like(x)
            else:
                out[key] = jnp.concatenate([ns(x[:k]), jnp.zeros_like(x[k:])], axis=0)
        return out
    return owners(run, stacks, per_device)


# at most this many branches in the owners' program; past it every owner iterates on every slot
# of its blocks (the empty ones are zero matrices, which the iterations keep zero)
_MAX_BRANCHES = 32


def _by_device(run, per_device, axis):
    """Inside a shard_map over ``axis``: each device runs ``run`` with its own assignment (one
    branch per distinct assignment, chosen by the device's index: the program holds the
    costliest branch's FLOPs, not the sum)."""
    distinct, index = _patterns(per_device)
    if len(distinct) == 1:
        return lambda blocks: run(blocks, distinct[0])
    if len(distinct) > _MAX_BRANCHES:  # a program that grows with N would cost more to compile than it saves
        return lambda blocks: run(blocks)
    table = jnp.asarray(index, jnp.int32)
    branches = [functools.partial(run, real=a) for a in distinct]
    return lambda blocks: jax.lax.switch(table[jax.lax.axis_index(axis)], branches, blocks)


def _owners(plan, split: Optional[bool] = None):
    """How the stacks (each a multiple of N matrices) reach their owners, a block of each per
    device, and which of its matrices each owner orthogonalises (:func:`balance`).

    Stages 1–3 (the stacks built from partitions): a sharding constraint splitting each by
    matrix, which XLA makes one all-to-all there and one back per stack. Stage 0 (every device
    holds every matrix): each device takes its blocks (a local slice), orthogonalises them, and
    one all-gather per stack gives every device the whole result, instead of every device
    running the iterations on every matrix."""
    axis = plan.data_axis
    owned = NamedSharding(plan.mesh, P(axis))
    whole = NamedSharding(plan.mesh, P())

    def on_owners(run, stacks, per_device):
        body = _by_device(run, per_device, axis)
        specs = {k: P(axis) for k in stacks}
        if (plan.stage >= 1) if split is None else split:
            stacks = {k: jax.lax.with_sharding_constraint(x, owned) for k, x in stacks.items()}
            out = shard_map(body, plan.mesh, in_specs=(specs,), out_specs=specs, manual_axes=(axis,))(stacks)
            return {k: jax.lax.with_sharding_constraint(x, owned) for k, x in out.items()}
        gather = lambda blocks: {k: jax.lax.all_gather(x, axis, axis=0, tiled=True)  # noqa: E731
                                 for k, x in body(blocks).items()}
        # replicated on the way in: the split must not travel back into the momentum's layout
        stacks = {k: jax.lax.with_sharding_constraint(x, whole) for k, x in stacks.items()}
        return shard_map(gather, plan.mesh, in_specs=(specs,), out_specs={k: P() for k in stacks},
                         manual_axes=(axis,))(stacks)
    return on_owners


def _stack(parts, per_device, key, cap, xp=jnp):
    """Real matrices ``parts`` (``[k_i, m, n]`` each) -> the stack of N blocks of ``cap``
    slots, device d's block opening with its ``per_device[d][key]`` matrices (in order),
    zero matrices after (``xp``: jax.numpy, or numpy on the host)."""
    real = xp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    pieces, start = [], 0
    for a in per_device:
        k = a[key]
        if k:
            pieces.append(real[start:start + k])
            start += k
        if cap - k:
            pieces.append(xp.zeros((cap - k,) + key, real.dtype))
    return xp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]


def _unstack(x, per_device, key, cap, xp=jnp):
    """The inverse of :func:`_stack`: the real matrices, in order."""
    pieces = [x[d * cap:d * cap + a[key]] for d, a in enumerate(per_device) if a[key]]
    return xp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]


def orthogonalise(hats: dict, ns_coeffs, eps, owners, n: int) -> dict:
    """{leaf index: Nesterov-mixed momentum (a matrix or a stack of them)} -> the same
    orthogonalised (Newton–Schulz on stacks of same-shape matrices, each whole on its owner:
    ``owners``, :func:`_owners`) and scaled by ``sqrt(max(1, fan_out / fan_in))``."""
    if not hats:
        return {}
    owners = owners or (lambda run, stacks, per_device: run(stacks))
    groups: dict = {}
    for i, h in hats.items():
        groups.setdefault(tuple(h.shape[-2:]), []).append(i)
    counts = {key: sum(math.prod(hats[i].shape[:-2]) for i in idx) for key, idx in groups.items()}
    per_device = balance(counts, n)
    caps = {key: -(-k // n) for key, k in counts.items()}
    stacks = {key: _stack([hats[i].reshape((-1,) + key) for i in idx], per_device, key, caps[key])
              for key, idx in groups.items()}
    done = _newton_schulz(stacks, ns_coeffs, eps, owners, per_device)
    out = {}
    for key, idx in groups.items():
        real = _unstack(done[key], per_device, key, caps[key])
        start = 0
        for i in idx:
            h = hats[i]
            count = math.prod(h.shape[:-2])
            u = real[start:start + count].reshape(h.shape)
            start += count
            fan_in, fan_out = h.shape[-2], h.shape[-1]
            out[i] = u * jnp.sqrt(jnp.maximum(1, fan_out / fan_in))
    return out
