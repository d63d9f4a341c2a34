"""Data: JSONL formats, canvas layout, token shards, the corpus script."""

import copy
import dataclasses
import hashlib
import itertools
import json
import re
import subprocess
import sys
from array import array
from pathlib import Path

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from terminal import read_terminal

from blockpress.data import (
    _RUN_CONFIG_KEYS,
    Example,
    TokenShards,
    is_raw_text,
    jsonl_files,
    left_out,
    load_jsonl,
    load_text,
    make_batch,
    parse_examples,
    shard_files,
    split_heldout,
    write_shard,
)
from blockpress.tokenizer import train_bpe_tokenizer
from blockpress.train_config import TrainConfig

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)


def test_canvas_layout_eos_fill_and_padding():
    batch = make_batch([Example([2, 3], [5, 6, 7]), Example([2], [5] * 9)], canvas_length=4, pad_id=0, eos_id=1)
    assert batch.prompt_length == 2 and batch.ids.shape == (2, 2 + 3 * 4)
    # row 0: one canvas, EOS-filled; its two later canvases are padding (not valid, not scored)
    assert batch.ids[0, 2:6].tolist() == [5, 6, 7, 1]
    assert batch.scored[0].tolist() == [True] * 4 + [False] * 8
    # row 1: 9 tokens -> 3 canvases (the last holds 1 token + EOS fill); prompt left-padded
    assert batch.ids[1, :2].tolist() == [0, 2] and not batch.valid[1, 0]
    assert batch.ids[1, 2:].tolist() == [5] * 9 + [1] * 3
    # AR targets stop at the first EOS
    assert batch.ar_scored[0].nonzero()[-1].item() == 4  # position 4 predicts the EOS at slot 5


def test_canvas_exactly_full_gets_an_eos_canvas():
    batch = make_batch([Example([2], [5, 6, 7, 8])], canvas_length=4, pad_id=0, eos_id=1)
    assert batch.ids[0, 1:].tolist() == [5, 6, 7, 8, 1, 1, 1, 1]


def test_running_text_windows_have_no_eos():
    batch = make_batch([Example([2], [5, 6, 7, 8, 9, 10], ends=False)], canvas_length=4, pad_id=0, eos_id=1)
    assert 1 not in batch.ids[0].tolist()
    assert batch.scored[0].tolist() == [True] * 6 + [False] * 2


def test_jsonl_formats(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    lines = [
        {"prompt": "def f(x):", "response": " return x"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"prompt_ids": [2, 7], "response_ids": [9, 10]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ex = load_jsonl(path, tok, vocab_size=tok.vocab_size)
    assert len(ex) == 3
    assert ex[0].prompt[0] == tok.bos_id and list(ex[0].response) == tok.encode(" return x")  # make_batch adds the EOS
    assert tok.decode(ex[1].prompt, skip_special_tokens=False).endswith("<start_of_turn>model\n")
    assert ex[1].response[-1] == tok.token_to_id("<end_of_turn>")
    assert ex[2] == Example(array("i", [2, 7]), array("i", [9, 10]))  # held compactly (4 bytes a token)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(st.text(alphabet="def x():+1\n ", min_size=1, max_size=12),
                  st.text(alphabet="def x():+1\n ", max_size=24), st.integers(2, 6))
def test_a_text_record_trains_as_the_ids_record_of_its_tokens(tok, prompt, response, canvas):
    """parse_example put an EOS after a text record's response and make_batch another after that: an EOS -> EOS
    next-token target, and a canvas of nothing but EOS after a response of canvas - 1 tokens, where the same
    tokens given as prompt_ids/response_ids trained neither."""
    [text] = parse_examples({"prompt": prompt, "response": response}, tok, "d.jsonl:1")
    [ids] = parse_examples({"prompt_ids": tok.encode_prompt(prompt), "response_ids": tok.encode(response)}, tok,
                           "d.jsonl:2")
    a, b = (make_batch([ex], canvas, pad_id=0, eos_id=tok.eos_id) for ex in (text, ids))
    for field in ("ids", "valid", "scored", "ar_scored"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.prompt_length == b.prompt_length


@pytest.mark.parametrize("role", ["user", "Assistant", "bot", None])
def test_messages_must_end_with_assistant_and_a_wrong_last_role_is_named(tmp_path, tok, role):
    """A misspelt last role ("Assistant", "bot") got "'messages' must be a list ending with an assistant message",
    naming neither the message nor the role read."""
    path = tmp_path / "d.jsonl"
    last = {"content": "there"} if role is None else {"role": role, "content": "there"}
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, last]}) + "\n")
    with pytest.raises(ValueError, match=rf"d.jsonl:1: messages\[1\].role is {re.escape(repr(role))}; the last message "
                                         r"must be the assistant's \('assistant' or 'model'\)"):
        load_jsonl(path, tok)


def test_a_record_both_a_chat_and_a_prompt_response_is_refused_and_metadata_is_not(tok):
    """It trained on the chat and dropped the prompt/response without a word (a leftover column). Fields of no whole
    text stay metadata: ultrachat's `prompt` beside `messages`, the nulls a dataframe export writes for a row's
    missing columns, and the text kept beside token ids (which win)."""
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match=r"d.jsonl:1: holds both a chat \('messages'\) and a 'prompt'\+'response'; "
                                         r"which one is this record's text"):
        parse_examples({"prompt": "P", "response": "R", "messages": chat}, tok, "d.jsonl:1")
    ids = Example(array("i", [2, 5]), array("i", [6, 7]))
    for record, examples in (({"prompt": "a", "prompt_id": "x1", "messages": chat}, 1),
                             ({"messages": chat, "prompt": None, "response": None}, 1),
                             ({"messages": None, "prompt": "P", "response": "R"}, 1),
                             ({"prompt_ids": [2, 5], "response_ids": [6, 7], "prompt": "P", "response": "R"}, [ids]),
                             ({"prompt_ids": [2, 5], "response_ids": [6, 7], "messages": chat}, [ids]),
                             ({"prompt_ids": None, "response_ids": None, "prompt": "P", "response": "R"}, 1)):
        got = parse_examples(record, tok, "d.jsonl:1")
        assert (len(got) if isinstance(examples, int) else got) == examples, record


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.lists(st.text(alphabet="ab x:\n", max_size=6), min_size=1, max_size=3),
       st.lists(st.text(alphabet="ab x:\n", min_size=1, max_size=6), min_size=1, max_size=3))
def test_chat_content_parts_train_as_the_server_reads_them(tok, asked, answer):
    """OpenAI's content parts were trained on as the Python repr of the list ("[{'type': 'text', ...}]"), while
    `blockpress serve` joins their text (one line apart, as vLLM joins them): the model was prompted unlike it was
    trained."""
    from blockpress.serve import Message

    def parts(pieces):
        return [{"type": "text", "text": piece} for piece in pieces]

    as_parts = {"messages": [{"role": "user", "content": parts(asked)}, {"role": "assistant", "content": parts(answer)}]}
    as_text = {"messages": [{"role": "user", "content": "\n".join(asked)},
                            {"role": "assistant", "content": "\n".join(answer)}]}
    [ex] = parse_examples(as_parts, tok, "d.jsonl:1")
    assert [ex] == parse_examples(as_text, tok, "d.jsonl:1")
    served = Message.model_validate(as_parts["messages"][0]).for_template(0)  # a request's user turn
    assert tok.apply_chat_template([served], add_generation_prompt=True, tokenize=True) == list(ex.prompt)


def test_a_developer_message_trains_as_the_template_renders_it(tok):
    """"developer" trained as "system" even under a template that renders it itself (DeepSeek V4's, in the user
    turn): the prompt is the template's for "developer" where its text names the role, and "system"'s where not."""
    from test_tokenizer import DEVELOPER_TEMPLATE, ROLE_TEMPLATE

    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}]
    for template, asked in ((DEVELOPER_TEMPLATE, "<User>Be brief.<User>Hi<Assistant>"),
                            (ROLE_TEMPLATE + "{% if add_generation_prompt %}<assistant>{% endif %}",
                             "<system>Be brief.<user>Hi<assistant>")):
        custom = copy.copy(tok)
        custom.chat_template = template
        [example] = parse_examples({"messages": chat}, custom, "d.jsonl:1")
        assert custom.decode(example.prompt, skip_special_tokens=False) == asked


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "assistant", "content": "y"}],
     r"d.jsonl:1: messages\[0\].content: only text parts .* \(messages\[0\].content\[0\] is 'image_url'\)"),
    # trained silently as an empty turn, where the server answers 400
    ([{"role": "user"}, {"role": "assistant", "content": "y"}],
     r"d.jsonl:1: messages\[0\].content: expected str or a list of text parts, got nothing"),
    ([{"role": "user", "content": []}, {"role": "assistant", "content": "y"}],
     r"d.jsonl:1: messages\[0\].content: an empty list of parts"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}],
     r"d.jsonl:1: messages\[1\].content: expected str or a list of text parts, got int"),
    # was "an empty conversation; give at least one message", of a conversation holding one
    ([{"role": "assistant", "content": "y"}], r"d.jsonl:1: 'messages' has no user message before the assistant's "
                                              r"\(messages\[0\]\); give the user turn"),
    # two assistant turns, or a system turn before one, passed: the model trained on a prompt of no user turn
    ([{"role": "assistant", "content": "y"}, {"role": "assistant", "content": "z"}],
     r"d.jsonl:1: 'messages' has no user message before the assistant's \(messages\[1\]\)"),
    ([{"role": "system", "content": "s"}, {"role": "model", "content": "y"}],
     r"d.jsonl:1: 'messages' has no user message before the assistant's \(messages\[1\]\)"),
])
def test_chat_messages_a_template_cannot_render_are_named(tmp_path, tok, messages, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path, tok)


CHAT = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "FIRST"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "second"}]


# A Gemma-4-style template: its turns are <|turn>ROLE ... <turn|>, not Gemma 3's <start_of_turn> ... <end_of_turn>.
TURN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content | trim }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


@pytest.mark.parametrize(("template", "end"), [
    (TURN_TEMPLATE, "<turn|>"),
    # a template that writes plain text after a reply, and no header for the turn to come (it ignores
    # add_generation_prompt): the reply is all it writes for the turn, its header and newline too, then the EOS
    # make_batch adds
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", None),
])
def test_a_chat_reply_ends_with_the_templates_end_of_turn(template, end):
    """A reply trained on ended with <end_of_turn> whatever the template: a Gemma-4-style checkpoint, whose template
    ends an assistant turn with <turn|>, was trained to end its replies with EOS alone (its <turn|> never a
    target), and a template without either still got <end_of_turn> where the vocabulary had one."""
    tok = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300,
                              special_tokens=["<pad>", "<eos>", "<bos>", "<end_of_turn>", "<|turn>", "<turn|>"])
    tok.chat_template = template
    [example] = parse_examples({"messages": CHAT[:2]}, tok, "d.jsonl:1")
    rendered = tok.apply_chat_template(CHAT[:2], add_generation_prompt=False)
    assert "FIRST" + (end or "\n") in rendered  # the template's own rendering of the reply
    expected = tok.encode("FIRST") + [tok.token_to_id(end)] if end else tok.encode("assistant: FIRST\n")
    assert list(example.response) == expected


def test_every_assistant_turn_of_a_chat_is_an_example(tok):
    """Only the last assistant turn was trained on; the earlier replies were prompt alone, a multi-turn dataset
    training on about 1/N of its assistant text. chat_turns="last" keeps that."""
    end = [tok.token_to_id("<end_of_turn>")]
    first, second = parse_examples({"messages": CHAT}, tok, "d.jsonl:1")
    assert list(first.prompt) == tok.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=True)
    assert list(first.response) == tok.encode("FIRST") + end
    assert list(second.prompt) == tok.apply_chat_template(CHAT[:3], add_generation_prompt=True, tokenize=True)
    assert list(second.response) == tok.encode("second") + end
    assert parse_examples({"messages": CHAT}, tok, "d.jsonl:1", chat_turns="last") == [second]


def test_an_assistant_greeting_before_the_user_is_context(tok):
    """A chat opening with the assistant's greeting was refused ('no user message before the assistant's'), though
    lm.chat_prompt renders it and the reply trained on answers a user. The greeting is prompt, not a target."""
    greeted = [{"role": "assistant", "content": "Hi, how can I help?"}, *CHAT]
    examples = parse_examples({"messages": greeted}, tok, "d.jsonl:1")
    assert [tok.decode(e.response) for e in examples] == ["FIRST", "second"]
    assert list(examples[0].prompt) == tok.apply_chat_template(greeted[:2], add_generation_prompt=True, tokenize=True)
    assert "Hi, how can I help?" in tok.decode(examples[0].prompt)


