"""Prompt prefixes kept encoded between calls (prefix.py): same cache, same output, less encoding."""

import sys
import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockpress
from blockpress import PrefixCache
from blockpress.generate import left_pad
from blockpress.prefix import encode_prompts

PAD = 0


@pytest.fixture(scope="module")
def lm():
    # sliding_window 8: prompts longer than the window check that a reused row's slots line up exactly
    return blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)


def ids_from(draw_list):
    return [5 + (t % 100) for t in draw_list]


prompts = st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=30), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), earlier=prompts, later=prompts)
def test_reused_cache_equals_a_fresh_encode(lm, data, earlier, later):
    """After any earlier prompts, a batch's cache (keys, values, validity, positions) and last logits are what
    one plain encode builds; each row reuses its longest shared prefix but always encodes its last token."""
    earlier = [ids_from(r) for r in earlier]
    # later prompts often extend or branch off earlier ones
    later = [data.draw(st.sampled_from(earlier))[: data.draw(st.integers(0, 30))] + ids_from(r) for r in later]
    pc = PrefixCache(min_tokens=1)
    model = lm.model
    seen: list[list[int]] = []  # every prompt kept so far
    with torch.no_grad():
        for batch in (earlier, later):
            prompt, mask = left_pad(batch, PAD)
            room = prompt.shape[1] + 8
            want_cache = lm.new_cache(len(batch), room)
            want = model.encode(prompt, want_cache, attention_mask=mask, logits="last")
            # Rows that share nothing with the kept prompts are encoded first, together; the others then reuse
            # what they can, those fresh rows and the rows before them included.
            # A prompt repeated in the batch is encoded once: its repeats reuse it (all but their last token), and
            # report none reused, as nothing of it was kept before the batch.
            # Each row reports only what it shares with the prompts kept before the batch (it may load more).
            kept = list(seen)
            new = [i for i, r in enumerate(batch) if _reuse(seen, r) == 0]
            repeats = [i for i in new if len(batch[i]) >= 2 and batch[i] in batch[:i]]
            fresh = [i for i in new if i not in repeats]
            seen += [batch[i] for i in fresh]
            expected = [0] * len(batch)
            for i, r in enumerate(batch):
                if i not in fresh:
                    expected[i] = 0 if i in repeats else min(_reuse(seen, r), _reuse(kept, r))
                    seen.append(r)
            got_cache, got, reused = encode_prompts(model, prompt, mask, pc, room, logits=True)
            assert reused == expected
            assert got_cache.length == want_cache.length and got_cache.has_padding == want_cache.has_padding
            assert torch.equal(got_cache.valid, want_cache.valid) and torch.equal(got_cache.next_pos, want_cache.next_pos)
            v = want_cache.valid[:, : want_cache.length]
            for a, b in zip((*got_cache.keys, *got_cache.values), (*want_cache.keys, *want_cache.values)):
                n = want_cache.length
                torch.testing.assert_close(a[:, :, :n].transpose(1, 2)[v], b[:, :, :n].transpose(1, 2)[v],
                                           rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_rows_report_only_what_was_kept_before_their_batch(lm):
    """A prompt twice in a batch, partly kept by an earlier call: the first row kept all of it, and the second,
    which loads that, reported its tokens reused (19 where 12 were kept before), as nothing of a wholly new
    prompt's repeats is."""
    base = list(range(5, 25))
    pc = PrefixCache(min_tokens=4)
    lm.generate([base[:12]], max_new_tokens=4, seed=0, prefix_cache=pc)
    assert lm.generate([base, base], max_new_tokens=4, seeds=[1, 2],
                       prefix_cache=pc).extra["reused_prompt_tokens"] == [12, 12]


def test_n_identical_rows_encode_their_prompt_once(lm, monkeypatch):
    """n sampled choices are n identical rows (the server batches a job a choice): every one was new to the cache
    when the batch began, so each was encoded whole (8 choices of a 3,000-token prompt: 6-8x one choice's prefill).
    The first is encoded, with the other new rows; its repeats load what it kept and encode their last token. The
    cache, logits and samples are what encoding every row gives."""
    g = torch.Generator().manual_seed(1)
    prompt, other = (torch.randint(5, 120, (40,), generator=g).tolist() for _ in range(2))
    batch = [prompt, other, prompt, prompt]
    calls = []
    encode = lm.model.encode
    monkeypatch.setattr(lm.model, "encode", lambda *a, **k: (calls.append(tuple(a[0].shape)), encode(*a, **k))[1])
    pc = PrefixCache(min_tokens=4)
    with torch.no_grad():
        cache, got, reused = encode_prompts(lm.model, torch.tensor(batch), None, pc, 48, logits=True)
    assert calls == [(2, 40), (1, 1), (1, 1)] and reused == [0, 0, 0, 0]  # (the repeats reuse what this batch kept: nothing cached before it)
    monkeypatch.undo()
    with torch.no_grad():
        want_cache = lm.new_cache(4, 48)
        want = lm.model.encode(torch.tensor(batch), want_cache, logits="last")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip((*cache.keys, *cache.values), (*want_cache.keys, *want_cache.values)):
        torch.testing.assert_close(a[:, :, :40], b[:, :, :40], rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=16, max_denoising_steps=4, seed=3, draw_temperature=1.0)
    plain = lm.generate(batch, **kw)
    assert torch.equal(lm.generate(batch, prefix_cache=PrefixCache(min_tokens=4), **kw).sequences, plain.sequences)


def _stored(pc):  # the token ids of every entry
    return [e.ids.tolist() for e in pc._entries.values()]


def _reuse(seen, r):  # what a row reuses: its longest shared prefix, all but its last token at most
    return min(max((_lcp(e, r) for e in seen), default=0), len(r) - 1)


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_generation_is_unchanged_and_reuses_what_it_can(lm):
    g = torch.Generator().manual_seed(0)
    base = torch.randint(5, 120, (40,), generator=g).tolist()
    turn1, turn2, other = base[:30], base + [7, 8, 9], base[:10] + [11] * 12
    kw = dict(max_new_tokens=20, max_denoising_steps=4, seed=3)
    plain = lm.generate([turn1, turn2, other], **kw)
    pc = PrefixCache(min_tokens=4)
    first = lm.generate([turn1], prefix_cache=pc, **kw)
    assert first.extra["reused_prompt_tokens"] == [0] and len(pc) == 1
    again = lm.generate([turn1, turn2, other], prefix_cache=pc, **kw)
    assert again.extra["reused_prompt_tokens"] == [29, 30, 10]
    assert torch.equal(again.sequences, plain.sequences)
    # turn2 extends turn1, so its entry replaced turn1's; `other` branched off and has its own
    assert sorted(len(e) for e in _stored(pc)) == [22, 43]
    assert pc.nbytes == sum(e.nbytes for e in pc._entries.values())
    assert pc.hits == 3 and pc.reused_tokens == 69
    ar_plain = lm.generate_ar([turn1, turn2, other], max_new_tokens=12)
    ar = lm.generate_ar([turn1, turn2, other], max_new_tokens=12, prefix_cache=pc)
    assert ar.extra["reused_prompt_tokens"] == [29, 42, 21] and torch.equal(ar.sequences, ar_plain.sequences)
    assert plain.extra["reused_prompt_tokens"] == [0, 0, 0]


def test_budget_min_tokens_and_lru(lm):
    one = PrefixCache(min_tokens=5)
    lm.generate([list(range(5, 9))], max_new_tokens=4, max_denoising_steps=1, prefix_cache=one)
    assert len(one) == 0  # 4 tokens: below min_tokens
    lm.generate([list(range(5, 25))], max_new_tokens=4, max_denoising_steps=1, prefix_cache=one)
    per_prompt = one.nbytes
    assert len(one) == 1 and per_prompt > 0
    lm.generate([list(range(5, 25))], max_new_tokens=4, max_denoising_steps=1, prefix_cache=one)
    assert len(one) == 1 and one.nbytes == per_prompt  # the same prompt is not kept twice
    pair = PrefixCache(min_tokens=5)
    lm.generate([list(range(30, 50))] * 2, max_new_tokens=4, max_denoising_steps=1, prefix_cache=pair)
    assert len(pair) == 1 and pair.nbytes == per_prompt  # nor twice from one batch
    two = PrefixCache(max_bytes=2 * per_prompt, min_tokens=5)
    a, b, c = ([t] * 20 for t in (30, 40, 50))
    for p in (a, b, a, c):  # a is used again after b, so b is the least recently used when c comes
        lm.generate([p], max_new_tokens=4, max_denoising_steps=1, prefix_cache=two)
    assert sorted(e[0] for e in _stored(two)) == [30, 50] and two.nbytes <= two.max_bytes
    assert two.nbytes == sum(e.nbytes for e in two._entries.values())  # the running count stays true
    tiny = PrefixCache(max_bytes=per_prompt - 1, min_tokens=5)
    lm.generate([a], max_new_tokens=4, max_denoising_steps=1, prefix_cache=tiny)
    assert len(tiny) == 0  # larger than the whole budget: not kept
    exact = PrefixCache(max_bytes=per_prompt, min_tokens=5)
    lm.generate([a], max_new_tokens=4, max_denoising_steps=1, prefix_cache=exact)
    assert len(exact) == 1 and exact.nbytes == exact.max_bytes  # exactly the whole budget: kept
    off = PrefixCache(max_bytes=0, min_tokens=5)  # a budget of nothing is allowed: it keeps nothing
    lm.generate([a], max_new_tokens=4, max_denoising_steps=1, prefix_cache=off)
    assert len(off) == 0 and off.nbytes == 0


def test_clear_errors(lm):
    with pytest.raises(ValueError, match="prefix_cache: expected a blockpress.PrefixCache"):
        lm.generate([5, 6], max_new_tokens=4, prefix_cache={})
    out = lm.generate([5, 6, 7], max_new_tokens=4, max_denoising_steps=1, return_cache=True)
    with pytest.raises(ValueError, match="prefix_cache: not together with cache="):
        lm.generate([8], max_new_tokens=4, cache=out.cache, prefix_cache=PrefixCache())
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixCache(min_tokens=0)
    pc = PrefixCache(min_tokens=1)
    lm.generate([5, 6, 7], max_new_tokens=4, max_denoising_steps=1, prefix_cache=pc)
    other = blockpress.random_model(blockpress.ModelConfig.tiny(head_dim=16), seed=0)
    with pytest.raises(ValueError, match="another model"):
        other.generate([5, 6, 7], max_new_tokens=4, max_denoising_steps=1, prefix_cache=pc)
    # The same shapes but other weights: its keys differ, so reusing them would be silently wrong.
    twin = blockpress.random_model(lm.config, seed=123)
    with pytest.raises(ValueError, match="another model"):
        twin.generate([5, 6, 7], max_new_tokens=4, max_denoising_steps=1, prefix_cache=pc)
    kept = pc.nbytes
    pc.clear()  # forgets the model too: the twin may use it now
    assert kept > 0 and len(pc) == 0 and pc.nbytes == 0 and pc._sorted == []  # the byte count starts again too
    assert twin.generate([5, 6, 7], max_new_tokens=4, max_denoising_steps=1, prefix_cache=pc).sequences.shape[1] == 7
    assert len(pc) == 1 and pc.nbytes == kept  # the twin's one prompt, counted once
    for bad in (dict(max_bytes=True), dict(min_tokens=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrefixCache(**bad)


def test_a_cache_whose_model_is_gone_serves_the_next_one():
    """The model that filled a PrefixCache freed (a notebook loading again), its entries stayed, holding their
    memory, and refused every later model as "another model" until clear(): nothing could use them."""
    import gc

    pc = PrefixCache(min_tokens=4)
    ids = [[2, *range(10, 40)]]
    first = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    first.generate(ids, max_new_tokens=4, max_denoising_steps=1, prefix_cache=pc, seed=0)
    assert len(pc) == 1
    del first
    gc.collect()
    again = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=1)
    out = again.generate(ids, max_new_tokens=4, max_denoising_steps=1, prefix_cache=pc, seed=0)
    assert torch.equal(out.sequences, again.generate(ids, max_new_tokens=4, max_denoising_steps=1, seed=0).sequences)
    assert len(pc) == 1 and pc._model() is again.model  # (the new model's entry alone)


@pytest.mark.parametrize("change", ["quantize", "round trip", "own edit"])
def test_caches_filled_before_the_weights_changed_are_not_reused_after(change):
    """Quantizing swaps the projections in place, and a float32 -> bf16 -> float32 round trip rounds the weights
    (same object, same layout): the old keys were reused silently. A PrefixCache drops them, a KVCache is refused.
    A caller's own edit in place (an optimizer step, load_state_dict) says so with lm.model.weights_changed(), as
    python-api.md has it: without it a PrefixCache reuses the old keys."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    prompt = list(range(5, 25))
    pc = PrefixCache(min_tokens=1)
    kw = dict(max_new_tokens=4, max_denoising_steps=1, seed=1)
    before = lm.generate(prompt, prefix_cache=pc, return_cache=True, **kw)
    assert lm.generate(prompt, prefix_cache=pc, **kw).extra["reused_prompt_tokens"] == [len(prompt) - 1]
    if change == "quantize":
        lm.quantize("int8")
    elif change == "round trip":
        lm.to(dtype="bfloat16").to(dtype="float32")
    else:
        with torch.no_grad():
            lm.model.embed_tokens.weight.mul_(2)
        lm.model.weights_changed()
    reused = lm.generate(prompt, prefix_cache=pc, **kw)
    assert reused.extra["reused_prompt_tokens"] == [0]
    assert torch.equal(reused.sequences, lm.generate(prompt, **kw).sequences)
    with pytest.raises(ValueError, match="^cache: filled before this model's weights changed"):
        lm.generate([7], cache=before.cache, **kw)


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_another_models_conversation_cache_is_refused(engine):
    """Two models of one shape each began at weights_version 0, so one's return_cache continued a conversation on the
    other unrefused (its keys and values under the other's weights); a model changed in place is told apart."""
    a, b = (blockpress.random_model(blockpress.ModelConfig.tiny(), seed=s) for s in (0, 1))
    cache = a.generate([3, 4, 5], max_new_tokens=4, max_denoising_steps=2, seed=0, return_cache=True).cache
    with pytest.raises(ValueError, match=r"^cache: filled by another model \(another LM's return_cache\)"):
        getattr(b, engine)([7], cache=cache, max_new_tokens=4)
    getattr(a, engine)([7], cache=cache, max_new_tokens=4)  # its own model continues it


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_model_is_a_model_of_its_own_to_the_caches(how):
    """A copy (copy.deepcopy; pickle, whose serial is another process's, maybe a model's here: a multiprocessing
    result, torch.save of an LM) kept the serial of the model copied, so it continued that model's conversation, or
    another model's, unrefused. The copy refuses it, continues its own, and computes what the original does."""
    import copy
    import pickle

    a = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    b = copy.deepcopy(a) if how == "deepcopy" else pickle.loads(pickle.dumps(a))
    assert b.model.weights_version[0] != a.model.weights_version[0]
    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=0)
    cache = a.generate([3, 4, 5], return_cache=True, **kw).cache
    with pytest.raises(ValueError, match=r"^cache: filled by another model \(another LM's return_cache\)"):
        b.generate([7], cache=cache, **kw)
    mine = b.generate([3, 4, 5], return_cache=True, **kw)
    assert torch.equal(mine.sequences, a.generate([3, 4, 5], **kw).sequences)
    assert torch.equal(b.generate([7], cache=mine.cache, **kw).sequences, a.generate([7], cache=cache, **kw).sequences)


def test_one_cache_shared_by_threads_that_generate_at_once(lm):
    """Threads encoding at once through one PrefixCache (request threads sharing an LM): its dict was iterated while
    another thread changed it (RuntimeError), an entry was evicted between lookup and load (KeyError), and the
    byte count drifted. Each row must still get what a plain encode builds, and the counts must add up."""
    system = list(range(5, 40))
    pc = PrefixCache(max_bytes=300_000, min_tokens=1)  # ~20 entries: lookups take a while, evictions race
    errors: list[BaseException] = []
    rows_done = [0] * 4

    def work(k: int) -> None:
        g = torch.Generator().manual_seed(k)
        try:
            for _ in range(20):
                batch = [system + torch.randint(5, 120, (int(n),), generator=g).tolist()
                         for n in torch.randint(1, 12, (2,), generator=g)]
                prompt, mask = left_pad(batch, PAD)
                with torch.no_grad():
                    _, got, _ = encode_prompts(lm.model, prompt, mask, pc, prompt.shape[1] + 1, logits=True)
                    want = lm.model.encode(prompt, lm.new_cache(2, prompt.shape[1] + 1), attention_mask=mask,
                                           logits="last")
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                rows_done[k] += 2
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    switch, cores = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(1e-4)  # switch threads often, so the races show within a few calls
    torch.set_num_threads(1)  # four threads of tiny ops: more would only wait on each other
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        torch.set_num_threads(cores)
    assert not errors, errors[0]
    assert pc.lookups == sum(rows_done) == 160
    assert pc.nbytes == sum(e.nbytes for e in pc._entries.values()) <= pc.max_bytes


def test_a_prompt_that_shares_less_than_min_tokens_is_encoded_afresh_with_the_other_new_rows(lm, monkeypatch):
    """Every prompt starts with BOS, as every kept one does: that one token counted as a hit (a server's usage said
    cached_tokens 1 for every unrelated prompt), and made each new row an encode of its own instead of one batch."""
    pc = PrefixCache(min_tokens=8)
    kept = [2] + list(range(10, 30))  # BOS, then 20 tokens
    encode_prompts(lm.model, torch.tensor([kept]), None, pc, 32)
    calls = []
    encode = lm.model.encode
    monkeypatch.setattr(lm.model, "encode", lambda *a, **k: (calls.append(a[0].shape), encode(*a, **k))[1])
    new = [[2, 40, 41, 42, 43], [2, 50, 51, 52, 53], kept[:5] + [60, 61]]  # sharing BOS, BOS, 5 tokens: all < 8
    tokens, mask = left_pad(new, pad_id=PAD)
    cache, _, reused = encode_prompts(lm.model, tokens, mask, pc, 16)
    assert reused == [0, 0, 0] and pc.hits == 0
    assert calls == [torch.Size([3, 7])]  # one batch, as with nothing kept
    again = kept[:12] + [70]  # 12 shared tokens: reused
    assert encode_prompts(lm.model, torch.tensor([again]), None, pc, 16)[2] == [12] and pc.hits == 1


class _Read(torch.Tensor):
    """A kept prompt's ids that note, in `_Read.seen`, each entry a lookup reads (sliced to compare)."""

    seen: set = set()

    def __getitem__(self, index):
        if isinstance(index, slice) and getattr(self, "_entry", None) is not None:
            _Read.seen.add(self._entry)
        return super().__getitem__(index)


def _one_row_cache(lm, n):
    row = blockpress.KVCache.allocate(lm.config.text, 1, n, lm.dtype)
    row.commit(None, n)
    return row


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kept=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=0, max_size=30),
       query=st.lists(st.integers(0, 3), min_size=1, max_size=9))
