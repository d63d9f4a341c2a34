"""`blockpress train` end to end, bad inputs, and two torchrun processes (gloo) matching one process."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from saved import saved_dtype

import blockpress
from blockpress.cli import main
from blockpress.lm import MODELS_DIR
from blockpress.train import plot_metrics


def write_data(path, n=8):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt_ids": [2, 5 + i, 6], "response_ids": [10 + i] * (3 + i % 5)}) + "\n")
    return path


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def train_args(data, out, steps=3):
    return ["train", "--config", "tiny", "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--batch-size", "4", "--log-every", "1", "--heldout", "0", "--quiet", "--warmup-steps", "1"]


@pytest.mark.parametrize("device, why", [("mps", "MPS is not available here"), ("cuda", "sees no CUDA GPU")])
def test_train_device_that_is_not_here_names_the_flag(tmp_path, capsys, device, why):
    """As generate, info, serve and bench say it: train said "device: 'mps' asked for", naming no flag."""
    if getattr(torch, device).is_available():
        pytest.skip(f"{device} is available here")
    data = write_data(tmp_path / "d.jsonl")
    for model in (["--model", "blockpress-sudoku"], ["--config", "tiny"]):  # fine-tuning loads, a fresh model is built
        args = train_args(data, tmp_path / "out")
        args[1:3] = model
        assert main([*args, "--device", device]) == 2
        err = capsys.readouterr().err
        assert f"blockpress train: error: --device: '{device}' asked for, but" in err and why in err


def test_train_lora_over_a_float16_base_scales_its_loss(tmp_path, capsys, monkeypatch):
    """--lora-rank keeps a checkpoint's own dtype, float16 where it computes natively (a GPU): it was refused, its
    adapters' gradient underflowing in float16. Now it trains with loss scaling, and its metrics say the scale."""
    pytest.importorskip("peft")
    from blockpress import checkpoint

    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), dtype="float16").save(tmp_path / "half")
    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: True)  # as a GPU loads it: float16
    args = train_args(write_data(tmp_path / "d.jsonl"), tmp_path / "out")
    args[1:3] = ["--model", str(tmp_path / "half")]
    assert main([*args, "--lora-rank", "2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(row["loss_scale"] <= 2.0 ** 16 and isinstance(row["skipped"], bool) for row in rows)
    err = capsys.readouterr().err
    assert "holds a float32 checkpoint (the base was float16; blockpress.load(" in err and "--dtype float16" not in err
    lm = blockpress.load(tmp_path / "out")
    assert lm.generate([[1, 2, 3]], max_new_tokens=4).sequences.shape == (1, 7)


def test_train_lora_says_the_merge_against_the_checkpoints_dtype_on_any_cpu(tmp_path, capsys, monkeypatch):
    """A bfloat16 base that a CPU without native bf16 loads widened to float32: the notice that the merged checkpoint
    is float32 where the base was bfloat16 compared the float32 it computed in, and said nothing there (a
    checkpoint twice the base's size, unsaid), where a CPU with native bf16 said it."""
    pytest.importorskip("peft")
    from blockpress import checkpoint

    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), dtype="bfloat16").save(tmp_path / "bf16")
    data = write_data(tmp_path / "d.jsonl")
    for native in (True, False):
        monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype, native=native: native)
        args = train_args(data, tmp_path / f"out_{native}")
        args[1:3] = ["--model", str(tmp_path / "bf16")]
        assert main([*args, "--lora-rank", "2"]) == 0
        err = capsys.readouterr().err
        assert "holds a float32 checkpoint (the base was bfloat16; --dtype bfloat16 saves that" in err, (native, err)


def test_train_cli_writes_checkpoint_and_metrics(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "out")) == 0
    assert len(losses(tmp_path / "out")) == 3
    lm = blockpress.load(tmp_path / "out")
    assert lm.config.canvas_length == 16
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the run's curves


def test_train_out_expands_a_home_path(tmp_path, monkeypatch):
    """`--out=~/run` (bash leaves a ~ after = as it is) trained into ./~/run."""
    data = write_data(tmp_path / "d.jsonl")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(train_args(data, "~/run", steps=1)) == 0
    assert (tmp_path / "home" / "run" / "model.safetensors").is_file() and not (tmp_path / "~").exists()


def test_train_notes_are_warning_lines(tmp_path, capsys, monkeypatch):
    """The README promises a warning is a `warning: ...` line on stderr; train's own notes (a --heldout that holds
    out nothing, a warmup longer than the run, no matplotlib for loss.png) were bare lines a script's grep missed.
    A --heldout that holds out nothing is the Trainer's to say (a Trainer of one's own says it too), once."""
    import blockpress.train

    def no_matplotlib(*args, **kwargs):
        raise ImportError("no matplotlib")

    monkeypatch.setattr(blockpress.train, "plot_metrics", no_matplotlib)
    data = write_data(tmp_path / "d.jsonl")
    args = [a for a in train_args(data, tmp_path / "out", steps=2) if a != "--quiet"]
    args[args.index("--heldout") + 1], args[args.index("--warmup-steps") + 1] = "0.02", "5"
    assert main(args) == 0
    err = capsys.readouterr().err.splitlines()
    # (the Trainer's warning, as a Trainer of one's own gives it: said once, not also by the command)
    assert sum("holds out none" in line for line in err) == 1
    # (named by its flag, and not "; ignored": the fraction was applied and held none out)
    [said] = [line for line in err if "holds out none" in line]
    assert said.startswith("warning: --heldout 0.02: holds out none of 8 examples") and "ignored" not in said
    for start in ("--warmup-steps 5 leaves --steps 2 no step to decay in: the learning rate ends at 0.00012 (0.4x --lr)",
                  "no loss.png: matplotlib is not installed (pip install 'blockpress[train]')"):
        assert any(line.startswith("warning: " + start) for line in err), (start, err)


@pytest.mark.parametrize("warmup, warned", [(3, True), (2, True), (1, False), (0, False)])
def test_a_warmup_that_leaves_no_step_to_decay_is_warned_of(tmp_path, capsys, warmup, warned):
    """Only a warmup longer than --steps was warned of ("never reaches --lr"): one of --steps or --steps - 1 left
    no step to decay in, so the run ended at the peak learning rate with no word."""
    steps = 1 if warmup == 0 else 3  # (no warmup: nothing to say, even where --steps leaves none to decay in)
    args = [a for a in train_args(write_data(tmp_path / "d.jsonl"), tmp_path / "out", steps=steps) if a != "--quiet"]
    args[args.index("--warmup-steps") + 1] = str(warmup)
    assert main(args) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --warmup-steps")]
    assert bool(said) == warned, said
    from blockpress.train import TrainConfig

    lr = TrainConfig().lr
    if warned:
        assert f"ends at {lr:.3g} (1x --lr)" in said[0] and "give fewer warmup steps" in said[0]


def test_train_quantize_shows_its_choices(tmp_path, capsys):
    """train's usage line read `--quantize QUANTIZE` where the other commands list {int8,fp8,int4,none}."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    assert "--quantize {int8,fp8,int4}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "tiny", "--data", "d", "--out", str(tmp_path / "o"), "--quantize", "int3"])
    assert exit_.value.code == 2 and "--quantize: invalid choice: 'int3'" in capsys.readouterr().err


def test_plot_metrics_draws_every_logged_series(tmp_path):
    rows = [{"step": s, "loss": 5.0 - s, "diffusion_loss": 3.0 - s, "ar_loss": 2.0, "lr": 1e-3} for s in (1, 2, 3)]
    rows[2]["eval_loss"] = 4.5
    text = "".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"step": 3, "stopped": "interrupted"}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 4, "lo')  # a line cut short by a crash
    series = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert series["total"] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert series["held-out total"] == [(3, 4.5)] and len(series["learning rate"]) == 3
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_train_config_file_and_flags(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    (tmp_path / "tc.json").write_text(json.dumps({"lr": 1e-3, "steps": 5}))
    assert main(train_args(data, tmp_path / "out", steps=2) + ["--train-config", str(tmp_path / "tc.json")]) == 0
    assert len(losses(tmp_path / "out")) == 2  # the flag wins over the file


@pytest.mark.parametrize("text, error", [
    ('{"reweight": "false"}', "reweight: expected true or false, got 'false'"),  # trained with reweighting
    ('{"seed": "a"}', "seed: expected an integer, got 'a'"),  # a traceback at the first batch, a partial --out
    ("[1]", "expected a JSON object, got list"),  # TypeError: cannot convert dictionary update sequence element
])
def test_train_config_file_values_are_checked_before_the_model_loads(tmp_path, capsys, text, error):
    data = write_data(tmp_path / "d.jsonl")
    (tmp_path / "tc.json").write_text(text)
    assert main(train_args(data, tmp_path / "out") + ["--train-config", str(tmp_path / "tc.json")]) == 2
    assert f"error: --train-config {tmp_path / 'tc.json'}: {error}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_data_workers_where_python_has_no_fork_is_refused_naming_the_flag(tmp_path, capsys, monkeypatch):
    """On Windows (multiprocessing's start methods: spawn alone) torch's DataLoader refused the hard-coded fork
    context after the model was built, in its own words, naming no flag ("multiprocessing_context option should
    specify a valid start method in ['spawn']"), and left an empty metrics.jsonl. Simulated as the platform lists
    its start methods."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "out") + ["--data-workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: --data-workers: needs the fork start method, which Python lacks on this platform" in err
    assert "use 0" in err and not (tmp_path / "out" / "metrics.jsonl").exists()
    assert main(train_args(data, tmp_path / "out") + ["--data-workers", "0"]) == 0  # batches built in the loop


def test_a_train_config_that_cannot_be_read_is_named_in_words(tmp_path, capsys):
    """A missing --train-config, or a folder, is said in words (it was Python's "[Errno 2] No such file or
    directory: '...'", the path again), before the model loads."""
    data = write_data(tmp_path / "d.jsonl")
    for path, why in [(tmp_path / "nope.json", "No such file or directory"), (tmp_path, "is a folder")]:
        assert main(train_args(data, tmp_path / "out") + ["--train-config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err == (f"blockpress train: error: --train-config {path}: {why} (expected a JSON object of training "
                       "settings)\n")
    assert not (tmp_path / "out").exists()


def test_a_diverging_run_exits_2_and_saves_no_checkpoint(tmp_path, capsys):
    """--lr 1e10 printed 'loss nan', saved NaN weights as the run's checkpoint and exited 0."""
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "out") + ["--lr", "1e10"]) == 2
    assert re.search(r"error: step \d: the loss is nan: training diverged.* lower --lr than 1e\+10",
                     capsys.readouterr().err)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_diverging_run_without_a_save_says_its_out_holds_no_model(tmp_path, capsys):
    """It said "a save made before, in OUT, is kept" where no save had been made: OUT held metrics.jsonl alone."""
    data, out = write_data(tmp_path / "d.jsonl"), tmp_path / "out"
    assert main(train_args(data, out) + ["--lr", "1e10"]) == 2
    err = capsys.readouterr().err
    assert f"without saving ({out} holds no model, only the metrics.jsonl of the steps logged; a new run with this " \
           "--out replaces it)" in err and "a save made before" not in err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("save_every", [0, 2])
def test_a_save_that_fails_says_what_its_out_keeps(tmp_path, capsys, monkeypatch, save_every):
    """A full disk at the final save ended in "error: OUT/model.safetensors: No space left on device", and OUT held
    the run's metrics.jsonl, looking like a run's output with no model in it. The error now says the step was not
    saved and what OUT holds instead: the run's last save, or no model (and a new run there replaces the metrics)."""
    import errno

    from blockpress.files import StagedFiles

    data, out = write_data(tmp_path / "d.jsonl"), tmp_path / "out"
    write, saves = StagedFiles.write, []

    def disk_full(file):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_at_the_last(self, path, writer):
        if path.name == "model.safetensors":
            saves.append(path)
            if len(saves) == (2 if save_every else 1):
                writer = disk_full
        return write(self, path, writer)

    monkeypatch.setattr(StagedFiles, "write", full_at_the_last)
    assert main(train_args(data, out, steps=4) + ["--save-every", str(save_every)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    kept = (f"the run as saved at step 2 is kept in {out}" if save_every else
            f"{out} holds no model, only the metrics.jsonl of the steps logged; a new run with this --out replaces it")
    assert err == f"blockpress train: error: {out / 'model.safetensors'}: No space left on device; step 4 is not " \
                  f"saved ({kept})"
    held = sorted(p.name for p in out.iterdir())
    assert ("trainer_state.pt" in held) == bool(save_every) and "metrics.jsonl" in held
    if not save_every:  # as said: a new run there replaces the metrics of the one that saved nothing
        monkeypatch.setattr(StagedFiles, "write", write)
        assert main(train_args(data, out, steps=4)) == 0
        assert "replacing the metrics.jsonl" in capsys.readouterr().err and len(losses(out)) == 4


def test_resuming_a_full_fine_tune_whose_config_json_is_gone_says_so(tmp_path, capsys):
    """It was said to be a LoRA run's adapters without their base ("give it again with --model")."""
    data, out = write_data(tmp_path / "d.jsonl"), tmp_path / "out"
    assert main(train_args(data, out, steps=2)) == 0
    (out / "config.json").unlink()
    resume = [a for a in train_args(data, out, steps=3) if a not in ("--config", "tiny")] + ["--resume"]
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert f"--resume: {out} holds no config.json, which a full fine-tune saves" in err and "LoRA" not in err


def test_resume_continues_the_run_exactly(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "whole", steps=5)) == 0
    assert main(train_args(data, tmp_path / "split", steps=2)) == 0
    # --resume without --model/--config continues from the run's own checkpoint, to the new --steps
    assert main([a for a in train_args(data, tmp_path / "split", steps=5) if a not in ("--config", "tiny")]
                + ["--resume"]) == 0
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)


def test_resume_without_state_is_a_clear_error(tmp_path, capsys):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "nothing") + ["--resume"]) == 2
    assert "trainer_state.pt" in capsys.readouterr().err


