"""Training: the objective's pieces, the overfit test, and that accumulation / resume / LoRA change nothing."""

import json
import math
import os
import signal
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from saved import saved_dtype

import blockpress
from blockpress.data import Example, make_batch
from blockpress.train import (
    Diverged,
    ExampleSource,
    Objective,
    TrainConfig,
    Trainer,
    autocast_dtype,
    draw_noise,
    lr_at,
    read_trainer_state,
)

EXAMPLES = [Example([2, 5 + i], [10 + i, 11 + i, 12 + i, 13 + i, 20, 21 - i]) for i in range(4)]


def tiny_lm(seed=0, **overrides):
    cfg = blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8, **overrides)
    return blockpress.random_model(cfg, seed=seed)


def run(tmp_path, steps, name="out", lm=None, resume=False, **cfg):
    lm = lm or tiny_lm()
    tc = TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup_steps=5, log_every=1, **cfg)
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), tc, tmp_path / name, progress=False)
    if resume:
        trainer.resume()
    return lm, trainer.train()


@pytest.mark.parametrize("mode", [False, True])
def test_evaluate_puts_back_the_mode_it_found(tmp_path, mode):
    """evaluate() ended in train mode whatever it found: called after train() (which ends in eval mode), it left every
    later generation of a model with attention_dropout dropping attention at random."""
    lm = tiny_lm()
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4), tmp_path / "e",
                      progress=False, heldout=ExampleSource(EXAMPLES, 0))
    lm.model.train(mode)
    first = trainer.evaluate()
    assert lm.model.training is mode and trainer.evaluate() == first


def test_an_on_step_callback_runs_with_the_model_in_eval_mode(tmp_path):
    """on_step ran in train mode: a callback that generated a sample each step dropped attention at random
    (attention_dropout), two same-seed generations differing. It now runs in eval mode, the steps go on in train
    mode, and the run's losses are those of a run without the callback."""
    raw = blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8).to_dict()
    raw["text_config"]["attention_dropout"] = 0.3
    cfg = blockpress.ModelConfig.from_dict(raw)
    seen = []

    def sample(step, loss):
        once = lm.generate([[2, 5, 6]], max_new_tokens=8, max_denoising_steps=2, seed=1).new_tokens
        again = lm.generate([[2, 5, 6]], max_new_tokens=8, max_denoising_steps=2, seed=1).new_tokens
        seen.append((lm.model.training, torch.equal(once, again)))

    results = []
    for name, callback in (("with", sample), ("without", None)):
        lm = blockpress.random_model(cfg, seed=0)
        trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=3, batch_size=4, lr=3e-3), tmp_path / name,
                          progress=False, on_step=callback)
        results.append(trainer.train().losses)
    assert seen == [(False, True)] * 3 and results[0] == results[1]


def test_a_trainer_leaves_the_model_in_eval_mode_and_a_refused_one_leaves_the_lm_as_it_was(tmp_path):
    """Trainer() put the model in train mode: one made and never run (a refused resume) left every generation after
    dropping attention at random (attention_dropout). Its steps alone run in train mode. And one refused for a LoRA
    rank had already taken the checkpoint's noise token out of its generation config (another decoding after)."""
    raw = blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8).to_dict()
    raw["text_config"]["attention_dropout"] = 0.5
    lm = blockpress.random_model(blockpress.ModelConfig.from_dict(raw), seed=0)
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=2, batch_size=4), tmp_path / "t",
                      progress=False)
    assert not lm.model.training
    with pytest.raises(FileNotFoundError):
        trainer.resume()  # (no run saved there yet)
    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=1)
    assert torch.equal(lm.generate([[2, 5, 6]], **kw).new_tokens, lm.generate([[2, 5, 6]], **kw).new_tokens)
    modes = []
    lm.model.layers[0].register_forward_pre_hook(lambda module, args: modes.append(module.training))
    trainer.train_step()
    assert modes and all(modes) and not lm.model.training  # the step in train mode, eval mode after it
    lm.generation_config["noise_token_id"] = 7
    before = dict(lm.generation_config)
    with pytest.raises(ValueError, match="lora_rank: 100000 is more than any adapted layer can use"):
        Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=100000),
                tmp_path / "r", progress=False)
    assert lm.generation_config == before


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_trainer_refused_for_a_lora_target_the_model_lacks_leaves_the_lm_as_it_was(tmp_path, quantize):
    """The check of --lora-targets ran in add_lora, after the Trainer had set the run's noise (dropping the model's
    noise token) and quantized the model in place: refused, it left the caller's LM decoding otherwise."""
    c = blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8)
    # one full-attention layer: its values are its keys, so the model has no v_proj
    c = replace(c, text=replace(c.text, num_hidden_layers=1, layer_types=["full_attention"], per_layer_config=None))
    lm = blockpress.random_model(c, seed=0)
    lm.generation_config["noise_token_id"] = 7
    before = dict(lm.generation_config)
    with pytest.raises(ValueError, match="^lora_targets: this model has no v_proj layer to adapt"):
        Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=2, lora_targets="v_proj",
                                                            quantize=quantize), tmp_path / "r", progress=False)
    assert lm.generation_config == before
    assert lm.quantization is None


def test_save_adapter_refuses_what_lm_save_refuses_and_what_its_loader_would(tmp_path):
    """save_adapter (what lm.save's refusal of unmerged adapters points to) skipped lm.save's path checks: a file
    gave "Not a directory", a link to nothing a bare "File exists"; and it wrote r=0 or lora_alpha=NaN (not JSON),
    which blockpress.load(base, adapter=...) then refused."""
    pytest.importorskip("peft")
    from blockpress.train import add_lora, save_adapter

    model = add_lora(tiny_lm().model, rank=2, alpha=4)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=r"^save_adapter: '.*afile' is a file; give a folder$"):
        save_adapter(model, tmp_path / "afile", 2, 4, None)
    with pytest.raises(ValueError, match=r"^save_adapter: '.*link' is a link to '.*gone', which does not exist"):
        save_adapter(model, tmp_path / "link", 2, 4, None)
    for rank, alpha in ((0, 4), (2, float("nan")), (2, -1.0), (True, 4)):
        with pytest.raises(ValueError, match=r"^save_adapter: rank=.*, alpha=.*; expected positive numbers"):
            save_adapter(model, tmp_path / "out", rank, alpha, None)
    with pytest.raises(ValueError, match=r"^save_adapter: rank=4, but the model's adapters are of rank 2$"):
        save_adapter(model, tmp_path / "out", 4, 8, None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "gone").exists()
    save_adapter(model, tmp_path / "out", np.int64(2), np.float32(4), None)  # (numpy's numbers: JSON all the same)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 2


def test_a_lora_trainer_that_merged_its_adapters_refuses_to_save_or_train_again_and_keeps_its_files(tmp_path):
    """After a LoRA run's train() (its final save merges the adapters into lm.model), trainer.save() deleted the
    merged checkpoint and wrote an adapter of no tensors over the run's, and a second train() (its steps raised)
    logged losses while it changed no weight: the optimizer held the adapters the merge had taken out."""
    pytest.importorskip("peft")
    from blockpress.train import save_adapter

    out = tmp_path / "out"
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=2, batch_size=4, lora_rank=2), out,
                      progress=False)
    trainer.train()

    def files():
        return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    kept = files()
    assert Path("model.safetensors") in kept and Path("adapter/adapter_model.safetensors") in kept
    finished = (r"this LoRA run has ended: its final save merged its adapters into lm.model at step 2, .*; to train "
                r"on, fine-tune the merged checkpoint with a new Trainer \(blockpress train --model ")
    with pytest.raises(RuntimeError, match=rf"^Trainer\.save: {finished}"):
        trainer.save()
    trainer.cfg.steps = 4  # (to continue the run)
    with pytest.raises(RuntimeError, match=rf"^Trainer\.train: {finished}"):
        trainer.train()
    # save_adapter over a model without adapters: refused, not an adapter of no tensors
    with pytest.raises(ValueError, match=r"^save_adapter: the model holds no LoRA adapters to save"):
        save_adapter(trainer.lm.model, out / "adapter", 2, 8, None)
    assert files() == kept
    # a run its clock stopped is merged too, its adapters kept to resume: the hint says so
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=4, batch_size=4, lora_rank=2,
                      max_minutes=1e-9), tmp_path / "clock", progress=False)
    assert trainer.train().stopped == "max_minutes"
    with pytest.raises(RuntimeError, match=r"^Trainer\.train: this LoRA run has ended: .* at step 0, .*; to train on, "
                                           r"resume it from .* with a new Trainer over the base loaded again"):
        trainer.train()
    # a final save that failed after its merge: the message says the merged model is in lm.model alone
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=2, batch_size=4, lora_rank=2),
                      tmp_path / "full", progress=False)
    real_save = trainer.lm.save

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    trainer.lm.save = full_disk
    with pytest.raises(OSError):
        trainer.train()
    trainer.lm.save = real_save
    with pytest.raises(RuntimeError, match=r"^Trainer\.save: this LoRA run's final save merged its adapters into "
                                           r"lm\.model at step 2, then failed, .*: save the merged model with "
                                           r"trainer\.lm\.save\("):
        trainer.save(final=True)


def test_overfit_until_greedy_reproduces(tmp_path):
    lm, result = run(tmp_path, 300)
    assert result.losses[-1] < 0.25 * result.losses[0]
    for e in EXAMPLES:
        out = lm.generate(e.prompt, max_new_tokens=8, sampler="greedy", seed=0, max_denoising_steps=8)
        assert out.new_tokens[0, :6].tolist() == e.response
        assert out.new_tokens[0, 6].item() == 1  # and it learned to end
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and all("loss" in x for x in lines)
    reloaded = blockpress.load(tmp_path / "out")  # the trained checkpoint loads back
    assert torch.equal(reloaded.model.embed_tokens.weight, lm.model.embed_tokens.weight)


def test_corruption_follows_t():
    examples = [Example([2], list(range(3, 31)) * 20) for _ in range(6)]
    batch = make_batch(examples, 8, 0, 1)
    noise = draw_noise(batch, 32, TrainConfig(), torch.Generator().manual_seed(0))
    rate = noise.corrupt.float().mean(1)
    n = noise.corrupt.shape[1]
    sd = (noise.t * (1 - noise.t) / n).sqrt()
    assert ((rate - noise.t).abs() <= 4 * sd + 1e-3).all()
    assert noise.t.min() >= 1e-3 and noise.t.max() <= 1 - 1e-3


def test_block_causal_mask_hides_own_and_later_canvases():
    """Perturb canvas b's clean tokens or later canvases: canvas b's loss must not move; earlier ones must."""
    lm = tiny_lm(seed=3)
    ex = [Example([2, 7, 8], list(range(3, 27)))]  # 24 tokens -> 4 canvases of 8 (the last all EOS)
    batch = make_batch(ex, 8, 0, 1)
    noise = draw_noise(batch, 32, TrainConfig(self_conditioning_prob=0.0), torch.Generator().manual_seed(1))

    def per_canvas_loss(ids):
        b = type(batch)(ids, batch.valid, batch.scored, batch.ar_scored, batch.prompt_length, 8)
        noisy = torch.where(noise.corrupt, noise.tokens, batch.canvas_ids)  # same noisy input every time
        with torch.no_grad():
            h, kv, pos = lm.model.encode_sequence(b.ids, b.valid)
            logits = lm.model.denoise_blocks(noisy, kv, b.valid, pos, b.prompt_length)
        ce = torch.nn.functional.cross_entropy(logits[0], batch.canvas_ids[0], reduction="none")
        return ce.view(-1, 8).mean(1)

    base = per_canvas_loss(batch.ids)
    for target in range(4):
        ids = batch.ids.clone()
        s = batch.prompt_length + target * 8
        ids[0, s : s + 8] = (ids[0, s : s + 8] + 5) % 32  # change canvas `target`'s clean tokens
        moved = (per_canvas_loss(ids) - base).abs() > 1e-6
        assert not moved[: target + 1].any()  # itself and earlier canvases: untouched
        assert moved[target + 1 :].all()  # later canvases do see it


