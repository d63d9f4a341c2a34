"""The CLI's printed figures (stats lines, info and quantize --json), its terminal-only output (progress bars,
line buffering) and its flags' range edges, each checked before anything loads (from two mutation hunts over
blockpress/cli: each test kills a mutant the rest of the suite let live)."""
import io
import json
import os
import re
import sys
import time
import types

import pytest
import torch

import blockpress
import blockpress.bench
import blockpress.cli.common
import blockpress.cli.serve
from blockpress.cli import build_parser, main
from blockpress.cli.common import as_flags, command_flags, load_announced, print_stats, stats_of
from blockpress.cli.output import guard_stdout, progress_bar


def test_the_stats_line_puts_each_figure_under_its_own_unit(capsys):
    stats = stats_of(10, 4, 2.5, 3.0)
    assert stats == dict(new_tokens=10, forward_passes=4, tokens_per_forward=2.5, tok_s=3.33, seconds=3.0)
    print_stats(stats)
    assert capsys.readouterr().err == "\n[10 new tokens · 4 forward passes · 2.5 tokens/forward · 3.33 tok/s]\n"
    print_stats(stats, own_line=True)
    assert capsys.readouterr().err == "[10 new tokens · 4 forward passes · 2.5 tokens/forward · 3.33 tok/s]\n"


def test_an_infills_stats_line_says_filled_of_template_tokens(capsys):
    stats = {**stats_of(5, 2, 2.5, 1.0), "template_tokens": 9, "filled_tokens": 5}
    print_stats(stats)
    assert capsys.readouterr().err == "\n[5 filled of 9 template tokens · 2 forward passes · 2.5 tokens/forward · 5.0 tok/s]\n"


class TerminalIO(io.StringIO):
    def isatty(self):
        return True


def test_the_loading_line_ends_at_100_percent_when_the_reads_come_fast(monkeypatch, tmp_path):
    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0).save(tmp_path / "m")
    times = iter([0.0] + [2.0] * 10_000)  # past the first second, then every read at once
    monkeypatch.setattr(blockpress.cli.common, "time", types.SimpleNamespace(perf_counter=lambda: next(times)))
    stderr = TerminalIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    load_announced(build_parser().parse_args(["generate", "x", "--model", str(tmp_path / "m"), "--dtype", "float32"]))
    shown = stderr.getvalue().split("\r")
    percents = [int(re.search(r"(\d+)% of", x)[1]) for x in shown[1:-2]]
    assert percents and percents[-1] == 100, percents
    assert len(percents) == 2, percents  # the first read shown, the rest held back but the last


def test_a_valued_error_names_the_value_as_a_shell_reads_it_without_pythons_quotes():  # c12
    assert as_flags("model 'nope': not a checkpoint folder", {"model": "--model"}) == "--model nope: not a checkpoint folder"
    assert as_flags("model 'a b': x", {"model": "--model"}) == "--model 'a b': x"


def test_adapter_is_named_as_a_flag_only_when_given():  # c13
    assert "adapter" not in command_flags(build_parser().parse_args(["generate", "x"]))
    assert command_flags(build_parser().parse_args(["generate", "x", "--adapter", "a"]))["adapter"] == "--adapter"


def test_info_json_says_no_tied_copies_as_null(tmp_path, capsys):  # x3
    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0).save(tmp_path / "m")
    assert main(["info", "--model", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tied_copies"] is None


def test_quantize_json_seconds_is_the_runs_wall_time_and_dtype_the_one_written(tmp_path, capsys, monkeypatch):  # x5, x6
    import blockpress.checkpoint

    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0).to(dtype=torch.bfloat16).save(tmp_path / "m")
    # a CPU without native bf16 matmuls (an AVX2 one): the load widens bf16 to float32, the save writes bf16 back
    real = blockpress.checkpoint.native_dtype
    monkeypatch.setattr(blockpress.checkpoint, "native_dtype",
                        lambda dtype, device: torch.float32 if dtype == torch.bfloat16 else real(dtype, device))
    t0 = time.perf_counter()
    assert main(["quantize", "--model", str(tmp_path / "m"), str(tmp_path / "q"), "--quantize", "int8", "--json"]) == 0
    wall = time.perf_counter() - t0
    data = json.loads(capsys.readouterr().out)
    assert 0 < data["seconds"] <= wall
    assert data["dtype"] == "bfloat16"
    assert blockpress.load(tmp_path / "q", dtype=None).widened_from in (torch.bfloat16, None)


def test_quantize_says_the_megabytes_it_wrote(tmp_path, capsys):  # q2
    import re

    assert main(["quantize", "--model", "random-tiny", str(tmp_path / "q"), "--quantize", "int8"]) == 0
    line = capsys.readouterr().out
    size = sum(f.stat().st_size for f in (tmp_path / "q").glob("*.safetensors"))
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'q'))}: int8, {size / 1e6:.1f} MB, in \d+\.\d s\n", line), line



def test_a_hidden_progress_bar_draws_nothing_on_a_terminal(monkeypatch):  # o6
    monkeypatch.setattr(sys, "stderr", TerminalIO())
    bar = progress_bar(total=3, desc="sudoku", unit="puzzle", hidden=True)
    bar.update(3)
    bar.close()
    assert sys.stderr.getvalue() == ""
    bar = progress_bar(total=3, desc="sudoku", unit="puzzle")  # and one not hidden does draw there
    bar.update(3)
    bar.close()
    assert "sudoku" in sys.stderr.getvalue()


