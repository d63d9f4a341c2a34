"""What a checkpoint's generation_config.json says, and how blockpress reads it: the pad id, keys it does not
use, sampler_config, EOS ids past the vocabulary, max_length; and prompts that blockpress pads itself."""

import json
import shutil

import pytest
import torch
from test_checkpoint import _load_recording as load_recording  # the LM and its warnings
from test_reference_generate import one_thread  # noqa: F401  (autouse: one thread, so the engines' draws match)

import blockpress
from blockpress.lm import resolve_path
from blockpress.tokenizer import Tokenizer

G = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

VOCAB = 96  # tests/reference.py's TINY_TEXT
EOS, PAD = 1, 0  # config.json's, as make_reference writes them


def folder_with(ref_checkpoint, tmp_path, gen=None, own=None):
    """A copy of the tiny reference checkpoint whose generation_config.json (and blockpress's own file) say `gen`
    (and `own`)."""
    path = tmp_path / "c"
    shutil.copytree(ref_checkpoint[0], path)
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen))
    if own is not None:
        (path / "blockpress_generation_config.json").write_text(json.dumps(own))
    return path


# -- 1. pad_token_id ---------------------------------------------------------------------------------------------

def test_the_generation_configs_pad_id_fills_after_eos_as_in_the_reference(monkeypatch, ref_checkpoint, tmp_path):
    """config.json says pad 0, generation_config.json pad 3: the reference pads finished rows with 3 (its
    _finalize_canvas reads the generation config); blockpress wrote config.json's 0 there."""
    from test_reference_generate import reference_generate

    path, ref = ref_checkpoint
    prompt = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=16, max_denoising_steps=6, seed=1, entropy_bound=0.1, t_max=0.8, t_min=0.4,
                   adaptive_stopping=False)
    # An EOS the model writes early in row 0's first canvas (EOS changes no draw, only where a row ends): the rest
    # of that canvas and all of the next are padding.
    first = blockpress.load(path).generate(prompt, **options).new_tokens[0].tolist()
    eos = next(t for i, t in enumerate(first[1:7], 1) if t not in first[:i] and t != 3)
    lm, _ = load_recording(folder_with(ref_checkpoint, tmp_path, {"eos_token_id": eos, "pad_token_id": 3}))
    got = lm.generate(prompt, **options).new_tokens
    want = reference_generate(monkeypatch, ref, prompt, 1, 6, max_new_tokens=16, t_max=0.8, t_min=0.4,
                              sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=0.1), stability_threshold=None,
                              eos_token_id=eos, pad_token_id=3)
    assert torch.equal(got, want)
    assert (got[0, first.index(eos) + 1:] == 3).all()


def test_the_generation_configs_pad_id_also_left_pads_and_changes_nothing_generated(ref_checkpoint):
    """The reference pads no prompt (its caller's tokenizer does); blockpress uses one pad id for the whole output,
    the generation config's, so `sequences` holds one id for "no token". Padding is masked: the tokens are equal."""
    model = blockpress.load(ref_checkpoint[0]).model
    prompts = [[5, 6, 7], [5]]
    plain = blockpress.LM(model).generate(prompts, max_new_tokens=4, max_denoising_steps=2, seed=0)
    padded = blockpress.LM(model, None, {"pad_token_id": 3}).generate(prompts, max_new_tokens=4,
                                                                      max_denoising_steps=2, seed=0)
    assert padded.sequences[1, :2].tolist() == [3, 3] and plain.sequences[1, :2].tolist() == [PAD, PAD]
    assert torch.equal(padded.new_tokens, plain.new_tokens)


