"""Sampler pieces against the reference's on identical inputs, plus properties that hold for all inputs."""

import itertools
import math
from collections import Counter
from dataclasses import asdict, replace

import pytest
import torch
from aten_ops import aten_ops
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blockpress.sampling import (
    MAX_COUNT,
    CanvasRules,
    RowDraws,
    SamplerConfig,
    StepNumbers,
    accept_confidence,
    accept_entropy_bound,
    accept_topk,
    candidate_probs,
    denoise_step,
    entropy,
    hashed_tokens,
    init_state,
    penalize_repeats,
    probs_and_entropy,
    sample,
    take_rows,
    temperature,
    top_filter,
    topk_count,
)

ref_gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")


def logits_from(seed, b=2, c=12, v=17, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(b, c, v, generator=g)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), bound=st.floats(0.01, 5.0), scale=st.floats(0.1, 20.0))
def test_entropy_bound_accept_matches_reference(seed, bound, scale):
    logits = logits_from(seed, scale=scale)
    sampler = ref_gen.EntropyBoundSampler(ref_gen.EntropyBoundSamplerConfig(entropy_bound=bound), 12, 17, 10)
    current = torch.zeros(2, 12, dtype=torch.long)
    denoiser = torch.ones(2, 12, dtype=torch.long)
    accepted = sampler.accept_canvas(current, denoiser, logits, 5)
    ent = entropy(logits)
    ours, theirs = accept_entropy_bound(ent, bound), sampler.accepted_token_mask
    # The same positions, but where two entropies are exactly equal at the acceptance's edge: which of them the
    # bound takes is the sort's tie-break, and blockpress's and the reference's differ (seed=927, bound=1.0,
    # scale=0.1: positions 0 and 8 of row 1 hold the same float32 entropy). Each takes as many, and any position
    # they disagree on holds the entropy of the last one both take in order.
    assert torch.equal(ours.sum(-1), theirs.sum(-1))
    for row in (ours != theirs).nonzero()[:, 0].unique().tolist():
        edge = ent[row][ours[row]].max()
        assert torch.equal(ent[row][ours[row] != theirs[row]], edge.expand(int((ours[row] != theirs[row]).sum())))
        assert edge == ent[row][theirs[row]].max()
    assert torch.equal(torch.where(theirs, denoiser, current), accepted)
    # re-noise positions: exactly the non-accepted ones
    renoised = sampler.renoise_canvas(torch.full((2, 12), -5), 5)
    assert torch.equal(renoised == -5, theirs)


@settings(max_examples=60, deadline=None)
@given(eighths=st.lists(st.lists(st.integers(0, 6), min_size=6, max_size=6), min_size=1, max_size=3),
       bound=st.integers(1, 12))
def test_entropy_bound_accepts_a_sum_that_reaches_the_bound_exactly(eighths, bound):
    """The rule is `sum of the entropies taken before <= bound`, as the reference's: on entropies that are exact
    multiples of 1/8 the sum meets the bound exactly (random logits never do), and that position is accepted."""
    ent = torch.tensor(eighths, dtype=torch.float32) / 8
    acc = accept_entropy_bound(ent, bound / 8)
    for row, accepted in zip(ent.tolist(), acc):
        ranked = sorted(row)
        want = sum(1 for i in range(len(ranked)) if sum(ranked[:i]) <= bound / 8)
        assert int(accepted.sum()) == want
        taken = [e for e, a in zip(row, accepted.tolist()) if a]
        assert max(taken) <= min([e for e, a in zip(row, accepted.tolist()) if not a], default=float("inf"))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_entropy_matches_reference_categorical(seed):
    logits = logits_from(seed)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy(logits), expected, atol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 20, 48])
def test_temperature_schedule_matches_reference(n):
    """Bit for bit: a temperature one bit off at one step grows, through self-conditioning, into other tokens."""
    proc = ref_gen.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=n)
    cfg = SamplerConfig(max_denoising_steps=n)
    x = torch.randn(1, 64, 50, generator=torch.Generator().manual_seed(n)) * 5
    for step in range(n, 0, -1):  # the reference's loop hands the processor its step as an int32 tensor
        assert torch.equal(proc(None, x, torch.tensor(step, dtype=torch.int32)), x / temperature(cfg, step))
    assert float(temperature(cfg, n)) == pytest.approx(0.8)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), stability=st.integers(0, 3), threshold=st.floats(0.01, 3.0))
def test_stop_decisions_match_reference(seed, stability, threshold):
    """Feed both the same sequence of (argmax, logits); the per-row stop decisions must agree every step."""
    g = torch.Generator().manual_seed(seed)
    crit = ref_gen.StableAndConfidentStoppingCriteria(stability, threshold)
    cfg = SamplerConfig(max_denoising_steps=8, stability_threshold=stability, confidence_threshold=threshold,
                        entropy_bound=1e9)
    sharp = torch.randn(2, 6, 9, generator=g) * 30
    state = init_state(torch.zeros(2, 6, dtype=torch.long))
    for step in range(8, 0, -1):
        # alternate between repeating logits (stable argmax) and fresh ones
        raw = sharp if step % 3 else torch.randn(2, 6, 9, generator=g) * 8
        processed = raw / temperature(cfg, step)
        expected = crit(processed.argmax(-1), processed)
        new = denoise_step(cfg, state, raw, step, torch.zeros(2, 6, dtype=torch.long))
        stop_now = new.done & ~state.done
        # rows that had not stopped before must take exactly the reference's decision
        live = ~state.done
        assert torch.equal(stop_now[live], expected[live])
        state = new


@settings(max_examples=40, deadline=None)
@given(stability=st.one_of(st.integers(0, 8), st.integers(0, 2**70)))
def test_any_stability_threshold_stops_as_counted_or_is_refused_by_name(stability):
    """10**30 was accepted, then failed the step's comparison with the stable-step counts ("int too big to
    convert"; a server's 500 after the prompt was encoded). One that fits stops when the argmax has been stable
    that many steps, which a threshold past the canvas's steps never is."""
    if stability > MAX_COUNT:
        with pytest.raises(ValueError, match=r"stability_threshold: expected an integer in \[0, "):
            SamplerConfig(stability_threshold=stability)
        return
    cfg = SamplerConfig(max_denoising_steps=8, stability_threshold=stability, confidence_threshold=1e9)
    state = init_state(torch.zeros(1, 4, dtype=torch.long))
    sharp = torch.zeros(1, 4, 5).index_fill_(-1, torch.tensor([2]), 50.0)  # the same certain argmax every step
    for step in range(8, 0, -1):
        state = denoise_step(cfg, state, sharp, step, torch.zeros(1, 4, dtype=torch.long))
        assert bool(state.done) == (8 - step >= stability), step


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), stability=st.integers(0, 3), threshold=st.floats(0.01, 3.0), kept=st.integers(1, 5))
def test_a_cut_canvas_stops_on_the_positions_it_keeps(seed, stability, threshold, kept):
    """A last canvas that max_new_tokens cuts to its first `kept` positions stops as the reference's rule does on
    those positions alone: the discarded tail's churn (stability) and entropy (confidence) do not count."""
    g = torch.Generator().manual_seed(seed)
    crit = ref_gen.StableAndConfidentStoppingCriteria(stability, threshold)
    cfg = SamplerConfig(max_denoising_steps=8, stability_threshold=stability, confidence_threshold=threshold,
                        entropy_bound=1e9)
    scored = (torch.arange(6) < kept).expand(2, 6)
    sharp = torch.randn(2, 6, 9, generator=g) * 30
    state = init_state(torch.zeros(2, 6, dtype=torch.long))
    for step in range(8, 0, -1):
        raw = sharp.clone()
        raw[:, kept:] = torch.randn(2, 6 - kept, 9, generator=g) * 8  # the tail never settles
        if step % 3 == 0:
            raw = torch.randn(2, 6, 9, generator=g) * 8
        processed = raw / temperature(cfg, step)
        expected = crit(processed[:, :kept].argmax(-1), processed[:, :kept])
        new = denoise_step(cfg, state, raw, step, torch.zeros(2, 6, dtype=torch.long), rules=CanvasRules(scored=scored))
        live = ~state.done
        assert torch.equal((new.done & ~state.done)[live], expected[live])
        state = new


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1000), sampler=st.sampled_from(["entropy_bound", "greedy", "confidence", "topk"]),
       rank_by=st.sampled_from(["entropy", "margin", "position"]), keep_accepted=st.booleans(),
       kept=st.integers(1, 7), given_=st.booleans(), bound=st.sampled_from([0.05, 0.5, 3.0]))