def test_resume_mismatches_are_clear_errors(tmp_path, capsys):
    """Each was a traceback (IndexError, KeyError 'lora') or torch's optimizer message before."""
    pytest.importorskip("peft")
    data = write_data(tmp_path / "d.jsonl")
    resume = lambda out, *extra: main([a for a in train_args(data, out, steps=3) if a not in ("--config", "tiny")]  # noqa: E731
                                      + ["--resume", *extra])
    assert main(train_args(data, tmp_path / "full", steps=3)) == 0
    assert main(train_args(data, tmp_path / "lora", steps=2) + ["--lora-rank", "2"]) == 0
    capsys.readouterr()
    for out, extra, message in ((tmp_path / "full", [], "already at step 3 of --steps 3"),
                                (tmp_path / "full", ["--lora-rank", "2"], "trained all weights (no --lora-rank)"),
                                (tmp_path / "lora", ["--lora-rank", "0"], "trained LoRA adapters of rank 2 (give --lora-rank 2)"),
                                (tmp_path / "lora", [], "finished and merged its adapters"),  # its saved rank, 2
                                (tmp_path / "lora", ["--lora-rank", "2"], "finished and merged its adapters")):
        assert resume(out, *extra) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_cpu_autocast_trains_in_bfloat16_close_to_float32(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "fp32")) == 0
    assert main(train_args(data, tmp_path / "bf16") + ["--cpu-autocast"]) == 0
    fp32, bf16 = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert fp32 != bf16  # autocast really changed the arithmetic
    assert bf16 == pytest.approx(fp32, rel=0.05)
    assert blockpress.load(tmp_path / "bf16").model.embed_tokens.weight.dtype == blockpress.load(
        tmp_path / "fp32").model.embed_tokens.weight.dtype  # weights stay in their own dtype


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "d.jsonl:2: not valid JSON"),
        (json.dumps({"prompt_ids": [2, 3]}), "response_ids"),
        (json.dumps({"prompt_ids": [2], "response_ids": [1, "x"]}), "list of integers"),
        (json.dumps({"prompt_ids": [2], "response_ids": [99999]}), "outside the vocabulary"),
        (json.dumps({"prompt": "hi", "response": "there"}), "need a tokenizer"),
        (json.dumps({"foo": 1}), "expected 'prompt'"),
    ],
)
def test_bad_data_lines_name_the_line(tmp_path, capsys, line, message):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt_ids": [2], "response_ids": [3]}) + "\n" + line + "\n")
    assert main(train_args(data, tmp_path / "out")) == 2
    assert message in capsys.readouterr().err


def test_resume_keeps_the_runs_own_settings(tmp_path, capsys):
    """--resume used to train on with the defaults of every setting not given again (uniform noise, another lr)."""
    data = write_data(tmp_path / "d.jsonl")
    recipe = ["--lr", "1e-3", "--noise-token-id", "3", "--seed", "7"]
    assert main(train_args(data, tmp_path / "whole", steps=4) + recipe) == 0
    assert main(train_args(data, tmp_path / "split", steps=2) + recipe) == 0
    assert main([a for a in train_args(data, tmp_path / "split", steps=4) if a not in ("--config", "tiny")]
                + ["--resume"]) == 0
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    saved = json.loads((tmp_path / "split" / "train_config.json").read_text())
    assert (saved["lr"], saved["noise_token_id"], saved["seed"], saved["steps"]) == (1e-3, 3, 7, 4)
    # flags given again override, and say so in a warning line
    assert "warning: --resume: the run's saved settings, except steps 2 -> 4" in capsys.readouterr().err


def test_a_run_whose_out_is_named_as_a_shipped_model_resumes_from_its_folder(tmp_path, capsys, monkeypatch):
    """`--out blockpress-code` (a folder of that name in the current one): --resume loaded the shipped model of that
    name as the run's checkpoint, and was refused as another model (or went on from the shipped weights)."""
    monkeypatch.chdir(tmp_path)
    data = write_data(tmp_path / "d.jsonl")
    args = train_args(data, "blockpress-code", steps=2)
    assert main(args) == 0
    resume = [a for a in train_args(data, "blockpress-code", steps=3) if a not in ("--config", "tiny")] + ["--resume"]
    assert main(resume) == 0, capsys.readouterr().err
    assert "shipped" not in capsys.readouterr().err
    assert len(losses(tmp_path / "blockpress-code")) == 3


def test_train_in_an_emulated_half_precision_says_so(tmp_path, monkeypatch, capsys):
    """generate --dtype bfloat16 on a CPU without bf16 matmuls notes they run emulated, many times slower; train,
    which runs them far longer (forward and backward), said nothing."""
    from blockpress import checkpoint

    monkeypatch.setattr(checkpoint, "cpu_computes_natively", lambda dtype: False)
    assert main(train_args(write_data(tmp_path / "d.jsonl"), tmp_path / "o", steps=1) + ["--dtype", "bfloat16"]) == 0
    assert "note: --dtype bfloat16: this CPU has no native bf16 matmuls" in capsys.readouterr().err


def test_resume_keeps_the_runs_held_out_split(tmp_path, capsys):
    """--heldout was not saved with the run: --resume without it held out the default 0.02 instead, trained on
    another set of examples and reported an eval loss over examples the run had trained on."""
    data = write_data(tmp_path / "d.jsonl", n=16)
    for out, steps in ((tmp_path / "whole", 4), (tmp_path / "split", 2)):
        args = train_args(data, out, steps=steps)
        args[args.index("--heldout") + 1] = "0.5"
        assert main(args) == 0
    assert json.loads((tmp_path / "split" / "train_config.json").read_text())["heldout"] == 0.5
    resume = [a for a in train_args(data, tmp_path / "split", steps=4) if a not in ("--config", "tiny")]
    resume = resume[: resume.index("--heldout")] + resume[resume.index("--heldout") + 2 :] + ["--resume"]
    assert main(resume + ["--heldout", "0.25"]) == 2  # another split is refused, the run left as it was
    assert "--heldout: the run in" in capsys.readouterr().err
    # a held-out file added is another split too: said of --heldout-data (it blamed "--heldout/--heldout-data: give
    # one of them", with one given)
    held = write_data(tmp_path / "h.jsonl", n=4)
    assert main(resume + ["--heldout-data", str(held)]) == 2
    assert "error: --heldout-data: the run in" in capsys.readouterr().err
    assert main(resume) == 0
    # a run that held out none of --data may evaluate on a file (no split changes); one holding out a file keeps it
    nothing = train_args(data, tmp_path / "none", steps=2)  # (--heldout 0)
    assert main(nothing) == 0
    again = [a for a in train_args(data, tmp_path / "none", steps=3) if a not in ("--config", "tiny")]
    again = again[: again.index("--heldout")] + again[again.index("--heldout") + 2 :] + ["--resume"]
    assert main(again + ["--heldout-data", str(held)]) == 0, capsys.readouterr().err
    filed = train_args(data, tmp_path / "filed", steps=2)
    filed[filed.index("--heldout") : filed.index("--heldout") + 2] = ["--heldout-data", str(held)]
    assert main(filed) == 0
    capsys.readouterr()
    back = [a for a in filed if a not in ("--config", "tiny")] + ["--resume", "--heldout", "0.25"]
    back[back.index("--steps") + 1] = "3"
    assert main(back) == 2
    err = capsys.readouterr().err
    assert f"error: --heldout: the run in {tmp_path / 'filed'} holds out {held}" in err and "warning" not in err
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)


def test_heldout_fraction_with_token_shards_is_refused(tmp_path, capsys):
    """--heldout with shard data was silently ignored (no held-out loss, no word)."""
    from blockpress.data import write_shard

    write_shard(tmp_path / "s.bin", [list(range(3, 200))], vocab_size=512)
    args = train_args(tmp_path / "s.bin", tmp_path / "out", steps=1)
    args[args.index("--heldout") + 1] = "0.3"
    assert main(args) == 2
    assert "--heldout: for JSONL examples" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    args[args.index("--heldout") : args.index("--heldout") + 2] = ["--heldout-data", str(tmp_path / "s.bin")]
    assert main(args) == 0
    assert "eval_loss" in json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])