def test_longest_finds_the_longest_shared_prefix_of_any_kept_prompt(lm, kept, query):
    """A small alphabet, so prompts share prefixes of every length: the lookup (the sorted neighbours) finds what
    comparing with every kept prompt finds, and names an entry that shares that much."""
    pc = PrefixCache(min_tokens=1)
    row = _one_row_cache(lm, 8)
    for ids in kept:
        pc.add(torch.tensor(ids), row)
    key, entry, n = pc.longest(torch.tensor(query))
    assert n == max((_lcp(e, query) for e in _stored(pc)), default=0)
    if n:
        assert pc._entries[key] is entry and _lcp(entry.ids.tolist(), query) == n
    else:
        assert key is None and entry is None
    assert len(pc._sorted) == len(pc) and pc.nbytes == sum(e.nbytes for e in pc._entries.values())


def test_a_lookup_reads_a_few_entries_however_many_are_kept(lm):
    """A long-running server keeps thousands of prompts (1 GiB held ~20,000 short ones of blockpress-code): each
    lookup compared the prompt with every one of them, ~9 us each (0.07 s a lookup at 8,000 entries, two lookups
    a prompt row, in the engine thread), so requests slowed as the cache filled (0.056 s a short generate with an
    empty cache, 0.152 s at 10,000 entries)."""
    pc = PrefixCache(min_tokens=4)
    row = _one_row_cache(lm, 12)
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        pc.add(torch.cat([torch.tensor([2]), torch.randint(5, 60, (11,), generator=g)]), row)
    assert len(pc) == 500
    for key, entry in pc._entries.items():
        entry.ids = entry.ids.as_subclass(_Read)
        entry.ids._entry = key
    for query in (list(pc._entries.values())[123].ids.tolist()[:8] + [1, 1], [2, 7, 7, 7, 7], [3]):
        _Read.seen = set()
        key, entry, n = pc.longest(torch.tensor(query))
        assert n == max(_lcp(e, query) for e in _stored(pc))
        assert len(_Read.seen) <= 2, f"a lookup read {len(_Read.seen)} of {len(pc)} entries"
    # evictions and replacements keep the sorted index in step with the entries
    small = PrefixCache(max_bytes=pc._entries[0].nbytes // 12 * 14, min_tokens=4)  # room for 14 tokens
    for ids, kept in (([2, 5, 6, 7], 1), ([2, 5, 6, 7, 8], 1), ([2, 9, 9, 9], 2), ([2, 4, 4, 4], 3),
                      ([2, 5, 6, 7, 8, 9], 3), ([2, 3, 3, 3, 3], 2)):  # extensions replace; the last evicts two
        small.add(torch.tensor(ids), _one_row_cache(lm, len(ids)), replaces=small.longest(torch.tensor(ids))[0])
        assert len(small) == kept and len(small._sorted) == kept
    assert sorted(_stored(small)) == [[2, 3, 3, 3, 3], [2, 5, 6, 7, 8, 9]]
    assert [k for _, k in small._sorted] == sorted(small._entries, key=lambda k: small._entries[k].ids.tolist())


def test_a_row_whose_match_the_new_rows_evicted_is_encoded_afresh(lm):
    """A batch's new rows are kept first, and with a tight budget they evict the entry a later row of the same
    batch matched: that row then shares nothing kept, loads nothing and encodes its whole prompt (the path a
    thread evicting meanwhile takes too), and its cache and logits are still a plain encode's."""
    kept = list(range(5, 25))
    one = PrefixCache(min_tokens=4)
    encode_prompts(lm.model, torch.tensor([kept]), None, one, 24)
    pc = PrefixCache(max_bytes=one.nbytes, min_tokens=4)  # room for one prompt of 20 tokens
    encode_prompts(lm.model, torch.tensor([kept]), None, pc, 24)
    batch = [kept + [7, 8], [60 + t % 7 for t in range(20)]]  # extends the kept one; shares nothing with it
    prompt, mask = left_pad(batch, PAD)
    with torch.no_grad():
        cache, got, reused = encode_prompts(lm.model, prompt, mask, pc, 26, logits=True)
        want_cache = lm.new_cache(2, 26)
        want = lm.model.encode(prompt, want_cache, attention_mask=mask, logits="last")
    assert reused == [0, 0] and pc.hits == 0
    assert _stored(pc) == [batch[1]]  # the new row's prompt evicted the kept one; the longer one does not fit
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(cache.valid, want_cache.valid) and torch.equal(cache.next_pos, want_cache.next_pos)


def test_the_constructor_takes_the_settings_alone():
    """PrefixCache's signature held its counters and eight private fields beside max_bytes and min_tokens:
    `PrefixCache(hits=9)` started with made-up /metrics figures. The counters start at 0 and the rest is state."""
    import inspect

    assert list(inspect.signature(PrefixCache).parameters) == ["max_bytes", "min_tokens"]
    for name in ("hits", "lookups", "reused_tokens", "_entries", "_lock"):
        with pytest.raises(TypeError, match=name):
            PrefixCache(**{name: 9})
    pc = PrefixCache(max_bytes=100, min_tokens=2)
    assert (pc.lookups, pc.hits, pc.reused_tokens, len(pc), pc.nbytes) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_prefix_cache_has_its_settings_and_serves_afresh(lm, how):
    """copy.deepcopy and pickle of a PrefixCache (an object holding one: a server's settings, a worker's) raised
    "cannot pickle '_thread.RLock' object". The copy has the settings, not the entries (one model's keys and values
    in this process), and a generation through it gives what one through the original does."""
    import copy
    import pickle

    cache = PrefixCache(max_bytes=1 << 20, min_tokens=2)
    prompt = torch.tensor([[2, 5, 6, 7, 8]])
    first = lm.generate(prompt, max_new_tokens=8, seed=1, prefix_cache=cache)
    assert len(cache) == 1
    copied = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    assert (copied.max_bytes, copied.min_tokens, len(copied), copied.lookups) == (1 << 20, 2, 0, 0)
    again = lm.generate(prompt, max_new_tokens=8, seed=1, prefix_cache=copied)
    assert torch.equal(again.sequences, first.sequences) and len(copied) == 1 and len(cache) == 1
    # a subclass's own settings come along (the copy was rebuilt from max_bytes and min_tokens alone)
    tenant = TenantCache(max_bytes=1 << 20, tenant="team-a")
    tenant_copy = copy.deepcopy(tenant) if how == "deepcopy" else pickle.loads(pickle.dumps(tenant))
    assert type(tenant_copy) is TenantCache and (tenant_copy.tenant, tenant_copy.max_bytes) == ("team-a", 1 << 20)


@dataclass
class TenantCache(PrefixCache):  # (module level, as pickle finds a class by its name)
    tenant: str = "default"