@pytest.mark.parametrize("reweight", [False, True])
def test_the_diffusion_loss_is_a_self_conditioned_passs_cross_entropy_on_the_scored_positions(reweight):
    """Objective against a plain computation, row by row: a scored position drawn for corruption holds the drawn
    token; a row drawn for self-conditioning takes the first pass's logits as its soft input, another none; the sum
    is the cross-entropy over scored positions alone (row 1's second canvas is not its own), each row's divided by
    1 - t when reweighting. Nothing else checked the loss's value: the overfit runs pass without self-conditioning."""
    lm = tiny_lm(seed=2)
    batch = make_batch([Example([2, 7], list(range(3, 12))), Example([4], [5, 6, 7])], 8, 0, 1)  # 2 canvases, 1
    noise = draw_noise(batch, 32, TrainConfig(), torch.Generator().manual_seed(0))
    noise.self_condition[:] = torch.tensor([True, False])
    assert not batch.scored[1].all() and (noise.corrupt & batch.scored).any()
    m = lm.model
    with torch.no_grad():
        diffusion, _ = Objective(m, TrainConfig(reweight=reweight))(batch, noise)
        want, without_sc = 0.0, 0.0
        for r in range(2):
            row, nz = batch.rows(slice(r, r + 1)), noise.rows(slice(r, r + 1))
            hit = nz.corrupt & row.scored
            noisy = torch.where(hit, nz.tokens, row.canvas_ids)
            _, kv, pos = m.encode_sequence(row.ids, row.valid)
            plain = m.denoise_blocks(noisy, kv, row.valid, pos, row.prompt_length)
            logits = plain
            if nz.self_condition[0]:
                logits = m.denoise_blocks(noisy, kv, row.valid, pos, row.prompt_length, self_conditioning_logits=plain)
            weight = 1 / (1 - nz.t[0]) if reweight else 1.0
            want += weight * F.cross_entropy(logits[0], row.canvas_ids[0], reduction="none")[row.scored[0]].sum()
            without_sc += weight * F.cross_entropy(plain[0], row.canvas_ids[0], reduction="none")[row.scored[0]].sum()
    torch.testing.assert_close(diffusion, want, rtol=1e-5, atol=1e-5)
    assert abs(float(want - without_sc)) > 1e-3  # self-conditioning moves the loss here: its absence would show


def test_example_order_is_drawn_once_per_epoch_and_unchanged(monkeypatch):
    """A permutation of every example was drawn for each example of each batch: 1.8 s a batch at 1M examples."""
    examples = [Example([2], [i]) for i in range(10)]
    batches = {step: ExampleSource(examples, 3).batch(step, 4) for step in (0, 2, 5, 1)}  # any order, fresh sources
    for step, got in batches.items():  # the order the per-example draws gave
        want = [int(torch.randperm(10, generator=torch.Generator().manual_seed(3 * 7919 + i // 10))[i % 10])
                for i in range(step * 4, step * 4 + 4)]
        assert [e.response[0] for e in got] == want
    draws = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **kw: draws.append(1) or real(*a, **kw))
    source = ExampleSource(examples, 3)
    seen = [e.response[0] for step in range(5) for e in source.batch(step, 4)]  # 20 examples: epochs 0 and 1
    assert len(draws) == 2 and sorted(seen[:10]) == sorted(seen[10:]) == list(range(10))


def test_examples_longer_than_the_context_are_refused_by_the_library_too(tmp_path):
    """Trainer took an example longer than the model's context from Python (blockpress-code took a 5000-token
    response at a context of 4096) where the CLI refused it while reading the file: now it is refused, naming the
    example and its lengths, for the held-out examples too; max_canvases, which keeps the first canvases, fits it."""
    lm = tiny_lm(max_position_embeddings=64)  # canvases of 8
    long = Example([2, 5], [10] * 70)  # 2 + 9 whole canvases of 8 = 74 positions
    with pytest.raises(ValueError, match=r"^example 4: prompt and response take 74 positions \(a prompt of 2 tokens "
                                         r"and a response of 70, .* context of 64; max_canvases 7 keeps"):
        Trainer(lm, ExampleSource([*EXAMPLES, long], 0), TrainConfig(), tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match=r"^held-out example 1: prompt and response take 74 positions"):
        Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(), tmp_path / "b", progress=False,
                heldout=ExampleSource([EXAMPLES[0], long], 0))
    Trainer(lm, ExampleSource([*EXAMPLES, long], 0), TrainConfig(max_canvases=7), tmp_path / "c", progress=False)


def test_an_out_dir_under_an_unknown_user_is_refused_by_name(tmp_path, monkeypatch):
    """Trainer(out_dir="~nobody/run") raised pathlib's bare RuntimeError 'Could not determine home directory.'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^out_dir: '~no-such-user-blockpress/run' starts with "
                                         r"~no-such-user-blockpress, and no home folder is known"):
        Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(), "~no-such-user-blockpress/run", progress=False)
    assert not any(tmp_path.iterdir())


def test_an_out_dir_with_a_nul_byte_is_refused_by_name(tmp_path, monkeypatch):
    """Python's bare ValueError 'embedded null byte' at the first save, after the run's first steps."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^out_dir: 'run\\x00' holds a NUL byte"):
        Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(), "run\x00", progress=False)
    assert not any(tmp_path.iterdir())


def test_any_allowed_seed_trains(tmp_path):
    """A seed past about 9.2e12 overflowed int64 in the seeds drawn from it (seed * 1_000_003 + step): 'Overflow when
    unpacking long long' at the first batch, naming no setting. Each stream's seed is taken modulo 2**63 now."""
    for seed in (2**62, 2**63 - 1):
        _, result = run(tmp_path, 1, f"s{seed}", seed=seed)
        assert len(result.losses) == 1 and math.isfinite(result.losses[0])
        assert len(ExampleSource(EXAMPLES, seed).batch(0, 4)) == 4  # the epoch's order, drawn from the seed too


def test_a_diverging_run_stops_at_its_first_non_finite_loss_and_saves_nothing(tmp_path):
    """lr 1e10: the loss went NaN at step 2, and the run went on to its end, saved NaN weights and returned."""
    steps = []
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=4, batch_size=4, lr=1e10, save_every=1),
                      tmp_path / "out", progress=False, on_step=lambda step, loss: steps.append(step))
    with pytest.raises(Diverged, match=r"^step 2: the loss is nan: training diverged, .* lower --lr than 1e\+10"):
        trainer.train()
    assert steps == [1] and trainer.step == 1  # stopped before step 2's update
    assert read_trainer_state(tmp_path / "out" / "trainer_state.pt")["step"] == 1  # the save before is kept


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """The last step's update has no next loss to show it: the save itself refuses weights that overflowed."""
    lm = tiny_lm()
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4), tmp_path / "out",
                      progress=False)
    with torch.no_grad():
        next(lm.model.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(Diverged, match="^step 0: the trained weights hold values that are not finite"):
        trainer.save(final=True)
    assert not (tmp_path / "out").exists()


def test_grad_accumulation_changes_nothing(tmp_path):
    _, whole = run(tmp_path, 4, "a")
    _, micro = run(tmp_path, 4, "b", micro_batch_size=1)
    assert whole.losses == pytest.approx(micro.losses, rel=1e-5)


@pytest.mark.parametrize("lora", [0, 4])
def test_a_callers_grad_mode_and_default_dtype_change_no_run(tmp_path, lora):
    """Under a caller's torch.no_grad() the loss was scaled without grad (torch's "element 0 of tensors does not
    require grad"); under a float64 default dtype the noise was drawn otherwise (another first loss: a resume across
    processes was not exact). Both now train as a plain run does (up to AdamW's own step count, which torch keeps
    in the default dtype); inference mode, where nothing can be trained, is refused by name."""
    _, plain = run(tmp_path, 3, "plain", lora_rank=lora)
    with torch.no_grad():
        _, no_grad = run(tmp_path, 3, "no_grad", lora_rank=lora)
    assert plain.losses == no_grad.losses and len(plain.losses) == 3
    default = torch.get_default_dtype()
    for dtype in (torch.float64, torch.bfloat16):  # (LoRA's adapters were drawn in it too)
        torch.set_default_dtype(dtype)
        try:
            _, wide = run(tmp_path, 3, f"wide_{dtype}", lora_rank=lora)
        finally:
            torch.set_default_dtype(default)
        # the same draws and sums; torch's AdamW keeps its step count in the default dtype, a last-bit difference
        assert wide.losses[0] == plain.losses[0] and wide.losses == pytest.approx(plain.losses, rel=1e-5), dtype
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"^Trainer.train: called under "
                                                                   r"torch.inference_mode\(\)"):
        run(tmp_path, 2, "inference", lora_rank=lora)
    if lora:  # adapters made with the Trainer in that block, trained after it
        with torch.inference_mode():
            trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=2, batch_size=4, lora_rank=lora),
                              tmp_path / "made_in_inference", progress=False)
        with pytest.raises(RuntimeError, match=r"^Trainer.train: the weights to train were made under torch.infer"):
            trainer.train()


def test_a_model_left_with_unmerged_adapters_is_not_saved_as_a_checkpoint(tmp_path):
    """A LoRA run stopped before its final save (Ctrl-C, an error) leaves the model's layers wrapped by peft: save
    wrote a folder that looked whole and that neither load read (blockpress: "unexpected tensor
    '...base_layer.weight'"; transformers filled the missing weights with random ones), and a new run was told the
    adapters sat "over its quantized base", which there was none of. Both are refused, saying how to fold them in;
    folded, the save loads back with the same logits (to float32 rounding)."""
    from blockpress.train import add_lora, merge_lora

    lm = tiny_lm()
    add_lora(lm.model, rank=4, alpha=8)
    with pytest.raises(ValueError, match=r"^save: the model holds LoRA adapters, unmerged \(layer '.*'.*merge_lora\(lm"):
        lm.save(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"^train: the model holds LoRA adapters, unmerged \(layer '[^;]*'\); fold "):
        Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=2), tmp_path / "run", progress=False)
    merge_lora(lm.model)
    lm.save(tmp_path / "out")
    prompt, canvas = torch.tensor([[2, 5, 6]]), torch.tensor([[7] * 8])
    torch.testing.assert_close(blockpress.load(tmp_path / "out").logits(prompt, canvas), lm.logits(prompt, canvas))


def test_resume_is_exact(tmp_path):
    _, straight = run(tmp_path, 6, "straight")
    lm = tiny_lm()
    run(tmp_path, 3, "split", lm=lm)
    _, rest = run(tmp_path, 6, "split", lm=tiny_lm(seed=9), resume=True)  # other init: resume must overwrite
    assert len(rest.losses) == 3
    assert straight.losses[3:] == pytest.approx(rest.losses, rel=1e-6)


@pytest.mark.parametrize("first, then", [(4, 2), (2, 3)])
def test_resume_with_another_batch_size_reads_on_from_the_examples_the_run_consumed(tmp_path, monkeypatch, first, then):
    """A run of 3 steps at one batch size, resumed at another, trains on exactly the examples a run that never stopped
    would have met next, in that order, none twice and none skipped (its batches were indexed by step alone: resumed
    at batch 2 after 3 steps of 4, it went on from example 6 of the stream, training 6-11 twice; at a larger batch size
    it skipped some)."""
    import blockpress.train as train_module

    examples = [Example([2, 3], [4 + i, 5]) for i in range(10)]  # response[0] names the example; epochs wrap at 10
    seen: list[int] = []
    real = train_module.make_batch
    monkeypatch.setattr(train_module, "make_batch", lambda ex, *a, **k: seen.extend(e.response[0] for e in ex)
                        or real(ex, *a, **k))

    def part(name, steps, batch_size, resume=False):
        cfg = TrainConfig(steps=steps, batch_size=batch_size, lr=1e-3, warmup_steps=1, log_every=1)
        trainer = Trainer(tiny_lm(), ExampleSource(examples, 0), cfg, tmp_path / name, progress=False)
        if resume:
            trainer.resume()
        trainer.train()

    part("whole", 3 + 12 // first, first)  # the stream an unbroken run reads: 3 steps, then 12 examples more
    stream = list(seen)
    seen.clear()
    part("parts", 3, first)
    assert seen == stream[:3 * first]
    seen.clear()
    part("parts", 3 + 12 // then, then, resume=True)
    assert seen == stream[3 * first:3 * first + 12]
    state = read_trainer_state(tmp_path / "parts" / "trainer_state.pt")
    assert state["examples_seen"] == 3 * first + 12


def test_resume_with_another_batch_size_over_a_source_indexed_by_step_is_refused(tmp_path):
    """A data source of its own (anything with batch(step, size), as scripts/train_sudoku.py's) draws step k's batch by
    k alone: where its stream stands after a part at another batch size is unknown, so the resume is refused naming
    both sizes (it went on, reading examples the run had seen)."""

    class Source:
        def batch(self, step, size):
            return [Example([2, 3], [4 + (step * size + i) % 10, 5]) for i in range(size)]

    def part(steps, batch_size):
        cfg = TrainConfig(steps=steps, batch_size=batch_size, lr=1e-3, warmup_steps=1, log_every=1)
        return Trainer(tiny_lm(), Source(), cfg, tmp_path / "run", progress=False)

    part(2, 4).train()
    with pytest.raises(ValueError, match=r"ran at batch_size 4 and this one asks for 2; its data source \(Source\)"):
        part(4, 2).resume()
    trainer = part(4, 4)  # its own batch size resumes
    trainer.resume()
    assert trainer.train().steps == 4


def test_resume_trains_with_the_optimizer_settings_given_to_it(tmp_path):
    """`--resume --weight-decay 0.5 --beta2 0.5` warned that it overrode the run's settings and recorded them, but
    the optimizer's load_state_dict put the saved groups' weight decay and betas back: the resumed steps trained with
    the old ones, exactly as a resume without the flags."""
    import shutil

    run(tmp_path, 3, "split")
    shutil.copytree(tmp_path / "split", tmp_path / "other")

    def resumed(name, **cfg):
        tc = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=5, log_every=1, **cfg)
        trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / name, progress=False)
        trainer.resume()
        trainer.train()
        return trainer

    same = resumed("split")
    other = resumed("other", weight_decay=0.5, beta1=0.5, beta2=0.5)
    assert [(g["weight_decay"], g["betas"]) for g in other.optimizer.param_groups] == [(0.5, (0.5, 0.5)),
                                                                                        (0.0, (0.5, 0.5))]
    assert [(g["weight_decay"], g["betas"]) for g in same.optimizer.param_groups] == [(0.01, (0.9, 0.95)),
                                                                                       (0.0, (0.9, 0.95))]
    # the step trained after the resume is another one with the settings given
    assert not all(torch.equal(p, q) for p, q in zip(same.model.parameters(), other.model.parameters(), strict=True))


