"""The KV cache: owned by the caller, allocated once for a generation (a continued conversation grows it with
`ensure_capacity` only when a turn needs more room); its encoded slots are written only by encoding (the
encoder, or a prefix cache copying in slots it encoded before), and moved within a row by compaction.

Layout: one key and one value tensor per layer, `[batch, kv_heads, capacity, head_dim]`, plus a
`[batch, capacity]` validity mask. Rows of a batch share one slot count; a row with a shorter prompt is
left-padded, masked slots are never attended, and each row's positions count only its valid slots, so a
row computes exactly what it would compute alone.

A batch's layout moves: continuing it (and ending rows at different points) compacts each row's slots so its
padding stays on the left, so slot `i` does not keep holding the token it held. `mark` records what each row
holds instead, and `truncate(mark)` goes back to exactly that, whatever moved in between.

The decoder (denoise) writes the canvas' own keys/values into the slots just past `length` as scratch
space and never advances `length`: the cache's state is unchanged, and no per-step concatenation is
needed. That is why `capacity` must leave room for one canvas past the last encoded token.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch

from .checks import allocation_failed, is_int, outside_inference_mode
from .config import TextConfig

# Why a mark is gone, unless the caller that went back says otherwise (KVCache.keep's `why`)
_WENT_BACK = "the cache went back to before it since (truncate or reset)"


@dataclass(eq=False)  # compared by identity: a cache keeps its live marks in a WeakSet
class CacheMark:
    """Where a cache's conversation ended when `KVCache.mark` was called: each row's token count, which stays
    true however the slots move (a row's tokens keep their order), and the slot count then."""

    length: int
    counts: tuple[int, ...]  # [B] the row's valid slots: its conversation's tokens
    cache: weakref.ref = field(repr=False, compare=False)
    # Why the cache dropped it (None while it holds): what truncate(mark) then tells the caller, who may not have
    # gone back themselves (lm.chat keeps only what a re-rendered conversation shares with the cache).
    gone: str | None = field(default=None, repr=False, compare=False)
    # The cache's moved_from then, where its rows were laid out left-padded (else False): going back lays them out so,
    # every slot where it was, and truncate(int) may take what it could take then
    moved_from: int | None | bool = field(default=False, repr=False, compare=False)
    # The cache's known tokens then (None: not known), for truncate to bring back: an encode since forgot them
    # (commit), and LM.chat continues only a cache whose tokens are known
    tokens: list[list[int]] | None = field(default=None, repr=False, compare=False)


@dataclass(eq=False)  # one call's own: compared (removed from a cache's users) as itself
class Claim:
    """A call's hold on a cache (KVCache.in_use): the thread running it (a stream's: the thread iterating it now)
    and whether it is suspended (a stream between its events)."""

    thread: int
    suspended: bool = False


@dataclass(repr=False)  # (__repr__ below: the generated one printed every layer's keys and values)
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [B, capacity] bool: False on left padding
    next_pos: torch.Tensor  # [B] long: the position the row's next valid token gets
    length: int = 0  # encoded slots, shared by all rows
    has_padding: bool = False  # host-side flag so unpadded batches skip mask building
    # The first slot whose token moved (compaction, going back to a mark) since it was encoded (None: none did):
    # truncate(int) keeps slots, which are the conversation's start only while they have not moved.
    moved_from: int | None = field(default=None, repr=False, compare=False)
    # Marks still on this cache's history: going back below one (then encoding more) drops it.
    marks: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False, compare=False)
    # The token ids each row holds, where known (None: not known): `LM.chat` records them, to encode only what a
    # re-rendered conversation adds. An encode that does not record them forgets them; going back keeps what
    # each row still holds (a row's tokens are its conversation's first `next_pos`).
    tokens: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # The model's weights_version when a generation filled it (None: none did): after lm.to or quantize the keys
    # are the old weights', and LM refuses to continue it.
    weights_version: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    # The threads of the calls continuing this cache now, one entry a call, and the lock their entry is taken under
    # (see `in_use`). A copy (copy.deepcopy, pickle) is held by no call: see __getstate__.
    users: list[Claim] = field(default_factory=list, init=False, repr=False, compare=False)
    _claim: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        """This cache's state for a copy, without its calls' claims: a copy taken while a call held the cache (a
        branch of the conversation) is free, not refused to other threads forever. (A lock does not copy.)"""
        state = self.__dict__.copy()
        del state["_claim"]
        state["users"] = []
        # nor its marks: a mark names the cache it was made on (truncate refuses it on a copy), and a WeakSet and
        # the marks' weak references do not pickle, which made a cache (and an output holding one) unpicklable
        del state["marks"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._claim = threading.Lock()
        self.marks = weakref.WeakSet()

    def release(self, claim: Claim) -> None:
        """Let `claim` go before its call ends: a stream that has handed out its last event (Done, Cancelled) writes
        the cache no more, though its caller may hold it open (a `break` at Done, a notebook's `next`)."""
        with self._claim, suppress(ValueError):
            self.users.remove(claim)

    @contextmanager
    def in_use(self) -> Iterator[Claim]:
        """Held by each call that continues this cache (generate, stream, generate_ar and chat with cache=...): a
        call from another thread meanwhile is refused, as both would write the same slots and each reply read the
        other's tokens; so is any call while a stream continuing it is suspended between its events (two async
        handlers taking turns on one event loop's thread, a stream's consumer calling generate): the stream, resumed,
        would go on over the other call's tokens. Calls of one thread nest (chat runs generate, generate a stream).
        A stream marks its claim suspended at each event it hands out and moves it to the thread that resumes it
        (an executor's pool threads), releasing it where it ends, in whatever thread closes it."""
        me = threading.get_ident()
        claim = Claim(me)  # this call's own entry: given back only if taken, wherever a Ctrl-C lands
        try:
            with self._claim:  # (checked and taken at once)
                if any(other.thread != me for other in self.users):
                    raise ValueError("cache: in use by a call in another thread; a KVCache (a conversation) is "
                                     "continued by one call at a time: wait for that call to end, or give each "
                                     "thread its own cache")
                if any(other.suspended for other in self.users):
                    raise ValueError("cache: in use by a stream that is open, suspended between its events; a KVCache "
                                     "(a conversation) is continued by one call at a time: finish or close that "
                                     "stream first, or give this call its own cache")
                self.users.append(claim)
            yield claim
        finally:
            with suppress(ValueError):  # (not there: refused, or stopped before it was taken)
                self.users.remove(claim)

    # A cache outlives the call that made it: its tensors are made outside torch.inference_mode, even under one, so
    # that it can be continued in either mode (an inference tensor refuses in-place writes outside inference mode).
    @classmethod
    @outside_inference_mode
    def allocate(
        cls,
        config: TextConfig,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        for name, value in (("batch_size", batch_size), ("capacity", capacity)):
            if not is_int(value) or value <= 0:  # 2.0 or "2" would fail inside torch.zeros; True would pass for 1
                raise ValueError(f"KVCache: {name}: expected a positive int, got {value!r}")
        batch_size, capacity = int(batch_size), int(capacity)  # numpy integers: plain ones, as the shapes hold
        nbytes = cls.allocation_bytes(config, dtype, batch_size, capacity)
        if nbytes >= 2**63:  # sizes are int64: past that, torch.zeros fails ('Overflow when unpacking long long')
            raise ValueError(f"KVCache: batch_size {batch_size} x capacity {capacity} would take {nbytes:.3g} bytes, "
                             "past what any device addresses (2**63)")
        keys, values = [], []
        with _allocating(f"batch_size {batch_size} x capacity {capacity}", nbytes):
            for spec in config.layers:
                shape = (batch_size, spec.num_kv_heads, capacity, spec.head_dim)
                keys.append(torch.zeros(shape, dtype=dtype, device=device))
                values.append(torch.zeros(shape, dtype=dtype, device=device))
            valid = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)
            next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(keys=keys, values=values, valid=valid, next_pos=next_pos)

    @staticmethod
    def bytes_per_token(config: TextConfig, dtype: torch.dtype) -> int:
        """One row's keys and values per token, all layers, in `dtype`: every layer keeps every token (sliding ones
        too), so a cache of capacity N takes N times this per row. What `blockpress info` reports and what
        `blockpress bench` checks a run against before it starts."""
        return 2 * dtype.itemsize * sum(spec.num_kv_heads * spec.head_dim for spec in config.layers)

    @classmethod
    def allocation_bytes(cls, config: TextConfig, dtype: torch.dtype, batch_size: int, capacity: int) -> int:
        """The bytes `allocate(config, batch_size, capacity, dtype)` takes: keys and values, then the validity mask
        and the positions."""
        return batch_size * capacity * (cls.bytes_per_token(config, dtype) + 1) + batch_size * 8

    def buffers_key(self) -> tuple:
        """Where every buffer lives, and the host flag that picks the masked path: what a CUDA graph bakes in.
        A graph captured on one cache replays correctly on any cache with the same key (the same memory), and
        on no other: id() or the first buffer's address alone can match a new cache whose other buffers moved."""
        return (self.has_padding, self.valid.data_ptr(), self.next_pos.data_ptr(),
                *(t.data_ptr() for t in self.keys), *(t.data_ptr() for t in self.values))

    def __repr__(self) -> str:
        """One line (a notebook shows `out.cache`): the generated repr printed each layer's keys and values, 11,626
        characters for blockpress-code's, 682,744 for a 30-layer model's, copied from the device on a GPU."""
        dtype = self.keys[0].dtype if self.keys else None
        return (f"KVCache(rows={self.batch_size}, layers={len(self.keys)}, length={self.length}, "
                f"capacity={self.capacity}, dtype={dtype}, device={self.device})")

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
        self._rewound()

    def mark(self) -> CacheMark:
        """Where the conversation ends now, for `truncate` to go back to (branch, retry; as often as wanted). It
        holds until the cache goes back to before it: then what it marked may be overwritten."""
        m = CacheMark(self.length, tuple(self.next_pos.tolist()), weakref.ref(self),
                      moved_from=False if self._holes() else self.moved_from,
                      tokens=None if self.tokens is None else [list(row) for row in self.tokens])
        self.marks.add(m)
        return m

    def truncate(self, to: int | CacheMark) -> None:
        """Forget everything after a `mark` (each row goes back to exactly what it held then, whatever moved in
        between), or after the first `to` slots. Multi-turn edits and retries; no copy unless slots moved.

        A slot count is only the conversation's start while those slots have not moved: a batch's continuation
        compacts each row's history, so then it is refused (use a mark). A mark is refused once the cache went
        back to before it (its tokens may have been overwritten), or when it is another cache's."""
        if isinstance(to, CacheMark):
            if to.cache() is not self:
                raise ValueError("KVCache.truncate: this mark was made on another cache")
            if to not in self.marks:
                raise ValueError(f"KVCache.truncate: this mark is gone: {to.gone or _WENT_BACK}, so what it marked "
                                 "may have been overwritten")
            self._left_pad(torch.tensor(to.counts, device=self.device), to.length)
            self._rewound()
            if to.moved_from is not False:  # every slot back where it was when marked
                self.moved_from = to.moved_from
            if to.tokens is not None:  # (else _rewound kept what is known of them)
                self.tokens = [list(row) for row in to.tokens]
            return
        if not isinstance(to, int) or isinstance(to, bool):
            raise ValueError(f"KVCache.truncate: expected a slot count (int) or a CacheMark, got {type(to).__name__}")
        if not 0 <= to <= self.length:
            raise ValueError(f"KVCache.truncate: length must be in [0, {self.length}], got {to}")
        if to == self.length:
            return
        if self.moved_from is not None and to > self.moved_from:
            raise ValueError(
                f"KVCache.truncate: slots {self.moved_from} and on moved since they were encoded (continuing a "
                f"batch compacts each row's history so its padding stays on the left), so the first {to} slots are "
                "no longer where the conversation stood: note `mark = cache.mark()` and `cache.truncate(mark)`")
        self._cut(to)

    def keep(self, counts: list[int], why: str | None = None) -> None:
        """Row r keeps its first `counts[r]` tokens (at most what it holds) and forgets the rest: a batch going back
        a different way in each row (LM.chat keeps what each re-rendered conversation shares with the cache).
        `why`: what a mark this drops says in truncate's error (default: the cache went back by truncate or reset)."""
        held = self.next_pos.tolist()
        if len(counts) != len(held) or not all(is_int(c) and 0 <= c <= h for c, h in zip(counts, held)):
            raise ValueError(f"KVCache.keep: expected one count per row, each at most what the row holds ({held}), "
                             f"got {counts}")
        if counts == held:
            return
        self._left_pad(torch.tensor(counts, device=self.device), max(counts))
        self._rewound(why)

    def _cut(self, length: int) -> None:
        """Keep the first `length` slots as they are."""
        self.length = length
        self.next_pos.copy_(self.valid[:, :length].sum(dim=1))
        self.valid[:, length:] = True
        self.has_padding = bool((~self.valid[:, :length]).any()) if length else False
        self._rewound()

    def _rewound(self, why: str | None = None) -> None:
        """After the conversation got shorter: slots past the end are gone, and so are the marks past it (what
        they held will be overwritten); `why` is what such a mark then says (default: `_WENT_BACK`)."""
        if self.moved_from is not None and self.moved_from >= self.length:
            self.moved_from = None
        if self.tokens is not None:
            self.tokens = [row[:n] for row, n in zip(self.tokens, self.next_pos.tolist())]
        if len(self.marks):
            held = self.next_pos.tolist()
            for m in list(self.marks):
                if any(c > h for c, h in zip(m.counts, held)):
                    m.gone = why or _WENT_BACK
                    self.marks.discard(m)

    def reserve(self, new_tokens: int, scratch: int = 0) -> None:
        """Check that `new_tokens` more slots (plus `scratch` decoder slots) fit, with a clear error."""
        need = self.length + new_tokens + scratch
        if need > self.capacity:
            raise ValueError(
                f"KVCache: needs {need} slots ({self.length} used + {new_tokens} new + {scratch} canvas scratch) "
                f"but was allocated with capacity {self.capacity}"
            )

    @outside_inference_mode
    def ensure_capacity(self, capacity: int, most: int | None = None) -> None:
        """Grow (by reallocating once, at least doubling) so that `capacity` slots fit. Multi-turn chats use it.
        `most`: the slots the model can ever use (its context and a canvas of scratch); doubling stops there, so a
        chat near the context does not get a cache twice the size any turn could fill."""
        if capacity <= self.capacity:
            return
        doubled = 2 * self.capacity if most is None else min(2 * self.capacity, most)
        new = max(capacity, doubled)
        n = self.length
        grown_bytes = sum(t.element_size() * t[:, :, :1].numel() for t in (*self.keys, *self.values)) * new
        # every tensor allocated before any replaces its old one: a failure part way left the first layers grown
        # (their memory held, where the error says to retry with less) beside a validity mask of the old capacity
        with _allocating(f"batch_size {self.batch_size} x capacity {new} (grown from {self.capacity})", grown_bytes):
            keys, values = ([t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3]) for t in old]
                            for old in (self.keys, self.values))
            valid = self.valid.new_ones(self.batch_size, new)
        for grown, old in zip((*keys, *values), (*self.keys, *self.values)):
            grown[:, :, :n] = old[:, :, :n]
        valid[:, :n] = self.valid[:, :n]
        self.keys[:], self.values[:], self.valid = keys, values, valid  # (the lists kept: views of them stay whole)

    def end_rows(self, ends: torch.Tensor) -> None:
        """Row r keeps its slots before `ends[r]`; the later ones (what it encoded after it ended, pads) become
        padding, moved to the left (`compact`). A single row is truncated instead."""
        if self.batch_size == 1:
            self._cut(int(ends[0]))
            return
        n = self.length
        self.valid[:, :n] &= torch.arange(n, device=self.device)[None, :] < ends.to(self.device)[:, None]
        self.next_pos.copy_(self.valid[:, :n].sum(dim=1))
        self.has_padding = bool((~self.valid[:, :n]).any())
        self.compact()
        self._rewound()

    def compact(self) -> None:
        """Move each row's valid slots to the end of the encoded ones, in order, so padding is only on the left.

        A batch leaves holes behind a row that ended before the others (its later slots are invalid). Sliding
        windows count slots, so tokens encoded after such a hole (the next turn of a conversation) would see
        fewer earlier tokens than they do alone; after compacting they see exactly what they would. Keys already
        hold their rotary positions, so moving them changes nothing else. The slots that are then padding in every
        row are let go (the cache ends at its longest row): kept, they would grow with every turn whose rows write
        unlike lengths, each attended to.
        """
        if not self._holes():  # already left-padded
            return
        counts = self.valid[:, : self.length].sum(dim=1)
        self._left_pad(counts, int(counts.max()))

    def _holes(self) -> bool:
        """Whether a row has padding after a token (a host sync): the layout compact and going back to a mark undo."""
        valid = self.valid[:, : self.length]
        return bool((valid[:, :-1] & ~valid[:, 1:]).any())

    def _left_pad(self, counts: torch.Tensor, length: int) -> None:
        """Keep each row's first `counts[r]` valid slots, in order, moved to the end of the first `length` slots
        (padding on the left: the layout of a left-padded batch encoded in one pass); forget the rest. In place,
        and no copy when nothing moves (a single row never does)."""
        n = self.length
        old = self.valid[:, :length].clone()  # past n: True, unencoded
        slots = torch.arange(length, device=self.device)[None, :]
        rank = slots - (length - counts)[:, None]  # the target slot's place among the row's kept tokens
        new = rank >= 0
        changed = new ^ old
        if n:
            valid = self.valid[:, :n]
            keep = valid & (valid.cumsum(dim=1) <= counts[:, None])
            order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept slots first, in order
            source = order.gather(1, rank.clamp(0, n - 1))
            changed |= new & (source != slots)
        moved = changed.any(dim=0).nonzero()
        if moved.numel():
            first = int(moved[0, 0])
            self.moved_from = first if self.moved_from is None else min(self.moved_from, first)
            if n:
                for tensors in (self.keys, self.values):
                    for t in tensors:
                        index = source[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                        t[:, :, :length] = t[:, :, :n].gather(2, index)
        self.valid[:, :length] = new
        self.valid[:, length:] = True
        self.next_pos.copy_(counts)
        self.length = length
        self.has_padding = bool((~new).any())

    def positions(self, new_tokens: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Positions [B, L] of the next tokens: each row counts only its valid slots."""
        if mask is None:
            return self.next_pos[:, None] + torch.arange(new_tokens, device=self.device)[None, :]
        return self.next_pos[:, None] + (mask.long().cumsum(dim=1) - 1).clamp(min=0)

    def commit(self, mask: torch.Tensor | None, new_tokens: int) -> None:
        """Record `new_tokens` encoded slots (mask: 1 = token, 0 = padding that is never attended)."""
        start = self.length
        self.tokens = None  # what was encoded is not known here (LM.chat records it after its turn)
        if mask is None:
            self.next_pos += new_tokens
        else:
            mask = mask.to(device=self.device, dtype=torch.bool)
            self.valid[:, start : start + new_tokens] = mask
            self.next_pos += mask.sum(dim=1)
            if not bool(mask.all()):
                self.has_padding = True
        self.length = start + new_tokens

    @outside_inference_mode
    def rows(self, index: torch.Tensor, scratch: int) -> KVCache:
        """A new cache holding only the rows `index` (the encoded slots plus `scratch` free ones).

        Decoding uses it to stop computing rows of a batch that have finished their canvas. Each call copies the
        rows kept, so within a canvas decoding calls it only when at least half the working rows have stopped; at a
        canvas's start, for the rows that ended in an earlier one: once where no cache is handed back (the batch's
        cache then holds them no more), at each canvas where one is.
        """
        n = self.length
        # slice, then select: index_select writes a fresh tensor of just the slots kept (one copy, not two)
        keys = [t[:, :, : n + scratch].index_select(0, index) for t in self.keys]
        values = [t[:, :, : n + scratch].index_select(0, index) for t in self.values]
        valid = self.valid[:, : n + scratch].index_select(0, index)
        has_padding = bool((~valid[:, :n]).any()) if n else False
        return KVCache(keys, values, valid, self.next_pos.index_select(0, index), n, has_padding,
                       weights_version=self.weights_version)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@contextmanager
def _allocating(what: str, nbytes: int) -> Iterator[None]:
    """A cache's allocation, whose failure says what is asked (the allocator's own message names neither the cache
    nor the count behind it, only 'tried to allocate N bytes'). Raised as
    torch.OutOfMemoryError whatever the device, so that one handler (the CLI's, the server's) takes both."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not allocation_failed(exc):
            raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise torch.OutOfMemoryError(
            f"KVCache: {what} positions need {nbytes / 2**30:,.1f} GiB, which the device could not allocate "
            f"({reason}); ask for fewer new tokens (max_new_tokens; the server's max_tokens) or fewer rows") from None
