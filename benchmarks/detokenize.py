"""What the text of a long reply costs, read at each commit: all its tokens decoded again at each one (as the engine's
texts so far, the server's and `blockpress chat`'s text with special tokens were), against a TextStream that decodes
what the new tokens add (what they do now).

The reply is --tokens tokens of stdlib Python source in the shipped blockpress-code tokenizer, with Gemma 4's thought
and turn markers around it as special tokens, read in commits of --commit-tokens tokens (a canvas). Both must give
the same text at every commit (checked). Prints JSON: per way of decoding (special tokens dropped, as the texts so
far; kept, as the text a response template reads), the seconds each took in all (the best of --repeats) and their
ratio; and the seconds of one encode and decode of the whole reply's text (`plain` in chat and the server: once a
reply, where it read a thought).

    python benchmarks/detokenize.py --tokens 8000 --commit-tokens 256
"""

from __future__ import annotations

import argparse
import inspect
import json

from benchmark_args import Formatter, best_seconds, positive_int

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
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs of each; the fastest counts")
    return ap


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
                    raise SystemExit(f"the stream's texts differ from the whole decodes ({tokens} tokens, commits of "
                                     f"{step}, skip_special_tokens={skip})")
                rows.append({"tokens": len(ids), "commit_tokens": step, "commits": len(ends),
                             "special_tokens": "dropped" if skip else "kept", "whole_s": round(seconds["whole"], 4),
                             "stream_s": round(seconds["stream"], 4),
                             "speedup": round(seconds["whole"] / seconds["stream"], 1)})
        raw = tok.decode(ids, skip_special_tokens=False)
        best = best_seconds(lambda raw=raw: tok.decode(tok.encode(raw)), args.repeats)
        rows.append({"tokens": len(ids), "plain_round_trip_s": round(best, 4)})
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
