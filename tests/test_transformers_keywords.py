"""transformers' generate keywords (input_ids, max_length, generation_config, eos_token_id, pad_token_id,
num_return_sequences, stop_strings, sampler_config) mapped onto blockpress's, in generate, stream and generate_ar: each mapped call
is the native call with the same seed, token for token; the habits with no exact meaning here are refused with the
nearest setting named. (Against the reference's own generate: tests/test_reference_generate.py.)"""

import re
import warnings

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import blockpress
from blockpress.generate import Done
from blockpress.sampling import choice_seed

STEPS = dict(max_denoising_steps=4)


@pytest.fixture(scope="module")
def lm():
    return blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(0))


def done(events):
    return next(e for e in events if isinstance(e, Done)).output


def test_input_ids_and_attention_mask_are_the_prompt(lm, ids):
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1 is padded on the left
    native = lm.generate(ids, 8, attention_mask=mask, seed=3, **STEPS)
    mapped = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, seed=3, **STEPS)
    assert torch.equal(mapped.sequences, native.sequences)
    assert torch.equal(done(lm.stream(input_ids=ids, attention_mask=mask, max_new_tokens=8, seed=3, **STEPS)).sequences,
                       native.sequences)
    assert torch.equal(lm.generate_ar(input_ids=ids, attention_mask=mask, max_new_tokens=5).sequences,
                       lm.generate_ar(ids, 5, attention_mask=mask).sequences)


def test_sampler_config_is_the_entropy_bound(lm, ids):
    """The reference's per-call spelling of the entropy bound, sampler_config=EntropyBoundSamplerConfig(...), was
    refused as no keyword of generate's. It is the bound, over the checkpoint's and a generation_config's, and below
    a call's own entropy_bound."""
    G = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    native = lm.generate(ids, 8, entropy_bound=50.0, seed=3, **STEPS)
    assert not torch.equal(native.sequences, lm.generate(ids, 8, seed=3, **STEPS).sequences)  # the bound matters
    for value in (G.EntropyBoundSamplerConfig(entropy_bound=50.0), {"entropy_bound": 50.0}):
        assert torch.equal(lm.generate(ids, 8, sampler_config=value, seed=3, **STEPS).sequences, native.sequences)
        assert torch.equal(done(lm.stream(ids, 8, sampler_config=value, seed=3, **STEPS)).sequences, native.sequences)
    over = lm.generate(ids, 8, sampler_config={"entropy_bound": 50.0}, seed=3, **STEPS,
                       generation_config={"sampler_config": {"entropy_bound": 0.2}})
    assert torch.equal(over.sequences, native.sequences)
    under = lm.generate(ids, 8, sampler_config={"entropy_bound": 0.2}, entropy_bound=50.0, seed=3, **STEPS)
    assert torch.equal(under.sequences, native.sequences)
    for bad in (0.9, {}):  # ({} set no bound, and dropped the checkpoint's)
        with pytest.raises(ValueError, match=rf"sampler_config: expected transformers' EntropyBoundSamplerConfig .*got "
                                             rf"{re.escape(repr(bad))}"):
            lm.generate(ids, 8, sampler_config=bad)
    with pytest.raises(ValueError, match=r"entropy_bound: expected > 0"):
        lm.generate(ids, 8, sampler_config={"entropy_bound": 0})


def test_a_prompt_is_given_once(lm, ids):
    for call in (lm.generate, lm.stream, lm.generate_ar):
        with pytest.raises(ValueError, match=r"^prompt: .* needs a prompt .*input_ids="):
            call(max_new_tokens=4)
        with pytest.raises(ValueError, match=r"^input_ids: .* the prompt twice"):
            call(ids, input_ids=ids, max_new_tokens=4)


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_max_length_counts_the_prompt(lm, ids, engine):
    call = getattr(lm, engine)
    out = call(ids, max_length=ids.shape[1] + 5, seed=1, **(STEPS if engine == "generate" else {}))
    native = call(ids, max_new_tokens=5, seed=1, **(STEPS if engine == "generate" else {}))
    assert out.new_tokens.shape[1] == 5
    assert torch.equal(out.sequences, native.sequences)


def test_max_new_tokens_wins_over_max_length_as_in_transformers(lm, ids):
    with pytest.warns(UserWarning, match="max_length: max_new_tokens was given too and takes precedence"):
        out = lm.generate(ids, 3, max_length=ids.shape[1] + 9, seed=1, **STEPS)
    assert out.new_tokens.shape[1] == 3