def test_the_turns_of_a_chat_are_held_out_together(tmp_path, tok):
    """A later turn's prompt holds the earlier replies: split apart, a held-out reply is trained on as prompt."""
    path = tmp_path / "d.jsonl"
    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
              {"role": "user", "content": "more"}, {"role": "assistant", "content": f"b{i}"}] for i in range(60)]
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    examples = load_jsonl(path, tok)
    assert len(examples) == 120
    train, held = split_heldout(examples, 0.3)
    held_replies = {tok.decode(e.response) for e in held}
    assert 0 < len(held) < 120
    for i in range(60):
        assert (f"a{i}" in held_replies) == (f"b{i}" in held_replies), i
    # the conversations held out are those of the last turn alone (chat_turns="last"), as before
    last = load_jsonl(path, tok, chat_turns="last")
    assert {tok.decode(e.response) for e in split_heldout(last, 0.3)[1]} == {r for r in held_replies if r[0] == "b"}


def test_no_example_is_both_trained_and_held_out_where_chats_share_a_turn(tmp_path, tok):
    """A conversation and its extension by one more turn (as chat-tree datasets hold them) each hashed their turns
    by their own last turn: the first turn, the same example in both, was held out in one and trained on in the
    other (35 such of 600 examples). A held-out copy of a trained example now trains. Chats that all open with one
    canned exchange keep their held-out share (joining every chat that shares a turn held out none of them or all),
    and the split is the same in any order."""
    key = lambda e: (tuple(e.prompt), tuple(e.response))  # noqa: E731
    greeting = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! What shall we do?"}]
    for name, records in (
            ("trees", [r for i in range(80) for base in [[{"role": "user", "content": f"q{i}"},
                                                         {"role": "assistant", "content": f"a{i}"}]]
                       for r in (base, [*base, {"role": "user", "content": "more"}, {"role": "assistant",
                                                                                    "content": f"b{i}"}])]),
            ("greeted", [[*greeting, {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                         for i in range(100)])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in records))
        examples = load_jsonl(path, tok)
        train, held = split_heldout(examples, 0.3)
        assert not {key(e) for e in train} & {key(e) for e in held}, name
        assert 0.1 * len(examples) < len(held) < 0.4 * len(examples), (name, len(held), len(examples))
        again = split_heldout(list(reversed(examples)), 0.3)[1]
        assert sorted(map(key, again)) == sorted(map(key, held))


def test_a_chat_turn_too_long_for_the_context_is_named(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    long = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x " * 40},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]
    path.write_text(json.dumps({"messages": long}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: messages\[1\]: prompt and response take"):
        load_jsonl(path, tok, context=(4, 40, None))


def test_a_chat_is_refused_at_its_first_turn_too_long_without_making_the_later_ones(tmp_path, tok, monkeypatch):
    """A chat's turns were all rendered and tokenized (each renders the whole chat before it) before any was checked
    against the context: a chat of 600 turns took 6 s to be refused at messages[33]. The first turn that cannot fit
    stops the record."""
    calls = []
    render = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: (calls.append(1), render(*a, **k))[1])
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x " * 40}] * 20
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": turns}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: messages\[1\]: prompt and response take"):
        load_jsonl(path, tok, context=(4, 40, None))
    assert 0 < len(calls) <= 3, len(calls)  # the first assistant turn's prompt and reply, not the 19 after it


def test_jsonl_examples_are_held_compactly_and_draw_the_batches_they_did(tmp_path, tok):
    """JSONL examples were held as Python lists of ints once tokenized, some 36 bytes a token (11 MB of memory per MB
    of JSONL, for the whole run): their ids are an array("i"), 4 bytes a token, and a run holds out the examples and
    draws the batches (the same seed) it did when they were lists."""
    from blockpress.train import ExampleSource, StepBatches

    path = tmp_path / "d.jsonl"
    records = [{"prompt": f"def f{i}(x):", "response": " return x + 1\n" * (i % 5)} for i in range(30)]
    records += [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x + 1 " * i},
                              {"role": "user", "content": "more"}, {"role": "assistant", "content": f"b{i}"}]}
                for i in range(20)]
    records += [{"prompt_ids": [2, 7 + i], "response_ids": [9 + i] * i} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    examples = load_jsonl(path, tok, vocab_size=tok.vocab_size)
    assert all(isinstance(ids, array) and ids.itemsize == 4 for e in examples for ids in (e.prompt, e.response))
    lists = [dataclasses.replace(e, prompt=list(e.prompt), response=list(e.response),
                                 split_key=e.split_key and (list(e.split_key[0]), list(e.split_key[1])))
             for e in examples]  # as they were held

    def held_out_as_it_was(e: Example) -> bool:  # split_heldout's hash of the lists' JSON
        text = json.dumps(list(e.split_key) if e.split_key else [e.prompt, e.response])
        return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < 0.3

    train, held = split_heldout(examples, 0.3)
    at = {id(e): i for i, e in enumerate(examples)}
    assert [at[id(e)] for e in held] == [i for i, e in enumerate(lists) if held_out_as_it_was(e)] != []
    cfg = TrainConfig(steps=8, batch_size=4, seed=5, max_canvases=3)
    kept = [lists[at[id(e)]] for e in train]
    for step in range(cfg.steps):
        (a, noise_a), (b, noise_b) = (StepBatches(ExampleSource(source, cfg.seed), cfg, canvas_length=4,
                                                  vocab_size=tok.vocab_size, pad=0, eos=tok.eos_id)[step]
                                      for source in (train, kept))
        for x, y in zip(dataclasses.astuple(a) + dataclasses.astuple(noise_a),
                        dataclasses.astuple(b) + dataclasses.astuple(noise_b)):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, step
    # an id no array("i") holds is no token id, and said so (no vocabulary given to refuse it by)
    with pytest.raises(ValueError, match=r"d.jsonl:1: field 'response_ids': 2147483648 is no token id"):
        parse_examples({"prompt_ids": [2], "response_ids": [2**31]}, tok, "d.jsonl:1")
    # (a negative one too, as what it is: "ids are below 2**31" was true of it, and odd)
    with pytest.raises(ValueError, match=r"field 'prompt_ids': -1099511627776 is no token id \(ids are 32-bit "
                                         r"integers\)"):
        parse_examples({"prompt_ids": [-2**40], "response_ids": [2]}, tok, "d.jsonl:1")


def test_heldout_split_is_stable():
    ex = [Example([2], [i]) for i in range(200)]
    a_train, a_held = split_heldout(ex, 0.1)
    b_train, b_held = split_heldout(list(reversed(ex)), 0.1)
    assert {tuple(e.response) for e in a_held} == {tuple(e.response) for e in b_held}
    assert 5 <= len(a_held) <= 40 and len(a_train) + len(a_held) == 200


def test_shards_roundtrip_and_windows(tmp_path):
    docs = [[3, 4, 5, 6, 7, 1], list(range(10, 60)) + [1]]
    n = write_shard(tmp_path / "s.bin", docs, vocab_size=100)
    shards = TokenShards([tmp_path / "s.bin"])
    assert n == shards.tokens == 57
    flat = np.concatenate([np.array(d) for d in docs])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ex = shards.sample(g, (2, 5), 8)
        window = ex.prompt + ex.response
        assert 2 <= len(ex.prompt) <= 5 and len(ex.response) == 8 and not ex.ends
        starts = [i for i in range(len(flat) - len(window) + 1) if flat[i : i + len(window)].tolist() == window]
        assert starts  # a real contiguous window of the corpus


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(st.integers(2, 40), st.data())
def test_a_shard_yields_windows_up_to_its_whole_length(size, data):
    """A shard of exactly a window's length holds one window, and sample() refused it ("no shard holds a 20-token
    window (the longest holds 20 tokens)"): a shard's weight was size - need, one fewer than its windows."""
    need = data.draw(st.integers(2, size))
    prompt = data.draw(st.integers(1, need - 1))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ex = TokenShards.of_tokens(np.arange(100, 100 + size)).sample(g, (prompt, prompt), need - prompt)
    window = ex.prompt + ex.response
    assert len(ex.prompt) == prompt and window == list(range(window[0], window[0] + need)) and window[-1] < 100 + size


def test_shards_are_drawn_by_the_windows_they_hold(tmp_path):
    """With windows as long as the longest shard, only that shard holds one: it was weighted 0, and refused."""
    write_shard(tmp_path / "a.bin", [list(range(10, 30))], vocab_size=100)  # 20 tokens: one 20-token window
    write_shard(tmp_path / "b.bin", [list(range(40, 59))], vocab_size=100)  # 19 tokens: none
    shards = TokenShards([tmp_path / "a.bin", tmp_path / "b.bin"])
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ex = shards.sample(g, (10, 10), 10)
        assert ex.prompt + ex.response == list(range(10, 30))


def test_corpus_script_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_code_corpus.py"), "--out", str(tmp_path),
                        "--vocab-size", "400", "--max-files", "40", "--heldout", "0.2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr  # its bars (reading, encoding) are a terminal's alone: none in a pipe
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["train_files"] > 0 and manifest["heldout_files"] > 0
    assert manifest["train_tokens"] == TokenShards([tmp_path / "train.bin"]).tokens
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()
    held = set(manifest["heldout_modules"])
    assert held and all(m.endswith(".py") for m in held)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b, j: j.write_text('{"dtype": "float32", "tokens": 57}'), r'"dtype" must be one of'),
        (lambda b, j: j.write_text('{"dtype": "int8"}'), r'"dtype" must be one of'),
        (lambda b, j: j.write_text('{"dtype": "uint16", "tokens": 114}'), "says 114 tokens, but s.bin holds 57"),
        (lambda b, j: j.write_text("{}"), r'"dtype" must be one of'),
        (lambda b, j: j.write_text("[1]"), r'"dtype" must be one of'),
        (lambda b, j: j.unlink(), "cannot read its sidecar"),
        (lambda b, j: b.write_bytes(b.read_bytes()[:-1]), "not a whole number"),
        (lambda b, j: (b.write_bytes(b""), j.write_text('{"dtype": "uint16"}')), "0 bytes"),
        (lambda b, j: (b.write_bytes(np.array([3, 4, 60000], dtype=np.uint16).tobytes()),
                       j.write_text('{"dtype": "uint16", "tokens": 3}')), "token id 60000, outside the model's vocabulary of 100"),
    ],
)
def test_bad_shards_are_refused_naming_the_file(tmp_path, edit, message):
    """A sidecar naming the wrong dtype used to train on the bytes read as that dtype, silently."""
    write_shard(tmp_path / "s.bin", [[3, 4, 5, 6, 7, 1], list(range(10, 60)) + [1]], vocab_size=100)
    edit(tmp_path / "s.bin", tmp_path / "s.bin.json")
    with pytest.raises(ValueError, match=message) as err:
        TokenShards([tmp_path / "s.bin"], vocab_size=100)
    assert "s.bin" in str(err.value)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("count", [False, True])
def test_a_numpy_npy_file_is_refused_as_a_shard(tmp_path, dtype, count):
    """np.save's .npy under a hand-written sidecar without a token count trained on its header as tokens (200 ids
    read as 264, the first 20115, 19797, 22864: b"\\x93NUMPY"); with a count it said only that the counts differ."""
    ids = np.arange(1, 201, dtype=dtype)
    np.save(tmp_path / "s.npy", ids)
    sidecar = {"dtype": dtype, **({"tokens": len(ids)} if count else {})}
    (tmp_path / "s.npy.json").write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match=r"s.npy: is a NumPy .npy file \(np.save\), whose header would be read as"):
        TokenShards([tmp_path / "s.npy"], vocab_size=32768)
    ids.tofile(tmp_path / "s.npy")  # the raw ids, as the message says: the same sidecar reads them
    (tmp_path / "s.npy.json").write_text(json.dumps({"dtype": dtype, "tokens": len(ids)}))
    assert TokenShards([tmp_path / "s.npy"], vocab_size=32768).arrays[0].tolist() == ids.tolist()


