"""Small behaviours of the cache, the sampler, generate, the prefix cache and the signal guard that no other test
checks: each one a rule the code documents (or an invariant, such as a batch row computing what it computes alone)
that a plausible one-token slip in the code would break without failing the rest of the suite."""

import signal
import threading

import pytest
import torch

import blockpress
from blockpress import PrefixCache
from blockpress.prefix import encode_prompts
from blockpress.sampling import SamplerConfig, top_filter, topk_count
from blockpress.stopping import stop_signals_interrupt


@pytest.fixture(scope="module")
def lm():
    return blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)


# --- KVCache.truncate ---------------------------------------------------------------------------------------------


def test_truncate_stays_refused_after_a_later_turn_moves_only_later_slots(lm):
    """A slot count names the conversation's start only while no slot up to it has moved. The first continued turn
    compacts the rows from slot 0 on; a second turn that moves only later slots does not put slots 0 and 1 back, so
    truncate(2) must still be refused: the cache has to remember the first slot that ever moved, not the last move's
    first slot, or truncate would hand back slots that hold another token's keys."""
    cache = lm.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=8, seed=1, eos_token_id=[], return_cache=True).cache
    # unequal prompts: each row's history is compacted so its padding stays on the left
    lm.generate([[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [21]], cache=cache, max_new_tokens=8, seed=2,
                eos_token_id=[])
    with pytest.raises(ValueError, match="moved since they were encoded"):
        cache.truncate(2)
    lm.generate([[22, 23], [24, 25, 26, 27, 28, 29, 30, 31, 32]], cache=cache, max_new_tokens=8, seed=3,
                eos_token_id=[])
    with pytest.raises(ValueError, match="moved since they were encoded"):
        cache.truncate(2)


def test_truncate_past_what_is_encoded_is_refused(lm):
    """truncate(n) keeps the first n encoded slots, so n must be in [0, length]: a count past the length (within
    the capacity) would turn unencoded slots into conversation that the next turn attends to."""
    cache = lm.generate([[5, 6, 7]], max_new_tokens=8, seed=1, eos_token_id=[], return_cache=True).cache
    length, counts = cache.length, cache.next_pos.tolist()
    assert cache.capacity >= length + 5  # the count asked for fits the buffers: only the length refuses it
    with pytest.raises(ValueError, match=rf"length must be in \[0, {length}\], got {length + 5}"):
        cache.truncate(length + 5)
    assert cache.length == length and cache.next_pos.tolist() == counts


def test_truncate_to_the_current_length_is_a_no_op_even_after_slots_moved(lm):
    """Truncating to the length the cache already has forgets nothing, so it is a no-op, also after a batch's
    continuation compacted its rows (where any shorter slot count is refused): code that trims "to where we are"
    must not fail just because the batch once moved."""
    cache = lm.generate([[5, 6, 7], [8, 9]], max_new_tokens=[3, 9], seed=1, eos_token_id=[], return_cache=True).cache
    lm.generate([[11, 12, 13, 14], [15]], cache=cache, max_new_tokens=[9, 2], seed=2, eos_token_id=[])
    with pytest.raises(ValueError, match="moved"):  # slots did move: a shorter count is refused
        cache.truncate(cache.length - 1)
    length, counts = cache.length, cache.next_pos.tolist()
    cache.truncate(length)
    assert cache.length == length and cache.next_pos.tolist() == counts


def test_weights_changed_while_the_batch_runs_on_fewer_rows_is_still_refused(lm):
    """Once rows end, decoding goes on with a smaller cache holding only the working rows; that cache must carry
    the weights' version, so a weights change mid-call (lm.to, quantize, a training step: model.weights_changed())
    is still refused rather than decoding on keys the old weights computed."""
    model = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    one_row_steps = []

    def meddle(logits, rows):
        if rows.numel() == 1:  # rows 0-2 ended with the first canvas; row 3 goes on alone
            one_row_steps.append(1)
            if len(one_row_steps) == 5:  # the first step of its last canvas (4 steps a canvas)
                model.model.weights_changed()
        return logits

    with pytest.raises(RuntimeError, match="weights changed"):
        model.generate([[5, 6]] * 4, max_new_tokens=[8, 8, 8, 24], max_denoising_steps=4, seed=0, eos_token_id=[],
                       logits_processor=meddle, adaptive_stopping=False)
    assert len(one_row_steps) == 5


# --- sampling ------------------------------------------------------------------------------------------------------


def test_topk_ramp_counts_a_partial_last_canvas_by_its_own_holes(lm):
    """The topk sampler accepts topk_count(step) of the positions it may fill: a linear ramp to all of them at the
    last step. A template whose last canvas is partial (its tail past the template is pinned, not scored) has the
    same 4 holes as the first canvas, so both canvases accept 1, 2, 3, 4 of them over 4 steps, not all at once."""
    steps = 4
    template = [[3, 4, -1, -1, -1, -1, 5, 6, -1, -1, -1, -1]]  # canvas_length 8: 4 holes in each canvas
    assert lm.model.config.canvas_length == 8
    cfg = SamplerConfig(sampler="topk", max_denoising_steps=steps)
    ramp = [topk_count(cfg, step, 4) for step in range(steps, 0, -1)]
    assert ramp == [1, 2, 3, 4]
    accepted: dict[int, list[int]] = {}
    for ev in lm.stream([[2]], template=template, sampler="topk", max_denoising_steps=steps, adaptive_stopping=False,
                        seed=0):
        if ev.kind == "draft":
            accepted.setdefault(ev.canvas_index, []).append(int(ev.accepted[0]))
    assert accepted == {0: ramp, 1: ramp}


def test_per_row_top_k_one_beside_a_row_without_limit(lm):
    """top_k is per row: a row at top_k=1 keeps only its argmax token even beside a row whose top_k reaches the
    vocabulary (which keeps every token), and each row of such a batch computes exactly what it computes alone."""
    v = lm.model.config.text.vocab_size
    probs = torch.softmax(torch.randn(2, v, generator=torch.Generator().manual_seed(0)), -1)
    kept = top_filter(probs, top_k=torch.tensor([1, v + 5])) > 0
    assert kept.sum(-1).tolist() == [1, v]
    assert int(kept[0].nonzero()) == int(probs[0].argmax())

    kw = dict(max_new_tokens=8, max_denoising_steps=6, eos_token_id=[])
    batch = lm.generate([[5, 6, 7]] * 2, top_k=[1, 10**6], seeds=[3, 4], **kw).new_tokens
    alone_k1 = lm.generate([[5, 6, 7]], top_k=1, seeds=[3], **kw).new_tokens
    alone_all = lm.generate([[5, 6, 7]], top_k=10**6, seeds=[4], **kw).new_tokens
    assert torch.equal(batch[0], alone_k1[0])
    assert torch.equal(batch[1], alone_all[0])


@pytest.mark.parametrize("probs, top_p, kept", [
    ([0.5, 0.5, 0.0, 0.0], 0.5, [0]),  # an exact two-way tie: the first (by token id) alone reaches 0.5
    ([0.25] * 4, 0.25, [0]),
    ([0.25] * 4, 0.5, [0, 1]),
    ([0.25] * 4, 0.75, [0, 1, 2]),
])
def test_nucleus_keeps_the_fewest_tokens_that_reach_top_p(probs, top_p, kept):
    """top_p keeps the fewest most likely tokens whose probability reaches top_p (as transformers' and vLLM's), ties
    ranked by token id: on an exact boundary the token that brings the sum to top_p is the last one kept, and the
    next one goes. (All numbers here are exact in binary, so no rounding decides.)"""
    out = top_filter(torch.tensor([probs]), top_p=top_p)
    assert out[0].nonzero()[:, 0].tolist() == kept


def test_noise_token_id_zero_is_absorbing_noise(lm):
    """noise_token_id is an id (>= 0: the model's one noise token; -1 or None: uniform noise), and 0 is an id like
    any other: a canvas starts as all 0s, not as uniform random tokens."""
    drafts = []

    def spy(draft, settled):
        drafts.append((draft.clone(), settled.clone()))
        return torch.zeros(1, 1, 1, dtype=torch.bool)

    lm.generate([5, 6, 7], max_new_tokens=8, max_denoising_steps=2, noise_token_id=0, seed=0, constraint=spy,
                eos_token_id=[])
    draft, settled = drafts[0]
    assert not settled.any()  # the first step: nothing accepted yet, the whole draft is noise
    assert draft.tolist() == [[0] * 8]


def test_a_canvas_is_not_stable_at_its_first_step(lm):
    """Adaptive stopping ends a canvas once its argmax has held for stability_threshold steps (1 by default) while
    confident. The first step has no earlier prediction to agree with (the reference's history starts empty), so a
    canvas whose first prediction equals its absorbing noise must still take a second step, and stop there."""
    noise = 7

    def sure_of_noise(logits, rows):  # the model predicts the noise token everywhere, with near-zero entropy
        out = torch.full_like(logits, -30.0)
        out[..., noise] = 30.0
        return out

    out = lm.generate([5, 6, 8], max_new_tokens=8, max_denoising_steps=10, noise_token_id=noise, seed=0,
                      logits_processor=sure_of_noise, eos_token_id=[], adaptive_stopping=True, stability_threshold=1)
    assert out.steps_per_canvas.tolist() == [[2]]


def test_top_level_entropy_bound_wins_over_sampler_config():
    """A generation_config may carry both blockpress's top-level entropy_bound and the reference's
    sampler_config.entropy_bound; blockpress's own key is the newer word and wins, the reference's is read only
    when the top-level one is absent."""
    both = {"entropy_bound": 0.3, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1}}
    assert SamplerConfig.from_generation_config(both).entropy_bound == 0.3
    only_reference = {"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1}}
    assert SamplerConfig.from_generation_config(only_reference).entropy_bound == 0.1


# --- generate ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [3, 5])
def test_min_new_tokens_bans_eos_for_exactly_that_many_tokens(lm, m):
    """min_new_tokens=m bans EOS for the first m new tokens only (as transformers' min_new_tokens): a model that
    wants EOS everywhere writes m other tokens and then its EOS, m + 1 new tokens in all."""
    eos = 1

    def wants_eos(logits, rows):
        out = logits.clone()
        out[..., eos] = 50.0
        return out

    out = lm.generate([5, 6, 7], max_new_tokens=16, min_new_tokens=m, eos_token_id=[eos], logits_processor=wants_eos,
                      seed=0)
    assert out.num_new_tokens.tolist() == [m + 1]
    tokens = out.new_tokens[0, : m + 1].tolist()
    assert eos not in tokens[:m] and tokens[m] == eos


# --- prefix cache --------------------------------------------------------------------------------------------------


def test_a_prompt_branching_off_a_kept_one_does_not_evict_it(lm):
    """Two conversations that share a system prompt and then branch are both kept: a new entry replaces a kept one
    only when that one is a prefix of it. Re-sending the first then reuses all of it but its last token (which is
    always encoded, for its logits)."""
    pc = PrefixCache(min_tokens=4)
    base = list(range(5, 25))
    a, b = base + [40] * 6, base + [60] * 6
    with torch.no_grad():
        for p in (a, b):
            encode_prompts(lm.model, torch.tensor([p]), None, pc, 40)
        assert sorted(e.ids.tolist() for e in pc._entries.values()) == sorted([a, b])
        _, _, reused = encode_prompts(lm.model, torch.tensor([a]), None, pc, 40)
    assert reused == [len(a) - 1]


def test_a_prompt_that_is_a_prefix_of_a_kept_one_adds_no_entry(lm):
    """An entry serves every prefix of itself, so a prompt that is a prefix of a kept prompt needs no entry of its
    own: one would only spend the cache's byte budget on keys it already holds. Exactly min_tokens long, the prompt
    is encoded afresh (it could reuse all but its last token, one short of min_tokens), and must still add nothing."""
    pc = PrefixCache(min_tokens=8)
    long = list(range(5, 35))
    with torch.no_grad():
        encode_prompts(lm.model, torch.tensor([long]), None, pc, 40)
        nbytes = pc.nbytes
        _, _, reused = encode_prompts(lm.model, torch.tensor([long[:8]]), None, pc, 40)
    assert reused == [0]  # 8 - 1 tokens reusable: under min_tokens
    assert [e.ids.tolist() for e in pc._entries.values()] == [long]
    assert pc.nbytes == nbytes


# --- stopping ------------------------------------------------------------------------------------------------------


def test_stop_signals_interrupt_in_a_worker_thread_changes_nothing():
    """Only the main thread can take signals: stop_signals_interrupt() in a worker thread (a CLI command run from a
    thread pool, say) must run its body and leave the handlers alone, not raise signal.signal's ValueError."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    result = []

    def work():
        try:
            with stop_signals_interrupt():
                result.append("ran")
        except Exception as e:  # reported to the main thread's assert
            result.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert result == ["ran"]
    assert {s: signal.getsignal(s) for s in before} == before
