"""Token healing: the prompt's last token is re-chosen by the model when a longer token could merge there."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockpress
from blockpress.generate import Commit, Done, Template, parse_template
from blockpress.healing import (
    Healed,
    allowed_first_tokens,
    heal,
    heal_holes,
    heal_into_template,
    strip_prefix,
)
from blockpress.lm import resolve_path
from blockpress.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif("blockpress-code" not in blockpress.shipped_models(),
                                reason="blockpress-code is not in this package")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(resolve_path("blockpress-code"))


@pytest.fixture(scope="module")
def lm():
    return blockpress.load("blockpress-code", dtype="float32")


def test_trailing_newline_is_healed(tok):
    # The code tokenizer merges a newline with the indentation after it, so a bare "\n" is healable.
    ids = tok.encode("def add(a, b):\n")
    healed = heal(tok, ids)
    assert healed.prefix == "\n"
    assert healed.ids == ids[:-1]


def test_unextendable_last_token_is_kept(tok):
    texts = tok.token_texts()
    # A token no other token extends: healing it would only cost a forward's worth of freedom.
    leaf = next(i for i, t in enumerate(texts)
                if t.strip() and not any(len(u) > len(t) and u.startswith(t) for u in texts))
    ids = [tok.encode("x = ")[0], leaf]
    assert heal(tok, ids).ids == ids
    assert heal(tok, ids).prefix == ""


def test_punctuation_is_not_healed_even_when_it_could_merge(tok):
    # "):" extends to "):\n    " and the like, but healing it measured harmful (see healing.py).
    ids = tok.encode("def f(n):")
    last = tok.token_texts()[ids[-1]]
    assert last.strip() and last in tok.extendable_texts()
    assert heal(tok, ids) == heal(tok, ids).__class__(ids, "")


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet="abc ():=\n\t_1.\"'", min_size=2, max_size=40))
def test_healing_loses_no_text(tok, text):
    ids = tok.encode(text)
    healed = heal(tok, ids)
    if healed.prefix:
        assert not healed.prefix.strip()  # only whitespace is healed
        assert healed.ids == ids[:-1]
        assert tok.decode(healed.ids) + healed.prefix == tok.decode(ids)
    else:
        assert healed.ids == ids


def test_allowed_tokens_are_exactly_the_extensions(tok):
    texts = tok.token_texts()
    mask = allowed_first_tokens(tok, ["\n", ""], tok.vocab_size)
    assert mask.shape == (2, tok.vocab_size)
    assert bool(mask[1].all())  # a row that was not healed is unconstrained
    for i, t in enumerate(texts):
        assert bool(mask[0, i]) == t.startswith("\n"), (i, t)
    assert int(mask[0].sum()) > 1
    # A model's vocabulary may be padded past the tokenizer's texts: those ids have no text and never start one.
    padded = allowed_first_tokens(tok, ["\n", ""], len(texts) + 5)
    assert torch.equal(padded[:, : len(texts)], mask[:, : len(texts)])
    assert not bool(padded[0, len(texts):].any()) and bool(padded[1].all())


def test_allowed_first_tokens_scan_the_vocabulary_once_per_prefix(tok, monkeypatch):
    """Each healed row of every request scanned every token's text in Python (36 ms a row at 262,144 tokens): the
    tokenizer keeps each prefix's mask, so a prefix is scanned once, and the rows get what the scan gives."""
    fresh = Tokenizer(backend=tok.backend, bos_id=tok.bos_id, eos_ids=list(tok.eos_ids), pad_id=tok.pad_id)
    texts = fresh.token_texts()
    scans = []
    monkeypatch.setattr(fresh, "token_texts", lambda: scans.append(1) or texts)
    for size in (len(texts), len(texts) + 3, len(texts) - 2):
        for prefix in ("\n", " "):
            mask = allowed_first_tokens(fresh, [prefix, "", prefix], size)
            want = [i < len(texts) and texts[i].startswith(prefix) for i in range(size)]
            assert mask[0].tolist() == mask[2].tolist() == want and bool(mask[1].all())
    assert len(scans) == 2  # once per prefix


def test_a_one_token_prompt_is_never_healed(tok):
    """Healing its only token would leave the model nothing to condition on: a lone "\n" prompt stays as it is."""
    newline = tok.encode("def f():\n")[-1]
    assert heal(tok, [newline - 1, newline]).prefix == "\n"  # healable as a prompt's last token
    assert heal(tok, [newline]) == heal(tok, []).__class__([newline], "")


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_generation_starts_with_the_healed_text(lm, engine):
    prompt = "def add(a, b):\n"
    tok = lm.tokenizer
    kwargs = dict(max_new_tokens=8, seed=0, token_healing=True)
    out = lm.generate(prompt, **kwargs) if engine == "diffusion" else lm.generate_ar(prompt, **kwargs)
    healed = heal(tok, tok.encode(prompt, add_bos=tok.bos_id is not None))
    # The prompt lost its last token; the first new token puts that text back (and maybe more).
    assert out.sequences[0, : out.prompt_length].tolist() == healed.ids
    first = tok.token_texts()[int(out.new_tokens[0, 0])]
    assert first.startswith("\n")
    # texts start after the original prompt: prompt + text is the whole decoded sequence.
    whole = tok.decode(out.sequences[0, : out.prompt_length + int(out.num_new_tokens[0])].tolist())
    assert prompt + out.texts[0] == whole


