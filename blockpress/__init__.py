"""blockpress: a fast, hackable engine for block-diffusion language models of the DiffusionGemma kind."""

from .cache import KVCache
from .checkpoint import CheckpointError
from .config import ConfigError, ModelConfig, TextConfig
from .generate import Cancelled, Commit, Done, Draft, GenerationOutput, NonFiniteLogits, escape_template
from .lm import LM, load, random_model, shipped_models
from .model import DiffusionGemma
from .prefix import PrefixCache
from .sampling import SamplerConfig

__version__ = "0.1.0"

# What the README and LM's docstrings tell users to pass or check: SamplerConfig for `sampler`, the events of
# `stream` (isinstance), GenerationOutput, KVCache and PrefixCache; escape_template for infill's fixed text.
__all__ = [
    "LM",
    "Cancelled",
    "CheckpointError",
    "Commit",
    "ConfigError",
    "DiffusionGemma",
    "Done",
    "Draft",
    "GenerationOutput",
    "KVCache",
    "ModelConfig",
    "NonFiniteLogits",
    "PrefixCache",
    "SamplerConfig",
    "TextConfig",
    "escape_template",
    "load",
    "random_model",
    "shipped_models",
]
