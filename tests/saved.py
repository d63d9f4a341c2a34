"""What a saved checkpoint holds, apart from how `blockpress.load` would compute with it on this CPU."""

from pathlib import Path

import torch

from blockpress.checkpoint import MappedSafetensors, stored_dtype


def saved_dtype(path: Path) -> torch.dtype:
    """The dtype a checkpoint folder's weights are stored in. `blockpress.load(path).dtype` is not it: with no dtype
    asked for, a CPU without bf16 matmuls (an AVX2 one) loads bf16 weights as float32 (checkpoint.native_dtype)."""
    return stored_dtype([MappedSafetensors(file) for file in sorted(Path(path).glob("*.safetensors"))])
