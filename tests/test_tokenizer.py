"""Tests for blockpress.tokenizer: BPE training, exact round trips, checkpoint loading, chat templates."""

from __future__ import annotations

import inspect
import json
import json.decoder
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import processors

from blockpress.tokenizer import GEMMA_CHAT_TEMPLATE, TEMPLATES_KEPT, Tokenizer, train_bpe_tokenizer

SAMPLES = [
    "",
    "def f(x):\n    return x + 1\n",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows newlines",
    "unicode: héllo wörld, 日本語, emoji 🙂🚀",
    "special tokens inline: <bos>a<eos>b<start_of_turn>user\n<|hole|>",
]

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|hole|>"]

TWO_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]

HYPOTHESIS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _training_lines() -> list[str]:
    # Real Python source gives BPE something realistic to merge; a few hundred lines keeps it fast.
    return inspect.getsource(textwrap).splitlines()[:400] + inspect.getsource(json.decoder).splitlines()[:200]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe_tokenizer(_training_lines(), vocab_size=500, special_tokens=SPECIALS)


@pytest.fixture(scope="module")
def saved_dir(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("saved_tokenizer")
    tok.save(folder)
    return folder


@pytest.fixture(scope="module")
def hf_tok(saved_dir: Path) -> Any:
    from transformers import AutoTokenizer  # test-only dependency

    return AutoTokenizer.from_pretrained(str(saved_dir))


def _write_checkpoint(folder: Path, tok: Tokenizer, **files: dict[str, Any] | str) -> Path:
    """A checkpoint folder with tok's tokenizer.json and the given extra files (name -> JSON or text)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        filename = name.replace("__", ".")
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / filename).write_text(text, encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------------------- training


def test_vocab_and_special_token_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 500
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2, 3, 4, 5]
    # Chat generations must stop at <end_of_turn> as well as <eos>.
    assert tok.eos_ids == [1, 4]
    assert tok.special_ids == {0, 1, 2, 3, 4, 5}
    assert tok.chat_template == GEMMA_CHAT_TEMPLATE


def test_training_is_deterministic(tok: Tokenizer) -> None:
    again = train_bpe_tokenizer(_training_lines(), vocab_size=500, special_tokens=SPECIALS)
    assert again.backend.to_str() == tok.backend.to_str()


def test_training_actually_merges(tok: Tokenizer) -> None:
    # BPE merges should make common source text much shorter than its byte count.
    text = "    def __init__(self, width=70):\n        return self.width\n"
    assert len(tok.encode(text)) < len(text.encode("utf-8")) // 2


@HYPOTHESIS
@given(text=st.text())
def test_encode_decode_round_trip_is_exact(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_encode_adds_bos_only_when_asked(tok: Tokenizer) -> None:
    plain = tok.encode("hello world")
    assert tok.bos_id not in plain
    assert tok.encode("hello world", add_bos=True) == [tok.bos_id, *plain]
    assert tok.decode(tok.encode("hello world", add_bos=True)) == "hello world"


def test_encode_lets_other_threads_run(tok: Tokenizer) -> None:
    """The library's `encode` holds the GIL while it works, so a long prompt tokenized in a server's worker thread
    still froze its event loop (240 KB: /health held 0.2 s); encode_batch lets go of it. A thread that ticks while
    another encodes must get to run throughout, and the ids are the backend's own."""
    import concurrent.futures as cf
    import time

    text = "def f(x):\n    return x + 1\n" * 20000  # 560 KB
    assert tok.encode(text[:300]) == tok.backend.encode(text[:300], add_special_tokens=False).ids
    for encode in (tok.encode, tok.encode_plain):
        with cf.ThreadPoolExecutor(1) as pool:
            start = last = time.perf_counter()
            # a future, not an event the worker sets: an encode that raises ends the loop, and result() raises it
            worker = pool.submit(encode, text)
            gaps = []
            while not worker.done():
                assert last - start < 60, f"{encode.__name__} of 560 KB still running after 60 s"
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            ids = worker.result()
        took = time.perf_counter() - start
        assert len(ids) > 1000 and took > 0.02, (len(ids), took)  # long enough to tell
        assert max(gaps) < took / 2, (encode.__name__, max(gaps), took)


def test_decode_skips_special_tokens_by_default(tok: Tokenizer) -> None:
    ids = tok.encode("<start_of_turn>hi<end_of_turn><eos>")
    assert ids[0] == tok.token_to_id("<start_of_turn>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<start_of_turn>hi<end_of_turn><eos>"


def test_a_pad_id_that_is_an_ordinary_token_is_left_out_by_decode(tok: Tokenizer) -> None:
    """The pad id is special wherever a config points it, an ordinary word included, as transformers takes its
    pad_token: decode leaves it out with the BOS and EOS ids (left in, a padded row decodes with words it never had)."""
    word = tok.encode("return")[0]
    padded = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=word)
    assert word in padded.special_ids
    assert padded.decode([word, *tok.encode(" x")]) == " x"


class _CountingBackend:
    """A tokenizers.Tokenizer that counts how often its added tokens are read (the Rust object takes no patches)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self.backend, self.reads = backend, 0

    def get_added_tokens_decoder(self) -> Any:
        self.reads += 1
        return self.backend.get_added_tokens_decoder()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def test_decode_reads_the_added_tokens_once_not_per_call(tok: Tokenizer) -> None:
    """Every decode read all of tokenizer.json's added tokens to find the special ones: 9 ms a decode with 6,000 added
    tokens (0.03 ms to decode), so a terminal's live view spent 660 ms a step decoding a 32-token canvas's drafts.
    What changes the special ids (an EOS id, a token added) is still seen."""
    counting = _CountingBackend(tokenizers.Tokenizer.from_str(tok.backend.to_str()))
    ours = Tokenizer(backend=counting, bos_id=2, eos_ids=[1], pad_id=0)  # type: ignore[arg-type]
    ids = ours.encode("<start_of_turn>hi<end_of_turn><eos>x")
    for _ in range(50):
        assert ours.decode(ids) == "hix"
        assert ours.decode(ids[:1]) == ""  # <start_of_turn> alone
    assert counting.reads == 1
    ours.eos_ids.append(ours.token_to_id("x"))  # in place, as a caller may
    assert ours.decode(ids) == "hi"
    counting.add_special_tokens(["<tool>"])
    assert ours.token_to_id("<tool>") in ours.special_ids
    assert ours.decode(ours.encode("a<tool>b")) == "ab"
    assert counting.reads == 3


def test_post_processor_never_adds_special_tokens(tok: Tokenizer) -> None:
    # Real Gemma tokenizer.json files carry a post-processor that prepends <bos>; encode must ignore it.
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    assert backend.encode("hi", add_special_tokens=True).ids[0] == 2
    gemma_like = Tokenizer(backend=backend, bos_id=2, eos_ids=[1], pad_id=0)
    assert gemma_like.encode("hi") == tok.encode("hi")
    assert gemma_like.encode("hi", add_bos=True) == [2, *tok.encode("hi")]


def test_decode_batch(tok: Tokenizer) -> None:
    batch = [tok.encode(t, add_bos=True) for t in SAMPLES[:3]]
    assert tok.decode_batch(batch) == SAMPLES[:3]


def test_longest_token_counts_the_added_tokens(tok: Tokenizer) -> None:
    """longest_token bounds the characters one token holds, added tokens included: a text longer than a context
    times it cannot fit, refused untokenized, so a bound from the trained words alone refuses a prompt of long
    special tokens that fits."""
    long = "<|a_special_token_longer_than_any_word|>"
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.add_special_tokens([long])
    assert Tokenizer(backend=backend, bos_id=2, eos_ids=[1], pad_id=0).longest_token() == len(long)


def test_token_texts_blank_the_special_tokens_and_extendable_texts_are_those_a_longer_text_starts_with(
        tok: Tokenizer) -> None:
    """What token healing matches on: each id's text, "" for special ones (healing never extends a special token),
    and the texts some longer token's text starts with, found in one sorted pass; here checked against that
    definition by brute force (a text one character shorter than the next included)."""
    texts = tok.token_texts()
    assert [texts[i] for i in sorted(tok.special_ids)] == [""] * len(tok.special_ids)
    distinct = set(texts) - {""}
    expected = {a for a in distinct if any(b != a and b.startswith(a) for b in distinct)}
    assert tok.extendable_texts() == expected
    assert any(b.startswith(a) and len(b) == len(a) + 1 for a in expected for b in distinct)
    # the texts every later healing matches on, and the ids every later generation bans, are no caller's to edit:
    # both were the tokenizer's own lists, and `texts[:] = [t.strip() for t in texts]` changed later generations
    with pytest.raises(TypeError):
        texts[0] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        tok.unknown_ids(tok.vocab_size + 3)[0] = 0  # type: ignore[index]


def test_unknown_ids_keeps_a_few_limits_and_names_a_bad_one(tok: Tokenizer) -> None:
    """Every distinct limit's ids were kept forever (300 limits: 2.9M ids, 106 MB), and a limit of None or -5 raised
    from inside range() or gave () unsaid."""
    from blockpress.tokenizer import TEMPLATES_KEPT

    for i in range(3 * TEMPLATES_KEPT):
        assert tok.unknown_ids(tok.vocab_size + i) == tuple(range(tok.vocab_size, tok.vocab_size + i))
    assert len(tok._unknown_ids) == TEMPLATES_KEPT
    for bad in (None, -5, 2.5, True):
        with pytest.raises(ValueError, match="limit: expected a vocabulary size"):
            tok.unknown_ids(bad)  # type: ignore[arg-type]


def test_texts_starting_with_is_the_scan_kept_for_a_few_prefixes(tok: Tokenizer) -> None:
    """Token healing's mask of a prefix (a byte per id: its text starts with it) is kept, as a scan of every token's
    text costs 36 ms at 262,144 tokens, for the PREFIXES_KEPT prefixes used last: a caller passing a new prefix each
    time keeps a few, not one more every call. Bytes: no caller can edit the mask later rows read."""
    from blockpress.tokenizer import PREFIXES_KEPT

    texts = tok.token_texts()
    for prefix in ("\n", " ", "", "\n" + " " * 8, "x"):
        assert tok.texts_starting_with(prefix) == bytes(t.startswith(prefix) for t in texts)
    assert tok.texts_starting_with(" ") is tok.texts_starting_with(" ")  # kept, not scanned again
    for i in range(3 * PREFIXES_KEPT):
        assert tok.texts_starting_with(" " * i) == bytes(t.startswith(" " * i) for t in texts)
    assert len(tok._prefix_masks) == PREFIXES_KEPT
    with pytest.raises(TypeError):
        tok.texts_starting_with(" ")[0] = 0  # type: ignore[index]


def test_add_bos_without_bos_token_is_an_error(tok: Tokenizer) -> None:
    no_bos = Tokenizer(backend=tok.backend, eos_ids=[1], pad_id=0)
    with pytest.raises(ValueError, match="BOS"):
        no_bos.encode("x", add_bos=True)


# ----------------------------------------------------------------------------------- save / load


def test_save_from_dir_round_trip(tok: Tokenizer, saved_dir: Path) -> None:
    loaded = Tokenizer.from_dir(saved_dir)
    assert (loaded.bos_id, loaded.eos_ids, loaded.pad_id) == (tok.bos_id, tok.eos_ids, tok.pad_id)
    assert loaded.special_ids == tok.special_ids
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.chat_template == tok.chat_template
    assert loaded.add_bos_token is True
    for text in SAMPLES:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.apply_chat_template(TWO_TURNS) == tok.apply_chat_template(TWO_TURNS)


def test_from_dir_expands_a_home_path(tok: Tokenizer, saved_dir: Path, monkeypatch) -> None:
    """`load("~/m")` expanded the ~ but Tokenizer.from_dir("~/m"), which error messages point to, said the folder
    had no tokenizer.json."""
    monkeypatch.setenv("HOME", str(saved_dir.parent))
    assert Tokenizer.from_dir(f"~/{saved_dir.name}").vocab_size == tok.vocab_size


@pytest.mark.skipif(sys.platform in ("win32", "darwin"), reason="file names there are Unicode, not bytes")
def test_a_folder_named_in_bytes_that_are_not_utf8_saves_and_loads(tok: Tokenizer, tmp_path: Path) -> None:
    """`blockpress quantize $'q\\xff'` and `train --out` such a folder failed: the tokenizers library's own save
    refused the path ("surrogates not allowed"), where every other file of the save was written. Python writes it."""
    import blockpress

    folder = tmp_path / "q\udcff"  # the byte 0xff, as Python holds a file name that is not UTF-8
    tok.save(folder)
    assert Tokenizer.from_dir(folder).encode(SAMPLES[0]) == tok.encode(SAMPLES[0])
    assert json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")) == json.loads(tok.backend.to_str())
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=tok.vocab_size), tokenizer=tok)
    lm.save(tmp_path / "m\udcff")
    assert blockpress.load(tmp_path / "m\udcff").tokenizer.encode(SAMPLES[0]) == tok.encode(SAMPLES[0])


def test_transformers_loads_saved_tokenizer(hf_tok: Any) -> None:
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (2, 1, 0)


@pytest.mark.parametrize("text", SAMPLES)
def test_transformers_encodes_samples_identically(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_transformers_encodes_identically(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)


def test_missing_tokenizer_json_names_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "no_tokenizer_here"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as excinfo:
        Tokenizer.from_dir(folder)
    assert str(folder) in str(excinfo.value)
    assert "tokenizer.json" in str(excinfo.value)
    assert "token ids" in str(excinfo.value)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json"])
@pytest.mark.parametrize("text", ['{"bos_token": "<bos>"', "[1, 2]", "\udcff"])
def test_a_damaged_config_file_is_named(tok: Tokenizer, saved_dir: Path, tmp_path: Path, name: str, text: str) -> None:
    """A cut-off or wrong tokenizer config gave json's own error ("Expecting ',' delimiter: line 1 column 21"),
    naming no file."""
    import shutil

    folder = shutil.copytree(saved_dir, tmp_path / "ckpt")
    (folder / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=rf"{name}: (not valid JSON|expected a JSON object, got list)"):
        Tokenizer.from_dir(folder)


@pytest.mark.parametrize("text", ["{bad", "[1]", "{}", "\udcff"])
def test_a_damaged_tokenizer_json_is_named(saved_dir: Path, tmp_path: Path, text: str) -> None:
    """The tokenizers library raised a bare Exception ("key must be a string at line 1 column 2", "Model missing."),
    naming no file and missed by `except ValueError`, as the CLI's handler missed it (a traceback, exit 1)."""
    import shutil

    folder = shutil.copytree(saved_dir, tmp_path / "ckpt")
    (folder / "tokenizer.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    why = r"not UTF-8 \(byte 0xff at byte 1\)" if text == "\udcff" else "not a tokenizer the "
    with pytest.raises(ValueError, match=rf"^{re.escape(str(folder / 'tokenizer.json'))}: {why}"):
        Tokenizer.from_dir(folder)


def test_eos_list_in_generation_config_is_read(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_checkpoint(
        tmp_path / "ckpt",
        tok,
        tokenizer_config__json={"bos_token": "<bos>", "pad_token": "<pad>"},
        generation_config__json={"eos_token_id": [4, 1], "bos_token_id": 2},
    )
    loaded = Tokenizer.from_dir(folder)
    assert loaded.eos_ids == [4, 1]
    assert loaded.eos_id == 4


def test_eos_token_string_comes_first_then_generation_config_ids(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_checkpoint(
        tmp_path / "ckpt",
        tok,
        tokenizer_config__json={"eos_token": {"content": "<eos>", "special": True}},
        generation_config__json={"eos_token_id": [5, 1]},
        config__json={"eos_token_id": 3},
    )
    assert Tokenizer.from_dir(folder).eos_ids == [1, 5, 3]


def test_a_negative_config_id_is_no_token(tok: Tokenizer, tmp_path: Path) -> None:
    """LLaMA's configs say pad_token_id -1 for no pad token: the tokenizers library failed on it ("number too small
    to fit in target type") at the load, and on an eos_token_id -1 at the first stop string."""
    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json={"eos_token": "<eos>"},
                               config__json={"pad_token_id": -1, "eos_token_id": [-1, 3], "bos_token_id": -1})
    loaded = Tokenizer.from_dir(folder)
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_ids) == (None, None, [1, 3])
    assert "<eos>" in loaded.special_texts()


@pytest.mark.parametrize("eos_ids", [[4, 1, 3], [1]])
def test_eos_ids_changed_since_loading_are_saved_over_the_folders_own_list(tok: Tokenizer, tmp_path: Path,
                                                                           eos_ids: list[int]) -> None:
    """Saved back into a folder whose generation_config.json lists EOS ids, a changed list was not written (the file
    said eos_token_id already), so a reload gave the old one; an unchanged one leaves the file as it was."""
    gen = {"eos_token_id": [4, 1], "max_new_tokens": 7}
    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json={"bos_token": "<bos>"},
                               generation_config__json=gen)
    loaded = Tokenizer.from_dir(folder)
    loaded.save(folder)
    assert json.loads((folder / "generation_config.json").read_text()) == gen
    loaded.eos_ids = eos_ids
    loaded.save(folder)
    assert json.loads((folder / "generation_config.json").read_text()) == {**gen, "eos_token_id": eos_ids}
    assert Tokenizer.from_dir(folder).eos_ids == eos_ids


def test_a_tokenizer_writes_its_eos_list_only_where_the_folder_names_none(tok: Tokenizer, tmp_path: Path) -> None:
    """A list of EOS ids goes to generation_config.json, where transformers reads it. A folder's own file keeps its
    eos_token_id (LM.save writes the model's first: its EOS set stays); a single EOS id, which the config's
    eos_token says, writes no file at all."""
    two = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1, 4], pad_id=0)
    gen = {"eos_token_id": 7, "temperature": 0.5}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps(gen))
    two.save(tmp_path / "model")
    assert json.loads((tmp_path / "model" / "generation_config.json").read_text()) == gen
    two.save(tmp_path / "fresh")
    assert json.loads((tmp_path / "fresh" / "generation_config.json").read_text()) == {"eos_token_id": [1, 4]}
    Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0).save(tmp_path / "one")
    assert not (tmp_path / "one" / "generation_config.json").exists()