def test_sample_candidates_are_honoured_over_a_greedy_default(ref_checkpoint):
    """A checkpoint whose default sampler is greedy (blockpress-code's) took candidates="sample" and still decoded
    greedily. It now draws, as entropy_bound does (greedy is entropy_bound with argmax candidates). keep_accepted
    commits the accepted candidates, and flattened logits make a draw unlike the argmax, so the two differ."""
    model = blockpress.load(ref_checkpoint[0]).model
    lm = blockpress.LM(model, None, {"sampler": "greedy", "keep_accepted": True})
    prompts = [[5, 6, 7]] * 4
    options = dict(max_new_tokens=8, max_denoising_steps=4, seeds=[0, 1, 2, 3], logits_processor=lambda x, rows: x / 100)
    drawn = lm.generate(prompts, candidates="sample", **options).new_tokens
    assert torch.equal(drawn, lm.generate(prompts, sampler="entropy_bound", **options).new_tokens)
    assert not torch.equal(drawn, lm.generate(prompts, **options).new_tokens)  # the greedy default's
    assert torch.equal(lm.generate(prompts, sampler=lm.sampler_defaults.with_(candidates="sample"), **options).new_tokens,
                       drawn)


def test_a_pad_id_past_the_vocabulary_is_dropped_with_a_warning(ref_checkpoint, tmp_path):
    """The reference would write it into the output; blockpress's output must stay usable as the next prompt."""
    lm, warned = load_recording(folder_with(ref_checkpoint, tmp_path, {"pad_token_id": 500}))
    assert len(warned) == 1 and "generation_config.json: pad_token_id: 500 at or above the vocabulary size 96" in warned[0]
    assert lm.pad_id == PAD
    lm.generation_config["pad_token_id"] = 500  # set by hand after loading
    with pytest.raises(ValueError, match=r"generation_config pad_token_id: expected a token id in \[0, 96\), got 500"):
        lm.generate([[5, 6]], max_new_tokens=2)


# -- 2. keys blockpress does not use ------------------------------------------------------------------------------

@pytest.mark.parametrize("gen", [{"temperature": 0.5, "repetition_penalty": 1.2}, {"temperature": 0.0, "do_sample": False}])
def test_generation_config_keys_blockpress_ignores_are_named_at_load(ref_checkpoint, tmp_path, gen):
    """They loaded silently and did nothing: a user believed temperature 0.5 in effect. The reference refuses
    them ("Unexpected kwargs"); blockpress warns, since older folders of its own hold its settings there."""
    path = folder_with(ref_checkpoint, tmp_path, dict(gen, max_new_tokens=8, pad_token_id=0))
    with pytest.raises(ValueError, match="Unexpected kwargs"):
        G.DiffusionGemmaGenerationConfig.from_pretrained(path)
    _, warned = load_recording(path)
    names = ", ".join(sorted(gen))
    assert len(warned) == 1 and f"{path / 'generation_config.json'}: {names}: not blockpress settings" in warned[0]
    assert "draw_temperature" in warned[0] and "t_max down to t_min" in warned[0]  # what to set instead


def test_a_gemma_style_files_top_k_and_top_p_are_said_to_be_read(ref_checkpoint, tmp_path):
    """A Gemma generation_config.json ({"do_sample": true, "top_k": 64, "top_p": 0.95}) holds autoregressive
    settings whose names are SamplerConfig's candidate filters: the warning named do_sample and temperature as
    ignored and said nothing of top_k and top_p, which changed every draw. It says they are read."""
    path = folder_with(ref_checkpoint, tmp_path, {"do_sample": True, "top_k": 64, "top_p": 0.95, "temperature": 1.0})
    lm, warned = load_recording(path)
    assert len(warned) == 2 and "do_sample, temperature: not blockpress settings" in warned[0]
    assert f"{path / 'generation_config.json'}: top_k, top_p: read as blockpress's candidate filters" in warned[1]
    assert (lm.sampler_defaults.top_k, lm.sampler_defaults.top_p) == (64, 0.95)  # (read, as said)
    assert load_recording(folder_with(ref_checkpoint, tmp_path / "own", {"top_k": 64}))[1] == []  # without do_sample
    # blockpress's own file sets them (null: unset): none is read from the Gemma-style file, so nothing is said of it
    path = folder_with(ref_checkpoint, tmp_path / "over", {"do_sample": True, "top_k": 64, "top_p": 0.95},
                       own={"top_k": None, "top_p": 1.0})
    lm, warned = load_recording(path)
    assert (lm.sampler_defaults.top_k, lm.sampler_defaults.top_p) == (0, 1.0)
    assert not any("candidate filters" in w for w in warned)
    lm, _ = load_recording(folder_with(ref_checkpoint, tmp_path / "again", {"do_sample": True, "top_k": 64}))
    lm.save(tmp_path / "saved")  # (its settings move to blockpress's own file: no Gemma-style file is left)
    assert not any("candidate filters" in w for w in load_recording(tmp_path / "saved")[1])


