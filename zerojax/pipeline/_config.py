"""DeepSpeed's "pipeline" block, read for a PipelineModel.

    pipe = zj.PipelineModel(embed, block, head, **zj.pipeline.pipeline_options("ds_config.json", stages=2))

    stages                          "auto" or the number of stages: must equal the mesh's "pipe" size
    activation_checkpoint_interval  honoured: jax.checkpoint around every k layers of a stage
    partition                       "parameters", "uniform" (and the default "best") all give L / P
                                    consecutive layers per stage, since the blocks are identical;
                                    "type:..." has no meaning here: warned
    seed_layers                     warned when true: the params are the caller's, not seeded per layer
    pipe_partitioned,               warned when false: they split the activations and gradients sent
    grad_partitioned                between stages over tensor-parallel ranks, which zerojax does not do
"""
from __future__ import annotations

import warnings
from typing import Optional

from zerojax._errors import ConfigError, PipelineKeyWarning

__all__ = ["DEFAULTS", "pipeline_options"]

# DeepSpeed's defaults for the block
DEFAULTS = {"stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
            "pipe_partitioned": True, "grad_partitioned": True}


def _warn(key: str, value, why: str) -> None:
    warnings.warn(f'pipeline.{key}={value!r}: {why}; zerojax goes on without it. Fix: remove "{key}"',
                  PipelineKeyWarning, stacklevel=3)


def pipeline_options(config, stages: Optional[int] = None) -> dict:
    """The ``zj.PipelineModel`` options a DeepSpeed config's "pipeline" block sets.

    ``config``: a DeepSpeed config (dict or JSON path). ``stages``: the mesh's "pipe" size,
    checked against ``pipeline.stages`` when both are given. Keys without a meaning here warn
    (:class:`~zerojax._errors.PipelineKeyWarning`), unknown keys are a ConfigError."""
    from zerojax.config._deepspeed import _load

    block = _load(config).get("pipeline") or {}
    if not isinstance(block, dict):
        raise ConfigError(f'"pipeline" must be a JSON object with keys {sorted(DEFAULTS)}, got {block!r}')
    unknown = sorted(set(block) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"pipeline.{unknown[0]} is not a key of DeepSpeed's pipeline block. Fix: use one of "
                          f"{sorted(DEFAULTS)}")
    got = {**DEFAULTS, **block}
    want = got["stages"]
    if want != "auto":
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            raise ConfigError(f'pipeline.stages={want!r} must be "auto" or an int >= 1')
        if stages is not None and want != stages:
            raise ConfigError(f"pipeline.stages={want} but the mesh's 'pipe' axis has {stages} devices: the stages "
                              f"are the pipe axis. Fix: set pipeline.stages to \"auto\" or {stages}, or build the mesh "
                              f"with zj.make_mesh(({want}, D), ('pipe', 'data'))")
    interval = got["activation_checkpoint_interval"]
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"pipeline.activation_checkpoint_interval={interval!r} must be an int >= 0")
    partition = got["partition"]
    if not isinstance(partition, str):
        raise ConfigError(f"pipeline.partition={partition!r} must be a string such as \"parameters\"")
    if partition.lower() not in ("best", "parameters", "uniform"):
        _warn("partition", partition, "a PipelineModel's blocks are identical, so every stage gets L / P "
              "consecutive layers")
    if got["seed_layers"] is not False:
        _warn("seed_layers", got["seed_layers"], "the params are built by the caller, not seeded layer by layer")
    for key in ("pipe_partitioned", "grad_partitioned"):
        if got[key] is not True:
            _warn(key, got[key], "it splits what moves between stages over tensor-parallel ranks, which zerojax "
                  "does not do (every stage sends whole activations)")
    return {"activation_checkpoint_interval": interval}
