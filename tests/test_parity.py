"""blockpress logits against the reference transformers implementation (the oracle), float32."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import one_attention_kernel

import blockpress
from blockpress.config import ACTIVATIONS

pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def lm(ref_checkpoint):
    path, _ = ref_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return blockpress.load(path)


def ref_logits(model, prompt, canvas, sc=None, **kw):
    with torch.no_grad():
        return model(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc, **kw).logits


def ids(g, *shape, vocab=96):
    return torch.randint(0, vocab, shape, generator=g)


def test_short_prompt(lm, ref_checkpoint):
    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(1)
    prompt, canvas = ids(g, 2, 3), ids(g, 2, 8)
    diff = (lm.logits(prompt, canvas) - ref_logits(ref, prompt, canvas)).abs().max().item()
    print(f"short prompt max|diff| = {diff:.2e}")
    assert diff <= TOL


def test_prompt_longer_than_sliding_window(lm, ref_checkpoint):
    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(2)
    prompt, canvas = ids(g, 2, 23), ids(g, 2, 8)  # window is 6
    diff = (lm.logits(prompt, canvas) - ref_logits(ref, prompt, canvas)).abs().max().item()
    print(f"long prompt max|diff| = {diff:.2e}")
    assert diff <= TOL


@one_attention_kernel
def test_one_pass_is_the_references_bit_for_bit_on_one_thread(ref_checkpoint):
    """float32, one thread, the weights aligned as the reference's are: encoder and decoder passes give the reference's
    logits to the last bit (every op rounds as the reference's does). One-row batches, where the experts' groups are
    small: there a mapped, 4-byte aligned weight rounded differently (~1e-6, which self-conditioning grows)."""
    from reference import fresh_weights

    path, ref = ref_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = fresh_weights(blockpress.load(path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for seed in range(12):
            g = torch.Generator().manual_seed(seed)
            prompt, canvas = ids(g, 1, (3, 9, 23)[seed % 3]), ids(g, 1, 8)  # window 6: shorter and longer
            sc = None if seed % 4 == 0 else (1 + seed % 7) * torch.randn(1, 8, 96, generator=g)
            assert torch.equal(lm.logits(prompt, canvas, sc), ref_logits(ref, prompt, canvas, sc)), f"seed {seed}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("start, end, sliding_from", [(0, 300, 0), (40, 300, 35), (0, 1, 0)])
def test_encoder_masks_make_nothing_wider_than_a_bool_per_pair(lm, start, end, sliding_from):
    """The sliding mask was built from `slots - keys`, an int64 [P, P]: a 100k-token prompt died on an 80 GB
    allocation. Nothing quadratic may be wider than the bool mask now (whose values the test above checks against
    the reference, window 6 under a 23-token prompt)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor))
            return out

    with Record():
        masks = lm.model.causal_masks(start, end, sliding_from, None)
    pairs = (end - start) * (end - sliding_from)
    wide = [(t.dtype, tuple(t.shape)) for t in made if t.numel() >= pairs > 1 and t.element_size() > 1]
    assert not wide
    slots, keys = torch.arange(start, end)[:, None], torch.arange(sliding_from, end)[None, :]
    want = (keys <= slots) & (slots - keys < lm.config.text.sliding_window)
    assert masks["sliding_attention"] is None if end - start == 1 else torch.equal(masks["sliding_attention"][0, 0], want)


def test_self_conditioning_logits(lm, ref_checkpoint):
    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(3)
    prompt, canvas = ids(g, 2, 9), ids(g, 2, 8)
    sc = 3 * torch.randn(2, 8, 96, generator=g)
    ours = lm.logits(prompt, canvas, self_conditioning_logits=sc)
    diff = (ours - ref_logits(ref, prompt, canvas, sc)).abs().max().item()
    print(f"self-conditioning max|diff| = {diff:.2e}")
    assert diff <= TOL
    # and self-conditioning really changes the output (the wiring is exercised)
    assert (ours - lm.logits(prompt, canvas)).abs().max() > 1e-2
    # the decoding loop hands over probabilities it already has: the same logits
    cache = lm.new_cache(2, 9 + 8)
    with torch.no_grad():
        lm.model.encode(prompt, cache)
        via_probs = lm.model.denoise(canvas, cache, self_conditioning_probs=torch.softmax(sc, -1))
    assert (via_probs - ours).abs().max().item() <= 1e-5
    # with neither to embed, refused by name (torch.softmax(None) raised a TypeError naming no argument)
    with pytest.raises(ValueError, match="soft_embedding: expected logits or probs"):
        lm.model.soft_embedding()


