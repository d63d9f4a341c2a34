"""blockpress: a fast, hackable engine for block-diffusion language models of the DiffusionGemma kind."""

from .cache import KVCache
from .checkpoint import CheckpointError
from .config import ConfigError, ModelConfig, TextConfig
from .lm import LM, load, random_model, shipped_models
from .model import DiffusionGemma
from .prefix import PrefixCache

__version__ = "0.1.0"

__all__ = [
    "LM",
    "CheckpointError",
    "ConfigError",
    "DiffusionGemma",
    "KVCache",
    "ModelConfig",
    "PrefixCache",
    "TextConfig",
    "load",
    "random_model",
    "shipped_models",
]