def test_a_cut_canvas_accepts_as_a_canvas_of_the_positions_it_keeps(seed, sampler, rank_by, keep_accepted, kept,
                                                                    given_, bound):
    """A last canvas that max_new_tokens cuts to its first `kept` positions ranked all of them for acceptance, so
    the kept ones waited behind positions then thrown away (8 new tokens of blockpress-code took 31 passes, 32 took
    29). Every rule now accepts, step after step, as it would on a canvas of the kept positions alone; the tail is
    never accepted (it stays noise)."""
    g = torch.Generator().manual_seed(seed)
    c, v = 8, 9
    cfg = SamplerConfig(sampler=sampler, max_denoising_steps=6, rank_by="entropy" if sampler == "confidence" else rank_by,
                        keep_accepted=keep_accepted, entropy_bound=bound, confidence=0.6,
                        candidates="argmax" if sampler == "greedy" else "sample")
    fixed = torch.full((2, c), -1, dtype=torch.long)
    if given_:
        fixed[0, 0] = 3  # a template's token among the kept positions
    scored = (torch.arange(c) < kept).expand(2, c)
    whole = init_state(torch.randint(v, (2, c), generator=g), fixed)
    cut = init_state(whole.canvas[:, :kept].clone(), fixed[:, :kept])
    for step in range(6, 0, -1):
        raw = torch.randn(2, c, v, generator=g) * 3
        noise = torch.randint(v, (2, c), generator=g)
        uniforms = torch.rand(2, c, generator=g)
        live = ~whole.done  # a row that stopped keeps its canvas
        whole = denoise_step(cfg, whole, raw, step, noise, uniforms, CanvasRules(fixed, scored))
        cut = denoise_step(cfg, cut, raw[:, :kept], step, noise[:, :kept], uniforms[:, :kept],
                           CanvasRules(fixed[:, :kept]))
        for name in ("canvas", "argmax", "settled"):
            assert torch.equal(getattr(whole, name)[:, :kept], getattr(cut, name)), (name, step)
        assert torch.equal(whole.accepted, cut.accepted) and torch.equal(whole.done, cut.done), step
        assert torch.equal(whole.canvas[live, kept:], noise[live, kept:]) and not whole.settled[:, kept:].any()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), thr=st.floats(0.05, 1.0) | st.integers(0, 23))
def test_confidence_accepts_at_least_one(seed, thr):
    probs = torch.softmax(logits_from(seed), -1).amax(-1)
    free = torch.rand(probs.shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    free[:, 0] = True
    if isinstance(thr, int):  # a threshold one position reaches exactly ("reaches": it is accepted)
        thr = float(probs.flatten()[thr])
    acc = accept_confidence(probs, thr, free)
    assert (acc & free).any(-1).all()
    assert torch.equal(acc & (probs >= thr), probs >= thr)  # every token at or over the threshold is accepted
    extra = acc & (probs < thr)
    assert (extra.sum(-1) <= 1).all()  # ... and at most one below it (the forced one)
    for row in range(probs.shape[0]):  # the forced one is the most confident free position
        if not (acc[row] & free[row] & (probs[row] >= thr)).any():
            best = torch.where(free[row], probs[row], -1.0).argmax()
            assert extra[row].nonzero().flatten().tolist() == [int(best)]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(0, 12))
def test_topk_accepts_exactly_count_lowest(seed, count):
    ent = entropy(logits_from(seed))
    acc = accept_topk(ent, count)
    assert (acc.sum(-1) == count).all()
    if 0 < count < 12:
        assert (ent[acc].view(2, count).amax(-1) <= ent.masked_fill(acc, 1e9).amin(-1)).all()


def test_topk_schedule_reaches_all():
    cfg = SamplerConfig(sampler="topk", max_denoising_steps=5)
    counts = [topk_count(cfg, s, 12) for s in range(5, 0, -1)]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
    per_row = topk_count(cfg, 3, torch.tensor([[12], [5], [0]]))  # step 3 of 5: 3/5 of each row's holes
    assert per_row.flatten().tolist() == [8, 3, 0]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(1, 12), holes=st.lists(st.integers(0, 16), min_size=2, max_size=2))
def test_topk_ramps_over_each_rows_free_positions(seed, steps, holes):
    """With fixed positions, step k of N accepts ceil(k * holes / N) free positions in each row (its own
    number of holes), the most certain ones; the fixed positions always hold their token."""
    g = torch.Generator().manual_seed(seed)
    c, vocab = 16, 11
    fixed = torch.randint(0, vocab, (2, c), generator=g)
    for row, n in enumerate(holes):
        fixed[row, torch.randperm(c, generator=g)[:n]] = -1
    cfg = SamplerConfig(sampler="topk", max_denoising_steps=steps, adaptive_stopping=False)
    state = init_state(torch.full((2, c), vocab - 1), fixed)
    for k, step in enumerate(range(steps, 0, -1), start=1):
        raw = torch.randn(2, c, vocab, generator=g) * 3
        state = denoise_step(cfg, state, raw, step, torch.full((2, c), vocab - 1), rules=CanvasRules(fixed))
        free = fixed < 0
        for row, n in enumerate(holes):
            assert int((state.settled[row] & free[row]).sum()) == -(-k * n // steps)
        assert torch.equal(state.canvas[~free], fixed[~free])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(2, 8))
def test_topk_margin_accepts_the_widest_gaps(seed, steps):
    """rank_by="margin": the accepted free positions are those with the largest gap between the two most
    likely tokens (of the tempered softmax), not the lowest entropy."""
    g = torch.Generator().manual_seed(seed)
    c, vocab = 16, 9
    fixed = torch.randint(0, vocab, (2, c), generator=g)
    fixed[:, torch.randperm(c, generator=g)[:10]] = -1
    cfg = SamplerConfig(sampler="topk", max_denoising_steps=steps, rank_by="margin", adaptive_stopping=False)
    raw = torch.randn(2, c, vocab, generator=g) * 3
    state = denoise_step(cfg, init_state(torch.zeros(2, c, dtype=torch.long), fixed), raw, steps,
                         torch.zeros(2, c, dtype=torch.long), rules=CanvasRules(fixed))
    top2 = torch.softmax(raw / temperature(cfg, steps), -1).topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    free = fixed < 0
    for row in range(2):
        took, left = state.settled[row] & free[row], ~state.settled[row] & free[row]
        assert int(took.sum()) == -(-10 // steps)
        if left.any():
            assert margin[row][took].min() >= margin[row][left].max()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(2, 10), sampler=st.sampled_from(["topk", "entropy_bound", "confidence"]),
       candidates=st.sampled_from(["sample", "argmax"]))
