"""The block-diffusion decoding loop, and the autoregressive baseline on the same backbone.

`run` is the one implementation: a generator of events (`Draft` each step when asked, `Commit` each
canvas, `Done` at the end, or `Cancelled` where the caller's `cancelled` ended it). `generate` drains it;
`stream` hands it to the caller; the CLI and the server are built on `stream`.
"""

from __future__ import annotations

import inspect
import numbers
import os
import re
import time
from array import array
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from os.path import commonprefix
from typing import Any, cast

import numpy as np
import torch

import blockpress

from .cache import KVCache
from .checks import check_flag, check_keywords, check_text, is_int, utf8_problem
from .healing import strip_prefix
from .model import DiffusionGemma
from .prefix import PrefixCache, encode_prompts
from .sampling import (
    CanvasRules,
    CanvasState,
    RowDraws,
    SamplerConfig,
    StepNumbers,
    candidate_probs,
    choice_seed,
    denoise_step,
    hashed_uniforms,
    init_state,
    noise_tokens,
    penalize_repeats,
    put_rows,
    sample,
    take_rows,
)
from .tokenizer import TextStream

# A marker and the backslashes right before it (they escape it): ASCII digits, as \d would take "３" or "٣" as well
_HOLE_RE = re.compile(r"(\\*)(<\|hole(?::([0-9]+))?\|>)")
# Anything that starts like a marker, with the backslashes right before it: a mistyped one unless escaped, every
# marker too. Only "<|hole" is consumed, so the next one's backslashes stay its own; group 2 is what a typo looks
# like after it (closed wrongly within a few characters, or not closed at all), for the error.
_NEAR_HOLE_RE = re.compile(r"(\\*)<\|\s*hole(?=([^<>\n]{0,16}>|[^<>\n]{0,16}))", re.IGNORECASE)


@dataclass(frozen=True)
class StepFunctions:
    """What the decoding loops call once per step: the decoder pass, the sampler step and, for the AR
    baseline, the one-token encoder pass. Plain methods by default; `compiled` wraps the same functions in
    torch.compile, so the model and the sampler stay ordinary eager code."""

    denoise: Callable[..., torch.Tensor]
    sampler_step: Callable[..., CanvasState]
    encode_step: Callable[..., torch.Tensor | None]

    @classmethod
    def eager(cls, model: DiffusionGemma) -> StepFunctions:
        return cls(model.denoise, denoise_step, model.encode)

    @classmethod
    def compiled(cls, model: DiffusionGemma, **options: Any) -> StepFunctions:
        """torch.compile'd step functions (`options` go to torch.compile, e.g. mode or backend). The first
        calls compile (minutes on a 2-core CPU, even for a tiny model); a changing cache length recompiles once as dynamic,
        and the sampler's numbers are tensors (StepNumbers), so new values compile nothing (see LM.compile)."""
        check_compile_options(options)
        if "recompile_limit" in inspect.signature(torch.compile).parameters:  # (torch 2.13; older ones keep 8)
            import torch._dynamo as dynamo  # (torch.compile's own, loaded on its first use)

            # never below a limit the process raised for itself (a function's own limit wins over dynamo's config)
            limit = max(RECOMPILE_LIMIT, getattr(dynamo.config, "recompile_limit", 0))
            options = {"recompile_limit": limit, **options}
        return cls(torch.compile(model.denoise, **options), torch.compile(denoise_step, **options),
                   torch.compile(model.encode, **options))

    @classmethod
    def cuda_graphs(cls, model: DiffusionGemma) -> StepFunctions:
        """The decoder pass and the AR one-token encoder pass replayed from CUDA graphs (GraphedDenoise,
        GraphedEncodeStep); the sampler stays eager."""
        return cls(GraphedDenoise(model), denoise_step, GraphedEncodeStep(model))


# Graphs a compiled step may hold before it runs eagerly (torch's default: 8). Each kind of batch (one row or
# several, padded or not, a canvas's first step or a later one, a fixed cache length then a dynamic one) takes a
# graph of its own: a plain user's first few kinds of batch can fill torch's 8 for the decoder pass, and every
# batch after them would decode eagerly.
RECOMPILE_LIMIT = 32

# torch.compile's modes as its documentation lists them, for a torch that does not list them itself
# (torch._inductor.list_mode_options)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile_options(options: Mapping[str, Any]) -> None:
    """Refuse, by name, a keyword torch.compile does not take, and an unknown mode for its default compiler
    (inductor), as every other bad argument is: torch's are a RuntimeError ('Unrecognized mode=x') and a
    TypeError, which an app that catches ValueError for bad parameters would miss."""
    parameters = inspect.signature(torch.compile).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):  # (a wrapper's **options: any)
        check_keywords("compile", options, [name for name in parameters if name != "model"])
    backend = options.get("backend")
    if isinstance(backend, str):  # (a callable is a backend of the caller's own)
        try:  # torch names an unknown one with a RuntimeError (InvalidBackend) at the first compiled call
            from torch._dynamo.backends.registry import list_backends, lookup_backend
            from torch._dynamo.exc import InvalidBackend
        except ImportError:  # (another torch's layout: torch.compile says it then)
            pass
        else:
            try:
                lookup_backend(backend)
            except InvalidBackend:
                raise ValueError(f"backend: {backend!r} is not a torch.compile backend; torch {torch.__version__} "
                                 f"has {', '.join(list_backends())}") from None
    mode = options.get("mode")
    if mode is None or backend not in (None, "inductor"):  # another compiler reads its own modes
        return
    try:
        from torch._inductor import list_mode_options

        modes = tuple(list_mode_options())
    except (ImportError, AttributeError):
        modes = COMPILE_MODES
    if not isinstance(mode, str) or mode not in modes:
        raise ValueError(f"mode: {mode!r} is not a torch.compile mode; torch {torch.__version__} takes "
                         f"{', '.join(modes)}")


def _capture_graph(fn: Callable[[], torch.Tensor], device: torch.device, pool: Any = None) -> tuple[Any, torch.Tensor]:
    """(CUDA graph of fn, the tensor fn returns inside it). fn runs once first on a side stream, so lazy
    initialisation (cuBLAS handles, workspaces) stays out of the graph.

    With `device` the current GPU: torch.cuda.graph captures on a stream of the current one, and a model on
    another (cuda:1 while cuda:0 is current, as it is in every new thread: the server's worker) would run its kernels
    on its own GPU's stream, outside the capture."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


class GraphedDenoise:
    """`model.denoise` replayed from a captured CUDA graph. At batch 1 a pass is thousands of small kernels whose
    launch cost, paid by Python on every step, outweighs the GPU work; a graph pays it once per canvas.

    One graph per (canvas shape, cache state) and self-conditioning on or off: a new canvas, whose cache has
    grown, or a batch that shrank when rows stopped, captures anew and frees the old graphs. Inputs are copied
    into the graph's own buffers; the logits it returns live in the graph's memory and are overwritten by the
    next call, so a caller uses them before calling again (the decoding loop does)."""

    def __init__(self, model: DiffusionGemma):
        self.model = model
        self.state_key: tuple | None = None
        self.graphs: dict[tuple | None, tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
        self.pool: Any = None
        self.captures = 0

    def __call__(self, canvas_ids: torch.Tensor, cache: KVCache,
                 self_conditioning_probs: torch.Tensor | None = None) -> torch.Tensor:
        # The cache's length and buffers are baked into a graph (see KVCache.buffers_key).
        key = (tuple(canvas_ids.shape), cache.length, cache.buffers_key())
        if key != self.state_key:
            self.graphs.clear()
            self.state_key = key
        probs = self_conditioning_probs
        sc_key = None if probs is None else (probs.dtype, tuple(probs.shape))
        if sc_key not in self.graphs:
            self.graphs[sc_key] = self.capture(canvas_ids.clone(), cache, None if probs is None else probs.clone())
            self.captures += 1
        graph, canvas, static_probs, logits = self.graphs[sc_key]
        canvas.copy_(canvas_ids)
        if static_probs is not None and probs is not None:  # (captured with probs exactly when they are given)
            static_probs.copy_(probs)
        graph.replay()
        return logits

    def capture(self, canvas: torch.Tensor, cache: KVCache,
                probs: torch.Tensor | None) -> tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(graph, its canvas input, its self-conditioning input, its logits output)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, logits = _capture_graph(lambda: self.model.denoise(canvas, cache, self_conditioning_probs=probs),
                                       canvas.device, self.pool)
        return graph, canvas, probs, logits


class GraphedEncodeStep:
    """The AR loop's one-token encoder pass (`encode(token, cache, logits="last")`) replayed from one CUDA graph
    per cache: `model.encode_one` keeps every shape fixed, so the graph captured at the first token serves all
    the others. Anything else (a prompt, a mask) runs eagerly. The logits live in the graph's memory and are
    overwritten by the next call."""

    def __init__(self, model: DiffusionGemma):
        self.model = model
        self.key: tuple | None = None
        self.graph: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.captures = 0

    def __call__(self, input_ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
                 logits: str = "none") -> torch.Tensor | None:
        if input_ids.shape[1] != 1 or attention_mask is not None or logits != "last":
            return self.model.encode(input_ids, cache, attention_mask=attention_mask, logits=logits)
        cache.reserve(1)
        key = (tuple(input_ids.shape), cache.capacity, cache.buffers_key())
        if key != self.key:
            self.graph = None  # free the old graph's memory before capturing the new one
            slot = torch.full((1,), cache.length, dtype=torch.long, device=input_ids.device)
            self.graph = self.capture(input_ids.clone(), cache, slot)
            self.key = key
            self.captures += 1
        assert self.graph is not None  # captured above for this key, or earlier for the same one
        graph, token, slot, out = self.graph
        token.copy_(input_ids)
        slot.fill_(cache.length)
        graph.replay()
        cache.commit(None, 1)
        return out

    def capture(self, token: torch.Tensor, cache: KVCache,
                slot: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(graph, its token input, its slot input, its logits output). The warm-up pass writes the slot that
        the first replay then writes again with the same values."""
        graph, out = _capture_graph(lambda: self.model.encode_one(token, cache, slot), token.device)
        return graph, token, slot, out


@dataclass
class Draft:
    canvas_index: int
    step: int  # steps done in this canvas (1-based)
    tokens: torch.Tensor  # [B, n] current argmax of the canvas positions kept (cpu); pad for rows that ended and
    # past a row's max_new_tokens
    # [B] positions accepted at this step: with keep_accepted=True only the new ones (the tokens held from earlier
    # steps are not counted again, so a canvas's Drafts add up to the positions the sampler accepted: a canvas that
    # runs out of steps or stops early commits the rest as they stand, uncounted); never a template's given tokens.
    # Without keep_accepted every position is re-decided, so each step's count stands alone.
    accepted: torch.Tensor
    done: torch.Tensor  # [B] bool: row has stopped denoising this canvas (or ended in an earlier one)
    elapsed: float
    kind: str = "draft"


@dataclass
class Commit:
    canvas_index: int
    tokens: torch.Tensor  # [B, n] committed tokens (cpu), pad after EOS or a stop string
    steps: torch.Tensor  # [B] denoising steps this canvas took per row
    finished: torch.Tensor  # [B] bool: row has ended (EOS, stop string, budget, or cut by `cancelled`)
    elapsed: float
    # This canvas's tokens decoded on their own, when a tokenizer is present: a character whose bytes a canvas edge
    # splits is U+FFFD in both commits, and a stop string is not cut; to show the answer use `texts_so_far`.
    texts: list[str] | None = None
    # [B] valid new tokens so far (through an EOS or the token completing a stop string): Done's output.num_new_tokens
    num_new_tokens: torch.Tensor | None = None
    # Each row's text so far as Done's `output.texts` would read were the generation to end here (when a tokenizer is
    # present): decoded whole, no pads, the healed prefix left out, a template's fixed text as written, cut at a
    # stop string. The last Commit's is Done's output.texts.
    texts_so_far: list[str] | None = None
    # a template's holes so far, as Done's `output.fills` (None: no template)
    fills_so_far: list[list[str]] | None = None
    # Each row's texts_so_far less what a later Commit may still change (settled_text): a character whose bytes are
    # still arriving, and a tail that a stop string may yet start with (it would be cut). Each is a prefix of the
    # next and of Done's text, which a row that has finished shows whole: what an app prints as it streams.
    settled_texts: list[str] | None = None
    # [B] whether a stop string ended the row (Done's output.extra["stopped"] so far), and the prompt tokens each row
    # reused from a prefix cache (its extra["reused_prompt_tokens"]): with num_new_tokens and the steps, what a row
    # that `finished` here will end with, so a consumer (the server) answers it now, not when its batch ends
    stopped: list[bool] | None = None
    reused_prompt_tokens: list[int] | None = None
    num_chosen_tokens: torch.Tensor | None = None  # [B] of num_new_tokens, those the model chose (a template's holes)
    kind: str = "commit"


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N]: prompt (as given, left padded) + new tokens, pad after EOS or a stop string
    prompt_length: int
    texts: list[str] | None
    tokens_per_forward: torch.Tensor  # [B] new tokens the model chose / decoder passes (a template's fixed ones are given)
    forward_passes: torch.Tensor  # [B] decoder (or AR) forward passes per row
    num_new_tokens: torch.Tensor  # [B] valid new tokens (up to and including EOS)
    steps_per_canvas: torch.Tensor  # [B, canvases]
    encode_seconds: float = 0.0
    denoise_seconds: float = 0.0
    cache: KVCache | None = None
    num_chosen_tokens: torch.Tensor | None = None  # [B] valid new tokens less a template's fixed ones (its holes)
    # A template's holes as text, per row: one per hole marker, in order (a token-id template: one per run of -1s),
    # cut from `texts`, so that fixed text + fills reads as it (a character two holes share goes whole to the later
    # one); None without a template
    fills: list[list[str]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length :]

    @property
    def seconds(self) -> float:
        return self.encode_seconds + self.denoise_seconds


@dataclass
class Done:
    output: GenerationOutput
    kind: str = "done"


