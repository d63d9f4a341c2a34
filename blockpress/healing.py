"""Token healing: let the model re-choose the last prompt token when the tokenizer split the text there.

BPE merges text greedily, so a prompt that stops mid-merge ends in a token the model rarely saw in that
place. The code tokenizer, for one, merges a newline with the indentation after it: a prompt ending in
"\\n" hands the model a bare newline, which in training meant "the next line starts at column 0". Healing
drops that last token and requires the first new token to start with its text ("\\n" may become
"\\n    "), so the model picks the merge itself. The returned text starts after the original prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Healed:
    ids: list[int]  # the prompt without its last token (unchanged when nothing needs healing)
    prefix: str  # the removed token's text: the continuation must start with it ("" when not healed)


def heal(tokenizer: Tokenizer, ids: Sequence[int]) -> Healed:
    """Back off the last token when a longer vocabulary token starts with its text (it could have merged)."""
    ids = list(ids)
    if len(ids) < 2:  # nothing would be left to condition on
        return Healed(ids, "")
    texts = tokenizer.token_texts()
    last = texts[ids[-1]] if 0 <= ids[-1] < len(texts) else ""
    if last not in tokenizer.extendable_texts():
        return Healed(ids, "")
    return Healed(ids[:-1], last)


def allowed_first_tokens(tokenizer: Tokenizer, prefixes: Sequence[str], vocab_size: int) -> torch.Tensor:
    """[B, vocab_size] bool: the tokens each row's first new token may be (all, for a row not healed)."""
    texts = tokenizer.token_texts()
    out = torch.ones(len(prefixes), vocab_size, dtype=torch.bool)
    for row, prefix in enumerate(prefixes):
        if prefix:
            ok = torch.tensor([t.startswith(prefix) for t in texts], dtype=torch.bool)
            out[row] = False
            out[row, : ok.numel()] = ok[:vocab_size]
    return out


def strip_prefix(text: str, prefix: str) -> str:
    """The generated text after the healed prefix (it always starts with it, unless the row ended at once)."""
    return text[len(prefix):] if text.startswith(prefix) else text