def test_a_run_resumed_from_its_own_folder_is_bit_exact(tmp_path):
    """`blockpress train --resume` loads the model from the run's folder, as zero-copy views of its mmapped file, at
    offsets that the header's length (the run's step metadata) shifts from the base's: CPU kernels rounded
    differently there, and the resumed run drifted from the uninterrupted one by 1e-6 after a few steps."""
    tiny_lm().save(tmp_path / "base")

    def trainer(model, name):  # as the CLI makes it: the model loaded from a folder in float32
        tc = TrainConfig(steps=8, batch_size=4, lr=3e-3, warmup_steps=5, log_every=1)
        lm = blockpress.load(model, dtype="float32")
        return Trainer(lm, ExampleSource(EXAMPLES, 0), tc, tmp_path / name, progress=False)

    straight = trainer(tmp_path / "base", "straight")
    whole = straight.train()
    interrupted = trainer(tmp_path / "base", "split")
    for _ in range(3):
        interrupted.train_step()
    interrupted.save()  # as Ctrl-C saves
    resumed = trainer(tmp_path / "split", "split")  # --resume: --model is --out
    resumed.resume()
    rest = resumed.train()
    assert whole.losses[3:] == rest.losses
    assert all(torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True))


def test_resume_of_a_folder_without_a_run_is_a_clear_error(tmp_path):
    """It was torch.load's '[Errno 2] No such file or directory' on trainer_state.pt."""
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=2, batch_size=4), tmp_path / "none",
                      progress=False)
    with pytest.raises(FileNotFoundError, match=r"--resume: .*none has no trainer_state.pt to continue from"):
        trainer.resume()



class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling calls Path.touch(marker): a stand-in for any code a pickle can run
        return (Path.touch, (Path(self.marker),))


def test_resume_does_not_unpickle_objects_a_state_never_holds(tmp_path):
    """A trainer state was read with weights_only=False: a trainer_state.pt from someone else (a shared run folder)
    ran whatever code its pickle named on --resume. It is read as tensors and plain values now, and one holding
    anything else is refused by name."""
    run(tmp_path, 2, "run")
    state_file = tmp_path / "run" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({**state, "extra": _RunsCodeWhenUnpickled(marker)}, state_file)
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=4, batch_size=4), tmp_path / "run",
                      progress=False)
    with pytest.raises(ValueError, match=r"--resume: .*trainer_state.pt holds Python objects other than tensors "
                                         r"and plain values \([\w.]+\)"):
        trainer.resume()
    assert not marker.exists()

def test_lora_trains_adapters_and_merges_exactly(tmp_path):
    pytest.importorskip("peft")
    from blockpress.train import add_lora, merge_lora

    lm = tiny_lm()
    base = {k: v.clone() for k, v in lm.model.state_dict().items()}
    model = add_lora(lm.model, rank=4, alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # adapters over adapters: "this model has no q_proj layer to adapt" was said of a model whose layers were wrapped
    with pytest.raises(ValueError, match=r"^add_lora: the model holds LoRA adapters already \(layer '.*q_proj'\)"):
        add_lora(model, rank=4, alpha=8)
    assert not any("experts" in n or "router" in n or "self_conditioning" in n for n in trainable)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    lm.model = model
    prompt, canvas = torch.tensor([[2, 5, 6]]), torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with_adapters = lm.logits(prompt, canvas)
    lm.model = merge_lora(model)
    merged = lm.logits(prompt, canvas)
    assert (with_adapters - merged).abs().max() < 1e-4
    assert set(lm.model.state_dict()) == set(base)  # a plain checkpoint again
    assert not torch.equal(lm.model.state_dict()["layers.0.self_attn.q_proj.weight"], base["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(lm.model.state_dict()["layers.0.experts.gate_up_proj"], base["layers.0.experts.gate_up_proj"])
    # nor peft's record of the adapters: left behind, the next add_lora warned of "multiple adapters"
    assert not hasattr(lm.model, "peft_config")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add_lora(lm.model, rank=4, alpha=8)


def test_lora_adapters_train_in_float32_on_a_bfloat16_base(tmp_path):
    """peft made them in the base layer's dtype: bf16 adapters, whose small AdamW updates round away."""
    pytest.importorskip("peft")
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=0, dtype="bfloat16")
    cfg = TrainConfig(steps=2, batch_size=4, lora_rank=4, warmup_steps=1)
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), cfg, tmp_path, progress=False)
    adapters = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert adapters and {p.dtype for p in adapters.values()} == {torch.float32}
    assert lm.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16  # the frozen base stays
    before = {n: p.detach().clone() for n, p in adapters.items()}
    row = trainer.train_step()
    assert torch.isfinite(torch.tensor(row["loss"]))
    assert any(not torch.equal(before[n], p) for n, p in adapters.items())


def test_a_lora_run_is_reproducible_from_its_seed_alone(tmp_path):
    """peft drew lora_A from torch's unseeded global generator: one command gave other losses from step 2 on, and a
    run with accumulation did not reproduce the plain one. The run's seed draws them, and the caller's global
    generator is left where it was."""
    pytest.importorskip("peft")
    torch.manual_seed(1)
    _, plain = run(tmp_path, 3, "plain", lora_rank=4)
    state = torch.get_rng_state()
    torch.manual_seed(2)  # another global state: nothing may depend on it
    _, micro = run(tmp_path, 3, "micro", lora_rank=4, micro_batch_size=1)
    assert plain.losses == pytest.approx(micro.losses, rel=1e-5)
    torch.set_rng_state(state)
    expected = torch.rand(4)
    torch.set_rng_state(state)
    lm = tiny_lm()
    Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=4), tmp_path / "x",
            progress=False)
    assert torch.equal(torch.rand(4), expected)  # the global generator did not move
    seeded = {n: p.detach().clone() for n, p in lm.model.named_parameters() if "lora_A" in n}
    lm = tiny_lm()
    Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=4, seed=1), tmp_path / "y",
            progress=False)
    assert any(not torch.equal(p, seeded[n]) for n, p in lm.model.named_parameters() if "lora_A" in n)


def test_a_lora_run_on_a_bfloat16_base_is_merged_in_float32(tmp_path):
    """The adapters were folded into the bf16 base weights: a third of the trained update rounded away, in a
    checkpoint whose reported eval loss was that of the unrounded model."""
    pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    from blockpress.train import merge_lora

    def trained(name, **kwargs):
        lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=0,
                                     dtype="bfloat16")
        cfg = TrainConfig(steps=3, batch_size=4, lora_rank=4, lr=1e-2, warmup_steps=1)
        trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), cfg, tmp_path / name, progress=False, **kwargs)
        for _ in range(3):
            trainer.train_step()
        return trainer

    trainer = trained("f32")
    exact = {name: m.get_base_layer().weight.detach().double() + m.get_delta_weight("default").detach().double()
             for name, m in trainer.model.named_modules() if isinstance(m, LoraLayer)}
    trainer.save(final=True)
    saved = blockpress.load(tmp_path / "f32")
    assert saved.dtype == torch.float32
    for name, weight in exact.items():
        assert (saved.model.get_submodule(name).weight.double() - weight).abs().max() < 1e-6, name
    rounded = trained("bf16", merged_dtype=torch.bfloat16)  # asked for: the update rounded to bf16, as before
    rounded.save(final=True)
    assert saved_dtype(tmp_path / "bf16") == torch.bfloat16
    buffers = {b.dtype for n, b in rounded.lm.model.named_buffers() if "inv_freq" in n}
    assert buffers == {torch.float32}  # RoPE frequencies stay float32, as a bf16 load keeps them
    model = merge_lora(trained("again").model)  # the function's own default: float32 throughout
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_lora_run_on_a_shipped_model_records_its_name(tmp_path):
    """lora_base.json held the package's absolute folder, which a reinstall moves: --resume lost its base."""
    pytest.importorskip("peft")
    from blockpress.train import lora_base

    lm = blockpress.load("blockpress-code")
    Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=2), tmp_path / "run",
            progress=False).save()
    assert lora_base(tmp_path / "run") == "blockpress-code"
    folder = tmp_path / "base"  # a base in a folder of its own keeps its path
    tiny_lm().save(folder)
    Trainer(blockpress.load(folder), ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=2),
            tmp_path / "run2", progress=False).save()
    assert lora_base(tmp_path / "run2") == str(folder)


def test_a_lora_run_records_its_bases_absolute_path(tmp_path, monkeypatch):
    """A base given by a relative path was recorded as typed: --resume from another folder could not find it."""
    pytest.importorskip("peft")
    from blockpress.train import lora_base

    tiny_lm().save(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    Trainer(blockpress.load("base"), ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, lora_rank=2),
            "run", progress=False).save()
    assert lora_base(tmp_path / "run") == str((tmp_path / "base").resolve())


def test_lora_training_run_saves_a_merged_checkpoint(tmp_path):
    pytest.importorskip("peft")
    lm, result = run(tmp_path, 5, "lora", lora_rank=4)
    assert result.losses[-1] < result.losses[0]
    again = blockpress.load(tmp_path / "lora")
    assert set(again.model.state_dict()) == set(tiny_lm().model.state_dict())


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(steps=0), "steps"), (dict(lr=-1.0), "lr"), (dict(self_conditioning_prob=2.0), "self_conditioning_prob"),
     (dict(t_eps=0.7), "t_eps"), (dict(micro_batch_size=-1), "micro_batch_size"),
     (dict(time_schedule=True), "time_schedule"), (dict(data_workers=-1), "data_workers"),
     # Each of these trained without a word before: NaN weights, a climbing loss, a negative end of schedule.
     (dict(lr=float("inf")), "lr: expected a finite number"), (dict(grad_clip=-1.0), "grad_clip"),
     (dict(min_lr_ratio=-5.0), "min_lr_ratio"), (dict(weight_decay=-1.0), "weight_decay"),
     (dict(beta2=1.0), "beta2"), (dict(log_every=0), "log_every"), (dict(lr="3e-4"), "lr: expected a finite"),
     (dict(batch_size=2, micro_batch_size=4), "micro_batch_size: 4 is more than batch_size 2"),
     # lora_alpha 0 trained a silent no-op (eval_batches 0 is refused by the Trainer, where data is held out)
     (dict(eval_batches=-1), "eval_batches: expected an integer >= 0"),
     (dict(lora_alpha=0), "lora_alpha: expected a positive number"), (dict(lora_alpha=-8), "lora_alpha"),
     (dict(lora_alpha=float("nan")), "lora_alpha: expected a finite number"),
     # refused as a flag, ignored silently from --train-config or in Python
     (dict(lora_alpha=64), "lora_alpha: 64 scales LoRA adapters; it needs lora_rank > 0"),
     (dict(lora_targets="q_proj"), "lora_targets: 'q_proj' chooses the layers LoRA adapts; it needs lora_rank > 0"),
     # the linear layers blockpress adapts, by peft's names; the routed experts are 3-D parameters, said so
     (dict(lora_rank=4, lora_targets="q_proj,qkv"), r"lora_targets: unknown module\(s\) \['qkv'\]; expected "
      "comma-separated names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
     (dict(lora_rank=4, lora_targets="experts"), "'experts': the routed experts' weights are 3-D parameters"),
     (dict(lora_rank=4, lora_targets=" , "), "lora_targets: expected comma-separated names"),
     # from a JSON file: "false" switched reweighting on, a seed "a" failed at the first batch, 1.5 was taken
     (dict(reweight="false"), "reweight: expected true or false, got 'false'"),
     (dict(compile=1), "compile: expected true or false"), (dict(seed="a"), "seed: expected an integer, got 'a'"),
     (dict(seed=1.5), "seed: expected an integer"), (dict(steps=True), "steps: expected an integer, got True"),
     # as inference seeds: -1 was taken (generate refuses it), 2**64 failed at the first batch, unnamed
     (dict(seed=-1), r"seed: expected an integer in \[0, 2\*\*63\), got -1"),
     (dict(seed=2**63), r"seed: expected an integer in \[0, 2\*\*63\)"),
     (dict(heldout="0.1"), "heldout: expected a finite number or null"),
     (dict(heldout_data=3), "heldout_data: expected a string or null, got 3")],
)
def test_bad_train_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)