@dataclass
class Cancelled:
    """The last event of a stream that `cancelled` ended (in place of `Done`): the work done until then, which a
    server counts as its load although nobody receives it."""

    forward_passes: torch.Tensor  # [B] decoder passes per row, the unfinished canvas's included (cpu)
    num_new_tokens: torch.Tensor  # [B] valid new tokens of the canvases committed, as Commit's (cpu)
    kind: str = "cancelled"


@dataclass(frozen=True)  # built whole by LM._request; nothing changes it afterwards
class Request:
    """A normalised generation request (what `prepare` makes of the user's arguments)."""

    prompt: torch.Tensor  # [B, P]
    attention_mask: torch.Tensor | None  # [B, P] or None when nothing is padded
    # New tokens: one count for every row, or one per row (a server batches requests of different lengths); read
    # them through `row_budgets`. A row that has written its max_new_tokens ends, as one that wrote an EOS does.
    # With a template, each row's own template length (its row of `template` is padded past it).
    max_new_tokens: int | tuple[int, ...]
    min_new_tokens: int | tuple[int, ...]
    sampler: SamplerConfig
    seed: int | None
    template: torch.Tensor | None  # [B, N] fixed token ids, -1 for holes; pad_id past a shorter row's end
    eos_ids: list[int]
    pad_id: int
    seeds: list[int] | None = None  # per-row seeds (the server batches requests); default: `seed` for every row
    # Per-row candidate draws (the server batches requests at different temperatures): each row's draw_temperature,
    # top_k and top_p, read through `row_draws`; None: the sampler's for every row.
    draw_temperatures: tuple[float, ...] | None = None
    top_ks: tuple[int, ...] | None = None
    top_ps: tuple[float, ...] | None = None
    skip_stopped_rows: bool = True  # shrink the batch as rows stop (False: compute them to the end, for comparison)
    # Optional rule over the canvas: (draft tokens [b, C], settled [b, C] bool) -> banned tokens [b, C, V] bool,
    # called once per step before sampling. A pure tensor function (no host sync); `b` is the rows still working.
    constraint: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Optional transform of each step's logits: (logits [b, C, V], the working rows' batch indices [b]) -> logits
    # of the same shape, before sampling. A pure tensor function, for rules that mix rows (ensembles of views).
    logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Token healing (see healing.py): per row, the tokens the first new token may be [B, V], and the text
    # each row's output must drop because the prompt already holds it.
    first_allowed: torch.Tensor | None = None
    heal_prefixes: list[str] | None = None
    # Healed template holes (healing.heal_holes): {(row, position): the tokens that position may be [V]}, and
    # the fixed whitespace each such hole took over, which its fill leaves out.
    hole_allowed: dict[tuple[int, int], torch.Tensor] | None = None
    hole_prefixes: dict[tuple[int, int], str] | None = None
    # Each row's holes as (start, end) spans of `template`, one per marker (Template.holes, healed); None: each run
    # of -1s is one hole.
    template_holes: list[list[tuple[int, int]]] | None = None
    # Stop strings, one list per row: a row ends at the token that completes one of them (see `_Stops`).
    stops: list[list[str]] | None = None
    # Per row, whether its min_new_tokens bans EOS alone, so that a stop string may end inside them (a server's
    # default minimum: its client never sees a stop string). None: no row's does; no stop string ends inside a
    # row's min_new_tokens (vLLM's min_tokens).
    eos_only_minimum: tuple[bool, ...] | None = None
    # Per row, the special tokens its stop strings name (special_stop_ids): the row ends at one, as at a stop string
    # (a special token has no text in the decoded text that the strings are searched in). None: no row has one.
    stop_ids: list[frozenset[int]] | None = None
    # Encoded prompts kept between calls (prefix.py): each row encodes only what no earlier prompt shared.
    prefix_cache: PrefixCache | None = None
    # Asked on the host before every step; True ends the generation there, with `Cancelled` (LM.stream); one bool
    # per row ends the rows marked True there, as their max_new_tokens would (all True before any row ended: `Cancelled`).
    cancelled: Callable[[], bool | Sequence[bool]] | None = None
    # Ids the tokenizer has no token for (Tokenizer.unknown_ids: an embedding padded past its vocabulary) [k]: their
    # logits are -inf, so no row ever chooses one (it would have no text). None: every id may be chosen.
    unknown_ids: torch.Tensor | None = None

    def row_budgets(self) -> tuple[list[int], list[int]]:
        """Each row's (max_new_tokens, min_new_tokens). A template's rows each write their whole length (their
        max_new_tokens), with no minimum (no EOS comes inside it)."""
        b = self.prompt.shape[0]

        def per_row(value: int | Sequence[int], name: str) -> list[int]:
            if is_int(value):
                return [int(value)] * b  # type: ignore[arg-type]  # (is_int: an int, numpy's or a 0-d tensor)
            value = cast(Sequence[int], value)  # not an integer: a list, tuple or 1-D tensor of them
            if len(value) != b:
                raise ValueError(f"{name}: expected one count per row ({b}), got {len(value)}")
            return [int(v) for v in value]

        budgets = per_row(self.max_new_tokens, "max_new_tokens")
        if self.template is None:
            return budgets, per_row(self.min_new_tokens, "min_new_tokens")
        if max(budgets) > self.template.shape[1]:
            raise ValueError(f"max_new_tokens: a template row's length, at most its {self.template.shape[1]} "
                             f"tokens, got {budgets}")
        return budgets, [0] * b

    def row_draws(self, device: torch.device | str = "cpu") -> RowDraws:
        """Each row's draw temperature, top_k and top_p as [B] tensors on `device`: its own, else the sampler's."""
        return RowDraws.of(self.sampler, self.prompt.shape[0], device, self.draw_temperatures, self.top_ks,
                           self.top_ps)

    def row_seeds(self) -> torch.Tensor:
        """Every row's randomness comes from its own seed alone (see sampling._hash)."""
        b = self.prompt.shape[0]
        if self.seeds is not None:
            if len(self.seeds) != b:
                raise ValueError(f"seeds: expected {b} per-row seeds, got {len(self.seeds)}")
            return torch.tensor(self.seeds, dtype=torch.long, device="cpu")
        if self.seed is not None:
            return torch.full((b,), self.seed, dtype=torch.long, device="cpu")
        drawn = torch.randint(0, 2**47, (b,), device="cpu")
        inherited = blockpress._SEED_AT_FORK
        if inherited is not None and torch.initial_seed() == inherited:
            # a process forked after `import blockpress` (a multiprocessing Pool's worker, an os.fork) holds its
            # parent's torch generator, so every worker drew the same "fresh" seeds: each mixes in its process id
            # (Python's random reseeds at a fork for the same reason), but only until it seeds torch itself: a
            # worker's own torch.manual_seed (e.g. base + worker id) makes its draws repeatable, as it does in the
            # main process and a spawned worker (which torch seeds afresh)
            drawn ^= choice_seed(os.getpid(), 1) % 2**47
        return drawn


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("prompt: every prompt must have at least one token")
    width = max(len(r) for r in rows)
    # on the CPU, named: a program's torch.set_default_device("cuda") must not move the host's work
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
    for i, r in enumerate(rows):
        # through an int64 array, read in C: torch.as_tensor reads a list one Python int at a time (4 ms per
        # 30,000 ids against 1 ms)
        ids[i, width - len(r) :] = torch.frombuffer(array("q", r), dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, (None if bool(mask.all()) else mask)


def encode_texts(texts: Sequence[str], tokenizer: Any, bos: bool = True, context: int | None = None) -> list[list[int]]:
    """Text prompts as token ids, BOS first when the tokenizer has one and `bos` (a conversation's next turn
    has none: it continues a sequence that has one), and not twice (a rendered chat template brings its own).
    `context`: the model's, whose tokens a text longer than it times the longest token cannot fit: such a text is
    refused before it is tokenized, which for a huge prompt takes seconds just to learn that it cannot fit."""
    for i, text in enumerate(texts):  # named as the caller wrote it, not as the tokenizer's "text"
        name = "prompt" if len(texts) == 1 else f"prompt[{i}]"
        check_text(text, name)
        if context is not None and len(text) > context * (most := tokenizer.longest_token()):
            raise ValueError(f"{name}: {len(text):,} characters cannot fit the model's context of {context} tokens "
                             f"(no token of this vocabulary holds more than {most} characters, so a text of more "
                             f"than {context * most:,} is refused before it is tokenized)")
    return [tokenizer.encode_prompt(t) if bos else tokenizer.encode(t) for t in texts]


def readable_array(x: Any) -> Any:
    """`x`, or where it is a numpy array torch does not read as it is (a reversed view, a[::-1]; big-endian values,
    ">i8", as a file or another machine wrote them: torch's "given numpy array has byte order different from the
    native byte order"), a copy in this machine's byte order."""
    if isinstance(x, np.ndarray) and (not x.dtype.isnative or any(s < 0 for s in x.strides)):
        return np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("="))
    return x


def host_tensor(x: Any) -> torch.Tensor:
    """A tensor as it is; anything else (a list, an array) read into a CPU tensor, also where the program set another
    default device (torch.set_default_device("cuda"): the host's bookkeeping must not move to the GPU, nor a tensor
    the caller placed be moved)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(readable_array(x), device="cpu")


def as_tensor(x: Any, name: str, expected: str = "integer token ids") -> torch.Tensor:
    """`x` as a tensor, or a ValueError naming `name` and what was `expected` (not torch's "could not infer
    dtype of NoneType")."""
    try:  # no dtype forced: 1.5 or True must be refused by the caller, not truncated to a token id
        return host_tensor(x)
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"{name}: expected {expected}, got a value torch cannot read ({exc})") from None