def test_batch_heals_each_row_on_its_own(lm):
    prompts = ["def f(x):\n", "x = 1"]
    out = lm.generate(prompts, max_new_tokens=8, seed=0, token_healing=True)
    tok = lm.tokenizer
    for row, prompt in enumerate(prompts):
        healed = heal(tok, tok.encode(prompt, add_bos=tok.bos_id is not None))
        first = tok.token_texts()[int(out.new_tokens[row, 0])]
        assert first.startswith(healed.prefix)
        valid = out.sequences[row, out.prompt_length - len(healed.ids):]
        whole = tok.decode(valid[: len(healed.ids) + int(out.num_new_tokens[row])].tolist())
        assert prompt + out.texts[row] == whole


def test_streamed_commits_match_the_final_text(lm):
    events = list(lm.stream("def add(a, b):\n", max_new_tokens=40, seed=1, token_healing=True, drafts=False))
    commits = [e.texts[0] for e in events if isinstance(e, Commit)]
    done = next(e for e in events if isinstance(e, Done))
    assert len(commits) == 2
    # The first commit drops the healed "\n" just as the final text does; nothing is lost or repeated.
    assert "".join(commits) == done.output.texts[0]


def test_strip_prefix():
    assert strip_prefix("\n    return x", "\n") == "    return x"
    assert strip_prefix("", "\n") == ""  # a row that ended at once has nothing to strip
    assert strip_prefix(" \n", "\n") == " \n"  # a text that does not start with it is left whole


def test_id_prompts_heal_like_text(lm):
    tok = lm.tokenizer
    prompt = "def add(a, b):\n"
    ids = tok.encode(prompt, add_bos=True)
    by_text = lm.generate(prompt, max_new_tokens=8, seed=3, token_healing=True)
    by_ids = lm.generate(torch.tensor(ids), max_new_tokens=8, seed=3, token_healing=True)
    assert torch.equal(by_text.sequences, by_ids.sequences)
    assert by_text.texts == by_ids.texts


def test_healing_errors_are_clear(lm):
    tiny = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="token_healing: needs a model with a tokenizer"):
        tiny.generate(torch.tensor([5, 6, 7]), max_new_tokens=4, token_healing=True)
    # with a template, healing means its holes' edges; the prompt's end is followed by fixed tokens, kept as given
    both = lm.generate("x = ", template="a <|hole|>", token_healing=True, seed=0)
    assert both.texts[0].startswith("a") and both.sequences[0, : len(lm.tokenizer.encode_prompt("x = "))].tolist() \
        == lm.tokenizer.encode_prompt("x = ")


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(["", " ", "x = ", "\n", "a +  ", "\t"]), st.integers(1, 4)),
                      min_size=1, max_size=5))
def test_healed_holes_keep_each_marker_and_its_length(tok, parts):
    """Healing opens a space before a hole into it: every marker stays one hole of its own length (an adjacent
    one has no space before it to take), and the layout shrinks by one position per healed hole."""
    template = "".join(f"{text}<|hole:{n}|>" for text, n in parts) + "\n"
    parsed = parse_template(template, tok, 1, 8)
    healed, prefixes = heal_holes(tok, parsed)
    assert [e - s for s, e in healed.holes[0]] == [e - s for s, e in parsed.holes[0]] == [n for _, n in parts]
    assert len(healed.rows[0]) == len(parsed.rows[0]) - len(prefixes)
    opened = {p for _, p in prefixes}  # each at a hole's start, never one right after another hole
    assert opened <= {s for s, _ in healed.holes[0]}
    assert not any(s in opened for (s, _), (text, _) in zip(healed.holes[0], parts) if text == "" and s > 0)
    fixed = [t for t in healed.rows[0] if t >= 0]  # the fixed tokens that stay, in order
    assert sum(1 for t in healed.rows[0] if t < 0) == sum(n for _, n in parts) and len(fixed) == len(
        [t for t in parsed.rows[0] if t >= 0]) - len(prefixes)


