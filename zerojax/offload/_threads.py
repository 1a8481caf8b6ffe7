"""The thread split of ``HostAdamW``'s compiled step: how many blocks the numpy threads take
while XLA updates the others on one core, adapted from step to step."""
from __future__ import annotations

__all__ = ["ThreadSplit"]


class ThreadSplit:
    """How much of a compiled step the numpy path takes, adapted from step to step.

    XLA runs the compiled kernel on one core. ``helpers`` more threads can meanwhile
    update the last blocks on the numpy path: that pays when cores are free and costs
    when they are not, since the numpy path needs about twice the CPU time per element.
    Each split step moves ``fraction`` toward equal finishing times. The throughput of
    split and of XLA-only steps is tracked; splitting is used when it is ``MARGIN``
    faster (it spends more CPU time), and the other choice is retried every ``EXPLORE``
    steps, so a change of load on the machine is noticed.
    """

    EXPLORE = 16
    MARGIN = 1.05

    def __init__(self, helpers: int):
        self.helpers = helpers
        self.fraction = helpers / (helpers + 2.0)  # XLA's core ~ two numpy threads
        self.rate = {False: None, True: None}  # elements/s: XLA-only, split
        self.steps = 0

    def share(self) -> float:
        """Fraction of the whole blocks the numpy path takes in this step."""
        if not self.helpers:
            return 0.0
        self.steps += 1
        solo, split = self.rate[False], self.rate[True]
        if solo is None or split is None:
            use = solo is not None
        else:
            use = (split > self.MARGIN * solo) != (self.steps % self.EXPLORE == 0)
        return self.fraction if use else 0.0

    def record(self, share: float, seconds: float, numpy_seconds: float, xla_last: bool,
               xla_elements: int, numpy_elements: int) -> None:
        split = share > 0
        rate = (xla_elements + numpy_elements) / seconds
        old = self.rate[split]
        self.rate[split] = rate if old is None else 0.5 * (old + rate)
        if not split:
            return
        if xla_last:  # both rates are known: aim at equal finishing times
            numpy_rate = numpy_elements / max(numpy_seconds, 1e-9)
            xla_rate = xla_elements / seconds
            target = numpy_rate / (numpy_rate + xla_rate)
        else:  # XLA waited for the numpy path
            target = 0.8 * share
        self.fraction = min(0.9, max(0.02, 0.5 * (share + target)))