def test_extra_eos_id_that_is_an_ordinary_token_is_special(tok: Tokenizer, tmp_path: Path) -> None:
    # A stop id from generation_config.json that tokenizer.json does not mark special must still be
    # treated as special: reported in special_ids and dropped by decode.
    stop_id = tok.encode("return")[0]
    folder = _write_checkpoint(
        tmp_path / "ckpt",
        tok,
        tokenizer_config__json={"eos_token": "<eos>"},
        generation_config__json={"eos_token_id": [1, stop_id]},
    )
    loaded = Tokenizer.from_dir(folder)
    assert loaded.eos_ids == [1, stop_id]
    assert stop_id in loaded.special_ids
    assert loaded.decode([*tok.encode("x = 1"), stop_id]) == "x = 1"


def test_config_json_ids_are_fallbacks(tok: Tokenizer, tmp_path: Path) -> None:
    # No token strings anywhere: ids come from config.json (here nested like multimodal checkpoints).
    folder = _write_checkpoint(
        tmp_path / "ckpt",
        tok,
        config__json={"text_config": {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}},
    )
    loaded = Tokenizer.from_dir(folder)
    assert (loaded.bos_id, loaded.eos_ids, loaded.pad_id) == (2, [1], 0)
    assert loaded.chat_template is None
    assert loaded.add_bos_token is False


@pytest.mark.parametrize("layout", ["older", "current"])
def test_special_tokens_map_and_the_config_disagreeing_read_as_transformers_reads_them(tok: Tokenizer, tmp_path: Path,
                                                                                      layout: str) -> None:
    """transformers 5 reads special_tokens_map.json only beside a tokenizer_config.json without added_tokens_decoder
    (the older layout), where the map's tokens override the config's; in the current layout it ignores the file.
    blockpress let the config win the ids in the older layout and the map name the template's tokens in both, so a
    template rendered other tokens (and the older layout stopped on another EOS)."""
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<|hole|>",
              "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|"
                               "{% for m in messages %}{{ m.content }}{% endfor %}"}
    if layout == "current":
        config["added_tokens_decoder"] = {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for i, t in enumerate(SPECIALS)}
    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json=config, special_tokens_map__json={
        "bos_token": {"content": "<start_of_turn>", "lstrip": False}, "eos_token": "<end_of_turn>",
        "pad_token": {"content": "<eos>"}, "unk_token": "<pad>"})
    ours, theirs = Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.apply_chat_template(TWO_TURNS) == theirs.apply_chat_template(TWO_TURNS, tokenize=False)
    assert (ours.bos_id, ours.eos_ids[0], ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                           theirs.pad_token_id)
    assert ours.bos_id == (3 if layout == "older" else 2)  # the two layouts do differ


@pytest.mark.parametrize("where", ["top level", "extra_special_tokens"])
def test_a_model_specific_token_the_config_names_wins_over_the_older_map(tok: Tokenizer, tmp_path: Path,
                                                                         where: str) -> None:
    """In the older layout the map's standard tokens win, but a model-specific one (image_token) that the config
    names wins over the map's (transformers takes the map's as a fallback): the map's won here, and a template
    rendered another token."""
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<pad>",
              "chat_template": "{{ image_token }}|{{ audio_token }}|{{ unk_token }}|"
                               "{% for m in messages %}{{ m.content }}{% endfor %}"}
    if where == "top level":
        config["image_token"] = "<start_of_turn>"
    else:
        config["extra_special_tokens"] = {"image_token": "<start_of_turn>"}
    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json=config, special_tokens_map__json={
        "image_token": "<end_of_turn>", "audio_token": "<eos>", "unk_token": "<bos>"})
    ours, theirs = Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.apply_chat_template(TWO_TURNS) == theirs.apply_chat_template(TWO_TURNS, tokenize=False)
    assert ours.apply_chat_template(TWO_TURNS).startswith("<start_of_turn>|<eos>|<bos>|")


def test_chat_template_list_takes_default(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_checkpoint(
        tmp_path / "ckpt",
        tok,
        tokenizer_config__json={
            "bos_token": "<bos>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT {{ messages | length }}"},
            ],
        },
    )
    assert Tokenizer.from_dir(folder).apply_chat_template(TWO_TURNS) == "DEFAULT 2"


def test_chat_template_jinja_file_wins(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_checkpoint(
        tmp_path / "ckpt",
        tok,
        tokenizer_config__json={"bos_token": "<bos>", "chat_template": "FROM JSON"},
        chat_template__jinja="FROM FILE {{ bos_token }}",
    )
    assert Tokenizer.from_dir(folder).apply_chat_template(TWO_TURNS) == "FROM FILE <bos>"


def test_a_tokenizer_json_saved_on_windows_loads_and_one_not_utf8_is_named(tok: Tokenizer, tmp_path: Path) -> None:
    """tokenizer.json with a UTF-8 byte-order mark (Notepad's "UTF-8 with BOM") was refused as "expected value at
    line 1 column 1"; one holding a Latin-1 byte as "stream did not contain valid UTF-8", naming no byte."""
    plain = _write_checkpoint(tmp_path / "plain", tok)
    data = (plain / "tokenizer.json").read_bytes()
    edited = _write_checkpoint(tmp_path / "edited", tok)
    (edited / "tokenizer.json").write_bytes(b"\xef\xbb\xbf" + data.replace(b"\n", b"\r\n"))
    text = "def grüße(x):\n    return x  # ✓\n"
    assert Tokenizer.from_dir(edited).encode(text) == Tokenizer.from_dir(plain).encode(text) == tok.encode(text)
    at = data.index(b'"')
    for mark in (b"", b"\xef\xbb\xbf"):
        (edited / "tokenizer.json").write_bytes(mark + data[:at] + "é".encode("latin-1") + data[at:])
        with pytest.raises(ValueError, match=re.escape(f"{edited / 'tokenizer.json'}: not UTF-8 (byte 0xe9 at byte "
                                                       f"{len(mark) + at + 1})")):
            Tokenizer.from_dir(edited)


# ---------------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("name", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
def test_a_template_file_that_is_not_utf8_is_named(tok: Tokenizer, tmp_path: Path, name: str) -> None:
    """A chat_template.jinja saved as Latin-1 ended loading (any command, plain prompts too) with the codec's own
    "'utf-8' codec can't decode byte 0xe9 in position 18", which named no file."""
    folder = _write_checkpoint(tmp_path / "ckpt", tok)
    (folder / name).parent.mkdir(exist_ok=True)
    for mark in (b"", b"\xef\xbb\xbf"):  # the byte named at its offset in the file (a BOM's 3 bytes counted)
        (folder / name).write_bytes(mark + "{{ bos_token }}café".encode("latin-1"))
        with pytest.raises(ValueError, match=re.escape(f"{folder / name}: a chat template is UTF-8 text, and this is "
                                                       f"not (byte 0xe9 at byte {19 + len(mark)})")):
            Tokenizer.from_dir(folder)


@pytest.mark.parametrize("name", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja"])
def test_a_template_file_saved_on_windows_renders_as_the_plain_one(tok: Tokenizer, tmp_path: Path, name: str) -> None:
    """A template file saved with a UTF-8 byte-order mark (Notepad's "UTF-8 with BOM") put U+FEFF before the BOS of
    every prompt it rendered; CRLF line endings (and no newline at the end) render as LF ones."""
    template = "[{{ messages[0]['content'] }}]\n[{{ messages[1]['content'] }}]\n"
    rendered = []
    for variant, data in [("plain", template.encode()), ("bom", b"\xef\xbb\xbf" + template.encode()),
                          ("crlf", template.replace("\n", "\r\n").encode()),
                          ("both", b"\xef\xbb\xbf" + template.rstrip("\n").replace("\n", "\r\n").encode())]:
        folder = _write_checkpoint(tmp_path / variant, tok)
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)
        loaded = Tokenizer.from_dir(folder)
        rendered.append(loaded.apply_chat_template(TWO_TURNS, chat_template=None if name.startswith("chat") else
                                                   "tool_use"))
    assert rendered[0].startswith("[What is 2+2?]\n[4.]")
    assert rendered[1:3] == [rendered[0], rendered[0]] and rendered[3] == rendered[0].removesuffix("\n")


def test_chat_template_with_generation_prompt(tok: Tokenizer) -> None:
    expected = (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert tok.apply_chat_template(TWO_TURNS) == expected


def test_chat_template_without_generation_prompt(tok: Tokenizer) -> None:
    expected = "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4.<end_of_turn>\n"
    assert tok.apply_chat_template(TWO_TURNS, add_generation_prompt=False) == expected


@pytest.mark.parametrize("after, turn_end", [("<end_of_turn>\n", "<end_of_turn>"), ("\nhello", None)])
def test_the_turn_end_is_the_special_token_a_template_writes_after_a_reply(tok: Tokenizer, after: str,
                                                                          turn_end: str | None) -> None:
    """turn_end_id: the special token the template writes right after an assistant message's text, what a reply
    trained on ends with; where it writes plain text there, none (not the text's first token, "\n", which
    training would then teach every reply to end with)."""
    ours = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0,
                     chat_template=f"{{% for m in messages %}}{{{{ m.content }}}}{after}{{% endfor %}}")
    assert ours.turn_end_id() == (None if turn_end is None else tok.token_to_id(turn_end))


def test_the_generation_prompt_is_what_add_generation_prompt_adds(tok: Tokenizer) -> None:
    """generation_prompt_ids: the turn header add_generation_prompt=True ends a rendering with (what lm.chat_ids
    refuses to heal), tokenized in context; [] for a template that adds none, or cannot render a user message."""
    ours = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0, chat_template=GEMMA_CHAT_TEMPLATE)
    header = ours.generation_prompt_ids()
    assert ours.decode(header, skip_special_tokens=False) == "<start_of_turn>model\n"
    assert ours.apply_chat_template(TWO_TURNS, tokenize=True)[-len(header):] == header
    assert ours.generation_prompt_ids("{% for m in messages %}{{ m.content }}{% endfor %}") == []
    assert ours.generation_prompt_ids("{{ raise_exception('no') }}") == []
    # a template that ends a chat otherwise without the prompt (an <eos> in its else branch) has one all the same:
    # the rendering without it is no start of the one with it
    eos_else = GEMMA_CHAT_TEMPLATE.replace("{%- if add_generation_prompt -%}", "{%- if not add_generation_prompt -%}"
                                           "{{ eos_token }}{%- endif -%}{%- if add_generation_prompt -%}")
    assert eos_else != GEMMA_CHAT_TEMPLATE
    assert ours.generation_prompt_ids(eos_else) == header


