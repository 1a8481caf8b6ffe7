"""ZenFlow written out in numpy (float32, as it computes): the trajectory a ZenFlowStep run must reproduce.

The algorithm of REFERENCE.md section 8, with the semantics zerojax documents for it
(zerojax/offload/_zenflow.py):

* every 2-D weight ``W[in, out]`` with more than one row is scored per input feature (row)
  by the L1 norm of its gradient; the ``ceil(topk_ratio * rows)`` rows with the largest
  scores are important (ties: the lower row). Every other leaf is a "vector" leaf;
* each step the device runs AdamW on the important rows, with moments that exist only for
  them and restart at every selection, and AdamW on the vector leaves (moments never
  restart); the learning rate is the schedule's value at the number of applied steps;
* the gradient of every 2-D weight is accumulated; once ``update_interval`` steps are
  accumulated the host runs AdamW on its fp32 master with the mean of the accumulated
  gradients (its own moments and step count, never reset) at the learning rate of the last
  accumulated step. Its result replaces the device's weights except the important rows,
  which keep the device's values. Without overlap the result lands at once; with overlap
  it lands when the next host update is launched (or at a reselection, or at ``finish``),
  while the next steps accumulate into a second buffer;
* a selection is due at the first step after warm-up and then every ``select_interval``
  steps (strategy "step"): any pending result is applied and the accumulated gradients are
  applied by a host update at once, then the host master is re-synced from the device's
  weights, and the selection (from this step's gradient) and the device moments restart;
* ``full_warm_up_rounds`` steps come first: no device update of the 2-D weights, a host
  update of one step's gradient every step, whose result replaces the whole weight;
* clipping: DeepSpeed's coefficient on the global norm of the whole gradient.

Staleness is measured row by row: a row reflects every gradient through step t when it was
updated from them (the device's rows every step, the others by the host result that covered
step t); a step's staleness is the step count minus the oldest row's.
"""
from __future__ import annotations

import math

import jax
import numpy as np


F32 = np.float32


class AdamW:
    """optax.adamw's update (eps_root 0, decoupled weight decay) in float32, the precision both
    of ZenFlow's AdamWs compute in, operation by operation as optax writes it."""

    def __init__(self, shape, b1, b2, eps, weight_decay):
        self.m, self.v = np.zeros(shape, F32), np.zeros(shape, F32)
        self.count = 0
        self.b1, self.b2, self.eps, self.wd = F32(b1), F32(b2), F32(eps), F32(weight_decay)

    def step(self, p, g, lr):
        one = F32(1)
        self.count += 1
        self.m = (one - self.b1) * g + self.b1 * self.m
        self.v = (one - self.b2) * (g * g) + self.b2 * self.v
        m_hat = self.m / (one - self.b1**self.count)
        v_hat = self.v / (one - self.b2**self.count)
        update = m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * p
        return p + F32(-lr) * update


class SGD:
    """optax.sgd's update (momentum 0: plain; Nesterov or not) in float32, as optax writes it."""

    def __init__(self, shape, momentum=0.0, nesterov=False):
        self.t = np.zeros(shape, F32)
        self.mom, self.nesterov = momentum, nesterov

    def step(self, p, g, lr):
        if not self.mom:
            return p + F32(-lr) * g
        self.t = g + self.mom * self.t
        u = g + self.mom * self.t if self.nesterov else self.t
        return p + F32(-lr) * u


class Lion:
    """optax.lion's update in float32, as optax writes it."""

    def __init__(self, shape, b1=0.9, b2=0.99, weight_decay=0.0):
        self.m = np.zeros(shape, F32)
        self.b1, self.b2, self.wd = b1, b2, weight_decay

    def step(self, p, g, lr):
        u = np.sign((1 - self.b1) * g + self.b1 * self.m)
        self.m = (1 - self.b2) * g + self.b2 * self.m
        if self.wd:
            u = u + self.wd * p
        return p + F32(-lr) * u