def test_window_settings_on_examples_are_refused():
    """prompt_min, prompt_max and response_canvases shape windows of running text: refused as flags on JSONL
    examples, they were ignored silently from --train-config or in Python. Their defaults are no setting."""
    Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4), "unused", progress=False)
    with pytest.raises(ValueError, match=r"prompt_min/response_canvases: for running text"):
        Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, prompt_min=4,
                response_canvases=3), "unused", progress=False)


def test_unknown_train_config_field():
    with pytest.raises(ValueError, match="lerning_rate"):
        TrainConfig.from_dict({"lerning_rate": 1e-3})
    with pytest.raises(ValueError, match="reweight: expected true or false"):
        TrainConfig.from_dict({"reweight": "false"})
    assert TrainConfig.from_dict({"lr": 1, "heldout": None}).lr == 1  # an integer is a number


def test_time_budget_stops_and_saves(tmp_path):
    lm, result = run(tmp_path, 1000, "budget", max_minutes=1e-9)
    assert result.steps < 1000
    assert (tmp_path / "budget" / "model.safetensors").exists()
    last = json.loads((tmp_path / "budget" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["stopped"] == "max_minutes"


@pytest.mark.parametrize("steps, budget", [(2, 0.0), (1000, 1e-9)])  # its last step; its clock
def test_a_run_is_saved_before_its_last_evaluation(tmp_path, monkeypatch, steps, budget):
    """The last evaluation ran before the final save: an error or OOM in it lost the whole run."""
    def out_of_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(Trainer, "evaluate", out_of_memory)
    lm = tiny_lm()
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=steps, batch_size=4, max_minutes=budget),
                      tmp_path / "run", heldout=ExampleSource(EXAMPLES, 1), progress=False)
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        trainer.train()
    saved = blockpress.load(tmp_path / "run")
    assert torch.equal(saved.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert read_trainer_state(tmp_path / "run" / "trainer_state.pt")["step"] == trainer.step


def test_a_run_its_clock_stops_right_after_an_evaluation_is_not_evaluated_again(tmp_path, monkeypatch):
    """--eval-every evaluated the last step, the clock then ran out, and the stop evaluated the same weights on the
    same held-out batches again: a whole evaluation's time, and the step twice in eval_losses."""
    import time

    calls, real = [], Trainer.evaluate

    def counted(self):
        calls.append(self.step)
        return real(self)

    monkeypatch.setattr(Trainer, "evaluate", counted)
    cfg = TrainConfig(steps=1000, batch_size=4, eval_every=1, max_minutes=0.01, warmup_steps=1)
    out_of_time = lambda step, loss: time.sleep(0.7)  # noqa: E731 - past the 0.6 s budget after step 1
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", heldout=ExampleSource(EXAMPLES, 1),
                      progress=False, on_step=out_of_time)
    result = trainer.train()
    assert (result.stopped, result.steps, calls) == ("max_minutes", 1, [1])
    assert [step for step, _ in result.eval_losses] == [1]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 1, "stopped": "max_minutes", "eval_loss": result.eval_losses[0][1]}


def test_tokens_per_second_leave_evaluations_and_saves_out(tmp_path, monkeypatch):
    """The log line's, the bar's and metrics.jsonl's tok/s and the summary's tokens_per_second divided the training
    tokens by the wall time since the start, held-out evaluations and saves included: a tiny run said 298 tok/s with
    --eval-every 1 --eval-batches 8 where its steps ran at 1751."""
    import time

    real_evaluate, real_save = Trainer.evaluate, Trainer.save

    def slow(real):
        def wrapped(self, *args, **kwargs):
            time.sleep(1.0)  # an evaluation or a save of a real model
            return real(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(Trainer, "evaluate", slow(real_evaluate))
    monkeypatch.setattr(Trainer, "save", slow(real_save))
    cfg = TrainConfig(steps=3, batch_size=4, log_every=1, eval_every=1, save_every=1, warmup_steps=1)
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run",
                      heldout=ExampleSource(EXAMPLES, 1), progress=False)
    started = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - started
    assert wall > 6  # three evaluations and three saves slept
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tokens = [row["tokens"] for row in rows]
    # the seconds each figure counts: the steps' own, not the sleeps (before: 4 s of them by the last step's row,
    # 6 s by the end); wall holds both and the steps' real evaluations and saves
    assert sum(tokens) / rows[-1]["tok_s"] < wall - 5
    assert sum(tokens) / result.tokens_per_second < wall - 5


def test_without_clipping_the_gradient_norm_is_logged_and_checked(tmp_path):
    """--grad-clip 0 logged grad_norm 0.0 at every step, and a gradient that was not finite (its loss finite) went
    into the update unchecked: the run stopped a step later, naming the NaN loss of weights already NaN."""
    _, clipped = run(tmp_path, 2, "clipped", grad_clip=1e9)  # a bound never reached: the same updates, measured
    _, unclipped = run(tmp_path, 2, "unclipped", grad_clip=0.0)
    assert unclipped.losses == clipped.losses

    def norms(name):
        return [json.loads(line)["grad_norm"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert norms("unclipped") == pytest.approx(norms("clipped"), rel=1e-6) and min(norms("unclipped")) > 0
    lm = tiny_lm()
    lm.model.embed_tokens.weight.register_hook(lambda grad: grad * float("inf"))  # finite loss, gradient not
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=3, batch_size=4, grad_clip=0.0),
                      tmp_path / "inf", progress=False)
    with pytest.raises(Diverged, match=r"^step 1: the gradient norm is (nan|inf)"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in lm.model.parameters())  # stopped before the update


@pytest.mark.parametrize("clip", [0.01, 0.5])
def test_grad_clip_bounds_the_gradient_each_update_takes(tmp_path, clip):
    """The norm of the gradient AdamW steps on is the clip where the raw one is larger (grad_norm logs the raw one),
    and the raw one where it is not (a clip of 1e9 elsewhere changes nothing, which a dropped clip passed too)."""
    lm = tiny_lm()
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=3, batch_size=4, grad_clip=clip, log_every=1),
                      tmp_path, progress=False)
    applied, step = [], trainer.optimizer.step

    def measured_step(*args, **kwargs):
        grads = [p.grad for p in lm.model.parameters() if p.grad is not None]
        applied.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return step(*args, **kwargs)

    trainer.optimizer.step = measured_step
    trainer.train()
    raw = [json.loads(line)["grad_norm"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(applied) == len(raw) == 3
    for norm, logged in zip(applied, raw):
        assert norm == pytest.approx(min(clip, logged), rel=1e-4)
    assert any(logged > clip for logged in raw)  # (the clip was in play)


def test_batches_built_by_workers_change_nothing(tmp_path):
    """Nor the caller's global generator, which the loader drew its workers' base seed from: the program's next
    torch.rand after training depended on data_workers."""
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    _, inline = run(tmp_path, 4, "inline")
    assert torch.equal(torch.get_rng_state(), state)
    _, workers = run(tmp_path, 4, "workers", data_workers=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert inline.losses == pytest.approx(workers.losses, rel=1e-6)


def test_data_workers_where_python_has_no_fork_are_refused_by_name(tmp_path, monkeypatch):
    """Windows' Python has the spawn start method alone: the Trainer built, and train() then ended in torch's
    DataLoader error for the fork context, naming no setting."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ValueError, match=r"^data_workers: needs the fork start method, .*spawn\); use 0"):
        run(tmp_path, 2, data_workers=2)


@given(step=st.integers(0, 400), fraction=st.floats(0.0, 1.0), later=st.floats(0.0, 1.0))
def test_time_schedule_anneals_over_the_budget(step, fraction, later):
    cfg = TrainConfig(steps=10_000, lr=1e-3, warmup_steps=20, max_minutes=5.0, time_schedule=True)
    lr = lr_at(cfg, step, fraction)
    assert lr <= lr_at(cfg, step) + 1e-12  # the clock only ever brings the decay forward
    assert lr_at(cfg, step, max(fraction, later)) <= lr + 1e-12  # and more time spent never raises it
    # a spent budget sits at the floor, inside the warmup too (a budget spent before --warmup-steps ended the run
    # at the ramp's top, 0.36x --lr where the docs promise the low learning rate); before it the ramp is the steps'
    floor = cfg.lr * cfg.min_lr_ratio
    assert lr_at(cfg, step, 1.0) == pytest.approx(floor if step >= cfg.warmup_steps else min(floor, lr_at(cfg, step)))
    if step < cfg.warmup_steps:  # the steps' ramp, under the clock's cosine (that of the warmup's end at this time)
        assert lr == pytest.approx(min(cfg.lr * (step + 1) / cfg.warmup_steps, lr_at(cfg, cfg.warmup_steps, fraction)))


@given(steps=st.integers(1, 300), warmup=st.integers(0, 300), ratio=st.floats(0.0, 1.0))
def test_the_cosine_schedule_ends_at_its_floor(steps, warmup, ratio):
    """The help says the schedule ends at --lr x --min-lr-ratio; over steps - warmup the last step (steps - 1) never
    reached it (a 10-step run with 3 warmup ended at 0.145x --lr for a floor of 0.1x). Where a step is left to decay
    in, the last one is at the floor; the schedule never goes below it and never rises after the warmup."""
    cfg = TrainConfig(steps=steps, lr=1e-3, warmup_steps=warmup, min_lr_ratio=ratio)
    lrs = [lr_at(cfg, step) for step in range(steps)]
    floor = cfg.lr * ratio
    assert all(lr >= floor - 1e-15 for lr in lrs[warmup:])  # (the warmup's ramp starts below it)
    assert all(b <= a + 1e-15 for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))
    if steps - 1 > warmup:  # (no step after the warmup's peak: the CLI warns that it ends there)
        assert lrs[-1] == pytest.approx(floor, abs=1e-15)


def test_ar_only_baseline_trains_the_encoder(tmp_path):
    lm, result = run(tmp_path, 150, "ar", diffusion_weight=0.0)
    assert result.losses[-1] < 0.5 * result.losses[0]
    out = lm.generate_ar(EXAMPLES[1].prompt, max_new_tokens=7)
    assert out.new_tokens[0, :6].tolist() == EXAMPLES[1].response


def test_absorbing_noise_corrupts_to_one_token_and_the_model_remembers(tmp_path):
    """noise_token_id: the same positions are corrupted as with uniform noise (same draws), all to that token;
    the trained checkpoint decodes with it."""
    batch = make_batch(EXAMPLES, 8, 0, 1)
    uniform = draw_noise(batch, 32, TrainConfig(), torch.Generator().manual_seed(4))
    absorbing = draw_noise(batch, 32, TrainConfig(noise_token_id=30), torch.Generator().manual_seed(4))
    assert torch.equal(uniform.corrupt, absorbing.corrupt) and uniform.corrupt.any()
    assert (absorbing.tokens == 30).all() and not (uniform.tokens == 30).all()
    lm, result = run(tmp_path, 3, noise_token_id=30)
    assert lm.generation_config["noise_token_id"] == 30
    assert blockpress.load(tmp_path / "out").sampler_defaults.noise_token_id == 30
    lm, _ = run(tmp_path, 1, name="uniform", lm=lm)  # trained on uniform noise again: the saved model forgets it
    assert blockpress.load(tmp_path / "uniform").sampler_defaults.noise_token_id is None


def test_a_quantized_model_is_refused_before_training(tmp_path):
    """Its projections are frozen buffers, and saving it is refused: before, every step ran and the save failed."""
    with pytest.raises(ValueError, match=r"train: the model is quantized \(int8\)"):
        run(tmp_path, 2, lm=tiny_lm().quantize("int8"))
    assert not (tmp_path / "out").exists()


def test_a_float16_model_is_refused_a_full_fine_tune_and_trains_once_widened(tmp_path):
    """AdamW's float16 steps: a float16 full fine-tune went NaN at its first update and was called a divergence ("a
    lower --lr"). Refused before anything changes, naming what trains; the same weights in float32 train."""
    lm = tiny_lm()
    lm.to(dtype="float16")
    settings = dict(lm.generation_config)
    with pytest.raises(ValueError, match=r"^dtype: the model's weights are float16, which a full fine-tune cannot "
                                         r"update .*--autocast-dtype float16.*LoRA adapters over the float16 base"):
        run(tmp_path, 2, lm=lm)
    assert not (tmp_path / "out").exists() and lm.generation_config == settings and lm.dtype == torch.float16
    lm.to(dtype="float32")
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    _, result = run(tmp_path, 2, lm=lm)
    assert all(math.isfinite(x) for x in result.losses) and len(result.losses) == 2
    after = dict(lm.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(before[n], p) for n, p in after.items())


def adapter_gradient(trainer):
    """The true (unscaled) gradient of the adapters on the run's first batch, flattened."""
    batch, noise = trainer._batch(trainer.source, 0)
    trainer._losses(batch, noise, train=True)
    trainer.scaler.unscale_(trainer.optimizer)
    return torch.cat([p.grad.flatten() for _, p in sorted(trainer.model.named_parameters()) if p.requires_grad])


@pytest.mark.parametrize("lora", [{"lora_rank": 4}, {"lora_rank": 4, "quantize": "int8"}])
def test_adapters_over_a_float16_base_train_with_loss_scaling(tmp_path, lora):
    """Adapters over a float16 base (a float16 checkpoint under --lora-rank on a GPU) were refused: their gradient came
    back through float16 activations, where small values underflow. Loss scaling brings it back: a loss made 1,000
    times smaller (as a batch 1,000 times larger makes each token's share) left the unscaled float16 gradient 33% off
    float32's, and 4% scaled; the run trains, its rows saying the scale and the steps skipped while it settles."""
    pytest.importorskip("peft")
    small = {"diffusion_weight": 1e-3, "aux_ar_weight": 1e-3, **lora}

    def trainer(dtype, name, **cfg):
        lm = tiny_lm()
        lm.to(dtype=dtype)
        if "quantize" in cfg:
            lm.quantize(cfg["quantize"])
        return Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, **cfg), tmp_path / name,
                       progress=False)

    exact = adapter_gradient(trainer("float32", "a", **small))
    half = trainer("float16", "b", **small)
    assert half.scaler.is_enabled() and half.scaler.get_scale() == 2.0 ** 16
    scaled = adapter_gradient(half)
    half.scaler = torch.amp.GradScaler("cpu", enabled=False)  # as before: no scaling
    half.optimizer.zero_grad(set_to_none=True)
    unscaled = adapter_gradient(half)
    assert ((scaled - exact).norm() / exact.norm()) < 0.1 < ((unscaled - exact).norm() / exact.norm())

    lm = tiny_lm()
    lm.to(dtype="float16")
    if "quantize" in lora:
        lm.quantize(lora["quantize"])
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    _, result = run(tmp_path, 6, lm=lm, **lora)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x) for x in result.losses) and len(rows) == 6
    scales = [row["loss_scale"] for row in rows]
    # each skipped step halves the scale for the next; a step that is not skipped keeps it (no growth in 6 steps)
    assert scales[0] == 2.0 ** 16 and all(b == a / 2 if row["skipped"] else b == a
                                          for a, b, row in zip(scales, scales[1:], rows))
    assert not rows[-1]["skipped"] and all((row["grad_norm"] is None) == row["skipped"] for row in rows)
    after = dict(lm.model.named_parameters())
    # merged into the base at the end (LoRA), or kept beside the quantized one (QLoRA)
    assert (any(not torch.equal(before[n], p) for n, p in after.items() if n in before)
            or any(p.abs().sum() > 0 for n, p in after.items() if "lora_B" in n))