def _holds_ids(t: torch.Tensor) -> bool:
    """Whether `t`'s dtype can hold token ids: an integer one (not a float, complex or bool, which torch would
    truncate or read as 0 / 1 without a word)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_integer_dtype(t: torch.Tensor, name: str) -> None:
    if not _holds_ids(t):
        raise ValueError(f"{name}: expected integer token ids, got {t.dtype}")


def _id_row(row: Any, name: str) -> list[int]:
    """One row of ids as ints: a list of Python or numpy integers, an array.array of ints (an Example's ids, as
    load_jsonl holds them), or a 1-D integer tensor / numpy array."""
    if isinstance(row, array):
        _check_array_of_ints(row, name)
        return row.tolist()
    if not isinstance(row, (torch.Tensor, list, tuple, str)) and hasattr(row, "__array__"):
        row = as_tensor(row, name)
    if isinstance(row, torch.Tensor):
        if row.dim() != 1:
            raise ValueError(f"{name}: expected each row of a list to be 1-D token ids, got shape {list(row.shape)}")
        _check_integer_dtype(row, name)
        return row.tolist()
    if not isinstance(row, (list, tuple)):
        raise ValueError(f"{name}: expected integer token ids, got {row!r}")
    # is_int asks of a value's type alone, so each type the row holds is asked once (set(map(type, ...)) runs in C):
    # is_int on every id would cost a server's batch milliseconds for each long prompt as it starts
    kinds = set(map(type, row))
    if not all(issubclass(k, numbers.Integral) and not issubclass(k, bool) for k in kinds):
        # a 0-d tensor or array (list(t) of a 1-D tensor gives them) is the number it holds; a float or bool one is
        # then refused below as that number is
        row = [t.item() if isinstance(t, (torch.Tensor, np.ndarray)) and t.ndim == 0 else t for t in row]
        kinds = set(map(type, row))
        odd = [t for t in row if not is_int(t)]
        if odd:  # torch would truncate 1.5 to 1 and read True as 1, silently
            raise ValueError(f"{name}: expected integer token ids, got {odd[0]!r}")
    return list(row) if kinds <= {int} else list(map(int, row))


def _check_array_of_ints(row: array, name: str) -> None:
    if row.typecode in "fduw":  # floats would be truncated to ids, characters are text
        raise ValueError(f"{name}: expected integer token ids, got an array.array of typecode {row.typecode!r}")


def read_token_ids(ids: Any, name: str, also: str = "") -> torch.Tensor | list[list[int]]:
    """Token ids as people hold them: a tensor or numpy array [P] / [B, P] (-> an int64 tensor [B, P]), a list or
    an array.array of ids (an Example's, as load_jsonl holds them), or a list of rows that may differ in length,
    each a list or array.array of ids or a 1-D integer tensor / numpy array, the
    usual way to hold ragged prompts (-> the rows as lists of ints). Python and numpy integers alike, never a
    bool or a float. Ids are range-checked against the vocabulary by the caller. `also`: what else the caller
    takes, for the error message."""
    if isinstance(ids, Mapping):  # a tokenizer's output (transformers' BatchEncoding is a Mapping, not a dict)
        raise ValueError(f"{name}: got a mapping with keys {list(ids)} (a tokenizer's output?); pass the ids and "
                         "the mask apart: generate(enc['input_ids'], attention_mask=enc['attention_mask'])")
    if not isinstance(ids, (torch.Tensor, list, tuple, str)) and hasattr(ids, "__array__"):
        ids = as_tensor(ids, name)  # a numpy array: read like a tensor
    if isinstance(ids, array):  # one row of ids, as a list of them (it has no __array__ to read it by)
        _check_array_of_ints(ids, name)
        ids = ids.tolist()
    if isinstance(ids, torch.Tensor):
        t = ids[None] if ids.dim() == 1 else ids
        if t.dim() != 2 or 0 in t.shape:  # an empty batch [0, P] met torch's min() over nothing, later
            raise ValueError(f"{name}: expected token ids of shape [P] or [B, P] with B > 0 and P > 0, got "
                             f"{list(ids.shape)}")
        _check_integer_dtype(t, name)
        return t.long()
    if isinstance(ids, (list, tuple)) and ids:
        first = ids[0]
        # (a 0-d tensor or array is an id, not a row: list(t) of a 1-D tensor gives them)
        nested = (not is_int(first) and getattr(first, "ndim", 1) != 0
                  and (isinstance(first, (list, tuple, torch.Tensor, array)) or hasattr(first, "__array__")))
        rows = [_id_row(r, name) for r in ids] if nested else [_id_row(ids, name)]
        if any(not r for r in rows):
            raise ValueError(f"{name}: every row needs at least one token id")
        # beyond int64 torch would fail with an overflow; the vocabulary check comes later. (min and max run in C;
        # the first bad id is looked for only in a row that holds one.)
        for r in rows:
            if min(r) < 0 or max(r) >= 2**63:
                token = next(t for t in r if not 0 <= t < 2**63)
                raise ValueError(f"{name}: token id {token} is not a token id (expected 0 <= id < vocab_size)")
        return rows
    empty = isinstance(ids, (list, tuple, str)) and not ids
    raise ValueError(f"{name}: expected {also}token ids [P] or [B, P] (a tensor, a numpy array, an array.array or "
                     f"lists), or a list of rows of ids; got {type(ids).__name__}{' (empty)' if empty else ''}")


def prompt_to_ids(prompt: Any, tokenizer: Any, pad_id: int, bos: bool = True,
                  context: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """str | list[str] | token ids (see read_token_ids; ragged rows are left-padded) -> (ids [B, P], mask or
    None). Texts get BOS first when `bos` (see encode_texts); ids are taken as given. A numpy array of strings is
    texts, as a list of them (as `stop` takes one)."""
    if isinstance(prompt, np.ndarray) and prompt.dtype.kind in "US":
        if prompt.ndim > 1:
            raise ValueError(f"prompt: a {prompt.ndim}-D array of strings; texts go as a str or a 1-D list or array "
                             "of them, one a row")
        prompt = prompt.tolist()
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                   and all(isinstance(p, str) for p in prompt)):
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer, and this model has none; pass token ids instead")
        return left_pad(encode_texts([prompt] if isinstance(prompt, str) else list(prompt), tokenizer, bos,
                                     context), pad_id)
    if isinstance(prompt, (list, tuple)) and any(isinstance(p, str) for p in prompt):  # texts, and one is not
        i, item = next((i, p) for i, p in enumerate(prompt) if not isinstance(p, str))
        raise ValueError(f"prompt[{i}]: a batch of texts holds {type(item).__name__} {item!r:.40} there; expected a "
                         "str (every row a text, or every row token ids)")
    ids = read_token_ids(prompt, "prompt", also="str, list[str], ")
    return (ids.cpu(), None) if isinstance(ids, torch.Tensor) else left_pad(ids, pad_id)


def is_text_template(template: Any) -> bool:
    """Text with hole markers, or a batch of such texts (not token ids)."""
    return isinstance(template, str) or (isinstance(template, (list, tuple)) and bool(template)
                                         and all(isinstance(x, str) for x in template))


@dataclass(frozen=True)
class Template:
    """A constrained canvas as `parse_template` reads it: each row's token ids, -1 in the holes, and each row's
    holes as (start, end) spans of those ids, in order: one per <|hole|> marker (adjacent markers stay apart),
    or one per run of -1s in a token-id template. Rows may differ in length: each writes its own."""

    rows: list[list[int]]
    holes: list[list[tuple[int, int]]]

    @property
    def lengths(self) -> list[int]:
        """Each row's number of tokens, fixed and holes together."""
        return [len(r) for r in self.rows]

    def ids(self, pad_id: int) -> torch.Tensor:
        """[B, N]: the rows as one layout, N the longest row; a shorter row is `pad_id` past its end (given, not a
        hole: its budget ends there, see Request.max_new_tokens)."""
        ids = torch.full((len(self.rows), max(self.lengths)), pad_id, dtype=torch.long, device="cpu")
        for r, row in enumerate(self.rows):  # (through an int64 array, read in C: see left_pad)
            ids[r, : len(row)] = torch.frombuffer(array("q", row), dtype=torch.long)
        return ids


def hole_runs(row: Sequence[int]) -> list[tuple[int, int]]:
    """The (start, end) spans of a row's runs of -1: a token-id template's holes."""
    # where the row turns from fixed to hole and back, found by numpy: a Python loop over a long row's ids is slow
    try:
        holes = np.frombuffer(array("q", row), dtype=np.int64) < 0
    except OverflowError:  # an id past int64 (the vocabulary's range check refuses it later) is no hole
        holes = np.array([t < 0 for t in row], dtype=bool)
    edges = np.flatnonzero(np.diff(holes, prepend=False, append=False)).tolist()
    return list(zip(edges[::2], edges[1::2]))


def escape_template(text: str, before_hole: bool = False) -> str:
    """`text` as a text template's fixed text: every hole marker in it, and everything that looks like one
    (`<|HOLE|>`, `<| hole |>`, `"<|hole"`), escaped with a backslash, the backslashes right before one doubled, so
    that infill keeps it exactly as it is. `before_hole`: a hole marker comes right after it, so its trailing
    backslashes are doubled too (else they would escape that marker). Put holes between escaped pieces:
    `escape_template(before, before_hole=True) + "<|hole:8|>" + escape_template(after)`."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str, got {type(text).__name__}")
    check_flag("before_hole", before_hole)
    text = _NEAR_HOLE_RE.sub(lambda m: "\\" * (2 * len(m.group(1)) + 1) + m.group(0)[len(m.group(1)):], text)
    return text + "\\" * (len(text) - len(text.rstrip("\\"))) if before_hole else text


def parse_text_template(template: str, tokenizer: Any, hole_length: int,
                        max_length: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """One text template's ids and hole spans. A backslash before a marker keeps it as text: each pair of
    backslashes right before a marker stands for one, and an odd one left over makes the marker literal
    (`\\<|hole|>` is the text "<|hole|>", `\\\\<|hole|>` a backslash and then a hole); other backslashes are text.
    So does it before what looks like a marker but is not one (`\\<|HOLE|>` is the text "<|HOLE|>"), which is
    refused unescaped: a typo would stay in the text, silently. `escape_template` escapes a whole text.
    A literal marker is encoded as plain text (`Tokenizer.encode_plain`): where the tokenizer has `<|hole|>` as a
    special token, that id is the absorbing noise token of models trained with it, not text."""
    if tokenizer is None:
        raise ValueError("template: text templates need a tokenizer; pass token ids with -1 for holes")
    if not template:
        raise ValueError("template: empty text; expected text with <|hole|> or <|hole:N|> markers")
    check_text(template, "template")  # its position in the template, not in one fixed piece of it
    matches = list(_HOLE_RE.finditer(template))
    markers = {m.start(2) for m in matches}
    near = [m for m in _NEAR_HOLE_RE.finditer(template) if m.end(1) not in markers]
    typo = next((m for m in near if not len(m.group(1)) % 2), None)
    if typo is not None:  # a typo would otherwise stay in the text as fixed tokens, silently
        shown = template[typo.end(1) : typo.end()] + typo.group(2)
        raise ValueError(f"template: {shown!r} looks like a hole marker but is not one; write <|hole|> or "
                         "<|hole:N|> (no spaces, lower case), or keep it as text with a backslash right before its "
                         "<| (blockpress.escape_template(text) escapes every marker of a text)")
    ids: list[int] = []
    holes: list[tuple[int, int]] = []
    text, pos = "", 0  # the fixed text since the last hole, encoded whole when the next hole (or the end) comes
    for m in sorted([*matches, *near], key=lambda m: m.start()):
        slashes = m.group(1)
        text += template[pos : m.start()] + "\\" * (len(slashes) // 2)
        if m.re is _NEAR_HOLE_RE:  # an escaped near-marker: plain text from its "<|" on
            pos = m.end(1)
            continue
        marker, length = m.group(2), m.group(3)
        pos = m.end()
        if len(slashes) % 2:  # escaped: the marker is text, its own tokens (special tokens split text there anyway)
            ids += (tokenizer.encode(text) if text else []) + tokenizer.encode_plain(marker)
            text = ""
            continue
        if length is None and (not is_int(hole_length) or hole_length < 1):  # only a bare marker reads it
            raise ValueError(f"hole_length: expected a positive integer (the length of a bare <|hole|>), got {hole_length!r}")
        if length is not None and int(length) < 1:
            raise ValueError(f"template: {marker} holds no token; a hole needs a length of 1 or more")
        ids += tokenizer.encode(text) if text else []
        text = ""
        # int(): a numpy integer would do the arithmetic below in its own type, which wraps (np.int8(127) past a
        # few tokens of text laid the hole out backwards; np.int32(2**31 - 1) passed the context check)
        n = int(length) if length is not None else int(hole_length)
        if max_length is not None and len(ids) + n > max_length:
            raise ValueError(f"template: {marker} takes the template past the model's context of "
                             f"{max_length} tokens")
        holes.append((len(ids), len(ids) + n))
        ids += [-1] * n
    text += template[pos:]
    ids += tokenizer.encode(text) if text else []
    return ids, holes


def _parse_text_row(template: str, r: int, rows: int, tokenizer: Any, hole_length: int,
                    max_length: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """`parse_text_template` of row `r` of a batch of `rows` text templates: its errors name the row when there are
    several ("template: empty text" or a typo's message alone would leave the user to find which of the batch it
    is)."""
    try:
        return parse_text_template(template, tokenizer, hole_length, max_length)
    except ValueError as exc:
        message = str(exc)
        if rows == 1 or not message.startswith("template: "):  # hole_length's errors are the setting's, not a row's
            raise
        raise ValueError(f"template: row {r}: {message.removeprefix('template: ')}") from None


def _template_row(row: Any) -> Any:
    """A 1-D tensor or array in a list of template rows, as a list of its ids; anything else as it is."""
    if not (isinstance(row, torch.Tensor) or hasattr(row, "__array__")) or getattr(row, "ndim", 0) == 0:
        return row
    t = as_tensor(row, "template", "rows of integer token ids (-1 for holes)")
    if t.dim() != 1 or not _holds_ids(t):
        raise ValueError(f"template: a row given as a tensor or array must hold 1-D integer token ids (-1 for "
                         f"holes), got {str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
    return t.tolist()


def parse_template(template: Any, tokenizer: Any, batch: int, hole_length: int,
                   max_length: int | None = None) -> Template:
    """A constrained canvas: text with <|hole|> / <|hole:N|> markers (a backslash before one keeps it as text,
    see `parse_text_template`), or ids with -1 (or None) for holes, where a run of -1s is one hole.
    `max_length`: the most tokens it may hold (the model's context), checked before any hole is laid out."""
    if is_text_template(template):
        texts = [template] if isinstance(template, str) else list(template)
        if not isinstance(template, str) and len(texts) != batch:
            raise ValueError(f"template: {len(texts)} text templates for a batch of {batch} prompts")
        parsed = [_parse_text_row(x, r, len(texts), tokenizer, hole_length, max_length) for r, x in enumerate(texts)]
        if isinstance(template, str):
            parsed *= batch
        rows, holes = [list(r) for r, _ in parsed], [list(h) for _, h in parsed]
        if not any(holes):
            raise ValueError("template: has no holes to fill (use <|hole|> markers or -1 ids)")
        empty = next((i for i, h in enumerate(holes) if not h), None)
        if empty is not None:  # as a template alone is refused, so is one of a batch (a row given whole is a prompt)
            raise ValueError(f"template: row {empty} has no holes to fill (use <|hole|> markers)")
        return Template(rows, holes)
    shape_error = f"template: expected [N] or [{batch}, N] token ids with N > 0 (id rows may differ in length), got "
    if isinstance(template, torch.Tensor) or hasattr(template, "__array__"):  # a tensor or a numpy array
        t = as_tensor(template, "template", "integer token ids (-1 for holes)")
        if not _holds_ids(t):
            raise ValueError(f"template: expected integer token ids (-1 for holes), got a {t.dtype} tensor")
        t = t.detach().to("cpu", torch.long)
        if t.dim() == 1:
            t = t[None].expand(batch, -1)
        if t.dim() != 2 or t.shape[0] != batch or t.shape[1] == 0:
            raise ValueError(f"{shape_error}{list(t.shape)}")
        rows = t.tolist()
    else:
        expected = "text with <|hole|> markers, token ids [N] or [B, N] (-1 or None for holes)"
        if not isinstance(template, (list, tuple)):  # bytes iterate as ints: read as ids, a template with no holes
            hint = " (decode it to str)" if isinstance(template, (bytes, bytearray)) else ""
            raise ValueError(f"template: expected {expected}, got {type(template).__name__}{hint}")
        if not template:  # read as one row of no ids, it would pass for a template
            raise ValueError(f"template: expected {expected}, got an empty {type(template).__name__}")
        # rows of their own lengths come as a list: of lists, or of 1-D tensors / arrays, as prompts may
        if not set(map(type, template)) <= {int, type(None)}:  # (one row of plain ids has no row to convert)
            template = [_template_row(r) for r in template]
        nested = bool(template) and isinstance(template[0], (list, tuple))
        given = template if nested else [template]
        try:  # each type a row holds is asked of once below, not every id (as _id_row does)
            kinds = [set(map(type, row)) for row in given]
        except TypeError:
            raise ValueError(f"template: expected {expected}, got {type(template).__name__}") from None
        if any(issubclass(k, (torch.Tensor, np.ndarray)) for k in set().union(*kinds)):
            # 0-d tensors or arrays (list(t) of a 1-D tensor gives them): the ids they hold, as a prompt's are read
            given = [[v.item() if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v for v in row]
                     for row in given]
            kinds = [set(map(type, row)) for row in given]
        rows = [[-1 if v is None else v for v in row] if type(None) in k else list(row) for row, k in zip(given, kinds)]
        if not all(issubclass(k, numbers.Integral) and not issubclass(k, bool) for k in set().union(*kinds) - {type(None)}):
            odd = next((v for row in rows for v in row
                        if isinstance(v, bool) or not isinstance(v, numbers.Integral)), None)
            if odd is not None:  # torch would truncate 7.9 to 7 and read True as 1, silently
                raise ValueError(f"template: expected integer token ids (-1 or None for holes), got {odd!r}")
        rows = [row if k <= {int, type(None)} else list(map(int, row)) for row, k in zip(rows, kinds)]
        rows = rows * (1 if nested else batch)
        if len(rows) != batch or not all(rows):
            raise ValueError(f"{shape_error}{len(rows)} rows of {[len(r) for r in rows]} ids")
    low = min(min(row) for row in rows)
    if low < -1:
        raise ValueError(f"template: ids are token ids or -1 for a hole, got {low}")
    if low >= 0:
        raise ValueError("template: has no holes to fill (use <|hole|> markers or -1 ids)")
    return Template(rows, [hole_runs(r) for r in rows])


def decode_rows(tokenizer: Any, rows: list[list[int]], template: torch.Tensor | None = None) -> list[str]:
    """Each row's text. Special tokens are dropped, as from any generated text, except at a template's fixed
    positions (`template` [B, >= len(row)], -1 in the holes): those are what the user wrote (`<eos>`, a chat turn's
    markers), and a filled template keeps its fixed text as given."""
    if template is None:
        return tokenizer.decode_batch(rows)
    special = tokenizer.special_ids
    return [tokenizer.decode([t for t, f in zip(row, fixed) if f >= 0 or t not in special], skip_special_tokens=False)
            for row, fixed in zip(rows, template.tolist())]


def hole_fills(tokenizer: Any, rows: list[list[int]], holes: list[list[tuple[int, int]]],
               prefixes: dict[tuple[int, int], str], template: torch.Tensor) -> list[list[str]]:
    """Each row's holes ((start, end) spans of the new tokens, one per marker) as text: cut from the row's whole text
    (decode_rows, as `texts` reads it with `template` [B, N]) at the characters that the tokens before each edge
    make. Decoded on its own, a hole that holds part of a character's bytes (adjacent holes sharing one) would read
    as U+FFFD; cut from the whole text, the character goes whole to the later span. A healed hole's first token
    starts with the whitespace the template wrote before it (`prefixes`, by (row, position)); that text is the
    template's, so the fill leaves it out: fixed text + fills reads as the filled template."""
    fills = []
    for r, (row, spans) in enumerate(zip(rows, holes)):
        spans = [(s, e) for s, e in spans if s < len(row)]  # a row cut short (an EOS) has no text for later holes
        fixed = template[r : r + 1]
        text = decode_rows(tokenizer, [row], fixed)[0]
        # Each edge's offset: the text of the tokens before it reads as U+FFFD from a character the edge splits on,
        # so where it parts from the whole text, that character begins (adjacent holes share their edge).
        at = {p: len(commonprefix([decode_rows(tokenizer, [row[:p]], fixed)[0], text]))
              for p in {p for span in spans for p in span}}
        fills.append(_cut_fills(text, spans, at, {start: prefixes.get((r, start), "") for start, _ in spans}))
    return fills


def _cut_fills(text: str, spans: list[tuple[int, int]], at: Mapping[int, int], prefixes: Mapping[int, str]) -> list[str]:
    """A row's fills: `text` cut at each span's edges (`at`: an edge's position -> its offset in `text`), less the
    template's whitespace that a healed hole's first token starts with (`prefixes`, by the span's start)."""
    return [strip_prefix(text[at[start] : at[end]], prefixes.get(start, "")) for start, end in spans]


def _shared_length(edge: str, text: str) -> int:
    """len(commonprefix([edge, text])), compared in C: the text nearly always starts with an edge's text, and where
    it does not (a character the edge split on), a bisection finds where they part (a character at a time in
    Python, as commonprefix goes, cost as much as decoding the row)."""
    if text.startswith(edge):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text))  # edge[:lo] is shared; edge[:hi + 1] is not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if text.startswith(edge[:mid]) else (lo, mid - 1)
    return lo


