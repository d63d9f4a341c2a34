"""The KV cache: owned by the caller, allocated once for a generation (a continued conversation grows it with
`ensure_capacity` only when a turn needs more room); its encoded slots are written only by encoding (the
encoder, or a prefix cache copying in slots it encoded before).

Layout: one key and one value tensor per layer, `[batch, kv_heads, capacity, head_dim]`, plus a
`[batch, capacity]` validity mask. Rows of a batch share one slot count; a row with a shorter prompt is
left-padded, masked slots are never attended, and each row's positions count only its valid slots, so a
row computes exactly what it would compute alone.

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
    next_pos: torch.Tensor  # [B] long: the position the row's next valid token gets
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
        next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(keys=keys, values=values, valid=valid, next_pos=next_pos)

    def buffers_key(self) -> tuple:
        """Where every buffer lives, and the host flag that picks the masked path: what a CUDA graph bakes in.
        A graph captured on one cache replays correctly on any cache with the same key (the same memory), and
        on no other: id() or the first buffer's address alone can match a new cache whose other buffers moved."""
        return (self.has_padding, self.valid.data_ptr(), self.next_pos.data_ptr(),
                *(t.data_ptr() for t in self.keys), *(t.data_ptr() for t in self.values))

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def device(self) -> torch.device:
        return self.valid.device

    @property
    def layout(self) -> tuple:
        """What ties a cache to a model's shape: (kv heads, head size) per layer, dtype, device."""
        return tuple((k.shape[1], k.shape[3]) for k in self.keys), self.keys[0].dtype, self.device

    @staticmethod
    def layout_for(config: TextConfig, dtype: torch.dtype, device: torch.device) -> tuple:
        """The `layout` of a cache that `allocate(config, ..., dtype, device)` builds."""
        return tuple((spec.num_kv_heads, spec.head_dim) for spec in config.layers), dtype, torch.device(device)

    def reset(self) -> None:
        self.length = 0
        self.valid.fill_(True)
        self.next_pos.zero_()
        self.has_padding = False

    def truncate(self, length: int) -> None:
        """Forget everything after `length` slots (multi-turn edits, retries). Cheap: no copy."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length must be in [0, {self.length}], got {length}")
        self.length = length
        self.next_pos.copy_(self.valid[:, :length].sum(dim=1))
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

    def ensure_capacity(self, capacity: int) -> None:
        """Grow (by reallocating once, at least doubling) so that `capacity` slots fit. Multi-turn chats use it."""
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity)
        n = self.length
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                grown = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                grown[:, :, :n] = t[:, :, :n]
                tensors[i] = grown
        valid = self.valid.new_ones(self.batch_size, new)
        valid[:, :n] = self.valid[:, :n]
        self.valid = valid

    def end_rows(self, ends: torch.Tensor) -> None:
        """Row r keeps its slots before `ends[r]`; the later ones (what it encoded after it ended, pads) become
        padding, moved to the left (`compact`). A single row is truncated instead."""
        if self.batch_size == 1:
            self.truncate(int(ends[0]))
            return
        n = self.length
        self.valid[:, :n] &= torch.arange(n, device=self.device)[None, :] < ends.to(self.device)[:, None]
        self.next_pos.copy_(self.valid[:, :n].sum(dim=1))
        self.has_padding = bool((~self.valid[:, :n]).any())
        self.compact()

    def compact(self) -> None:
        """Move each row's valid slots to the end of the encoded ones, in order, so padding is only on the left.

        A batch leaves holes behind a row that ended before the others (its later slots are invalid). Sliding
        windows count slots, so tokens encoded after such a hole (the next turn of a conversation) would see
        fewer earlier tokens than they do alone; after compacting they see exactly what they would. Keys already
        hold their rotary positions, so moving them changes nothing else.
        """
        n = self.length
        valid = self.valid[:, :n]
        if n == 0 or not bool((valid[:, :-1] & ~valid[:, 1:]).any()):  # already left-padded
            return
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)  # invalid slots first, each kind in order
        for tensors in (self.keys, self.values):
            for t in tensors:
                index = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t[:, :, :n] = t[:, :, :n].gather(2, index)
        self.valid[:, :n] = valid.gather(1, order)
        self.has_padding = True

    def positions(self, new_tokens: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Positions [B, L] of the next tokens: each row counts only its valid slots."""
        if mask is None:
            return self.next_pos[:, None] + torch.arange(new_tokens, device=self.device)[None, :]
        return self.next_pos[:, None] + (mask.long().cumsum(dim=1) - 1).clamp(min=0)

    def commit(self, mask: torch.Tensor | None, new_tokens: int) -> None:
        """Record `new_tokens` encoded slots (mask: 1 = token, 0 = padding that is never attended)."""
        start = self.length
        if mask is None:
            self.next_pos += new_tokens
        else:
            mask = mask.to(device=self.device, dtype=torch.bool)
            self.valid[:, start : start + new_tokens] = mask
            self.next_pos += mask.sum(dim=1)
            if not bool(mask.all()):
                self.has_padding = True
        self.length = start + new_tokens

    def rows(self, index: torch.Tensor, scratch: int) -> KVCache:
        """A new cache holding only the rows `index` (the encoded slots plus `scratch` free ones).

        Decoding uses it to stop computing rows of a batch that have finished their canvas. Each call copies the
        rows kept, so decoding calls it only when at least half the working rows have stopped.
        """
        n = self.length
        # slice, then select: index_select writes a fresh tensor of just the slots kept (one copy, not two)
        keys = [t[:, :, : n + scratch].index_select(0, index) for t in self.keys]
        values = [t[:, :, : n + scratch].index_select(0, index) for t in self.values]
        valid = self.valid[:, : n + scratch].index_select(0, index)
        has_padding = bool((~valid[:, :n]).any()) if n else False
        return KVCache(keys, values, valid, self.next_pos.index_select(0, index), n, has_padding)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