def test_template_texts_kept_compiled_are_bounded(tok: Tokenizer) -> None:
    """Every template text a caller passed stayed compiled for good (16 KB each: a notebook or app writing a date or
    a name into its template, 300 calls, 4.9 MB), and so did the turn-end id of every chat_template set. Now the
    TEMPLATES_KEPT used last are kept: each text still renders as its own, and one used again is not compiled again."""
    ours = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0, chat_template=GEMMA_CHAT_TEMPLATE)
    texts = [GEMMA_CHAT_TEMPLATE + f"{{{{- '#{i}' -}}}}" for i in range(TEMPLATES_KEPT + 8)]
    default = ours.apply_chat_template(TWO_TURNS)
    for i, text in enumerate(texts):
        assert ours.apply_chat_template(TWO_TURNS, chat_template=text) == default + f"#{i}"
        assert ours.apply_chat_template(TWO_TURNS) == default  # the tokenizer's own, kept throughout
        ours.chat_template = text
        assert ours.turn_end_id() == ours.token_to_id("<end_of_turn>")
        ours.chat_template = GEMMA_CHAT_TEMPLATE
    assert len(ours._compiled_templates) == len(ours._turn_ends) == TEMPLATES_KEPT
    compiled = ours._template(GEMMA_CHAT_TEMPLATE)
    ours.apply_chat_template(TWO_TURNS, chat_template=texts[0])
    assert ours._template(GEMMA_CHAT_TEMPLATE) is compiled


def test_templates_kept_compiled_are_shared_safely_by_threads(tok: Tokenizer) -> None:
    """The server renders chats in worker threads on one tokenizer: with more template texts in use than are kept,
    one thread's eviction must not pull an entry from under another between its test and its read (a KeyError), nor
    hand it another text's template."""
    from concurrent.futures import ThreadPoolExecutor

    ours = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0, chat_template=GEMMA_CHAT_TEMPLATE)
    default = ours.apply_chat_template(TWO_TURNS)
    texts = [GEMMA_CHAT_TEMPLATE + f"{{{{- '#{i}' -}}}}" for i in range(TEMPLATES_KEPT * 2)]

    def render(i: int) -> bool:
        return ours.apply_chat_template(TWO_TURNS, chat_template=texts[i % len(texts)]) == default + f"#{i % len(texts)}"

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(render, range(len(texts) * 2)))
    assert len(ours._compiled_templates) <= TEMPLATES_KEPT


