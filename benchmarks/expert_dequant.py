"""Time one quantized expert projection three ways, side by side, for a preset's expert shape and a few row counts.

A MoE layer's experts take the tokens' rows sorted by expert (a token's top-k slots each a row). Where the quantized
experts cannot sync with the host (int4 on a GPU, int8 inside a CUDA graph) they dequantize on the device:
- `all`: every expert's weight at once, then one grouped GEMM (what such experts did for any row count);
- `per_row`: one expert's weight per row (what they do now for fewer rows than experts, an AR step's 8 of the
  26B-A4B's 128); not timed where the rows are as many as the experts or more, which dequantize all at once;
- `loop`: the experts with rows one at a time, one host sync a layer (what a CPU and a GPU's int8 / fp8 outside a CUDA
  graph do; int4 in bf16 on a CPU multiplies with torch's CPU int4 GEMM there).
Each row of the JSON gives the fewest milliseconds of `--repeats` runs, and ratios to `all`.

    python benchmarks/expert_dequant.py --preset 26b-a4b --rows 8 64 2048 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from typing import Any

from benchmark_args import PRESET_HELP, Formatter, best_seconds, fail, positive_int, preset_name


def measure(preset: str, schemes: list[str], row_counts: list[int], device: str, dtype_name: str, repeats: int,
            seed: int) -> list[dict[str, Any]]:
    """A row of figures per scheme and row count: the gate-up projection of `preset`'s experts (random weights)."""
    import torch

    from blockpress.config import ModelConfig
    from blockpress.model import ExpertRows, Experts
    from blockpress.quantize import CPU_KERNEL_DTYPES, QuantizedExperts

    dtype = getattr(torch, dtype_name)
    text = ModelConfig.preset(preset).text
    torch.manual_seed(seed)
    plain = Experts(text)
    for weight in plain.parameters():  # Experts allocates its weights uninitialised (a checkpoint fills them)
        torch.nn.init.normal_(weight, std=0.02)
    plain = plain.to(dtype)
    synced = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = []
    for scheme in schemes:
        # the stored layout, which `all` and `per_row` read; eval mode, as a loaded model generates
        experts = QuantizedExperts(plain, scheme).to(device).eval()
        looped = experts
        if device == "cpu" and dtype in CPU_KERNEL_DTYPES and scheme == "int4" and experts.fits_cpu_int4():
            looped = copy.deepcopy(experts)
            looped.set_cpu_int4(True)  # as a loaded model holds it: the loop multiplies with torch's CPU int4 GEMM
        for rows in row_counts:
            routed = torch.randint(0, experts.num_experts, (rows,), device=device).sort().values
            offsets = (routed[None, :] <= torch.arange(experts.num_experts, device=device)[:, None]).sum(
                1, dtype=torch.int32)
            x = torch.randn(rows, text.hidden_size, dtype=dtype, device=device)
            engines = ways(x, experts, looped, ExpertRows(offsets))
            row: dict[str, Any] = {"scheme": scheme, "rows": rows, "experts": experts.num_experts,
                                   "shape": [experts.gate_up_proj.shape[1], text.hidden_size], "device": device,
                                   "dtype": dtype_name}
            for name, run in engines.items():
                row[f"{name}_ms"] = None if run is None else round(1e3 * timed(run, synced, repeats), 3)
            for name in ("per_row", "loop"):
                if row[f"{name}_ms"]:
                    row[f"all_over_{name}"] = round(row["all_ms"] / row[f"{name}_ms"], 2)
            results.append(row)
    return results


def ways(x: Any, experts: Any, looped: Any, plan: Any) -> dict[str, Callable[[], object] | None]:
    """The three ways of the module docstring over the same rows (None: not a way such rows take)."""
    from blockpress.model import _grouped_linear
    from blockpress.quantize import _dequantized_per_row, dequantize_weight

    q, scale = experts.gate_up_proj, experts.gate_up_proj_scale
    return {
        "all": lambda: _grouped_linear(x, dequantize_weight(q, scale, x.dtype), plan),
        "per_row": (lambda: _dequantized_per_row(x, q, scale, plan)) if x.shape[0] < experts.num_experts else None,
        "loop": lambda: looped.project(x, "gate_up_proj", plan),
    }


def timed(run: Callable[[], object], synced: Callable[[], object], repeats: int) -> float:
    """The fewest seconds of `repeats` runs of `run`, after one untimed (lazy initialisation stays out of it)."""
    import torch

    with torch.no_grad():
        run()
        return best_seconds(lambda: (run(), synced()), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--preset", type=preset_name, default="26b-a4b", help=PRESET_HELP + " (its experts' shape)")
    ap.add_argument("--schemes", nargs="+", choices=["int4", "int8"], default=["int4", "int8"], help="quantizations")
    ap.add_argument("--rows", nargs="+", type=positive_int, default=[8, 64, 2048],
                    help="routed rows (tokens x top-k): an AR token of the 26B-A4B routes 8, a 256-token canvas 2048")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the experts run")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="activations' dtype")
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs per engine; the fewest ms is kept")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch's CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0, help="weights, routing and inputs")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.preset, args.schemes, args.rows, args.device, args.dtype, args.repeats, args.seed)
    json.dump({"preset": args.preset, "threads": torch.get_num_threads(), "rows": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
