"""Helpers that build tiny random *reference* (transformers) checkpoints. transformers is test-only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _cpu_flash_takes_groups() -> bool:
    """Does torch's CPU flash-attention kernel take grouped key/value heads (enable_gqa)? torch 2.6 to 2.8's does not
    (SDPA then runs its math kernel). Asked of torch's own kernel choice, a private op: if it moves, assume it does."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, False, scale=1.0, enable_gqa=True)
        return choice == torch._fused_sdp_choice(q, q, q, None, 0.0, False, scale=1.0)
    except (AttributeError, RuntimeError, TypeError):
        return True


# Where it does not, the reference gives grouped heads to SDPA's math kernel where it passes no mask and repeated ones
# to the flash kernel where it passes one, while blockpress gives them grouped throughout, so their passes round apart
# in the last bit (up to 2e-5 on the tiny model's logits under torch 2.6), which self-conditioning grows into other
# tokens. Comparisons to the bit need one kernel.
one_attention_kernel = pytest.mark.skipif(not _cpu_flash_takes_groups(), reason="this torch's CPU flash attention "
                                          "takes no grouped heads, so the reference's SDPA kernel differs by pass")

TINY_TEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=6,
    num_experts=4, top_k_experts=2, moe_intermediate_size=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)
TINY_VISION = dict(
    model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8,
)


def make_reference(path: Path, seed: int = 0, canvas_length: int = 8, **text_overrides):
    """Save a tiny random reference checkpoint with perturbed norms/scalars so wiring errors show."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    text = dict(TINY_TEXT, **text_overrides)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION), canvas_length=canvas_length)
    model = perturbed(DiffusionGemmaForBlockDiffusion(cfg).eval(), seed)
    model.save_pretrained(path)
    return model


def perturbed(model, seed: int):
    """`model` (the reference's) with random weights, its norms and scalars moved off 1, so wiring errors show."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm scales, router scale, per-expert scale
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.5, generator=g)
            else:
                p.normal_(0.0, 0.15, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # encoder and decoder scalars differ on purpose
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def fresh_weights(lm):
    """`lm` with its weights copied into fresh allocations, as `make_reference`'s in-memory model holds its own.

    A CPU load keeps the weights as views of the mapped safetensors file, aligned only as the file's layout puts
    them (4 bytes here); MKL's float32 GEMMs (the experts' grouped_mm above all) round the last bit differently for
    a weight that is not 16-byte aligned. For a bit-for-bit comparison both sides need the same alignment; the
    values are unchanged. (transformers' own from_pretrained maps them too, and is just as unaligned.)"""
    with torch.no_grad():
        for tensor in [*lm.model.parameters(), *lm.model.buffers()]:
            tensor.data = tensor.data.clone()
    return lm