def test_system_message_is_folded_into_first_user_turn(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be terse."}, *TWO_TURNS]
    expected = (
        "<bos><start_of_turn>user\nBe terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected


CONVERSATIONS = [
    TWO_TURNS,
    [{"role": "user", "content": "only one turn"}],
    [{"role": "system", "content": "sys"}, *TWO_TURNS, {"role": "user", "content": "and 3+3?"}],
    [{"role": "system", "content": "system alone"}],
    [{"role": "user", "content": "  spaces, tabs\t and\nnewlines  \n"}, {"role": "model", "content": "ok"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs


def test_tokenized_chat_has_exactly_one_bos(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template(TWO_TURNS, tokenize=True)
    assert isinstance(ids, list)
    assert ids[0] == tok.bos_id
    assert ids.count(tok.bos_id) == 1
    assert ids == tok.encode(str(tok.apply_chat_template(TWO_TURNS)))
    prompt = tok.encode("<start_of_turn>model\n")
    assert ids[-len(prompt) :] == prompt


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([{"role": "user", "content": "hi"}, {"content": "no role"}], r"Message 1 .*'role'"),
        ([{"role": "user", "content": 42}], r"Message 0 .*'content'.*int"),
        ([], "an empty conversation"),
        ([{"role": None, "content": "x"}], r"Message 0 .*'role'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, "text"], r"Message 2 "),
    ],
)
def test_bad_messages_name_the_index(tok: Tokenizer, messages: list[Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        tok.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="system"):
        tok.apply_chat_template([*TWO_TURNS, {"role": "system", "content": "late"}])
    with pytest.raises(ValueError, match="Unsupported chat role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_no_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(TWO_TURNS)


@pytest.mark.parametrize("template, cause", [
    ("{{ messages[0].nope.x }}", "rendering failed: UndefinedError"),
    ("{{ 1 // 0 }}", "rendering failed: ZeroDivisionError"),  # escaped as a bare traceback before
    ("{% for m in messages %}", "not a valid template"),
    ("{{ messages | no_such_filter }}", "not a valid template"),
    # past Python's limits on the code jinja writes: SyntaxError, IndentationError, RecursionError escaped (a 500 from
    # the server, a 3,000-line traceback from `blockpress chat`)
    ("{% for a in messages %}" * 21 + "{% endfor %}" * 21, "not a valid template: nested too deeply for Python"),
    ("{% if messages %}" * 120 + "{% endif %}" * 120, "not a valid template: nested too deeply for Python"),
    ("{{ " + "1+(" * 400 + "1" + ")" * 400 + " }}", "not a valid template: nested too deeply for Python"),
    ("", "rendered no text for 2 message"),  # an empty chat_template.jinja: an empty prompt, refused as "prompt: ..."
    ("{# none yet #}\n", "rendered no text for 2 message"),
    ("{% for m in messages %} \n{% endfor %}", "rendered no text for 2 message"),  # whitespace alone: no text either
])
def test_a_broken_chat_template_is_a_clear_error(tok: Tokenizer, template: str, cause: str) -> None:
    """A syntax error was wrapped twice ("chat_template: rendering failed: ValueError: chat_template: not a valid
    template: ...") and an unknown filter's came with a second line ('File "<introspection>"')."""
    broken = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], chat_template=template)
    with pytest.raises(ValueError) as caught:
        broken.apply_chat_template(TWO_TURNS)
    message = str(caught.value)
    assert message.startswith(f"chat_template: {cause}") and "\n" not in message, message


TRANSFORMERS_HABITS = (
    "{% if tools is none %}no tools{% else %}tools{% endif %}|{% if documents is none %}no docs{% endif %}|"
    "{{ bos_token }}|{% for m in messages %}{% generation %}{{ m.role }}:"
    "{% if m.content is string %}{{ m.content }}{% else %}{{ m.content[0].text }}{% endif %}"
    "{% endgeneration %};{% endfor %}|{{ strftime_now('%Y') | length }}"
)


def test_templates_see_what_transformers_gives_them(tok: Tokenizer, tmp_path: Path) -> None:
    """tools / documents are None (not undefined), {% generation %} renders its body, strftime_now exists, a
    caller's variable wins over the tokenizer's, and list contents pass: as in transformers, compared directly."""
    from transformers import AutoTokenizer

    with_template = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0, chat_template=TRANSFORMERS_HABITS)
    with_template.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    for kwargs in ({}, {"bos_token": "B"}, {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        ours = with_template.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
        assert ours == hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=False, **kwargs)
    assert ours.startswith("tools|no docs|<bos>|user:hi;assistant:yo;|4")
    with pytest.raises(ValueError, match="messages: an empty conversation"):
        with_template.apply_chat_template([])


def test_transformers_adds_bos_to_plain_prompts_as_blockpress_does(tok: Tokenizer, saved_dir: Path) -> None:
    """A trained tokenizer carries the post-processor Gemma's have, so transformers' encode puts BOS in front of
    a plain prompt, as blockpress's prompts have it (before: transformers users fed the model a different prompt)."""
    from transformers import AutoTokenizer

    from blockpress.generate import encode_texts
    from blockpress.lm import MODELS_DIR

    for folder, ours in ((saved_dir, tok), (MODELS_DIR / "blockpress-code", Tokenizer.from_dir(MODELS_DIR / "blockpress-code"))):
        hf = AutoTokenizer.from_pretrained(str(folder))
        for text in ("def f(x):", "hello world", ""):
            assert hf.encode(text) == encode_texts([text], ours)[0]


@pytest.mark.parametrize("edit", [
    lambda c: c.update(bos_token=None, eos_token=None),  # named null: no such token
    lambda c: [c.pop("bos_token"), c.pop("pad_token")],  # not named (config.json still gives their ids)
    lambda c: None,
])
def test_a_template_sees_the_special_tokens_the_tokenizer_config_names(tmp_path: Path, edit) -> None:
    """A chat template's bos_token, eos_token and pad_token are the tokens the tokenizer config names, as in
    transformers: one whose id came from config.json alone rendered as its token ("<bos>"), where transformers renders
    nothing, so the same conversation became another prompt. Saved and loaded again, the folder renders the same."""
    import shutil

    from transformers import AutoTokenizer

    from blockpress.lm import MODELS_DIR

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(MODELS_DIR / "blockpress-code" / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}]{{ messages[0]['content'] }}"
    edit(config)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(messages, tokenize=False)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.apply_chat_template(messages) == theirs
    assert ours.bos_id == 2  # (its id still starts plain prompts)
    ours.save(tmp_path / "saved")
    assert Tokenizer.from_dir(tmp_path / "saved").apply_chat_template(messages) == theirs


def test_saving_leaves_no_stale_template_file(tok: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("OLD {{ messages[0].content }}")
    Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], chat_template="NEW {{ messages[0].content }}").save(tmp_path)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "NEW x"


def test_a_save_that_fails_part_way_keeps_the_template_files(tok: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    """chat_template.jinja was deleted, then written in place: a save stopped while writing it left half a template
    (every chat render failed), and one stopped between, none (the model loaded without one)."""
    Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1]).save(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("OLD {{ messages[0].content }}")
    ours = Tokenizer.from_dir(tmp_path)
    real = Path.write_text

    def half_then_full_disk(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if "chat_template.jinja" in self.name:
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError("No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(OSError, match="No space left"):
        ours.save(tmp_path)
    monkeypatch.undo()
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "OLD x"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_save_removes_template_temporaries_a_killed_save_left(tok: Tokenizer, tmp_path: Path) -> None:
    """A named template's temporary, left by a save killed part-way, stayed for good (its name not written again)."""
    from blockpress.tokenizer import NAMED_TEMPLATES_DIR

    (tmp_path / NAMED_TEMPLATES_DIR).mkdir()
    (tmp_path / NAMED_TEMPLATES_DIR / ".tool_use.jinja.tmp").write_text("half a templ")
    Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], chat_template="NEW").save(tmp_path)
    assert not (tmp_path / NAMED_TEMPLATES_DIR).exists()


# A Gemma-like checkpoint's tokenizer files, as google's are laid out: the class, left padding, model-specific token
# names at the top level, an unnamed extra_special_tokens list, a special_tokens_map.json and a chat_template.jinja.
GEMMA_LIKE_ADDED = ["<unk>", "<mask>", "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<|turn>", "<turn|>"]
GEMMA_LIKE_CONFIG = {
    "tokenizer_class": "GemmaTokenizer", "padding_side": "left", "add_bos_token": True, "add_eos_token": False,
    "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
    "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
    "extra_special_tokens": ["<|turn>", "<turn|>"], "clean_up_tokenization_spaces": False,
    "model_max_length": 1000000000000000019884624838656,
}
GEMMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content | trim }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
GEMMA_LIKE_SAMPLE = "<|turn>user\ndef f(x):  return x<turn|>\n<start_of_image><image_soft_token><end_of_image>"


def _gemma_like_checkpoint(folder: Path) -> Path:
    gemma_like = train_bpe_tokenizer(_training_lines(), vocab_size=512, special_tokens=SPECIALS + GEMMA_LIKE_ADDED)
    return _write_checkpoint(
        folder, gemma_like, tokenizer_config__json=GEMMA_LIKE_CONFIG, chat_template__jinja=GEMMA_LIKE_TEMPLATE,
        special_tokens_map__json={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
    )


def _as_transformers_sees_it(folder: Path) -> dict[str, Any]:
    """What transformers' AutoTokenizer makes of a folder, as plain values to compare."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    named = hf.special_tokens_map  # transformers 5: the model-specific names (boi_token, ...) too
    return {
        "class": type(hf).__name__,
        "padding_side": hf.padding_side,
        "named": {name: (token, hf.convert_tokens_to_ids(token)) for name, token in named.items()},
        "extra": list(zip(hf.extra_special_tokens, hf.extra_special_tokens_ids, strict=True)),
        "chat_template": hf.chat_template,
        "encode": hf.encode(GEMMA_LIKE_SAMPLE),
        "chat": hf.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True),
        "batch": hf(["def", GEMMA_LIKE_SAMPLE], padding=True)["input_ids"],
        "decode": hf.decode(hf.encode("x , y ."), skip_special_tokens=True),
    }


def _behaviour(ours: Tokenizer) -> dict[str, Any]:
    return {
        "ids": (ours.bos_id, ours.eos_ids, ours.pad_id, ours.add_bos_token), "named": ours.named_tokens,
        "chat_template": ours.chat_template, "encode": ours.encode_prompt(GEMMA_LIKE_SAMPLE),
        "chat": ours.apply_chat_template(TWO_TURNS),
    }


def test_lm_save_keeps_a_checkpoints_tokenizer_as_transformers_reads_it(tmp_path: Path) -> None:
    """lm.save wrote tokenizer_config.json from scratch: transformers loaded the saved folder as a plain fast tokenizer
    padding on the right, without the image token names, the extra special tokens or special_tokens_map.json."""
    import warnings

    import blockpress
    from blockpress.config import ModelConfig

    blockpress.random_model(ModelConfig.tiny(vocab_size=512)).save(tmp_path / "ckpt")
    original = _gemma_like_checkpoint(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(original)
    lm.save(tmp_path / "saved")
    before = _as_transformers_sees_it(original)
    assert before["class"] == "GemmaTokenizer" and before["padding_side"] == "left"
    assert before["named"]["image_token"] == ("<image_soft_token>", len(SPECIALS) + 4)
    assert before["batch"][0][0] == 0  # the short row is padded on the left, with <pad>
    assert _as_transformers_sees_it(tmp_path / "saved") == before
    assert (tmp_path / "saved" / "special_tokens_map.json").is_file()
    again = Tokenizer.from_dir(tmp_path / "saved")
    assert _behaviour(again) == _behaviour(lm.tokenizer) == _behaviour(Tokenizer.from_dir(original))


def test_a_tokenizer_larger_than_the_model_is_said_at_load(tmp_path: Path) -> None:
    """A checkpoint whose tokenizer.json has more tokens than config.json's vocab_size loaded without a word (as the
    reference loads it), and its first text whose ids pass the embedding failed at generate. Said at load now."""
    import shutil

    import blockpress
    from blockpress.config import ModelConfig

    blockpress.random_model(ModelConfig.tiny(vocab_size=96)).save(tmp_path / "ckpt")
    code = blockpress.load("blockpress-code")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(code.path / name, tmp_path / "ckpt" / name)
    with pytest.warns(UserWarning, match=rf"tokenizer.json: {code.tokenizer.vocab_size} tokens, more than config.json's "
                                         r"vocab_size of 96: its ids past 95 have no embedding"):
        lm = blockpress.load(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
        lm.generate("def add(a, b): return a + b", max_new_tokens=8, max_denoising_steps=2, seed=0)


def test_save_changes_only_the_settings_changed_since_loading(tmp_path: Path) -> None:
    """Settings changed after loading are saved where the files keep them; everything else stays as loaded."""
    original = _gemma_like_checkpoint(tmp_path / "ckpt")
    ours = Tokenizer.from_dir(original)
    ours.pad_id = ours.token_to_id("<mask>")
    ours.named_tokens["image_token"] = "<|hole|>"
    ours.named_tokens["audio_token"] = "<start_of_turn>"
    del ours.named_tokens["unk_token"]
    ours.chat_template = "NEW {{ messages[0].content }}"
    ours.add_bos_token = False
    ours.save(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    changed = {"pad_token": "<mask>", "image_token": "<|hole|>", "audio_token": "<start_of_turn>", "unk_token": None,
               "add_bos_token": False}
    assert {key: config.get(key) for key in changed} == changed
    assert {key: value for key, value in config.items() if key not in changed} == {
        key: value for key, value in GEMMA_LIKE_CONFIG.items() if key not in changed}
    special_map = json.loads((tmp_path / "saved" / "special_tokens_map.json").read_text())
    assert special_map == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<mask>"}  # agrees with the config
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == ours.chat_template  # the form it came in
    seen = _as_transformers_sees_it(tmp_path / "saved")
    assert (seen["class"], seen["padding_side"], seen["chat_template"]) == ("GemmaTokenizer", "left", ours.chat_template)
    assert seen["named"]["pad_token"] == ("<mask>", ours.pad_id)  # (GemmaTokenizer has an unk_token by default)
    assert seen["named"]["audio_token"] == ("<start_of_turn>", 3)
    assert _behaviour(Tokenizer.from_dir(tmp_path / "saved")) == _behaviour(ours)


def test_a_template_in_the_config_stays_there(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json={
        "tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left", "chat_template": "A {{ bos_token }}",
        "bos_token": {"content": "<bos>", "lstrip": False, "normalized": False, "rstrip": False, "special": True}})
    ours = Tokenizer.from_dir(folder)
    ours.save(tmp_path / "same")
    assert json.loads((tmp_path / "same" / "tokenizer_config.json").read_text()) == json.loads(
        (folder / "tokenizer_config.json").read_text())  # the AddedToken form of bos_token too
    ours.chat_template = {"default": "B", "tool_use": "C"}
    ours.save(tmp_path / "same")
    assert not (tmp_path / "same" / "chat_template.jinja").exists()
    assert Tokenizer.from_dir(tmp_path / "same").chat_template == {"default": "B", "tool_use": "C"}


def test_a_tokenizer_blockpress_built_saves_a_complete_config(tok: Tokenizer, saved_dir: Path) -> None:
    """transformers pads batched prompts on the left as blockpress does (before: on the right), and decodes to the
    text blockpress decodes to; the shipped model's tokenizer was saved so too."""
    from transformers import AutoTokenizer

    from blockpress.generate import prompt_to_ids
    from blockpress.lm import MODELS_DIR

    for folder, ours in ((saved_dir, tok), (MODELS_DIR / "blockpress-code", Tokenizer.from_dir(MODELS_DIR / "blockpress-code"))):
        hf = AutoTokenizer.from_pretrained(str(folder))
        texts = ["def f(x):", "x"]
        assert hf(texts, padding=True)["input_ids"] == prompt_to_ids(texts, ours, pad_id=ours.pad_id)[0].tolist()
        ids = ours.encode("a , b . c ' d")
        assert hf.decode(ids) == ours.decode(ids)
        assert not (folder / "special_tokens_map.json").exists()
        assert Tokenizer.from_dir(folder).files is not None  # and saving it again keeps that config
        # (transformers 5 no longer cleans " ," to "," unasked; the config says so for the versions that do)
        assert json.loads((folder / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False


def test_text_that_was_not_utf8_is_a_clear_error(tok: Tokenizer) -> None:
    """Bytes that are not UTF-8 on a command line or stdin reach Python as lone surrogates."""
    with pytest.raises(ValueError, match="text: not valid UTF-8 \\(byte 0xff at character 2\\)"):
        tok.encode(b"ab\xff".decode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match="text: expected a str"):
        tok.encode(b"ab")


@pytest.mark.parametrize("text", ["ab\ud800", "ab\udc00", "ab\ud83d"])
def test_a_lone_surrogate_is_a_clear_error(tok: Tokenizer, text: str) -> None:
    """Half of a UTF-16 pair (JSON's "\\ud800", a string cut inside an emoji): the error's own message raised a
    bare UnicodeEncodeError (it read the character as a byte of surrogateescape, which only U+DC80..U+DCFF are)."""
    with pytest.raises(ValueError, match=f"text: not valid UTF-8 \\(lone surrogate U\\+{ord(text[2]):04X} at character 2\\)"):
        tok.encode(text)


def test_text_that_is_not_utf8_in_a_message_or_tool_names_its_field(tok: Tokenizer) -> None:
    """The error named a position in the whole rendered prompt ("at character 25"), not the field that holds it."""
    from blockpress.tokenizer import MessageError, chat_message

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b\ud800"}]
    with pytest.raises(MessageError, match=r"^messages\[1\]\.content\[1\]\.text: not valid UTF-8 \(lone surrogate "
                                           r"U\+D800 at character 1\)") as caught:
        chat_message({"role": "user", "content": parts}, 1)
    assert caught.value.field == "messages[1].content[1].text"
    call = {"function": {"name": "f", "arguments": {"city": "\udcff"}}}
    with pytest.raises(MessageError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments\.city: not valid "
                                           r"UTF-8 \(byte 0xff at character 0\)"):
        chat_message({"role": "assistant", "content": None, "tool_calls": [call]}, 0)
    weather = {"type": "function", "function": {"name": "weather", "description": "x\ud800"}}
    with pytest.raises(MessageError, match=r"tools\[1\]\.function\.description: not valid UTF-8"):
        tok.apply_chat_template(TWO_TURNS, tools=[TOOL_SCHEMA, weather])


def test_tojson_filter_is_plain_json(tok: Tokenizer) -> None:
    custom = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], chat_template="{{ messages[0] | tojson }}")
    message = {"role": "user", "content": "<b> & 'é'"}
    assert custom.apply_chat_template([message]) == json.dumps(message, ensure_ascii=False)


# ------------------------------------------------------- transformers' chat-template behaviours, compared directly


def _with_transformers(tok: Tokenizer, folder: Path, **kwargs: Any) -> tuple[Tokenizer, Any]:
    """A Tokenizer sharing tok's vocabulary, saved to `folder`, and what transformers loads from there."""
    from transformers import AutoTokenizer

    ours = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0, **kwargs)
    ours.save(folder)
    return Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(str(folder))


def _both(ours: Tokenizer, theirs: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, str]:
    kwargs.setdefault("add_generation_prompt", False)  # the defaults differ; name it for both
    return ours.apply_chat_template(messages, **kwargs), theirs.apply_chat_template(messages, tokenize=False, **kwargs)


TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.content is defined %}{{ m.content }}{% else %}(no content){% endif %}"
    "{% if m.tool_calls is defined %} calls {{ m.tool_calls | tojson }}{% endif %};{% endfor %}"
)
TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}


@pytest.mark.parametrize("calls, field, problem", [
    ("x", "tool_calls", "expected a list of calls .*got str"),
    ([1], r"tool_calls\[0\]\.function", "expected an object .*got int"),
    ([{"id": "a"}], r"tool_calls\[0\]\.function", "expected an object .*got nothing"),
    ([{"function": {"name": "", "arguments": {}}}], r"tool_calls\[0\]\.function\.name", "expected the function's name"),
    ([TOOL_CALL, {"function": {"name": "f", "arguments": '{"a": 1'}}], r"tool_calls\[1\]\.function\.arguments",
     "expected a JSON object as text"),
])
def test_tool_calls_the_server_refuses_are_refused_by_field_in_lm_chat_and_training(calls, field, problem):
    """lm.chat and a training file took tool_calls the server refuses ("x", calls without a function) and rendered
    the assistant's turn empty; a call's arguments as OpenAI's JSON text reach the template as the object, as the
    server passes them."""
    from blockpress.tokenizer import MessageError, chat_message

    with pytest.raises(MessageError, match=rf"^messages\[2\]\.{field}: {problem}"):
        chat_message({"role": "assistant", "content": None, "tool_calls": calls}, 2)
    as_text = {**TOOL_CALL, "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    message = {"role": "assistant", "content": None, "tool_calls": [as_text]}
    assert chat_message(message, 2)["tool_calls"] == [TOOL_CALL]
    assert message["tool_calls"] == [as_text]  # the caller's message is left as it was


def test_text_parts_are_joined_one_line_apart_as_vllm_joins_them(tok: Tokenizer) -> None:
    """Text parts were glued ("Describe this:" and "The cat sat." read "Describe this:The cat sat."), where
    vLLM joins them with "\\n" for a template that takes text, and Granite 4's own template writes them so."""
    from blockpress.tokenizer import chat_message

    parts = [{"type": "text", "text": "Describe this:"}, {"type": "text", "text": "The cat sat."}]
    assert chat_message({"role": "user", "content": parts}, 0)["content"] == "Describe this:\nThe cat sat."
    assert chat_message({"role": "user", "content": parts[:1]}, 0)["content"] == "Describe this:"  # one: as it is


# As DeepSeek V4's template (V3.2's and GigaChat 3's alike) renders a developer message: inside the user turn, where a
# system one is a preamble
DEVELOPER_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% elif m.role == 'user' or "
    "m.role == 'developer' %}<User>{{ m.content }}{% else %}<Assistant>{{ m.content }}<end>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<Assistant>{% endif %}")