def test_keep_accepted_never_changes_an_accepted_token(seed, steps, sampler, candidates):
    """keep_accepted: a token accepted at one step stays, in the canvas and in the answer, at every later step
    however the logits move; the givens stay too. topk still follows its ramp over the free positions."""
    g = torch.Generator().manual_seed(seed)
    c, vocab, noise_id = 16, 11, 10
    fixed = torch.randint(0, vocab - 1, (2, c), generator=g)
    fixed[:, torch.randperm(c, generator=g)[:12]] = -1
    free = fixed < 0
    cfg = SamplerConfig(sampler=sampler, max_denoising_steps=steps, keep_accepted=True, candidates=candidates,
                        adaptive_stopping=False, entropy_bound=0.5, confidence=0.5)
    noise = torch.full((2, c), noise_id)
    state = init_state(noise.clone(), fixed)
    for k, step in enumerate(range(steps, 0, -1), start=1):
        before = state
        raw = torch.randn(2, c, vocab, generator=g) * 3
        raw[..., noise_id] = -1e4  # never a candidate: a settled position must hold a real token
        state = denoise_step(cfg, state, raw, step, noise, rules=CanvasRules(fixed))
        held = before.settled
        assert torch.equal(state.canvas[held], before.canvas[held])
        assert torch.equal(state.argmax[held & free], before.canvas[held & free])
        assert (state.settled >= held).all()
        assert torch.equal(state.canvas[~free], fixed[~free])
        if sampler == "topk":
            assert ((state.settled & free).sum(-1) == -(-k * 12 // steps)).all()
    assert (state.canvas[state.settled] != noise_id).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(2, 8), keep_accepted=st.booleans(),
       sampler=st.sampled_from(["topk", "entropy_bound", "confidence", "greedy"]), stopping=st.booleans())
def test_accepted_counts_the_steps_own_acceptances(seed, steps, keep_accepted, sampler, stopping):
    """state.accepted (a Draft's `accepted`) is the positions the step's rule accepted: with keep_accepted the new
    ones only, so a canvas's steps add up to the free positions it settled (it counted every held one again: 1, 2,
    ..., 32 over blockpress-code's canvas); a template's givens never count. A row that stopped (`stopping`: its
    canvas stable for a step, while the batch goes on) accepts none: it repeated its last step's count, so a
    blockpress-code canvas's Drafts added up to 41 of its 32 positions."""
    g = torch.Generator().manual_seed(seed)
    c, vocab = 12, 9
    fixed = torch.randint(0, vocab, (2, c), generator=g)
    fixed[:, torch.randperm(c, generator=g)[:9]] = -1
    free = fixed < 0
    cfg = SamplerConfig(sampler=sampler, max_denoising_steps=steps, keep_accepted=keep_accepted, entropy_bound=0.5,
                        confidence=0.5, adaptive_stopping=stopping, stability_threshold=1, confidence_threshold=100.0)
    state = init_state(torch.zeros(2, c, dtype=torch.long), fixed)
    total = torch.zeros(2, dtype=torch.long)
    same_logits = torch.randn(2, c, vocab, generator=g) * 3  # (with `stopping`: the canvas is stable, and stops)
    for step in range(steps, 0, -1):
        before, stopped = (state.settled if keep_accepted else ~free), state.done
        logits = same_logits if stopping else torch.randn(2, c, vocab, generator=g) * 3
        state = denoise_step(cfg, state, logits, step, torch.zeros(2, c, dtype=torch.long), rules=CanvasRules(fixed))
        assert torch.equal(state.accepted, (state.settled & ~before).sum(-1) * ~stopped), step
        total += state.accepted
    # (the case is there: both rows stopped early.) Not with keep_accepted and a sampler that draws: a held position
    # reads as its drawn token, and each step's new acceptances change the canvas until every position is held
    assert not stopping or steps < 3 or (keep_accepted and sampler != "greedy") or bool(state.done.all())
    if keep_accepted:
        assert torch.equal(total, (state.settled & free).sum(-1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(2, 8), sampler=st.sampled_from(["greedy", "entropy_bound", "topk"]),
       bound=st.floats(0.01, 3.0), keep=st.booleans())
def test_position_order_accepts_a_left_to_right_run(seed, steps, sampler, bound, keep):
    """rank_by="position": at every step the free positions accepted so far are a prefix of the row's free
    positions (givens may sit anywhere), the step takes at least one more while any are left, and under the
    entropy rule it takes exactly those whose entropies to their left, in order, sum to <= bound."""
    g = torch.Generator().manual_seed(seed)
    c, vocab = 14, 9
    fixed = torch.randint(0, vocab, (2, c), generator=g)
    fixed[:, torch.randperm(c, generator=g)[:10]] = -1
    free = fixed < 0
    cfg = SamplerConfig(sampler=sampler, max_denoising_steps=steps, rank_by="position", entropy_bound=bound,
                        keep_accepted=True, self_conditioning=keep, adaptive_stopping=False)
    state = init_state(torch.zeros(2, c, dtype=torch.long), fixed)
    for step in range(steps, 0, -1):
        raw = torch.randn(2, c, vocab, generator=g) * 3
        before = state.settled & free
        state = denoise_step(cfg, state, raw, step, torch.zeros(2, c, dtype=torch.long), rules=CanvasRules(fixed))
        ent = entropy(raw / temperature(cfg, step))
        for row in range(2):
            took = (state.settled & free)[row][free[row]].tolist()  # free positions only, left to right
            n = sum(took)
            assert took == [True] * n + [False] * (len(took) - n)
            assert n > int(before[row].sum()) or n == len(took)
            if sampler != "topk":
                open_ent = ent[row][free[row] & ~before[row]].tolist()
                expect = sum(1 for k in range(len(open_ent)) if sum(open_ent[:k]) <= bound)
                assert n - int(before[row].sum()) == expect


def test_argmax_candidates_with_sampling_temperature():
    """candidates="argmax": every accepted token is the most likely one, whatever the uniforms draw."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(3, 20, 13, generator=g)
    cfg = SamplerConfig(sampler="topk", max_denoising_steps=1, candidates="argmax", t_max=3.0, t_min=3.0)
    state = denoise_step(cfg, init_state(torch.zeros(3, 20, dtype=torch.long)), raw, 1, torch.zeros(3, 20, dtype=torch.long),
                         uniforms=torch.rand(3, 20, generator=g))
    assert state.settled.all() and torch.equal(state.canvas, raw.argmax(-1))
    sampled = denoise_step(cfg.with_(candidates="sample"), init_state(torch.zeros(3, 20, dtype=torch.long)), raw, 1,
                           torch.zeros(3, 20, dtype=torch.long), uniforms=torch.rand(3, 20, generator=g))
    assert not torch.equal(sampled.canvas, raw.argmax(-1))  # at T 3 the draws differ somewhere: the option matters


def test_margin_and_entropy_rank_a_two_way_tie_differently():
    """Two positions: a near tie between two tokens (low entropy, no margin) and one clear favourite among
    many (higher entropy, a wide margin). Entropy accepts the tie first; margin the favourite."""
    tie = torch.log(torch.tensor([0.5, 0.5, 1e-6, 1e-6, 1e-6, 1e-6]))
    spread = torch.log(torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]))
    raw = torch.stack([tie, spread])[None]  # [1, 2, 6]
    accepted = {}
    for rank_by in ("entropy", "margin"):
        cfg = SamplerConfig(sampler="topk", max_denoising_steps=2, rank_by=rank_by, t_max=1.0, t_min=1.0)
        state = denoise_step(cfg, init_state(torch.zeros(1, 2, dtype=torch.long)), raw, 2, torch.zeros(1, 2, dtype=torch.long))
        accepted[rank_by] = state.settled[0].tolist()
    assert accepted == {"entropy": [True, False], "margin": [False, True]}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**40), ci=st.integers(0, 50), step=st.integers(0, 100))
def test_hashed_noise_is_per_row(seed, ci, step):
    seeds = torch.tensor([seed, seed + 1, seed])
    t = hashed_tokens(seeds, ci, step, 64, 1000)
    assert t.min() >= 0 and t.max() < 1000
    assert torch.equal(t[0], t[2])  # same row seed -> same noise whatever the neighbours
    assert torch.equal(t[:1], hashed_tokens(seeds[:1], ci, step, 64, 1000))
    assert len(set(t[0].tolist())) > 32  # not degenerate


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), ci=st.integers(0, 10**7), step=st.integers(0, 1000))
def test_hashed_noise_covers_every_seed_and_canvas(seed, ci, step):
    """Any int64 seed and any canvas index draw (long generations overflowed a Python int into int64), and
    seeds that differ only above the hash's 47 bits draw differently."""
    t = hashed_tokens(torch.tensor([seed]), ci, step, 64, 1000)
    assert t.min() >= 0 and t.max() < 1000
    assert not torch.equal(t, hashed_tokens(torch.tensor([seed ^ (1 << 50)]), ci, step, 64, 1000))
    assert not torch.equal(t, hashed_tokens(torch.tensor([seed]), ci + 1, step, 64, 1000))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), ci=st.integers(1, 10**6), step=st.integers(1, 1000))
def test_the_draws_and_the_noise_are_separate_streams(seed, ci, step):
    """A step's sampling draws share no numbers with the noise of that step or of the canvases and steps around it:
    were the streams' counters to overlap, a position's draw would be the noise it is re-noised with a step later.
    (A vocabulary of 2**47 tokens hands back the hash's integers themselves.)"""
    from blockpress.sampling import hashed_uniforms

    seeds = torch.tensor([seed])
    draws = hashed_uniforms(seeds, ci, step, 32)
    for c in (ci - 1, ci, ci + 1):
        for s in (step - 1, step, step + 1):
            noise = (hashed_tokens(seeds, c, s, 32, 2**47) >> 23).double() / float(1 << 24)
            assert not torch.equal(noise, draws)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_denoising_steps=-1), "max_denoising_steps"),
        # past int32 (the step counter's dtype): accepted, then torch's unnamed overflow at the first step
        (dict(max_denoising_steps=2**31), r"max_denoising_steps: expected an integer in \[1, 2147483647\]"),
        (dict(max_denoising_steps=2**63), "max_denoising_steps: expected an integer in"),
        (dict(t_min=0.9, t_max=0.5), "t_max"),
        (dict(sampler="beam"), "sampler"),
        (dict(entropy_bound=0.0), "entropy_bound"),
        (dict(stability_threshold=-2), "stability_threshold"),
        (dict(confidence=1.5), "confidence"),
        (dict(rank_by="variance"), "rank_by"),
        (dict(candidates="beam"), "candidates"),
        (dict(keep_accepted="yes"), "keep_accepted"),
        (dict(self_conditioning=0), "self_conditioning"),
        (dict(t_max=float("inf")), "t_max: expected a finite number"),
        (dict(t_min=float("nan")), "t_min: expected a finite number"),
        (dict(entropy_bound="0.1"), "entropy_bound: expected a finite number"),
        (dict(confidence=True), "confidence: expected a finite number"),
        (dict(adaptive_stopping="no"), "adaptive_stopping: expected True or False"),
        # bools passed for 1: a stability of one step, a penalty of 1, noise token 1
        (dict(stability_threshold=True), "stability_threshold: expected an integer"),
        (dict(presence_penalty=True), "presence_penalty: expected a number"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty: expected a number"),
        (dict(noise_token_id=True), "noise_token_id: expected None, -1 \\(uniform noise\\) or a token id"),
        (dict(noise_token_id=-2), "noise_token_id: expected None, -1"),
        (dict(sampler="confidence", rank_by="margin"), "rank_by: the confidence sampler .* rank_by='margin' would be "
                                                       "ignored"),
        (dict(sampler="confidence", rank_by="position"), "rank_by: the confidence sampler"),
    ],
)
def test_bad_sampler_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**kwargs)


def test_a_schedule_end_past_its_start_names_the_setting_given():
    """with_(t_min=5) said "t_max: t_max (0.8) must be >= t_min (5.0)": a server's 400 named t_max, a field the
    request never sent."""
    base = SamplerConfig(t_min=0.4, t_max=0.8)
    with pytest.raises(ValueError, match=r"^t_min: 5 must be <= t_max \(0.8, the setting here\)$"):
        base.with_(t_min=5)
    with pytest.raises(ValueError, match=r"^t_max: t_max \(0.3\) must be >= t_min \(0.4\)$"):
        base.with_(t_max=0.3)
    with pytest.raises(ValueError, match=r"^t_max: "):  # both given: the pair, as SamplerConfig names it
        base.with_(t_min=5, t_max=1)
    assert base.with_(t_min=0.8).t_min == 0.8


