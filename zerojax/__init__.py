"""zerojax: ZeRO data parallelism for JAX."""
from zerojax.config import ConfigError as ConfigError
from zerojax.config import ZeroConfig as ZeroConfig
from zerojax.precision import LossScaleError as LossScaleError
from zerojax.precision import LossScaler as LossScaler
from zerojax.precision import LossScalerState as LossScalerState

__all__ = ["ConfigError", "LossScaleError", "LossScaler", "LossScalerState", "ZeroConfig"]
