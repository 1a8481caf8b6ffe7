"""zerojax: ZeRO data parallelism for JAX."""
from zerojax.config import ConfigError as ConfigError
from zerojax.config import ZeroConfig as ZeroConfig
from zerojax.precision import LossScaleError as LossScaleError
from zerojax.precision import LossScaler as LossScaler
from zerojax.precision import LossScalerState as LossScalerState

__all__ = ["ConfigError", "LossScaleError", "LossScaler", "LossScalerState", "ZeroConfig"]
from zerojax.mesh import make_mesh as make_mesh
from zerojax.plan import LeafLayout as LeafLayout
from zerojax.plan import ZeroPlan as ZeroPlan
from zerojax.state import TrainState as TrainState
from zerojax.state import shard_train_state as shard_train_state
from zerojax.step import HostUpdateWarning as HostUpdateWarning
from zerojax.step import NonFiniteError as NonFiniteError
from zerojax.step import TrainStep as TrainStep
from zerojax.step import make_train_step as make_train_step

__all__ += ["HostUpdateWarning", "make_mesh", "LeafLayout", "ZeroPlan", "TrainState", "shard_train_state", "NonFiniteError",
            "TrainStep", "make_train_step"]
from zerojax.optim import zero_optimizer as zero_optimizer
from zerojax.report import MemoryReport as MemoryReport
from zerojax.report import memory_report as memory_report

__all__ += ["zero_optimizer", "MemoryReport", "memory_report"]
from zerojax.deepspeed import IgnoredKeysWarning as IgnoredKeysWarning
from zerojax.deepspeed import TrainingArgs as TrainingArgs
from zerojax.deepspeed import optimizer_from_config as optimizer_from_config
from zerojax.initialize import initialize as initialize

__all__ += ["IgnoredKeysWarning", "TrainingArgs", "optimizer_from_config", "initialize"]
from zerojax.estimate import estimate as estimate
from zerojax.estimate import estimate_zero2_model_states_mem_needs as estimate_zero2_model_states_mem_needs
from zerojax.estimate import (
    estimate_zero2_model_states_mem_needs_all_cold as estimate_zero2_model_states_mem_needs_all_cold,
)
from zerojax.estimate import (
    estimate_zero2_model_states_mem_needs_all_live as estimate_zero2_model_states_mem_needs_all_live,
)
from zerojax.estimate import estimate_zero3_model_states_mem_needs as estimate_zero3_model_states_mem_needs
from zerojax.estimate import (
    estimate_zero3_model_states_mem_needs_all_cold as estimate_zero3_model_states_mem_needs_all_cold,
)
from zerojax.estimate import (
    estimate_zero3_model_states_mem_needs_all_live as estimate_zero3_model_states_mem_needs_all_live,
)
from zerojax.visualize import visualize as visualize

__all__ += ["estimate", "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
            "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
            "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
            "visualize"]
from zerojax.compiled import comm_report as comm_report
from zerojax.compiled import peak_memory as peak_memory

__all__ += ["comm_report", "peak_memory"]
from zerojax.stages.stage3 import gather as gather

__all__ += ["gather"]
from zerojax.state import abstract_train_state as abstract_train_state

__all__ += ["abstract_train_state"]
from zerojax.planning import Ref as Ref
from zerojax.planning import StepPlan as StepPlan
from zerojax.planning import plan_step as plan_step

__all__ += ["Ref", "StepPlan", "plan_step"]
from zerojax.flax_support import linen_params as linen_params
from zerojax.flax_support import nnx_params as nnx_params

__all__ += ["linen_params", "nnx_params"]
from zerojax import checkpoint as checkpoint
from zerojax.checkpoint import CheckpointManager as CheckpointManager

__all__ += ["checkpoint", "CheckpointManager"]
from zerojax import distributed as distributed

__all__ += ["distributed"]
from zerojax.autotune import autotune as autotune

__all__ += ["autotune"]