def test_settings_people_pass_from_numpy_and_uniform_noise_on_request():
    import numpy as np

    cfg = SamplerConfig(noise_token_id=5).with_(entropy_bound=np.float32(0.05), t_max=np.float64(1.0))
    assert cfg.entropy_bound == pytest.approx(0.05) and cfg.noise_token_id == 5  # numpy's float32 was refused
    assert cfg.with_(noise_token_id=-1).noise_token_id == -1  # -1, as in training: uniform noise, said outright
    assert cfg.with_(noise_token_id=None).noise_token_id == 5  # None still means "not given"


@settings(max_examples=30, deadline=None)
@given(value=st.integers(1, 127), kind=st.sampled_from(["int8", "int32", "int64", "uint8", "uint64"]))
def test_numpy_integer_counts_are_taken_as_ints(value, kind):
    """np.int64 (an array's arithmetic gives them) was refused as a step count; it is kept as a plain int, so the
    config still writes to JSON."""
    import json

    import numpy as np

    n = getattr(np, kind)(value)
    cfg = SamplerConfig(max_denoising_steps=n, stability_threshold=n, noise_token_id=n)
    for got in (cfg.max_denoising_steps, cfg.stability_threshold, cfg.noise_token_id):
        assert type(got) is int and got == value
    assert json.loads(json.dumps(asdict(cfg)))["max_denoising_steps"] == value
    with pytest.raises(ValueError, match="stability_threshold: expected an integer"):
        SamplerConfig(stability_threshold=np.True_)


def test_rank_by_with_the_confidence_sampler_is_refused_only_when_given():
    """The confidence sampler ignored rank_by silently (and the CLI's --rank-by). Given with it, it is refused;
    a checkpoint's ranking set for its own sampler (sudoku's topk by margin) gives way when confidence is asked."""
    checkpoint = SamplerConfig(sampler="topk", rank_by="margin")
    assert checkpoint.with_(sampler="confidence").rank_by == "entropy"
    assert checkpoint.with_(sampler="confidence", rank_by="entropy").sampler == "confidence"  # the default: fine
    assert checkpoint.with_(sampler="greedy").rank_by == "margin"
    with pytest.raises(ValueError, match="rank_by: the confidence sampler"):
        checkpoint.with_(sampler="confidence", rank_by="margin")
    with pytest.raises(ValueError, match="rank_by: the confidence sampler"):
        SamplerConfig(sampler="confidence").with_(rank_by="position")


def test_sample_candidates_over_a_greedy_default_draw():
    """candidates="sample" over a config whose sampler is greedy (blockpress-code's checkpoint default) was kept and
    never read, as greedy always takes the argmax: the explicit field is honoured with the rule greedy is made of
    (entropy_bound), and asked for together with greedy it is refused by name."""
    checkpoint = SamplerConfig(sampler="greedy", entropy_bound=0.02, keep_accepted=True)
    cfg = checkpoint.with_(candidates="sample")
    assert not cfg.argmax_candidates
    assert cfg == replace(checkpoint, sampler="entropy_bound")  # everything else the checkpoint's
    assert checkpoint.with_(candidates="sample", draw_temperature=0.7).draw_temperature == 0.7
    with pytest.raises(ValueError, match="candidates: sampler='greedy'"):
        SamplerConfig().with_(sampler="greedy", candidates="sample")
    assert checkpoint.with_(candidates="argmax").sampler == "greedy"


# Each setting that only some samplers read, with two values far enough apart that a reader accepts differently.
SAMPLER_KNOBS = {"entropy_bound": (0.01, 1e3), "confidence": (0.05, 1.0)}


@settings(max_examples=40, deadline=None)
@given(sampler=st.sampled_from(["entropy_bound", "confidence", "topk", "greedy"]),
       name=st.sampled_from(sorted(SAMPLER_KNOBS)), seed=st.integers(0, 10_000),
       sampler_given=st.booleans())
def test_a_setting_the_sampler_ignores_is_refused_when_given(sampler, name, seed, sampler_given):
    """--sampler topk --entropy-bound 50 ran as if the bound were not there (as confidence did), while a ranking
    given to the confidence sampler was refused as "would be ignored". Given, a setting is refused exactly where
    the sampler's step does not change with it, naming it and the sampler; a checkpoint's own stays harmless."""
    checkpoint = SamplerConfig(sampler=sampler, max_denoising_steps=4)  # its entropy_bound and confidence: defaults
    logits, state = logits_from(seed), init_state(torch.zeros(2, 12, dtype=torch.long))
    noise = torch.zeros(2, 12, dtype=torch.long)
    uniforms = torch.rand(2, 12, generator=torch.Generator().manual_seed(seed))
    accepted = [denoise_step(SamplerConfig(sampler=sampler, max_denoising_steps=4, **{name: v}), state, logits, 4,
                             noise, uniforms=uniforms).accepted.tolist() for v in SAMPLER_KNOBS[name]]
    reads = accepted[0] != accepted[1]
    base, given_ = (SamplerConfig(), dict(sampler=sampler)) if sampler_given else (checkpoint, {})
    low = SAMPLER_KNOBS[name][0]
    if reads:
        assert getattr(base.with_(**given_, **{name: low}), name) == low
    else:
        with pytest.raises(ValueError, match=f"{name}: the {sampler} sampler.* does not read it, so {name}={low}"):
            base.with_(**given_, **{name: low})
    assert base.with_(**given_).sampler == sampler  # not given, the defaults' value is no mistake


FLOAT_SETTINGS = ("entropy_bound", "t_min", "t_max", "confidence_threshold", "draw_temperature")


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(FLOAT_SETTINGS), value=st.floats(1.0, 1e308), step=st.integers(1, 4))
def test_a_float_setting_past_float32_is_refused_by_name(name, value, step):
    """A t_max of 1e308 was accepted, and became inf in float32: every logit over it 0, so token 0 won every
    position (an empty answer billed as 8 tokens). Any setting float32 holds keeps the logits' order."""
    given = {name: value, **({"t_max": value} if name == "t_min" else {})}
    if value > torch.finfo(torch.float32).max:
        for make in (lambda: SamplerConfig(**given), lambda: SamplerConfig().with_(**given)):
            with pytest.raises(ValueError, match=f"{name}: expected a finite number within float32's range"):
                make()
        if name == "draw_temperature":
            with pytest.raises(ValueError, match=r"draw_temperature\[1\]: expected a finite number within float32"):
                RowDraws.of(SamplerConfig(), 2, draw_temperature=[1.0, value])
            with pytest.raises(ValueError, match="temperature: expected a finite number >= 0 .* within float32"):
                SamplerConfig().with_temperature(value)
        return
    cfg = SamplerConfig(max_denoising_steps=4, **given)
    raw = torch.tensor([[[30.0, 0.0, -30.0]]])
    scaled = raw / temperature(cfg, step)
    assert bool(scaled.isfinite().all()) and scaled.argmax(-1).item() == 0


def test_a_vanishing_temperature_is_greedy_not_nan():
    """1e-45 underflows a float32 division (30 / 1e-45 = inf, and inf - inf = NaN lost every token); below
    MIN_TEMPERATURE the sampler divides by MIN_TEMPERATURE, which is greedy for any logits."""
    from blockpress.sampling import MIN_TEMPERATURE

    cfg = SamplerConfig(t_min=1e-45, t_max=1e-45)
    assert temperature(cfg, 3) == MIN_TEMPERATURE
    logits = torch.tensor([[[30.0, 29.0, -30.0, 0.0]]])
    state = init_state(torch.tensor([[2]]))
    out = denoise_step(cfg.with_(sampler="entropy_bound"), state, logits, 1, torch.tensor([[2]]))
    assert out.argmax.tolist() == [[0]] and bool(out.accepted.all())


@pytest.mark.parametrize("cfg", [
    SamplerConfig(entropy_bound=0.3, max_denoising_steps=12, t_min=0.2),
    SamplerConfig(sampler="topk", max_denoising_steps=81, t_max=1.0, t_min=1.0, noise_token_id=3),
    SamplerConfig(sampler="confidence", confidence=0.7, adaptive_stopping=False),
    SamplerConfig(sampler="topk", rank_by="margin", t_max=3.0, t_min=1.0, noise_token_id=3),
    SamplerConfig(sampler="topk", candidates="argmax", keep_accepted=True, adaptive_stopping=False,
                  self_conditioning=False),
    SamplerConfig(sampler="greedy", rank_by="position", presence_penalty=0.5, frequency_penalty=-0.25),
])
def test_generation_config_roundtrip(cfg):
    """What LM.save writes (the reference's file and blockpress's own, split by split_generation_config) reads
    back as the same sampler."""
    from blockpress.lm import split_generation_config

    reference, own = split_generation_config(asdict(cfg))
    assert SamplerConfig.from_generation_config(reference | own) == cfg
    if cfg.t_max > cfg.t_min:  # the reference's own layout; the rest is blockpress's
        assert set(reference) == {"max_denoising_steps", "sampler_config", "t_max", "t_min", "stability_threshold",
                                  "confidence_threshold"}


