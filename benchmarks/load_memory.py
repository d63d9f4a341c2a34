"""Memory to load a checkpoint, relative to its size on disk.

Each load runs in a fresh subprocess and reports the growth of its peak resident set size.

    python benchmarks/load_memory.py --preset medium
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import resource, sys, warnings, json
warnings.simplefilter("ignore")
import torch
path = sys.argv[1]
import blockpress
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before_peak, before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss()
lm = blockpress.load(path, quantize=None if sys.argv[2] == "none" else sys.argv[2])
after_load = rss()
# touch every weight: one forward pass (the point where a lazy load has really read the file)
for p in (*lm.model.parameters(), *lm.model.buffers()):
    p.data.float().sum()
after_touch = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
n = lm.weights_bytes()
print(json.dumps({"rss_growth_after_load": after_load - before, "rss_growth_after_touch": after_touch - before,
                  "peak_growth_bytes": peak - max(before_peak, before), "weights_bytes": n}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", choices=["none", "int8", "fp8", "int4"], default="none",
                    help="quantize while loading (the resident weights are then the quantized ones)")
    args = ap.parse_args()
    import blockpress

    lm = blockpress.random_model(blockpress.ModelConfig.preset(args.preset), dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        lm.save(tmp)
        disk = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        del lm
        result = {"benchmark": "load_memory", "preset": args.preset, "dtype": args.dtype, "quantize": args.quantize,
                  "disk_bytes": disk}
        out = subprocess.run([sys.executable, "-c", CHILD, tmp, args.quantize], capture_output=True, text=True,
                             check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["resident_over_disk"] = row["rss_growth_after_touch"] / disk
        # what the weights themselves add once read (the rest is fixed runtime state, independent of size)
        row["weights_resident_over_disk"] = (row["rss_growth_after_touch"] - row["rss_growth_after_load"]) / disk
        row["peak_over_disk"] = row["peak_growth_bytes"] / disk
        result["blockpress"] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
