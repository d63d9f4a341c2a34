"""The KV cache: owned by the caller, allocated once, written only by the encoder.

Layout: one key and one value tensor per layer, `[batch, kv_heads, capacity, head_dim]`, plus a
`[batch, capacity]` validity mask for left padding. Rows of a batch share one length; a row with a
shorter prompt is left-padded, and its positions are `slot - pad[row]` so it computes exactly what it
would compute alone.

The decoder (denoise) writes the canvas' own keys/values into the slots just past `length` as scratch
space and never advances `length`: the cache's state is unchanged, and no per-step concatenation is
needed. That is why `capacity` must leave room for one canvas past the last encoded token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TextConfig


@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [B, capacity] bool: False on left padding
    pad: torch.Tensor  # [B] long: left-padding slots of each row (positions are slot - pad)
    length: int = 0  # encoded slots, shared by all rows
    has_padding: bool = False  # host-side flag so unpadded batches skip mask building

    @classmethod
    def allocate(
        cls,
        config: TextConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        if batch_size <= 0 or capacity <= 0:
            raise ValueError(f"KVCache: batch_size and capacity must be positive, got {batch_size}, {capacity}")
        keys, values = [], []
        for spec in config.layers:
            shape = (batch_size, spec.num_kv_heads, capacity, spec.head_dim)
            keys.append(torch.zeros(shape, dtype=dtype, device=device))
            values.append(torch.zeros(shape, dtype=dtype, device=device))
        valid = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)
        pad = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(keys=keys, values=values, valid=valid, pad=pad)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def device(self) -> torch.device:
        return self.valid.device

    def reset(self) -> None:
        self.length = 0
        self.valid.fill_(True)
        self.pad.zero_()
        self.has_padding = False

    def truncate(self, length: int) -> None:
        """Forget everything after `length` slots (multi-turn edits, retries). Cheap: no copy."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length must be in [0, {self.length}], got {length}")
        self.length = length
        if length <= int(self.pad.max()):
            # Truncated into some row's padding: that padding is gone, the row restarts at slot `length`.
            self.pad.clamp_(max=length)
        self.valid[:, length:] = True
        self.has_padding = bool((~self.valid[:, :length]).any()) if length else False

    def reserve(self, new_tokens: int, scratch: int = 0) -> None:
        """Check that `new_tokens` more slots (plus `scratch` decoder slots) fit, with a clear error."""
        need = self.length + new_tokens + scratch
        if need > self.capacity:
            raise ValueError(
                f"KVCache: needs {need} slots ({self.length} used + {new_tokens} new + {scratch} canvas scratch) "
                f"but was allocated with capacity {self.capacity}"
            )

    def mark_padding(self, attention_mask: torch.Tensor) -> None:
        """Record left padding for the next `attention_mask.shape[1]` slots (1 = token, 0 = pad)."""
        n = attention_mask.shape[1]
        self.reserve(n)
        mask = attention_mask.to(device=self.device, dtype=torch.bool)
        self.valid[:, self.length : self.length + n] = mask
        if not bool(mask.all()):
            if self.length:
                raise ValueError("attention_mask: padding is only supported on the first (prompt) segment")
            # Left padding only: every row must be pads followed by tokens.
            if bool((mask[:, 1:].int() - mask[:, :-1].int() < 0).any()):
                raise ValueError("attention_mask: expected left padding (zeros before ones in each row)")
            self.pad.copy_((~mask).sum(dim=1))
            self.has_padding = True

    def row_state(self, rows: torch.Tensor) -> KVCache:
        """A new cache holding a copy of the given rows (used to split a batch)."""
        return KVCache(
            keys=[k[rows].clone() for k in self.keys],
            values=[v[rows].clone() for v in self.values],
            valid=self.valid[rows].clone(),
            pad=self.pad[rows].clone(),
            length=self.length,
            has_padding=self.has_padding,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