def test_sample_follows_the_distribution():
    from blockpress.sampling import sample

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(20000, 4).contiguous()
    draws = sample(probs, torch.rand(20000, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert freq[1] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs[0], atol=0.015)


@settings(max_examples=60, deadline=None)
@given(zeros=st.lists(st.booleans(), min_size=2, max_size=9), seed=st.integers(0, 10_000),
       edge=st.sampled_from([0.0, 1 - 2**-24, None]))
def test_sample_never_draws_a_zero_probability_token(zeros, seed, edge):
    """At the ends of [0, 1) too: u = 0 used to land on a leading zero-probability token (a banned EOS, a pad),
    and u * total rounding up to the total on a trailing one."""
    from blockpress.sampling import sample

    g = torch.Generator().manual_seed(seed)
    zeros[seed % len(zeros)] = False  # at least one token can be drawn
    probs = torch.rand(64, len(zeros), generator=g) * torch.tensor([0.0 if z else 1.0 for z in zeros])
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(64, generator=g, dtype=torch.float64) if edge is None else torch.full((64,), edge, dtype=torch.float64)
    draws = sample(probs, u)
    assert (probs.gather(-1, draws[:, None]) > 0).all()


def test_entropy_ignores_banned_tokens():
    logits = torch.tensor([[[2.0, float("-inf"), 0.5, float("-inf")]]])
    ent = entropy(logits)
    expected = torch.distributions.Categorical(logits=torch.tensor([2.0, 0.5])).entropy()
    assert torch.isfinite(ent).all() and torch.allclose(ent[0, 0], expected, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), presence=st.floats(-2, 2), frequency=st.floats(-2, 2), flat=st.booleans())
def test_penalize_repeats_counts_the_text_so_far_but_not_the_position_itself(seed, presence, frequency, flat):
    """Against a plain loop: a position's logit for token v drops by presence * [n > 0] + frequency * n, where n
    counts v in the committed history plus the counted canvas positions other than this one."""
    g = torch.Generator().manual_seed(seed)
    b, c, v = 2, 6, 7
    logits = torch.randn(b, v, generator=g) if flat else torch.randn(b, c, v, generator=g)
    history = torch.randint(0, 3, (b, v), generator=g).float()
    canvas = torch.randint(0, v, (b, c), generator=g)
    counted = torch.rand(b, c, generator=g) < 0.6
    cfg = SamplerConfig(presence_penalty=presence, frequency_penalty=frequency)
    out = penalize_repeats(cfg, logits, history) if flat else penalize_repeats(cfg, logits, history, canvas, counted)
    for row in range(b):
        for pos in range(1 if flat else c):
            for tok in range(v):
                n = float(history[row, tok])
                if not flat:
                    n += sum(1 for j in range(c) if j != pos and counted[row, j] and canvas[row, j] == tok)
                raw = logits[row, tok] if flat else logits[row, pos, tok]
                got = out[row, tok] if flat else out[row, pos, tok]
                assert abs(float(got) - (float(raw) - presence * (n > 0) - frequency * n)) < 1e-4


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 30.0))
def test_probabilities_are_torch_softmax_bit_for_bit(seed, scale):
    """Self-conditioning feeds these back into the next pass; the reference feeds torch.softmax's. A last-bit
    difference grows step by step into other tokens, so they must be the same bits, not merely close."""
    x = torch.randn(3, 5, 257, generator=torch.Generator().manual_seed(seed)) * scale
    probs, ent, best = probs_and_entropy(x)
    assert torch.equal(probs, torch.softmax(x, dim=-1, dtype=torch.float32))
    assert torch.equal(best, x.argmax(-1)) and torch.equal(probs.gather(-1, best[..., None])[..., 0], probs.amax(-1))
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=x).entropy(), atol=1e-5, rtol=1e-5)


