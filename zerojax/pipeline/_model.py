"""PipelineModel: a model written as embed, a stack of identical blocks, and a head.

    pipe = zj.PipelineModel(embed=embed_fn, block=block_fn, head=head_fn)
    embed_fn(params["embed"], batch) -> h
    block_fn(one_layer_params, h) -> h          # params["blocks"]: leaves stacked on a layer axis
    head_fn(params["head"], h, batch) -> loss   # a scalar
    pipe.loss(params, batch)                    # the same model run plainly (lax.scan over blocks)

On a mesh with a "pipe" axis of size P, ``zj.make_train_step(pipe, state)`` runs it as a
pipeline: stage s holds layers s L/P .. (s + 1) L/P - 1 (:mod:`zerojax.pipeline._engine`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from zerojax._errors import ConfigError
from zerojax._remat import remat

__all__ = ["PipelineModel", "PARAM_KEYS"]

PARAM_KEYS = ("blocks", "embed", "head")


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """Embed, blocks and head of a model, and how its pipeline runs.

    ``activation_checkpoint_interval`` (DeepSpeed's ``pipeline.activation_checkpoint_interval``):
    0 keeps a stage's activations for its backward as jax does; k > 0 wraps every k layers in
    ``zj.remat``, keeping only the inputs of each group of k (k must divide L / P), in pinned host
    memory with the config's ``"activation_checkpointing": {"cpu_checkpointing": true}``. A block
    may also call ``zj.remat`` itself.
    ``schedule``: "1f1b" (a forward and a backward per tick), "1f1b-serial" (DeepSpeed's order,
    one op per tick) or "gpipe" (:mod:`zerojax.pipeline._schedule`).
    """

    embed: Callable
    block: Callable
    head: Callable
    activation_checkpoint_interval: int = 0
    schedule: str = "1f1b"

    def __post_init__(self):
        for name in ("embed", "block", "head"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"PipelineModel({name}=...) must be a function, got {type(getattr(self, name))}")
        k = self.activation_checkpoint_interval
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"PipelineModel(activation_checkpoint_interval={k!r}) must be an int >= 0 "
                              "(0: no checkpointing, k: jax.checkpoint around every k layers)")
        from zerojax.pipeline._schedule import SCHEDULES
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"PipelineModel(schedule={self.schedule!r}) is not known. Fix: use one of "
                              f"{sorted(SCHEDULES)}")

    def run_blocks(self, blocks, h):
        """``h`` through the stacked ``blocks`` (every layer on the leading axis), in order."""
        k = self.activation_checkpoint_interval
        layers = jax.tree_util.tree_leaves(blocks)[0].shape[0]
        body = lambda x, p: (self.block(p, x), None)  # noqa: E731
        if not k:
            return jax.lax.scan(body, h, blocks)[0]
        if layers % k:
            raise ConfigError(f"activation_checkpoint_interval={k} does not divide the {layers} layers of a "
                              "pipeline stage. Fix: use a divisor of the layers per stage, or 0")
        grouped = jax.tree_util.tree_map(lambda x: x.reshape((layers // k, k) + x.shape[1:]), blocks)
        # zj.remat: the config's activation_checkpointing block (cpu_checkpointing) applies here too
        group = remat(lambda x, ps: jax.lax.scan(body, x, ps)[0], params_argnums=(1,))
        return jax.lax.scan(lambda x, ps: (group(x, ps), None), h, grouped)[0]

    def loss(self, params, batch):
        """The model run plainly: embed, every block in order (a lax.scan), head."""
        check_params(params)
        h = self.embed(params["embed"], batch)
        return self.head(params["head"], self.run_blocks(params["blocks"], h), batch)


def check_params(params) -> None:
    if not isinstance(params, dict) or sorted(params) != list(PARAM_KEYS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ConfigError(f"a PipelineModel's params must be a dict with exactly the keys {list(PARAM_KEYS)} "
                          f"(params['blocks'] stacked on a leading layer axis), got {got}")
    leaves = jax.tree_util.tree_leaves(params["blocks"])
    if not leaves:
        raise ConfigError("params['blocks'] of a PipelineModel holds no arrays")
    layers = {x.shape[0] if getattr(x, "ndim", 0) else None for x in leaves}
    if len(layers) != 1 or None in layers:
        raise ConfigError(f"every leaf of params['blocks'] must have the same leading layer axis, got sizes "
                          f"{sorted(layers, key=str)}")