def test_max_length_that_leaves_no_room_is_refused(lm, ids):
    with pytest.raises(ValueError, match=r"^max_length: the call's max_length \(6\) leaves no room after a 6-token prompt; pass a larger "
                                         r"max_length, or max_new_tokens"):
        lm.generate(ids, max_length=6)
    with pytest.raises(ValueError, match=r"max_length: expected a positive integer, got 0"):
        lm.generate(ids, max_length=0)


def test_max_length_overrides_the_checkpoints_max_new_tokens(ids):
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    lm.generation_config["max_new_tokens"] = 20
    assert lm.generate(ids, max_length=ids.shape[1] + 4, seed=1, **STEPS).new_tokens.shape[1] == 4


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_a_generation_configs_max_length_overrides_the_checkpoints_max_new_tokens(ids, engine):
    """As the max_length keyword does, and as transformers does: the checkpoint's max_new_tokens won, and the call's
    bound was silently ignored (20 new tokens for a bound that leaves 4)."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    lm.generation_config["max_new_tokens"] = 20
    call = getattr(lm, engine)
    extra = STEPS if engine == "generate" else {}
    G = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    bound = ids.shape[1] + 4
    for config in ({"max_length": bound}, G.DiffusionGemmaGenerationConfig(max_length=bound)):
        assert call(ids, generation_config=config, seed=1, **extra).new_tokens.shape[1] == 4
    both = {"max_length": ids.shape[1] + 4, "max_new_tokens": 6}  # its own max_new_tokens still wins
    assert call(ids, generation_config=both, seed=1, **extra).new_tokens.shape[1] == 6
    with pytest.raises(ValueError, match=r"^min_new_tokens: 9 new tokens, past the 4 that"):
        call(ids, generation_config={"max_length": ids.shape[1] + 4}, min_new_tokens=9, **extra)


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_a_calls_max_length_bounds_min_new_tokens(lm, ids, engine):
    """A call's max_length is a bound (transformers stops there whatever min_new_tokens says): a minimum past it is
    refused, where the default grew to it and the sequences came out longer than max_length asked."""
    call = getattr(lm, engine)
    extra = STEPS if engine == "generate" else {}
    with pytest.raises(ValueError, match=r"^min_new_tokens: 30 new tokens, past the 8 that max_length=14 leaves after "
                                         r"the prompt's 6 tokens"):
        call(ids, max_length=14, min_new_tokens=30, **extra)
    with pytest.raises(ValueError, match=r"^min_new_tokens: 30 new tokens, past the 8 that max_length=14"):
        call(ids, generation_config={"max_length": 14}, min_new_tokens=30, **extra)
    assert call(ids, max_length=14, min_new_tokens=8, seed=1, **extra).sequences.shape[1] == 14
    grown = blockpress.LM(lm.model, lm.tokenizer, {"max_length": 14})  # the checkpoint's default grows to it
    assert call.__func__(grown, ids, min_new_tokens=10, seed=1, **extra).new_tokens.shape[1] == 10
    # a checkpoint's max_length that leaves one token grew to the minimum, one that leaves none was refused
    for room in (1, 0):
        grown = blockpress.LM(lm.model, lm.tokenizer, {"max_length": ids.shape[1] + room})
        assert call.__func__(grown, ids, min_new_tokens=3, seed=1, **extra).new_tokens.shape[1] == 3
    with pytest.raises(ValueError, match=r"^max_length: the generation config's max_length \(6\) leaves no room"):
        call.__func__(grown, ids, min_new_tokens=[3, 0], seed=1, **extra)
    for bad in (0, -3, 2.5, True):  # still refused, whatever minimum is given
        broken = blockpress.LM(lm.model, lm.tokenizer, {"max_length": bad})
        with pytest.raises(ValueError, match=r"^generation_config max_length: expected a positive integer"):
            call.__func__(broken, ids, min_new_tokens=3, seed=1, **extra)


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_max_length_counts_the_width_passed_right_padding_included(lm, ids, engine):
    """transformers' max_length less input_ids.shape[1]: right-padded rows (re-laid on the left, their padding
    trimmed) got the trimmed columns as extra new tokens."""
    call = getattr(lm, engine)
    extra = STEPS if engine == "generate" else {}
    right, left = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    right[:, :5], left[:, 4:] = ids[:, :5], ids[:, :5]
    right_mask, left_mask = (right != 0).long(), (left != 0).long()
    assert bool(right_mask[:, :5].all()) and bool(left_mask[:, 4:].all())
    for rows, mask in ((right, right_mask), (left, left_mask)):
        out = call(input_ids=rows, attention_mask=mask, max_length=13, seed=1, **extra)
        assert out.new_tokens.shape[1] == 4
        # a cache that holds nothing yet counts as none (a batch continued counts each row's conversation)
        out = call(input_ids=rows, attention_mask=mask, max_length=13, seed=1, cache=lm.new_cache(2, 64), **extra)
        assert out.new_tokens.shape[1] == 4


def test_generation_configs_max_new_tokens_wins_over_max_length(lm, ids):
    with pytest.warns(UserWarning, match="max_length: generation_config's max_new_tokens was given too and takes"):
        out = lm.generate(ids, generation_config={"max_new_tokens": 3}, max_length=ids.shape[1] + 9, seed=1, **STEPS)
    assert out.new_tokens.shape[1] == 3


def test_generation_config_token_healing_is_refused_for_the_argument(lm, ids):
    """generation_config.json's token_healing is the CLI's default; given per call it was accepted and did nothing."""
    for call in (lm.generate, lm.generate_ar):
        with pytest.raises(ValueError, match=r"^generation_config: token_healing: .*pass token_healing=True itself"):
            call(ids, 4, generation_config={"token_healing": True})
    # a tuned model's own settings passed back (blockpress train writes token_healing false) are taken as they are
    tuned = blockpress.LM(lm.model, lm.tokenizer, {"token_healing": False, "max_new_tokens": 6})
    out = tuned.generate(ids, seed=1, generation_config={**tuned.generation_config, "max_new_tokens": 4}, **STEPS)
    assert torch.equal(out.sequences, tuned.generate(ids, 4, seed=1, **STEPS).sequences)


def test_generation_config_bos_token_id_is_refused_unless_the_checkpoints(lm, ids):
    """A per-call bos_token_id was accepted and never read (a text prompt still started with the tokenizer's BOS);
    the checkpoint's own, passed back with the rest of its settings, is taken."""
    own = lm.generation_config.get("bos_token_id")
    for call in (lm.generate, lm.generate_ar):
        with pytest.raises(ValueError, match=r"^generation_config: bos_token_id: not a per-call setting"):
            call(ids, 4, generation_config={"bos_token_id": (own or 0) + 1})
    out = lm.generate(ids, 4, seed=1, generation_config={**lm.generation_config}, **STEPS)
    assert torch.equal(out.sequences, lm.generate(ids, 4, seed=1, **STEPS).sequences)


def test_a_models_own_generation_config_read_back_is_taken(tmp_path):
    """A model whose settings name no bos_token_id (random_model's) saves the config's; its GenerationConfig read
    back from the folder holds that id and was refused as "not the checkpoint's (None)"."""
    from transformers import GenerationConfig

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    lm.save(tmp_path)
    gen = GenerationConfig.from_pretrained(tmp_path)
    assert gen.bos_token_id == lm.config.text.bos_token_id
    out = lm.generate([[3, 4]], 4, seed=1, generation_config=gen, **STEPS)
    assert torch.equal(out.sequences, lm.generate([[3, 4]], 4, seed=1, **STEPS).sequences)


def stopping_token(lm, ids):
    """A token row 0 writes at position 3 of its native output, and that output."""
    native = lm.generate(ids, 16, seed=2, **STEPS)
    return int(native.new_tokens[0, 3]), native


def test_eos_token_id_ends_the_rows(lm, ids):
    eos, native = stopping_token(lm, ids)
    out = lm.generate(ids, 16, seed=2, eos_token_id=[eos, 1], **STEPS)
    first = int((native.new_tokens[0] == eos).nonzero()[0])
    assert int(out.num_new_tokens[0]) == first + 1  # up to and including EOS
    assert torch.equal(out.new_tokens[0, : first + 1], native.new_tokens[0, : first + 1])
    # the same as a checkpoint whose generation_config.json names it; the checkpoint's own is unchanged
    assert torch.equal(out.sequences, blockpress.LM(lm.model, lm.tokenizer, {"eos_token_id": [eos, 1]}).generate(
        ids, 16, seed=2, **STEPS).sequences)
    assert "eos_token_id" not in lm.generation_config
    assert int(lm.generate(ids, 16, seed=2, eos_token_id=eos, **STEPS).num_new_tokens[0]) == first + 1
    # as tensors and numpy values, as the reference takes them (they were refused as not token ids)
    for given in (torch.tensor(eos), torch.tensor([eos, 1]), np.int64(eos), np.array([eos, 1])):
        assert int(lm.generate(ids, 16, seed=2, eos_token_id=given, **STEPS).num_new_tokens[0]) == first + 1


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_an_empty_eos_token_id_ends_no_row(lm, ids, engine):
    """eos_token_id=[] was read as unset: the checkpoint's EOS ids still ended rows, where the reference, whose EOS
    set is then empty, runs every row to its budget."""
    eos = lm.eos_ids[0]

    def only_eos(logits, rows):  # every token the model's own EOS
        logits = logits.clone()
        logits[..., eos] = 1e4
        return logits

    run = getattr(lm, engine)
    kw = dict(seed=2, logits_processor=only_eos, **(STEPS if engine == "generate" else {}))
    assert run(ids, 16, **kw).num_new_tokens.tolist() == [1, 1]
    out = run(ids, 16, eos_token_id=[], **kw)
    assert out.num_new_tokens.tolist() == [16, 16] and (out.new_tokens == eos).all()


def test_pad_token_id_fills_after_eos(lm, ids):
    eos, _ = stopping_token(lm, ids)
    out = lm.generate(ids, 16, seed=2, eos_token_id=eos, pad_token_id=7, **STEPS)
    n = int(out.num_new_tokens[0])
    assert n < 16 and (out.new_tokens[0, n:] == 7).all()
    with pytest.raises(ValueError, match=r"pad_token_id: expected a token id or a list of them, got -1"):
        lm.generate(ids, 4, pad_token_id=-1)


def test_generation_config_dict_is_read_as_the_file(lm, ids):
    eos, _ = stopping_token(lm, ids)
    gen = {"max_new_tokens": 12, "eos_token_id": eos, "max_denoising_steps": 4, "t_min": 0.1, "t_max": 0.3}
    out = lm.generate(ids, seed=2, generation_config=gen)
    assert torch.equal(out.sequences, blockpress.LM(lm.model, lm.tokenizer, gen).generate(ids, seed=2).sequences)
    assert out.new_tokens.shape[1] == 12 and lm.generation_config == {}
    # keywords over it, as in transformers
    assert lm.generate(ids, 5, seed=2, generation_config=gen).new_tokens.shape[1] == 5
    with pytest.raises(ValueError, match=r"^generation_config: do_sample: not a blockpress setting.*sampler='greedy'"):
        lm.generate(ids, generation_config={"do_sample": True})
    with pytest.raises(ValueError, match=r"^generate's generation settings: max_new_tokens: expected a positive"):
        lm.generate(ids, generation_config={"max_new_tokens": "8"})
    with pytest.raises(ValueError, match=r"^generation_config: expected transformers' Diffusion.*got str"):
        lm.generate(ids, generation_config="greedy")
    # return_dict_in_generate false asks the reference for a bare tensor: it was accepted and changed nothing
    for call in (lm.generate, lm.generate_ar):
        with pytest.raises(ValueError, match=r"^generation_config: return_dict_in_generate: false .*GenerationOutput"):
            call(ids, 4, generation_config={"return_dict_in_generate": False})
        assert call(ids, 4, generation_config={"return_dict_in_generate": True}).sequences.shape == (2, 10)


def test_the_references_generation_config_object(lm, ids):
    G = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    config = G.DiffusionGemmaGenerationConfig(max_new_tokens=8, max_denoising_steps=4, t_min=0.1, t_max=0.3,
                                              sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=0.2))
    out = lm.generate(ids, seed=2, generation_config=config)
    native = lm.generate(ids, 8, seed=2, max_denoising_steps=4, t_min=0.1, t_max=0.3, entropy_bound=0.2)
    assert torch.equal(out.sequences, native.sequences)


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_num_return_sequences_gives_each_copy_its_own_seed(lm, ids, engine):
    call = getattr(lm, engine)
    extra = STEPS if engine == "generate" else dict(temperature=1.0)
    out = call(ids, 8, seed=5, num_return_sequences=3, **extra)
    assert out.sequences.shape[0] == 6
    assert torch.equal(out.sequences[:, :6], ids.repeat_interleave(3, dim=0))
    seeds = [choice_seed(5, i) for _ in range(2) for i in range(3)]
    assert torch.equal(out.sequences, call(ids.repeat_interleave(3, dim=0), 8, seeds=seeds, **extra).sequences)
    assert torch.equal(out.sequences[::3], call(ids, 8, seed=5, **extra).sequences)  # the first copy: seed itself
    assert not torch.equal(out.new_tokens[0], out.new_tokens[1])  # the samples differ
    mask = torch.ones_like(ids)
    masked = call(input_ids=ids, attention_mask=mask, max_new_tokens=8, seed=5, num_return_sequences=3, **extra)
    assert torch.equal(masked.sequences, out.sequences)