def test_draw_temperature_changes_the_draws_only():
    """draw_temperature tempers the candidate draws alone: the entropies that accept, rank and stop, and the
    self-conditioning probabilities, stay the schedule's; 1 is the plain sampler."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    state = init_state(torch.zeros(2, 6, dtype=torch.long))
    noise = torch.full((2, 6), 10)
    uniforms = torch.rand(2, 6)
    base = SamplerConfig(max_denoising_steps=4)
    plain = denoise_step(base, state, logits, 4, noise, uniforms=uniforms)
    same = denoise_step(base.with_(draw_temperature=1.0), state, logits, 4, noise, uniforms=uniforms)
    cold = denoise_step(base.with_(draw_temperature=1e-4), state, logits, 4, noise, uniforms=uniforms)
    hot = denoise_step(base.with_(draw_temperature=50.0), state, logits, 4, noise, uniforms=uniforms)
    assert torch.equal(plain.canvas, same.canvas)
    for other in (cold, hot):  # acceptance and self-conditioning follow the schedule, not the draws
        assert torch.equal(other.accepted, plain.accepted) and torch.equal(other.settled, plain.settled)
        assert torch.equal(other.sc_probs, plain.sc_probs) and torch.equal(other.argmax, plain.argmax)
    # cold draws are the most likely tokens wherever a position was accepted
    assert torch.equal(cold.canvas[cold.settled], logits.argmax(-1)[cold.settled])
    # hot draws are near uniform: they differ from the schedule's draws somewhere
    assert not torch.equal(hot.canvas, plain.canvas)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1"])
def test_bad_draw_temperature_is_refused(value):
    with pytest.raises(ValueError, match="draw_temperature"):
        SamplerConfig(draw_temperature=value)


@settings(max_examples=40, deadline=None)
@given(sampler=st.sampled_from(["entropy_bound", "confidence", "topk", "greedy"]),
       candidates=st.sampled_from(["sample", "argmax"]), t=st.floats(0.05, 3.0))
def test_a_draw_temperature_argmax_candidates_would_ignore_is_refused(sampler, candidates, t):
    """draw_temperature with the greedy sampler (blockpress-code's default) or argmax candidates was taken and
    ignored: every seed gave the greedy answer. It is refused, as a ranking the confidence sampler would ignore;
    switching to argmax candidates drops an earlier one (a checkpoint's, set for its draws). OpenAI's temperature
    (the CLI's and the server's) still turns a default greedy sampler into draws, and keeps one asked for."""
    import re

    cfg = SamplerConfig(sampler=sampler, candidates=candidates)
    if cfg.argmax_candidates and t != 1.0:
        named = f"sampler='{sampler}'" if sampler == "greedy" else "candidates='argmax'"
        with pytest.raises(ValueError, match=re.escape(f"draw_temperature: {named} takes the most likely "
                                                       f"candidates and draws none, so draw_temperature={t} would")):
            cfg.with_(draw_temperature=t)
    else:
        assert cfg.with_(draw_temperature=t).draw_temperature == t
    drawn = cfg.with_(candidates="sample", sampler="entropy_bound" if sampler == "greedy" else None, draw_temperature=t)
    assert drawn.with_(sampler="greedy").draw_temperature == drawn.with_(candidates="argmax").draw_temperature == 1.0
    tempered = cfg.with_temperature(t)
    assert not tempered.argmax_candidates and tempered.draw_temperature == t
    assert cfg.with_temperature(t, sampler_given=True).sampler == sampler


@pytest.mark.parametrize("sampler, knob", [("confidence", dict(confidence=0.5)), ("topk", dict(rank_by="margin")),
                                           ("entropy_bound", dict(entropy_bound=0.3)), ("greedy", {})])
def test_temperature_0_keeps_a_chosen_sampler_with_argmax_candidates(sampler, knob):
    """with_temperature(0) swapped any sampler for greedy, so a chosen topk or confidence rule and its knob went
    unread; so did a checkpoint's own default rule when the caller named none. It keeps the rule and its settings
    and takes the most likely candidates, whoever chose the rule."""
    chosen = SamplerConfig(draw_temperature=0.7).with_(sampler=sampler, **knob)
    zero = chosen.with_temperature(0, sampler_given=True)
    assert zero.sampler == sampler and zero.argmax_candidates and zero.draw_temperature == 1.0
    assert all(getattr(zero, k) == v for k, v in knob.items())
    assert chosen.with_temperature(0) == zero  # the checkpoint's default rule, not named by the caller


@settings(max_examples=40, deadline=None)
@given(low=st.integers(0, 2**47 - 1), high=st.integers(1, 2**16 - 1))
def test_seeds_past_47_bits_draw_their_own_numbers(low, high):
    """Seeds fold to 47 bits for the hash; seed 1 and seed 2**47 (and the like) drew the same numbers."""
    from blockpress.sampling import hashed_uniforms

    big = low + (high << 47)
    seeds = torch.tensor([low, big, big ^ 1, low ^ (big >> 47)])
    draws = hashed_uniforms(seeds, 0, 3, 16)
    assert len({tuple(row.tolist()) for row in draws}) == 4
    assert torch.equal(hashed_uniforms(torch.tensor([low]), 0, 3, 16)[0], draws[0])  # a seed's draws don't move


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.01, 1.0), top_k=st.integers(0, 20),
       scale=st.floats(0.1, 10.0), banned=st.integers(0, 8))
def test_top_filter_keeps_exactly_the_top_k_nucleus(seed, top_p, top_k, scale, banned):
    """What top_filter keeps is the nucleus of the top_k most likely tokens: the most likely ones (nothing dropped
    is likelier than anything kept), holding at least top_p of the top-k mass, and none to spare (without its
    least likely token the rest holds less); kept probabilities are unchanged. Banned (zero) tokens never stay."""
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(3, 4, 17, generator=g, dtype=torch.float64)
    logits[..., :banned] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    out = top_filter(probs, top_k, top_p)
    kept = out > 0
    assert torch.equal(out[kept], probs[kept]) and not kept[..., :banned].any()
    for p, keep in zip(probs.reshape(-1, 17), kept.reshape(-1, 17)):
        n = int(keep.sum())
        assert 1 <= n <= (top_k or 17)
        assert not (~keep).any() or p[keep].min() >= p[~keep].max()
        top = p.sort(descending=True).values[: top_k or 17]
        top = top[top > 0]
        total = float(top.sum())
        assert float(p[keep].sum()) >= top_p * total - 1e-12  # reaches top_p of the top-k mass
        assert float(p[keep].sum() - p[keep].min()) < top_p * total + 1e-12  # and no token more than needed
        assert n <= len(top)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(5e-324, 1e-38), top_k=st.integers(0, 5))
def test_a_top_p_float32_rounds_to_0_keeps_the_most_likely_token(seed, top_p, top_k):
    """A top_p of 1e-320 is 0 in float32 (RowDraws' tensor, float32 probabilities): every token was dropped, and
    `sample` then drew the last token of the vocabulary at every position. The nucleus is the most likely token."""
    probs = torch.softmax(logits_from(seed), -1)
    draws = RowDraws.of(SamplerConfig(), 2, top_k=[top_k, top_k], top_p=[1.0, top_p])
    for out, p in ((top_filter(probs, top_k, top_p), probs), (candidate_probs(draws, probs.log())[1], probs[1])):
        top = p.argmax(-1, keepdim=True)
        assert torch.equal((out > 0).sum(-1), torch.ones(out.shape[:-1], dtype=torch.long))
        assert torch.allclose(out.gather(-1, top), p.gather(-1, top))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_top_k_one_keeps_the_argmax_also_in_a_tie(seed):
    """top_k=1 is greedy: the one token left is argmax's, also where ties (bf16 logits) make several as likely."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (5, 9), generator=g).float()  # many ties
    out = top_filter(torch.softmax(logits, -1), top_k=1)
    assert torch.equal((out > 0).sum(-1), torch.ones(5, dtype=torch.long))
    assert torch.equal(out.argmax(-1), logits.argmax(-1)) and bool((out.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all())


def _oracle_top_filter(probs, k, p):
    """The filter written out for one position [V]: a stable sort (ties by token id), the first k, then of those the
    most likely ones up to the first whose mass before it reaches top_p of theirs (the first always), put back.
    top_p is read as the probabilities' dtype holds it, as top_filter reads it: 1 - 1e-16 is 1 in float32, no filter
    (read as a Python float, the oracle's own running sum dropped the least likely tokens of an unfiltered row)."""
    p = float(torch.tensor(p, dtype=probs.dtype))
    v = probs.shape[-1]
    ordered, order = torch.sort(probs, descending=True, stable=True)
    n = k if 0 < k < v else v
    head = ordered.masked_fill(torch.arange(v) >= n, 0.0)
    if p < 1.0:
        before = torch.cumsum(head, -1) - head
        past = [i for i in range(1, n) if float(before[i]) >= float(p * head.sum())]
        n = past[0] if past else n
    out = torch.zeros_like(probs)
    out[order[:n]] = probs[order[:n]]
    return out


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.lists(st.tuples(st.integers(0, 20), st.floats(0.01, 1.0) | st.just(1.0)),
                                                  min_size=1, max_size=3),
       ties=st.booleans(), v=st.sampled_from([7, 17, 300]))
@example(seed=0, rows=[(0, 0.9999999999999999)], ties=False, v=300)
def test_top_filter_keeps_what_a_sort_keeps_also_in_ties(seed, rows, ties, v):
    """top_filter (torch.topk's k-th value as the cut-off for top_k alone, one sort for top_p) keeps exactly what a
    stable sort of each position's probabilities keeps, with the same ties at the cut-off: the lower token ids."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-2, 2, (len(rows), 3, v), generator=g).float() if ties  # many exact ties
              else 3 * torch.randn(len(rows), 3, v, generator=g))
    probs = torch.softmax(logits, -1)
    ks, ps = (list(x) for x in zip(*rows))
    got = top_filter(probs, torch.tensor(ks), torch.tensor(ps, dtype=torch.float32))
    for r, (k, p) in enumerate(rows):
        alone = top_filter(probs[r : r + 1], k, p)
        for c in range(3):
            want = _oracle_top_filter(probs[r, c], k, p)
            assert torch.equal(got[r, c], want) and torch.equal(alone[0, c], want), (r, c, k, p)


def test_top_k_alone_sorts_nothing_and_top_p_sorts_once():
    """A top_k-only filter takes torch.topk's k-th value as its cut-off (it sorted the whole vocabulary per position
    per step, which made sampled generation 1.7x slower); top_p takes one sort and one running sum, and neither
    scatters the sorted probabilities back."""
    probs = torch.softmax(logits_from(0, v=300), -1)
    for draws in (RowDraws.of(SamplerConfig(top_k=20), 2), RowDraws.of(SamplerConfig(), 2, top_k=[0, 5])):
        ops = Counter(name for name, _ in aten_ops(lambda d=draws: candidate_probs(d, probs.log(), probs)))
        assert ops["topk"] == 1 and not ops["sort"] and not ops["scatter"], ops
    nucleus = RowDraws.of(SamplerConfig(top_k=20, top_p=0.9), 2)
    ops = Counter(name for name, _ in aten_ops(lambda: candidate_probs(nucleus, probs.log(), probs)))
    assert ops["sort"] == 1 and ops["cumsum"] == 1 and not ops["scatter"], ops


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), ks=st.lists(st.integers(0, 8), min_size=1, max_size=3), tied=st.integers(1, 40),
       above=st.integers(0, 7), flat=st.booleans(), v=st.sampled_from([4096, 4099]))
def test_top_k_alone_breaks_ties_as_a_stable_sort_does(seed, ks, tied, above, flat, v):
    """Ties at the cut-off (counted in int32 now) keep what a stable sort keeps: `tied` tokens at the cut-off's
    probability and `above` likelier ones at random ids among distinct unlikely ones, or a flat row (all tied)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(len(ks), 2, v) if flat else torch.randn(len(ks), 2, v, generator=g) - 30.0
    at = torch.rand(len(ks), 2, v, generator=g).argsort(-1)
    logits.scatter_(-1, at[..., :tied], 0.0).scatter_(-1, at[..., tied : tied + above], 1.0)
    probs = torch.softmax(logits, -1)
    got = top_filter(probs, torch.tensor(ks))
    for r, k in enumerate(ks):
        for c in range(2):
            assert torch.equal(got[r, c], _oracle_top_filter(probs[r, c], k, 1.0)), (r, c, k)


def test_a_step_reads_the_vocabulary_once_for_its_max_and_copies_nothing_it_need_not():
    """denoise_step's [B, C, V] work: one max over the vocabulary gives the entropy's shift, the argmax and the top
    probability (three reductions did); the loop's own logits are divided by the temperature in place
    (`own_logits`); and without a row-mixing logits processor (`rows_mix`) a done row's self-conditioning input is
    not copied forward, since its logits are never read. The step's result is bit for bit the same."""
    b, c, v = 3, 6, 50
    logits = logits_from(1, b=b, c=c, v=v)
    state = replace(init_state(torch.zeros(b, c, dtype=torch.long)), done=torch.tensor([True, False, False]),
                    sc_probs=torch.softmax(logits_from(2, b=b, c=c, v=v), -1))
    noise, uniforms = torch.full((b, c), 7), torch.rand(b, c)
    vocab_ops = ("amax", "max", "argmax")
    for sampler in ("entropy_bound", "confidence", "greedy"):
        cfg = SamplerConfig(sampler=sampler, max_denoising_steps=4)
        plain = denoise_step(cfg, state, logits, 3, noise, uniforms=uniforms)
        ops = aten_ops(lambda cfg=cfg: denoise_step(cfg, state, logits, 3, noise, uniforms=uniforms))
        assert sum(name in vocab_ops and shape in ((b, c), (b, c, 1)) for name, shape in ops) == 1, (sampler, ops)
        owned = logits.clone()
        ops = aten_ops(lambda cfg=cfg, owned=owned: denoise_step(cfg, state, owned, 3, noise, uniforms=uniforms,
                                                                   rules=CanvasRules(rows_mix=False), own_logits=True))
        assert not any(name == "div" and shape == (b, c, v) for name, shape in ops), ops
        assert not any(name == "where" and shape == (b, c, v) for name, shape in ops), ops
        fast = denoise_step(cfg, state, logits.clone(), 3, noise, uniforms=uniforms, rules=CanvasRules(rows_mix=False), own_logits=True)
        for name in ("canvas", "argmax", "stable_steps", "done", "accepted", "settled"):
            assert torch.equal(getattr(fast, name), getattr(plain, name)), name
        assert torch.equal(fast.sc_probs[1:], plain.sc_probs[1:])  # the working rows' input to the next pass
        assert torch.equal(plain.sc_probs[0], state.sc_probs[0])  # mixing rows: the done row's is kept


def test_top_filters_change_the_diffusion_draws_only():
    """top_k and top_p filter the candidate draws, like draw_temperature: acceptance, ranking and
    self-conditioning keep the schedule's full distribution; top_k=1 draws the argmax candidates."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    state = init_state(torch.zeros(2, 6, dtype=torch.long))
    noise = torch.full((2, 6), 10)
    uniforms = torch.rand(2, 6)
    base = SamplerConfig(max_denoising_steps=4, entropy_bound=100.0)  # every position accepted
    plain = denoise_step(base, state, logits, 4, noise, uniforms=uniforms)
    argmax = denoise_step(base.with_(candidates="argmax"), state, logits, 4, noise, uniforms=uniforms)
    for cfg in (base.with_(top_k=1), base.with_(top_p=1e-6), base.with_(top_k=3, top_p=0.5)):
        other = denoise_step(cfg, state, logits, 4, noise, uniforms=uniforms)
        assert torch.equal(other.accepted, plain.accepted) and torch.equal(other.settled, plain.settled)
        assert torch.equal(other.sc_probs, plain.sc_probs) and torch.equal(other.argmax, plain.argmax)
    for cfg in (base.with_(top_k=1), base.with_(top_p=1e-6)):
        assert torch.equal(denoise_step(cfg, state, logits, 4, noise, uniforms=uniforms).canvas, argmax.canvas)
    assert not torch.equal(plain.canvas, argmax.canvas)  # the check above means something


ROW = st.tuples(st.floats(0.05, 4.0) | st.just(1.0), st.integers(0, 20) | st.just(0), st.floats(0.01, 1.0) | st.just(1.0))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.lists(ROW, min_size=1, max_size=4), scale=st.floats(0.1, 10.0))
def test_each_row_draws_with_its_own_temperature_and_filters_as_alone(seed, rows, scale):
    """A batch's rows may each draw at their own temperature, top_k and top_p (RowDraws: the server batches requests
    that differ in them): every row's candidate probabilities are, bit for bit, what its settings give it alone
    (one implementation: the scalar setting is every row at one value). So a row at top_k 0 and top_p 1 comes out
    unfiltered, and at temperature 1 untempered, whatever its neighbours do."""
    logits = logits_from(seed, b=len(rows), c=5, scale=scale)
    temps, ks, ps = (list(x) for x in zip(*rows))
    base = SamplerConfig()
    draws = RowDraws.of(base, len(rows), draw_temperature=temps, top_k=ks, top_p=ps)
    batch = candidate_probs(draws, logits, torch.softmax(logits, -1))
    for i, (t, k, p) in enumerate(rows):
        cfg = base.with_(draw_temperature=t, top_k=k, top_p=p)
        alone = candidate_probs(RowDraws.of(cfg, 1), logits[i : i + 1], torch.softmax(logits[i : i + 1], -1))
        assert torch.equal(batch[i], alone[0]), (i, rows)
        if (t, k, p) == (1.0, 0, 1.0):  # alone this is softmax(logits) itself, untouched
            assert torch.equal(batch[i], torch.softmax(logits[i], -1))
    # the per-row values reach the draws through denoise_step too, each row as alone
    state = init_state(torch.zeros(len(rows), 5, dtype=torch.long))
    noise, uniforms = torch.zeros(len(rows), 5, dtype=torch.long), torch.rand(len(rows), 5)
    stepped = denoise_step(base, state, logits, 3, noise, uniforms=uniforms, rules=CanvasRules(draws=draws))
    for i, (t, k, p) in enumerate(rows):
        alone = denoise_step(base.with_(draw_temperature=t, top_k=k, top_p=p), take_rows(state, torch.tensor([i])),
                             logits[i : i + 1], 3, noise[i : i + 1], uniforms=uniforms[i : i + 1])
        assert torch.equal(stepped.canvas[i], alone.canvas[0])


def test_row_draws_name_the_row_and_the_count():
    cfg = SamplerConfig()
    with pytest.raises(ValueError, match=r"top_p: expected one per row \(2\), got 3"):
        RowDraws.of(cfg, 2, top_p=[0.5, 0.6, 0.7])
    for name, values, message in (("top_k", [3, -1], r"top_k\[1\]: expected an integer in \[0, "),
                                  ("top_p", [0.5, 1.5], r"top_p\[1\]: expected a probability in \(0, 1\]"),
                                  ("draw_temperature", [1.0, 0.0], r"draw_temperature\[1\]: expected > 0")):
        with pytest.raises(ValueError, match=message):
            RowDraws.of(cfg, 2, **{name: values})


@settings(max_examples=60, deadline=None)
@given(k=st.one_of(st.integers(0, 64), st.integers(0, 2**70)), seed=st.integers(0, 1000))
def test_any_top_k_is_a_filter_or_a_refusal_by_name(k, seed):
    """A top_k past int64 (2**63, a client's 10**30) was accepted, then failed the tensor of the whole batch it
    joined: now each value is either refused by name, alone, or filters as top_filter does (any k at or above the
    vocabulary's size: nothing filtered, as 0)."""
    if k > MAX_COUNT:
        for make in (lambda: SamplerConfig(top_k=k), lambda: RowDraws.of(SamplerConfig(), 2, top_k=[0, k])):
            with pytest.raises(ValueError, match=r"top_k(\[1\])?: expected an integer in \[0, "):
                make()
        return
    draws = RowDraws.of(SamplerConfig(), 2, top_k=[0, k])
    probs = torch.softmax(logits_from(seed), -1)
    filtered = candidate_probs(draws, probs.log())
    unfiltered = torch.softmax(probs.log(), -1)
    assert torch.equal(filtered[0], unfiltered[0])
    kept = (filtered[1] > 0).sum(-1)
    assert torch.equal(kept, torch.full_like(kept, min(k, probs.shape[-1]) if k else probs.shape[-1]))


@pytest.mark.parametrize("field, value", [("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_k", "5"),
                                          ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", "0.9")])
def test_bad_top_filters_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field}: expected"):
        SamplerConfig(**{field: value})


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), sampler=st.sampled_from(["entropy_bound", "confidence", "topk", "greedy"]),
       steps=st.integers(1, 6), t_max=st.floats(0.5, 2.0), bound=st.floats(0.05, 3.0), conf=st.floats(0.1, 1.0),
       stability=st.integers(0, 3), threshold=st.floats(0.001, 2.0), top_k=st.integers(0, 20), top_p=st.floats(0.3, 1.0),
       penalty=st.floats(-2.0, 2.0))
def test_a_step_given_its_numbers_as_tensors_reads_none_from_the_config(seed, sampler, steps, t_max, bound, conf,
                                                                         stability, threshold, top_k, top_p, penalty):
    """The decoding loop hands a step cfg.step_choices(), every number at its default (torch 2.6's compile guarded
    on each, read or not), with the numbers in CanvasRules (StepNumbers, RowDraws): a step then computes what it
    computes from the config itself, step by step."""
    from blockpress.sampling import StepNumbers

    cfg = SamplerConfig(sampler=sampler, max_denoising_steps=steps, t_max=t_max, t_min=t_max / 2, entropy_bound=bound,
                        confidence=conf, stability_threshold=stability, confidence_threshold=threshold, top_k=top_k,
                        top_p=top_p, frequency_penalty=penalty, presence_penalty=-penalty, noise_token_id=3,
                        **({} if sampler == "greedy" else dict(draw_temperature=0.7)))
    g = torch.Generator().manual_seed(seed)
    b, c, v = 2, 6, 11
    noise = torch.randint(v, (b, c), generator=g)
    rules = CanvasRules(numbers=StepNumbers.of(cfg), draws=RowDraws.of(cfg, b))
    plain = given_numbers = init_state(noise)
    for step in range(steps, 0, -1):
        raw, uniforms = 3 * torch.randn(b, c, v, generator=g), torch.rand(b, c, generator=g)
        plain = denoise_step(cfg, plain, raw, step, noise, uniforms)
        given_numbers = denoise_step(cfg.step_choices(), given_numbers, raw, step, noise, uniforms, rules)
        for name, x in vars(plain).items():
            y = getattr(given_numbers, name)
            assert (x is None and y is None) or torch.equal(x, y), (step, name)


def test_the_sampler_maths_stay_float32_under_a_callers_autocast():
    """torch.autocast around generate ran the entropy's vecdot in bfloat16: the entropy moved by up to 5e-3, and a
    bf16 model gave other tokens under autocast though its logits were the same bit for bit."""
    import blockpress
    from blockpress.sampling import probs_and_entropy

    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(0)) * 3
    want = probs_and_entropy(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = probs_and_entropy(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0, dtype=torch.bfloat16)
    kw = dict(max_new_tokens=16, max_denoising_steps=4, seed=0)
    plain = lm.generate([2, 10, 11, 12, 13], **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lm.generate([2, 10, 11, 12, 13], **kw).sequences, plain.sequences)


def test_the_sampler_enters_no_autocast_block_where_none_is_on(monkeypatch):
    """Turning a caller's autocast off cost every step 28 Python calls even where no autocast was on: the block is
    entered only under one."""
    from blockpress.sampling import probs_and_entropy

    entered, autocast = [], torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: entered.append(k.get("enabled")) or autocast(*a, **k))
    x = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
    want = probs_and_entropy(x)
    assert entered == []
    with autocast("cpu", dtype=torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(probs_and_entropy(x), want)) and entered == [False]


# -- behaviours no test held, found by mutating the sampler (each test fails on its mutant) -----------------

@pytest.mark.parametrize("change", [dict(candidates="argmax"), dict(sampler="greedy")])
def test_argmax_candidates_with_a_draw_temperature_given_together_is_refused(change):
    """argmax candidates and a draw temperature given together in one with_() call must be refused,
    as SamplerConfig(...) refuses them; with_ drops draw_temperature only when it was NOT given (an earlier one)."""
    with pytest.raises(ValueError, match="draw_temperature"):
        SamplerConfig().with_(draw_temperature=0.7, **change)
    # an earlier draw temperature (a checkpoint's) is dropped, as documented
    assert SamplerConfig(draw_temperature=0.7).with_(**change).draw_temperature == 1.0


@pytest.mark.parametrize("t_max, t_min", [(0.3, 0.1), (0.7, 0.3), (1.3, 0.2), (0.9, 0.6), (0.5, 0.4)])
@pytest.mark.parametrize("n", [7, 48])
def test_temperature_schedule_matches_reference_for_other_ends(t_max, t_min, n):
    """the schedule matches the reference bit for bit for any (t_max, t_min), not only 0.8/0.4:
    t_max - t_min is taken in float64 (the reference's Python floats), then rounded once."""
    proc = ref_gen.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=n)
    cfg = SamplerConfig(max_denoising_steps=n, t_max=t_max, t_min=t_min)
    x = torch.randn(1, 8, 50, generator=torch.Generator().manual_seed(n)) * 5
    for step in range(n, 0, -1):
        assert torch.equal(proc(None, x, torch.tensor(step, dtype=torch.int32)), x / temperature(cfg, step)), step


