"""Flax models in ZeRO: params and their tensor-parallel annotations from NNX modules and Linen variables.

The annotations a model carries (``nnx.with_partitioning``, ``nn.with_partitioning``) become the
``param_specs`` of ``shard_train_state``; the plan keeps them and adds the data axis on top::

    params, specs, merge = zj.nnx_params(model)
    state = zj.shard_train_state(params, optax.adamw(1e-3), mesh=zj.make_mesh((4, 2), ("data", "model")),
                                 config=zj.ZeroConfig(stage=3), param_specs=specs)
    step = zj.make_train_step(lambda p, b: mse(merge(p)(b["x"]), b["y"]), state)

    variables = LinenModel().init(key, x)
    params, specs = zj.linen_params(variables)
    step = zj.make_train_step(lambda p, b: mse(LinenModel().apply({"params": p}, b["x"]), b["y"]), state)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import jax
from jax.sharding import PartitionSpec as P
from zerojax._errors import ConfigError



def nnx_params(module) -> Tuple[Any, Any, Callable[[Any], Any]]:
    """(params, param_specs, merge_fn) of an NNX module.

    ``params`` is the module's ``nnx.Param`` state (an ``nnx.State``, a pytree of arrays);
    ``param_specs`` the same tree of PartitionSpecs, read from each variable's sharding
    metadata (``nnx.with_partitioning(init, (None, "model"))``, logical names resolved by flax);
    ``merge_fn(params)`` rebuilds the module from (traced) params, for use inside a loss.
    Other state (batch statistics, RNG counters) is merged in as it was when split: it is
    not trained and stays frozen, so use modules whose non-Param state the loss does not need
    to update.
    """
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise ConfigError(f"nnx_params expects an nnx.Module, got {type(module).__name__}; for Linen variables "
                          "use zj.linen_params(variables)")
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    # a tree shaped like ``params`` (Param nodes holding PartitionSpecs); logical names go through
    # the variables' sharding_rules and the nn.logical_axis_rules context, as flax resolves them
    specs = nnx.get_partition_spec(params)

    def merge_fn(p):
        return nnx.merge(graphdef, p, rest)

    return params, specs, merge_fn


def linen_params(variables, rules: Optional[Sequence[Tuple[str, Any]]] = None) -> Tuple[Any, Any]:
    """(params, param_specs) of Linen variables boxed by ``nn.with_partitioning``.

    ``variables`` is what ``model.init`` returns (its ``"params"`` collection is taken) or the
    params collection itself. Boxed leaves (``nn.Partitioned``) are unboxed and give their mesh
    axis names; ``nn.LogicallyPartitioned`` names are mapped through ``rules`` (logical axis ->
    mesh axis, as ``nn.logical_axis_rules``). Unannotated leaves get ``P()``.
    """
    import flax.linen as nn
    from flax.core import meta

    params = variables.get("params", variables) if hasattr(variables, "get") else variables

    def spec(x):
        if isinstance(x, nn.LogicallyPartitioned):
            if rules is None and not nn.get_logical_axis_rules():
                raise ConfigError(f"a param is annotated with logical axes {x.names}: pass "
                                  "zj.linen_params(variables, rules=[('logical', 'mesh axis'), ...])")
            return nn.logical_to_mesh_axes(x.names, rules)
        if isinstance(x, meta.Partitioned):
            return x.get_partition_spec()
        return P()

    specs = jax.tree_util.tree_map(spec, params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
    return nn.unbox(params), specs


__all__ = ["linen_params", "nnx_params"]
