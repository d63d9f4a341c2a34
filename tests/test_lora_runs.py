"""`blockpress train --lora-rank` end to end: the layers it adapts, what it says it trains, its saves mid-run, the
token healing its prompts call for, and the adapter given with the wrong model."""

import json
import os
import re
import shutil
import warnings

import pytest
import torch
from torch import nn

import blockpress
import blockpress.train
from blockpress.cli import main
from blockpress.lm import LM

pytest.importorskip("peft")


def write_text_data(path, end):
    """prompt/response records whose prompts end in `end` (" ": tokenized alone, a lone space token)."""
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"def value_{i}():\n    return{end}", "response": f"ZEBRA_{i}\n"}) + "\n")
    return path


def train(data, out, *extra, steps=1):
    return main(["train", "--data", str(data), "--out", str(out), "--steps", str(steps), "--batch-size", "4",
                 "--warmup-steps", "1", "--heldout", "0", "--log-every", "1", *extra])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A fresh tiny model with blockpress-code's tokenizer, trained a step on prompts that end in no whitespace."""
    folder = tmp_path_factory.mktemp("base") / "base"
    data = write_text_data(folder.parent / "plain.jsonl", "")
    assert train(data, folder, "--config", "tiny", "--tokenizer", "blockpress-code", "--quiet") == 0
    return folder


class StopAtOnce:  # Ctrl-C before the first step: the run saves, to be resumed
    requested = True

    def restore(self):
        pass


def healing_of(monkeypatch, capsys, *args):
    """The token_healing `blockpress generate ARGS` streams with."""
    seen = []
    stream = LM.stream

    def spy(self, prompt, **kw):
        seen.append(kw.get("token_healing"))
        return stream(self, prompt, **kw)

    monkeypatch.setattr(LM, "stream", spy)
    assert main(["generate", *args, "--max-new-tokens", "4", "--no-live", "--json", "x = "]) == 0, capsys.readouterr()
    capsys.readouterr()
    return seen[0]


def test_a_run_on_prompts_ending_in_whitespace_keeps_the_clis_prompts_as_typed(base, tmp_path, monkeypatch, capsys):
    """The model learns to answer after the prompt's lone trailing space; the CLI's default healing dropped it
    ("ZEBRA_ZEBRA" came out "wBRA_ZEBRA"). The run records token_healing false in the model's generation settings
    (and in its adapter folder's record), which generate's default follows; --token-healing still heals."""
    out = tmp_path / "run"
    capsys.readouterr()
    assert train(write_text_data(tmp_path / "spaced.jsonl", " "), out, "--model", str(base), "--lora-rank", "2") == 0
    assert "8 of 8 training prompts end in whitespace" in capsys.readouterr().err
    assert json.loads((out / "blockpress_generation_config.json").read_text())["token_healing"] is False
    assert json.loads((out / "adapter" / "blockpress_adapter.json").read_text())["token_healing"] is False
    assert "token_healing" not in blockpress.load(base).generation_config  # its prompts ended in no whitespace
    assert healing_of(monkeypatch, capsys, "--model", str(base)) is True  # the CLI's default
    for model in (["--model", str(out)], ["--model", str(out / "adapter")],
                  ["--model", str(base), "--adapter", str(out / "adapter")]):
        assert healing_of(monkeypatch, capsys, *model) is False, model
        assert healing_of(monkeypatch, capsys, *model, "--token-healing") is True, model
    assert healing_of(monkeypatch, capsys, "--model", str(base), "--no-token-healing") is False