def test_a_uniform_rounding_to_one_never_draws_a_zero_probability_token():
    """`sample` never draws a token of probability 0, also for a uniform that rounds up to 1.0
    in float32 (a float64 0.99999999 from a caller) and for a row whose probabilities are all 0 (it stays in range)."""
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    u = torch.tensor([0.99999999], dtype=torch.float64)  # float32(u) == 1.0
    assert sample(probs, u).tolist() == [1]


def test_an_all_zero_row_draws_a_token_in_range():
    out = sample(torch.zeros(2, 5), torch.tensor([0.0, 0.5]))
    assert ((out >= 0) & (out < 5)).all()


def test_frequency_penalty_alone_lowers_a_repeated_tokens_logit():
    """frequency_penalty alone (presence_penalty 0) penalises repeats; it was only ever tested
    beside a presence penalty, which switched the penalties on by itself."""
    cfg = SamplerConfig(frequency_penalty=1.0)
    assert cfg.penalizes_repeats
    logits = torch.zeros(1, 3, 6)
    history = torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    out = penalize_repeats(cfg, logits, history)
    assert torch.allclose(out[0, :, 1], torch.full((3,), -2.0)) and (out[0, :, [0, 2, 3, 4, 5]] == 0).all()


def test_a_draw_temperature_of_1e_5_is_applied_as_given():
    """a tiny draw temperature (1e-5, accepted: > 0) draws from softmax(logits / 1e-5): only
    temperatures below MIN_TEMPERATURE (1e-6) are clamped. A clamp at 1e-3 drew the runner-up 27% of the time here."""
    cfg = SamplerConfig(draw_temperature=1e-5)
    logits = torch.tensor([[[1.0, 0.999, -5.0]]])
    probs = candidate_probs(RowDraws.of(cfg, 1), logits, torch.softmax(logits, -1))
    assert probs[0, 0, 1] < 1e-30  # exp(-0.001 / 1e-5) = exp(-100)