class ZenFlowReference:
    """``params = ref.step(batch)``; ``ref.finish()``; ``ref.staleness`` per step.

    ``grad_fn(params, batch)``: the fp32 gradient of the mean loss (a pytree like params).
    ``lr_fn(count)``: the learning rate of the step taken after ``count`` applied steps.
    """

    def __init__(self, params, grad_fn, lr_fn, *, topk_ratio, update_interval, overlap, select_interval,
                 full_warm_up_rounds=0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, clip=0.0, make=None):
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.p = [np.array(x, F32) for x in leaves]
        self.grad_fn, self.lr_fn = grad_fn, lr_fn
        self.interval, self.overlap, self.select_interval = update_interval, overlap, select_interval
        self.warm_up, self.clip = full_warm_up_rounds, clip
        adam = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
        # the optimizer of every update, host and device: AdamW unless ``make(shape)`` says otherwise
        self.make = make or (lambda shape: AdamW(shape, **adam))
        self.mat = [i for i, x in enumerate(self.p) if x.ndim == 2 and x.shape[0] > 1]
        self.vec = [i for i in range(len(self.p)) if i not in self.mat]
        self.k = {i: max(1, math.ceil(topk_ratio * self.p[i].shape[0])) for i in self.mat}
        self.master = {i: self.p[i].copy() for i in self.mat}
        self.host = {i: self.make(self.p[i].shape) for i in self.mat}
        self.vec_adam = {i: self.make(self.p[i].shape) for i in self.vec}
        self.sel_adam: dict = {}
        self.idx: dict = {}
        self.acc = [{i: np.zeros(self.p[i].shape, F32) for i in self.mat} for _ in range(2)]
        self.acc_steps = [0, 0]
        self.cur = 0
        self.pending = None
        self.steps = self.selections = self.since_select = self.host_updates = 0
        self.lr_last = None
        # per row of each 2-D weight: the last step whose gradient it reflects
        self.through = {i: np.zeros(self.p[i].shape[0], np.int64) for i in self.mat}
        self.staleness: list = []
        self.norms: list = []

    # ---------------------------------------------------------------- host side
    def _apply(self, result, through):
        for i in self.mat:
            new = result[i].copy()
            rows = np.zeros(new.shape[0], bool)
            if self.selections > 0:  # the important rows keep the device's values
                rows[self.idx[i]] = True
                new[rows] = self.p[i][rows]
            self.p[i] = new
            self.through[i][~rows] = through
        self.host_updates += 1

    def _launch(self, sync):
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None
        a = self.cur
        if self.acc_steps[a] == 0:
            return
        n = self.acc_steps[a]
        for i in self.mat:
            self.master[i] = self.host[i].step(self.master[i], self.acc[a][i] / F32(n), self.lr_last)
            self.acc[a][i] = np.zeros_like(self.acc[a][i])
        self.acc_steps[a] = 0
        result = ({i: self.master[i].copy() for i in self.mat}, self.steps)
        if sync:
            self._apply(*result)
        else:
            self.pending = result
            self.cur = 1 - self.cur

    # ---------------------------------------------------------------- the step
    def step(self, batch):
        warm = self.steps < self.warm_up
        reselect = not warm and (self.selections == 0 or self.since_select >= self.select_interval)
        if reselect:
            self._launch(sync=True)
            self.cur = 0
            self.master = {i: self.p[i].copy() for i in self.mat}
            for i in self.mat:
                self.through[i][:] = self.steps
            self.selections += 1
            self.since_select = 0
        lr = float(self.lr_fn(self.steps))
        g = [np.asarray(x, F32) for x in jax.tree_util.tree_leaves(self.grad_fn(self.params(), batch))]
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g))
        self.norms.append(norm)
        coef = F32(max(1.0, (norm + 1e-6) / self.clip) if self.clip else 1.0)
        g = [x / coef for x in g]
        if reselect:
            for i in self.mat:
                scores = np.abs(g[i]).sum(axis=1)
                order = np.argsort(-scores, kind="stable")
                k = self.k[i]
                if k < len(scores):  # a selection that rounding could flip makes the comparison moot
                    gap = scores[order[k - 1]] - scores[order[k]]
                    assert gap > 1e-4 * max(scores[order[k - 1]], 1e-30), f"leaf {i}: near-tie at the top-{k} cut"
                self.idx[i] = np.sort(order[:k])
                self.sel_adam[i] = self.make((k,) + self.p[i].shape[1:])
        if not warm:
            for i in self.mat:
                ix = self.idx[i]
                self.p[i][ix] = self.sel_adam[i].step(self.p[i][ix], g[i][ix], lr)
        for i in self.vec:
            self.p[i] = self.vec_adam[i].step(self.p[i], g[i], lr)
        self.lr_last = lr
        self.steps += 1
        self.since_select += 1
        for i in self.mat:
            self.acc[self.cur][i] += g[i]
            if not warm:
                self.through[i][self.idx[i]] = self.steps
        self.acc_steps[self.cur] += 1
        if warm:
            self._launch(sync=True)
        elif self.acc_steps[self.cur] >= self.interval:
            self._launch(sync=not self.overlap)
        oldest = min(int(t.min()) for t in self.through.values()) if self.mat else self.steps
        self.staleness.append(self.steps - oldest)
        return self.params()

    def finish(self):
        self._launch(sync=True)
        return self.params()

    def params(self):
        return self.treedef.unflatten([x.copy() for x in self.p])