def test_a_key_set_in_lm_generation_config_that_blockpress_does_not_read_is_said_not_saved(tmp_path, recwarn):
    """lm.generation_config["temperature"] = 0.9 (HF's habit) ran greedy as before without a word, and lm.save wrote
    it into blockpress's own file, whose next load warned about it. generate says it once; save leaves it out."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    lm.generation_config.update(temperature=0.9, max_new_token=4, t_min=0.3)  # (a typo; a setting read)
    for _ in range(2):
        lm.generate([3, 4], max_new_tokens=2, max_denoising_steps=2)
    said = [str(w.message) for w in recwarn.list if "lm.generation_config" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("lm.generation_config: max_new_token, temperature: not blockpress "
                                                 "settings, ignored") and "draw_temperature" in said[0], said
    lm.save(tmp_path / "saved")
    assert any(str(w.message).startswith("save: generation_config: max_new_token, temperature: not blockpress "
                                         "settings, left out of ") for w in recwarn.list)
    recwarn.clear()
    again = blockpress.load(tmp_path / "saved")
    assert [str(w.message) for w in recwarn.list] == []
    assert again.generation_config["t_min"] == 0.3 and "temperature" not in again.generation_config
    # a loaded folder's own unread keys were said by load: generate does not say them again
    config = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    (tmp_path / "saved" / "generation_config.json").write_text(json.dumps({**config, "do_sample": True}))
    gemma = blockpress.load(tmp_path / "saved")
    assert [str(w.message).split(": ")[1] for w in recwarn.list] == ["do_sample"]
    recwarn.clear()
    gemma.generate([3, 4], max_new_tokens=2, max_denoising_steps=2)
    assert [str(w.message) for w in recwarn.list] == []
    # given to LM(...) (no load said it), or set on a quantized copy (its own settings): said at its generate
    for other in (blockpress.LM(lm.model, None, {"do_sample": True}), gemma.quantized_copy("int8")):
        other.generation_config["typical_p"] = 0.9
        other.generate([3, 4], max_new_tokens=2, max_denoising_steps=2)
        said = [str(w.message) for w in recwarn.list]
        assert len(said) == 1 and said[0].startswith("lm.generation_config: ") and "typical_p" in said[0], said
        recwarn.clear()
    gemma.generation_config["typical_p"] = 0.9  # (the copy's saying was its own)
    gemma.generate([3, 4], max_new_tokens=2, max_denoising_steps=2)
    assert len(recwarn.list) == 1 and "typical_p" in str(recwarn.list[0].message)


def test_blockpress_own_file_is_checked_too_and_known_keys_pass_quietly(ref_checkpoint, tmp_path):
    path = folder_with(ref_checkpoint, tmp_path, own={"sampler": "greedy", "top_p": 0.9, "typical_p": 0.9})
    _, warned = load_recording(path)
    assert warned == [f"{path / 'blockpress_generation_config.json'}: typical_p: not blockpress settings, ignored (it reads "
                      "max_new_tokens, max_length, eos_token_id, pad_token_id, sampler_config and SamplerConfig's "
                      "fields)"]
    # What the reference saves (nulls, return_dict_in_generate, transformers_version) and what LM.save writes
    assert load_recording(ref_checkpoint[0])[1] == []
    lm = blockpress.load(ref_checkpoint[0])
    lm.generation_config.update(sampler="topk", noise_token_id=5, t_min=0.2, max_length=30)
    lm.save(tmp_path / "saved")
    assert load_recording(tmp_path / "saved")[1] == []
    # The one sampler_config there is loads in both
    path = folder_with(ref_checkpoint, tmp_path / "entropy", {"sampler_config": {
        "_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.25}})
    assert G.DiffusionGemmaGenerationConfig.from_pretrained(path).sampler_config.entropy_bound == 0.25
    lm, warned = load_recording(path)
    assert lm.sampler_defaults.entropy_bound == 0.25 and warned == []


@pytest.mark.parametrize("sampler_config, message", [
    ({"_cls_name": "TopKSamplerConfig", "entropy_bound": 0.2}, "_cls_name 'TopKSamplerConfig' is not a sampler"),
    (0.3, "expected an object .*, got 0.3"),
    ("entropy_bound", "expected an object .*, got 'entropy_bound'"),
    ({"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.2, "top_k": 4}, r"unknown keys \['top_k'\]"),
])
def test_a_sampler_config_blockpress_cannot_run_is_refused_like_the_reference(ref_checkpoint, tmp_path,
                                                                               sampler_config, message):
    """It fell back to the entropy-bound defaults silently; the reference refuses every one of these."""
    path = folder_with(ref_checkpoint, tmp_path, {"sampler_config": sampler_config})
    with pytest.raises((ValueError, TypeError, AttributeError)):
        G.DiffusionGemmaGenerationConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=f"generation_config.json: sampler_config: {message}"):
        load_recording(path)


# -- 3. EOS ids past the vocabulary ---------------------------------------------------------------------------------

@pytest.mark.parametrize("listed, kept", [(500, [EOS]), ([7, 500], [7]), ([96], [EOS])])
def test_eos_ids_past_the_vocabulary_are_dropped_with_a_warning(ref_checkpoint, tmp_path, listed, kept):
    """generate(min_new_tokens=2) and generate_ar crashed with a bare IndexError (banning EOS indexed past the
    logits). The reference loads such an id and never meets it, so blockpress drops it, and says so."""
    path = folder_with(ref_checkpoint, tmp_path, {"eos_token_id": listed})
    reference = G.DiffusionGemmaGenerationConfig.from_pretrained(path)
    assert reference.eos_token_id == listed  # tolerated there
    lm, warned = load_recording(path)
    bad = [i for i in (listed if isinstance(listed, list) else [listed]) if i >= VOCAB]
    assert len(warned) == 1
    assert f"generation_config.json: eos_token_id: {bad} at or above the vocabulary size 96" in warned[0]
    assert ("model's own EOS ids" in warned[0]) == (kept == [EOS])  # nothing left: config.json's EOS ends rows
    assert lm._eos_ids() == kept
    out = lm.generate([[5, 6, 7]], max_new_tokens=4, min_new_tokens=2, max_denoising_steps=2, seed=0)
    assert out.new_tokens.shape == (1, 4) and kept[0] not in out.new_tokens[0, :2].tolist()
    assert lm.generate_ar([[5, 6, 7]], max_new_tokens=3, min_new_tokens=2).new_tokens.shape == (1, 3)


def test_an_eos_id_past_the_vocabulary_set_by_hand_is_named(ref_checkpoint):
    lm = blockpress.LM(blockpress.load(ref_checkpoint[0]).model, None, {"eos_token_id": [1, 500]})
    for call in (lambda: lm.generate([[5, 6]], max_new_tokens=4, min_new_tokens=2),
                 lambda: lm.generate_ar([[5, 6]], max_new_tokens=4, min_new_tokens=2)):
        with pytest.raises(ValueError, match=r"generation_config eos_token_id: expected token ids in \[0, 96\) "
                                             r"\(the vocabulary\), got 500"):
            call()


# -- 4. max_length -------------------------------------------------------------------------------------------------

def test_default_max_new_tokens_says_what_max_length_allows(ref_checkpoint):
    """With max_length 20 and no max_new_tokens, `info` said 256; generate gives 20 less the prompt, at most 19."""
    model = blockpress.load(ref_checkpoint[0]).model
    lm = blockpress.LM(model, None, {"max_length": 20, "max_denoising_steps": 2})
    assert lm.default_max_new_tokens == 19
    assert lm.generate([[5]], seed=0).new_tokens.shape == (1, 19)
    assert lm.generate([[5, 6, 7]], seed=0).new_tokens.shape == (1, 17)
    assert blockpress.LM(model, None, {"max_length": 1}).default_max_new_tokens == 0  # no prompt leaves room
    assert blockpress.LM(model, None, {"max_length": 20, "max_new_tokens": 5}).default_max_new_tokens == 5
    assert blockpress.LM(model, None, {}).default_max_new_tokens == 256


# -- 5. attention_mask with prompts blockpress pads itself ------------------------------------------------------------

def test_a_mask_with_ragged_rows_is_refused(ref_checkpoint):
    """Rows were left-padded first and the mask, shaped like the result, then applied: row 1 became two pads."""
    lm = blockpress.LM(blockpress.load(ref_checkpoint[0]).model)
    with pytest.raises(ValueError, match=r"attention_mask: not with id rows of different lengths \[4, 2\]"):
        lm.generate([[2, 51, 29, 13], [2, 51]], attention_mask=[[1, 1, 1, 1], [1, 1, 0, 0]], max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="attention_mask: not with id rows of different lengths"):
        lm.generate_ar([[2, 51, 29, 13], [2, 51]], attention_mask=[[1, 1, 1, 1], [1, 1, 0, 0]], max_new_tokens=4)
    # Equal-length rows (a list or a tensor) with their mask still work, and read as the same prompt
    ids, mask = [[0, 0, 2, 51], [2, 51, 29, 13]], [[0, 0, 1, 1], [1, 1, 1, 1]]
    listed = lm.generate(ids, attention_mask=mask, max_new_tokens=4, max_denoising_steps=2, seed=0)
    tensor = lm.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=4,
                         max_denoising_steps=2, seed=0)
    ragged = lm.generate([[2, 51], [2, 51, 29, 13]], max_new_tokens=4, max_denoising_steps=2, seed=0)
    assert torch.equal(listed.new_tokens, tensor.new_tokens) and torch.equal(listed.new_tokens, ragged.new_tokens)


@pytest.mark.skipif("blockpress-code" not in blockpress.shipped_models(), reason="needs blockpress-code's tokenizer")
def test_a_mask_with_text_prompts_is_refused(ref_checkpoint):
    """Texts are tokenized (BOS first) and padded by blockpress: a mask could only match their shape by chance."""
    tokenizer = Tokenizer.from_dir(resolve_path("blockpress-code"))
    lm = blockpress.LM(blockpress.load(ref_checkpoint[0]).model, tokenizer)
    width = len(tokenizer.encode_prompt("x"))
    for prompt, mask in (("x", [[1] * width]), (["x", "x"], [[1] * width] * 2)):
        with pytest.raises(ValueError, match="attention_mask: not with text prompts"):
            lm.generate(prompt, attention_mask=mask, max_new_tokens=4)


def test_eos_ids_are_public_and_read_only(ref_checkpoint, tmp_path):
    """The set of ids that end a row had only a private spelling (`_eos_ids()`), which the server and the
    trainer read; `eos_ids` is the public one, a copy that cannot change the model's."""
    lm, _ = load_recording(folder_with(ref_checkpoint, tmp_path, own={"eos_token_id": [EOS, 7]}))
    assert lm.eos_ids == lm._eos_ids() == [EOS, 7]
    lm.eos_ids.append(9)
    assert lm.eos_ids == [EOS, 7]
    with pytest.raises(AttributeError):
        lm.eos_ids = [3]
    lm.generation_config["eos_token_id"] = 5
    assert lm.eos_ids == [5]
