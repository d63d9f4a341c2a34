"""Tokenizer wrapper around a Hugging Face `tokenizers` fast tokenizer, plus chat templates.

Reads the files a Hugging Face checkpoint folder ships (tokenizer.json, tokenizer_config.json,
chat_template.jinja, special_tokens_map.json, config.json, generation_config.json) without depending
on `transformers`, and renders chat templates the way `transformers` does (sandboxed jinja2 with
trim_blocks/lstrip_blocks), so prompts built here match prompts built there.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import jinja2.defaults
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import tokenizers
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from .checks import check_flag, check_text, is_int, utf8_problem
from .files import (
    StagedFiles,
    expand_user,
    lfs_pointer_problem,
    parse_json,
    read_json_object,
    remove_stale,
    staging,
    text_of_file,
    undecodable_byte,
    utf16_note,
)
from .response import builtin_response_template, compile_template, parse_response

# Gemma order: pad=0, eos=1, bos=2; the turn markers and the infilling hole follow.
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|hole|>",
)

# The special tokens that have ids of their own here (Tokenizer.bos_id, eos_id, pad_id).
ID_TOKENS: tuple[str, ...] = ("bos_token", "eos_token", "pad_token")
# Special tokens that tokenizer configs name besides bos/eos/pad (which have ids of their own here).
NAMED_TOKENS: tuple[str, ...] = ("unk_token", "sep_token", "cls_token", "mask_token")

# What one rendering of a chat template may take. A checkpoint's template is code from whoever made the checkpoint:
# the sandbox keeps it from Python's internals, not from loops of loops (range is capped at 100,000 a call, so two
# nested ranges are 10**10 iterations), `'x' * 10**10` or `2 ** 10**10`, which would hold `chat` and every request
# to the server, or take all memory. A real template renders a conversation in milliseconds.
TEMPLATE_SECONDS = 10.0
TEMPLATE_CHARS = 50_000_000  # a prompt's text, and any one string or list a template makes (past any model's context)
# Template texts kept compiled (and their turn-end ids), least recently used first out: a tokenizer has one or a few,
# but a caller may pass a new text every call (a date or a user's name written into it), and each kept one costs
# 16 KB for good. transformers' own cache of compiled templates is bounded too.
TEMPLATES_KEPT = 32
# Token-healing masks kept (Tokenizer.texts_starting_with), least recently used first out: healing's prefixes are a
# few whitespace texts, and each mask is a byte per token (256 KB at 262,144 tokens).
PREFIXES_KEPT = 16
_NOT_KEPT: Any = object()  # a cache's answer for a text it does not hold, where None is a value it holds
_T = TypeVar("_T")

# Where transformers 5 saves named chat templates other than the default one (as NAME.jinja).
NAMED_TEMPLATES_DIR = "additional_chat_templates"

# A Gemma-style turn template. A leading system message is folded into the first user turn (Gemma has
# no system role); if no user turn follows it, it becomes a user turn of its own. "assistant" is
# rendered as Gemma's "model" role. Content may be a string, a list of parts whose text parts are joined (as
# Gemma's own templates do; other parts are refused, since this vocabulary has no image tokens), or null / absent
# (an assistant turn that only calls tools), which renders as nothing. Every jinja tag strips the whitespace around
# it, so the layout below is for reading only and the output is exactly the quoted strings, whatever the renderer's
# settings.
GEMMA_CHAT_TEMPLATE: str = """\
{{- bos_token -}}
{%- macro text_of(content) -%}
    {%- if content is not defined or content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got: ' ~ part) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Message content must be a string or a list of parts, got: ' ~ content) -}}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('Only the first message may have the system role.') -}}
        {%- endif -%}
        {%- if loop.last or messages[1]['role'] != 'user' -%}
            {{- '<start_of_turn>user\\n' ~ text_of(message['content']) ~ '<end_of_turn>\\n' -}}
        {%- else -%}
            {%- set ns.system = text_of(message['content']) ~ '\\n\\n' -%}
        {%- endif -%}
    {%- else -%}
        {%- if message['role'] == 'user' -%}
            {%- set role = 'user' -%}
        {%- elif message['role'] in ['assistant', 'model'] -%}
            {%- set role = 'model' -%}
        {%- else -%}
            {{- raise_exception('Unsupported chat role: ' ~ message['role']) -}}
        {%- endif -%}
        {{- '<start_of_turn>' ~ role ~ '\\n' ~ ns.system ~ text_of(message['content']) ~ '<end_of_turn>\\n' -}}
        {%- set ns.system = '' -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""


def _checked_text(text: Any) -> str:
    """`text` if it is a str of valid UTF-8, else a ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str to tokenize, got {type(text).__name__}")
    return check_text(text, "text")


@dataclass(frozen=True)
class TokenizerFiles:
    """A checkpoint's tokenizer_config.json and special_tokens_map.json as `Tokenizer.from_dir` read them.

    `Tokenizer.save` writes them back as they were, changing only the settings changed since loading, so that
    transformers loads the saved folder as it loaded the original (tokenizer class, padding side, model-specific token
    names, ... are read there, not here).
    """

    config: dict[str, Any]
    special_tokens_map: dict[str, Any] | None  # None: the folder had no special_tokens_map.json
    template_files: bool  # the chat templates came as .jinja files (chat_template.jinja, ...), not in the config
    settings: dict[str, Any]  # Tokenizer._settings() as loaded: what "changed since loading" is measured against


@dataclass
class Tokenizer:
    """A fast tokenizer plus the special-token ids and chat template a checkpoint declares.

    `eos_ids` holds every id that ends generation (e.g. Gemma's `<eos>` and `<end_of_turn>`);
    `eos_id` is the first of them, the one written as the tokenizer's `eos_token`.
    """

    backend: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    pad_id: int | None = None
    # One template, or several by name ({"default": ..., "tool_use": ...}) as tokenizer_config.json may list them.
    chat_template: str | dict[str, str] | None = None
    # tokenizer_config.json's flag, kept and saved for transformers 4. (blockpress puts BOS in front of plain
    # prompts whenever the tokenizer has one, as Gemma's tokenizers do.)
    add_bos_token: bool = False
    # The other special tokens a config names (unk_token, sep_token, cls_token, mask_token, and model-specific names
    # such as image_token): chat templates see them as variables, as they do in transformers, and save() keeps them.
    named_tokens: dict[str, str] = field(default_factory=dict)
    # Of bos_token, eos_token and pad_token, those whose id came from a model or generation config's number alone (no
    # tokenizer config names the token): as in transformers, a chat template does not see them (its `bos_token` is
    # undefined, where a template that starts with it would otherwise write a BOS the checkpoint's own never had).
    unnamed_tokens: frozenset[str] = frozenset()
    # tokenizer_config.json's response_template (transformers 5's format, see response.py): how a reply reads as a
    # message with content and tool calls (parse_response). The legacy `response_schema` key is left unread, as
    # transformers 5 leaves it, and saved as it was. Replies are read with `reply_template`: this, or a built-in one.
    response_template: dict[str, Any] | None = None
    # The tokenizer files this came from (from_dir), written back by save(); None for one blockpress built itself.
    files: TokenizerFiles | None = field(default=None, repr=False, compare=False)
    # template text -> (compiled template, the variables it reads); at most TEMPLATES_KEPT
    _compiled_templates: OrderedDict[str, tuple[jinja2.Template, frozenset[str]]] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )
    _token_texts: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _extendable: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    _plain_backend: tokenizers.Tokenizer | None = field(default=None, init=False, repr=False, compare=False)
    _unknown_ids: OrderedDict[int, tuple[int, ...]] = field(default_factory=OrderedDict, init=False, repr=False,
                                                            compare=False)
    _special_ids: tuple[tuple[Any, ...], frozenset[int]] | None = field(default=None, init=False, repr=False,
                                                                       compare=False)
    _turn_ends: OrderedDict[str, int | None] = field(default_factory=OrderedDict, init=False, repr=False,
                                                     compare=False)  # at most TEMPLATES_KEPT
    _longest_token: int | None = field(default=None, init=False, repr=False, compare=False)
    _prefix_masks: OrderedDict[str, bytes] = field(default_factory=OrderedDict, init=False, repr=False,
                                                   compare=False)  # at most PREFIXES_KEPT
    _developer_places: OrderedDict[str, bool] = field(default_factory=OrderedDict, init=False, repr=False,
                                                      compare=False)  # renders_developer's; at most TEMPLATES_KEPT
    _generation_prompts: OrderedDict[str, tuple[int, ...]] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )  # generation_prompt_ids'; at most TEMPLATES_KEPT

    def __getstate__(self) -> dict[str, Any]:
        """A copy's state (copy.deepcopy, pickle) without the compiled chat templates: jinja's code objects and its
        sandbox's thread-locals copy neither way (both failed once a chat had rendered); a copy compiles its own."""
        state = self.__dict__.copy()
        state["_compiled_templates"] = OrderedDict()
        return state

    # ----------------------------------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face checkpoint folder (~ expanded, as `load` expands it)."""
        folder = expand_user(path, "path")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"The checkpoint at {folder} has no tokenizer.json, so text cannot be tokenized; "
                "pass token ids instead of text, or add a tokenizer.json to the folder."
            )
        if (pointer := lfs_pointer_problem(tokenizer_file)) is not None:
            raise ValueError(pointer)
        try:
            # Decoded here, not by the Rust library: a UTF-8 byte-order mark (Notepad's "UTF-8 with BOM") is read
            # past (it says "expected value at line 1 column 1"), and bytes that are not UTF-8 are named by offset
            # (it says "stream did not contain valid UTF-8", naming none).
            data = tokenizer_file.read_bytes()
            text = text_of_file(data)  # (CRLF as LF: JSON's whitespace alike)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{tokenizer_file}: not UTF-8 ({undecodable_byte(exc)}){utf16_note(data)}"
                             "; tokenizer.json is UTF-8 JSON") from None
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the Rust library raises plain Exception ("key must be a string at line 1 column 2")
            raise ValueError(f"{tokenizer_file}: not a tokenizer the tokenizers library reads ({exc})") from None
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        # Tokens the folder declares beside tokenizer.json, which transformers adds after its own (and lm.save's
        # tokenizer.json then holds): missing, a chat template's <tool> would be encoded as <unk>
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        # (one in the vocabulary that a config declares special becomes an added token, as in transformers)
        declared = [t for t in _declared_tokens(tok_cfg, folder)
                    if backend.token_to_id(t.content) is None or (t.special and t.content not in added)]
        if declared:
            backend.add_tokens(list({t.content: t for t in declared}.values()))
        special_map = _read_json(folder / "special_tokens_map.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        # Multimodal checkpoints keep the language model's ids under text_config.
        text_cfg = model_cfg.get("text_config")
        id_sources = [gen_cfg, model_cfg, text_cfg if isinstance(text_cfg, dict) else {}]

        # transformers 5 reads special_tokens_map.json only beside a tokenizer_config.json without
        # added_tokens_decoder (the older layout), and there the map's entries override the config's; the current
        # layout (every save since writes added_tokens_decoder) names its tokens in the config alone
        legacy_map = special_map if "added_tokens_decoder" not in tok_cfg else {}

        def token_id(name: str) -> int | None:
            # Token strings win; the numeric ids in the model/generation configs are fallbacks.
            for source in (legacy_map, tok_cfg):
                content = _token_content(source.get(name))
                if content is not None and (tid := backend.token_to_id(content)) is not None:
                    return tid
            for source in id_sources:
                ids = _as_id_list(source.get(f"{name}_id"))
                if ids:
                    return ids[0]
            return None

        # EOS is a union: generation_config.json commonly lists extra stop ids (Gemma: <end_of_turn>)
        # that generation must honour even though tokenizer_config.json names only one eos_token.
        eos_ids: list[int] = []
        first_eos = token_id("eos_token")
        candidates = [first_eos] if first_eos is not None else []
        for source in id_sources:
            candidates.extend(_as_id_list(source.get("eos_token_id")))
        for tid in candidates:
            if tid not in eos_ids:
                eos_ids.append(tid)

        # Template files win over tokenizer_config.json's chat_template: chat_template.jinja is the default one,
        # additional_chat_templates/NAME.jinja the named others (how transformers 5 saves several).
        templates = {}
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = _read_template_file(folder / "chat_template.jinja")
        for file in sorted((folder / NAMED_TEMPLATES_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_template_file(file)
        if list(templates) == ["default"]:
            chat_template: str | dict[str, str] | None = templates["default"]
        elif templates:
            chat_template = templates
        else:
            chat_template = _read_chat_template(tok_cfg.get("chat_template"), folder / "tokenizer_config.json")

        # Every other NAME_token key names a special token, as transformers 5 reads them: the standard ones and
        # model-specific ones (image_token, ...), at the top level or in an extra_special_tokens dict (a list there is
        # unnamed: not template variables). For the standard ones (NAMED_TOKENS) the older layout's
        # special_tokens_map.json wins, as for the ids above; a model-specific one the config names wins over the
        # map's (transformers takes the map's as a fallback only); the dict wins over the top level, as there.
        named_tokens: dict[str, str] = {}
        extra = tok_cfg.get("extra_special_tokens")
        legacy_extra = legacy_map.get("extra_special_tokens")
        legacy = (legacy_map, legacy_extra if isinstance(legacy_extra, dict) else {})
        config = (extra if isinstance(extra, dict) else {}, tok_cfg)
        for standard, sources in ((True, (*legacy, *config)), (False, (*config, *legacy))):
            for source in sources:
                for name, value in source.items():
                    content = _token_content(value)  # (not add_bos_token's bool)
                    if (name in NAMED_TOKENS) == standard and name.endswith("_token") and name not in ID_TOKENS \
                            and content is not None:
                        named_tokens.setdefault(name, content)

        tokenizer = cls(
            backend=backend,
            bos_id=token_id("bos_token"),
            eos_ids=eos_ids,
            pad_id=token_id("pad_token"),
            chat_template=chat_template,
            add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
            named_tokens=named_tokens,
            unnamed_tokens=frozenset(name for name in ID_TOKENS
                                     if all(_token_content(source.get(name)) is None for source in (legacy_map, tok_cfg))),
            response_template=tok_cfg.get("response_template"),
        )
        if (folder / "tokenizer_config.json").is_file():  # without one, save() writes a config of its own
            tokenizer.files = TokenizerFiles(
                config=tok_cfg,
                special_tokens_map=special_map if (folder / "special_tokens_map.json").is_file() else None,
                template_files=bool(templates),
                settings=tokenizer._settings(),
            )
        return tokenizer

    def save(self, path: str | Path, *, files: StagedFiles | None = None) -> None:
        """Write tokenizer.json and the tokenizer's config files so `from_dir` and `transformers` can load them.

        A tokenizer loaded with `from_dir` gets the files it came with back, changed only where its settings (special
        tokens, add_bos_token, chat template, response template) were changed since; one blockpress built gets a config
        of its own.
        When there is more than one EOS id, generation_config.json gets `eos_token_id` as a list (other
        fields of an existing generation_config.json are kept), because tokenizer_config.json can only
        name one eos_token.
        The files are written under temporary names and moved into place together (files.StagedFiles); `files`:
        stage them there instead, for its owner to commit with the rest of a larger save (a model's).
        """
        folder = Path(path)
        config, special_map, template_files = self._files_to_save()
        with staging(files) as staged:
            staged.make_folder(folder)  # (one this save made is removed again if it fails)
            # whole or not at all: a save killed mid-write would leave a truncated tokenizer.json, which no longer loads
            # written by Python, as the rest: the tokenizers library's own save refuses a path that is not UTF-8
            # (a folder named in bytes, which Python holds as surrogates), which would fail a whole save or training run
            staged.write(folder / "tokenizer.json",
                         lambda file: file.write_bytes(self.backend.to_str(pretty=True).encode("utf-8")))
            named_dir = folder / NAMED_TEMPLATES_DIR
            if named_dir.is_dir():  # templates a save killed part-way staged under other names
                staged.remove_leftovers(named_dir, "*.jinja")
            if folder.is_dir():  # the folder of them a save killed in its commit moved aside (removing it)
                remove_stale(folder, f".{NAMED_TEMPLATES_DIR}", ".bak")
            written = set()
            if template_files and self.chat_template is not None:  # the form the templates came in: files
                templates = self.chat_template if isinstance(self.chat_template, dict) else {"default": self.chat_template}
                for name, text in templates.items():
                    file = folder / "chat_template.jinja" if name == "default" else named_dir / f"{name}.jinja"
                    staged.make_folder(file.parent)
                    staged.write_text(file, text)
                    written.add(file)
            # Template files left from an earlier save would win over the templates written here on loading: removed
            # at the commit (not at once: a save killed then would leave the model without its template).
            for file in [folder / "chat_template.jinja", *named_dir.glob("*.jinja")]:
                if file not in written:
                    staged.remove(file)
            if named_dir.is_dir():
                staged.remove(named_dir)  # when left empty
            staged.write_text(folder / "tokenizer_config.json", _json_text(config))
            if special_map is not None:
                staged.write_text(folder / "special_tokens_map.json", _json_text(special_map))
            else:  # one left from an earlier save would override the tokens named in the config
                staged.remove(folder / "special_tokens_map.json")
            gen_path = folder / "generation_config.json"
            source = staged.read_path(gen_path)
            gen_cfg = _read_json(source)  # a model's, when saved with one (LM.save): its own EOS set stays
            loaded_eos = None if self.files is None else self.files.settings.get("eos_ids")
            if source == gen_path and loaded_eos is not None and list(self.eos_ids) != loaded_eos:
                # the folder's own file, and eos_ids changed since loading: else the file's list comes back on loading
                write = _as_id_list(gen_cfg.get("eos_token_id")) != list(self.eos_ids)
            else:
                write = len(self.eos_ids) > 1 and "eos_token_id" not in gen_cfg
            if write:
                gen_cfg["eos_token_id"] = list(self.eos_ids)
                staged.write_text(gen_path, _json_text(gen_cfg))

    def _settings(self) -> dict[str, Any]:
        """What save() writes that may change after loading: the special tokens (by config key), add_bos_token,
        the chat template(s) and the response template."""
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return {"tokens": {**tokens, **self.named_tokens}, "add_bos_token": self.add_bos_token,
                "eos_ids": list(self.eos_ids),
                "chat_template": copy.deepcopy(self.chat_template),
                "response_template": copy.deepcopy(self.response_template)}

    def _files_to_save(self) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """(tokenizer_config.json, special_tokens_map.json or None for none, whether the templates go in files)."""
        now = self._settings()
        if self.files is None:
            return self._own_config(now["tokens"]), None, False
        config = copy.deepcopy(self.files.config)
        special_map = copy.deepcopy(self.files.special_tokens_map)
        loaded = self.files.settings
        extra = config.get("extra_special_tokens")
        for name in [*now["tokens"], *(name for name in loaded["tokens"] if name not in now["tokens"])]:
            content = now["tokens"].get(name)
            if content == loaded["tokens"].get(name):
                continue  # as loaded: kept in whatever form and place the files have it
            # Where the config has it; a new model-specific name goes where this config keeps such names (a dict of
            # them, or the top level, which transformers 5 reads too).
            home: dict[str, Any] = config
            if isinstance(extra, dict) and name not in config and name not in ID_TOKENS + NAMED_TOKENS:
                home = extra
            in_map = special_map is not None and name in special_map
            for where in (config, extra if isinstance(extra, dict) else {}, special_map or {}):
                where.pop(name, None)
            if content is not None:
                home[name] = content
                if special_map is not None and in_map:  # it wins over the config in transformers; keep the two
                    special_map[name] = content  # saying the same
        if now["add_bos_token"] != loaded["add_bos_token"]:
            config["add_bos_token"] = now["add_bos_token"]
        if now["chat_template"] != loaded["chat_template"]:
            config.pop("chat_template", None)
            if not self.files.template_files and self.chat_template is not None:
                config["chat_template"] = _config_template(self.chat_template)
        if now["response_template"] != loaded["response_template"]:
            config.pop("response_template", None)
            if self.response_template is not None:
                config["response_template"] = self.response_template
        return config, special_map, self.files.template_files

    def _own_config(self, tokens: dict[str, str | None]) -> dict[str, Any]:
        """The tokenizer_config.json of a tokenizer blockpress built (trained, or assembled in code)."""
        # Works for transformers 4 and 5 (where it aliases TokenizersBackend).
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        model_specific = {}
        for name, content in tokens.items():
            if name in ID_TOKENS or name in NAMED_TOKENS:
                config[name] = content
            else:
                model_specific[name] = content
        config.update({
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            # Batched prompts are padded on the left, as blockpress pads them: generation continues after the last
            # token of every row.
            "padding_side": "left",
            # decode gives back the text exactly, as blockpress's does (not with spaces before punctuation removed).
            "clean_up_tokenization_spaces": False,
        })
        if model_specific:  # where transformers reads model-specific named tokens from
            config["extra_special_tokens"] = model_specific
        if self.chat_template is not None:
            config["chat_template"] = _config_template(self.chat_template)
        if self.response_template is not None:
            config["response_template"] = self.response_template
        return config

    # -------------------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids decode drops: tokenizer.json's special added tokens, the EOS ids, BOS and pad. Worked out again
        only when one of those changes: reading the added tokens builds an object for each (9 ms a decode with a
        checkpoint's 6,000, where decode itself takes 0.03 ms), and decode runs per draft token of every step."""
        key = (id(self.backend), self.backend.get_vocab_size(with_added_tokens=True), tuple(self.eos_ids),
               self.bos_id, self.pad_id)
        if self._special_ids is None or self._special_ids[0] != key:
            ids = {tid for tid, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
            ids.update(self.eos_ids)
            ids.update(tid for tid in (self.bos_id, self.pad_id) if tid is not None)
            self._special_ids = (key, frozenset(ids))
        return self._special_ids[1]

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_id)

    @property
    def reply_template(self) -> dict[str, Any] | None:
        """The response template replies are read with: the checkpoint's `response_template`, else a built-in one
        for the reply format its special tokens tell (Gemma 4's, where <|turn>, <turn|>, <|channel>, <channel|>,
        <|tool_call> and <tool_call|> are each a special token: response.builtin_response_template), else None
        (replies are text). The built-in one is not the checkpoint's: save() leaves it out of tokenizer_config.json,
        which keeps the response_template the folder had (none)."""
        if self.response_template is not None:
            return self.response_template
        special = self.special_ids
        return builtin_response_template(lambda text: self.backend.token_to_id(text) in special)

    def token_to_id(self, token: str) -> int | None:
        """The id of the token whose text is `token`; None where no token is it."""
        check_text(token, "token")  # (a lone surrogate, which no token holds, is named; tokenizers fails on it)
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The text of token `token_id`; None where it has none (past the vocabulary). tokenizers took True as 1 and
        failed on -1 or an id past 32 bits with an OverflowError."""
        token_id = token_id if type(token_id) is int else _one_id(token_id)
        if token_id < 0:
            raise ValueError(f"token_id: {token_id} is negative (expected a token id, 0 <= id < vocab_size "
                             f"{self.vocab_size})")
        return self.backend.id_to_token(token_id) if token_id <= 0xFFFFFFFF else None  # (the backend's ids are u32)

    # ------------------------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids for `text`; BOS is prepended only when asked, never by the post-processor."""
        check_flag("add_bos", add_bos)
        ids = _encoded(self.backend, _checked_text(text))
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token.")
            ids = [self.bos_id, *ids]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids for `text` read as plain text: a special token's text (`<|hole|>`, `<eos>`) becomes ordinary
        tokens, not its special id (an escaped hole marker in a template must not become the noise token)."""
        _checked_text(text)
        if self._plain_backend is None:
            # A copy with the flag set once: toggling it on the shared backend would race a server's other threads.
            plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return _encoded(self._plain_backend, text)

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt's ids: BOS first when the tokenizer has one, but not twice (a rendered chat template,
        or text that starts with the BOS token, brings its own)."""
        ids = self.encode(text)
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`: python ints, numpy integers, or an integer tensor / array. An id that is not an integer,
        is negative, or has no token here (past the vocabulary: see `unknown_ids`) is a ValueError (the backend
        would coerce it without a word, overflow, or drop it)."""
        check_flag("skip_special_tokens", skip_special_tokens)
        id_list = self._id_list(ids)
        if skip_special_tokens:
            # Also drop ids that a config marks special but tokenizer.json does not (e.g. extra EOS ids).
            special = self.special_ids
            id_list = [i for i in id_list if i not in special]
        return self.backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def _id_list(self, ids: Iterable[int]) -> list[int]:
        # A tensor or numpy array becomes plain python numbers in one call (floats stay floats, bools stay bools).
        if getattr(ids, "is_meta", False):  # (torch fails on it: "Cannot copy out of meta tensor")
            raise ValueError("ids: a tensor on the meta device holds no values (shapes only); give it on the CPU")
        if hasattr(ids, "tolist") and hasattr(ids, "dtype"):
            values = ids.tolist()
        elif is_int(ids):  # one Python int: a single number below, as a numpy one is (list() said "'int' object is
            values = ids  # not iterable", naming no argument)
        else:
            try:
                values = list(ids)
            except TypeError:  # None, a float: Python's "object is not iterable" named no argument
                raise ValueError(f"ids: expected a sequence of token ids, got {type(ids).__name__} {ids!r:.40}") from None
        if not isinstance(values, list):  # a 0-d tensor or array: one number, where a sequence of them is asked
            raise ValueError(f"ids: expected a sequence of token ids, got a single {type(ids).__name__} {values!r:.40} "
                             "(pass [id], or a 1-D tensor)")
        if not all(type(v) is int for v in values):  # the usual case is only this one pass
            values = [_one_id(v, position) for position, v in enumerate(values)]
        if values and (low := min(values)) < 0:
            raise ValueError(f"ids: token id {low} at position {values.index(low)} is negative (expected a token id, "
                             f"0 <= id < vocab_size {self.vocab_size})")
        if values and max(values) >= self.vocab_size:  # the usual case is only this one test
            # each id past the vocabulary asked of itself: unknown_ids(max + 1) would list every id up to the largest
            # (decode([2**40]) would run for minutes, gigabytes growing) and keep the list
            special = self.special_ids
            for position, value in enumerate(values):
                if value >= self.vocab_size and value not in special and self.id_to_token(value) is None:
                    raise ValueError(f"ids: token id {value} at position {position} has no token in this tokenizer "
                                     f"(its vocabulary has {self.vocab_size}; a model's embedding may be padded past "
                                     "it, and generation never chooses those ids)")
        return values

    def unknown_ids(self, limit: int) -> tuple[int, ...]:
        """The ids below `limit` (a model's vocabulary size) that this tokenizer has no token for, so no text: a
        checkpoint's embedding is often padded past its tokenizer's vocabulary. Generation never chooses them
        (LM masks their logits) and decode refuses them. Ids the configs name special (an extra EOS id) are not
        among them: they end or pad a text, and decode drops them. Worked out once per limit, and kept as a tuple:
        a caller who edited a list in place changed which ids every later generation bans. The last few limits' are
        kept (a model asks for its one vocabulary size; a caller's every distinct limit was kept forever)."""
        if not is_int(limit) or limit < 0:
            raise ValueError(f"limit: expected a vocabulary size (an integer >= 0), got {limit!r}")
        found = self._unknown_ids.get(limit)
        if found is None:
            special = self.special_ids
            found = tuple(i for i in range(self.vocab_size, limit)
                          if i not in special and self.backend.id_to_token(i) is None)
        return _keep(self._unknown_ids, limit, found)

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        check_flag("skip_special_tokens", skip_special_tokens)  # before the first row: an empty batch too
        # (5, None, a 0-d tensor or array: a bare TypeError, "iteration over a 0-d tensor")
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable) or getattr(batch, "ndim", 1) == 0:
            raise ValueError(f"batch: expected a list of rows of token ids, got {type(batch).__name__} {batch!r:.40}")
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def longest_token(self) -> int:
        """The most characters one token of the vocabulary holds, added tokens included, computed once (a byte-level
        vocabulary's entries have a character per byte, at least one per character of text): a text longer than a
        context times this cannot fit it, which is known without tokenizing it."""
        if self._longest_token is None:
            self._longest_token = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._longest_token

    def token_texts(self) -> tuple[str, ...]:
        """Every id's text on its own (special tokens as ""), computed once: what token healing matches on. A tuple:
        a caller who tidied a list in place (`texts[:] = ...`) changed every later generation's healing."""
        if self._token_texts is None:
            special = self.special_ids
            texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            self._token_texts = tuple("" if i in special else t for i, t in enumerate(texts))
        return self._token_texts

    def texts_starting_with(self, prefix: str) -> bytes:
        """One byte per id of token_texts(), 1 where its text starts with `prefix`: what token healing lets a healed
        row's first new token be. Kept for the PREFIXES_KEPT prefixes used last: each is a scan of every token's text
        in Python (36 ms at 262,144 tokens), which every healed row of every request paid. Bytes, as token_texts is a
        tuple: no caller can edit what later generations read."""
        found = self._prefix_masks.get(prefix)
        if found is None:
            found = bytes(text.startswith(prefix) for text in self.token_texts())
        return _keep(self._prefix_masks, prefix, found, PREFIXES_KEPT)

    def special_texts(self) -> dict[str, frozenset[int]]:
        """Each special token's text (as decode writes it with skip_special_tokens=False) -> the ids that have it:
        what decode leaves out of a text by default (a stop string's search, say, never sees them). Ids past the
        vocabulary (an extra EOS id a config names) have no text. Worked out on each call (eos_ids may change)."""
        ids = sorted(i for i in self.special_ids if self.backend.id_to_token(i) is not None)
        texts: dict[str, set[int]] = {}
        for i, text in zip(ids, self.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)):
            if text:
                texts.setdefault(text, set()).add(i)
        return {text: frozenset(found) for text, found in texts.items()}

    def extendable_texts(self) -> frozenset[str]:
        """Token texts that a longer token's text starts with (could have merged further), computed once.

        In sorted order every string that starts with `s` follows `s` directly, so comparing each distinct
        text with the next one finds them all in one pass."""
        if self._extendable is None:
            distinct = sorted(set(self.token_texts()) - {""})
            self._extendable = frozenset(a for a, b in zip(distinct, distinct[1:]) if b.startswith(a))
        return self._extendable

    # -------------------------------------------------------------------------------- chat templates

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool | None = None,
        tokenize: bool = False,
        continue_final_message: bool | str = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_vars: Any,
    ) -> str | list[int]:
        """Render `messages` with the chat template; with tokenize=True return the prompt's ids.

        add_generation_prompt (default: True, or False with continue_final_message) ends the prompt with the header of
        a new assistant turn. continue_final_message=True instead ends the prompt right after the last message's
        content, so the model carries on writing it (prefilling); a string names another field of the last message
        to continue, e.g. "reasoning_content". chat_template picks one of the tokenizer's named templates, or is a
        template's own text; by default "tool_use" is used when there is one and `tools` are given, else "default".
        `tools` are JSON schemas and `documents` dicts, as transformers' templates expect. Other keyword arguments
        become template variables (transformers' return_tensors, padding, truncation, ... are refused by name). The
        template itself is responsible for BOS, so tokenize=True adds no other. Unlike transformers' defaults,
        tokenize is False and add_generation_prompt True: the prompt a caller renders is most often one to reply to.
        """
        check_flag("add_generation_prompt", add_generation_prompt, none=True)
        check_flag("tokenize", tokenize)
        options = sorted(TRANSFORMERS_RENDER_OPTIONS & template_vars.keys())
        if options:  # transformers' keywords for what it returns: here they would become template variables,
            # unread, and a prompt asked to be truncated would come back whole
            raise ValueError(f"{options[0]}: a transformers option that apply_chat_template does not take; it returns "
                             "the text, or with tokenize=True a list of ids (torch.tensor([ids]) for a batch of "
                             "one; cut or pad the list yourself)")
        reserved = sorted(RESERVED_TEMPLATE_NAMES & template_vars.keys())
        if reserved:  # as the server refuses them in chat_template_kwargs: {"namespace": 1} would fail inside the
            # template, blamed on chat_template ("'int' object is not callable"), and {"range": 3} pass unsaid
            raise ValueError(f"{reserved[0]}: not a template variable a caller may set: the chat rendering sets it "
                             f"itself (reserved: {', '.join(sorted(RESERVED_TEMPLATE_NAMES))})")
        if not isinstance(continue_final_message, (bool, str)):
            raise ValueError(f"continue_final_message: expected a bool or a message field's name, got "
                             f"{type(continue_final_message).__name__}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True; the one "
                             "continues the last message, the other starts a new assistant turn after it")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        source = self._pick_template(chat_template, tools)
        _validate_messages(messages)
        _validate_tools_and_documents(tools, documents)
        chat = [_template_message(message) for message in messages]
        # What transformers passes templates: tools and documents are None unless given (a template testing
        # `tools is not none` must not see them defined), the special tokens the tokenizer names (and only those),
        # and the caller's variables win over the tokenizer's.
        variables: dict[str, Any] = {name: token for name, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                                     ("pad_token", self.pad_token))
                                     if token is not None and name not in self.unnamed_tokens}
        variables.update(self.named_tokens)
        variables.update(tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                         raise_exception=_raise_template_error, strftime_now=_strftime_now)
        variables.update(template_vars)
        final_text = None
        if continue_final_message:
            field_name = "content" if continue_final_message is True else continue_final_message
            final_text = _mark_continuation(chat[-1], field_name, source)
        template = self._template(source)[0]  # a syntax error is its own ValueError, not a failed rendering
        try:
            rendered = _render(template, {"messages": chat, **variables})
        except (TemplateRaised, TemplateTooCostly):  # its raise_exception (about the conversation); limits named
            raise
        except Exception as exc:  # the checkpoint's template is broken, or breaks on these messages
            raise ValueError(f"chat_template: rendering failed: {type(exc).__name__}: {exc}") from None
        if chat and not rendered.strip():  # (an empty chat_template.jinja): an empty prompt, refused downstream
            # as "prompt: expected str, ... got list (empty)", which names neither the template nor the fix
            raise ValueError(f"chat_template: rendered no text for {len(chat)} message(s); the template is empty or "
                             "writes nothing for them (check the checkpoint's chat_template.jinja, or "
                             "tokenizer_config.json's chat_template)")
        if final_text is not None:
            rendered = _cut_at_continuation(rendered, final_text)
        if tokenize:
            return self.encode(rendered, add_bos=False)
        return rendered

    def turn_end_id(self) -> int | None:
        """The special token the chat template writes right after an assistant message's text (Gemma's
        `<end_of_turn>`, Gemma 4's `<turn|>`), or None where it writes none there: what a chat reply trained on ends
        with, so a fine-tuned model ends its turns as the template renders them. Read off the default template once
        (a conversation of one user message and a reply); a template that cannot render that raises its error."""
        source = self._pick_template(None, None)
        if (known := self._turn_ends.get(source, _NOT_KEPT)) is not _NOT_KEPT:  # (None: the template writes none)
            return _keep(self._turn_ends, source, known)
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": TURN_END_MARK}]
        rendered = str(self.apply_chat_template(chat, add_generation_prompt=False, chat_template=source))
        after = rendered.rpartition(TURN_END_MARK)[2] if TURN_END_MARK in rendered else ""
        first = self.encode(after)[:1]
        return _keep(self._turn_ends, source, first[0] if first and first[0] in self.special_ids else None)

    def generation_prompt_ids(self, chat_template: str | None = None, tools: Any = None) -> list[int]:
        """The ids add_generation_prompt=True ends a rendering with (the header of the assistant's turn: Gemma's
        `<start_of_turn>model\n`), for the template apply_chat_template(chat_template=..., tools=...) renders with;
        [] where it adds none. Read off a conversation of one user message rendered both ways, in context (the
        header's text alone could tokenize otherwise), once per template text: what the rendering with it holds past
        the two renderings' common start. A template whose flag changes the conversation before its end (a line
        written first) gives more than the header, which no chat ends with (so chat_ids' check is off); one that
        cannot render that conversation gives []."""
        source = self._pick_template(chat_template, tools)
        known = self._generation_prompts.get(source)
        if known is None:
            chat = [{"role": "user", "content": "Hi"}]
            try:  # (as tokenize=True encodes a rendering)
                without, with_header = (self.encode(str(self.apply_chat_template(
                    chat, add_generation_prompt=flag, chat_template=source)), add_bos=False) for flag in (False, True))
            except Exception:  # noqa: BLE001 - any refusal of the template's (raise_exception, a missing field)
                with_header = without = []
            # what follows the renderings' common start: a template that ends a chat without the prompt otherwise
            # (an <eos> in its else branch) has one all the same
            pairs = zip(without, with_header)
            common = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(without), len(with_header)))
            known = tuple(with_header[common:])
        header: tuple[int, ...] = _keep(self._generation_prompts, source, known)
        return list(header)

    def parse_response(self, text: str, prefix: str = "", tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The message a model's reply holds, read with the tokenizer's response template, as transformers'
        `parse_response` reads it: {"role": "assistant", "content": ..., "tool_calls": [{"type": "function",
        "function": {"name": ..., "arguments": {...}}}], ...} (which keys, the template says).

        `text` is the reply with its special tokens (decode(ids, skip_special_tokens=False)): a checkpoint's
        tool-call markers often are special tokens. `prefix`: the prompt, whose last assistant turn the template may
        have begun (an opened <think>, say). `tools`: the request's tools, whose parameter types text-valued
        arguments get ("7" is 7 for an integer parameter)."""
        template = self.reply_template
        if template is None:
            raise ValueError("response_template: this tokenizer has none (tokenizer_config.json has no "
                             "response_template, and its special tokens are no reply format blockpress knows: "
                             "Gemma 4's), so replies cannot be parsed into messages; set Tokenizer.response_template")
        return parse_response(compile_template(template), text, prefix, tools)

    def _pick_template(self, chat_template: str | None, tools: Any) -> str:
        """The template text to render: transformers' choice among named templates."""
        templates = self.chat_template
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise ValueError(f"chat_template: expected a template name or a template's text, got "
                                 f"{type(chat_template).__name__}")
            if isinstance(templates, dict) and chat_template in templates:
                return templates[chat_template]
            if "{{" not in chat_template and "{%" not in chat_template:  # a mistyped name, not a template
                names = sorted(templates) if isinstance(templates, dict) else []
                raise ValueError(f"chat_template: {chat_template!r} is neither one of this tokenizer's template "
                                 f"names {names} nor a jinja template")
            return chat_template
        if templates is None:
            raise ValueError(
                "This tokenizer has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); set Tokenizer.chat_template, e.g. to GEMMA_CHAT_TEMPLATE."
            )
        if isinstance(templates, str):
            return templates
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"chat_template: this tokenizer's templates are named {sorted(templates)}, none of them "
                         "'default'; pass chat_template=<one of those names>")

    def renders_developer(self, chat_template: str | None = None, tools: Any = None) -> bool:
        """Whether the template apply_chat_template(chat_template=..., tools=...) renders with has a place of its own
        for role "developer" (DeepSeek V4's and GigaChat 3's: the user turn): a developer message's text is in its
        rendering, and it raises nothing. chat_message renders the role as "system" where it has none: most have
        none (Gemma's raises on any role but its own), and some that name the word only in prose or a variable drop
        such a message without a word (DeepSeek V3.2's, Command R7B's) or raise (Apertus's). Found by rendering once
        per template text (kept for the TEMPLATES_KEPT used last)."""
        source = self._pick_template(chat_template, tools)
        if "developer" not in source:  # (no rendering for the templates that never name it)
            return False
        if (known := self._developer_places.get(source)) is not None:
            return _keep(self._developer_places, source, known)
        mark = "blockpress: is this text rendered?"
        try:
            text = self.apply_chat_template([{"role": "developer", "content": mark}, {"role": "user", "content": "?"}],
                                            chat_template=source, add_generation_prompt=True)
            known = mark in str(text)
        except Exception:  # noqa: BLE001 - any refusal of the template's (raise_exception, a missing field): no place
            known = False
        return _keep(self._developer_places, source, known)

    def chat_template_variables(self, chat_template: str | None = None, tools: Any = None) -> frozenset[str]:
        """The variables that the template apply_chat_template(chat_template=..., tools=...) renders reads (messages,
        tools, add_generation_prompt, ...): whether it would use `tools` at all, before sending them."""
        return self._template(self._pick_template(chat_template, tools))[1]

    def _template(self, source: str) -> tuple[jinja2.Template, frozenset[str]]:
        """(the compiled template, the variables it reads) of a template text: compiled once, while it is among the
        TEMPLATES_KEPT texts used last."""
        if (kept := self._compiled_templates.get(source)) is not None:
            return _keep(self._compiled_templates, source, kept)
        env = _TemplateSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
        )
        try:  # parsed once: the variables it reads come from the same tree
            tree = env.parse(source)
            variables = frozenset(jinja2.meta.find_undeclared_variables(tree))
            compiled = env.from_string(tree)
        except jinja2.TemplateSyntaxError as exc:
            # exc.message alone: str(exc) adds a 'File "<introspection>"' line for an unknown filter
            raise ValueError(f"chat_template: not a valid template: {exc.message} (line {exc.lineno})") from None
        except (SyntaxError, RecursionError) as exc:  # Python's limits on the code jinja writes (20 nested loops)
            raise ValueError(f"chat_template: not a valid template: nested too deeply for Python "
                             f"({type(exc).__name__}: {exc.msg if isinstance(exc, SyntaxError) else exc})") from None
        return _keep(self._compiled_templates, source, (compiled, variables))

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


# What TextStream decodes again before a text's new tokens, at least (HF's DecodeStream and vLLM's detokenizer take 5):
# enough that the window's text starts the way the whole text's part of it does.
STREAM_OVERLAP = 6


class TextStream:
    """The text of a growing sequence of token ids, exactly as `tokenizer.decode(ids, skip_special_tokens)` gives it,
    decoding the ids added since the last call rather than them all: a reply's text so far is asked for once a
    canvas, and decoding it whole each time cost its length squared (an 8,000-token reply in commits of 8 took 1.1 s
    of decode for one reader). Checking that the ids continue the last ones and joining the text still read the
    whole row, at memory speed (one row of 128k tokens in commits of 32: 10.8 s in all, a helper's measurement).

    It keeps the text of a settled prefix (one whose text does not end in U+FFFD: no character's bytes are still
    arriving) and decodes only a window: a few settled tokens before the new ones, then those tokens again with the new
    ones; what the window's text adds past its settled part is what the new ids add. That holds where a decoder's
    effects are local (byte-level BPE joins bytes, SentencePiece's ▁ is a space). Where the window's settled part
    reads as nothing or ends in U+FFFD (a decoder that strips the text's leading space strips the window's; a window
    that starts inside a character), the window widens; where the window's text does not extend its settled part's
    (a byte-fallback token that makes the bytes before it invalid turns each into U+FFFD), the whole ids are decoded,
    as before.

    `text(ids)` takes any ids: those that do not start with the settled ones (a shorter row) start the stream again.
    A decode error (an id past the vocabulary) is the whole decode's, naming the id's position in `ids`."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        check_flag("skip_special_tokens", skip_special_tokens)
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []  # the ids of the last call
        self.last = ""  # their text
        self.settled = 0  # the first `settled` of them have the text `settled_text`, which does not end in U+FFFD
        self.settled_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def text(self, ids: Sequence[int]) -> str:
        """The text of `ids` (a list of ints, as `decode` reads them)."""
        ids = list(ids)
        if ids == self.ids:
            return self.last
        s = self.settled
        if len(ids) < s or ids[:s] != self.ids[:s]:  # not the settled ids' continuation: start again
            s = self.settled = 0
            self.settled_text = ""
        text = None
        width = STREAM_OVERLAP
        while s - width > 0:  # else the window is all the ids: decoded whole, below
            try:
                head = self._decode(ids[s - width : s])
                if head and not head.endswith("\ufffd"):  # the window's start reads as in the whole text
                    tail = self._decode(ids[s - width :])
                    if tail.startswith(head):
                        text = self.settled_text + tail[len(head) :]
                    break  # (else a later id changed the settled ids' text: decoded whole)
            except ValueError:  # a bad id: the whole decode's error, at its position in `ids`
                break
            width *= 2
        if text is None:
            text = self._decode(ids)
        if not text.endswith("\ufffd"):
            self.settled, self.settled_text = len(ids), text
        self.ids, self.last = ids, text
        return text


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (any text round-trips exactly) with Gemma-style special tokens.
    `progress`: the tokenizers library's own bars on stderr (a vocabulary of 16k from 160 MB takes minutes).

    Special tokens get ids 0.. in the given order (by default pad=0, eos=1, bos=2). EOS ids are
    `<eos>` then `<end_of_turn>` when present, so chat generations stop at the end of the model turn.
    """
    backend = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would not survive decode, breaking exact round trips.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        # The full byte alphabet guarantees every input is encodable, whatever the training text.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    backend.train_from_iterator(texts, trainer=trainer)

    def special(token: str) -> int | None:
        return backend.token_to_id(token) if token in special_tokens else None

    eos_ids = [tid for tid in (special("<eos>"), special("<end_of_turn>")) if tid is not None]
    bos = special("<bos>")
    if bos is not None:  # transformers then adds BOS to a plain prompt as blockpress does (blockpress encodes
        # with add_special_tokens=False and adds it itself, so this changes nothing here)
        backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                               special_tokens=[("<bos>", bos)])
    return Tokenizer(
        backend=backend,
        bos_id=special("<bos>"),
        eos_ids=eos_ids,
        pad_id=special("<pad>"),
        chat_template=GEMMA_CHAT_TEMPLATE,
        add_bos_token=True,
    )


# ------------------------------------------------------------------------------------------ helpers


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the optional file is absent."""
    return read_json_object(path) if path.is_file() else {}


def _read_template_file(path: Path) -> str:
    """A chat template file's text, or a ValueError naming the file when it is not UTF-8 (the codec's own error named
    neither the file nor that it was the chat template, and ended every command, plain prompts too, at loading).
    A byte-order mark (Notepad's "UTF-8 with BOM") is no part of the template: kept, it was rendered as U+FEFF before
    the BOS of every prompt. CRLF line endings are the LF ones, as transformers reads the file (as text)."""
    try:
        return text_of_file(path.read_bytes())
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: a chat template is UTF-8 text, and this is not ({undecodable_byte(exc)}); save it "
                         "as UTF-8") from None


def _json_text(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"



def _declared_tokens(tok_cfg: dict[str, Any], folder: Path) -> list[tokenizers.AddedToken]:
    """The added tokens a folder declares outside tokenizer.json, in the order transformers 5 adds them:
    tokenizer_config.json's added_tokens_decoder by id (or, in the older layout without one, added_tokens.json's, a
    token special where a config names it), then extra_special_tokens (a list, or named ones) and transformers 4's
    additional_special_tokens (special)."""
    def added(entry: Any) -> tokenizers.AddedToken | None:
        content = _token_content(entry)
        if content is None:
            return None
        flags = {k: bool(entry[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                 if isinstance(entry, dict) and k in entry}
        return tokenizers.AddedToken(content, **flags)

    tokens: list[tokenizers.AddedToken | None] = []
    decoder = tok_cfg.get("added_tokens_decoder")
    extra = tok_cfg.get("extra_special_tokens")
    if isinstance(decoder, dict):
        # ids as ASCII digits ("²" is a digit to isdigit, and 5,000 digits past int()'s limit: both a bare ValueError)
        by_id = {int(k): v for k, v in decoder.items() if str(k).isascii() and str(k).isdigit() and len(str(k)) < 20}
        tokens += [added(entry) for _, entry in sorted(by_id.items())]  # ("500" and "0500": one id, the last, as
        # transformers reads them; sorting the pairs compared their entries)
    elif isinstance(legacy := _read_json(folder / "added_tokens.json"), dict) and legacy:
        named = {c for k, v in tok_cfg.items() if k.endswith("_token") and (c := _token_content(v)) is not None}
        named |= {c for v in (extra if isinstance(extra, list) else []) if (c := _token_content(v)) is not None}
        tokens += [tokenizers.AddedToken(content, normalized=content not in named, special=content in named)
                   for content, _ in sorted(legacy.items(), key=lambda item: item[1] if is_int(item[1]) else math.inf)]
    # extra_special_tokens: a list, or named ones ({"image_token": "<image>"}); transformers 4's name for the list
    for listed in (list(extra.values()) if isinstance(extra, dict) else extra, tok_cfg.get("additional_special_tokens")):
        if isinstance(listed, list):
            tokens += [added(entry if isinstance(entry, dict) else {"content": entry, "special": True})
                       for entry in listed]
    return [t for t in tokens if t is not None]


def _token_content(value: Any) -> str | None:
    """A special token as configs spell it: a plain string or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    """Config ids may be an int, a list of ints, or null; a negative one is none (LLaMA's configs say pad_token_id -1
    for no pad token, and the tokenizers library failed on it, deep inside, at the load or the first stop string)."""
    values = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _keep(kept: OrderedDict[Any, _T], key: Any, value: _T, most: int = TEMPLATES_KEPT) -> _T:
    """`value`, put (back) last in a cache of at most `most` entries, the least recently used going first.
    Each step is one dict operation, so threads sharing a tokenizer (the server renders in worker threads) cannot
    pop a key between another's test and read: the caller returns `value`, never reads the cache again."""
    kept.pop(key, None)
    kept[key] = value
    while len(kept) > most:
        try:
            kept.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            break
    return value


def _config_template(templates: str | dict[str, str]) -> str | list[dict[str, str]]:
    """Chat templates as tokenizer_config.json holds them: one as text, several by name as a list."""
    if isinstance(templates, dict):
        return [{"name": name, "template": text} for name, text in templates.items()]
    return templates


def _read_chat_template(value: Any, where: Path) -> str | dict[str, str] | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (several by name)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        templates = {}
        for index, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: chat_template[{index}]: expected {{\"name\": str, \"template\": str}}, "
                                 f"got {entry!r:.80}")
            templates[entry["name"]] = entry["template"]
        return templates
    raise ValueError(f"{where}: chat_template: expected a string or a list of named templates, got "
                     f"{type(value).__name__}")


def _one_id(value: Any, position: int | None = None) -> int:
    """A token id that is not a plain int: a numpy integer or a one-element integer tensor, else an error naming
    `ids` at `position` (None: id_to_token's `token_id`)."""
    number = value
    if hasattr(value, "item") and hasattr(value, "dtype"):
        with contextlib.suppress(ValueError, RuntimeError):  # (more elements than one: refused below)
            number = value.item()
    if isinstance(number, bool) or not isinstance(number, int):
        if position is None:
            raise ValueError(f"token_id: expected an integer token id, got {type(value).__name__} {value!r:.40}")
        raise ValueError(f"ids: expected integer token ids (python or numpy ints, or an integer tensor), got "
                         f"{type(value).__name__} {value!r:.40} at position {position}")
    return int(number)


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}.")
    if not messages:
        raise ValueError("messages: an empty conversation; give at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"Message {index} must be a dict, got {type(message).__name__}.")
        if "role" not in message:
            raise ValueError(f"Message {index} has no 'role' field.")
        if not isinstance(message["role"], str):
            raise ValueError(f"Message {index} field 'role' must be a str, got {type(message['role']).__name__}.")
        # Text, a list of parts ([{"type": "text", "text": ...}], which templates iterate), or null / absent (an
        # assistant turn that only carries tool_calls, as OpenAI's API writes it): what transformers' templates take.
        content = message.get("content")
        if not (content is None or isinstance(content, (str, list))):
            raise ValueError(f"Message {index} field 'content' must be a str, a list of parts or null, got "
                             f"{type(content).__name__}.")


class MessageError(ValueError):
    """A chat message blockpress cannot render; `field` names what to change as OpenAI's API names it
    ("messages[2].content")."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


def chat_message(message: Any, index: int, developer: bool = False) -> dict[str, Any]:
    """messages[index] as blockpress renders it, from a server request and a training file alike (so a model is
    prompted as it was trained): a copy whose content is text, OpenAI's list of parts [{"type": "text", "text":
    ...}] joined one line apart ("\\n", as vLLM joins them; a template may print the list itself: templates differ on
    parts), and role "developer" (what OpenAI's newer clients call the system role) as "system", unless `developer`
    says the chat template it is rendered with has a place of its own for it (Tokenizer.renders_developer: DeepSeek
    V4's puts it in the user turn). Other parts
    are refused, and so is content null or absent except on an assistant message with tool_calls (OpenAI's rule),
    whose content is then "" (vLLM's): a template would render an empty turn. Errors are MessageError naming the
    field."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessageError(where, f"expected an object with 'role' and 'content', got {type(message).__name__}")
    _check_texts(message, where)
    if not isinstance(message.get("role"), str):
        raise MessageError(f"{where}.role", f"expected a str ('system', 'user', 'assistant', ...), got "
                                            f"{'nothing' if 'role' not in message else type(message['role']).__name__}")
    # templates know "system" (Gemma's raises on any other role), but a few have a place of their own for
    # "developer" (DeepSeek V4's, GigaChat 3's: the user turn, where "system" is a preamble)
    if message["role"] == "developer" and not developer:
        message = {**message, "role": "system"}
    if message.get("tool_calls") is not None:
        message = {**message, "tool_calls": _tool_calls(message["tool_calls"], where)}
    content = message.get("content")
    if content is None:
        if message.get("tool_calls") and message["role"] in ("assistant", "model"):
            # "" as vLLM renders it: templates that read message.content (Qwen 3's '\n' + content, Phi-3.5's,
            # Granite's) fail on a field left out, and "" renders as null does on the templates that take null
            return {**message, "content": ""}
        raise MessageError(f"{where}.content", f"expected str or a list of text parts, got "
                                               f"{'null' if 'content' in message else 'nothing'} (only an assistant "
                                               "message with tool_calls may leave it out)")
    if isinstance(content, list):
        if not content:
            raise MessageError(f"{where}.content", "an empty list of parts; give text, or at least one text part")
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageError(f"{where}.content", f"only text parts {{'type': 'text', 'text': str}} are "
                                                       f"supported ({where}.content[{j}] is {kind!r})")
        # one line apart, as vLLM joins them for a template that takes text (Granite 4's own template does so too):
        # glued, "Describe this:" and "The cat sat." read "Describe this:The cat sat."
        content = "\n".join(part["text"] for part in content)
    elif not isinstance(content, str):
        raise MessageError(f"{where}.content", f"expected str or a list of text parts, got {type(content).__name__}")
    return {**message, "content": content}


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool_calls as transformers' tool templates take them: each call's arguments an object.
    OpenAI writes them as JSON text ('{"city": "Oslo"}'), which the server parses for the template; lm.chat and a
    training file passed the text on, and a template printed it as written: Gemma 4's trained on
    'call:weather{{"city": "Oslo"}}', a call no response template reads back. A call is OpenAI's
    {"function": {"name", "arguments"}}, or the flat {"name", "arguments"} that many templates also take (Qwen's,
    Llama's: `tool_call.function if defined`); text that is no JSON object, and calls of neither shape, are refused
    by field, as the server refuses them."""
    if not isinstance(calls, list):
        raise MessageError(f"{where}.tool_calls", f"expected a list of calls ({{'type': 'function', 'function': "
                                                  f"{{'name': ..., 'arguments': ...}}}}), got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if isinstance(call, dict) and "function" not in call and "name" in call:  # the flat shape
            out.append({**call, "arguments": _call_arguments(call, at)})
            continue
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise MessageError(f"{at}.function", "expected an object {'name': ..., 'arguments': ...}, got "
                                                 f"{'nothing' if isinstance(call, dict) else type(call).__name__}")
        out.append({**call, "function": {**function, "arguments": _call_arguments(function, f"{at}.function")}})
    return out


def _call_arguments(function: dict[str, Any], at: str) -> dict[str, Any]:
    """A call's arguments as an object (`function`: what holds its name and arguments, `at`: its field), from an
    object or OpenAI's JSON text of one; a call without a name, or arguments of neither kind, refused by field."""
    if not (isinstance(function.get("name"), str) and function["name"]):
        raise MessageError(f"{at}.name", f"expected the function's name, got {function.get('name')!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = parse_json(arguments)
        except json.JSONDecodeError:  # (parse_json's too: nested past the parser's depth, a number too long)
            arguments = None
        if not isinstance(arguments, dict):
            raise MessageError(f"{at}.arguments", f"expected a JSON object as text (as OpenAI writes them) or an "
                                                  f"object, got {function['arguments'][:80]!r}")
    elif not isinstance(arguments, dict):
        raise MessageError(f"{at}.arguments", "expected an object, or a JSON object as text (as OpenAI writes "
                                              f"them), got {type(arguments).__name__}")
    return arguments


# What apply_chat_template itself passes a template, or takes as its own arguments: a template variable of these names
# (a server's chat_template_kwargs) would replace the conversation, the tools or raise_exception, or change how the
# prompt is rendered rather than what the template reads.
# The names a chat rendering sets itself, and jinja's own globals (namespace, range, ...): a template variable of one
# of those names would replace it, and a template calling it then fail ({"namespace": 1} over a template that
# calls namespace(...): "'int' object is not callable", which the server would answer as its own fault, a 500)
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                     "chat_template", "tokenize", "raise_exception", "strftime_now",
                                     *jinja2.defaults.DEFAULT_NAMESPACE})
# transformers' apply_chat_template keywords that shape what it returns rather than what the template sees
TRANSFORMERS_RENDER_OPTIONS = frozenset({"return_tensors", "return_dict", "padding", "truncation", "max_length",
                                         "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def template_variables(variables: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """`variables` checked as extra chat-template variables (vLLM's chat_template_kwargs, e.g. {"enable_thinking":
    true} for Gemma 4's templates): a dict of names to JSON values (None: none). A name must be an identifier, and not
    one of RESERVED_TEMPLATE_NAMES; errors name `field`. A template that never reads a variable ignores it, as
    transformers' and vLLM's do (a client sends the same kwargs to every model)."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise ValueError(f"{field}: expected an object of template variables (e.g. {{\"enable_thinking\": true}}), "
                         f"got {type(variables).__name__}")
    for name, value in variables.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{field}: {name!r} is not a template variable's name (letters, digits and _)")
        if name in RESERVED_TEMPLATE_NAMES:
            raise ValueError(f"{field}: {name!r} is set by the chat rendering itself (reserved: "
                             f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))})")
        if name in TRANSFORMERS_RENDER_OPTIONS:  # (apply_chat_template refuses it: say so naming this field)
            raise ValueError(f"{field}: {name!r} is a transformers tokenizer option, not a template variable (the "
                             "rendering returns the whole prompt as text)")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(f"{field}.{name}: expected a JSON value (text, number, true/false, null, a list or an "
                             f"object), got {type(value).__name__}") from None
        _check_texts(value, f"{field}.{name}")
    return dict(variables)


def _validate_tools_and_documents(tools: Any, documents: Any) -> None:
    for name, items in (("tools", tools), ("documents", documents)):
        if items is None:
            continue
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{name}: expected a list of dicts, got {type(items).__name__}")
        for index, item in enumerate(items):
            if isinstance(item, dict):
                continue
            if name == "tools" and callable(item):
                # transformers turns a documented function into a schema; blockpress takes the schema itself.
                raise ValueError(f"tools[{index}]: got the function {getattr(item, '__name__', item)!r}; pass its JSON "
                                 "schema instead, {'type': 'function', 'function': {'name': ..., 'description': ..., "
                                 "'parameters': {...}}} (transformers.utils.get_json_schema(f) writes one)")
            raise ValueError(f"{name}[{index}]: expected a dict, got {type(item).__name__}")
        for index, item in enumerate(items):
            _check_texts(item, f"{name}[{index}]")


def _check_texts(value: Any, where: str) -> None:
    """A MessageError naming the field (messages[1].content, tools[0].function.description) of the first string in
    `value`, nested dicts and lists included, that UTF-8 cannot encode: the rendered prompt could not be tokenized,
    and its error would name a position in the whole prompt, not the field the caller wrote."""
    if isinstance(value, str):
        problem = utf8_problem(value)
        if problem is not None:
            raise MessageError(where, f"not valid UTF-8 ({problem})")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and (problem := utf8_problem(key)) is not None:
                raise MessageError(where, f"not valid UTF-8 ({problem} of the key {key!r})")
            _check_texts(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_texts(item, f"{where}[{i}]")


# The names a message's reasoning may come under; templates read the first (gpt-oss's read "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to templates: a copy without the fields that are None (templates test for
    a field's presence, and print None as "None"), and reasoning under every name templates read."""
    copy = {key: value for key, value in message.items() if value is not None}
    reasoning = next((copy[key] for key in REASONING_FIELDS if key in copy), None)
    if reasoning is not None:
        # Same key order as transformers gives it (a template may print the whole message as JSON): "thinking" in
        # front unless the message has its own, "reasoning_content" where the message has it, else last.
        copy = {"thinking": reasoning, **copy, "reasoning_content": reasoning}
    return copy


# An assistant message's text whose end turn_end_id finds in the rendered template (plain letters: no template trims
# or changes them).
TURN_END_MARK = "BLOCKPRESSREPLYENDSHERE"

# Put after the text to continue, rendered, then cut off with everything after it. The trailing space tells whether
# the template kept the text's end as it was or stripped it (then the cut strips it too).
CONTINUE_MARK = "BLOCKPRESS_CONTINUE_FROM_HERE "


def _mark_continuation(message: dict[str, Any], field_name: str, template: str) -> str:
    """Append CONTINUE_MARK to the text of `message[field_name]` (in place: the message is already a copy); return
    that text, which the rendered prompt must contain."""
    text = message.get(field_name)
    if text is None:
        raise ValueError(f"continue_final_message: the last message has no {field_name!r} to continue")
    fields = [field_name]
    if field_name in REASONING_FIELDS:  # copied under each name: mark every copy, the template reads one of them
        fields = [name for name in REASONING_FIELDS if message.get(name) == text]
    if not any(name in template for name in fields):
        raise ValueError(f"continue_final_message: the chat template never reads the message field {field_name!r}")
    if isinstance(text, list):  # parts: continue the last text part
        for index in reversed(range(len(text))):
            part = text[index]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts = list(text)
                parts[index] = {**part, "text": part["text"] + CONTINUE_MARK}
                message[field_name] = parts
                return part["text"]
        raise ValueError(f"continue_final_message: the last message's {field_name!r} has no text part to continue")
    if not isinstance(text, str):
        raise ValueError(f"continue_final_message: the last message's {field_name!r} must be text to continue, got "
                         f"{type(text).__name__}")
    for name in fields:
        message[name] = text + CONTINUE_MARK
    return text


def _cut_at_continuation(rendered: str, final_text: str) -> str:
    """`rendered` up to where the marked text ends."""
    anchor = CONTINUE_MARK.rstrip()
    if anchor not in rendered or final_text.strip() not in rendered:
        raise ValueError("continue_final_message: the chat template changed or dropped the last message's text, so "
                         "the prompt has no place to continue it from")
    at = rendered.rindex(anchor)
    return rendered[:at] if rendered.startswith(CONTINUE_MARK, at) else rendered[:at].rstrip()


class TemplateRaised(ValueError):
    """A chat template's raise_exception(): what it says is about the conversation, not a broken template."""


class TemplateTooCostly(ValueError):
    """A chat template that runs past TEMPLATE_SECONDS or makes text past TEMPLATE_CHARS (see there)."""


class _DeadlineCodeGenerator(CodeGenerator):
    """jinja's code generator, with a check of the render's time limit at the top of every block of code it writes:
    each pass of a loop's body (an empty one too), each call of a macro, each branch taken, and at each `set`. A
    template's work that calls nothing (a loop that writes nothing, a run of `set`s) runs there, so it is stopped
    there. (A loop's `if` filter runs between two passes of its body unchecked: one pass over one sequence at most,
    100,000 items of a range or TEMPLATE_CHARS of a string.) A sys.settrace of every line did the same at 3.3-3.9x the
    render's time: every Python call jinja makes paid the tracer. `~` joins through the sandbox's `joined`, which
    measures the text before making it."""

    def blockvisit(self, nodes: Iterable[jinja2.nodes.Node], frame: Frame) -> None:
        self.writeline("environment.check_deadline()")
        super().blockvisit(nodes, frame)

    def visit_Assign(self, node: jinja2.nodes.Assign, frame: Frame) -> None:
        self.writeline("environment.check_deadline()")
        super().visit_Assign(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:  # Markup's join ({% autoescape true %}): measured
            self.write("environment.made(")                        # after, as it escapes its parts
            super().visit_Concat(node, frame)
            self.write(", '~')")
            return
        self.write("environment.joined((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _size(value: Any) -> int:
    """About how many characters `value` is as text, without making the text: a string's length, a list's or
    tuple's items plus its strings' lengths (a list of one long string repeated is as long as their join)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(item) for item in value if isinstance(item, str))
    return 0


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _too_costly(what: str) -> TemplateTooCostly:
    return TemplateTooCostly(f"chat_template: {what}, past {TEMPLATE_CHARS:,} characters")


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with the operations that can make a long text or a big number measured before they
    run, and every value a call or operator makes measured after: a text, list or mapping past TEMPLATE_CHARS, or a
    number of more than 4,096 bits, is refused (either took all memory or minutes of CPU). Measured before: `*` and
    `+` of texts and lists, `~`, a size past TEMPLATE_CHARS passed to a call that makes text or lists of that size
    (center(10**9): SIZED), a format text's widths and fields (`%`, str.format, the format filter), join, replace,
    indent, expandtabs and tojson's indent and separators; and every value written ({{ }}). Its templates' code checks
    the render's deadline (_DeadlineCodeGenerator, set by _render for the thread that renders: one template may render
    in several server threads at once). Not measured: text made by printing whole a list nested in lists of long
    strings; _render's own check of the whole text bounds what reaches the prompt."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _DeadlineCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.deadlines = threading.local()
        # Every {{ value }} written is measured: a {% set %} block that writes a value twice doubles it with no
        # operator to measure (a loop of them grows the text exponentially).
        self.finalize = self._written
        # jinja2's own tojson HTML-escapes <, >, & and '; chat templates want plain JSON.
        self.filters["tojson"] = _tojson
        # A template's code calls its filters directly, not through call_filter: each is measured in a wrapper.
        self.filters = {name: self._measured(name, f) for name, f in self.filters.items()}

    def _measured(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        passes_first = getattr(f, "jinja_pass_arg", None) is not None  # (a context or environment, then the value)

        @functools.wraps(f)  # (keeps jinja_pass_arg)
        def measured(*args: Any, **kwargs: Any) -> Any:
            value, rest = (args[1], args[2:]) if passes_first else (args[0], args[1:])
            self.check_arguments(name, value, rest, kwargs)
            return self.made(f(*args, **kwargs), f"the filter {name}")

        return measured

    def _written(self, value: Any) -> Any:
        if _size(value) > TEMPLATE_CHARS:
            raise _too_costly(f"writes a {type(value).__name__} of {_size(value):,} characters")
        return value

    def check_deadline(self) -> None:
        deadline = getattr(self.deadlines, "at", None)
        if deadline is not None and time.monotonic() > deadline:
            raise TemplateTooCostly(f"chat_template: rendering ran past {TEMPLATE_SECONDS:g} s")

    def made(self, value: Any, what: str) -> Any:
        """`value`, which `what` made, refused when it is past the limits."""
        if isinstance(value, (str, list, tuple, dict)) and len(value) > TEMPLATE_CHARS:
            raise _too_costly(f"{what} made a {type(value).__name__} of {len(value):,} items")
        return value

    def joined(self, parts: tuple[Any, ...]) -> str:
        if sum(map(_size, parts)) > TEMPLATE_CHARS:
            raise _too_costly(f"joins texts of {sum(map(_size, parts)):,} characters with ~")
        return self.made("".join(map(str, parts)), "~")

    def check_arguments(self, name: str, value: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuses the call `name`(value, *args, **kwargs) of a filter or method before it runs when what it would
        make is past the limits (the size of its result is known from its arguments). A number is a size only to the
        calls that make text or lists of it (SIZED): a timestamp passed to format() or default() is none."""
        self.check_deadline()
        if name in SIZED:
            for arg in (*args, *kwargs.values()):
                if (n := _count(arg)) is not None and abs(n) > TEMPLATE_CHARS:
                    raise _too_costly(f"passes {n:,} to {name}")
        first = args[0] if args else None
        estimate = 0
        if name == "join" and isinstance(value, (list, tuple)):  # the filter: items | join(separator)
            sep = first if isinstance(first, str) else kwargs.get("d", "")
            estimate = _size(value) + len(sep if isinstance(sep, str) else "") * len(value)
        elif name == "join" and isinstance(value, str) and isinstance(first, (list, tuple)):  # separator.join(items)
            estimate = _size(first) + len(value) * len(first)
        elif name == "replace" and isinstance(value, str) and len(args) >= 2 and isinstance(args[0], str) \
                and isinstance(args[1], str):
            old, new = args[0], args[1]
            estimate = len(value) + (value.count(old) if old else len(value) + 1) * max(len(new) - len(old), 0)
        elif name == "indent" and isinstance(value, str):  # (its width: a number of spaces, or a text)
            width = first if first is not None else kwargs.get("width", 4)
            per_line = len(width) if isinstance(width, str) else _count(width) or 0
            estimate = len(value) + (value.count("\n") + 1) * per_line
        elif name == "expandtabs" and isinstance(value, str):
            tab = _count(first if first is not None else kwargs.get("tabsize", 8)) or 0
            estimate = len(value) + value.count("\t") * tab
        elif name == "generate_lorem_ipsum":  # lipsum(n=5, html=True, min=20, max=100): n paragraphs of up to max
            n = _count(first if first is not None else kwargs.get("n", 5)) or 0  # words of up to 12 characters
            words = _count(args[3] if len(args) > 3 else kwargs.get("max", 100)) or 0
            estimate = n * words * 13
        elif name == "format" and isinstance(value, str):  # the filter: '%s ...' | format(...), %-formatting
            _check_format(value, [*args, *kwargs.values()], "%")
        elif name == "tojson":  # its indent (a number, or a text) and separators are written once a line and item
            indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
            separators = kwargs.get("separators", args[2] if len(args) > 2 else None)
            parts = [indent if isinstance(indent, str) else " " * min(_count(indent) or 0, 65),
                     *(separators if isinstance(separators, (list, tuple)) else ())]
            if any(isinstance(part, str) and len(part) > 64 for part in parts):
                raise TemplateTooCostly("chat_template: tojson with an indent or separator of more than 64 "
                                        "characters (at most 64 here)")
        if estimate > TEMPLATE_CHARS:
            raise _too_costly(f"{name} would make {estimate:,} characters")

    # map('upper'), select('odd'), reject(...) call these once an item, in jinja's code, not the template's: a filter
    # over a long sequence ('x' * 5_000_000) would run on past the deadline without a check here.
    def call_filter(self, name: str, value: Any, args: Sequence[Any] | None = None,
                    kwargs: Mapping[str, Any] | None = None, context: Any = None, eval_ctx: Any = None) -> Any:
        self.check_deadline()
        return super().call_filter(name, value, args, kwargs, context=context, eval_ctx=eval_ctx)

    def call_test(self, name: str, value: Any, args: Sequence[Any] | None = None,
                  kwargs: Mapping[str, Any] | None = None, context: Any = None, eval_ctx: Any = None) -> Any:
        self.check_deadline()
        return super().call_test(name, value, args, kwargs, context=context, eval_ctx=eval_ctx)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        bound = getattr(__obj, "__self__", None)
        __self.check_arguments(name, bound if isinstance(bound, str) else None, args, kwargs)
        return __self.made(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__

        @functools.wraps(wrapped)
        def measured(*args: Any, **kwargs: Any) -> Any:  # '{:>1000000000}'.format(1): the width is in the text
            _check_format(text, [*args, *kwargs.values(), *(v for a in args if isinstance(a, dict) for v in a.values())],
                          "{")
            return wrapped(*args, **kwargs)

        return measured

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, _count(right)), (right, _count(left))):
                if isinstance(seq, (str, list, tuple)) and n is not None and _size(seq) * n > TEMPLATE_CHARS:
                    raise _too_costly(f"repeats a {type(seq).__name__} of {len(seq):,} items {n:,} times")
            a, b = _count(left), _count(right)
            if a is not None and b is not None and a.bit_length() + b.bit_length() > 4096:
                raise TemplateTooCostly("chat_template: multiplies two numbers into one of more than 4,096 bits")
        elif operator == "**":
            base, exponent = _count(left), _count(right)
            if base is not None and exponent is not None and abs(base) > 1 and exponent * math.log2(abs(base)) > 4096:
                raise TemplateTooCostly(f"chat_template: computes {base} ** {exponent}, a number of more than 4,096 "
                                        "bits")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and _size(left) + _size(right) > TEMPLATE_CHARS:
                raise _too_costly(f"adds texts or lists of {_size(left) + _size(right):,} characters")
        elif operator == "%" and isinstance(left, str):
            values = list(right) if isinstance(right, tuple) else list(right.values()) if isinstance(right, dict) \
                else [right]
            _check_format(left, values, "%")
        return self.made(super().call_binop(context, operator, left, right), f"`{operator}`")


# What makes a text or list as long as a number says: a width, a number of lines or parts.
SIZED = frozenset({"center", "ljust", "rjust", "zfill", "indent", "wordwrap", "expandtabs", "slice", "batch",
                   "tojson", "generate_lorem_ipsum"})  # (the last: jinja's lipsum(n) global, n paragraphs)
# A %-format's field (its flags, width and precision: each a number, or * for the next value) and a str.format field
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


def _check_format(text: str, values: Sequence[Any], style: str) -> None:
    """A format text whose output would pass TEMPLATE_CHARS, refused before it is made: a width or precision it
    writes ('%0100000000d', '{:>100000000}') or takes from a value ('%*d', '{:>{w}}'), or fields that repeat its
    values ('{0}' 2,000 times). `values`: the values formatted, in order (a %-format's tuple) or not; `style`: "%" or
    "{" (str.format)."""
    fields = list(_PERCENT_FIELD.finditer(text)) if style == "%" else list(_BRACE_FIELD.finditer(text))
    for spec in fields:
        numbers = [g for g in spec.groups() if g and g != "*"] if style == "%" else \
            re.findall(r"\d+", spec.group().partition(":")[2])
        if any(int(n) > TEMPLATE_CHARS for n in numbers):
            raise _too_costly(f"formats with a width of {max(map(int, numbers)):,}")
    if style == "%":  # each * takes the next value as a width, and each field but %% the value after it
        taken = 0
        for spec in fields:
            for group in spec.groups():
                if group == "*":
                    if taken < len(values) and _width(values[taken]) > TEMPLATE_CHARS:
                        raise _too_costly(f"formats with a * width of {_width(values[taken]):,}")
                    taken += 1
            taken += spec.group() != "%%"
    elif re.search(r"\{[^{}]*\{", text) and any(_width(v) > TEMPLATE_CHARS for v in values):  # a nested field
        raise _too_costly(f"formats with a width of {max(map(_width, values)):,} taken from a value")
    sizes = [_size(v) for v in values]
    # each value once where there are as many values as fields; else a field may repeat the longest
    estimate = len(text) + (sum(sizes) if len(fields) <= len(values) else len(fields) * max(sizes, default=0))
    if estimate > TEMPLATE_CHARS:
        raise _too_costly(f"formats {len(fields):,} fields of up to {max(sizes, default=0):,} characters")


def _width(value: Any) -> int:
    """A value read as a width: a number, or a text of digits (str.format takes both in a nested field)."""
    if isinstance(value, str) and value.isdigit() and value.isascii():
        return int(value) if len(value) < 20 else 10**20
    return abs(_count(value) or 0)


def _render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template` (compiled by a _TemplateSandbox) rendered with `variables`, refused (TemplateTooCostly) once it runs
    past TEMPLATE_SECONDS or its text passes TEMPLATE_CHARS. The time is checked by the template's own code, at each
    block it runs (see _DeadlineCodeGenerator), so a loop that writes nothing is stopped too, whatever tracer (a
    debugger, coverage) is set."""
    environment = template.environment
    if not isinstance(environment, _TemplateSandbox):  # its code would not check the deadline
        raise TypeError(f"template: expected one compiled by a _TemplateSandbox, got {type(environment).__name__}'s")
    deadlines = environment.deadlines
    deadlines.at = time.monotonic() + TEMPLATE_SECONDS
    try:
        parts, size = [], 0
        for part in template.generate(**variables):
            size += len(part)
            if size > TEMPLATE_CHARS:
                raise TemplateTooCostly(f"chat_template: its text passed {TEMPLATE_CHARS:,} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        deadlines.at = None


def _encoded(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    """The ids of `text` through `backend`. encode_batch, not encode: the library's encode holds the GIL throughout
    (0.25 s for 240 KB of text, which froze a server's event loop even from a worker thread), encode_batch lets go of
    it; the ids are the same. A checkpoint's tokenizer.json whose regex backtracks past the library's limit
    (`(a|aa)+$` on 35 characters) makes the library panic, which Python sees as a BaseException that no `except
    Exception` catches (the server answered a plain-text 500): it is a ValueError here, naming the file."""
    try:
        return backend.encode_batch([text], add_special_tokens=False)[0].ids
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":  # (pyo3's; the tokenizers package does not export the class)
            raise
        raise ValueError(f"tokenizer.json: the tokenizer failed on this text of {len(text):,} characters "
                         f"({str(exc).splitlines()[0] if str(exc) else 'the library panicked'}); the checkpoint's "
                         "tokenizer.json is at fault (e.g. a pre-tokenizer regex that backtracks)") from None


def _raise_template_error(message: str) -> None:
    # Exposed to templates as raise_exception(); a bad conversation is a caller error.
    raise TemplateRaised(f"Chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    """Templates that date their system prompt call strftime_now (transformers provides it)."""
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}: it marks the assistant's text for training masks; a
    rendered prompt is just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