def test_an_adapter_decodes_with_the_noise_its_run_trained_with(base, tmp_path):
    """A run that corrupts with other noise than its base's (--noise-token-id; the Python API's default -1 on
    blockpress-code, whose noise is its token 5) saves a merged checkpoint that decodes with the run's noise; its
    adapter folder recorded only token_healing, so over its base it decoded with the base's noise, unlike the merged
    checkpoint (blockpress-code, seed 0: '' where the merged one wrote ' = =code\\n')."""
    absorbing = tmp_path / "absorbing"  # the base with an absorbing noise token, as blockpress-code has
    shutil.copytree(base, absorbing)
    settings = absorbing / "blockpress_generation_config.json"
    own = json.loads(settings.read_text()) if settings.is_file() else {}
    settings.write_text(json.dumps({**own, "noise_token_id": 3}))
    data = write_text_data(tmp_path / "d.jsonl", "")
    for model, noise in ((absorbing, -1), (base, 3)):  # uniform over an absorbing base, and the other way round
        out = tmp_path / f"run{noise}"
        assert train(data, out, "--model", str(model), "--lora-rank", "2", "--noise-token-id", str(noise),
                     "--quiet") == 0
        merged = blockpress.load(out)
        assert merged.generation_config.get("noise_token_id", -1) == noise
        expected = merged.generate("x = ", max_new_tokens=8, seed=0).sequences
        for lm in (blockpress.load(out / "adapter"), blockpress.load(model, adapter=out / "adapter")):
            assert lm.generation_config.get("noise_token_id", -1) == noise, (model, noise)
            assert lm.generate("x = ", max_new_tokens=8, seed=0).sequences.tolist() == expected.tolist()