def test_threads_one_past_the_cpus_is_refused(capsys):  # i1
    cpus = os.cpu_count()
    assert main(["generate", "x", "--model", "random-tiny", "--threads", str(cpus + 1)]) == 2
    assert f"--threads: expected 0 (torch's default) to {cpus}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--min-new-tokens"])
def test_infill_refuses_a_length_flag_of_1_too(capsys, flag):  # n3
    assert main(["infill", "left <|hole|> right", "--model", "random-tiny", flag, "1"]) == 2
    assert "an infill is as long as its template" in capsys.readouterr().err


def test_the_guarded_stdout_keeps_a_terminals_line_buffering(monkeypatch):  # o7
    r, w = os.pipe()
    old = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w")), encoding="utf-8", line_buffering=True)
    monkeypatch.setattr(sys, "stdout", old)
    monkeypatch.setattr(sys, "__stdout__", old)
    try:
        assert guard_stdout() is old
        assert sys.stdout.line_buffering is True
        sys.stdout.write("a line\n")  # out at once, as on a terminal, not when the buffer fills
        assert os.read(r, 100) == b"a line\n"
    finally:
        sys.stdout = old
        old.close()
        os.close(r)


def test_a_progress_bar_is_cleared_when_done(monkeypatch):  # x31: no bar left above the output that follows
    monkeypatch.setattr(sys, "stderr", TerminalIO())
    bar = progress_bar(total=3, desc="sudoku", unit="puzzle")
    bar.update(3)
    bar.close()
    drawn = sys.stderr.getvalue()
    assert "sudoku" in drawn and "\n" not in drawn and drawn.endswith("\r")


def test_the_finished_out_file_names_its_plot_as_each_row_did(tmp_path, monkeypatch, capsys):  # x9
    pytest.importorskip("matplotlib")
    plotted = []

    def run_bench(settings, on_row):
        on_row({"rows": [{"batch": 1}]})
        return {"rows": [{"batch": 1}, {"batch": 2}]}

    monkeypatch.setattr(blockpress.bench, "run_bench", run_bench)
    monkeypatch.setattr(blockpress.bench, "plot", lambda result, path: plotted.append(dict(result)))
    out, png = tmp_path / "b.json", tmp_path / "p.png"
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data == {"rows": [{"batch": 1}, {"batch": 2}], "plot": str(png)}  # whole: no "partial"
    assert json.loads(capsys.readouterr().out) == data
    assert plotted[0]["plot"] == plotted[-1]["plot"] == str(png)


class Bound(Exception):
    pass


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))

    def bind_socket(host, port):  # every check before the bind passed
        raise Bound(port)

    monkeypatch.setattr(blockpress.cli.serve, "bind_socket", bind_socket)


def test_serve_port_65536_is_refused_by_range(no_server, capsys):  # v1
    assert main(["serve", "--port", "65536"]) == 2
    assert "--port: expected 0-65535 (0: any free port), got 65536" in capsys.readouterr().err
    with pytest.raises(Bound):
        main(["serve", "--port", "65535"])


def test_serve_takes_a_shutdown_timeout_of_0(no_server):  # v2: "seconds >= 0"
    with pytest.raises(Bound):
        main(["serve", "--port", "0", "--shutdown-timeout", "0"])


def test_sudoku_draws_no_bar_for_a_single_batch(monkeypatch):  # s3
    import io
    import sys

    from blockpress.cli.sudoku import _puzzle_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # the answers to a file
    assert _puzzle_bar(8, 8).disable is True  # one batch: its answers come at once, nothing to follow
    assert not _puzzle_bar(9, 8).disable


@pytest.mark.parametrize("flag", ["--max-batch", "--max-queue", "--max-context", "--max-body-bytes", "--max-stops"])
def test_serve_refuses_a_zero_limit_before_binding_or_loading(no_server, capsys, flag):  # v3
    assert main(["serve", "--port", "0", flag, "0"]) == 2
    assert f"blockpress serve: error: {flag}: expected a positive integer, got 0" in capsys.readouterr().err


def test_sudoku_speed_is_puzzles_per_second(monkeypatch, capsys):  # x12
    import types

    import blockpress.cli.sudoku
    from blockpress.tasks import sudoku_model

    solved = "123456789456789123789123456214365897365897214897214365531642978642978531978531642"
    monkeypatch.setattr(blockpress.cli.sudoku, "load_announced", lambda args: None)
    monkeypatch.setattr(sudoku_model, "prepare", lambda puzzles: puzzles)
    monkeypatch.setattr(sudoku_model, "solve", lambda lm, batch, **kw: [
        types.SimpleNamespace(puzzle=p, solution=solved, valid=True, steps=1, errors=[]) for p in batch])
    clock = iter([10.0, 14.0])  # the solves take 4 s
    monkeypatch.setattr(blockpress.cli.sudoku, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert main(["sudoku", "0" * 81, "0" * 81]) == 0
    assert capsys.readouterr().err.strip().endswith("[2/2 valid · 0.50 puzzles/s]")
