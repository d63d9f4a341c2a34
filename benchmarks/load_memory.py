"""Memory to load a checkpoint, relative to its size on disk.

Each load runs in a fresh subprocess. Its figures are growths of that process's resident set size over its size
just before the load, taken once torch, blockpress and the loading path's own lazy imports are in (those are the
runtime's, whatever the checkpoint): `rss_growth_after_load`, `rss_growth_after_touch` (every weight read once)
and `peak_growth_bytes`, the child's own peak. A process inherits its parent's peak across fork and exec, so the
peak is reset in the child (VmHWM, via /proc/self/clear_refs; where that fails, the resident size is sampled
every millisecond, a lower bound; `peak_from` says which). The *_over_disk ratios divide by the safetensors bytes:
`weights_over_disk` is the weights the model holds (`weights_bytes`: the quantized ones under --quantize), and
`read_growth_over_disk` what reading every weight adds after `load` returned (a plain load's mapped weights; a
quantized load has read and converted them already).

    python benchmarks/load_memory.py --preset medium
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmark_args import (
    PRESET_HELP,
    Formatter,
    fail,
    measure_in_child,
    preset_name,
    preset_weights_that_cannot_fit,
)

PAGE_STEP = 1 << 20  # slack when checking that a reset peak is back at the current size


def status(field: str) -> int:
    """Bytes of a size line ("VmRSS", "VmHWM") of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field} line")


def reset_peak() -> bool:
    """Set this process's peak resident size (VmHWM) to its current size: writing 5 to clear_refs (Linux 4.0+).
    False where that is not possible, or did not take."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status("VmHWM") <= status("VmRSS") + PAGE_STEP
    except OSError:
        return False


class RssSampler:
    """The most resident memory seen, sampled every `interval` s by a thread: a lower bound on the peak."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.peak, self.done = interval, status("VmRSS"), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.interval):
            self.peak = max(self.peak, status("VmRSS"))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, status("VmRSS"))


def measure_load(path: str, quantize: str | None) -> dict[str, Any]:
    """Load the checkpoint at `path` in this process and report its memory growth (see the module's docstring)."""
    import warnings

    warnings.simplefilter("ignore")
    import blockpress
    import blockpress.quantize  # noqa: F401  (imported by a quantized load)

    # A model built on the meta device runs the loading path's code once: its first run imports ~80 MB of torch
    # modules (sympy among them), which belong in the baseline.
    blockpress.random_model(blockpress.ModelConfig.preset("tiny"), device="meta")
    exact = reset_peak()
    sampler = None if exact else RssSampler()
    before = status("VmRSS")
    lm = blockpress.load(path, quantize=quantize)
    after_load = status("VmRSS")
    # touch every weight: the point where a lazy load has really read the file
    for p in (*lm.model.parameters(), *lm.model.buffers()):
        p.data.float().sum()
    after_touch = status("VmRSS")
    # (a sampled peak can miss the reading just taken: the touch's temporaries are freed by the time it stops)
    peak = status("VmHWM") if sampler is None else max(sampler.stop(), after_load, after_touch)
    return {"rss_growth_after_load": after_load - before, "rss_growth_after_touch": after_touch - before,
            "peak_growth_bytes": peak - before, "weights_bytes": lm.weights_bytes(),
            "peak_from": "VmHWM, reset in the child" if exact else "VmRSS sampled every 1 ms (a lower bound)"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--preset", type=preset_name, default="medium",
                    help=PRESET_HELP)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype the checkpoint is saved in")
    ap.add_argument("--quantize", choices=["none", "int8", "fp8", "int4"], default="none",
                    help="quantize while loading (the resident weights are then the quantized ones)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the measuring process: load this folder
    return ap


def main() -> None:
    args = build_parser().parse_args()
    scheme = None if args.quantize == "none" else args.quantize
    if args.child is not None:
        print(json.dumps(measure_load(args.child, scheme)))
        return
    if (why := preset_weights_that_cannot_fit(args.preset, args.dtype, "--preset/--dtype")) is not None:
        fail(why)
    import blockpress

    lm = blockpress.random_model(blockpress.ModelConfig.preset(args.preset), dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        lm.save(tmp)
        disk = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        del lm
        result = {"benchmark": "load_memory", "preset": args.preset, "dtype": args.dtype, "quantize": args.quantize,
                  "disk_bytes": disk}
        row = measure_in_child([sys.executable, __file__, "--child", tmp, "--quantize", args.quantize],
                               "the loading process")  # (a stop: the folder is removed on the way out)
        row["resident_over_disk"] = row["rss_growth_after_touch"] / disk
        # What reading every weight adds after `load` returned: a plain load maps the file and reads a weight when it
        # is first used, so this is its weights; a quantized load has already read and converted them (~0 here).
        row["read_growth_over_disk"] = (row["rss_growth_after_touch"] - row["rss_growth_after_load"]) / disk
        # the weights the model holds (the quantized ones under --quantize), whenever they were read
        row["weights_over_disk"] = row["weights_bytes"] / disk
        row["peak_over_disk"] = row["peak_growth_bytes"] / disk
        result["blockpress"] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