@pytest.mark.parametrize("greedy", [dict(sampler="greedy"), dict(candidates="argmax")])
def test_greedy_copies_are_one_answer_whatever_the_seed(lm, ids, greedy):
    """Greedy copies (argmax candidates) are one answer, as the server's n greedy choices are: seed=None's were
    (greedy reads it as 0), while seed=0 gave each copy a seed of its own, so n different answers."""
    for seed in (None, 0, 5):
        out = lm.generate(ids, 8, seed=seed, num_return_sequences=3, **STEPS, **greedy)
        assert out.extra["seeds"] == [seed or 0] * 6
        alone = lm.generate(ids, 8, seed=seed or 0, **STEPS, **greedy)
        for copy in range(3):
            assert torch.equal(out.sequences[copy::3], alone.sequences)


def test_greedy_copies_with_per_row_settings_are_one_answer(lm, ids):
    """Settings given one per prompt row (top_k=[0, 0]: greedy refuses a filter that would change nothing) leave
    greedy greedy: the check ran on the rows already repeated, where two values for six rows were refused as a
    mismatch, read as "not greedy", so each copy got a seed of its own and, under uniform noise, an answer of its own."""
    out = lm.generate(ids, 8, sampler="greedy", seed=3, num_return_sequences=3, top_k=[0, 0], **STEPS)
    assert out.extra["seeds"] == [3] * 6
    for copy in range(3):
        assert torch.equal(out.sequences[copy::3], out.sequences[::3])


