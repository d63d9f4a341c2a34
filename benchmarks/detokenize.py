"""What the text of a long reply costs, read at each commit: all its tokens decoded again at each one (as the engine's
texts so far, the server's and `blockpress chat`'s text with special tokens were), against a TextStream that decodes
what the new tokens add (what they do now).

The reply is --tokens tokens of stdlib Python source in the shipped blockpress-code tokenizer, with Gemma 4's thought
and turn markers around it as special tokens, read in commits of --commit-tokens tokens (a canvas). Both must give
the same text at every commit (checked). Prints JSON: per way of decoding (special tokens dropped, as the texts so
far; kept, as the text a response template reads), the seconds each took in all (the best of --repeats) and their
ratio; and the seconds of one encode and decode of the whole reply's text (`plain` in chat and the server: once a
reply, where it read a thought).

A template row (lm.infill, generate's template=) of the same tokens, a hole of --hole-tokens every --hole-every, is
read in commits of --template-commit-tokens: its text and fills at each commit, decoded whole (decode_rows and
hole_fills, as the engine did) against a TemplateRowText (what it does now); both must give the same text and fills
at every commit (checked).

    python benchmarks/detokenize.py --tokens 8000 --commit-tokens 256
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch
from benchmark_args import Formatter, best_seconds, fail, positive_int

from blockpress.generate import TemplateRowText, decode_rows, hole_fills
from blockpress.lm import MODELS_DIR
from blockpress.tokenizer import TextStream, Tokenizer


def reply_ids(tok: Tokenizer, tokens: int) -> list[int]:
    """`tokens` ids of a reply: a thought, then Python source, then the end of the turn (special tokens added to
    the tokenizer for it, as Gemma 4's are special)."""
    import argparse as source_a
    import json.decoder as source_b
    import textwrap as source_c

    text = "".join(inspect.getsource(module) for module in (source_a, source_b, source_c))
    body = tok.encode(text)
    while len(body) < tokens:
        body += body
    marker = {name: tok.token_to_id(name) for name in ("<|channel>", "<channel|>", "<turn|>")}
    ids = [marker["<|channel>"], *body[: tokens // 8], marker["<channel|>"], *body[tokens // 8 :]]
    return ids[: tokens - 1] + [marker["<turn|>"]]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=[8000], help="reply lengths, in tokens")
    ap.add_argument("--commit-tokens", type=positive_int, nargs="+", default=[256, 8],
                    help="tokens a commit (a canvas) adds")
    ap.add_argument("--template-commit-tokens", type=positive_int, nargs="+", default=[256],
                    help="tokens a commit adds to the template row (decoded whole, commits of 32 at 8,000 tokens "
                         "take a minute)")
    ap.add_argument("--hole-every", type=positive_int, default=64, help="a template row's tokens from one hole to the next")
    ap.add_argument("--hole-tokens", type=positive_int, default=16, help="a template row's tokens a hole")
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs of each; the fastest counts")
    return ap


def template_rows(tok: Tokenizer, ids: list[int], args: argparse.Namespace) -> list[dict]:
    """A template row of `ids` (a hole of --hole-tokens every --hole-every tokens, its fixed special tokens kept)
    read at each commit, whole and decoded on: the seconds of each, per commit size."""
    fixed = [-1 if p % args.hole_every < args.hole_tokens else t for p, t in enumerate(ids)]
    spans = [(p, min(p + args.hole_tokens, len(ids))) for p in range(0, len(ids), args.hole_every)]
    template = torch.tensor([fixed])
    rows = []
    for step in args.template_commit_tokens:
        ends = list(range(step, len(ids), step)) + [len(ids)]

        def whole(ends: list[int] = ends) -> list[tuple[str, list[str]]]:
            return [(decode_rows(tok, [ids[:end]], template)[0], hole_fills(tok, [ids[:end]], [spans], {}, template)[0])
                    for end in ends]

        def stream(ends: list[int] = ends) -> list[tuple[str, list[str]]]:
            texts = TemplateRowText(tok, fixed, spans, {})
            return [(texts.text(ids[:end]), texts.fills(ids[:end])) for end in ends]

        seconds = {name: best_seconds(run, args.repeats) for name, run in (("whole", whole), ("stream", stream))}
        if whole() != stream():
            fail(f"the template row's texts or fills differ from the whole decodes ({len(ids)} tokens, "
                 f"commits of {step})", 1)
        rows.append({"template_tokens": len(ids), "holes": len(spans), "commit_tokens": step, "commits": len(ends),
                     "whole_s": round(seconds["whole"], 4), "stream_s": round(seconds["stream"], 4),
                     "speedup": round(seconds["whole"] / seconds["stream"], 1)})
    return rows


def main() -> None:
    args = build_parser().parse_args()
    tok = Tokenizer.from_dir(MODELS_DIR / "blockpress-code")
    tok.backend.add_special_tokens(["<|channel>", "<channel|>", "<turn|>"])
    rows = []
    for tokens in args.tokens:
        ids = reply_ids(tok, tokens)
        for step in args.commit_tokens:
            ends = list(range(step, len(ids), step)) + [len(ids)]
            for skip in (True, False):

                def whole(skip: bool = skip, ends: list[int] = ends, ids: list[int] = ids) -> list[str]:
                    return [tok.decode(ids[:end], skip_special_tokens=skip) for end in ends]

                def stream(skip: bool = skip, ends: list[int] = ends, ids: list[int] = ids) -> list[str]:
                    texts = TextStream(tok, skip_special_tokens=skip)
                    return [texts.text(ids[:end]) for end in ends]

                seconds = {name: best_seconds(run, args.repeats) for name, run in (("whole", whole), ("stream", stream))}
                if whole() != stream():
                    fail(f"the stream's texts differ from the whole decodes ({tokens} tokens, commits of "
                         f"{step}, skip_special_tokens={skip})", 1)
                rows.append({"tokens": len(ids), "commit_tokens": step, "commits": len(ends),
                             "special_tokens": "dropped" if skip else "kept", "whole_s": round(seconds["whole"], 4),
                             "stream_s": round(seconds["stream"], 4),
                             "speedup": round(seconds["whole"] / seconds["stream"], 1)})
        raw = tok.decode(ids, skip_special_tokens=False)
        best = best_seconds(lambda raw=raw: tok.decode(tok.encode(raw)), args.repeats)
        rows.append({"tokens": len(ids), "plain_round_trip_s": round(best, 4)})
        rows += template_rows(tok, ids, args)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
