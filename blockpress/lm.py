"""`LM`: a loaded model with its tokenizer and generation defaults — the object users hold."""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import difflib
import functools
import gc
import inspect
import json
import os
import sys
import threading
import weakref
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from .cache import KVCache
from .checkpoint import (
    DTYPE_ALIASES,
    DTYPES,
    Passthrough,
    available_bytes,
    check_fits,
    folder_quantization,
    hf_cached_snapshot,
    hf_hub_cache,
    indexed_device,
    load_plan,
    plan_model,
    resolve_device,
    resolve_dtype,
    return_freed_heap,
    save_model,
)
from .checks import (
    check_flag,
    check_keywords,
    check_positive_int,
    is_finite_number,
    is_int,
    outside_inference_mode,
    warn_user,
    weak_members,
)
from .config import ModelConfig
from .files import StagedFiles, expand_user, output_folder, read_json_object, staging
from .generate import (
    Cancelled,
    Commit,
    Done,
    Draft,
    GenerationOutput,
    Request,
    StepFunctions,
    Template,
    _id_row,
    as_tensor,
    canvas_positions,
    canvas_room,
    host_tensor,
    is_text_template,
    left_pad,
    no_choice,
    normalize_stops,
    parse_template,
    prompt_to_ids,
    read_token_ids,
    run,
    run_ar,
    special_stop_ids,
)
from .healing import allowed_first_tokens, heal, heal_into_template
from .healing import heal_holes as heal_holes_of
from .model import GROUPED_MM, DiffusionGemma, lora_wrapped_layer
from .prefix import PrefixCache
from .quantize import check_cast, check_runs, check_scheme
from .sampling import (
    ROW_SETTINGS,
    TEMPERATURE_HINT,
    SamplerConfig,
    check_row_setting,
    check_temperature,
    choice_seed,
)

MODELS_DIR = Path(__file__).parent / "models"
DEFAULT_NEW_TOKENS = 256  # max_new_tokens for a call that gives none, when the checkpoint's settings say nothing
HOLE_LENGTH = 8  # the tokens a template's bare <|hole|> marker gets
# A count of new tokens: one for every row, or one per row (a list, or a 1-D integer tensor / array)
Counts = int | Sequence[int] | torch.Tensor | np.ndarray
# A setting for every row, or one per row: a list, or a 1-D tensor / array (temperature, top_p; flags)
Numbers = float | Sequence[float] | torch.Tensor | np.ndarray
Flags = bool | Sequence[bool] | torch.Tensor | np.ndarray
# Stop strings: one, a list of them for every row, or a list of them per row (tuples and other sequences too)
Stops = str | Sequence[str] | Sequence[Sequence[str]]
# Token ids as prompt_to_ids reads them: a tensor or array [P] / [B, P], a list of ids, or a list of rows that may
# differ in length (each a list, a 1-D tensor or array)
TokenIds = (torch.Tensor | np.ndarray | Sequence[int | np.integer]
            | Sequence[Sequence[int | np.integer] | torch.Tensor | np.ndarray])
# A prompt for generate, stream and generate_ar: a text, a batch of texts, or token ids; a template for infill too
# (text with <|hole|> markers, or ids with -1 in the holes)
Prompt = str | Sequence[str] | TokenIds
# One conversation (a list of {"role", "content"} messages), or a batch of them
Messages = Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]
# What stream and chat_stream yield; a generator, so a caller that leaves early can close() it
Events = Generator[Draft | Commit | Done | Cancelled, None, None]
# One seed per row: a list, or a 1-D integer tensor / array
Seeds = Sequence[int] | torch.Tensor | np.ndarray


def _one_thread_after_fork() -> None:
    """In a process forked from one holding an LM: torch's CPU ops on one thread (what torch's DataLoader gives its
    workers). GNU OpenMP's thread pool does not survive a fork: once the parent has run a threaded op (loading a
    checkpoint does), a forked child's first threaded op waits forever on threads that are not there, so a
    multiprocessing.Pool (fork, Linux's default before Python 3.14) of lm.generate calls would hang in every worker."""
    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)


@functools.cache  # once a process: a hook registered twice would run twice
def _guard_fork() -> None:
    """Register `_one_thread_after_fork` once a process holds a model (import alone changes nothing). Only where
    torch's threads are OpenMP's; the parent keeps its count, and a child may set its own (at its peril)."""
    if hasattr(os, "register_at_fork") and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        os.register_at_fork(after_in_child=_one_thread_after_fork)


def shipped_models() -> list[str]:
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").exists())