def test_a_shard_glob_skips_sidecars_and_says_when_nothing_matches(tmp_path):
    write_shard(tmp_path / "a.bin", [[3, 4, 5]], vocab_size=100)
    write_shard(tmp_path / "b.bin", [[6, 7]], vocab_size=100)
    assert shard_files(str(tmp_path / "*"), "--data") == [str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]
    with pytest.raises(FileNotFoundError, match="--heldout-data .*nomatch.*no token shards match"):
        shard_files(str(tmp_path / "nomatch*"), "--heldout-data")


def test_data_that_is_neither_jsonl_nor_shards_says_what_was_expected(tmp_path):
    """Each said "cannot read its sidecar X.json" or "no token shards match" before."""
    record = json.dumps({"prompt_ids": [2], "response_ids": [3]}) + "\n"
    (tmp_path / "data.json").write_text(record)
    (tmp_path / "code.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "shards").mkdir()
    for name, end in (("data.json", "; it starts with '{': if it is JSONL, rename it to data.jsonl"),
                      ("code.txt", "in a clone of the blockpress repository builds a corpus of them)"),
                      ("shards", f"(e.g. {tmp_path / 'shards'}/*.bin)")):
        with pytest.raises(ValueError if name != "shards" else IsADirectoryError) as err:
            shard_files(str(tmp_path / name), "--data")
        assert str(err.value).startswith(f"--data {tmp_path / name}: "), err.value
        assert str(err.value).endswith(end), err.value
        if name != "shards":
            assert "expected a .jsonl file (one JSON object per line) or token shards" in str(err.value)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(IsADirectoryError, match="dir.jsonl: is a directory"):
        load_jsonl(tmp_path / "dir.jsonl")


def test_a_byte_order_mark_before_the_first_line_is_read_past(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + (json.dumps({"prompt_ids": [2], "response_ids": [3]}) + "\n").encode() * 2)
    assert [(list(e.prompt), list(e.response)) for e in load_jsonl(path)] == [([2], [3])] * 2  # was "Unexpected UTF-8 BOM"


def test_a_key_given_twice_in_a_record_is_refused_naming_line_and_key(tmp_path, tok):
    """json.loads keeps the last of a repeated key: the first response (or a chat message's first content) was
    trained away without a word, where generate --input refuses the same line."""
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "def f(x):", "response": " return x"}) + "\n"
    path.write_text(good + '{"prompt": "def f(x):", "response": " return x", "response": " raise ValueError"}\n')
    with pytest.raises(ValueError, match=r'd.jsonl:2: "response" is given twice in one object \(JSON would keep '
                                         r"only the last\); give it once"):
        load_jsonl(path, tok)
    path.write_text('{"messages": [{"role": "user", "content": "hi", "content": "ho"}, '
                    '{"role": "assistant", "content": "x"}]}\n')  # nested, too
    with pytest.raises(ValueError, match=r'd.jsonl:1: "content" is given twice'):
        load_jsonl(path, tok)
    path.write_text('{"text": "a", "text": "b"}\n')  # running text reads the same lines
    with pytest.raises(ValueError, match=r'd.jsonl:1: "text" is given twice'):
        load_text(path, tok)
    path.write_text(good * 2)  # the same key in two records is no repeat
    assert len(load_jsonl(path, tok)) == 2


def test_jsonl_errors_name_the_line_for_encoding_templates_and_length(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt_ids": [2], "response_ids": [3]}) + "\n"
    path.write_bytes(good.encode() + b'{"prompt": "caf\xff", "response": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid UTF-8"):
        load_jsonl(path, tok)
    path.write_text(good + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")  # was a bare RecursionError
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON \(nested deeper than Python's JSON parser"):
        load_jsonl(path, tok)
    path.write_text(good + '{"prompt_ids": [' + "9" * 5000 + '], "response_ids": [3]}\n')  # was a bare ValueError
    with pytest.raises(ValueError, match=r"^.*d.jsonl:2: not valid JSON \(a number of more digits than Python reads "
                                         r"\(Exceeds the limit \(4300 digits\)"):
        load_jsonl(path, tok)
    path.write_text(good + json.dumps({"messages": [{"role": "banana", "content": "hi"},
                                                    {"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: "):
        load_jsonl(path, tok)
    # 30 prompt tokens + one 16-token canvas fit a context of 64; 60 + 16 do not
    path.write_text(good + json.dumps({"prompt_ids": [2] * 30, "response_ids": [3] * 5}) + "\n")
    assert len(load_jsonl(path, tok, context=(16, 64, None))) == 2
    path.write_text(good + json.dumps({"prompt_ids": [2] * 60, "response_ids": [3] * 5}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: prompt and response take 76 positions .* context of 64$"):
        load_jsonl(path, tok, context=(16, 64, None))  # the prompt leaves no room for a canvas: no --max-canvases
    # a long response fits when the trainer keeps only its first canvases
    path.write_text(good + json.dumps({"prompt_ids": [2] * 30, "response_ids": [3] * 200}) + "\n")
    assert len(load_jsonl(path, tok, context=(16, 64, 2))) == 2
    with pytest.raises(ValueError, match="take 238 positions") as err:
        load_jsonl(path, tok, context=(16, 64, None))
    assert str(err.value).endswith("; --max-canvases 2 keeps the first 2 canvases of each response and fits it")


def test_a_prompt_response_record_too_long_to_fit_is_refused_before_it_is_tokenized(tmp_path, tok, monkeypatch):
    """A {"prompt","response"} record was tokenized whole before its tokens were counted against the context: an 8 MB
    response took 17 s and 1.4 GB to refuse, a 100 MB one ran out of memory. No token holds more than
    longest_token() characters, so a text of more than that times the positions cannot fit: refused by its length,
    as the server refuses a request's. With --max-canvases a response of any length is cut to fit."""
    most = tok.longest_token()
    encoded = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: (encoded.append(len(text)), encode(text, *a, **k))[1])
    path = tmp_path / "d.jsonl"
    long = "x" * (64 * most + 1)
    path.write_text(json.dumps({"prompt": "def f", "response": long}) + "\n")
    with pytest.raises(ValueError, match=rf"^.*d.jsonl:1: 'response': {len(long):,} characters cannot fit the \d+ "
                                         rf"positions that the model's context of 64 leaves after a prompt of \d+ "
                                         rf"tokens \(no token of this vocabulary holds more than {most} characters.*"
                                         rf"; --max-canvases 3 keeps the first 3 canvases"):
        load_jsonl(path, tok, context=(16, 64, None))
    assert len(long) not in encoded
    assert len(load_jsonl(path, tok, context=(16, 64, 2))) == 1  # cut to 2 canvases: it fits
    path.write_text(json.dumps({"prompt": long, "response": "x"}) + "\n")
    encoded.clear()
    with pytest.raises(ValueError, match=rf"^.*d.jsonl:1: 'prompt': {len(long):,} characters cannot fit the model's "
                                         rf"context of 64 tokens \(no token of this vocabulary holds more than {most}"):
        load_jsonl(path, tok, context=(16, 64, 2))
    assert not encoded
    # a prompt that fits but leaves less than one canvas: the response is not tokenized either (it was, to 5 MB)
    prompt = " ".join(["word"] * 80)  # (more tokens than the context: room for no response at all)
    path.write_text(json.dumps({"prompt": prompt, "response": long}) + "\n")
    encoded.clear()
    for cut in (None, 2):
        with pytest.raises(ValueError, match=r"d.jsonl:1: 'prompt': \d+ tokens leave \d+ of the model's context of 64 "
                                             r"positions, less than one canvas of response \(16\)"):
            load_jsonl(path, tok, context=(16, 64, cut))
    assert len(long) not in encoded
    # exactly one canvas of room is room enough; a position less is not
    n = len(tok.encode_prompt("def add(a, b):"))
    path.write_text(json.dumps({"prompt": "def add(a, b):", "response": "ok"}) + "\n")
    assert len(load_jsonl(path, tok, context=(8, n + 8, None))) == 1
    with pytest.raises(ValueError, match=rf"'prompt': {n} tokens leave 7 of the model's context of {n + 7} positions"):
        load_jsonl(path, tok, context=(8, n + 7, None))


def test_max_canvases_tokenizes_a_long_response_as_far_as_it_keeps(tmp_path, tok, monkeypatch):
    """With max_canvases a response was tokenized whole and kept whole, though make_batch lays out its first canvases
    alone: a 12 MB response kept to 4 canvases took 230 s and 3 GB, and the hint of the refusal without
    --max-canvases led there. Its text is now cut to a prefix that holds a canvas more tokens than are kept (at a
    point the tokenizer splits at), and the ids kept are the whole text's first max_canvases canvases."""
    most = tok.longest_token()
    encoded = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: (encoded.append(len(text)), encode(text, *a, **k))[1])
    long = "x = 1\n" * 20_000 + "def f(x):\n    return x + 1\n" * 5_000
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "def f", "response": long}) + "\n")
    [ex] = load_jsonl(path, tok, context=(16, 64, 2))
    assert max(encoded) < (2 * 16 + 16) * most + 100  # the prompt and a prefix of the response, never all of it
    assert list(ex.response) == encode(long)[: 2 * 16]
    # a stretch without a point to cut at (base64, minified JSON) is cut at the limit all the same: it was encoded
    # whole, and kept whole (2 MB of base64: 1.7 M ids, review)
    import base64
    import random

    blob = base64.b64encode(random.Random(0).randbytes(60_000)).decode()
    encoded.clear()
    [ex] = parse_examples({"prompt": "def f", "response": blob}, tok, "d.jsonl:1", context=(16, 64, 2))
    assert max(encoded) < (2 * 16 + 16) * most + 100 and list(ex.response) == encode(blob)[: 2 * 16]
    encoded.clear()  # (and followed by a line far on, where a cut could go: it was encoded up to that line)
    [ex] = parse_examples({"prompt": "def f", "response": blob + "\nend"}, tok, "d.jsonl:1", context=(16, 64, 2))
    assert max(encoded) < (2 * 16 + 16 * 2) * most + 100 and list(ex.response) == encode(blob)[: 2 * 16]
    # a response that is not that long is kept whole, as without max_canvases
    encoded.clear()
    [short] = parse_examples({"prompt": "def f", "response": "x = 1\n" * 3}, tok, "d.jsonl:1", context=(16, 64, 2))
    assert list(short.response) == encode("x = 1\n" * 3)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.text(alphabet="def x():+1\n ", min_size=1, max_size=400), st.integers(1, 3), st.integers(1, 4))
def test_a_response_cut_for_max_canvases_keeps_the_whole_texts_ids(tok, response, canvases, canvas):
    """The ids kept of a response cut before it is tokenized (max_canvases) are those its whole text's tokens begin
    with, for any text and cut: the prefix ends at a point where the tokenizer splits (_PIECE_BOUNDARY)."""
    [ex] = parse_examples({"prompt": "def", "response": response}, tok, "d.jsonl:1",
                          context=(canvas, 10_000, canvases))
    whole = tok.encode(response)
    assert list(ex.response) == whole[: max(len(ex.response), canvases * canvas)]
    assert len(ex.response) >= min(len(whole), canvases * canvas)


def test_max_canvases_tokenizes_a_long_chat_reply_as_far_as_it_keeps(tok, monkeypatch):
    """A chat's reply was tokenized whole under max_canvases, though make_batch lays out its first canvases alone (a
    prompt/response record's response was cut before it was tokenized already): a reply of megabytes cost what it
    would without the cut. It is cut as a response is, and the ids kept are the whole reply's."""
    most = tok.longest_token()
    encoded = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: (encoded.append(len(text)), encode(text, *a, **k))[1])
    long = "x = 1\n" * 20_000 + "def f(x):\n    return x + 1\n" * 5_000
    record = {"messages": [{"role": "user", "content": "def f"}, {"role": "assistant", "content": long}]}
    [ex] = parse_examples(record, tok, "d.jsonl:1", context=(16, 64, 2))
    assert max(encoded) < (2 * 16 + 16 * 2) * most + 100  # the prompt and a prefix of the reply, never all of it
    [whole] = parse_examples(record, tok, "d.jsonl:1")
    assert max(encoded) > len(long) and ex.response == whole.response[: 2 * 16]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.text(alphabet="def x():+1\n ", min_size=1, max_size=30), st.integers(-30, 30), st.integers(1, 3),
                  st.integers(1, 4))
def test_a_chat_reply_cut_for_max_canvases_keeps_the_ids_tokenizing_it_whole_kept(tok, text, past, canvases, canvas):
    """The ids kept of a chat reply cut before it is tokenized (max_canvases), on replies about as long as the cut's
    limit (`past` it), are those of the reply tokenized whole, ended at its end of turn and cut to max_canvases
    canvases: the batch is the one it was."""
    limit = (canvases + 1) * canvas * tok.longest_token()  # (_kept_response's, before it looks for a boundary)
    reply = (text * limit)[: limit + past]
    record = {"messages": [{"role": "user", "content": "def"}, {"role": "assistant", "content": reply}]}
    [whole] = parse_examples(record, tok, "d.jsonl:1")  # tokenized whole, as every reply was
    [ex] = parse_examples(record, tok, "d.jsonl:1", context=(canvas, 10_000, canvases))
    assert ex.prompt == whole.prompt
    assert ex.response == whole.response[: max(len(ex.response), canvases * canvas)]
    if past > 0:  # past the limit: held cut, as it was not
        assert len(ex.response) == canvases * canvas
    a, b = (make_batch([e], canvas, pad_id=0, eos_id=tok.eos_id, max_canvases=canvases) for e in (whole, ex))
    for field in ("ids", "valid", "scored", "ar_scored"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("closing", [250, 10])
def test_a_chat_reply_cut_ends_at_its_end_of_turn_when_the_template_writes_more_after_it(tok, closing):
    """A cut reply was the text kept tokenized, with no end-of-turn cut: a template that writes more than a canvas
    after the last turn's end (a closing line when the chat ends with the assistant) left "\n" after <end_of_turn>
    in the ids kept, trained in place of EOS, where the whole reply ends at its end of turn."""
    from blockpress.tokenizer import Tokenizer

    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}"
                "\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                "{% elif messages[-1].role == 'assistant' %}# saved by the exporter {{ '.' * " + str(closing) +
                " }}\n{% endif %}")
    ours = Tokenizer(backend=tok.backend, bos_id=2, eos_ids=[1], pad_id=0, chat_template=template)
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]}
    [whole] = parse_examples(record, ours, "d.jsonl:1")
    [cut] = parse_examples(record, ours, "d.jsonl:1", context=(2, 1000, 2))
    assert ours.decode(list(whole.response), skip_special_tokens=False) == "ok<end_of_turn>"
    assert list(cut.response) == list(whole.response)[:4]
    a, b = (make_batch([e], 2, pad_id=0, eos_id=1, max_canvases=2) for e in (whole, cut))
    assert torch.equal(a.ids, b.ids) and a.ids[0, -1].item() == 1


