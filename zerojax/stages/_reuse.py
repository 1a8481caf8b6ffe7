"""DeepSpeed's stage-3 reuse rule (``stage3_max_reuse_distance``, ``stage3_max_live_parameters``):
which gathered params a stage-3 step keeps, between uses in the forward pass and from the
forward to the backward pass. :class:`Fetches` is the running count the stage-3 replay
(:mod:`zerojax.stages._stage3`) keeps; :func:`kept_leaves` applies the same rule to a plan's
leaves taken in order, for the figures that do not compile the step (the comm theory, hpZ's
secondary partition)."""
from __future__ import annotations

import dataclasses
import math
import sys

from zerojax._plan import ZeroPlan

__all__ = ["Fetches", "Slicing", "kept_leaves"]


class Fetches:
    """The forward replay's running count of param elements used (DeepSpeed's fetch trace),
    against which ``max_reuse_distance`` is measured, and the gathered params kept for the
    backward pass (at most ``max_live`` elements)."""

    __slots__ = ("count", "limit", "max_live", "kept", "repeat")

    def __init__(self, limit: float, max_live: float = math.inf):
        self.count, self.limit, self.max_live = 0, limit, max_live
        self.kept = 0  # elements of gathered params held from their forward to their backward use
        self.repeat = 1  # iterations of the loop whose body is being replayed

    def used(self, bases) -> None:
        """Record one use site's params: each one's distance is counted from here."""
        for b in bases:
            self.count += b.lay.size
        for b in bases:
            b.last_use = self.count

    def keep_for_backward(self, at: int, sizes) -> list:
        """Whether each param (of ``sizes`` elements) of the use site after which ``count`` was
        ``at`` keeps its gathered copy for the backward pass. Decided when the backward pass is
        traced, so ``count`` is the whole forward pass's.

        DeepSpeed keeps a param when it is used again within ``max_reuse_distance`` elements
        of params, counted over the fetch trace of the whole step, forward then backward. The
        backward use of a param used at a site follows the rest of the forward pass and the
        backward pass of that rest: twice the elements the forward pass used after the site.
        In a loop the first iteration decides (its distance is the longest) and every
        iteration is kept alike. The kept elements are capped at ``max_live``
        (``max_live_parameters``), nearest uses first (the backward pass decides in reverse)."""
        distance = 2 * max(self.count - at, 0)
        out = []
        for size in sizes:
            keep = distance < self.limit and self.kept + size <= self.max_live
            if keep:
                self.kept += size
            out.append(keep)
        return out


# Slicing a param into k gathers holds 1/k of it at a time but costs k - 1 more collectives
# each way, in a loop. Against the prefetch bucket a param is sliced only when it spans more
# than this many buckets, and then in this many slices: the vocabulary tables, not a block's
# matrices (with DeepSpeed's "auto" bucket, 0.9 * hidden^2, those span 1-5 buckets; slicing
# them took stage 3 from 0.99x to 1.19x GSPMD FSDP's step time on a GPT of vocab 8192 x d 256),
# and 8 slices hold 1/8 of a table where one slice per bucket (437 for a 50257 x 128 table)
# would save little more memory for 55 times the collectives.
SLICE_SPAN = 8


@dataclasses.dataclass(frozen=True)
class Slicing:
    """Which params a stage-3 matmul gathers slice by slice, and how many elements at once.

    A param is sliced when it is larger than ``max_live_parameters`` (``live``: the bound on
    gathered elements resident at once, kept strictly) or than :data:`SLICE_SPAN` prefetch
    buckets (``bucket``); each slice gathers a bucket or 1/:data:`SLICE_SPAN` of the param,
    whichever is larger, and never more than ``live`` elements. A bound of 0 is DeepSpeed's
    "off" (no prefetch; nothing live beyond the param in use), not a fetch unit of no elements:
    it slices nothing, and the param in use is gathered whole, as DeepSpeed gathers it."""

    bucket: int
    live: int

    @classmethod
    def of(cls, config) -> "Slicing":
        def bound(b):
            return int(b) if int(b) > 0 else sys.maxsize

        return cls(bound(config.prefetch_bucket_size), bound(config.max_live_parameters))

    def sliced(self, size: int) -> bool:
        return size > self.live or size > SLICE_SPAN * self.bucket

    def unit(self, size: int) -> int:
        """The most elements of a sliced param of ``size`` elements gathered at once."""
        return min(self.live, max(self.bucket, -(-size // SLICE_SPAN)))


def kept_leaves(plan: ZeroPlan) -> list:
    """For each of ``plan.leaves``, whether a stage-3 step keeps the param gathered from its forward
    to its backward use, by :meth:`Fetches.keep_for_backward` with the partitioned params used
    once each in the plan's order. A param a matmul gathers in slices (:class:`Slicing`)
    counts as not kept: it is never whole. Unpartitioned leaves are never gathered (False)."""
    cfg = plan.config
    sizes = [lay.size if lay.params_partitioned else 0 for lay in plan.leaves]
    slicing = Slicing.of(cfg)
    fetches = Fetches(int(cfg.max_reuse_distance), int(cfg.max_live_parameters))
    fetches.count = at = sum(sizes)
    kept = [False] * len(sizes)
    for i in reversed(range(len(sizes))):  # the backward pass decides, last use first
        if sizes[i] and not slicing.sliced(sizes[i]):
            kept[i] = fetches.keep_for_backward(at, [sizes[i]])[0]
        at -= sizes[i]
    return kept
