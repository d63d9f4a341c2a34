"""The training objective against the reference (transformers' DiffusionGemma, the oracle) on a tiny random checkpoint:
the same batch and the same noise give the same loss, and config.json's attention_dropout is applied as the reference
applies it (attention probabilities dropped in train mode only)."""

import statistics
import warnings

import pytest
import torch
import torch.nn.functional as F

import blockpress
from blockpress.config import ConfigError
from blockpress.data import Example, make_batch
from blockpress.train import ExampleSource, Noise, Objective, TrainConfig, Trainer

pytest.importorskip("transformers")
C, VOCAB = 8, 96  # reference.TINY_TEXT's vocabulary, the reference's default canvas in make_reference


def load(path):
    from reference import fresh_weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fresh_weights(blockpress.load(path))


def batch_and_noise(seed, rows=3, prompt=5, response=12):
    """Rows of one prompt length and one response length (two canvases each: 12 tokens, the EOS, then EOS fill), so no
    row is padded; a noise draw with some rows self-conditioned and some not."""
    g = torch.Generator().manual_seed(seed)
    examples = [Example(torch.randint(2, VOCAB, (prompt,), generator=g).tolist(),
                        torch.randint(2, VOCAB, (response,), generator=g).tolist()) for _ in range(rows)]
    batch = make_batch(examples, C, 0, 1)
    n = batch.canvas_ids.shape[1]
    t = 0.05 + 0.9 * torch.rand(rows, generator=g)
    sc = torch.arange(rows) % 2 == 0
    noise = Noise(t, torch.rand(rows, n, generator=g) < t[:, None], torch.randint(0, VOCAB, (rows, n), generator=g), sc)
    return batch, noise


def our_losses(model, batch, noise, cfg=None):
    diffusion, ar = Objective(model, cfg or TrainConfig())(batch, noise)
    return float(diffusion) / float(batch.scored.sum()), float(ar) / float(batch.ar_scored[:, :-1].sum())


def reference_losses(ref, batch, noise, ar=True):
    """The published objective computed with the reference's own forward, a canvas at a time: canvas k is denoised
    over the clean prompt and the clean canvases before it (input_ids), pass 1 without gradients, pass 2 fed pass 1's
    logits as self-conditioning for the rows noise.self_condition picks; the AR loss on the encoder's last hidden state
    through the tied LM head and its soft-capping."""
    from transformers import DynamicCache

    p, n = batch.prompt_length, batch.canvas_ids.shape[1]
    noisy = torch.where(noise.corrupt & batch.scored, noise.tokens, batch.canvas_ids)
    total = 0.0
    for lo in range(0, n, C):
        # the context encoded once, its cache read by both passes (as ours: under dropout, one set of draws for both)
        cache = DynamicCache(config=ref.config.get_text_config())
        ref.model.encoder(input_ids=batch.ids[:, :p + lo], cache=cache)
        canvas = noisy[:, lo:lo + C]
        with torch.no_grad():
            first = ref(decoder_input_ids=canvas, cache=cache).logits
        logits = ref(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=first,
                     self_conditioning_mask=noise.self_condition).logits
        ce = F.cross_entropy(logits.flatten(0, 1), batch.canvas_ids[:, lo:lo + C].flatten(), reduction="none")
        total += float((ce * batch.scored[:, lo:lo + C].flatten().float()).detach().sum())
    diffusion = total / float(batch.scored.sum())
    if not ar:
        return diffusion, None
    hidden = ref.model.encoder(input_ids=batch.ids).last_hidden_state[:, :-1]
    logits = ref.lm_head(hidden).float()
    cap = ref.final_logit_softcapping
    logits = torch.tanh(logits / cap) * cap
    targets = batch.ids[:, 1:].masked_fill(~batch.ar_scored[:, :-1], -100)
    ar_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return diffusion, float(ar_loss) / float(batch.ar_scored[:, :-1].sum())