def test_raw_texts_tokenizing_is_reported_and_shown_on_a_terminal_alone(tmp_path, tok, monkeypatch):
    """`train --data` on a folder of raw text tokenized it in silence (the standard library's 162 MB: minutes).
    load_text reports the characters done after each document, and train's bar is drawn on a terminal's stderr
    (a pty here) alone: nothing on a pipe or with --quiet; the tokens are the same either way."""

    from blockpress.cli.train import train_corpus

    docs = ["def f(x):\n    return x + 1\n", "   \n", "# notes\nsome text\n", "plain words\n"]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in zip(["a.py", "b.py", "c.md", "d.txt"], docs):
        (folder / name).write_text(text)
    calls = []
    plain = load_text(folder, tok).arrays[0].tolist()
    assert load_text(folder, tok, progress=lambda done, total: calls.append((done, total))).arrays[0].tolist() == plain
    kept = [len(d) for d in docs if d.strip()]  # (a blank document is left out)
    assert calls == [(0, sum(kept))] + [(sum(kept[: i + 1]), sum(kept)) for i in range(len(kept))]
    assert_bar_on_a_terminal_alone(monkeypatch, "--data tokenizing", lambda quiet: train_corpus(
        str(folder), "--data", tok, 300, quiet=quiet).arrays[0].tolist() == plain)


def test_jsonl_examples_reading_is_reported_and_shown_on_a_terminal_alone(tmp_path, tok, monkeypatch):
    """`train --data` on JSONL examples tokenized them in silence, on a terminal too (800k prompt/response records:
    150 s, 10k chats: 70 s, an error on the last line said only then). load_jsonl reports the bytes read after each
    record, and train's bar is drawn on a terminal's stderr (a pty here) alone: nothing on a pipe or with --quiet."""
    from types import SimpleNamespace

    from blockpress.cli.train import _examples

    lines = [json.dumps({"prompt": "def f", "response": " return x"}) + "\n", "\n",
             json.dumps({"prompt": "def g", "response": " return y + 1"}) + "\n",
             json.dumps({"prompt_ids": [2, 7], "response_ids": [9, 10]}) + "\n"]
    folder = tmp_path / "sft"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(lines[:2]))
    (folder / "b.jsonl").write_text("".join(lines[2:]))
    calls = []
    plain = load_jsonl(folder, tok, 300)
    assert load_jsonl(folder, tok, 300, progress=lambda done, total: calls.append((done, total))) == plain
    sizes = [len(line.encode()) for line in lines]
    assert calls == [(sizes[0], sum(sizes)), (sum(sizes[:3]), sum(sizes)), (sum(sizes), sum(sizes))]
    lm = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(canvas_length=4, text=SimpleNamespace(
        vocab_size=300, max_position_embeddings=512)))
    assert_bar_on_a_terminal_alone(monkeypatch, "--data reading",
                                   lambda quiet: _examples(str(folder), "--data", lm, TrainConfig(), quiet) == plain)


def test_a_folder_is_walked_once_inside_folders_listed_once_and_afresh_outside(tmp_path, monkeypatch):
    """folders_listed_once() keeps a folder's walk for the span of a command's reading (train walked its --data folder
    9 times); outside it each look walks the folder afresh, so a library caller sees files it added since."""
    from blockpress.data import folders_listed_once, hidden_data_files

    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"prompt_ids": [2], "response_ids": [3]}) + "\n")
    walks = []
    rglob = Path.rglob
    monkeypatch.setattr(Path, "rglob", lambda self, *a, **k: (walks.append(self), rglob(self, *a, **k))[1])
    with folders_listed_once():
        assert jsonl_files(folder) == [folder / "a.jsonl"] and left_out(folder) is None
        assert len(load_jsonl(folder)) == 1 and not is_raw_text(folder) and hidden_data_files(folder) == []
    assert walks == [folder]
    (folder / "b.jsonl").write_text("")
    assert jsonl_files(folder) == [folder / "a.jsonl", folder / "b.jsonl"]


def test_raw_text_is_laid_out_as_a_token_shard(tmp_path, tok):
    """.txt/.py/.md files, a folder of them and {"text": ...} JSONL lines could not be trained on at all."""
    docs = ["def f(x):\n    return x + 1\n", "# notes\nsome text\n", "plain words\n"]
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    for name, text in zip(["a.py", "b/b.md", "c.txt"], docs):  # read in sorted order
        (folder / name).write_text(text)
    (folder / "skip.bin").write_bytes(b"\x00\xff")  # not text: left out
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    write_shard(tmp_path / "s.bin", [tok.encode(d) + [tok.eos_id] for d in docs], vocab_size=300)
    expected = TokenShards([tmp_path / "s.bin"]).arrays[0].tolist()  # the layout scripts/build_code_corpus.py writes
    for given in (folder, tmp_path / "t.jsonl"):
        assert is_raw_text(given)
        assert load_text(given, tok, 300).arrays[0].tolist() == expected, given
    assert load_text(folder / "a.py", tok).arrays[0].tolist() == tok.encode(docs[0]) + [tok.eos_id]
    g = torch.Generator().manual_seed(0)
    window = load_text(folder, tok).sample(g, (2, 4), 8)  # cut into windows as shards are
    assert not window.ends and 2 <= len(window.prompt) <= 4 and len(window.response) == 8
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert not is_raw_text(tmp_path / "sft.jsonl") and not is_raw_text(tmp_path / "s.bin")


@pytest.mark.parametrize("lines, message", [
    (['{"text": "a"}', '{"prompt": "a", "response": "b"}'], r"t.jsonl:2: expected \{\"text\": string\}"),
    (['{"text": "a"}', '{"text": 3}'], r"t.jsonl:2: expected"),
    (['{"text": "   "}'], "no text"),
])
def test_bad_raw_text_is_named(tmp_path, tok, lines, message):
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        load_text(tmp_path / "t.jsonl", tok)


def test_a_lone_surrogate_escape_is_named_by_line_and_field(tmp_path, tok):
    """A JSON escape of half an emoji ("\\ud83d", as scraped corpora hold) was refused by the tokenizer as
    "text: not valid UTF-8 (...)": for {"text"} lines with no file or line (`train` then read it as "--data text: ..."),
    and for a prompt/response record under a field "text" that the record has not."""
    (tmp_path / "t.jsonl").write_text('{"text": "fine"}\n{"text": "cut \\ud83d here"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: text: not valid UTF-8 \(lone surrogate U\+D83D at character 4\)"):
        load_text(tmp_path / "t.jsonl", tok)
    (tmp_path / "p.jsonl").write_text('{"prompt": "ok", "response": "ok"}\n{"prompt": "ok", "response": "cut \\ud83d"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: response: not valid UTF-8 \(lone surrogate U\+D83D"):
        load_jsonl(tmp_path / "p.jsonl", tok)


def test_raw_text_errors(tmp_path, tok):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="a folder without .txt/.py/.md or .jsonl files"):
        load_text(tmp_path / "empty", tok)
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="x.txt: not valid UTF-8"):
        load_text(tmp_path / "x.txt", tok)
    with pytest.raises(ValueError, match="raw text needs a tokenizer"):
        load_text(tmp_path / "x.txt", None)


def test_a_missing_text_file_is_named_as_a_missing_jsonl_file_is(tmp_path):
    """A missing .txt file said "[Errno 2] No such file or directory: '...'", which train put its flag before."""
    for name in ("nope.txt", "nope.jsonl"):
        with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(tmp_path / name))}: no such data file$"):
            (load_text if name.endswith(".txt") else load_jsonl)(tmp_path / name, object())


def test_a_glob_of_text_is_refused_by_name(tmp_path):
    """`--data "corpus/*.txt"` met a bare FileNotFoundError naming the glob: text is one file or a folder."""
    (tmp_path / "a.txt").write_text("hello world\n")
    import blockpress

    tok = blockpress.load("blockpress-code").tokenizer
    with pytest.raises(ValueError, match="not a glob; globs are for token shards"):
        load_text(tmp_path / "*.txt", tok)
    assert load_text(tmp_path, tok).arrays[0].tolist() == tok.encode("hello world\n") + [tok.eos_id]


def test_several_jsonl_files_as_a_glob_or_a_folder(tmp_path, tok):
    """A folder of .jsonl files was "a folder without .txt/.py/.md files", and `--data 'dir/*.jsonl'` "no such data
    file" though files matched: their examples (or text) are now taken in name order."""
    from blockpress.data import is_examples, is_raw_text

    pairs, text = tmp_path / "pairs", tmp_path / "text"
    for folder, lines in ((pairs, ({"prompt_ids": [2, 5], "response_ids": [7, 8]}, {"prompt": "a", "response": "b"})),
                          (text, ({"text": "hello"}, {"text": "world"}))):
        (folder / "sub").mkdir(parents=True)
        (folder / "b.jsonl").write_text(json.dumps(lines[0]) + "\n")
        (folder / "sub" / "a.jsonl").write_text(json.dumps(lines[1]) + "\n" + json.dumps(lines[0]) + "\n")
    one_by_one = load_jsonl(pairs / "b.jsonl", tok) + load_jsonl(pairs / "sub" / "a.jsonl", tok)
    for given in (pairs, str(pairs / "*.jsonl"), str(pairs / "**" / "*.jsonl")):
        assert is_examples(given) and not is_raw_text(given)
    assert load_jsonl(pairs, tok) == one_by_one  # recursively, in name order
    assert load_jsonl(str(pairs / "*.jsonl"), tok) == one_by_one[:1]
    assert load_jsonl(str(pairs / "**" / "*.jsonl"), tok) == one_by_one  # any depth (it was one level down alone)
    assert is_raw_text(text) and is_raw_text(str(text / "*.jsonl")) and not is_examples(text)
    documents = [tok.encode(w) + [tok.eos_id] for w in ("hello", "world", "hello")]  # b.jsonl, then sub/a.jsonl
    assert load_text(text, tok).arrays[0].tolist() == [t for doc in documents for t in doc]


