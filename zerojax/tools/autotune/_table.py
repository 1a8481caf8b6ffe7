"""The result table: one :class:`Row` per candidate and the :class:`AutotuneResult` that ranks them."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from zerojax.config import ZeroConfig
from zerojax._errors import ConfigError
from zerojax.tools.autotune._cost import CostModel
from zerojax.tools.autotune._ds_json import deepspeed_dict
from zerojax.tools.autotune._units import size_text
from zerojax.tools._planning import StepPlan

__all__ = ["AutotuneResult", "Row"]


@dataclasses.dataclass
class Row:
    """One candidate: a stage, an offload choice and a micro-batch per device."""

    stage: int
    offload: str  # "none" | "optimizer" | "optimizer+param"
    micro_batch: int
    gradient_accumulation_steps: int
    devices: int
    config: ZeroConfig  # the candidate's full config, batch keys included
    peak_bytes: Optional[int] = None  # compiled peak per device, device memory (None: not compiled)
    host_bytes: Optional[int] = None  # offloaded state per device in host memory (None: not compiled)
    fits: Optional[bool] = None  # None: not settled (a configuration earlier in the order fits)
    est_seconds: Optional[float] = None  # per optimizer step, CostModel
    measured_seconds: Optional[float] = None  # per optimizer step, median of the timed steps
    reason: str = ""
    plan: Optional[StepPlan] = dataclasses.field(default=None, repr=False)

    @property
    def samples_per_step(self) -> int:
        return self.devices * self.gradient_accumulation_steps * self.micro_batch

    @property
    def seconds(self) -> Optional[float]:
        """The ranking's time per step: measured when timed, else estimated."""
        return self.measured_seconds if self.measured_seconds is not None else self.est_seconds

    @property
    def samples_per_second(self) -> Optional[float]:
        return None if not self.seconds else self.samples_per_step / self.seconds

    @property
    def compiled(self) -> bool:
        return self.plan is not None


@dataclasses.dataclass
class AutotuneResult:
    """The recommendation (``best``), every candidate considered (``table``) and how they were ranked."""

    best: Optional[Row]  # None only on AutotuneError.result
    table: List[Row]
    budget: int
    host_budget: Optional[int]
    devices: int
    n_params: int
    ranked_by: str  # "measured time" | "the cost model"
    cost_model: CostModel
    seconds: float  # wall time of the search
    compilations: int

    def deepspeed_config(self, row: Optional[Row] = None) -> dict:
        """``row`` (default: the best) as a DeepSpeed JSON config, readable by ``ZeroConfig.from_deepspeed``."""
        row = row or self.best
        if row is None:
            raise ConfigError("no candidate fits the budget, so there is no configuration to write")
        return deepspeed_dict(row.config)

    def __str__(self) -> str:
        b = self.best
        precision = (b or self.table[0]).config.precision
        host = "" if self.host_budget is None else f" and {size_text(self.host_budget)} host"
        n = self.compilations
        lines = [
            f"autotune: {self.n_params / 1e6:,.2f}M params on {self.devices} devices, budget {size_text(self.budget)} "
            f"per device{host}, {precision}; ranked by {self.ranked_by}; {n} compilation{'s' * (n != 1)} in "
            f"{self.seconds:.1f}s",
            f"{'':2}{'stage':>5}  {'offload':<15}{'micro':>6}{'GAS':>5}{'peak/device':>13}{'host/device':>13}"
            f"{'fits':>6}{'est s/step':>12}{'measured':>10}{'samples/s':>12}  note",
        ]

        def num(x, fmt):
            return "-" if x is None else format(x, fmt)

        for r in self.table:
            mark = "*" if r is b else " "
            fits = {True: "yes", False: "no", None: "?"}[r.fits]
            lines.append(f"{mark} {r.stage:>5}  {r.offload:<15}{r.micro_batch:>6}{r.gradient_accumulation_steps:>5}"
                         f"{size_text(r.peak_bytes):>13}{size_text(r.host_bytes):>13}{fits:>6}"
                         f"{num(r.est_seconds, '.4g'):>12}{num(r.measured_seconds, '.4g'):>10}"
                         f"{num(r.samples_per_second, ',.1f'):>12}  {r.reason}")
        if b is None:
            lines.append("best: nothing fits")
        else:
            lines.append(f"best: stage {b.stage}, offload {b.offload}, micro-batch {b.micro_batch} x GAS "
                         f"{b.gradient_accumulation_steps} x {self.devices} devices, peak {size_text(b.peak_bytes)} "
                         "per device")
        return "\n".join(lines)


