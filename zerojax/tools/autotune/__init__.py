"""autotune: the fastest ZeRO configuration that fits a device memory budget.

    result = zj.autotune(init_fn, loss_fn, lambda mb: {"tokens": jax.ShapeDtypeStruct((mb, 1025), jnp.int32)},
                         devices=64, budget="80GiB", config=zj.ZeroConfig(precision="bf16"))
    print(result)                      # every candidate: stage, offload, micro-batch, peak, fits, time
    result.best.config                 # the recommendation as a ZeroConfig
    result.deepspeed_config()          # ... and as a DeepSpeed JSON dict

    python -m zerojax.tools.autotune --model gpt2-small --devices 64 --budget 80GiB

The candidates are ZeRO stages x offload choices (none, the optimizer to the CPU, optimizer and
params to the CPU for stage 3) x micro-batch sizes. Whether a candidate fits is never guessed:
``zj.plan_step`` compiles its step for N devices and the compiled peak per device is compared
with the budget. The fitting candidates are ranked by throughput (samples per second), measured
by a few real steps each with ``timed=True`` when this process has the N devices, and otherwise
estimated by :class:`CostModel`.

How the search spends compilations (each one is the real step, seconds to minutes for a large
model), as DeepSpeed's autotuner does, which stops exploring a stage once a lower one fits:

* configurations are visited in the cost model's order: no offload, then optimizer offload, then
  optimizer + param offload, and stages 0, 1, 2, 3 within each. At an equal micro-batch an
  earlier configuration never moves more data (the same compute, no more collective volume, no
  more host traffic), so a configuration is compiled only at micro-batches larger than the
  largest one an earlier configuration fits;
* within a configuration, the largest fitting micro-batch is found by bisection: the peak
  grows with the micro-batch, so the candidates below a fitting one fit and those above a
  failing one do not. The table says which rows were settled this way, without compiling.

``exhaustive=True`` compiles every candidate. ``timed=True`` compiles each configuration's
micro-batches in increasing order until one exceeds the budget and times every fitting one.

Where the step is compiled for the CPU (simulated devices, always the case when this process
has fewer than N devices) every memory kind shares one address space, so the compiled peak
includes the state that offloading keeps in host memory; that host-resident state (``zj.estimate``
of the candidate) is subtracted to give the device peak. Accelerator compilers account host
memory separately, and their peak is taken as is.
"""
from zerojax._errors import AutotuneError as AutotuneError
from zerojax.tools.autotune._candidates import OFFLOADS as OFFLOADS
from zerojax.tools.autotune._cli import main as main
from zerojax.tools.autotune._cost import CostModel as CostModel
from zerojax.tools.autotune._ds_json import deepspeed_dict as deepspeed_dict
from zerojax.tools.autotune._search import autotune as autotune
from zerojax.tools.autotune._table import AutotuneResult as AutotuneResult
from zerojax.tools.autotune._table import Row as Row
from zerojax.tools.autotune._units import parse_bytes as parse_bytes

__all__ = ["AutotuneError", "AutotuneResult", "CostModel", "Row", "autotune", "parse_bytes"]