ROLE_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"  # knows no role by name


# The word in a variable's name and in prose only, as DeepSeek V3.2's template has it: a developer message is dropped
NAMES_DEVELOPER_ONLY = (
    "{# developer messages are not supported #}{% set developer_prompt = '' %}{% for m in messages %}"
    "{% if m.role == 'system' %}<sys>{{ m.content }}{% elif m.role == 'user' %}<User>{{ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<Assistant>{% endif %}")
RAISES_ON_DEVELOPER = (  # Apertus's way: a role it has no place for is an error, though it names the word
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Invalid message role: ' + m.role + ' (not developer)') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("template, kept", [(DEVELOPER_TEMPLATE, True), (ROLE_TEMPLATE, False),
                                            (NAMES_DEVELOPER_ONLY, False), (RAISES_ON_DEVELOPER, False)])
def test_developer_is_system_unless_the_template_has_a_place_for_it(tok: Tokenizer, template: str, kept: bool) -> None:
    """"developer" was always rewritten to "system", so a template that renders it itself (DeepSeek V4's, in the
    user turn) rendered it as its system preamble. It stays "developer" where the template renders a developer
    message; one that only names the word (in a comment, a variable) dropped the message or raised when the role was
    kept wherever the word appeared, and gets "system" as before."""
    from blockpress.tokenizer import chat_message

    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert tok.renders_developer(template) is kept
    read = [chat_message(m, i, tok.renders_developer(template)) for i, m in enumerate(messages)]
    assert read[0]["role"] == ("developer" if kept else "system")
    assert "Answer in French." in tok.apply_chat_template(read, chat_template=template)
    assert chat_message(messages[0], 0)["role"] == "system"
    assert chat_message(messages[0], 0, developer=True)["role"] == "developer"


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_null_content_beside_tool_calls_is_an_assistants_alone(role: str) -> None:
    """Null content beside tool_calls became "" on any role, where the error itself says only an assistant message
    may leave it out (and the server refuses the rest)."""
    from blockpress.tokenizer import MessageError, chat_message

    with pytest.raises(MessageError, match=r"^messages\[0\]\.content: .*only an assistant message with tool_calls"):
        chat_message({"role": role, "content": None, "tool_calls": [TOOL_CALL]}, 0)
    assert chat_message({"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}, 0)["content"] == ""


def test_flat_tool_calls_are_taken_with_their_arguments_read_as_an_object():
    """Calls written flat ({"name", "arguments"}, which Qwen's and Llama's templates take beside OpenAI's
    {"function": ...}) reached such templates before the calls were checked; they still do, their JSON-text arguments
    read as the object, and a flat call's faults are named at its own fields."""
    from blockpress.tokenizer import MessageError, chat_message

    flat = {"name": "weather", "arguments": '{"city": "Paris"}'}
    message = chat_message({"role": "assistant", "content": None, "tool_calls": [flat, TOOL_CALL]}, 1)
    assert message["tool_calls"] == [{"name": "weather", "arguments": {"city": "Paris"}}, TOOL_CALL]
    with pytest.raises(MessageError, match=r"^messages\[1\]\.tool_calls\[0\]\.arguments: expected a JSON object as text"):
        chat_message({"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "[1]"}]}, 1)
    with pytest.raises(MessageError, match=r"^messages\[1\]\.tool_calls\[0\]\.name: expected the function's name"):
        chat_message({"role": "assistant", "content": None, "tool_calls": [{"name": 3, "arguments": {}}]}, 1)


# As Qwen 3's template writes an assistant turn ('\n' + message.content: an error where the field is left out), as do
# QwQ's, the R1 distills', Phi-3.5's, Granite 3.3's, Devstral's and LFM2's
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}{%- for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{%- endif %}")


@pytest.mark.parametrize("assistant", [
    {"role": "assistant", "tool_calls": [TOOL_CALL]},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},  # what OpenAI's clients and the server send
])
def test_a_tool_call_turn_without_content_renders_it_as_empty_text(tok: Tokenizer, assistant: dict[str, Any]) -> None:
    """A turn of tool calls alone left its content out, and templates that read message.content failed ("'dict
    object' has no attribute 'content'": a 500 in the server's agent loop). Its content is "" as vLLM renders it."""
    from blockpress.tokenizer import chat_message

    messages = [{"role": "user", "content": "w?"}, assistant, {"role": "tool", "content": "sunny"}]
    read = [chat_message(m, i) for i, m in enumerate(messages)]
    rendered = tok.apply_chat_template(read, chat_template=QWEN3_STYLE_TEMPLATE)
    assert read[1]["content"] == ""
    assert rendered == tok.apply_chat_template([*messages[:1], {**assistant, "content": ""}, messages[2]],
                                               chat_template=QWEN3_STYLE_TEMPLATE)
    assert '<|im_start|>assistant\n<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}' in rendered


@pytest.mark.parametrize("assistant", [
    {"role": "assistant", "tool_calls": [TOOL_CALL]},  # OpenAI's shape: no content key at all
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},  # the same, written out as null
])
def test_tool_call_messages_without_content_render_as_in_transformers(
    tok: Tokenizer, tmp_path: Path, assistant: dict[str, Any]
) -> None:
    ours, theirs = _with_transformers(tok, tmp_path, chat_template=TOOL_TEMPLATE)
    messages = [{"role": "user", "content": "w?"}, assistant, {"role": "tool", "content": "sunny"}]
    mine, expected = _both(ours, theirs, messages)
    assert mine == expected
    assert "assistant:(no content) calls" in mine


# Written for these tests in the manner of Gemma 4's template (15k characters of macros): a value printed by a macro
# that calls itself for dicts and lists, keys in dictsort order, namespaces carried across loops, `map('upper')`,
# `is mapping` / `is string` / `is sequence`, `message.get(...)`, past thinking channels cut off with split, a
# `{% set %}` block captured and measured, calls as call:NAME{...} answered by following tool messages.
GEMMA4_STYLE_TEMPLATE = """\
{%- macro value(v) -%}
    {%- if v is none -%}null{%- elif v is string -%}<|"|>{{ v }}<|"|>
    {%- elif v is boolean -%}{{ 'true' if v else 'false' }}
    {%- elif v is mapping -%}{ {%- set ns = namespace(first=true) -%}
        {%- for k, x in v | dictsort -%}{{ '' if ns.first else ',' }}{{ k }}:{{ value(x) }}{%- set ns.first = false -%}
        {%- endfor -%} }
    {%- elif v is sequence -%}[{%- for x in v -%}{{ value(x) }}{{ '' if loop.last else ',' }}{%- endfor -%}]
    {%- else -%}{{ v }}{%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(out='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- set ns.out = ns.out + (part.split('<|channel>')[0] if '<|channel>' in part else part) -%}
    {%- endfor -%}
    {{- ns.out | trim -}}
{%- endmacro -%}
{{- bos_token -}}
{%- set rest = messages[1:] if messages[0]['role'] in ['system', 'developer'] else messages -%}
{%- if enable_thinking | default(false) or tools or rest is not sameas messages -%}
    {{- '<|turn>system\\n' ~ ('<|think|>\\n' if enable_thinking | default(false) else '') -}}
    {%- if rest is not sameas messages %}{{ messages[0]['content'] | trim }}{% endif -%}
    {%- for tool in tools or [] -%}
        <|tool>{{ tool['function']['name'] }}{{ value(tool['function'].get('parameters', {})) }}
        {%- set types = tool['function'].get('parameters', {}).get('properties', {}).values() | map(attribute='type') -%}
        :{{ types | map('string') | map('upper') | list | join('|') }}<tool|>
    {%- endfor -%}
    {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for message in rest if message['role'] != 'tool' -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    <|turn>{{ role ~ '\\n' }}
    {%- for call in message.get('tool_calls') or [] -%}
        <|tool_call>call:{{ call['function']['name'] }}
        {%- set args = call['function']['arguments'] -%}
        {{ value(args) if args is mapping else '{' ~ args ~ '}' }}<tool_call|>
    {%- endfor -%}
    {%- set index = rest.index(message) -%}
    {%- set answers = namespace(any=false) -%}
    {%- for follow in rest[index + 1:] -%}
        {%- if follow['role'] != 'tool' -%}{%- break -%}{%- endif -%}
        <|tool_response>response:{{ follow.get('name', 'unknown') }}{value:{{ value(follow['content']) }}}<tool_response|>
        {%- set answers.any = true -%}
    {%- endfor -%}
    {%- set text -%}
        {%- if message.get('content') is string -%}
            {{ strip_thinking(message['content']) if role == 'model' else message['content'] | trim }}
        {%- elif message.get('content') is sequence -%}
            {%- for part in message['content'] if part.get('type') == 'text' -%}{{ part['text'] | trim }}{%- endfor -%}
        {%- endif -%}
    {%- endset -%}
    {{ text }}{{ '' if answers.any and text | length == 0 else '<turn|>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}
"""
GEMMA4_STYLE_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Wetter — 天気", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "Städte"},
        "unit": {"type": "string", "enum": ["c", "f"], "nullable": True},
        "days": {"type": "array", "items": {"type": "object", "properties": {"day": {"type": "integer"}}}}}}}},
    {"type": "function", "function": {"name": "now"}}]


