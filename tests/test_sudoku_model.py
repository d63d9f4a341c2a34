"""Sudoku through the model: givens are fixed canvas positions; CLI output; clear errors."""

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import blockpress
from blockpress.cli import main
from blockpress.tasks import sudoku_model
from blockpress.tasks.sudoku import format_board, generate, verify

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from train_sudoku import sudoku_config  # noqa: E402


@pytest.fixture(scope="module")
def tiny_sudoku(tmp_path_factory):
    cfg = sudoku_config()
    cfg.text.num_hidden_layers, cfg.text.layer_types, cfg.text.per_layer_config = 2, ["sliding_attention", "full_attention"], None
    cfg = blockpress.ModelConfig.from_dict(cfg.to_dict())
    lm = blockpress.random_model(cfg, seed=0)
    path = tmp_path_factory.mktemp("sudoku")
    lm.save(path)
    return path, lm


def test_givens_never_change(tiny_sudoku):
    _, lm = tiny_sudoku
    puzzles = [generate(s, "medium").puzzle for s in range(3)]
    for r in sudoku_model.solve(lm, puzzles, max_denoising_steps=3) + sudoku_model.solve_ar(lm, puzzles):
        assert len(r.solution) == 81
        assert all(g == "0" or g == s for g, s in zip(r.puzzle, r.solution))