@pytest.mark.parametrize("value, message", [(-2, "expected -1"), (32, "outside the vocabulary")])
def test_bad_noise_token_id_in_training(tmp_path, value, message):
    with pytest.raises(ValueError, match=f"noise_token_id.*{message}"):
        run(tmp_path, 1, noise_token_id=value)


def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    # AOT autograd without inductor's C++ code generation: it traces what can break in our code (the graph
    # capture, the experts' custom op with its fake and backward) in seconds, where compiling the kernels of a
    # forward and backward took 200 s on a 2-core AVX2 CPU. Inductor itself runs in the generation test.
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, **kw: real_compile(module, **{"backend": "aot_eager", **kw}))
    _, eager = run(tmp_path, 3, "eager")
    _, compiled = run(tmp_path, 3, "compiled", compile=True)
    assert compiled.compile_error is None
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)


def test_a_failed_compile_falls_back_to_eager_and_says_so(tmp_path, monkeypatch):
    def broken_compile(module, **options):
        def call(*args, **kwargs):
            raise RuntimeError("backend exploded\nstack trace")
        return call

    _, eager = run(tmp_path, 3, "eager")
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.warns(UserWarning, match="backend exploded"):
        _, fell_back = run(tmp_path, 3, "fell_back", compile=True)
    assert fell_back.compile_error == "RuntimeError: backend exploded"
    assert fell_back.losses == eager.losses
    rows = [json.loads(line) for line in (tmp_path / "fell_back" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["compile_error"] == "RuntimeError: backend exploded"


@pytest.mark.parametrize("width", [16, 6])  # 16: torch's grouped GEMM; 6 floats: unaligned rows, the per-expert loop
def test_grouped_linear_op_gradients(width):
    """The experts' op (what torch.compile sees) has the same gradients as plain autograd through its pieces."""
    from blockpress.model import ExpertRows, _grouped_linear_eager

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([3, 9, 9, 21], dtype=torch.int32)  # the third expert has no rows
    x = torch.randn(21, width, generator=g, requires_grad=True)
    w = torch.randn(4, 2 * width, width, generator=g, requires_grad=True)
    upstream = torch.randn(21, 2 * width, generator=g)
    torch.ops.blockpress.grouped_linear(x, w, offsets).backward(upstream)
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    rows = [torch.arange(a, b) for a, b in zip([0, 3, 9, 9], offsets.tolist())]
    expected = torch.cat([x[r] @ w[e].T for e, r in enumerate(rows)])
    expected.backward(upstream)
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], w.grad)
    assert not got[1][2].any()  # no rows, no gradient
    assert _grouped_linear_eager(x, w, ExpertRows(offsets)).shape == (21, 2 * width)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.blockpress.grouped_linear(a, b, offsets), (xd, wd))


def test_float16_autocast_trains_with_loss_scaling_and_resumes_exactly(tmp_path):
    """Mixed precision in float16 (GPUs without bf16: a T4, a V100) had no loss scaling. Now a step whose gradient
    overflows the scale is skipped and the scale halved; the first loss is float32's to 1%; the scale reached is saved
    with the run, so a resumed run goes on as the straight one did (a fresh scale would skip steps again)."""
    half = {"cpu_autocast": True, "autocast_dtype": "float16"}
    _, exact = run(tmp_path, 6, "fp32")
    _, straight = run(tmp_path, 6, "straight", **half)
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    skipped = [row["step"] for row in rows if row["skipped"]]
    assert skipped and len(skipped) < 6 and rows[-1]["loss_scale"] == 2.0 ** 16 / 2 ** len(skipped)
    # the first step's weights are the same: float16 arithmetic really ran, and close; a skipped step updates nothing
    assert straight.losses[0] != exact.losses[0] and straight.losses[0] == pytest.approx(exact.losses[0], rel=0.01)
    assert straight.losses[-1] < straight.losses[0] - 0.1
    run(tmp_path, 3, "split", **half)
    state = read_trainer_state(tmp_path / "split" / "trainer_state.pt")
    assert state["scaler"]["scale"] == rows[2]["loss_scale"] / (2 if rows[2]["skipped"] else 1)
    _, rest = run(tmp_path, 6, "split", lm=tiny_lm(seed=9), resume=True, **half)
    assert straight.losses[3:] == pytest.approx(rest.losses, rel=1e-6)


def test_a_gradient_float16_cannot_hold_at_any_scale_stops_the_run(tmp_path):
    """An overflow is the scale's fault until the scale is below 1: then the gradient itself is past float16's range,
    and skipping steps for ever would train nothing. The run stops, saying what to train in."""
    lm = tiny_lm()
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=3, batch_size=4, cpu_autocast=True,
                                                                  autocast_dtype="float16"), tmp_path, progress=False)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    lm.model.embed_tokens.weight.register_hook(lambda grad: grad * math.inf)
    assert trainer.train_step()["skipped"] and trainer.scaler.get_scale() == 1.0  # at 2: skipped, halved
    assert trainer.train_step()["skipped"]
    with pytest.raises(Diverged, match=r"^step 3: the gradient overflows float16 at a loss scale of 0.5, below 1: "
                                       r".* --autocast-dtype bfloat16"):
        trainer.train_step()


@pytest.mark.parametrize("device, cfg, bf16_native, expected", [
    ("cuda", {}, True, torch.bfloat16), ("cuda", {}, False, torch.float16),  # auto: a T4 / V100 gets float16
    ("cuda", {"autocast_dtype": "bfloat16"}, False, torch.bfloat16), ("cuda", {"autocast": False}, True, None),
    ("cpu", {}, False, None), ("cpu", {"cpu_autocast": True}, False, torch.bfloat16),
    ("cpu", {"cpu_autocast": True, "autocast_dtype": "float16"}, True, torch.float16), ("mps", {}, True, None)])
def test_autocast_dtype_auto_takes_bfloat16_where_the_hardware_computes_it(monkeypatch, device, cfg, bf16_native,
                                                                           expected):
    """torch.cuda.is_bf16_supported() counts emulation, so a T4 trained in emulated bf16: "auto" asks for native.
    It reads the current GPU, so the check is made with the run's GPU current (simulated: GPU 0 answers the
    opposite, as on a machine with an A100 and a T4; before, a run on cuda:1 was answered for cuda:0)."""
    import contextlib

    current = [0]

    @contextlib.contextmanager
    def current_gpu(d):
        before, current[0] = current[0], torch.device(d).index
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "device", current_gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or (
        bf16_native if current[0] == 1 else not bf16_native))
    assert autocast_dtype(TrainConfig(**cfg), torch.device("cuda:1" if device == "cuda" else device)) == expected


@pytest.mark.parametrize("native", [True, False])
def test_cpu_autocast_warns_where_bf16_is_emulated(tmp_path, monkeypatch, native):
    import warnings

    import blockpress.train as train

    monkeypatch.setattr(train, "cpu_computes_natively", lambda dtype: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, cpu_autocast=True),
                tmp_path, progress=False)
    assert any("cpu_autocast" in str(w.message) for w in caught) == (not native)


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_a_run_saves_the_dtype_it_trained_in_not_the_one_a_load_widened_from(tmp_path, monkeypatch, lora_rank):
    """lm.save writes a bf16 checkpoint that a CPU without native bf16 loaded as float32 back as bf16; a training
    run saves what it trained (full fine-tune) or merged (LoRA: float32), as documented, whatever the CPU."""
    from blockpress import checkpoint

    if lora_rank:
        pytest.importorskip("peft")
    tiny_lm().to(dtype="bfloat16").save(tmp_path / "base")
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: False)
    lm = blockpress.load(tmp_path / "base")
    assert lm.widened_from == torch.bfloat16
    tc = TrainConfig(steps=1, batch_size=4, lora_rank=lora_rank, warmup_steps=0)
    Trainer(lm, ExampleSource(EXAMPLES, 0), tc, tmp_path / "out", progress=False).train()
    assert saved_dtype(tmp_path / "out") == torch.float32


def test_a_log_line_says_how_long_the_run_has_left(tmp_path, capsys, monkeypatch):
    """The bar shows an ETA; a log (nohup, `| tee`) had none: "train: step 2/6, loss 3.1, 540 tok/s" and nothing
    said whether the run ends in a minute or a day."""
    import re
    import time
    import types

    import blockpress.train as train_module

    # The trainer's clock moves 1 s a step and not otherwise, so the ETAs are exact: a real sleep let a busy
    # machine's slower later steps push the second ETA above the first (a CI run measured 4 s, then 5 s).
    now = [0.0]
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=time.sleep))
    real = Trainer.train_step

    def step_of_one_second(self, *args, **kwargs):
        now[0] += 1.0
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", step_of_one_second)
    tc = TrainConfig(steps=6, batch_size=2, log_every=2, warmup_steps=0)
    Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", progress=True).train()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: step ")]
    etas = [re.search(r", ETA (\d+):(\d\d)$", x) for x in lines]
    assert all(etas[:2]) and etas[2] is None, lines  # the last line: nothing left
    left = [int(m[1]) * 60 + int(m[2]) for m in etas[:2]]
    assert left == [4, 2], lines  # 4 steps of 1 s left after step 2, then 2