@pytest.mark.parametrize("messages, options", [
    ([{"role": "developer", "content": "  Be brief.  "}, {"role": "user", "content": "Hi 🐈"},
      {"role": "assistant", "content": "<|channel>thought\nshort<channel|>Hello!"}, {"role": "user", "content": "¿y?"}],
     {"add_generation_prompt": True, "enable_thinking": True}),
    ([{"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Zürich?"}]},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "a", "type": "function", "function": {"name": "weather", "arguments": {
              "city": "Zürich", "unit": None, "days": [{"day": 1}, {"day": 2}], "ok": True, "ratio": 0.5}}},
          {"id": "b", "type": "function", "function": {"name": "now", "arguments": '"tz": "CET"'}}]},
      {"role": "tool", "tool_call_id": "a", "name": "weather", "content": '{"temp": 21}'},
      {"role": "tool", "tool_call_id": "b", "content": "12:00"},
      {"role": "assistant", "content": "21 °C."}], {"add_generation_prompt": False}),
])
def test_a_gemma4_style_template_renders_as_in_transformers(
    tok: Tokenizer, tmp_path: Path, messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    """A template written like Gemma 4's (recursive macros, namespaces, dictsort, map('upper'), captured blocks, tool
    calls and responses, thinking channels) renders what transformers renders, tools and template variables given:
    the checks of the render's time limit written into its code (every block, each item of a map) change nothing."""
    ours, theirs = _with_transformers(tok, tmp_path, chat_template=GEMMA4_STYLE_TEMPLATE)
    mine, expected = _both(ours, theirs, messages, tools=GEMMA4_STYLE_TOOLS, **options)
    assert mine == expected
    assert "<|tool>weather{properties:{city:{description:<|\"|>Städte<|\"|>" in mine
    assert ":STRING|STRING|ARRAY<tool|>" in mine and "short" not in mine


CONTINUE_TEMPLATES = {
    "gemma": GEMMA_CHAT_TEMPLATE,
    # Templates that trim the content cut the prompt where the trimmed text ends.
    "trimming": "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}",
    "reasoning": "{% for m in messages %}[{{ m.thinking }}]{{ m.content }}<end>{% endfor %}",
    # One that writes the flag where the cut keeps it (a generation prompt after the last message is cut off).
    "flag": "{{ add_generation_prompt }}|{% for m in messages %}{{ m.content }};{% endfor %}",
}


@pytest.mark.parametrize(("template", "last", "field"), [
    ("gemma", {"role": "assistant", "content": "The answer is"}, True),
    ("gemma", {"role": "assistant", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": " Pa"}]},
     True),
    ("trimming", {"role": "assistant", "content": "The answer is  "}, True),
    ("reasoning", {"role": "assistant", "reasoning_content": "Let me th", "content": "x"}, "reasoning_content"),
    ("flag", {"role": "assistant", "content": "The answer is"}, True),
])
def test_continue_final_message_matches_transformers(
    tok: Tokenizer, tmp_path: Path, template: str, last: dict[str, Any], field: bool | str
) -> None:
    """The prompt ends where the last message's text ends (before: the template's end-of-turn followed it)."""
    ours, theirs = _with_transformers(tok, tmp_path, chat_template=CONTINUE_TEMPLATES[template])
    messages = [{"role": "user", "content": "q"}, last]
    mine, expected = _both(ours, theirs, messages, continue_final_message=field)
    assert mine == expected
    assert mine.endswith(("The answer is", " Pa", "Let me th"))
    # Without add_generation_prompt, it is off when continuing.
    assert ours.apply_chat_template(messages, continue_final_message=field) == mine
    assert ours.apply_chat_template(messages, continue_final_message=field, tokenize=True) == ours.encode(mine)


def test_continue_final_message_errors(tok: Tokenizer, tmp_path: Path) -> None:
    drops_last = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"
    ours, theirs = _with_transformers(tok, tmp_path, chat_template=drops_last)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    for kwargs, pattern in (
        ({"add_generation_prompt": True}, "continue_final_message: cannot be combined with add_generation_prompt"),
        ({}, "continue_final_message: the chat template changed or dropped the last message's text"),
        ({"continue_final_message": "reasoning_content"}, "the last message has no 'reasoning_content' to continue"),
    ):
        kwargs = {"continue_final_message": True, "add_generation_prompt": False, **kwargs}
        with pytest.raises(ValueError):  # transformers refuses these as well
            theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        with pytest.raises(ValueError, match=pattern):
            ours.apply_chat_template(messages, **kwargs)


@pytest.mark.parametrize(("ids", "pattern"), [
    ([7, -1], r"ids: token id -1 at position 1 is negative \(expected a token id, 0 <= id < vocab_size 500\)"),
    ([1.5], "ids: expected integer token ids .* got float 1.5 at position 0"),
    (["3"], "got str '3' at position 0"),
    ([True], "got bool True at position 0"),
    ([None], "got NoneType None at position 0"),
    ([7, 500, 8], r"ids: token id 500 at position 1 has no token in this tokenizer \(its vocabulary has 500;"),
])
def test_decode_refuses_ids_that_are_not_tokens(tok: Tokenizer, ids: list[Any], pattern: str) -> None:
    """Before: floats / strings / bools were coerced, -1 overflowed, an id past the vocabulary was dropped."""
    with pytest.raises(ValueError, match=pattern):
        tok.decode(ids)


def test_decode_checks_tensors_and_arrays_by_dtype(tok: Tokenizer) -> None:
    """Integer tensors, arrays and numpy ints decode as before; float and bool ones are refused (before: coerced)."""
    import numpy as np
    import torch

    ids = tok.encode("def f(x):")
    for form in (np.array(ids), torch.tensor(ids), torch.tensor(ids, dtype=torch.int32), [np.int64(i) for i in ids],
                 list(torch.tensor(ids)), tuple(ids)):
        assert tok.decode(form) == "def f(x):"
    assert tok.decode([]) == ""
    for bad in (torch.tensor([1.0, 2.0]), np.array([1.5]), torch.tensor([True]), [np.float32(3)]):
        with pytest.raises(ValueError, match="ids: expected integer token ids"):
            tok.decode(bad)


NAMED_TEMPLATES = [{"name": "default", "template": "DEFAULT {{ messages | length }}"},
                   {"name": "tool_use", "template": "TOOLS {{ tools | length if tools else 0 }} {{ messages[0].content }}"}]
TOOL_SCHEMA = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("templates", [NAMED_TEMPLATES, NAMED_TEMPLATES[1:]], ids=["with_default", "tool_use_only"])
def test_named_templates_are_chosen_as_in_transformers(
    tok: Tokenizer, tmp_path: Path, templates: list[dict[str, str]]
) -> None:
    """tool_use when tools are given, default otherwise, either by name (before: always default; a list without
    default was no template at all)."""
    from transformers import AutoTokenizer

    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json={"bos_token": "<bos>",
                                                                              "chat_template": templates})
    ours, theirs = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(str(folder))
    calls: list[dict[str, Any]] = [{"tools": [TOOL_SCHEMA]}, {"chat_template": "tool_use"},
                                   {"chat_template": "tool_use", "tools": [TOOL_SCHEMA]}]
    if len(templates) == 2:
        calls += [{}, {"chat_template": "default", "tools": [TOOL_SCHEMA]}]
    for kwargs in calls:
        mine, expected = _both(ours, theirs, TWO_TURNS, **kwargs)
        assert mine == expected
    assert ours.apply_chat_template(TWO_TURNS, tools=[TOOL_SCHEMA]) == "TOOLS 1 What is 2+2?"
    if len(templates) == 1:
        with pytest.raises(ValueError):
            theirs.apply_chat_template(TWO_TURNS, tokenize=False)
        with pytest.raises(ValueError, match=r"chat_template: this tokenizer's templates are named \['tool_use'\]"):
            ours.apply_chat_template(TWO_TURNS)
    with pytest.raises(ValueError, match=r"chat_template: 'tool_usee' is neither one of this tokenizer's template"):
        ours.apply_chat_template(TWO_TURNS, chat_template="tool_usee")


def test_named_templates_are_saved_whole(tok: Tokenizer, tmp_path: Path) -> None:
    """save() keeps every named template (before: only default), for transformers and for from_dir; and the folders
    transformers 5 writes (chat_template.jinja plus additional_chat_templates/NAME.jinja) load with all of them."""
    from transformers import AutoTokenizer

    templates = {entry["name"]: entry["template"] for entry in NAMED_TEMPLATES}
    ours, theirs = _with_transformers(tok, tmp_path / "ours", chat_template=templates)
    assert ours.chat_template == templates
    assert theirs.chat_template == templates
    theirs.save_pretrained(str(tmp_path / "theirs"))
    assert (tmp_path / "theirs" / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert Tokenizer.from_dir(tmp_path / "theirs").chat_template == templates
    # Saving a single template over that folder leaves no named files to shadow it.
    Tokenizer.from_dir(tmp_path / "theirs").save(tmp_path / "theirs")
    Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], chat_template="ONE").save(tmp_path / "theirs")
    assert not (tmp_path / "theirs" / "additional_chat_templates").exists()
    assert not [p.name for p in (tmp_path / "theirs").iterdir() if p.name.startswith(".")]  # (nor its backup)
    assert Tokenizer.from_dir(tmp_path / "theirs").chat_template == "ONE"
    assert AutoTokenizer.from_pretrained(str(tmp_path / "theirs")).chat_template == "ONE"


def test_gemma_template_renders_text_parts_and_null_content(tok: Tokenizer, hf_tok: Any) -> None:
    """Before: a list of parts rendered as its Python repr, and null content as the text "None"."""
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi, "}, {"type": "text", "text": "what is 2+2?"}]},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    ]
    expected = ("<bos><start_of_turn>user\nBe terse.\n\nHi, what is 2+2?<end_of_turn>\n"
                "<start_of_turn>model\n<end_of_turn>\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert hf_tok.apply_chat_template(messages, tokenize=False) == expected
    with pytest.raises(ValueError, match="Only text content parts are supported"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}])


def test_reasoning_fields_are_aliased_as_in_transformers(tok: Tokenizer, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{{ m | tojson }};{% endfor %}"
    ours, theirs = _with_transformers(tok, tmp_path, chat_template=template)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning": "because", "content": "a"},
        {"role": "assistant", "content": "b", "thinking": "hmm"},
        {"role": "assistant", "reasoning_content": None, "reasoning": "r", "content": "c"},
    ]
    mine, expected = _both(ours, theirs, messages)
    assert mine == expected
    assert "because|because|" in mine


def test_named_special_tokens_reach_templates_and_are_saved(tok: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = "{{ unk_token }}|{{ mask_token }}|{{ image_token }}|{{ sep_token is defined }}|{{ bos_token }}"
    folder = _write_checkpoint(
        tmp_path / "ckpt", tok,
        tokenizer_config__json={"bos_token": "<bos>", "mask_token": "<|hole|>", "chat_template": template,
                                "extra_special_tokens": {"image_token": "<start_of_turn>"}},
        special_tokens_map__json={"unk_token": "<pad>", "mask_token": "<eos>"},  # this one wins, as there
    )
    ours = Tokenizer.from_dir(folder)
    mine, expected = _both(ours, AutoTokenizer.from_pretrained(str(folder)), TWO_TURNS)
    assert mine == expected == "<pad>|<eos>|<start_of_turn>|False|<bos>"
    ours.save(tmp_path / "saved")
    assert Tokenizer.from_dir(tmp_path / "saved").named_tokens == ours.named_tokens
    mine, expected = _both(ours, AutoTokenizer.from_pretrained(str(tmp_path / "saved")), TWO_TURNS)
    assert mine == expected


def test_model_specific_token_names_at_the_top_level_reach_templates(tok: Tokenizer, tmp_path: Path) -> None:
    """Gemma's configs name boi_token, image_token, ... at the top level; transformers 5 gives templates those names
    (before: blockpress read model-specific names only from an extra_special_tokens dict, so they were undefined)."""
    from transformers import AutoTokenizer

    template = ("{{ boi_token }}|{{ image_token }}|{{ eoi_token is defined }}|{{ add_bos_token is defined }}|"
                "{{ tokenizer_class is defined }}|{{ padding_side is defined }}")
    folder = _write_checkpoint(
        tmp_path / "ckpt", tok,
        tokenizer_config__json={"chat_template": template, "boi_token": "<start_of_turn>", "add_bos_token": True,
                                "image_token": "<|hole|>", "extra_special_tokens": {"image_token": "<eos>"},
                                "tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left"},
    )
    ours = Tokenizer.from_dir(folder)
    mine, expected = _both(ours, AutoTokenizer.from_pretrained(str(folder)), TWO_TURNS)
    # the dict wins, as there; only NAME_token keys are tokens (tokenizer_class is a string, not a token)
    assert mine == expected == "<start_of_turn>|<eos>|False|False|False|False"


def test_a_changed_model_specific_token_is_saved_where_the_config_has_it(tok: Tokenizer, tmp_path: Path) -> None:
    """A model-specific token the config names at its top level, changed since loading, is saved there, where the
    file keeps it, and the config's extra_special_tokens dict beside it stays as it was (not given the token: only a
    name new to the config goes into the dict)."""
    folder = _write_checkpoint(tmp_path / "ckpt", tok, tokenizer_config__json={
        "image_token": "<|hole|>", "extra_special_tokens": {"audio_token": "<pad>"}})
    ours = Tokenizer.from_dir(folder)
    ours.named_tokens["image_token"] = "<start_of_turn>"
    ours.save(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert (config["image_token"], config["extra_special_tokens"]) == ("<start_of_turn>", {"audio_token": "<pad>"})
    assert Tokenizer.from_dir(tmp_path / "saved").named_tokens["image_token"] == "<start_of_turn>"


def test_tools_must_be_json_schemas(tok: Tokenizer) -> None:
    """transformers turns a function into a schema itself; blockpress says to pass the schema (before: a JSON
    TypeError from inside the template)."""

    def weather(city: str) -> str:
        """Get the weather.

        Args:
            city: The city.
        """
        return city

    custom = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], chat_template="{{ tools | tojson }}")
    with pytest.raises(ValueError, match=r"tools\[1\]: got the function 'weather'; pass its JSON schema"):
        custom.apply_chat_template(TWO_TURNS, tools=[TOOL_SCHEMA, weather])
    with pytest.raises(ValueError, match=r"tools\[0\]: expected a dict, got str"):
        custom.apply_chat_template(TWO_TURNS, tools=["weather"])
    assert custom.apply_chat_template(TWO_TURNS, tools=[TOOL_SCHEMA]) == json.dumps([TOOL_SCHEMA])


@pytest.mark.parametrize("bad", ["no", 1, 0, None])
@pytest.mark.parametrize("call, flag", [
    (lambda tok, v: tok.encode("x", add_bos=v), "add_bos"),
    (lambda tok, v: tok.decode([5], skip_special_tokens=v), "skip_special_tokens"),
    (lambda tok, v: tok.decode_batch([], skip_special_tokens=v), "skip_special_tokens"),
    (lambda tok, v: tok.apply_chat_template(TWO_TURNS, tokenize=v), "tokenize"),
    (lambda tok, v: tok.apply_chat_template(TWO_TURNS, add_generation_prompt=v), "add_generation_prompt"),
], ids=["encode", "decode", "decode_batch", "tokenize", "add_generation_prompt"])
def test_flags_are_bools_not_truthy_stand_ins(tok: Tokenizer, call: Any, flag: str, bad: Any) -> None:
    """The tokenizer read its flags as truthy ("no" added a BOS, 0 skipped nothing) where the rest of the library
    refuses anything but True / False (None where it means "the default")."""
    if bad is None and flag == "add_generation_prompt":  # None: the default, decided by continue_final_message
        assert call(tok, bad) == call(tok, True)
        return
    with pytest.raises(ValueError, match=f"^{flag}: expected True"):
        call(tok, bad)