def test_resume_drops_metrics_rows_past_the_checkpoint(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    assert main(train_args(data, out, steps=2)) == 0
    with (out / "metrics.jsonl").open("a") as f:  # steps logged after the last save, then a crash mid-write
        f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n" + '{"step": 4, "lo')
    assert main([a for a in train_args(data, out, steps=4) if a not in ("--config", "tiny")] + ["--resume"]) == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and 9.0 not in losses(out)


def test_the_summary_says_which_step_its_first_loss_is_after_resume(tmp_path, capsys):
    """first_loss is this invocation's first step's: after --resume, a later step of the run than the summary said
    (it named none), so it read as the run's first loss."""
    data = write_data(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    loud = [a for a in train_args(data, out, steps=2) if a != "--quiet"]
    assert main(loud) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert first["first_step"] == 1 and first["first_loss"] == losses(out)[0]
    resumed = [a for a in train_args(data, out, steps=4) if a not in ("--config", "tiny", "--quiet")]
    assert main([*resumed, "--resume"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    rows = {json.loads(x)["step"]: json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()}
    assert summary["first_step"] == 3 and summary["first_loss"] == rows[3] and summary["last_loss"] == rows[4]


def test_an_earlier_run_in_out_is_not_overwritten(tmp_path, capsys):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "out")) == 0
    before = (tmp_path / "out" / "metrics.jsonl").read_text()
    assert main(train_args(data, tmp_path / "out")) == 2
    assert "already holds a training run" in capsys.readouterr().err
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == before
    # nor a checkpoint: `--model X --out X` would overwrite the model being fine-tuned
    args = [a for a in train_args(data, tmp_path / "ckpt") if a not in ("--config", "tiny")]
    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0).save(tmp_path / "ckpt")
    assert main(args + ["--model", str(tmp_path / "ckpt")]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_a_second_run_on_an_out_in_use_is_refused(tmp_path, capsys):
    """Two runs on one --out at once (a job resubmitted while the first still ran) deleted each other's staged
    files, one dying on a raw FileNotFoundError with wrong --resume advice, and both appended to one metrics.jsonl.
    A run holds its --out until it ends: a second is refused before it touches the folder, naming the first's pid."""
    pytest.importorskip("fcntl")
    from blockpress.files import lock_folder

    data, out = write_data(tmp_path / "d.jsonl"), tmp_path / "out"
    release = lock_folder(out, "--out")  # as the first run holds it (a lock of this process's own, as flock's are)
    try:
        assert main(train_args(data, out)) == 2
        assert f"error: --out {out}: in use by another run (pid {os.getpid()})" in capsys.readouterr().err
        assert [p.name for p in out.iterdir()] == [".lock"]  # no metrics.jsonl of the second run's
    finally:
        release()
    assert not out.exists()  # made for the lock alone, and removed with it
    assert main(train_args(data, out, steps=1)) == 0
    assert not (out / ".lock").exists()

def test_data_paths_the_user_meant_as_jsonl(tmp_path, capsys):
    """pr.JSONL was read as a shard glob ("cannot read its sidecar"); dir.jsonl said "no such data file"."""
    upper = write_data(tmp_path / "pr.JSONL")
    assert main(train_args(upper, tmp_path / "upper", steps=1)) == 0
    (tmp_path / "dir.jsonl").mkdir()
    assert main(train_args(tmp_path / "dir.jsonl", tmp_path / "out", steps=1)) == 2
    err = capsys.readouterr().err
    assert f"error: --data {tmp_path / 'dir.jsonl'}: is a directory" in err and "Traceback" not in err


def test_a_run_that_died_before_its_first_save_can_be_started_again(tmp_path, capsys):
    """Its --out held only metrics.jsonl: a fresh run said "continue it with --resume", --resume said "no
    trainer_state.pt"; neither would take it."""
    data = write_data(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + "\n")
    assert main(train_args(data, out)) == 0
    assert "replacing the metrics.jsonl of a run that stopped before its first save" in capsys.readouterr().err
    assert len(losses(out)) == 3 and 99.0 not in losses(out)


def test_a_lora_run_cut_short_names_its_base_on_resume(tmp_path, capsys):
    pytest.importorskip("peft")
    import blockpress.train

    class StopAtOnce:  # Ctrl-C before the first step: the run saves its adapters, unmerged, to be resumed
        requested = True

        def restore(self):
            pass

    data = write_data(tmp_path / "d.jsonl")
    mid = tmp_path / "mid"  # what a LoRA run holds before its end: adapters in trainer_state.pt, no checkpoint
    with pytest.MonkeyPatch.context() as patch:  # (a copy of a finished run's state is refused as finished)
        patch.setattr(blockpress.train, "_StopOnInterrupt", StopAtOnce)
        assert main(train_args(data, mid, steps=2) + ["--lora-rank", "2"]) == 130
    assert not (mid / "config.json").exists()  # a fresh model (--config): no base to record
    capsys.readouterr()
    assert main([a for a in train_args(data, mid, steps=3) if a not in ("--config", "tiny")] + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "LoRA run's adapters" in err and "--model" in err and "saved settings" not in err


def test_a_lora_run_cut_short_resumes_on_its_own_base_and_refuses_another(tmp_path, capsys):
    """The adapters record the base they adapt: `--resume` alone takes it (before: "give its base model again"),
    and another base is a one-line error (before: 40 lines of torch size mismatches)."""
    pytest.importorskip("peft")
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "base", steps=1)) == 0
    import blockpress.train

    class StopAtOnce:  # Ctrl-C before the first step: the run saves its adapters, unmerged, to be resumed
        requested = True

        def restore(self):
            pass

    mid = tmp_path / "mid"
    tuned = [a for a in train_args(data, mid, steps=2) if a not in ("--config", "tiny")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blockpress.train, "_StopOnInterrupt", StopAtOnce)
        assert main(tuned + ["--model", str(tmp_path / "base"), "--lora-rank", "2"]) == 130
    assert (mid / "lora_base.json").is_file() and not (mid / "config.json").exists()
    other = tmp_path / "other"
    blockpress.random_model(blockpress.ModelConfig.tiny(hidden_size=48), seed=0).save(other)
    capsys.readouterr()
    resume = [a for a in train_args(data, mid, steps=3) if a not in ("--config", "tiny")] + ["--resume"]
    assert main(resume + ["--model", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--model {other}: not the base of the LoRA run" in err and "Traceback" not in err
    assert f"train over {(tmp_path / 'base').resolve()}" in err
    assert main(resume) == 0  # its own base, found beside the adapters
    assert blockpress.load(mid).config.text.hidden_size == blockpress.load(tmp_path / "base").config.text.hidden_size


def test_fine_tuning_keeps_the_models_noise_and_trains_in_float32(tmp_path, capsys):
    """The shipped code model decodes with absorbing noise; fine-tuning it with the default (uniform) noise
    ruined it. And AdamW on its bf16 weights dropped small updates."""
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "base", steps=1) + ["--noise-token-id", "3", "--dtype", "bfloat16"]) == 0
    assert saved_dtype(tmp_path / "base") == torch.bfloat16
    args = [a for a in train_args(data, tmp_path / "tuned", steps=1) if a not in ("--config", "tiny")]
    assert main(args + ["--model", str(tmp_path / "base")]) == 0
    tuned = blockpress.load(tmp_path / "tuned")
    assert tuned.sampler_defaults.noise_token_id == 3 and tuned.dtype == torch.float32
    assert json.loads((tmp_path / "tuned" / "train_config.json").read_text())["noise_token_id"] == 3
    args = [a for a in train_args(data, tmp_path / "uniform", steps=1) if a not in ("--config", "tiny")]
    capsys.readouterr()
    assert main(args + ["--model", str(tmp_path / "base"), "--noise-token-id", "-1"]) == 0
    assert re.search(r"^warning: .*decodes with noise_token_id 3", capsys.readouterr().err, re.M)  # allowed, and said
    assert blockpress.load(tmp_path / "uniform").sampler_defaults.noise_token_id is None


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])  # SIGTERM: `timeout`, docker stop, Slurm
def test_ctrl_c_saves_a_run_that_resumes_exactly(tmp_path, signum, capsys):
    import signal

    from blockpress.train import ExampleSource, TrainConfig, Trainer

    signum = getattr(signal, signum)
    def unhandled(*_):  # in place of the default, which would end pytest itself
        raise AssertionError(f"{signal.Signals(signum).name} reached the default handler: the run was not saved")
    previous = signal.signal(signal.SIGTERM, unhandled) if signum == signal.SIGTERM else None

    examples = [blockpress.data.Example([2, 5 + i, 6], [10 + i] * (3 + i % 5)) for i in range(8)]
    cfg = TrainConfig(steps=4, batch_size=4, log_every=1, warmup_steps=1)

    def trainer(out, on_step=None):
        lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0)
        return Trainer(lm, ExampleSource(examples, 0), cfg, tmp_path / out, progress=False, on_step=on_step)

    whole = trainer("whole").train()
    ctrl_c = lambda step, loss: os.kill(os.getpid(), signum) if step == 2 else None  # noqa: E731
    try:
        cut = trainer("cut", ctrl_c).train()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    assert (cut.stopped, cut.steps) == ("interrupted", 2)
    # what stops it at once: Ctrl-C again at a terminal, a second signal from `kill` or `timeout`
    assert ("Ctrl-C again" if signum == signal.SIGINT else "a second signal") in capsys.readouterr().err
    assert (tmp_path / "cut" / "trainer_state.pt").is_file() and (tmp_path / "cut" / "model.safetensors").is_file()
    again = trainer("cut")
    again.resume()
    rest = again.train()
    assert cut.losses + rest.losses == pytest.approx(whole.losses, rel=1e-5)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_at_once_with_its_own_status(tmp_path, name):
    """The second signal raised a bare KeyboardInterrupt whatever it was: two SIGTERMs (`timeout` then its kill
    grace, a scheduler) exited 130 "interrupted", where cli.md promises 143 on a SIGTERM."""
    import signal

    from blockpress.stopping import Stopped, stop_status
    from blockpress.train import ExampleSource, TrainConfig, Trainer

    signum = getattr(signal, name)
    previous = signal.signal(signal.SIGTERM, lambda *_: pytest.fail("SIGTERM reached the default handler"))
    twice = lambda step, loss: [os.kill(os.getpid(), signum) for _ in range(2)]  # noqa: E731
    examples = [blockpress.data.Example([2, 5 + i, 6], [10 + i] * 3) for i in range(4)]
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0)
    trainer = Trainer(lm, ExampleSource(examples, 0), TrainConfig(steps=3, batch_size=2, warmup_steps=1),
                      tmp_path / "out", progress=False, on_step=twice)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            trainer.train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert isinstance(caught.value, Stopped) == (name == "SIGTERM")
    assert stop_status(caught.value) == 128 + signum
    assert not (tmp_path / "out" / "trainer_state.pt").exists()  # at once, unsaved


@pytest.mark.parametrize("signum, status, said", [("SIGINT", 130, "interrupted at step 1"),
                                                   ("SIGTERM", 143, "stopped by SIGTERM at step 1"),
                                                   pytest.param("SIGHUP", 129, "stopped by SIGHUP at step 1",
                                                                marks=pytest.mark.skipif(not hasattr(signal, "SIGHUP"),
                                                                                         reason="no SIGHUP here"))])
