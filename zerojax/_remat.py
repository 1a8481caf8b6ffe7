"""zj.remat: activation checkpointing as DeepSpeed's ``activation_checkpointing`` block sets it.

    block = zj.remat(block_fn)              # block_fn(params, x, ...) -> y
    y = block(params, x)                    # inside a loss a zerojax step trains

``zj.remat`` is to a JAX model what ``deepspeed.checkpointing.checkpoint`` is to a PyTorch one:
the wrapped function keeps only its inputs for the backward pass and runs again there
(``jax.checkpoint`` with a policy that saves nothing inside). How those inputs are kept comes
from the config of the step being traced (``ZeroConfig.activation_checkpointing``, DeepSpeed's
block): with ``"cpu_checkpointing": true`` they are moved to pinned host memory after the
forward pass and back for the backward pass (JAX's offload policy,
``save_and_offload_only_these_names``).

The step makes its config visible while it traces the loss (:func:`config_scope`): every path
(stages 0-3, offload, NVMe, ZenFlow, the pipeline) calls the loss inside it. Outside a zerojax
step ``zj.remat`` is ``jax.checkpoint`` saving the inputs only.

``when_configured=True`` checkpoints only inside a step whose config has the block (absent:
``fn`` runs as it is, nothing added to the program): a model that can be checkpointed, like
``zerojax.models.gpt``, uses it so the config file alone turns checkpointing on.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zerojax._errors import ConfigError

__all__ = ["INPUT_NAME", "config_scope", "remat", "remat_policy"]

# the name the activation inputs of a checkpointed function carry (for the offload policy)
INPUT_NAME = "zerojax.remat.input"

_OUTSIDE = object()  # no zerojax step is being traced
# the activation_checkpointing block of the step being traced (None: the config has none)
_BLOCK: contextvars.ContextVar = contextvars.ContextVar("zerojax_activation_checkpointing", default=_OUTSIDE)


def config_scope(fn: Callable, block: Optional[dict]) -> Callable:
    """``fn`` (a loss, a pipeline stage's body) that traces with ``block`` (the config's
    ``activation_checkpointing``, or None) visible to every ``zj.remat`` it calls. The
    signature is ``fn``'s (``inspect.signature`` follows the wrapper)."""

    return traced_with(_BLOCK, block, fn)


def traced_with(var: contextvars.ContextVar, value, fn: Callable) -> Callable:
    """``fn`` that runs (traces) with ``var`` set to ``value``, restored after: how a step makes
    a config setting visible to the model code it traces."""

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        token = var.set(value)
        try:
            return fn(*args, **kwargs)
        finally:
            var.reset(token)

    return scoped


def remat_policy(cpu_checkpointing: bool = False):
    """The ``jax.checkpoint`` policy zj.remat uses: nothing saved inside the function (only its
    inputs are kept), or, with ``cpu_checkpointing``, its activation inputs offloaded from device
    memory to pinned host memory. For ``flax.linen.remat(Module, policy=zj.remat_policy())``: the
    offload needs the inputs named ``INPUT_NAME`` with ``jax.ad_checkpoint.checkpoint_name``."""
    if cpu_checkpointing:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=(INPUT_NAME,),
            offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint_policies.nothing_saveable


def _named(tree):
    return jax.tree_util.tree_map(
        lambda x: checkpoint_name(x, INPUT_NAME) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x, tree)


def _argnums(name: str, value) -> tuple:
    nums = (value,) if isinstance(value, int) else tuple(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in nums):
        raise ConfigError(f"zj.remat({name}={value!r}): expected an int >= 0 or a tuple of them (positions of the "
                          "function's arguments)")
    return nums


def remat(fn: Optional[Callable] = None, *, params_argnums: Sequence[int] = (0,), static_argnums: Sequence[int] = (),
          when_configured: bool = False, prevent_cse: bool = True) -> Callable:
    """``fn`` checkpointed: in the backward pass it runs again from its inputs instead of
    keeping what it computed. Usable as a decorator (``@zj.remat`` or ``@zj.remat(...)``).

    ``params_argnums``: the positional arguments that are parameters (default the first, as in
    ``fn(params, x)`` or a Flax ``module.apply``); every other array argument is an activation,
    which ``"cpu_checkpointing": true`` keeps in pinned host memory between the passes.
    ``static_argnums``: arguments that are not arrays (as ``jax.checkpoint``'s).
    ``when_configured``: checkpoint only inside a zerojax step whose config has an
    ``activation_checkpointing`` block; elsewhere ``fn`` runs unchanged.
    """
    params_argnums, static_argnums = _argnums("params_argnums", params_argnums), \
        _argnums("static_argnums", static_argnums)
    if fn is None:
        return functools.partial(remat, params_argnums=params_argnums, static_argnums=static_argnums,
                                 when_configured=when_configured, prevent_cse=prevent_cse)
    if not callable(fn):
        raise ConfigError(f"zj.remat(fn): fn must be a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def checkpointed(*args, **kwargs):
        block = _BLOCK.get()
        if block is _OUTSIDE or block is None:
            if when_configured:
                return fn(*args, **kwargs)
            cpu = False
        else:
            cpu = bool(block.get("cpu_checkpointing"))

        def inner(*args):
            if cpu:
                args = tuple(a if i in params_argnums or i in static_argnums else _named(a)
                             for i, a in enumerate(args))
            return fn(*args, **kwargs)

        return jax.checkpoint(inner, policy=remat_policy(cpu), prevent_cse=prevent_cse,
                              static_argnums=static_argnums)(*args)

    return checkpointed
