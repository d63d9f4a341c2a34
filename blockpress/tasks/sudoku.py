"""Sudoku as a block-diffusion task: parsing, solving, verification, generation and tokenization.

Board format
------------
A puzzle or a solution is an 81-character string of digits in row-major order; ``'0'`` marks an empty
cell. ``parse_puzzle`` also accepts ``'.'``, ``'-'``, ``'_'`` and ``'*'`` for empty cells (as puzzle sites
and data sets write them) and a 9-line grid form in which whitespace and the box-drawing characters ``|`` and
``+`` are ignored, and so are border lines (only ``-``, ``+``, ``|`` and spaces, with a ``+`` or a run of
dashes: ``------+-------+------``), so the output of ``format_board`` parses back to the same string. In any
other line a ``-`` is an empty cell (``- - - | - - - | - - -`` is a row with no givens). A line of nine dashes and
no ``+`` in runs of three (``---|---|---``) is told from a border by its place: after a grid's first row, a row with
no givens inside a band of three rows or right after a border line, where no border goes; a border elsewhere (above
a grid's first row: write that row with ``.``, and a grid left short of its rows says so). Nine adjacent dashes
always read as a border. ``split_puzzle_file`` reads a file of
such puzzles, one a line or one grid of 9 lines at a time (bordered or not, with header lines such as
"Grid 01" between them), or a CSV with a header line (Kaggle's "1 million sudoku": ``quizzes,solutions``),
which ``read_puzzle_csv`` reads with its solutions. Rows, columns and boxes are numbered 1-9 in error
messages (boxes row-major), and a cell is written ``r<row>c<col>``, also 1-based.

Difficulty
----------
Difficulty is defined by the number of givens only: easy >= 40, medium 30-39, hard < 30. Every puzzle
from ``generate`` has exactly one solution, and the same seed always yields the same puzzle.

Token format
------------
The vocabulary is tiny (``SudokuVocab``): pad=0, eos=1, bos=2, digits '0'..'9' -> ids 3..12, sep=13,
and ``vocab_size`` 16 so that a few ids are left free. The prompt is::

    [bos] + 81 digit ids of the puzzle ('0' = empty) + [sep]      (PROMPT_LEN = 83 tokens)

and the target canvas the model fills in is exactly the 81 digit ids of the solution, with no eos
(CANVAS_LEN = 81). ``decode_digits`` turns model output back into an 81-character string, mapping any
non-digit id to '0' and truncating or padding to 81, so a malformed output can still be verified and
simply scores as wrong.
"""

from __future__ import annotations

import csv
import hashlib
import numbers
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CANVAS_LEN",
    "DIFFICULTIES",
    "PROMPT_LEN",
    "VOCAB",
    "NotUnique",
    "Puzzle",
    "SudokuVocab",
    "Symmetry",
    "Undecided",
    "Verdict",
    "cell_accuracy",
    "check_puzzle",
    "count_solutions",
    "decode_digits",
    "difficulty_of",
    "encode_prompt",
    "encode_solution",
    "format_board",
    "generate",
    "generate_many",
    "is_puzzle_csv",
    "join_grid_rows",
    "parse_puzzle",
    "read_puzzle_csv",
    "split_puzzle_file",
    "random_symmetry",
    "solve",
    "verify",
]

DIFFICULTIES: tuple[str, ...] = ("easy", "medium", "hard")

_DIGITS = "0123456789"
# The characters besides '0' that puzzle sites and data sets write for an empty cell.
_EMPTY = ".-_*"
# Characters used to draw grids; ignored in a line of cells so that printed boards parse back. A '-' draws only in a
# border line (_is_border); in a line of cells it is an empty one.
_SEPARATORS = frozenset("|+")
_EXPECTED = "expected digits 0-9, or '.', '-', '_' or '*' for an empty cell"
# A header line in a file of puzzles ("Grid 01", "Puzzle 3:", "Easy"): it starts with a word of two letters or more,
# which no line of cells can (a single letter is more likely a typo in a row).
_HEADER = re.compile(r"[^\W\d_]{2,}\b")
# The most cells a header line may hold: a title's number or date ("Grid 01", "Daily 2024.01.15") holds a few, so a
# line with more is a puzzle or a grid row after a label ("easy: 5300...") that skipping it would silently lose.
_HEADER_MAX_CELLS = 16