@pytest.fixture(scope="module")
def dropout_checkpoint(tmp_path_factory):
    """(path, reference model) of the tiny reference checkpoint with attention_dropout 0.1."""
    from reference import make_reference

    path = tmp_path_factory.mktemp("dropout")
    return path, make_reference(path, attention_dropout=0.1)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_training_loss_is_the_references(ref_checkpoint, seed):
    """Same batch, same noise (forced): our one block-causal forward over every canvas gives the loss the reference's
    forward gives a canvas at a time, both diffusion and AR, within 1e-5; in train mode too (no dropout there)."""
    path, ref = ref_checkpoint
    lm = load(path)
    batch, noise = batch_and_noise(seed)
    expected = reference_losses(ref.eval(), batch, noise)
    for train in (False, True):
        lm.model.train(train)
        ours = our_losses(lm.model, batch, noise)
        assert ours == pytest.approx(expected, abs=1e-5), (train, ours, expected)
    lm.model.eval()


@pytest.mark.parametrize("response", [9, 13, 23])
def test_a_window_that_ends_inside_a_canvas_is_the_references(ref_checkpoint, response):
    """A running-text window (no EOS) whose response ends inside its last canvas: the canvas's padded tail is
    numbered on from the response, as a partly used canvas is at inference and in the reference's forward. Its
    positions repeated the last token's (valid's running count), so the scored positions attended to a tail at the
    wrong place: a diffusion loss of 6.30 / 6.41 / 7.31 a token where the reference gives 6.11 / 6.92 / 7.33."""
    path, ref = ref_checkpoint
    lm = load(path)
    g = torch.Generator().manual_seed(response)
    example = Example(torch.randint(2, VOCAB, (5,), generator=g).tolist(),
                      torch.randint(2, VOCAB, (response,), generator=g).tolist(), ends=False)
    batch = make_batch([example], C, 0, 1)
    n = batch.canvas_ids.shape[1]
    assert n % C == 0 and int(batch.scored.sum()) == response < n  # the last canvas has a padded tail
    t = torch.tensor([0.6])
    noise = Noise(t, torch.rand(1, n, generator=g) < t, torch.randint(0, VOCAB, (1, n), generator=g),
                  torch.tensor([True]))
    assert our_losses(lm.model, batch, noise) == pytest.approx(reference_losses(ref.eval(), batch, noise), abs=1e-5)


def test_no_attention_dropout_leaves_training_as_it_was(ref_checkpoint):
    """attention_dropout 0 (the reference's default): train mode computes what eval mode does, bit for bit."""
    lm = load(ref_checkpoint[0])
    assert lm.config.attention_dropout == 0.0
    batch, noise = batch_and_noise(2)
    lm.model.eval()
    evaluated = Objective(lm.model, TrainConfig())(batch, noise)
    lm.model.train()
    torch.manual_seed(0)
    trained = Objective(lm.model, TrainConfig())(batch, noise)
    lm.model.eval()
    assert all(torch.equal(a, b) for a, b in zip(trained, evaluated, strict=True))


def test_attention_dropout_drops_in_train_mode_only(dropout_checkpoint):
    """attention_dropout 0.1: two train-mode passes differ (it was read and never applied: they were equal), while
    eval mode, and so generation, keeps every probability and gives the reference's eval logits."""
    path, ref = dropout_checkpoint
    lm = load(path)
    assert lm.config.attention_dropout == 0.1
    batch, noise = batch_and_noise(3)
    lm.model.train()
    first, second = our_losses(lm.model, batch, noise), our_losses(lm.model, batch, noise)
    assert first[0] != second[0] and first[1] != second[1]
    lm.model.eval()
    assert our_losses(lm.model, batch, noise) == our_losses(lm.model, batch, noise)
    assert our_losses(lm.model, batch, noise) == pytest.approx(reference_losses(ref.eval(), batch, noise), abs=1e-5)
    g = torch.Generator().manual_seed(4)
    prompt, canvas = torch.randint(0, VOCAB, (2, 7), generator=g), torch.randint(0, VOCAB, (2, C), generator=g)
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas).logits
    assert (lm.logits(prompt, canvas) - expected).abs().max().item() <= 1e-4
    out = [lm.generate([[3, 4, 5]], max_new_tokens=8, seed=1).sequences for _ in range(2)]
    assert torch.equal(out[0], out[1])