def test_self_conditioning_mask(lm, ref_checkpoint):
    """The reference's forward takes a per-row self_conditioning_mask (training drops self-conditioning for some
    rows); lm.logits takes it too, so a training step can be checked against the reference without a hand-built
    cache."""
    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(4)
    prompt, canvas = ids(g, 3, 7), ids(g, 3, 8)
    sc = 3 * torch.randn(3, 8, 96, generator=g)
    mask = torch.tensor([True, False, True])
    ours = lm.logits(prompt, canvas, self_conditioning_logits=sc, self_conditioning_mask=mask)
    assert (ours - ref_logits(ref, prompt, canvas, sc, self_conditioning_mask=mask)).abs().max().item() <= TOL
    # the masked row is the row without self-conditioning, the others keep theirs
    assert (ours[1] - lm.logits(prompt[1:2], canvas[1:2])[0]).abs().max().item() <= TOL
    assert (ours[0] - lm.logits(prompt[:1], canvas[:1], self_conditioning_logits=sc[:1])[0]).abs().max() <= TOL
    # not a tensor at all: torch.as_tensor's RuntimeError ('Could not infer dtype of dict') named no argument
    for bad in (torch.tensor([1, 0, 1]), torch.tensor([True, False]), [True, None, True], {"rows": 3}, object()):
        with pytest.raises(ValueError, match=r"self_conditioning_mask: expected a bool tensor of shape \[3\] "
                                              r"\(one flag per canvas row\), got \w"):
            lm.logits(prompt, canvas, self_conditioning_logits=sc, self_conditioning_mask=bad)
    with pytest.raises(ValueError, match="self_conditioning_mask: says which rows"):
        lm.logits(prompt, canvas, self_conditioning_mask=mask)


def test_canvas_after_committed_canvases(lm, ref_checkpoint):
    """Prompt, then two committed canvases encoded one at a time, then a canvas denoised."""
    from transformers import DynamicCache

    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(4)
    prompt, c1, c2, canvas = ids(g, 1, 5), ids(g, 1, 8), ids(g, 1, 8), ids(g, 1, 8)
    with torch.no_grad():
        cache = DynamicCache(config=ref.config.get_text_config())
        for part in (prompt, c1, c2):
            ref.model.encoder(input_ids=part, cache=cache)
        expected = ref(decoder_input_ids=canvas, cache=cache).logits
    cache = lm.new_cache(1, 5 + 16 + 8)
    for part in (prompt, c1, c2):
        lm.model.encode(part, cache)
    with torch.no_grad():
        ours = lm.model.denoise(canvas, cache)
    diff = (ours - expected).abs().max().item()
    print(f"after canvases max|diff| = {diff:.2e}")
    assert diff <= TOL
    # encoding everything at once gives the same
    whole = lm.logits(torch.cat([prompt, c1, c2], 1), canvas)
    assert (whole - ours).abs().max().item() <= TOL


