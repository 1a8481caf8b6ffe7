"""zerojax: ZeRO data parallelism for JAX.

The data flow, and where each part lives:

    config/   ZeroConfig, the DeepSpeed reader, optimizers, schedules
    plan.py   ZeroPlan: how each leaf is stored and split at the config's stage (decisions)
    placement.py  moving trees between the plan's storage and the step's compute layouts
    state.py  TrainState: the sharded params, master, optimizer state and loss scaler
    update/   what every engine shares: the optimizer recognition and the step pipeline
              (unscale, norm, finite check, skip, clip, loss scale, metrics)
    stages/   the rules of stages 0–3: gradient reduction, collectives, the stage-3 gathers,
              the optimizer update on partitions and the jitted on-device step
    offload/  the host update, host Adam, flat buffers, the NVMe store and step, ZenFlow
    kernels/  Pallas kernels (the fused AdamW)
    step.py   the step contract and make_train_step, above every path
    checkpoint/  Orbax save, restore onto any mesh and stage, consolidation
    tools/    memory reports, estimators, compiled-step reports, visualize, plan_step, autotune
    runtime/  multi-process start-up and the launcher
"""
# errors first: every other module raises them
from zerojax._errors import AutoTPCoverageWarning as AutoTPCoverageWarning
from zerojax._errors import AutotuneError as AutotuneError
from zerojax._errors import BatchError as BatchError
from zerojax._errors import CheckpointError as CheckpointError
from zerojax._errors import ConfigError as ConfigError
from zerojax._errors import DeprecatedKeyWarning as DeprecatedKeyWarning
from zerojax._errors import DistributedError as DistributedError
from zerojax._errors import HostUpdateWarning as HostUpdateWarning
from zerojax._errors import IgnoredKeysWarning as IgnoredKeysWarning
from zerojax._errors import LaunchError as LaunchError
from zerojax._errors import LossScaleError as LossScaleError
from zerojax._errors import NativeKernelWarning as NativeKernelWarning
from zerojax._errors import NonFiniteError as NonFiniteError
from zerojax._errors import NvmeError as NvmeError
from zerojax._errors import OptimizerError as OptimizerError
from zerojax._errors import StateError as StateError
from zerojax._errors import PipelineKeyWarning as PipelineKeyWarning
from zerojax._errors import StepOptionError as StepOptionError
from zerojax._errors import ZeroJaxError as ZeroJaxError
from zerojax._errors import ZeroJaxWarning as ZeroJaxWarning

__all__ = ["AutoTPCoverageWarning", "AutotuneError", "BatchError", "CheckpointError", "ConfigError", "DeprecatedKeyWarning", "DistributedError",
           "HostUpdateWarning", "IgnoredKeysWarning", "LaunchError", "LossScaleError", "NativeKernelWarning",
           "NonFiniteError", "NvmeError", "OptimizerError", "PipelineKeyWarning", "StateError", "StepOptionError",
           "ZeroJaxError", "ZeroJaxWarning"]

# config -> plan -> state
from zerojax.config import TrainingArgs as TrainingArgs
from zerojax.config import ZeroConfig as ZeroConfig
from zerojax.config import optimizer_from_config as optimizer_from_config
from zerojax.config import _schedules as schedules
from zerojax._init_rule import init_fn as init_fn
from zerojax._mesh import make_mesh as make_mesh
from zerojax._plan import LeafLayout as LeafLayout
from zerojax._plan import ZeroPlan as ZeroPlan
from zerojax._precision import LossScaler as LossScaler
from zerojax._precision import LossScalerState as LossScalerState
from zerojax._state import TrainState as TrainState
from zerojax._state import abstract_train_state as abstract_train_state
from zerojax._state import shard_train_state as shard_train_state

__all__ += ["TrainingArgs", "ZeroConfig", "optimizer_from_config", "schedules", "init_fn", "make_mesh", "LeafLayout",
            "ZeroPlan", "LossScaler", "LossScalerState", "TrainState", "abstract_train_state", "shard_train_state"]