def test_without_a_terminal_progress_is_a_line_per_metrics_row(tmp_path, capsys):
    """tqdm draws no bar into a log file (nohup, `| tee`), which then showed nothing between start and end."""
    tc = TrainConfig(steps=6, batch_size=2, log_every=2, warmup_steps=0)
    Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", progress=True).train()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: step ")]
    assert [x.split(",")[0] for x in lines] == ["train: step 2/6", "train: step 4/6", "train: step 6/6"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [f"{r['loss']:.4f}" for r in rows] == [x.split("loss ")[1].split(",")[0] for x in lines]


def test_progress_without_a_stderr_trains_quietly(tmp_path, monkeypatch, capsys):
    """pythonw or a service has sys.stderr None: tqdm's bar failed at the start with an AttributeError, so the run
    trained nothing and saved nothing."""
    monkeypatch.setattr(sys, "stderr", None)
    tc = TrainConfig(steps=2, batch_size=2, log_every=1, warmup_steps=0)
    result = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", progress=True).train()
    assert result.steps == 2 and (tmp_path / "run" / "model.safetensors").is_file()
    assert capsys.readouterr().out == ""


def test_the_bar_says_when_the_run_saves_or_evaluates(tmp_path, monkeypatch):
    """A large model's save or evaluation takes minutes, and the bar stood still at its step meanwhile, as if hung:
    its label says the phase while it runs, and "train" again after."""
    labels, phases = [], []

    class Bar:
        disable = False  # (drawn: a terminal)

        def set_description(self, text):
            labels.append(text)

        def set_postfix(self, **_):
            pass

        def update(self, _):
            pass

        def close(self):
            pass

    real_save, real_evaluate = Trainer.save, Trainer.evaluate

    def save(self, *args, **kwargs):
        phases.append(("save", labels[-1] if labels else None))
        return real_save(self, *args, **kwargs)

    def evaluate(self):
        phases.append(("evaluate", labels[-1] if labels else None))
        return real_evaluate(self)

    monkeypatch.setattr(Trainer, "_progress_bar", lambda self: Bar())
    monkeypatch.setattr(Trainer, "save", save)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    tc = TrainConfig(steps=4, batch_size=2, save_every=2, eval_every=2, warmup_steps=0)
    Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", heldout=ExampleSource(EXAMPLES, 1),
            progress=True).train()
    assert phases == [("evaluate", "train (evaluating)"), ("save", "train (saving)"),
                      ("save", "train (saving)"), ("evaluate", "train (evaluating)")]
    assert labels[-1] == "train"


def test_buffers_are_registered_in_the_same_order_in_every_process():
    """DDP pairs buffers across processes by their order; the RoPE frequencies were registered in a set's order, which
    follows the per-process string hash (PYTHONHASHSEED 0 and 1 differ), so syncing them broadcast one process's
    sliding-window frequencies into another's full-attention ones."""
    import os
    import subprocess
    import sys

    code = ("import blockpress; lm = blockpress.random_model(blockpress.ModelConfig.preset('tiny'), seed=0); "
            "print([n for n, _ in lm.model.named_buffers()])")
    orders = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1")}
    assert len(orders) == 1, orders


def test_data_parallel_keeps_buffers_unsynced_without_torchs_deprecation_warning():
    """Every torchrun run printed torch 2.13's FutureWarning "`broadcast_buffers` is deprecated" once a process."""
    import warnings

    import torch.distributed as dist

    from blockpress.train import data_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning DDP gives fails the test
            ddp = data_parallel(torch.nn.Linear(2, 2))
        assert ddp.broadcast_buffers is False  # (torch 2.13: the property reads forward_sync_buffers)
    finally:
        dist.destroy_process_group()


def test_the_autoregressive_baseline_trains_under_ddp(tmp_path, monkeypatch):
    """torchrun with --diffusion-weight 0 died at step 2 ("Expected to have finished reduction in the prior
    iteration"): the baseline never runs the decoder, whose self-conditioning parameters got no gradient, and DDP
    waits for every trained parameter. DDP checks that in one process as in two: the Trainer is made to think it is
    one of two (the real group has one), so it wraps its objective in DDP."""
    import torch.distributed as dist

    from blockpress import train

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(train, "_world", lambda: (0, 2))
        lm = tiny_lm()
        before = {k: v.clone() for k, v in lm.model.self_conditioning.state_dict().items()}
        trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=2, batch_size=4, diffusion_weight=0),
                          tmp_path / "out", progress=False)
        assert isinstance(trainer.objective, torch.nn.parallel.DistributedDataParallel)
        assert len(trainer.train().losses) == 2
    finally:
        dist.destroy_process_group()
    # left as one process leaves them: no gradient, so no update (nor weight decay)
    assert all(torch.equal(before[k], v) for k, v in lm.model.self_conditioning.state_dict().items())


def _resumed(tmp_path, name, steps):
    trainer = Trainer(tiny_lm(seed=9), ExampleSource(EXAMPLES, 0), TrainConfig(steps=steps, batch_size=4, lr=3e-3,
                      warmup_steps=5, log_every=1), tmp_path / name, progress=False)
    trainer.resume()
    return trainer


@pytest.mark.parametrize("dies_in", ["weights", "state"])
def test_a_save_that_dies_part_way_leaves_the_previous_one_to_resume(tmp_path, monkeypatch, dies_in):
    """Checkpoints were written in place: a kill during a save left trainer_state.pt (or the weights) truncated, the
    previous save overwritten, and the whole run lost."""
    import blockpress.checkpoint

    _, straight = run(tmp_path, 6, "straight")
    run(tmp_path, 3, "split")
    trainer = _resumed(tmp_path, "split", 6)
    trainer.train_step()  # step 4, then a save that dies after writing part of a file

    def part_then_die(real):
        def write(obj, file, *args, **kwargs):
            Path(file).write_bytes(b"PK\3\4" + b"\0" * 64)
            raise OSError("No space left on device")
        return write

    if dies_in == "weights":
        monkeypatch.setattr(blockpress.checkpoint, "save_file", part_then_die(blockpress.checkpoint.save_file))
    else:
        monkeypatch.setattr(torch, "save", part_then_die(torch.save))
    with pytest.raises(OSError, match="No space left"):
        trainer.save()
    monkeypatch.undo()
    assert not [p.name for p in (tmp_path / "split").iterdir() if p.name.endswith(".tmp")]
    rest = _resumed(tmp_path, "split", 6)
    assert rest.step == 3
    assert rest.train().losses == pytest.approx(straight.losses[3:], rel=1e-6)  # the step-3 save, whole


def _killed_while_moving(tmp_path, monkeypatch, before):
    """The run in tmp_path / "split", its save of step 4 stopped just before `before` was moved into place."""
    import blockpress.files

    run(tmp_path, 3, "split")
    trainer = _resumed(tmp_path, "split", 6)
    trainer.train_step()
    real = os.replace

    def dies_before(src, dst):
        if Path(dst).name == before:
            raise KeyboardInterrupt  # the process stops between the moves
        real(src, dst)

    monkeypatch.setattr(blockpress.files.os, "replace", dies_before)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    monkeypatch.undo()


@pytest.mark.parametrize("before", ["config.json", "model.safetensors", "generation_config.json", "trainer_state.pt"])
def test_resume_finishes_a_save_killed_while_its_files_were_moved(tmp_path, monkeypatch, capsys, before):
    """lm.save committed the weights (and its other files) on its own, before trainer_state.pt's move: a kill between
    left step-4 weights beside the step-3 state, and --resume refused the run, though the step-4 state was whole
    beside it under its temporary name."""
    _, straight = run(tmp_path, 6, "straight")
    _killed_while_moving(tmp_path, monkeypatch, before)
    rest = _resumed(tmp_path, "split", 6)
    # stopped before the first move (config.json's), the save removed what it had staged: the step-3 save stands
    step = 3 if before == "config.json" else 4
    finished = f"the save of step 4 in {tmp_path / 'split'} was stopped while its files were moved"
    assert (finished in capsys.readouterr().err) == (step == 4)
    assert rest.step == step
    assert not [p.name for p in (tmp_path / "split").iterdir() if p.name.endswith(".tmp")]
    assert rest.train().losses == pytest.approx(straight.losses[step:], rel=1e-6)  # that save, whole


def test_a_save_that_fails_while_its_files_move_says_resume_finishes_it(tmp_path, monkeypatch):
    """A rename that failed after the weights had moved said "the run as saved at step 3 is kept", while the folder's
    weights were step 4's (what --model OUT loads); and discarding the staged state made --resume refuse the run.
    The staged files stay for the commit record, the error says so, and --resume finishes the save."""
    import blockpress.files

    _, straight = run(tmp_path, 6, "straight")
    run(tmp_path, 3, "split")
    trainer = _resumed(tmp_path, "split", 6)
    trainer.train_step()
    real = os.replace

    def fails_at_the_state(src, dst):
        if Path(dst).name == "trainer_state.pt":
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(blockpress.files.os, "replace", fails_at_the_state)
    with pytest.raises(OSError, match=r"step 4 is not saved \(its files were being moved into place in .*; --resume "
                                      r"finishes the save\)"):
        trainer.save()
    monkeypatch.undo()
    rest = _resumed(tmp_path, "split", 6)
    assert rest.step == 4
    assert rest.train().losses == pytest.approx(straight.losses[4:], rel=1e-6)


@pytest.mark.parametrize("entry", [["../victim.txt", False], ["{victim}", False], ["../victim.txt", True],
                                   ["linked/victim.txt", False], ["C:/victim.txt", False], [3, False],
                                   ["model.safetensors"], ["model.safetensors", "no"]])
def test_resume_refuses_a_save_record_naming_files_outside_the_run(tmp_path, entry):
    """The record of a killed save is read from the run folder as found, and its removals deleted what it named: a
    run folder someone shared ("resume my run") deleted files outside it ("../x", an absolute path, a name under a
    link to elsewhere). Such a record is refused before anything moves, naming the entry."""
    from blockpress.train import finish_interrupted_save

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir(), outside.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    (outside / "victim.txt").write_text("the user's too")
    (run_dir / "linked").symlink_to(outside)
    (run_dir / "kept.json").write_text("{}")
    (run_dir / ".kept.json.tmp").write_text('{"new": 1}')  # a file the same record would move, listed first
    entry = [entry[0].format(victim=victim), *entry[1:]] if isinstance(entry[0], str) else entry
    torch.save({"step": 7, "commit": [["kept.json", True], entry]}, run_dir / ".trainer_state.pt.tmp")
    with pytest.raises(ValueError, match=r"the record of its interrupted save names .*expected a file's path inside "
                                         r"the folder; nothing was moved or removed"):
        finish_interrupted_save(run_dir)
    assert victim.read_text() == "the user's" and (outside / "victim.txt").read_text() == "the user's too"
    assert (run_dir / "kept.json").read_text() == "{}"  # nothing moved either


def test_resume_leaves_an_older_versions_staged_state_without_a_record(tmp_path):
    """A run folder from before saves kept their record (an older blockpress killed while it saved) holds a staged
    trainer state with no record of the files its save moved: left as it is, and the run resumes from the state in
    place (taken for a save to finish, its missing record was a TypeError)."""
    from blockpress.train import finish_interrupted_save

    torch.save({"step": 1}, tmp_path / "trainer_state.pt")
    torch.save({"step": 2}, tmp_path / ".trainer_state.pt.tmp")
    finish_interrupted_save(tmp_path)
    assert torch.load(tmp_path / "trainer_state.pt")["step"] == 1


def test_weights_and_state_of_different_steps_are_refused(tmp_path, monkeypatch):
    """A kill between the weights' move and trainer_state.pt's left step-4 weights beside step-3 optimizer state,
    which --resume combined silently. Without the staged step-4 state there is no save to finish."""
    _killed_while_moving(tmp_path, monkeypatch, "trainer_state.pt")
    [staged] = (tmp_path / "split").glob(".trainer_state.pt.*.tmp")  # (named by its save's tag)
    staged.write_bytes(b"PK\3\4" + b"\0" * 64)  # cut short
    with pytest.raises(ValueError, match=r"weights in .*split \(model.safetensors\) were saved at step 4, and "
                                         r"trainer_state.pt at step 3: the run was stopped while it saved"):
        _resumed(tmp_path, "split", 6)


def test_an_adapter_save_that_fails_part_way_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """save_adapter wrote adapter_config.json, the weights and its record in place: one stopped part-way left the new
    config (another rank) beside the old weights, a folder that no longer loads."""
    pytest.importorskip("peft")
    import safetensors.torch

    from blockpress.train import add_lora, save_adapter

    folder = tmp_path / "adapter"
    save_adapter(add_lora(tiny_lm().model, rank=2, alpha=4), folder, 2, 4, None)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def part_then_die(tensors, file, *args, **kwargs):
        Path(file).write_bytes(b"\0" * 64)
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", part_then_die)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(add_lora(tiny_lm(seed=1).model, rank=4, alpha=8), folder, 4, 8, None)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_adapter_path_is_refused_by_the_argument_as_lm_saves_is(tmp_path, monkeypatch):
    """save_adapter took its path as given: a NUL byte failed as Python's bare 'embedded null byte', "" wrote the
    adapter into the current folder, and "~/a" or "~nobody/a" into a folder of that name here; each is
    files.expand_user's now, as lm.save's path is, and nothing is written where it is refused."""
    pytest.importorskip("peft")
    from blockpress.train import add_lora, is_adapter_folder, save_adapter

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model = add_lora(tiny_lm().model, rank=2, alpha=4)
    for path, why in [("ad\x00", r"'ad\\x00' holds a NUL byte \(\\x00\), which no file name may"),
                      ("~no-such-user-blockpress/ad", r"'~no-such-user-blockpress/ad' starts with ~no-such-user-blockpress, "
                                                      r"and no home folder is known"),
                      ("", "expected a folder path, got ''")]:
        with pytest.raises(ValueError, match=rf"^save_adapter: {why}"):
            save_adapter(model, path, 2, 4, None)
    assert not any(work.iterdir())
    save_adapter(model, "~/ad", 2, 4, None)
    assert not any(work.iterdir()) and is_adapter_folder(home / "ad")


