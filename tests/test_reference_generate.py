"""Whole generations against the reference's own `generate` (the oracle), float32.

The reference draws its randomness from torch's global generator; blockpress from counter-based hashes of
(seed, canvas, step). To compare the two decoding loops, the reference's three random calls (the starting canvas,
the re-noising of rejected positions, the multinomial draw) are routed to blockpress's draws for the same
canvas and step; everything else (temperature schedule, acceptance, self-conditioning, adaptive stopping,
committing, padding after EOS) is the reference's own code.

One thread, low temperatures, blockpress's weights aligned as the reference's (`fresh_weights`): self-conditioning
feeds each step's softmax into the next pass, so two correct implementations whose GEMMs round differently
(multi-threaded, differently shaped, or reading differently aligned weights) drift apart by ~2x a step (5e-6 to
7e-3 over ten steps at two threads on this tiny random model) and a draw near a CDF boundary can then flip. On one
thread, with the weights aligned alike, the two passes agree to the bit, so the tokens must be equal.
"""

import warnings

import pytest
import torch
from reference import one_attention_kernel

import blockpress
from blockpress.sampling import hashed_tokens, hashed_uniforms, sample

G = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from reference import fresh_weights, make_reference

    path = tmp_path_factory.mktemp("refgen")
    ref = make_reference(path, seed=5, sliding_window=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ref, fresh_weights(blockpress.load(path))


def reference_generate(monkeypatch, ref, prompt: torch.Tensor, seed: int, steps: int, **kwargs) -> torch.Tensor:
    """The reference's generate, drawing blockpress's random numbers; returns its new tokens. EOS 1 and pad 0
    unless `kwargs` name others."""
    seeds = torch.full((prompt.shape[0],), seed, dtype=torch.long)
    at = {"canvas": -1, "step": steps + 1}  # blockpress numbers the starting canvas's draw as step N + 1
    prepare = G.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs
    schedule = G.LinearTemperatureScheduleLogitsProcessor.__call__

    def new_canvas(*args, **kw):
        at["canvas"] += 1
        at["step"] = steps + 1
        return prepare(*args, **kw)

    def scheduled(self, input_ids, scores, cur_step):
        at["step"] = int(cur_step)
        return schedule(self, input_ids, scores, cur_step)

    def noise(self, batch_size, device):
        return hashed_tokens(seeds[:batch_size], at["canvas"], at["step"], self.canvas_length, self.vocab_size)

    def multinomial(probs, num_samples=1, **kw):
        uniforms = hashed_uniforms(seeds, at["canvas"], at["step"], probs.shape[0] // len(seeds))
        return sample(probs, uniforms.reshape(-1))[:, None]

    monkeypatch.setattr(G.DiffusionGemmaGenerationMixin, "_prepare_denoiser_inputs", new_canvas)
    monkeypatch.setattr(G.LinearTemperatureScheduleLogitsProcessor, "__call__", scheduled)
    monkeypatch.setattr(G.EntropyBoundSampler, "initialize_canvas", noise)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    with torch.no_grad():
        out = ref.generate(prompt, max_denoising_steps=steps, **{"eos_token_id": 1, "pad_token_id": 0, **kwargs})
    monkeypatch.undo()
    return out.sequences[:, prompt.shape[1]:]


def both_engines(monkeypatch, models, seed: int, steps: int, t_max: float, t_min: float,
                 stability: int | None = None, threshold: float | None = None):
    """(the reference's new tokens, blockpress's output) for one 2-row batch; no stopping rule when
    `stability` is None."""
    ref, lm = models
    prompt = torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(seed))
    want = reference_generate(monkeypatch, ref, prompt, seed, steps, max_new_tokens=16, t_max=t_max, t_min=t_min,
                              sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=0.1),
                              stability_threshold=stability, confidence_threshold=threshold)
    stopping = (dict(adaptive_stopping=False) if stability is None
                else dict(stability_threshold=stability, confidence_threshold=threshold))
    got = lm.generate(prompt, max_new_tokens=16, max_denoising_steps=steps, seed=seed, entropy_bound=0.1,
                      t_max=t_max, t_min=t_min, **stopping)
    return want, got


