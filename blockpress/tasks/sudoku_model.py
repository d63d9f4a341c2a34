"""Solving sudoku with a block-diffusion model: the givens are fixed positions of a constrained canvas.

By default the model alone decides every empty cell: no candidate filtering, no search, no rules in the
decoder. `rules=True` is the rule-aware option, reported separately: each step, a cell may not take a digit
that a settled peer (a given, or a cell accepted at the last step, in its row, column or box) already
holds. It filters candidates only; there is still no search and no backtracking.
`ensemble=N` is another option, also reported separately: the puzzle is denoised as N symmetric views at
once (the identity and N - 1 relabelled, permuted boards, as in training), and every step each view samples
from the views' averaged log-probabilities mapped into its own frame. No rules and no search: the model's
answers, pooled over board symmetries it was trained to respect (test-time augmentation); N times the work.
`solve_ar` decodes the same kind of model left to right, givens forced (the autoregressive baseline).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import check_flag, is_int, warn_user
from ..generate import Commit, Done, Draft
from ..lm import check_seed
from .sudoku import (
    CANVAS_LEN,
    VOCAB,
    NotUnique,
    Symmetry,
    Undecided,
    check_puzzle,
    decode_digits,
    encode_prompt,
    parse_puzzle,
    random_symmetry,
    verify,
)

# The most symmetric views an ensemble takes: each view is a row of the batch, and 8 already add little over 4.
MAX_VIEWS = 64
_DIGIT_IDS = torch.tensor([VOCAB.digit_id(str(d)) for d in range(1, 10)])


def _peers() -> torch.Tensor:
    """[81, 81] float: 1 where two different cells share a row, a column or a box."""
    cell = torch.arange(81)
    row, col = cell // 9, cell % 9
    box = (row // 3) * 3 + col // 3
    same = (row[:, None] == row[None]) | (col[:, None] == col[None]) | (box[:, None] == box[None])
    return (same & (cell[:, None] != cell[None])).float()


def rules_constraint(vocab_size: int, device: torch.device | str = "cpu") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rule-aware decoding constraint: only digits, and none a settled peer already holds.

    A cell whose every digit is held by its peers (the settled cells contradict each other) is left to the
    model rather than forced into a non-digit.
    """
    peers, digits = _peers().to(device), _DIGIT_IDS.to(device)  # moved once, not every step

    def constraint(draft: torch.Tensor, settled: torch.Tensor) -> torch.Tensor:
        held = ((draft[..., None] == digits) & settled[..., None]).float()  # [b, 81, 9]
        taken = torch.einsum("ij,bjd->bid", peers, held) > 0
        taken &= ~taken.all(dim=-1, keepdim=True)
        banned = torch.ones(*draft.shape, vocab_size, dtype=torch.bool, device=draft.device)
        banned[..., digits] = taken
        return banned

    return constraint


def symmetric_views(n: int, seed: int | None = 0) -> list[Symmetry]:
    """The identity, then n - 1 seeded random symmetries of the board."""
    # is_int: a bool is no count (True would run as 1 view)
    if not is_int(n) or not 1 <= n <= MAX_VIEWS:
        raise ValueError(f"ensemble: expected 1 to {MAX_VIEWS} views, got {n!r}")
    rng = random.Random(seed)
    return [Symmetry(tuple(range(81)), "0123456789")] + [random_symmetry(rng) for _ in range(n - 1)]


