"""Tokenizer wrapper around a Hugging Face `tokenizers` fast tokenizer, plus chat templates.

Reads the files a Hugging Face checkpoint folder ships (tokenizer.json, tokenizer_config.json,
chat_template.jinja, special_tokens_map.json, config.json, generation_config.json) without depending
on `transformers`, and renders chat templates the way `transformers` does (sandboxed jinja2 with
trim_blocks/lstrip_blocks), so prompts built here match prompts built there.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

# Gemma order: pad=0, eos=1, bos=2; the turn markers and the infilling hole follow.
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|hole|>",
)

# A Gemma-style turn template. A leading system message is folded into the first user turn (Gemma has
# no system role); if no user turn follows it, it becomes a user turn of its own. "assistant" is
# rendered as Gemma's "model" role. Every jinja tag strips the whitespace around it, so the layout below
# is for reading only and the output is exactly the quoted strings, whatever the renderer's settings.
GEMMA_CHAT_TEMPLATE: str = """\
{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('Only the first message may have the system role.') -}}
        {%- endif -%}
        {%- if loop.last or messages[1]['role'] != 'user' -%}
            {{- '<start_of_turn>user\\n' ~ message['content'] ~ '<end_of_turn>\\n' -}}
        {%- else -%}
            {%- set ns.system = message['content'] ~ '\\n\\n' -%}
        {%- endif -%}
    {%- else -%}
        {%- if message['role'] == 'user' -%}
            {%- set role = 'user' -%}
        {%- elif message['role'] in ['assistant', 'model'] -%}
            {%- set role = 'model' -%}
        {%- else -%}
            {{- raise_exception('Unsupported chat role: ' ~ message['role']) -}}
        {%- endif -%}
        {{- '<start_of_turn>' ~ role ~ '\\n' ~ ns.system ~ message['content'] ~ '<end_of_turn>\\n' -}}
        {%- set ns.system = '' -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""


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
    chat_template: str | None = None
    # tokenizer_config.json's flag, kept and saved for transformers 4. (blockpress puts BOS in front of plain
    # prompts whenever the tokenizer has one, as Gemma's tokenizers do.)
    add_bos_token: bool = False
    _compiled_template: tuple[str, jinja2.Template] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _token_texts: list[str] | None = field(default=None, init=False, repr=False, compare=False)
    _extendable: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    # ----------------------------------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face checkpoint folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"The checkpoint at {folder} has no tokenizer.json, so text cannot be tokenized; "
                "pass token ids instead of text, or add a tokenizer.json to the folder."
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        # Multimodal checkpoints keep the language model's ids under text_config.
        text_cfg = model_cfg.get("text_config")
        id_sources = [gen_cfg, model_cfg, text_cfg if isinstance(text_cfg, dict) else {}]

        def token_id(name: str) -> int | None:
            # Token strings win; the numeric ids in the model/generation configs are fallbacks.
            for source in (tok_cfg, special_map):
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

        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(tok_cfg.get("chat_template"))

        return cls(
            backend=backend,
            bos_id=token_id("bos_token"),
            eos_ids=eos_ids,
            pad_id=token_id("pad_token"),
            chat_template=chat_template,
            add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        )

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json so `from_dir` and `transformers` can load them.

        When there is more than one EOS id, generation_config.json gets `eos_token_id` as a list (other
        fields of an existing generation_config.json are kept), because tokenizer_config.json can only
        name one eos_token.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {
            # Works for transformers 4 and 5 (where it aliases TokenizersBackend).
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token(self.bos_id),
            "eos_token": self._token(self.eos_id),
            "pad_token": self._token(self.pad_id),
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            (folder / "chat_template.jinja").unlink(missing_ok=True)  # a stale one would win over it on loading
        _write_json(folder / "tokenizer_config.json", config)
        gen_path = folder / "generation_config.json"
        gen_cfg = _read_json(gen_path)
        if len(self.eos_ids) > 1 and "eos_token_id" not in gen_cfg:  # a model's own EOS set (LM.save) stays
            gen_cfg["eos_token_id"] = list(self.eos_ids)
            _write_json(gen_path, gen_cfg)

    # -------------------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def special_ids(self) -> set[int]:
        ids = {tid for tid, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(self.eos_ids)
        ids.update(tid for tid in (self.bos_id, self.pad_id) if tid is not None)
        return ids

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ------------------------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids for `text`; BOS is prepended only when asked, never by the post-processor."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str to tokenize, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes that were not UTF-8 (a command line or stdin) arrive as surrogates
            bad = text[exc.start].encode("utf-8", "surrogateescape")
            raise ValueError(f"text: not valid UTF-8 (byte 0x{bad.hex()} at character {exc.start})") from None
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token.")
            ids = [self.bos_id, *ids]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt's ids: BOS first when the tokenizer has one, but not twice (a rendered chat template,
        or text that starts with the BOS token, brings its own)."""
        ids = self.encode(text)
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # int() accepts tensors' and numpy arrays' elements as well as plain ints.
        id_list = [int(i) for i in ids]
        if skip_special_tokens:
            # Also drop ids that a config marks special but tokenizer.json does not (e.g. extra EOS ids).
            special = self.special_ids
            id_list = [i for i in id_list if i not in special]
        return self.backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def token_texts(self) -> list[str]:
        """Every id's text on its own (special tokens as ""), computed once: what token healing matches on."""
        if self._token_texts is None:
            special = self.special_ids
            texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            self._token_texts = ["" if i in special else t for i, t in enumerate(texts)]
        return self._token_texts

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
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_vars: Any,
    ) -> str | list[int]:
        """Render `messages` with the chat template; with tokenize=True return the prompt's ids.

        Extra keyword arguments become template variables (e.g. `tools` for templates that use them).
        The template itself is responsible for BOS, so tokenize=True does not add another one.
        """
        if self.chat_template is None:
            raise ValueError(
                "This tokenizer has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); set Tokenizer.chat_template, e.g. to GEMMA_CHAT_TEMPLATE."
            )
        _validate_messages(messages)
        # What transformers passes templates: tools and documents are None unless given (a template testing
        # `tools is not none` must not see them defined), and the caller's variables win over the tokenizer's.
        variables = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "", pad_token=self.pad_token or "",
                         tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                         raise_exception=_raise_template_error, strftime_now=_strftime_now)
        variables.update(template_vars)
        try:
            rendered = self._template().render(messages=messages, **variables)
        except TemplateRaised:  # the template's own raise_exception: a message about the conversation
            raise
        except Exception as exc:  # the checkpoint's template is broken, or breaks on these messages
            raise ValueError(f"chat_template: rendering failed: {type(exc).__name__}: {exc}") from None
        if tokenize:
            return self.encode(rendered, add_bos=False)
        return rendered

    def _template(self) -> jinja2.Template:
        # Compile once per template string; recompile if someone swapped chat_template.
        assert self.chat_template is not None
        if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
            )
            # jinja2's own tojson HTML-escapes <, >, & and '; chat templates want plain JSON.
            env.filters["tojson"] = _tojson
            try:
                self._compiled_template = (self.chat_template, env.from_string(self.chat_template))
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat_template: not a valid template: {exc} (line {exc.lineno})") from None
        return self._compiled_template[1]

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer (any text round-trips exactly) with Gemma-style special tokens.

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
        show_progress=False,
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
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object, found {type(data).__name__}.")
    return data


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _token_content(value: Any) -> str | None:
    """A special token as configs spell it: a plain string or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    """Config ids may be an int, a list of ints, or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_chat_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
    return None


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}.")
    if not messages:
        raise ValueError("messages: an empty conversation; give at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"Message {index} must be a dict, got {type(message).__name__}.")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"Message {index} has no '{key}' field.")
        if not isinstance(message["role"], str):
            raise ValueError(f"Message {index} field 'role' must be a str, got {type(message['role']).__name__}.")
        # Text, a list of parts ([{"type": "text", "text": ...}], which templates iterate), or None beside
        # tool_calls: what transformers' templates take.
        if not (isinstance(message["content"], (str, list)) or message["content"] is None):
            raise ValueError(f"Message {index} field 'content' must be a str, a list of parts or null, got "
                             f"{type(message['content']).__name__}.")


class TemplateRaised(ValueError):
    """A chat template's raise_exception(): what it says is about the conversation, not a broken template."""


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
