"""Pipeline parallelism over a mesh's "pipe" axis, composed with ZeRO over its data axis.

    pipe = zj.PipelineModel(embed=embed_fn, block=block_fn, head=head_fn)
    mesh = zj.make_mesh((2, 4), ("pipe", "data"))
    state = zj.shard_train_state(params, tx, mesh=mesh, config=zj.ZeroConfig(stage=1, gradient_accumulation_steps=4))
    step = zj.make_train_step(pipe, state)

    model.py     PipelineModel: embed, stacked blocks, head; the plain loss
    schedule.py  1F1B, DeepSpeed's serial 1F1B and GPipe as tables of ticks
    grads.py     the tick loop: stage forwards and backwards, ppermute between stages
    engine.py    the step: pipelined gradients, then the shared update
    config.py    DeepSpeed's "pipeline" block
"""
from zerojax.pipeline._config import pipeline_options as pipeline_options
from zerojax.pipeline._engine import PipelineStep as PipelineStep
from zerojax.pipeline._engine import make_pipeline_step as make_pipeline_step
from zerojax.pipeline._model import PipelineModel as PipelineModel
from zerojax.pipeline._schedule import Schedule as Schedule
from zerojax.pipeline._schedule import make_schedule as make_schedule
from zerojax.pipeline._schedule import theory_idle_fraction as theory_idle_fraction

__all__ = ["PipelineModel", "PipelineStep", "Schedule", "make_pipeline_step", "make_schedule", "pipeline_options",
           "theory_idle_fraction"]
