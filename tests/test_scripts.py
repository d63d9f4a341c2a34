"""Prepared scripts run end to end on a tiny shape (the GPU runs use the same code)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from fp8 import needs_fp8
from hypothesis import given, settings
from hypothesis import strategies as st
from terminal import read_terminal

ROOT = Path(__file__).parent.parent
# For the scripts that take no --threads (as tests/test_train_cli.py does, and gpu_session.sh for its trainings): torch's
# two threads on a loaded 2-core machine spin against each other, a sudoku training step 3.4 s alone, 10-14.6 s
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_code_model_script(name: str, *args: str, monkeypatch, capsys) -> str:
    """Run scripts/<name> on the shipped code model in this process, as `python scripts/<name>` would (skipped where
    the package does not ship it): its stdout. (A subprocess paid torch's and the model's import: 3-4 s each.)"""
    import pytest

    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    code, out, err = run_script_in_process(f"scripts/{name}", [*args, "--threads", "1"], monkeypatch, capsys)
    assert code in (0, None), err
    return out


@needs_fp8  # its last phase runs fp8 on this CPU
def test_gpu_bench_smoke_on_cpu(tmp_path, monkeypatch, capsys):
    # In this process (a subprocess paid torch's import, 3-4 s), on one thread as ONE_THREAD gave it; the suite's
    # fixture puts the thread count back.
    torch.set_num_threads(1)
    code, _, err = run_script_in_process(
        "scripts/gpu_bench.py", ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-length", "12",
                                 "--new-tokens", "20", "--steps", "2", "--ar-tokens", "6", "--compile-mode", "none",
                                 "--out", str(tmp_path)], monkeypatch, capsys)
    assert code in (0, None), err
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["diffusion"]["new_tokens"] == 20 and data["diffusion"]["forward_passes"] == 2 * 2
    assert data["ar"]["new_tokens"] == 6
    assert data["diffusion"]["tok_s"] > 0 and data["diffusion_over_ar_without_prefill"] > 0
    # 20 diffusion tokens against 6 AR ones: tok_s spreads the prefill over different counts, so no ratio of them
    assert "diffusion_over_ar" not in data and "20 new tokens, AR 6" in data["diffusion_over_ar_omitted"]
    # tok_s is with the prefill, as in `blockpress bench` (it was the rate after it here): every phase has both
    # (AR's after the prefill counts one token fewer, so it need not be the larger)
    for entry in (data["diffusion"], data["fp8"]):
        assert 0 < entry["tok_s"] < entry["tok_s_without_prefill"]
    for entry in (data["ar"], {k[3:]: v for k, v in data["fp8"].items() if k.startswith("ar_")}):
        assert entry["tok_s"] > 0 and entry["tok_s_without_prefill"] > 0
    assert "prefill included" in data["figures"]["tok_s"] and "tok_s_with_prefill" not in data["diffusion"]
    assert "diffusion_compiled" not in data and "compile_error" not in data
    fp8 = data["fp8"]  # the last phase: the same model quantized in place
    assert "fp8_error" not in data and fp8["tok_s"] > 0 and fp8["ar_tok_s"] > 0
    assert fp8["ar_new_tokens"] == 6  # its AR count (at most 64) was in no field, beside eager AR's --ar-tokens
    assert fp8["weights_gb"] < 0.6 * fp8["weights_gb_before"]
    assert 0 < fp8["logits_max_abs_error"] < fp8["logits_max_abs"] and fp8["top1_agreement"] > 0.5
    for trace in data["profile"].values():  # where the next speed change should look
        assert trace["by_time"] and all(row["count"] >= 1 for row in trace["by_time"])
        times = [row["self_ms"] for row in trace["by_time"]]
        assert times == sorted(times, reverse=True) and times[0] > 0
        assert any(row["op"] == "aten::mm" or row["op"] == "aten::addmm" for row in trace["by_count"] + trace["by_time"])


def gpu_bench_module():
    """scripts/gpu_bench.py as a module."""
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("gpu_bench")


def test_gpu_bench_ar_rates_count_the_passes_after_the_prefill():
    """gpu_bench's AR tok_s was the rate after the prefill (bench's tok_s is with it), and it and ms_per_token
    divided the time after the prefill by all n tokens, though the prefill's logits give the first: n - 1 passes
    follow it. 6 tokens in 1 s, 0.5 s of it after the prefill."""
    from blockpress.generate import GenerationOutput

    script = gpu_bench_module()
    out = GenerationOutput(sequences=torch.zeros(1, 9, dtype=torch.long), prompt_length=3, texts=None,
                           tokens_per_forward=torch.ones(1), forward_passes=torch.tensor([6]),
                           num_new_tokens=torch.tensor([6]), steps_per_canvas=torch.ones(1, 1),
                           encode_seconds=0.5, denoise_seconds=0.5)
    assert script.ar_rates(out, 1.0) == pytest.approx({"new_tokens": 6, "tok_s": 6.0, "tok_s_without_prefill": 10.0,
                                                        "ms_per_token": 100.0})
    assert script.diffusion_rates(out, 1.0) == pytest.approx({"tok_s": 6.0, "tok_s_without_prefill": 12.0})


def test_gpu_bench_compares_tok_s_with_the_prefill_only_for_equal_tokens():
    """The prepared session times 256 diffusion tokens and 64 AR ones after one 4,096-token prompt: diffusion_over_ar
    divided tok_s that spread the prefill over 256 and over 64 tokens. With the H200's figures (prefill 0.248 s,
    diffusion 0.823 s after it, AR 54.3 ms a token) that was 239 / 17.4 = 13.7x where 256 AR tokens give 13.2x."""
    script = gpu_bench_module()

    def rates(n, after_s, first_token_free):
        made = n - 1 if first_token_free else n
        return {"new_tokens": n, "tok_s": n / (0.248 + after_s), "tok_s_without_prefill": made / after_s}

    diffusion = rates(256, 0.823, False)
    short_ar, whole_ar = rates(64, 63 * 0.0543, True), rates(256, 255 * 0.0543, True)
    unequal, equal = script.diffusion_over_ar(diffusion, short_ar), script.diffusion_over_ar(diffusion, whole_ar)
    assert "diffusion_over_ar" not in unequal and "256 new tokens, AR 64" in unequal["diffusion_over_ar_omitted"]
    assert equal["diffusion_over_ar"] == pytest.approx(diffusion["tok_s"] / whole_ar["tok_s"]) == pytest.approx(13.2, abs=0.05)
    # after the prefill both are rates per token: the same ratio whatever the AR count
    assert unequal["diffusion_over_ar_without_prefill"] == pytest.approx(equal["diffusion_over_ar_without_prefill"])


def test_gpu_bench_times_graphed_ar_with_the_shape_it_warmed_up():
    """ar_cuda_graphs warmed up on 8 tokens and timed 64: the graph is keyed on the cache's capacity (prompt + new
    tokens + 1), so the timed run captured again. The capture is tests/test_generate.py's eager stand-in, recording
    the capacity of each capture and of each replayed token."""
    from test_generate import ReplayedEncodeStep

    import blockpress
    from blockpress.generate import StepFunctions
    from blockpress.sampling import denoise_step

    class Recorded(ReplayedEncodeStep):
        captured, replayed = [], []

        def capture(self, token, cache, slot):
            self.captured.append(cache.capacity)
            return super().capture(token, cache, slot)

        def __call__(self, input_ids, cache, attention_mask=None, logits="none"):
            if input_ids.shape[1] == 1 and logits == "last":
                self.replayed.append(cache.capacity)
            return super().__call__(input_ids, cache, attention_mask=attention_mask, logits=logits)

    cfg = blockpress.ModelConfig.tiny()
    cfg.text.eos_token_id = None
    lm = blockpress.random_model(cfg, seed=0)
    step = Recorded(lm.model)
    lm.step_functions = StepFunctions(lm.model.denoise, denoise_step, step)
    prompt = torch.randint(3, cfg.text.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    out, seconds, captures = gpu_bench_module().graphed_ar_run(lm, prompt, 6, torch.device("cpu"))
    assert int(out.num_new_tokens[0]) == 6 and seconds >= out.seconds > 0
    # Every graph the runs asked for, the timed run's included, has the timed run's shape. (On a CPU each run's
    # new cache lands elsewhere, so the stand-in captures again; on CUDA the allocator gives the memory back.)
    assert set(step.captured) == set(step.replayed) == {5 + 6 + 1}
    assert captures == step.captures - 1 >= 0


@needs_fp8  # its last phase runs fp8 on this CPU
def test_gpu_bench_keeps_going_past_a_failing_profiler(tmp_path, monkeypatch, capsys):
    """The profile phase raised out of the script: the FP8 phase after it never ran, and the reason was lost."""
    script = gpu_bench_module()

    def broken(fn, device, top=15):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED (stand-in)")

    monkeypatch.setattr(script, "profile_ops", broken)
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                                      "--prompt-length", "8", "--new-tokens", "8", "--steps", "1", "--ar-tokens", "2",
                                      "--compile-mode", "none", "--out", str(tmp_path)])
    script.main()
    data = json.loads((tmp_path / "result.json").read_text())
    assert "stand-in" in data["profile_error"] and "profile" not in data
    assert "fp8_error" not in data and data["fp8"]["tok_s"] > 0


def test_gpu_bench_refuses_what_cannot_fit_before_building_a_model(tmp_path, monkeypatch, capsys):
    """Only random_model's weights check stood before the run: a --prompt-length whose cache cannot fit was torch's
    allocator traceback after the model was built (minutes of a timed lease for the 26B-A4B shape)."""
    import blockpress

    script = gpu_bench_module()
    cfg = blockpress.ModelConfig.preset("tiny")
    weights = blockpress.random_model(cfg, device="meta").weights_bytes()
    per_token = 2 * 4 * sum(spec.num_kv_heads * spec.head_dim for spec in cfg.text.layers)  # float32 keys, values
    monkeypatch.setattr(script, "available_bytes", lambda device: weights + 1000 * per_token)
    real = script.blockpress.random_model
    monkeypatch.setattr(script.blockpress, "random_model", lambda *a, device="cpu", **k: real(*a, device=device, **k)
                        if device == "meta" else pytest.fail("built a model"))
    argv = ["gpu_bench.py", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--new-tokens", "8",
            "--ar-tokens", "2", "--compile-mode", "none", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [*argv, "--prompt-length", "2000"])
    with pytest.raises(SystemExit) as exit:
        script.main()
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "error: --prompt-length/--new-tokens/--ar-tokens: 2000 prompt + 8 new" in err
    assert "KV cache" in err and "Traceback" not in err and not (tmp_path / "result.json").exists()
    monkeypatch.setattr(sys, "argv", [*argv, "--prompt-length", "200000"])  # past the context: said so, too
    with pytest.raises(SystemExit):
        script.main()
    assert "exceed the tiny preset's context of 131072 tokens" in capsys.readouterr().err


def gpu_bench_argv(tmp_path, *extra):
    return ["gpu_bench.py", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-length", "8",
            "--new-tokens", "8", "--steps", "1", "--ar-tokens", "2", "--compile-mode", "none", "--no-profile",
            "--out", str(tmp_path), *extra]


def test_gpu_bench_times_compiled_ar_with_the_shape_it_warmed_up(tmp_path, monkeypatch):
    """The compiled phase warmed AR up on 8 tokens and timed --ar-tokens: the cache's capacity is in the compiled
    graph, so the timed run recompiled (2.3 tok/s against eager's 98 on the tiny preset). compile is a stand-in
    here (compiling takes minutes on a CPU): the runs after it are what is checked."""
    import blockpress

    script = gpu_bench_module()
    calls = []
    real = blockpress.LM.generate_ar
    monkeypatch.setattr(blockpress.LM, "compile", lambda self, **kw: calls.append("compile"))
    monkeypatch.setattr(blockpress.LM, "generate_ar",
                        lambda self, *a, **kw: calls.append(kw["max_new_tokens"]) or real(self, *a, **kw))
    argv = gpu_bench_argv(tmp_path, "--no-fp8", "--ar-tokens", "5")
    monkeypatch.setattr(sys, "argv", [*argv[:argv.index("--compile-mode") + 1], "default",
                                      *argv[argv.index("--compile-mode") + 2:]])
    script.main()
    assert calls[calls.index("compile"):] == ["compile", 5, 5]
    assert json.loads((tmp_path / "result.json").read_text())["ar_compiled"]["new_tokens"] == 5


def test_gpu_bench_says_each_phase_on_stderr_as_it_goes(tmp_path, monkeypatch, capsys):
    """It printed nothing until the end: a session whose timeout cut it had an empty log, and no one knew where it
    stopped. Now a line per phase on stderr; stdout is still the JSON alone."""
    script = gpu_bench_module()
    monkeypatch.setattr(sys, "argv", gpu_bench_argv(tmp_path, "--no-fp8"))
    script.main()
    out, err = capsys.readouterr()
    assert json.loads(out) == json.loads((tmp_path / "result.json").read_text())
    lines = err.splitlines()
    assert lines and all(re.match(r"gpu_bench \[\d+ s\]: ", line) for line in lines)
    said = [line.partition(": ")[2] for line in lines]
    for start in ("building the tiny model", "model built in", "diffusion: warm-up", "diffusion: ", "ar: warm-up"):
        assert any(line.startswith(start) for line in said), (start, said)
    assert re.fullmatch(r"ar: [\d.]+ tok/s", said[-2]) and said[-1] == "done"


def test_gpu_bench_result_stays_whole_when_a_write_is_cut(tmp_path, monkeypatch):
    """result.json was written in place: a kill while it was written (the session's timeout) left a broken file."""
    script = gpu_bench_module()
    real, writes = Path.write_text, []

    def cut_on_the_second(self, text, *args, **kwargs):
        writes.append(self)
        if len(writes) == 2:  # half of it written, then the kill
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", cut_on_the_second)
    monkeypatch.setattr(sys, "argv", gpu_bench_argv(tmp_path, "--no-fp8"))
    with pytest.raises(KeyboardInterrupt):
        script.main()
    data = json.loads((tmp_path / "result.json").read_text())  # the first phase's, whole
    assert data["params_total"] > 0 and "diffusion" not in data


@needs_fp8  # its last phase runs fp8 on this CPU
def test_gpu_bench_warms_up_fp8_ar_before_timing_it(tmp_path, monkeypatch):
    """The FP8 phase timed AR on its first call after quantize (diffusion had a warm-up): the kernels' first call
    was in the figure."""
    import blockpress

    script = gpu_bench_module()
    calls = []  # each generate_ar call: (quantized, inside a timed run)
    timing = [False]
    real_ar, real_timed = blockpress.LM.generate_ar, script.timed

    def generate_ar(self, *args, **kwargs):
        calls.append((self.quantization is not None, timing[0]))
        return real_ar(self, *args, **kwargs)

    def timed(fn, device):
        timing[0] = True
        try:
            return real_timed(fn, device)
        finally:
            timing[0] = False

    monkeypatch.setattr(blockpress.LM, "generate_ar", generate_ar)
    monkeypatch.setattr(script, "timed", timed)
    monkeypatch.setattr(sys, "argv", gpu_bench_argv(tmp_path))
    script.main()
    fp8 = [in_timing for quantized, in_timing in calls if quantized]
    assert fp8 and fp8[0] is False and True in fp8  # an untimed FP8 run came first


@pytest.mark.parametrize("script", ["benchmarks/prefix_cache.py", "benchmarks/load_memory.py",
                                    "benchmarks/prefill_memory.py", "benchmarks/expert_dequant.py",
                                    "scripts/gpu_bench.py"])
def test_preset_help_names_every_preset_the_script_takes(script, monkeypatch, capsys):
    """prefix_cache's and load_memory's --preset help listed tiny, small and medium, yet took 26b-a4b; gpu_bench
    listed all four and took any name (a traceback after startup for one it did not know)."""
    from blockpress.config import preset_names

    code, help_text, _ = run_script_in_process(script, ["--help"], monkeypatch, capsys)
    assert code == 0
    said = " ".join(re.search(r"\n  --preset (.*?)(?=\n  --)", help_text, re.S).group(1).split())
    assert all(name in said for name in preset_names()), said
    code, _, err = run_script_in_process(script, ["--preset", "bogus", "--out", "unused"], monkeypatch, capsys)
    assert code == 2 and "--preset" in err and "Traceback" not in err


def test_profile_train_step_smoke(tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.json"
    # 4 puzzles and no warm-up step: the 64 puzzles and two untimed steps it always took were 2.4 s of its 45.
    # In this process on one thread (as ONE_THREAD gave its subprocess, which paid torch's import: 3-4 s).
    torch.set_num_threads(1)
    code, stdout, err = run_script_in_process(
        "scripts/profile_train_step.py", ["--batch-size", "2", "--steps", "1", "--warmup-steps", "0", "--puzzles", "4",
                                          "--out", str(out)], monkeypatch, capsys)
    assert code in (0, None), err
    data = json.loads(out.read_text())
    assert (data["puzzles"], data["warmup_steps"], data["steps"], data["batch_size"]) == (4, 0, 1, 2)
    assert json.loads(stdout) == data
    assert data["ms_per_step"] > 0 and data["aten_ops"] > 100
    counts = [row["count"] for row in data["by_count"]]
    assert counts == sorted(counts, reverse=True) and data["by_time"]


def test_train_sudoku_gpu_flags_smoke(tmp_path):
    """The options the GPU session uses: a fresh model of another depth and width, puzzles generated by
    several processes into a cache that a bigger run extends, batches built by a worker, a time schedule."""
    cache = tmp_path / "puzzles.jsonl"
    script = str(ROOT / "scripts" / "train_sudoku.py")
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path / "x"), "--puzzles", "6",
                        "--puzzle-cache", str(cache), "--only-puzzles"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    first = cache.read_text().splitlines()
    r = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path / "run"), "--puzzles", "12", "--puzzle-cache", str(cache),
         "--puzzle-workers", "2", "--layers", "2", "--hidden", "64", "--steps", "2", "--batch-size", "4",
         "--heldout-puzzles", "4",
         "--data-workers", "1", "--minutes", "5", "--time-schedule", "--noise", "empty", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in cache.read_text().splitlines()]
    assert [x["seed"] for x in rows] == list(range(12)) and cache.read_text().splitlines()[:6] == first
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["heldout_puzzles"] == 4 and summary["eval"][-1][0] == 2
    import blockpress

    trained = blockpress.load(tmp_path / "run")
    assert trained.config.text.num_hidden_layers == 2 and trained.config.text.hidden_size == 64