def test_paths_with_glob_characters_that_exist_are_read_as_they_are(tmp_path, tok):
    """'data [v2]/d.jsonl' was read as a glob whose [v2] matched no file: the file was refused ("rename it to
    d.jsonl"), the folder 'data [v2]' read as raw text, a text file in it refused as a glob, a shard not found."""
    from blockpress.data import is_examples

    folder = tmp_path / "data [v2] *?"
    folder.mkdir()
    (folder / "d.jsonl").write_text(json.dumps({"prompt_ids": [2, 5], "response_ids": [7, 8]}) + "\n")
    want = load_jsonl(folder / "d.jsonl", tok)
    assert len(want) == 1
    for given in (folder / "d.jsonl", folder, str(folder)):
        assert is_examples(given) and not is_raw_text(given)
        assert load_jsonl(given, tok) == want
    (tmp_path / "text [1]").mkdir()
    (tmp_path / "text [1]" / "a.txt").write_text("hello world\n")
    for given in (tmp_path / "text [1]" / "a.txt", tmp_path / "text [1]"):
        assert is_raw_text(given) and not is_examples(given)
        assert load_text(given, tok).arrays[0].tolist() == tok.encode("hello world\n") + [tok.eos_id]
    write_shard(folder / "a [0].bin", [[3, 4, 5]], vocab_size=100)
    assert shard_files(str(folder / "a [0].bin"), "--data") == [str(folder / "a [0].bin")]


def test_a_glob_of_jsonl_and_other_files_is_refused_by_name(tmp_path):
    """'dir/*' catching .jsonl files and a README.md was read as token shards: "README.md: cannot read its sidecar
    README.md.json ...; shards come from write_shard", when the fix is 'dir/*.jsonl'."""
    from blockpress.data import is_examples, is_raw_text, jsonl_files

    for name in ("one.jsonl", "two.jsonl", "README.md"):
        (tmp_path / name).write_text(json.dumps({"prompt_ids": [2], "response_ids": [3]}) + "\n")
    for call in (jsonl_files, is_examples, is_raw_text, left_out, load_jsonl):
        with pytest.raises(ValueError, match=r"matches JSONL files \(.*one.jsonl, .*two.jsonl\) and also "
                                             r".*README.md, which is not JSONL; .*narrow it"):
            call(str(tmp_path / "*"))
    assert jsonl_files(str(tmp_path / "*.jsonl")) == [tmp_path / "one.jsonl", tmp_path / "two.jsonl"]


def test_a_folder_of_jsonl_leaves_its_dataset_card_out(tmp_path, tok):
    """A README.md beside the .jsonl files made the whole folder raw text: it trained on the README alone, silently
    (or failed with "no shard holds a 77-token window"). Raw text beside JSONL was read the same way, the JSONL
    never: now which of the two is meant is asked."""
    from blockpress.data import is_examples, is_raw_text, jsonl_files

    folder = tmp_path / "data"
    (folder / "docs").mkdir(parents=True)
    (folder / "train.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    (folder / "README.md").write_text("# a dataset card\n" * 30)
    (folder / "docs" / "CARD.md").write_text("more card\n")
    assert jsonl_files(folder) == [folder / "train.jsonl"] and is_examples(folder) and not is_raw_text(folder)
    assert load_jsonl(folder, tok) == load_jsonl(folder / "train.jsonl", tok)
    assert left_out(folder) == ("reads train.jsonl; leaves out README.md, docs/CARD.md (a .md file beside .jsonl "
                                "files is taken for a dataset card, not data)")
    assert left_out(folder / "docs") is None and left_out(folder / "train.jsonl") is None  # nothing left out
    (folder / "docs" / "notes.txt").write_text("notes")
    for call in (jsonl_files, is_examples, is_raw_text, left_out):
        with pytest.raises(ValueError, match=r"holds JSONL files \(train.jsonl\) and raw text \(docs/notes.txt\)"):
            call(folder)


def test_a_data_folder_leaves_its_hidden_folders_out(tmp_path, tok):
    """A project folder given as --data read its .venv too: a one-file project trained on 13,700 tokens of which
    its own file was 1,184, the rest the virtualenv's site-packages, without a word. Hidden files and folders are
    left out (as git and ls leave them) and named; a hidden folder named itself is read."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("def main():\n    return 1\n")
    venv = project / ".venv" / "lib" / "site-packages"
    venv.mkdir(parents=True)
    (venv / "six.py").write_text("import sys\n" * 50)
    (project / ".notes.txt").write_text("private\n")
    (project / ".ipynb_checkpoints").mkdir()
    (project / ".ipynb_checkpoints" / "main-checkpoint.py").write_text("def main():\n    return 1\n")
    expected = tok.encode("def main():\n    return 1\n") + [tok.eos_id]
    assert load_text(project, tok).arrays[0].tolist() == expected
    from blockpress.data import hidden_data_files, left_out

    assert hidden_data_files(project) == [project / ".ipynb_checkpoints" / "main-checkpoint.py", project / ".notes.txt",
                                         venv / "six.py"]
    note = left_out(project)
    assert note.startswith("leaves out 3 hidden files") and ".venv/lib/site-packages/six.py" in note, note
    assert load_text(venv.parent.parent, tok).arrays[0].tolist() == tok.encode("import sys\n" * 50) + [tok.eos_id]
    assert left_out(project / "src") is None
    # a folder of JSONL alike: its hidden copies are not a second epoch of the data
    data = tmp_path / "data"
    (data / ".ipynb_checkpoints").mkdir(parents=True)
    for name in ("train.jsonl", ".ipynb_checkpoints/train-checkpoint.jsonl"):
        (data / name).write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert len(load_jsonl(data, tok)) == 1
    assert left_out(data).startswith("leaves out 1 hidden file, named or inside a folder named with a leading '.'")


@pytest.mark.parametrize("marker", ["train_config.json", "trainer_state.pt", None, "empty log", "cut log",
                                    "stopped log"])
def test_a_data_folder_leaves_a_training_runs_folder_in_it_out(tmp_path, tok, marker):
    """`train --data dd --out dd/run`: resumed, the run read dd/run/metrics.jsonl as data ("expected 'prompt'+
    'response'"), and a raw-text folder then held "JSONL files and raw text"; every later run on dd failed alike. A
    folder holding a run's files is the run's, not data; a run's folder named itself as --data is still read."""
    data = tmp_path / "dd"
    (data / "run" / "adapter").mkdir(parents=True)
    (data / "train.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    (data / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (data / "run" / "adapter" / "notes.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # a folder inside a run
    if marker in ("empty log", "cut log", "stopped log"):  # a divergence before the first row logged (--log-every
        # 10), a kill, or a stop (Ctrl-C, --max-minutes) before the first step logged its row
        (data / "run" / "metrics.jsonl").write_text({"empty log": "", "cut log": '{"step": 1, "lo',
                                                     "stopped log": '{"step": 0, "stopped": "interrupted"}\n'}[marker])
    elif marker == "train_config.json":  # as a save writes it
        (data / "run" / marker).write_text(json.dumps(dataclasses.asdict(TrainConfig(steps=2))))
    elif marker is not None:  # None: a run that stopped before its first save (a divergence) left its log alone
        (data / "run" / marker).write_bytes(b"")
    assert jsonl_files(data) == [data / "train.jsonl"] and len(load_jsonl(data, tok)) == 1
    assert "leaves out 1 training run folder (run: " in left_out(data)  # said, not only done
    assert "training run" not in (left_out(data, data / "run") or "")  # the run reading the data: said to no use
    (data / "train.jsonl").unlink()
    (data / "main.py").write_text("def main():\n    return 1\n")
    assert load_text(data, tok).arrays[0].tolist() == tok.encode("def main():\n    return 1\n") + [tok.eos_id]
    assert jsonl_files(data / "run") == [data / "run" / "adapter" / "notes.jsonl", data / "run" / "metrics.jsonl"]


@pytest.mark.parametrize("other", [{"epochs": 3, "model": "other"},
                                   {"model": "t5-small", "lr": 1e-4, "batch_size": 32, "steps": 5000},
                                   *({key: 1 for key in sorted(_RUN_CONFIG_KEYS) if key != left}
                                     for left in sorted(_RUN_CONFIG_KEYS))])
def test_data_beside_another_tools_train_config_json_is_still_data(tmp_path, tok, other):
    """Any file named train_config.json marked its folder as a training run's and left it out, unsaid: a dataset
    whose math/ part carried another tool's config trained on 10 of its 100 examples; so did one with steps,
    batch_size and lr, as most tools' configs have. Only TrainConfig's marks it."""
    data = tmp_path / "dd"
    (data / "math").mkdir(parents=True)
    (data / "code.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    (data / "math" / "math.jsonl").write_text(json.dumps({"prompt": "1+1", "response": "2"}) + "\n")
    (data / "math" / "train_config.json").write_text(json.dumps(other))
    assert len(load_jsonl(data, tok)) == 2 and left_out(data) is None


def test_running_text_is_told_by_the_fields_that_hold_values_in_the_first_record_there_is(tmp_path):
    """{"text": ..., "prompt": null, "response": null} (a dataframe's export) was taken for examples and refused
    ("field 'prompt' must be a string"); a folder whose first file is empty was decided by nothing, and read as
    examples too."""
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "x = 1", "prompt": None, "response": None}) + "\n")
    assert is_raw_text(tmp_path / "t.jsonl")
    corpus = tmp_path / "corp"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "y = 2"}) + "\n")
    assert is_raw_text(corpus)
    (tmp_path / "ex.jsonl").write_text(json.dumps({"text": "z", "prompt": "a", "response": "b"}) + "\n")
    assert not is_raw_text(tmp_path / "ex.jsonl")  # (fields of examples that hold values: examples)