class TemplateRowText:
    """One template row's text and the offsets of its holes' edges in it as its new tokens grow: what decode_rows
    and hole_fills give for the whole row, from a TextStream (special tokens kept) over the ids that decode_rows
    decodes, which only grow as the row does (whether a position's id is kept depends on that position alone). Each
    edge's text is read once, when the row first reaches it; the row's text at each call costs its new tokens, where
    decode_rows and hole_fills would decode the row again, and once more for each hole's edges, at each commit."""

    def __init__(self, tokenizer: Any, fixed: list[int], spans: list[tuple[int, int]], prefixes: Mapping[int, str]) -> None:
        self.fixed, self.spans, self.prefixes = fixed, spans, prefixes
        self.special = tokenizer.special_ids
        self.edges = sorted({p for span in spans for p in span})
        self.stream = TextStream(tokenizer, skip_special_tokens=False)
        self._restart()

    def _restart(self) -> None:
        self.row: list[int] = []  # the new tokens read so far
        self.kept: list[int] = []  # those that decode_rows decodes (a hole's special tokens dropped)
        self.kept_at = [0]  # kept_at[p]: len(kept) for the row's first p tokens
        self.edge_texts: dict[int, str] = {}  # the text of the row's first p tokens, for each edge p reached
        self.edge_at: dict[int, int] = {}  # each edge's offset in the text of the last fills call
        self.last_text = ""  # that text

    def text(self, row: list[int]) -> str:
        """decode_rows' text of `row` (the row's new tokens so far, a list of ints)."""
        if row[: len(self.row)] != self.row:  # not a continuation (a shorter row): start again
            self._restart()
        for p in range(len(self.row), len(row)):
            t = row[p]
            if self.fixed[p] >= 0 or t not in self.special:  # (a row is never longer than its template)
                self.kept.append(t)
            self.kept_at.append(len(self.kept))
        self.row = list(row)
        for p in self.edges:  # in order: the stream reads each edge's ids, then the row's, as ids that grow
            if p > len(row):
                break
            if p not in self.edge_texts:
                self.edge_texts[p] = self.stream.text(self.kept[: self.kept_at[p]])
        return self.stream.text(self.kept)

    def fills(self, row: list[int]) -> list[str]:
        """hole_fills' fills of `row`: its text cut at each hole's edges."""
        text = self.text(row)
        spans = [(s, e) for s, e in self.spans if s < len(row)]  # (as hole_fills: no text for later holes)
        # An edge's offset (where its text parts from the row's) depends on the row's text up to that offset and the
        # character there alone: where those are the last call's, so is the offset. One comparison of the text a
        # call, not one per edge (a template of 2,048 one-token holes spent 0.5 s a row in them).
        same = _shared_length(self.last_text, text)
        self.last_text = text
        at = {}
        for p in {p for span in spans for p in span}:
            old = self.edge_at.get(p)
            if p >= len(row):
                at[p] = len(text)
            elif old is not None and (old < same or old == len(self.edge_texts[p]) <= same):
                at[p] = old
            else:
                at[p] = self.edge_at[p] = _shared_length(self.edge_texts[p], text)
        return _cut_fills(text, spans, at, self.prefixes)


def _through_first(is_eos: torch.Tensor) -> torch.Tensor:
    """[B, n] bool: the positions up to and including each row's first EOS (`is_eos` [B, n]; all when it has none).
    What a row keeps of its tokens, for both engines (the AR loop's count and a canvas's commit)."""
    return (is_eos.cumsum(-1) - is_eos.long()) == 0


def _count_valid(new_tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """New tokens up to and including the first EOS (all of them when there is none)."""
    return _through_first(torch.isin(new_tokens, eos)).sum(-1)


def _output(
    req: Request,
    *,
    new_tokens: torch.Tensor,
    num_valid: torch.Tensor,
    passes: torch.Tensor,
    steps_per_canvas: torch.Tensor,
    encode_s: float,
    denoise_s: float,
    cache: KVCache | None,
    texts_of: _RowTexts | None,
    stopped: list[bool],
    reused: list[int],
    seeds: torch.Tensor,
) -> GenerationOutput:
    texts = fills = None
    if texts_of is not None:  # what the stop search and the Commit events decoded is not decoded again
        rows = [row[: int(n)] for row, n in zip(new_tokens.tolist(), num_valid.tolist())]
        texts, fills = texts_of.answers(rows), texts_of.fills(rows)
    chosen = chosen_tokens(req, num_valid)
    return GenerationOutput(
        sequences=torch.cat([req.prompt, new_tokens.cpu()], dim=1),
        prompt_length=req.prompt.shape[1],
        texts=texts,
        tokens_per_forward=(chosen.float() / passes.clamp(min=1)).cpu(),
        forward_passes=host_copy(passes),
        num_new_tokens=host_copy(num_valid),
        steps_per_canvas=host_copy(steps_per_canvas),
        encode_seconds=encode_s,
        denoise_seconds=denoise_s,
        cache=cache,
        num_chosen_tokens=host_copy(chosen),
        fills=fills,
        # stopped: whether a stop string ended each row; seeds: each row's, drawn where seed was None (seeds= repeats
        # the sample)
        extra={"stopped": stopped, "reused_prompt_tokens": reused, "seeds": seeds.tolist()},
    )


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU, its own storage: an event's or output's counts are the caller's to edit (`n -= before`), where
    `.cpu()` of a CPU tensor is the decoder's running counter itself, which the stream goes on counting in (edited,
    it cut the generation's output)."""
    return t.to("cpu", copy=True)


def chosen_tokens(req: Request, num_valid: torch.Tensor) -> torch.Tensor:
    """[B] the new tokens the model chose of each row's `num_valid`: a template's fixed tokens are given, not
    decoded, so there its holes within the valid tokens are counted."""
    if req.template is None:
        return num_valid
    within = torch.arange(req.template.shape[1], device=num_valid.device) < num_valid[:, None]
    return ((req.template.to(num_valid.device) < 0) & within).sum(-1)


def _heal_texts(req: Request, texts: list[str]) -> list[str]:
    """Drop the healed prefix that the prompt already holds from each row's first text."""
    if not req.heal_prefixes:
        return texts
    return [strip_prefix(t, p) for t, p in zip(texts, req.heal_prefixes)]


@dataclass
class _RowTexts:
    """Each row's text as its new tokens grow, for the stop search, the Commit events' texts so far and Done's
    output.texts: the text of all its tokens, as decoded whole (a character whose bytes straddle two canvases comes out
    whole), once per length, shared by the three. A row only grows (tokens once written stay), so its newest text is
    all there is to keep, and each row's TextStream decodes only what its new tokens add (a template's row's, with its
    holes' edges: TemplateRowText); the text of its first min_new_tokens (the stop floor) is fixed once it has them,
    so that is decoded once per generation."""

    req: Request
    tokenizer: Any
    newest: list[tuple[int, str] | None]  # per row: (tokens, their text) last decoded
    floors: list[str | None]  # per row: the text of its first min_new_tokens tokens, once it has more (see floor)
    minimums: list[int]  # per row: the new tokens no stop string ends in (min_new_tokens, or 0: eos_only_minimum)
    streams: list[TextStream]  # per row: its text so far, decoded on (special tokens dropped, as decode_rows does)
    templates: list[TemplateRowText] | None  # per row, with a template: its text and fills so far, decoded on

    @classmethod
    def of(cls, req: Request, tokenizer: Any) -> _RowTexts:
        b = req.prompt.shape[0]
        eos_only = req.eos_only_minimum or (False,) * b
        templates = None
        if req.template is not None:
            fixed = req.template.tolist()
            holes = req.template_holes or [hole_runs(row) for row in fixed]
            prefixes = req.hole_prefixes or {}
            templates = [TemplateRowText(tokenizer, row, spans, {start: prefixes.get((r, start), "") for start, _ in spans})
                         for r, (row, spans) in enumerate(zip(fixed, holes))]
        return cls(req, tokenizer, [None] * b, [None] * b,
                   [0 if only else m for m, only in zip(req.row_budgets()[1], eos_only)],
                   [TextStream(tokenizer) for _ in range(b)], templates)

    def _decode(self, r: int, row: list[int]) -> str:
        template = None if self.req.template is None else self.req.template[r : r + 1]
        prefix = self.req.heal_prefixes[r] if self.req.heal_prefixes else ""
        return strip_prefix(decode_rows(self.tokenizer, [row], template)[0], prefix)

    def text(self, r: int, row: list[int]) -> str:
        """Row `r`'s text of its new tokens `row`: decoded whole (a template's fixed special tokens kept, see
        decode_rows), without the healed prefix the prompt holds, not cut at a stop string."""
        newest = self.newest[r]
        if newest is None or newest[0] != len(row):
            prefix = self.req.heal_prefixes[r] if self.req.heal_prefixes else ""
            raw = self.streams[r].text(row) if self.templates is None else self.templates[r].text(row)
            newest = self.newest[r] = (len(row), strip_prefix(raw, prefix))
        return newest[1]

    def fills(self, rows: list[list[int]]) -> list[list[str]] | None:
        """A template's holes as text, per row, from its new tokens `rows` (all of them, or those so far: a hole not
        yet reached has no text, one reached in part its part); None without a template. See hole_fills."""
        if self.templates is None:
            return None
        return [template.fills(row) for template, row in zip(self.templates, rows)]

    def floor(self, r: int, row: list[int]) -> int:
        """How many characters of the text the first min_new_tokens tokens make: no stop string ends in them
        (vLLM's min_tokens). A row of at most min_new_tokens tokens is all floor."""
        m = self.minimums[r]
        if not m:
            return 0
        if len(row) <= m:
            return len(self.text(r, row))
        first = self.floors[r]
        if first is None:
            first = self.floors[r] = self._decode(r, row[:m])
        # A character the m-th token leaves unfinished ends after it, and is no floor: the first m tokens' text ends
        # in U+FFFD where the row's text has that character. One the model wrote whole is in both.
        return len(first) if self.text(r, row).startswith(first) else len(first.rstrip("\ufffd"))

    def answers(self, rows: list[list[int]]) -> list[str]:
        """Each row's text as the answer reads, from its valid new tokens `rows` (all of them, or those so far):
        `text`, cut before its stop string."""
        texts = [self.text(r, row) for r, row in enumerate(rows)]
        if not self.req.stops:
            return texts
        return [cut_at_stop(text, stops, self.floor(r, row))
                for r, (text, row, stops) in enumerate(zip(texts, rows, self.req.stops))]

    def first_stop(self, r: int, row: list[int], checked: int, final: bool = False) -> int | None:
        """The fewest tokens of `row` whose text holds one of row `r`'s stop strings ending past the floor, or that
        end with a special token one names (None: no stop yet). The first `checked` tokens were searched before, so
        the answer lies after them; bisection, as a prefix that holds a stop keeps holding it. The whole text is
        `text`'s (shared with the answer so far), so a row without a stop costs no decode of its own; the text at
        the answer is kept for the answer. `final`: the row ends with `row` (its EOS, its budget), so the U+FFFD
        that ends its text is written, not a character still arriving (see cut_at_stop)."""
        stops, m = self.req.stops[r] if self.req.stops else [], self.minimums[r]
        lo = max(checked, m)  # a row of at most min_new_tokens tokens is all floor: no stop counts in it
        if not stops or len(row) <= lo:
            return None
        ids = self.req.stop_ids[r] if self.req.stop_ids else None
        # A named special token ends the row at it (as vLLM's stop_token_ids, past min_tokens); its text is dropped
        # from the decoded text, so a stop string can only end before it: search the tokens up to it.
        at = next((i + 1 for i in range(lo, len(row)) if row[i] in ids), None) if ids else None
        row = row if at is None else row[:at]
        floor = self.floor(r, row)

        def holds(text: str, written: bool) -> bool:
            return len(cut_at_stop(text, stops, floor, growing=not written)) < len(text)

        hi, at_hi = len(row), self.text(r, row)
        if not holds(at_hi, final or at is not None):
            return at  # the row's answer is its text through the special token (`text` kept it), or no stop yet
        while hi - lo > 1:  # holds(lo) is False, holds(hi) is True
            mid = (lo + hi) // 2
            text = self._decode(r, row[:mid])
            # (a prefix's trailing U+FFFD reads as one still arriving: its text cannot tell the bytes of one the
            # model wrote from the first of them, so a stop ending in one it wrote counts a token late)
            lo, hi, at_hi = (lo, mid, text) if holds(text, False) else (mid, hi, at_hi)
        self.newest[r] = (hi, at_hi)  # the row's answer is its text through here
        return hi


@dataclass
class _Answers:
    """Each row's valid new tokens so far, on the host, for the Commit events' `texts_so_far` and `fills_so_far`:
    read once a canvas (never per step) through the generation's _RowTexts, and only with a tokenizer."""

    texts: _RowTexts
    rows: list[list[int]]

    @classmethod
    def of(cls, texts: _RowTexts) -> _Answers:
        return cls(texts, [[] for _ in texts.newest])

    def add(self, committed: list[list[int]], written: list[int]) -> tuple[list[str], list[list[str]] | None]:
        """A canvas's `committed` tokens, of which each row keeps what takes it to `written` valid tokens (the rest
        is padding); returns (texts so far, fills so far)."""
        for row, new, n in zip(self.rows, committed, written):
            row += new[: n - len(row)]
        return self.texts.answers(self.rows), self.texts.fills(self.rows)


def normalize_stops(stop: Any, batch: int) -> list[list[str]] | None:
    """`stop`: a string, a list of strings (every row; a 1-D numpy array of them too), or one list of strings per
    row -> one list per row."""
    expected = "a string, a list of strings or one list per row"
    # numpy (as other per-batch arguments): a list of strings. Not np.str_ (an array's element), which has an ndim
    # of 0 and is a str
    if hasattr(stop, "ndim") and hasattr(stop, "tolist") and not isinstance(stop, str):
        if stop.ndim != 1:
            raise ValueError(f"stop: expected {expected}, got a {stop.ndim}-D array (only a 1-D one is a list)")
        stop = stop.tolist()
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):  # the type first: comparing an unknown object could raise or mislead
        raise ValueError(f"stop: expected {expected}, got {type(stop).__name__}")
    if all(isinstance(s, str) for s in stop):
        rows = [list(stop)] * batch
    elif all(isinstance(r, (list, tuple)) for r in stop):
        if len(stop) != batch:
            raise ValueError(f"stop: expected one list of stop strings per row ({batch}), got {len(stop)}")
        rows = [list(r) for r in stop]
    else:
        raise ValueError(f"stop: expected {expected}, got {stop!r}")
    if any(not isinstance(s, str) or not s for r in rows for s in r):
        raise ValueError("stop: stop strings must be non-empty strings")
    for s in (s for r in rows for s in r):
        if (problem := utf8_problem(s)) is not None:
            raise ValueError(f"stop: {s!r} is not valid UTF-8 ({problem}); generated text always is, so it would "
                             "never match")
    return rows if any(rows) else None