def test_train_gpu_sudoku_makes_its_puzzles_through_the_cache(tmp_path):
    """--task sudoku asked for 200,000 puzzles on one process with no cache: ~35 minutes before its --minutes
    budget began. Its puzzles now go through --puzzle-cache (what is there is not made again) and workers."""
    cache = tmp_path / "puzzles.jsonl"
    train_sudoku_module().base_puzzles(4, 0, cache)
    made = cache.read_text()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gpu.py"), "--task", "sudoku", "--device", "cpu",
                        "--minutes", "1", "--steps", "1", "--batch-size", "2", "--puzzles", "6",
                        "--puzzle-cache", str(cache), "--puzzle-workers", "2", "--heldout-puzzles", "2",
                        "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "x" / "model" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["heldout_puzzles"] == 2  # (64 made for one eval batch of 2: 1.4 s)
    rows = cache.read_text()
    assert rows.startswith(made) and [json.loads(x)["seed"] for x in rows.splitlines()] == list(range(6))


def test_train_sudoku_levels_pick_the_difficulties_and_keep_their_own_cache(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "puzzles.jsonl"
    # the all-levels cache that a default run writes, made here (its own subprocess was 2-4 s of the test's 12-15)
    train_sudoku_module().base_puzzles(4, 0, cache)
    assert [json.loads(x)["difficulty"] for x in cache.read_text().splitlines()] == ["easy", "medium", "hard", "easy"]
    run = [sys.executable, str(ROOT / "scripts" / "train_sudoku.py"), "--out", str(tmp_path / "x"), "--puzzles", "4",
           "--puzzle-cache", str(cache), "--only-puzzles"]
    # The all-levels cache is not reused for another mix, nor replaced by it (its puzzles, up to 150k made in tens of
    # CPU minutes, were lost without a word): refused, naming it, and kept as it was.
    before = cache.read_text()
    r = subprocess.run([*run, "--levels", "medium,hard"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and cache.read_text() == before
    assert f"--puzzle-cache {cache}: holds 4 puzzles of --levels easy,medium,hard from seed 0, not of --levels " \
           "medium,hard from seed 0" in r.stderr
    cache = tmp_path / "medium-hard.jsonl"
    r = subprocess.run([*run[:-2], str(cache), "--only-puzzles", "--levels", "medium,hard"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["puzzles"] == 4
    rows = [json.loads(x) for x in cache.read_text().splitlines()]
    assert [x["difficulty"] for x in rows] == ["medium", "hard", "medium", "hard"]
    assert all(x["givens"] < 40 for x in rows)
    code, _, err = run_script_in_process("scripts/train_sudoku.py", [*run[2:], "--levels", "medium,expert"],
                                         monkeypatch, capsys)
    assert code == 2 and "--levels" in err and "Traceback" not in err


def test_train_sudoku_cache_of_more_levels_is_refused_though_it_starts_as_the_runs_levels(tmp_path):
    """A cache of easy,medium,hard begins as one of easy,medium would (its first two rows): only those were
    compared, so a run of --levels easy,medium trained on the hard boards from its third row on, without a word."""
    cache = tmp_path / "puzzles.jsonl"
    base_puzzles = train_sudoku_module().base_puzzles
    base_puzzles(4, 0, cache)  # easy, medium, hard, easy
    before = cache.read_text()
    with pytest.raises(ValueError, match="holds 4 puzzles of --levels easy,medium,hard from seed 0, not of --levels "
                                         "easy,medium from seed 0"):
        base_puzzles(4, 0, cache, levels=("easy", "medium"))
    assert cache.read_text() == before
    # the rows it keeps that are the run's own are still reused: the first two are easy, medium either way
    assert [p.difficulty for p in base_puzzles(2, 0, cache, levels=("easy", "medium"))] == ["easy", "medium"]


def test_train_sudoku_init_from_and_resume_keep_the_models_decoding_defaults(tmp_path):
    """A continued model decodes as the model it continues (the shipped one's sampler, steps and temperatures were
    tuned for it; they were replaced by a fresh model's 32 steps), and a resumed run as it saved them."""
    import blockpress

    if "blockpress-sudoku" not in blockpress.shipped_models():
        pytest.skip("blockpress-sudoku is not in this package")
    out = tmp_path / "run"
    run = [sys.executable, str(ROOT / "scripts" / "train_sudoku.py"), "--out", str(out), "--noise", "empty",
           "--puzzles", "8", "--heldout-puzzles", "2", "--batch-size", "2", "--warmup-steps", "0", "--threads", "1"]
    r = subprocess.run([*run, "--init-from", "blockpress-sudoku", "--steps", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    shipped = blockpress.load("blockpress-sudoku").generation_config
    assert shipped["sampler"] == "topk" and shipped["max_denoising_steps"] == 81  # what is at stake
    assert blockpress.load(out).generation_config == shipped
    r = subprocess.run([*run, "--resume", "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert blockpress.load(out).generation_config == shipped


def test_train_sudoku_puzzles_stopped_by_sigterm_keep_what_was_made(tmp_path):
    """The GPU session stops the puzzle generator at its deadline: the cache used to be written only once all were
    made, so it kept none of them (and the pool's workers went on without their parent)."""
    import os
    import signal
    import time

    script = train_sudoku_module()
    cache = tmp_path / "puzzles.jsonl"
    first = script.base_puzzles(4, 0, cache)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train_sudoku.py"), "--out", str(tmp_path / "x"),
                             "--puzzle-cache", str(cache), "--only-puzzles", "--puzzles", "100000",
                             "--puzzle-workers", "2"], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while len(cache.read_bytes().splitlines()) <= 4 and time.monotonic() < deadline:  # a chunk was made
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        with pytest.raises(ProcessLookupError):  # the workers ended with it
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(rows) > 4 and [r["seed"] for r in rows] == list(range(len(rows)))
    assert [script.Puzzle(**r) for r in rows[:4]] == first
    # A line cut short (a harder kill) is dropped by the next run, which keeps the rest and extends them.
    cache.write_text(cache.read_text() + '{"seed": 99')
    again = script.base_puzzles(len(rows) + 2, 0, cache)
    assert [p.__dict__ for p in again[: len(rows)]] == rows and [p.seed for p in again] == list(range(len(rows) + 2))
    assert [json.loads(line) for line in cache.read_text().splitlines()] == [p.__dict__ for p in again]


def train_sudoku_module():
    """scripts/train_sudoku.py as a module."""
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("train_sudoku")


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),  # were tracebacks, after minutes
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--minutes", "-1"], "--minutes: expected >= 0"),
    (["--layers", "0"], "--layers: expected a positive integer, got 0"),
    (["--hidden", "160"], "--hidden: expected a positive multiple of 64"),  # 5 heads over 2 KV heads
    (["--puzzles", "0"], "--puzzles: expected a positive integer, got 0"),
    (["--heldout-puzzles", "0"], "--heldout-puzzles: expected a positive integer, got 0"),
    (["--resume"], "--resume: {out} has no trainer_state.pt to continue from"),
    (["--init-from", "blockpress-sudoku", "--resume"], "--init-from and --resume: choose one"),
    (["--init-from", "no-such-model"], "--init-from: model 'no-such-model': not a checkpoint folder"),
    (["--threads", "-1"], "--threads: expected 0 (torch's default) or more, got -1"),  # torch's RuntimeError
    (["--device", "nodevice"], "--device: 'nodevice' is not a torch device"),
])
def test_train_sudoku_refuses_bad_values_by_flag_before_generating_puzzles(argv, message, tmp_path, capsys,
                                                                            monkeypatch):
    """Each was checked only after every puzzle was generated (20,000 by default: minutes), most as a traceback."""
    script = train_sudoku_module()
    monkeypatch.setattr(script, "base_puzzles", lambda *a, **kw: pytest.fail("generated puzzles first"))
    monkeypatch.setattr(sys, "argv", ["train_sudoku.py", "--out", str(tmp_path / "run"), *argv])
    with pytest.raises(SystemExit) as done:
        script.main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"train_sudoku.py: error: {message.format(out=tmp_path / 'run')}" in err


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 40))
def test_train_sudoku_config_ends_with_a_full_attention_layer_itself(layers):
    """Any --layers not a multiple of 6 warned 'the last layer must be full attention; forcing it' (the script's own
    pattern ended in a sliding layer)."""
    import warnings

    from blockpress.config import FULL, SLIDING

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        types = train_sudoku_module().sudoku_config(layers).text.layer_types
    assert len(types) == layers and set(types) <= {FULL, SLIDING}
    assert {i for i, kind in enumerate(types) if kind == FULL} == {*range(5, layers, 6), layers - 1}


def tune_code_sampler_module():
    """scripts/tune_code_sampler.py as a module."""
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("tune_code_sampler")


def test_tune_code_sampler_smoke(monkeypatch, capsys):
    # every built-in setting on one function (two, in a batch of two, were 5.4 s of decoding, one 3.9 s on a quiet
    # machine); test_tune_code_sampler_ar_mode_decodes_one_token_per_forward keeps a batch of two
    out = run_code_model_script("tune_code_sampler.py", "--functions", "1", "--batch", "1", "--max-new-tokens", "8",
                                monkeypatch=monkeypatch, capsys=capsys)
    lines = [json.loads(x) for x in out.splitlines()]
    rows, best = lines[:-1], lines[-1]["best"]
    script = tune_code_sampler_module()
    assert [x["setting"] for x in rows] == ["generation_config", *script.SETTINGS[1:]]
    assert all(0 <= x["parseable"] <= 1 and x["tokens_per_forward"] > 0 for x in rows)
    assert best["parseable"] == max(x["parseable"] for x in rows)


def test_tune_code_sampler_ar_mode_decodes_one_token_per_forward(monkeypatch, capsys):
    out = run_code_model_script("tune_code_sampler.py", "--functions", "2", "--batch", "2", "--max-new-tokens", "8",
                                "--ar", "--settings", '[{}, {"frequency_penalty": 0.5}]', monkeypatch=monkeypatch,
                                capsys=capsys)
    rows = [json.loads(x) for x in out.splitlines()][:-1]
    assert [x["setting"] for x in rows] == ["generation_config", {"frequency_penalty": 0.5}]
    assert all(x["tokens_per_forward"] == 1.0 for x in rows)


def test_tune_code_sampler_ar_mode_compares_ar_settings_by_default(monkeypatch, capsys):
    """--ar ran the built-in diffusion settings: the second one's t_max was generate_ar's ValueError traceback,
    after the first had run, and no "best" line."""
    out = run_code_model_script("tune_code_sampler.py", "--functions", "1", "--batch", "1", "--max-new-tokens", "4",
                                "--ar", monkeypatch=monkeypatch, capsys=capsys)
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["setting"] for x in lines[:-1]] == ["generation_config", *tune_code_sampler_module().AR_SETTINGS[1:]]
    assert "best" in lines[-1]


def tune_sudoku_module():
    """scripts/tune_sudoku_sampler.py as a module."""
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("tune_sudoku_sampler")


@pytest.mark.parametrize("argv, message", [
    (["--per-difficulty", "0"], "--per-difficulty: expected a positive integer, got 0"),  # was ZeroDivisionError
    (["--threads", "0"], "--threads: expected a positive integer, got 0"),
    (["--settings", "[{"], "--settings: not JSON"),
    (["--settings", '{"sampler": "topk"}'], "--settings: expected a JSON list of objects"),
    (["--settings", "[]"], "--settings: expected a JSON list of objects"),
    # a misspelt option ran the settings before it, then ended in a traceback, without the "best" line
    (["--settings", '[{}, {"temprature": 1.0}]'], "--settings[1]: 'temprature' is no option of sudoku_model.solve"),
])
def test_tune_sudoku_sampler_refuses_bad_values_by_flag_before_loading(argv, message, capsys, monkeypatch):
    script = tune_sudoku_module()
    monkeypatch.setattr(sys, "argv", ["tune_sudoku_sampler.py"])  # the program name its errors start with
    monkeypatch.setattr(script.blockpress, "load", lambda *a, **kw: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit) as done:
        script.main(argv)
    assert done.value.code == 2 and f"tune_sudoku_sampler.py: error: {message}" in capsys.readouterr().err


def test_tune_sudoku_sampler_refuses_a_model_that_is_no_sudoku_model_before_making_puzzles(capsys, monkeypatch):
    """--model blockpress-code was a traceback from solve, after the puzzles were made."""
    import blockpress

    script = tune_sudoku_module()
    monkeypatch.setattr(sys, "argv", ["tune_sudoku_sampler.py"])
    monkeypatch.setattr(script.blockpress, "load",
                        lambda *a, **kw: blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0))
    monkeypatch.setattr(script, "generate", lambda *a: pytest.fail("made the puzzles first"))
    with pytest.raises(SystemExit) as done:
        script.main(["--model", "some-model", "--per-difficulty", "1"])
    assert done.value.code == 2
    assert "tune_sudoku_sampler.py: error: --model some-model: not a sudoku model" in capsys.readouterr().err


def test_tune_sudoku_sampler_settings_without_sampler_or_steps_take_the_models(capsys, monkeypatch):
    """A --settings entry without "max_denoising_steps" (or "sampler") raised KeyError after the model loaded and
    the puzzles were made."""
    import blockpress

    if "blockpress-sudoku" not in blockpress.shipped_models():
        pytest.skip("blockpress-sudoku is not in this package")
    script = tune_sudoku_module()
    seen = []
    easy = script.generate(3, "easy")  # quick to make; what solve is asked is the point, not how well it does
    monkeypatch.setattr(script, "generate", lambda seed, level: easy)

    def solve(lm, puzzles, steps, sampler, **options):
        seen.append((steps, sampler, options))
        return [script.sudoku_model.ModelSolution(p, easy.solution, True, 1) for p in puzzles]

    monkeypatch.setattr(script.sudoku_model, "solve", solve)
    script.main(["--per-difficulty", "1", "--settings", '[{"t_max": 1.0}, {"sampler": "confidence"}]'])
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r.get("sampler") for r in rows[:2]] == [None, "confidence"] and "best" in rows[2]
    assert seen == [(None, None, {"t_max": 1.0})] * 2 + [(None, "confidence", {})] * 2