def test_a_run_stopped_by_a_signal_exits_with_its_status(tmp_path, monkeypatch, capsys, signum, status, said):
    """128 + the signal, as a shell reports a process it ended: a SIGTERM (timeout, Slurm, docker stop) exited 130,
    Ctrl-C's status, saying "interrupted", so a job script could not tell its scheduler's stop from a user's. A
    SIGHUP (an ssh session that dropped) ended the run unsaved."""
    from blockpress.train import Trainer, read_trainer_state

    name, signum = signum, getattr(signal, signum)
    def unhandled(*_):  # in place of the default, which would end pytest itself
        raise AssertionError(f"{name} reached the default handler: the run was not saved")
    real = Trainer.train_step

    def step_then_signal(self, *args, **kwargs):
        row = real(self, *args, **kwargs)
        if self.step == 1:
            os.kill(os.getpid(), signum)
        return row

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    data = write_data(tmp_path / "d.jsonl")
    caught = signal.SIGTERM if signum == signal.SIGINT else signum
    previous = signal.signal(caught, unhandled)
    try:
        assert main(train_args(data, tmp_path / "out", steps=3)) == status
    finally:
        signal.signal(caught, previous)
    assert said in capsys.readouterr().err
    assert read_trainer_state(tmp_path / "out" / "trainer_state.pt")["step"] == 1  # saved, to be resumed


@pytest.mark.parametrize("name, status", [("SIGTERM", 143), pytest.param("SIGHUP", 129, marks=pytest.mark.skipif(
    not hasattr(signal, "SIGHUP"), reason="no SIGHUP here"))])
def test_a_signal_while_the_data_is_read_stops_the_run_with_a_word(tmp_path, monkeypatch, capsys, name, status):
    """A SIGTERM (a scheduler's time limit) or SIGHUP while train read its data or loaded the model (minutes, for a
    large corpus) met the signal's default action: the process died without a word, leaving --out behind locked.
    train's loop takes them itself (to save); before it they stop the run as a Ctrl-C does."""
    import blockpress.data

    signum = getattr(signal, name)
    real = blockpress.data.load_jsonl

    def read_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(blockpress.data, "load_jsonl", read_then_signal)
    data = write_data(tmp_path / "d.jsonl")
    previous = signal.signal(signum, lambda *_: pytest.fail(f"{name} reached the default handler"))
    try:
        assert main(train_args(data, tmp_path / "out", steps=3)) == status
    finally:
        signal.signal(signum, previous)
    assert f"blockpress train: stopped by {name}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # (made by this run, and left as a Ctrl-C leaves it: removed)


@pytest.mark.parametrize("saved_before", [False, True])
def test_a_second_ctrl_c_says_what_the_folder_holds(tmp_path, monkeypatch, capsys, saved_before):
    """A second Ctrl-C stops at once, that step unsaved, and said only "blockpress train: interrupted", where the
    first says "saved in OUT; continue with --resume": the folder's last save (or none) went unsaid."""
    from blockpress.train import Trainer

    real = Trainer.train_step

    def step_then_twice(self, *args, **kwargs):
        row = real(self, *args, **kwargs)
        if self.step == 3:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
        return row

    monkeypatch.setattr(Trainer, "train_step", step_then_twice)
    data = write_data(tmp_path / "d.jsonl")
    save_every = ["--save-every", "2"] if saved_before else []
    assert main(train_args(data, tmp_path / "out", steps=5) + save_every) == 130
    err = capsys.readouterr().err
    said = (f"stopped at once: {tmp_path / 'out'} holds the run's last save (continue it with --resume)"
            if saved_before else f"stopped at once: {tmp_path / 'out'} holds no save of this run")
    assert said in err and "blockpress train: interrupted" in err, err
    assert (tmp_path / "out" / "trainer_state.pt").is_file() == saved_before


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals here")
def test_a_hung_up_terminal_is_left_for_dev_null(tmp_path):
    """After a SIGHUP every write to the closed terminal fails (EIO): the progress bar's next one would have ended
    the run before its save. stdout / stderr on a terminal go to /dev/null, as under nohup; a file stays."""
    code = textwrap.dedent("""
        import os, sys
        from blockpress.stopping import leave_hung_up_terminal, terminal_fds
        master, slave = os.openpty()
        os.dup2(slave, 2)
        log = open(sys.argv[1], "w")
        os.dup2(log.fileno(), 1)
        fds = terminal_fds()
        os.close(master)  # the hang-up: isatty says no from now on, and writing fails
        leave_hung_up_terminal(fds)
        os.write(2, b"still writable")
        os.write(1, b"kept")
        print(os.isatty(2), os.path.samestat(os.fstat(2), os.stat(os.devnull)), file=sys.__stdout__, flush=True)
    """)
    log = tmp_path / "log"
    run = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert log.read_text() == "kept" + "False True\n"


def test_a_fresh_preset_trains_on_text_with_the_tokenizers_vocabulary(tmp_path):
    """The README's fresh-model line: text JSONL needs a tokenizer, and a preset sizes its vocabulary to it."""
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": f"\n    return x + {i}\n"}) + "\n"
                            for i in range(8)))
    args = train_args(data, tmp_path / "fresh", steps=1) + ["--tokenizer", str(MODELS_DIR / "blockpress-code")]
    assert main(args) == 0
    lm = blockpress.load(tmp_path / "fresh")
    assert lm.config.text.vocab_size == lm.tokenizer.vocab_size == 8192 and lm.config.text.hidden_size == 64
    # its tokenizer.json, or a shipped model's name, name the same tokenizer (a file was "has no tokenizer.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((MODELS_DIR / "blockpress-code" / "tokenizer.json").read_text())
    (other / "small.json").write_text("{}")  # its folder's tokenizer.json is not it: refused, not swapped in
    assert main(train_args(data, tmp_path / "refused", steps=1) + ["--tokenizer", str(other / "small.json")]) == 2
    for given in (MODELS_DIR / "blockpress-code" / "tokenizer.json", "blockpress-code"):
        out = tmp_path / f"fresh-{len(str(given))}"
        assert main(train_args(data, out, steps=1) + ["--tokenizer", str(given)]) == 0
        assert blockpress.load(out).tokenizer.vocab_size == 8192


