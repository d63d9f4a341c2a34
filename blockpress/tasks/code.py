"""Code completion as a task: held-out functions from Python source, and what counts as a parseable body.

Shared by `benchmarks/code_model.py` (the test split) and `scripts/tune_code_sampler.py` (a validation split
of the same held-out modules, disjoint from the test functions), so both judge completions the same way.

A completion is judged as a function body: the prompt is the source up to and including the `def` line(s);
the body is cut where it ends (the first non-blank line indented no deeper than the `def`) or at the last
complete line, and it must hold at least one statement that is not a comment.
"""

from __future__ import annotations

import ast
import io
import random
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from blockpress.checks import warn_user

if TYPE_CHECKING:
    from blockpress.tokenizer import Tokenizer

CONTEXT_LINES = 20  # source lines before the def that the prompt keeps


@dataclass(frozen=True)
class Function:
    module: str  # path relative to the source root
    prefix: str  # up to CONTEXT_LINES lines of context, ending with the def line(s)
    header: str  # the def line(s) alone (decorators excluded)
    body: str  # the original body (2-15 lines)

    @property
    def indent(self) -> int:
        return len(self.header) - len(self.header.lstrip())

    @property
    def prompt_text(self) -> str:
        """The prefix without its final newline. Byte-level BPE merges a newline with the indentation after
        it ("\n        " is one token), so a prompt ending in a bare "\n" token tells the model that the next
        line starts at column 0. The model writes the newline and the body's indentation itself."""
        return self.prefix[:-1] if self.prefix.endswith("\n") else self.prefix


def functions_in(source: str, module: str) -> list[Function]:
    """Functions whose body starts on its own line and spans 2-15 lines, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    # Split where ast counts lines (\n, \r\n, \r) and nowhere else: str.splitlines also breaks at a form feed
    # (an Emacs ^L page break), \v, \x1c-\x1e, \x85 and U+2028/9, which shifts every later function's lines
    lines = io.StringIO(source, newline="").readlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        body_start = node.body[0].lineno - 1
        end = node.end_lineno  # (set by ast.parse; None only on a node built by hand)
        if end is None or node.body[0].lineno == node.lineno or not 2 <= end - body_start <= 15:
            continue
        prefix = "".join(lines[max(0, node.lineno - 1 - CONTEXT_LINES) : body_start])
        header = "".join(lines[node.lineno - 1 : body_start])
        out.append(Function(module, prefix, header, "".join(lines[body_start : node.end_lineno])))
    return out


def heldout_functions(root: str | Path, modules: list[str], seed: int) -> list[Function]:
    """Every eligible function of `modules` (paths under `root`), shuffled by `seed`.

    The benchmark takes the first N (the test split); tuning takes a slice after them (validation)."""
    out: list[Function] = []
    for rel in modules:
        try:
            source = (Path(root) / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.extend(functions_in(source, rel))
    random.Random(seed).shuffle(out)
    return out


def model_heldout_functions(model_dir: str | Path, manifest: str | Path | None = None, seed: int = 0) -> list[Function]:
    """`heldout_functions` over this interpreter's stdlib, for the modules a model's corpus held out
    (its shipped `corpus_manifest.json`, or `manifest`)."""
    import json
    import sysconfig

    path = Path(manifest) if manifest else Path(model_dir) / "corpus_manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no corpus manifest (pass --manifest, the corpus build's manifest.json)")
    manifest_data = json.loads(path.read_text(encoding="utf-8"))
    stdlib = sysconfig.get_paths()["stdlib"]
    # The modules are read from this interpreter's stdlib: another Python's holds other code under the same names,
    # so the functions (and the figures measured on them) are not the manifest's
    built = re.search(r"python(\d+\.\d+)", PurePath(str(manifest_data.get("source", ""))).name)
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if built and built.group(1) != running:
        warn_user(f"{path}: the corpus was split from Python {built.group(1)}'s standard library, and this is Python "
                  f"{running}: its held-out modules hold other code here, so the functions (and the figures) differ "
                  f"from those measured on {built.group(1)}")
    return heldout_functions(stdlib, manifest_data["heldout_modules"], seed)


def cut_body(completion: str, indent: int) -> str:
    """The body: up to the first non-blank line indented no deeper than the def, or the last full line."""
    kept = []
    for line in completion.split("\n")[:-1]:  # the last piece may be a line cut off mid-way
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        kept.append(line)
    return "\n".join(kept)


def parses(header: str, body: str) -> bool:
    """Does `header + body` parse as Python, with at least one statement in the body?"""
    if not any(line.strip() and not line.strip().startswith("#") for line in body.splitlines()):
        return False
    # The header's comment lines go first: one at column 0 between the def line and the body (the header keeps it)
    # would stop dedent, and then no body could parse. (The body holds none: cut_body ends it at such a line. Not
    # the body's own comment lines: one may close a string or follow a backslash, where deleting it changes the parse.)
    header = "".join(line for line in header.splitlines(keepends=True) if not line.lstrip().startswith("#"))
    try:
        ast.parse(textwrap.dedent(header + body + "\n"))
        return True
    except SyntaxError:
        return False


def completion_parses(function: Function, completion: str) -> bool:
    return parses(function.header, cut_body(completion, function.indent))


def budget_ceiling(tokenizer: Tokenizer, functions: list[Function], max_new_tokens: int) -> float:
    """The fraction of `functions` whose own body, as a completion cut at `max_new_tokens` tokens (what a model
    writing the original code returns), `completion_parses` accepts: a reference point for the engines' figures,
    as a body the budget cuts inside a statement or an open bracket does not parse (not a bound: a body of `pass`
    parses at any budget)."""
    fits = sum(completion_parses(f, tokenizer.decode(tokenizer.encode("\n" + f.body)[:max_new_tokens]))
               for f in functions)
    return fits / max(1, len(functions))


def repeats_a_line(body: str, times: int = 3, shortest: int = 8) -> bool:
    """Does some line of `body` (stripped, at least `shortest` characters) occur `times` times or more? A model
    caught in a loop writes the same statement again and again; real code rarely repeats one that long."""
    counts: dict[str, int] = {}
    for line in body.splitlines():
        text = line.strip()
        if len(text) >= shortest:
            counts[text] = counts.get(text, 0) + 1
            if counts[text] >= times:
                return True
    return False


def completion_parses_without_loops(function: Function, completion: str) -> bool:
    """A stricter reading of `completion_parses`: the body parses and repeats no line three times."""
    body = cut_body(completion, function.indent)
    return parses(function.header, body) and not repeats_a_line(body)


@dataclass(frozen=True)
class InfillCase:
    before: str  # context and body lines above the hole, without the newline that ends them
    target: str  # the line to recover
    hole: list[int]  # the tokens of "\n" + target (the hole has exactly this length)
    suffix: list[int]  # tokens after the hole that fit on the canvas


def infill_cases(functions: list[Function], tokenizer: Tokenizer, canvas: int, limit: int, seed: int) -> list[InfillCase]:
    """One body line per function becomes a hole of its own token length; the following lines stay fixed.

    The newline before the target belongs to the hole, as running text tokenizes it (see `prompt_text`). At most
    `limit` cases (0: none), from the first functions that have one."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit: expected a non-negative integer, got {limit!r}")
    rng = random.Random(seed)
    cases: list[InfillCase] = []
    for f in functions:
        if len(cases) >= limit:  # tested before a case is added: limit 0 is none
            break
        lines = f.body.split("\n")
        candidates = [i for i, line in enumerate(lines[:-1]) if line.strip() and not line.strip().startswith("#")]
        if not candidates:
            continue
        i = rng.choice(candidates)
        before = f.prompt_text + "".join("\n" + line for line in lines[:i])
        hole = tokenizer.encode("\n" + lines[i])
        suffix = tokenizer.encode("\n" + "\n".join(lines[i + 1 :]))
        room = canvas - len(hole)
        if room < 4 or not hole:
            continue
        cases.append(InfillCase(before, lines[i], hole, suffix[:room]))
    return cases