def test_rerank_code_candidates_smoke(monkeypatch, capsys):
    out = run_code_model_script("rerank_code_candidates.py", "--functions", "2", "--candidates", "2",
                                "--max-new-tokens", "8", monkeypatch=monkeypatch, capsys=capsys)
    rates = json.loads(out)["parseable"]
    # "any draft parses" is the ceiling of every way of choosing one draft.
    assert all(0 <= rates[k] <= rates["any"] <= 1 for k in ("greedy", "best_total", "best_mean"))


@pytest.mark.parametrize("script", ["tune_code_sampler.py", "rerank_code_candidates.py"])
def test_code_validation_scripts_refuse_a_test_split_that_leaves_no_function(script, monkeypatch, capsys):
    """--test-functions at or past the held-out list's length left nothing to validate on: a ZeroDivisionError
    traceback once the model had loaded."""
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    code, out, err = run_script_in_process(f"scripts/{script}", ["--test-functions", "100000", "--functions", "1",
                                                                  "--threads", "1"], monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert re.search(rf"{script}: error: --test-functions: 100000 skips all (\d+) held-out functions; at most "
                     r"(\d+) leaves one to validate on", err)


def test_prefix_cache_benchmark_smoke(monkeypatch, capsys):
    code, out, err = run_script_in_process(
        "benchmarks/prefix_cache.py", ["--preset", "tiny", "--system-tokens", "40", "--user-tokens", "8", "--turns",
                                       "3", "--new-tokens", "8", "--steps", "1", "--repeats", "1", "--threads", "1"],
        monkeypatch, capsys)
    assert code in (0, None), err
    data = json.loads(out)
    chat, shared = data["chat"], data["shared"]
    # chat: turn k reuses the whole previous prompt and reply; shared: every request after the first reuses the
    # system prompt
    assert chat["prefix_cache"]["reused_tokens"] == (40 + 8) + (40 + 8 + 8 + 8)
    assert shared["prefix_cache"]["reused_tokens"] == 2 * 40 and shared["no_cache"]["reused_tokens"] == 0
    for w in (chat, shared):
        assert w["no_cache"]["prompt_tokens"] == w["prefix_cache"]["prompt_tokens"]
        assert w["encode_ratio"] > 0 and w["total_ratio"] > 0


def test_stream_parse_benchmark_smoke(monkeypatch, capsys):
    """Its two readers of a streamed reply agree at every chunk (it exits naming the reply where they do not), and
    the server's stream of a reply with a call sends the call, with Gemma 4's template and Qwen 3.5's (whose
    markers' patterns start with \\s*: read on too)."""
    code, out, err = run_script_in_process("benchmarks/stream_parse.py", ["--tokens", "60", "--chunk-tokens", "3",
                                                                          "--repeats", "1"], monkeypatch, capsys)
    assert code in (0, None), err
    rows = json.loads(out)["rows"]
    assert [(row["template"], row["kind"]) for row in rows] == [
        (name, kind) for name in ("gemma4", "qwen3.5") for kind in ("plain", "thought", "thought+call")]
    assert [row["calls_sent"] for row in rows] == [0, 0, 1] * 2 and all(row["resumable"] for row in rows)
    assert all(row["chunks"] == -(-row["chars"] // 12) and row["whole_s"] > 0 and row["read_on_s"] > 0 for row in rows)


def test_detokenize_benchmark_smoke(monkeypatch, capsys):
    """Its stream's texts are the whole decodes at every commit (it exits naming the reply where they are not), with
    special tokens dropped and kept, in commits of each size; and a template row's texts and fills, in commits of
    each of its sizes."""
    code, out, err = run_script_in_process("benchmarks/detokenize.py", ["--tokens", "300", "--commit-tokens", "7", "64",
                                                                        "--template-commit-tokens", "5", "32",
                                                                        "--hole-every", "20", "--hole-tokens", "3",
                                                                        "--repeats", "1"], monkeypatch, capsys)
    assert code in (0, None), err
    rows = json.loads(out)["rows"]
    timed = [row for row in rows if "special_tokens" in row]
    assert [(row["commit_tokens"], row["special_tokens"]) for row in timed] == [
        (7, "dropped"), (7, "kept"), (64, "dropped"), (64, "kept")]
    assert all(row["tokens"] == 300 and row["commits"] == -(-300 // row["commit_tokens"]) for row in timed)
    assert all(row["whole_s"] > 0 and row["stream_s"] > 0 for row in timed)
    assert [row["plain_round_trip_s"] > 0 for row in rows if "plain_round_trip_s" in row] == [True]
    template = [row for row in rows if "template_tokens" in row]
    assert [(row["template_tokens"], row["holes"], row["commit_tokens"], row["commits"]) for row in template] == [
        (300, 15, 5, 60), (300, 15, 32, 10)]
    assert all(row["whole_s"] > 0 and row["stream_s"] > 0 for row in template)


def test_prefill_memory_refuses_a_cache_that_cannot_fit(monkeypatch, capsys):
    """--batch 100000000 started a child that died in torch's allocator, its traceback relayed. (In this process:
    a traceback would propagate; the refusal comes before any child is started.)"""
    code, _, err = run_script_in_process("benchmarks/prefill_memory.py",
                                         ["--tokens", "64", "--batch", "100000000", "--chunks", "0"], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("prefill_memory.py: error: --batch/--tokens: 100000000 x 64 tokens need a ")


@pytest.mark.parametrize("script, argv, message", [
    ("prefix_cache", ["--preset", "small"], "--preset: small in float32 needs 0.1 GB of weights but 0.0 GB are "
                                            "available; a smaller --preset"),
    ("load_memory", ["--preset", "medium", "--dtype", "bfloat16"],
     "--preset/--dtype: medium in bfloat16 needs 0.1 GB of weights but 0.0 GB are available; a smaller --preset or "
     "--dtype"),
])
def test_benchmark_scripts_refuse_weights_that_cannot_fit_before_building_them(script, argv, message, monkeypatch,
                                                                               capsys):
    """--preset 26b-a4b (101 GB in float32) on a 24 GB machine was random_model's traceback."""
    import blockpress
    import blockpress.checkpoint

    module = benchmark_module(script)
    monkeypatch.setattr(blockpress.checkpoint, "available_bytes", lambda device: 10_000_000)
    real = blockpress.random_model
    monkeypatch.setattr(blockpress, "random_model", lambda *a, **k: real(*a, **k) if k.get("device") == "meta"
                        else pytest.fail("built the model"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 2 and capsys.readouterr().err.startswith(f"{script}.py: error: {message}")


def test_prefix_cache_refuses_a_chat_past_the_context(monkeypatch, capsys):
    """--system-tokens 140000 on the tiny preset (a 131,072-token context) was generate's traceback."""
    import blockpress

    module = benchmark_module("prefix_cache")
    real = blockpress.random_model
    monkeypatch.setattr(blockpress, "random_model", lambda *a, **k: real(*a, **k) if k.get("device") == "meta"
                        else pytest.fail("built the model"))
    # 131000 + 3 x 16 + 2 x 8 = 131064 prompt tokens: the prompt fits, its reply's 16-token canvas does not
    monkeypatch.setattr(sys, "argv", ["prefix_cache.py", "--preset", "tiny", "--system-tokens", "131000",
                                      "--user-tokens", "16", "--turns", "3", "--new-tokens", "8"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 2
    assert capsys.readouterr().err == ("prefix_cache.py: error: --system-tokens/--user-tokens/--turns/--new-tokens: the "
                                       "chat's last request, 131064 prompt tokens + 8 new tokens in whole 16-token "
                                       "canvases (16 positions), exceeds the tiny preset's context of 131072 tokens "
                                       "(max_position_embeddings)\n")


def test_prefill_memory_refuses_a_prompt_past_the_context(monkeypatch, capsys):
    """--tokens 140000 on the tiny preset (a 131,072-token context) was encoded anyway, for minutes."""
    # in this process: the refusal comes before any child is started (a subprocess only added torch's import), and an
    # exception that is no SystemExit (a traceback in a real run) fails the test
    code, out, err = run_script_in_process("benchmarks/prefill_memory.py",
                                           ["--tokens", "140000", "--chunks", "512", "--repeats", "1"], monkeypatch,
                                           capsys)
    assert code == 2 and "Traceback" not in err and out == ""
    assert err == ("prefill_memory.py: error: --tokens: 140000 tokens exceed the tiny preset's context of 131072 tokens "
                   "(max_position_embeddings)\n")


def test_prefill_memory_benchmark_smoke(monkeypatch, capsys):
    # the script in this process, each encode in the fresh child it measures (as in a real run)
    code, out, err = run_script_in_process("benchmarks/prefill_memory.py",
                                           ["--tokens", "64", "--chunks", "0", "16", "--repeats", "1"], monkeypatch,
                                           capsys)
    assert code in (0, None), err
    runs = json.loads(out)["runs"]
    assert [run["chunk_size"] for run in runs] == [64, 16]  # 0: the whole prompt in one pass
    assert all(run["seconds"] > 0 and run["peak_growth_bytes"] >= 0 for run in runs)


@pytest.mark.parametrize("folder", ["benchmarks", "scripts"])
def test_the_scripts_progress_bars_are_drawn_on_a_terminal_alone(folder, monkeypatch):
    """The benchmarks' bars (tqdm's defaults) were drawn on any stderr: a run logged by CI or nohup filled its log
    with carriage-return redraws. benchmark_args.progress and script_args.progress draw on a terminal (a pty here),
    on stderr, and nothing on a pipe; the items pass through either way."""
    import fcntl
    import importlib.util
    import io
    import pty
    import struct
    import termios

    name = "benchmark_args" if folder == "benchmarks" else "script_args"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main_fd, terminal_fd = pty.openpty()
    # a terminal of 100 columns (a new pty has 0, and tqdm draws nothing in 0)
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    terminal = open(terminal_fd, "w", buffering=1, closefd=True)
    try:
        for stream, drawn in ((terminal, True), (io.StringIO(), False)):
            monkeypatch.setattr(sys, "stderr", stream)
            assert list(module.progress(range(3), desc="puzzles under test", mininterval=0)) == [0, 1, 2]
            if drawn:
                terminal.flush()
                shown = read_terminal(main_fd, 10)
                assert shown, "nothing drawn on the terminal"
                assert "puzzles under test" in shown and "\r" in shown
            else:
                assert stream.getvalue() == ""
    finally:
        terminal.close()
        os.close(main_fd)


def test_sudoku_benchmark_smoke(monkeypatch, capsys):
    """The side-by-side table's script on the shipped model and the kept AR baseline: every engine, every
    difficulty, figures in range (the puzzles are fresh, so the rates are not fixed; the easy ones the model
    solves, as tests/test_sudoku_model.py checks on its own set)."""
    # 12 steps at most (40 were 266 decoder passes over the four engines, 6 of its 10 s on a quiet machine)
    code, out, err = run_script_in_process(
        "benchmarks/sudoku.py", ["--per-difficulty", "2", "--batch", "2", "--steps", "12", "--rules", "--ensemble", "2",
                                 "--threads", "1"], monkeypatch, capsys)
    assert code in (0, None), err
    assert "\r" not in err  # its bars are a terminal's: a log (here a capture, as CI's pipe) gets no redraws
    data = json.loads(out)
    assert data["per_difficulty"] == 2 and data["params"] > 1_000_000
    for level in ("easy", "medium", "hard"):
        assert set(data[level]) == {"diffusion", "diffusion_rules", "diffusion_ensemble", "ar"}
        for figures in data[level].values():
            assert 0 <= figures["exact"] <= 1 and 0 < figures["cell_accuracy"] <= 1
            assert figures["puzzles_per_s"] > 0
        assert all(0 < data[level][k]["mean_steps"] <= 12 for k in ("diffusion", "diffusion_rules", "diffusion_ensemble"))


@pytest.mark.parametrize("healing", ["40", "0"])
def test_code_model_refuses_a_skip_past_every_held_out_function(healing, monkeypatch, capsys):
    """--skip 100000 was a ZeroDivisionError, or with --healing-functions 0 a JSON of 0 functions whose rates read
    0.0 (every completion failing)."""
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    code, out, err = run_script_in_process("benchmarks/code_model.py", ["--skip", "100000", "--infills", "0",
                                           "--healing-functions", healing], monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert re.fullmatch(r"code_model.py: error: --skip: 100000 skips all (\d+) held-out functions; at most (\d+) leaves one\n", err)


@pytest.mark.parametrize("script", ["code_model.py", "quant_quality.py"])
def test_code_benchmarks_split_the_functions_as_the_tuning_scripts_whatever_the_seed(script, monkeypatch, capsys):
    """--seed shuffled the held-out functions too: with any seed but 0 the test split (the first --functions) took
    8-15 of its 100 functions from the ones tune_code_sampler.py and rerank_code_candidates.py validate on (shuffled
    with seed 0, after the first 100), where their docstrings say the two sets are disjoint."""
    import blockpress
    import blockpress.tasks.code

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    shuffles = []

    class Split(Exception):
        """the run stopped once the split was asked for: the rest is the sampler's"""

    def heldout(model_dir, manifest=None, seed=0):
        shuffles.append(seed)
        raise Split

    monkeypatch.setattr(blockpress.tasks.code, "model_heldout_functions", heldout)
    with pytest.raises(Split):
        run_script_in_process(f"benchmarks/{script}", ["--seed", "3", "--functions", "1", "--threads", "1"],
                              monkeypatch, capsys)
    assert shuffles == [0]


def test_code_model_refuses_new_tokens_past_the_context(monkeypatch, capsys):
    """--max-new-tokens 100000 was generate's ValueError traceback at the first prompt."""
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    code, out, err = run_script_in_process("benchmarks/code_model.py", ["--max-new-tokens", "3841", "--functions",
                                           "1"], monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == ("code_model.py: error: --max-new-tokens: prompts of up to 256 tokens + 3841 new tokens in whole "
                   "32-token canvases (3872 positions) exceed blockpress-code's context of 4096 tokens; at most 3840 fits\n")


def test_code_model_sampler_options_reach_both_engines_as_a_dict():
    module = benchmark_module("code_model")
    args = module.build_parser().parse_args(["--sampler-options", '{"frequency_penalty": 0.5, "t_max": 0.7}'])
    assert args.sampler_options == {"frequency_penalty": 0.5, "t_max": 0.7}


@needs_fp8  # one of its schemes is fp8, on this CPU
def test_quant_quality_benchmark_smoke(monkeypatch, capsys):
    """Every scheme's block, each judged against the unquantized load: that one agrees with itself exactly, the
    quantized ones hold fewer bytes and differ in their logits; the rates are rates (1 function: not a threshold)."""
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    code, out, err = run_script_in_process("benchmarks/quant_quality.py", ["--functions", "1", "--max-new-tokens", "1",
                                                                           "--threads", "1"], monkeypatch, capsys)
    assert code in (0, None), err
    assert "\r" not in err  # (no bar redraws off a terminal)
    data = json.loads(out)
    assert data["functions"] == 1 and data["dtype"] == "float32"
    schemes = ("none", "int8", "fp8", "int4")
    assert [key for key in data if key in schemes] == list(schemes)  # the reference first
    exact = {"top1_agreement": 1.0, "mean_kl": 0.0, "max_abs_diff": 0.0}
    assert data["none"]["logits"] == {"clean": exact, "masked": exact}  # blockpress-code: absorbing noise
    assert data["none"]["diffusion"]["same_text"] == 1.0
    for scheme in schemes:
        diffusion = data[scheme]["diffusion"]
        for logits in data[scheme]["logits"].values():
            assert 0 <= logits["top1_agreement"] <= 1 and logits["mean_kl"] >= 0
            if scheme != "none":
                assert logits["max_abs_diff"] > 0 and logits["mean_kl"] > 0
        assert 0 <= diffusion["parseable_without_loops"] <= diffusion["parseable"] <= 1
        assert 0 <= diffusion["same_text"] <= 1 and diffusion["tokens_per_forward"] > 0 and diffusion["tok_s"] > 0
    sizes = {scheme: data[scheme]["weights_bytes"] for scheme in schemes}
    assert sizes["int4"] < sizes["int8"] == sizes["fp8"] < sizes["none"]


@given(st.integers(1, 6), st.integers(2, 9), st.floats(-50, 50), st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_quant_quality_logit_agreement_is_kl_top1_and_max_difference(rows, vocab, shift, seed):
    """Shifting a row's logits changes no probability: KL 0 and the same argmax, with |shift| the largest
    difference; against other logits the KL is torch's kl_div of the two log-softmaxes."""
    import torch.nn.functional as F

    module = benchmark_module("quant_quality")
    generator = torch.Generator().manual_seed(seed)
    ref = [torch.randn(rows, vocab, generator=generator) * 3 for _ in range(2)]
    shifted = module.logit_agreement(ref, [r + shift for r in ref])
    assert shifted["top1_agreement"] == 1.0 and abs(shifted["mean_kl"]) < 1e-4
    assert shifted["max_abs_diff"] == pytest.approx(abs(shift), abs=1e-4)
    other = [torch.randn(rows, vocab, generator=generator) for _ in range(2)]
    figures = module.logit_agreement(ref, other)
    p, q = torch.cat(ref).log_softmax(-1), torch.cat(other).log_softmax(-1)
    assert figures["mean_kl"] == pytest.approx(F.kl_div(q, p, log_target=True, reduction="batchmean").item(), rel=1e-4)
    assert figures["top1_agreement"] == (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    assert figures["max_abs_diff"] == (torch.cat(ref) - torch.cat(other)).abs().max().item()


def test_quant_quality_clean_canvas_is_the_body_then_eos():
    """The canvas the logits are taken on: the newline the prompt leaves out and the body, cut to one canvas, with
    eos after a body shorter than a canvas (as training fills one)."""
    import blockpress
    from blockpress.tasks.code import Function

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    module = benchmark_module("quant_quality")
    lm = blockpress.load("blockpress-code", dtype="float32")
    canvas, eos = lm.config.canvas_length, lm.eos_ids[0]
    short = Function("m.py", "def f(x):\n", "def f(x):\n", "    y = x\n    return y\n")
    ids = lm.tokenizer.encode("\n" + short.body, add_bos=False)
    assert len(ids) < canvas and module.clean_canvas(lm, short) == ids + [eos] * (canvas - len(ids))
    long = Function("m.py", "def g():\n", "def g():\n", "".join(f"    a{i} = {i}\n" for i in range(40)))
    got = module.clean_canvas(lm, long)
    assert len(got) == canvas and eos not in got
    assert ("\n" + long.body).startswith(lm.tokenizer.decode(got))


def test_sudoku_benchmark_interrupted_prints_the_difficulties_finished(monkeypatch, capsys):
    """A Ctrl-C was a KeyboardInterrupt traceback with nothing on stdout: an ensemble run's finished difficulties,
    many minutes of it, were lost."""
    module = benchmark_module("sudoku")
    real_solve = module.sudoku_model.solve
    calls = []

    def interrupted_at_medium(lm, puzzles, *args, **kwargs):
        calls.append(puzzles)
        if len(calls) == 2:  # the first medium batch: easy is done
            raise KeyboardInterrupt
        return real_solve(lm, puzzles, *args, **kwargs)

    monkeypatch.setattr(module.sudoku_model, "solve", interrupted_at_medium)
    monkeypatch.setattr(sys, "argv", ["sudoku.py", "--ar-model", "", "--per-difficulty", "1", "--steps", "40",
                                      "--threads", "1"])
    with pytest.raises(SystemExit) as done:
        module.main()
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert done.value.code == 130 and data["partial"] is data["interrupted"] is True
    assert "easy" in data and "medium" not in data and 0 <= data["easy"]["diffusion"]["exact"] <= 1
    assert captured.err.strip().splitlines()[-1] == ('sudoku.py: interrupted after 1 of 3 difficulties (easy: their '
                                                     'JSON on stdout, marked "partial")')


def test_sudoku_benchmark_refuses_a_model_of_another_task_before_making_puzzles():
    """blockpress-code as --model made the puzzles, then died in a traceback (ValueError: model: not a sudoku model)."""
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sudoku.py"), "--model", "blockpress-code",
                        "--ar-model", "", "--per-difficulty", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line
    assert r.stderr.startswith("sudoku.py: error: --model blockpress-code: not a sudoku model: its vocabulary has 8192 tokens")


def test_serve_load_says_in_one_line_why_the_server_refused_its_requests():
    """--max-tokens past the model's context: the server's 400 was the openai client's 21-line traceback."""
    pytest.importorskip("openai")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--model", "random-tiny",
                        "--max-tokens", "200000", "--levels", "1", "--requests", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("serve_load.py: error: the server refused a request (HTTP 400: max_tokens: ")
    assert "exceed the context of 131072 tokens); a smaller --max-tokens fits" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_load_runs_each_level_once_in_ascending_order(monkeypatch, capsys):
    """--levels 2 1 2 ran three levels and reported two: the second run of 2 replaced the first in the JSON."""
    pytest.importorskip("openai")
    module = benchmark_module("serve_load")
    pools = []
    real_pool = module.cf.ThreadPoolExecutor

    def counted(workers):
        pools.append(workers)
        return real_pool(workers)

    # the script's own name for concurrent.futures alone: the openai client's pools stay as they are
    monkeypatch.setattr(module, "cf", types.SimpleNamespace(ThreadPoolExecutor=counted))
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--model", "random-tiny", "--levels", "2", "1", "2",
                                      "--requests", "2", "--max-tokens", "2"])
    module.main()
    assert pools == [1, 2] and list(json.loads(capsys.readouterr().out)["levels"]) == ["1", "2"]


def test_serve_load_queues_the_largest_level_and_keeps_the_levels_measured_when_refused(monkeypatch, capsys):
    """--levels 100 300 --requests 300: the server's queue was a fixed 256, so level 300 got its 429 "the request
    queue is full" and the run ended with exit 1 and nothing on stdout, level 100's figures lost. The queue is now
    sized for the largest level; and a level the server refuses all the same (here a queue cut to 1 under the
    script, a stand-in for 300 real clients) still prints the levels measured before it, marked partial."""
    pytest.importorskip("openai")
    module = benchmark_module("serve_load")
    asked = []
    real_create_app = module.create_app

    def queue_of_one(lm, name, *, max_queue, max_batch):
        asked.append(max_queue)
        return real_create_app(lm, name, max_queue=1, max_batch=max_batch)

    monkeypatch.setattr(module, "create_app", queue_of_one)
    pools = []  # the client's connection pool: httpx's default of 1,000 ran a level past it at 1,000 at once
    real_client = module.openai.DefaultHttpxClient

    def client(**kwargs):
        pools.append(kwargs["limits"].max_connections)
        return real_client(**kwargs)

    monkeypatch.setattr(module.openai, "DefaultHttpxClient", client)
    # one in a batch, one waiting: of 4 clients at once, the others are refused
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--model", "random-tiny", "--levels", "1", "1500",
                                      "--requests", "4", "--max-tokens", "4", "--max-batch", "1"])
    with pytest.raises(SystemExit) as done:
        module.main()
    captured = capsys.readouterr()
    assert asked == [1500] and pools == [1500] and done.value.code == 1
    assert "error: the server refused a request (HTTP 429: " in captured.err
    result = json.loads(captured.out)
    assert result["partial"] is True and list(result["levels"]) == ["1"] and result["levels"]["1"]["requests"] == 4


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(0, 100), min_size=1, max_size=40))
def test_serve_load_p95_is_never_below_the_median(values):
    """Rounding the rank down reported p95 below p50 for two requests."""
    import statistics

    pytest.importorskip("openai")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import nearest_rank

    lat = sorted(values)
    p95 = nearest_rank(lat, 0.95)
    assert p95 in lat and p95 >= statistics.median(lat) and nearest_rank(lat, 1.0) == lat[-1]


@pytest.mark.parametrize("argv, message", [
    # every file held out: an empty train.bin and a tokenizer trained on nothing (exit 0)
    (["--heldout", "1.5"], "--heldout: expected a fraction in [0, 1), got 1.5"),
    (["--heldout", "-1"], "--heldout: expected a fraction in [0, 1), got -1"),  # none held out
    (["--max-files", "-1"], "--max-files: expected an integer >= 0 (0: every file), got -1"),  # files[:-1]
    (["--vocab-size", "10"], "--vocab-size: expected at least 262 (the 256 bytes and 6 special tokens), got 10"),
    # one file read, held out (its hash is below 0.999999): nothing left to train on
    (["--heldout", "0.999999", "--max-files", "1"], "--heldout 0.999999: all 1 files read were held out, none is "
                                                    "left to train on"),
])
def test_build_code_corpus_refuses_flags_that_make_a_broken_corpus(tmp_path, monkeypatch, capsys, argv, message):
    """Each was a corpus written with exit 0: the flag's values were never checked."""
    code, out, err = run_script_in_process("scripts/build_code_corpus.py", ["--out", str(tmp_path / "c"), *argv],
                                           monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"build_code_corpus.py: error: {message}" in err
    assert not (tmp_path / "c" / "train.bin").exists()


def build_code_corpus_module():
    """scripts/build_code_corpus.py as a module."""
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("build_code_corpus")


def test_build_code_corpus_names_modules_with_slashes_on_every_platform():
    """The held-out split hashes each module's path under the stdlib: str() of it had backslashes on Windows, so the
    same stdlib split otherwise there, and its manifest named modules as no other platform does."""
    from pathlib import PureWindowsPath

    script = build_code_corpus_module()
    root = PureWindowsPath(r"C:\Python311\Lib")
    name = script.module_name(root / "concurrent" / "futures" / "process.py", root)
    assert name == "concurrent/futures/process.py" and script.is_heldout(name, 0.05)  # held out in the shipped split


def test_build_code_corpus_reproduces_the_shipped_split():
    """The names it hashes give the shipped blockpress-code's held-out modules again, from the stdlib it was built
    from (only there: another Python's stdlib has other files)."""
    import sysconfig

    manifest = json.loads((ROOT / "blockpress" / "models" / "blockpress-code" / "corpus_manifest.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    if str(root) != manifest["source"]:
        pytest.skip(f"the shipped corpus was built from {manifest['source']}, not this stdlib ({root})")
    script = build_code_corpus_module()
    names = [script.module_name(path, root) for path in script.stdlib_files(root)]
    assert len(names) == manifest["train_files"] + manifest["heldout_files"]  # (no exact copy dropped here)
    assert [name for name in names if script.is_heldout(name, 0.05)] == manifest["heldout_modules"]


@pytest.mark.parametrize("name", ["", ".", "..", "../escape", "a/b"])
def test_package_model_refuses_names_outside_the_models_folder(name):
    """"" or "." named the models folder itself: packaging replaced every shipped model with the new one."""
    models = ROOT / "blockpress" / "models"
    before = sorted(p.name for p in models.iterdir())
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "package_model.py"), "blockpress-code", name],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "name: expected a plain folder name" in r.stderr
    assert sorted(p.name for p in models.iterdir()) == before


def test_package_model_over_its_size_limit_says_it_as_its_other_refusals(tmp_path, monkeypatch, capsys):
    """A package over --max-mb ended with its message bare (exit 1), where the script's other refusals say
    "package_model.py: error: ..." (exit 2, argparse's); the shipped models stay as they were."""
    import blockpress

    models = ROOT / "blockpress" / "models"
    before = sorted(p.name for p in models.iterdir())
    blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8)).save(tmp_path / "ckpt")
    code, out, err = run_script_in_process("scripts/package_model.py", [str(tmp_path / "ckpt"), "tiny-test",
                                           "--dtype", "float32", "--max-mb", "0.01"], monkeypatch, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert re.search(r"\npackage_model.py: error: tiny-test: \d+\.\d MB is over --max-mb 0.01; the package is "
                     r"unchanged\n$", err)
    assert sorted(p.name for p in models.iterdir()) == before


def test_package_model_carries_the_checkpoints_corpus_manifest_over(tmp_path, monkeypatch, capsys):
    """Re-packaging a code model (new --generation defaults) without --manifest dropped its corpus_manifest.json,
    the record of its held-out modules, where metrics.jsonl and summary.json came along: the code benchmarks then
    stopped with "no corpus manifest". A --manifest given still replaces it."""
    import shutil

    import blockpress

    src = tmp_path / "ckpt"
    blockpress.random_model(blockpress.ModelConfig.tiny(vocab_size=32, canvas_length=8)).save(src)
    (src / "corpus_manifest.json").write_text('{"heldout_modules": ["chunk.py"]}')
    (src / "summary.json").write_text("{}")
    other = tmp_path / "other.json"
    other.write_text('{"heldout_modules": ["other.py"]}')
    # a copy of the script, whose models folder (beside it, as the package's is) is the test's own: written into the
    # package, the model would be listed by shipped_models() for tests running meanwhile, and shipped if left behind
    repo = tmp_path / "repo"
    (repo / "blockpress" / "models").mkdir(parents=True)
    shutil.copytree(ROOT / "scripts", repo / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    dst = repo / "blockpress" / "models" / "tiny-manifest-test"
    for extra, shipped in (([], src / "corpus_manifest.json"), (["--manifest", str(other)], other)):
        code, _, err = run_script_in_process("scripts/package_model.py", [str(src), dst.name, "--dtype", "float32",
                                             *extra], monkeypatch, capsys, root=repo)
        assert code in (0, None), err
        assert (dst / "corpus_manifest.json").read_text() == shipped.read_text()
        assert (dst / "summary.json").read_text() == "{}"
    assert not (ROOT / "blockpress" / "models" / dst.name).exists()


def test_load_memory_peak_is_the_childs_own():
    """A child inherits its parent's peak resident size across fork and exec: the peak read in the child was the
    parent's (which had just built and saved the model), so the reported peak growth came out far below the
    growth the child itself held (0.8 MB against 84 MB). Here the parent first holds 600 MB, then frees them."""
    launcher = ("import runpy, sys; x = bytearray(600 << 20); x[::4096] = b'1' * len(x[::4096]); del x; "
                f"sys.argv = [{str(ROOT / 'benchmarks' / 'load_memory.py')!r}, '--preset', 'tiny']; "
                f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["blockpress"]
    assert row["peak_growth_bytes"] >= row["rss_growth_after_touch"] > 0
    assert row["peak_over_disk"] == row["peak_growth_bytes"] / json.loads(r.stdout)["disk_bytes"]
    # torch's lazily imported modules (~80 MB) are in the baseline: what a tiny checkpoint adds is small
    assert row["rss_growth_after_touch"] < 40e6


def test_load_memory_reports_the_quantized_weights_it_holds(monkeypatch, capsys):
    """A quantized load reads and converts every weight before `load` returns, so what touching them adds is not
    its weights: a figure once called weights_resident_over_disk read 0.12 for int4 weights a third the file's size.
    (The script in this process; the load in the fresh child it measures, as in a real run.)"""
    code, stdout, err = run_script_in_process("benchmarks/load_memory.py", ["--preset", "tiny", "--quantize", "int4"],
                                              monkeypatch, capsys)
    assert code in (0, None), err
    out = json.loads(stdout)
    row = out["blockpress"]
    assert row["weights_over_disk"] == row["weights_bytes"] / out["disk_bytes"]
    assert 0 < row["weights_over_disk"] < 0.5  # int4 of float32 weights, with their scales and the float norms
    assert row["read_growth_over_disk"] == (row["rss_growth_after_touch"] - row["rss_growth_after_load"]) / out["disk_bytes"]


def test_load_memory_without_a_resettable_peak_samples_it(tmp_path, monkeypatch):
    """Where /proc/self/clear_refs cannot reset the peak, the sampled resident size stands in, and says so."""
    import blockpress

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import load_memory

    blockpress.random_model(blockpress.ModelConfig.preset("tiny")).save(tmp_path)
    monkeypatch.setattr(load_memory, "reset_peak", lambda: False)
    row = load_memory.measure_load(str(tmp_path), None)
    assert row["peak_from"].startswith("VmRSS sampled")
    assert row["peak_growth_bytes"] >= row["rss_growth_after_touch"]


def test_load_memory_shows_the_childs_error(monkeypatch, capsys):
    """A failing child was a CalledProcessError that hid the child's own error (its stderr was captured)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import load_memory

    real_run = subprocess.run

    def failing_child(args, **kwargs):
        return real_run([sys.executable, "-c", "import sys; sys.exit('ValueError: load: the child broke')"], **kwargs)

    monkeypatch.setattr(subprocess, "run", failing_child)  # (benchmark_args.measure_in_child runs it)
    monkeypatch.setattr(sys, "argv", ["load_memory.py", "--preset", "tiny"])
    with pytest.raises(SystemExit) as done:
        load_memory.main()
    err = capsys.readouterr().err
    assert done.value.code == 1 and err.startswith("load_memory.py: error: the loading process failed (exit status 1)")
    assert "ValueError: load: the child broke" in err


def signal_self_once(signum: int, ready) -> None:
    """From a thread: send `signum` to this process once `ready()` is true (given up after 60 s)."""
    import threading
    import time

    def wait_then_signal():
        deadline = time.time() + 60
        while not ready():
            if time.time() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait_then_signal, daemon=True).start()


@contextlib.contextmanager
def signal_fails_the_test(signum: int):
    """While inside, `signum` sent to this process fails the test where the code under test does not take it: a
    SIGTERM or SIGHUP would otherwise end the whole pytest run."""
    def reached_us(signum, frame):
        raise AssertionError(f"signal {signum} reached the test's process: the code under test did not take it")

    previous = signal.signal(signum, reached_us)
    try:
        yield
    finally:
        signal.signal(signum, previous)


@pytest.mark.parametrize("signum", [15, 1])  # SIGTERM, SIGHUP
def test_a_stop_signal_to_a_memory_benchmark_stops_its_measuring_child(tmp_path, signum):
    """prefill_memory and load_memory measure in a child process: a SIGTERM (a scheduler, `kill`) or SIGHUP to the
    script ended it and left the child measuring on, an orphan. Now the child is killed with it, and the script
    ends with 128 + the signal and one line."""
    import time

    module = benchmark_module("benchmark_args")
    pid_file = tmp_path / "pid"
    child = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(120)"]
    signal_self_once(signum, lambda: pid_file.exists() and pid_file.read_text())
    started = time.time()
    with signal_fails_the_test(signum), pytest.raises(SystemExit) as done:
        module.measure_in_child(child, "the loading process")
    assert done.value.code == 128 + signum and time.time() - started < 30
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process
        os.kill(pid, 0)
    assert signal.getsignal(signum) is not None  # the handlers in place before are back


def benchmark_module(name: str):
    """benchmarks/<name>.py as a module (its sibling benchmark_args importable)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def run_script_in_process(script: str, argv: list[str], monkeypatch, capsys, root: Path = ROOT
                          ) -> tuple[int | str | None, str, str]:
    """Run <root>/<script> as `python <script> *argv` would, in this process: (exit code, stdout, stderr).

    For a refusal made before any model work, a subprocess only adds torch's import (3-9 s each on a busy 2-core
    CI machine). An exception that is no SystemExit (a traceback in a real run) propagates and fails the test."""
    import runpy

    path = root / script
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])  # as python puts the script's folder first
    code = 0
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # sys.exit("message"): Python prints it to stderr and exits 1
        code, err = 1, err + code + "\n"
    return code, out, err


@pytest.mark.parametrize("script, argv, message", [
    ("prefix_cache", ["--repeats", "0"], "--repeats: expected a positive integer, got '0'"),  # was KeyError
    ("prefix_cache", ["--turns", "0"], "--turns: expected a positive integer"),  # was ZeroDivisionError
    ("prefix_cache", ["--threads", "0"], "--threads: expected a positive integer"),  # was torch's RuntimeError
    ("prefix_cache", ["--system-tokens", "-1"], "--system-tokens: expected an integer >= 0, got '-1'"),
    ("sudoku", ["--per-difficulty", "0"], "--per-difficulty: expected a positive integer"),  # was ZeroDivisionError
    ("sudoku", ["--batch", "x"], "--batch: expected a positive integer, got 'x'"),
    ("sudoku", ["--ensemble", "-2"], "--ensemble: expected an integer in [0, 64], got '-2'"),
    # past what the library takes: a traceback once the model was loaded, after the first difficulty's plain run
    ("sudoku", ["--ensemble", "65"], "--ensemble: expected an integer in [0, 64], got '65'"),
    ("sudoku", ["--steps", str(2**31)], f"--steps: expected an integer in [1, {2**31 - 1}], got '{2**31}'"),
    ("prefix_cache", ["--steps", str(2**31)], f"--steps: expected an integer in [1, {2**31 - 1}], got '{2**31}'"),
    ("code_model", ["--functions", "0"], "--functions: expected a positive integer"),
    ("code_model", ["--healing-functions", "-1"], "--healing-functions: expected an integer >= 0"),
    ("quant_quality", ["--functions", "0"], "--functions: expected a positive integer"),
    ("quant_quality", ["--schemes", "int2"], "--schemes: invalid choice: 'int2'"),
    ("quant_quality", ["--model", "blockpress-cod"], "--model: model 'blockpress-cod': no such folder"),
    ("serve_load", ["--levels", "1", "0"], "--levels: expected a positive integer"),  # was a ThreadPool traceback
    ("serve_load", ["--max-batch", "0"], "--max-batch: expected a positive integer"),
    ("load_memory", ["--dtype", "float64"], "--dtype: invalid choice"),
    ("prefix_cache", ["--preset", "huge"], "--preset: unknown preset 'huge'; expected one of"),  # was a traceback
    ("load_memory", ["--preset", "huge"], "--preset: unknown preset 'huge'; expected one of"),
    # a folder that is no checkpoint, a typo of a shipped name: an 18-line traceback once loading started
    ("sudoku", ["--model", str(ROOT / "docs")], f"--model: {ROOT / 'docs' / 'config.json'}: no config.json"),
    ("sudoku", ["--ar-model", "blockpress-sudok"], "--ar-model: model 'blockpress-sudok': no such folder"),
    # bad JSON, a list, a misspelt or bad setting: JSONDecodeError, AttributeError, generate's ValueError tracebacks
    ("code_model", ["--sampler-options", "{bad"], "--sampler-options: expected a JSON object, got '{bad'"),
    ("code_model", ["--sampler-options", "[1]"], "--sampler-options: expected a JSON object of sampler settings"),
    ("code_model", ["--sampler-options", '{"temprature": 1}'], "--sampler-options: temprature: no such sampler "
                                                                "setting; expected some of sampler, "),
    ("code_model", ["--sampler-options", '{"t_max": -1}'], "--sampler-options: t_max: expected >= 0, got -1"),
    ("code_model", ["--model", str(ROOT / "docs")], f"--model: {ROOT / 'docs' / 'config.json'}: no config.json"),
    ("code_model", ["--model", str(ROOT / "README.md")], "--model: model " + repr(str(ROOT / "README.md")) + ": a file"),
    ("serve_load", ["--model", "blockpress-cod"], "--model: model 'blockpress-cod': no such folder"),
    ("serve_load", ["--model", "random-huge"], "--model: unknown preset 'huge'"),
])
def test_benchmark_scripts_refuse_bad_values_by_flag(script, argv, message, capsys):
    if script == "serve_load":
        pytest.importorskip("openai")
    with pytest.raises(SystemExit) as done:
        benchmark_module(script).build_parser().parse_args(argv)
    assert done.value.code == 2 and f"error: argument {message}" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["prefix_cache", "sudoku", "code_model", "serve_load", "load_memory",
                                    "quant_quality"])
def test_benchmark_scripts_explain_every_option_and_its_default(script):
    """--functions, --model, --max-batch, ... had no help, and no option showed its default."""
    if script == "serve_load":
        pytest.importorskip("openai")
    parser = benchmark_module(script).build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.help == "==SUPPRESS==" or not action.option_strings:
            continue
        assert action.help, action.option_strings
        if action.default not in (None, False, "") and action.dest != "help":
            assert "default" in action.help.lower() or f"(default: {action.default})" in text, action.option_strings


def test_code_model_trailing_newline_rates_are_over_the_functions_used(monkeypatch, capsys):
    """With --functions 1 and --healing-functions 3, a healed success read 1/3: the rate divided by the functions
    asked for, not the one used."""
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        pytest.skip("blockpress-code is not in this package")
    code, out, err = run_script_in_process(
        "benchmarks/code_model.py", ["--functions", "1", "--infills", "0", "--healing-functions", "3",
                                     "--max-new-tokens", "8", "--threads", "1"], monkeypatch, capsys)
    assert code in (0, None), err
    result = json.loads(out)
    # --infills 0 skips them: one ran, and its rate read 0.0 as if every infill had missed
    assert result["infill_cases"] == 0 and result["diffusion"]["infill_exact"] is result["ar"]["infill_exact"] is None
    trailing = result["trailing_newline"]
    assert trailing["functions"] == 1
    rates = [rate for engine in ("diffusion", "ar") for rate in trailing[engine].values()]
    assert all(rate in (0.0, 1.0) for rate in rates) and any(rates)  # one function: it parses or it does not


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for folder in ("scripts", "benchmarks")
                                          for p in (ROOT / folder).glob("*.py")))
def test_script_docstrings_show_their_commands_as_written(script):
    """canvas_transcript.py's --help printed its example's $'...\\n...' with real line breaks (the docstring's
    escapes were read), so the command it showed could not be copied: a --help text is the docstring as typed."""
    import ast

    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree, clean=False)
    assert doc, "a script says what it does in its docstring (its --help)"
    literal = ast.get_source_segment(source, tree.body[0].value)
    assert literal.lstrip("rR")[3:-3] == doc, "the docstring has escapes: make it a raw string (r\"\"\")"


def test_canvas_transcript_help_shows_the_readmes_command(monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`(python scripts/canvas_transcript\.py [^`]+)`", readme).group(1)
    code, out, err = run_script_in_process("scripts/canvas_transcript.py", ["--help"], monkeypatch, capsys)
    assert code == 0, err
    assert command in [line.strip() for line in out.splitlines()]


def test_train_sudoku_augmented_source_encodes_only_the_batches_boards(monkeypatch):
    """AugmentedSource encoded every base puzzle when built (150,000 to_example calls, 7.9 s before the GPU session's
    first sudoku step) and never used them: each batch encodes its boards after their symmetry. The batches are
    those of the order over the puzzles, as before."""
    from blockpress.tasks.sudoku import random_symmetry
    from blockpress.train import ExampleSource

    script = train_sudoku_module()
    base = [script._generate(seed) for seed in range(6)]
    calls = []
    real = script.to_example
    monkeypatch.setattr(script, "to_example", lambda *a: calls.append(a) or real(*a))
    source = script.AugmentedSource(base, seed=5)
    assert calls == []
    batch = source.batch(3, 4)
    assert len(calls) == 4
    import random

    order = ExampleSource(list(range(len(base))), 5).batch(3, 4)
    for i, (example, j) in enumerate(zip(batch, order)):
        sym = random_symmetry(random.Random(5 * 1_000_003 + 3 * 4099 + i))
        want = real(sym.apply(base[j].puzzle), sym.apply(base[j].solution))
        assert (example.prompt, example.response) == (want.prompt, want.response)


@pytest.mark.parametrize(("cores", "env", "threads"), [("2", {}, "1"), ("16", {}, "2"), ("2", {"TRAIN_THREADS": "3"}, "3")])
def test_gpu_session_fits_the_trainings_threads_to_the_cores(tmp_path, cores, env, threads):
    """gpu_session.sh gave each of its three trainings two threads whatever the machine: on the 2-core CPU of its own
    smoke run they spun against each other and each run logged one step in its budget (9 with one thread each)."""
    import os
    import shutil

    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    calls = tmp_path / "calls"
    # a Python that only records how each command was started (with which thread count)
    (bin_dir / "fakepy").write_text(f'#!/bin/sh\necho "$OMP_NUM_THREADS $*" >>{calls}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    data = tmp_path / "gpu"  # (what prepare_gpu_session.sh builds, empty)
    (data / "corpus").mkdir(parents=True)
    for name in ("corpus/train.bin", "corpus/heldout.bin", "sudoku-puzzles.jsonl"):
        (data / name).touch()
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "WORK": str(tmp_path / "work"), "PY": "fakepy", "DEADLINE": "140", "DEVICE": "cpu",
               "GPU_DATA": str(data), **env}
    run_env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run(["bash", "scripts/gpu_session.sh", "1", "0.3"], cwd=ROOT, env=run_env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    trainings = [line for line in calls.read_text().splitlines() if "--time-schedule" in line]  # the three runs
    assert len(trainings) == 3, calls.read_text() + r.stdout + r.stderr
    assert {line.split()[0] for line in trainings} == {threads}


@pytest.mark.parametrize(("error", "retried_with"), [("torch.OutOfMemoryError: CUDA out of memory.", "--batch-size 256"),
                                                   ("RuntimeError: a worker died", "--data-workers 0 --no-autocast")])
def test_gpu_session_retries_a_training_out_of_memory_with_half_the_batch(tmp_path, error, retried_with):
    """A run that failed early was retried without autocast at the same batch: out of memory, the likeliest early
    failure, that takes more memory, and the lease's one training failed twice."""
    import os
    import shutil

    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    bin_dir, data, calls, failed = tmp_path / "bin", tmp_path / "gpu", tmp_path / "calls", tmp_path / "failed"
    bin_dir.mkdir(), (data / "corpus").mkdir(parents=True)
    for name in ("corpus/train.bin", "corpus/heldout.bin", "sudoku-puzzles.jsonl"):
        (data / name).touch()
    # a Python that records each command, and fails the code training's first start with `error`
    (bin_dir / "fakepy").write_text(f"""#!/bin/sh
echo "$*" >>{calls}
case "$*" in *"cli train"*) [ -e {failed} ] || {{ touch {failed}; echo "{error}" >&2; exit 1; }};; esac
""")
    (bin_dir / "fakepy").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "WORK": str(tmp_path / "work"), "PY": "fakepy", "DEADLINE": "140", "DEVICE": "cpu",
               "GPU_DATA": str(data)}
    r = subprocess.run(["bash", "scripts/gpu_session.sh", "1", "0.3"], cwd=ROOT, env=run_env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    code_runs = [line for line in calls.read_text().splitlines() if "cli train" in line]
    assert len(code_runs) == 2 and "--batch-size 512" in code_runs[0], code_runs
    assert code_runs[1].endswith(retried_with), code_runs[1]


@pytest.mark.parametrize("layout", ["checkout", "worktree", "copy"])
def test_prepare_gpu_session_keeps_gpu_out_of_git_wherever_it_runs(tmp_path, layout):
    """In a git worktree (.git a file) it failed to write the exclude ("mkdir: cannot create directory '.git'") and went
    on, leaving 18 MB of .gpu/ for `git add -A`, in a checkout the device tool does not send; in a copy that is no
    git checkout it stopped (`git rev-parse` under set -e). What it builds is there already, so nothing runs."""
    import os
    import shutil

    if shutil.which("bash") is None or shutil.which("git") is None:
        pytest.skip("needs bash and git")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "prepare_gpu_session.sh", repo / "scripts")
    here = repo
    if layout != "copy":
        subprocess.run([*git, "init", "-q", str(repo)], check=True)
        subprocess.run([*git, "-C", str(repo), "add", "scripts"], check=True)
        subprocess.run([*git, "-C", str(repo), "commit", "-qm", "x"], check=True)
    if layout == "worktree":
        here = tmp_path / "wt"
        subprocess.run([*git, "-C", str(repo), "worktree", "add", "-q", str(here)], check=True)
    (here / ".gpu" / "corpus").mkdir(parents=True)
    (here / ".gpu" / "corpus" / "train.bin").touch()
    (here / ".gpu" / "sudoku-puzzles.jsonl").touch()
    r = subprocess.run(["bash", "scripts/prepare_gpu_session.sh"], cwd=here, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PY": "false"})
    assert r.returncode == 0, r.stderr
    assert ("worktree" in r.stderr) == (layout == "worktree"), r.stderr
    if layout != "copy":
        status = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True).stdout
        assert ".gpu" not in status, status


def test_gpu_session_stops_at_once_without_what_prepare_builds(tmp_path):
    """carry=[".gpu"] from a checkout without it (prepared in a worktree the device tool does not send) sends nothing:
    the session ran on, every training failing, and spent the lease. It says what is missing and stops."""
    import os
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    run_env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PY": "false",
               "DEVICE": "cpu", "GPU_DATA": str(tmp_path / "none")}
    r = subprocess.run(["bash", "scripts/gpu_session.sh", "1", "0.3"], cwd=ROOT, env=run_env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    log = (tmp_path / "out" / "session.log").read_text()
    assert f"missing {tmp_path / 'none'}/corpus/train.bin: run scripts/prepare_gpu_session.sh in the checkout" in log


def test_train_gpu_ends_with_its_steps_error_alone(tmp_path):
    """A step that fails (here train_sudoku.py refusing --minutes) has said why; train_gpu.py then ended in a
    CalledProcessError traceback of its own, exit 1, under that message."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gpu.py"), "--task", "sudoku", "--minutes", "-1",
                        "--device", "cpu", "--puzzles", "3", "--puzzle-workers", "1", "--out", str(tmp_path / "x"),
                        "--puzzle-cache", str(tmp_path / "p.jsonl")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "train_sudoku.py: error: " in r.stderr and "--minutes" in r.stderr


@pytest.mark.parametrize("signum", [2, 15])  # SIGINT (Ctrl-C), SIGTERM
def test_train_gpu_passes_a_stop_signal_to_its_step_once_and_waits_for_it(tmp_path, signum):
    """A Ctrl-C reached the trainer from the terminal and subprocess.run killed it 0.25 s later, mid-save; a SIGTERM
    to train_gpu.py alone left the trainer running on. Now the step, in a process group of its own (so a signal
    to the whole group, as `timeout` sends, does not reach it twice: a second one stops a trainer unsaved), gets
    each signal once from train_gpu.py, which waits while it saves and ends with its status."""
    import importlib
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    train_gpu = importlib.import_module("train_gpu")
    log = tmp_path / "log"
    child = [sys.executable, "-c", f"""
import os, signal, sys, time
log = open({str(log)!r}, "a", buffering=1)
def stop(signum, frame):  # as the trainer: finish, save (1 s), exit 128 + the signal
    log.write(f"signal {{signum}}\\n"); time.sleep(1); log.write("saved\\n"); os._exit(128 + signum)
signal.signal(signal.SIGINT, stop); signal.signal(signal.SIGTERM, stop)
log.write(f"ready {{os.getpgid(0)}}\\n")
time.sleep(60)
"""]
    signal_self_once(signum, lambda: "ready" in (log.read_text() if log.exists() else ""))
    started = time.time()
    with signal_fails_the_test(signum), pytest.raises(SystemExit) as done:
        train_gpu.run(child)
    assert done.value.code == 128 + signum and time.time() - started < 30
    lines = log.read_text().splitlines()
    assert lines[1:] == [f"signal {signum}", "saved"], lines  # once, and waited for
    assert int(lines[0].split()[1]) != os.getpgid(0)  # its own group: a group's signal reaches it once, from us


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("profile_train_step.py", ["--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
    ("profile_train_step.py", ["--steps", "0"], "--steps: expected a positive integer, got 0"),
    ("profile_train_step.py", ["--puzzles", "0"], "--puzzles: expected a positive integer, got 0"),
    ("profile_train_step.py", ["--warmup-steps", "-1"], "--warmup-steps: expected 0 or more, got -1"),
    ("profile_train_step.py", ["--device", "cuda:99"], "--device: 'cuda:99' asked for"),
    ("rerank_code_candidates.py", ["--candidates", "0"], "--candidates: expected a positive integer, got 0"),
    ("rerank_code_candidates.py", ["--sampled", "{bad"], "--sampled: not JSON"),
    ("rerank_code_candidates.py", ["--sampled", "[1]"], "--sampled: expected a JSON object"),
    ("tune_code_sampler.py", ["--functions", "0"], "--functions: expected a positive integer, got 0"),
    ("tune_code_sampler.py", ["--settings", '{"sampler": "greedy"}'], "--settings: expected a JSON list of objects"),
    # read as a slice from the end of the held-out list: (here) none, and a ZeroDivisionError after the model loaded
    ("tune_code_sampler.py", ["--test-functions", "-1"], "--test-functions: expected an integer >= 0, got -1"),
    ("rerank_code_candidates.py", ["--test-functions", "-1"], "--test-functions: expected an integer >= 0, got -1"),
    # a diffusion sampler's option under --ar ran the settings before it, then was generate_ar's traceback
    ("tune_code_sampler.py", ["--ar", "--settings", '[{}, {"t_max": 0.3}]'],
     "--settings[1]: 't_max' is no option of generate_ar (--ar; it takes frequency_penalty, "),
    ("canvas_transcript.py", ["x", "--steps", "0"], "--steps: expected a positive integer, got 0"),
    ("canvas_transcript.py", ["x", "--model", "no-such-model"], "--model: model 'no-such-model'"),
])
def test_small_scripts_refuse_bad_flags_in_one_line(script, argv, message, monkeypatch, capsys):
    """Each was a traceback (or, for --candidates 0, every rate printed as 0.0 with exit 0), some after loading the
    model or making puzzles. Run in process: the smoke tests above run the scripts end to end."""
    code, out, err = run_script_in_process(f"scripts/{script}", argv, monkeypatch, capsys)
    assert code == 2, out + err
    assert f"{script}: error: {message}" in err and "Traceback" not in err


def test_expert_dequant_benchmark_smoke(monkeypatch, capsys):
    """Each scheme and row count times its ways side by side: one expert's weight per row only for fewer rows than
    experts (as the experts take it), and the ratios are the times' own."""
    code, out, err = run_script_in_process("benchmarks/expert_dequant.py", ["--preset", "tiny", "--rows", "2", "9",
                                                                            "--repeats", "1", "--threads", "1"],
                                           monkeypatch, capsys)
    assert code in (0, None), err
    rows = json.loads(out)["rows"]
    assert [(row["scheme"], row["rows"]) for row in rows] == [("int4", 2), ("int4", 9), ("int8", 2), ("int8", 9)]
    assert all(row["experts"] == 4 and row["all_ms"] > 0 and row["loop_ms"] > 0 for row in rows)
    assert [row["per_row_ms"] is None for row in rows] == [False, True, False, True]
    for row in rows:
        for way in ("per_row", "loop"):
            assert row.get(f"all_over_{way}") == (round(row["all_ms"] / row[f"{way}_ms"], 2) if row[f"{way}_ms"] else None)