def test_a_truncated_trainer_state_is_a_clear_error(tmp_path):
    """It was torch's 15-line traceback (PytorchStreamReader failed reading zip archive, EOFError, ...)."""
    from blockpress.train import check_resumable, read_trainer_state

    run(tmp_path, 1, "r")
    state = tmp_path / "r" / "trainer_state.pt"
    whole = state.read_bytes()
    # cut anywhere: in the zip's first entry, its middle, and each byte of its end-of-directory record
    for cut in sorted({0, 1, 30, len(whole) // 3, len(whole) // 2, *range(len(whole) - 30, len(whole))}):
        state.write_bytes(whole[:cut])
        for read in (lambda: check_resumable(tmp_path / "r"), lambda: read_trainer_state(state)):
            with pytest.raises(ValueError, match=r"--resume: .*trainer_state.pt cannot be read \(.*\); the run's "
                                                 "state is damaged"):
                read()


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_resume_with_a_model_of_another_shape_names_the_fields(tmp_path, lora_rank):
    """A full fine-tune's was torch's "size of tensor a (256) must match ... (64)" deep in resume; LoRA's named only
    the first of torch's size mismatches."""
    if lora_rank:
        pytest.importorskip("peft")
    cfg = TrainConfig(steps=4, batch_size=4, lora_rank=lora_rank)
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
    trainer.train_step()
    trainer.save()  # mid-run: resumable
    width = trainer.lm.config.text.hidden_size
    other = Trainer(tiny_lm(hidden_size=width // 2), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=rf"--resume: the (weights|LoRA adapters) in .*run do not fit this (base )?"
                                         rf"model.*\(.*hidden_size {width} \(this model: {width // 2}\)"):
        other.resume()
    # a field that adds weights without changing a width: attention_bias's biases failed deep in torch (or, paired
    # off by position, could copy one tensor into another of its shape)
    for field, value in (("attention_bias", True),):
        other = Trainer(tiny_lm(**{field: value}), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
        with pytest.raises(ValueError, match=rf"--resume: .* do not fit this (base )?model.*{field} {not value}"):
            other.resume()
    again = Trainer(tiny_lm(seed=3, tie_word_embeddings=False), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run",
                    progress=False)
    again.resume()  # a model of the run's shape (text_config's tie_word_embeddings changes no weight): resumed
    assert again.step == 1


def test_resume_pairs_saved_weights_by_name(tmp_path):
    """A run saved before its state recorded a field that adds weights has no shape to refuse another model by: the
    weights are matched by name, and one this model lacks (or holds in another shape) is named."""
    cfg = TrainConfig(steps=4, batch_size=4)
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
    trainer.train_step()
    trainer.save()
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=False)
    del state["base_shape"]["attention_bias"]  # as a run saved before it was recorded
    torch.save(state, tmp_path / "run" / "trainer_state.pt")
    other = Trainer(tiny_lm(attention_bias=True), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"do not fit this model \(layers\.0\.self_attn\.bias\.k_proj: none saved, \(\d+,\) in "
                                         r"this model\)"):
        other.resume()


def test_a_cache_filled_before_a_training_step_is_refused_after(tmp_path):
    """Training changes the weights in place; a conversation's cache from before held keys of the old weights and
    was continued silently (lm.to and quantize already marked their changes)."""
    lm = tiny_lm()
    prompt = torch.tensor([[2, 5, 6]])
    out = lm.generate(prompt, max_new_tokens=4, return_cache=True, seed=0)
    lm.generate(torch.tensor([[7]]), max_new_tokens=4, cache=out.cache, seed=0)  # before training: continued
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), TrainConfig(steps=1, batch_size=4, warmup_steps=1), tmp_path / "o",
                      progress=False)
    trainer.train_step()
    with pytest.raises(ValueError, match="cache"):
        lm.generate(torch.tensor([[7]]), max_new_tokens=4, cache=out.cache, seed=0)


def test_windows_of_running_text_start_with_bos_as_generation_prompts_do():
    """A text prompt is generated after BOS (encode_prompt), and raw-text windows were trained without one: a tiny
    model that had learned "the cat sat on the mat. " to a loss of 0.09 garbled it after the BOS it had never seen."""
    import numpy as np

    from blockpress.data import TokenShards
    from blockpress.train import ShardSource

    shards = TokenShards.of_tokens(np.arange(3, 200))
    cfg = TrainConfig(steps=1, batch_size=6, prompt_min=2, prompt_max=5)
    bare, after_bos = ShardSource(shards, cfg, 8).batch(0, 6), ShardSource(shards, cfg, 8, bos=2).batch(0, 6)
    for window, example in zip(bare, after_bos, strict=True):  # the same draws, BOS first
        assert example.prompt == [2, *window.prompt] and example.response == window.response
    assert ShardSource(shards, cfg, 8, bos=2).positions == ShardSource(shards, cfg, 8).positions + 1
    with_bos = TokenShards.of_tokens(np.array([2] * 200))  # shards that hold BOS already: not twice
    assert all(e.prompt.count(2) == len(e.prompt) and len(e.prompt) <= 5
               for e in ShardSource(with_bos, cfg, 8, bos=2).batch(0, 6))


def test_running_text_windows_are_drawn_as_long_as_max_canvases_keeps():
    """With --max-canvases under --response-canvases a window was drawn whole and cut in make_batch: text long
    enough for every window trained was refused, and the start-up line counted the cut tokens as covered."""
    import numpy as np

    from blockpress.data import TokenShards
    from blockpress.train import ShardSource

    cfg = TrainConfig(steps=1, batch_size=4, prompt_min=4, prompt_max=8, response_canvases=8, max_canvases=1)
    source = ShardSource(TokenShards.of_tokens(np.arange(3, 103)), cfg, 16)  # 100 tokens: 8 + 16 fit, 8 + 128 not
    source.check_length("--data short.bin")
    assert source.canvases == 1 and source.positions == 8 + 16
    assert {len(e.response) for e in source.batch(0, 4)} == {16}
    with pytest.raises(ValueError, match=r"fewer than the longest window of running text, 40 \(a prompt of up to 8 "
                                         r"tokens, then 2 canvases of 16\)"):
        ShardSource(TokenShards.of_tokens(np.arange(3, 33)), replace(cfg, max_canvases=2), 16).check_length("it")


def test_settings_a_run_cannot_apply_are_named(tmp_path):
    """Taken silently, each trained exactly as without it: eval_batches with nothing held out, the diffusion loss's
    settings with diffusion_weight 0, and autocast_dtype where no mixed precision runs (a CPU run without
    cpu_autocast). Each is said; warned, not refused, so that a run saved with one resumes (a float16 run resumed
    with --no-autocast, or one saved before this check)."""
    import warnings

    lm = tiny_lm()
    source = ExampleSource(EXAMPLES, 0)

    def said(name, **settings):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(lm, source, TrainConfig(steps=1, batch_size=4, **settings), tmp_path / name, progress=False)
        return [str(w.message) for w in caught if "ignored" in str(w.message)]

    assert said("plain") == [] and said("none", eval_batches=0) == []
    assert said("eval", eval_batches=9) == ["eval_batches 9: this run has no held-out data to evaluate; ignored"]
    for setting, shown in (({"reweight": True}, "reweight True"), ({"self_conditioning_prob": 1.0},
                           "self_conditioning_prob 1.0"), ({"t_eps": 0.4}, "t_eps 0.4")):
        assert said("ar", diffusion_weight=0.0, **setting) == [
            f"{shown}: a setting of the diffusion loss, which diffusion_weight 0 turns off; ignored"]
        assert said("diffusion", **setting) == []  # (with the diffusion loss on, each applies)
    assert said("cpu", autocast_dtype="float16") == [
        "autocast_dtype float16: the dtype of a mixed precision this run on cpu does not use (without --cpu-autocast); "
        "ignored"]
    assert said("mixed", autocast_dtype="bfloat16", cpu_autocast=True) == []


def _torchrun_here(monkeypatch, local_rank, gpus):
    """torchrun's environment for process `local_rank` of two, on a machine with `gpus` GPUs (stand-ins): what
    init_distributed asks torch.cuda and torch.distributed is recorded, nothing is joined."""
    import blockpress.train as train

    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("current", index))
    monkeypatch.setattr(train.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(train.dist, "init_process_group", lambda backend, **kw: calls.setdefault("backend", backend))
    return calls


def test_torchrun_on_cuda_gives_each_process_its_own_gpu(monkeypatch):
    """--device cuda is the current GPU, GPU 0 in every process unless each makes its own current: every rank
    loaded onto GPU 0, which NCCL refuses (Duplicate GPU detected)."""
    from blockpress.train import init_distributed

    calls = _torchrun_here(monkeypatch, local_rank=1, gpus=2)
    assert init_distributed("cuda") == "cuda:1"
    assert calls == {"current": 1, "backend": "nccl"}


def test_torchrun_on_cpu_uses_gloo_on_a_gpu_machine(monkeypatch):
    """nccl takes CUDA tensors alone: a --device cpu run on a machine with GPUs got nccl and failed at its first
    all-reduce."""
    from blockpress.train import init_distributed

    calls = _torchrun_here(monkeypatch, local_rank=1, gpus=2)
    assert init_distributed("cpu") == "cpu"
    assert calls == {"backend": "gloo"}


@pytest.mark.parametrize("device, gpus, message", [
    ("cuda:0", 2, r"device: 'cuda:0' under torchrun, where each process takes the GPU of its LOCAL_RANK \(this one: 1\)"),
    ("cuda", 1, "LOCAL_RANK 1 needs GPU 1, but only 1 CUDA GPU"),
])
def test_torchrun_refuses_gpus_processes_cannot_have(monkeypatch, device, gpus, message):
    from blockpress.train import init_distributed

    calls = _torchrun_here(monkeypatch, local_rank=1, gpus=gpus)
    with pytest.raises(ValueError, match=message):
        init_distributed(device)
    assert calls == {}  # refused before joining anything


def test_a_metrics_row_holds_the_mean_losses_of_the_steps_since_the_row_before(tmp_path):
    """A row every --log-every steps held that one step's losses: the noise of every tenth step, not the trend."""
    tc = TrainConfig(steps=7, batch_size=2, log_every=3, warmup_steps=0)
    result = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", progress=False).train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["steps_averaged"]) for r in rows] == [(3, 3), (6, 3), (7, 1)]
    for row, steps in zip(rows, (result.losses[0:3], result.losses[3:6], result.losses[6:7])):
        assert row["loss"] == pytest.approx(sum(steps) / len(steps))
        assert row["step_loss"] == steps[-1]
    assert len(set(result.losses[0:3])) > 1  # (the mean differs from the step's own)


def test_a_run_stopped_between_rows_logs_the_mean_of_its_unlogged_steps(tmp_path):
    tc = TrainConfig(steps=50, batch_size=2, log_every=4, warmup_steps=0)
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", progress=False,
                      on_step=lambda step, loss: step == 6 and os.kill(os.getpid(), signal.SIGINT))
    result = trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["stopped"] == "interrupted" and rows[-1]["step"] == 6
    assert rows[-1]["steps_averaged"] == 2
    assert rows[-1]["loss"] == pytest.approx(sum(result.losses[4:6]) / 2)


def test_a_trainer_with_several_mistakes_names_the_first_in_its_order(tmp_path):
    """The Trainer's refusals come in one order, each before anything changes: the evaluation settings, then the
    model's weights, then the data against the context, then the noise token; the model's settings untouched."""
    long = [Example([2] * 100, [10] * 8)]  # more than the model's context of 64
    lm = tiny_lm(max_position_embeddings=64)
    settings = dict(lm.generation_config)
    half = tiny_lm(max_position_embeddings=64)
    half.to(dtype="float16")
    for model, examples, cfg, message in (
            (half, EXAMPLES, dict(eval_every=2, noise_token_id=99), r"^eval_every: "),
            (half, long, dict(noise_token_id=99), r"^dtype: the model's weights are float16"),
            (lm, long, dict(noise_token_id=99), r"^example 0: "),
            (lm, EXAMPLES, dict(noise_token_id=99), r"^noise_token_id: 99 is outside the vocabulary \(size 32\)")):
        tc = TrainConfig(steps=1, batch_size=4, **cfg)
        with pytest.raises(ValueError, match=message):
            Trainer(model, ExampleSource(examples, 0), tc, tmp_path / "out", progress=False)
    assert lm.generation_config == settings and lm.model.training is False and not (tmp_path / "out").exists()


