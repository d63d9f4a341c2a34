"""Prompt prefixes kept encoded between calls: a prompt that starts like an earlier one encodes only the rest.

Chat clients resend the whole conversation every turn, and many requests open with the same system prompt,
so most of a server's prefill is work it has done before. `PrefixCache` keeps the keys and values of recent
prompts (one row each, least recently used first out, within a byte budget); `encode_prompts` builds a
batch's cache from them and encodes only each row's unseen tail.

Each row is encoded on its own, right-aligned in the batch cache (left padding only), so its slots hold what
one encode of its whole prompt would hold: no hole inside a row, which matters because sliding-window layers
count slots. At least the last prompt token is always encoded, so the AR loop gets its first logits.

One `PrefixCache` may serve several threads that generate at once (one LM shared by request threads): a lock
guards its entries and counters, held only for the bookkeeping, never while the model runs.
"""

from __future__ import annotations

import bisect
import struct
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .cache import KVCache
from .quantize import quantization_of


def _sort_key(ids: torch.Tensor) -> bytes:
    """`ids` [n] as bytes that sort as the id sequences do (4 big-endian bytes an id; ids are non-negative)."""
    return struct.pack(f">{ids.numel()}I", *ids.tolist())


def _shared(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first tokens the id rows `a` and `b` share."""
    m = min(a.numel(), b.numel())
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0, 0]) if differ.numel() else m


@dataclass
class _Entry:
    ids: torch.Tensor  # [n] long, on the CPU
    keys: list[torch.Tensor]  # per layer [kv_heads, n, head_dim]
    values: list[torch.Tensor]
    order: bytes = field(default=b"", repr=False)  # _sort_key(ids): its place in PrefixCache._sorted

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _settings_copy(cls: type[PrefixCache], settings: dict[str, Any]) -> PrefixCache:
    """A PrefixCache of class `cls` with `settings` (PrefixCache.__reduce__'s copy)."""
    return cls(**settings)


@dataclass
class PrefixCache:
    """Encoded prompts of one model, reusable by any later prompt that starts with the same tokens.

    `max_bytes`: the keys and values kept (least recently used prompts go first); `min_tokens`: shorter
    prompts are not kept, and a prompt that shares fewer tokens with every entry is encoded afresh (every prompt
    shares its BOS: reusing that alone made each row a lookup hit of 1 token, encoded alone instead of in one batch
    with the other new rows). An entry serves every prefix of itself, so a new prompt that extends an entry
    replaces it. Counters: `lookups` (rows encoded), `hits` (rows that reused something), `reused_tokens`.
    Thread-safe: calls in several threads may share one (each takes the lock for its lookups and updates only).
    """

    max_bytes: int = 1 << 30
    min_tokens: int = 16
    # The counters and the private fields below are state, not settings: init=False keeps them out of the
    # constructor and its signature (PrefixCache(hits=9) started a server's /metrics at made-up figures).
    lookups: int = field(default=0, init=False)
    hits: int = field(default=0, init=False)
    reused_tokens: int = field(default=0, init=False)
    _entries: OrderedDict[int, _Entry] = field(init=False, default_factory=OrderedDict, repr=False)
    # (_sort_key(ids), key) of every entry, in order: the entry sharing the longest prefix with a prompt sorts right
    # before or after it, so a lookup compares two entries, not all of them (a scan of every entry costs ~9 us each:
    # 0.07 s a lookup at 8,000 entries, two lookups a prompt row, where 1 GiB holds ~20,000 short prompts)
    _sorted: list[tuple[bytes, int]] = field(init=False, default_factory=list, repr=False)
    _next: int = field(init=False, default=0, repr=False)
    _layout: tuple | None = field(init=False, default=None, repr=False)
    _model: Any = field(init=False, default=None, repr=False)  # a weak reference to the model whose keys and values these are
    _version: tuple[int, int] | None = field(init=False, default=None, repr=False)  # that model's weights_version when they were encoded
    _bytes: int = field(init=False, default=0, repr=False)
    # Guards _entries, _bytes, _next, the model fields and the counters. An entry's tensors never change once
    # made, so a row copies from an entry it holds without the lock (an eviction meanwhile only drops the dict's
    # reference). Reentrant: check_model clears under it.
    _lock: threading.RLock = field(init=False, default_factory=threading.RLock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 0:
            raise ValueError(f"max_bytes: expected a non-negative integer, got {self.max_bytes!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 1:
            raise ValueError(f"min_tokens: expected a positive integer, got {self.min_tokens!r}")

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self) -> tuple:
        """A copy (copy.copy and copy.deepcopy alike, pickle: a server's settings saved, a multiprocessing worker's)
        has this one's settings, a subclass's fields included, and no entries: those are one model's keys and values
        in this process, which the copy cannot check it serves (a lock and a weak reference, which neither copies)."""
        return (_settings_copy, (type(self), {f.name: getattr(self, f.name) for f in fields(self) if f.init}))

    @property
    def nbytes(self) -> int:
        return self._bytes  # kept as a count, so another thread (a server's /metrics) can read it any time

    def clear(self) -> None:
        """Forget every entry, and the model they belonged to: the cache may then serve another one."""
        with self._lock:
            self._entries.clear()
            self._sorted.clear()
            self._bytes = 0
            self._layout = self._model = None

    def longest(self, ids: torch.Tensor) -> tuple[int | None, _Entry | None, int]:
        """(key of the entry sharing the longest prefix with `ids` [n] long, that entry, that prefix's length).
        The entry is returned too: another thread may evict it before `load`, which then still reads it.
        Of the kept prompts in sorted order, the one sharing the most with `ids` is a neighbour of where `ids` would
        sort (any prompt further away shares at most what the neighbour on that side shares): two are compared."""
        with self._lock:  # the comparisons run outside the lock
            i = bisect.bisect_left(self._sorted, (_sort_key(ids),))
            near = [(key, self._entries[key]) for _, key in self._sorted[max(0, i - 1) : i + 1]]
        best, best_entry, best_n = None, None, 0
        for key, entry in near:  # on a tie the one before: a kept prompt that `ids` extends sorts before it
            n = _shared(entry.ids, ids)
            if n > best_n:
                best, best_entry, best_n = key, entry, n
        return best, best_entry, best_n

    def count(self, reused: int) -> None:
        """Count one row's lookup, which reused `reused` tokens."""
        with self._lock:
            self.lookups += 1
            self.hits += reused > 0
            self.reused_tokens += reused

    def check_model(self, model: Any, cache: KVCache) -> None:
        """Entries only fit the model that made them: the same model object (another one with the same shapes
        has other weights, so its keys differ) and the same layout (layers, heads, head size, dtype, device).
        After that model's weights changed in place (lm.to, quantize: model.weights_version) they are stale: the
        cache drops them and fills again."""
        # Quantizing swaps the model's projections in place: same object, same layout, other keys and values.
        layout = (cache.layout, quantization_of(model))
        with self._lock:
            if self._model is not None and self._model() is model and self._version != model.weights_version:
                self.clear()
            if self._model is not None and self._model() is None:
                # the model that made them is gone: nothing can use them (a notebook that loads again would be
                # refused for good, and they held their memory): dropped, and the next model is this cache's
                self.clear()
            if self._layout is None:
                self._layout, self._model, self._version = layout, weakref.ref(model), model.weights_version
                return
            same = layout == self._layout and self._model() is model
        if not same:
            raise ValueError("prefix_cache: it holds keys and values of another model (another model object, "
                             "other layers, heads, dtype or device); use one "
                             "PrefixCache per model, or clear() it")

    def load(self, key: int, entry: _Entry, n: int, row: KVCache) -> None:
        """Copy the first `n` tokens of `entry` (`longest`'s) into the empty one-row cache `row`, and mark entry
        `key` used if it is still kept."""
        with self._lock:
            if self._entries.get(key) is entry:
                self._entries.move_to_end(key)
        for src, dst in ((entry.keys, row.keys), (entry.values, row.values)):
            for s, d in zip(src, dst):
                d[0, :, :n] = s[:, :n]
        row.commit(None, n)

    def add(self, ids: torch.Tensor, row: KVCache, replaces: int | None = None) -> None:
        """Keep the one-row cache `row`, which holds exactly `ids`. Entry `replaces` goes if it is a prefix of
        `ids` (the new entry serves everything it did)."""
        n = ids.numel()
        if n < self.min_tokens:
            return
        entry = _Entry(ids.clone(), [k[0, :, :n].clone() for k in row.keys], [v[0, :, :n].clone() for v in row.values],
                       _sort_key(ids))
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:  # the copies above are this call's own: only the bookkeeping is shared
            old = self._entries.get(replaces) if replaces is not None else None
            if (replaces is not None and old is not None and old.ids.numel() <= n
                    and torch.equal(old.ids, ids[: old.ids.numel()])):
                self._drop(replaces)
            while self._entries and self._bytes + entry.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))  # the least recently used
            self._entries[self._next] = entry
            bisect.insort(self._sorted, (entry.order, self._next))
            self._bytes += entry.nbytes
            self._next += 1

    def _drop(self, key: int) -> None:
        """Forget entry `key` (the lock held)."""
        entry = self._entries.pop(key)
        del self._sorted[bisect.bisect_left(self._sorted, (entry.order, key))]
        self._bytes -= entry.nbytes


def encode_prompts(
    model: Any, prompt: torch.Tensor, attention_mask: torch.Tensor | None, prefixes: PrefixCache, capacity: int,
    logits: bool = False,
) -> tuple[KVCache, torch.Tensor | None, list[int]]:
    """Encode a left-padded prompt batch [B, P] into a new cache of `capacity` slots, reusing `prefixes`.

    Returns (the cache, the last prompt token's logits [B, V] when `logits`, tokens reused per row of what was kept
    before this batch: a prompt's repeats in it reuse what its first row kept, and report none). For a
    left-padded batch (as blockpress pads) the cache is what `model.encode(prompt, cache, attention_mask)` would
    have built: same slots, same positions. Padding anywhere else ends up on the left.
    Rows that share nothing with the kept prompts are encoded together, as one batch (per-row calls cost a
    small model more than the tokens), a prompt repeated in the batch once; the others then each encode their own
    tail, and may also reuse what those fresh rows just added.
    """
    b, p = prompt.shape
    device = prompt.device
    cache = KVCache.allocate(model.config.text, b, capacity, model.dtype, model.device)
    prefixes.check_model(model, cache)
    mask = torch.ones_like(prompt, dtype=torch.bool) if attention_mask is None else attention_mask.bool().to(device)
    ids = [prompt[i][mask[i]].cpu() for i in range(b)]

    def view(i: int) -> KVCache:
        """Row i of the batch cache from where its tokens start: encoding into it writes the batch cache in place."""
        off = p - ids[i].numel()
        return KVCache([k[i : i + 1, :, off:] for k in cache.keys], [v[i : i + 1, :, off:] for v in cache.values],
                       cache.valid[i : i + 1, off:], cache.next_pos[i : i + 1])

    last: list[torch.Tensor | None] = [None] * b
    reused = [0] * b

    def reusable(shared: int, i: int) -> int:
        """What row i reuses of a `shared` prefix: its last token is always encoded (its logits start the AR loop),
        and less than min_tokens is not worth a row encoded alone (every prompt shares its BOS with every entry)."""
        n = min(shared, ids[i].numel() - 1)
        return n if n >= prefixes.min_tokens else 0

    fresh: list[int] = []
    firsts: set[tuple[int, ...]] = set()
    repeats: set[int] = set()  # rows that reuse what a row of this batch adds: nothing cached before it, as reported
    # what each row shares with what was kept before this batch: all it reports reused, though it may load more (a
    # longer entry an earlier row of this batch adds, as the rows of n choices that partly match an old one do)
    before = [reusable(prefixes.longest(ids[i])[2], i) for i in range(b)]
    for i in range(b):
        if before[i] > 0:
            continue
        # n sampled choices are n identical rows: only the first is encoded with the new rows; the others, once it
        # is kept, load it and encode their last token below (one too big to keep is encoded whole there)
        row_ids = tuple(ids[i].tolist())
        if row_ids in firsts and reusable(ids[i].numel(), i) > 0:
            repeats.add(i)
            continue
        firsts.add(row_ids)
        fresh.append(i)
    if fresh:
        from .generate import left_pad  # generate imports this module

        # Left-padded again: the caller's padding may be anywhere.
        tokens, valid = left_pad([ids[i].tolist() for i in fresh], pad_id=0)
        width = tokens.shape[1]
        valid = None if valid is None else valid.to(device)
        mode = "last" if logits else "none"
        if len(fresh) == b and width == p:  # every row is new (the common case): encode in place, as without reuse
            out = model.encode(tokens.to(device), cache, attention_mask=valid, logits=mode)
        else:  # a sub-batch of its own, then its slots copied into the right rows, right-aligned
            rows = torch.tensor(fresh, device=device)
            sub = KVCache.allocate(model.config.text, len(fresh), width, model.dtype, model.device)
            out = model.encode(tokens.to(device), sub, attention_mask=valid, logits=mode)
            for dst, src in zip((*cache.keys, *cache.values), (*sub.keys, *sub.values)):
                dst[rows, :, p - width : p] = src[:, :, :width]
            cache.next_pos[rows] = sub.next_pos
        for j, i in enumerate(fresh):
            last[i] = None if out is None else out[j : j + 1]
            key, _, shared = prefixes.longest(ids[i])  # a row of this batch may have added the same prompt already
            if shared < ids[i].numel():
                prefixes.add(ids[i], view(i), replaces=key)
    for i in range(b):
        if i in fresh:
            prefixes.count(0)
            continue
        # another thread may have evicted what this row matched at first: then it shares less, maybe nothing
        key, entry, shared = prefixes.longest(ids[i])
        n = reusable(shared, i)
        row = view(i)
        if n > 0 and key is not None and entry is not None:  # (n > 0: an entry shares it)
            prefixes.load(key, entry, n, row)
        last[i] = model.encode(ids[i][n:][None].to(device), row, logits="last" if logits else "none")
        if shared < ids[i].numel():  # an entry that already holds all of `ids` serves it as it is
            prefixes.add(ids[i], row, replaces=key)
        # (a repeat's tokens were encoded by this batch: none came from before it, as OpenAI's cached_tokens counts)
        reused[i] = 0 if i in repeats else min(n, before[i])
        prefixes.count(reused[i])
    lengths = torch.tensor([x.numel() for x in ids], device=cache.device)
    cache.valid[:, :p] = torch.arange(p, device=cache.device)[None, :] >= p - lengths[:, None]
    cache.length = p
    cache.has_padding = bool((lengths < p).any())
    return cache, torch.cat(last) if logits else None, reused  # type: ignore[arg-type]