@pytest.mark.parametrize("greedy", [{}, dict(temperature=0), dict(temperature=np.float64(0.0))])
def test_generate_ar_greedy_copies_share_the_seed(lm, ids, greedy):
    out = lm.generate_ar(ids, max_new_tokens=6, seed=3, num_return_sequences=2, **greedy)
    assert out.extra["seeds"] == [3] * 4
    sampled = lm.generate_ar(ids, max_new_tokens=6, seed=3, num_return_sequences=2, temperature=1.0)
    assert sampled.extra["seeds"] == [choice_seed(3, i) for _ in range(2) for i in range(2)]


@pytest.mark.parametrize("mask", [[1.0] * 6, [True] * 6, np.ones(6, dtype=np.float32).tolist()])
def test_a_one_row_float_or_bool_mask_is_repeated_as_one_row(lm, ids, mask):
    out = lm.generate(ids[0].tolist(), 4, attention_mask=mask, seed=1, num_return_sequences=2, **STEPS)
    plain = lm.generate(ids[0].tolist(), 4, seed=1, num_return_sequences=2, **STEPS)
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_num_return_sequences_repeats_per_row_settings(lm, ids, engine):
    call = getattr(lm, engine)
    extra = STEPS if engine == "generate" else {}
    temperature = "draw_temperature" if engine == "generate" else "temperature"
    draws = {temperature: torch.tensor([0.5, 1.5])} | ({"sampler": "entropy_bound"} if engine == "generate" else {})
    out = call(ids, max_new_tokens=[3, 8], seed=5, num_return_sequences=2, **draws, **extra)
    seeds = [choice_seed(5, i) for _ in range(2) for i in range(2)]
    native = call(ids.repeat_interleave(2, dim=0), max_new_tokens=[3, 3, 8, 8], seeds=seeds,
                  **{**draws, temperature: [0.5, 0.5, 1.5, 1.5]}, **extra)
    assert out.num_new_tokens.tolist()[:2] == [3, 3]
    assert torch.equal(out.sequences, native.sequences)