def special_stop_ids(tokenizer: Any, stops: list[list[str]] | None) -> list[frozenset[int]] | None:
    """Per row, the special tokens its stop strings name (None: none does). Decoded text leaves special tokens out,
    so a stop string that is one's text (`"<end_of_turn>"`, as chat APIs take it) is never in it: it names that
    token, which ends the row as an EOS would. A stop string that holds one's text among other text could not be
    found in either: refused, naming both."""
    if not stops:
        return None
    special = tokenizer.special_texts()
    rows = []
    for row in stops:
        ids: set[int] = set()
        for s in row:
            if s in special:
                ids |= special[s]
            elif (inside := next((t for t in special if t in s), None)) is not None:
                raise ValueError(f"stop: {s!r} holds the special token {inside!r} among other text, and generated "
                                 f"text leaves special tokens out, so it would never match; give {inside!r} as a stop "
                                 "string of its own (it ends the row at that token)")
        rows.append(frozenset(ids))
    return rows if any(rows) else None


def cut_at_stop(text: str, stops: Sequence[str], floor: int = 0, growing: bool = False) -> str:
    """`text` up to (not including) the earliest stop string it holds that ends past its first `floor`
    characters (the text of the min_new_tokens, where a stop does not count: vLLM's min_tokens). `growing`: the text
    of a row that may go on, whose trailing replacement characters may be a character whose bytes are still arriving: a
    stop string does not end in them yet (one holding U+FFFD would end a row at a half-written character that its final
    text does not have); the next token settles them, and a U+FFFD the model wrote then counts."""
    cut, searched = len(text), text.rstrip("\ufffd") if growing else text
    for s in stops:
        at = searched.find(s, max(0, floor - len(s) + 1)) if s else -1
        if at >= 0:
            cut = min(cut, at)
    return text[:cut]


def settled_text(text: str, stops: Sequence[str]) -> str:
    """The part of a growing text (already cut at its stop string, as Commit.texts_so_far is) that later tokens
    cannot change: without a trailing replacement character (a character whose bytes are still arriving) and
    without a tail that could be the start of a stop string (the next tokens may complete it). What a stream
    shows, Commit.settled_texts and the server's chunks alike, so that it never has to take text back."""
    text = text.rstrip("\ufffd")
    hold = max((_stop_start(text, s) for s in stops), default=0)
    return text[: len(text) - hold]


def _stop_start(text: str, stop: str) -> int:
    """The longest k < len(stop) such that `text` ends with stop[:k], in time linear in len(stop). (Testing every k
    with text.endswith(stop[:k]) copied stop[:k] each time: quadratic, on every canvas and streamed chunk, so 16
    stops of 25k characters took 12.7 s of a 15.7 s generation.)"""
    if len(stop) < 2 or not text:
        return 0
    tail = text[-(len(stop) - 1):]  # a start of the stop that is not all of it
    last = tail[-16:]
    end = min(len(stop) - 1, len(tail))
    # A start of 16 characters or more ends where the stop holds the text's last 16: str.rfind finds those, longest
    # first, and a stop holds few of them, unless it repeats itself; after a few, KMP's linear scan takes over.
    for _ in range(4):
        end = stop.rfind(last, 0, end) + len(last)
        if end < len(last):  # none: a start is shorter than `last`, if any
            return next((k for k in range(len(last) - 1, 0, -1) if tail.endswith(stop[:k])), 0)
        if tail.endswith(stop[:end]):
            return end
        end -= 1
    pi = _prefix_function(stop)
    k = 0  # the longest start of the stop that the tail read so far ends with
    for c in tail:
        while k and c != stop[k]:
            k = pi[k - 1]
        if c == stop[k]:
            k += 1
    return k


@lru_cache(maxsize=32)
def _prefix_function(s: str) -> list[int]:
    """KMP's prefix function: [i], the longest proper prefix of s[: i + 1] that ends it too. Kept for a stream's
    stops, which every canvas and chunk tests again."""
    pi, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


def text_with_special_tokens(tok: Any, tokens: list[int], eos_ids: Sequence[int], heal_prefix: str,
                             stops: Sequence[str], stream: TextStream | None = None) -> str:
    """An answer's valid new `tokens` as a response template reads them: decoded with their special tokens, but
    without the end-of-turn token that ended the row, the healed prefix that the prompt holds, and the stop string
    that ended it (`stops`: the row's, when one did; it completes in the last token, so the cut is at the first
    occurrence ending there, as the answer's text is cut). `stream`: a TextStream of `tok` keeping special tokens,
    which read the answer's earlier tokens (a reply read at each commit): it decodes only what the new ones add."""
    if tokens and tokens[-1] in eos_ids:
        tokens = tokens[:-1]
    text = strip_prefix(tok.decode(tokens, skip_special_tokens=False) if stream is None else stream.text(tokens),
                        heal_prefix)
    if stops and tokens:
        text = cut_at_stop(text, stops, len(strip_prefix(tok.decode(tokens[:-1], skip_special_tokens=False),
                                                         heal_prefix).rstrip("\ufffd")))
    return text


def _check_constraint(banned: Any, canvas: torch.Tensor, vocab: int) -> torch.Tensor:
    """A constraint's result must be a bool mask [b, C, V] (or broadcastable to it): checked by shape, no sync."""
    b, c = canvas.shape
    if not isinstance(banned, torch.Tensor) or banned.dtype != torch.bool or banned.dim() != 3:
        got = f"{banned.dtype} {list(banned.shape)}" if isinstance(banned, torch.Tensor) else type(banned).__name__
        raise ValueError(f"constraint: expected a bool tensor [{b}, {c}, {vocab}] of banned tokens, got {got}")
    if any(n not in (1, want) for n, want in zip(banned.shape, (b, c, vocab))):
        raise ValueError(f"constraint: expected shape [{b}, {c}, {vocab}] (or broadcastable), got {list(banned.shape)}")
    if banned.device != canvas.device:  # torch's own error names no hook ("not on the expected device")
        raise ValueError(f"constraint: expected a mask on the canvas's device {canvas.device}, got one on "
                         f"{banned.device} (make it with device=draft.device)")
    return banned


def no_choice(logits: torch.Tensor, open_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Whether any (open) position's distribution is undefined: a NaN or +inf logit, or no finite one (every token
    banned: bans are -inf in the logits). A 0-d bool tensor on the logits' device, read when the caller chooses (a
    denoising step reads none)."""
    # One reduction: the largest logit is NaN if any is, +inf if any is, and -inf if every token is banned.
    undefined = ~torch.isfinite(logits.amax(-1))
    return (undefined if open_positions is None else undefined & open_positions).any()


class NonFiniteLogits(ValueError):
    """The model itself gave NaN or infinite logits (not a hook): decoding them would write token 0 everywhere."""


def _all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or inf. FP8 codes (torch has no isfinite for them: "not implemented for
    'Float8_e4m3fn'") are widened to float32 a slice at a time, never a whole expert tensor's worth at once."""
    if t.element_size() > 1:
        return bool(torch.isfinite(t).all())
    return all(bool(torch.isfinite(part.float()).all()) for part in t.reshape(-1).split(1 << 24))