def test_a_log_line_gives_the_held_out_loss_of_its_row(tmp_path, capsys):
    """Without a terminal, a metrics row that evaluated the held-out data says its eval loss in its line, as
    metrics.jsonl holds it, and a row that did not says none."""
    tc = TrainConfig(steps=4, batch_size=2, log_every=1, eval_every=2, eval_batches=1, warmup_steps=0)
    Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), tc, tmp_path / "run", heldout=ExampleSource(EXAMPLES[:2], 0),
            progress=True).train()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: step ")]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    said = [x.split(", eval loss ")[1].split(",")[0] if ", eval loss " in x else None for x in lines]
    assert said == [None if "eval_loss" not in r else f"{r['eval_loss']:.4f}" for r in rows]
    assert said[0] is None and said[1] is not None and said[3] is not None


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_metrics_row_that_cannot_be_written_names_the_file_and_what_out_keeps(tmp_path):
    """A disk that filled between saves ended the run with "[Errno 28] No space left on device", naming no file and
    not what `out` kept. /dev/full stands in for the full disk under metrics.jsonl."""
    import errno

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(OSError) as caught:
        lm = tiny_lm()
        tc = TrainConfig(steps=3, batch_size=4, warmup_steps=1, log_every=2)
        Trainer(lm, ExampleSource(EXAMPLES, 0), tc, out, progress=False).train()
    kept = f"{out} holds no model, only the metrics.jsonl of the steps logged; a new run with this --out replaces it"
    assert str(caught.value) == f"{out / 'metrics.jsonl'}: No space left on device; the run stops at step 2 ({kept})"
    assert caught.value.errno == errno.ENOSPC


# From a mutation hunt over train.py: settings at values the defaults never exercise, the optimizer stepping at the
# scheduled rate (not only logging it), running-text windows over prompt_min..prompt_max.
def test_noise_levels_self_conditioning_and_absorbing_token_follow_their_settings():
    batch = make_batch(EXAMPLES * 64, 8, 0, 1)
    g = torch.Generator().manual_seed(0)
    noise = draw_noise(batch, 32, TrainConfig(t_eps=0.4), g)
    assert noise.t.min() >= 0.4 and noise.t.max() <= 0.6  # U(eps, 1 - eps)
    assert not draw_noise(batch, 32, TrainConfig(self_conditioning_prob=0.0), g).self_condition.any()
    assert draw_noise(batch, 32, TrainConfig(self_conditioning_prob=1.0), g).self_condition.all()
    sc = draw_noise(batch, 32, TrainConfig(self_conditioning_prob=0.2), g).self_condition.float().mean()
    assert 0.1 < sc < 0.3
    assert (draw_noise(batch, 32, TrainConfig(noise_token_id=0), g).tokens == 0).all()  # token 0 is a token too


def test_the_logged_loss_weighs_the_ar_loss_by_its_weight(tmp_path):
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=0)
    cfg = TrainConfig(steps=1, batch_size=4, lr=1e-3, warmup_steps=1, log_every=1, aux_ar_weight=0.25,
                      diffusion_weight=2.0)
    row = Trainer(lm, ExampleSource(EXAMPLES, 0), cfg, tmp_path / "out", progress=False).train_step()
    assert math.isclose(row["loss"], 2.0 * row["diffusion_loss"] + 0.25 * row["ar_loss"], rel_tol=1e-6)


def test_each_step_updates_at_the_learning_rate_of_the_schedule(tmp_path):
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=0)
    cfg = TrainConfig(steps=20, batch_size=4, lr=1e-2, warmup_steps=10, log_every=1)
    trainer = Trainer(lm, ExampleSource(EXAMPLES, 0), cfg, tmp_path / "out", progress=False)
    for step in range(3):
        row = trainer.train_step()
        assert row["lr"] == lr_at(cfg, step)
        assert all(group["lr"] == row["lr"] for group in trainer.optimizer.param_groups)
    # AdamW's first update is lr * sign-like (m / sqrt(v) = +-1 per element): its size shows the rate used
    lm2 = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=0)
    trainer2 = Trainer(lm2, ExampleSource(EXAMPLES, 0), cfg, tmp_path / "out2", progress=False)
    before = {n: p.detach().clone() for n, p in lm2.model.named_parameters()}
    trainer2.train_step()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in lm2.model.named_parameters())
    assert moved < 1.5 * lr_at(cfg, 0)  # 1e-3 (+ weight decay), not --lr's 1e-2


def test_window_prompts_span_prompt_min_to_prompt_max_and_an_exact_fit_is_taken():
    import numpy as np

    from blockpress.data import TokenShards
    from blockpress.train import ShardSource

    cfg = TrainConfig(prompt_min=2, prompt_max=5, response_canvases=1, seed=0)
    source = ShardSource(TokenShards.of_tokens(np.arange(3, 200)), cfg, 4)
    lengths = {len(e.prompt) for step in range(20) for e in source.batch(step, 8)}
    assert lengths == {2, 3, 4, 5}
    ShardSource(TokenShards.of_tokens(np.arange(3, 3 + 5 + 4)), cfg, 4).check_length("it")  # 9 tokens: 5 + 4


def test_each_process_draws_its_own_attention_dropout():
    """Under torchrun each process seeds its dropout draws by (seed, step, rank): processes that drew alike would drop
    the same attention positions in their halves of the batch."""
    from types import SimpleNamespace

    draws = []
    for rank in (0, 1, 0):
        trainer = SimpleNamespace(attention_dropout=0.1, lm=SimpleNamespace(device=torch.device("cpu")),
                                  cfg=SimpleNamespace(seed=0), world=2, rank=rank)
        with Trainer._dropout_draws(trainer, 5):
            draws.append(torch.rand(8))
    assert not torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])


def test_a_lora_target_names_a_layer_or_the_end_of_one_after_a_dot():
    """peft's rule: "q_proj" adapts every ...self_attn.q_proj; "_proj" is no layer's name (nor "proj"'s end after a
    dot), and was taken by the check, to fail later in peft's own words."""
    from blockpress.train import check_lora_targets

    model = tiny_lm().model
    check_lora_targets(model, ["q_proj", "layers.0.self_attn.q_proj"])
    for target in ("_proj", "roj", "self_attn"):
        with pytest.raises(ValueError, match=f"^lora_targets: this model has no {target} layer"):
            check_lora_targets(model, [target])


def test_a_trainer_applies_its_settings_dtype_to_the_model_it_trains_and_saves(tmp_path):
    """TrainConfig(dtype="float32") given to a Trainer over a bfloat16 model was recorded in train_config.json and
    ignored: the run trained (AdamW rounding small updates away) and saved bfloat16 weights, without a word."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), seed=0, dtype="bfloat16")
    cfg = TrainConfig(steps=1, batch_size=2, warmup_steps=0, dtype="float32")
    Trainer(lm, ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False).train()
    assert lm.dtype == torch.float32 and saved_dtype(tmp_path / "run") == torch.float32
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["dtype"] == "float32"
    # a float16 model is refused for a full fine-tune unless the settings train it in another dtype
    half = blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8), dtype="float16")
    with pytest.raises(ValueError, match="dtype: the model's weights are float16"):
        Trainer(half, ExampleSource(EXAMPLES, 0), replace(cfg, dtype=None), tmp_path / "half", progress=False)
    Trainer(half, ExampleSource(EXAMPLES, 0), cfg, tmp_path / "half", progress=False)
    assert half.dtype == torch.float32
    # a quantized model cannot be cast: refused by name, the model left as it was
    quantized = tiny_lm().quantize("int8")
    with pytest.raises(ValueError, match=r"dtype: the model is quantized \(int8\) in float32"):
        Trainer(quantized, ExampleSource(EXAMPLES, 0), TrainConfig(lora_rank=2, quantize="int8", dtype="bfloat16"),
                tmp_path / "q", progress=False)
    assert quantized.dtype == torch.float32
    with pytest.raises(ValueError, match="merged_dtype: bfloat16 is not the run's dtype float32"):
        Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "m", merged_dtype=torch.bfloat16)


def test_a_lora_trainers_settings_dtype_is_its_merged_checkpoints(tmp_path):
    """A LoRA run's dtype setting is the dtype of its merged checkpoint, as `blockpress train --dtype` saves it (a
    Trainer merged into float32 whatever the settings said)."""
    pytest.importorskip("peft")
    cfg = TrainConfig(steps=1, batch_size=2, warmup_steps=0, lora_rank=2, dtype="bfloat16")
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
    assert trainer.merged_dtype == torch.bfloat16
    trainer.train()
    assert saved_dtype(tmp_path / "run") == torch.bfloat16


def test_a_trainer_reads_the_heldout_data_its_settings_name(tmp_path):
    """TrainConfig(heldout_data=..., heldout=...) given to a Trainer without heldout= were recorded in
    train_config.json (which --resume reads back as the run's) and ignored: no held-out evaluation ran."""
    from blockpress.data import TokenShards, write_shard
    from blockpress.train import ShardSource

    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt_ids": e.prompt, "response_ids": e.response}) + "\n"
                            for e in EXAMPLES[:2]))
    cfg = TrainConfig(steps=1, batch_size=2, warmup_steps=0, eval_batches=1, heldout_data=str(held))
    result = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False).train()
    assert [step for step, _ in result.eval_losses] == [1]
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["heldout_data"] == str(held.resolve())
    # the heldout fraction is split off the examples, as `blockpress train` splits --data
    many = [Example([2, 3 + i % 20], [4 + i % 25, 5]) for i in range(200)]
    split = Trainer(tiny_lm(), ExampleSource(many, 0), TrainConfig(heldout=0.25), tmp_path / "split", progress=False)
    assert split.heldout is not None and len(split.source.examples) + len(split.heldout.examples) == 200
    assert 0 < len(split.heldout.examples) < 100
    # running text takes its held-out text or shards
    write_shard(tmp_path / "held.bin", [list(range(3, 30))], 32)
    text = ShardSource(TokenShards.of_tokens(np.arange(3, 30)), TrainConfig(prompt_min=2, prompt_max=4), 8)
    shards = Trainer(tiny_lm(), text, TrainConfig(prompt_min=2, prompt_max=4, heldout_data=str(tmp_path / "held.bin")),
                     tmp_path / "text", progress=False)
    assert isinstance(shards.heldout, ShardSource) and shards.heldout.shards.tokens == 27
    for bad, match in ((TrainConfig(heldout=0.1, heldout_data=str(held)), "heldout/heldout_data: .* give one of them"),
                       (TrainConfig(heldout_data=str(tmp_path / "held.bin")), "heldout_data .*: not JSONL examples")):
        with pytest.raises(ValueError, match=match):
            Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), bad, tmp_path / "bad", progress=False)
    with pytest.raises(ValueError, match="heldout: a fraction of JSONL examples"):
        Trainer(tiny_lm(), text, TrainConfig(prompt_min=2, prompt_max=4, heldout=0.1), tmp_path / "bad",
                progress=False)
    with pytest.raises(ValueError, match="heldout_data .*held.jsonl: JSONL examples"):
        Trainer(tiny_lm(), text, TrainConfig(prompt_min=2, prompt_max=4, heldout_data=str(held)), tmp_path / "bad",
                progress=False)


def test_a_heldout_fraction_that_holds_none_out_is_warned_of_once_a_run(tmp_path):
    """`blockpress train` warned of a --heldout that holds out none of a few examples (no held-out loss); a Trainer
    given the same settings split them alike and said nothing. It warns, once a run (not again as it trains)."""
    cfg = TrainConfig(steps=1, batch_size=2, warmup_steps=0, heldout=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", progress=False)
        assert trainer.heldout is None
        trainer.train()
    said = [w for w in caught if "holds out none" in str(w.message)]
    # (the fraction was applied: not "; ignored", as the settings a run cannot apply are)
    assert [str(w.message) for w in said] == ["heldout 0.02: holds out none of 4 examples (each is held out by a hash "
                                              "of its content), so this run has no held-out loss; a larger fraction "
                                              "or held-out data of its own gives one"]
    assert said[0].filename == __file__  # the caller's line, as warn_user attributes it


def test_a_heldout_source_of_ones_own_beside_a_heldout_fraction_is_taken(tmp_path):
    """Recording the split (the held-out examples' digests, for --resume) read `.examples` of any held-out source: a
    source of one's own with batch() alone, given beside TrainConfig(heldout=...), ended the Trainer in an
    AttributeError where it had been taken. A split of ExampleSources is recorded; a source of one's own is not."""

    class Mine:
        def batch(self, step, size):
            return [EXAMPLES[step % len(EXAMPLES)]] * size

    cfg = TrainConfig(steps=1, batch_size=2, warmup_steps=0, heldout=0.25)
    trainer = Trainer(tiny_lm(), ExampleSource(EXAMPLES, 0), cfg, tmp_path / "run", heldout=Mine(), progress=False)
    assert trainer.heldout is not None and "heldout" not in trainer.data
    made = Trainer(tiny_lm(), ExampleSource(EXAMPLES * 8, 0), cfg, tmp_path / "made", progress=False)
    assert isinstance(made.data.get("heldout"), list)
