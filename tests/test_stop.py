"""Stop strings: a row ends at the token that completes one, its text just before it (OpenAI's `stop`)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import blockpress
from blockpress.generate import Commit, cut_at_stop, normalize_stops, settled_text
from blockpress.healing import strip_prefix
from blockpress.tokenizer import Tokenizer

PROMPTS = ["import os\n\ndef list_files(path):", "class Stack:\n    def push(self, item):"]
N = 64


@pytest.fixture(scope="module")
def lm():
    return blockpress.load("blockpress-code", dtype="float32")


@pytest.fixture(scope="module")
def full(lm):
    """Each engine's unstopped output for each prompt (same seeds as the stopped runs)."""
    return {
        "diffusion": [lm.generate(p, max_new_tokens=N, seed=3) for p in PROMPTS],
        "ar": [lm.generate_ar(p, max_new_tokens=N) for p in PROMPTS],
    }


def run(lm, engine, prompt, **kw):
    return (lm.generate(prompt, max_new_tokens=N, seed=3, **kw) if engine == "diffusion"
            else lm.generate_ar(prompt, max_new_tokens=N, **kw))


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stopped_output_is_the_full_output_cut_at_the_stop(lm, full, engine, data):
    which = data.draw(st.integers(0, len(PROMPTS) - 1), label="prompt")
    ref = full[engine][which]
    text = ref.texts[0]
    start = data.draw(st.integers(0, len(text) - 2), label="start")
    stop = text[start : start + data.draw(st.integers(1, 6), label="length")]
    out = run(lm, engine, PROMPTS[which], stop=stop)
    assert out.texts[0] == cut_at_stop(text, [stop])
    n = int(out.num_new_tokens[0])
    tokens = out.new_tokens[0].tolist()
    # The kept tokens end with the one that completes the stop string; the rest are padding.
    assert stop in lm.tokenizer.decode(tokens[:n]) and stop not in lm.tokenizer.decode(tokens[: n - 1])
    assert tokens[:n] == ref.new_tokens[0, :n].tolist()
    assert all(t == lm.config.text.pad_token_id for t in tokens[n:])
    assert int(out.forward_passes[0]) <= int(ref.forward_passes[0])
    if engine == "ar":  # one pass per token kept: none for the tokens after the stop string
        assert int(out.forward_passes[0]) == n


def test_an_ar_row_that_stops_counts_one_pass_per_token_kept(lm):
    """Stops are checked every 8 tokens: a batch's stopped rows were charged the passes up to that check
    ([24, 24] for 23 and 17 tokens)."""
    out = lm.generate_ar(["def add(a, b):", "x"], max_new_tokens=40, stop="\n\n")
    assert out.extra["stopped"] == [True, True] and len(set(out.num_new_tokens.tolist())) == 2
    assert out.forward_passes.tolist() == out.num_new_tokens.tolist()


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_stop_that_never_appears_changes_nothing(lm, full, engine):
    out = run(lm, engine, PROMPTS[0], stop=["\x00never"])
    ref = full[engine][0]
    assert out.texts == ref.texts and torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.forward_passes, ref.forward_passes)


def test_an_early_stop_saves_denoising_passes(lm, full):
    ref = full["diffusion"][0]
    assert int(ref.num_new_tokens[0]) > lm.config.canvas_length  # the unstopped run takes several canvases
    out = run(lm, "diffusion", PROMPTS[0], stop=ref.texts[0][5:9])  # text of the first canvas
    assert int(out.num_new_tokens[0]) <= lm.config.canvas_length
    assert int(out.forward_passes[0]) < int(ref.forward_passes[0])


