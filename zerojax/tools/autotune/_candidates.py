"""The candidates: ZeRO stages x offload choices x micro-batches, each as a :class:`Row`."""
from __future__ import annotations

from typing import List, Tuple

from zerojax.config import ZeroConfig
from zerojax._errors import ConfigError
from zerojax.tools.autotune._table import Row

__all__ = ["OFFLOADS", "candidate_rows", "check_choices"]

# offload choice -> (offload_optimizer, offload_param), in the order the search visits them
OFFLOADS = {"none": (None, None), "optimizer": ("cpu", None), "optimizer+param": ("cpu", "cpu")}


def candidate_rows(base: ZeroConfig, devices: int, stages, offloads, micro_batches, train_batch_size) -> List[Row]:
    rows = []
    for offload in OFFLOADS:
        if offload not in offloads:
            continue
        for stage in stages:
            if (offload != "none" and stage == 0) or (offload == "optimizer+param" and stage != 3):
                continue
            opt, par = OFFLOADS[offload]
            for mb in micro_batches:
                gas, reason = base.gradient_accumulation_steps, ""
                if train_batch_size is not None:
                    gas, rem = divmod(train_batch_size, devices * mb)
                    if rem or gas < 1:
                        gas, reason = 1, (f"train_batch_size {train_batch_size} is not a multiple of {devices} "
                                          f"devices x micro-batch {mb}")
                cfg = base.replace(stage=stage, offload_optimizer=opt, offload_param=par,
                                   gradient_accumulation_steps=gas, train_micro_batch_size_per_gpu=mb,
                                   train_batch_size=devices * gas * mb)
                row = Row(stage, offload, mb, gas, devices, cfg, reason=reason)
                if reason:
                    row.fits = False
                rows.append(row)
    return rows


def check_choices(stages, offloads, micro_batches) -> Tuple[tuple, tuple, tuple]:
    stages = tuple(sorted(set(int(s) for s in stages)))
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(f"stages={stages!r} must be a non-empty selection of 0, 1, 2, 3")
    offloads = tuple(offloads)
    unknown = [o for o in offloads if o not in OFFLOADS]
    if not offloads or unknown:
        raise ConfigError(f"offloads={offloads!r}: each must be one of {list(OFFLOADS)}")
    mbs = tuple(sorted(set(int(m) for m in micro_batches)))
    if not mbs or mbs[0] < 1:
        raise ConfigError(f"micro_batches={micro_batches!r} must be positive integers")
    return stages, offloads, mbs


