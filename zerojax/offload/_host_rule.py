"""The recognised optimizer's update over flat host buffers: what the host paths (the NVMe
store, ZenFlow's host side, the in-memory host loop) run.

``HostOptimizer(opt, settings)`` has ``HostAdamW``'s interface (``step(params, grads, m, v,
count, lr=, grad_scale=, out16=)``, in place): Adam/AdamW (``eps_root`` 0) runs in
:class:`~zerojax.offload._host_adam.HostAdamW` (the native one-pass kernel where it is built);
SGD (momentum, Nesterov), Lion and Adam with ``eps_root`` run the element-wise rule of
:mod:`zerojax.update._recognize` in numpy. ``m`` and ``v`` hold the optimizer's per-element
state in order (``trace`` / Lion's ``mu`` in ``m``); what an optimizer does not keep is left
untouched.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from zerojax.offload._host_adam import HostAdamW
from zerojax.update._recognize import Optimizer, rule

__all__ = ["HostOptimizer"]


def _widen(g: np.ndarray) -> np.ndarray:
    if g.dtype == np.uint16:  # bfloat16 bits
        return np.left_shift(g.astype(np.uint32), 16).view(np.float32)
    return g.astype(np.float32, copy=False)


class HostOptimizer:
    """One recognised optimizer's in-place update on flat fp32 host buffers."""

    def __init__(self, opt: Optimizer, settings: dict, *, num_threads: int | None = None):
        self.opt = opt
        self.settings = dict(settings)
        self._adam = None
        if opt.kind == "adam" and not float(settings.get("eps_root", 0.0)):
            self._adam = HostAdamW(lr=float(settings["learning_rate"]), b1=float(settings["b1"]),
                                   b2=float(settings["b2"]), eps=float(settings["eps"]),
                                   weight_decay=float(settings["weight_decay"]), num_threads=num_threads)

    def use(self, settings: dict) -> None:
        """The settings of the next steps (injected hyperparameters change between steps)."""
        self.settings = dict(settings)
        if self._adam is not None:
            a = self._adam
            a.lr, a.b1, a.b2, a.eps = (float(settings[k]) for k in ("learning_rate", "b1", "b2", "eps"))
            a.weight_decay = float(settings["weight_decay"])

    def step(self, params: np.ndarray, grads: np.ndarray, m: np.ndarray, v: np.ndarray, count: int, *,
             lr: float | None = None, grad_scale: float = 1.0, out16: np.ndarray | None = None) -> None:
        """One update of ``params`` (and ``m``, ``v``) in place; see ``HostAdamW.step``."""
        if self._adam is not None:
            self._adam.step(params, grads, m, v, count, lr=lr, grad_scale=grad_scale, out16=out16)
            return
        hp = dict(self.settings)
        if lr is not None:
            hp["learning_rate"] = np.float32(lr)
        g = _widen(np.asarray(grads))
        if grad_scale != 1.0:
            g = g * np.float32(grad_scale)
        slots = (m, v)[:len(self.opt.slots)]
        new_p, new_slots = rule(self.opt, hp, int(count), params, g, slots, xp=np)
        params[...] = new_p
        for buf, new in zip(slots, new_slots):
            buf[...] = new
        if out16 is not None:
            if out16.dtype == np.uint16:
                out16[...] = _to_bf16_bits(new_p)
            else:
                out16[...] = new_p.astype(out16.dtype)

    def close(self) -> None:
        if self._adam is not None:
            self._adam.close()


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bfloat16 (nearest even), as bits."""
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)