def test_num_return_sequences_refusals(lm, ids):
    with pytest.raises(ValueError, match=r"^num_return_sequences: expected a positive integer, got 0"):
        lm.generate(ids, 4, num_return_sequences=0)
    with pytest.raises(ValueError, match=r"^num_return_sequences: not with seeds"):
        lm.generate(ids, 4, num_return_sequences=2, seeds=[1, 2])


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_num_return_sequences_over_a_cache_of_one_row_a_prompt_says_so(lm, ids, engine):
    """One prompt, num_return_sequences=2, and the cache of that one conversation was refused as "cache: holds 1
    rows, the prompt has 2", naming neither the copies nor how to get several continuations. A cache of one row a
    copy (a num_return_sequences output's own) continues each copy."""
    call = getattr(lm, engine)
    extra = STEPS if engine == "generate" else dict(temperature=1.0)
    out = call(ids, 4, seed=5, return_cache=True, **extra)
    with pytest.raises(ValueError, match=rf"^num_return_sequences: the cache holds 2 rows, and 2 prompt rows x 3 "
                                         rf"copies need 6 .*cache.mark\(\), then call {engine} once per continuation"):
        call(ids[:, :2], 4, cache=out.cache, seed=5, num_return_sequences=3, **extra)
    copies = call(ids, 4, seed=5, num_return_sequences=3, return_cache=True, **extra)
    more = call(ids[:, :2], 4, cache=copies.cache, seed=6, num_return_sequences=3, **extra)
    assert more.sequences.shape[0] == 6 and copies.cache.length > out.cache.length


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_habits_without_a_meaning_here_name_the_nearest_setting(lm, ids, engine):
    call = getattr(lm, engine)
    with pytest.raises(ValueError, match=r"^do_sample: .* no such keyword; transformers' switch .*sampler='greedy'"):
        call(ids, 4, do_sample=False)
    with pytest.raises(ValueError, match=r"^repetition_penalty: .*presence_penalty / frequency_penalty"):
        call(ids, 4, repetition_penalty=1.2)
    # each got the generic list of keywords (use_cache: "did you mean cache?", which takes a KVCache, not a flag)
    for keyword, value, nearest in [("use_cache", True, "leave use_cache out"), ("min_length", 8, "min_new_tokens"),
                                    ("stopping_criteria", [], "stop= .* cancelled="), ("output_scores", True, "lm.logits"),
                                    ("output_logits", True, "lm.logits"), ("bad_words_ids", [[3]], "constraint"),
                                    ("suppress_tokens", [3], "constraint"),
                                    ("return_dict_in_generate", True, "always returns a GenerationOutput")]:
        with pytest.raises(ValueError, match=rf"^{keyword}: {engine} takes no such keyword; .*{nearest}"):
            call(ids, 4, **{keyword: value})


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_a_transformers_logits_processor_is_refused_naming_the_call_blockpress_makes(lm, ids, engine):
    """A transformers LogitsProcessorList (or one processor) was taken as a callable and called as blockpress calls its
    own, (logits, rows), where transformers' take (input_ids, scores): it failed inside transformers ("Dimension out
    of range", an int64 overflow) or with a misleading shape error."""
    generation = pytest.importorskip("transformers.generation")
    call = getattr(lm, engine)
    for processor in (generation.LogitsProcessorList([generation.TemperatureLogitsWarper(0.7)]),
                      generation.TopKLogitsWarper(5), generation.RepetitionPenaltyLogitsProcessor(1.3)):
        with pytest.raises(ValueError, match=rf"^logits_processor: a transformers {type(processor).__name__}, which "
                                             r"is called as \(input_ids, scores\); blockpress calls "
                                             r"logits_processor\(logits, rows\)"):
            call(ids, 4, logits_processor=processor)