def resolve_path(path_or_name: str | Path) -> Path:
    """An HF-format folder, the name of a model shipped inside the package, or a Hugging Face repo id
    ("owner/name", or "owner/name@revision") that is already in the local Hugging Face cache."""
    if not isinstance(path_or_name, (str, Path)) or not str(path_or_name).strip():
        raise ValueError(f"model: expected a checkpoint folder or a shipped model name, got {path_or_name!r}")
    path = expand_user(path_or_name, "model")
    # A bare shipped name is the shipped model, whatever the current folder holds: the CLI's default --model is
    # one, and a folder of that name here (a run's --out, a copy) silently loaded in its place. "./name" (or any
    # path that is not the bare name) is the folder.
    shipped = str(path_or_name) in shipped_models()
    if shipped:
        if path.is_dir():
            warn_user(f"model {str(path_or_name)!r}: loading the shipped model; the folder {path.absolute()} of "
                      f"the same name is not read (give ./{path_or_name} to load it)")
        return MODELS_DIR / str(path_or_name)
    if path.is_dir():
        return path
    if path.is_file():  # config.json or model.safetensors given instead of the folder that holds them
        raise ValueError(f"model {str(path_or_name)!r}: a file; give the checkpoint folder that holds it ({path.parent})")
    name = str(path_or_name)
    repo_id, _, revision = name.partition("@")
    # Only a folder can be named so: absolute, relative to . / .. / ~, more than a repo id's owner/name, or holding a
    # backslash, which no repo id does (Windows' separator: runs\x was advised as `hf download runs\x`). The hub's
    # advice would mislead there (a typo in a path is no model to download).
    parts = repo_id.replace(os.sep, "/").split("/")
    if (Path(name).is_absolute() or name.startswith(("~", ".")) or len(parts) > 2 or not all(parts)
            or "\\" in name):
        raise FileNotFoundError(f"model {name!r}: no such folder ({path.absolute()})")
    snapshot = hf_cached_snapshot(repo_id, revision or "main")
    if snapshot is not None:
        return snapshot
    names = ", ".join(shipped_models()) or "none installed"
    close = difflib.get_close_matches(name, shipped_models(), n=1, cutoff=0.75) if len(parts) == 1 else []
    if close:  # a typo of a shipped name: the hub's advice below would send the user to download another model
        raise FileNotFoundError(f"model {name!r}: no such folder, shipped model (shipped: {names}) or cached repo id; "
                                f"did you mean {close[0]!r}?")
    fetch = (f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`" if len(parts) == 2
             else "e.g. `hf download google/diffusiongemma-26B-A4B-it`")
    raise FileNotFoundError(
        f"model {name!r}: not a checkpoint folder, a shipped model name (shipped: {names}) nor a "
        f"model in the Hugging Face cache ({hf_hub_cache()}); blockpress never downloads: fetch it first, {fetch}"
    )


def _as_ids(x: Any, name: str, vocab_size: int | None, device: torch.device) -> torch.Tensor:
    """Token ids [B, P] on `device`, read like a prompt's (read_token_ids) but one length per row: no padding.
    `vocab_size` None: the caller checks the range itself."""
    ids = read_token_ids(x, name)
    if not isinstance(ids, torch.Tensor):
        lengths = [len(r) for r in ids]
        if len(set(lengths)) > 1:
            raise ValueError(f"{name}: rows of different lengths {lengths}; expected one [B, P] batch of ids")
        ids = torch.tensor(ids, dtype=torch.long, device="cpu")
    t = ids.to(device)
    if vocab_size is not None:
        check_vocab_range(t, name, vocab_size)
    return t


def _check_mask(mask: Any, shape: torch.Size, like: str) -> torch.Tensor:
    """An attention mask: 1 for a real token, 0 for padding, shaped like the prompt, a real token in every row. A
    1-D mask is one row, as a 1-D prompt is (`shape` is the prompt as read: [1, P] then)."""
    if isinstance(mask, (list, tuple)) and mask and all(isinstance(r, torch.Tensor) and r.dim() == 1 for r in mask):
        # rows as 1-D tensors, as a ragged prompt's may be: torch.as_tensor reads a list of tensors only when each
        # holds one number ("only integer tensors of a single element can be converted to an index")
        lengths = [len(r) for r in mask]
        if len(set(lengths)) > 1:
            raise ValueError(f"attention_mask: rows of different lengths {lengths}; expected one row per prompt row, "
                             f"shaped like {like}")
        mask = torch.stack([r.detach().cpu() for r in mask])
    t = as_tensor(mask, "attention_mask", f"a mask of 0 (padding) and 1 (token) shaped like {like}")
    if t.dim() == 1 and len(shape) == 2 and shape[0] == 1:
        t = t[None]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"attention_mask: expected shape {list(shape)} (like {like}), got {list(t.shape)}")
    # Float masks of exactly 0.0 / 1.0 are common (transformers takes them); 0.5 would be truncated to 0 silently.
    odd = t[(t != 0) & (t != 1)] if not t.is_complex() else t.flatten()
    if odd.numel():
        raise ValueError(f"attention_mask: expected 0 (padding) and 1 (token) only, got {odd[0].item()!r}")
    if not bool(t.bool().any(-1).all()):
        raise ValueError("attention_mask: every row needs at least one token (a 1)")
    return t.long()


def _unmasked_to_pad(ids: torch.Tensor, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    """`ids` with `pad_id` wherever `mask` says padding: no layer reads those positions, so any id may stand there
    (transformers users pad with -100, or whatever their tokenizer has), and the range check then sees tokens only."""
    return ids.masked_fill(mask.to(ids.device) == 0, pad_id)


def _token_rows(ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's token ids, its padding (0 in `mask`) left out; mask None: every position is a token. Read through
    numpy on the host: torch's boolean indexing row by row wakes its worker threads, which on a busy machine costs
    up to 60 ms for 8 rows of 4,000 ids (numpy: under 5 ms)."""
    if mask is None:
        return ids.tolist()
    keep = mask.cpu().numpy() != 0
    return [row[k].tolist() for row, k in zip(ids.cpu().numpy(), keep)]


def _padding_to_the_left(
    ids: torch.Tensor, mask: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows with padding after a token (right-padded, or a gap) re-laid with all their padding on the left, as
    `left_pad` lays out ragged rows (mask None: no padding left); a mask already padded on the left is returned as
    it is. Decoding needs it there: a sliding layer reads the last window - 1 *slots* before the canvas, which for
    a right-padded short row are all padding. The result stays on the ids' device."""
    if not bool((mask[:, :-1] > mask[:, 1:]).any()):
        return ids, mask
    left, left_mask = left_pad(_token_rows(ids, mask), pad_id)
    return left.to(ids.device), None if left_mask is None else left_mask.to(ids.device)


# The dtypes each float dtype holds every value of: casting from one to it widens exactly
_WIDER_THAN = {torch.float32: (torch.bfloat16, torch.float16),
               torch.float64: (torch.float32, torch.bfloat16, torch.float16)}


def keeps_values(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting `source` weights to `target` keeps every value (bf16 and fp16 widen to float32 exactly)."""
    return source == target or source in _WIDER_THAN.get(target, ())


def _model_bytes(model: DiffusionGemma, dtype: torch.dtype) -> int:
    """The bytes `model` takes with its parameters in `dtype`: what moving or casting it there allocates (its buffers,
    rotary tables and masks, keep their own dtype)."""
    params = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def _graphs_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why CUDA graphs cannot replay a model on `device` in `dtype` (None: they can). A graph holds no host sync:
    the experts must run as one grouped GEMM, which CUDA has in bf16 only (other dtypes loop over the experts,
    reading their row counts on the host once a layer)."""
    if device.type != "cuda":
        return f"needs a model on a CUDA device, not {device}"
    if dtype != torch.bfloat16:
        return (f"needs bfloat16 weights (the experts' grouped GEMM on CUDA is bf16-only), not "
                f"{str(dtype).removeprefix('torch.')}")
    return None


def check_vocab_range(ids: torch.Tensor, name: str, vocab_size: int) -> None:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got values in [{lo}, {hi}]")


def _dtype_argument(dtype: Any) -> Any:
    """"auto" (transformers' spelling of the checkpoint's own dtype) is None here."""
    return None if isinstance(dtype, str) and dtype.lower() == "auto" else dtype


def _device_argument(device: Any) -> Any:
    """None (the default, as a caller passes it on) is the CPU, load's default device."""
    return "cpu" if device is None else device


def _check_function(value: Any, name: str, signature: str) -> Any:
    """`value` where it is None or callable, else a ValueError naming `name` and the function it takes."""
    if value is not None and not callable(value):
        raise ValueError(f"{name}: expected a function {signature}, got {type(value).__name__}")
    if inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(type(value).__call__):
        # (Starlette's request.is_disconnected is one): its call gives a coroutine, never run, which reads as True
        raise ValueError(f"{name}: an async function, which the engine cannot await (it runs outside the event loop); "
                         f"expected a plain function {signature} (e.g. one reading a flag that async code sets)")
    return value


def _check_logits_processor(processor: Any) -> Any:
    if type(processor).__module__.startswith("transformers."):  # a LogitsProcessorList, a LogitsProcessor or warper
        # (called as blockpress calls its own, with the arguments in other roles, it would fail inside transformers)
        raise ValueError(f"logits_processor: a transformers {type(processor).__name__}, which is called as "
                         "(input_ids, scores); blockpress calls logits_processor(logits, rows) -> logits, the logits "
                         "[B, C, V] of a canvas (generate_ar: [B, 1, V]) and the batch rows [B] they are; for "
                         "transformers' settings use blockpress's own: temperature / draw_temperature, top_k, top_p, "
                         "presence_penalty / frequency_penalty")
    return _check_function(processor, "logits_processor", "(logits, rows) -> logits")


def _listed(ids: Any) -> Any:
    """chat_ids' ids with an array.array of ids (an Example's, as load_jsonl holds them) read as the list of ids it
    holds, one row or each of a list of rows; anything else as it is (_chat_start refuses what is no ids)."""
    if isinstance(ids, array):
        return _id_row(ids, "ids")
    if isinstance(ids, list) and ids and any(isinstance(row, array) for row in ids):
        return [_id_row(row, f"ids[{r}]") if isinstance(row, array) else row for r, row in enumerate(ids)]
    return ids


def _chat_copies(kwargs: dict[str, Any], cache: KVCache | None) -> int:
    """How many output rows chat_ids / chat_stream get per conversation: num_return_sequences (transformers' keyword,
    which generate takes), else 1. Its copies are rows of their own, so chat's bookkeeping (the tokens each cache row
    holds, the reused counts) repeats each conversation's for them: zipped with the conversations alone, it covered
    the first copy only. A value generate refuses is left to it, to say so."""
    n = kwargs.get("num_return_sequences")
    if n is None or not (is_int(n) and n > 1):
        return 1
    if cache is not None:  # the cache holds one row per conversation, and its n copies would need one each
        raise ValueError(f"num_return_sequences: not with cache= (the cache holds one row per conversation, and "
                         f"its {n} copies would need one each); for several replies to one conversation take mark = "
                         "cache.mark(), then call lm.chat once per reply, each with a seed of its own, with "
                         "cache.truncate(mark) between them")
    return int(n)


def _repeat_chat_rows(rows: list[list[int]], common: list[int], copies: int) -> tuple[list[list[int]], list[int]]:
    """Each conversation's rows and held counts once per copy, in the order num_return_sequences repeats rows."""
    return [r for r in rows for _ in range(copies)], [n for n in common for _ in range(copies)]


def _chat_rewind(rows: list[list[int]], held: list[list[int]], common: list[int]) -> str | None:
    """What a mark that lm.chat's rewind drops says in truncate's error (None: no row goes back): the caller only
    called lm.chat, so say that it went back, where, and why (the first row that went back)."""
    r = next((i for i, (had, n) in enumerate(zip(held, common)) if n < len(had)), None)
    if r is None:
        return None
    where = f"{common[r]} tokens" + (f" in row {r}" if len(rows) > 1 else "")
    if held[r][: len(rows[r])] == rows[r]:  # it matched to its end, and its last token is encoded again
        cause = "the conversation it was given ends there (its last token is always encoded again)"
    else:
        cause = (f"the conversation re-tokenized differently there (token {held[r][common[r]]} held, "
                 f"{rows[r][common[r]]} rendered): a reply's text can encode to other tokens than the model wrote "
                 "(two \"\\n\" tokens as one \"\\n\\n\"), or an edit changed the conversation there")
    return (f"a chat turn (lm.chat / lm.chat_ids) took the cache back to the prefix it shares with the conversation, "
            f"at {where}, because {cause}")


def _parameters(method: Callable[..., Any]) -> tuple[str, ...]:
    """The named parameters of an LM method (no self, no **kwargs)."""
    return tuple(name for name, p in inspect.signature(method).parameters.items()
                 if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _check_keywords(call: str, options: tuple[str, ...], given: dict[str, Any], sampler_settings: bool = True,
                    leave_out: tuple[str, ...] = ()) -> None:
    """checks.check_keywords for a generation entry point: `options` (less `leave_out`), then, where it takes
    them as keywords (`sampler_settings`), SamplerConfig's fields."""
    options = tuple(name for name in options if name not in leave_out)
    settings = [f.name for f in fields(SamplerConfig)] if sampler_settings else []
    hints = {"temperature": TEMPERATURE_HINT, "streamer": "for tokens as they come, iterate lm.stream(...)"}
    check_keywords(call, given, options, settings,
                   hints={**(hints if settings else {}), **TRANSFORMERS_HINTS, **OTHER_NAMES_HINTS})


def _check_forwarded(call: str, own: tuple[str, ...], given: dict[str, Any]) -> None:
    """_check_keywords for a method that passes its keywords on to generate or stream (chat, chat_ids, chat_stream,
    infill), so that a refusal names the method called. transformers' keywords are left to generate, which maps them;
    `own`: the method's own parameters, which take the place of generate's prompt."""
    # (but input_ids, transformers' prompt: the method's own take its place, and generate would say it was given the
    # prompt twice, naming neither the call made nor what the method takes)
    _check_keywords(call, tuple(dict.fromkeys((*own, *STREAM_OPTIONS))),
                    {k: v for k, v in given.items() if k not in TRANSFORMERS_KEYWORDS or k == "input_ids"},
                    leave_out=() if "prompt" in own else ("prompt",))


# transformers' generate keywords that have blockpress's meaning: `LM._from_transformers` maps them, one place for
# generate, stream and generate_ar (a DiffusionGemma user's `model.generate(input_ids=..., max_length=...)`)
TRANSFORMERS_KEYWORDS = frozenset({"input_ids", "max_length", "generation_config", "eos_token_id", "pad_token_id",
                                   "num_return_sequences", "stop_strings", "sampler_config"})
# apply_chat_template's own parameters: lm.chat takes them in template_options, beside generate's keywords
CHAT_TEMPLATE_OPTIONS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template", "tools",
                                   "documents"})
# The settings that may be one per row (generate's and generate_ar's), which num_return_sequences repeats with the rows
# where one is given per prompt row, else reads as one per output row (as it does lists of stop strings); one template
# per row is repeated
ROW_KEYWORDS = ("max_new_tokens", "min_new_tokens", "min_new_tokens_eos_only", "draw_temperature", "temperature",
                "top_k", "top_p")
# blockpress's settings as its CLI, its server and OpenAI's API name them: refused, naming the keyword here
OTHER_NAMES_HINTS = {
    "n": "OpenAI's and the server's n is num_return_sequences here (or seeds=[...], one seed a row)",
    "steps": "the CLI's --steps is max_denoising_steps here",
    "max_tokens": "OpenAI's and the server's max_tokens is max_new_tokens here",
    "chat_template_kwargs": "the CLI's and the server's chat_template_kwargs are lm.chat's template_options={...} "
                            "here (the chat template's own options, enable_thinking among them)",
    "prefix": "infill's --prefix (an --input line's \"prefix\") is lm.infill's prompt= here: the text before the "
              "template",
    "input_ids": "transformers' input_ids is the prompt, which this call takes as its first argument",
}
# transformers' keywords with no exact meaning here: refused, naming the nearest setting and how it differs
TRANSFORMERS_HINTS = {
    "do_sample": "transformers' switch between greedy and sampled decoding, which DiffusionGemma's generate has "
                 "not (it always draws candidates on its temperature schedule); the nearest: generate's "
                 "sampler='greedy' and generate_ar's temperature=0 take the argmax, as do_sample=False would, and "
                 "generate's sampler='entropy_bound' and generate_ar's temperature=1 draw, as do_sample=True (the "
                 "checkpoint's generation_config.json says which each does by default)",
    "repetition_penalty": "transformers' repetition_penalty divides a repeated token's logit, the prompt's tokens "
                          "included; the nearest: presence_penalty / frequency_penalty (OpenAI's), which subtract "
                          "from the logits of tokens in the new text only",
    "num_beams": "block diffusion has no beam search; for several samples pass num_return_sequences (or seeds)",
    "use_cache": "blockpress always encodes into a KV cache of its own (`cache=` is a conversation's cache to "
                 "continue, from return_cache=True); leave use_cache out",
    "min_length": "transformers' min_length counts the prompt; the nearest: min_new_tokens, which counts new tokens",
    "stopping_criteria": "the nearest: stop= (strings that end a row) and cancelled= (a callable that ends the "
                         "call), or lm.stream(...) to stop reading whenever you like",
    "output_scores": "generate returns no scores; lm.logits(prompt_ids, canvas_ids) gives a canvas's logits",
    "output_logits": "generate returns no logits; lm.logits(prompt_ids, canvas_ids) gives a canvas's logits",
    "return_dict_in_generate": "generate always returns a GenerationOutput (.sequences is transformers' tensor)",
    "bad_words_ids": "the nearest: generate's constraint(draft, settled) -> banned [B, C, V] or a logits_processor",
    "suppress_tokens": "the nearest: generate's constraint(draft, settled) -> banned [B, C, V] or a logits_processor",
}


@contextlib.contextmanager
def _named_as_given(given_as: dict[str, str]) -> Iterator[None]:
    """A refusal of a transformers keyword's value names the keyword the caller gave (`stop_strings: ...`), not the
    blockpress argument it was mapped onto (`stop: ...`), which the caller never wrote. `given_as`: blockpress's
    name, as an error starts with it, -> the caller's keyword."""
    try:
        yield
    except ValueError as e:
        message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else ""
        ours = next((name for name in given_as if message.startswith(f"{name}:")), None)
        if ours is not None:  # the same error, traceback and all, under the caller's name
            e.args = (given_as[ours] + message[len(ours):],)
        raise


def _generation_settings(config: Any, own: Mapping[str, Any]) -> dict[str, Any]:
    """generate's generation_config=: transformers' (Diffusion Gemma)GenerationConfig or a plain dict, as
    generation_config.json's fields: what it sets (its unset None values, metadata and the reference's cache
    settings left out). A field blockpress does not read is refused: per call, it would look in effect; so are a
    token_healing (the CLI's default: a call passes token_healing= itself) and a bos_token_id other than the
    checkpoint's `own`."""
    if isinstance(config, dict):
        raw = dict(config)
    elif callable(getattr(config, "to_diff_dict", None)):  # what differs from the class's defaults: what is set
        raw = config.to_diff_dict()
    else:
        raise ValueError(f"generation_config: expected transformers' DiffusionGemmaGenerationConfig or a dict of "
                         f"generation_config.json's fields, got {type(config).__name__}")
    out = {}
    for key, value in raw.items():
        if value is None or key.startswith("_") or key == "transformers_version":
            continue
        if key == "return_dict_in_generate" and value is False:  # (the reference then returns a bare tensor)
            raise ValueError(f"generation_config: return_dict_in_generate: false is not a blockpress setting; "
                             f"{TRANSFORMERS_HINTS[key]}")
        if key == "token_healing":  # a checkpoint's default for the CLI, which generate's own argument is per call
            if value == own.get("token_healing"):  # the checkpoint's settings passed back: nothing asked
                continue
            raise ValueError("generation_config: token_healing: a checkpoint's default for `blockpress generate`; "
                             f"per call pass token_healing={value!r} itself")
        if key == "bos_token_id" and value != own.get("bos_token_id"):  # the checkpoint's passed back: nothing asked
            raise ValueError(f"generation_config: bos_token_id: not a per-call setting (the checkpoint's is "
                             f"{own.get('bos_token_id')}; a text prompt starts with the tokenizer's BOS); to start "
                             "with another, pass token ids")
        if key not in KNOWN_GENERATION_KEYS:
            hint = f"; {TRANSFORMERS_HINTS[key]}" if key in TRANSFORMERS_HINTS else ""
            raise ValueError(f"generation_config: {key}: not a blockpress setting (it reads max_new_tokens, "
                             f"max_length, eos_token_id, pad_token_id, sampler_config and SamplerConfig's fields)"
                             f"{hint}")
        out[key] = value.to_dict() if callable(getattr(value, "to_dict", None)) else value  # sampler_config
    return out


def _sampler_config_setting(value: Any) -> dict[str, Any]:
    """generate's sampler_config= (the reference's EntropyBoundSamplerConfig, or a dict of its fields) as
    generation_config.json holds it; its bound is checked with the rest of the call's settings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"_cls_name": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, dict) and "entropy_bound" in value:  # ({} would set no bound, dropping the checkpoint's)
        return dict(value)
    raise ValueError(f"sampler_config: expected transformers' EntropyBoundSamplerConfig or a dict "
                     f"{{'entropy_bound': <number>}}, got {value!r:.60} (or pass entropy_bound= itself)")


def _repeat_rows(value: Any, n: int, name: str) -> Any:
    """Each row of a prompt (or attention_mask) `n` times in a row, as transformers' num_return_sequences repeats
    them: a text or one row of ids is one row."""
    if isinstance(value, str):
        return [value] * n
    if isinstance(value, (list, tuple)):
        # one row of ids, or of a mask's 0/1, False/True or 0.0/1.0 (numbers alone: a row, not rows)
        if value and all(isinstance(x, (int, float, np.integer, np.floating, np.bool_)) for x in value):
            return [list(value)] * n
        return [row for row in value for _ in range(n)]
    try:
        t = host_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name}: expected a text, a list of them, or ids, got {type(value).__name__}") from None
    return (t[None] if t.dim() == 1 else t).repeat_interleave(n, dim=0)


def _check_prefix_cache(prefix_cache: Any) -> PrefixCache | None:
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise ValueError(f"prefix_cache: expected a blockpress.PrefixCache, got {type(prefix_cache).__name__}")
    return prefix_cache


def check_tokenizer(tokenizer: Any, vocab_size: int | None = None, name: str = "tokenizer") -> Any:
    """None or a blockpress Tokenizer: anything else would be accepted and fail at the first text prompt. Given the
    model's `vocab_size`, also one whose ids all fit it: an id past it fails later, at the first prompt or training
    example that holds one. `name`: the argument as the message names it (`blockpress train`: the flag)."""
    if tokenizer is None:
        return None
    # imported here, as in `load`: jinja2 and tokenizers are for models that have a tokenizer
    from .tokenizer import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"{name}: expected None or a blockpress Tokenizer (blockpress.tokenizer.Tokenizer."
                         f"from_dir(folder), or another LM's .tokenizer), got {type(tokenizer).__name__}")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{name}: {tokenizer.vocab_size} tokens, more than the model's vocab_size of {vocab_size} "
                         f"(its config's text.vocab_size): its ids past {vocab_size - 1} have no embedding; give a "
                         f"config with a vocab_size of at least {tokenizer.vocab_size}")
    return tokenizer


def _template_batch(template: Any) -> bool:
    """Whether a template is one per row (a list of texts or of id rows, or a 2-D tensor / array), not one for
    every row (a text, or one row of ids)."""
    if isinstance(template, (list, tuple)):
        return bool(template) and (isinstance(template[0], (str, list, tuple)) or getattr(template[0], "ndim", 0) >= 1)
    return len(getattr(template, "shape", ())) == 2


def _template_texts(template: Any) -> Any:
    """A numpy array of strings as the list of text templates it holds, as a prompt's array of them is read
    (prompt_to_ids); anything else as it is. (Read as ids, it was "expected integer token ids".)"""
    if isinstance(template, np.ndarray) and template.dtype.kind in "US":
        if template.ndim > 1:
            raise ValueError(f"template: a {template.ndim}-D array of strings; text templates go as a str or a 1-D "
                             "list or array of them, one a row")
        return template.tolist()
    return template


def _template_rows(template: Any) -> int:
    """How many rows a template holds: a list of texts or of id rows (lists, or 1-D tensors / arrays), or a 2-D
    tensor; else one (also for an empty batch, which parse_template then refuses by name, not the default prompt of
    no rows)."""
    if not _template_batch(template):
        return 1
    return len(template) if isinstance(template, (list, tuple)) else max(int(template.shape[0]), 1)


def _number(value: Any) -> Any:
    """A 0-d array or tensor of a number (what indexing one gives) as that Python number; anything else as it is,
    a 0-d bool too (a flag refuses np.True_ as it refuses 1). The counts and sampler settings are read through it,
    so a 0-d tensor works wherever a number does, as it does for a seed (check_seed)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "tolist") and not isinstance(value.tolist(), bool):
        return value.tolist()
    return value


def check_seed(seed: Any, name: str) -> int | None:
    """A seed is None or an integer in [0, 2**63) (returned as an int): a Python or numpy integer, or a 0-d integer
    tensor / array (what indexing one gives; `seeds`' elements are read the same way). The per-row seeds live in
    an int64 tensor."""
    if seed is None:
        return None
    if getattr(seed, "ndim", None) == 0 and hasattr(seed, "tolist"):
        seed = seed.tolist()  # a plain number (a float or bool stays one, and is refused below)
    if not is_int(seed) or not 0 <= seed < 2**63:
        hint = (" (one seed per row: seeds=[...]; rows of one prompt with one seed are the same sample)"
                if isinstance(seed, (list, tuple)) or getattr(seed, "ndim", None) else "")
        raise ValueError(f"{name}: expected an integer in [0, 2**63), got {seed!r}{hint}")
    return int(seed)


def _layout_differences(have: tuple, want: tuple) -> list[str]:
    """What differs between a cache's layout (KVCache.layout) and a model's: each part by name, so the message says
    which (it listed 'layers, heads, dtype or device' and then two equal dtypes and devices)."""
    (have_layers, have_dtype, have_device), (want_layers, want_dtype, want_device) = have, want
    out = []
    if len(have_layers) != len(want_layers):
        out.append(f"it has {len(have_layers)} layers, this model {len(want_layers)}")
    elif have_layers != want_layers:
        i = next(i for i, (h, w) in enumerate(zip(have_layers, want_layers)) if h != w)
        out.append(f"its layer {i} holds {have_layers[i][0]} kv heads of size {have_layers[i][1]}, this model's "
                   f"{want_layers[i][0]} of size {want_layers[i][1]}")
    if have_dtype != want_dtype:
        out.append(f"it holds {have_dtype}, this model computes in {want_dtype}")
    if have_device != want_device:
        out.append(f"it is on {have_device}, this model on {want_device}")
    return out


def _as_rows(value: Any, name: str, what: str) -> Any:
    """`value` as given, or as a list where it is one value per row (a list, a tuple, or a 1-D array or tensor).
    `what`: one value, for the error."""
    value = _number(value)
    if hasattr(value, "ndim") and hasattr(value, "tolist"):  # numpy / torch, one value per row
        if value.ndim > 1:
            raise ValueError(f"{name}: expected {what}, or one per row (1-D), got shape {list(value.shape)}")
        value = value.tolist()  # plain numbers (floats and bools stay what they are, and are refused after)
    return list(value) if isinstance(value, (list, tuple)) else value


def _row_counts(value: Any, name: str, batch: int, what: str = "an integer") -> Any:
    """`value` as given, or, where it is one value per row (`_as_rows`), a list of `batch` of them; their values are
    checked by the caller (`_check_budgets`, `_row_draws`). `what`: one value, for the error."""
    value = _as_rows(value, name, what)
    if isinstance(value, list):
        if len(value) != batch:
            raise ValueError(f"{name}: expected {what}, or one per row of the {batch}-row batch, got {len(value)} "
                             "values")
    return value


def _check_budgets(max_new_tokens: Any, min_new_tokens: Any) -> tuple[int | tuple[int, ...], int | tuple[int, ...]]:
    """Every row's max_new_tokens (a positive integer) and min_new_tokens (0 up to the row's max_new_tokens), each
    one integer for every row or a list of one per row (`_row_counts`); returned as ints, or tuples of them."""
    rows = next((len(x) for x in (max_new_tokens, min_new_tokens) if isinstance(x, list)), 1)
    maxes, mins = (x if isinstance(x, list) else [x] * rows for x in (max_new_tokens, min_new_tokens))
    for i, (most, least) in enumerate(zip(maxes, mins)):
        max_name, min_name = (name + (f"[{i}]" if isinstance(x, list) else "") for name, x in
                              (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)))
        check_positive_int(most, max_name)
        if not is_int(least) or not 0 <= least <= most:
            raise ValueError(f"{min_name}: expected an integer in [0, {max_name}={most}], got {least!r}")
    def plain(x: Any) -> int | tuple[int, ...]:  # numpy integers as plain ints
        return tuple(int(v) for v in x) if isinstance(x, list) else int(x)

    return plain(max_new_tokens), plain(min_new_tokens)


def _row_draws(sampler_options: dict[str, Any], batch: int,
               temperature_name: str = "draw_temperature") -> tuple[dict[str, Any], dict[str, tuple]]:
    """`sampler_options` split into the settings for every row and, for each of ROW_SETTINGS given one value per row
    (a list, a tuple, a 1-D array or tensor: a batch of requests at different temperatures), its per-row values,
    each checked and named by its row (`top_p[1]`). `temperature_name`: what the caller calls draw_temperature.
    A 0-d array or tensor is read as its number (`_number`), for every setting."""
    shared, per_row = {name: _number(value) for name, value in sampler_options.items()}, {}
    for name in ROW_SETTINGS:
        label = temperature_name if name == "draw_temperature" else name
        values = _row_counts(shared.get(name), label, batch, "an integer" if name == "top_k" else "a number")
        if isinstance(values, list):
            per_row[name] = tuple(check_row_setting(name, v, f"{label}[{i}]") for i, v in enumerate(values))
            del shared[name]
    return shared, per_row


def _each(count: int | tuple[int, ...]) -> tuple[int, ...]:
    """A checked count's values: the one for every row, or each row's."""
    return count if isinstance(count, tuple) else (count,)


@dataclass
class _PromptRows:
    """A request's prompt as left-padded id rows [B, P] (`mask` None where nothing is padded), `pad_id` their padding;
    `trimmed`: the columns of padding that re-laying the caller's right-padded rows on the left left out (max_length
    counts the width the caller passed, as in transformers)."""
    ids: torch.Tensor
    mask: torch.Tensor | None
    pad_id: int
    trimmed: int = 0

    def rows(self) -> list[list[int]]:
        """Each row's token ids, its padding left out."""
        return _token_rows(self.ids, self.mask)

    def padded(self, rows: list[list[int]]) -> _PromptRows:
        """Other rows (the prompt's, healed), left-padded alike."""
        return _PromptRows(*left_pad(rows, self.pad_id), self.pad_id, self.trimmed)


@dataclass
class _Budgets:
    """A request's token budgets, checked: max_new_tokens as the call gave it (`asked`, None: unset) and as it runs,
    min_new_tokens, and each row's min_new_tokens_eos_only where any row's is True (else None)."""
    asked: Any
    max_new_tokens: int | tuple[int, ...]
    min_new_tokens: int | tuple[int, ...]
    eos_only_minimum: tuple[bool, ...] | None


@dataclass
class _TemplateLayout:
    """A request's template, parsed and healed, and the prompt it follows (healing may move a text prompt's
    trailing space into a hole): with the prefixes healing gave the rows and the holes, and what each hole's first
    token may be."""
    template: Template
    prompt: _PromptRows
    heal_prefixes: list[str] | None = None
    hole_prefixes: dict[tuple[int, int], str] | None = None
    hole_allowed: dict[tuple[int, int], torch.Tensor] | None = None


def _conversation_width(rows: _PromptRows, cache: KVCache | None) -> int:
    """The prompt's width as max_length counts it: the widest row's tokens, what a continued `cache` holds of its
    conversation included, as the same rows passed whole without the cache count (their padded width). Not the
    cache's slots + the new part's width: rows that kept unlike prefixes (lm.chat's batch continued) would count
    one row's cached tokens and another's new ones, and get fewer new tokens than without the cache. Without a
    cache, or with one that holds nothing yet (new, or reset), the width passed (transformers' input_ids.shape[1]):
    left padding counts, right padding (trimmed) too."""
    if not isinstance(cache, KVCache) or cache.length == 0:
        return rows.ids.shape[1] + rows.trimmed
    b = rows.ids.shape[0]
    own = [rows.ids.shape[1]] * b if rows.mask is None else [int(n) for n in rows.mask.sum(-1)]
    # a cache of another batch size is refused by _check_context; until then its slots stand for every row
    held = cache.next_pos.tolist() if cache.batch_size == b else [cache.length] * b
    return max(h + n for h, n in zip(held, own)) + rows.trimmed


def _template_budget(template: Template, budgets: _Budgets, vocab: int) -> tuple[int, ...]:
    """Each row's budget under a template: its own length, as healed (healing moves a space into each hole after
    one). The batch is laid out to its longest row, and each row's budget ends at its own end, as it would alone.
    A min_new_tokens, or a max_new_tokens other than that length, is refused: it would be ignored."""
    lengths = tuple(template.lengths)
    count = lengths[0] if len(set(lengths)) == 1 else list(lengths)
    says = f"{count} tokens" + (", one per row" if isinstance(count, list) else "")
    if max(max(r) for r in template.rows) >= vocab:
        raise ValueError(f"template: token ids must be below the vocabulary size {vocab}")
    if any(_each(budgets.min_new_tokens)):  # a template's length is fixed, its holes never end early
        raise ValueError(f"min_new_tokens: not with a template (its {says} are all written, no EOS inside), "
                         f"got {budgets.min_new_tokens}")
    budget = budgets.max_new_tokens
    given = budget if isinstance(budget, tuple) else (budget,) * len(lengths)
    if budgets.asked is not None and given != lengths:
        raise ValueError(f"max_new_tokens: the template sets the length ({says}); leave max_new_tokens "
                         f"unset or give {count}, got {budgets.asked}")
    return lengths


def _row_seeds(seeds: Any) -> list[int] | None:
    """`seeds`: None, or one seed per row (overriding `seed`), each row then sampled as it would be alone: a list,
    or a 1-D integer array or tensor (each element checked like a list's; the count against the batch is
    Request.row_seeds')."""
    if seeds is None:
        return None
    _no_meta_tensors(seeds=seeds)
    if hasattr(seeds, "ndim") and hasattr(seeds, "tolist"):  # numpy / torch: np.arange(b) + base, say
        if seeds.ndim != 1:
            raise ValueError(f"seeds: expected one seed per row (1-D), got shape {list(seeds.shape)}")
        seeds = seeds.tolist()  # plain ints (floats and bools stay what they are, and are refused below)
    if not isinstance(seeds, (list, tuple)):
        raise ValueError(f"seeds: expected a list of one seed per row, got {type(seeds).__name__} "
                         "(one seed for the whole batch is `seed`)")
    checked = [check_seed(x, f"seeds[{i}]") for i, x in enumerate(seeds)]
    if None in checked:  # one row random, the others seeded: give it a seed of its own
        raise ValueError(f"seeds[{checked.index(None)}]: expected an integer (each row needs its seed)")
    return [seed for seed in checked if seed is not None]  # (all of them)


def _no_meta_tensors(**args: Any) -> None:
    """Refuse, by name, an argument that is a tensor (or a list of them) on the meta device, which holds shapes and
    no values (what `random_model(device="meta")` and `lm.to("meta")` make): torch would fail on one deep inside
    ("Cannot copy out of meta tensor; no data!")."""
    for name, value in args.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
            raise ValueError(f"{name}: a tensor on the meta device holds no values (shapes only); give it on the "
                             "CPU or the model's device")


def _turn_undo(cache: KVCache) -> Callable[[BaseException], None]:
    """A function that takes a failed call's part of a turn back out of `cache`: what it holds now (its known tokens
    too) is what it holds again. Otherwise a generate that a Ctrl-C (a notebook's interrupt) or an error stops would
    leave the prompt and the canvases so far in the cache, and running the cell again would continue from that half
    turn: another text, silently. The argument is the exception that stopped the call, told if the cache cannot go
    back."""
    mark = cache.mark()  # (which keeps the known tokens, for truncate to bring back)

    def undo(stopped: BaseException) -> None:
        try:
            cache.truncate(mark)
        except ValueError as e:  # kept from replacing the exception that stopped the call
            stopped.add_note(f"cache: holds part of this call's turn, as it could not go back ({e})")

    return undo


def _held(cache: KVCache | None) -> contextlib.AbstractContextManager[Any]:
    """`cache.in_use()` for a call that continues a cache; nothing for one that makes its own."""
    if cache is not None and not isinstance(cache, KVCache):  # (before its claim is asked for)
        raise ValueError(f"cache: expected the KVCache of an earlier call (return_cache=True), got "
                         f"{type(cache).__name__}")
    return cache.in_use() if cache is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _undone_on_failure(cache: KVCache | None) -> Iterator[None]:
    """A call that continues `cache` (None: none): one that fails or is interrupted inside the block takes its part
    of the turn back out of it (_turn_undo). Entered once the call's arguments are checked, before anything is
    encoded; the mark it goes back to is taken under the cache's claim (taken before, it could be another thread's
    turn that ended meanwhile, and going back to it would drop that turn)."""
    with _held(cache):
        undo = _turn_undo(cache) if cache is not None else None
        try:
            yield
        except BaseException as e:
            if undo is not None:
                undo(e)
            raise


# Streams still open when the interpreter exits are closed first, while torch is whole: one suspended over a
# conversation's cache and left to the interpreter's teardown aborts the process (torch's INTERNAL ASSERT in
# THPVariable_clear) however the script ended. A process-wide registry, as the exit is the process's.
_OPEN_STREAMS: weakref.WeakSet[Events] = weakref.WeakSet()


def _kept_open(events: Events) -> Events:
    """`events`, closed at exit if still open (see _OPEN_STREAMS)."""
    with contextlib.suppress(TypeError):  # (a stand-in iterator that is no generator cannot be weakly referenced)
        _OPEN_STREAMS.add(events)
    return events


@atexit.register
def _close_open_streams() -> None:
    for events in weak_members(_OPEN_STREAMS):
        with contextlib.suppress(Exception):
            events.close()


def _undone_on_error(events: Events, cache: KVCache) -> Events:
    """`events` of a call that continues `cache`, which goes back to where it stood when the stream started if the
    stream fails (a Ctrl-C inside it, an error). Not when it is left (a break, close, or garbage collection): the
    cache may have been continued since by another call, whose turn going back would drop. The mark is taken at the
    first event, when encoding starts, not when the stream is made. Between its events the claim is marked suspended
    (no other call may continue the cache meanwhile, not even one of this thread) and, resumed, it is the resuming
    thread's; it goes with the last event (Done, Cancelled), after which the stream writes the cache no more."""
    with cache.in_use() as claim:
        undo = _turn_undo(cache)
        try:
            for event in events:
                if isinstance(event, (Done, Cancelled)):  # its last: the stream writes the cache no more
                    cache.release(claim)
                    yield event
                    continue
                claim.suspended = True
                try:
                    yield event
                finally:
                    claim.suspended, claim.thread = False, threading.get_ident()
        except GeneratorExit:
            raise
        except BaseException as e:
            undo(e)
            raise
        finally:  # (left early: the inner stream ends here, under the claim, as `yield from` ended it)
            events.close()


class LM:
    """A loaded model with its tokenizer and generation settings: `blockpress.load(...)` or `random_model(...)`.

    `generate` / `stream` / `infill` decode by block diffusion, `generate_ar` one token at a time on the same
    weights, `logits` gives one denoising pass; `compile`, `cuda_graphs` and `quantize` transform it in place."""

    # A call's generation_config top_k / top_p (not the checkpoint's): refused, as the keywords are, where nothing is
    # drawn for them to filter (_sampler_config); set on the call's copy of this LM (_from_transformers). A class
    # default, read-only: an LM pickled before it existed reads it too.
    _call_filters: Mapping[str, Any] = MappingProxyType({})

    def __init__(
        self,
        model: DiffusionGemma,
        tokenizer: Any = None,
        generation_config: dict[str, Any] | None = None,
        *,
        passthrough: Passthrough | None = None,
        path: Path | None = None,
        adapter: Path | None = None,
        widened_from: torch.dtype | None = None,
        unread_said: Iterable[str] = (),
    ):
        self.model = model.eval()
        self.tokenizer = check_tokenizer(tokenizer)
        self.generation_config = dict(generation_config or {})
        # keys blockpress does not read that have been said to be ignored (`unread_said`: the ones read_generation_config
        # warned about, for the folder read); any other in lm.generation_config, given here or set later, is said when
        # generate reads the dict (`sampler_defaults`)
        self._unread_said = set(unread_said)
        self._max_length_from = "generation config"  # whose max_length errors name: a call's max_length= is its own
        self.passthrough = passthrough or Passthrough()
        # the base's folder, absolute: a save after a chdir recorded another folder of that name as quantized_from
        self.path = None if path is None else Path(path).absolute()
        self.adapter = adapter  # the LoRA folder applied over it (then the weights are not `path`'s alone)
        # Both are said of the weights as they were when set (`_while_unchanged`): a change made around this LM's own
        # methods (an in-place edit and weights_changed(), lm.model.bfloat16(), a training step) ends them.
        # The checkpoint's dtype where `load` computes in a wider one for this CPU (dtype=None: bf16 as float32 without
        # native bf16 matmuls): `save` writes it back, so a saved folder does not depend on the CPU that saved it.
        # None once lm.to names a dtype: the model is then saved in it.
        self.widened_from = widened_from
        # The checkpoint's stored dtype while the weights hold its values exactly (load sets it), None once a cast
        # rounded them (a float32 folder loaded or cast to bf16, even if cast back) or where they are no checkpoint's:
        # lm.quantize then makes other codes than load(..., quantize=) makes from the stored weights, so a save records
        # no quantized_from
        self.stored_values = None
        self.step_functions: StepFunctions | None = None  # None: eager; see `compile`
        self._reapply_steps: Callable[[], LM] | None = None  # compile / cuda_graphs again, after a quantize
        _guard_fork()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (copy.deepcopy) of a compiled LM compiles its own steps: torch.compile's functions copy as they are,
        bound to the original's model, so the copy would run the original's weights (after lm.to on the original, a
        float32 copy would fail inside dynamo). A shallow copy (copy.copy) shares the model, and its steps with it: its
        compile-again is still the original's, so nothing is compiled anew."""
        self.__dict__.update(state)
        again = getattr(self._reapply_steps, "func", self._reapply_steps)  # (compile's partial, or cuda_graphs)
        if self.step_functions is not None and getattr(again, "__self__", None) is self:
            self._reapply_steps()

    @property
    def widened_from(self) -> torch.dtype | None:
        return self._while_unchanged(self._widened_from)

    @widened_from.setter
    def widened_from(self, dtype: torch.dtype | None) -> None:
        self._widened_from = (dtype, self.model.values_changes)

    @property
    def stored_values(self) -> torch.dtype | None:
        return self._while_unchanged(self._stored_values)

    @stored_values.setter
    def stored_values(self, dtype: torch.dtype | None) -> None:
        self._stored_values = (dtype, self.model.values_changes)

    def _while_unchanged(self, said: tuple[torch.dtype | None, int]) -> torch.dtype | None:
        """What was said of the weights (a dtype, and the model's values_changes then), while their values are
        unchanged: edited in place (weights_changed()) or cast by the model's own methods (not moved), they no longer
        hold the checkpoint's values, and a save would write them back in the dtype of a folder they no longer are
        (a widened float16 folder cast with lm.model.bfloat16() would save float16) or record the folder as the base
        of codes made from other values."""
        dtype, changes = said
        return dtype if changes == self.model.values_changes else None

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def num_parameters(self, active: bool = True) -> int:
        """Parameters used per token (`active`, the default here: the routed experts only), or all of them
        (active=False, ModelConfig.num_parameters' default)."""
        return self.config.num_parameters(active=active)

    def compile(self, **options: Any) -> LM:
        """Run decoding steps through torch.compile from now on (`options` go to torch.compile).

        Pays where per-op overhead dominates (bf16 on CPU, small batches on GPU); the first generation
        includes compilation. Returns self.

        What compiles again: the sampler's numbers (t_min, t_max, entropy_bound, confidence, confidence_threshold,
        stability_threshold) reach the compiled step as tensors and compile nothing, nor do seeds, draw temperatures
        (RowDraws), max_denoising_steps and the repeat penalties (applied outside it); a second top_k value compiles the
        sampler step once more, and other values after it nothing. Other batch sizes, prompt lengths and max_new_tokens
        compile once more as dynamic (a batch of one is a shape of its own, and so is the one row a batch shrinks to as
        its other rows stop: each choice below may take a graph at each). Each choice of code compiles the sampler step
        once more (twice with a logits_processor: its first step, then the rest): the sampler, rank_by, candidates,
        keep_accepted, self_conditioning, adaptive_stopping, and whether any row draws at a temperature other than 1,
        filters by top_k or by top_p. So each new kind of batch takes a few graphs (a fixed cache length, then a
        dynamic one, each with and without self-conditioning; calls under torch.inference_mode take their own, its
        tensors being another kind), and past the recompile limit a step runs eagerly, as torch's warning "hit
        config.recompile_limit" says. That limit is torch.compile's recompile_limit, which this sets to
        generate.RECOMPILE_LIMIT (32 a function; torch's default is 8), or to the process's own
        torch._dynamo.config.recompile_limit where that is higher (a torch before 2.13 keeps the latter alone): pass
        recompile_limit= for more, or dynamic=True (what `serve --compile` does) to compile each kind once.
        """
        self.step_functions = StepFunctions.compiled(self.model, **options)
        self._reapply_steps = partial(self.compile, **options)
        return self

    def quantize(self, scheme: str) -> LM:
        """Quantize the model's projections in place: "int8" (weights), "fp8" (weights and activations, for
        GPUs with FP8 tensor cores) or "int4" (weights, for memory); see blockpress.quantize. Returns self."""
        from .quantize import quantize

        stored, widened = self.stored_values, self.widened_from
        try:
            quantize(self.model, check_scheme(scheme))
            return_freed_heap(self.device)
        finally:  # codes made from the values these describe, or (refused, or undone part-way) those values still
            self.stored_values, self.widened_from = stored, widened
        if self.step_functions is not None and self._reapply_steps is not None:
            self._reapply_steps()  # compiled or captured steps hold the old modules: make them anew, checks included
        return self

    def quantized_copy(self, scheme: str) -> LM:
        """A quantized twin of this LM beside it (see `quantize` for the schemes): its projections quantized from this
        model's weights one matrix at a time, its embedding, norms and router this model's own (shared, never copied
        whole), and everything else this LM's: tokenizer, generation settings (sampler, noise, penalties), folder.
        This LM is unchanged. The twin runs eager: compile it yourself if you want. Changing a shared tensor in place
        changes both: say so to each (`lm.model.weights_changed()` and `twin.model.weights_changed()`), or the twin's
        caches (a prefix cache above all) go on with keys of the old values."""
        from .quantize import quantized_copy

        twin = copy.copy(self)
        twin.model = quantized_copy(self.model, check_scheme(scheme))
        twin.generation_config = dict(self.generation_config)  # its own: a setting changed on one is that one's
        twin._unread_said = set(self.__dict__.get("_unread_said", ()))
        twin.step_functions, twin._reapply_steps = None, None  # this LM's steps run this LM's modules
        # said of the same values as this LM's (read before the model changed: what they record is per model)
        twin.stored_values, twin.widened_from = self.stored_values, self.widened_from
        return twin

    @property
    def quantization(self) -> str | None:
        from .quantize import quantization_of

        return quantization_of(self.model)

    def weights_bytes(self) -> int:
        """Bytes of every parameter and buffer (quantized weights are buffers)."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def cuda_graphs(self) -> LM:
        """Replay each decoder pass (captured once per canvas) and each AR token's encoder pass (captured once per
        cache) from CUDA graphs from now on; see GraphedDenoise and GraphedEncodeStep. Needs a CUDA model."""
        why = _graphs_refusal(self.device, self.dtype)
        if why is not None:
            raise ValueError(f"cuda_graphs: {why}; load the model with device='cuda', dtype='bfloat16', or move it "
                             "with lm.to('cuda', 'bfloat16')")
        if GROUPED_MM is None:  # torch 2.6 and 2.7: no torch._grouped_mm (it came in 2.8)
            raise ValueError(f"cuda_graphs: torch {torch.__version__} has no grouped GEMM (torch._grouped_mm, from "
                             "torch 2.8 on), so the experts run one GEMM each with host syncs, which a graph cannot "
                             "hold; use a newer torch, or eager decoding")
        if self.quantization == "fp8":  # find out now, eagerly, whether the FP8 grouped GEMM runs here
            c = self.config.canvas_length
            self.logits(torch.full((1, 1), 3, device=self.device), torch.full((1, c), 3, device=self.device))
            if not all(getattr(m, "grouped_fp8", True) for m in self.model.modules()):
                raise ValueError("cuda_graphs: this GPU or torch has no FP8 grouped GEMM, so FP8 experts run one "
                                 "GEMM each with host syncs; use eager decoding, or int4 / bf16 weights")
        self.step_functions = StepFunctions.cuda_graphs(self.model)
        self._reapply_steps = self.cuda_graphs
        return self

    @outside_inference_mode
    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None) -> LM:
        """Move the model to `device` and/or cast its weights to `dtype` ("bfloat16", torch.float16, ...), in place;
        None keeps either as it is. The model then computes what `blockpress.load(..., dtype=, device=)` would
        give (the rotary tables stay float32: DiffusionGemma._apply). Returns self.

        `compile` / `cuda_graphs` steps are made anew for the moved weights. KV caches made before hold the old
        weights' keys and are refused (make new ones); a PrefixCache drops what it held and fills again. A dtype
        named here is also the one `save` writes (not the one a load widened from).
        A quantized model can change device, not dtype (a cast would cast its scales, which keep their own dtype,
        too: quantize.check_cast): load it again with dtype= and quantize=."""
        self._check_runnable()
        named = isinstance(device, str) and device.lower().removeprefix("torch.") in (*DTYPES, *DTYPE_ALIASES)
        if isinstance(device, torch.dtype) or named:  # lm.to(torch.bfloat16), as nn.Module.to takes it
            raise ValueError(f"device: {device!r} is a dtype; pass it as lm.to(dtype={device!r})")
        target_device = self.device if device is None else resolve_device(device)
        if target_device.type == "meta":
            raise ValueError("device: 'meta' holds no weights (shapes only); to count parameters and bytes, build "
                             "the model there: random_model(config, device='meta')")
        chosen = resolve_dtype(_dtype_argument(dtype))
        target_dtype = chosen or self.dtype
        if target_dtype != self.dtype:  # a quantized model refuses, before anything else is checked
            check_cast(self.model, lambda t: t.to(target_dtype) if t.is_floating_point() else t)  # as model.to casts
        scheme = self.quantization
        # (lm.to("cuda") on a model on cuda:0 is a no-op, as lm.to("cpu") on the CPU: not a second copy)
        if indexed_device(target_device) == self.device and target_dtype == self.dtype:
            if chosen is not None:  # named now: the dtype saved too
                self.widened_from = None
            return self
        # Refusals first: nothing moves unless all of it can.
        graphed = self.step_functions is not None and self._reapply_steps == self.cuda_graphs
        why = _graphs_refusal(target_device, target_dtype) if graphed else None
        if why is not None:
            raise ValueError(f"to: this LM replays CUDA graphs (lm.cuda_graphs()), and a graph {why}; load the "
                             "model anew to run it there")
        if scheme is not None:
            check_runs(scheme, target_device, target_dtype)
        check_fits(_model_bytes(self.model, target_dtype), target_device,
                   f"to: {self.config.describe()} in {str(target_dtype).removeprefix('torch.')}")
        # judged against the values held (a bf16 folder widened to float32 and cast back is the folder's own)
        stored = self.stored_values
        stored = None if stored is not None and not keeps_values(stored, target_dtype) else stored
        widened = None if chosen is not None else self.widened_from  # named now: the dtype saved too
        if target_dtype == self.dtype:  # a quantized model's float32 scales keep their dtype
            self.model.to(target_device)
        else:
            self.model.to(target_device, target_dtype)
        self.stored_values, self.widened_from = stored, widened  # (of the values moved or cast here)
        if self.step_functions is not None and self._reapply_steps is not None:
            self._reapply_steps()  # compiled or captured steps hold the old tensors: make them anew
        return self

    def _check_runnable(self) -> None:
        if self.device.type == "meta":
            raise ValueError("device: this model is on the meta device (shapes only, for counting parameters and "
                             "bytes); build or load it on cpu or cuda to run it")

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty KVCache for this model: `batch_size` rows of `capacity` token slots each (positive ints), on
        its device in its dtype. One that would not fit in the memory the device has free now
        (checkpoint.available_bytes: Linux's MemAvailable and the process' cgroup and address-space limits, CUDA's
        free memory) is refused with the figures, before torch tries to allocate it."""
        if is_int(batch_size) and is_int(capacity) and batch_size > 0 and capacity > 0:
            nbytes = KVCache.allocation_bytes(self.config.text, self.dtype, int(batch_size), int(capacity))
            free = available_bytes(self.device)
            if free is not None and 2**63 > nbytes > free:
                raise ValueError(f"KVCache: batch_size {batch_size} x capacity {capacity} needs {nbytes / 1e9:,.1f} GB "
                                 f"on {self.device} but {free / 1e9:.1f} GB are available")
        # (allocate refuses sizes that are no positive ints, or past what torch addresses, by name)
        return KVCache.allocate(self.config.text, batch_size, capacity, self.dtype, self.device)

    @torch.no_grad()
    def logits(
        self,
        prompt_ids: TokenIds,
        canvas_ids: TokenIds,
        self_conditioning_logits: torch.Tensor | None = None,
        attention_mask: TokenIds | None = None,
        self_conditioning_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One denoising pass on a fresh cache: encode the prompt, denoise the canvas. float32 [B, L, V]. A one-row
        prompt (with its one-row attention_mask) serves every canvas row. `attention_mask` (1 token, 0 padding) may
        pad anywhere (right-padded, as many tokenizers do): the padding is moved to the left, as generate moves it,
        and the logits are still those of `canvas_ids`, row for row. `self_conditioning_mask` [B] bool, as the
        reference's forward takes it: False rows get no self-conditioning (training drops it for some rows)."""
        self._check_runnable()
        _no_meta_tensors(prompt_ids=prompt_ids, canvas_ids=canvas_ids, self_conditioning_logits=self_conditioning_logits,
                         attention_mask=attention_mask, self_conditioning_mask=self_conditioning_mask)
        v = self.config.text.vocab_size
        prompt = _as_ids(prompt_ids, "prompt_ids", None, self.device)
        canvas = _as_ids(canvas_ids, "canvas_ids", v, self.device)
        if attention_mask is not None:  # against the prompt as given: a one-row prompt's mask is broadcast with it
            attention_mask = _check_mask(attention_mask, prompt.shape, "prompt_ids").to(self.device)
            prompt = _unmasked_to_pad(prompt, attention_mask, self.pad_id)
        check_vocab_range(prompt, "prompt_ids", v)
        if prompt.shape[0] != canvas.shape[0]:
            if prompt.shape[0] != 1:
                raise ValueError(f"canvas_ids: batch {canvas.shape[0]} does not match prompt_ids batch {prompt.shape[0]}")
            prompt = prompt.expand(canvas.shape[0], -1)
            if attention_mask is not None:
                attention_mask = attention_mask.expand(canvas.shape[0], -1)
        if attention_mask is not None:  # as generate does; the canvas is apart, so the logits stay aligned with it
            prompt, attention_mask = _padding_to_the_left(prompt, attention_mask, self.pad_id)
        context = self.config.text.max_position_embeddings
        longest = prompt.shape[1] if attention_mask is None else int(attention_mask.sum(-1).max())  # padding: no position
        if longest + canvas.shape[1] > context:
            blame = "prompt_ids" if longest >= context else "canvas_ids"  # the prompt when no canvas token fits after it
            raise ValueError(f"{blame}: {longest} prompt + {canvas.shape[1]} canvas tokens exceed the model's context "
                             f"of {context} tokens (max_position_embeddings)")
        if self_conditioning_logits is not None:
            want = (*canvas.shape, v)
            if not isinstance(self_conditioning_logits, torch.Tensor):
                raise ValueError(f"self_conditioning_logits: expected a float tensor of shape {list(want)}, "
                                 f"got {type(self_conditioning_logits).__name__}")
            if tuple(self_conditioning_logits.shape) != want:
                raise ValueError(
                    f"self_conditioning_logits: expected shape {list(want)}, got {list(self_conditioning_logits.shape)}"
                )
            if not self_conditioning_logits.is_floating_point():  # ids instead of logits would run, meaninglessly
                raise ValueError(f"self_conditioning_logits: expected floating-point logits of shape {list(want)}, "
                                 f"got {self_conditioning_logits.dtype}")
            self_conditioning_logits = self_conditioning_logits.to(self.device)
            # the check a logits_processor's output gets: a softmax over NaN / +inf, or over all -inf, is NaN
            if bool(no_choice(self_conditioning_logits)):
                raise ValueError("self_conditioning_logits: a position has no distribution (NaN or +inf logits, or "
                                 "every token -inf); expected finite logits, -inf only for tokens it rules out")
        if self_conditioning_mask is not None:
            expected = (f"self_conditioning_mask: expected a bool tensor of shape [{canvas.shape[0]}] (one flag per "
                        "canvas row)")
            try:  # a list of flags is taken as the tensor it reads as
                mask = host_tensor(self_conditioning_mask)
            except (TypeError, ValueError, RuntimeError):  # None in a list, a dict: torch's 'Could not infer dtype'
                raise ValueError(f"{expected}, got {type(self_conditioning_mask).__name__}") from None
            if mask.dtype != torch.bool or tuple(mask.shape) != (canvas.shape[0],):
                raise ValueError(f"{expected}, got {mask.dtype} {list(mask.shape)}")
            if self_conditioning_logits is None:
                raise ValueError("self_conditioning_mask: says which rows get self_conditioning_logits, which are None")
            self_conditioning_mask = mask.to(self.device)
        cache = self.new_cache(prompt.shape[0], prompt.shape[1] + canvas.shape[1])
        self.model.encode(prompt, cache, attention_mask=attention_mask)
        return self.model.denoise(canvas, cache, self_conditioning_logits, self_conditioning_mask)

    # -- generation ------------------------------------------------------------------------------------------
    @property
    def sampler_defaults(self) -> SamplerConfig:
        """The checkpoint's generation_config.json, else the reference's defaults. A key blockpress does not read
        (HF's temperature, do_sample, a typo) is said once, as load says one in the file: silent, it looked applied."""
        said = self.__dict__.setdefault("_unread_said", set())  # (an LM pickled before the set existed)
        unread = sorted(unread_generation_keys(self.generation_config) - said)
        if unread:
            said.update(unread)
            warn_user(f"lm.generation_config: {', '.join(unread)}: {UNREAD_KEYS_NOTE}"
                      f"{f'; {TEMPERATURE_HINT}' if {'temperature', 'do_sample'} & set(unread) else ''}")
        return SamplerConfig.from_generation_config(self.generation_config)

    @property
    def default_max_new_tokens(self) -> int:
        """The most new tokens a call that gives no max_new_tokens generates (what `blockpress info` shows):
        generation_config.json's `max_new_tokens`; else, when it sets `max_length`, max_length - 1, because
        generate then gives max_length less the prompt's padded width (`default_new_tokens`), and a prompt has
        at least one token (0: no prompt leaves room, every call must pass max_new_tokens); else 256. A null
        there is "unset", as in the reference."""
        gen = self.generation_config
        if gen.get("max_new_tokens") is None and gen.get("max_length") == 1:  # no prompt leaves room
            return 0
        return self.default_new_tokens(1)  # a prompt has at least one token; validates the settings too

    def _max_new_tokens_setting(self) -> int:
        """generation_config.json's `max_new_tokens`, else 256; max_length aside (see default_new_tokens)."""
        value = self.generation_config.get("max_new_tokens")
        if value is None:
            return DEFAULT_NEW_TOKENS
        check_positive_int(value, "generation_config max_new_tokens")
        return int(value)

    def default_new_tokens(self, prompt_length: int, *, room_needed: bool = True) -> int:
        """max_new_tokens for a call that gives none: generation_config.json's `max_new_tokens`, else its
        `max_length` less the prompt, as in the reference (which counts the prompt's padded width; continuing a
        cache, the widest row's conversation, the cache's part included: `_conversation_width`), else 256.
        `room_needed=False`: 0 where max_length leaves no room (a minimum the call gives is the length then), not an
        error."""
        max_length = self.generation_config.get("max_length")
        if self.generation_config.get("max_new_tokens") is not None or max_length is None:
            return self._max_new_tokens_setting()
        name = "max_length" if self._max_length_from == "call" else "generation_config max_length"
        check_positive_int(max_length, name)
        if max_length <= prompt_length:
            if not room_needed:
                return 0
            raise ValueError(f"max_length: the {self._max_length_from}'s max_length ({max_length}) leaves no room "
                             f"after a {prompt_length}-token prompt; pass "
                             f"{'a larger max_length, or ' if self._max_length_from == 'call' else ''}max_new_tokens")
        return int(max_length) - prompt_length

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end a row (a new list each time: change `generation_config["eos_token_id"]` to change
        them). generation_config.json's `eos_token_id`, when it names any, is the whole set, as in the reference;
        a checkpoint without one (save_pretrained writes none) stops on the model's and the tokenizer's EOS ids
        instead of running every row to max_new_tokens."""
        return self._eos_ids()

    def _eos_ids(self) -> list[int]:
        """`eos_ids`, computed (callers inside blockpress use this spelling)."""
        v = self.config.text.vocab_size
        raw = self.generation_config.get("eos_token_id")
        if isinstance(raw, list) and not raw:  # none at all, as the reference reads []: no EOS ends a row
            return []
        listed = raw if isinstance(raw, list) else [raw] if raw is not None else []
        if listed:
            # `load` drops ids past the vocabulary with a warning; one set by hand since is refused, as banning EOS
            # (before min_new_tokens) would index past the logits
            bad = [i for i in listed if not (is_int(i) and 0 <= i < v)]
            if bad:
                raise ValueError(f"generation_config eos_token_id: expected token ids in [0, {v}) (the vocabulary), "
                                 f"got {bad[0]!r}")
            return list(dict.fromkeys(int(i) for i in listed))
        ids = list(self.config.text.eos_token_ids)
        if self.tokenizer is not None:
            ids += [i for i in self.tokenizer.eos_ids if i not in ids]
        # A tokenizer larger than the model may name an EOS the model can never produce: it could never end a row.
        return [i for i in ids if i < v]

    @property
    def pad_id(self) -> int:
        """The id written where a row has no token: the left padding of shorter prompts and every position after
        a row's EOS. generation_config.json's `pad_token_id` when it names one (the reference pads finished rows
        with that), else config.json's, else 0. Padding is masked out of attention, so the id changes only what
        `sequences` and `new_tokens` hold, never what is generated."""
        pad = self.generation_config.get("pad_token_id")
        if pad is None:
            pad = self.config.text.pad_token_id
            return pad if pad is not None else 0
        v = self.config.text.vocab_size
        if not (is_int(pad) and 0 <= pad < v):  # `load` drops one past the vocabulary with a warning
            raise ValueError(f"generation_config pad_token_id: expected a token id in [0, {v}), got {pad!r}")
        return int(pad)

    def _request(
        self,
        prompt: Any,
        *,
        cache: KVCache | None,
        max_new_tokens: Counts | None,
        min_new_tokens: Counts | None,
        sampler: str | SamplerConfig | None,
        sampler_options: dict[str, Any],
        min_new_tokens_eos_only: Flags | None = None,
        seed: int | None,
        attention_mask: Any,
        token_healing: bool | None,
        stop: Any,
        template: Any = None,
        hole_length: int = HOLE_LENGTH,
        canvases: bool = True,
        temperature_name: str = "draw_temperature",
        **fields: Any,
    ) -> Request:
        """The user's arguments, checked and normalised into a complete Request that also fits the context (and
        `cache`): in whole canvases for block diffusion, token by token for AR (`canvases=False`).
        `sampler_options`: SamplerConfig fields; draw_temperature, top_k and top_p may be one per row
        (`temperature_name`: what the caller calls draw_temperature, for the errors). `fields`: Request's own fields
        as the caller checked them (seeds, prefix_cache, and stream's skip_stopped_rows, constraint,
        logits_processor, cancelled)."""
        self._check_runnable()
        _no_meta_tensors(prompt=prompt, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=min_new_tokens, min_new_tokens_eos_only=min_new_tokens_eos_only, seed=seed,
                         template=template, **sampler_options, **fields)
        template = _template_texts(template)
        pad_id = self.pad_id
        cached = cache.length if isinstance(cache, KVCache) else 0
        rows = self._prompt_rows(prompt, attention_mask, pad_id, continuing=cached > 0)
        check_flag("token_healing", token_healing, none=True)
        if token_healing and self.tokenizer is None:
            raise ValueError("token_healing: needs a model with a tokenizer (to know which tokens could merge)")
        healed = None
        # With a template, healing applies to its holes' edges instead (the prompt's end is followed by fixed tokens)
        if token_healing and template is None:
            healed = [heal(self.tokenizer, row) for row in rows.rows()]
            rows = rows.padded([h.ids for h in healed])
        v = self.config.text.vocab_size
        check_vocab_range(rows.ids, "prompt", v)
        budgets = self._budgets(max_new_tokens, min_new_tokens, min_new_tokens_eos_only, rows.ids.shape[0],
                                prompt_width=_conversation_width(rows, cache), templated=template is not None)
        seed = check_seed(seed, "seed")
        cfg, per_row = self._sampler_config(sampler, sampler_options, rows.ids.shape[0], temperature_name)
        if cfg.argmax_candidates and seed is None:
            # greedy (and any sampler with argmax candidates, what temperature 0 gives a chosen sampler) promises
            # the same answer every time: the starting canvas may not be random either
            seed = 0
        budget, tmpl, layout = budgets.max_new_tokens, None, None
        if template is not None:
            layout = self._template_layout(template, hole_length, token_healing, is_text_template(prompt), rows)
            rows = layout.prompt
            budget = _template_budget(layout.template, budgets, v)
            tmpl = layout.template.ids(pad_id)
        elif not (isinstance(hole_length, int) and hole_length == HOLE_LENGTH):
            markers = isinstance(prompt, str) and "<|hole" in prompt
            raise ValueError(f"hole_length: the tokens each bare <|hole|> marker of a template gets; this call has no "
                             f"template (template=, or lm.infill's text), so hole_length={hole_length!r} would be "
                             "ignored" + ("; the prompt's <|hole|> markers are text to generate (a prompt is never "
                                          "filled): pass it as template= or to lm.infill" if markers else ""))
        unknown = self._unknown_ids(tmpl)
        heal_prefixes = first_allowed = None
        if healed is not None and any(h.prefix for h in healed):
            heal_prefixes = [h.prefix for h in healed]
            first_allowed = allowed_first_tokens(self.tokenizer, heal_prefixes, v)
        elif layout is not None:
            heal_prefixes = layout.heal_prefixes
        stops = self._stops(stop, rows.ids.shape[0], tmpl)
        req = Request(prompt=rows.ids, attention_mask=rows.mask, max_new_tokens=budget,
                      min_new_tokens=budgets.min_new_tokens, sampler=cfg, seed=seed, template=tmpl,
                      eos_ids=self._eos_ids(), pad_id=pad_id, stops=stops, stop_ids=special_stop_ids(self.tokenizer, stops),
                      draw_temperatures=per_row.get("draw_temperature"), top_ks=per_row.get("top_k"),
                      top_ps=per_row.get("top_p"), eos_only_minimum=budgets.eos_only_minimum, unknown_ids=unknown,
                      heal_prefixes=heal_prefixes, first_allowed=first_allowed,
                      template_holes=None if layout is None else layout.template.holes,
                      hole_prefixes=None if layout is None else layout.hole_prefixes,
                      hole_allowed=None if layout is None else layout.hole_allowed, **fields)
        req.row_seeds()  # checks the count of `seeds` now, not mid-generation
        self._check_context(req, cache, self.config.canvas_length if canvases else None,
                            defaulted=budgets.asked is None and template is None and self._max_length_from != "call")
        return req

    def _prompt_rows(self, prompt: Any, attention_mask: Any, pad_id: int, continuing: bool) -> _PromptRows:
        """The prompt as left-padded id rows, with the caller's attention_mask where it gave one (id rows only).
        `continuing`: the prompt continues a cache, a sequence that began with BOS: a text turn gets no second one."""
        ids, mask = prompt_to_ids(prompt, self.tokenizer, pad_id, bos=not continuing,
                                  context=self.config.text.max_position_embeddings)
        if attention_mask is not None:
            # blockpress pads texts and ragged rows itself, so a caller's mask could only be shaped like the result
            # by accident, and would then mark some row's tokens as padding (is_text_template: the same test for
            # "text" as prompt_to_ids')
            if is_text_template(prompt):
                raise ValueError("attention_mask: not with text prompts (blockpress tokenizes and left-pads them, "
                                 "and masks the padding itself); leave attention_mask out")
            if mask is not None:  # prompt_to_ids padded: a list of id rows of different lengths
                row_lengths = [int(n) for n in mask.sum(-1)]
                raise ValueError(f"attention_mask: not with id rows of different lengths {row_lengths} (blockpress "
                                 "left-pads them and masks the padding itself); leave attention_mask out, or pass "
                                 "equal-length rows (a tensor) with their mask")
            mask = _check_mask(attention_mask, ids.shape, "the prompt")
            width = ids.shape[1]
            ids, mask = _padding_to_the_left(_unmasked_to_pad(ids, mask, pad_id), mask, pad_id)
            return _PromptRows(ids, mask, pad_id, width - ids.shape[1])
        return _PromptRows(ids, mask, pad_id)

    def _budgets(self, max_new_tokens: Counts | None, min_new_tokens: Counts | None,
                 min_new_tokens_eos_only: Flags | None, batch: int, *, prompt_width: int,
                 templated: bool) -> _Budgets:
        """The token budgets of a `batch`-row request, checked: max_new_tokens unset is the checkpoint's default for
        a prompt of `prompt_width` tokens (the cache's included), or, `templated`, a stand-in that the template's
        length replaces."""
        asked = max_new_tokens = _row_counts(max_new_tokens, "max_new_tokens", batch)
        mins = _row_counts(0 if min_new_tokens is None else min_new_tokens, "min_new_tokens", batch)
        if max_new_tokens is None and not templated:
            # A minimum past the default length is what the call wants: the default grows to it (as the server's
            # does), not to "min_new_tokens: expected an integer in [0, max_new_tokens=64]", naming a count not given.
            capped = self._max_length_from == "call"  # a call's max_length is a bound, as in transformers
            # A checkpoint's max_length that leaves no room: every row's minimum is the length asked, as it grows
            # past the one token a longer max_length leaves
            minimums = all(is_int(n) and n > 0 for n in (mins if isinstance(mins, list) else [mins]))
            default = self.default_new_tokens(prompt_width, room_needed=capped or not minimums)

            def grown(least: Any) -> int:  # (a value that is no count is left to _check_budgets to refuse)
                if capped and is_int(least) and least > default:
                    raise ValueError(f"min_new_tokens: {least} new tokens, past the {default} that max_length="
                                     f"{self.generation_config['max_length']} leaves after the prompt's {prompt_width} "
                                     "tokens; pass a larger max_length, or max_new_tokens")
                return max(default, int(least)) if is_int(least) else default

            max_new_tokens = [grown(n) for n in mins] if isinstance(mins, list) else grown(mins)
        elif max_new_tokens is None:  # the template sets the length; this only has to pass the checks below
            max_new_tokens = self._max_new_tokens_setting()
        budget, least = _check_budgets(max_new_tokens, mins)
        eos_only = _row_counts(False if min_new_tokens_eos_only is None else min_new_tokens_eos_only,
                               "min_new_tokens_eos_only", batch, "True or False")
        for i, flag in enumerate(eos_only if isinstance(eos_only, list) else [eos_only]):
            check_flag("min_new_tokens_eos_only" + (f"[{i}]" if isinstance(eos_only, list) else ""), flag)
        minimum = None
        if eos_only is True or (isinstance(eos_only, list) and any(eos_only)):
            minimum = tuple(eos_only) if isinstance(eos_only, list) else (True,) * batch
        return _Budgets(asked, budget, least, minimum)

    def _sampler_config(self, sampler: str | SamplerConfig | None, sampler_options: dict[str, Any], batch: int,
                        temperature_name: str) -> tuple[SamplerConfig, dict[str, tuple]]:
        """The request's SamplerConfig, and the settings given one per row (`_row_draws`)."""
        sampler_options, per_row = _row_draws(sampler_options, batch, temperature_name)
        if isinstance(sampler, SamplerConfig):
            # The noise token is how the model was trained (absorbing noise), not a decoding preference: a config
            # built to pick a sampler leaves it None, and decoding such a model with uniform noise gives word salad.
            # None takes the checkpoint's; uniform noise there is asked for with noise_token_id=-1 (in the config
            # or as a keyword), which the config keeps as -1: mapped to None, it would take the checkpoint's token here.
            if sampler.noise_token_id is None:
                sampler = sampler.with_(noise_token_id=self.sampler_defaults.noise_token_id)
            cfg = sampler.with_(**sampler_options)
        else:
            cfg = self.sampler_defaults.with_(sampler=sampler, **sampler_options)
        if cfg.argmax_candidates:
            # as SamplerConfig refuses one draw_temperature for every row: argmax candidates draw none, so a draw
            # setting this call gives would be ignored (the idle values are what a server's greedy requests carry;
            # a checkpoint's own top_k / top_p, in the defaults, are no call's)
            for name, idle in (("draw_temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
                value = sampler_options.get(name)
                given = per_row.get(name, (self._call_filters.get(name) if value is None else value,))
                if all(v is None or v == idle for v in given):
                    continue
                label = temperature_name if name == "draw_temperature" else name
                if temperature_name == "temperature":  # generate_ar: greedy unless given a temperature
                    rule, fix = "generate_ar without a temperature above 0", "a temperature above 0"
                elif cfg.sampler == "greedy":
                    rule, fix = f"sampler={cfg.sampler!r}", "sampler='entropy_bound'"
                else:
                    rule, fix = f"candidates={cfg.candidates!r}", "candidates='sample'"
                what = f"the per-row {label}" if name == "draw_temperature" else f"{label}, a filter of the draws,"
                raise ValueError(f"{label}: {rule} takes the most likely candidates and draws none, so {what} would "
                                 f"be ignored; draw them with {fix}")
        return cfg, per_row

    def _template_layout(self, template: Any, hole_length: int, token_healing: bool | None, text_prompt: bool,
                         rows: _PromptRows) -> _TemplateLayout:
        """The template parsed for the prompt's rows and healed: None (token_healing's default) heals a text
        template's holes, nothing else; True/False say so for all. A `text_prompt`'s trailing space joins a hole the
        template starts with."""
        # _number: a 0-d tensor is a hole length as it is a max_new_tokens
        parsed = parse_template(template, self.tokenizer, rows.ids.shape[0], _number(hole_length),
                                self.config.text.max_position_embeddings)
        layout = _TemplateLayout(parsed, rows)
        if self.tokenizer is None or not (token_healing is True or (token_healing is None
                                                                    and is_text_template(template))):
            return layout
        if text_prompt:
            moved, layout.template = heal_into_template(self.tokenizer, rows.rows(), layout.template)
            if any(h.prefix for h in moved):
                layout.prompt = rows.padded([h.ids for h in moved])
                layout.heal_prefixes = [h.prefix for h in moved]
        layout.template, hole_prefixes = heal_holes_of(self.tokenizer, layout.template)
        if hole_prefixes:
            unique = sorted(set(hole_prefixes.values()))
            masks = dict(zip(unique, allowed_first_tokens(self.tokenizer, unique, self.config.text.vocab_size)))
            layout.hole_allowed = {pos: masks[prefix] for pos, prefix in hole_prefixes.items()}
            layout.hole_prefixes = hole_prefixes
        return layout

    def _unknown_ids(self, template: torch.Tensor | None) -> torch.Tensor | None:
        """The ids past the tokenizer's vocabulary that the model's (padded) embedding has: never generated, since
        they have no text (transformers samples them, and its decode drops them without a word); a template that
        holds one is refused. None: there are none."""
        v = self.config.text.vocab_size
        unknown = self.tokenizer.unknown_ids(v) if self.tokenizer is not None else []
        if not unknown:
            return None
        ids = torch.tensor(unknown, device="cpu")
        if template is not None and bool(torch.isin(template, ids).any()):
            bad = int(template[torch.isin(template, ids)][0])
            raise ValueError(f"template: token id {bad} has no token in the tokenizer (its vocabulary has "
                             f"{self.tokenizer.vocab_size}; the model's embedding is padded to {v}), so no text")
        return ids

    def _from_transformers(self, call: str, args: dict[str, Any]) -> tuple[LM, dict[str, Any], dict[str, str]]:
        """transformers' generate keywords (TRANSFORMERS_KEYWORDS) in `args`, a call's arguments by name, as
        blockpress's: (the LM to run it on, the arguments, the names the caller gave: `_named_as_given`'s). input_ids is the prompt, stop_strings `stop`,
        num_return_sequences repeats each row with seeds of its own (the server's n); generation_config (over the
        checkpoint's, as in transformers), eos_token_id, pad_token_id and max_length (the prompt's width + new
        tokens; max_new_tokens wins when both are given, as in transformers) are the call's generation settings: a
        copy of this LM that holds them, so the checkpoint's are not changed."""
        hf = {k: args.pop(k) for k in TRANSFORMERS_KEYWORDS if k in args}
        _no_meta_tensors(**{k: v for k, v in hf.items() if k in ("input_ids", "eos_token_id", "pad_token_id")})
        given_as = {}  # blockpress's name (as its errors start) -> the keyword the caller used for it
        input_ids = hf.pop("input_ids", None)
        if input_ids is not None:  # (None: not given, as transformers' default)
            given_as["prompt"] = "input_ids"
            if args.get("prompt") is not None:
                raise ValueError(f"input_ids: {call} was given the prompt twice (input_ids and prompt); give one")
            args["prompt"] = input_ids
        if args.get("prompt") is None:
            raise ValueError(f"prompt: {call} needs a prompt (the first argument, or input_ids= as in transformers)")
        if hf.get("stop_strings") is not None:
            if args.get("stop") is not None:
                raise ValueError("stop_strings: transformers' name for stop, which was given too; give one")
            args["stop"] = hf["stop_strings"]
            given_as["stop"] = "stop_strings"
        gen = dict(self.generation_config)
        call_settings: dict[str, Any] = {}
        if hf.get("generation_config") is not None:
            own = dict(self.generation_config)
            if own.get("bos_token_id") is None:  # (what lm.save writes, and a GenerationConfig read back holds)
                own["bos_token_id"] = self.config.text.bos_token_id
            call_settings = _generation_settings(hf["generation_config"], own)
            if "sampler_config" in call_settings and "entropy_bound" not in call_settings:
                gen.pop("entropy_bound", None)  # blockpress's spelling, which wins over sampler_config in one dict
            gen.update(call_settings)
            if "max_length" in call_settings and "max_new_tokens" not in call_settings:
                # the call's bound replaces the checkpoint's max_new_tokens, as the max_length keyword's does (and
                # as in transformers): left in place, that count would win and the bound be silently ignored
                gen["max_new_tokens"] = None
                given_as["max_new_tokens"] = "generation_config max_length"
        if hf.get("sampler_config") is not None:  # the reference's per-call spelling of the entropy bound
            gen.pop("entropy_bound", None)
            gen["sampler_config"] = _sampler_config_setting(hf["sampler_config"])
        for key in ("eos_token_id", "pad_token_id"):
            if hf.get(key) is not None:  # a tensor or numpy id (list), as the reference takes it, as plain ints
                value = hf[key]
                gen[key] = value.tolist() if isinstance(value, torch.Tensor) or hasattr(value, "__array__") else value
                given_as[f"generation_config {key}"] = key  # checked against the vocabulary as the settings' own
        if hf.get("max_length") is not None:
            if args.get("max_new_tokens") is not None or call_settings.get("max_new_tokens") is not None:
                check_positive_int(hf["max_length"], "max_length")  # unread, but a mistake all the same
                given = "max_new_tokens" if args.get("max_new_tokens") is not None else "generation_config's max_new_tokens"
                warn_user(f"max_length: {given} was given too and takes precedence, as in transformers")
            else:  # the call's max_length, not a max_new_tokens the checkpoint's settings hold
                gen.update(max_length=hf["max_length"], max_new_tokens=None)
                given_as["max_new_tokens"] = "max_length"  # the count it leaves is what the context check names
        n = hf.get("num_return_sequences")
        if n is not None:
            check_positive_int(n, "num_return_sequences")
        if n is not None and n > 1:
            self._check_copies(call, args["prompt"], int(n), args.get("max_new_tokens"), gen, args.get("cache"))
            if args.get("seeds") is not None:
                raise ValueError("num_return_sequences: not with seeds (it gives each repeated row a seed of its "
                                 "own); pass one seed per row in seeds and repeat the prompt yourself")
            # asked before the rows are repeated: a setting given one per prompt row is then the right length
            greedy = self._greedy(call, gen, args, len(_repeat_rows(args["prompt"], 1, "prompt")))
            args["prompt"] = _repeat_rows(args["prompt"], int(n), "prompt")
            if args.get("attention_mask") is not None:
                args["attention_mask"] = _repeat_rows(args["attention_mask"], int(n), "attention_mask")
            rows = len(args["prompt"]) // int(n)
            cache = args.get("cache")
            if isinstance(cache, KVCache) and cache.batch_size != rows * int(n):  # said as the prompt's rows alone
                raise ValueError(f"num_return_sequences: the cache holds {cache.batch_size} rows, and {rows} prompt "
                                 f"{'row' if rows == 1 else 'rows'} x {n} copies need {rows * int(n)} (each copy "
                                 "continues a cache row of its own, as a num_return_sequences output's cache holds "
                                 "them); for several continuations of one conversation take mark = cache.mark(), then "
                                 f"call {call} once per continuation, each with a seed of its own, with "
                                 "cache.truncate(mark) between them")
            for key in ROW_KEYWORDS:  # one setting per prompt row: each copy keeps its row's
                value = args.get(key)
                value = value.tolist() if value is not None and getattr(value, "ndim", None) == 1 else value
                if isinstance(value, (list, tuple)) and len(value) == rows:
                    args[key] = [v for v in value for _ in range(int(n))]
            stop = args.get("stop")
            # one list of stop strings per prompt row: each copy keeps its row's. Any other count is read as one per
            # output row, as the settings above are (repeated regardless, 2 lists for 1 row x 2 copies were refused
            # as 4)
            if isinstance(stop, (list, tuple)) and len(stop) == rows and all(isinstance(r, (list, tuple)) for r in stop):
                args["stop"] = [r for r in stop for _ in range(int(n))]
            if "template" in args:  # (an array of texts is a batch of them: read so before its rows repeat)
                args["template"] = _template_texts(args["template"])
            if _template_batch(args.get("template")):  # one template per row, not one for every row
                args["template"] = _repeat_rows(args["template"], int(n), "template")
            seed = check_seed(args.get("seed"), "seed")
            # None draws a fresh seed per row, which differ already; greedy copies are one answer whatever the seed, as
            # the server's n greedy choices are (and as seed=None's, which greedy reads as 0)
            if seed is not None and not greedy:
                args["seeds"] = [choice_seed(seed, i) for _ in range(rows) for i in range(int(n))]
        if gen == self.generation_config:
            return self, args, given_as
        check_generation_settings(gen, f"{call}'s generation settings")
        lm = copy.copy(self)  # shares the model, tokenizer and compiled steps; only the settings are its own
        lm.generation_config = gen
        if (hf.get("max_length") is not None or call_settings.get("max_length") is not None) and \
                args.get("max_new_tokens") is None and gen.get("max_new_tokens") is None:
            lm._max_length_from = "call"  # the call's bound, not the checkpoint's default
        lm._call_filters = {key: call_settings[key] for key in ("top_k", "top_p")
                            if call_settings.get(key) is not None and call_settings[key] != self.generation_config.get(key)}
        for key in lm._call_filters:
            if args.get(key) is None:  # (a keyword given too is what the call runs with, and names itself)
                given_as[key] = f"generation_config {key}"
        return lm, args, given_as

    def _greedy(self, call: str, settings: dict[str, Any], args: dict[str, Any], rows: int) -> bool:
        """Whether a `call`'s `args` for `rows` prompt rows decode with argmax candidates under the generation
        `settings`: its copies are then one answer. A setting it refuses is refused later, naming it."""
        if call == "generate_ar":  # its own rule (generate_ar's docstring): temperature 0, or none and no sampler
            temperature, sampler = _number(args.get("temperature")), args.get("sampler")
            if temperature is None:
                return sampler is None or (isinstance(sampler, SamplerConfig) and sampler.argmax_candidates)
            return is_finite_number(temperature) and temperature == 0
        held = copy.copy(self)
        held.generation_config = settings
        options = {k: v for k, v in args.items() if k not in STREAM_OPTIONS or k == "max_denoising_steps"}
        try:
            return held._sampler_config(args.get("sampler"), options, rows, "temperature")[0].argmax_candidates
        except (ValueError, TypeError):
            return False

    def _check_copies(self, call: str, prompt: Any, n: int, max_new_tokens: Any = None,
                      settings: Mapping[str, Any] | None = None, cache: Any = None) -> None:
        """num_return_sequences' batch, the prompt's rows x `n`, before the rows are repeated: at most 2**31 - 1
        rows (past that the batch is absurd on any device, and a Python or torch size past int64 overflows), and
        where the device's free memory is known (checkpoint.available_bytes), rows whose KV cache
        fits in it at the least a generation holds. A floor, not a forecast: the step's work comes on top (unchecked, a
        huge n builds a gigantic batch on the host, then fails in torch's allocator, or raises OverflowError).
        generate's cache grows a canvas at a time, so its floor is one canvas a row; generate_ar's (`_ar_floor`)
        is allocated whole at the start, the prompt and every new token, with a float32 row of logits beside it
        (`max_new_tokens` and `settings`: the call's; a `cache` given holds its slots already)."""
        rows = len(_repeat_rows(prompt, 1, "prompt"))
        total = rows * n
        what = f"{rows} prompt {'row' if rows == 1 else 'rows'} x {n} copies"
        if total >= 2**31:
            raise ValueError(f"num_return_sequences: {what} make {total} rows, past the 2**31 - 1 any batch may hold")
        if call == "generate_ar":
            positions, extra, says = self._ar_floor(prompt, max_new_tokens, settings or self.generation_config, cache)
        else:
            positions, extra, says = self.config.canvas_length, 0, ""
        nbytes = KVCache.allocation_bytes(self.config.text, self.dtype, total, positions) + total * extra
        free = available_bytes(self.device)
        if free is not None and nbytes > free:
            raise ValueError(f"num_return_sequences: {what} make {total} rows, whose KV cache needs at least "
                             f"{nbytes / 1e9:,.1f} GB on {self.device} ({positions} "
                             f"{'token' if positions == 1 else 'tokens'} a row{says}), but {free / 1e9:.1f} GB are "
                             "available")

    def _ar_floor(self, prompt: Any, max_new_tokens: Any, settings: Mapping[str, Any],
                  cache: Any = None) -> tuple[int, int, str]:
        """What generate_ar allocates a row at the least, for `_check_copies`: (its cache's positions, the bytes beside
        them, how the message says them). run_ar's cache holds the prompt's padded width, every new token and one
        slot more from the start, and its logits are a float32 row of the vocabulary (a floor of one position a row
        would pass a huge n of one-token prompts, which then fail in torch's allocator). A prompt or count that
        cannot be read counts as one token: the request's own checks name it after this. A conversation's `cache`
        is in memory already: only a cache grown past its capacity is new."""
        try:
            width = int(prompt_to_ids(prompt, self.tokenizer, self.pad_id)[0].shape[1])
        except (ValueError, TypeError):
            width = 1
        given = max_new_tokens.tolist() if getattr(max_new_tokens, "ndim", None) == 1 else max_new_tokens
        counts = [c for c in (given if isinstance(given, (list, tuple)) else [given]) if is_int(c) and c > 0]
        new = int(max(counts)) if counts else 1
        setting: Any = settings.get("max_new_tokens")
        length: Any = settings.get("max_length")
        if given is None and setting is None and length is None:
            new = DEFAULT_NEW_TOKENS
        elif given is None and setting is not None:  # the call's settings, as default_new_tokens reads them
            new = int(setting) if is_int(setting) and setting > 0 else 1
        elif given is None:  # its max_length less the prompt
            new = int(length) - width if is_int(length) and length > width else 1
        # a count past the context is refused by _check_context: what the context leaves is all it could allocate
        room = max(1, self.config.text.max_position_embeddings - width)
        capped = " (what the context leaves)" if new > room else ""
        new = min(new, room)
        vocab = self.config.text.vocab_size
        held = cache.length if isinstance(cache, KVCache) else 0
        positions = held + width + new + 1
        if isinstance(cache, KVCache) and positions <= cache.capacity:
            return 0, 4 * vocab, f": the cache given holds them; {vocab:,} float32 logits"
        cached = f"{held} cached + " if held else ""
        return positions, 4 * vocab, f": {cached}{width} prompt + {new} new{capped} + 1, and {vocab:,} float32 logits"

    def _check_context(self, req: Request, cache: KVCache | None, canvas_length: int | None,
                       defaulted: bool = False) -> None:
        """Positions past max_position_embeddings were never trained, and an absurd max_new_tokens would first
        allocate a cache that long: refuse with a clear error instead. `canvas_length`: block diffusion's, whose
        new tokens take whole canvases (a few new tokens on a canvas longer than the context would otherwise
        pass, then run for minutes past it); None for AR, one position a token."""
        if cache is not None:
            self._check_cache(cache, req.prompt.shape[0])
        limit = self.config.text.max_position_embeddings
        # Per row: its own cached positions, its own prompt (left padding takes no position) and its own budget.
        b = req.prompt.shape[0]
        held = torch.zeros(b, dtype=torch.long, device="cpu") if cache is None else cache.next_pos.cpu().long().expand(b)
        lengths = (torch.full((b,), req.prompt.shape[1], device="cpu") if req.attention_mask is None
                   else req.attention_mask.sum(-1).cpu()).long()
        budgets = req.row_budgets()[0]
        # Python ints: a max_new_tokens past int64 (2**63) is refused below by name, where a long tensor of it
        # would raise 'Overflow when unpacking long long'
        taken = [n if canvas_length is None else canvas_positions(n, canvas_length) for n in budgets]
        totals = [h + p + t for h, p, t in zip(held.tolist(), lengths.tolist(), taken)]
        r = max(range(b), key=totals.__getitem__)  # the first row that needs the most positions
        h, p, n, t = int(held[r]), int(lengths[r]), budgets[r], taken[r]
        if h + p + t > limit:
            where = f"{h} cached + " if h else ""
            row = f" (row {r})" if b > 1 else ""
            whole = f" (whole {canvas_length}-token canvases: {t} positions)" if t != n else ""
            # which one to shorten: the prompt when not even one new token (one canvas) fits after it; a
            # template's length is its own, not max_new_tokens
            blame = ("prompt" if h + p + (canvas_length or 1) > limit else "template" if req.template is not None
                     else "max_new_tokens")
            # `defaulted`: the call gave no max_new_tokens, so the count is the checkpoint's default (a long chat
            # would otherwise meet a refusal of "256 new tokens" it never asked for): say so, and what would fit
            room = limit - h - p if canvas_length is None else canvas_room(limit, h + p, canvas_length)
            hint = (f"; none was given, so {n} is the checkpoint's default: max_new_tokens {room} fits"
                    if defaulted and blame == "max_new_tokens" else "")
            raise ValueError(f"{blame}: {where}{p} prompt + {n} new tokens{row}{whole} exceed the model's "
                             f"context of {limit} tokens (max_position_embeddings){hint}")

    def _check_cache(self, cache: Any, batch: int) -> None:
        """A conversation's cache continues only the model (and batch) that built it: same layers, heads, head
        sizes, dtype and device."""
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: expected the KVCache of an earlier call (return_cache=True), got "
                             f"{type(cache).__name__}")
        have, want = cache.layout, KVCache.layout_for(self.config.text, self.dtype, self.device)
        if have != want:
            raise ValueError(f"cache: built by another model ({'; '.join(_layout_differences(have, want))})")
        if cache.batch_size != batch:
            raise ValueError(f"cache: holds {cache.batch_size} rows, the prompt has {batch}")
        if cache.length and cache.weights_version not in (None, self.model.weights_version):
            if cache.weights_version[0] != self.model.weights_version[0]:
                raise ValueError("cache: filled by another model (another LM's return_cache), so it holds that "
                                 "model's keys and values; continue it with the LM that returned it, or start the "
                                 "conversation anew (return_cache=True)")
            raise ValueError("cache: filled before this model's weights changed (lm.to, quantize, a training step), so it holds the "
                             "old weights' keys and values; start the conversation anew (return_cache=True)")

    def _stops(self, stop: Any, batch: int, template: torch.Tensor | None) -> list[list[str]] | None:
        stops = normalize_stops(stop, batch)
        if stops and self.tokenizer is None:
            raise ValueError("stop: stop strings need a model with a tokenizer (to read the text)")
        if stops and template is not None:
            raise ValueError("stop: not with a template (a constrained canvas has a fixed length)")
        return stops

    def stream(
        self,
        prompt: Prompt | None = None,
        max_new_tokens: Counts | None = None,
        *,
        max_denoising_steps: int | None = None,
        sampler: str | SamplerConfig | None = None,
        seed: int | None = None,
        min_new_tokens: Counts | None = None,
        min_new_tokens_eos_only: Flags | None = None,
        attention_mask: Any = None,
        template: Prompt | None = None,
        hole_length: int = HOLE_LENGTH,
        cache: KVCache | None = None,
        return_cache: bool | None = None,
        drafts: bool | None = None,
        seeds: Seeds | None = None,
        skip_stopped_rows: bool | None = None,
        constraint: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        token_healing: bool | None = None,
        stop: Stops | None = None,
        prefix_cache: PrefixCache | None = None,
        cancelled: Callable[[], Flags] | None = None,
        **sampler_options: Any,
    ) -> Events:
        """Generate, yielding `Draft` (each step, if `drafts`), `Commit` (each canvas) and a final `Done`.

        `seeds`: one seed per row (overrides `seed`), as a server batching independent requests uses it.
        `constraint(draft [b, C], settled [b, C]) -> banned [b, C, V]`: a rule applied every step before
        sampling, e.g. sudoku's "no digit twice in a unit" (`settled`: positions holding an accepted or fixed
        token; the rest of the draft is noise).
        `logits_processor(logits [b, C, V], rows [b]) -> logits`: transforms every step's logits before
        sampling; `rows` are the working rows' indices in the batch (all of them with skip_stopped_rows=False),
        so it may combine rows, e.g. sudoku's ensemble of symmetric views (tasks/sudoku_model.py). The sampler
        writes into the logits it returns: `logits` itself, changed in place or not, costs nothing; any other
        tensor is copied first (one [b, C, V] copy a step), as the processor may keep it.
        `token_healing`: let the model re-choose each prompt's whitespace-only last token when a longer token
        could have merged there (a trailing newline before indentation, say; see healing.py for why punctuation
        is left alone); needs a tokenizer; texts start after the prompt. With a template it heals the holes
        instead: a whitespace-only fixed token right before a hole becomes the hole's first position, whose token
        must start with it (healing.heal_holes), and a text prompt's whitespace-only last token joins a hole the
        template starts with the same way (healing.heal_into_template; texts and fills leave it out). None, the
        default: text templates are healed, nothing else; pass False to keep a text template's tokens exactly (a
        `constraint` that addresses its positions needs that) and the prompt as given.
        `stop`: a string, a list of strings (or a 1-D numpy array of them), or one list per row. A row ends with
        the canvas in which its text first holds one; its tokens end at the token that completes it, and its final
        text stops just before it (as OpenAI's `stop`). Texts leave special tokens out, so a stop string that is a
        special token's text (`"<end_of_turn>"`) ends the row at that token instead (its tokens end with it, its
        text before it, as at an EOS); one that holds a special token's text among other text is refused. A
        `Commit`'s `texts_so_far` is each row's answer so far, read as `Done`'s `texts` (decoded whole, cut at a
        stop string; the last Commit's are Done's), `num_new_tokens` its tokens, `fills_so_far` a
        template's holes so far; its `texts` are this canvas's tokens alone, stop string included, and a character
        whose bytes a canvas edge splits comes out as U+FFFD in two commits there. texts_so_far may take text back
        (a half character's U+FFFD, the start of a stop string that the next canvas completes and cuts); a
        Commit's `settled_texts` never do: each row's texts_so_far less such a tail (generate.settled_text, what the
        server streams), each a prefix of the next and of Done's texts: print their growth.
        `prefix_cache`: a `PrefixCache` kept across calls; each prompt encodes only what no earlier prompt in
        it shared (the output's `extra["reused_prompt_tokens"]` says how much was reused, per row).
        `cache`: continue the conversation a `return_cache=True` output holds (its tokens: `sequences`' valid ones,
        through an EOS or the token that completes a stop string, which the text leaves out). It is extended in
        place (no copy):
        afterwards it holds this turn too, so continuing twice from one cache continues the second time from
        the first continuation, and a stream left midway (a break, close) leaves part of a turn in it; one that fails
        (an error, a Ctrl-C inside it), and a generate that does, leave the cache as it was. To branch or retry,
        `mark = cache.mark()` before and `cache.truncate(mark)` after: each row goes back to exactly what it held
        (a slot count would not do for a batch: continuing one moves each row's history so its padding stays on
        the left; `truncate(cache.length noted before)` is refused then).
        `cancelled() -> bool`: asked before every step, on the host (no device sync); once it says True the stream
        ends there, with a `Cancelled` (the passes and tokens done so far) in place of `Done` (a server's clients
        that left free the engine within a step). It may say one bool per row instead (a list, or a 1-D tensor or
        array): a row marked True ends there as at its max_new_tokens (its text so far stays; the rest of the batch
        goes on as it would) and, unless the cache is handed back or a logits processor mixes rows, its cache row is
        freed at the next canvas (a server's client that left a shared batch); every row True at once, before any row
        has ended, is the whole stream's `Cancelled` (rows marked one by one end so, the last with the stream's Done).
        """
        if prompt is None or TRANSFORMERS_KEYWORDS & sampler_options.keys():
            args = {k: v for k, v in locals().items() if k not in ("self", "sampler_options")}
            lm, args, given_as = self._from_transformers("stream", {**args, **sampler_options})
            with _named_as_given(given_as):
                return lm.stream(**args)
        _check_keywords("stream", STREAM_OPTIONS, sampler_options)
        _check_function(cancelled, "cancelled", "() -> bool")
        _check_function(constraint, "constraint", "(draft, settled) -> banned")
        check_flag("skip_stopped_rows", skip_stopped_rows, none=True)
        check_flag("return_cache", return_cache, none=True)
        check_flag("drafts", drafts, none=True)
        skip_stopped_rows, drafts = skip_stopped_rows is not False, drafts is not False  # (None: the defaults)
        req = self._request(
            prompt, cache=cache, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, sampler=sampler,
            sampler_options=dict(sampler_options, max_denoising_steps=max_denoising_steps), seed=seed,
            min_new_tokens_eos_only=min_new_tokens_eos_only,
            attention_mask=attention_mask, token_healing=token_healing, stop=stop, template=template,
            hole_length=hole_length, seeds=_row_seeds(seeds), prefix_cache=_check_prefix_cache(prefix_cache),
            skip_stopped_rows=skip_stopped_rows, constraint=constraint,
            logits_processor=_check_logits_processor(logits_processor),
            cancelled=cancelled)
        events = run(self.model, req, cache=cache, drafts=drafts, keep_cache=bool(return_cache) or cache is not None,
                     tokenizer=self.tokenizer, fns=self.step_functions)
        return _kept_open(events if cache is None else _undone_on_error(events, cache))

    def generate(self, prompt: Prompt | None = None, max_new_tokens: Counts | None = None, *, max_denoising_steps: int | None = None,
                 sampler: str | SamplerConfig | None = None, seed: int | None = None, **kwargs: Any) -> GenerationOutput:
        """Block-diffusion generation. `prompt`: str, list[str], ids [P] / [B, P], or a list of id lists (ragged
        rows are left-padded). Text prompts get BOS first (not twice; not on a turn that continues a `cache`).
        Everything after `max_new_tokens` is a keyword, here and in `stream` and `generate_ar` (a third positional
        argument meant max_denoising_steps here and temperature there).

        `max_new_tokens`: exactly this many new tokens at most (default: the checkpoint's generation config's
        max_new_tokens, else its max_length less the prompt's padded width, else 256), or one count per row (a list
        or 1-D integer tensor of length B): a row ends once it has written its own, as at an EOS (pads after it, no
        more passes), and is what it would be alone with that count; `new_tokens` is as wide as the largest.
        `min_new_tokens` (default 0): no EOS before this many new tokens, likewise one count or one per
        row, each at most the row's max_new_tokens, and, as vLLM's min_tokens, no `stop` string ends inside their
        text; `min_new_tokens_eos_only=True` (or one flag per row) bans EOS alone, so a stop string there ends the
        row as anywhere (a server's default minimum: its reply never holds a stop string). `max_denoising_steps`: per canvas (default: the checkpoint's,
        else 48). `sampler`: "entropy_bound" (the reference's), "confidence", "topk" or "greedy", or a whole
        `SamplerConfig`, which replaces the checkpoint's settings rather than adding to them, except
        `noise_token_id`: that says how the model was trained, so a SamplerConfig that leaves it None decodes with the checkpoint's noise token (pass
        noise_token_id=-1 for uniform noise on a model trained with absorbing noise). `seed`: None draws a fresh
        one per row, which `out.extra["seeds"]` reports (pass them as `seeds` to repeat the sample); greedy, and any
        sampler with candidates="argmax", uses 0. Every row draws from it as it would alone (a row's output does not
        depend on the batch, up to the float rounding docs/python-api.md describes), so rows holding the same prompt
        get the same sample: for different samples of one prompt pass `seeds`, one per row (the server's n > 1
        choices get seeds of their own this way).

        Keyword options (see `stream` for the details): attention_mask, stop (OpenAI's: a string,
        a list, or one list per row), template (constrained canvas) and hole_length, cache (continue a
        conversation) and return_cache, seeds (one per row), skip_stopped_rows (default True: a row that has
        stopped leaves the batch), constraint and logits_processor (per-step hooks), token_healing, prefix_cache,
        and any SamplerConfig field (entropy_bound, confidence, t_min, t_max, stability_threshold,
        confidence_threshold, adaptive_stopping, rank_by, candidates, draw_temperature, top_k, top_p, keep_accepted,
        self_conditioning, noise_token_id, presence_penalty, frequency_penalty); any other keyword is a ValueError
        that names it, the closest one taken and all of them (generate_ar's alike). `draw_temperature` is OpenAI's
        `temperature` (the server maps it there): candidates are drawn at the schedule's temperature (t_max down to
        t_min) times it, while acceptance keeps the schedule; it needs a sampler that draws candidates, and is
        refused with "greedy" (a checkpoint's default may be, as blockpress-code's is: pass sampler="entropy_bound")
        or candidates="argmax", which would ignore it. draw_temperature, top_k and top_p may also be one per row (a
        list or a 1-D array / tensor, as max_new_tokens): each row draws as it would alone with its own.

        transformers' keywords (input_ids, max_length, generation_config, eos_token_id, pad_token_id,
        num_return_sequences, stop_strings) have the reference generate's meaning, here, in `stream` and in
        `generate_ar` (`_from_transformers`); do_sample and repetition_penalty are refused, naming the nearest setting.
        num_return_sequences' batch (the prompt's rows x n) is refused past 2**31 - 1 rows, or where the device's
        free memory is known, when even one canvas a row of KV cache (generate_ar: its whole cache, the prompt +
        max_new_tokens + 1 a row, and a float32 row of logits) would not fit in it.

        Returns a GenerationOutput: sequences (prompt as encoded + new tokens), new_tokens, num_new_tokens (up to
        and including EOS), texts, forward_passes and steps_per_canvas per row, tokens_per_forward, the encode
        and denoise seconds, and `cache` when asked.
        """
        if kwargs.pop("drafts", None) is not None:  # generate returns the end result only; the drafts are stream()'s
            raise ValueError("drafts: generate returns the finished output; iterate lm.stream(..., drafts=True) to see "
                             "the canvas settle")
        if prompt is None or TRANSFORMERS_KEYWORDS & kwargs.keys():
            lm, args, given_as = self._from_transformers("generate", dict(
                kwargs, prompt=prompt, max_new_tokens=max_new_tokens, max_denoising_steps=max_denoising_steps,
                sampler=sampler, seed=seed))
            with _named_as_given(given_as):
                return lm.generate(**args)
        _check_keywords("generate", STREAM_OPTIONS, kwargs, leave_out=("drafts",))
        events = self.stream(prompt, max_new_tokens, max_denoising_steps=max_denoising_steps, sampler=sampler,
                             seed=seed, drafts=False, **kwargs)
        with _undone_on_failure(kwargs.get("cache")):  # (stream checked it; nothing is encoded yet)
            try:
                for event in events:
                    if isinstance(event, Done):
                        return event.output
                # run ends with Done unless `cancelled` said so
                raise RuntimeError("cancelled: generation was cancelled before it finished")
            except BaseException:  # a Ctrl-C between two events too: the stream's own undo does not see it
                events.close()
                raise

    def chat_prompt(self, messages: Messages, **template_options: Any) -> list[int] | list[list[int]]:
        """The ids of a conversation rendered through the checkpoint's chat template, ending with the header of the
        model's turn: the one rendering that `chat`, `blockpress chat`, `blockpress generate --chat` and the
        server's /v1/chat/completions prompt with. `messages`: one conversation, a list of {"role", "content"}
        dicts (-> a list of ids), or a list of conversations (-> one row of ids each); each message is read as the
        server and `blockpress train` read it (tokenizer.chat_message: OpenAI's text parts joined by "\\n",
        "developer" as "system" where the template has no place of its own for it, other parts and missing content refused
        by field). `template_options` go to
        Tokenizer.apply_chat_template (tools, documents, chat_template, continue_final_message, template
        variables; not `tokenize`: ids are what this returns, and their text is
        `lm.tokenizer.decode(ids, skip_special_tokens=False)`); tools are refused where the template never reads
        them (they would vanish from the prompt)."""
        # imported here, as in `load`: jinja2 and tokenizers are for models that have a tokenizer
        from .tokenizer import MessageError, chat_message

        if "tokenize" in template_options:  # it would reach apply_chat_template twice: a bare TypeError
            raise ValueError(f"tokenize: chat_prompt always returns token ids (got tokenize="
                             f"{template_options['tokenize']!r}); for the rendered text, "
                             "lm.tokenizer.decode(lm.chat_prompt(messages), skip_special_tokens=False)")
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer (no tokenizer.json in its folder) to render a "
                             "conversation with; pass token ids to generate")
        if self.tokenizer.chat_template is None and template_options.get("chat_template") is None:
            raise ValueError("chat_template: this model's tokenizer has no chat template (no chat_template.jinja, "
                             "nor chat_template in tokenizer_config.json), so messages cannot be rendered; pass a "
                             "plain prompt to generate, or set lm.tokenizer.chat_template")
        tools = template_options.get("tools")
        for name, instead in (("tools", "describe them in a message instead"),
                              ("documents", "put their text in a message instead")):
            # what the template never reads would vanish from the prompt: a reply written without it, unsaid
            if template_options.get(name) and name not in self.tokenizer.chat_template_variables(
                    template_options.get("chat_template"), tools):
                raise MessageError(name, f"this model's chat template does not use {name}; {instead}")
        batch = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        conversations = messages if batch else [messages]
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages: expected a list of {{'role', 'content'}} dicts, or a list of such lists, got "
                             f"{messages!r:.80}")
        developer = self.tokenizer.renders_developer(template_options.get("chat_template"), tools)
        read = [[chat_message(m, i, developer) for i, m in enumerate(conversation)] for conversation in conversations]
        for c, conversation in enumerate(read):
            self._check_chat_length(conversation, f"messages[{c}]" if batch else "messages")
        rows = [self.tokenizer.apply_chat_template(conversation, tokenize=True, **template_options)
                for conversation in read]
        return rows if batch else rows[0]

    def _check_chat_length(self, conversation: list[dict[str, Any]], name: str) -> None:
        """Refuse a conversation whose messages' text alone cannot fit the context, before the template renders it
        and the tokenizer reads it, which for a huge message take seconds just to learn that it cannot fit (the bound
        is encode_texts', the server's too)."""
        assert self.tokenizer is not None  # chat_prompt checked
        context = self.config.text.max_position_embeddings
        chars = sum(len(m["content"]) for m in conversation if isinstance(m.get("content"), str))
        if chars > context * (most := self.tokenizer.longest_token()):
            raise ValueError(f"{name}: {chars:,} characters of message content cannot fit the model's context of "
                             f"{context} tokens (no token of this vocabulary holds more than {most} characters, so "
                             f"more than {context * most:,} are refused before the chat template renders them)")

    def chat(self, messages: Messages, template_options: dict[str, Any] | None = None, **kwargs: Any) -> GenerationOutput:
        """The model's reply to a conversation (or one reply per conversation of a batch): `generate` on
        `chat_prompt(messages, **template_options)`, so an instruction-tuned checkpoint is prompted the way it was
        trained. `kwargs`: generate's (max_new_tokens, seed, sampler, stop, return_cache, ...). out.texts[0] is the
        reply. `cache`: continue the conversation as `chat_ids` says: pass the whole conversation again (with the
        reply and the new message), and only what it does not share with the cache is encoded."""
        if template_options is not None and not isinstance(template_options, dict):
            raise ValueError(f"template_options: expected a dict of apply_chat_template's options (tools=..., ...), "
                             f"got {type(template_options).__name__}")
        options = sorted(CHAT_TEMPLATE_OPTIONS & kwargs.keys())
        if options:  # (passed on, generate would say it takes no such keyword, naming neither chat nor the way)
            raise ValueError(f"{options[0]}: chat takes the chat template's options in template_options: pass "
                             f"template_options={{{options[0]!r}: ...}}")
        _check_forwarded("chat", ("messages", "template_options"), kwargs)
        check_flag("token_healing", kwargs.get("token_healing"), none=True)
        if kwargs.get("token_healing") and not (template_options or {}).get("continue_final_message"):
            raise ValueError("token_healing: not with a chat prompt that ends with the chat template's turn header "
                             "(the template's own, never healed: as `generate --chat` and the server refuse it); a "
                             "reply continued with template_options={'continue_final_message': True} ends with its "
                             "text, which heals")
        ids = self.chat_prompt(messages, **(template_options or {}))
        if kwargs.get("token_healing"):  # (continue_final_message, checked above; chat_prompt read the messages)
            from .tokenizer import chat_message

            batch = all(isinstance(m, (list, tuple)) for m in messages)
            conversations: list[Any] = list(messages) if batch else [messages]
            for c, conversation in enumerate(conversations):
                if conversation and chat_message(conversation[-1], len(conversation) - 1)["content"] == "":
                    # the rendering ends where the reply would begin: at the template's turn header, which healing
                    # would re-sample (the template's own tokens, as without continue_final_message)
                    where = f"messages[{c}][{len(conversation) - 1}]" if batch else f"messages[{len(conversation) - 1}]"
                    raise ValueError(f"token_healing: {where}, the final message continue_final_message continues, "
                                     "is empty: there is no reply text to heal (the rendering ends with the chat "
                                     "template's turn header, the template's own); pass token_healing=False, or "
                                     "give the reply's first text")
        return self.chat_ids(ids, **kwargs)

    def chat_ids(self, ids: list[int] | list[list[int]], *, cache: KVCache | None = None,
                 **kwargs: Any) -> GenerationOutput:
        """`generate` on a rendered conversation (`chat_prompt`'s ids: one list, or one per conversation), continuing
        `cache` when given: the cache an earlier `chat` / `chat_ids(..., return_cache=True)` returned. Only what
        `ids` add to what the cache holds is encoded (each row keeps the longest common prefix of its tokens; a reply
        that re-renders to other tokens costs re-encoding from the first difference, and drops the cache's marks past
        it), so the reply is the one the conversation gets without a cache. The cache records the tokens it holds; one extended since by generate or
        stream is refused (truncating it since to a mark taken before is fine). A turn that fails or is interrupted leaves it
        holding that common prefix. out.extra["reused_prompt_tokens"]: each row's tokens that the cache held, so
        not encoded this turn (out.sequences' prompt is the rest, the part encoded). `kwargs`: generate's
        (token_healing=True refused on ids that end with the chat template's generation prompt, its turn header
        rendered with the template's default options: the template's own tokens, which healing would re-sample. A
        generation prompt that template options change, as Qwen3's enable_thinking=False adds an empty thought after
        the header, is not told from a reply's text, and a template that cannot render a conversation of one user
        message leaves the check off: heal those ids only where they end with text of the reply's)."""
        _check_forwarded("chat_ids", ("ids",), kwargs)
        ids = _listed(ids)
        self._check_chat_healing(ids, kwargs.get("token_healing"))
        copies = _chat_copies(kwargs, cache)
        with _held(cache):
            rows, common = self._chat_start(ids, cache)
            try:
                out = self.generate([row[n:] for row, n in zip(rows, common)], cache=cache, **kwargs)
            except BaseException:  # a bad turn or a Ctrl-C: the cache holds the conversation before it, and says so
                self._chat_undo(cache, rows, common)
                raise
            self._chat_finish(out, *_repeat_chat_rows(rows, common, copies))
        return out

    def chat_stream(self, ids: list[int] | list[list[int]], *, cache: KVCache | None = None,
                    **kwargs: Any) -> Events:
        """`stream` on a rendered conversation, as `chat_ids` is `generate` on one: the same events, each Commit's
        `settled_texts` the reply so far (print their growth), and Done's output what chat_ids returns, its cache
        included. A stream that is cancelled, fails, or is left before its Done (a Ctrl-C, a `break`) leaves the
        cache holding the conversation before the turn, as chat_ids does. `kwargs`: stream's."""
        _check_forwarded("chat_stream", ("ids",), kwargs)
        ids = _listed(ids)
        self._check_chat_healing(ids, kwargs.get("token_healing"))  # now, not at the stream's first event
        return _kept_open(self._chat_events(ids, cache, kwargs))

    def _check_chat_healing(self, ids: Any, token_healing: Any) -> None:
        """chat's refusal of token_healing on a prompt that ends with the chat template's turn header (the template's
        own, healing would re-sample it), where rendered ids can tell: chat knows from its template_options, chat_ids
        and chat_stream only see the ids, which a continue_final_message rendering ends with the reply's text (that
        heals). So a row that ends with a generation prompt of the tokenizer's templates is refused: as each renders
        it with its default options (Tokenizer.generation_prompt_ids; none for a template that cannot render one user
        message), so a generation prompt that template options change is not seen (chat refuses those by its
        template_options)."""
        check_flag("token_healing", token_healing, none=True)
        if not token_healing or self.tokenizer is None or self.tokenizer.chat_template is None:
            return  # (no template: nothing to tell; ids that are no rows are _chat_start's to refuse)
        if not (isinstance(ids, list) and ids):
            return
        batch = isinstance(ids[0], list)
        templates = self.tokenizer.chat_template
        headers = [self.tokenizer.generation_prompt_ids(name) for name in
                   (sorted(templates) if isinstance(templates, dict) else [None])]
        for r, row in enumerate(ids if batch else [ids]):
            if isinstance(row, list) and any(h and row[-len(h):] == h for h in headers):
                raise ValueError(f"token_healing: not with {f'ids[{r}]' if batch else 'ids'}, which end with the chat "
                                 "template's generation prompt (its turn header: the template's own tokens, which "
                                 "healing would re-sample); ids of a reply continued, rendered with "
                                 "continue_final_message=True, end with its text, which heals")

    def _chat_events(self, ids: list[int] | list[list[int]], cache: KVCache | None, kwargs: dict[str, Any]) -> Events:
        with _held(cache) as claim:
            copies = _chat_copies(kwargs, cache)
            rows, common = self._chat_start(ids, cache)
            each_rows, each_held = _repeat_chat_rows(rows, common, copies)  # one per output row
            done = False
            try:
                for event in self.stream([row[n:] for row, n in zip(rows, common)], cache=cache, **kwargs):
                    if isinstance(event, Done):
                        self._chat_finish(event.output, each_rows, each_held)
                    elif isinstance(event, Commit) and event.reused_prompt_tokens is not None:  # counted as Done's
                        event.reused_prompt_tokens = [n + r for n, r in zip(each_held, event.reused_prompt_tokens)]
                    elif isinstance(event, Cancelled):
                        self._chat_undo(cache, rows, common)
                    if isinstance(event, (Done, Cancelled)):  # the turn is settled, the cache the next call's: held
                        # open after it (a notebook's next()), neither its claim nor a later undo may touch it
                        done = True
                        if cache is not None:
                            cache.release(claim)
                    yield event
            except BaseException:  # a bad turn, a Ctrl-C, or a caller that left early (GeneratorExit): the cache holds
                if not done:  # the conversation before the turn, and says so
                    self._chat_undo(cache, rows, common)
                raise

    def _chat_start(self, ids: Any, cache: KVCache | None) -> tuple[list[list[int]], list[int]]:
        """chat_ids' rows and, per row, how many of its first tokens `cache` holds already (it keeps those alone)."""
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"ids: expected chat_prompt's token ids (a list of ids, or one list per conversation), "
                             f"got {ids!r:.80}")
        rows = ids if isinstance(ids[0], list) else [ids]
        common = [0] * len(rows)
        if cache is not None:
            self._check_cache(cache, len(rows))
            if len(cache.users) > 1:  # (this turn holds one claim: another is a call of this thread still open)
                raise ValueError("cache: another call of this thread is continuing it (a stream or chat_stream still "
                                 "open): finish or close it before the next turn")
            held = cache.tokens
            if held is None and cache.length == 0:  # an empty cache holds no token
                held = [[] for _ in rows]
            if held is None:
                raise ValueError("cache: lm.chat continues a cache whose tokens it knows, one that a chat(..., "
                                 "return_cache=True) returned (truncating it since to a mark taken before is fine); "
                                 "this one was extended by generate or stream since: continue it with generate on "
                                 "the ids past what it holds")
            for i, (row, had) in enumerate(zip(rows, held)):  # one token at least is encoded: decoding starts there
                while common[i] < min(len(had), len(row) - 1) and had[common[i]] == row[common[i]]:
                    common[i] += 1
            cache.keep(common, why=_chat_rewind(rows, held, common))
        return rows, common

    @staticmethod
    def _chat_undo(cache: KVCache | None, rows: list[list[int]], common: list[int]) -> None:
        """Take an unfinished turn out of `cache`: it goes back to what it held of the conversation before it."""
        if cache is not None:
            cache.keep([min(n, h) for n, h in zip(common, cache.next_pos.tolist())])
            cache.tokens = [row[:n] for row, n in zip(rows, cache.next_pos.tolist())]

    @staticmethod
    def _chat_finish(out: GenerationOutput, rows: list[list[int]], common: list[int]) -> None:
        """A finished turn's output as chat_ids returns it: the reused tokens counted, the cache's tokens recorded."""
        out.extra["reused_prompt_tokens"] = [n + r for n, r in zip(common, out.extra["reused_prompt_tokens"])]
        if out.cache is not None:
            # What each row now holds: what it kept, its prompt as encoded (token healing may have changed its end;
            # left padding is no token) and its new tokens through the end.
            new = [r[:n] for r, n in zip(out.new_tokens.tolist(), out.num_new_tokens.tolist())]
            prompts = out.sequences[:, : out.prompt_length].tolist()
            out.cache.tokens = [row[:n] + p[len(p) - (end - n - len(t)):] + t for row, n, p, t, end in
                                zip(rows, common, prompts, new, out.cache.next_pos.tolist())]

    def infill(self, template: Prompt, prompt: Prompt | None = None, **kwargs: Any) -> GenerationOutput:
        """Fill the holes of `template` (text with <|hole|> / <|hole:N|> markers, a backslash before one keeping it
        as text; or ids with -1), keeping every fixed token. `fills` holds each hole's text, one per marker in
        order (per run of -1s in ids); `prompt`: context before the template (default: BOS alone; continuing a
        `cache`, the turn's own text before the template is needed: BOS would land mid-conversation). A list of
        templates (texts, or id rows of any lengths) is one batch, each row filled as it would be alone: its
        sequences and new_tokens are pad past its own length, its num_new_tokens that length."""
        if template is None:
            raise ValueError("template: expected text with <|hole|> markers or token ids with -1 for holes, got None "
                             "(for a free continuation use generate)")
        _check_forwarded("infill", ("template", "prompt"), kwargs)
        template = _template_texts(template)  # (before its rows are counted)
        if prompt is None:
            cache = kwargs.get("cache")
            if isinstance(cache, KVCache) and cache.length:
                # BOS starts a sequence: in the middle of the conversation the cache holds it is a token the model
                # never saw there (the fills went wrong), and a turn needs at least one token of its own to encode
                raise ValueError("prompt: infill continuing a cache needs the turn's text before the template as "
                                 "prompt= (at least one token; its default, BOS, only starts a fresh sequence), e.g. "
                                 "the template's text up to its first hole")
            bos = self.config.text.bos_token_id
            prompt = [[bos if bos is not None else 0]] * _template_rows(template)
        return self.generate(prompt, template=template, **kwargs)

    def generate_ar(
        self,
        prompt: Prompt | None = None,
        max_new_tokens: Counts | None = None,
        *,
        temperature: Numbers | None = None,
        seed: int | None = None,
        sampler: SamplerConfig | None = None,
        top_k: Counts | None = None,
        top_p: Numbers | None = None,
        min_new_tokens: Counts | None = None,
        min_new_tokens_eos_only: Flags | None = None,
        attention_mask: Any = None,
        cache: KVCache | None = None,
        return_cache: bool | None = None,
        token_healing: bool = False,
        stop: Stops | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        prefix_cache: PrefixCache | None = None,
        seeds: Seeds | None = None,
        logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        **unknown: Any,
    ) -> GenerationOutput:
        """The same backbone decoding one token at a time (encoder path + LM head): the AR baseline.

        Its draws are the diffusion candidates' (sampling.candidate_probs, one implementation for both engines):
        `temperature` 0 is greedy; T > 0 draws from softmax(logits / T), which is SamplerConfig.draw_temperature
        (AR has no temperature schedule). `top_k`, `top_p`: as SamplerConfig's, keep the top_k most likely tokens,
        then the nucleus of top_p. `presence_penalty`, `frequency_penalty`: OpenAI's, over the new tokens.
        `sampler`: a SamplerConfig, to decode with the settings a `generate(sampler=...)` run used: its candidate
        draw (candidates="argmax" or sampler="greedy": greedy; else draw_temperature), top_k, top_p and penalties;
        its other fields (acceptance rule, schedule, stopping, noise) are block diffusion's and are ignored. The
        keyword arguments override it. Without it, the checkpoint's settings with greedy draws unless `temperature`
        says otherwise (a checkpoint's greedy sampler also samples when given a temperature > 0, as on the server).
        `stop` as in `stream` (checked every 8 tokens; a row's tokens and text end at its stop string).
        `max_new_tokens`, `min_new_tokens` (and `min_new_tokens_eos_only`): one count, or one per row, as in
        `generate`. `temperature` (each > 0: greedy is the whole batch's), `top_k` and `top_p` may also be one per
        row (a list, or a 1-D array / tensor): each row then draws as it would alone with its own.
        `prefix_cache`, `seeds` (one per row, overriding `seed`; when sampling): as in `stream`. As in `generate`,
        rows holding the same prompt draw the same sample from one `seed`: give them `seeds` to differ.
        `logits_processor(logits [B, 1, V], rows [B]) -> logits`: as in `stream`, each token's next-token logits as
        a canvas of one position (rows: every row, each token), before the penalties and bans.
        Any other keyword is a ValueError naming it and the closest one taken (as generate's)."""
        if prompt is None or TRANSFORMERS_KEYWORDS & unknown.keys():
            args = {k: v for k, v in locals().items() if k not in ("self", "unknown")}
            lm, args, given_as = self._from_transformers("generate_ar", {**args, **unknown})
            with _named_as_given(given_as):
                return lm.generate_ar(**args)
        _check_keywords("generate_ar", GENERATE_AR_OPTIONS, unknown, sampler_settings=False)
        _no_meta_tensors(temperature=temperature, top_k=top_k, top_p=top_p)  # (read before _request's check)
        temperature = _as_rows(temperature, "temperature", "a number")
        per_row = isinstance(temperature, list)
        if isinstance(temperature, list):  # each checked with the other per-row settings (`_row_draws`); 0 is another rule
            zero = next((i for i, t in enumerate(temperature) if is_finite_number(t) and t == 0), None)
            if zero is not None:
                raise ValueError(f"temperature[{zero}]: 0 (greedy) is a whole batch's setting, not one row's (greedy "
                                 "takes the argmax where the other rows draw); pass temperature=0, or one > 0 for "
                                 "every row")
        elif temperature is not None:  # (a str too: _as_rows listed the others)
            check_temperature(temperature)
        if sampler is not None and not isinstance(sampler, SamplerConfig):
            raise ValueError(f"sampler: expected a SamplerConfig (its candidate draw and penalties are used) or None, "
                             f"got {sampler!r}; generate_ar has no acceptance rule: for greedy pass temperature=0")
        check_flag("return_cache", return_cache, none=True)
        base = self.sampler_defaults if sampler is None else sampler
        cfg = base.with_(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
        if temperature is None and sampler is None:
            temperature = 0.0  # the baseline's default: greedy
        if not per_row and temperature == 0:
            cfg = cfg.with_(candidates="argmax")
        elif temperature is not None:
            # greedy is entropy_bound with argmax candidates; asked for a temperature, it samples (as the server's)
            cfg = cfg.with_(candidates="sample", sampler="entropy_bound" if cfg.sampler == "greedy" else None)
        # the draw settings, one for every row or one per row, as generate takes them
        draw = dict(draw_temperature=None if temperature == 0 else temperature, top_k=top_k, top_p=top_p)
        req = self._request(prompt, cache=cache, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                            min_new_tokens_eos_only=min_new_tokens_eos_only,
                            sampler=cfg, sampler_options=draw, seed=seed, attention_mask=attention_mask,
                            token_healing=token_healing, stop=stop, seeds=_row_seeds(seeds),
                            prefix_cache=_check_prefix_cache(prefix_cache), canvases=False,
                            temperature_name="temperature", logits_processor=_check_logits_processor(logits_processor))
        with _undone_on_failure(cache):  # as generate's (_request checked it; nothing is encoded yet)
            return run_ar(self.model, req, cache=cache, keep_cache=bool(return_cache) or cache is not None,
                          tokenizer=self.tokenizer, fns=self.step_functions)

    def _own_mapped_tensors(self) -> None:
        """The weights (and kept vision tensors) that are views of the loaded files' mappings, copied into memory
        of their own, so that the mappings close: Windows refuses to replace a file a process maps, so a save over
        the folder the model was loaded from would fail as it moves its files into place. (A mapping is the one
        storage here that cannot be resized.)"""
        def own(t: torch.Tensor) -> torch.Tensor:
            return t if t.untyped_storage().resizable() else t.clone()

        mapped = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (
            *self.model.state_dict().values(), *self.passthrough.tensors.values()) if not t.untyped_storage().resizable()}
        check_fits(sum(mapped.values()), torch.device("cpu"), "save: over the folder the model was loaded from, on "
                   "Windows, the weights that view its files are copied first (a mapped file cannot be replaced)")
        with torch.no_grad():
            for module in self.model.modules():
                for param in module._parameters.values():
                    if param is not None:
                        param.data = own(param.data)  # (the Parameter kept: tied weights and optimizers hold it)
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = own(buffer)
        self.passthrough.tensors = {name: own(t) for name, t in self.passthrough.tensors.items()}
        gc.collect()  # a mapping closes once nothing views it

    def save(self, path: str | Path, metadata: dict[str, str] | None = None, *,
             dtype: torch.dtype | str | None = None, files: StagedFiles | None = None) -> None:
        """An HF-format folder that `blockpress.load` and transformers' `from_pretrained` both read. The files are
        written under temporary names and moved into place together (files.StagedFiles): a save killed part-way
        leaves no truncated file, and one whose moves fail part-way (an I/O error) is undone, the folder left as it
        was, with an OSError naming the file. `metadata`: string entries for the safetensors headers (a training run records its
        step there). `dtype`: the one the weights are written in, cast as they are written (the model keeps its
        own). None: the checkpoint's, where `load` widened it for this CPU (`widened_from`: bf16 loaded as float32
        without native bf16 matmuls), else the model's. `files`: stage them there instead, for its owner to commit
        with the rest of a larger save (a training run's, with its state).

        A quantized model saves quantized: its codes and scales as held, config.json's `quantization_config` naming
        the scheme; `blockpress.load` gives it back bit for bit (transformers cannot read it). `dtype` then applies
        to the tensors left unquantized (embedding, norms, router)."""
        dtype = resolve_dtype(_dtype_argument(dtype)) or self.widened_from or self.dtype
        adapted = lora_wrapped_layer(self.model)
        if adapted is not None:  # peft's modules would be saved under its names, which no load reads
            if self.quantization is not None:
                raise ValueError(f"save: the model holds LoRA adapters, unmerged over its quantized base ({self.quantization}, "
                                 f"layer {adapted!r}); save the adapters apart (blockpress.train.save_adapter), or "
                                 "merge them into the unquantized base (blockpress.load(base, adapter=...)) and save that")
            # (a LoRA run stopped before its last save, by Ctrl-C or an error, leaves them so): the folder written
            # would look whole, and neither load would read it (transformers fills the missing weights with random ones)
            raise ValueError(f"save: the model holds LoRA adapters, unmerged (layer {adapted!r}: a LoRA training run "
                             "stopped before its final save leaves them so); save the adapters apart "
                             "(blockpress.train.save_adapter), or fold them into the weights first "
                             "(blockpress.train.merge_lora(lm.model)) and save that")
        # as load reads one: else "~/out" makes a folder named ~ in the current one, and "" writes into this one
        path = output_folder(path, "save")
        self._check_runnable()  # a meta-device model has no weights to write (it would fail half-way)
        # numpy scalars (values a user set) as plain numbers, before any file is written: JSON refuses them
        gen = {k: v.item() if hasattr(v, "item") and getattr(v, "ndim", None) == 0 else v
               for k, v in self.generation_config.items()}
        try:  # anything else JSON cannot hold fails here, with the folder untouched
            json.dumps(gen)
        except TypeError as exc:
            raise ValueError(f"save: generation_config holds a value JSON cannot store ({exc})") from None
        # as a load reads them back: a value generate refuses (entropy_bound 0), saved, makes a folder that loads
        # neither here nor in transformers
        check_generation_settings(gen, "save: generation_config")
        # a key blockpress does not read would land in its own file, which the next load warns about: left out
        unread = sorted(unread_generation_keys(gen))
        if unread:
            warn_user(f"save: generation_config: {', '.join(unread)}: not blockpress settings, left out of {path} "
                      "(blockpress ignores them)")
            gen = {k: v for k, v in gen.items() if k not in unread}
        if MAPPED_FILES_LOCKED and self.path is not None and path.resolve() == self.path.resolve():
            self._own_mapped_tensors()
        with staging(files) as staged:
            save_model(self.model, path, self.passthrough, metadata=metadata, files=staged, dtype=dtype,
                       quantized_from=self._quantized_from())
            text = self.config.text
            gen.setdefault("bos_token_id", text.bos_token_id)
            gen.setdefault("pad_token_id", text.pad_token_id)
            # The set in effect now, written out whole: what a reload stops on is what this model stops on.
            eos = self._eos_ids()
            gen["eos_token_id"] = eos if len(eos) != 1 else eos[0]
            reference, own = split_generation_config(gen)
            staged.write_text(path / "generation_config.json", json.dumps(reference, indent=2, sort_keys=True) + "\n")
            own_file = path / BLOCKPRESS_GENERATION_FILE
            if own:
                staged.write_text(own_file, json.dumps(own, indent=2, sort_keys=True) + "\n")
            else:  # one left from an earlier save into this folder would override the settings
                staged.remove(own_file)
            if self.tokenizer is not None:
                self.tokenizer.save(path, files=staged)
            else:  # an earlier model's tokenizer in this folder would load with these weights
                for name in TOKENIZER_FILES:
                    staged.remove(path / name)

    def _quantized_from(self) -> str | None:
        """The checkpoint a quantized model's codes were made from, as a LoRA run records its base (train.base_name),
        for a save's quantization_config: the folder it was loaded from, or the one a folder saved quantized names
        itself; None for a plain model, random weights, weights an adapter changed, or codes quantize made from weights
        rounded below the checkpoint's (stored_values None)."""
        if self.quantization is None or self.path is None or self.adapter is not None or self.stored_values is None:
            return None
        from .train import base_name

        try:
            stored = read_json_object(self.path / "config.json").get("quantization_config")
        except (OSError, ValueError):  # the folder moved or changed since the load: nothing to say
            return None
        if not stored:
            return base_name(self)
        origin = stored.get("quantized_from") if isinstance(stored, dict) else None
        return origin if isinstance(origin, str) else None

    def __repr__(self) -> str:
        return f"LM({self.config.describe()}, dtype={self.dtype}, device={self.device})"


# The keywords stream (and so generate) and generate_ar take, read from their signatures once, at import: the
# typo errors list them (a method wrapped later, as a test's spy, keeps them)
STREAM_OPTIONS = _parameters(LM.stream)
GENERATE_AR_OPTIONS = _parameters(LM.generate_ar)

# Windows refuses to replace or delete a file that a process maps (Linux replaces the name; the mapping keeps the
# old file): LM.save over the folder the model was loaded from copies what it maps first
MAPPED_FILES_LOCKED = os.name == "nt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# The keys the reference's generation config takes; it refuses any other ("Unexpected kwargs"), so blockpress's
# own settings (sampler, penalties, noise token, ...) live beside it in BLOCKPRESS_GENERATION_FILE.
REFERENCE_GENERATION_KEYS = frozenset({
    "max_new_tokens", "max_length", "return_dict_in_generate", "max_denoising_steps", "sampler_config", "t_min",
    "t_max", "stability_threshold", "confidence_threshold", "cache_implementation", "cache_config",
    "disable_compile", "bos_token_id", "pad_token_id", "eos_token_id", "_commit_hash", "_from_model_config",
    "transformers_version",
})
BLOCKPRESS_GENERATION_FILE = "blockpress_generation_config.json"
# What a generation config may hold without a warning: the reference's keys (blockpress reads the lengths, the
# special ids and the sampler's; the rest say how the reference runs, not what it generates) and blockpress's
# own settings. Anything else (HF's temperature, do_sample, top_k, ...) would look in effect and be ignored.
KNOWN_GENERATION_KEYS = REFERENCE_GENERATION_KEYS | {f.name for f in fields(SamplerConfig)} | {"token_healing"}


def unread_generation_keys(gen: dict[str, Any]) -> set[str]:
    """The keys of a generation config that blockpress does not read (read_generation_config warns about them)."""
    return {key for key in gen if key not in KNOWN_GENERATION_KEYS}


# what is said of keys that unread_generation_keys finds (by load, by generate and by save)
UNREAD_KEYS_NOTE = ("not blockpress settings, ignored (it reads max_new_tokens, max_length, eos_token_id, "
                    "pad_token_id, sampler_config and SamplerConfig's fields)")


def split_generation_config(gen: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what generation_config.json may hold, blockpress's own keys).

    A top-level `entropy_bound` (blockpress's spelling, which wins when both are set) becomes the reference's
    `sampler_config`. Values the reference would refuse stay in blockpress's file, so the folder still loads in
    transformers: numbers it wants as floats are written as floats, a `sampler_config` gets the `_cls_name` the
    reference needs (one that sets no bound is left out), and a schedule with t_max <= t_min (the reference wants
    t_max > t_min) is kept out of generation_config.json."""
    reference = {k: v for k, v in gen.items() if k in REFERENCE_GENERATION_KEYS}
    own = {k: v for k, v in gen.items() if k not in REFERENCE_GENERATION_KEYS}
    if "entropy_bound" in own:
        reference["sampler_config"] = {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": own.pop("entropy_bound")}
    sampler = reference.get("sampler_config")
    if isinstance(sampler, dict) and "entropy_bound" in sampler:
        # The reference rebuilds the class `_cls_name` names, and fails on a dict without one (TypeError), which
        # blockpress reads as the one sampler there is (as written by hand, or set in lm.generation_config): named
        reference["sampler_config"] = {"_cls_name": "EntropyBoundSamplerConfig", **sampler,
                                       "entropy_bound": float(sampler["entropy_bound"])}
    elif isinstance(sampler, dict):  # sets no bound: the default one holds, which is the reference's default too
        del reference["sampler_config"]
    for key in ("t_min", "t_max", "confidence_threshold"):
        if isinstance(reference.get(key), int) and not isinstance(reference[key], bool):
            reference[key] = float(reference[key])
    t_min, t_max = reference.get("t_min"), reference.get("t_max")
    if t_min is not None and t_max is not None and not t_max > t_min:
        own["t_min"], own["t_max"] = reference.pop("t_min"), reference.pop("t_max")
    return reference, own


def check_generation_settings(raw: dict[str, Any], file: str) -> None:
    """generation_config.json's fields (a file's, or a generate call's generation_config=), checked now and
    naming `file`: a wrong type would otherwise fail at the first generate, deep in the sampler."""
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = raw.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{file}: {key}: expected a token id or a list of them, got {value!r}")
    # `blockpress generate`'s default for healing a prompt's last token (the library and the server heal only when
    # asked); blockpress train writes false for a model fine-tuned on prompts that end in whitespace
    if raw.get("token_healing") is not None and not isinstance(raw["token_healing"], bool):
        raise ValueError(f"{file}: token_healing: expected true or false, got {raw['token_healing']!r}")
    for key in ("max_new_tokens", "max_length"):  # null: unset, as in the reference
        if raw.get(key) is not None:
            check_positive_int(raw[key], f"{file}: {key}")
    try:
        SamplerConfig.from_generation_config(raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{file}: {exc}") from None


def read_generation_config(path: Path, vocab_size: int) -> dict[str, Any]:
    """generation_config.json with blockpress's own settings (BLOCKPRESS_GENERATION_FILE) over it. Folders saved
    before the split hold those in generation_config.json itself; they read the same. Warns about keys blockpress
    does not use, and drops (with a warning) EOS / pad ids at or above `vocab_size`."""
    files = [f for f in (path / "generation_config.json", path / BLOCKPRESS_GENERATION_FILE) if f.exists()]
    if not files:
        return {}
    raw: dict[str, Any] = {}
    source: dict[str, Path] = {}  # the file each key's value comes from, for the messages
    ar_file: Path | None = None  # a generation_config.json with do_sample (an autoregressive model's settings)
    for f in files:
        content = read_json_object(f)
        raw.update(content)
        source.update(dict.fromkeys(content, f))
        unused = sorted(unread_generation_keys(content))
        if unused:
            hint = ""
            if {"temperature", "do_sample"} & set(unused):
                hint = f"; {TEMPERATURE_HINT}"
            warn_user(f"{f}: {', '.join(unused)}: {UNREAD_KEYS_NOTE}{hint}")
        # A Gemma-style generation_config.json ({"do_sample": true, "top_k": 64, "top_p": 0.95}) holds an
        # autoregressive model's settings; their names are also SamplerConfig's candidate filters, which blockpress
        # reads (where its own file does not set them): said, not silent.
        if f.name == "generation_config.json" and "do_sample" in content:
            ar_file = f
    read = sorted(k for k in ("top_k", "top_p") if ar_file is not None and source.get(k) == ar_file
                  and raw.get(k) is not None)
    if read:
        warn_user(f"{ar_file}: {', '.join(read)}: read as blockpress's candidate filters (SamplerConfig's "
                  f"{' and '.join(read)}), though the file's do_sample says they were written for autoregressive "
                  "sampling; drop them from the file to draw from the whole distribution")
    file = " + ".join(str(f) for f in files)
    check_generation_settings(raw, file)
    # The reference loads ids past the vocabulary and simply never meets them (no token is one). They are dropped
    # here the same way, but said: banning EOS before min_new_tokens would index past the logits, and a pad id
    # there would make `sequences` unusable as the next prompt.
    eos = raw.get("eos_token_id")
    listed = eos if isinstance(eos, list) else [eos] if eos is not None else []
    bad = [i for i in listed if i >= vocab_size]
    if bad:
        kept = [i for i in listed if i < vocab_size]
        fallback = "" if kept else "; rows end on the model's own EOS ids (config.json's, the tokenizer's) instead"
        warn_user(f"{source['eos_token_id']}: eos_token_id: {bad} at or above the vocabulary size {vocab_size}; "
                  f"ignored, no token can be one{fallback}")
        if kept:
            raw["eos_token_id"] = kept
        else:
            del raw["eos_token_id"]
    pad = raw.get("pad_token_id")
    if pad is not None and pad >= vocab_size:
        warn_user(f"{source['pad_token_id']}: pad_token_id: {pad} at or above the vocabulary size {vocab_size}; "
                  "ignored, padding uses config.json's pad_token_id")
        del raw["pad_token_id"]
    return raw


NO_QUANTIZATION = "none"  # `quantize` for an adapter folder loaded by name: its base unquantized, as trained or not


def resolve_model(path_or_name: str | Path, quantize: str | None = None, adapter: str | Path | None = None
                  ) -> tuple[Path, Path | None, str | None]:
    """(the base's folder, the LoRA adapter folder or None, the quantization or None) that `load` reads for its
    arguments. An adapter folder given as the model (`blockpress train --lora-rank`'s <out>/adapter, or the <out>
    of a QLoRA run, which holds no checkpoint) stands for its base with the adapter over it: the base it records (train.adapter_record), quantized as the adapter was trained
    unless `quantize` says otherwise (NO_QUANTIZATION, "none": not at all). "none" over a folder stored quantized
    (lm.save of a quantized model) is refused: it holds the codes, not the unquantized weights, and a dequantized copy
    would pass for them."""
    if quantize is not None and quantize != NO_QUANTIZATION:
        check_scheme(quantize)  # before reading gigabytes
    if adapter is not None and (not isinstance(adapter, (str, Path)) or not str(adapter).strip()):
        raise ValueError(f"adapter: expected a PEFT LoRA folder, got {adapter!r}")
    path = resolve_path(path_or_name)
    from .train import ADAPTER_DIR, adapter_record, is_adapter_folder  # train imports this module

    if not (path / "config.json").is_file() and is_adapter_folder(path / ADAPTER_DIR):
        path = path / ADAPTER_DIR  # a QLoRA run's --out: its adapters are all it holds of a model
    if is_adapter_folder(path):
        if adapter is not None:
            raise ValueError(f"adapter: the model {str(path_or_name)!r} is itself an adapter folder; give its base as "
                             f"the model, or leave adapter out (the folder loads its recorded base)")
        record = adapter_record(path)
        if record["base"] is None:
            raise ValueError(f"model {str(path_or_name)!r}: an adapter folder that names no base (its base was not "
                             "loaded from a folder); give the base as the model and this folder as the adapter "
                             "(blockpress.load(BASE, adapter=...), --model BASE --adapter ...)")
        try:
            base = resolve_path(record["base"])
        except (FileNotFoundError, ValueError):
            raise FileNotFoundError(
                f"model {str(path_or_name)!r}: an adapter folder trained on {record['base']!r}, which is not here (not "
                "a checkpoint folder, a shipped model nor a cached repo id); give the base as the model and this "
                "folder as the adapter (blockpress.load(BASE, adapter=...), --model BASE --adapter ...)") from None
        path, adapter = base, path
        if quantize is None:
            quantize = record["quantize"]
    adapter = None if adapter is None else expand_user(adapter, "adapter")  # as the model's path is
    if quantize == NO_QUANTIZATION and (saved := folder_quantization(path)) is not None:
        raise ValueError(f"quantize: 'none' (unquantized) asked for, but {path} is stored quantized with {saved}: it "
                         f"holds the codes, not the unquantized weights; load it as saved (quantize={saved!r}, or none "
                         "given; --quantize " + saved + "), or give the unquantized checkpoint")
    return path, adapter, None if quantize == NO_QUANTIZATION else quantize


@outside_inference_mode
def load(path_or_name: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device | None = "cpu",
         quantize: str | None = None, adapter: str | Path | None = None,
         progress: bool | Callable[[int, int], None] = False) -> LM:
    """Load an HF-format DiffusionGemma folder (or a shipped model by name). `quantize` ("int8", "fp8" or "int4")
    quantizes each projection as it is read, so the full-precision weights are never all in memory.
    `dtype=None` (or "auto", transformers' spelling) keeps the checkpoint's dtype, except that bf16 / fp16 weights load as float32 on a CPU without
    native half-precision matmuls, where they would run many times slower (see checkpoint.native_dtype); `lm.save`
    then writes them back in the stored dtype (LM.widened_from).
    `adapter`: a PEFT LoRA folder for this base (`blockpress train --lora-rank`'s <out>/adapter, or peft's own on the
    reference model), merged in float32 into the weights in `dtype` (train.apply_adapter; needs peft; `lm.save` then
    writes the model's dtype, float32 for a widened bf16 base, as a LoRA run's merged checkpoint is); with
    `quantize`, kept unmerged in float32 over the quantized base, as `blockpress train --quantize` trained it (merged
    and then quantized, its update would mostly be rounded away). An adapter folder may also be given as the model:
    it loads the base it was trained on with it, quantized as it was trained unless `quantize` says otherwise
    ("none": unquantized; see resolve_model). `device` None is the default, the CPU (as None keeps the default
    everywhere else: lm.to(device=None) keeps the model where it is).
    `progress`: True shows a bar of the bytes read on stderr (tqdm; none where sys.stderr is None), a callable is
    called as progress(done, total) with the stored bytes of the weights read so far and in all."""
    if not (isinstance(progress, bool) or callable(progress)):
        raise ValueError(f"progress: expected True, False or a callable progress(done, total), got {progress!r}")
    given = adapter
    path, adapter, quantize = resolve_model(path_or_name, quantize, adapter)
    if given is not None and adapter is not None:  # (an adapter folder given as the model loads over its own base)
        from .train import check_adapter_pairing

        check_adapter_pairing(adapter, path, quantize)
    plan = plan_model(path, dtype=_dtype_argument(dtype), device=_device_argument(device), quantize=quantize)
    if progress is True and sys.stderr is None:  # pythonw, a service: no stream to draw on (tqdm's AttributeError)
        progress = False
    if progress is True:
        from tqdm import tqdm

        with tqdm(desc=f"loading {path.name}", unit="B", unit_scale=True, leave=False) as bar:
            def advance(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            model, passthrough = load_plan(plan, advance)
    else:
        model, passthrough = load_plan(plan, progress or None)
    if adapter is not None:
        from .train import apply_adapter

        model = apply_adapter(model, adapter)
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
        vocab = model.config.text.vocab_size
        if tokenizer.vocab_size > vocab:  # loaded as the reference loads it, said now: random_model refuses it
            warn_user(f"{path / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than config.json's vocab_size "
                      f"of {vocab}: its ids past {vocab - 1} have no embedding, and a text that encodes to one is "
                      "refused when it is generated from")
    generation = read_generation_config(path, model.config.text.vocab_size)
    if adapter is not None:
        from .train import adapter_generation

        generation.update(adapter_generation(adapter))  # what the adapter's run changed: as its merged checkpoint
    # Merged weights are not the checkpoint's: written back in the dtype the load widened from (bf16), the update
    # merged in float32 would be rounded to the base weights' step, as a LoRA run's own checkpoint is not (float32)
    widened_from = plan.widened_from if adapter is None else None
    lm = LM(model, tokenizer, generation, passthrough=passthrough, path=path, adapter=adapter,
            widened_from=widened_from, unread_said=unread_generation_keys(generation))
    # (codes made in the load, or stored, are the stored weights': only a plain load's rounding counts)
    rounded = quantize is None and not plan.quantized and plan.stored is not None and \
        not keeps_values(plan.stored, plan.dtype)
    lm.stored_values = None if rounded else plan.stored or plan.dtype
    return lm


@outside_inference_mode
def random_model(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = "cpu",
    tokenizer: Any = None,
) -> LM:
    """A randomly initialised model of any size: built on the meta device, then initialised in place.

    device="meta" stops before allocating: shapes and dtypes only, to count parameters and bytes (`info`); None
    is the CPU, as in `load`."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config: expected a blockpress.ModelConfig (e.g. ModelConfig.tiny() or "
                         f"ModelConfig.from_dict(...)), got {type(config).__name__}")
    tokenizer = check_tokenizer(tokenizer, config.text.vocab_size)  # before the weights are allocated
    checked_seed = check_seed(seed, "seed")
    if checked_seed is None:
        raise ValueError("seed: expected an integer (the weights are a function of it), got None")
    dtype = resolve_dtype(_dtype_argument(dtype)) or torch.float32  # "auto" / None: no checkpoint to follow
    device = resolve_device(_device_argument(device))
    with torch.device("meta"):
        model = DiffusionGemma(config)
    # Cast while still on the meta device, so the real allocation happens once, in the final dtype.
    model = model.to(dtype)
    if device.type == "meta":
        return LM(model, tokenizer)
    check_fits(_model_bytes(model, dtype), device,
               f"random_model: {config.describe()} in {str(dtype).replace('torch.', '')}")
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(checked_seed)
    model.init_weights(generator)
    model.reset_buffers()
    return LM(model, tokenizer)