def test_a_stop_in_a_later_canvas_pads_the_rest_of_that_canvas(lm, full):
    """A stop string completed inside the second canvas keeps the tokens through it and pads the rest of that canvas.
    With the canvas's tokens past the stop found at `m + lo` instead of `m - lo` (the same in the first canvas, lo
    0), nothing of it was padded and the row kept its whole canvas; every test passed, their stops all in canvas 0."""
    ref, c = full["diffusion"][0], lm.config.canvas_length
    text, tokens = ref.texts[0], ref.new_tokens[0].tolist()
    assert int(ref.num_new_tokens[0]) >= 2 * c
    start = len(lm.tokenizer.decode(tokens[:c])) + 1  # past the first canvas's text
    k = next(k for k in range(start, len(text)) if text.find(text[k : k + 3]) == k)  # its first appearance
    out = run(lm, "diffusion", PROMPTS[0], stop=text[k : k + 3])
    n = int(out.num_new_tokens[0])
    assert c < n < 2 * c and out.texts[0] == cut_at_stop(text, [text[k : k + 3]])
    assert out.new_tokens[0, :n].tolist() == tokens[:n]
    assert all(t == lm.config.text.pad_token_id for t in out.new_tokens[0, n:].tolist())


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_each_row_has_its_own_stops(lm, full, engine):
    refs = full[engine]
    stops = [[refs[0].texts[0][10:14]], []]  # row 0 stops early, row 1 never
    out = (lm.generate(PROMPTS, max_new_tokens=N, seeds=[3, 3], stop=stops) if engine == "diffusion"
           else lm.generate_ar(PROMPTS, max_new_tokens=N, stop=stops))
    assert out.texts[0] == cut_at_stop(refs[0].texts[0], stops[0])
    assert out.texts[1] == refs[1].texts[0]


def test_stop_with_token_healing_cuts_the_healed_text(lm):
    prompt = PROMPTS[0] + "\n"
    ref = lm.generate(prompt, max_new_tokens=N, seed=3, token_healing=True)
    stop = ref.texts[0][8:12]
    out = lm.generate(prompt, max_new_tokens=N, seed=3, token_healing=True, stop=stop)
    assert out.texts[0] == cut_at_stop(ref.texts[0], [stop])


@pytest.mark.parametrize("stop, message", [
    ([""], "non-empty"),
    ([["a"]], "one list of stop strings per row"),
    (3, "expected a string"),
    (["a", 3], "expected a string"),
])
def test_bad_stops_are_clear_errors(lm, stop, message):
    with pytest.raises(ValueError, match=f"stop: .*{message}"):
        lm.generate(["a", "b"], max_new_tokens=4, stop=stop)


def test_stop_needs_text_and_no_template(lm):
    with pytest.raises(ValueError, match="stop: not with a template"):
        lm.infill("x = <|hole|>", stop="\n")
    bare = blockpress.random_model(blockpress.ModelConfig.preset("tiny"))
    with pytest.raises(ValueError, match="stop: stop strings need a model with a tokenizer"):
        bare.generate([[1, 2, 3]], max_new_tokens=4, stop="x")


def test_normalize_stops_shapes():
    assert normalize_stops(None, 2) is None and normalize_stops([], 3) is None
    assert normalize_stops("x", 2) == [["x"], ["x"]]
    assert normalize_stops([["a"], ["b", "c"]], 2) == [["a"], ["b", "c"]]


# (numpy drops a string's trailing NULs; a lone surrogate is refused either way, as text that never matches)
@given(st.lists(st.text(st.characters(codec="utf-8", blacklist_characters="\x00"), min_size=1, max_size=4), max_size=3),
       st.integers(1, 3))
def test_a_1d_numpy_array_of_stop_strings_is_a_list_of_them(stops, batch):
    """Other per-batch arguments take numpy arrays; stop failed with numpy's "truth value ... ambiguous" (it was
    compared with [] before its type was checked)."""
    assert normalize_stops(np.array(stops), batch) == normalize_stops(stops, batch)


def test_a_numpy_string_is_a_stop_string():
    """np.str_ (an element of an array of strings) is a str, as prompts and stop=[np.str_] take it; alone it was
    refused as "a 0-D array (only a 1-D one is a list)"."""
    stop = np.array(["\n", ";"])[0]
    assert normalize_stops(stop, 2) == [["\n"], ["\n"]]


@pytest.mark.parametrize("stop, message", [
    (np.array([["a"], ["b"]]), "got a 2-D array"),
    (np.array("a"), "got a 0-D array"),
    (torch.tensor([1, 2]), "got \\[1, 2\\]"),
    ({"a"}, "got set"),
    (b"a", "got bytes"),
])
def test_stops_that_are_not_lists_are_clear_errors(stop, message):
    with pytest.raises(ValueError, match=f"stop: expected a string, a list of strings or one list per row, {message}"):
        normalize_stops(stop, 2)


