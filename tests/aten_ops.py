"""A recorder of the aten ops a piece of code runs, for tests of what work a step does (no full sort, no copy)."""

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def aten_ops(fn: Callable[[], Any]) -> list[tuple[str, tuple[int, ...] | None]]:
    """The aten ops `fn()` runs: (name, e.g. "sort" or "masked_fill_", the shape of its (first) output or None)."""
    ops: list[tuple[str, tuple[int, ...] | None]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out  # max(dim): (values, indices)
            ops.append((func.overloadpacket.__name__, tuple(first.shape) if isinstance(first, torch.Tensor) else None))
            return out

    with Record():
        fn()
    return ops
