"""`blockpress sudoku`: puzzles from arguments, a file or standard input, solved in batches, each answer printed
and scored."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from blockpress.checks import check_text, utf8_problem
from blockpress.cli.common import load_announced
from blockpress.cli.output import print_warning
from blockpress.files import text_of_file, undecodable_byte, utf16_note, utf16_note_of_text, utf16_text_error
from blockpress.stopping import fresh_line, stop_status, stop_word


def cmd_sudoku(args: argparse.Namespace) -> int:
    from blockpress.tasks import sudoku_model
    from blockpress.tasks.sudoku import (
        cell_accuracy,
        format_board,
        is_puzzle_csv,
        join_grid_rows,
        read_puzzle_csv,
        split_puzzle_file,
    )

    if args.puzzles.count("-") + (args.file == "-") > 1:  # the second reader would get an empty stdin, silently
        raise ValueError("standard input can be read once: give - once (a puzzle argument or --file -)")
    puzzles: list[str] = []
    expected: list[str | None] = []  # each puzzle's solution, where a CSV gave one: the answers are scored against it
    read_from: list[str] = []  # the files (stdin) read: one that held no puzzle is named, not told to give --file

    def read(text: str, name: str) -> None:
        read_from.append(name)
        # stdin keeps bytes that are not UTF-8 as surrogates (as generate's does): named here as such, by line, where
        # the puzzle reader would see "illegal character '\udcff'", a character the input never held
        for n, line in enumerate(text.splitlines(), start=1):
            if (problem := utf8_problem(line)) is not None:  # (UTF-16 piped in: said so, as a --file of it is)
                raise ValueError(f"{name} line {n}: not valid UTF-8 ({problem}){utf16_note_of_text(line)}")
        if error := utf16_text_error(text, name):  # UTF-16 without a byte-order mark: valid UTF-8, NULs and all
            raise error
        pairs = read_puzzle_csv(text, name) if is_puzzle_csv(text) else [(p, None) for p in split_puzzle_file(text, name)]
        puzzles.extend(p for p, _ in pairs)
        expected.extend(s for _, s in pairs)

    for k, word in enumerate(args.puzzles, start=1):  # a command line's bytes that are not UTF-8 arrive so too
        check_text(word, f"puzzle argument {k}")
    for text in join_grid_rows(args.puzzles):  # - reads them from standard input, as a --file would be read
        if text == "-":
            read(sys.stdin.read(), "stdin")
        else:
            puzzles.append(text)
            expected.append(None)
    if args.file == "-":
        read(sys.stdin.read(), "--file -")
    elif args.file:
        data = b""
        try:
            # UTF-8 whatever the locale says, a BOM (Notepad's) left out and counted in a bad byte's position (utf-8-sig's
            # positions left its 3 bytes out)
            data = Path(args.file).read_bytes()
            lines = text_of_file(data).splitlines()
        except (OSError, UnicodeDecodeError) as exc:  # a folder, a missing or a binary file
            # (Python's own text, "[Errno 21] Is a directory: 'd'", repeated the path and named no flag's terms)
            why = ("is a folder" if Path(args.file).is_dir() else exc.strerror or str(exc) if isinstance(exc, OSError)
                   else f"not UTF-8: {undecodable_byte(exc)}{utf16_note(data[:2])}")
            raise ValueError(f"--file {args.file}: cannot read puzzles from it ({why})") from None
        read("\n".join(lines), f"--file {args.file}")
    if not puzzles and read_from:  # not "give at least one puzzle ..., or --file" to a --file of none
        raise ValueError(f"{read_from[-1]}: holds no puzzle (expected 81 characters a line, 0 . - _ or * for empty, "
                         "9-line grids, or a quizzes,solutions CSV)")
    if not puzzles:
        raise ValueError("give at least one puzzle (81 characters, 0 . - _ or * for empty), or --file")
    if args.batch_size < 1:  # before the model loads
        raise ValueError(f"--batch-size: expected a positive integer, got {args.batch_size}")
    puzzles = sudoku_model.prepare(puzzles)  # clear errors before the model is even loaded (warns of the unsettled)
    lm = load_announced(args)

    def show(step: int, boards: list[str]) -> None:
        print(f"step {step}\n{format_board(boards[0])}\n", file=sys.stderr)

    on_draft = show if args.show_steps and len(puzzles) == 1 else None
    if args.show_steps and len(puzzles) > 1:
        print_warning(f"--show-steps: shows one puzzle's steps; {len(puzzles)} puzzles given, so none are shown")
    results: list[Any] = []
    scored = []  # (matches the file's solution, cell accuracy on the empty cells) of each puzzle that came with one
    t0 = time.perf_counter()
    bar = _puzzle_bar(len(puzzles), args.batch_size)
    try:
        # --batch-size puzzles at a time, each batch's answers printed as it ends: one batch of every puzzle given
        # would grow ~2.2 MB a puzzle (a Kaggle CSV of 100,000 would want ~220 GB), print nothing until the last was
        # solved, and lose them all to a Ctrl-C. A row's answer is the same in any batch (its randomness is its
        # seed's), up to float rounding.
        for start in range(0, len(puzzles), args.batch_size):
            batch = puzzles[start:start + args.batch_size]
            done = sudoku_model.solve(lm, batch, max_denoising_steps=args.steps, sampler=args.sampler,
                                      seed=args.seed, on_draft=on_draft, rules=args.rules, rank_by=args.rank_by,
                                      ensemble=args.ensemble, confidence=args.confidence, checked=True)
            for r, truth in zip(done, expected[start:start + args.batch_size]):
                score = None if truth is None else (r.solution == truth, cell_accuracy(r.solution, truth, r.puzzle))
                if score is not None:
                    scored.append(score)
                print_sudoku_answer(r, truth, score, args.json)
            results.extend(done)
            if sys.stdout is not None:  # each batch's answers out now (piped, Python holds them in a buffer)
                sys.stdout.flush()
            bar.update(len(done))
    except KeyboardInterrupt as exc:  # a Ctrl-C, SIGTERM or SIGHUP (off the terminal's "^C")
        bar.close()
        print(f"{fresh_line(exc)}{stop_word(exc)} ({len(results)} of {len(puzzles)} puzzles solved, printed above)",
              file=sys.stderr)
        return stop_status(exc)
    bar.close()
    seconds = time.perf_counter() - t0
    if not args.json:
        solved = sum(r.valid for r in results)
        accuracy = "" if not scored else (
            f" · {sum(c for c, _ in scored)}/{len(scored)} match the file's solutions, cell accuracy "
            f"{sum(a for _, a in scored) / len(scored):.1%}")
        print(f"[{solved}/{len(results)} valid{accuracy} · {len(results) / seconds:.2f} puzzles/s]", file=sys.stderr)
        if solved < len(results) and args.ensemble == 1 and not args.rules:
            # The measured trade (benchmarks/RESULTS.md): 8 pooled views solved 97.5% of medium puzzles
            # against 86.5% for one, at an eighth of the speed.
            print("hint: --ensemble 8 pools the model's predictions over 8 symmetric views of each puzzle (no "
                  "rules; 8x the work); --rules adds candidate filtering", file=sys.stderr)
    return 0 if all(r.valid for r in results) else 1  # scripts can tell a failed solve without parsing


def _puzzle_bar(puzzles: int, batch_size: int) -> Any:
    """A bar of the puzzles solved, on a terminal's stderr while the answers go to a file or pipe (`--json >
    out.jsonl`: a CSV of thousands solved for minutes without a sign), over more than one batch. With the answers on
    the terminal too, they are the progress, a batch at a time; on a log (no terminal) a bar would be redraws."""
    from blockpress.cli.output import progress_bar

    answers_shown = sys.stdout is not None and sys.stdout.isatty()
    return progress_bar(total=puzzles, desc="sudoku", unit="puzzle", hidden=answers_shown or puzzles <= batch_size)


def print_sudoku_answer(r: Any, truth: str | None, score: tuple[bool, float] | None, as_json: bool) -> None:
    """One answer of `sudoku`, as a JSON line or as its board, whether it is valid, and the rules it breaks."""
    from blockpress.tasks.sudoku import format_board

    if as_json:
        row = {"puzzle": r.puzzle, "solution": r.solution, "valid": r.valid, "steps": r.steps, "errors": r.errors}
        if score is not None:
            row.update(expected=truth, correct=score[0], cell_accuracy=score[1])
        print(json.dumps(row))
        return
    print(format_board(r.solution))
    # which rules the grid breaks, and where: the board alone does not show it
    against = "" if score is None else (" · matches the file's solution" if score[0] else
                                        f" · differs from the file's solution (cell accuracy {score[1]:.1%})")
    print(f"{'valid' if r.valid else 'INVALID'} · {r.steps} denoising steps{against}"
          + "".join(f"\n  {error}" for error in r.errors) + "\n")