def test_a_prompts_trailing_space_moves_into_a_leading_hole(tok):
    ids = tok.encode_prompt("def f(r):\n    return ")
    [healed], template = heal_into_template(tok, [ids], parse_template([-1, -1, 7], tok, 1, 8))
    assert healed.ids == ids[:-1] and healed.prefix == " " and template.rows == [ids[-1:] + [-1, -1, 7]]
    for prompt, canvas in ((ids, [7, -1]), (ids, [0, -1]), (tok.encode_prompt("def f(r):"), [-1, 7])):  # fixed first
        # (id 0 too, a token like any other); no space
        [healed], template = heal_into_template(tok, [prompt], parse_template(canvas, tok, 1, 8))
        assert healed.ids == prompt and healed.prefix == "" and template.rows == [canvas]


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.sampled_from(["x = ", "def f(r):\n    return ", "a +  ", "y", "z\n"]), min_size=1, max_size=3),
       parts=st.lists(st.tuples(st.sampled_from(["", " ", "x = ", "\n"]), st.integers(1, 4)), min_size=1, max_size=4))
def test_heal_into_template_moves_the_holes_with_the_tokens(tok, prompts, parts):
    """LM._request moved each hole span by hand after heal_into_template put a prompt's space in front of the
    template; the spans now come back with the rows: each still covers its own -1s, with its length, and then
    heal_holes opens the moved space into the first hole."""
    template = "".join(f"{text}<|hole:{n}|>" for text, n in parts) + "\n"
    ids = [tok.encode_prompt(p) for p in prompts]
    parsed = parse_template(template, tok, len(ids), 8)
    healed, moved = heal_into_template(tok, ids, parsed)
    for r, (h, row, spans) in enumerate(zip(healed, moved.rows, moved.holes)):
        shift = len(ids[r]) - len(h.ids)
        assert shift == (1 if h.prefix else 0) and h.ids + row[:shift] == ids[r]
        assert row[shift:] == parsed.rows[r]
        assert [(s - shift, e - shift) for s, e in spans] == parsed.holes[r]
        assert all(row[p] == -1 for s, e in spans for p in range(s, e))
        assert sum(e - s for s, e in spans) == row.count(-1)
    opened, prefixes = heal_holes(tok, moved)
    for r, h in enumerate(healed):
        if h.prefix:  # the template starts with a hole: the space opens into it, which keeps its length
            assert prefixes[(r, 0)] == h.prefix and opened.holes[r][0] == parsed.holes[r][0] == (0, parts[0][1])


class _Vocabulary:
    """What healing reads of a tokenizer, for a vocabulary a test draws: each id's text, and the texts that a longer
    one starts with (Tokenizer.extendable_texts, by its definition). Its id 0 may be whitespace, as the code
    tokenizer's (pad, no text) is not."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def token_texts(self) -> list[str]:
        return self.texts

    def extendable_texts(self) -> frozenset[str]:
        return frozenset(t for t in self.texts if t and any(len(u) > len(t) and u.startswith(t) for u in self.texts))

    def texts_starting_with(self, prefix: str) -> bytes:
        return bytes(t.startswith(prefix) for t in self.texts)


VOCABULARIES = st.lists(st.sampled_from(["", " ", "  ", "\n", "\n  ", "\t", "a", " a", "):"]), min_size=1, max_size=6)


def ids_of(texts: list[str], low: int = -1, **kw):
    """Ids of a drawn vocabulary and past it (a model's vocabulary padded past its tokenizer's: no text), and -1."""
    return st.lists(st.integers(low, len(texts) + 1), **kw)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), texts=VOCABULARIES)
def test_heal_backs_off_exactly_a_whitespace_token_that_could_merge(data, texts):
    """Any vocabulary, any ids: the last token goes iff something stays before it and its text is whitespace that
    a longer token's text starts with; an id with no text (past the texts, or -1) stays. Any sequence comes back
    as a list of its own (the caller's prompt is not the Healed's). Every id is tried last, id 0 too."""
    vocab = _Vocabulary(texts)
    before = data.draw(ids_of(texts, max_size=3))
    for ids in [before, *(before + [t] for t in range(-1, len(texts) + 2))]:
        last = texts[ids[-1]] if ids and 0 <= ids[-1] < len(texts) else ""
        heals = len(ids) >= 2 and not last.strip() and last in vocab.extendable_texts()
        want = Healed(ids[:-1], last) if heals else Healed(ids, "")
        assert heal(vocab, tuple(ids)) == want
        healed = heal(vocab, ids)
        assert healed == want and healed.ids is not ids


@settings(max_examples=60, deadline=None)
@given(data=st.data(), texts=VOCABULARIES)
def test_heal_holes_opens_exactly_the_whitespace_token_before_each_hole(data, texts):
    """A row of parts (fixed ids, then a hole), any vocabulary: each hole takes in the fixed token right before it
    when that is whitespace a longer token extends, keeping its length; a hole right after another (no fixed ids
    between) or after an id with no text takes nothing. Every id is tried before a hole (id 0 too), and before a
    pair of adjacent holes."""
    vocab = _Vocabulary(texts)

    def check(parts: list[tuple[list[int], int]], tail: list[int]) -> None:
        row, spans = [], []
        want_row, want_spans, want_prefixes = [], [], {}
        for fixed, length in parts:
            spans.append((len(row) + len(fixed), len(row) + len(fixed) + length))
            row += fixed + [-1] * length
            text = texts[fixed[-1]] if fixed and fixed[-1] < len(texts) else ""
            opens = not text.strip() and text in vocab.extendable_texts()
            want_row += fixed[:-1] if opens else fixed
            if opens:
                want_prefixes[0, len(want_row)] = text
            want_spans.append((len(want_row), len(want_row) + length))
            want_row += [-1] * length
        healed, prefixes = heal_holes(vocab, Template([row + tail], [spans]))
        assert healed.rows == [want_row + tail] and healed.holes == [want_spans] and prefixes == want_prefixes

    parts = data.draw(st.lists(st.tuples(ids_of(texts, 0, max_size=2), st.integers(1, 3)), min_size=1, max_size=4))
    check(parts, data.draw(ids_of(texts, 0, max_size=2)))
    for t in range(len(texts) + 2):
        check([([t], 1), ([], 2)], [t])


@settings(max_examples=30, deadline=None)
@given(texts=VOCABULARIES, prefix=st.sampled_from(["", " ", "\n"]), extra=st.integers(-3, 3))
def test_allowed_first_tokens_fit_a_vocabulary_of_any_size(texts, prefix, extra):
    """The model's vocabulary may end before the tokenizer's texts or past them: an id is allowed iff it has a text
    that starts with the healed prefix (every id, for a row not healed)."""
    size = max(1, len(texts) + extra)
    mask = allowed_first_tokens(_Vocabulary(texts), [prefix, ""], size)
    assert mask.shape == (2, size) and bool(mask[1].all())
    assert mask[0].tolist() == [not prefix or (i < len(texts) and texts[i].startswith(prefix)) for i in range(size)]


@pytest.fixture(scope="module")
def tiny(tok):
    """A tiny random model with the code tokenizer: the layout checks and healing, without blockpress-code's weights."""
    return blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=tok.vocab_size), seed=0, tokenizer=tok)