# 20 steps: the schedule's temperature at steps 1, 4, 13 and 15 rounds differently in float64 than in the
# reference's float32, which self-conditioning grew into other tokens (6 steps have no such step). 20 and 48 steps
# (seeds 2, 3) parted while blockpress read its weights as mapped, 4-byte aligned views of the file (~1e-6 a pass).
# Still apart: 20 steps with seed 5, whose row 0 ends in the first canvas; the reference keeps computing that row,
# blockpress drops it, and the survivor's tokens meet the experts' GEMMs in groups of another size.
@pytest.mark.parametrize("seed, steps", [(1, 6), (2, 6), (3, 6), *[pytest.param(seed, steps, marks=one_attention_kernel)
                                                                     for seed, steps in ((1, 20), (2, 20), (2, 48), (3, 48))]])
def test_fixed_steps_match_reference_token_for_token(monkeypatch, models, seed, steps):
    want, got = both_engines(monkeypatch, models, seed, steps, t_max=0.8, t_min=0.4)
    assert torch.equal(got.new_tokens, want)


@pytest.mark.parametrize("stability, threshold, seed", [(1, 2.0, 3), (2, 4.0, 2), (1, 4.0, 1)])
def test_adaptive_stopping_matches_reference_over_canvases(monkeypatch, models, stability, threshold, seed):
    want, got = both_engines(monkeypatch, models, seed, 10, t_max=0.1, t_min=0.05, stability=stability,
                             threshold=threshold)
    assert torch.equal(got.new_tokens, want)
    if threshold < 4.0:
        assert int((got.steps_per_canvas < 10).sum()) >= 3  # most canvases stopped early: the rule did act


def test_max_length_in_the_generation_config_matches_reference(monkeypatch, models):
    """Without max_new_tokens, the reference generates max_length less the prompt's (padded) width, 13 here, in
    whole canvases (16 tokens); blockpress gives exactly the 13. It read only max_new_tokens and generated 256.
    The first canvas is the reference's token for token; the second, cut to 5 of its 8 positions, is not: blockpress
    accepts only the positions it keeps there, where the reference ranks all 8 (see the README's list of where
    blockpress decides otherwise), so its tokens are the ones a 5-position canvas gets."""
    ref, lm = models
    prompt = torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(ref.generation_config, "max_length", 19)
    want = reference_generate(monkeypatch, ref, prompt, 4, 6, t_max=0.8, t_min=0.4, stability_threshold=None,
                              sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=0.1))
    with_max_length = blockpress.LM(lm.model, lm.tokenizer, dict(lm.generation_config, max_length=19))
    got = with_max_length.generate(prompt, max_denoising_steps=6, seed=4, entropy_bound=0.1, t_max=0.8, t_min=0.4,
                                   adaptive_stopping=False)
    assert want.shape[1] == 16 and got.new_tokens.shape[1] == 13
    assert torch.equal(got.new_tokens[:, :8], want[:, :8])
    assert torch.equal(got.new_tokens, lm.generate(prompt, max_new_tokens=13, max_denoising_steps=6, seed=4,
                                                   entropy_bound=0.1, t_max=0.8, t_min=0.4,
                                                   adaptive_stopping=False).new_tokens)


@pytest.mark.parametrize("masked", [False, True])
def test_transformers_keywords_match_reference(monkeypatch, models, masked):
    """The keywords a transformers user passes (input_ids, attention_mask, max_length, eos_token_id as a list,
    pad_token_id, the reference's generation_config object) give the reference's tokens: blockpress refused all
    but attention_mask ("takes no such keyword"; input_ids: a TypeError, the prompt was positional). The EOS is a
    token row 0 writes in the last canvas, so no row leaves the batch early (where the two part, see the README)."""
    ref, lm = models
    prompt = torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    if masked:
        mask[1, :2] = 0
    config = G.DiffusionGemmaGenerationConfig(t_max=0.1, t_min=0.05, stability_threshold=1, confidence_threshold=2.0,
                                              sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=0.1))
    plain = lm.generate(input_ids=prompt, attention_mask=mask, max_length=22, generation_config=config, seed=3,
                        max_denoising_steps=10, eos_token_id=1)
    eos = next(int(t) for t in plain.new_tokens[0, 9:] if t not in plain.new_tokens[1, :8] and t != 1)
    keywords = dict(attention_mask=mask, max_length=22, generation_config=config, eos_token_id=[eos, 1],
                    pad_token_id=3)
    want = reference_generate(monkeypatch, ref, prompt, 3, 10, **keywords)
    got = lm.generate(input_ids=prompt, seed=3, max_denoising_steps=10, **keywords)
    assert want.shape == got.new_tokens.shape == (2, 16)
    assert torch.equal(got.new_tokens, want)
    assert int(got.num_new_tokens[0]) < 16 and (got.new_tokens[0, int(got.num_new_tokens[0]):] == 3).all()
