"""blockpress: a fast, hackable engine for block-diffusion language models of the DiffusionGemma kind."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
# In a process forked after `import blockpress` (a multiprocessing Pool's worker, an os.fork): torch's seed as the fork
# left it, its parent's, with its parent's generator state; None elsewhere (the importing process, a spawned worker)
# and where torch was not imported before the fork (the child's import seeds torch afresh). While torch.initial_seed()
# is still this one, the child's fresh seeds mix in its process id (generate.Request.row_seeds); a child that seeds
# torch itself (torch.manual_seed, a Pool initializer's) draws repeatably again.
_SEED_AT_FORK: int | None = None


def _note_seed_at_fork() -> None:
    global _SEED_AT_FORK
    torch = sys.modules.get("torch")  # (not imported here: importing torch takes seconds)
    _SEED_AT_FORK = torch.initial_seed() if torch is not None and hasattr(torch, "initial_seed") else None


if hasattr(os, "register_at_fork"):  # (not on Windows, which has no fork)
    os.register_at_fork(after_in_child=_note_seed_at_fork)

# What the README and LM's docstrings tell users to pass or check: SamplerConfig for `sampler`, the events of
# `stream` (isinstance), GenerationOutput, KVCache and PrefixCache; escape_template for infill's fixed text.
# Each is imported from its module on first use (PEP 562), not here: importing torch takes seconds, and
# `blockpress --help` (which imports this package first) needs none of it.
_EXPORTS = {
    "KVCache": "cache",
    "CheckpointError": "checkpoint",
    "ConfigError": "config",
    "ModelConfig": "config",
    "TextConfig": "config",
    "Cancelled": "generate",
    "Commit": "generate",
    "Done": "generate",
    "Draft": "generate",
    "GenerationOutput": "generate",
    "NonFiniteLogits": "generate",
    "escape_template": "generate",
    "LM": "lm",
    "load": "lm",
    "random_model": "lm",
    "shipped_models": "lm",
    "DiffusionGemma": "model",
    "PrefixCache": "prefix",
    "SamplerConfig": "sampling",
}
# Written out, not computed (sorted(_EXPORTS)): type checkers read only a literal __all__, so to mypy
# `from blockpress import *` defined none of these names, and pyright exported every module global (os, Any...).
# tests/test_packaging.py checks that it is sorted(_EXPORTS), as the TYPE_CHECKING imports below are.
__all__ = [
    "Cancelled",
    "CheckpointError",
    "Commit",
    "ConfigError",
    "DiffusionGemma",
    "Done",
    "Draft",
    "GenerationOutput",
    "KVCache",
    "LM",
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


# Hidden from type checkers: to them a module with __getattr__ has every attribute, so `blockpress.laod(...)` (a
# typo) passed mypy --strict as Any; they read the real names from the TYPE_CHECKING imports below instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """`blockpress.load` and the rest of __all__ from their modules, and `blockpress.lm` (a submodule) as a plain
        package import would give it."""
        if name in _EXPORTS:
            value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        else:
            try:
                value = importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":  # a module of ours that fails to import: its own error
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        globals()[name] = value  # found once: later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    # (`X as X` marks each as re-exported for checkers that cannot read a computed __all__)
    from .cache import KVCache as KVCache
    from .checkpoint import CheckpointError as CheckpointError
    from .config import ConfigError as ConfigError
    from .config import ModelConfig as ModelConfig
    from .config import TextConfig as TextConfig
    from .generate import Cancelled as Cancelled
    from .generate import Commit as Commit
    from .generate import Done as Done
    from .generate import Draft as Draft
    from .generate import GenerationOutput as GenerationOutput
    from .generate import NonFiniteLogits as NonFiniteLogits
    from .generate import escape_template as escape_template
    from .lm import LM as LM
    from .lm import load as load
    from .lm import random_model as random_model
    from .lm import shipped_models as shipped_models
    from .model import DiffusionGemma as DiffusionGemma
    from .prefix import PrefixCache as PrefixCache
    from .sampling import SamplerConfig as SamplerConfig
