"""Config schema (dataclasses), loading (omegaconf) and the Megatron-style --prism-* flags."""

from prism_megatron.config.loader import MODEL_PRESETS, load_config, to_yaml
from prism_megatron.config.schema import (
    ConfigError,
    EmulationConfig,
    ModelConfig,
    ParallelConfig,
    PrismConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError", "EmulationConfig", "ModelConfig", "ParallelConfig", "PrismConfig", "TrainConfig",
    "MODEL_PRESETS", "load_config", "to_yaml",
]