def test_stop_strings_is_stop():
    code = blockpress.load("blockpress-code", dtype="float32")
    prompt = "def add(a, b):"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native = code.generate(prompt, 32, seed=0, stop=["\n"])
        mapped = code.generate(prompt, 32, seed=0, stop_strings=["\n"])
    assert torch.equal(mapped.sequences, native.sequences) and mapped.texts == native.texts
    assert int(native.num_new_tokens[0]) < 32  # the stop did end the row
    with pytest.raises(ValueError, match=r"^stop_strings: transformers' name for stop, which was given too"):
        code.generate(prompt, 4, stop="x", stop_strings="y")


@pytest.mark.parametrize("engine", ["generate", "stream", "generate_ar"])
def test_a_mapped_keywords_refusal_names_the_keyword_given(lm, ids, engine):
    call = getattr(lm, engine)
    refusals = [(dict(stop_strings=5), r"^stop_strings: expected a string"),
                (dict(stop_strings=["a"]), r"^stop_strings: stop strings need a model with a tokenizer"),
                (dict(input_ids=[[1.5]]), r"^input_ids: expected integer token ids, got 1.5"),
                (dict(input_ids=ids, max_length=10**30), r"^max_length: 6 prompt \+ 9+4 new tokens .*exceed the "
                                                          r"model's context"),
                (dict(input_ids=ids, eos_token_id=500), r"^eos_token_id: expected token ids in \[0, 128\)"),
                (dict(input_ids=ids, pad_token_id=torch.tensor(500)), r"^pad_token_id: expected a token id in \[0, 128\)")]
    for given, error in refusals:
        given = {"input_ids": ids, **({} if "max_length" in given else {"max_new_tokens": 4}), **given}
        with pytest.raises(ValueError, match=error):
            call(**given)
    # blockpress's own names stay its own
    with pytest.raises(ValueError, match=r"^stop: expected a string"):
        call(ids, 4, stop=5)
    with pytest.raises(ValueError, match=r"^prompt: expected integer token ids"):
        call([[1.5]], 4)