def model_logits_fault(model: DiffusionGemma, where: str) -> NonFiniteLogits:
    """The error for NaN / inf logits from the model at `where`, saying why: weights that hold NaN or inf (a damaged
    checkpoint, or one saved from a run that diverged), else activations that overflowed the model's dtype. Looked
    into only once it has happened, so the check itself costs one reduction of a canvas's first logits."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    bad = [name for name, t in tensors if t.is_floating_point() and not _all_finite(t)]
    if bad:
        why = (f"{len(bad)} of its {len(tensors)} weight tensors hold NaN or inf ({', '.join(bad[:3])}"
               f"{', ...' if len(bad) > 3 else ''}): the checkpoint is damaged, or was saved from a run that diverged")
    else:
        dtype = str(model.dtype).removeprefix("torch.")
        hint = " (float16 is known to overflow Gemma's activations: load it in bfloat16 or float32)" \
            if model.dtype == torch.float16 else ""
        why = f"its weights are finite, so its activations overflowed {dtype}{hint}"
    return NonFiniteLogits(f"the model's logits are NaN or infinite at {where}, so there is nothing to decode: {why}")


def processed_logits(processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
    """`processor(logits [b, C, V], rows [b]) -> logits`, checked: float logits of the same shape, contiguous and
    blockpress's own: the temperature and the bans written after it go in place, which an expanded view (one row's
    logits for all, say) would spread to every row, and which would change a tensor the caller keeps (a table of
    logits returned at every step would be divided by each step's temperature in turn)."""
    # rows: a copy, as the engine goes on using its own (a transformers-style fn(input_ids, scores) writes into
    # its second argument, and writing into these would move rows)
    processed = processor(logits, rows.clone())
    if (not isinstance(processed, torch.Tensor) or processed.shape != logits.shape
            or not processed.dtype.is_floating_point):
        got = (f"{processed.dtype} {list(processed.shape)}" if isinstance(processed, torch.Tensor)
               else type(processed).__name__)
        raise ValueError(f"logits_processor: expected float logits of shape {list(logits.shape)}, got {got}")
    if processed.device != logits.device:  # a processor that works on the CPU (numpy, say) for a GPU model
        raise ValueError(f"logits_processor: expected logits on the model's device {logits.device}, got them on "
                         f"{processed.device} (return them with .to(logits.device))")
    if processed.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
        return processed.clone(memory_format=torch.contiguous_format)  # not ours: perhaps the caller's to keep
    return processed.contiguous()


@dataclass
class _Bans:
    """Tokens banned at a few (row, position) pairs of a canvas: the first new token under token healing, and a
    healed template hole's first position (its token must extend the whitespace it took over). Kept sparse: a
    dense [B, C, V] mask is 64 MiB a row at a 262,144-token vocabulary, and indexing it by the working rows
    copies it on every step."""

    rows: torch.Tensor  # [n] rows (of the batch, or of the working sub-batch once `take`n)
    positions: torch.Tensor  # [n] canvas positions
    banned: torch.Tensor  # [n, V] bool

    @classmethod
    def of_canvas(cls, req: Request, ci: int, lo: int, keep: int, device: torch.device) -> _Bans | None:
        """The bans of canvas `ci` (new tokens lo .. lo + keep), or None when it has none."""
        found: dict[tuple[int, int], torch.Tensor] = {}
        if ci == 0 and req.first_allowed is not None:
            found.update({(r, 0): ~ok for r, ok in enumerate(req.first_allowed)})
        for (r, p), ok in (req.hole_allowed or {}).items():
            if lo <= p < lo + keep:  # a position named twice takes both bans (one index_put cannot)
                found[r, p - lo] = found[r, p - lo] | ~ok if (r, p - lo) in found else ~ok
        if not found:
            return None
        rows, positions = zip(*found)
        return cls(torch.tensor(rows, device=device), torch.tensor(positions, device=device),
                   torch.stack(list(found.values())).to(device))

    def take(self, keep: torch.Tensor, size: int) -> _Bans | None:
        """The bans of the sub-batch rows `keep` (of `size` rows), renumbered to them. One host sync, at a shrink."""
        where = torch.full((size,), -1, dtype=torch.long, device=keep.device)
        where[keep] = torch.arange(keep.numel(), device=keep.device)
        rows = where[self.rows]
        kept = rows >= 0
        if not bool(kept.any()):
            return None
        return _Bans(rows[kept], self.positions[kept], self.banned[kept])

    def apply(self, logits: torch.Tensor) -> None:
        """-inf at the banned tokens of `logits` [b, C, V] (in place; only the n named rows are read and written)."""
        at = (self.rows, self.positions)
        logits.index_put_(at, logits[at].masked_fill(self.banned, float("-inf")))


def prepare_logits(req: Request, logits: torch.Tensor, rows: torch.Tensor, *, history: torch.Tensor | None = None,
                   canvas: torch.Tensor | None = None, counted: torch.Tensor | None = None, bans: _Bans | None = None,
                   unknown: torch.Tensor | None = None, eos: torch.Tensor | None = None,
                   eos_banned: torch.Tensor | None = None) -> torch.Tensor:
    """One step's logits [b, C, V] made ready to sample, by both engines (the AR loop's are a canvas of one position):
    through the logits processor (`rows` [b]: the batch rows they are), less the repeat penalties (`history`, and
    the canvas positions that count: see penalize_repeats), then every ban at -inf: `bans` (token healing, healed
    holes), the tokenizer's `unknown` ids and the `eos` ids where `eos_banned` [b, C]. The processor sees the
    model's logits; a ban is -inf, which the penalties leave -inf, so their order changes nothing. The bans are
    written in place: `logits` is this step's own (processed_logits returns a contiguous tensor of its own)."""
    if req.logits_processor is not None:
        logits = processed_logits(req.logits_processor, logits, rows)
    if history is not None:
        logits = penalize_repeats(req.sampler, logits, history, canvas, counted)
    if bans is not None:
        bans.apply(logits)
    if unknown is not None:
        logits.index_fill_(-1, unknown, float("-inf"))
    if eos_banned is not None:
        logits[:, :, eos] = logits[:, :, eos].masked_fill(eos_banned[:, :, None], float("-inf"))
    return logits


@dataclass
class _Canvas:
    """What stays the same over a canvas's steps: where it lies in the new tokens, what is given, what is banned."""

    index: int
    lo: int  # its first new token
    keep: int  # the new tokens it holds (the last canvas may hold fewer than canvas_length)
    fixed: torch.Tensor | None  # [B, C] a template's tokens, -1 in its holes
    scored: torch.Tensor  # [B, C] bool: the positions within each row's new tokens (its max_new_tokens)
    writable: torch.Tensor  # [B, C] bool: the scored positions not given (the ones this canvas writes)
    bans: _Bans | None  # token healing: the first new token; healed holes
    eos_banned: torch.Tensor | None  # [B, C] bool: no EOS here (before a row's min_new_tokens, or in a template)
    short_rows: bool  # some row's budget ends before `keep` (in this canvas or earlier): its tail is not its own

    @classmethod
    def of(cls, req: Request, ci: int, canvas_len: int, device: torch.device) -> _Canvas:
        b = req.prompt.shape[0]
        budgets, minimums = req.row_budgets()
        lo = ci * canvas_len
        keep = min(canvas_len, max(budgets) - lo)
        fixed = None
        if req.template is not None:
            fixed = torch.full((b, canvas_len), -1, dtype=torch.long, device=device)
            # Past a row's end (the template's is pad there, so is the canvas past `keep`) nothing is scored; the
            # slots are pinned to pad so they stay quiet, as they are when the row runs alone.
            fixed[:, :keep] = req.template[:, lo : lo + keep].to(device)
            fixed[:, keep:] = req.pad_id
        # A row's last canvas ends at its own budget, as it would alone: the positions past it are not scored (see
        # denoise_step), so their churn holds no row, and commit pads them.
        position = torch.arange(canvas_len, device=device)[None]
        scored = position < torch.tensor(budgets, device=device)[:, None] - lo
        eos_banned = None
        if req.eos_ids and req.template is not None:  # a template's holes have a fixed length: no EOS inside
            eos_banned = torch.ones(b, canvas_len, dtype=torch.bool, device=device)
        elif req.eos_ids and max(minimums) > lo:  # none before a row's min_new_tokens
            eos_banned = position < torch.tensor(minimums, device=device)[:, None] - lo
        writable = scored if fixed is None else scored & (fixed < 0)
        return cls(ci, lo, keep, fixed, scored, writable, _Bans.of_canvas(req, ci, lo, keep, device), eos_banned,
                   min(budgets) < lo + keep)


@dataclass
class _Working:
    """The rows of a batch still denoising the current canvas, with everything indexed to them once (not on
    every step: only the state changes within a canvas)."""

    rows: torch.Tensor  # [b'] their indices in the full batch
    state: CanvasState
    cache: KVCache
    rules: CanvasRules  # their givens, kept positions and draws, as the sampler step takes them
    writable: torch.Tensor  # see _Canvas
    bans: _Bans | None  # numbered by the sub-batch
    eos_banned: torch.Tensor | None
    seeds: torch.Tensor
    finished: torch.Tensor  # [b'] ended in an earlier canvas (an EOS, a stop string, its max_new_tokens)
    history: torch.Tensor | None  # [b', V] their committed new tokens, counted (the repeat penalties)

    def shrink(self, keep: torch.Tensor, canvas_len: int, cache_rows: torch.Tensor | None = None) -> _Working:
        """Only the sub-batch positions `keep` (the cache rows are copied here, once per shrink; `cache_rows`: their
        rows in the cache, where it holds fewer rows than the batch: every one of them is the cache as it is)."""
        scored, draws = self.rules.scored, self.rules.draws
        assert scored is not None and draws is not None  # (the decoding loop's rules carry both)
        whole = cache_rows is not None and cache_rows.numel() == self.cache.batch_size  # (sorted, distinct rows)
        return _Working(
            rows=self.rows[keep], state=take_rows(self.state, keep),
            cache=self.cache if whole else self.cache.rows(keep if cache_rows is None else cache_rows, canvas_len),
            rules=replace(self.rules, fixed=None if self.rules.fixed is None else self.rules.fixed[keep],
                          scored=scored[keep], draws=draws.take(keep)),
            writable=self.writable[keep], bans=None if self.bans is None else self.bans.take(keep, self.rows.numel()),
            eos_banned=None if self.eos_banned is None else self.eos_banned[keep],
            seeds=self.seeds[keep], finished=self.finished[keep],
            history=None if self.history is None else self.history[keep])


@dataclass
class _Stops:
    """A batch's stop strings, searched in its new tokens (`_RowTexts.first_stop`), and the rows they ended."""

    req: Request
    texts: _RowTexts | None  # the rows' texts (None: no tokenizer, so no stop search)
    length: torch.Tensor  # [B] the new tokens each row keeps: through its stop string, or its max_new_tokens
    stopped: list[bool]  # the rows a stop string ended (the server's finish_reason)

    @classmethod
    def of(cls, req: Request, texts: _RowTexts | None, device: torch.device) -> _Stops:
        budgets, _ = req.row_budgets()
        return cls(req, texts, torch.tensor(budgets, dtype=torch.long, device=device), [False] * len(budgets))

    @property
    def active(self) -> bool:
        return bool(self.req.stops) and self.texts is not None  # a template never has stops (LM._stops refuses)

    def find(self, tokens: torch.Tensor, counts: list[int], skip: list[bool], checked: list[int],
             finished: torch.Tensor) -> dict[int, int]:
        """Rows whose first `counts` new `tokens` [B, n] hold a stop string -> the tokens they keep (through the one
        completing it); those rows end (`finished` is set in place). Rows in `skip` are not searched; `checked`:
        the tokens searched before (see `_RowTexts.first_stop`). Only called when `active`."""
        texts = self.texts
        assert texts is not None
        hits = {}
        ends, budgets = finished.tolist(), self.length.tolist()  # (a row that ends here, by its EOS or its budget)
        for r, (row, c, s) in enumerate(zip(tokens.tolist(), counts, skip)):
            if not s and (m := texts.first_stop(r, row[:c], checked[r], ends[r] or c >= budgets[r])) is not None:
                hits[r] = m
                finished[r], self.length[r], self.stopped[r] = True, m, True
        return hits


def _encode_prompt(model: DiffusionGemma, req: Request, prompt: torch.Tensor, cache: KVCache | None, room: int,
                   logits: bool) -> tuple[KVCache, torch.Tensor | None, list[int]]:
    """Encode the prompt into `cache` (a new one when None), with `room` more slots past what it holds; through
    `req.prefix_cache` when set. Returns (cache, the last prompt token's logits [B, V] if `logits`, prompt tokens
    reused per row)."""
    b = prompt.shape[0]
    version = model.weights_version  # before encoding: weights changed meanwhile are caught at the first step
    # A continued cache holds keys of the weights it was filled with: checked by LM._check_cache when the call was
    # made, and here again, as a stream begins at its first event (weights changed in between would go on
    # silently).
    held = cache.weights_version if cache is not None and cache.length else None
    with weights_unchanged(model, version if held is None else held):
        if req.prefix_cache is not None:
            if cache is not None:
                raise ValueError("prefix_cache: not together with cache= (a continued conversation already skips what "
                                 "its cache holds)")
            cache, last, reused = encode_prompts(model, prompt, req.attention_mask, req.prefix_cache, room, logits)
        else:
            if cache is None:  # a given cache was checked against the model and the batch by LM._check_cache
                cache = KVCache.allocate(model.config.text, b, room, model.dtype, model.device)
            # a turn's room is at most the context and one canvas of scratch: growth stops there (lm._check_context)
            most = model.config.text.max_position_embeddings + model.config.canvas_length
            cache.ensure_capacity(cache.length + room, most)
            mask, reused = req.attention_mask, [0] * b
            if cache.length and mask is not None and not bool(mask.all()):
                last = _encode_continuation(model, prompt, mask.to(prompt.device).bool(), cache, logits)
            else:
                last = model.encode(prompt, cache, attention_mask=mask, logits="last" if logits else "none")
    cache.weights_version = version  # what a later turn (LM._check_cache) and each step are checked against
    return cache, last, reused


def _encode_continuation(model: DiffusionGemma, prompt: torch.Tensor, mask: torch.Tensor, cache: KVCache,
                         logits: bool) -> torch.Tensor | None:
    """A left-padded batch of next turns, appended to a conversation's cache so that each row is exactly what it
    would be alone. Left padding here would leave a gap between a row's history and its new tokens, and sliding
    windows count slots: so every row's tokens but its last are written right after its history (padding on the
    right), the padding is moved to the far left (`compact`), and the last tokens follow as one column."""
    rows = [prompt[i][mask[i]] for i in range(prompt.shape[0])]
    width = max(r.numel() for r in rows) - 1
    if width:
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=prompt.device)
        head = torch.zeros(len(rows), width, dtype=torch.bool, device=prompt.device)
        for i, r in enumerate(rows):
            ids[i, : r.numel() - 1], head[i, : r.numel() - 1] = r[:-1], True
        model.encode(ids, cache, attention_mask=head)  # a row with one new token encodes only padding here
        cache.compact()
    last = torch.stack([r[-1] for r in rows])[:, None]
    return model.encode(last, cache, logits="last" if logits else "none")