def test_the_tokenizer_imports_no_torch() -> None:
    """blockpress.tokenizer and the checks it shares with the rest of the library load where torch cannot (the
    package's __init__, which does import torch, is bypassed)."""
    import subprocess
    import sys

    package = Path(__file__).resolve().parents[1] / "blockpress"
    code = (f"import sys, types; sys.modules['torch'] = None; pkg = types.ModuleType('blockpress'); "
            f"pkg.__path__ = [{str(package)!r}]; sys.modules['blockpress'] = pkg; "
            "from blockpress.tokenizer import train_bpe_tokenizer; "
            "tok = train_bpe_tokenizer(['a b c'], vocab_size=300); assert tok.decode(tok.encode('a b')) == 'a b'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_encode_prompt_puts_bos_first_once(tok: Tokenizer) -> None:
    """A plain prompt gets BOS in front; one that brings its own (a rendered chat template) keeps just that one; a
    tokenizer without BOS adds none. test_tokenizer.py passed with encode_prompt prepending BOS always."""
    assert tok.encode_prompt("hello world") == [tok.bos_id, *tok.encode("hello world")]
    rendered = tok.apply_chat_template(TWO_TURNS)
    assert tok.encode_prompt(rendered) == tok.encode(rendered) and tok.encode(rendered).count(tok.bos_id) == 1
    assert Tokenizer(backend=tok.backend, eos_ids=[1], pad_id=0).encode_prompt("hi") == tok.encode("hi")


def test_block_tags_take_their_line_with_them_as_in_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    """transformers renders with trim_blocks and lstrip_blocks: a line holding only a block tag leaves nothing, its
    indentation included. The Gemma template strips by hand, so every other test passed with lstrip_blocks off."""
    template = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n  U: {{ m['content'] }}\n"
                "    {% endif %}\n{% endfor %}")
    expected = "  U: What is 2+2?\n"
    assert tok.apply_chat_template(TWO_TURNS, chat_template=template) == expected
    assert hf_tok.apply_chat_template(TWO_TURNS, chat_template=template, tokenize=False) == expected


@pytest.mark.parametrize("token_id", [4_000_000, 2**40, 2**63 - 1])
def test_an_id_far_past_the_vocabulary_is_refused_at_once_keeping_nothing(tok: Tokenizer, token_id: int) -> None:
    """decode listed every id from the vocabulary's end up to the largest one given, and kept the list: decode([2**40])
    ran for minutes, gigabytes growing, and each refused id stayed in memory. Each id is asked alone now."""
    import threading

    refused: list[BaseException] = []

    def run() -> None:
        try:
            tok.decode([5, token_id])
        except ValueError as exc:
            refused.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "decode of one huge id did not return"
    assert refused and f"token id {token_id} at position 1 has no token" in str(refused[0])
    assert tok._unknown_ids == {} or max(map(len, tok._unknown_ids.values())) < 10_000


@pytest.mark.parametrize("call, message", [
    (lambda t: t.id_to_token(-1), r"^token_id: -1 is negative"),
    (lambda t: t.id_to_token(True), r"^token_id: expected an integer token id, got bool"),
    (lambda t: t.id_to_token(2.0), r"^token_id: expected an integer token id, got float"),
    (lambda t: t.token_to_id(5), r"^token: expected a str, got int"),
    (lambda t: t.token_to_id("\ud800"), r"^token: not valid UTF-8"),
    (lambda t: t.decode(np.int64(5)), r"^ids: expected a sequence of token ids, got a single"),
    (lambda t: t.decode(5), r"^ids: expected a sequence of token ids, got a single int 5 \(pass \[id\]"),
    (lambda t: t.decode(None), r"^ids: expected a sequence of token ids, got NoneType None$"),
    (lambda t: t.decode_batch([[5], 6]), r"^ids: expected a sequence of token ids, got a single int 6"),
    (lambda t: t.decode_batch(5), r"^batch: expected a list of rows of token ids, got int 5"),
    (lambda t: t.decode_batch(None), r"^batch: expected a list of rows of token ids, got NoneType None"),
    (lambda t: t.decode_batch(np.array(5)), r"^batch: expected a list of rows of token ids, got ndarray"),
    (lambda t: t.decode(__import__("torch").tensor([5, 6], device="meta")), r"^ids: a tensor on the meta device"),
])
def test_token_lookups_name_a_bad_argument(tok: Tokenizer, call: Any, message: str) -> None:
    """id_to_token and token_to_id handed their argument to tokenizers: True was token 1, -1 and ids past 32 bits an
    OverflowError, an int or a lone surrogate a TypeError or UnicodeEncodeError; decode of one number (a Python int
    too) or of None a bare TypeError."""
    with pytest.raises(ValueError, match=message):
        call(tok)
    assert tok.id_to_token(2**64) is None and tok.id_to_token(np.int64(2)) == tok.id_to_token(2) == "<bos>"


@pytest.mark.parametrize("name", ["namespace", "range", "raise_exception", "strftime_now", "dict"])
def test_a_template_variable_the_rendering_sets_is_refused_by_name(tok: Tokenizer, name: str) -> None:
    """The server refuses such names in chat_template_kwargs; apply_chat_template (lm.chat's template_options) passed
    them on: {"namespace": 1} failed inside the template blamed on chat_template, {"range": 3} went unsaid."""
    with pytest.raises(ValueError, match=rf"^{name}: not a template variable a caller may set"):
        tok.apply_chat_template(TWO_TURNS, **{name: 1})
    assert tok.apply_chat_template(TWO_TURNS, enable_thinking=True) == tok.apply_chat_template(TWO_TURNS)


@pytest.mark.parametrize("options", [{"return_tensors": "pt"}, {"return_dict": True}, {"padding": "max_length"},
                                     {"max_length": 5, "truncation": True}, {"return_assistant_tokens_mask": True}])
def test_transformers_return_options_are_refused_by_name(tok: Tokenizer, options: dict[str, Any]) -> None:
    """transformers' apply_chat_template keywords for what it returns became template variables, unread: a prompt
    asked to be cut to 5 tokens came back whole, return_tensors="pt" a list."""
    first = sorted(options)[0]
    with pytest.raises(ValueError, match=rf"^{first}: a transformers option that apply_chat_template does not take"):
        tok.apply_chat_template(TWO_TURNS, tokenize=True, **options)


@pytest.mark.parametrize("field", ["chat_template_kwargs", "--chat-template-kwargs"])
def test_transformers_return_options_are_refused_as_template_variables_by_field(field: str) -> None:
    """The server's chat_template_kwargs (a request's, or serve's --chat-template-kwargs defaults) passed
    max_length on to apply_chat_template, which refuses it: every chat request then failed, blamed on messages."""
    from blockpress.tokenizer import template_variables

    with pytest.raises(ValueError, match=rf"^{field}: 'max_length' is a transformers tokenizer option, not a "
                                         r"template variable"):
        template_variables({"enable_thinking": True, "max_length": 4096}, field)
    assert template_variables({"enable_thinking": True}, field) == {"enable_thinking": True}


def test_an_eos_id_past_the_vocabulary_is_not_unknown(tok: Tokenizer) -> None:
    """A config may name an EOS id past tokenizer.json's vocabulary (the model's embedding is padded): it ends a
    text, so it is not among unknown_ids (whose logits generation masks) and decode drops it. test_tokenizer.py
    passed with unknown_ids counting every id without a token."""
    past = tok.vocab_size
    extra = Tokenizer(backend=tok.backend, bos_id=tok.bos_id, eos_ids=[*tok.eos_ids, past], pad_id=tok.pad_id)
    assert extra.unknown_ids(past + 2) == (past + 1,)
    assert extra.decode([*tok.encode("x = 1"), past]) == "x = 1"


@pytest.mark.parametrize("template, message", [
    # nested ranges (each capped at 100,000 by the sandbox): 10**10 iterations that write nothing
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", r"rendering ran past 0.3 s"),
    # one filter over 5M items, each a call in jinja's code, not the template's (10 s here before it was checked)
    ("{{ ('x' * 5000000) | map('upper') | select('ne', 'y') | list | length }}", r"rendering ran past 0.3 s"),
    ("{{ 'x' * 10**9 }}", r"repeats a str of 1 items 1,000,000,000 times"),
    ("{{ [0] * 10**9 }}", r"repeats a list of 1 items 1,000,000,000 times"),
    ("{{ 2 ** 100000000 }}", r"computes 2 \*\* 100000000, a number of more than 4,096 bits"),
    ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", r"its text passed 50,000,000 characters"),
    # each of these made 10**8 characters or more, or ran for seconds, before the text or the number was measured
    ("{% set a = 'x' * 50000000 %}{% set b = a ~ a %}{{ b | length }}", r"joins texts of 100,000,000 characters"),
    ("{% set a = 'x' * 50000000 %}{{ (a + a) | length }}", r"adds texts or lists of 100,000,000 characters"),
    ("{{ (['x' * 1000000] * 100) | join }}", r"repeats a list of 1 items 100 times"),
    ("{{ 'x' | center(10**8) }}", r"passes 100,000,000 to center"),
    ("{{ 'x'.ljust(10**8) }}", r"passes 100,000,000 to ljust"),
    ("{{ '%0100000000d' % 1 }}", r"formats with a width of 100,000,000"),
    ("{{ '{:>100000000}'.format(1) }}", r"formats with a width of 100,000,000"),
    ("{{ ('x' * 10000).replace('x', 'y' * 10000) }}", r"replace would make 100,000,000 characters"),
    ("{{ ('x' * 10000) | replace('x', 'y' * 10000) }}", r"replace would make 100,000,000 characters"),
    ("{{ ('\t' * 10000).expandtabs(10000) }}", r"expandtabs would make 100,010,000 characters"),
    ("{{ ('x\n' * 10000) | indent(10000) }}", r"indent would make 100,030,000 characters"),
    ("{{ (['x' * 10000] * 1000) | join('y' * 50000) }}", r"join would make 60,001,000 characters"),
    ("{{ messages | tojson(indent=1000) }}", r"tojson with an indent or separator of more than 64 characters"),
    ("{{ messages | tojson(indent=' ' * 100) }}", r"tojson with an indent or separator of more than 64 characters"),
    # routes a review found past those checks: Markup's ~, a {% set %} block that writes a value twice, the format
    # filter's width, a * width, repeated fields, str.join
    ("{% autoescape true %}{% set ns = namespace(s='x' * 40000000) %}{% set ns.s = ns.s ~ ns.s %}{% endautoescape %}",
     r"~ made a str of 80,000,000 items"),
    ("{% set ns = namespace(s='x' * 40000000) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}{{ ns.s }}",
     r"writes a str of 80,000,000 characters"),
    ("{{ '%0200000000d' | format(1) }}", r"formats with a width of 200,000,000"),
    ("{{ '%*d' % (200000000, 1) }}", r"formats with a \* width of 200,000,000"),
    ("{{ ('{0}' * 2000).format('x' * 100000) }}", r"formats 2,000 fields of up to 100,000 characters"),
    ("{{ ('%(a)s' * 2000) % {'a': 'x' * 100000} }}", r"formats 2,000 fields of up to 100,000 characters"),
    ("{{ ('y' * 200000).join(['a'] * 1000) }}", r"join would make 200,002,000 characters"),
    # and a second review's: jinja's lipsum global (unbounded once sizes were read only where they are sizes), a
    # width from a nested field (built whole, 10**9 characters, before it was refused)
    ("{{ lipsum(10**8, html=False) }}", r"passes 100,000,000 to generate_lorem_ipsum"),
    ("{{ lipsum(100000, html=False) }}", r"generate_lorem_ipsum would make 130,000,000 characters"),
    ("{{ '{:>{w}}'.format(1, w=10**9) }}", r"formats with a width of 1,000,000,000 taken from a value"),
    ("{{ '{0:>{1}}'.format(1, '1000000000') }}", r"formats with a width of 1,000,000,000 taken from a value"),
    ("{% set v = 2 ** 4000 %}{% set w = v * v %}", r"multiplies two numbers into one of more than 4,096 bits"),
])
def test_a_template_that_would_hang_or_fill_memory_is_refused(tok: Tokenizer, monkeypatch, template, message) -> None:
    """A checkpoint's chat template is its maker's code: the sandbox kept it from Python's internals but not from a
    loop of loops or a string of 10**9 characters, which held `chat` and the server's every request (or took all
    memory). Each is refused, naming the chat template; an ordinary template renders as before."""
    import time

    import blockpress.tokenizer as tokenizer

    own_limit = tokenizer.TEMPLATE_SECONDS
    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.3)
    messages = [{"role": "user", "content": "hi"}]
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"^chat_template: {message}"):
        tok.apply_chat_template(messages, chat_template=template)
    assert time.monotonic() - started < 30
    # the templates that must render do so under the real limit: 0.3 s is a heavily loaded machine's blink (the
    # 6-million-character format below once ran past it on a busy CI machine)
    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", own_limit)
    assert tok.apply_chat_template(messages, chat_template="{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ messages[0].content }}") \
        == "ababab1024hi"
    ordinary = ("{{ 'a' ~ 'b' + 'c' }}{{ 'x' | center(3) }}{{ '%03d' % 7 }}{{ '{:>3}'.format(1) }}{{ 'ab'.replace('a', 'c') }}"
                "{{ ['p', 'q'] | join(',') }}{{ 'u\nv' | indent(2) }}{{ messages | tojson(indent=2) | length }}"
                "{{ 'hi' | upper }}{{ messages | map(attribute='role') | join }}{{ 3 * 4 }}")
    assert tok.apply_chat_template(messages, chat_template=ordinary) \
        == f"abc x 007  1cbp,qu\n  v{len(json.dumps(messages, indent=2))}HIuser12"
    # a big number is no size where the call makes nothing of its size (a timestamp, a default, a phone number)
    numbers = ("{{ 'sent at {}'.format(1717171717) }}|{{ {}.get('b', 100000000) }}|{{ x | default(100000000) }}|"
               "{{ 'call +1 5551234567, %s' % 'me' }}|{{ 'Build 20240601123000: {}'.format('r') }}|"
               "{{ namespace(seed=3141592653).seed }}|{{ '%*d' % (12, 1717171717) }}|"
               "{{ ('{}' * 10).format(1, 2, 3, 4, 5, 6, 7, 8, 9, 'c' * 6000000) | length }}")
    assert tok.apply_chat_template(messages, chat_template=numbers) == \
        "sent at 1717171717|100000000|100000000|call +1 5551234567, me|Build 20240601123000: r|3141592653|" \
        "  1717171717|6000009"
    assert "hi" in tok.apply_chat_template(messages)