def fills_the_line(fill: str, target: str) -> bool:
    """Whether a single-line infill's text (the hole's, from the newline it starts with) is the target line: its
    indentation included, which Python reads (a line indented as another block is another program); whitespace
    at the end aside."""
    return fill.removeprefix("\n").rstrip() == target.rstrip()


@dataclass(frozen=True)
class SpaceInfillCase:
    before: str  # context and body lines above the hole's line, without the newline that ends them
    start: str  # the hole's line up to and including a space ("    x = "): a template's fixed text before the hole
    target: str  # the rest of the line, which the hole should recover ("compute(y)")
    length: int  # the tokens of " " + target: running text merges the space into the target's first token
    suffix: str  # the lines after, from their newline, cut to what fits on the canvas


def space_infill_cases(functions: list[Function], tokenizer: Tokenizer, canvas: int, limit: int,
                       seed: int) -> list[SpaceInfillCase]:
    """One body line per function is cut after a space inside it (one following a word, followed by a word: the
    template's fixed text ends in a lone space token, which running text never holds before a word); the rest of the
    line is the hole. The hole is as long as running text's tokens of the space and the rest, which token healing
    fills (the space's position opened into the hole, see blockpress.healing.heal_holes); the lines after follow it,
    as far as the canvas holds them. At most `limit` cases (0: none), from the first functions that have one."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit: expected a non-negative integer, got {limit!r}")
    rng = random.Random(seed)
    cases: list[SpaceInfillCase] = []
    for f in functions:
        if len(cases) >= limit:
            break
        lines = f.body.split("\n")
        cuts = [(i, k) for i, line in enumerate(lines[:-1]) if line.strip() and not line.strip().startswith("#")
                for k in range(len(line) - len(line.lstrip()) + 1, len(line) - 1)
                if line[k] == " " and not line[k - 1].isspace() and not line[k + 1].isspace()]
        if not cuts:
            continue
        i, k = rng.choice(cuts)
        target = lines[i][k + 1 :]
        length = len(tokenizer.encode(" " + target))
        room = canvas - length
        suffix = tokenizer.encode("\n" + "\n".join(lines[i + 1 :]))[: max(0, room)]
        if room < 4:
            continue
        cases.append(SpaceInfillCase(f.prompt_text + "".join("\n" + line for line in lines[:i]), lines[i][: k + 1],
                                     target, length, tokenizer.decode(suffix)))
    return cases