@settings(max_examples=3, deadline=None)
@given(b=st.integers(1, 3), c=st.integers(1, 3))
def test_a_batch_of_templates_runs_each_row_at_its_healed_length(tiny, tok, b, c):
    """Healing moves the space before a hole into it, so templates equal as written ran unequal and the other way
    round, and a batch was refused unless the layout that ran matched. Each row now runs its own healed length (or,
    unhealed, its length as written), as it would alone."""
    second = f"x = <|hole:{b}|>\ny = <|hole:{c}|> + 1\n"  # two holes after a space
    runs = [len(heal_holes(tok, parse_template(t, tok, 1, 8))[0].rows[0]) for t in ("return <|hole:1|>\n", second)]
    for a in range(1, runs[1] - runs[0] + 3):  # the one length where both run alike, and those around it
        first = f"return <|hole:{a}|>\n"  # one hole after a space
        written = [len(parse_template(t, tok, 1, 8).rows[0]) for t in (first, second)]
        for healing, lengths in ((None, [runs[0] + a - 1, runs[1]]), (False, written)):
            out = tiny.infill([first, second], token_healing=healing, max_denoising_steps=1, seeds=[1, 2])
            assert out.num_new_tokens.tolist() == lengths and out.new_tokens.shape[1] == max(lengths)
            assert [len(f) for f in out.fills] == [1, 2]
            for r, template in enumerate((first, second)):
                alone = tiny.infill(template, token_healing=healing, max_denoising_steps=1, seed=r + 1)
                assert out.new_tokens[r, : lengths[r]].tolist() == alone.new_tokens[0].tolist()
                assert out.texts[r] == alone.texts[0] and out.fills[r] == alone.fills[0]



class Vocab:
    texts = ["a", "b", "  x", " "]  # id 3 (the last) is a lone space that " x"-like tokens extend

    def token_texts(self):
        return self.texts

    def extendable_texts(self):
        return frozenset({" "})


def test_a_hole_with_no_fixed_token_before_it_is_left_alone():
    """a hole at the start of a row, or right after another, has no fixed token before it: heal_holes
    must not read the vocabulary's last token (index -1) as if it were one. A stub vocabulary whose last token is a
    whitespace that longer tokens extend shows it (the mutant pops a position that is not there, or another hole's)."""
    template = Template(rows=[[-1, -1, 0, -1, -1, -1]], holes=[[(0, 2), (3, 4), (4, 6)]])
    healed, prefixes = heal_holes(Vocab(), template)
    assert healed.rows == template.rows and healed.holes == template.holes and prefixes == {}