@pytest.mark.parametrize("engine", ["generate", "stream", "generate_ar"])
def test_num_return_sequences_past_any_batch_is_refused_before_the_rows_are_built(lm, ids, engine, monkeypatch):
    """OverflowError 'cannot fit 'int' into an index-sized integer' (2**63), or a batch of 10**9 rows built on the
    host, then torch's allocator's 'can't allocate memory' or Python's MemoryError."""
    call = getattr(lm, engine)
    for prompt, rows in ((ids, 2), ([3, 4, 5], 1), (["a", "b"], 2)):
        with pytest.raises(ValueError, match=rf"^num_return_sequences: {rows} prompt rows? x {2**63} copies make "
                                             rf"{rows * 2**63} rows, past the 2\*\*31 - 1 any batch may hold"):
            call(prompt, 2, num_return_sequences=2**63)
    # generate_ar's cache holds the 6 prompt tokens, the 2 new ones and one more from the start, beside its logits
    per_row = 6 + 2 + 1 if engine == "generate_ar" else lm.config.canvas_length
    vocab = lm.config.text.vocab_size
    logits = 2 * 10**6 * 4 * vocab if engine == "generate_ar" else 0
    need = blockpress.KVCache.allocation_bytes(lm.config.text, lm.dtype, 2 * 10**6, per_row) + logits
    says = rf": 6 prompt \+ 2 new \+ 1, and {vocab} float32 logits" if engine == "generate_ar" else ""
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=rf"^num_return_sequences: 2 prompt rows x 1000000 copies make 2000000 rows, "
                                         rf"whose KV cache needs at least {need / 1e9:,.1f} GB on cpu \({per_row} "
                                         rf"tokens a row{says}\), but"):
        call(ids, 2, num_return_sequences=10**6)
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: None)  # unknown (meta): 2**31 - 1 alone
    with pytest.raises(ValueError, match=r"^num_return_sequences: 2 prompt rows x 1073741824 copies make 2147483648"):
        call(ids, 2, num_return_sequences=2**30)
    out = call(ids, 2, num_return_sequences=2, seed=0, **(STEPS if engine != "generate_ar" else {}))
    assert (done(out) if engine == "stream" else out).sequences.shape[0] == 4


def test_num_return_sequences_repeats_per_row_templates(lm):
    seeds = [choice_seed(5, i) for _ in range(2) for i in range(2)]
    template = [[7, -1, -1, 9], [11, 12, -1, -1, -1, 13]]  # one per row, of their own lengths
    out = lm.infill(template, num_return_sequences=2, seed=5, **STEPS)
    native = lm.infill([t for t in template for _ in range(2)], seeds=seeds, **STEPS)
    assert torch.equal(out.sequences, native.sequences)
    grid = torch.tensor([[7, -1, -1, 9], [-1, 12, 13, -1]])  # a 2-D tensor is one row each too
    out = lm.infill(grid, num_return_sequences=2, seed=5, **STEPS)
    assert torch.equal(out.sequences, lm.infill(grid.repeat_interleave(2, dim=0), seeds=seeds, **STEPS).sequences)