def test_bad_train_flags(tmp_path, capsys):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "out") + ["--lr", "-1"]) == 2
    assert "error: --lr: expected > 0, got -1.0" in capsys.readouterr().err
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(train_args(tmp_path / "missing.jsonl", tmp_path / "o")) == 2
    assert f"error: --data {tmp_path / 'missing.jsonl'}: no such data file" in capsys.readouterr().err
    # Each of these was a traceback or a misleading message before.
    nope = str(tmp_path / "nope.json")
    (tmp_path / "a_file").write_text("x")
    # The errors name the flag to change, not TrainConfig's field ("batch_size: expected a positive integer").
    for extra, message in ((["--config", nope], f"error: --config {nope}: no such file"),
                           (["--config", "huge"], "error: --config huge: unknown preset 'huge'; expected one of"),
                           (["--log-every", "0"], "error: --log-every: expected a positive integer"),
                           (["--batch-size", "0"], "error: --batch-size: expected a positive integer"),
                           (["--heldout", "-0.5"], "error: --heldout: expected a fraction in [0, 1)"),
                           (["--grad-clip", "-1"], "error: --grad-clip: expected >= 0"),
                           (["--lr", "inf"], "error: --lr: expected a finite number"),
                           (["--heldout-data", "x*.bin"], "--heldout-data x*.bin: not JSONL examples; with JSONL examples as --data"),
                           (["--prompt-min", "9", "--prompt-max", "4"], "error: --prompt-min/--prompt-max: need"),
                           (["--eval-batches", "0", "--heldout", "0.5"],
                            "error: --eval-batches: expected a positive integer with held-out data"),
                           (["--eval-batches", "-1"], "error: --eval-batches: expected an integer >= 0"),
                           (["--lora-alpha", "0"], "error: --lora-alpha: expected a positive number"),
                           (["--threads", "-1"], "error: --threads: expected 0"),
                           (["--response-canvases", "0"], "error: --response-canvases: expected a positive integer"),
                           # each was silently ignored: no evaluation, no adapters, no windows of JSONL examples
                           (["--eval-every", "2"], "error: --eval-every: evaluates the held-out data every 2 steps, "
                                                   "and this run has none"),
                           (["--lora-alpha", "64"], "error: --lora-alpha: 64 scales LoRA adapters; it needs lora_rank > 0"),
                           (["--prompt-min", "4", "--response-canvases", "2"],
                            "error: --prompt-min/--response-canvases: for running text")):
        args = train_args(data, tmp_path / "o")
        if extra[0] == "--config":
            args[args.index("--config") + 1] = extra[1]
        else:
            args += extra
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)
    # the same settings from a --train-config file were ignored silently (a saved one, every field at its default: fine)
    for settings, message in (({"lora_alpha": 64}, "error: --lora-alpha: 64 scales LoRA adapters"),
                              ({"prompt_max": 32, "response_canvases": 3},
                               "error: --prompt-max/--response-canvases: for running text")):
        (tmp_path / "tc.json").write_text(json.dumps(settings))
        assert main(train_args(data, tmp_path / "o") + ["--train-config", str(tmp_path / "tc.json")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (settings, err)
    # a config.json's vocabulary is its own: a larger tokenizer is refused (a preset takes the tokenizer's)
    blockpress.ModelConfig.preset("tiny").save(tmp_path / "tiny.json")
    args = train_args(data, tmp_path / "o")
    args[args.index("--config") + 1] = str(tmp_path / "tiny.json")
    assert main(args + ["--tokenizer", str(MODELS_DIR / "blockpress-code")]) == 2
    assert "8192 tokens, more than the model's vocab_size of 512" in capsys.readouterr().err
    assert main(train_args(data, tmp_path / "a_file")) == 2  # --out is a file: one line, no traceback
    assert "a_file" in capsys.readouterr().err
    # a folder that cannot be made was "[Errno 20] Not a directory", without the flag, after the model loaded
    assert main(train_args(data, tmp_path / "a_file" / "x")) == 2
    assert f"error: --out {tmp_path / 'a_file' / 'x'}: cannot be created ({tmp_path / 'a_file'} is not a folder)" \
        in capsys.readouterr().err
    # a checkpoint brings its own tokenizer: --tokenizer beside --model was silently ignored
    args = train_args(data, tmp_path / "o")
    args[args.index("--config") : args.index("--config") + 2] = ["--model", "random-tiny", "--tokenizer", "x"]
    assert main(args) == 2
    assert "--tokenizer: only for a fresh model" in capsys.readouterr().err
    # a fine-tuning run took --seed -1 (a fresh model's random_model refuses it, as generate does)
    args = train_args(data, tmp_path / "o")
    args[args.index("--config") : args.index("--config") + 2] = ["--model", "random-tiny"]
    assert main(args + ["--seed", "-1"]) == 2
    assert "error: --seed: expected an integer in [0, 2**63), got -1" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not available")
def test_two_processes_match_one(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "one", steps=3)) == 0
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29517", "-m", "blockpress.cli",
                        *train_args(data, tmp_path / "two", steps=3)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FutureWarning" not in r.stderr, r.stderr[-2000:]  # torch 2.13's, of DDP's broadcast_buffers, per process
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun not available")
def test_a_stop_that_reaches_one_process_stops_them_all_at_one_step(tmp_path):
    """Under torchrun each process met Ctrl-C at its own moment: one that met it after its check of the step went
    into the next step's all-reduce while its peer had stopped, and died there ("Connection closed by peer", a
    traceback), so rank 0 never saved and the run was lost (a Ctrl-C to torchrun at step ~37 of a tiny run)."""
    data = write_data(tmp_path / "d.jsonl")
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        "import blockpress.train as T\n"
        "from blockpress.cli import main\n"
        "class Stop(T._StopOnInterrupt):\n"
        "    last = None\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        Stop.last = self\n"
        "real = T.Trainer.train_step\n"
        "import blockpress.cli.train as C\n"
        "real_plot = C._plot_training\n"
        "def slow_plot(*args, **kwargs):  # rank 0's work after the run (its plot, then 'saved in'), slowed: rank 1\n"
        "    import time  # left at once, torchrun stopped rank 0 meanwhile, and nothing said where the run was saved\n"
        "    time.sleep(3)\n"
        "    return real_plot(*args, **kwargs)\n"
        "C._plot_training = slow_plot\n"
        "def step(self, *args, **kwargs):\n"
        "    row = real(self, *args, **kwargs)\n"
        "    if self.rank == 1 and self.step == 2:  # a Ctrl-C that reached this process alone, after its check\n"
        "        Stop.last.requested = True\n"
        "    return row\n"
        "T._StopOnInterrupt, T.Trainer.train_step = Stop, step\n"
        "sys.exit(main(sys.argv[1:]))\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29519", str(driver),
                        *train_args(data, tmp_path / "two", steps=6)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "Connection closed" not in r.stderr, r.stderr[-2000:]
    from blockpress.train import read_trainer_state

    assert read_trainer_state(tmp_path / "two" / "trainer_state.pt")["step"] == 2, r.stderr[-2000:]
    assert r.stderr.count("saved in") == 1  # by rank 0, which saves (rank 1 said it too)


def _sentencepiece_style_tokenizer(folder, eos=True):
    """A tokenizer whose specials are not Gemma's: <pad>=0, <s>=1, </s>=2 (Llama's order, pad first)."""
    from blockpress.tokenizer import train_bpe_tokenizer

    folder.mkdir()
    train_bpe_tokenizer(["def f(x): return x"], vocab_size=300, special_tokens=("<pad>", "<s>", "</s>")).backend.save(
        str(folder / "tokenizer.json"))
    specials = {"bos_token": "<s>", "pad_token": "<pad>", **({"eos_token": "</s>"} if eos else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(specials))
    return folder


def test_a_fresh_model_takes_its_tokenizers_special_ids(tmp_path, capsys):
    """The preset's Gemma ids (bos 2, eos 1) were saved beside a tokenizer where 1 is <s>: canvases after an
    answer were filled with BOS, and generation stopped on it."""
    tok = _sentencepiece_style_tokenizer(tmp_path / "tok")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"f{i}", "response": f"x + {i}"}) + "\n" for i in range(8)))
    for config in ("tiny", str(tmp_path / "tiny.json")):  # a preset, and a config.json of the same shape
        blockpress.ModelConfig.preset("tiny").save(tmp_path / "tiny.json")
        out = tmp_path / f"fresh{len(config)}"
        args = train_args(data, out, steps=1)
        args[args.index("--config") + 1] = config
        assert main(args + ["--tokenizer", str(tok)]) == 0
        saved = json.loads((out / "config.json").read_text())
        text = saved.get("text_config", saved)
        assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (1, 2, 0)
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    lm = blockpress.load(out)
    from blockpress.train import ExampleSource, TrainConfig, Trainer

    trainer = Trainer(lm, ExampleSource([blockpress.data.Example([1, 5], [7])], 0), TrainConfig(steps=1, batch_size=1),
                      tmp_path / "t", progress=False)
    assert (trainer.eos, trainer.pad) == (2, 0)  # what fills a canvas after the answer
    no_eos = _sentencepiece_style_tokenizer(tmp_path / "no_eos", eos=False)
    assert main(train_args(data, tmp_path / "refused", steps=1) + ["--tokenizer", str(no_eos)]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {no_eos}: names no EOS token" in err and "Traceback" not in err


def test_train_help_comes_from_the_fields_without_their_source(monkeypatch, capsys):
    """--help was built by reading TrainConfig's source and parsing its trailing comments: where only .pyc files
    ship, inspect.getsource fails and `blockpress train` could not even parse its flags."""
    import dataclasses
    import inspect

    from blockpress.cli import build_parser
    from blockpress.train import TrainConfig

    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["help"] and " ".join(f.metadata["help"].split()) in shown, f.name


def test_chat_data_trains_every_assistant_turn(tmp_path, capsys):
    """Only a chat's last assistant turn was an example; --chat-turns last keeps that, and running text has none."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": chat[:k]}) + "\n" for k in (4, 4, 2)))
    last = ["--tokenizer", str(MODELS_DIR / "blockpress-code"), "--chat-turns", "last"]
    assert main(train_args(data, tmp_path / "last", steps=1) + last) == 0  # (all turns: 5; test_data.py)
    assert torch.load(tmp_path / "last" / "trainer_state.pt", weights_only=True)["data"]["size"] == "3 examples"
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    assert main(train_args(text, tmp_path / "text", steps=1) + last) == 2
    assert "--chat-turns last: for JSONL examples of chat `messages`" in capsys.readouterr().err
    # prompt/response records have no turns either: the flag was taken and did nothing
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"p{i}", "response": "r"}) + "\n" for i in range(3)))
    assert main(train_args(pairs, tmp_path / "pairs", steps=1) + last) == 2
    err = capsys.readouterr().err
    assert "--chat-turns last: for JSONL examples of chat `messages`; the examples given are prompt/response" in err
    assert not (tmp_path / "pairs").exists()


def test_a_run_from_before_chat_turns_resumes_on_the_last_turns(tmp_path, capsys):
    """A run saved before --chat-turns existed trained on each chat's last assistant turn; resumed, it took the new
    default (every turn) without a word: other examples for the rest of the run, and train_config.json said "all"
    for all of it. It goes on as it began, and says so; prompt/response runs of that age resume as they are."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": chat[:k]}) + "\n" for k in (4, 4, 2)))
    tok = ["--tokenizer", str(MODELS_DIR / "blockpress-code")]
    for records, out in ((data, tmp_path / "chats"), (write_data(tmp_path / "pairs.jsonl"), tmp_path / "pairs")):
        assert main(train_args(records, out, steps=1) + tok + ["--save-every", "1"]) == 0
        saved = json.loads((out / "train_config.json").read_text())
        del saved["chat_turns"]  # as a run of that age wrote it
        (out / "train_config.json").write_text(json.dumps(saved))
        capsys.readouterr()
        assert main(train_args(records, out, steps=2) + tok + ["--resume"]) == 0
        err = capsys.readouterr().err
        turns = json.loads((out / "train_config.json").read_text())["chat_turns"]
        if records == data:
            assert "began before --chat-turns, on each chat's last assistant turn, and goes on so" in err
            assert turns == "last"
            assert torch.load(out / "trainer_state.pt", weights_only=True)["data"]["size"] == "3 examples"
        else:
            assert "--chat-turns" not in err and turns == "all"
    # --chat-turns all asked for at the resume wins, and the change is said (the saved settings name no reading)
    out = tmp_path / "asked"
    assert main(train_args(data, out, steps=1) + tok + ["--save-every", "1"]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    del saved["chat_turns"]
    (out / "train_config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(train_args(data, out, steps=2) + tok + ["--resume", "--chat-turns", "all"]) == 0
    assert "chat_turns 'all' changes what the rest of it trains on" in capsys.readouterr().err
    assert json.loads((out / "train_config.json").read_text())["chat_turns"] == "all"


def test_an_agent_chat_of_tool_calls_and_thoughts_trains(tmp_path):
    """A chat whose assistant turns call tools or think was refused ('the assistant's reply trained on must be
    text'); with a Gemma-4-style tokenizer every turn trains, calls in the template's format, thoughts between the
    response template's markers (test_data.py)."""
    from test_response import gemma4_tokenizer
    from test_tokenizer import GEMMA4_STYLE_TEMPLATE

    tok = gemma4_tokenizer()
    tok.chat_template = GEMMA4_STYLE_TEMPLATE
    tok.save(tmp_path / "tok")
    call = {"id": "a", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "Ask the tool."},
            {"role": "tool", "tool_call_id": "a", "name": "weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "It says sunny."}]
    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": chat[:2]}) + "\n")
    assert main(train_args(data, tmp_path / "out", steps=2) + ["--tokenizer", str(tmp_path / "tok")]) == 0
    state = torch.load(tmp_path / "out" / "trainer_state.pt", weights_only=True)
    assert state["data"]["size"] == "3 examples" and state["step"] == 2


def test_raw_text_trains_from_a_folder_with_held_out_text(tmp_path, capsys):
    """A folder of .py files (and {"text": ...} JSONL, a .txt file) was refused: "is a directory; expected ..."."""
    source = os.path.dirname(blockpress.__file__)
    folder = tmp_path / "code"
    folder.mkdir()
    for name in ("data.py", "train.py"):
        shutil.copy(f"{source}/{name}", folder / name)
    (tmp_path / "held.jsonl").write_text(json.dumps({"text": open(f"{source}/serve.py").read()}) + "\n")
    args = train_args(folder, tmp_path / "out", steps=2)
    args[args.index("--heldout") : args.index("--heldout") + 2] = ["--heldout-data", str(tmp_path / "held.jsonl")]
    args += ["--tokenizer", str(MODELS_DIR / "blockpress-code")]
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and "eval_loss" in rows[-1]
    no_tokenizer = train_args(folder, tmp_path / "o2", steps=1)
    assert main(no_tokenizer) == 2  # a fresh model without --tokenizer cannot read text
    assert f"--data {folder}: raw text needs a tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["jsonl", "text"])
def test_a_data_folder_is_walked_once_before_training(tmp_path, monkeypatch, kind):
    """Each check and reader of a --data folder walked it afresh (left_out, is_examples, _sources, train_corpus,
    load_text: 9 walks): 200k small files took 6 minutes to start, without a sign. Now the command walks it once."""
    from pathlib import Path

    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    if kind == "jsonl":
        write_data(folder / "a.jsonl")
        write_data(folder / "sub" / "b.jsonl")
        (folder / "README.md").write_text("# a dataset card\n")
        extra = []
    else:
        for i in range(3):
            (folder / "sub" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
        extra = ["--tokenizer", str(MODELS_DIR / "blockpress-code"), "--prompt-max", "8", "--response-canvases", "1"]
    (folder / ".hidden" / "c.jsonl" if kind == "jsonl" else folder / ".hidden" / "c.py").write_text("")
    walks = []
    rglob = Path.rglob
    monkeypatch.setattr(Path, "rglob", lambda self, *a, **k: (walks.append(self), rglob(self, *a, **k))[1])
    args = train_args(folder, tmp_path / "out", steps=1) + extra
    if kind == "text":
        args[args.index("--heldout") : args.index("--heldout") + 2] = []
    assert main(args) == 0
    assert [w for w in walks if Path(w) == folder] == [folder]


def test_raw_text_shorter_than_a_window_is_refused_before_training(tmp_path, capsys):
    """It trained until a step drew a long enough prompt, then died with nothing saved, saying "TokenShards: no shard
    holds a 80-token window", naming neither --data nor the settings to change."""
    text = tmp_path / "small.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 5)
    tokens = len(blockpress.load("blockpress-code").tokenizer.encode(text.read_text())) + 1  # and its EOS
    args = train_args(text, tmp_path / "out", steps=2) + ["--tokenizer", str(MODELS_DIR / "blockpress-code")]
    args.remove("--heldout")
    args.remove("0")
    assert main(args) == 2
    err = capsys.readouterr().err
    # (the preset's canvases are 16 tokens, its prompts up to 64: windows of up to 80 tokens)
    assert (f"error: --prompt-max/--response-canvases: --data {text.resolve()} holds {tokens} tokens, fewer than the "
            f"longest window of running text, 80 (a prompt of up to 64 tokens, then 1 canvas of 16); --prompt-max "
            f"{tokens - 16} fits it") in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert main(args + ["--prompt-max", str(tokens - 16)]) == 0  # as it says: windows up to the whole text
    assert len(losses(tmp_path / "out")) == 2


def test_resume_keeps_the_runs_dtype(tmp_path, capsys):
    """--dtype was not saved with the run: --resume without it trained on (and saved) in float32, and said only
    which other settings changed."""
    data = write_data(tmp_path / "d.jsonl")
    bf16 = ["--dtype", "bfloat16"]
    assert main(train_args(data, tmp_path / "whole", steps=4) + bf16) == 0
    assert main(train_args(data, tmp_path / "split", steps=2) + bf16) == 0
    resume = [a for a in train_args(data, tmp_path / "split", steps=4) if a not in ("--config", "tiny")] + ["--resume"]
    assert main(resume) == 0
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    assert saved_dtype(tmp_path / "split") == torch.bfloat16
    capsys.readouterr()
    again = [a for a in train_args(data, tmp_path / "whole", steps=5) if a not in ("--config", "tiny")]
    assert main(again + ["--resume", "--dtype", "float32"]) == 0  # asked for: allowed, and said
    assert "dtype 'bfloat16' -> 'float32'" in capsys.readouterr().err
    assert blockpress.load(tmp_path / "whole").dtype == torch.float32
    # LoRA: the dtype the adapters are merged into
    pytest.importorskip("peft")
    from blockpress import train

    class StopAtOnce:  # Ctrl-C before the first step: the run saves its adapters, unmerged, to be resumed
        requested = True

        def restore(self):
            pass

    lora = [a for a in train_args(data, tmp_path / "lora", steps=2) if a not in ("--config", "tiny")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "_StopOnInterrupt", StopAtOnce)
        assert main(lora + ["--model", str(tmp_path / "whole"), "--lora-rank", "2"] + bf16) == 130
    assert main(lora + ["--resume"]) == 0
    assert saved_dtype(tmp_path / "lora") == torch.bfloat16


def test_running_text_windows_must_fit_the_models_context(tmp_path, capsys):
    """Windows past the model's context trained silently (JSONL examples that long were refused)."""
    from blockpress.data import write_shard

    model = tmp_path / "short"
    blockpress.random_model(blockpress.ModelConfig.tiny(max_position_embeddings=64), seed=0).save(model)
    write_shard(tmp_path / "s.bin", [list(range(3, 120)) * 4], vocab_size=128)
    args = [a for a in train_args(tmp_path / "s.bin", tmp_path / "out", steps=1) if a not in ("--config", "tiny")]
    args = args[: args.index("--heldout")] + args[args.index("--heldout") + 2 :] + ["--model", str(model)]
    # what fits is named, either setting (a --prompt-max too long alone got no hint)
    for extra, positions, fits in ((["--prompt-min", "8", "--prompt-max", "60"], 68, "--prompt-max 56 fits"),
                                   (["--prompt-min", "8", "--prompt-max", "32", "--response-canvases", "5"], 72,
                                    "--prompt-max 24 or --response-canvases 4 fits"),
                                   (["--prompt-min", "60", "--prompt-max", "60"], 68,
                                    "a model of a longer context is needed")):
        assert main(args + extra) == 2
        err = capsys.readouterr().err
        assert f"error: --prompt-max/--response-canvases: windows of running text take up to {positions} " \
               "positions" in err and "context of 64" in err, err
        assert err.rstrip().endswith(fits), err
        assert not (tmp_path / "out").exists()
    assert main(args + ["--prompt-min", "8", "--prompt-max", "32", "--response-canvases", "4"]) == 0  # 64: fits


def test_a_time_scheduled_run_resumes_its_clock(tmp_path, capsys):
    """The elapsed time was not saved: a resumed --time-schedule run restarted its clock and jumped the lr from
    where the budget had annealed it straight back to the peak."""
    import signal

    from blockpress.train import ExampleSource, TrainConfig, Trainer

    examples = [blockpress.data.Example([2, 5 + i, 6], [10 + i] * (3 + i % 5)) for i in range(8)]
    cfg = TrainConfig(steps=100_000, batch_size=4, log_every=1, warmup_steps=1, max_minutes=1.0, time_schedule=True)

    def trainer(stop_at):
        lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0)
        ctrl_c = lambda step, loss: os.kill(os.getpid(), signal.SIGINT) if step == stop_at else None  # noqa: E731
        return Trainer(lm, ExampleSource(examples, 0), cfg, tmp_path / "run", progress=False, on_step=ctrl_c)

    assert trainer(3).train().stopped == "interrupted"
    saved = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=True)["minutes"]
    again = trainer(5)
    again.resume()
    assert again.minutes == saved > 0
    assert again.train().stopped == "interrupted" and again.minutes > saved
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "lr" in x]
    assert len(lrs) == 5 and all(a > b for a, b in zip(lrs[1:], lrs[2:])), lrs  # the decay goes on across the resume


def test_resuming_a_run_whose_budget_is_spent_is_a_clear_error(tmp_path, capsys):
    data = write_data(tmp_path / "d.jsonl")
    args = train_args(data, tmp_path / "out", steps=50) + ["--max-minutes", "1e-5", "--time-schedule"]
    assert main(args) == 0
    resume = [a for a in train_args(data, tmp_path / "out", steps=50) if a not in ("--config", "tiny")] + ["--resume"]
    capsys.readouterr()
    assert main(resume) == 2  # it would stop again at once
    err = capsys.readouterr().err
    assert "minutes of --max-minutes 1e-05, the budget of the whole run; give a larger --max-minutes" in err, err
    assert main(resume + ["--max-minutes", "1", "--steps", "3"]) == 0
    assert [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][-1] == 3


def test_a_lora_run_stopped_by_its_clock_resumes(tmp_path, capsys):
    """A LoRA run cut by --max-minutes merged its adapters and dropped them: --resume said it had "finished". It
    now writes its merged checkpoint and adapter folder and keeps the adapters to resume, as a full fine-tune does."""
    pytest.importorskip("peft")
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "base", steps=1)) == 0
    # warmup over every step: the lr of a step does not depend on --steps, so the cut run may give another
    lora = lambda out, steps: [a for a in train_args(data, out, steps=steps) if a not in ("--config", "tiny")] + [  # noqa: E731
        "--model", str(tmp_path / "base"), "--lora-rank", "2", "--warmup-steps", "3"]
    assert main(lora(tmp_path / "whole", 3)) == 0
    assert main(lora(tmp_path / "cut", 50) + ["--max-minutes", "1e-5"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["stopped"] == "max_minutes" and rows[-1]["step"] < 3
    assert (tmp_path / "cut" / "adapter" / "adapter_model.safetensors").is_file()
    assert blockpress.load(tmp_path / "cut").config.text.hidden_size == 64  # a usable, merged checkpoint
    resume = [a for a in train_args(data, tmp_path / "cut", steps=3) if a not in ("--config", "tiny")]
    assert main(resume + ["--resume", "--max-minutes", "0", "--warmup-steps", "3"]) == 0  # on its base, not the merged
    trained = [json.loads(x).get("loss") for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in trained if x is not None] == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    whole, cut = blockpress.load(tmp_path / "whole"), blockpress.load(tmp_path / "cut")
    for (name, p), q in zip(whole.model.named_parameters(), cut.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    assert not (tmp_path / "cut" / "lora_base.json").exists()  # finished: nothing left to resume


def test_a_lora_run_resumed_after_its_clock_stopped_it_drops_that_merged_checkpoint_when_it_saves(tmp_path,
                                                                                                 monkeypatch):
    """The clock's stop merged the adapters into --out; resumed and saved mid-run (a Ctrl-C here), the adapters moved
    on while that merged checkpoint stayed, and `--model OUT` ("its base with the adapters so far") loaded it."""
    pytest.importorskip("peft")
    from blockpress.train import Trainer

    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "base", steps=1)) == 0
    lora = [a for a in train_args(data, tmp_path / "cut", steps=50) if a not in ("--config", "tiny")] + [
        "--model", str(tmp_path / "base"), "--lora-rank", "2", "--warmup-steps", "3", "--lr", "1e-2"]
    assert main(lora + ["--max-minutes", "1e-5"]) == 0
    assert (tmp_path / "cut" / "config.json").is_file()  # merged at the clock's stop
    real = Trainer.train_step

    def step_then_ctrl_c(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # the run saves after this step, to be resumed
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_ctrl_c)
    assert main(lora + ["--resume", "--max-minutes", "0"]) == 130
    assert not (tmp_path / "cut" / "config.json").exists() and not (tmp_path / "cut" / "model.safetensors").exists()
    ids, canvas = torch.tensor([[2, 5, 6, 7]]), torch.full((1, 8), 5)
    now, adapters = blockpress.load(tmp_path / "cut"), blockpress.load(tmp_path / "cut" / "adapter")
    assert torch.equal(now.logits(ids, canvas), adapters.logits(ids, canvas))


def test_held_out_examples_from_a_file_of_their_own(tmp_path, capsys):
    """--heldout-data was refused with JSONL data ("for token-shard data", though it takes raw text too), and a
    JSONL file of examples given with raw text was to be "renamed" to the name it had."""
    data = write_data(tmp_path / "d.jsonl")
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt_ids": [2, 7], "response_ids": [40, 41, 42]}) + "\n")
    args = train_args(data, tmp_path / "out", steps=2)
    args = args[: args.index("--heldout")] + args[args.index("--heldout") + 2 :]
    assert main(args + ["--heldout-data", str(val)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert "eval_loss" in rows[-1]
    saved = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert (saved["heldout_data"], saved["heldout"]) == (str(val), None)  # all of --data trains
    # the eval loss is val.jsonl's own, not a split of d.jsonl's
    from blockpress.train import ExampleSource, TrainConfig, Trainer

    cfg = TrainConfig(**{**saved, "steps": 3})
    evaluate = lambda held: Trainer(blockpress.load(tmp_path / "out"), ExampleSource(held, 0), cfg,  # noqa: E731
                                    tmp_path / "x", heldout=ExampleSource(held, 0), progress=False).evaluate()
    assert evaluate(blockpress.data.load_jsonl(val)) == pytest.approx(rows[-1]["eval_loss"], rel=1e-6)
    capsys.readouterr()
    both = [tmp_path / "both" if a == str(tmp_path / "out") else a for a in args]
    assert main([str(a) for a in both] + ["--heldout-data", str(val), "--heldout", "0.5"]) == 2  # one or the other
    assert "--heldout/--heldout-data: " in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("some running text, " * 40)
    tokenizer = ["--tokenizer", str(MODELS_DIR / "blockpress-code")]
    for data_, held, message in ((data, text, f"--heldout-data {text}: not JSONL examples; with JSONL examples as --data"),
                                 (text, val, f"--heldout-data {val}: JSONL examples (prompt/response")):
        wrong = train_args(data_, tmp_path / "wrong", steps=1)
        wrong = wrong[: wrong.index("--heldout")] + wrong[wrong.index("--heldout") + 2 :]
        assert main(wrong + tokenizer + ["--heldout-data", str(held)]) == 2
        err = capsys.readouterr().err
        assert message in err and "rename" not in err and "token-shard data" not in err, err


def test_held_out_data_that_data_also_reads_is_said_naming_the_files(tmp_path, capsys):
    """--heldout-data inside the --data folder, matched by its glob, or the same file (typed another way) was trained
    on and then scored as held out, without a word; the train files alone (a glob) say nothing."""
    (tmp_path / "d").mkdir()
    write_data(tmp_path / "d" / "train.jsonl")
    val = write_data(tmp_path / "d" / "val.jsonl", n=4)
    text = tmp_path / "t"
    text.mkdir()
    (text / "a.txt").write_text("some running text, " * 40)
    (text / "val.txt").write_text("other running text, " * 40)
    tokenizer = ["--tokenizer", str(MODELS_DIR / "blockpress-code")]
    for i, (data, held) in enumerate(((tmp_path / "d", val), (f"{tmp_path}/d/*.jsonl", val),
                                      (val, tmp_path / "d" / ".." / "d" / "val.jsonl"), (text, text / "val.txt"))):
        args = [a for a in train_args(data, tmp_path / f"out{i}", steps=1) if a != "--quiet"]
        args = args[: args.index("--heldout")] + args[args.index("--heldout") + 2 :]
        assert main([str(a) for a in args] + tokenizer + ["--heldout-data", str(held)]) == 0
        err = capsys.readouterr().err
        named = val.resolve() if held != text / "val.txt" else held
        assert f"warning: --heldout-data {held}: {named} is also read by --data {data}, so the held-out data is " \
               "trained on" in err, err
    args = [a for a in train_args(f"{tmp_path}/d/t*.jsonl", tmp_path / "out", steps=1) if a != "--quiet"]
    args = args[: args.index("--heldout")] + args[args.index("--heldout") + 2 :]
    assert main([str(a) for a in args] + ["--heldout-data", str(val)]) == 0
    assert "also read by" not in capsys.readouterr().err


def test_several_jsonl_files_train_together(tmp_path):
    """A folder of .jsonl files was "a folder without .txt/.py/.md files"; a glob of them "no such data file"."""
    (tmp_path / "many").mkdir()
    write_data(tmp_path / "many" / "a.jsonl", n=4)
    (tmp_path / "many" / "b.jsonl").write_text(json.dumps({"prompt_ids": [2, 9], "response_ids": [30, 31]}) + "\n")
    for given, out in ((tmp_path / "many", "folder"), (tmp_path / "many" / "*.jsonl", "glob")):
        assert main(train_args(given, tmp_path / out, steps=1)) == 0
    assert losses(tmp_path / "folder") == losses(tmp_path / "glob")


def test_a_readme_beside_jsonl_is_left_out_and_said_so(tmp_path, capsys):
    """`--data folder` with train.jsonl and a README.md trained on the README alone, as raw text, without a word."""
    (tmp_path / "data").mkdir()
    write_data(tmp_path / "data" / "train.jsonl")
    (tmp_path / "data" / "README.md").write_text("Line of the dataset card.\n" * 30)
    assert main(train_args(tmp_path / "data", tmp_path / "folder", steps=1)) == 0
    assert f"warning: --data {tmp_path / 'data'}: reads train.jsonl; leaves out README.md" in capsys.readouterr().err
    assert main(train_args(tmp_path / "data" / "train.jsonl", tmp_path / "file", steps=1)) == 0
    assert losses(tmp_path / "folder") == losses(tmp_path / "file")
    (tmp_path / "data" / "notes.txt").write_text("notes\n")
    assert main(train_args(tmp_path / "data", tmp_path / "mixed", steps=1)) == 2
    assert f"error: --data {tmp_path / 'data'}: holds JSONL files (train.jsonl) and raw text (notes.txt)" \
        in capsys.readouterr().err
    # a glob catching the card too was read as token shards: "README.md: cannot read its sidecar README.md.json"
    assert main(train_args(tmp_path / "data" / "*", tmp_path / "glob", steps=1)) == 2
    err = capsys.readouterr().err
    assert f"error: --data {tmp_path / 'data' / '*'}: matches JSONL files ({tmp_path / 'data' / 'train.jsonl'}) " \
           f"and also {tmp_path / 'data' / 'README.md'}, {tmp_path / 'data' / 'notes.txt'}, which are not JSONL" in err
    assert f"narrow it (e.g. '{tmp_path / 'data' / '*.jsonl'}')" in err and not (tmp_path / "glob").exists()


def test_eval_every_evaluates_the_held_out_examples(tmp_path):
    data = write_data(tmp_path / "d.jsonl", n=16)
    args = train_args(data, tmp_path / "out", steps=2)
    args[args.index("--heldout") + 1] = "0.5"
    assert main(args + ["--eval-every", "1", "--lora-alpha", "8", "--lora-rank", "2"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, 2]


@pytest.mark.parametrize("time_schedule", [True, False])
def test_a_timed_runs_progress_counts_minutes_and_the_steps_that_bound_it(tmp_path, capsys, time_schedule):
    """`--max-minutes M --time-schedule` logged "step 35/1000": 1000 is --steps' default, a cap the clock ends first.
    Without --time-schedule, --steps does end the run (and spans its lr schedule), and "step 1, 0.01/60 min" hid it."""
    import signal

    from blockpress.train import ExampleSource, TrainConfig, Trainer

    examples = [blockpress.data.Example([2, 5 + i, 6], [10 + i] * (3 + i % 5)) for i in range(8)]
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0)
    cfg = TrainConfig(steps=7, batch_size=4, log_every=1, warmup_steps=1, max_minutes=2.5, time_schedule=time_schedule)
    ctrl_c = lambda step, loss: os.kill(os.getpid(), signal.SIGINT) if step == 2 else None  # noqa: E731
    Trainer(lm, ExampleSource(examples, 0), cfg, tmp_path / "run", on_step=ctrl_c).train()  # stderr: no terminal
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: step")]
    of = "" if time_schedule else "/7"
    assert len(lines) == 2 and all(re.match(rf"train: step {i + 1}{of}, \d+\.\d\d/2\.5 min, loss ", x)
                                   for i, x in enumerate(lines)), lines


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model.safetensors"])
def test_resume_of_a_damaged_save_names_the_file(tmp_path, capsys, damaged):
    """A truncated trainer_state.pt (a save killed mid-write) gave torch's 15-line traceback, exit 1."""
    data = write_data(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    assert main(train_args(data, out, steps=2)) == 0
    file = out / damaged
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    capsys.readouterr()
    assert main([a for a in train_args(data, out, steps=4) if a not in ("--config", "tiny")] + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert str(file) in err and "Traceback" not in err, err


def test_lora_over_an_adapter_folder_is_refused(tmp_path, capsys):
    """It trained, and wrote adapters whose base_model_name_or_path was null: loadable in no way its errors named."""
    pytest.importorskip("peft")
    data = write_data(tmp_path / "d.jsonl")
    assert main(train_args(data, tmp_path / "base", steps=1)) == 0
    tuned = lambda model, out: [a for a in train_args(data, out, steps=1) if a not in ("--config", "tiny")] + [  # noqa: E731
        "--model", str(model), "--lora-rank", "2"]
    assert main(tuned(tmp_path / "base", tmp_path / "lora")) == 0
    capsys.readouterr()
    assert main(tuned(tmp_path / "lora" / "adapter", tmp_path / "chain")) == 2
    err = capsys.readouterr().err
    assert "--lora-rank: the model is the LoRA adapters in" in err and "Traceback" not in err, err
    assert "that LoRA run's --out holds one" in err and not (tmp_path / "chain").exists()


def test_resume_on_other_data_says_so(tmp_path, capsys):
    """The data was not recorded with the run: --resume on another file went on silently."""
    data, other = write_data(tmp_path / "d.jsonl"), write_data(tmp_path / "other.jsonl", n=6)
    out = tmp_path / "run"
    assert main(train_args(data, out, steps=2)) == 0
    resume = lambda data, steps: [a for a in train_args(data, out, steps=steps) if a not in ("--config", "tiny")] + [  # noqa: E731
        "--resume"]
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(data)
    # its own data, however the path to it is spelled (.., a link): nothing to say
    for steps, same in enumerate([data, tmp_path / "sub" / ".." / "d.jsonl", tmp_path / "link.jsonl"], start=3):
        capsys.readouterr()
        assert main(resume(same, steps)) == 0
        assert "warning: --data" not in capsys.readouterr().err, same
    was, now = (re.escape(str(path.resolve())) for path in (data, other))
    assert main(resume(other, 6)) == 0
    assert re.search(rf"^warning: --data: the run in .*run trained on {was} \(8 examples\), "
                     rf"and continues on {now} \(6 examples\)", capsys.readouterr().err, re.M)


def test_resume_says_when_it_holds_out_other_examples(tmp_path, capsys):
    """A run recorded nothing of its held-out split: resumed on data that changed, or read by a blockpress that
    tokenizes it otherwise (b5c4ace dropped the EOS a prompt/response record's ids ended with), it held out other
    examples without a word, and its held-out loss scored examples it had trained on."""
    data = write_data(tmp_path / "d.jsonl", n=16)
    out = tmp_path / "run"
    args = train_args(data, out, steps=2)
    args[args.index("--heldout") + 1] = "0.5"
    assert main(args) == 0
    resume = [a for a in train_args(data, out, steps=3) if a not in ("--config", "tiny", "--heldout", "0")]
    resume += ["--resume"]
    capsys.readouterr()
    assert main(resume) == 0  # its own data: nothing to say (but the --steps given)
    assert "held out" not in capsys.readouterr().err
    # the same records, their responses read into other ids (as another tokenization reads them)
    held = torch.load(out / "trainer_state.pt", weights_only=True)["data"]["heldout"]
    assert 0 < len(held) < 16
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt_ids": [2, 5 + i, 6], "response_ids": [40 + i] * (3 + i % 5)}) + "\n")
    resume[resume.index("--steps") + 1] = "4"
    assert main(resume) == 0
    err = capsys.readouterr().err
    said = re.search(r"^warning: --resume: the run in .*run held out (\d+) examples, and this resume holds out (\d+): "
                     r"0 of the run's are among them, so (\d+) (?:is|are) no longer held out \(trained on from here "
                     r"on, where the data still holds them\), and the held-out loss from here on includes (\d+) "
                     r"examples? the run did not hold out", err, re.M)
    assert said, err
    assert int(said[1]) == int(said[3]) == len(held) and int(said[2]) == int(said[4]) > 0
    assert "Its data changed, or blockpress's reading of it into tokens did" in err
    # the next resume checks against the split the run now holds out
    resume[resume.index("--steps") + 1] = "5"
    assert main(resume) == 0
    assert "held out" not in capsys.readouterr().err
    # a run saved before the split was recorded resumes as before, with a line that says it cannot be checked
    state = torch.load(out / "trainer_state.pt", weights_only=True)
    del state["data"]["heldout"]
    torch.save(state, out / "trainer_state.pt")
    resume[resume.index("--steps") + 1] = "6"
    assert main(resume) == 0
    err = capsys.readouterr().err
    assert re.search(r"^warning: --resume: the run in .*run was saved by a blockpress that did not record which "
                     r"examples it held out, so whether this resume holds out the same ones cannot be checked", err,
                     re.M) and err.count("held out") == 1, err
    # a split that differs on data of the same path and size: the --resume line alone (the --data line compared
    # the recorded split too, and said the data's path and size twice, equal)
    state = torch.load(out / "trainer_state.pt", weights_only=True)
    state["data"]["heldout"] = ["0" * 16]
    torch.save(state, out / "trainer_state.pt")
    resume[resume.index("--steps") + 1] = "7"
    assert main(resume) == 0
    err = capsys.readouterr().err
    assert "the run in" in err and "held out 1 examples" in err and "--data:" not in err, err


def test_raw_text_windows_are_trained_after_the_tokenizers_bos(tmp_path, monkeypatch):
    """`generate` puts BOS before a text prompt; `train` on raw text cut its windows without one, so a model that had
    learned its text (loss 17.8 -> 0.09) garbled it when prompted ("the cat sat" -> "atatatat")."""
    from blockpress import train

    seen = []

    def recording(examples, *args, **kwargs):
        seen.extend(examples)
        return make_batch(examples, *args, **kwargs)

    make_batch = train.make_batch
    monkeypatch.setattr(train, "make_batch", recording)
    text = tmp_path / "cat.txt"
    text.write_text("the cat sat on the mat. " * 40)
    args = train_args(text, tmp_path / "out", steps=1) + ["--tokenizer", "blockpress-code", "--prompt-max", "8"]
    args[args.index("--heldout") : args.index("--heldout") + 2] = ["--heldout-data", str(text)]
    assert main(args) == 0
    bos = blockpress.load("blockpress-code").tokenizer.bos_id
    assert len(seen) == 4 + 4 * 4  # the step's batch and the evaluation's four
    assert all(e.prompt[0] == bos and bos not in e.prompt[1:] for e in seen)


def test_resume_from_another_folder_finds_the_held_out_data(tmp_path, monkeypatch, capsys):
    """--data was recorded whole and --heldout-data as typed: a run started with --heldout-data val.jsonl and resumed
    from another folder failed with "--heldout-data val.jsonl: no such data file"."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    write_data("d.jsonl")
    write_data("val.jsonl", n=3)
    args = train_args("d.jsonl", tmp_path / "out", steps=2)
    args[args.index("--heldout") : args.index("--heldout") + 2] = ["--heldout-data", "val.jsonl"]
    assert main(args) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", str(tmp_path / "out"), "--resume", "--steps", "3", "--quiet"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval_loss" in row] == [2, 3]
    monkeypatch.chdir(tmp_path / "work")  # the same file typed again as it was: no change of settings to report
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "out"), "--resume", "--steps", "4", "--quiet",
                 "--heldout-data", "val.jsonl"]) == 0
    assert "heldout_data" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--data", "--heldout-data"])
def test_an_empty_jsonl_file_is_named_by_its_flag(tmp_path, capsys, flag):
    """Said "empty.jsonl: no examples", where every other data error names the flag ("--data ...")."""
    (tmp_path / "empty.jsonl").write_text("\n")
    data = write_data(tmp_path / "d.jsonl")
    args = train_args(data, tmp_path / "out", steps=1)
    if flag == "--data":
        args[args.index("--data") + 1] = str(tmp_path / "empty.jsonl")
    else:
        args[args.index("--heldout") : args.index("--heldout") + 2] = ["--heldout-data", str(tmp_path / "empty.jsonl")]
    assert main(args) == 2
    assert f"error: {flag} {tmp_path / 'empty.jsonl'}: no examples" in capsys.readouterr().err


def test_train_starts_by_saying_what_data_it_trains_on(tmp_path, capsys):
    """Nothing said how much data a run read: not the examples a chat's turns make, how many --heldout held out,
    how many epochs --steps makes, nor how much text a folder held (its .venv went unseen that way)."""
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(10):  # two replies each: 20 examples
            f.write(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant",
                                "content": f"hello {i}"}, {"role": "user", "content": "more"},
                                {"role": "assistant", "content": "sure"}]}) + "\n")
    args = [a for a in train_args(chats, tmp_path / "out", steps=2) if a != "--quiet"]
    args[args.index("--heldout") + 1] = "0.3"
    assert main(args + ["--tokenizer", str(MODELS_DIR / "blockpress-code")]) == 0
    held = len([e for e in blockpress.data.load_jsonl(chats, blockpress.load("blockpress-code").tokenizer)]) - 12
    line = f"--data {chats}: 20 examples, 8 held out, 12 trained on; --steps 2 x --batch-size 4 draws 8: 0.667 epochs"
    assert held == 8 and line in capsys.readouterr().err
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "a.py").write_text("def add(a, b):\n    return a + b\n" * 400)
    tokens = len(blockpress.load("blockpress-code").tokenizer.encode((folder / "a.py").read_text())) + 1
    args = [a for a in train_args(folder, tmp_path / "text", steps=2) if a != "--quiet"]
    args[args.index("--heldout") : args.index("--heldout") + 2] = []
    assert main(args + ["--tokenizer", str(MODELS_DIR / "blockpress-code"), "--prompt-max", "16"]) == 0
    share = f"{100 * 2 * 4 * 16 / tokens:.2g}%"  # the tiny preset's canvases are 16 tokens: 2.5%, not "0.0246x"
    assert (f"--data {folder}: {tokens:,} tokens in 1 document; --steps 2 x --batch-size 4 windows of 16 response "
            f"tokens cover {share} of them") in capsys.readouterr().err
    data = write_data(tmp_path / "d.jsonl")  # responses of 3 to 7 ids: the 16-token canvas holds each with its EOS
    long = tmp_path / "long.jsonl"
    long.write_text(data.read_text() + json.dumps({"prompt_ids": [2], "response_ids": [9] * 16}) + "\n")
    args = [a for a in train_args(long, tmp_path / "cut", steps=1) if a != "--quiet"]
    assert main(args + ["--max-canvases", "1"]) == 0
    assert ("9 examples; --steps 1 x --batch-size 4 draws 4: 0.444 epochs; --max-canvases 1 cuts 1 of their "
            "responses short (their end, EOS, is not trained)") in capsys.readouterr().err
    assert main(train_args(chats, tmp_path / "quiet", steps=1) + ["--tokenizer", str(MODELS_DIR / "blockpress-code")]) == 0
    assert "--data" not in capsys.readouterr().err  # --quiet: no such line


def test_the_data_line_of_a_resumed_run_counts_what_the_run_consumed(tmp_path, capsys):
    """The start-up line said --steps x --batch-size even where a resumed run had taken its first steps at another
    batch size: 2 steps at 4 then 3 at 2 draw 14 examples, and it said 10."""
    data = write_data(tmp_path / "d.jsonl")  # 8 examples
    assert main(train_args(data, tmp_path / "run", steps=2)) == 0
    capsys.readouterr()
    again = [a for a in train_args(data, tmp_path / "run", steps=5) if a not in ("--config", "tiny", "--quiet")]
    again[again.index("--batch-size") + 1] = "2"
    assert main(again + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert (f"--data {data}: 8 examples; the 8 of steps 1-2 and steps 3-5 x --batch-size 2 draw 14: 1.75 epochs"
            in err), err
    capsys.readouterr()
    same = [a for a in train_args(data, tmp_path / "run", steps=6) if a not in ("--config", "tiny", "--quiet")]
    same[same.index("--batch-size") + 1] = "2"
    assert main(same + ["--resume"]) == 0  # steps 3-5 were at 2 too, but 1-2 were not: still the run's own count
    assert "the 14 of steps 1-5 and step 6 x --batch-size 2 draw 16: 2 epochs" in capsys.readouterr().err


def test_an_error_on_the_first_line_of_the_data_names_its_flag(tmp_path, capsys):
    """A bad first line said "bad.jsonl:1: not valid JSON", naming neither --data nor --heldout-data (a bad second
    line named the flag)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    data = write_data(tmp_path / "d.jsonl")
    held = train_args(data, tmp_path / "b")
    held[held.index("--heldout") : held.index("--heldout") + 2] = ["--heldout-data", str(bad)]
    for args in (train_args(bad, tmp_path / "a"), held):
        assert main(args) == 2
        flag = "--data" if "--heldout-data" not in args else "--heldout-data"
        assert f"error: {flag} {bad}:1: not valid JSON (Expecting value)" in capsys.readouterr().err


def test_train_refuses_in_its_order_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Where a command line holds two mistakes, the first check says its own, and every one of these is said before
    a model loads (a checkpoint's load takes minutes): the order cmd_train's steps keep."""
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("blockpress.cli.train.load_model", no_load)
    monkeypatch.setattr("blockpress.random_model", no_load)
    data = write_data(tmp_path / "d.jsonl")
    (tmp_path / "a_file").write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.pt").write_bytes(b"")
    (run / "config.json").write_text("{}")
    (tmp_path / "bad.json").write_text("[1]")
    no_data = [a for a in train_args(data, run) if a not in ("--data", str(data))]
    for argv, message in (
            # --out before --data, --data before the folder's run, the run before its checkpoint
            ([*no_data[:no_data.index("--out") + 1], str(tmp_path / "a_file"), *no_data[no_data.index("--out") + 2:]],
             "--out " + str(tmp_path / "a_file") + ": a file, not a folder"),
            # "" was the current folder: the run's files were written among whatever it held
            ([*no_data[:no_data.index("--out") + 1], "", *no_data[no_data.index("--out") + 2:]],
             "--out: expected the folder to write the run to, got ''"),
            (no_data, "--data: required"),
            (train_args(data, run), "already holds a training run (trainer_state.pt)"),
            # the settings (a --train-config) before the model's flags
            (train_args(data, tmp_path / "o") + ["--model", "random-tiny", "--train-config", str(tmp_path / "bad.json")],
             "--train-config " + str(tmp_path / "bad.json")),
            (train_args(data, tmp_path / "o") + ["--model", "random-tiny", "--lr", "-1"], "--lr: expected > 0"),
            (train_args(data, tmp_path / "o") + ["--model", "random-tiny"], "give exactly one of --model"),
            ([*train_args(data, tmp_path / "o")[:1], "--model", "random-tiny", *train_args(data, tmp_path / "o")[3:],
              "--tokenizer", "x"], "--tokenizer: only for a fresh model")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
