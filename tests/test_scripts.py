"""Prepared scripts run end to end on a tiny shape (the GPU runs use the same code)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_gpu_bench_smoke_on_cpu(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--preset", "tiny", "--device", "cpu",
         "--dtype", "float32", "--prompt-length", "12", "--new-tokens", "20", "--steps", "2", "--ar-tokens", "6",
         "--compile-mode", "none", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["diffusion"]["new_tokens"] == 20 and data["diffusion"]["forward_passes"] == 2 * 2
    assert data["ar"]["new_tokens"] == 6
    assert data["diffusion"]["tok_s"] > 0 and data["diffusion_over_ar"] > 0
    assert "diffusion_compiled" not in data and "compile_error" not in data


def test_tune_code_sampler_smoke():
    import blockpress

    if "blockpress-code" not in blockpress.shipped_models():
        import pytest

        pytest.skip("blockpress-code is not in this package")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tune_code_sampler.py"), "--functions", "2", "--batch", "2",
         "--max-new-tokens", "8", "--threads", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    rows, best = lines[:-1], lines[-1]["best"]
    assert len(rows) >= 2 and all(0 <= x["parseable"] <= 1 and x["tokens_per_forward"] > 0 for x in rows)
    assert best["parseable"] == max(x["parseable"] for x in rows)