def canvas_positions(new_tokens: int, canvas_length: int) -> int:
    """The positions after the prompt that block diffusion takes for `new_tokens`: whole canvases, since a canvas
    denoises all its positions, kept or not. What a context check must count (the new tokens alone let a last
    canvas run past the context)."""
    return -(-new_tokens // canvas_length) * canvas_length


def canvas_room(context: int, used: int, canvas_length: int) -> int:
    """The new tokens that fit after `used` of a `context` of positions: the free positions, in whole canvases
    (block diffusion fills every canvas it opens); the most max_new_tokens may be there."""
    return max(0, context - used) // canvas_length * canvas_length


def _new_length(req: Request) -> int:
    """The new tokens a request's batch holds: its template's, or the largest max_new_tokens."""
    return max(req.row_budgets()[0])


@dataclass
class _Decoding:
    """A block-diffusion generation between its canvases: the batch's new tokens and counts so far, and the three
    things done to each canvas (`denoise`, `commit`, `encode`)."""

    model: DiffusionGemma
    fns: StepFunctions
    req: Request
    cache: KVCache
    drafts: bool  # yield a Draft after every step
    seeds: torch.Tensor  # [B]
    draws: RowDraws  # [B] each row's draw temperature, top_k and top_p
    numbers: StepNumbers  # the sampler's numbers as tensors (see StepNumbers)
    eos: torch.Tensor  # the EOS ids ([-1] when there are none)
    new_tokens: torch.Tensor  # [B, N]: pad after a row's end
    written: torch.Tensor  # [B] the valid new tokens so far (through an EOS or a stop string)
    finished: torch.Tensor  # [B] bool: the row has ended (EOS, stop string, its max_new_tokens written)
    budgets: torch.Tensor  # [B] each row's max_new_tokens
    passes: torch.Tensor  # [B] decoder passes per row
    steps_per_canvas: torch.Tensor  # [B, canvases]
    history: torch.Tensor | None  # [B, V]: the committed new tokens counted per row (for the repeat penalties)
    unknown: torch.Tensor | None  # req.unknown_ids on the device
    stops: _Stops
    start: float  # when denoising began (the events' elapsed time)
    # Rows `cancelled` ended alone (it said so of some rows, not all): a bool per row, on the host, None while it
    # named none. They end as at their max_new_tokens, within a step. Where `drop_ended` (no cache handed back, no
    # logits processor that mixes rows), the cache lets go of every ended row at the next canvas, cut or ended by an
    # EOS, a stop string or its budget (`held`: the rows it still holds; None: all), once: a server's client that left
    # a shared batch stops costing passes and memory at once, and later canvases neither copy the ended rows' cache
    # out of the way (copying the others' rows takes a second cache's worth at the peak) nor encode them.
    cut_rows: list[bool] | None = None
    drop_ended: bool = False
    held: torch.Tensor | None = None

    @cached_property
    def step_cfg(self) -> SamplerConfig:
        """What a denoising step reads of the sampler config (its numbers come from `rules`: see
        SamplerConfig.step_choices), built once a generation: building it validates a whole config."""
        return self.req.sampler.step_choices()

    @classmethod
    def begin(cls, model: DiffusionGemma, req: Request, cache: KVCache, fns: StepFunctions, texts: _RowTexts | None,
              drafts: bool, keep_cache: bool = False) -> _Decoding:
        device, n_new = model.device, _new_length(req)
        b, vocab = req.prompt.shape[0], model.config.text.vocab_size
        n_canvases = -(-n_new // model.config.canvas_length)
        zeros = torch.zeros(b, dtype=torch.long, device=device)
        return cls(model, fns, req, cache, drafts, seeds=req.row_seeds().to(device), draws=req.row_draws(device),
                   numbers=StepNumbers.of(req.sampler),
                   eos=torch.tensor(req.eos_ids or [-1], device=device),
                   new_tokens=torch.full((b, n_new), req.pad_id, dtype=torch.long, device=device),
                   written=zeros.clone(), finished=zeros.bool(),
                   budgets=torch.tensor(req.row_budgets()[0], dtype=torch.long, device=device), passes=zeros,
                   steps_per_canvas=torch.zeros(b, n_canvases, dtype=torch.long, device=device),
                   history=torch.zeros(b, vocab, device=device) if req.sampler.penalizes_repeats else None,
                   unknown=None if req.unknown_ids is None else req.unknown_ids.to(device),
                   stops=_Stops.of(req, texts, device), start=time.perf_counter(),
                   drop_ended=req.skip_stopped_rows and req.logits_processor is None and not keep_cache)

    def cancelled(self) -> torch.Tensor | bool:
        """Ask `req.cancelled`: True when the whole batch is cancelled, the rows it newly cut [B] bool when it cut some
        (`self.cut_rows` and `self.finished` then hold them), else False. Compared on the host: no device sync a step."""
        said: Any = self.req.cancelled() if self.req.cancelled is not None else False
        b = self.finished.shape[0]
        if inspect.isawaitable(said):  # (a lambda calling an async function): a coroutine is truthy, never run
            if inspect.iscoroutine(said):
                said.close()
            raise ValueError("cancelled: returned an awaitable, which the engine cannot await (it runs outside the "
                             f"event loop); expected True / False or one bool per row ({b}) from a plain function")
        if isinstance(said, torch.Tensor) or hasattr(said, "__array__"):  # one flag a row in a tensor or array, as
            said = said.tolist()  # per-row settings are taken (bool() of it raises 'ambiguous' for two rows and more)
        if isinstance(said, str):  # any text is truthy: "no" would cancel the stream
            raise ValueError(f"cancelled: expected True / False or one bool per row ({b}), got {said!r}")
        if not isinstance(said, (list, tuple)):
            return bool(said)
        if len(said) != b:
            raise ValueError(f"cancelled: expected True / False or one bool per row ({b}), got {len(said)} values")
        said = [bool(x) for x in said]
        # Every row at once, none ended yet: the whole call is cancelled, as True says. Once a row has ended (its
        # text committed, or cut earlier: a criterion marking rows as each is done), the rest are cut as rows and
        # the call ends with its Done, keeping every row's text. (The device read runs once, when all are marked.)
        if all(said) and not bool(self.finished.any()):
            return True
        before = self.cut_rows or [False] * b
        newly = [x and not y for x, y in zip(said, before)]
        if not any(newly):
            return False
        new = torch.tensor(newly, device=self.finished.device)
        self.cut_rows = [x or y for x, y in zip(said, before)]
        self.finished = self.finished | new
        return new

    def drop_ended_rows(self) -> None:
        """Copy the cache without the rows that ended since the last canvas (cut, or `finished` otherwise), freeing
        theirs (see `drop_ended`)."""
        if not self.drop_ended:
            return
        held = torch.arange(self.finished.shape[0], device=self.finished.device) if self.held is None else self.held
        keep = (~self.finished[held]).nonzero()[:, 0]  # (a host read a canvas, not a step, as the canvas's start's)
        if keep.numel() == held.numel() or keep.numel() == 0:
            return
        self.cache = self.cache.rows(keep, self.cache.keys[0].shape[2] - self.cache.length)
        self.held = held[keep]

    def denoise(self, canvas: _Canvas) -> Generator[Draft, None, CanvasState | None]:
        """Denoise one canvas, with a Draft after each step when asked: its final state (None: cancelled)."""
        req, cfg = self.req, self.req.sampler
        canvas_len, vocab = self.model.config.canvas_length, self.model.config.text.vocab_size
        b = self.finished.shape[0]
        all_rows = torch.arange(b, device=self.finished.device)
        self.drop_ended_rows()
        noise = noise_tokens(cfg, self.seeds, canvas.index, cfg.max_denoising_steps + 1, canvas_len, vocab)
        state = init_state(noise, canvas.fixed)
        # Denoising runs on the rows still working (`w`: their rows, state, cache rows, constraints). When rows stop
        # (adaptive stopping, once half have; or an EOS in an earlier canvas) the batch shrinks, so they cost little;
        # every random number is per row, so the survivors compute exactly what they would have.
        # Rows with nothing to write here: ended earlier, or a template canvas without holes (its tokens are given).
        # They start done (a done row's state is frozen and costs no pass), and leave the batch when it shrinks.
        idle = self.finished if canvas.fixed is None else self.finished | (canvas.fixed[:, : canvas.keep] >= 0).all(-1)
        state = replace(state, done=state.done | idle)
        # a logits processor sees the whole batch (the sudoku ensemble mixes rows): see CanvasRules.rows_mix
        rules = CanvasRules(canvas.fixed, canvas.scored, self.draws, self.model.dtype,
                            rows_mix=req.logits_processor is not None, numbers=self.numbers)
        w = _Working(rows=all_rows, state=state, cache=self.cache, rules=rules, writable=canvas.writable,
                     bans=canvas.bans, eos_banned=canvas.eos_banned, seeds=self.seeds, finished=self.finished,
                     history=self.history)
        all_idle = canvas.fixed is not None and bool(idle.all())  # a stretch of given text: commit it as it is
        if not all_idle and self.held is not None:  # the cache holds only the rows not ended (ended rows are idle)
            keep = (~idle).nonzero()[:, 0]
            w = w.shrink(keep, canvas_len, torch.searchsorted(self.held, keep))
        elif not all_idle and req.skip_stopped_rows and b > 1 and bool(idle.any()):
            w = w.shrink((~idle).nonzero()[:, 0], canvas_len)
        hooked = req.logits_processor is not None or req.constraint is not None
        trouble = torch.zeros((), dtype=torch.bool, device=all_rows.device)  # a hook left an open position nothing
        # The model's own logits NaN / inf, a flag per step checked: the first step's alone, as every later step of
        # the same weights shows NaN weights too; in float16 every step's, as its activations can first overflow at
        # a later one (the canvas settling), and NaN logits would decode as token 0 unsaid. Read at the canvas's end (a stream's drafts
        # read each checked step's flag first, as a draft reads the device anyway).
        every_step = self.model.dtype == torch.float16
        broken = torch.zeros(cfg.max_denoising_steps if every_step else 1, dtype=torch.bool, device=all_rows.device)

        def step_fault(k: int) -> NonFiniteLogits:
            return model_logits_fault(self.model, f"canvas {canvas.index}'s "
                                      + ("first denoising step" if k == 1 else f"denoising step {k}"))

        def whole() -> CanvasState:  # every row's state: the working rows' put back among the rest
            return w.state if w.rows is all_rows else put_rows(state, w.rows, w.state)

        for k, step in enumerate(range(0 if all_idle else cfg.max_denoising_steps, 0, -1), start=1):
            if req.cancelled is not None:
                cut = self.cancelled()
                if cut is True:
                    return None
                if cut is not False:  # rows whose caller left: frozen from this step on
                    w.state = replace(w.state, done=w.state.done | cut[w.rows])
                    w.finished = w.finished | cut[w.rows]
                    if bool((w.state.done | w.finished).all()):  # (a sync only on a step that cut rows)
                        break  # nothing left to denoise: without adaptive stopping the steps would run on for no row
            active = ~(w.state.done | w.finished)
            self.passes[w.rows] += active
            self.steps_per_canvas[w.rows, canvas.index] += active
            checked = broken[k - 1] if every_step else broken[0] if k == 1 else None  # this step's NaN/inf flag
            with torch.no_grad():
                logits = self.logits(w, checked)
                if not w.rules.rows_mix:  # the pass was the last reader of the previous step's softmax [B, C, V]: let
                    w.state.sc_probs = None  # it go before the step makes its own (rows_mix: done rows keep theirs)
                if hooked:  # checked on the device; read once the canvas is done (no host sync in a step)
                    trouble |= no_choice(logits, w.writable & ~w.state.done[:, None])
                # argmax candidates read no draws: their 30-odd hash ops a step are skipped
                uniforms = None if cfg.argmax_candidates else hashed_uniforms(w.seeds, canvas.index, step, canvas_len)
                w.state = self.fns.sampler_step(
                    self.step_cfg, w.state, logits, step, noise_tokens(cfg, w.seeds, canvas.index, step, canvas_len, vocab),
                    uniforms, w.rules, own_logits=True,
                )
            if self.drafts:  # the positions kept, and nothing for rows that ended earlier nor past a row's budget
                if checked is not None and bool(checked):  # (a draft reads the device anyway: no sync of its own)
                    # a draft of NaN logits is token 0 everywhere: streamed, it would show before the canvas's error
                    raise step_fault(k)
                view = whole()
                tokens = view.argmax[:, : canvas.keep].masked_fill(self.finished[:, None] | ~canvas.scored[:, : canvas.keep],
                                                                   req.pad_id)
                yield Draft(canvas.index, k, tokens.cpu(), view.accepted.cpu(), (view.done | self.finished).cpu(),
                            time.perf_counter() - self.start)
            if cfg.adaptive_stopping:
                working = ~(w.state.done | w.finished)
                n_working = int(working.sum())  # the step's one host sync (more with drafts or a constraint)
                if n_working == 0:
                    break
                # Shrink only once half the rows have stopped: each shrink copies the cache rows (and, under CUDA
                # graphs, recaptures), and rows stop on nearby steps, so shrinking on every stop costs more than
                # computing a few frozen rows does. At most log2(batch) copies a canvas.
                if req.skip_stopped_rows and n_working <= w.rows.numel() // 2:
                    # (sc_probs: put_rows never reads it: held, it would stay to the canvas's end beside the rows'
                    # own; accepted: a row that leaves accepts none from now on, as a stopped row that stays does)
                    state = replace(whole(), sc_probs=None, accepted=w.state.accepted.new_zeros(b))
                    w = w.shrink(working.nonzero()[:, 0], canvas_len)
        bad = broken.tolist()  # read with the canvas's end (no host sync in a step); the cause, before the hooks' check
        if True in bad:
            raise step_fault(bad.index(True) + 1)
        if hooked and bool(trouble):
            hooks = " / ".join(n for n, f in (("logits_processor", req.logits_processor), ("constraint", req.constraint))
                               if f is not None)
            raise ValueError(f"{hooks}: left a position of canvas {canvas.index} with no token to choose "
                             "(NaN or +inf logits, or every token banned); ban tokens with -inf or a constraint, and "
                             "favour one with a large finite value")
        return whole()

    def logits(self, w: _Working, broken: torch.Tensor | None = None) -> torch.Tensor:
        """One step's logits [b', C, V] for the working rows: the decoder's, through the logits processor and the
        repeat penalties, with the canvas's bans and the constraint's at -inf. `broken` (a 0-d bool, set in place)
        learns whether the decoder's own logits hold NaN or inf (NaN weights, or a dtype overflowed): one reduction,
        on the steps `denoise` checks."""
        req = self.req
        with weights_unchanged(self.model, w.cache.weights_version):
            logits = self.fns.denoise(w.state.canvas, w.cache, self_conditioning_probs=w.state.sc_probs)
        if broken is not None:
            broken |= no_choice(logits)
        # the new text so far counts for the penalties: a template's fixed tokens are given, like the prompt
        counted = None if w.history is None else w.state.settled & w.writable
        logits = prepare_logits(req, logits, w.rows, history=w.history, canvas=w.state.canvas, counted=counted,
                                bans=w.bans, unknown=self.unknown, eos=self.eos, eos_banned=w.eos_banned)
        # The constraint's bans go into the logits too, once: the hooks' check and the sampler read every ban there as
        # -inf (which stays -inf under the temperature).
        if req.constraint is not None:
            banned = req.constraint(w.state.canvas, w.state.settled)
            logits.masked_fill_(_check_constraint(banned, w.state.canvas, logits.shape[-1]), float("-inf"))
        return logits

    def commit(self, canvas: _Canvas, state: CanvasState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the canvas's tokens into the new tokens, pad after an EOS, a stop string or a row's max_new_tokens,
        and count them (in `written`, and for the repeat penalties); end the rows whose budget this canvas spends.
        Returns (the committed tokens [B, keep], the valid ones: None when all are)."""
        req, lo, keep = self.req, canvas.lo, canvas.keep
        committed = state.argmax[:, :keep]
        valid = None
        if canvas.short_rows or self.cut_rows is not None or (req.template is None and (req.eos_ids or self.stops.active)):
            within = canvas.scored[:, :keep]  # each row's own budget (a template row's: its length)
            valid = (~self.finished)[:, None] & within
            ended_before = self.finished
            if req.eos_ids and req.template is None:  # a template's EOS is text it gives (its holes hold none)
                is_eos = torch.isin(committed, self.eos) & within
                valid = valid & _through_first(is_eos)
                self.finished = self.finished | is_eos.any(-1)
            if self.stops.active:
                self.finished = self.finished.clone()  # set in place below; `ended_before` may be this tensor
                b = committed.shape[0]
                tokens = torch.cat([self.new_tokens[:, :lo], committed], dim=1)
                hits = self.stops.find(tokens, (lo + valid.sum(-1)).tolist(), ended_before.tolist(), [lo] * b,
                                       self.finished)
                for r, m in hits.items():
                    valid[r, m - lo :] = False
            committed = committed.masked_fill(~valid, req.pad_id)
        self.new_tokens[:, lo : lo + keep] = committed
        self.written = self.written + (keep if valid is None else valid.sum(-1))  # a new tensor: Commit events hold it
        if self.history is not None:  # count what this canvas wrote: its valid tokens, not a template's givens
            counted = torch.ones_like(committed, dtype=torch.bool) if valid is None else valid
            if canvas.fixed is not None:
                counted = counted & (canvas.fixed[:, :keep] < 0)
            self.history.scatter_add_(1, committed, counted.to(self.history.dtype))
        self.finished = self.finished | (self.budgets <= lo + keep)
        return committed, valid

    def encode(self, committed: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Append the committed tokens to the cache, for the next canvas or the next turn."""
        if self.held is not None:  # the cache's rows only (`drop_ended_rows`)
            committed, valid = committed[self.held], None if valid is None else valid[self.held]
        enc, enc_mask = committed, valid
        if valid is not None and committed.shape[0] == 1:
            # One row: keep the cache free of holes (exactly a re-encoded conversation), drop the padding.
            enc, enc_mask = committed[:, : int(valid[0].sum())], None
        if enc.shape[1]:
            with torch.no_grad(), weights_unchanged(self.model, self.cache.weights_version):
                self.model.encode(enc, self.cache, attention_mask=enc_mask)


WEIGHTS_CHANGED = ("model: its weights changed (lm.to, lm.quantize, a training step) while this call was running, so "
                   "its cache holds the old weights' keys; call again. One LM is not changed while another thread "
                   "generates on it, nor between a stream's events")


@contextmanager
def weights_unchanged(model: DiffusionGemma, version: tuple[int, int] | None) -> Iterator[None]:
    """Run a forward pass of a call whose cache holds keys of the weights at `version` (model.weights_version; None:
    unchecked). Once the weights have changed in place (lm.to, quantize, a training step: another thread's, or the
    caller's between two events of a stream), refuse to go on, and say so where the pass would fail on half-changed
    weights: a cast would go on into torch's "Expected query, key, and value to have the same dtype", and a quantize
    would go on silently, the old weights' keys under the new ones. Two integers compared a pass."""
    if version is not None and model.weights_version != version:
        raise RuntimeError(WEIGHTS_CHANGED)
    try:
        yield
    except RuntimeError as e:
        if version is not None and model.weights_version != version:
            raise RuntimeError(WEIGHTS_CHANGED) from e
        raise


def run(*args: Any, **kwargs: Any) -> Generator[Draft | Commit | Done | Cancelled, None, None]:
    """`_run`'s loop, each resume in the inference mode of the call that began it (torch's decorator enters it per
    resume of a generator): a stream begun under torch.inference_mode makes its tensors there, and drained outside it
    would fail ("Inplace update to inference tensor outside InferenceMode"); run outside it always, a caller's hook
    that updates its own inference tensors would fail, and inference-mode callers would lose its speed."""
    return torch.inference_mode(torch.is_inference_mode_enabled())(_run)(*args, **kwargs)


def _run(
    model: DiffusionGemma,
    req: Request,
    cache: KVCache | None = None,
    drafts: bool = False,
    keep_cache: bool = False,
    tokenizer: Any = None,
    fns: StepFunctions | None = None,
) -> Generator[Draft | Commit | Done | Cancelled, None, None]:
    """The block-diffusion loop. See the module docstring of sampling.py for one step."""
    device = model.device
    canvas_len = model.config.canvas_length
    vocab = model.config.text.vocab_size
    prompt = req.prompt.to(device)
    n_new = _new_length(req)
    n_canvases = -(-n_new // canvas_len)
    noise_token_id = req.sampler.noise_token_id
    if noise_token_id is not None and noise_token_id >= vocab:
        raise ValueError(f"noise_token_id: {noise_token_id} is outside the vocabulary (size {vocab})")

    t0 = time.perf_counter()
    given = cache is not None  # the caller's: a stream left before Done hands back no other
    with torch.no_grad():
        cache, _, reused = _encode_prompt(model, req, prompt, cache, prompt.shape[1] + n_new + canvas_len, logits=False)
    device_sync(device)
    encode_s = time.perf_counter() - t0
    denoise_s = 0.0
    # Each row's text is decoded once a commit, for its stop search, the Commit's texts so far and Done's output.texts.
    texts_of = _RowTexts.of(req, tokenizer) if tokenizer is not None else None
    dec = _Decoding.begin(model, req, cache, fns or StepFunctions.eager(model), texts_of, drafts, keep_cache)
    if not (given or keep_cache):
        del cache  # the decoding holds it alone: the rows that end leave it (drop_ended_rows), and free their memory
    answers = _Answers.of(texts_of) if texts_of is not None else None
    try:
        for ci in range(n_canvases):
            canvas = _Canvas.of(req, ci, canvas_len, device)
            t_canvas = time.perf_counter()
            state = yield from dec.denoise(canvas)
            if state is None:  # cancelled: the stream ends here, saying what it did
                if given:
                    cache.compact()
                yield Cancelled(host_copy(dec.passes), host_copy(dec.written))
                return
            committed, valid = dec.commit(canvas, state)
            # let go of the canvas's state: held to the next canvas's end, its self-conditioning softmax [B, C, V]
            # (256 MB a row at a 262k vocabulary, float32) would stay beside the next canvas's own
            del state
            last = ci == n_canvases - 1 or bool(dec.finished.all())
            if not last or keep_cache:
                dec.encode(committed, valid)
            device_sync(device)
            denoise_s += time.perf_counter() - t_canvas
            host = committed.cpu()
            texts = so_far = fills = settled = None
            finished = (dec.finished | last).cpu()
            if answers is not None:
                rows = host.tolist()
                if valid is not None:  # each row's own tokens: a template row's fixed pads past its end are no text
                    rows = [row[:n] for row, n in zip(rows, valid.sum(-1).tolist())]
                texts = decode_rows(tokenizer, rows, None if canvas.fixed is None else canvas.fixed[:, : canvas.keep])
                texts = _heal_texts(req, texts) if ci == 0 else texts
                so_far, fills = answers.add(rows, dec.written.tolist())
                settled = [text if done else settled_text(text, req.stops[r] if req.stops else ())
                           for r, (text, done) in enumerate(zip(so_far, finished.tolist()))]
            yield Commit(ci, host, steps=host_copy(dec.steps_per_canvas[:, ci]), finished=finished,
                         elapsed=time.perf_counter() - dec.start, texts=texts, num_new_tokens=host_copy(dec.written),
                         texts_so_far=so_far, fills_so_far=fills, settled_texts=settled,
                         stopped=list(dec.stops.stopped), reused_prompt_tokens=list(reused),
                         num_chosen_tokens=host_copy(chosen_tokens(req, dec.written)))
            if last:
                break
    except GeneratorExit:  # a stream left midway (at the last Commit too) keeps what it encoded, each row as alone
        if given:
            cache.compact()
        raise

    if keep_cache:
        cache.compact()  # rows that ended early left holes; a next turn must see each row as it would alone
    out = _output(req, new_tokens=dec.new_tokens, num_valid=dec.written, passes=dec.passes,
                  steps_per_canvas=dec.steps_per_canvas, encode_s=encode_s, denoise_s=denoise_s,
                  cache=cache if keep_cache else None, texts_of=texts_of, stopped=dec.stops.stopped, reused=reused,
                  seeds=dec.seeds)
    yield Done(out)


def run_ar(
    model: DiffusionGemma,
    req: Request,
    cache: KVCache | None = None,
    keep_cache: bool = False,
    tokenizer: Any = None,
    fns: StepFunctions | None = None,
) -> GenerationOutput:
    """Left-to-right decoding with the encoder path and the LM head: the autoregressive baseline.

    Of `req.sampler` it uses what the diffusion candidates use too: argmax candidates (greedy), else a draw from
    `candidate_probs` (each row's draw_temperature, top_k, top_p) of the raw logits, and the penalties. The rest (the
    acceptance rule, its schedule and stopping) is block diffusion's."""
    fns = fns or StepFunctions.eager(model)
    device = model.device
    prompt = req.prompt.to(device)
    b, p = prompt.shape
    budgets, minimums = req.row_budgets()
    n_new, most_min = max(budgets), max(minimums)
    budget, minimum = (torch.tensor(x, dtype=torch.long, device=device) for x in (budgets, minimums))
    row_seed = req.row_seeds().to(device)
    draws = req.row_draws(device)
    eos = torch.tensor(req.eos_ids or [-1], device=device)
    new_tokens = torch.full((b, n_new), req.pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    passes = torch.zeros(b, dtype=torch.long, device=device)
    texts_of = _RowTexts.of(req, tokenizer) if tokenizer is not None else None
    stops = _Stops.of(req, texts_of, device)
    checked = [0] * b
    cfg = req.sampler
    penalized = cfg.penalizes_repeats
    history = torch.zeros(b, model.config.text.vocab_size, device=device) if penalized else None
    unknown = None if req.unknown_ids is None else req.unknown_ids.to(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        cache, logits, reused = _encode_prompt(model, req, prompt, cache, p + n_new + 1, logits=True)
    assert logits is not None  # (asked for: logits=True)
    start = cache.length
    device_sync(device)
    encode_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    all_rows = torch.arange(b, device=device)
    trouble = torch.zeros((), dtype=torch.bool, device=device)  # the logits processor left a row nothing to choose
    first_bans = _Bans.of_canvas(req, 0, 0, 1, device)  # token healing: what the first new token may be
    broken = no_choice(logits)  # the model's own logits after the prompt: read at the first check below
    # In float16 every later token's too (its activations can first overflow there), for the rows still writing:
    # a flag per token, read once at the end (no host sync a token)
    later = torch.zeros(n_new, dtype=torch.bool, device=device) if model.dtype == torch.float16 else None
    for i in range(n_new):
        # as a canvas of one position, every row's (the batch never shrinks); no EOS before a row's min_new_tokens
        eos_banned = (i < minimum)[:, None] if req.eos_ids and i < most_min else None
        logits = prepare_logits(req, logits[:, None], all_rows, history=history, bans=first_bans if i == 0 else None,
                                unknown=unknown, eos=eos, eos_banned=eos_banned)[:, 0]
        if req.logits_processor is not None:  # read with the end checks below (no host sync a token)
            trouble |= no_choice(logits, ~finished)
        if cfg.argmax_candidates:
            token = logits.argmax(-1)
        else:
            token = sample(candidate_probs(draws, logits), hashed_uniforms(row_seed, 0, i, 1)[:, 0])
        token = token.masked_fill(finished, req.pad_id)
        new_tokens[:, i] = token
        if history is not None:  # (made where the sampler penalizes repeats)
            history.scatter_add_(1, token[:, None], (~finished).to(history.dtype)[:, None])
        passes += ~finished
        finished = finished | torch.isin(token, eos) | (budget <= i + 1)  # an EOS, or its max_new_tokens written
        # Checking for the end costs a host sync: do it every 8 tokens, not every token.
        check = i == n_new - 1 or i % 8 == 7
        if check and i < 8 and bool(broken):
            raise model_logits_fault(model, "the first new token")
        if check and req.logits_processor is not None and bool(trouble):
            raise ValueError("logits_processor: left a row with no token to choose (NaN or +inf logits, or every "
                             "token -inf); ban tokens with -inf and favour one with a large finite value")
        if check and stops.active:
            counts = torch.minimum(_count_valid(new_tokens[:, : i + 1], eos), budget).tolist()
            for r, m in stops.find(new_tokens[:, : i + 1], counts, stops.stopped, checked, finished).items():
                new_tokens[r, m:] = req.pad_id
            checked = counts
        stop = i == n_new - 1 or (check and bool(finished.all()))
        if stop and not keep_cache:
            break
        with torch.no_grad(), weights_unchanged(model, cache.weights_version):
            step_logits = fns.encode_step(token[:, None], cache, logits="last")
        assert step_logits is not None  # (asked for: logits="last")
        logits = step_logits
        if stop:
            break
        if later is not None:
            later[i + 1] = no_choice(logits, ~finished)
    if later is not None and bool(later.any()):
        raise model_logits_fault(model, f"new token {int(later.nonzero()[0, 0]) + 1}")
    device_sync(device)
    decode_s = time.perf_counter() - t1
    num_valid = torch.minimum(_count_valid(new_tokens, eos), stops.length)
    # One pass per token kept, as for an EOS row (its EOS counts): stops are found every 8 tokens, and the
    # passes a stopped row runs past its stop string until then make no token of its.
    passes = torch.minimum(passes, stops.length)
    if keep_cache:  # a row that ended goes on encoding pads (until every row ends): they are not its text
        cache.end_rows(start + num_valid)
    return _output(req, new_tokens=new_tokens, num_valid=num_valid, passes=passes, steps_per_canvas=passes[:, None],
                  encode_s=encode_s, denoise_s=decode_s, cache=cache if keep_cache else None, texts_of=texts_of,
                  stopped=stops.stopped, reused=reused, seeds=row_seed)