@pytest.mark.parametrize("call, message", [
    (lambda lm: lm.generate("ab\ud800", max_new_tokens=2), r"^prompt: not valid UTF-8 \(lone surrogate U\+D800 at "
                                                            r"character 2\)"),
    (lambda lm: lm.generate(["a", "\udcff"], max_new_tokens=2), r"^prompt\[1\]: not valid UTF-8 \(byte 0xff"),
    (lambda lm: lm.infill("a\ud83d<|hole:2|>"), r"^template: not valid UTF-8 \(lone surrogate U\+D83D at character 1"),
    (lambda lm: lm.generate("a", max_new_tokens=2, stop=["x", "\ud800"]), r"^stop: '\\ud800' is not valid UTF-8 "
                                                                          r"\(lone surrogate U\+D800 .*never match"),
    (lambda lm: lm.generate_ar("a", max_new_tokens=2, stop="\udcff"), r"^stop: '\\udcff' is not valid UTF-8"),
])
def test_text_that_is_not_utf8_is_a_value_error_naming_the_argument(tiny_lm, call, message):
    """A lone surrogate (JSON's "\\ud800", half of an emoji) raised a bare UnicodeEncodeError from inside the
    tokenizer's own error message, and a stop string that generated text (always UTF-8) can never hold was taken."""
    with pytest.raises(ValueError, match=message):
        call(tiny_lm)


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_generate_takes_a_numpy_array_of_stops(tiny_lm, engine):
    make = tiny_lm.generate if engine == "diffusion" else tiny_lm.generate_ar
    text = make("x", max_new_tokens=16, seed=0).texts[0]
    stops = [text[3:5], "\x00never"]
    listed, array = (make("x", max_new_tokens=16, seed=0, stop=s) for s in (stops, np.array(stops)))
    assert array.texts == listed.texts == [cut_at_stop(text, stops)] and array.extra["stopped"] == [True]


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_outputs_say_which_rows_a_stop_string_ended(lm, full, engine):
    """Even a stop completed by the very last token counts (the server's finish_reason "stop")."""
    text = full[engine][0].texts[0]
    out = run(lm, engine, PROMPTS[0], stop=[text[-3:], "\x00never"])
    assert out.extra["stopped"] == [True]
    assert run(lm, engine, PROMPTS[0], stop="\x00never").extra["stopped"] == [False]


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_stop_inside_the_min_new_tokens_does_not_count(lm, engine):
    """vLLM's min_tokens: no stop string ends in the first min_new_tokens tokens' text. Before, a stop there cut
    the answer short (an empty chat reply, though chat asks for at least one token)."""
    k = 10
    ref = run(lm, engine, PROMPTS[1], min_new_tokens=k)
    text = ref.texts[0]
    floor = len(lm.tokenizer.decode(ref.new_tokens[0, :k].tolist()))
    stop = text[floor - 3 : floor - 1]  # ends inside the first k tokens' text
    out = run(lm, engine, PROMPTS[1], min_new_tokens=k, stop=stop)
    assert out.texts[0] == cut_at_stop(text, [stop], floor)
    assert out.texts[0].startswith(text[:floor]) and len(out.texts[0]) >= floor


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_each_rows_own_min_new_tokens_sets_its_stop_floor(lm, engine):
    """min_new_tokens and max_new_tokens per row: one row's stop inside its first k tokens does not count, the same
    stop ends the row beside it (min 0) at once, and each row is what it would be alone."""
    k = 10
    ref = run(lm, engine, PROMPTS[1], min_new_tokens=k)
    floor = len(lm.tokenizer.decode(ref.new_tokens[0, :k].tolist()))
    stop = ref.texts[0][floor - 3 : floor - 1]  # ends inside the first k tokens' text
    maxes, mins = [N, N // 2], [k, 0]
    kw = dict(max_new_tokens=maxes, min_new_tokens=mins, stop=stop)
    batch = (lm.generate([PROMPTS[1]] * 2, seeds=[3, 3], **kw) if engine == "diffusion"
             else lm.generate_ar([PROMPTS[1]] * 2, **kw))
    alone = [lm.generate(PROMPTS[1], max_new_tokens=m, min_new_tokens=n, stop=stop, seed=3) if engine == "diffusion"
             else lm.generate_ar(PROMPTS[1], max_new_tokens=m, min_new_tokens=n, stop=stop)
             for m, n in zip(maxes, mins)]
    assert batch.texts == [a.texts[0] for a in alone] and len(batch.texts[0]) >= floor > len(batch.texts[1])
    assert batch.num_new_tokens.tolist() == [int(a.num_new_tokens[0]) for a in alone]
    assert batch.extra["stopped"][1]


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_minimum_that_bans_eos_alone_lets_a_stop_inside_it_end_the_row(tiny_lm, engine):
    """A server's default chat minimum (one token, so no reply opens with its end of turn) held a stop string in the
    first token back, and the client got the stop string in its content. min_new_tokens_eos_only (one flag per row
    here) bans EOS alone: the stop ends that row as it would without a minimum, and the row beside it keeps vLLM's
    floor."""
    lm, k = tiny_lm, 6

    def make(prompt, **kw):
        if engine == "diffusion":
            return lm.generate(prompt, max_new_tokens=16, seeds=[0] * (1 if isinstance(prompt, str) else 2), **kw)
        return lm.generate_ar(prompt, max_new_tokens=16, **kw)

    ref = make("x", min_new_tokens=k)
    text = ref.texts[0]
    floor = len(lm.tokenizer.decode(ref.new_tokens[0, :k].tolist()))
    stop = text[:2]  # ends inside the first k tokens' text
    assert "\ufffd" not in stop and len(stop) <= floor
    assert cut_at_stop(text, [stop]) != cut_at_stop(text, [stop], floor)  # (the case at hand)
    out = make(["x", "x"], min_new_tokens=k, stop=stop, min_new_tokens_eos_only=[True, False])
    assert out.texts == [cut_at_stop(text, [stop]), cut_at_stop(text, [stop], floor)]
    assert out.extra["stopped"][0] and stop not in out.texts[0]
    with pytest.raises(ValueError, match="min_new_tokens_eos_only: expected True or False, got 'yes'"):
        make("x", min_new_tokens=1, min_new_tokens_eos_only="yes")


@given(st.text("ab", max_size=10), st.lists(st.text("ab", min_size=1, max_size=3), max_size=3), st.integers(0, 12))
def test_cut_at_stop_ignores_only_stops_ending_in_the_floor(text, stops, floor):
    counted = [i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > floor]
    assert cut_at_stop(text, stops, floor) == text[: min(counted, default=len(text))]


@pytest.fixture(scope="module")
def tiny_lm():
    """A tiny random model (canvases of 8) that writes with the code model's byte-level tokenizer."""
    code = blockpress.lm.MODELS_DIR / "blockpress-code"
    return blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=8192), seed=0,
                                   tokenizer=Tokenizer.from_dir(code))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_each_row_is_decoded_once_a_commit_and_reads_as_a_plain_decode(tiny_lm, data, monkeypatch):
    """A commit decoded each row's text for its stop search, again (with the min_new_tokens floor, on every search)
    for the text so far, and Done decoded it all once more. Now the three share one decode of each row a commit (the
    floor once a generation, a few more to find where a stop ends): and every text reads as a plain decode of the
    unstopped run's ids, cut where a stop string first appears past the floor."""
    lm = tiny_lm
    tok, c = lm.tokenizer, lm.config.canvas_length
    kw = dict(seeds=data.draw(st.lists(st.integers(0, 50), min_size=2, max_size=2), label="seeds"),
              max_new_tokens=data.draw(st.integers(2 * c + 1, 3 * c), label="max_new_tokens"),
              max_denoising_steps=data.draw(st.integers(1, 3), label="steps"),
              token_healing=data.draw(st.booleans(), label="token_healing"))
    kw["min_new_tokens"] = data.draw(st.integers(0, kw["max_new_tokens"] // 2), label="min_new_tokens")
    prompts = [PROMPTS[0], PROMPTS[1] + " "]  # the second heals a token
    ref = lm.generate(prompts, **kw)
    ids, texts = [], []
    for r in range(2):
        ids.append(ref.new_tokens[r, : int(ref.num_new_tokens[r])].tolist())
        texts.append(ref.texts[r])
    prefixes = []
    for r in range(2):
        whole = tok.decode(ids[r])
        assert whole.endswith(texts[r])
        prefixes.append(whole[: len(whole) - len(texts[r])])
    stops = []
    for r in range(2):  # pieces of the row's own text, so that they do appear (U+FFFD: a half character, not one)
        pieces = st.integers(0, max(0, len(texts[r]) - 1)).flatmap(
            lambda at, t=texts[r]: st.integers(1, 4).map(lambda n: t[at : at + n]))
        row_stops = data.draw(st.lists(pieces.filter(lambda s: s and "\ufffd" not in s), max_size=2), label="stops")
        stops.append(row_stops + data.draw(st.sampled_from([[], ["\x00never"]]), label="never"))

    def text(r: int, n: int) -> str:
        return strip_prefix(tok.decode(ids[r][:n]), prefixes[r])

    def answer(r: int, n: int) -> str:  # the straightforward answer of the first n tokens: decode all, then cut
        floor = len(text(r, min(n, kw["min_new_tokens"])))
        return cut_at_stop(text(r, n), stops[r], floor)

    want = [next((n for n in range(1, len(ids[r]) + 1) if answer(r, n) != text(r, n)), len(ids[r])) for r in range(2)]

    calls = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    events, counts = [], []
    for event in lm.stream(prompts, stop=stops, drafts=False, **kw):
        events.append(event)
        counts.append(len(calls))
        calls.clear()
    monkeypatch.undo()
    commits, out = events[:-1], events[-1].output
    # at least one commit; one alone when every row's stop string ends in the first canvas
    assert commits and all(isinstance(e, Commit) for e in commits)

    assert counts[-1] == 0  # Done's texts are the last Commit's: nothing to decode again
    written = [0, 0]
    for k, (commit, n_calls) in enumerate(zip(commits, counts)):
        now = commit.num_new_tokens.tolist()
        stopped_here = [out.extra["stopped"][r] and now[r] == want[r] and written[r] < want[r] for r in range(2)]
        # A canvas decoded on its own and the row's text so far (tokenizer.TextStream: the last few settled tokens,
        # then those with the new ones); a row's floor the commit it passes min_new_tokens; where a stop string ends,
        # a bisection.
        bound = sum(3 + (written[r] <= kw["min_new_tokens"] < now[r]) + stopped_here[r] * len(ids[r]).bit_length()
                    for r in range(2))
        assert n_calls <= bound, (k, n_calls, bound)
        for r in range(2):
            assert now[r] <= want[r] and commit.texts_so_far[r] == answer(r, now[r])
            canvas = commit.tokens[r].tolist()
            assert commit.texts[r] == (strip_prefix(tok.decode(canvas), prefixes[r]) if k == 0 else tok.decode(canvas))
        written = now
    assert out.num_new_tokens.tolist() == want
    assert out.texts == [answer(r, want[r]) for r in range(2)]
    assert out.extra["stopped"] == [want[r] < len(ids[r]) or answer(r, want[r]) != text(r, want[r]) for r in range(2)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_commits_settled_text_is_never_taken_back(tiny_lm, data):
    """texts_so_far could take text back (a stop string straddling two canvases, a character whose bytes straddle
    their edge: U+FFFD, then the character). settled_texts never does: each is a prefix of the next and of the
    final text. The stops drawn straddle a canvas edge, where the first canvas's text ends with their start."""
    lm, tok, c = tiny_lm, tiny_lm.tokenizer, tiny_lm.config.canvas_length
    kw = dict(seeds=data.draw(st.lists(st.integers(0, 50), min_size=2, max_size=2), label="seeds"),
              max_new_tokens=data.draw(st.integers(2 * c + 1, 4 * c), label="max_new_tokens"),
              max_denoising_steps=data.draw(st.integers(1, 3), label="steps"))
    ref = lm.generate(PROMPTS, **kw)
    stops = []
    for r in range(2):
        ids = ref.new_tokens[r, : int(ref.num_new_tokens[r])].tolist()
        text, edge = tok.decode(ids), len(tok.decode(ids[: c * data.draw(st.integers(1, 2), label="canvas")]))
        stop = text[max(0, edge - data.draw(st.integers(1, 4), label="before")) : edge + data.draw(
            st.integers(1, 4), label="after")]
        stops.append([stop] if stop.strip("\ufffd") else [])
    commits = [e for e in lm.stream(PROMPTS, stop=stops, drafts=False, **kw) if isinstance(e, Commit)]
    final = commits[-1].texts_so_far
    for r in range(2):
        shown = [e.settled_texts[r] for e in commits]
        assert all(e.texts_so_far[r].startswith(e.settled_texts[r]) for e in commits)
        assert all(b.startswith(a) for a, b in zip(shown, shown[1:])), (shown, stops[r])
        assert shown[-1] == final[r]


SOT = "<start_of_turn>"  # the code tokenizer's special token 3: not an EOS, so only a stop ends a row there


def canvas_patterns(tok, c):
    """What each canvas of a row writes: row 0 `a b <start_of_turn> c d e a b`, row 1 the letters alone."""
    a, b, cc, d, e = (tok.encode(w)[0] for w in "abcde")
    sot = tok.token_to_id(SOT)
    assert sot in tok.special_ids and sot not in tok.eos_ids
    return torch.tensor([[a, b, sot, cc, d, e, a, b], [a, b, cc, d, e, a, b, cc]])[:, :c]


def forced(lm, engine, rows, monkeypatch, **kw):
    """Generate "x" once per entry of `rows` (0 or 1: which canvas_patterns row it writes), every token forced:
    through a logits_processor for diffusion; generate_ar takes none, so there its LM head is rigged."""
    c = lm.config.canvas_length
    pats = canvas_patterns(lm.tokenizer, c)[rows]
    if engine == "diffusion":
        def force(logits, working):
            out = torch.full_like(logits, -1e4)
            out[torch.arange(len(working))[:, None], torch.arange(c), pats[working]] = 10.0
            return out
        return lm.generate(["x"] * len(rows), seed=0, max_denoising_steps=2, logits_processor=force, **kw)
    step = iter(range(10**6))

    def head(hidden):  # AR: [B, D], one call a new token, every row at the same step
        out = hidden.new_full((hidden.shape[0], lm.config.text.vocab_size), -1e4)
        out[torch.arange(len(rows)), pats[:, next(step) % c]] = 10.0
        return out
    with monkeypatch.context() as m:
        m.setattr(lm.model, "head", head)
        return lm.generate_ar(["x"] * len(rows), **kw)


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(min_new=st.integers(0, 12), alone=st.booleans())
def test_a_stop_string_that_is_a_special_tokens_text_ends_the_row_at_that_token(tiny_lm, monkeypatch, engine,
                                                                                min_new, alone):
    """Texts leave special tokens out, so stop="<start_of_turn>" never matched though the model wrote it (a chat
    API habit, silently ignored). Now it ends the row at that token (past min_new_tokens, as any stop), as an EOS
    would: its tokens end with it, its text before it; a row without it beside it runs on."""
    tok, n = tiny_lm.tokenizer, 24
    rows = [0] if alone else [0, 1]
    out = forced(tiny_lm, engine, rows, monkeypatch, max_new_tokens=n, min_new_tokens=min_new, stop=SOT)
    pats = canvas_patterns(tok, tiny_lm.config.canvas_length)
    written = [pats[r].tolist() * (n // pats.shape[1]) for r in rows]
    sot = tok.token_to_id(SOT)
    at = next(i for i in range(min_new, n) if written[0][i] == sot) + 1
    assert out.num_new_tokens.tolist() == [at, n][: len(rows)]
    assert out.new_tokens[0, :at].tolist() == written[0][:at]
    assert (out.new_tokens[0, at:] == tiny_lm.config.text.pad_token_id).all()
    assert out.texts[0] == tok.decode(written[0][: at - 1]) and not out.texts[0].endswith(SOT)
    assert out.extra["stopped"] == [True, False][: len(rows)]
    if not alone:
        assert out.texts[1] == tok.decode(written[1])
    if engine == "ar":
        assert out.forward_passes.tolist()[0] == at


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_text_stop_before_the_special_one_still_ends_the_row_first(tiny_lm, monkeypatch, engine):
    out = forced(tiny_lm, engine, [0], monkeypatch, max_new_tokens=16, stop=[SOT, "b"])
    assert out.num_new_tokens.tolist() == [2] and out.texts == ["a"]


def test_a_streams_commits_end_at_the_special_stop_too(tiny_lm):
    """Commit's texts_so_far and settled_texts, and Done's texts, all end before the special token."""
    c = tiny_lm.config.canvas_length
    pats = canvas_patterns(tiny_lm.tokenizer, c)

    def force(logits, working):
        out = torch.full_like(logits, -1e4)
        out[torch.arange(len(working))[:, None], torch.arange(c), pats[working]] = 10.0
        return out
    events = list(tiny_lm.stream(["x", "x"], max_new_tokens=3 * c, seed=0, max_denoising_steps=2, stop=SOT,
                                 logits_processor=force, drafts=False))
    commits, out = events[:-1], events[-1].output
    assert all(isinstance(e, Commit) for e in commits)
    assert commits[0].num_new_tokens.tolist() == [3, c]
    assert [e.texts_so_far[0] for e in commits] == ["ab"] * len(commits)
    assert all(e.settled_texts[0] == "ab" for e in commits) and out.texts[0] == "ab"
    assert out.texts[1] == tiny_lm.tokenizer.decode(pats[1].tolist() * 3)


@pytest.mark.parametrize("stop", ["ab" + SOT, [SOT + "\n"], [["x"], ["x<eos>y"]]])
@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_stop_string_holding_a_special_token_among_other_text_is_refused(tiny_lm, stop, engine):
    """Texts leave special tokens out, so such a string would never match: refused, naming both."""
    make = tiny_lm.generate if engine == "diffusion" else tiny_lm.generate_ar
    special = "<eos>" if isinstance(stop[0], list) else SOT
    with pytest.raises(ValueError, match=f"stop: '.*{special}.*' holds the special token '{special}' among other text"):
        make(["x", "y"], max_new_tokens=4, stop=stop)


SPLIT_TEXT = "ab✓日本語"  # the byte-level tokenizer writes 本 as 3 byte tokens: new tokens 8, 9 and 10


def _writing(lm, target, engine):
    """A logits_processor that makes `engine` write `target` (one denoising step a canvas for diffusion)."""
    calls, c = [0], lm.config.canvas_length

    def force(logits, rows):
        k = calls[0]
        calls[0] += 1
        at = [k * c + p for p in range(logits.shape[1])] if engine == "diffusion" else [k]
        ids = torch.tensor([target[min(i, len(target) - 1)] for i in at])
        logits.fill_(-1e4)
        logits[:, torch.arange(logits.shape[1]), ids] = 1e4
        return logits

    return force


def _run_written(lm, engine, **kw):
    target = lm.tokenizer.encode(SPLIT_TEXT) + [lm.tokenizer.eos_id]
    common = dict(max_new_tokens=len(target), logits_processor=_writing(lm, target, engine), **kw)
    return (lm.generate("hi", max_denoising_steps=1, seed=0, **common) if engine == "diffusion"
            else lm.generate_ar("hi", **common))


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_character_the_minimum_leaves_unfinished_ends_after_it(tiny_lm, engine):
    """The floor of min_new_tokens is the text of the characters its tokens finish: with the 8th or 9th token
    part-way through 本, the floor's text ended in U+FFFD counted as a character, and a stop '本' (finished by the
    10th token, past the minimum) was ignored: the whole text came back."""
    tok = tiny_lm.tokenizer
    assert [len(tok.decode(tok.encode(SPLIT_TEXT)[:k])) for k in (7, 10)] == [4, 5]  # (日 ends at token 7, 本 at 10)
    for m, text in ((0, "ab✓日"), (7, "ab✓日"), (8, "ab✓日"), (9, "ab✓日"), (10, SPLIT_TEXT)):
        out = _run_written(tiny_lm, engine, stop=["本"], min_new_tokens=m)
        assert out.texts[0] == text, m


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
def test_a_stop_holding_a_replacement_character_never_ends_in_a_half_written_one(tiny_lm, engine):
    """A text whose character is still arriving (bytes of 本 split over two canvases, or the tokens so far in AR)
    ends in U+FFFD until it is finished: a stop string holding U+FFFD cut the answer there, at 'ab✓', though the
    text never held one."""
    plain = _run_written(tiny_lm, engine)
    assert plain.texts[0] == SPLIT_TEXT
    out = _run_written(tiny_lm, engine, stop=["\ufffd"])
    assert out.texts[0] == SPLIT_TEXT and out.num_new_tokens.tolist() == plain.num_new_tokens.tolist()
    assert cut_at_stop("ab\ufffd", ["\ufffd"], growing=True) == "ab\ufffd" == cut_at_stop("ab\ufffd", ["x"])
    assert cut_at_stop("a\ufffdb", ["\ufffd"], growing=True) == "a" == cut_at_stop("ab\ufffd", ["\ufffd"])[:1]


@pytest.mark.parametrize("engine", ["diffusion", "ar"])
@pytest.mark.parametrize("written, stop, text", [("ab\ufffd", "\ufffd", "ab"), ("ab\ufffd", "b\ufffd", "a"),
                                                 ("ab\ufffd\ufffd", "\ufffd", "ab")])
def test_a_replacement_character_the_model_writes_is_text_a_stop_finds(tiny_lm, engine, written, stop, text):
    """The other side of a character still arriving: U+FFFD written whole (its 3 bytes, then EOS) is text, and a stop
    string ending in it cuts the answer there (the finished text was searched as if its U+FFFD were still
    arriving, and came back whole)."""
    tok = tiny_lm.tokenizer

    def run(target, **kw):
        common = dict(max_new_tokens=len(target), logits_processor=_writing(tiny_lm, target, engine), stop=[stop], **kw)
        return (tiny_lm.generate("hi", max_denoising_steps=1, seed=0, **common) if engine == "diffusion"
                else tiny_lm.generate_ar("hi", **common))

    for end in ([tok.eos_id], []):  # its EOS after it, or its budget ending on it: the row stopped there, said so
        out = run(tok.encode(written) + end)
        assert out.texts[0] == text and out.extra["stopped"] == [True]
        # through the stop, exactly where the row's budget ends on it (else it may count the tokens after it up to
        # the next character that is no U+FFFD: a prefix's U+FFFD reads as still arriving)
        if not end and written == text + stop:
            assert int(out.num_new_tokens[0]) == len(tok.encode(written))
    # one the first min_new_tokens write is in their floor, as any character they finish
    written_first = tok.encode(written) + tok.encode("cd") + [tok.eos_id]
    assert run(written_first, min_new_tokens=len(tok.encode(written))).texts[0] == written + "cd"


def _settled_before(text, stops):  # settled_text as first written: test every length of every stop's start
    text = text.rstrip("\ufffd")
    hold = max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


_small = st.text("ab\ufffd", max_size=12)  # two letters: stops repeat themselves, and start where the text ends


@settings(max_examples=400, deadline=None)
@given(text=_small, stops=st.lists(st.tuples(_small, _small), max_size=4), repeat=st.integers(1, 40))
@example(text="abab", stops=[("a", "ab"), ("b", "ba")], repeat=20)  # many places to test, none a start: KMP's scan
def test_settled_text_holds_back_the_longest_start_of_a_stop(text, stops, repeat):
    """The linear settled_text holds back what testing every start of every stop did: short stops, and long ones
    (repeat) that hold the text's last 16 characters many times over, after a start that may differ."""
    stops = [head for head, _ in stops] + [head + body * repeat for head, body in stops]
    for t in (text, text * repeat, text + "a" * repeat):
        assert settled_text(t, stops) == _settled_before(t, stops)


class _Counted(str):
    """A stop string that counts the characters read out of it (a slice of k characters is k)."""

    read = 0

    def __getitem__(self, index):
        out = super().__getitem__(index)
        _Counted.read += len(out)
        return out


@pytest.mark.parametrize("text, stop", [
    ("x" * 4000, "y" * 4000),  # the server allows 16 stops of ~250k characters
    ("ab" * 2000, "ab" * 1999 + "c"),  # a stop that repeats itself, and whose every even start ends the text
    ("ab" * 2000 + "a", "ab" * 1000 + "abc" + "ab" * 1000),
])
def test_settled_text_reads_a_long_stop_a_few_times_not_once_per_start(text, stop):
    """settled_text runs on every canvas and streamed chunk (the server's event loop): testing text.endswith(
    stop[:k]) for every k read ~L²/2 characters of a stop of L (16 stops of 25k characters took 12.7 s of a 15.7 s
    generation); now it reads it a few times at most."""
    _Counted.read = 0
    assert settled_text(text, [_Counted(stop)]) == _settled_before(text, [stop])
    assert _Counted.read <= 16 * len(stop), _Counted.read