def test_attention_dropout_statistics_are_the_references(dropout_checkpoint):
    """The train-mode diffusion loss under dropout 0.1 is a random variable: over 30 dropout draws each, its mean and
    spread are the reference's. The tolerance is 4 standard errors of the difference of the two means (each mean's
    standard error is its sample standard deviation / sqrt(30)), so a correct implementation fails about once in 15,000
    runs; the spreads agree within a factor 1.5 (a sample deviation of 30 draws is off by ~13% per standard error).
    Without dropout the mean is the eval loss and the spread 0, which both checks refuse; dropout at a place other
    than the probabilities (e.g. on the values) moves the mean by more than the tolerance."""
    path, ref = dropout_checkpoint
    lm = load(path)
    batch, noise = batch_and_noise(5, rows=12, response=6)
    draws = 30
    ours, theirs = [], []
    lm.model.train()
    ref.train()
    state = torch.random.get_rng_state()
    try:
        for i in range(draws):
            torch.manual_seed(100 + i)
            ours.append(our_losses(lm.model, batch, noise)[0])
            theirs.append(reference_losses(ref, batch, noise, ar=False)[0])
    finally:
        torch.random.set_rng_state(state)
        lm.model.eval()
        ref.eval()
    sd_ours, sd_theirs = statistics.stdev(ours), statistics.stdev(theirs)
    tolerance = 4 * ((sd_ours**2 + sd_theirs**2) / draws) ** 0.5
    print(f"mean loss {statistics.mean(ours):.4f} (ours) {statistics.mean(theirs):.4f} (reference), tolerance "
          f"{tolerance:.4f}; sd {sd_ours:.4f} / {sd_theirs:.4f}")
    assert abs(statistics.mean(ours) - statistics.mean(theirs)) <= tolerance
    assert 1 / 1.5 <= sd_ours / sd_theirs <= 1.5


def test_a_training_run_applies_attention_dropout_and_resumes_with_the_same_draws(dropout_checkpoint, tmp_path):
    """A run over a config with attention_dropout 0.1 trains with it (its losses are not those of the same run
    without it), and a run stopped and resumed drops what the uninterrupted run dropped: the same losses."""
    path, _ = dropout_checkpoint
    examples = [Example([2, 5 + i, 7], [10 + i, 11, 12 + i, 30, 20, 21 - i]) for i in range(6)]

    def run(out, steps, resume=False, dropout=True):
        lm = load(path)
        if not dropout:
            lm.config.text_extra["attention_dropout"] = 0.0
        cfg = TrainConfig(steps=steps, batch_size=2, lr=1e-3, warmup_steps=1, log_every=1)
        trainer = Trainer(lm, ExampleSource(examples, 0), cfg, tmp_path / out, progress=False)
        if resume:
            trainer.resume()
        return trainer.train().losses

    whole = run("whole", 4)
    assert run("none", 4, dropout=False) != whole
    first = run("parts", 2)
    assert first + run("parts", 4, resume=True) == whole


def test_a_cpu_runs_dropout_seeds_no_gpus_generator_and_leaves_the_callers_as_it_was(dropout_checkpoint, tmp_path,
                                                                                       monkeypatch):
    """Each step's dropout was seeded with torch.manual_seed, which reseeds every device's generator: a run on the
    CPU reseeded the caller's CUDA (or MPS) generators at every step, forking none of them."""
    path, _ = dropout_checkpoint
    reseeded = []
    for module, name in ((torch.cuda, "manual_seed_all"), (torch.cuda, "manual_seed"), (torch.mps, "manual_seed")):
        monkeypatch.setattr(module, name, lambda seed, name=name: reseeded.append(name))
    examples = [Example([2, 5 + i, 7], [10 + i, 11, 12 + i]) for i in range(4)]
    cfg = TrainConfig(steps=2, batch_size=2, lr=1e-3, warmup_steps=1, log_every=1)
    trainer = Trainer(load(path), ExampleSource(examples, 0), cfg, tmp_path / "run", progress=False)
    state = torch.get_rng_state()
    trainer.train()
    assert reseeded == []
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.1", float("nan")])
def test_an_attention_dropout_training_cannot_take_is_refused_by_name(tmp_path, bad):
    """Refused before any step (torch's own error came mid-run, from inside the attention); a model loads all the
    same, since inference never reads it."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32), seed=0)
    lm.config.text_extra["attention_dropout"] = bad
    cfg = TrainConfig(steps=1, batch_size=1)
    with pytest.raises(ConfigError, match=r"text_config.attention_dropout: expected a number in \[0, 1\)"):
        Trainer(lm, ExampleSource([Example([2, 3], [4, 5])], 0), cfg, tmp_path / "run", progress=False)