def test_a_template_renders_untraced_and_its_time_limit_holds_under_a_tracer(tok: Tokenizer, monkeypatch) -> None:
    """The render's time limit is checked by the template's own code, not by tracing it: the template runs with
    whatever tracer was set before (none, or a debugger's or coverage's, which is kept and sees the render), and the
    limits hold under one too. Tracing each line made a real Gemma 4 template's render 3.3-3.9x slower (every chat
    turn and server request), and a tracer already set had turned the time limit off."""
    import sys

    import blockpress.tokenizer as tokenizer

    messages = [{"role": "user", "content": "hi"}]
    seen: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        seen.append(frame.f_code.co_filename)
        return None

    before = sys.gettrace()
    sys.settrace(None)
    try:
        assert tok.apply_chat_template(messages, chat_template="{{ tracer() is none }}", tracer=sys.gettrace) == "True"
        sys.settrace(tracer)
        assert tok.apply_chat_template(messages, chat_template="{{ 'a' * 3 }}") == "aaa"
        assert tok.apply_chat_template(messages, chat_template="{{ tracer() is sameas same }}", tracer=sys.gettrace,
                                       same=tracer) == "True"
        with pytest.raises(ValueError, match="its text passed"):
            tok.apply_chat_template(messages, chat_template="{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}")
        monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.0)  # past at the template's first check
        with pytest.raises(ValueError, match="^chat_template: rendering ran past 0 s"):
            tok.apply_chat_template(messages, chat_template="{% for i in range(1000) %}{% endfor %}")
        with pytest.raises(ValueError, match="^chat_template: rendering ran past 0 s"):  # a `set` is checked too
            tok.apply_chat_template(messages, chat_template="{% set a = 1 %}")
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)
    assert "<template>" in seen


def _sentencepiece_like() -> Tokenizer:
    """A Gemma-style SentencePiece tokenizer, as tokenizer.json writes one: pieces with ▁ for a space, one token per
    byte for what they lack (byte fallback: a character's bytes may be split over tokens, and a byte that makes the
    bytes before it invalid turns each into U+FFFD), a decoder that strips the text's leading space, special tokens
    and an added token that is not special."""
    from tokenizers import decoders, models, normalizers

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<unk>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "é", "日", "▁a", "ab", "▁ab", "▁▁"]:
        vocab[piece] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab, [("▁", "a"), ("a", "b"), ("▁a", "b"), ("▁", "▁")],
                                              byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
    backend.add_tokens(["<mask>"])
    return Tokenizer(backend=backend, bos_id=2, eos_ids=[1, 4], pad_id=0)


def _code_tokenizer() -> Tokenizer:
    from blockpress.lm import MODELS_DIR

    return Tokenizer.from_dir(MODELS_DIR / "blockpress-code")


STREAM_TOKENIZERS = {"blockpress-code": _code_tokenizer(), "sentencepiece-like": _sentencepiece_like()}


@st.composite
def _token_runs(draw: Any, tokenizer: Tokenizer) -> list[int]:
    """Ids as a reply may hold them: any token (a byte alone), runs of special tokens, and text's tokens, whose
    characters' bytes byte fallback spreads over several."""
    special = sorted(tokenizer.special_ids)
    parts = st.one_of(st.integers(0, tokenizer.vocab_size - 1).map(lambda i: [i]),
                      st.lists(st.sampled_from(special), min_size=1, max_size=8),  # a run of them: the window's all
                      st.text(alphabet="ab c\n é日€🙂\ufffd<>", max_size=6).map(tokenizer.encode),
                      st.text(alphabet="€🙂", min_size=2, max_size=4).map(tokenizer.encode))  # a run of byte tokens
    return [i for part in draw(st.lists(parts, max_size=24)) for i in part]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(STREAM_TOKENIZERS)), skip=st.booleans())
def test_a_text_stream_reads_every_prefix_as_the_whole_decode(data: Any, name: str, skip: bool) -> None:
    """TextStream decodes a window of the ids since its settled text: at each call, in steps of any size, its text is
    decode's of all the ids so far, a character split over tokens, a byte that spoils the bytes before it, special
    tokens and a decoder that strips the text's leading space included; and after ids that do not continue the
    last ones (a shorter row)."""
    from blockpress.tokenizer import TextStream

    tokenizer = STREAM_TOKENIZERS[name]
    ids = data.draw(_token_runs(tokenizer), "ids")
    steps = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=len(ids) + 1), "steps")
    stream = TextStream(tokenizer, skip_special_tokens=skip)
    end = 0
    for step in steps * (len(ids) + 1):
        end = min(end + step, len(ids))
        assert stream.text(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=skip), ids[:end]
        if end == len(ids):
            break
    other = ids[: data.draw(st.integers(0, len(ids)), "kept")] + data.draw(_token_runs(tokenizer), "other")
    assert stream.text(other) == tokenizer.decode(other, skip_special_tokens=skip), other


class _CountingDecodes:
    """A tokenizer that counts the ids it decodes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", sorted(STREAM_TOKENIZERS))
def test_a_text_stream_decodes_the_new_ids_not_the_whole_reply_again(name: str) -> None:
    """Each call decodes a few ids before the new ones twice, not all of them (each commit of a reply decoded the
    whole reply: its length squared), a character split over a step's edge and a reply's special tokens included."""
    from blockpress.tokenizer import STREAM_OVERLAP, TextStream

    tokenizer = STREAM_TOKENIZERS[name]
    ids = tokenizer.encode("<start_of_turn>" + "a b 日€ é🙂 ab\n" * 40 + "<end_of_turn>")
    for skip in (True, False):
        counting = _CountingDecodes(tokenizer)
        stream = TextStream(counting, skip_special_tokens=skip)
        for end in range(7, len(ids) + 7, 7):
            before = counting.decoded
            assert stream.text(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=skip)
            assert counting.decoded - before <= 2 * (7 + 7 + 2 * STREAM_OVERLAP), (end, counting.decoded - before)


@pytest.mark.parametrize("progress", [True, False])
def test_training_a_tokenizer_shows_its_progress_on_a_terminal_when_asked(progress):
    """train_bpe_tokenizer kept the tokenizers library's bars off, so scripts/build_code_corpus.py trained its
    vocabulary (minutes over the standard library) in silence; progress=True shows them, on a terminal."""
    import os
    import pty
    import subprocess
    import sys

    code = ("from blockpress.tokenizer import train_bpe_tokenizer; "
            f"train_bpe_tokenizer(['ab cd ef gh'] * 200, vocab_size=300, progress={progress})")
    main_fd, terminal_fd = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=terminal_fd, stdout=terminal_fd, stderr=terminal_fd)
    os.close(terminal_fd)
    shown = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # (the child closed the terminal)
            break
        if not chunk:
            break
        shown += chunk
    os.close(main_fd)
    assert child.wait(timeout=60) == 0
    assert (b"Pre-processing sequences" in shown) is progress, shown[:200]


def test_a_tokenizer_json_that_makes_the_library_panic_is_a_clear_error(tok: Tokenizer, tmp_path: Path) -> None:
    """A checkpoint's pre-tokenizer regex that backtracks past the library's limit made `tokenizers` panic, a
    BaseException that no `except Exception` caught: the server answered a plain-text 500. It is a ValueError naming
    tokenizer.json, for encode and encode_plain, and other texts still encode."""
    spec = json.loads(tok.backend.to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}
    hostile = Tokenizer(backend=tokenizers.Tokenizer.from_str(json.dumps(spec)), bos_id=2, eos_ids=[1])
    for encode in (hostile.encode, hostile.encode_plain):
        with pytest.raises(ValueError, match=r"^tokenizer.json: the tokenizer failed on this text of 35 characters"):
            encode("a" * 34 + "b")
        assert encode("aab") == tok.encode("aab")


def test_a_tokenizer_that_rendered_a_chat_copies_and_pickles(tok: Tokenizer) -> None:
    """copy.deepcopy and pickle of an LM worked until its first chat, then failed on the compiled templates the
    tokenizer keeps (jinja's code objects, the sandbox's thread-locals): a copy compiles its own."""
    import copy
    import pickle

    rendered = tok.apply_chat_template(TWO_TURNS)
    for copied in (copy.deepcopy(tok), pickle.loads(pickle.dumps(tok))):
        assert copied.apply_chat_template(TWO_TURNS) == rendered
    assert tok.apply_chat_template(TWO_TURNS) == rendered  # (the original keeps its own)


@pytest.mark.parametrize("declared", ["added_tokens_decoder", "added_tokens.json", "extra_special_tokens",
                                      "extra_special_tokens dict", "additional_special_tokens"])
def test_tokens_declared_beside_tokenizer_json_are_added_as_transformers_adds_them(tok: Tokenizer, tmp_path: Path,
                                                                                   declared: str) -> None:
    """A token a folder declares in tokenizer_config.json's added_tokens_decoder, an older added_tokens.json, or an
    extra_special_tokens list, but tokenizer.json lacks: transformers adds it; blockpress encoded a chat template's
    <tool> as ordinary text. Added here too, it encodes to transformers' id, and a save keeps it in tokenizer.json."""
    from transformers import AutoTokenizer

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>"}
    files: dict[str, Any] = {}
    if declared == "added_tokens_decoder":
        config["added_tokens_decoder"] = {str(tok.vocab_size): {"content": "<tool>", "special": True, "lstrip": False,
                                                                "rstrip": False, "normalized": False,
                                                                "single_word": False}}
    elif declared == "added_tokens.json":
        files["added_tokens__json"] = {"<tool>": tok.vocab_size}
    elif declared == "extra_special_tokens":
        config["extra_special_tokens"] = ["<tool>"]
    elif declared == "extra_special_tokens dict":  # named, as a model's image_token
        config["extra_special_tokens"] = {"tool_token": "<tool>"}
    else:  # transformers 4's name
        config["additional_special_tokens"] = ["<tool>"]
    folder = _write_checkpoint(tmp_path / "c", tok, tokenizer_config__json=config, **files)
    ours, theirs = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(str(folder))
    text = "def f(x): <tool> return x"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert tok.vocab_size in ours.encode(text) and ours.vocab_size == tok.vocab_size + 1
    ours.save(tmp_path / "saved")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert Tokenizer.from_dir(tmp_path / "saved").encode(text) == again.encode(text, add_special_tokens=False) \
        == ours.encode(text)


@pytest.mark.parametrize("key", ["\u00b2", "9" * 5000, "0{vocab}"])
def test_an_added_token_id_that_is_no_integer_is_skipped(tok: Tokenizer, tmp_path: Path, key: str) -> None:
    """A superscript two is a digit to isdigit, and 5,000 digits are past int()'s limit: both failed the load with
    Python's bare "invalid literal for int()" / "Exceeds the limit", naming neither file nor field. Skipped, as a
    key of letters is. A second spelling of an id ("0500" after "500") is that id, the last entry read as
    transformers reads it (sorting the pairs compared the entries: a bare TypeError)."""
    key, odd, tool = key.format(vocab=tok.vocab_size), {"content": "<odd>", "special": True}, {"content": "<tool>",
                                                                                               "special": True}
    decoder = {str(tok.vocab_size): odd, key: tool} if key.startswith("0") else {key: odd, str(tok.vocab_size): tool}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder}
    ours = Tokenizer.from_dir(_write_checkpoint(tmp_path / "c", tok, tokenizer_config__json=config))
    assert ours.vocab_size == tok.vocab_size + 1 and ours.encode("<tool>") == [tok.vocab_size]


def test_a_vocabulary_word_a_config_declares_special_is_special_as_in_transformers(tok: Tokenizer,
                                                                                  tmp_path: Path) -> None:
    """A token tokenizer.json has as an ordinary word, which added_tokens_decoder declares special: transformers makes
    it a special added token (matched whole, dropped by decode); blockpress left it ordinary."""
    from transformers import AutoTokenizer

    word = next(w for w in ("return", "self", "def") if tok.backend.token_to_id(w) is not None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": {
        str(tok.backend.token_to_id(word)): {"content": word, "special": True, "lstrip": False, "rstrip": False,
                                            "normalized": False, "single_word": False}}}
    folder = _write_checkpoint(tmp_path / "c", tok, tokenizer_config__json=config)
    ours, theirs = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(str(folder))
    text = f"x = 1\n{word} x"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text, add_special_tokens=False),
                                                           skip_special_tokens=True)
    assert ours.vocab_size == tok.vocab_size and tok.backend.token_to_id(word) in ours.special_ids