def left_padded(rows):
    """Rows of ids of different lengths as one left-padded batch: (ids [B, P], attention mask [B, P] of 0/1)."""
    width = max(len(r) for r in rows)
    prompt = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        prompt[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return prompt, mask


def test_left_padded_batch(lm, ref_checkpoint):
    """Prompts of different lengths, left padded: each row equals the same prompt run alone."""
    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(5)
    lengths = [3, 11, 7]
    rows = [ids(g, n) for n in lengths]
    prompt, mask = left_padded(rows)
    canvas = ids(g, 3, 8)
    ours = lm.logits(prompt, canvas, attention_mask=mask)
    # oracle 1: each row alone through the reference
    worst = 0.0
    for i, r in enumerate(rows):
        alone = ref_logits(ref, r[None], canvas[i : i + 1])
        worst = max(worst, (ours[i] - alone[0]).abs().max().item())
    # oracle 2: the padded batch through the reference, with explicit positions and decoder mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    dec_pos = pos[:, -1:] + 1 + torch.arange(8)[None]
    batched = ref_logits(
        ref, prompt, canvas, attention_mask=mask, position_ids=pos, decoder_position_ids=dec_pos,
        decoder_attention_mask=torch.cat([mask, torch.ones(3, 8, dtype=torch.long)], 1),
    )
    worst_batched = (ours - batched).abs().max().item()
    print(f"left-padded max|diff| alone = {worst:.2e}, batched = {worst_batched:.2e}")
    assert worst <= TOL and worst_batched <= TOL


@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_chunked_prefill_matches_reference(lm, ref_checkpoint, chunk):
    """A left-padded batch encoded `chunk` queries at a time (window 6: chunks shorter and longer than it),
    then a canvas: each row as the reference computes it alone."""
    _, ref = ref_checkpoint
    g = torch.Generator().manual_seed(6)
    lengths = [3, 23, 14]
    rows = [ids(g, n) for n in lengths]
    prompt, mask = left_padded(rows)
    width = prompt.shape[1]
    canvas = ids(g, 3, 8)
    cache = lm.new_cache(3, width + 8)
    with torch.no_grad():
        lm.model.encode(prompt, cache, attention_mask=mask, chunk_size=chunk)
        ours = lm.model.denoise(canvas, cache)
    worst = max((ours[i] - ref_logits(ref, r[None], canvas[i : i + 1])[0]).abs().max().item()
                for i, r in enumerate(rows))
    print(f"chunked prefill ({chunk}) max|diff| = {worst:.2e}")
    assert worst <= TOL


def test_bf16_matches_reference_in_bf16(ref_checkpoint):
    """Both engines in bfloat16 on 16 inputs: blockpress's mean error against the float32 reference within 1.25x the
    reference's own bf16 one (bf16 logits scaled by 1.1 come to 1.37x). The largest difference of one input, checked
    against half the reference's spread, was luck (on random weights one ulp grows to several logits either way):
    seed 6 passed it under torch 2.13 and not under 2.6 (5.6 against 2.6), seeds 2, 3, 4, 9 and 10 failed it under
    2.13; these means stay within 0.89x to 1.18x of the reference's under both (seeds 6 to 9)."""
    import copy

    path, ref = ref_checkpoint
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm16 = blockpress.load(path, dtype="bfloat16")
    assert lm16.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(6)
    prompt, canvas = ids(g, 16, 10), ids(g, 16, 8)
    ours = lm16.logits(prompt, canvas)
    expected = ref_logits(ref16, prompt, canvas).float()
    fp32 = ref_logits(ref, prompt, canvas)
    error = (ours - fp32).abs().mean().item()
    spread = (expected - fp32).abs().mean().item()
    print(f"bf16 mean|error| vs reference fp32 = {error:.3f} (reference bf16: {spread:.3f})")
    assert ours.dtype == torch.float32
    assert error <= 1.25 * spread


def test_a_checkpoint_with_ten_layers_or_more(tmp_path):
    """transformers saves per_layer_config keys zero-padded to the widest index ("05" of 12 layers, as the
    released 30-layer model's "05"... "29"); they name the same layers (before: the full layers took the
    sliding shape and the config was refused)."""
    import json

    from reference import make_reference

    kinds = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    ref = make_reference(tmp_path, seed=3, num_hidden_layers=12, layer_types=kinds)
    keys = sorted(json.loads((tmp_path / "config.json").read_text())["text_config"]["per_layer_config"])
    assert keys == ["05", "11"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(tmp_path)
    assert [s.head_dim for s in lm.config.text.layers] == [8] * 5 + [16] + [8] * 5 + [16]
    g = torch.Generator().manual_seed(7)
    prompt, canvas = ids(g, 1, 9), ids(g, 1, 8)
    assert (lm.logits(prompt, canvas) - ref_logits(ref, prompt, canvas)).abs().max().item() <= TOL


@pytest.mark.parametrize("overrides", [
    # position interpolation on the full layers, and a tanh-GELU under another of transformers' names
    dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                          "full_attention": {"rope_type": "linear", "factor": 2.5, "rope_theta": 1_000_000.0}}),
    dict(hidden_activation="gelu_new"),
    # activations other than the tanh GELU: the dense MLP, the experts and self-conditioning all take it
    dict(hidden_activation="gelu"),
    dict(hidden_activation="silu"),
    # Llama 3.1 scaling on the sliding layers (head_dim 8 with an original context of 8: one frequency blended, the
    # others interpolated)
    dict(rope_parameters={"sliding_attention": {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 4.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8},
                          "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                             "rope_theta": 1_000_000.0}}),
    # YaRN: its attention factor derived from factor, then from the mscales, then given. `truncate: false` is
    # ignored by the reference for this model (it reads the flag beside the layer types): the ramp is rounded anyway
    dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                          "full_attention": {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 16, "truncate": False}}),
    dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 2.0,
                                                "original_max_position_embeddings": 8, "beta_fast": 4,
                                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
                          "full_attention": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0,
                                             "original_max_position_embeddings": 4, "attention_factor": 0.9}}),
    # Each was refused, though the reference builds and runs it: yarn's null factor (max_position_embeddings over the
    # original context, 256 / 16), a whole-number original context written as a float, a proportional layer that
    # rotates no angle, and Llama 3.1's scaling with no band between its two factors
    dict(rope_parameters={"sliding_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.0,
                                                "rope_theta": 10_000.0},
                          "full_attention": {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": None,
                                             "original_max_position_embeddings": 16.0}}),
    dict(rope_parameters={"sliding_attention": {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 4.0,
                                                "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                                                "original_max_position_embeddings": 8},
                          "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
    # dynamic NTK on both kinds, the prompt and canvas filling the whole context (31 = 23 + 8): the reference only
    # rescales past it
    dict(max_position_embeddings=31,
         rope_parameters={"sliding_attention": {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0},
                          "full_attention": {"rope_type": "dynamic", "rope_theta": 1_000_000.0, "factor": 3.0}}),
])
def test_other_configs_the_reference_runs(tmp_path, overrides):
    from reference import make_reference

    ref = make_reference(tmp_path, seed=4, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(tmp_path)
    rotary = ref.model.decoder.rotary_emb  # the tables the reference computed, compared first: a clearer failure
    for kind in set(lm.config.text.layer_types):
        torch.testing.assert_close(getattr(lm.model, f"inv_freq_{kind}"), getattr(rotary, f"{kind}_inv_freq"))
        assert lm.model.rope_scaling[kind] == getattr(rotary, f"{kind}_attention_scaling")
    g = torch.Generator().manual_seed(8)
    prompt, canvas = ids(g, 2, 23), ids(g, 2, 8)  # longer than the window (6) and the original contexts above
    sc = 3 * torch.randn(2, 8, 96, generator=g)
    assert (lm.logits(prompt, canvas, self_conditioning_logits=sc) - ref_logits(ref, prompt, canvas, sc)).abs().max().item() <= TOL


def _legacy_type(text):  # a rope type spelled `type`, as older configs write it
    text["rope_parameters"]["full_attention"] = {"type": "linear", "factor": 4.0, "rope_theta": 1e6}


def _legacy_scaling(text):  # rope_parameters under its older name, which wins over rope_parameters
    text["rope_scaling"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                            "full_attention": {"type": "yarn", "factor": 2.0, "rope_theta": 70.0,
                                               "original_max_position_embeddings": 8}}


def _legacy_factor(text):  # a top-level partial_rotary_factor, copied into the entries that name none
    text["partial_rotary_factor"] = 0.5
    text["rope_parameters"] = {"sliding_attention": {"rope_type": "proportional", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                  "partial_rotary_factor": 0.25}}


def _ignored_factor(text):  # beside default entries only: the reference builds no partial rope, nor does blockpress
    text["partial_rotary_factor"] = 0.5
    text["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1e6}}


def _factor_of_the_kinds_used(text):  # a sliding entry of a model without sliding layers takes no part
    assert set(text["layer_types"]) == {"full_attention"}  # (made so: see the test)
    text["partial_rotary_factor"] = 0.5
    text["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}


@pytest.mark.parametrize("edit", [_legacy_type, _legacy_scaling, _legacy_factor, _ignored_factor,
                                  _factor_of_the_kinds_used])
def test_older_rope_spellings_read_as_the_reference_reads_them(tmp_path, edit):
    """config.json's older rope keys that transformers still reads: each ran default rope, unscaled and whole, with
    nothing said (or "unknown field, ignored"), the logits 5-10 away from the reference's."""
    import json

    from reference import make_reference
    from transformers import DiffusionGemmaForBlockDiffusion

    full = ["full_attention"] * 4 if edit is _factor_of_the_kinds_used else None
    make_reference(tmp_path, seed=3, **({"num_hidden_layers": 4, "layer_types": full} if full else {}))
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path).eval()
        lm = blockpress.load(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompt, canvas = ids(g, 1, 11), ids(g, 1, 8)
    assert (lm.logits(prompt, canvas) - ref_logits(ref, prompt, canvas)).abs().max().item() <= TOL
    lm.save(tmp_path / "saved")  # written in today's spelling, which both read the same way
    again = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "saved").eval()
    assert (lm.logits(prompt, canvas) - ref_logits(again, prompt, canvas)).abs().max().item() <= TOL


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.update(rope_scaling=None), "text_config.rope_scaling: expected the rope settings by layer type"),
    (lambda t: t.update(rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "text_config.rope_scaling: expected the rope settings by layer type"),
    # a default entry would get the factor: the reference's rope table is then too short for its heads
    (lambda t: t.update(partial_rotary_factor=0.5),
     "text_config.partial_rotary_factor: .* the sliding_attention entry's rope_type 'default' takes no partial"),
    (lambda t: t.update(partial_rotary_factor="0.5"),
     r"text_config.partial_rotary_factor: expected a fraction in \[0, 1\], got '0.5'$"),
    (lambda t: t.update(partial_rotary_factor=1.5),
     r"text_config.partial_rotary_factor: expected a fraction in \[0, 1\], got 1.5$"),
])
def test_older_rope_spellings_the_reference_cannot_run_are_refused_by_name(tmp_path, edit, match):
    import json

    from reference import make_reference

    make_reference(tmp_path, seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        blockpress.load(tmp_path)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_every_activation_is_the_references(name, seed, scale):
    """Each hidden_activation name blockpress accepts computes what transformers' ACT2FN computes under that name."""
    from transformers.activations import ACT2FN

    from blockpress.model import ACTIVATION_FUNCTIONS

    x = scale * torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(ACTIVATION_FUNCTIONS[ACTIVATIONS[name]](x), ACT2FN[name](x))


def test_attention_biases(tmp_path):
    """attention_bias: true gives the q, k, v and o projections a bias in the reference (a full layer's values are
    its biased key projection), and the encoder's biases are not tied to the decoder's (make_reference draws them
    apart): blockpress reads both sets under the reference's names and adds each on its side."""
    from reference import make_reference
    from safetensors import safe_open

    from blockpress.checkpoint import local_to_hf

    ref = make_reference(tmp_path, seed=5, attention_bias=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = {k for k in f.keys() if k.endswith(".bias")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(tmp_path)
    ours = {local_to_hf(k) for k in lm.model.state_dict() if "bias." in k}
    assert ours == stored and {k.split(".")[1] for k in ours} == {"decoder", "encoder"}
    assert any(".v_proj." in k for k in ours) and any(".o_proj." in k for k in ours)
    g = torch.Generator().manual_seed(9)
    prompt, canvas = ids(g, 2, 23), ids(g, 2, 8)  # longer than the window of 6
    sc = 3 * torch.randn(2, 8, 96, generator=g)
    for kw in ({}, {"self_conditioning_logits": sc}):
        expected = ref_logits(ref, prompt, canvas, kw.get("self_conditioning_logits"))
        assert (lm.logits(prompt, canvas, **kw) - expected).abs().max().item() <= TOL


def test_the_reference_cannot_run_a_bidirectional_encoder(tmp_path):
    """blockpress refuses use_bidirectional_attention: "all" because the reference's own forward fails on it. When a
    transformers release runs it, this fails: then support it (a bidirectional encoder, its window halved plus one,
    as the reference's config derives it) and check it here instead."""
    from reference import make_reference

    ref = make_reference(tmp_path, seed=6, use_bidirectional_attention="all")
    g = torch.Generator().manual_seed(10)
    with pytest.raises(TypeError, match="is_causal"):
        ref_logits(ref, ids(g, 1, 9), ids(g, 1, 8))


# -- the whole space of configs the reference accepts --------------------------------------------------------------
# Every text_config field that changes the maths or the weights' layout, drawn together: the layer pattern (any mix,
# a sliding last layer forced to full), heads against kv heads and the full layers' own head_dim and kv heads (odd
# sizes and a zero-width rotary slice included), experts and top-k, every activation kind, norms' eps, softcapping,
# attention biases, vocab sizes that are multiples of nothing, token ids, and each rope type on either kind.
def _rope(draw, head_dim):
    kind = draw(st.sampled_from(["default", "proportional", "linear", "llama3", "yarn"]
                                + (["dynamic"] if head_dim > 2 else [])))  # dynamic raises to hd / (hd - 2)
    rope = {"rope_type": kind, "rope_theta": draw(st.sampled_from([100.0, 10_000.0, 1_000_000.0]))}
    if kind == "proportional":
        rope["partial_rotary_factor"] = draw(st.sampled_from([0.25, 0.5, 1.0]))
    elif kind in ("linear", "dynamic"):
        rope["factor"] = draw(st.sampled_from([0.5, 2.0, 8.0] if kind == "linear" else [2.0, 4.0]))
    elif kind == "llama3":
        rope.update(factor=draw(st.sampled_from([2.0, 8.0])), low_freq_factor=1.0,
                    high_freq_factor=draw(st.sampled_from([2.0, 4.0])),
                    original_max_position_embeddings=draw(st.sampled_from([4, 8, 64])))
    elif kind == "yarn":
        rope.update(factor=draw(st.sampled_from([2.0, 4.0])),
                    original_max_position_embeddings=draw(st.sampled_from([4, 8, 64])))
        if draw(st.booleans()):
            rope["attention_factor"] = draw(st.sampled_from([0.5, 1.2]))
        if draw(st.booleans()):
            rope.update(beta_fast=draw(st.sampled_from([8, 32])), beta_slow=draw(st.sampled_from([1, 2])))
    return rope


@st.composite
def reference_configs(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    divisors = [d for d in (1, 2, 3, 4) if heads % d == 0]
    n = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=n, max_size=n))
    experts = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([3, 37, 96, 101]))
    text = dict(
        vocab_size=vocab, hidden_size=draw(st.sampled_from([8, 12, 24, 32])),
        intermediate_size=draw(st.sampled_from([4, 12, 40])), num_hidden_layers=n, layer_types=kinds,
        num_attention_heads=heads, num_key_value_heads=draw(st.sampled_from(divisors)),
        head_dim=draw(st.sampled_from([2, 4, 6, 8])), global_head_dim=draw(st.sampled_from([2, 4, 12, 16])),
        num_global_key_value_heads=draw(st.sampled_from([None, *divisors])),
        sliding_window=draw(st.sampled_from([2, 3, 6, 9])), num_experts=experts,
        top_k_experts=draw(st.integers(1, experts)), moe_intermediate_size=draw(st.sampled_from([2, 6, 16])),
        hidden_activation=draw(st.sampled_from(["gelu_pytorch_tanh", "gelu", "silu", "relu"])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-3, 0.5])), attention_bias=draw(st.booleans()),
        final_logit_softcapping=draw(st.sampled_from([2.0, 30.0, 100.0])),
        pad_token_id=draw(st.sampled_from([0, vocab - 1, None])), bos_token_id=draw(st.sampled_from([2, None])),
        eos_token_id=draw(st.sampled_from([1, [1, 2], None])),
    )
    sliding_dim, full_dim = text["head_dim"], text["global_head_dim"]
    if draw(st.booleans()):
        # per_layer_config as written out, instead of derived from global_head_dim: any entry for the sliding layers
        # too, each kind's layers sharing one (the reference refuses to build them otherwise)
        sliding = draw(st.sampled_from([{}, {"num_key_value_heads": divisors[0]}, {"head_dim": 4},
                                        {"head_dim": 6, "num_key_value_heads": divisors[-1]}]))
        full = {"head_dim": full_dim, **({} if text["num_global_key_value_heads"] is None else
                                         {"num_key_value_heads": text["num_global_key_value_heads"]})}
        kinds = [*kinds[:-1], "full_attention"]  # the reference forces the last layer full before reading these
        text["per_layer_config"] = {i: dict(sliding if k == "sliding_attention" else full) for i, k in enumerate(kinds)}
        text["per_layer_config"] = {i: v for i, v in text["per_layer_config"].items() if v}
        sliding_dim = sliding.get("head_dim", sliding_dim)
    if draw(st.booleans()):
        text["rope_parameters"] = {"sliding_attention": _rope(draw, sliding_dim),
                                   "full_attention": _rope(draw, full_dim)}
        # the longest prompt and canvas (16 + 8) fit: blockpress refuses what runs past the context
        text["max_position_embeddings"] = draw(st.sampled_from([24, 64]))
    return text, draw(st.sampled_from([4, 8]))