_ROW_OF = tuple(i // 9 for i in range(81))
_COL_OF = tuple(i % 9 for i in range(81))
_BOX_OF = tuple((i // 27) * 3 + (i % 9) // 3 for i in range(81))
_ALL_DIGITS = 0b11_1111_1110  # bit d set <=> digit d (1..9) is present / allowed


def _is_border(line: str) -> bool:
    """A line that only draws a grid: '-', '+', '|' and whitespace, with a '+' or a run of dashes ('------+------',
    '+-------+', '|-------|'). Any other line's dashes are empty cells: '- - - | - - - | - - -' is a row with no
    givens (nine dashes and no '+' alone cannot be told from a border: the readers tell them by place, _row_shaped)."""
    return all(ch in "-+|" or ch.isspace() for ch in line) and ("+" in line or "--" in line)


def _row_shaped(line: str) -> bool:
    """A border line of nine dashes in runs of three or fewer and no '+' ('---|---|---', '|---|---|---|'): the shape
    of a row with no givens written with dashes, which only its place tells from a border. Between a grid's rows,
    inside a band of three or right after a border (where no border goes), it is that row; elsewhere it stays a
    border, and a grid short of 9 rows names it. Nine adjacent dashes stay a border anywhere: a grid of '530070000'
    rows may draw one under every row."""
    return (_is_border(line) and "+" not in line and line.count("-") == 9
            and max(len(run) for run in re.findall("-+", line)) <= 3)


def _as_row(line: str) -> str:
    """A _row_shaped line as the row of nine empty cells it is, in a form every reader takes as cells."""
    return line.replace("-", ".")


def _dashes_hint(line: tuple[int, str] | None) -> str:
    return "" if line is None else (f"; line {line[0]} ({line[1].strip()!r}) was read as a border line: write a row "
                                    "with no givens as '...|...|...' or '000000000'")


# A date at a title's end ("Daily 2024.1.15", "Date: 15-1-2024"): its 9 characters are no grid row
_DATE = re.compile(r"\b\d{1,4}[.-]\d{1,2}[.-]\d{1,4}$")


def _labelled_row(line: str) -> bool:
    """A line that starts with a word and ends with a grid row's 9 cells: after its last ':' ("Row 1: 5 3 0 0 7 0 0 0
    0"), or as its last word ("Row 1 530070000"); a title's number or date ("Daily 2024.01.15") is no row."""
    tail = line.rpartition(":")[2] if ":" in line else line.split()[-1]
    return _count_cells(tail) == 9 and not _HEADER.search(tail) and not _DATE.search(line)


def _count_cells(line: str) -> int:
    """The cells of one line: 0 for a border line."""
    return 0 if _is_border(line) else sum(ch in _DIGITS or ch in _EMPTY for ch in line)


def _cell_name(i: int) -> str:
    return f"r{i // 9 + 1}c{i % 9 + 1}"


def _units() -> tuple[tuple[str, tuple[int, ...]], ...]:
    units: list[tuple[str, tuple[int, ...]]] = []
    for r in range(9):
        units.append((f"row {r + 1}", tuple(r * 9 + c for c in range(9))))
    for c in range(9):
        units.append((f"column {c + 1}", tuple(r * 9 + c for r in range(9))))
    for b in range(9):
        r0, c0 = (b // 3) * 3, (b % 3) * 3
        name = f"box {b + 1} (rows {r0 + 1}-{r0 + 3}, columns {c0 + 1}-{c0 + 3})"
        units.append((name, tuple(i for i in range(81) if _BOX_OF[i] == b)))
    return tuple(units)


_UNITS = _units()


# ----------------------------------------------------------------------------------------------------
# Parsing and display
# ----------------------------------------------------------------------------------------------------


# The header's names of a CSV's columns: Kaggle's "1 million sudoku" writes quizzes,solutions, the larger data sets
# modelled on it puzzle,solution (some with more columns, such as an id, around them).
_CSV_PUZZLE = ("quizzes", "quiz", "puzzles", "puzzle")
_CSV_SOLUTION = ("solutions", "solution")


def _csv_header(text: str) -> tuple[list[str], int, int | None, int] | None:
    """(the header's names, the puzzle column, the solution column or None, the header's line number) when the first
    line that is not blank is a CSV header naming a puzzle column, else None."""
    for n, line in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        if not line.strip():
            continue
        if "," not in line:
            return None
        names = [name.strip().strip("\"'").lower() for name in next(csv.reader([line]))]
        puzzle = next((names.index(c) for c in _CSV_PUZZLE if c in names), None)
        if puzzle is None:
            return None
        return names, puzzle, next((names.index(c) for c in _CSV_SOLUTION if c in names), None), n
    return None


def is_puzzle_csv(text: str) -> bool:
    """Whether ``text`` is a CSV of puzzles: its first line that is not blank a header naming a column of puzzles
    (quizzes, quiz, puzzles or puzzle), as Kaggle's "1 million sudoku" ("quizzes,solutions")."""
    return _csv_header(text) is not None


def read_puzzle_csv(text: str, name: str = "file") -> list[tuple[str, str | None]]:
    """The (puzzle, solution) pairs of a CSV of puzzles (see is_puzzle_csv), each normalized by parse_puzzle; the
    solution is None without a solutions column or where a row leaves it empty. Other columns are ignored. A row
    without the header's columns, a puzzle or solution that does not parse, and a solution that is not one of its
    puzzle's (a given changed, a cell empty, a rule broken) are errors naming the line."""
    header = _csv_header(text)
    if header is None:
        raise ValueError(f"{name}: not a CSV of puzzles: its first line should be a header naming the column of "
                         f"puzzles ({', '.join(_CSV_PUZZLE)}), as Kaggle's 'quizzes,solutions'")
    names, puzzle_col, solution_col, first = header
    need = max(puzzle_col, -1 if solution_col is None else solution_col) + 1
    reader = csv.reader(text.removeprefix("\ufeff").splitlines()[first:])
    pairs: list[tuple[str, str | None]] = []
    for row in reader:
        n = first + reader.line_num
        if not any(field.strip() for field in row):
            continue
        if len(row) < need:
            raise ValueError(f"{name} line {n}: {len(row)} field(s) where the header ({','.join(names)}) needs "
                             f"{need}, for its {names[puzzle_col]}"
                             + ("" if solution_col is None else f" and {names[solution_col]}"))
        try:
            puzzle = parse_puzzle(row[puzzle_col])
        except ValueError as exc:
            raise ValueError(f"{name} line {n}, {names[puzzle_col]}: {exc}") from None
        solution = None
        if solution_col is not None and row[solution_col].strip():
            try:
                solution = parse_puzzle(row[solution_col])
            except ValueError as exc:
                raise ValueError(f"{name} line {n}, {names[solution_col]}: {exc}") from None
            verdict = verify(puzzle, solution)  # a wrong answer key would score right answers as wrong
            if not verdict.valid:
                more = f"; and {len(verdict.errors) - 3} more" if len(verdict.errors) > 3 else ""
                raise ValueError(f"{name} line {n}, {names[solution_col]}: not a solution of the puzzle: "
                                 + "; ".join(verdict.errors[:3]) + more)
        pairs.append((puzzle, solution))
    return pairs


def split_puzzle_file(text: str, name: str = "file") -> list[str]:
    """The puzzles of a file: one per line (81 cells) or as 9-line grids of 9 cells a line, with blank lines,
    '#' comments (a line's rest), border lines (only '|', '-', '+' and spaces, as around a pasted grid) and header lines
    between puzzles (a line that starts with a word, such as Project Euler's "Grid 01") skipped. Each puzzle
    comes back as its raw text (parse_puzzle reads it); lines that do not make whole puzzles are an error
    naming them, and so is a header line that holds more cells than a title's number ("easy: 5300...": the
    puzzle after the label would be skipped with it). A CSV of puzzles (is_puzzle_csv: Kaggle's
    "quizzes,solutions") gives its puzzles (read_puzzle_csv has their solutions too)."""
    if is_puzzle_csv(text):
        return [puzzle for puzzle, _ in read_puzzle_csv(text, name)]
    puzzles: list[str] = []
    rows: list[tuple[int, str, int]] = []  # the open grid's lines: (line number, text, cells)

    def where(first: int, last: int) -> str:
        return f"line {first}" if first == last else f"lines {first}-{last}"

    # The first row-shaped line read as a border (a grid's top or band edge): a grid's rows coming up short name it.
    dashes: tuple[int, str] | None = None
    after_border = False  # the last line of cells or border was a border

    def unfinished(what: str) -> ValueError:
        cells = sum(r[2] for r in rows)
        return ValueError(f"{name} {where(rows[0][0], rows[-1][0])}: {len(rows)} of a 9-line grid's rows "
                          f"({cells} cells), not a whole puzzle of 81; {what}{_dashes_hint(dashes)}")

    # A byte-order mark (Notepad's "UTF-8 with BOM", PowerShell's pipes) is no character of the file's first line:
    # left there, it would be refused as an illegal character the user cannot see.
    labelled: tuple[int, str] | None = None  # the header line just before, where it ends like a grid row
    for n, line in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        line = line.partition("#")[0]  # a comment, on a line of its own or after a puzzle ("<81 cells>  # easy")
        stripped = line.strip()
        if not stripped:
            continue
        if _HEADER.match(stripped):
            # A title holds no cells (the digits of "Grid 01" are its number), but only where no grid is open:
            # inside one, it would hide the rows missing before it.
            if rows:
                raise unfinished(f"line {n} ({stripped!r}) starts another puzzle")
            cells = _count_cells(stripped)
            if cells > _HEADER_MAX_CELLS:
                raise ValueError(f"{name} line {n}: starts with a word, as a header line does, but holds {cells} "
                                 "cells, which skipping it would lose; put the label on a line of its own (or after "
                                 "'#' there) and the puzzle on the next")
            # "Row 1: 530070000": nine such lines are a whole grid, not to be skipped unsaid. One line alone may be a
            # title ("Puzzle 100000001", "Daily 2024.1.15"); two in a row are a grid's rows.
            if _labelled_row(stripped):
                if labelled is not None:
                    raise ValueError(f"{name} lines {labelled[0]}-{n}: grid rows after labels ({labelled[1]!r}, "
                                     f"{stripped!r}), which skipping as headers would lose; write the grid's rows "
                                     "without labels (a label on a line of its own, or after '#')")
                labelled = (n, stripped)
            else:
                labelled = None
            continue
        label, labelled = labelled, None
        odd = next((ch for ch in line if not (ch in _DIGITS or ch in _EMPTY or ch.isspace() or ch in _SEPARATORS)),
                   None)
        if odd is not None:
            raise ValueError(f"{name} line {n}: illegal character {odd!r}; {_EXPECTED} ('#' starts a comment, a word "
                             "at the start of a line a header between puzzles)")
        cells = _count_cells(line)
        if label is not None and 0 < cells <= 9:
            # "Row 1: 530070000" over the grid's other rows: skipped as a title, it would take the next grid's first row
            # in its place (a title that ends in 9 cells over a grid of 9 rows: its number after '#', or a date)
            raise ValueError(f"{name} line {label[0]}: a grid row after a label ({label[1]!r}), which skipping as a "
                             "header would lose, over the grid's next row; write the grid's rows without labels (a "
                             "label on a line of its own, or after '#')")
        if cells == 0 and rows and (len(rows) % 3 or after_border) and _row_shaped(line):
            # inside a band of an open grid no border goes, nor right after one: '53-|-7-|---' rows make a row with
            # no givens '---|---|---', which read as a border would take the next grid's first row in its place (or end
            # the file short of one). Before a grid's first row it stays a border: one grid's bottom border and the
            # next one's top ('|---|---|---|' over '|53-|-7-|---|' rows) come in pairs
            line, cells = _as_row(line), 9
        after_border = cells == 0
        if cells == 0:  # a border line of a drawn grid ('+-------+---'): it neither opens nor closes a puzzle
            if dashes is None and _row_shaped(line):
                dashes = (n, line)
            continue
        if cells > 9:  # more than a grid row: a puzzle on one line
            if rows:
                raise unfinished(f"line {n} holds {cells} cells, where a grid row has 9")
            if cells != 81:
                raise ValueError(f"{name} line {n}: {cells} cells where a puzzle has 81 (one puzzle a line, or a "
                                 "9-line grid)")
            puzzles.append(line)
            continue
        rows.append((n, line, cells))
        if len(rows) == 9:
            total = sum(r[2] for r in rows)
            if total != 81:
                short = ", ".join(f"line {r[0]} has {r[2]}" for r in rows if r[2] != 9)
                raise ValueError(f"{name} {where(rows[0][0], n)}: {total} cells where a 9-line grid has 81, 9 a "
                                 f"line ({short}){_dashes_hint(dashes)}")
            puzzles.append("\n".join(r[1] for r in rows))
            rows = []
    if rows:
        raise unfinished("the file ends there")
    return puzzles


def _empty_cells_word(word: str) -> bool:
    """A command-line word of a grid row, or a box's row, with no givens, written with dashes: 9 or 3 dashes in runs
    of three or fewer, '|' between them, no '+' ('---|---|---', '---'). As a line of a file it would be a border
    (_is_border) unless its place says otherwise; a word stands for cells, as the words beside it do."""
    runs = re.findall("-+", word)
    return (bool(runs) and set(word) <= set("-|") and word.count("-") in (3, 9)
            and max(len(run) for run in runs) <= 3)


def join_grid_rows(texts: list[str]) -> list[str]:
    """Puzzles typed as command-line words: each word is a puzzle, except that words in a row that each hold a
    grid row or less (1-9 cells) are one puzzle once their cells add up to 81: a grid's 9 rows (`530070000
    600195000 ...`), its 27 boxes' rows (`530 070 000 ...`) or its 81 cells one a word (`5 3 0 0 7 ...`, a grid
    copied with its spaces). Inside a run, words that only draw the grid ('|', '------+-------+------': a board as
    format_board prints it) are skipped. A run that does not reach 81 is left as it is (9 words joined), for
    parse_puzzle to say how many cells each holds. A word of nine adjacent dashes ('---------') is refused: a row
    with no givens, or a file's border line, which no place tells apart here (skipped as a border, the next
    puzzle's first row took that row's place)."""
    out: list[str] = []
    run: list[str] = []
    cells = 0
    for k, text in enumerate(texts, start=1):
        if set(text) <= set("-|") and "-" * 9 in text and text.count("-") == 9:  # ('---|---|---' reads as a row)
            raise ValueError(f"puzzle argument {k}: {text!r} is a row with no givens or a border line, which a "
                             "command line's words cannot tell apart; write a row with no givens as '.........', "
                             "'000000000' or '---|---|---', and leave a border out (a --file reads a board "
                             "drawn with them)")

    def close() -> None:
        nonlocal run, cells
        out.extend(["\n".join(run)] if len(run) == 9 else run)
        run, cells = [], 0

    for text in texts:
        if _empty_cells_word(text):  # '---|---|---', '---': a word is no border (a file's place-rule, _row_shaped)
            text = _as_row(text)
        # '-' alone is standard input (the CLI's word for it), not a row of one empty cell
        row = text != "-" and all(ch in _DIGITS or ch in _EMPTY or ch.isspace() or ch in _SEPARATORS for ch in text)
        n = _count_cells(text) if row else 0
        if row and n == 0 and run:
            # '|' between a grid's boxes, '------+-------+------' between its bands (format_board's words): they draw
            # the grid, as parse_puzzle and a file read them, and do not end its run of cells
            continue
        if 1 <= n <= 9:
            if cells + n > 81:  # past a whole puzzle: the run so far was one, short of a cell or more
                close()
            run.append(text)
            cells += n
            if cells == 81:
                out.append("\n".join(run))  # a line a word: each reads as it was counted
                run, cells = [], 0
            continue
        close()
        out.append(text)
    close()
    return out


def parse_puzzle(text: str, name: str = "puzzle") -> str:
    """Normalize a puzzle/solution to 81 digits ('0' = empty).

    Accepts digits and '.', '-', '_' or '*' (empty); whitespace and the grid characters '|' and '+' are
    ignored wherever they appear, and so are border lines ('------+-------+------'), which covers both the
    one-line form and the 9-line grid form.
    Raises ValueError naming the first illegal character (and its 0-based position in ``text``) or the
    number of cells found when it is not 81. `name`: what `text` is (a puzzle, a solution), for those errors.
    """
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    cells: list[str] = []
    start = 0  # where the line begins in text, for the position of an illegal character
    grid_rows = 0  # lines of 9 cells so far, while every line of cells has held 9 (a grid's rows)
    dashes: tuple[int, str] | None = None  # the first row-shaped line read as a border, named if cells are missing
    after_border = False  # the last line that was not blank drew a border
    for n, line in enumerate(text.splitlines(keepends=True), start=1):
        if grid_rows > 0 and (grid_rows % 3 or after_border) and _row_shaped(line):
            line = _as_row(line)  # inside a band, or right after a border: a row with no givens (split_puzzle_file)
        elif dashes is None and _row_shaped(line):
            dashes = (n, line)
        if line.strip():
            after_border = _is_border(line)
        if not _is_border(line):
            before = len(cells)
            for pos, ch in enumerate(line, start=start):
                if ch in _DIGITS:
                    cells.append(ch)
                elif ch in _EMPTY:
                    cells.append("0")
                elif not (ch.isspace() or ch in _SEPARATORS):
                    raise ValueError(f"illegal character {ch!r} at position {pos} of the {name} (would be cell "
                                     f"{len(cells) + 1}); {_EXPECTED}")
            held = len(cells) - before
            if held:
                grid_rows = grid_rows + 1 if held == 9 and grid_rows >= 0 else -1  # -1: not a grid's rows
        start += len(line)
    if len(cells) != 81:
        hint = _dashes_hint(dashes) if len(cells) < 81 and len(cells) % 9 == 0 else ""
        raise ValueError(f"{name} has {len(cells)} cells, expected 81{hint}")
    return "".join(cells)


def format_board(grid: str) -> str:
    """Render a board as 9 text rows with box separators; empty cells are shown as '.'."""
    g = parse_puzzle(grid)
    lines: list[str] = []
    for r in range(9):
        if r in (3, 6):
            lines.append("------+-------+------")
        row = g[r * 9 : r * 9 + 9].replace("0", ".")
        lines.append(" | ".join(" ".join(row[c : c + 3]) for c in (0, 3, 6)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Solver
# ----------------------------------------------------------------------------------------------------


class _Search:
    """Backtracking over bitmask candidates, branching on the most constrained empty cell (or, when it has fewer
    choices, on the places left for a digit in a row, column or box).

    Before each branch, forced cells are filled: naked singles (a cell with one candidate) and hidden singles (a
    digit with one place left in a row, column or box); a cell with no candidate or a digit with no place ends
    the branch. Plain backtracking took over ten minutes to prove some 17-given puzzles unsolvable.
    ``rng`` (optional) shuffles the order in which candidate digits are tried; that is how random full grids
    are made, without the filling step: the same seed must keep giving the same grid (and puzzle) it always
    gave, and an empty grid never needs it. The search stops as soon as ``limit`` solutions have been found,
    or, with ``max_nodes``, once it has branched that many times (``gave_up``: the count is then a lower bound).
    """

    def __init__(self, grid: list[int], limit: int, rng: random.Random | None = None,
                 max_nodes: int | None = None) -> None:
        self.grid = grid
        self.limit = limit
        self.rng = rng
        self.max_nodes = max_nodes
        self.nodes = 0
        self.gave_up = False
        self.rows = [0] * 9
        self.cols = [0] * 9
        self.boxes = [0] * 9
        self.consistent = True
        for i, d in enumerate(grid):
            if d:
                bit = 1 << d
                r, c, b = _ROW_OF[i], _COL_OF[i], _BOX_OF[i]
                if (self.rows[r] | self.cols[c] | self.boxes[b]) & bit:
                    self.consistent = False
                self.rows[r] |= bit
                self.cols[c] |= bit
                self.boxes[b] |= bit
        self.empties = [i for i in range(81) if grid[i] == 0]
        self.count = 0
        self.first: list[int] | None = None

    def run(self) -> int:
        # Contradictory givens have no solutions; searching would only find ones that ignore the clash.
        if self.consistent:
            self._search(len(self.empties))
        return self.count

    def _candidates(self, i: int) -> int:
        return _ALL_DIGITS & ~(self.rows[_ROW_OF[i]] | self.cols[_COL_OF[i]] | self.boxes[_BOX_OF[i]])

    def _place(self, pos: int, k: int, bit: int) -> None:
        """Fill empties[pos] with `bit`'s digit and move it to empties[k - 1], out of the empty part."""
        empties = self.empties
        empties[pos], empties[k - 1] = empties[k - 1], empties[pos]
        i = empties[k - 1]
        self.grid[i] = bit.bit_length() - 1
        self.rows[_ROW_OF[i]] |= bit
        self.cols[_COL_OF[i]] |= bit
        self.boxes[_BOX_OF[i]] |= bit

    def _clear(self, start: int, end: int) -> None:
        """Empty the cells empties[start:end] again (undoes _place, in any order)."""
        for i in self.empties[start:end]:
            bit = 1 << self.grid[i]
            self.rows[_ROW_OF[i]] ^= bit
            self.cols[_COL_OF[i]] ^= bit
            self.boxes[_BOX_OF[i]] ^= bit
            self.grid[i] = 0

    def _fill_forced(self, k: int) -> tuple[int, bool]:
        """Fill the naked and hidden singles of empties[:k] until none is left: (the new k, False at a dead end:
        a cell without a candidate, or a digit without a place in some unit). The filled cells are
        empties[new k:k] either way."""
        grid, empties, rows, cols, boxes = self.grid, self.empties, self.rows, self.cols, self.boxes
        while True:
            k0 = k
            pos = 0
            while pos < k:
                mask = self._candidates(empties[pos])
                if mask == 0:
                    return k, False
                if mask & (mask - 1) == 0:
                    self._place(pos, k, mask)  # empties[pos] is now another cell: look at it next
                    k -= 1
                else:
                    pos += 1
            for _, cells in _UNITS:
                once = twice = filled = 0
                for i in cells:
                    if grid[i]:
                        filled |= 1 << grid[i]
                    else:
                        mask = _ALL_DIGITS & ~(rows[_ROW_OF[i]] | cols[_COL_OF[i]] | boxes[_BOX_OF[i]])
                        twice |= once & mask
                        once |= mask
                if (once | filled) != _ALL_DIGITS:
                    return k, False
                single = once & ~twice & ~filled
                while single:
                    bit = single & -single
                    single ^= bit
                    pos = next((p for p in range(k) if empties[p] in cells and self._candidates(empties[p]) & bit), -1)
                    if pos < 0:  # an earlier single of this pass took its only place
                        return k, False
                    self._place(pos, k, bit)
                    k -= 1
            if k == k0:
                return k, True

    def _search(self, k: int) -> None:
        # Invariant: empties[:k] are exactly the cells still empty.
        self.nodes += 1
        if self.max_nodes is not None and self.nodes > self.max_nodes:
            self.gave_up = True
            return
        k_before, alive = k, True
        if self.rng is None:
            k, alive = self._fill_forced(k)
        if alive:
            self._branch(k)
        self._clear(k, k_before)

    def _branch(self, k: int) -> None:
        """Try each way to fill the most constrained cell, or, when fewer, each place left for the most
        constrained digit of a row, column or box (with `rng`: cells only, as random grids always were)."""
        if k == 0:
            self.count += 1
            if self.first is None:
                self.first = self.grid.copy()
            return
        empties = self.empties
        best_pos, best_mask, best_n = -1, 0, 10
        for pos in range(k):
            mask = self._candidates(empties[pos])
            n = mask.bit_count()
            if n < best_n:
                best_pos, best_mask, best_n = pos, mask, n
                if n <= 1:  # forced or dead: no better choice exists
                    break
        if best_n == 0:
            return
        bits: list[int] = []
        while best_mask:
            low = best_mask & -best_mask
            bits.append(low)
            best_mask ^= low
        if self.rng is not None:
            self.rng.shuffle(bits)
        choices = [(empties[best_pos], bit) for bit in bits]
        if self.rng is None and best_n > 2:
            choices = self._fewest_places(choices)
        for cell, bit in choices:
            self._place(empties.index(cell, 0, k), k, bit)
            self._search(k - 1)
            self._clear(k - 1, k)
            if self.count >= self.limit or self.gave_up:
                break

    def _fewest_places(self, choices: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The (cell, digit bit) places of the digit with the fewest places left in some unit, if fewer than
        `choices` (the most constrained cell's)."""
        grid = self.grid
        for _, cells in _UNITS:
            places: dict[int, list[tuple[int, int]]] = {}
            for i in cells:
                if not grid[i]:
                    mask = self._candidates(i)
                    while mask:
                        bit = mask & -mask
                        mask ^= bit
                        places.setdefault(bit, []).append((i, bit))
            for found in places.values():
                if len(found) < len(choices):
                    choices = found
        return choices


def _count(puzzle: str, limit: int) -> int:
    """count_solutions for an already-normalized puzzle (skips parsing in the generator's hot loop)."""
    return _Search([int(ch) for ch in puzzle], limit).run()


class Undecided(RuntimeError):
    """The search ran out of its node budget before it could tell whether a puzzle has a solution (or, with
    require_unique, only one)."""


class NotUnique(ValueError):
    """The puzzle has more than one solution (check_puzzle with require_unique): playable, but not well-posed."""


def count_solutions(puzzle: str, limit: int = 2) -> int:
    """Number of solutions of ``puzzle``, counting no further than ``limit``.

    Returns 0 for contradictory givens. With the default limit of 2, a result of 1 means "unique".
    """
    if not _is_count(limit) or limit < 1:
        raise ValueError(f"limit: expected an integer >= 1, got {limit!r}")
    return _count(parse_puzzle(puzzle), int(limit))


def solve(puzzle: str) -> str | None:
    """A solution of ``puzzle`` (the first one found if there are several), or None if there is none."""
    search = _Search([int(ch) for ch in parse_puzzle(puzzle)], limit=1)
    search.run()
    if search.first is None:
        return None
    return "".join(str(d) for d in search.first)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def _find_conflicts(grid: str) -> list[str]:
    """One message per (unit, digit) that occurs more than once; empty cells are ignored."""
    problems: list[str] = []
    for name, cells in _UNITS:
        where: dict[str, list[int]] = {}
        for i in cells:
            if grid[i] != "0":
                where.setdefault(grid[i], []).append(i)
        for digit in sorted(where):
            found = where[digit]
            if len(found) > 1:
                cell_list = ", ".join(_cell_name(i) for i in found)
                problems.append(f"{name}: digit {digit} appears {len(found)} times ({cell_list})")
    return problems


def check_puzzle(puzzle: str, require_unique: bool = False, max_nodes: int | None = None) -> str:
    """Return the normalized puzzle, or raise ValueError if it cannot be played.

    Raises for contradictory givens (naming each row/column/box and digit involved), for consistent
    givens that admit no solution, and, if ``require_unique``, for puzzles with several solutions (NotUnique, a
    ValueError).
    With ``max_nodes``, raises Undecided when the search branches more often than that without an answer
    (rare: 17-given puzzles with no solution took a few thousand).
    """
    if not isinstance(require_unique, bool):  # ('no' is truthy: uniqueness would be required)
        raise ValueError(f"require_unique: expected True or False, got {require_unique!r}")
    # ('100' failed as a TypeError naming nothing, and 0 or -3 reported every puzzle, a trivial one too, Undecided)
    if max_nodes is not None and (not _is_count(max_nodes) or max_nodes < 1):
        raise ValueError(f"max_nodes: expected an integer >= 1 or None, got {max_nodes!r}")
    max_nodes = None if max_nodes is None else int(max_nodes)
    p = parse_puzzle(puzzle)
    conflicts = _find_conflicts(p)
    if conflicts:
        raise ValueError("contradictory givens: " + "; ".join(conflicts))
    search = _Search([int(ch) for ch in p], limit=2, max_nodes=max_nodes)
    n = search.run()
    if search.gave_up and (n == 0 or require_unique and n == 1):
        raise Undecided(f"the solver could not tell within {max_nodes} search nodes whether the puzzle has "
                        + ("a solution" if n == 0 else "only one solution"))
    if n == 0:
        raise ValueError("puzzle has no solution (givens are consistent, but no completion exists)")
    if require_unique and n > 1:
        raise NotUnique("puzzle has more than one solution")
    return p


@dataclass
class Verdict:
    """Result of checking a proposed solution against its puzzle; ``valid`` iff ``errors`` is empty."""

    valid: bool
    givens_kept: bool
    complete: bool
    errors: list[str] = field(default_factory=list)


def verify(puzzle: str, solution: str) -> Verdict:
    """Check ``solution`` against ``puzzle``: givens unchanged, no empty cells, no duplicate in any unit.

    Both arguments must parse (see ``parse_puzzle``); model output should go through ``decode_digits``
    first, which always yields 81 characters.
    """
    p = parse_puzzle(puzzle)
    s = parse_puzzle(solution, "solution")  # (else its errors say "puzzle has 3 cells" of a bad solution)
    errors: list[str] = []
    for i in range(81):
        if p[i] != "0" and s[i] != p[i]:
            shown = "empty" if s[i] == "0" else s[i]
            errors.append(f"cell {_cell_name(i)}: given {p[i]} changed to {shown}")
    givens_kept = not errors
    errors.extend(_find_conflicts(s))
    missing = s.count("0")
    if missing:
        errors.append(f"incomplete: {missing} empty cell(s)")
    return Verdict(valid=not errors, givens_kept=givens_kept, complete=missing == 0, errors=errors)


def cell_accuracy(solution_pred: str, solution_true: str, puzzle: str) -> float:
    """Fraction of the cells empty in ``puzzle`` that ``solution_pred`` fills as in ``solution_true``.

    The givens are excluded because a model copies them for free and they would inflate the score.
    A puzzle with no empty cells scores 1.0 (there was nothing to get wrong).
    """
    p = parse_puzzle(puzzle)
    pred = parse_puzzle(solution_pred, "solution_pred")
    true = parse_puzzle(solution_true, "solution_true")
    blanks = [i for i in range(81) if p[i] == "0"]
    if not blanks:
        return 1.0
    return sum(pred[i] == true[i] for i in blanks) / len(blanks)


# ----------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------

# Range the generator aims for within each band. Easy stops at 40-45 givens so that "easy" stays close
# to the band edge instead of being trivially full.
_TARGETS = {"easy": (40, 45), "medium": (30, 39), "hard": (24, 29)}
_MAX_ATTEMPTS = 64


@dataclass(frozen=True)
class Puzzle:
    """A generated puzzle with its unique solution. ``seed`` reproduces it via ``generate``."""

    puzzle: str
    solution: str
    givens: int
    difficulty: str
    seed: int


def difficulty_of(puzzle: str) -> str:
    """'easy' (>= 40 givens), 'medium' (30-39) or 'hard' (< 30)."""
    givens = 81 - parse_puzzle(puzzle).count("0")
    if givens >= 40:
        return "easy"
    if givens >= 30:
        return "medium"
    return "hard"


def _check_difficulty(difficulty: str) -> None:
    if difficulty not in _TARGETS:
        raise ValueError(f"unknown difficulty {difficulty!r}; expected one of {', '.join(DIFFICULTIES)}")


def _is_count(value: object) -> bool:
    """An integer that is no bool (True is 1 to Python, and made one puzzle where a count was meant); numpy's too
    (np.int64 from an array's arithmetic), which callers keep as int(value)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_seed(seed: Any) -> int:
    # random.Random seeds from abs() of an int (seed -1 gives seed 1's puzzle) and takes str, float and bool (True
    # gives seed 1's) as well, so anything else would quietly be another seed's puzzle, or a puzzle no int names.
    if not _is_count(seed) or seed < 0:  # (numpy's integers are integers: random.Random takes the int they hold)
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
    return int(seed)


def _derive_seed(*parts: object) -> int:
    # A hash of the parts' text (not Python's salted hash()) so derived seeds are the same in every run.
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _random_full_grid(rng: random.Random) -> str:
    search = _Search([0] * 81, limit=1, rng=rng)
    search.run()
    assert search.first is not None  # an empty grid always has a completion
    return "".join(str(d) for d in search.first)


def _remove_cells(solution: str, target: int, rng: random.Random) -> str:
    """Blank cells in random order, keeping each removal only if the solution stays unique."""
    grid = list(solution)
    order = list(range(81))
    rng.shuffle(order)
    givens = 81
    for i in order:
        if givens <= target:
            break
        kept = grid[i]
        grid[i] = "0"
        if _count("".join(grid), limit=2) == 1:
            givens -= 1
        else:
            grid[i] = kept
    return "".join(grid)


def generate(seed: int, difficulty: str = "medium") -> Puzzle:
    """A puzzle with exactly one solution whose givens fall in ``difficulty``'s band; same seed, same puzzle.

    If removal gets stuck above the band (only plausible for 'hard'), the attempt is redone with a seed
    derived from (seed, difficulty, attempt), so the result is still a pure function of the arguments.
    """
    seed = _check_seed(seed)
    _check_difficulty(difficulty)
    low, high = _TARGETS[difficulty]
    for attempt in range(_MAX_ATTEMPTS):
        rng = random.Random(seed if attempt == 0 else _derive_seed(seed, difficulty, attempt))
        solution = _random_full_grid(rng)
        puzzle = _remove_cells(solution, rng.randint(low, high), rng)
        if difficulty_of(puzzle) == difficulty:
            givens = 81 - puzzle.count("0")
            return Puzzle(puzzle=puzzle, solution=solution, givens=givens, difficulty=difficulty, seed=seed)
    raise RuntimeError(f"no {difficulty} puzzle after {_MAX_ATTEMPTS} attempts for seed {seed}")


def generate_many(n: int, seed: int, difficulty: str = "medium") -> list[Puzzle]:
    """``n`` puzzles, deterministic for ``seed``; puzzle k uses a seed derived from (seed, k).

    Derived (rather than consecutive) seeds keep the lists for seeds s and s+1 from sharing puzzles.
    """
    if not _is_count(n) or n < 0:  # (True would make one puzzle; 2.5 and '2' fail as TypeErrors from range and <)
        raise ValueError(f"n: expected an integer >= 0, got {n!r}")
    seed = _check_seed(seed)
    _check_difficulty(difficulty)
    return [generate(_derive_seed("many", seed, k), difficulty) for k in range(n)]


# ----------------------------------------------------------------------------------------------------
# Tokenization
# ----------------------------------------------------------------------------------------------------

PROMPT_LEN = 83  # bos + 81 cells + sep
CANVAS_LEN = 81  # the solution digits, nothing else


@dataclass(frozen=True)
class SudokuVocab:
    """Token ids of the Sudoku task; digits '0'..'9' are ``digit_base`` .. ``digit_base + 9``."""

    pad: int = 0
    eos: int = 1
    bos: int = 2
    digit_base: int = 3
    sep: int = 13
    vocab_size: int = 16  # 14 ids used; the rest is spare room

    def digit_id(self, ch: str) -> int:
        if len(ch) != 1 or ch not in _DIGITS:
            raise ValueError(f"not a digit: {ch!r}")
        return self.digit_base + int(ch)

    def id_to_digit(self, token_id: int) -> str | None:
        """The digit character for ``token_id``, or None if it is not a digit id."""
        offset = int(token_id) - self.digit_base
        return _DIGITS[offset] if 0 <= offset <= 9 else None


VOCAB = SudokuVocab()


def encode_prompt(puzzle: str, vocab: SudokuVocab = VOCAB) -> list[int]:
    """[bos] + 81 digit ids + [sep]."""
    return [vocab.bos] + [vocab.digit_id(ch) for ch in parse_puzzle(puzzle)] + [vocab.sep]


def encode_solution(solution: str, vocab: SudokuVocab = VOCAB) -> list[int]:
    """The 81 digit ids of the solution (the canvas has no eos)."""
    return [vocab.digit_id(ch) for ch in parse_puzzle(solution)]


def decode_digits(ids: Iterable[int], vocab: SudokuVocab = VOCAB) -> str:
    """Map canvas ids to an 81-character digit string; non-digit ids become '0', extra ids are dropped
    and a short output is padded with '0', so any model output can be passed to ``verify``."""
    if isinstance(ids, (str, bytes)):  # (its characters would fail in int() one by one)
        raise ValueError(f"ids: expected canvas token ids, got a {type(ids).__name__}; a digit string is a board")
    chars: list[str] = []
    for token_id in ids:
        if len(chars) == CANVAS_LEN:
            break
        chars.append(vocab.id_to_digit(token_id) or "0")
    return "".join(chars).ljust(CANVAS_LEN, "0")


# ----------------------------------------------------------------------------------------------------
# Symmetries (training-data augmentation)
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Symmetry:
    """A validity-preserving relabelling of a board: ``new[i] = digits[old[cells[i]]]``.

    Composed of a row permutation (bands, then rows inside each band), the same for columns, an optional
    transpose and a relabelling of the digits 1-9. Each maps a valid solution to a valid solution and a
    puzzle with one solution to a puzzle with one solution and the same number of givens, so one generated
    puzzle stands for ~1.2e12 distinct training examples and the model cannot memorise digit identities.
    """

    cells: tuple[int, ...]  # 81 source-cell indices
    digits: str  # digits[d] is the new character for digit d; digits[0] == '0'

    def apply(self, grid: str) -> str:
        grid = parse_puzzle(grid)
        return "".join(self.digits[int(grid[src])] for src in self.cells)


def random_symmetry(rng: random.Random) -> Symmetry:
    """A uniformly drawn element of the sudoku symmetry group, from ``rng``."""

    def line_order() -> list[int]:
        bands = rng.sample(range(3), 3)
        return [3 * band + r for band in bands for r in rng.sample(range(3), 3)]

    rows, cols, transpose = line_order(), line_order(), rng.random() < 0.5
    cells = []
    for r in range(9):
        for c in range(9):
            src_r, src_c = rows[r], cols[c]
            if transpose:
                src_r, src_c = src_c, src_r
            cells.append(9 * src_r + src_c)
    relabel = rng.sample("123456789", 9)
    return Symmetry(tuple(cells), "0" + "".join(relabel))