# step
from zerojax._contract import METRIC_KEYS as METRIC_KEYS
from zerojax._contract import Step as Step
from zerojax._initialize import initialize as initialize
from zerojax._optim import zero_optimizer as zero_optimizer
from zerojax import pipeline as pipeline
from zerojax.pipeline import PipelineModel as PipelineModel
from zerojax.stages._stage3 import gather as gather
from zerojax._step import TrainStep as TrainStep
from zerojax._step import make_train_step as make_train_step

__all__ += ["METRIC_KEYS", "Step", "initialize", "zero_optimizer", "pipeline", "PipelineModel", "gather", "TrainStep",
            "make_train_step"]

# monitors
from zerojax import monitor as monitor
from zerojax.monitor import Monitors as Monitors

__all__ += ["monitor", "Monitors"]

# checkpoint
from zerojax import checkpoint as checkpoint
from zerojax.checkpoint import CheckpointManager as CheckpointManager

__all__ += ["checkpoint", "CheckpointManager"]

# models
from zerojax._flax_support import linen_params as linen_params
from zerojax._flax_support import nnx_params as nnx_params

__all__ += ["linen_params", "nnx_params"]

# long sequences: the loss without the whole logits, activation checkpointing
from zerojax._remat import remat as remat
from zerojax._remat import remat_policy as remat_policy
from zerojax._tiled_loss import tiled_cross_entropy as tiled_cross_entropy

__all__ += ["remat", "remat_policy", "tiled_cross_entropy"]

from zerojax._ulysses import ulysses_attention as ulysses_attention

__all__ += ["ulysses_attention"]

# tensor parallelism from DeepSpeed's "tensor_parallel" block (AutoTP)
from zerojax._autotp import autotp_describe as autotp_describe
from zerojax._autotp import autotp_mesh as autotp_mesh
from zerojax._autotp import autotp_specs as autotp_specs

__all__ += ["autotp_describe", "autotp_mesh", "autotp_specs"]

# tools
from zerojax.tools.autotune import autotune as autotune
from zerojax.tools._compiled import comm_report as comm_report
from zerojax.tools._compiled import peak_memory as peak_memory
from zerojax.tools._estimate import estimate as estimate
from zerojax.tools._estimate import estimate_zero2_model_states_mem_needs as estimate_zero2_model_states_mem_needs
from zerojax.tools._estimate import (
    estimate_zero2_model_states_mem_needs_all_cold as estimate_zero2_model_states_mem_needs_all_cold,
)
from zerojax.tools._estimate import (
    estimate_zero2_model_states_mem_needs_all_live as estimate_zero2_model_states_mem_needs_all_live,
)
from zerojax.tools._estimate import estimate_zero3_model_states_mem_needs as estimate_zero3_model_states_mem_needs
from zerojax.tools._estimate import (
    estimate_zero3_model_states_mem_needs_all_cold as estimate_zero3_model_states_mem_needs_all_cold,
)
from zerojax.tools._estimate import (
    estimate_zero3_model_states_mem_needs_all_live as estimate_zero3_model_states_mem_needs_all_live,
)
from zerojax.tools._planning import Ref as Ref
from zerojax.tools._planning import StepPlan as StepPlan
from zerojax.tools._planning import plan_step as plan_step
from zerojax.tools._report import MemoryReport as MemoryReport
from zerojax.tools._report import memory_report as memory_report
from zerojax.tools._visualize import visualize as visualize

__all__ += ["autotune", "comm_report", "peak_memory", "estimate", "estimate_zero2_model_states_mem_needs",
            "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live",
            "estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
            "estimate_zero3_model_states_mem_needs_all_live", "Ref", "StepPlan", "plan_step", "MemoryReport",
            "memory_report", "visualize"]

# runtime
from zerojax.runtime import _distributed as distributed

__all__ += ["distributed"]
