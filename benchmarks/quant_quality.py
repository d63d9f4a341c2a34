"""What each quantization scheme costs a code model in quality, on the held-out stdlib functions of code_model.py.

The model is loaded once per scheme (float32 arithmetic; the unquantized load first, as the reference), and each
load is judged on the same first --functions held-out functions. Figures (JSON), per scheme:
- weights_bytes: the weights the load holds (`lm.weights_bytes()`: codes and scales, and the embedding and norms,
  which stay float32).
- logits: each function's prompt (its source up to the `def` line, as code_model.py builds it) and one canvas,
  `clean` (its true continuation: the newline and the body, eos after a body shorter than a canvas; no position
  noised) and `masked` (every position the model's noise token, the first denoising step's input; null for a
  model trained with uniform noise). Against the unquantized model's denoiser logits at every canvas position:
  `top1_agreement` (the same argmax), `mean_kl` (KL(unquantized || quantized) of the softmaxes, nats, mean over
  positions) and `max_abs_diff` (the largest |logit difference|).
- diffusion: code_model.py's end-to-end figures at the model's default settings, seeded as there (function i:
  --seed + i): `parseable`, `parseable_without_loops`, `tokens_per_forward`, `tok_s`; and `same_text`, the
  fraction of completions identical to the unquantized model's.

    python benchmarks/quant_quality.py --model blockpress-code --functions 100
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from benchmark_args import Formatter, checkpoint, positive_int, progress
from code_model import SPLIT_SEED, completion_figures, exit_if_past_context, function_prompt

import blockpress
from blockpress.config import SCHEMES
from blockpress.tasks.code import Function, model_heldout_functions


def clean_canvas(lm: blockpress.LM, function: Function) -> list[int]:
    """One canvas of the function's true continuation: the newline its prompt leaves out (the model writes it with
    the body's indentation) and the body, then eos to the canvas's end, as training fills a canvas after its end."""
    ids = lm.tokenizer.encode("\n" + function.body, add_bos=False)
    canvas, eos = lm.config.canvas_length, lm.eos_ids[0]
    return (ids + [eos] * canvas)[:canvas]


def denoiser_logits(lm: blockpress.LM, funcs: list[Function], masked: bool) -> list[torch.Tensor]:
    """The denoiser's float32 logits [canvas, vocab] on each function's clean canvas after its prompt, or with
    `masked` on a canvas of the noise token alone."""
    noise = lm.sampler_defaults.noise_token_id
    out = []
    with torch.inference_mode():
        for f in progress(funcs, desc=f"{'masked' if masked else 'clean'} canvases", unit="function"):
            canvas = [noise] * lm.config.canvas_length if masked else clean_canvas(lm, f)
            out.append(lm.logits([function_prompt(lm.tokenizer, f)], [canvas])[0])
    return out


def logit_agreement(reference: list[torch.Tensor], quantized: list[torch.Tensor]) -> dict[str, float]:
    """top-1 agreement, mean KL(reference || quantized) in nats and max |logit difference| over every position of
    every canvas (rows of the [canvas, vocab] tensors)."""
    ref, got = torch.cat(reference), torch.cat(quantized)
    ref_logp, got_logp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)
    return {"top1_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "mean_kl": kl.mean().item(), "max_abs_diff": (ref - got).abs().max().item()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--model", type=checkpoint, default="blockpress-code", help="a shipped name or a folder")
    ap.add_argument("--manifest", default=None, help="corpus manifest.json listing held-out modules "
                    "(default: the one shipped with the model)")
    ap.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES),
                    help="the quantizations measured, each against the unquantized load (always measured first)")
    ap.add_argument("--functions", type=positive_int, default=100, help="held-out functions (code_model.py's first)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64, help="new tokens per completion")
    ap.add_argument("--seed", type=int, default=0, help="seeds the sampler (the functions are code_model.py's test "
                    "split, whatever the seed)")
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"benchmark": "quant_quality", "model": args.model, "dtype": "float32"}
    reference: dict[str, list[torch.Tensor]] = {}
    reference_texts: list[str] = []
    schemes = ("none", *dict.fromkeys(args.schemes))  # a scheme named twice is measured once
    for scheme in progress(schemes, desc="schemes", unit="scheme"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = blockpress.load(args.model, dtype="float32", quantize=None if scheme == "none" else scheme)
        if scheme == "none":  # the functions and the context check once, before any scheme's work
            exit_if_past_context(lm, args.max_new_tokens, args.model)
            funcs = model_heldout_functions(lm.path, args.manifest, SPLIT_SEED)[: args.functions]
            result["functions"] = len(funcs)
            # absorbing noise only: uniform noise has no one canvas that is every position noised
            kinds = ("clean", "masked") if lm.sampler_defaults.noise_token_id not in (None, -1) else ("clean",)
        logits = {kind: denoiser_logits(lm, funcs, masked=kind == "masked") for kind in kinds}
        figures, texts = completion_figures(lm, funcs, "diffusion", args.max_new_tokens, args.seed, {})
        if scheme == "none":
            reference, reference_texts = logits, texts
        figures["same_text"] = sum(a == b for a, b in zip(texts, reference_texts)) / max(1, len(funcs))
        del figures["examples"]  # code_model.py shows completions; here the rates are the point
        agreement = {kind: logit_agreement(reference[kind], logits[kind]) if kind in kinds else None
                     for kind in ("clean", "masked")}
        result[scheme] = {"weights_bytes": lm.weights_bytes(), "logits": agreement, "diffusion": figures}
        del lm, logits
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
