"""Where fp8's tests can run on a CPU: torch._scaled_mm has a CPU kernel from torch 2.8 on. The torch 2.6 and 2.7
that pyproject allows have none, and blockpress refuses quantize='fp8' on a CPU there by name (check_runs, which
tests/test_quantize.py covers), so the tests that run fp8 on a CPU skip there; on 2.8+ (CI's 2.13) they run, and
fail if fp8 does not. Decided by the version, not by trying fp8: a broken fp8 path must fail, not skip."""

import pytest
import torch
from torch.torch_version import TorchVersion

FP8_ON_CPU = TorchVersion(torch.__version__) >= (2, 8)
needs_fp8 = pytest.mark.skipif(not FP8_ON_CPU, reason="torch < 2.8 has no CPU kernel for torch._scaled_mm (fp8)")
FP8 = pytest.param("fp8", marks=needs_fp8)  # for a parametrize list of schemes
SCHEMES = ("int8", "fp8", "int4") if FP8_ON_CPU else ("int8", "int4")  # the schemes that run on this CPU