def test_data_named_metrics_jsonl_is_still_data(tmp_path, tok):
    """Only a run's own log (rows of step and loss) marks its folder as a run's: data that bears the name is read."""
    data = tmp_path / "dd"
    (data / "eval").mkdir(parents=True)
    (data / "eval" / "metrics.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert jsonl_files(data) == [data / "eval" / "metrics.jsonl"] and len(load_jsonl(data, tok)) == 1


def assert_bar_on_a_terminal_alone(monkeypatch, label: str, run) -> None:
    """`run(quiet)` (True when its result is right) with stderr a terminal (a pty), the same with quiet, and a pipe:
    a bar named `label` is drawn on the first alone."""
    import fcntl
    import io
    import os
    import pty
    import struct
    import termios

    main_fd, terminal_fd = pty.openpty()
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (a new pty has 0 columns)
    terminal = open(terminal_fd, "w", buffering=1, closefd=True)
    try:
        for stream, quiet, drawn in ((terminal, False, True), (terminal, True, False), (io.StringIO(), False, False)):
            monkeypatch.setattr(sys, "stderr", stream)
            assert run(quiet)
            stream.flush()
            shown = read_terminal(main_fd, 2 if drawn else 0.2)
            if stream is terminal:
                assert (label in shown) == drawn, (quiet, shown)
            else:
                assert stream.getvalue() == ""
    finally:
        terminal.close()
        os.close(main_fd)


def test_a_byte_order_mark_before_raw_text_is_not_trained_on(tmp_path, tok):
    """A .txt saved "UTF-8 with BOM" (Windows' Notepad) trained on U+FEFF: its tokens came first in the document."""
    (tmp_path / "plain.txt").write_bytes(b"hello world\r\nline two\r\n")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello world\r\nline two\r\n")
    plain = load_text(tmp_path / "plain.txt", tok).arrays[0].tolist()
    assert load_text(tmp_path / "bom.txt", tok).arrays[0].tolist() == plain
    assert tok.decode(plain) == "hello world\nline two\n"  # (Windows line ends read as \n, as before)
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbfcaf\xe9\n")  # still named where it is not UTF-8, by the
    # file's own offset (the mark's 3 bytes counted: it said byte 3), from 1: the 7th byte
    with pytest.raises(ValueError, match=r"bad.txt: not valid UTF-8 \(byte 0xe9 at byte 7\)$"):
        load_text(tmp_path / "bad.txt", tok)
    (tmp_path / "mac.txt").write_bytes(b"hello world\rline two\r")  # a CR alone: a line end, as read as text
    assert load_text(tmp_path / "mac.txt", tok).arrays[0].tolist() == plain


# (ASCII, other scripts, a combining accent, and whitespace of every kind: Unicode's, and \x1c, \x85, U+180E, which
# Python and the tokenizer's pattern may tell apart)
@hypothesis.given(st.lists(st.sampled_from(list("ab Z09 \n\t\r'\"(){}.,;:-_é🙂яЖ中文αβ\u0301\xa0\u3000\u2028\x1c\x85\u180e\u200b")
                                           + ["  ", "\n\n", "'s", "<eos>", " \u0301", "\u3000\n"]),
                           max_size=60).map("".join), st.integers(1, 8))
@hypothesis.settings(max_examples=500, deadline=None)
def test_a_document_encoded_in_pieces_gives_the_ids_of_the_whole(tok, text, chunk):
    from blockpress.data import encode_document

    assert encode_document(tok, text, chunk) == tok.encode(text)


@pytest.mark.parametrize("token", [dict(lstrip=True), dict(rstrip=True), dict(single_word=True)])
def test_an_added_token_that_takes_the_whitespace_beside_it_keeps_a_document_whole(token):
    """An added token that absorbs the space beside it (lstrip / rstrip, as RoBERTa's <mask>) can span a cut before
    " word": in pieces, "foo <sep> bar" gave 'Ġbar' where the whole text gives 'bar'. Such a tokenizer's documents
    are encoded whole, to the whole text's ids."""
    from tokenizers import AddedToken

    from blockpress.data import _splits_at_boundaries, encode_document

    tok = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    assert _splits_at_boundaries(tok)
    tok.backend.add_special_tokens([AddedToken("<sep>", **token)])
    assert not _splits_at_boundaries(tok)
    for text in ("x = 1\n<sep> + 2", "foo <sep> bar", "print(a)\n" * 3 + "<sep>\n"):
        assert encode_document(tok, text, chunk=2) == tok.encode(text)


def test_a_large_raw_text_file_is_encoded_a_piece_at_a_time(tmp_path, tok, monkeypatch):
    """tokenizers holds some 500 bytes a token of the string it encodes: an 18 MB .txt file, encoded whole, peaked at
    3.1 GB (now 0.44 GB). It is encoded in pieces cut where the pre-tokenizer always splits, to the same ids, and
    kept as uint16 (it was int64)."""
    import blockpress.data as data

    text = (ROOT / "blockpress" / "train.py").read_text()
    (tmp_path / "big.txt").write_text(text)
    whole = tok.encode(text) + [tok.eos_id]
    lengths = []
    encode = type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, s, *a, **k: lengths.append(len(s)) or encode(self, s, *a, **k))
    monkeypatch.setattr(data, "DOCUMENT_CHUNK", 4096, raising=False)
    calls = []
    shards = load_text(tmp_path / "big.txt", tok, progress=lambda done, total: calls.append((done, total)))
    assert shards.arrays[0].tolist() == whole
    # the bar moves a piece at a time (a single large file was one step: the bar stood at 0 for minutes)
    assert calls[0] == (0, len(text)) and calls[-1] == (len(text), len(text)) and len(calls) == len(lengths) + 1
    # pieces of about 4096 characters (cut at the first split past it): as many as pieces of 4096 + 200 would make
    # (the count of whole 4096s alone failed once train.py grew past 27 of them, each piece a little longer)
    assert max(lengths) < 4096 + 200 and len(lengths) >= -(-len(text) // (4096 + 200)) > 1, (len(lengths), max(lengths))
    assert sum(lengths) == len(text) and shards.arrays[0].dtype == np.uint16
    # text in another script is cut alike (it had no cut at all: a Russian file was encoded whole)
    words = "Съешь же ещё этих мягких французских булок, да выпей чаю. Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιά\n"
    (tmp_path / "big.txt").write_text(words * 200)
    whole = tok.encode(words * 200) + [tok.eos_id]
    lengths.clear()
    assert load_text(tmp_path / "big.txt", tok).arrays[0].tolist() == whole
    assert max(lengths) < 4096 + 200 and len(lengths) > 3
    from blockpress.data import _splits_at_boundaries

    assert _splits_at_boundaries(tok)
    # a tokenizer that may merge across such a point (a prefix space on each piece) gets the text whole
    backend = tok.backend.to_str().replace('"add_prefix_space":false', '"add_prefix_space":true')
    import tokenizers

    other = type(tok).__new__(type(tok))
    other.__dict__.update(tok.__dict__, backend=tokenizers.Tokenizer.from_str(backend))
    assert not _splits_at_boundaries(other)


def test_a_held_out_fraction_that_leaves_nothing_to_train_on_names_heldout(tmp_path, capsys):
    """It said "split_heldout: the held-out fraction left no training examples": no flag, no count."""
    from blockpress.cli import main

    copies = [Example([2, 3], [5, 6])] * 3  # copies of one example are held out together
    with pytest.raises(ValueError, match=r"^heldout: 0.99 holds out all 3 examples, leaving none to train on"):
        split_heldout(copies, 0.99)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt_ids": [2, 3], "response_ids": [5, 6]}) + "\n")
    assert main(["train", "--config", "tiny", "--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1",
                 "--heldout", "0.99", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "error: --heldout: 0.99 holds out all 1 example, leaving none to train on" in err, err


def test_a_chat_whose_user_role_is_mistyped_names_the_role(tok):
    """{"role": "usr"} before the reply was refused as "has no user message before the assistant's", which the line
    seemed to have: the role is named now."""
    record = {"messages": [{"role": "usr", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(ValueError, match=re.escape("f.jsonl:2: 'messages' has no user message before the assistant's "
                                                   "(messages[1]) (messages[0].role is 'usr', not one of ['system', "
                                                   "'developer', 'user', 'assistant', 'model', 'tool']); give the "
                                                   "user turn")):
        parse_examples(record, tok, "f.jsonl:2")
    record["messages"][0]["role"] = "system"  # a real role: the message as it was
    with pytest.raises(ValueError, match=re.escape("(messages[1]); give the user turn it answers before it")):
        parse_examples(record, tok, "f.jsonl:2")


def test_a_json_array_of_records_says_how_to_write_it_as_jsonl(tmp_path):
    """An Alpaca-style data.json (a JSON array of records) got only "expected a .jsonl file ... or token shards"."""
    (tmp_path / "my data").mkdir()
    data = tmp_path / "my data" / "alpaca.json"
    records = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    data.write_text(json.dumps(records, indent=2))
    with pytest.raises(ValueError, match="it starts with '\\[': a JSON array of records is written as JSONL") as err:
        shard_files(str(data), "--data")
    command = str(err.value).split(" by ", 1)[1]
    assert command.endswith(f"'{data}' > '{data.with_suffix('.jsonl')}'")
    subprocess.run(command.replace("python ", f"{sys.executable} ", 1), shell=True, check=True)
    assert [json.loads(x) for x in data.with_suffix(".jsonl").read_text().splitlines()] == records


def test_a_byte_that_is_not_utf8_is_named_alike_by_train_and_generate(tmp_path):
    """The same Latin-1 byte, the 16th of a line, was "byte 16" to `generate --input` (counted from 1, its value named)
    and "invalid continuation byte at byte 15" to `train --data` (from 0, no value); after a byte-order mark it was
    "byte 16" to `generate --input` (the mark left out) and "at byte 18" to `train`. Both now count the line's bytes
    from 1, the first line's mark too, and name the byte."""
    from blockpress.batchfile import read_rows

    for mark in (b"", b"\xef\xbb\xbf"):
        data = mark + b'{"prompt": "caf\xe9", "response": "x"}\n'
        (tmp_path / "d.jsonl").write_bytes(data)
        said = f"d.jsonl:1: not {{}}UTF-8 (byte 0xe9 at byte {len(mark) + 16})"
        with pytest.raises(ValueError, match=re.escape(said.format("valid "))):
            load_jsonl(tmp_path / "d.jsonl")
        with pytest.raises(ValueError, match=re.escape(said.format(""))):
            read_rows("d.jsonl", data)


def test_jsonl_with_cr_alone_line_ends_is_said_to_be_so(tmp_path):
    """A file saved with classic Mac OS line ends (a CR alone) is one line to JSONL, refused as "not valid JSON
    (Extra data)", which said nothing of why; `generate --input` explained it, training's reading now does too."""
    (tmp_path / "cr.jsonl").write_bytes(b'{"prompt_ids": [2], "response_ids": [3]}\r' * 2)
    with pytest.raises(ValueError, match=r"cr.jsonl:1: is several lines ended by a CR alone .*save the file with LF"):
        load_jsonl(tmp_path / "cr.jsonl")
    (tmp_path / "crlf.jsonl").write_bytes(b'{"prompt_ids": [2], "response_ids": [3]}\r\n' * 2)  # (CRLF: read)
    assert len(load_jsonl(tmp_path / "crlf.jsonl")) == 2



    """Windows PowerShell's `>` writes UTF-16 with a byte-order mark: such a .jsonl or .txt was refused as 'not valid
    UTF-8 (invalid start byte at byte 0)', which said nothing of why."""
    (tmp_path / "d.jsonl").write_bytes('{"prompt": "a", "response": "b"}\r\n'.encode("utf-16"))
    (tmp_path / "t.txt").write_bytes("hello world\r\n".encode("utf-16"))
    said = "it is UTF-16 (it starts with a UTF-16 byte-order mark, as Windows PowerShell's > and Out-File write text)"
    with pytest.raises(ValueError, match=re.escape(f"d.jsonl:1: not valid UTF-8 (byte 0xff at byte 1); {said}")):
        load_jsonl(tmp_path / "d.jsonl", tok)
    with pytest.raises(ValueError, match=re.escape(f"t.txt: not valid UTF-8 (byte 0xff at byte 1); {said}")):
        load_text(tmp_path / "t.txt", tok)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # another encoding: no such word
    with pytest.raises(ValueError, match=r"latin1.txt: not valid UTF-8 \(byte 0xe9 at byte 4\)$"):
        load_text(tmp_path / "latin1.txt", tok)


# -- chats whose replies hold tool calls or thoughts --------------------------------------------------------------
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.lists(st.text(alphabet="ab x:\n<>|_", min_size=1, max_size=8), min_size=2, max_size=2),
                  st.sampled_from(["gemma", "turn"]))
def test_a_plain_reply_trains_on_the_tokens_it_did_before(tok, replies, template):
    """A reply is now cut from the template's rendering of its turn; a plain text reply gives the ids it gave when it
    was encoded alone and its end of turn put after it, so training runs on text chats are unchanged: the text as
    written (the Gemma template's), or with its ends trimmed where the template trims it (TURN_TEMPLATE's, as a
    later prompt holds it)."""
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": replies[1]}]
    if template == "turn":
        tok = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300,
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"])
        tok.chat_template = TURN_TEMPLATE
        hypothesis.assume(all(reply.strip() for reply in replies))
    examples = parse_examples({"messages": chat}, tok, "d.jsonl:1")
    end = tok.turn_end_id()
    texts = [reply if template == "gemma" else reply.strip() for reply in replies]
    assert [list(e.response) for e in examples] == [tok.encode(text) + [end] for text in texts]
    assert [list(e.prompt) for e in examples] == [tok.apply_chat_template(chat[:i], add_generation_prompt=True,
                                                                    tokenize=True) for i in (1, 3)]


@pytest.fixture(scope="module")
def gemma4_tok():
    """A tiny tokenizer with Gemma 4's markers as special tokens (its built-in response template) and a template
    written as Gemma 4's (tool calls and responses, thoughts stripped from past turns)."""
    from test_response import gemma4_tokenizer
    from test_tokenizer import GEMMA4_STYLE_TEMPLATE

    tok = gemma4_tokenizer()
    tok.chat_template = GEMMA4_STYLE_TEMPLATE
    return tok


def _gemma_call(name, arguments):
    return {"id": name, "type": "function", "function": {"name": name, "arguments": arguments}}


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(st.text(alphabet="abOslo ", min_size=1, max_size=10), st.integers(-50, 50), st.booleans())
def test_a_reply_of_tool_calls_trains_on_the_calls_the_server_reads_back(gemma4_tok, city, days, thought):
    """An assistant turn of tool calls (content null) was refused ('the assistant's reply trained on must be
    text'), so a model could not be fine-tuned to call tools. It trains on the calls as the chat template writes them
    (Gemma 4's <|tool_call>call:NAME{...}<tool_call|>), then <turn|>; its thought (reasoning_content, which Gemma 4's
    template never renders) first, between the response template's markers; and the reply read back with the
    tokenizer's response template, as the server reads it and as transformers' Gemma 4 fallback reads it, is the
    turn trained on."""
    from test_response import theirs
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    tok = gemma4_tok
    arguments = {"city": city, "days": days}
    turn = {"role": "assistant", "content": None, "tool_calls": [_gemma_call("weather", arguments)]}
    if thought:
        turn["reasoning_content"] = "Weather, then."
    chat = [{"role": "user", "content": "Weather in Oslo?"}, turn]
    [example] = parse_examples({"messages": chat}, tok, "d.jsonl:1")
    text = tok.decode(example.response, skip_special_tokens=False)
    head = "<|channel>thought\nWeather, then.<channel|>" if thought else ""
    assert text == f'{head}<|tool_call>call:weather{{city:<|"|>{city}<|"|>,days:{days}}}<tool_call|><turn|>'
    assert list(example.response) == tok.encode(text)
    assert tok.decode(example.prompt, skip_special_tokens=False).endswith("Weather in Oslo?<turn|>\n<|turn>model\n")
    expected = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                                      "arguments": arguments}}]}
    if thought:
        expected["reasoning_content"] = "Weather, then."
    assert tok.parse_response(text) == theirs(text, _RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)]) == expected


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(st.dictionaries(st.sampled_from(["city", "days", "unit"]),
                                  st.one_of(st.text(alphabet="Oslo é", max_size=6), st.integers(-9, 9)), max_size=3))