def ensemble_processor(views: Sequence[Symmetry], vocab_size: int,
                       device: torch.device | str = "cpu") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A logits_processor for a batch laid out as puzzle-major groups of len(views) rows (row p * V + v is view
    v of puzzle p): each step, every view's log-probabilities are mapped back to the original board (cells and
    digits), averaged over the views, and mapped into each view's frame again."""
    v = len(views)
    cells = torch.tensor([view.cells for view in views])  # view cell i shows original cell cells[v, i]
    tokens = torch.arange(vocab_size).repeat(v, 1)  # original token t appears in view v as tokens[v, t]
    for k, view in enumerate(views):
        for d in range(10):
            tokens[k, VOCAB.digit_id(str(d))] = VOCAB.digit_id(view.digits[d])
    to_orig: tuple[torch.Tensor, ...] = (torch.arange(v)[:, None, None], torch.argsort(cells, dim=1)[:, :, None], tokens[:, None, :])
    to_view: tuple[torch.Tensor, ...] = (cells[:, :, None], torch.argsort(tokens, dim=1)[:, None, :])
    to_orig = tuple(t.to(device) for t in to_orig)
    to_view = tuple(t.to(device) for t in to_view)

    def process(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        n, c, vocab = logits.shape
        if n % v or c != 81 or vocab != vocab_size:
            raise ValueError(f"ensemble: expected groups of {v} views of 81 cells over {vocab_size} tokens, "
                             f"got logits {list(logits.shape)}")
        grouped = logits.view(n // v, v, c, vocab)
        pooled = torch.log_softmax(grouped[:, to_orig[0], to_orig[1], to_orig[2]].float(), dim=-1).mean(dim=1)
        return pooled[:, to_view[0], to_view[1]].reshape(n, c, vocab).to(logits.dtype)

    return process


@dataclass
class ModelSolution:
    puzzle: str
    solution: str  # 81 digits as the model filled them
    valid: bool  # the verifier's verdict
    steps: int  # denoising steps used (tokens decoded for AR)
    errors: list[str] = field(default_factory=list)  # the verifier's: each broken rule and its cells (none if valid)


def _answer(puzzle: str, grid: str, steps: int) -> ModelSolution:
    verdict = verify(puzzle, grid)
    return ModelSolution(puzzle, grid, verdict.valid, steps, verdict.errors)


def _template(puzzle: str) -> list[int]:
    return [-1 if ch == "0" else VOCAB.digit_id(ch) for ch in puzzle]


# (scripts/ is in the source repository, not in the wheel: said where to find it)
_USE_A_SUDOKU_MODEL = ("use blockpress-sudoku or a model trained with scripts/train_sudoku.py in a clone of the "
                       "blockpress repository")


def check_sudoku_model(lm: Any) -> None:
    """A sudoku model reads and writes the task's token ids (VOCAB) on a canvas of one board (CANVAS_LEN cells); any
    other model would print noise as a board."""
    vocab = lm.config.text.vocab_size
    if vocab != VOCAB.vocab_size:
        raise ValueError(f"model: not a sudoku model: its vocabulary has {vocab} tokens, a sudoku model's has "
                         f"{VOCAB.vocab_size} (digits 0-9 as ids {VOCAB.digit_base}-{VOCAB.digit_base + 9}); "
                         f"{_USE_A_SUDOKU_MODEL}")
    # its canvas is one board's 81 cells: the rules and the ensemble's views are laid out on that grid (einsum's
    # "subscript j has size 8" from rules_constraint before, and a plain call ran over 11 canvases of 8)
    canvas = lm.config.canvas_length
    if canvas != CANVAS_LEN:
        raise ValueError(f"model: not a sudoku model: its canvas_length is {canvas}, a sudoku model's is {CANVAS_LEN} "
                         f"(one board's cells); {_USE_A_SUDOKU_MODEL}")


# Search nodes check_puzzle may spend on one puzzle (about 5,000 a second): a puzzle it cannot settle within them
# goes to the model with a warning rather than blocking the run.
CHECK_NODES = 10_000


def puzzle_list(puzzles: str | Sequence[str]) -> list[str]:
    """The puzzles of a call: a list of puzzle strings, or one string as a batch of one (as lm.generate takes a
    str prompt). A str is a Sequence too: read as one, its characters became 81 one-cell puzzles."""
    if isinstance(puzzles, str):
        return [puzzles]
    if isinstance(puzzles, (bytes, bytearray)) or not isinstance(puzzles, Iterable):
        raise ValueError(f"puzzles: expected a puzzle string or a list of them, got {type(puzzles).__name__}")
    return list(puzzles)


def prepare(puzzles: str | Sequence[str]) -> list[str]:
    """Parse and check each puzzle (clear errors for a non-string, bad length, characters, contradictions, no
    solution). A puzzle the solver cannot settle within CHECK_NODES is kept, with a warning; so is one with more
    than one solution (the check's search counts up to two either way, so saying so costs nothing)."""
    out = []
    for i, text in enumerate(puzzle_list(puzzles)):
        try:
            out.append(check_puzzle(parse_puzzle(text), require_unique=True, max_nodes=CHECK_NODES))
        except Undecided as exc:
            warn_user(f"puzzle {i + 1}: {exc}; the model tries it anyway")  # the caller's line (solve's too)
            out.append(parse_puzzle(text))
        except NotUnique as exc:
            # The model was trained on puzzles with one solution; any grid that keeps the givens and the rules
            # verifies as valid, whichever solution it is.
            warn_user(f"puzzle {i + 1}: {exc} (a proper puzzle has one, as the model's training puzzles do); "
                      "any grid that keeps the givens and the rules counts as valid")
            out.append(parse_puzzle(text))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"puzzle {i + 1}: {exc}") from None
    return out


def _with_complete_grids(puzzles: list[str], decode: Callable[[list[str]], list[ModelSolution]]) -> list[ModelSolution]:
    """The results of `puzzles`, in their order, with `decode` run on the open ones only (and not at all when there
    are none). A grid given complete has nothing to decode (a canvas needs a hole; the AR decoder would spend 81
    passes copying it): it is its own answer, checked, in 0 steps."""
    open_puzzles = [p for p in puzzles if "0" in p]
    answers = iter(decode(open_puzzles) if open_puzzles else [])
    return [next(answers) if "0" in p else _answer(p, p, 0) for p in puzzles]


def solve(
    lm: Any,
    puzzles: str | Sequence[str],
    max_denoising_steps: int | None = None,
    sampler: str | None = None,
    seed: int | None = 0,
    on_draft: Callable[[int, list[str]], None] | None = None,
    skip_stopped_rows: bool = True,
    rules: bool = False,
    ensemble: int = 1,
    checked: bool = False,
    **sampler_options: Any,
) -> list[ModelSolution]:
    """Fill every empty cell with the model; `on_draft(step, boards)` sees the canvas settle (a board per puzzle, in
    the order given; a complete grid as given). `puzzles`: puzzle strings (81 cells each), or one string; a list of
    results either way.

    `rules`: the rule-aware option (see the module docstring); off, the model alone decides.
    `ensemble`: denoise each puzzle as this many symmetric views with pooled predictions (module docstring).
    `checked`: the puzzles are as prepare() returned them (the CLI checks them before loading the model).
    `sampler_options`: sampler settings (entropy_bound, confidence, ...) over the model's defaults."""
    # Checked before any work: rules="false" would read as True (rule-aware results are reported apart from the
    # model's own), and on_draft=5 would fail at the first draft, after a denoising pass.
    for name, value in (("rules", rules), ("checked", checked), ("skip_stopped_rows", skip_stopped_rows)):
        check_flag(name, value)
    if on_draft is not None and not callable(on_draft):
        raise ValueError(f"on_draft: expected a function (step, boards) -> None, got {type(on_draft).__name__}")
    check_sudoku_model(lm)
    seed = check_seed(seed, "seed")  # (a numpy integer fails inside random.Random, naming nothing)
    puzzles = puzzle_list(puzzles) if checked else prepare(puzzles)
    views = symmetric_views(ensemble, seed)
    # the processor pools whole groups of views: no row of a group may stop alone
    processor = ensemble_processor(views, lm.config.text.vocab_size, lm.device) if ensemble > 1 else None

    # The canvas rows are the open puzzles only (_with_complete_grids keeps complete grids out of the decode):
    # on_draft gets a board per puzzle given, in that order, a complete grid as given, not the open ones shifted up.
    open_rows = [i for i, p in enumerate(puzzles) if "0" in p]

    def draft_boards(rows: list[list[int]]) -> list[str]:
        boards = list(puzzles)
        for i, row in zip(open_rows, rows, strict=True):
            boards[i] = decode_digits(row)
        return boards

    def denoise(open_puzzles: list[str]) -> list[ModelSolution]:
        boards = [view.apply(p) for p in open_puzzles for view in views]  # puzzle-major: row p * V + v
        out = None
        for event in lm.stream([encode_prompt(b) for b in boards], template=[_template(b) for b in boards],
                               max_denoising_steps=max_denoising_steps, sampler=sampler, seed=seed,
                               drafts=on_draft is not None, skip_stopped_rows=skip_stopped_rows and processor is None,
                               constraint=rules_constraint(lm.config.text.vocab_size, lm.device) if rules else None,
                               logits_processor=processor, **sampler_options):
            if isinstance(event, Draft) and on_draft is not None:
                on_draft(event.step, draft_boards(event.tokens[:: len(views)].tolist()))
            elif isinstance(event, Done):
                out = event.output
            elif isinstance(event, Commit):
                pass
        if out is None:  # (LM.stream ends every run with its Done)
            raise RuntimeError("sudoku: generation ended without its output")
        answers = []
        for i, p in enumerate(open_puzzles):
            row = i * len(views)  # the identity view: the board as given
            grid = decode_digits(out.new_tokens[row].tolist())
            answers.append(_answer(p, grid, int(out.steps_per_canvas[row].sum())))
        return answers

    return _with_complete_grids(puzzles, denoise)


def solve_ar(lm: Any, puzzles: str | Sequence[str]) -> list[ModelSolution]:
    """Left-to-right greedy decoding of the solution, givens forced (the AR baseline, same conditions): one encoder
    pass over the prompt, then one a cell for the first 80 cells. Its own loop rather than `lm.generate_ar`, which
    cannot force tokens at given positions."""
    check_sudoku_model(lm)
    return _with_complete_grids(prepare(puzzles), lambda open_puzzles: _decode_ar(lm, open_puzzles))


@torch.no_grad()  # here, not on solve_ar: torch's wrapper frame would be the caller prepare()'s warnings name
def _decode_ar(lm: Any, puzzles: list[str]) -> list[ModelSolution]:
    """solve_ar of puzzles that each have an empty cell."""
    model = lm.model
    b = len(puzzles)
    prompt = torch.tensor([encode_prompt(p) for p in puzzles], device=lm.device)
    fixed = torch.tensor([_template(p) for p in puzzles], device=lm.device)
    cache = lm.new_cache(b, prompt.shape[1] + 80)  # the last cell is never encoded: no cell reads its logits
    logits = model.encode(prompt, cache, logits="last")
    out = torch.zeros(b, 81, dtype=torch.long, device=lm.device)
    for i in range(81):
        # A given is copied, exactly as the diffusion canvas keeps it; every other cell is the argmax.
        token = torch.where(fixed[:, i] >= 0, fixed[:, i], logits.argmax(-1))
        out[:, i] = token
        if i < 80:
            logits = model.encode(token[:, None], cache, logits="last")
    return [_answer(p, decode_digits(row), 81) for p, row in zip(puzzles, out.tolist())]