def test_cli_json_fields(tiny_sudoku, capsys):
    path, _ = tiny_sudoku
    p = generate(1, "easy").puzzle.replace("0", ".")
    code = main(["sudoku", p, "--model", str(path), "--json", "--steps", "2"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert code == (0 if row["valid"] else 1)
    assert set(row) >= {"puzzle", "solution", "valid", "steps"} and row["steps"] <= 2
    assert row["puzzle"] == p.replace(".", "0") and isinstance(row["valid"], bool)


@pytest.mark.parametrize("rank_by", ["entropy", "margin"])
def test_cli_rank_by_is_the_samplers(tiny_sudoku, capsys, rank_by):
    """--rank-by reaches the sampler: the CLI's grid is the one `solve` gives with that ranking."""
    path, lm = tiny_sudoku
    p = generate(3, "hard").puzzle
    code = main(["sudoku", p, "--model", str(path), "--json", "--steps", "4", "--sampler", "topk", "--rank-by", rank_by])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert code == (0 if row["valid"] else 1)
    expected = sudoku_model.solve(lm, [p], max_denoising_steps=4, sampler="topk", rank_by=rank_by)[0]
    assert row["solution"] == expected.solution and row["steps"] == expected.steps


def test_cli_board_and_show_steps(tiny_sudoku, capsys):
    path, _ = tiny_sudoku
    code = main(["sudoku", generate(2, "easy").puzzle, "--model", str(path), "--steps", "2", "--show-steps"])
    captured = capsys.readouterr()
    assert code == (0 if "[1/1 valid" in captured.err else 1)
    assert "step 1" in captured.err and "step 2" in captured.err
    assert captured.out.count("|") >= 18  # a 9x9 board with box separators


def test_cli_hints_at_the_stronger_decodings_only_when_a_grid_is_invalid(tiny_sudoku, capsys):
    """An invalid answer also ends the run with status 1 (it was 0: scripts had to parse the output)."""
    path, lm = tiny_sudoku
    p = generate(3, "hard").puzzle  # random weights in 2 steps: not solved
    assert not sudoku_model.solve(lm, [p], max_denoising_steps=2)[0].valid
    for flags, hinted in (([], True), (["--ensemble", "2"], False), (["--rules"], False)):
        assert main(["sudoku", p, "--model", str(path), "--steps", "2", *flags]) == 1
        err = capsys.readouterr().err
        assert "[0/1 valid" in err and ("hint: --ensemble 8" in err) == hinted
    solved = generate(3, "hard").solution  # every cell given: nothing to hint at
    assert main(["sudoku", solved, "--model", str(path), "--steps", "2"]) == 0
    err = capsys.readouterr().err
    assert "[1/1 valid" in err and "hint" not in err


@pytest.mark.parametrize(
    "puzzle, message",
    [
        ("123", "expected 81"),
        ("x" * 81, "x"),
        ("11" + "0" * 79, "row 1"),  # contradictory givens
    ],
)
def test_bad_puzzles(tiny_sudoku, capsys, puzzle, message):
    path, _ = tiny_sudoku
    assert main(["sudoku", puzzle, "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_reads_puzzles_from_stdin_and_says_when_show_steps_cannot_apply(tiny_sudoku, capsys, monkeypatch):
    path, _ = tiny_sudoku
    a, b = generate(5, "easy").puzzle, generate(6, "easy").puzzle
    for source in (["-"], ["--file", "-"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{a}\n# a comment\n{b.replace('0', '.')}\n"))
        main(["sudoku", *source, "--model", str(path), "--json", "--steps", "1", "--show-steps"])
        out, err = capsys.readouterr()
        assert [json.loads(line)["puzzle"] for line in out.splitlines()] == [a, b]
        assert "warning: --show-steps: shows one puzzle's steps; 2 puzzles given, so none are shown" in err
        assert "step 1" not in err


def test_a_puzzle_the_check_cannot_settle_goes_to_the_model_with_a_note(tiny_sudoku, capsys, monkeypatch):
    """A 17-given puzzle without a solution kept the check busy for over ten minutes before the model loaded.
    Past the node budget the check says so and the model tries the puzzle; the CLI checks each puzzle once."""
    path, _ = tiny_sudoku
    no_solution = ".....5.8....6.1.43..........1.5........1.6...3.......553.....61........4........."
    monkeypatch.setattr(sudoku_model, "CHECK_NODES", 50)
    checked = []
    real_check = sudoku_model.check_puzzle
    monkeypatch.setattr(sudoku_model, "check_puzzle", lambda p, **kw: checked.append(p) or real_check(p, **kw))
    assert main(["sudoku", no_solution, "--model", str(path), "--json", "--steps", "2"]) == 1
    out, err = capsys.readouterr()
    assert "warning: puzzle 1: the solver could not tell within 50 search nodes whether the puzzle has a solution" in err
    assert json.loads(out)["valid"] is False and len(checked) == 1
    monkeypatch.undo()
    assert main(["sudoku", no_solution, "--model", str(path)]) == 2  # within the real budget: a definite answer
    assert "puzzle 1: puzzle has no solution" in capsys.readouterr().err


def test_a_model_that_is_not_a_sudoku_model_is_refused(capsys):
    """blockpress-code would print its token ids as a board (zeros inside, valid: false, exit 0)."""
    puzzle = generate(7, "easy").puzzle
    assert main(["sudoku", puzzle, "--model", "blockpress-code", "--json"]) == 2
    err = capsys.readouterr().err
    assert "model: not a sudoku model: its vocabulary has" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="not a sudoku model"):
        sudoku_model.solve_ar(blockpress.random_model(blockpress.ModelConfig.tiny()), [puzzle])


def test_a_model_whose_canvas_is_not_one_board_is_refused():
    """A model with the sudoku vocabulary and a canvas of 8 passed check_sudoku_model (vocabulary only): rules=True
    failed inside torch ("einsum(): subscript j has size 8"), ensemble=2 on logits shapes, and a plain call ran over 11
    canvases of 8. Refused before any work, naming the canvas_length."""
    cfg = blockpress.ModelConfig.tiny(vocab_size=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    lm = blockpress.random_model(cfg, seed=0)
    assert lm.config.canvas_length == 8
    puzzle = generate(1, "easy").puzzle
    message = "model: not a sudoku model: its canvas_length is 8, a sudoku model's is 81"
    with pytest.raises(ValueError, match=message):
        sudoku_model.check_sudoku_model(lm)
    for kwargs in ({"rules": True}, {"ensemble": 2}, {}):
        with pytest.raises(ValueError, match=message):
            sudoku_model.solve(lm, [puzzle], **kwargs)

def test_a_puzzle_file_not_utf8_is_named_at_its_byte_and_utf16_is_said(tmp_path, capsys, monkeypatch):
    """--file read with utf-8-sig named a bad byte 3 bytes early after a byte-order mark ("byte 10" for the 13th), and
    a UTF-16 --file or stdin was "byte 0xff" alone, where --input and --data say it is UTF-16 and how to save it."""
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf123456789\xe9")
    assert main(["sudoku", "--file", str(bom)]) == 2
    assert capsys.readouterr().err.endswith(f"--file {bom}: cannot read puzzles from it (not UTF-8: byte 0xe9 at "
                                            "byte 13)\n")
    utf16 = "1" * 81 + "\n"
    said = "; it is UTF-16 (it starts with a UTF-16 byte-order mark"
    (tmp_path / "u16.txt").write_bytes(utf16.encode("utf-16"))
    assert main(["sudoku", "--file", str(tmp_path / "u16.txt")]) == 2
    assert f"(not UTF-8: byte 0xff at byte 1{said}" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(utf16.encode("utf-16")), encoding="utf-8"))
    assert main(["sudoku", "-"]) == 2
    assert f"stdin line 1: not valid UTF-8 (byte 0xff at character 0){said}" in capsys.readouterr().err
    # without a byte-order mark (iconv -t UTF-16LE): valid UTF-8, and was "illegal character '\x00'"
    (tmp_path / "u16le.txt").write_bytes(utf16.encode("utf-16-le"))
    for args, codec in ((["--file", str(tmp_path / "u16le.txt")], "utf-16-le"), (["-"], "utf-16-be")):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(utf16.encode(codec)), encoding="utf-8"))
        assert main(["sudoku", *args]) == 2
        assert "holds NUL characters; it is UTF-16 without a byte-order mark" in capsys.readouterr().err


def test_an_unreadable_puzzle_file_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """Each in one line naming --file and why in words (it gave Python's "[Errno 21] Is a directory: '...'"); a
    file (or stdin) that holds no puzzle is named, where the error said to give a puzzle "or --file"."""
    binary = tmp_path / "puzzles.bin"
    binary.write_bytes(b"\xff\xfe" * 50)
    for path, why in [(tmp_path, "is a folder"), (binary, "not UTF-8: byte 0xff at byte 1; it is UTF-16 (it starts with a UTF-16 byte-order "
                                                "mark, as Windows PowerShell's > and Out-File write text): save it as "
                                                "UTF-8 (in PowerShell: Out-File -Encoding utf8)"),
                      (tmp_path / "missing.txt", "No such file or directory")]:
        assert main(["sudoku", "--file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err == f"blockpress sudoku: error: --file {path}: cannot read puzzles from it ({why})\n"
    empty = tmp_path / "empty.txt"
    for text in ["", "# a comment alone\n\n"]:
        empty.write_text(text)
        assert main(["sudoku", "--file", str(empty)]) == 2
        assert f"error: --file {empty}: holds no puzzle (expected 81 characters" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert main(["sudoku", "-"]) == 2 and "error: stdin: holds no puzzle" in capsys.readouterr().err


def test_shipped_model_solves_easy_puzzles():
    """The shipped model, alone (no rules in the decoder), solves fresh easy puzzles it never saw.

    Thresholds sit below what the packaged model measures here (10 of 10 solved, 100% of empty cells right),
    with room for platform numerics; an untrained model scores 0 and ~11% (chance).
    """
    if "blockpress-sudoku" not in blockpress.shipped_models():
        pytest.skip("blockpress-sudoku is not in this package")
    from blockpress.tasks.sudoku import cell_accuracy, verify

    lm = blockpress.load("blockpress-sudoku")
    truth = [generate(30_000_000 + i, "easy") for i in range(10)]
    results = sudoku_model.solve(lm, [t.puzzle for t in truth])
    acc = sum(cell_accuracy(r.solution, t.solution, t.puzzle) for r, t in zip(results, truth)) / len(truth)
    assert acc > 0.85
    assert sum(r.valid for r in results) >= 5
    assert all(r.valid == verify(t.puzzle, r.solution).valid for r, t in zip(results, truth))
    steps = lm.generation_config["max_denoising_steps"]
    assert all(1 <= r.steps <= steps for r in results)


def test_rules_constraint_bans_digits_of_settled_peers_only():
    from blockpress.tasks.sudoku import VOCAB

    rule = sudoku_model.rules_constraint(VOCAB.vocab_size)
    draft = torch.full((1, 81), VOCAB.digit_id("5"))
    settled = torch.zeros(1, 81, dtype=torch.bool)
    settled[0, 0] = True  # r1c1 = 5 is settled; every other 5 is noise
    banned = rule(draft, settled)[0]
    five = VOCAB.digit_id("5")
    peers_of_0 = [i for i in range(81) if i != 0 and (i // 9 == 0 or i % 9 == 0 or (i // 27 == 0 and i % 9 < 3))]
    assert len(peers_of_0) == 20
    assert all(banned[i, five] for i in peers_of_0)
    assert not banned[0, five] and not banned[80, five]  # itself, and a cell outside its units
    assert banned[:, [VOCAB.pad, VOCAB.eos, VOCAB.bos, VOCAB.sep, VOCAB.digit_id("0")]].all()  # digits 1-9 only
    assert not banned[:, [VOCAB.digit_id(str(d)) for d in range(1, 10) if d != 5]].any()


def test_rules_constraint_leaves_a_contradicted_cell_to_the_model():
    from blockpress.tasks.sudoku import VOCAB

    rule = sudoku_model.rules_constraint(VOCAB.vocab_size)
    draft = torch.zeros(1, 81, dtype=torch.long)
    settled = torch.zeros(1, 81, dtype=torch.bool)
    for d, cell in enumerate(range(1, 10)):  # row 1, columns 2-9 hold 1..8, and r2c1 holds 9: r1c1 has no digit left
        if cell < 9:
            draft[0, cell], settled[0, cell] = VOCAB.digit_id(str(d + 1)), True
    draft[0, 9], settled[0, 9] = VOCAB.digit_id("9"), True
    banned = rule(draft, settled)[0]
    assert not banned[0, [VOCAB.digit_id(str(d)) for d in range(1, 10)]].any()
    assert banned[1, VOCAB.digit_id("9")]  # r1c2 still may not repeat the 9 in its box


def test_rules_option_keeps_givens_and_only_fills_digits(tiny_sudoku, capsys):
    path, lm = tiny_sudoku
    puzzles = [generate(s, "medium").puzzle for s in range(3)]
    for r in sudoku_model.solve(lm, puzzles, max_denoising_steps=4, rules=True):
        assert all(g == "0" or g == s for g, s in zip(r.puzzle, r.solution))
        assert "0" not in r.solution  # the rule allows digits 1-9 only
    code = main(["sudoku", puzzles[0], "--model", str(path), "--json", "--steps", "2", "--rules"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["puzzle"] == puzzles[0] and code == (0 if row["valid"] else 1)


def test_shipped_model_solves_hard_puzzles_alone_and_with_rules():
    """The shipped model on 16 fresh hard puzzles, alone and with the rule-aware option (reported separately).

    Measured here: 9 solved alone (83.8% of empty cells right) and 9 with the rules (79.4%); on the 50-per-
    difficulty test set the rules solve more (60% against 42% of hard puzzles), on these 16 they tie. The
    thresholds leave room for platform numerics; the previous weights solved 3 alone and 6 with the rules.
    """
    if "blockpress-sudoku" not in blockpress.shipped_models():
        pytest.skip("blockpress-sudoku is not in this package")
    from blockpress.tasks.sudoku import cell_accuracy

    lm = blockpress.load("blockpress-sudoku")
    truth = [generate(30_000_000 + i, "hard") for i in range(16)]
    alone = sudoku_model.solve(lm, [t.puzzle for t in truth])
    ruled = sudoku_model.solve(lm, [t.puzzle for t in truth], rules=True)

    def accuracy(results):
        return sum(cell_accuracy(r.solution, t.solution, t.puzzle) for r, t in zip(results, truth)) / len(truth)

    assert sum(r.valid for r in alone) >= 7 and sum(r.valid for r in ruled) >= 7
    assert accuracy(alone) > 0.78 and accuracy(ruled) > 0.74
    # A solved grid is the unique solution, whichever way it was decoded.
    assert all(r.solution == t.solution for r, t in zip(alone + ruled, truth + truth) if r.valid)


def _as_view(orig: torch.Tensor, view) -> torch.Tensor:
    """Logits over the original board [81, V] as `view` shows them: cell i shows original cell view.cells[i],
    and digit d is written view.digits[d]."""
    from blockpress.tasks.sudoku import VOCAB

    out = torch.empty_like(orig)
    for t in range(orig.shape[1]):
        d = VOCAB.id_to_digit(t)
        out[:, VOCAB.digit_id(view.digits[int(d)]) if d is not None else t] = orig[list(view.cells), t]
    return out


@pytest.mark.parametrize("n, seed", [(1, 0), (3, 5), (8, 1)])
def test_ensemble_of_views_is_equivariant(n, seed):
    """Views whose logits are exact symmetric images of one board's agree already: pooling changes nothing
    but the normalisation. Different boards in one batch never mix."""
    views = sudoku_model.symmetric_views(n, seed)
    assert views[0].cells == tuple(range(81)) and views[0].digits == "0123456789"
    g = torch.Generator().manual_seed(seed)
    boards = torch.randn(2, 81, 16, generator=g)
    logits = torch.stack([_as_view(boards[b], v) for b in range(2) for v in views])
    pooled = sudoku_model.ensemble_processor(views, 16)(logits, torch.arange(2 * n))
    assert torch.allclose(pooled, torch.log_softmax(logits, -1), atol=1e-5)


def test_ensemble_pools_disagreeing_views_in_the_original_frame():
    """Two views that disagree: each ends up with the average of both, read in its own frame."""
    views = sudoku_model.symmetric_views(2, 3)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(81, 16, generator=g), torch.randn(81, 16, generator=g)  # original-frame beliefs
    logits = torch.stack([_as_view(a, views[0]), _as_view(b, views[1])])
    pooled = sudoku_model.ensemble_processor(views, 16)(logits, torch.arange(2))
    mean = (torch.log_softmax(a, -1) + torch.log_softmax(b, -1)) / 2
    assert torch.allclose(pooled[0], _as_view(mean, views[0]), atol=1e-5)
    assert torch.allclose(pooled[1], _as_view(mean, views[1]), atol=1e-5)


def test_ensemble_solve_keeps_givens_and_reports_the_board_as_given(tiny_sudoku):
    _, lm = tiny_sudoku
    puzzles = [generate(40_000_000 + i, "medium").puzzle for i in range(2)]
    boards = []
    results = sudoku_model.solve(lm, puzzles, max_denoising_steps=3, ensemble=4,
                                 on_draft=lambda step, b: boards.append(b))
    for p, r in zip(puzzles, results):
        assert all(pc == rc for pc, rc in zip(p, r.solution) if pc != "0")
    assert all(len(b) == 2 for b in boards)  # drafts show the identity view of each puzzle only
    for views in (0, 65):
        with pytest.raises(ValueError, match=f"ensemble: expected 1 to 64 views, got {views}"):
            sudoku_model.solve(lm, puzzles, ensemble=views)


@pytest.mark.parametrize("ensemble", [True, False, 0, -3, 2.0, "2"])
def test_ensemble_refuses_what_is_not_a_count_of_views(tiny_sudoku, ensemble):
    """solve(..., ensemble=True) ran as one view (a bool passed for the integer 1): refused before any decoding."""
    _, lm = tiny_sudoku
    with pytest.raises(ValueError, match=f"ensemble: expected 1 to 64 views, got {ensemble!r}"):
        sudoku_model.solve(lm, [generate(2, "medium").puzzle], ensemble=ensemble)


@pytest.mark.parametrize("options, message", [
    (dict(rules="false"), "rules: expected True or False, got 'false'"),  # a truthy string turned the rules on
    (dict(rules=1), "rules: expected True or False, got 1"),
    (dict(checked="no"), "checked: expected True or False"),
    (dict(on_draft=5), "on_draft: expected a function .*, got int"),  # failed at the first draft, after a pass
    (dict(seed=-1), "seed: expected an integer"), (dict(seed="3"), "seed: expected an integer"),
])
def test_solve_refuses_bad_options_before_any_decoding(tiny_sudoku, monkeypatch, options, message):
    _, lm = tiny_sudoku
    monkeypatch.setattr(lm, "stream", lambda *a, **kw: pytest.fail("decoded before the options were checked"))
    with pytest.raises(ValueError, match=message):
        sudoku_model.solve(lm, [generate(2, "medium").puzzle], **options)


def test_solve_takes_a_numpy_seed_as_generate_does(tiny_sudoku):
    """A numpy integer seed (as generate takes it) failed inside random.Random, naming nothing."""
    _, lm = tiny_sudoku
    p = [generate(2, "medium").puzzle]
    for ensemble in (1, 3):
        assert sudoku_model.solve(lm, p, max_denoising_steps=2, seed=np.int64(4), ensemble=ensemble) == \
            sudoku_model.solve(lm, p, max_denoising_steps=2, seed=4, ensemble=ensemble)


def test_cli_ensemble(tiny_sudoku, capsys):
    path, lm = tiny_sudoku
    p = generate(2, "medium").puzzle
    code = main(["sudoku", p, "--model", str(path), "--json", "--steps", "2", "--seed", "4", "--ensemble", "3"])
    row = json.loads(capsys.readouterr().out.strip())
    assert code == (0 if row["valid"] else 1)
    direct = sudoku_model.solve(blockpress.load(path), [p], max_denoising_steps=2, seed=4, ensemble=3)[0]
    assert row["solution"] == direct.solution and row["steps"] == direct.steps


def test_a_complete_grid_is_its_own_answer_beside_open_ones(tiny_sudoku):
    _, lm = tiny_sudoku
    full, other = generate(4, "easy"), generate(5, "easy")
    results = sudoku_model.solve(lm, [full.solution, other.puzzle, full.solution], max_denoising_steps=2)
    assert [r.puzzle for r in results] == [full.solution, other.puzzle, full.solution]
    assert results[0] == results[2] and results[0].solution == full.solution and results[0].valid
    assert results[0].steps == 0 and 0 < results[1].steps <= 2
    alone = sudoku_model.solve(lm, [other.puzzle], max_denoising_steps=2)[0]
    assert results[1] == alone  # the complete grids did not change the open puzzle's decoding


def test_on_draft_gets_a_board_per_puzzle_in_the_given_order_beside_complete_grids(tiny_sudoku):
    """The draft rows are the open puzzles only: with a complete grid first, on_draft got one board for two puzzles,
    and boards[0] was the second puzzle's canvas."""
    _, lm = tiny_sudoku
    full, other = generate(4, "easy"), generate(5, "easy")
    seen, alone = [], []
    results = sudoku_model.solve(lm, [full.solution, other.puzzle], max_denoising_steps=2,
                                 on_draft=lambda step, boards: seen.append(boards))
    sudoku_model.solve(lm, [other.puzzle], max_denoising_steps=2, on_draft=lambda step, boards: alone.append(boards))
    assert seen and all(len(boards) == 2 and boards[0] == full.solution for boards in seen)
    assert [boards[1] for boards in seen] == [boards[0] for boards in alone]
    assert seen[-1][1] == results[1].solution


def test_both_solvers_answer_no_puzzles_and_complete_grids_without_decoding(tiny_sudoku, monkeypatch):
    """solve_ar(lm, []) raised IndexError (solve gave []), and it ran 81 passes on a complete grid (steps=81) where
    solve runs none (steps=0): both share the shortcut and decode only the open puzzles, results in the given order
    (solve's mixed batch: test_a_complete_grid_is_its_own_answer_beside_open_ones)."""
    _, lm = tiny_sudoku
    full, other = generate(4, "easy"), generate(5, "easy")
    passes = []
    real_encode = type(lm.model).encode
    monkeypatch.setattr(type(lm.model), "encode", lambda self, *a, **kw: passes.append(1) or real_encode(self, *a, **kw))
    for solver in (sudoku_model.solve, sudoku_model.solve_ar):
        assert solver(lm, []) == []
        passes.clear()
        done = solver(lm, [full.solution, full.solution])
        assert not passes and [(r.solution, r.valid, r.steps) for r in done] == [(full.solution, True, 0)] * 2
    mixed = sudoku_model.solve_ar(lm, [full.solution, other.puzzle, full.solution])
    assert mixed[0] == mixed[2] == done[0] and mixed[1].puzzle == other.puzzle and mixed[1].steps == 81
    assert all(g == "0" or g == s for g, s in zip(other.puzzle, mixed[1].solution))


def test_solve_ar_encodes_the_prompt_then_one_cell_a_pass_but_not_the_last(tiny_sudoku, monkeypatch):
    """Each one-token pass gives the logits of the next cell: 80 of them serve cells 2..81. It ran an 81st pass
    over the last cell, whose logits nothing read."""
    _, lm = tiny_sudoku
    puzzles = [generate(s, "hard").puzzle for s in range(2)]
    prompt = len(sudoku_model.encode_prompt(puzzles[0]))
    widths = []
    real_encode = type(lm.model).encode
    monkeypatch.setattr(type(lm.model), "encode",
                        lambda self, ids, *a, **kw: widths.append(ids.shape[1]) or real_encode(self, ids, *a, **kw))
    results = sudoku_model.solve_ar(lm, puzzles)
    assert widths == [prompt] + [1] * 80
    assert [r.steps for r in results] == [81, 81]  # steps count the cells written, as before


def test_solve_takes_one_puzzle_string_as_a_batch_of_one(tiny_sudoku):
    """`solve(lm, "530070000...")` read the string as a list of 81 one-character puzzles ("puzzle 1: puzzle has 1
    cells, expected 81"); a str is a batch of one now, as lm.generate takes a str prompt."""
    _, lm = tiny_sudoku
    p = generate(7, "easy").puzzle
    for solver, kw in ((sudoku_model.solve, dict(max_denoising_steps=2)), (sudoku_model.solve_ar, {})):
        assert solver(lm, p, **kw) == solver(lm, [p], **kw)
    assert sudoku_model.solve(lm, sudoku_model.prepare(p), max_denoising_steps=2, checked=True)[0].puzzle == p
    with pytest.raises(ValueError, match="puzzles: expected a puzzle string or a list of them, got bytes"):
        sudoku_model.solve(lm, p.encode())


@pytest.mark.parametrize("source", [["-", "-"], ["-", "--file", "-"]])
def test_cli_refuses_reading_stdin_twice(source, capsys, monkeypatch):
    """`sudoku - -`: the second reader met an empty stdin without a word."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(generate(5, "easy").puzzle + "\n"))
    assert main(["sudoku", *source]) == 2
    assert "sudoku: error: standard input can be read once: give - once" in capsys.readouterr().err


def test_cli_refuses_a_nine_dash_row_word_saying_how_to_write_an_empty_row(capsys, monkeypatch):
    """`sudoku -- <9 row words, one of them ---------`: the dashes were skipped as a border and the next puzzle's
    first row joined in its place. Refused (exit 2, before the model loads), naming the word and an empty row's
    spellings."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    p = generate(5, "easy").puzzle
    rows = [p[r * 9 : r * 9 + 9] for r in range(9)]
    assert main(["sudoku", "--", *rows[:2], "---------", *rows[3:], *rows]) == 2
    assert ("sudoku: error: puzzle argument 3: '---------' is a row with no givens or a border line, which a command "
            "line's words cannot tell apart; write a row with no givens as '.........'") in capsys.readouterr().err


@pytest.mark.parametrize("source, said", [(["-"], "stdin line 2"), (["--file", "-"], "--file - line 2"),
                                          (["ARG"], "puzzle argument 1")])
def test_cli_names_bytes_that_are_not_utf8_as_such(source, said, capsys, monkeypatch):
    """Piped bytes that are not UTF-8 reach the CLI as surrogates (stdin's surrogateescape): sudoku called one
    "illegal character '\\udcff'", a character the input never held, where generate, infill and chat say "not valid
    UTF-8 (byte 0xff ...)" as README promises for piped text."""
    import blockpress.cli.common

    monkeypatch.setattr(blockpress.cli.common, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    p = generate(5, "easy").puzzle
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{p}\n\udcff{p[1:]}\n"))
    assert main(["sudoku", *(f"\udcff{p[1:]}" if word == "ARG" else word for word in source)]) == 2
    err = capsys.readouterr().err
    assert f"sudoku: error: {said}: not valid UTF-8 (byte 0xff at character 0)" in err and "illegal" not in err


def test_cli_reads_bordered_grids_from_a_file_and_stdin_and_grid_rows_as_words(tiny_sudoku, capsys, monkeypatch, tmp_path):
    """A file of pasted bordered grids failed ("0 cells left over"), and 9 words of rows were 9 puzzles of 9 cells."""
    from test_sudoku_task import _bordered

    path, _ = tiny_sudoku
    a, b = generate(5, "easy").puzzle, generate(6, "medium").puzzle
    text = _bordered(a) + "\n" + _bordered(b) + "\n"
    (tmp_path / "grids.txt").write_text(text)
    for source in (["--file", str(tmp_path / "grids.txt")], ["-"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        main(["sudoku", *source, "--model", str(path), "--json", "--steps", "1"])
        assert [json.loads(line)["puzzle"] for line in capsys.readouterr().out.splitlines()] == [a, b]
    main(["sudoku", *(a[r * 9 : r * 9 + 9] for r in range(9)), b, "--model", str(path), "--json", "--steps", "1"])
    assert [json.loads(line)["puzzle"] for line in capsys.readouterr().out.splitlines()] == [a, b]
    assert main(["sudoku", *(a[r * 9 : r * 9 + 9] for r in range(8)), "--model", str(path)]) == 2
    assert "puzzle 1: puzzle has 9 cells, expected 81" in capsys.readouterr().err
    main(["sudoku", *a, *(b[i : i + 3] for i in range(0, 81, 3)), "--model", str(path), "--json", "--steps", "1"])
    assert [json.loads(line)["puzzle"] for line in capsys.readouterr().out.splitlines()] == [a, b]  # a cell a word


def test_cli_reads_a_puzzle_file_saved_with_a_byte_order_mark(tiny_sudoku, capsys, tmp_path):
    """Notepad's "UTF-8 with BOM": exit 2, "--file ... line 1: illegal character '\ufeff'"."""
    path, _ = tiny_sudoku
    a, b = generate(5, "easy").puzzle, generate(6, "medium").puzzle
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + f"{a}\r\n{b}\r\n".encode())
    main(["sudoku", "--file", str(tmp_path / "bom.txt"), "--model", str(path), "--json", "--steps", "1"])
    out, err = capsys.readouterr()
    assert [json.loads(line)["puzzle"] for line in out.splitlines()] == [a, b], err


def test_a_puzzle_that_is_not_a_string_is_named_like_the_other_bad_puzzles():
    """solve(lm, [123]) raised a bare TypeError without the 'puzzle N:' the ValueErrors have."""
    good = generate(8, "easy").puzzle
    with pytest.raises(TypeError, match="^puzzle 2: puzzle must be a str, got int$"):
        sudoku_model.prepare([good, 123])


def test_a_puzzle_with_several_solutions_is_kept_with_a_warning(tiny_sudoku, capsys):
    """An empty grid (or 3 givens) went to the model silently; it has many solutions, none the puzzle's own."""
    path, lm = tiny_sudoku
    unique = generate(9, "easy").puzzle
    with pytest.warns(UserWarning, match="^puzzle 2: puzzle has more than one solution") as record:
        assert sudoku_model.prepare([unique, "0" * 81, "123" + "0" * 78]) == [unique, "0" * 81, "123" + "0" * 78]
    assert [str(w.message).split(":")[0] for w in record] == ["puzzle 2", "puzzle 3"]
    # through solve and solve_ar too, the warning names the caller's line, as every library warning does (a fixed
    # stacklevel named sudoku_model's own, and the default filter showed it once for every caller)
    with pytest.warns(UserWarning, match="more than one solution") as record:
        sudoku_model.solve(lm, "0" * 81, max_denoising_steps=1)
        sudoku_model.solve_ar(lm, "0" * 81)
    assert [w.filename for w in record] == [__file__] * 2
    main(["sudoku", unique, "--model", str(path), "--json", "--steps", "1"])
    assert "warning" not in capsys.readouterr().err  # one solution: nothing to say


def test_an_invalid_answer_names_the_broken_rules_in_text_and_json(tiny_sudoku, capsys):
    """The verifier knew which cells were wrong, but the output only said INVALID."""
    path, lm = tiny_sudoku
    p = generate(3, "hard").puzzle  # random weights in 2 steps: not solved
    r = sudoku_model.solve(lm, [p], max_denoising_steps=2)[0]
    assert not r.valid and r.errors == verify(p, r.solution).errors and r.errors
    assert main(["sudoku", p, "--model", str(path), "--json", "--steps", "2"]) == 1
    assert json.loads(capsys.readouterr().out)["errors"] == r.errors
    assert main(["sudoku", p, "--model", str(path), "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and all(f"\n  {e}\n" in out for e in r.errors)
    solved = generate(3, "hard").solution
    assert sudoku_model.solve(lm, [solved])[0].errors == []


def test_cli_scores_a_kaggle_csv_against_its_solutions(tiny_sudoku, capsys, monkeypatch, tmp_path):
    """Kaggle's "1 million sudoku" CSV (quizzes,solutions) was refused ("line 2: illegal character ','"); its
    solutions score the answers: correct and cell accuracy per puzzle, and both over the file."""
    from blockpress.tasks.sudoku import cell_accuracy

    path, _ = tiny_sudoku
    a, b = generate(5, "easy"), generate(6, "medium")
    text = f"quizzes,solutions\n{a.puzzle},{a.solution}\n{b.puzzle.replace('0', '-')},{b.solution}\n"
    (tmp_path / "sudoku.csv").write_text(text)
    main(["sudoku", "--file", str(tmp_path / "sudoku.csv"), "--model", str(path), "--json", "--steps", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["puzzle"] for r in rows] == [a.puzzle, b.puzzle] and [r["expected"] for r in rows] == [a.solution, b.solution]
    for r, t in zip(rows, (a, b)):
        assert r["correct"] == (r["solution"] == t.solution)
        assert r["cell_accuracy"] == cell_accuracy(r["solution"], t.solution, t.puzzle)
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    main(["sudoku", "-", "--model", str(path), "--steps", "1"])
    out, err = capsys.readouterr()
    mean = sum(r["cell_accuracy"] for r in rows) / 2
    matched = sum(r["correct"] for r in rows)
    assert f"valid · {matched}/2 match the file's solutions, cell accuracy {mean:.1%} · " in err
    assert "from the file's solution" in out
    # a malformed row stops before the model loads, naming its line
    (tmp_path / "bad.csv").write_text(f"quizzes,solutions\n{a.puzzle},{a.solution}\n{b.puzzle}\n")
    assert main(["sudoku", "--file", str(tmp_path / "bad.csv"), "--model", str(path)]) == 2
    assert "bad.csv line 3: 1 field(s) where the header (quizzes,solutions) needs 2" in capsys.readouterr().err


def test_cli_reads_dashed_puzzles_and_points_one_that_starts_with_a_dash_past_argparse(tiny_sudoku, capsys):
    path, _ = tiny_sudoku
    p = generate(5, "easy").puzzle
    dashed = "-" + p[1:].replace("0", "_")
    assert p[0] == "0"
    main(["sudoku", "--model", str(path), "--json", "--steps", "1", "--", dashed])
    assert json.loads(capsys.readouterr().out)["puzzle"] == p
    with pytest.raises(SystemExit):  # argparse's error, before anything loads
        main(["sudoku", dashed, "--model", str(path)])
    said = "a puzzle or border word that starts with '-' goes after -- (blockpress sudoku [FLAGS] -- PUZZLE...)"
    assert said in capsys.readouterr().err
    board = format_board(p).split()  # a board as blockpress prints it, typed as words: its borders start with '-'
    with pytest.raises(SystemExit):
        main(["sudoku", "--model", str(path), *board])
    assert said in capsys.readouterr().err
    main(["sudoku", "--model", str(path), "--json", "--steps", "1", "--", *board])
    assert json.loads(capsys.readouterr().out)["puzzle"] == p
    rows = [p[i:i + 9].replace("0", "-") for i in range(0, 81, 9)]  # its rows as words: one starts with '-'
    assert any(row.startswith("-") for row in rows)
    with pytest.raises(SystemExit):  # (a 9-cell row word got no hint: only words of more than 9 characters did)
        main(["sudoku", "--model", str(path), *rows])
    assert said in capsys.readouterr().err

def test_the_docs_give_the_shipped_sudoku_models_size_on_disk():
    """README, RESULTS.md and quantization.md said 4.4 MB for a safetensors file of 4,349,296 bytes (what
    `blockpress quantize` prints as 'against 4.3 MB for blockpress-sudoku')."""
    import re

    from blockpress.checkpoint import checkpoint_files
    from blockpress.lm import resolve_path

    megabytes = sum(f.stat().st_size for f in checkpoint_files(resolve_path("blockpress-sudoku"))) / 1e6
    root = Path(__file__).resolve().parent.parent
    said = [(page, float(m.group(1))) for page in ("README.md", "benchmarks/RESULTS.md", "docs/quantization.md")
            for m in re.finditer(r"blockpress-sudoku`? ?[:(][^\n]{0,50}?\b(\d+\.\d) MB", (root / page).read_text())]
    assert len(said) == 3 and all(size == round(megabytes, 1) for _, size in said), (said, megabytes)
