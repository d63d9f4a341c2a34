r"""What reading a streamed chat reply costs the server: its reply read with a response template at each chunk (Gemma
4's built-in one; Qwen 3.5's, whose markers are patterns that may start with whitespace, `\s*<tool_call>`), whole
every time (parse_partial, as the server read it before PartialReader) and read on from the last read
(PartialReader, what the server does now); and all the server does with each chunk (ToolStream.settle: the read,
the deltas, the plain text compared until a thought shows).

Replies of random words of about --chars-per-token characters a token, in chunks of --chunk-tokens tokens (a
canvas committed), of each kind: plain text; a thought, then the answer; a thought, the answer and a tool call.
Both readers must give the same settled message at every chunk (checked). Prints JSON: per template, length and
kind, the seconds each took in all (the best of --repeats), their ratio, and the seconds of settle.

    python benchmarks/stream_parse.py --tokens 2000 8000
"""

from __future__ import annotations

import argparse
import json
import random
import time

from benchmark_args import Formatter, best_seconds, fail, positive_int

from blockpress.response import (
    GEMMA4_MARKERS,
    PartialReader,
    PatternBudget,
    ResponseTemplate,
    compile_template,
    gemma4_response_template,
    parse_partial,
    parse_response,
)
from blockpress.serve import JobText, Reply, ToolStream

WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()
# Qwen 3.5's response template (as tests/test_response.py's QWEN35): calls as <function=NAME> with <parameter=KEY>
# tags, its markers patterns that take the whitespace before them
QWEN35 = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
            "close_pattern": r"</function>\s*</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                             "merge_duplicates": True},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)"},
    },
}
# Per template: its spec, the prompt a reply answers, the reply's parts (a thought's open and close, a call, the end
# of the turn) and the special tokens that its plain text (decode's) leaves out.
TEMPLATES = {
    "gemma4": (gemma4_response_template(), "<|turn>user\nWhat is the weather in Oslo?<turn|>\n<|turn>model\n",
               ("<|channel>thought\n", "<channel|>", '<|tool_call>call:weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>',
                "<turn|>"), (*GEMMA4_MARKERS, '<|"|>')),
    "qwen3.5": (QWEN35, "<|im_start|>user\nWhat is the weather in Oslo?<|im_end|>\n<|im_start|>assistant\n",
                ("<think>\n", "\n</think>\n\n", "\n<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n"
                 "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "<|im_end|>"),
                ("<|im_end|>",)),
}


def words(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        word = rng.choice(WORDS) + rng.choice([" ", " ", " ", ", ", ".\n"])
        out.append(word)
        n += len(word)
    return "".join(out)[:chars]


def reply(kind: str, chars: int, rng: random.Random, parts: tuple[str, str, str, str]) -> str:
    opens, closes, call, end = parts
    if kind == "plain":
        return words(rng, chars) + end
    thought = f"{opens}{words(rng, chars // 2)}{closes}"
    return thought + words(rng, chars - chars // 2) + (call if kind == "thought+call" else "") + end


def settle_all(template: ResponseTemplate, prefix: str, text: str, ends: list[int], special: tuple[str, ...]) -> dict:
    """The server's chunks of a streamed reply (ToolStream.settle), each chunk's plain text as decode gives it
    (`special` tokens left out); returns what was sent."""

    def plain(raw: str) -> str:
        for token in special:
            raw = raw.replace(token, "")
        return raw

    budget = PatternBudget(seconds=1e9, total=1e9)
    reply = Reply([], "chat", "bench", 1, parse=lambda raw: parse_response(template, raw, prefix),
                  read_partial=lambda: PartialReader(template, prefix, budget=budget))
    stream = ToolStream()
    items = [JobText(plain(text[:end]), text[:end]) for end in ends]
    start = time.perf_counter()
    for item in items:
        stream.settle(reply, item, [])
    return {"seconds": time.perf_counter() - start, "sent": (stream.reasoning, stream.content, len(stream.calls))}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--template", nargs="+", choices=sorted(TEMPLATES), default=sorted(TEMPLATES),
                    help="response templates to read with")
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=[2000, 8000], help="reply lengths, in tokens")
    ap.add_argument("--chars-per-token", type=positive_int, default=4, help="characters a token writes")
    ap.add_argument("--chunk-tokens", type=positive_int, default=8, help="tokens a chunk (a canvas) adds")
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs of each; the fastest counts")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    rows = []
    for name in args.template:
        spec, prefix, parts, special = TEMPLATES[name]
        template = compile_template(spec)
        for tokens in args.tokens:
            for kind in ("plain", "thought", "thought+call"):
                text = reply(kind, tokens * args.chars_per_token, random.Random(tokens), parts)
                step = args.chunk_tokens * args.chars_per_token
                ends = list(range(step, len(text), step)) + [len(text)]

                def whole(text: str = text, ends: list[int] = ends, template: ResponseTemplate = template,
                          prefix: str = prefix) -> list:
                    budget = PatternBudget(seconds=1e9, total=1e9)
                    return [parse_partial(template, text[:end], prefix, budget=budget) for end in ends]

                def read_on(text: str = text, ends: list[int] = ends, template: ResponseTemplate = template,
                            prefix: str = prefix) -> list:
                    reader = PartialReader(template, prefix, budget=PatternBudget(seconds=1e9, total=1e9))
                    return [reader.read(text[:end]) for end in ends]

                seconds = {way: best_seconds(run, args.repeats) for way, run in (("whole", whole), ("read_on", read_on))}
                if whole() != read_on():
                    fail(f"the readers differ on a {kind} reply of {tokens} tokens ({name})", 1)
                settle = min((settle_all(template, prefix, text, ends, special) for _ in range(args.repeats)),
                             key=lambda run: run["seconds"])
                rows.append({"template": name, "resumable": template.resumable, "tokens": tokens, "kind": kind,
                             "chars": len(text), "chunks": len(ends), "whole_s": round(seconds["whole"], 4),
                             "read_on_s": round(seconds["read_on"], 4),
                             "speedup": round(seconds["whole"] / seconds["read_on"], 1),
                             "settle_s": round(settle["seconds"], 4), "calls_sent": settle["sent"][2]})
    print(json.dumps({"chunk_tokens": args.chunk_tokens, "chars_per_token": args.chars_per_token, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