def test_num_return_sequences_repeats_per_row_stops():
    code = blockpress.load("blockpress-code", dtype="float32")
    prompts, stops = ["def add(a, b):", "import "], [["\n"], ["os"]]
    seeds = [choice_seed(5, i) for _ in range(2) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = code.generate(prompts, 24, seed=5, stop=stops, num_return_sequences=2)
        native = code.generate([p for p in prompts for _ in range(2)], 24, seeds=seeds,
                               stop=[s for s in stops for _ in range(2)])
    assert out.texts == native.texts and torch.equal(out.sequences, native.sequences)


def test_num_return_sequences_takes_stops_one_per_output_row():
    """Two lists of stop strings for one prompt x 2 copies were repeated regardless and refused as "got 4", a count
    the call did not give, where max_new_tokens=[4, 8] is read as one per output row. Stop lists are now repeated
    only when they are one per prompt row, as the per-row settings are."""
    code = blockpress.load("blockpress-code", dtype="float32")
    prompt, stops = "def add(a, b):", [["\n"], ["os"]]
    seeds = [choice_seed(5, i) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = code.generate(prompt, 12, seed=5, stop=stops, num_return_sequences=2)
        native = code.generate([prompt, prompt], 12, seeds=seeds, stop=stops)
        assert out.texts == native.texts and torch.equal(out.sequences, native.sequences)
        with pytest.raises(ValueError, match=r"^stop: expected one list of stop strings per row \(2\), got 3$"):
            code.generate(prompt, 12, seed=5, stop=[["a"], ["b"], ["c"]], num_return_sequences=2)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@hypothesis.given(widths=st.lists(st.integers(1, 7), min_size=1, max_size=3), n=st.integers(2, 3),
       budget=st.sampled_from([dict(max_new_tokens=3), dict(max_new_tokens="rows"), dict(max_length=12),
                               dict(generation_config={"max_new_tokens": 2})]))
def test_generate_ar_copies_floor_is_what_it_allocates(lm, monkeypatch, widths, n, budget):
    """generate_ar's floor counted one cache slot a row: 10**7 copies of a one-token prompt passed it, then failed in
    torch's allocator. It now counts what run_ar allocates before its first token (a cache of the prompt's padded
    width, every new token and one slot more, and a float32 row of logits): a request the memory holds exactly runs,
    one byte less is refused by name."""
    prompt = [list(range(3, 3 + w)) for w in widths]
    if budget == dict(max_new_tokens="rows"):  # one count per prompt row, the largest sizes the cache
        budget = dict(max_new_tokens=[1 + r % 3 for r in range(len(widths))])
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: None)
    out = lm.generate_ar(prompt, num_return_sequences=n, return_cache=True, **budget)
    rows = len(widths) * n
    held = blockpress.KVCache.allocation_bytes(lm.config.text, lm.dtype, rows, out.cache.capacity)
    held += rows * 4 * lm.config.text.vocab_size
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: held)
    assert torch.equal(lm.generate_ar(prompt, num_return_sequences=n, **budget).sequences, out.sequences)
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: held - 1)
    with pytest.raises(ValueError, match=rf"^num_return_sequences: {len(widths)} prompt rows? x {n} copies make "
                                         rf"{rows} rows, whose KV cache needs at least .* \({out.cache.capacity} "
                                         rf"tokens a row: {max(widths)} prompt \+ \d+ new \+ 1, and"):
        lm.generate_ar(prompt, num_return_sequences=n, **budget)


def test_generate_ar_copies_floor_counts_a_given_cache_as_held(lm, ids, monkeypatch):
    """A conversation's cache is in memory already: only the logits are new while it has room, its growth past it."""
    cache = lm.new_cache(4, 64)
    logits = 4 * 4 * lm.config.text.vocab_size
    room = blockpress.KVCache.allocation_bytes(lm.config.text, lm.dtype, 4, 0) + logits
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: room - 1)
    with pytest.raises(ValueError, match=r"^num_return_sequences: .* \(0 tokens a row: the cache given holds them; "):
        lm.generate_ar(ids, 2, cache=cache, num_return_sequences=2)
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: room)
    assert lm.generate_ar(ids, 2, cache=cache, num_return_sequences=2).sequences.shape == (4, 8)
    grown = blockpress.KVCache.allocation_bytes(lm.config.text, lm.dtype, 4, cache.length + 6 + 60 + 1) + logits
    monkeypatch.setattr(blockpress.lm, "available_bytes", lambda device: grown - 1)
    with pytest.raises(ValueError, match=rf"^num_return_sequences: .* \({cache.length + 67} tokens a row: "
                                         rf"{cache.length} cached \+ 6 prompt \+ 60 new \+ 1, and"):
        lm.generate_ar(ids, 60, cache=cache, num_return_sequences=2)


@pytest.mark.parametrize("engine, keyword", [
    ("generate", "min_new_tokens"), ("generate", "min_new_tokens_eos_only"), ("generate", "return_cache"),
    ("generate", "skip_stopped_rows"), ("generate", "input_ids"), ("stream", "drafts"),
    ("generate_ar", "min_new_tokens"), ("generate_ar", "min_new_tokens_eos_only"), ("generate_ar", "return_cache"),
    ("generate_ar", "input_ids"), ("generate", "drafts")])
def test_a_keyword_given_as_none_is_not_given(lm, ids, engine, keyword):
    """None for a keyword is "not given" (docs/python-api.md), and transformers' own default for min_new_tokens and
    input_ids is None: these were refused ("min_new_tokens: expected an integer ..., got None", "expected True or
    False", "given the prompt twice")."""
    steps = {} if engine == "generate_ar" else STEPS
    call = getattr(lm, engine)
    plain, with_none = call(ids, 4, seed=1, **steps), call(ids, 4, seed=1, **steps, **{keyword: None})
    if engine == "stream":
        plain, with_none = list(plain), list(with_none)
        assert [type(e) for e in plain] == [type(e) for e in with_none]  # drafts too, as by default
        plain, with_none = plain[-1].output, with_none[-1].output
    assert torch.equal(plain.sequences, with_none.sequences) and plain.texts == with_none.texts
    assert with_none.cache is None  # return_cache=None returns none, as False
