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



def _names(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _apply_rules(names, rules: Optional[Sequence[Tuple[str, Any]]], path: str) -> P:
    """The PartitionSpec of a param annotated with the model's own axis names (one entry per dim:
    a name, a tuple of names, or None), each name mapped to a mesh axis or None through ``rules``
    (flax's ``nn.logical_to_mesh_axes``: the first rule of a name whose mesh axis is still free;
    ``rules=None``: the ``nn.logical_axis_rules`` context). A name no rule lists is refused with
    a ConfigError naming the param, where ``rules`` are given."""
    import flax.linen as nn

    entries = tuple(names)
    flat = [n for e in entries for n in _names(e)]
    if rules is not None:
        listed = {logical for logical, _ in rules}
        missing = [n for n in flat if n not in listed]
        if missing:
            raise ConfigError(
                f"param {path!r} is annotated {entries} and rules= maps no axis named {missing[0]!r} (rules list "
                f"{sorted(listed)}). Fix: add ({missing[0]!r}, 'model') to rules= to split that dim over the "
                f"tensor-parallel axis, or ({missing[0]!r}, None) to leave it to ZeRO (an 'fsdp' axis: ZeRO "
                f"partitions over 'data' itself)")
    mapped = iter(nn.logical_to_mesh_axes(tuple(flat), rules))
    out = []
    for e in entries:
        axes = tuple(a for a in (next(mapped) for _ in _names(e)) if a is not None)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def nnx_params(module, rules: Optional[Sequence[Tuple[str, Any]]] = None) -> Tuple[Any, Any, Callable[[Any], Any]]:
    """(params, param_specs, merge_fn) of an NNX module.

    ``params`` is the module's ``nnx.Param`` state (an ``nnx.State``, a pytree of arrays);
    ``param_specs`` the same tree of PartitionSpecs, read from each variable's sharding
    metadata (``nnx.with_partitioning(init, (None, "model"))``, logical names resolved by flax);
    ``merge_fn(params)`` rebuilds the module from (traced) params, for use inside a loss.
    Other state (batch statistics, RNG counters) is merged in as it was when split: it is
    not trained and stays frozen, so use modules whose non-Param state the loss does not need
    to update.

    ``rules`` maps the model's own axis names onto zerojax's mesh axes, as in
    :func:`linen_params`: a model zoo's ``('fsdp', 'tp')`` annotations train on a
    ``("data", "model")`` mesh with ``rules=[("tp", "model"), ("fsdp", None)]`` (``None``: ZeRO
    partitions over ``"data"`` itself). Every name the annotations use must be listed.
    """
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise ConfigError(f"nnx_params expects an nnx.Module, got {type(module).__name__}; for Linen variables "
                          "use zj.linen_params(variables)")
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    # a tree shaped like ``params`` (Param nodes holding PartitionSpecs); logical names go through
    # the variables' sharding_rules and the nn.logical_axis_rules context, as flax resolves them
    specs = nnx.get_partition_spec(params)
    if rules is not None:
        specs = jax.tree_util.tree_map_with_path(
            lambda path, spec: _apply_rules(spec, rules, jax.tree_util.keystr(path, simple=True, separator="/")),
            specs, is_leaf=lambda x: isinstance(x, P))

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

    def spec(path, x):
        if isinstance(x, nn.LogicallyPartitioned):
            if rules is None and not nn.get_logical_axis_rules():
                raise ConfigError(f"a param is annotated with logical axes {x.names}: pass "
                                  "zj.linen_params(variables, rules=[('logical', 'mesh axis'), ...])")
            return _apply_rules(x.names, rules, jax.tree_util.keystr(path, simple=True, separator="/"))
        if isinstance(x, meta.Partitioned):
            return x.get_partition_spec()
        return P()

    specs = jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
    return nn.unbox(params), specs


__all__ = ["linen_params", "nnx_params"]
