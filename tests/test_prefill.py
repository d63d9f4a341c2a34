"""Chunked prefill: `encode` in chunks of queries computes exactly what one pass over the prompt computes."""

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import blockpress
from blockpress import KVCache, ModelConfig

VOCAB = 64


@functools.cache
def model(window: int, dtype: torch.dtype = torch.float32) -> blockpress.DiffusionGemma:
    """A tiny model with weights large enough that every layer's attention moves the logits."""
    m = blockpress.random_model(ModelConfig.tiny(vocab_size=VOCAB, sliding_window=window), seed=window).model
    g = torch.Generator().manual_seed(window)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.to(dtype)


def left_padded(g: torch.Generator, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=g)
    mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    return ids, None if bool(mask.all()) else mask


def encoded(m, before, prompt, mask, logits, chunk_size):
    """A fresh cache holding `before` (one pass), then `prompt` encoded in chunks: (logits, cache)."""
    cache = KVCache.allocate(m.config.text, prompt.shape[0], prompt.shape[1] + (0 if before is None else before[0].shape[1]),
                             m.dtype)
    with torch.no_grad():
        if before is not None:
            m.encode(before[0], cache, attention_mask=before[1])
        out = m.encode(prompt, cache, attention_mask=mask, logits=logits, chunk_size=chunk_size)
    return out, cache


@settings(max_examples=40, deadline=None)
@given(
    window=st.sampled_from([2, 3, 5, 8, 13]),
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    earlier=st.one_of(st.none(), st.lists(st.integers(1, 12), min_size=3, max_size=3)),
    chunk=st.integers(1, 26),
    logits=st.sampled_from(["all", "last", "none"]),
    seed=st.integers(0, 2**16),
)
@example(window=13, lengths=[1, 22], earlier=None, chunk=1, logits="all", seed=1553)
def test_chunked_encode_equals_one_pass(window, lengths, earlier, chunk, logits, seed):
    """Random chunk sizes (one query to the whole prompt), windows smaller and larger than a chunk, left-padded
    batches, and a cache continuing an earlier (padded) encode: the same logits and the same cache.
    In float64: in float32 a chunk's GEMMs round apart from the whole prompt's, by 1.2e-5 on logits of up to 9 in the
    pinned example, past the bound. In float64 that rounding is a billion times finer, and the float32 logits encode
    returns differ by at most their last bit (2e-6 below 32), while a chunk that saw a wrong key, mask or position
    moves them by far more."""
    m = model(window, torch.float64)
    g = torch.Generator().manual_seed(seed)
    prompt, mask = left_padded(g, lengths)
    before = None if earlier is None else left_padded(g, earlier[: len(lengths)])
    one, one_cache = encoded(m, before, prompt, mask, logits, chunk_size=prompt.shape[1])
    many, many_cache = encoded(m, before, prompt, mask, logits, chunk_size=chunk)
    if logits == "none":
        assert one is None and many is None
    else:
        assert many.shape == one.shape
        assert (many - one).abs().max().item() <= 1e-5
    assert many_cache.length == one_cache.length and many_cache.has_padding == one_cache.has_padding
    assert torch.equal(many_cache.valid, one_cache.valid) and torch.equal(many_cache.next_pos, one_cache.next_pos)
    for a, b in zip((*many_cache.keys, *many_cache.values), (*one_cache.keys, *one_cache.values)):
        assert (a - b).abs().max().item() <= 1e-5


def test_the_default_chunk_is_the_models_setting():
    """encode without chunk_size runs `prefill_chunk` queries a pass: as many layer passes as chunks."""
    m = model(5)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    passes = []
    hook = m.layers[0].register_forward_hook(lambda mod, args, out: passes.append(out.shape[1]))
    try:
        m.prefill_chunk = 4
        _, cache = encoded(m, None, prompt, None, "last", chunk_size=None)
    finally:
        m.prefill_chunk = blockpress.model.PREFILL_CHUNK
        hook.remove()
    assert passes == [4, 4, 2] and cache.length == 10


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8"])
def test_a_bad_chunk_size_is_named(bad):
    m = model(5)
    cache = KVCache.allocate(m.config.text, 1, 4)
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"):
        m.encode(torch.zeros(1, 4, dtype=torch.long), cache, chunk_size=bad)
    assert cache.length == 0  # refused before anything was written


def test_a_bad_logits_mode_is_named():
    m = model(5)
    with pytest.raises(ValueError, match='logits: expected "none", "last" or "all"'):
        m.encode(torch.zeros(1, 4, dtype=torch.long), KVCache.allocate(m.config.text, 1, 4), logits="first")
