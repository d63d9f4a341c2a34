"""Quality of a code model on held-out stdlib modules: block diffusion vs AR decoding of the same weights.

Figures (JSON):
- parseable: fraction of generated function bodies that `ast.parse` accepts. The prompt is the function's
  source up to its `def` line. The completion is cut where the body ends (the first non-blank line indented
  no deeper than the `def`) or at the last complete line, and must hold at least one statement.
- infill_exact: exact-match rate of single-line infills. One body line becomes a hole of its own token
  length; diffusion sees the following lines too (a constrained canvas), AR only the prefix.
- tokens_per_forward and tok/s at the model's default settings.

    python benchmarks/code_model.py --model blockpress-code --functions 100
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import time
import warnings
from pathlib import Path

import torch

import blockpress


def heldout_functions(modules: list[str], limit: int, seed: int) -> list[tuple[str, str, str, str]]:
    """(module, prefix ending with the def line(s), the def line(s) alone, body) for 2-15 line bodies."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel in modules:
        try:
            source = (root / rel).read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                body_start = node.body[0].lineno - 1
                if node.body[0].lineno == node.lineno:
                    continue  # one-liner
                end = node.end_lineno
                if not 2 <= end - body_start <= 15:
                    continue
                prefix = "".join(lines[max(0, node.lineno - 1 - 20) : body_start])  # 20 lines of context
                header = "".join(lines[node.lineno - 1 : body_start])
                out.append((rel, prefix, header, "".join(lines[body_start:end])))
    random.Random(seed).shuffle(out)
    return out[:limit]


def indent_of(header: str) -> int:
    return len(header) - len(header.lstrip())


def cut_body(completion: str, indent: int) -> str:
    """The function body: up to the first line indented no deeper than the def, or the last full line."""
    kept = []
    lines = completion.split("\n")
    complete = lines[:-1]  # the last piece may be a cut-off line
    for line in complete:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        kept.append(line)
    return "\n".join(kept)


def parses(header: str, body: str) -> bool:
    import textwrap

    if not any(line.strip() and not line.strip().startswith("#") for line in body.splitlines()):
        return False
    snippet = textwrap.dedent(header + body + "\n")
    try:
        ast.parse(snippet)
        return True
    except SyntaxError:
        return False


def infill_cases(functions, tokenizer, canvas: int, limit: int, seed: int):
    rng = random.Random(seed)
    cases = []
    for _, prefix, _header, body in functions:
        lines = body.split("\n")
        candidates = [i for i, line in enumerate(lines[:-1]) if line.strip() and not line.strip().startswith("#")]
        if not candidates:
            continue
        i = rng.choice(candidates)
        target = lines[i]
        before = prefix + "\n".join(lines[:i]) + ("\n" if i else "")
        hole = tokenizer.encode(target)
        suffix = tokenizer.encode("\n" + "\n".join(lines[i + 1 :]))
        room = canvas - len(hole)
        if room < 4 or not hole:
            continue
        cases.append((before, target, hole, suffix[:room]))
        if len(cases) >= limit:
            break
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="blockpress-code")
    ap.add_argument("--manifest", default=None, help="corpus manifest.json listing held-out modules "
                    "(default: the one shipped with the model)")
    ap.add_argument("--functions", type=int, default=100)
    ap.add_argument("--infills", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = blockpress.load(args.model, dtype="float32")
    manifest = Path(args.manifest) if args.manifest else Path(lm.path) / "corpus_manifest.json"
    modules = json.loads(manifest.read_text())["heldout_modules"]
    tok = lm.tokenizer
    funcs = heldout_functions(modules, args.functions, args.seed)
    result: dict = {"benchmark": "code_model", "model": args.model, "functions": len(funcs),
                    "params": lm.num_parameters(active=False), "active_params": lm.num_parameters(active=True)}

    for engine in ("diffusion", "ar"):
        ok, new, passes, seconds, examples = 0, 0, 0, 0.0, []
        for i, (_, prefix, header, _body) in enumerate(funcs):
            prompt = tok.encode(prefix, add_bos=True)[-256:]
            t0 = time.perf_counter()
            if engine == "diffusion":
                out = lm.generate([prompt], max_new_tokens=args.max_new_tokens, seed=args.seed + i)
            else:
                out = lm.generate_ar([prompt], max_new_tokens=args.max_new_tokens)
            seconds += time.perf_counter() - t0
            text = out.texts[0]
            good = parses(header, cut_body(text, indent_of(header)))
            ok += good
            new += int(out.num_new_tokens[0])
            passes += int(out.forward_passes[0])
            if len(examples) < 3:
                examples.append({"prefix_tail": prefix[-120:], "completion": text[:300], "parses": good})
        result[engine] = {"parseable": ok / max(1, len(funcs)), "tokens_per_forward": new / max(1, passes),
                          "tok_s": new / max(seconds, 1e-9), "examples": examples}

    cases = infill_cases(funcs, tok, lm.config.canvas_length, args.infills, args.seed)
    hits_diff = hits_ar = 0
    for i, (before, target, hole, suffix) in enumerate(cases):
        prompt = tok.encode(before, add_bos=True)[-256:]
        out = lm.infill([-1] * len(hole) + suffix, prompt=[prompt], seed=args.seed + i)
        got = tok.decode(out.new_tokens[0, : len(hole)].tolist())
        hits_diff += got.strip() == target.strip()
        ar = lm.generate_ar([prompt], max_new_tokens=len(hole))
        hits_ar += tok.decode(ar.new_tokens[0].tolist()).split("\n")[0].strip() == target.strip()
    result["infill_cases"] = len(cases)
    result["diffusion"]["infill_exact"] = hits_diff / max(1, len(cases))
    result["ar"]["infill_exact"] = hits_ar / max(1, len(cases))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
