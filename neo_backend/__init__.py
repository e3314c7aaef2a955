"""neo-triton engine: a Llama-family LLM serving engine with NEO CPU offloading."""

from .config import EngineConfig, ModelConfig
from .core.outputs import RequestMetrics, RequestOutput
from .core.sampling_params import SamplingParams
from .engine import LLMEngine
from .errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    KernelError,
    KernelInputError,
    ModelLoadError,
    NeoError,
    QueueFullError,
)

__all__ = [
    "EngineConfig",
    "ModelConfig",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "RequestMetrics",
    "NeoError",
    "ConfigError",
    "ModelLoadError",
    "InvalidRequestError",
    "QueueFullError",
    "EngineDeadError",
    "KernelError",
    "KernelInputError",
]