@settings(max_examples=4, deadline=None)  # 2-6 s each on a loaded 2-core machine
@given(drawn=reference_configs(), seed=st.integers(0, 2**16))
def test_random_configs_the_reference_accepts(tmp_path_factory, drawn, seed):
    """Any config the reference builds: its checkpoint loads with no warning (but the vision tower's, kept for
    saving), its logits are the reference's with and without self-conditioning, under a prompt shorter and one
    longer than the window, and `lm.save` writes a folder the reference loads to the same weights and config."""
    from reference import make_reference
    from transformers import DiffusionGemmaForBlockDiffusion

    text, canvas_length = drawn
    path = tmp_path_factory.mktemp("drawn")
    ref = make_reference(path / "ref", seed=seed, canvas_length=canvas_length, **text)
    if text["hidden_size"] % 4 or text["moe_intermediate_size"] % 4:
        # transformers' default experts (torch's grouped_mm) refuse a float32 stride that is not a multiple of 16
        # bytes: a limit of the reference's kernel (blockpress runs these); its eager experts compute the same
        ref.set_experts_implementation("eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = blockpress.load(path / "ref")
    assert [str(w.message) for w in caught if "vision tensors ignored" not in str(w.message)] == []
    vocab, window = text["vocab_size"], text["sliding_window"]
    g = torch.Generator().manual_seed(seed)
    for length in (3, window + 7):
        prompt, canvas = ids(g, 2, length, vocab=vocab), ids(g, 2, canvas_length, vocab=vocab)
        for sc in (None, 3 * torch.randn(2, canvas_length, vocab, generator=g)):
            diff = (lm.logits(prompt, canvas, sc) - ref_logits(ref, prompt, canvas, sc)).abs().max().item()
            assert diff <= TOL, (length, sc is not None, diff)
    lm.save(path / "saved")
    back = DiffusionGemmaForBlockDiffusion.from_pretrained(path / "saved")
    want, got = ref.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    # the text config the reference reads back: the same but for the dtype it now names, and the softcapping,
    # a class default the reference does not write and blockpress does
    skip = ("dtype", "final_logit_softcapping", "transformers_version")
    config, config_back = (dict(c.text_config.to_dict()) for c in (ref.config, back.config))
    assert {k: v for k, v in config_back.items() if k not in skip} == {k: v for k, v in config.items() if k not in skip}
    assert back.config.text_config.final_logit_softcapping == ref.config.text_config.final_logit_softcapping
    assert back.config.canvas_length == canvas_length


@pytest.mark.parametrize("top, text, field", [
    ({}, dict(hidden_activation="xielu"), "text_config.hidden_activation: 'xielu' is not supported"),
    ({}, dict(use_bidirectional_attention="all"), "text_config.use_bidirectional_attention: 'all' is not supported"),
    # the reference unties every weight then: an encoder and an LM head of their own, which blockpress cannot run
    (dict(tie_word_embeddings=False), {}, "tie_word_embeddings is false and .* differs from"),
])
def test_configs_the_reference_accepts_and_blockpress_does_not_are_refused_by_field(tmp_path, top, text, field):
    """A checkpoint the reference builds and saves, with a field blockpress does not support: refused on load,
    naming the field (never loaded with the field ignored)."""
    from reference import TINY_TEXT, TINY_VISION
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    config = DiffusionGemmaConfig(text_config=dict(TINY_TEXT, **text), vision_config=dict(TINY_VISION),
                                  canvas_length=8, **top)
    DiffusionGemmaForBlockDiffusion(config).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=field):
            blockpress.load(tmp_path)
