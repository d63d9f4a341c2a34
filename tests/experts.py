"""Random experts for the quantization tests (tests/test_quantize.py, tests/test_int4_cpu.py)."""

import torch

import blockpress
from blockpress.model import Experts


def noisy_experts(num_experts, dtype, width=16):
    """Experts of the tiny config's hidden size, `width` wide, with `num_experts` experts and N(0, 0.1) weights."""
    plain = Experts(blockpress.ModelConfig.tiny(vocab_size=64, num_experts=num_experts, top_k_experts=1,
                                                moe_intermediate_size=width).text)
    for weight in plain.parameters():  # Experts allocates its weights uninitialised (a checkpoint fills them)
        torch.nn.init.normal_(weight, std=0.1)
    return plain.to(dtype)