def test_tool_call_arguments_as_openai_json_text_train_as_the_object(gemma4_tok, arguments):
    """A call's arguments as OpenAI writes them, JSON text ('{"city": "Oslo"}', what a logged conversation holds and
    the server parses for the template), trained on the text printed as written ('call:weather{{"city": "Oslo"}}',
    a call no response template reads back); they now train as the object does, and text that is no JSON object is
    refused by field (load_jsonl puts the file and line before it)."""
    def response(args):
        chat = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [_gemma_call("weather", args)]}]
        return parse_examples({"messages": chat}, gemma4_tok, "d.jsonl:3")[0].response

    assert response(json.dumps(arguments)) == response(arguments)
    for bad, got in (("{", "'{'"), ("[1]", "'\\[1\\]'"), (None, "NoneType")):
        with pytest.raises(ValueError, match=rf"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: expected .*"
                                             rf"got {got}$"):
            response(bad)


def test_every_turn_of_an_agent_chat_trains_its_prompt_holding_the_tools_answers(gemma4_tok):
    """The turns of a chat with tool calls: the call turn is trained on (it was context only), and the answer after
    the tools' responses is prompted with the calls and responses as the template renders them; a thought and an
    answer together read back as both."""
    tok = gemma4_tok
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [_gemma_call("weather", {"city": "Oslo"})]},
            {"role": "tool", "tool_call_id": "weather", "name": "weather", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Sunny, it says."}]
    calls, answer = parse_examples({"messages": chat}, tok, "d.jsonl:1")
    assert list(calls.prompt) == tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True)
    assert list(answer.prompt) == tok.apply_chat_template(chat[:3], add_generation_prompt=True, tokenize=True)
    assert tok.decode(answer.prompt, skip_special_tokens=False).endswith(
        '<tool_call|><|tool_response>response:weather{value:<|"|>sunny<|"|>}<tool_response|><|turn>model\n')
    assert tok.parse_response(tok.decode(answer.response, skip_special_tokens=False)) == {
        "role": "assistant", "reasoning_content": "Sunny, it says.", "content": "It is sunny."}
    assert calls.split_key == (answer.prompt, answer.response)  # held out together, as before
    assert parse_examples({"messages": chat}, tok, "d.jsonl:1", chat_turns="last") == [answer]


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.sampled_from(["none", "content", "reasoning_content"]),
                                     st.text(alphabet="ab \n", max_size=6)), min_size=1, max_size=5),
                  st.sampled_from(["all", "last"]))