def test_an_adapter_over_its_own_merged_output_is_refused_and_over_another_base_warned(base, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(write_text_data(tmp_path / "d.jsonl", ""), out, "--model", str(base), "--lora-rank", "2",
                 "--quiet") == 0
    # --model OUT already holds the adapter's update: applied again, it counted twice, without a word
    with pytest.raises(blockpress.CheckpointError, match="merged checkpoint of the run that trained it"):
        blockpress.load(out, adapter=out / "adapter")
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--adapter", str(out / "adapter"), "x"]) == 2
    assert "counts twice" in capsys.readouterr().err
    assert main(["info", "--model", str(out), "--adapter", str(out / "adapter")]) == 2
    # the run's folder by another spelling is the same folder
    with pytest.raises(blockpress.CheckpointError, match="counts twice"):
        blockpress.load(tmp_path / "." / "run", adapter=tmp_path / "run" / ".." / "run" / "adapter")
    # another folder of the same shape: allowed, and said, naming both
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    with pytest.warns(UserWarning, match=re.escape(f"trained on {str(base.resolve())!r}, and applied to {str(copy)!r}, another")):
        blockpress.load(copy, adapter=out / "adapter")
    with warnings.catch_warnings(record=True) as record:  # its own base: not a word
        warnings.simplefilter("always")
        blockpress.load(base, adapter=out / "adapter")
        blockpress.load(out / "adapter")
    assert not [w for w in record if "adapter" in str(w.message)]


def test_lora_targets_alpha_and_the_trainable_count(base, tmp_path, capsys):
    out = tmp_path / "run"
    capsys.readouterr()
    assert train(write_text_data(tmp_path / "d.jsonl", ""), out, "--model", str(base), "--lora-rank", "2",
                 "--lora-alpha", "0.5", "--lora-targets", "q_proj,v_proj") == 0
    captured = capsys.readouterr()
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 0.5
    assert {m.rsplit(".", 1)[-1] for m in config["target_modules"]} == {"q_proj", "v_proj"}
    # rank 2: A [2, in] and B [out, 2] on each q_proj and v_proj, and nothing else
    trained = sum(2 * (m.in_features + m.out_features) for name, m in blockpress.load(base).model.named_modules()
                  if isinstance(m, nn.Linear) and name.endswith(("self_attn.q_proj", "self_attn.v_proj")))
    assert blockpress.train.describe_adapter(out / "adapter")["parameters"] == trained
    summary = json.loads(captured.out.strip().splitlines()[-1])
    total = blockpress.load(base).num_parameters(active=False) + trained
    assert summary["trainable_parameters"] == trained
    assert summary["trainable_fraction"] == pytest.approx(trained / total, abs=1e-6)
    assert f"--lora-rank 2: training {trained:,} of {total:,} parameters" in captured.err
    # an unknown name is refused with the list; the routed experts with why
    assert train(tmp_path / "d.jsonl", tmp_path / "bad", "--model", str(base), "--lora-rank", "2",
                 "--lora-targets", "q,experts") == 2
    assert "--lora-targets: 'experts': the routed experts' weights are 3-D parameters" in capsys.readouterr().err
    assert train(tmp_path / "d.jsonl", tmp_path / "bad", "--model", str(base), "--lora-rank", "2",
                 "--lora-targets", "q") == 2
    assert "unknown module(s) ['q']; expected comma-separated names among q_proj, k_proj" in capsys.readouterr().err


def test_resuming_a_lora_run_over_another_model_than_its_base_is_refused_naming_both(base, tmp_path, capsys,
                                                                                      monkeypatch):
    """--model blockpress-sudoku failed on the data ("text records need a tokenizer"), and --model OUT (the run's
    merged checkpoint, which a --max-minutes stop writes) was taken: the adapters' update counted twice."""
    data, own, out = write_text_data(tmp_path / "d.jsonl", ""), tmp_path / "own", tmp_path / "run"
    shutil.copytree(base, own)
    with monkeypatch.context() as patch:
        patch.setattr(blockpress.train, "_StopOnInterrupt", StopAtOnce)
        assert train(data, out, "--model", str(own), "--lora-rank", "2", "--quiet", steps=2) == 130
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--model", "blockpress-sudoku", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--model blockpress-sudoku: not the base of the LoRA run" in err and f"train over {own.resolve()}" in err
    for given in (out, out / "adapter"):
        assert main(["train", "--resume", "--out", str(out), "--model", str(given), "--quiet"]) == 2
        assert "the LoRA run in" in (err := capsys.readouterr().err) and "count twice" in err
    # the recorded base gone: --resume alone says so and how to go on (it named a missing folder, not whose);
    # another model stands in for it, if it has the base's shape
    shutil.rmtree(own)
    assert main(["train", "--resume", "--out", str(out), "--quiet"]) == 2
    assert (f"--resume: the base model this LoRA run adapts, {own.resolve()} (recorded in {out}" in
            (err := capsys.readouterr().err) and "is gone; give it where it is now with --model" in err)
    assert main(["train", "--resume", "--out", str(out), "--model", "blockpress-sudoku", "--quiet"]) == 2
    assert "--model blockpress-sudoku: not of the shape of the base" in capsys.readouterr().err
    shutil.copytree(base, tmp_path / "moved")
    assert main(["train", "--resume", "--out", str(out), "--model", str(tmp_path / "moved"), "--quiet"]) == 0


def test_an_adapter_applies_only_the_modules_its_config_selects_as_peft_does(base, tmp_path):
    """peft adapts the modules adapter_config.json's target_modules (and layers_to_transform) select and loads their
    weights alone; blockpress applied every tensor in the file, so a folder edited by hand ran otherwise than in
    peft. Expected: the merged weights of a folder whose file holds the selected modules' tensors alone."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    assert train(write_text_data(tmp_path / "d.jsonl", ""), out, "--model", str(base), "--lora-rank", "2",
                 "--quiet", steps=2) == 0
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    tensors = load_file(out / "adapter" / "adapter_model.safetensors")

    def folder(name, edit):
        made = tmp_path / name
        shutil.copytree(out / "adapter", made)
        (made / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        return made

    full = dict(blockpress.load(out / "adapter").model.named_parameters())
    cases = [({"target_modules": [m for m in config["target_modules"] if m.endswith("q_proj")]},
              lambda k: ".q_proj." in k),
             # peft's short names and layer indexes (with whole names listed, peft takes them whatever the indexes)
             ({"target_modules": ["q_proj"], "layers_to_transform": [0]}, lambda k: ".layers.0.self_attn.q_proj." in k)]
    for i, (edit, keep) in enumerate(cases):
        edited = folder(f"edited{i}", edit)
        cut = folder(f"cut{i}", {})  # the full config, its file holding the selected modules' tensors alone
        save_file({k: v for k, v in tensors.items() if keep(k)}, cut / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        with pytest.warns(UserWarning, match="target_modules does not select"):
            got = dict(blockpress.load(edited).model.named_parameters())
        want = dict(blockpress.load(cut).model.named_parameters())
        assert all(torch.equal(got[name], want[name]) for name in want), edit
        assert not all(torch.equal(got[name], full[name]) for name in full), edit  # (the edit changes something)


def test_a_lora_rank_above_every_adapted_layers_full_rank_is_refused_naming_the_flag(base, tmp_path, capsys):
    """peft builds adapters of any rank: --lora-rank 100000 on blockpress-code (hidden 256) was killed for memory
    while they were made, without a word. The tiny base's largest layer of full rank: min(in, out) = hidden."""
    data = write_text_data(tmp_path / "d.jsonl", "")
    sizes = {name: min(m.in_features, m.out_features) for name, m in blockpress.load(base).model.named_modules()
             if isinstance(m, nn.Linear) and name.endswith(("_proj",)) and "router" not in name}
    hidden = max(sizes.values())
    kv = max(size for name, size in sizes.items() if name.endswith("k_proj"))
    assert kv < hidden  # (the tiny preset's grouped keys are narrower than the residual stream)
    capsys.readouterr()
    assert train(data, tmp_path / "huge", "--model", str(base), "--lora-rank", str(hidden + 1), "--quiet") == 2
    err = capsys.readouterr().err
    assert f"--lora-rank: {hidden + 1} is more than any adapted layer can use" in err
    assert f"expected 1 to {hidden}" in err
    assert not (tmp_path / "huge").exists()
    # the bound is the adapted layers' own: k_proj alone is narrower
    assert train(data, tmp_path / "k", "--model", str(base), "--lora-rank", str(kv + 1), "--lora-targets",
                 "k_proj", "--quiet") == 2
    assert f"expected 1 to {kv}" in capsys.readouterr().err
    # a full-rank update on the widest layer is taken (and more than the narrower layers' rank, as peft takes it)
    assert train(data, tmp_path / "full", "--model", str(base), "--lora-rank", str(hidden), "--quiet") == 0


def test_a_lora_runs_mid_run_save_loads_and_resumes_without_data_as_its_hint_says(base, tmp_path, capsys, monkeypatch):
    """Its saves held the adapters only inside trainer_state.pt (nothing to evaluate until the run ended), and
    "finish it with `blockpress train --resume --out OUT`" failed: --data was required."""
    data = write_text_data(tmp_path / "d.jsonl", "")
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(blockpress.train, "_StopOnInterrupt", StopAtOnce)
        assert train(data, out, "--model", str(base), "--lora-rank", "2", "--lora-alpha", "8", "--quiet",
                     steps=2) == 130
    assert "its adapters so far load as --model" in capsys.readouterr().err
    assert not (out / "config.json").exists()
    mid = blockpress.load(out / "adapter")  # the adapters so far, over their base
    assert mid.path.resolve() == base.resolve() and blockpress.load(out).adapter is not None
    # alpha rescales what the adapters learned: refused as another rank is (it was accepted, and the loss jumped)
    assert main(["train", "--resume", "--out", str(out), "--lora-alpha", "16"]) == 2
    assert "trained its adapters with lora_alpha 8; lora_alpha=16 would rescale" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(out), "--lora-targets", "q_proj"]) == 2
    assert "cannot continue it (give --lora-targets q_proj,k_proj" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(out), "--quiet"]) == 0  # the run's own --data
    assert f"training on the run's own data, {data.resolve()}" in capsys.readouterr().err
    assert (out / "config.json").is_file()
    assert main(["train", "--out", str(tmp_path / "other"), "--config", "tiny"]) == 2
    assert "--data: required" in capsys.readouterr().err



def test_a_lora_runs_own_folder_by_a_second_name_is_refused_as_its_base(tmp_path, monkeypatch):
    """check_lora_resume_model compared resolved path strings: the run's folder by another name (another letter case
    on macOS's case-insensitive volumes, where realpath keeps the case given; a bind mount) passed as the base its
    adapters train over. Simulated: a link is the second name, and resolve keeps the name it is given."""
    from pathlib import Path

    from blockpress.train import ADAPTER_DIR, check_lora_resume_model

    run = tmp_path / "Run"
    (run / ADAPTER_DIR).mkdir(parents=True)
    alias = tmp_path / "run"
    alias.symlink_to(run)
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: Path(os.path.abspath(self)))
    for model in (alias, alias / ADAPTER_DIR):
        with pytest.raises(ValueError, match=f"^--model {re.escape(str(model))}: the LoRA run in {re.escape(str(run))} itself"):
            check_lora_resume_model(run, model)
