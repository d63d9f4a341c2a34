"""Stop strings: a row ends at the token that completes one, its text just before it (OpenAI's `stop`)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockpress
from blockpress.generate import cut_at_stop, normalize_stops

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


@given(st.text("ab", max_size=10), st.lists(st.text("ab", min_size=1, max_size=3), max_size=3), st.integers(0, 12))
def test_cut_at_stop_ignores_only_stops_ending_in_the_floor(text, stops, floor):
    counted = [i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > floor]
    assert cut_at_stop(text, stops, floor) == text[: min(counted, default=len(text))]
