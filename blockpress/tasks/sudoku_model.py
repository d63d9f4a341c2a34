"""Solving sudoku with a block-diffusion model: the givens are fixed positions of a constrained canvas.

By default the model alone decides every empty cell: no candidate filtering, no search, no rules in the
decoder. `rules=True` is the rule-aware option, reported separately: each step, a cell may not take a digit
that a settled peer (a given, or a cell accepted at the last step, in its row, column or box) already
holds. It filters candidates only; there is still no search and no backtracking.
`solve_ar` decodes the same kind of model left to right (the autoregressive baseline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..generate import Commit, Done, Draft
from .sudoku import VOCAB, check_puzzle, decode_digits, encode_prompt, parse_puzzle, verify

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


@dataclass
class ModelSolution:
    puzzle: str
    solution: str  # 81 digits as the model filled them
    valid: bool  # the verifier's verdict
    steps: int  # denoising steps used (tokens decoded for AR)


def _template(puzzle: str) -> list[int]:
    return [-1 if ch == "0" else VOCAB.digit_id(ch) for ch in puzzle]


def prepare(puzzles: Sequence[str]) -> list[str]:
    """Parse and check each puzzle (clear errors for bad length, characters, contradictions, no solution)."""
    out = []
    for i, text in enumerate(puzzles):
        try:
            out.append(check_puzzle(parse_puzzle(text)))
        except ValueError as exc:
            raise ValueError(f"puzzle {i + 1}: {exc}") from None
    return out


def solve(
    lm: Any,
    puzzles: Sequence[str],
    max_denoising_steps: int | None = None,
    sampler: str | None = None,
    seed: int = 0,
    on_draft: Callable[[int, list[str]], None] | None = None,
    skip_stopped_rows: bool = True,
    rules: bool = False,
    **sampler_options: Any,
) -> list[ModelSolution]:
    """Fill every empty cell with the model; `on_draft(step, boards)` sees the canvas settle.

    `rules`: the rule-aware option (see the module docstring); off, the model alone decides.
    `sampler_options`: sampler settings (entropy_bound, confidence, ...) over the model's defaults."""
    puzzles = prepare(puzzles)
    prompts = [encode_prompt(p) for p in puzzles]
    template = [_template(p) for p in puzzles]
    out = None
    for event in lm.stream(prompts, template=template, max_denoising_steps=max_denoising_steps, sampler=sampler,
                           seed=seed, drafts=on_draft is not None, skip_stopped_rows=skip_stopped_rows,
                           constraint=rules_constraint(lm.config.text.vocab_size, lm.device) if rules else None,
                           **sampler_options):
        if isinstance(event, Draft) and on_draft is not None:
            on_draft(event.step, [decode_digits(row) for row in event.tokens.tolist()])
        elif isinstance(event, Done):
            out = event.output
        elif isinstance(event, Commit):
            pass
    results = []
    for i, p in enumerate(puzzles):
        grid = decode_digits(out.new_tokens[i].tolist())
        results.append(ModelSolution(p, grid, verify(p, grid).valid, int(out.steps_per_canvas[i].sum())))
    return results


@torch.no_grad()
def solve_ar(lm: Any, puzzles: Sequence[str]) -> list[ModelSolution]:
    """Left-to-right greedy decoding of the solution, givens forced (the AR baseline, same conditions)."""
    puzzles = prepare(puzzles)
    model = lm.model
    b = len(puzzles)
    prompt = torch.tensor([encode_prompt(p) for p in puzzles], device=lm.device)
    fixed = torch.tensor([_template(p) for p in puzzles], device=lm.device)
    cache = lm.new_cache(b, prompt.shape[1] + 82)
    logits = model.encode(prompt, cache, logits="last")
    out = torch.zeros(b, 81, dtype=torch.long, device=lm.device)
    for i in range(81):
        # A given is copied, exactly as the diffusion canvas keeps it; every other cell is the argmax.
        token = torch.where(fixed[:, i] >= 0, fixed[:, i], logits.argmax(-1))
        out[:, i] = token
        logits = model.encode(token[:, None], cache, logits="last")
    return [ModelSolution(p, decode_digits(row), verify(p, decode_digits(row)).valid, 81)
            for p, row in zip(puzzles, out.tolist())]