def test_top_k_one_beside_a_top_k_past_the_vocabulary():
    """a batch where one row's top_k is 1 and another's is at or past the vocabulary's size (no
    limit, as documented): the first row still keeps only its argmax. RowDraws.top_k_range's low end decides whether
    any row filters at all."""
    v = 8
    logits = torch.randn(2, 3, v, generator=torch.Generator().manual_seed(0))
    draws = RowDraws.of(SamplerConfig(), 2, top_k=[1, v + 5])
    probs = candidate_probs(draws, logits, torch.softmax(logits, -1))
    assert ((probs[0] > 0).sum(-1) == 1).all()          # row 0: only the argmax
    assert torch.equal(probs[1], torch.softmax(logits[1], -1))  # row 1: unfiltered


@pytest.mark.parametrize("keep, sc, adaptive", list(itertools.product([False, True], repeat=3)))
def test_step_choices_keeps_the_flags(keep, sc, adaptive):
    """the decoding loop hands denoise_step cfg.step_choices(); it must keep the config's strings
    AND flags (keep_accepted, self_conditioning, adaptive_stopping), which the step reads as code choices. The existing
    test_a_step_given_its_numbers_as_tensors_reads_none_from_the_config draws only numbers, never a flag."""
    cfg = SamplerConfig(sampler="topk", max_denoising_steps=4, keep_accepted=keep, self_conditioning=sc,
                        adaptive_stopping=adaptive, stability_threshold=0, confidence_threshold=100.0)
    g = torch.Generator().manual_seed(0)
    b, c, v = 2, 6, 11
    noise = torch.randint(v, (b, c), generator=g)
    rules = CanvasRules(numbers=StepNumbers.of(cfg), draws=RowDraws.of(cfg, b))
    plain = given = init_state(noise)
    for step in range(4, 0, -1):
        raw, u = 3 * torch.randn(b, c, v, generator=g), torch.rand(b, c, generator=g)
        plain = denoise_step(cfg, plain, raw, step, noise, u)
        given = denoise_step(cfg.step_choices(), given, raw, step, noise, u, rules)
        for name, x in vars(plain).items():
            y = getattr(given, name)
            assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)), (step, name)


def test_a_mean_entropy_equal_to_the_threshold_does_not_stop():
    """the stop test is `mean entropy < confidence_threshold`, strictly, as the reference's
    StableAndConfidentStoppingCriteria: a canvas whose mean entropy equals the threshold exactly does not stop."""
    raw = torch.full((1, 4, 5), -1e4)
    raw[..., :2] = 0.0  # two equally likely tokens everywhere: entropy ln 2 at any temperature
    cfg0 = SamplerConfig(max_denoising_steps=2, stability_threshold=0, entropy_bound=1e9)
    ent = probs_and_entropy(raw / temperature(cfg0, 2))[1]
    thr = float(ent.mean(-1)[0])
    assert abs(thr - math.log(2)) < 1e-6
    cfg = SamplerConfig(max_denoising_steps=2, stability_threshold=0, entropy_bound=1e9, confidence_threshold=thr)
    state = denoise_step(cfg, init_state(torch.zeros(1, 4, dtype=torch.long)), raw, 2, torch.zeros(1, 4, dtype=torch.long),
                         uniforms=torch.zeros(1, 4))
    crit = ref_gen.StableAndConfidentStoppingCriteria(0, thr)
    processed = raw / temperature(cfg, 2)
    assert not bool(state.done[0]) and not bool(crit(processed.argmax(-1), processed)[0])


def test_the_server_offers_the_samplers_the_library_has():
    """The server's request model names the samplers in a Literal (its schema lists them); the CLI's choices and
    SamplerConfig's check read SAMPLERS itself."""
    import typing

    from blockpress.config import SAMPLERS
    from blockpress.serve import CompletionRequest

    literal, none = typing.get_args(CompletionRequest.model_fields["sampler"].annotation)  # Literal[...] | None
    assert none is type(None) and sorted(typing.get_args(literal)) == sorted(SAMPLERS)


def test_a_generation_makes_no_float64_tensor():
    """MPS has no float64 ("Cannot convert a MPS Tensor to float64 dtype"): the sampling draws were made in float64,
    so every sampled generation on MPS failed. The 24-bit draws are exact in float32; a float32 model's generate and
    sampled generate_ar make no float64 tensor at all (watched op by op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from blockpress import ModelConfig, random_model

    made = []

    class Float64Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.dtype == torch.float64:
                    made.append(str(func))
            return out

    lm = random_model(ModelConfig.tiny(), seed=0)
    with Float64Watch():
        lm.generate([[1, 5, 9]], max_new_tokens=8, seed=3)
        lm.generate_ar([[1, 5, 9]], max_new_tokens=4, seed=3, temperature=0.7)
    assert made == []


def test_the_typed_choices_are_the_ones_sampler_config_takes():
    """SamplerConfig's string settings are Literal types for a typed user's checker: the same choices as its checks."""
    from typing import get_args

    from blockpress.config import RANKINGS, SAMPLERS
    from blockpress.sampling import CANDIDATES, Candidates, RankBy, SamplerName

    assert sorted(get_args(SamplerName)) == sorted(SAMPLERS)
    assert sorted(get_args(RankBy)) == sorted(RANKINGS)
    assert sorted(get_args(Candidates)) == sorted(CANDIDATES)



def test_a_sampler_without_an_acceptance_rule_is_refused_not_run_as_topk():
    """denoise_step's last branch was a bare else (topk): a rule added to SAMPLERS without its own branch decoded as
    topk without a word."""
    cfg = SamplerConfig()
    object.__setattr__(cfg, "sampler", "threshold")  # as a name that passed SamplerConfig's check would arrive
    state = init_state(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="sampler: 'threshold' has no acceptance rule"):
        denoise_step(cfg, state, torch.randn(1, 4, 9), 4, torch.zeros(1, 4, dtype=torch.long))


def test_the_samplers_are_one_list_for_the_library_cli_and_server():
    """The server restated the names as its own Literal: a rule added to the library was a 400 there."""
    import typing

    from blockpress.config import SAMPLERS
    from blockpress.serve import CompletionRequest

    field = CompletionRequest.model_fields["sampler"].annotation
    assert set(typing.get_args(typing.get_args(field)[0])) == set(SAMPLERS)