def test_a_thought_the_template_strips_from_content_is_warned_of_once_for_the_data(gemma4_tok, records, turns):
    """Gemma 4's template strips a thought written in an assistant turn's content (<|channel>thought ...<channel|>),
    so the turn trained on the answer alone, without a word. One warning for the data counts the turns cut and
    names the first (its line and message), and says to give the thought as reasoning_content, which trains; a
    content rendered whole (its ends trimmed, as the template does) is not warned of."""
    import tempfile
    import warnings

    tok, rows, cut, trained = gemma4_tok, [], [], []
    for line, (where, answer) in enumerate(records, start=1):
        reply = {"role": "assistant", "content": f" a{answer} "}  # (trimmed by the template: not a cut)
        if where == "content":
            reply["content"] = f"<|channel>thought\nHm {answer}<channel|>{reply['content']}"
        elif where == "reasoning_content":
            reply["reasoning_content"] = f"Hm {answer}"
        chat = [{"role": "user", "content": "Hi"}, reply]
        if turns == "all":  # an earlier turn of the chat, cut alike, counts too
            chat = [*chat[:1], {**reply}, {"role": "user", "content": "And?"}, reply]
            cut += [f"{line}: messages[1]", f"{line}: messages[3]"] if where == "content" else []
        else:
            cut += [f"{line}: messages[1]"] if where == "content" else []
        rows.append({"messages": chat})
        # what each turn trains on: the answer as rendered, a thought in reasoning_content first, one in content gone
        thought = f"<|channel>thought\nHm {answer}<channel|>" if where == "reasoning_content" else ""
        trained += [f"{thought}a{answer.rstrip()}<turn|>"] * (2 if turns == "all" else 1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "d.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            examples = load_jsonl(path, tok, chat_turns=turns)
    said = [str(w.message) for w in caught]
    if not cut:
        assert said == []
    else:
        many = len(cut) > 1
        assert said == [
            f"{path}: the chat template leaves out part of the assistant's content in {len(cut)} "
            f"turn{'s' if many else ''} trained on ({'the first at ' if many else ''}{path}:{cut[0]}), which "
            f"train{'' if many else 's'} on the turn as the template renders it; "
            f"{f'{len(cut)} of them hold' if many else 'it holds'} a thought in content (<|channel>thought...<channel|>), "
            "which the template strips: give it as the message's reasoning_content to train on it"]
    assert [tok.decode(ex.response, skip_special_tokens=False) for ex in examples] == trained


def test_parse_examples_alone_warns_of_its_records_cut_turns(gemma4_tok):
    """Called on one record (no data to warn once for), parse_examples warns of it itself."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|channel>thought\nHm<channel|>a"}]
    with pytest.warns(UserWarning, match=r"^d.jsonl:4: the chat template leaves out part of the assistant's content "
                                         r"in 1 turn trained on \(d.jsonl:4: messages\[1\]\), which trains"):
        [example] = parse_examples({"messages": chat}, gemma4_tok, "d.jsonl:4")
    assert gemma4_tok.decode(example.response, skip_special_tokens=False) == "a<turn|>"


# Google's own Gemma 4 template (google/gemma-4-31B-it's chat_template.jinja, as llama.cpp vendors it), trimmed to
# what a chat renders: tool declarations, legacy tool_responses and image/audio/video parts left out, the rest as
# written. Unlike GEMMA4_STYLE_TEMPLATE, its generation prompt with thinking off ends with a closed, empty thought.
GEMMA4_TEMPLATE = r'''{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}
        {{- '{' -}}
        {%- set ns = namespace(found_first=false) -%}
        {%- for key, value in argument | dictsort -%}
            {%- if ns.found_first %},{% endif -%}
            {%- set ns.found_first = true -%}
            {%- if escape_keys -%}
                {{- '<|"|>' + key + '<|"|>' -}}
            {%- else -%}
                {{- key -}}
            {%- endif -%}
            :{{- format_argument(value, escape_keys=escape_keys) -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif argument is sequence -%}
        {{- '[' -}}
        {%- for item in argument -%}
            {{- format_argument(item, escape_keys=escape_keys) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- argument -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
{%- endmacro -%}

{%- macro format_tool_response_block(tool_name, response) -%}
    {{- '<|tool_response>' -}}
    {%- if response is mapping -%}
        {{- 'response:' + tool_name + '{' -}}
        {%- for key, value in response | dictsort -%}
            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- '}' -}}
    {%- else -%}
        {{- 'response:' + tool_name + '{value:' + format_argument(response, escape_keys=False) + '}' -}}
    {%- endif -%}
    {{- '<tool_response|>' -}}
{%- endmacro -%}

{%- set ns = namespace(prev_message_type=None) -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{#- Handle System/Tool Definitions Block -#}
{%- if (enable_thinking is defined and enable_thinking) or tools or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\n' -}}

    {#- Inject Thinking token at the very top of the FIRST system turn -#}
    {%- if enable_thinking is defined and enable_thinking -%}
        {{- '<|think|>\n' -}}
        {%- set ns.prev_message_type = 'think' -%}
    {%- endif -%}

    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- messages[0]['content'] | trim -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}

    {{- '<turn|>\n' -}}
{%- endif %}

{#- Pre-scan: find last user message index for reasoning guard -#}
{%- set ns_turn = namespace(last_user_idx=-1) -%}
{%- for i in range(loop_messages | length) -%}
    {%- if loop_messages[i]['role'] == 'user' -%}
        {%- set ns_turn.last_user_idx = i -%}
    {%- endif -%}
{%- endfor -%}

{#- Loop through messages -#}
{%- for message in loop_messages -%}
    {%- if message['role'] != 'tool' -%}
    {%- set ns.prev_message_type = None -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {#- Detect continuation: suppress duplicate <|turn>model when previous non-tool message was also assistant -#}
    {%- set prev_nt = namespace(role=None, found=false) -%}
    {%- if loop.index0 > 0 -%}
        {%- for j in range(loop.index0 - 1, -1, -1) -%}
            {%- if not prev_nt.found -%}
                {%- if loop_messages[j]['role'] != 'tool' -%}
                    {%- set prev_nt.role = loop_messages[j]['role'] -%}
                    {%- set prev_nt.found = true -%}
                {%- endif -%}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {%- set continue_same_model_turn = (role == 'model' and prev_nt.role == 'assistant') -%}
    {%- if not continue_same_model_turn -%}
        {{- '<|turn>' + role + '\n' }}
    {%- endif -%}

    {#- Render reasoning/reasoning_content as thinking channel -#}
    {%- set thinking_text = message.get('reasoning') or message.get('reasoning_content') -%}
    {%- if thinking_text and loop.index0 > ns_turn.last_user_idx and message.get('tool_calls') -%}
        {{- '<|channel>thought\n' + thinking_text + '\n<channel|>' -}}
    {%- endif -%}

            {%- if message['tool_calls'] -%}
                {%- for tool_call in message['tool_calls'] -%}
                    {%- set function = tool_call['function'] -%}
                    {{- '<|tool_call>call:' + function['name'] + '{' -}}
                    {%- if function['arguments'] is mapping -%}
                        {%- set ns_args = namespace(found_first=false) -%}
                        {%- for key, value in function['arguments'] | dictsort -%}
                            {%- if ns_args.found_first %},{% endif -%}
                            {%- set ns_args.found_first = true -%}
                            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
                        {%- endfor -%}
                    {%- elif function['arguments'] is string -%}
                        {{- function['arguments'] -}}
                    {%- endif -%}
                    {{- '}<tool_call|>' -}}
                {%- endfor -%}
                {%- set ns.prev_message_type = 'tool_call' -%}
            {%- endif -%}

            {%- set ns_tr_out = namespace(flag=false) -%}
            {%- if message.get('tool_calls') -%}
                {#- OpenAI Chat Completions: forward-scan consecutive role:tool messages -#}
                {%- set ns_tool_scan = namespace(stopped=false) -%}
                {%- for k in range(loop.index0 + 1, loop_messages | length) -%}
                    {%- if ns_tool_scan.stopped -%}
                    {%- elif loop_messages[k]['role'] != 'tool' -%}
                        {%- set ns_tool_scan.stopped = true -%}
                    {%- else -%}
                        {%- set follow = loop_messages[k] -%}
                        {#- Resolve tool_call_id to function name -#}
                        {%- set ns_tname = namespace(name=follow.get('name') | default('unknown')) -%}
                        {%- for tc in message['tool_calls'] -%}
                            {%- if tc.get('id') == follow.get('tool_call_id') -%}
                                {%- set ns_tname.name = tc['function']['name'] -%}
                            {%- endif -%}
                        {%- endfor -%}
                        {#- Handle content as string or content-parts array -#}
                        {%- set tool_body = follow.get('content') -%}
                        {%- if tool_body is string -%}
                            {{- format_tool_response_block(ns_tname.name, tool_body) -}}
                        {%- elif tool_body is sequence and tool_body is not string -%}
                            {%- set ns_txt = namespace(s='') -%}
                            {%- for part in tool_body -%}
                                {%- if part.get('type') == 'text' -%}
                                    {%- set ns_txt.s = ns_txt.s + (part.get('text') | default('')) -%}
                                {%- endif -%}
                            {%- endfor -%}
                            {{- format_tool_response_block(ns_tname.name, ns_txt.s) -}}
                        {%- else -%}
                            {{- format_tool_response_block(ns_tname.name, tool_body) -}}
                        {%- endif -%}
                        {%- set ns_tr_out.flag = true -%}
                        {%- set ns.prev_message_type = 'tool_response' -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- endif -%}

            {%- if message['content'] is string -%}
                {%- if role == 'model' -%}
                    {{- strip_thinking(message['content']) -}}
                {%- else -%}
                    {{- message['content'] | trim -}}
                {%- endif -%}
            {%- elif message['content'] is sequence -%}
                {%- for item in message['content'] -%}
                    {%- if item['type'] == 'text' -%}
                        {%- if role == 'model' -%}
                            {{- strip_thinking(item['text']) -}}
                        {%- else -%}
                            {{- item['text'] | trim -}}
                        {%- endif -%}
                    {%- endif -%}
                {%- endfor -%}
            {%- endif -%}

        {%- if ns.prev_message_type == 'tool_call' and not ns_tr_out.flag -%}
            {{- '<|tool_response>' -}}
        {%- elif not (ns_tr_out.flag and not message.get('content')) -%}
            {{- '<turn|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {%- if ns.prev_message_type != 'tool_response' and ns.prev_message_type != 'tool_call' -%}
        {{- '<|turn>model\n' -}}
        {%- if not enable_thinking | default(false) -%}
            {{- '<|channel>thought\n<channel|>' -}}
        {%- endif -%}
    {%- endif -%}
{%- endif -%}
'''


def test_google_gemma4_template_trains_with_its_empty_thought_prompt(gemma4_tok):
    """Google's Gemma 4 template, thinking off, ends the generation prompt with an empty thought
    (<|channel>thought\n<channel|>) that the rendered turn lacks: every chat record was refused ("renders the
    conversation up to messages[1] differently"). A turn trains after that prompt (the server's), its reply
    what the template writes; a turn with a thought trains after the prompt without the empty one, the thought
    once, in the reply (the response template's markers, or the template's own where it writes it: tool calls)."""
    tok = copy.copy(gemma4_tok)
    tok.chat_template = GEMMA4_TEMPLATE

    def trained(turn):
        [ex] = parse_examples({"messages": [{"role": "user", "content": "Hi"}, turn]}, tok, "d.jsonl:1")
        return (tok.decode(ex.prompt, skip_special_tokens=False), tok.decode(ex.response, skip_special_tokens=False))

    asked = "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert trained({"role": "assistant", "content": "Hello there"}) == (
        asked + "<|channel>thought\n<channel|>", "Hello there<turn|>")
    assert trained({"role": "assistant", "content": "Hello there", "reasoning_content": "Hm."}) == (
        asked, "<|channel>thought\nHm.<channel|>Hello there<turn|>")
    call = {"role": "assistant", "content": None, "tool_calls": [_gemma_call("weather", {"city": "Oslo"})]}
    assert trained(call) == (asked + "<|channel>thought\n<channel|>",
                             '<|tool_call>call:weather{city:<|"|>Oslo<|"|>}<tool_call|><|tool_response>')
    assert trained({**call, "reasoning_content": "Hm."}) == (
        asked, '<|channel>thought\nHm.\n<channel|><|tool_call>call:weather{city:<|"|>Oslo<|"|>}<tool_call|>'
               "<|tool_response>")


def test_a_thought_the_template_writes_itself_is_trained_on_once(tok):
    """A template that renders reasoning_content (Qwen 3's <think>) writes the thought where it puts it: it is not
    put before it a second time."""
    thinking = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    thinking.chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>"
                              "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<end_of_turn>{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "hmm"}]
    [example] = parse_examples({"messages": chat}, thinking, "d.jsonl:1")
    assert list(example.response) == thinking.encode("<think>hmm</think>a<end_of_turn>")


@pytest.mark.parametrize("template, turn, message", [
    # no reply format with a thought's markers, and a template that never renders it: it was silently dropped
    (None, {"content": "a", "reasoning_content": "hmm"},
     r"d.jsonl:1: messages\[1\].reasoning_content: the chat template does not render the assistant's thought, and "
     r"the tokenizer's response template has no reasoning_content field"),
    (None, {"content": "a", "thinking": ["hmm"]}, r"d.jsonl:1: messages\[1\].thinking: expected text, got list"),
    # the turn to come opens unlike the template renders an assistant's turn: no place to cut the reply at
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<model>"
     "{% endif %}", {"content": "a"},
     r"d.jsonl:1: the chat template renders the conversation up to messages\[1\] differently from the prompt before "
     r"it \(messages\[:1\] with add_generation_prompt=True is not its start\)"),
])
def test_a_reply_that_cannot_be_trained_as_written_is_refused_by_name(tmp_path, tok, template, turn, message):
    custom = train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    if template is not None:
        custom.chat_template = template
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", **turn}]}) + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path, custom)


# Gemma-4-like, with transformers' {% generation %} marks around what the model writes in its turn
MASKED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<|turn>model\n{% generation %}"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{city:<|\"|>{{ c.function.arguments.city }}"
    "<|\"|>}<tool_call|>{% endfor %}{{ m.content or '' }}<turn|>{% endgeneration %}\n{% else %}<|turn>{{ m.role }}\n"
    "{{ m.content }}<turn|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


@pytest.mark.parametrize("cities, answer", [(["Oslo"], "It is sunny in Oslo."), (["Oslo", "Paris"], "Both wet.")])
def test_the_replies_trained_on_are_transformers_assistant_tokens(gemma4_tok, tmp_path, cities, answer):
    """Every reply trained on, tool calls and text, is the run of tokens transformers' apply_chat_template marks
    as the assistant's (return_assistant_tokens_mask, from the template's {% generation %} marks)."""
    from test_tokenizer import _with_transformers

    ours, theirs = _with_transformers(gemma4_tok, tmp_path, chat_template=MASKED_TEMPLATE)
    calls = [_gemma_call("weather", {"city": city}) for city in cities]
    chat = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "content": "rain"}, {"role": "assistant", "content": answer}]
    out = theirs.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == ours.apply_chat_template(chat, add_generation_prompt=False, tokenize=True)
    marked = [[t for t, _ in run] for on, run in itertools.groupby(zip(out["input_ids"], out["assistant_masks"]),
                                                                    key=lambda pair: pair[1]) if on]
    assert marked == [list(e.response) for e in parse_examples({"messages": chat}, ours, "d.jsonl:1")]
    assert len(marked) == 2 and "<|tool_call>call:weather" in ours.decode(marked[0], skip_special_tokens=False)


# From a mutation hunt over data.py: AR targets end at the first EOS, max_canvases cuts and never adds, the last
# window of a shard is drawn, a shard's dtype and vocabulary bounds at their edges.
def test_the_eos_fill_after_the_first_eos_has_no_ar_target():
    batch = make_batch([Example([2, 3], [5]), Example([2], [5] * 6)], canvas_length=4, pad_id=0, eos_id=1)
    # row 0: [2 3 | 5 1 1 1 | pad x4]: positions 0, 1 predict 3, 5; position 2 (the 5) predicts the first EOS
    assert batch.ar_scored[0].nonzero().flatten().tolist() == [0, 1, 2]
    # row 1: [pad 2 | 5 5 5 5 | 5 5 1 1]: the last 5 (slot 7) predicts the EOS at 8, and nothing after
    assert batch.ar_scored[1].nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert batch.scored[0].tolist() == [True] * 4 + [False] * 4


def test_max_canvases_keeps_that_many_canvases_and_no_more():
    batch = make_batch([Example([2], [5] * 9), Example([2], [6])], canvas_length=4, pad_id=0, eos_id=1,
                       max_canvases=2)
    assert batch.ids.shape == (2, 1 + 2 * 4)
    assert batch.ids[0, 1:].tolist() == [5] * 8  # the first 2 canvases, no EOS (the response goes on)
    assert batch.scored[1].tolist() == [True] * 4 + [False] * 4  # the short row keeps its one canvas
    batch = make_batch([Example([2], [6])], canvas_length=4, pad_id=0, eos_id=1, max_canvases=3)
    assert batch.ids.shape == (1, 1 + 4)  # a cap above a row's canvases adds none


def test_the_last_window_of_a_shard_is_drawn_too():
    shards = TokenShards.of_tokens(np.arange(10))
    g = torch.Generator().manual_seed(0)
    starts = {shards.sample(g, (2, 2), 6).prompt[0] for _ in range(200)}  # need 8 of 10 tokens: starts 0, 1, 2
    assert starts == {0, 1, 2}


def test_a_vocabulary_past_uint16_is_written_wide_enough_for_its_last_id(tmp_path):
    assert write_shard(tmp_path / "a.bin", [[65_536, 3]], vocab_size=65_537) == 2
    assert TokenShards([tmp_path / "a.bin"], vocab_size=65_537).arrays[0].tolist() == [65_536, 3]
    write_shard(tmp_path / "b.bin", [[65_535]], vocab_size=65_536)  # the largest vocabulary uint16 holds
    assert TokenShards([tmp_path / "b.bin"]).arrays[0].dtype.name == "uint16"


def test_an_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    write_shard(tmp_path / "a.bin", [[1, 2, 300]], vocab_size=1000)
    TokenShards([tmp_path / "a.bin"], vocab_size=301)  # 300 is the last id of 301
    with pytest.raises(ValueError, match="holds token id 300, outside the model's vocabulary of 300"):
        TokenShards([tmp_path / "a.bin"], vocab_size=300)


def test_a_tool_call_turn_under_a_template_that_writes_no_calls_is_refused(tok):
    """A tool-call turn's null content became "" (as vLLM renders it), so a template that renders no tool_calls
    (Phi-3.5's, Granite 3.3's) trained the turn as an empty reply, teaching the model to end its turn where it should
    call the tool, without a word. It is refused, naming the field, as a thought such a template cannot write is."""
    from test_tokenizer import TOOL_CALL

    chat = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]
    custom = copy.copy(tok)
    custom.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    with pytest.raises(ValueError, match=r"^d.jsonl:1: messages\[1\]\.tool_calls: the chat template does not render "
                                         "tool calls"):
        parse_examples({"messages": chat}, custom, "d.jsonl:1")
    custom.chat_template = custom.chat_template.replace(
        "{{ m.content }}", "{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}")
    [example] = parse_examples({"messages": chat}, custom, "d.jsonl:1")  # one that writes them trains on them
    assert "weather" in custom.decode(example.response, skip_special_tokens=False)
    # and so does one that refuses a turn with neither content nor calls (Ministral 3's): the check's own rendering
    # without the calls raised, about a message the record never held
    custom.chat_template = custom.chat_template.replace(
        "<{{ m.role }}>", "{% if m.role == 'assistant' and not m.content and not m.tool_calls %}"
        "{{ raise_exception('Assistant message must have content or tool calls') }}{% endif %}<{{ m.role }}>")
    [example] = parse_examples({"messages": chat}, custom, "d.jsonl:1")
    assert "weather" in custom.decode(example.response, skip_special_tokens=False)


def test_token_ids_past_uint16_are_kept_whole_by_raw_text_and_shards(tmp_path):
    """Ids are stored in 16 bits only while every one fits: with a vocabulary past 65,536 (Gemma's 262k) id 65,536
    must not wrap to 0, in raw text read for training nor in a shard written for it."""

    class Wide:  # a tokenizer whose ids pass 16 bits
        eos_id = 1
        backend = None

        def encode(self, text):
            return [65_535, 65_536, 7]

    (tmp_path / "a.txt").write_text("hello")
    assert load_text(tmp_path / "a.txt", Wide()).arrays[0].tolist() == [65_535, 65_536, 7, 1]
    for vocab in (65_536, 65_537):
        write_shard(tmp_path / f"s{vocab}.bin", [[65_535, 3]] + ([[65_536]] if vocab > 65_536 else []), vocab)
    assert (tmp_path / "s65536.bin").stat().st_size == 2 * 2  # (uint16 while the vocabulary fits)
    assert np.fromfile(tmp_path / "s65537.bin", dtype=np.uint32).tolist() == [65_535, 3, 65_536]
