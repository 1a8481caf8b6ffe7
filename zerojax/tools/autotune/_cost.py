"""The cost model: estimated seconds of one optimizer step, from matmul flops, the compiled
step's collective volume and the offloaded bytes."""
from __future__ import annotations

import dataclasses
import math

import jax

from zerojax.stages._gradients import loss_arity
from zerojax.tools._planning import resolve

__all__ = ["CostModel", "matmul_flops", "step_flops"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Estimated seconds of one optimizer step, for ranking candidates that are not run.

    step = compute + collectives + offload traffic, none of them overlapped:

    * compute = GAS x (flops of one micro-batch / ``device_flops`` + ``micro_batch_latency``):
      the flops are the matrix-multiply flops of ``value_and_grad(loss_fn)`` on one device's
      micro-batch, counted from its jaxpr (a ``lax.scan`` body times its length); the fixed
      latency per micro-batch is why larger micro-batches have higher throughput;
    * collectives = the compiled step's collective elements per device x the bytes they travel
      in (2 under bf16/fp16, else 4) / ``link_bandwidth``; ZeRO's volumes make this grow with
      the stage (2Ψ for stages 0 and 1, (GAS + 1)Ψ for 2, 2Ψ·GAS to 3Ψ·GAS for 3 with
      ``max_reuse_distance``);
    * offload = 2 x host-resident bytes per device / ``host_bandwidth``: offloaded state is
      fetched to the device and written back every step.

    The defaults describe one current data-centre GPU; pass your hardware's figures.
    """

    device_flops: float = 200e12  # sustained matrix-multiply FLOP/s of one device
    micro_batch_latency: float = 2e-3  # fixed seconds per micro-batch (launches, small ops)
    link_bandwidth: float = 100e9  # bytes/s a device moves in collectives
    host_bandwidth: float = 20e9  # bytes/s between a device and host memory

    def seconds(self, flops: float, gas: int, collective_elements: float, comm_itemsize: int,
                host_bytes: float) -> float:
        compute = gas * (flops / self.device_flops + self.micro_batch_latency)
        collectives = collective_elements * comm_itemsize / self.link_bandwidth
        return compute + collectives + 2 * host_bytes / self.host_bandwidth


def matmul_flops(jaxpr) -> float:
    """Matrix-multiply and convolution flops of a jaxpr (2 per multiply-add); scan bodies count
    ``length`` times, the costliest ``cond`` branch once, ``while`` bodies once."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
        elif name == "conv_general_dilated":
            rhs, spec = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[d] for d in spec[1:])
        subs = [s.jaxpr if hasattr(s, "consts") else s for v in eqn.params.values()
                for s in (v if isinstance(v, (tuple, list)) else (v,)) if hasattr(s, "eqns") or hasattr(s, "consts")]
        if not subs:
            continue
        counts = [matmul_flops(s) for s in subs]
        if name == "cond":
            total += max(counts)
        else:
            total += sum(counts) * (eqn.params["length"] if name == "scan" else 1)
    return total


def step_flops(loss_fn, shapes, micro_batch, has_aux: bool) -> float:
    """Flops of value_and_grad(loss_fn) on one device's micro-batch (shapes only)."""
    loss = resolve(loss_fn)
    args = (jax.random.PRNGKey(0),) if loss_arity(loss) == 3 else ()
    closed = jax.make_jaxpr(jax.value_and_grad(lambda p, b: loss(p, b, *args), has_aux=has_aux))(shapes, micro_batch)
    return matmul_flops(closed.jaxpr)

