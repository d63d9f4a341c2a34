"""A KV cache across turns: reset, the bookkeeping of which truncations are allowed, weights checks after a batch
shrinks, masks with no fully masked query, and a continued stream or chat stream that fails, is cancelled or is left.
Each test holds a behaviour that mutating cache.py, model.py, generate.py or lm.py showed no other test held."""

import copy
import sys

import pytest
import torch

import blockpress
import blockpress.lm as lm_module
from blockpress.tokenizer import train_bpe_tokenizer


def _conversation(lm, cache):
    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=0, sampler="greedy")
    first = lm.generate([[3, 4, 5, 6], [7, 8, 9, 10]], cache=cache, return_cache=True, **kw)  # unpadded turn
    # a ragged (padded) next turn: the encoder builds masks from cache.valid for every slot
    second = lm.generate([[11, 12, 13], [14]], cache=first.cache, **kw)
    return first.new_tokens, second.new_tokens


def test_a_reset_cache_is_a_fresh_cache():
    """A reset cache that once held a padded batch must serve a new
    conversation exactly as a fresh cache does, including a later padded turn (which reads `valid` again)."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=0, sampler="greedy")
    padded = lm.generate([[3], [4, 5, 6, 7, 8, 9]], return_cache=True, **kw).cache  # row 0 left-padded
    assert padded.has_padding
    padded.reset()
    fresh = _conversation(lm, None)
    reused = _conversation(lm, padded)
    assert torch.equal(reused[0], fresh[0]) and torch.equal(reused[1], fresh[1])


def test_truncate_to_the_current_length_is_a_no_op_after_slots_moved():
    """Truncating to the length the cache
    already has is a no-op, even after a batch continuation moved slots (moved_from set), where a shorter slot count
    is rightly refused."""
    cfg = blockpress.ModelConfig.tiny().text
    cache = blockpress.KVCache.allocate(cfg, 2, 8)
    cache.commit(torch.tensor([[1, 1, 0], [1, 1, 1]]), 3)  # row 0 has a hole after its tokens
    cache.compact()  # moves row 0's tokens right: slots moved
    assert cache.moved_from is not None
    before = (cache.length, cache.next_pos.tolist(), cache.valid.clone(), cache.has_padding)
    cache.truncate(cache.length)  # nothing to forget: no error, nothing changes
    assert (cache.length, cache.next_pos.tolist(), cache.has_padding) == (before[0], before[1], before[3])
    assert torch.equal(cache.valid, before[2])


def test_a_later_compaction_does_not_forget_an_earlier_move():
    """Once slot 0 moved, a later
    compaction that moves only later slots must not make truncate(int) accept slot counts past slot 0 again."""
    cfg = blockpress.ModelConfig.tiny().text
    cache = blockpress.KVCache.allocate(cfg, 2, 16)
    cache.commit(torch.tensor([[1, 1, 0], [1, 1, 1]]), 3)
    cache.compact()  # row 0: [a b _] -> [_ a b]: slot 0 on moved
    assert cache.moved_from == 0
    cache.commit(torch.tensor([[1, 0], [1, 1]]), 2)
    cache.compact()  # row 0: [_ a b c _] -> [_ _ a b c]: slots 1 on moved this time
    assert cache.moved_from == 0  # still: slot 0 moved earlier
    with pytest.raises(ValueError, match="moved"):
        cache.truncate(1)  # slot 0 no longer holds the conversation's start in row 0


def test_going_back_to_a_mark_taken_over_holes_counts_as_a_move():
    """Going back to a mark taken on a cache
    with holes lays the rows out left-padded, which moves slots; truncate(int) past the moved slot must then be refused."""
    cfg = blockpress.ModelConfig.tiny().text
    cache = blockpress.KVCache.allocate(cfg, 2, 16)
    cache.commit(torch.tensor([[1, 1, 0], [1, 1, 1]]), 3)  # row 0 ends before row 1: a hole, not compacted yet
    mark = cache.mark()
    cache.commit(torch.tensor([[1], [1]]), 1)
    cache.truncate(mark)  # row 0 back to its 2 tokens, left-padded: [_ a b], moved from slot 0
    assert cache.next_pos.tolist() == [2, 3]
    with pytest.raises(ValueError, match="moved"):
        cache.truncate(1)


def test_a_mark_restores_what_truncate_int_may_take():
    """Going back to a mark taken while every row
    was left-padded puts every slot back where it was then, so truncate(int) takes again what it could take then."""
    cfg = blockpress.ModelConfig.tiny().text
    cache = blockpress.KVCache.allocate(cfg, 2, 16)
    cache.commit(torch.tensor([[0, 1, 1], [1, 1, 1]]), 3)  # left padding, nothing moved
    assert cache.moved_from is None
    mark = cache.mark()
    cache.commit(torch.tensor([[1, 1, 1], [1, 0, 0]]), 3)
    cache.compact()  # row 1 ended early: its history moves right
    assert cache.moved_from is not None
    cache.truncate(mark)  # every slot back where it was at the mark
    cache.truncate(2)  # so the first 2 slots are the conversation's start again, as they were at the mark
    assert cache.length == 2 and cache.next_pos.tolist() == [1, 2]


def test_a_shrunk_batch_still_refuses_changed_weights():
    """A stream whose batch dropped an ended row's cache must still
    refuse to go on once the weights changed between two of its events."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    c = lm.config.canvas_length
    events = lm.stream([[3, 4, 5], [6, 7]], max_new_tokens=[c, 3 * c], max_denoising_steps=2, seed=0, drafts=False,
                       sampler="greedy")
    first = next(events)  # canvas 0's Commit: row 0 has spent its budget and leaves the batch's cache next canvas
    assert first.kind == "commit" and bool(first.finished[0]) and not bool(first.finished[1])
    lm.to(dtype=torch.bfloat16)  # the weights change between two events of the stream
    with pytest.raises(RuntimeError, match="weights changed"):
        for _ in events:
            pass


def test_no_encoder_query_is_fully_masked():
    """No query row of an encoder mask may be fully
    masked. torch 2.13's CPU SDPA returns 0 for such a row, so no output test on this machine sees it; other kernels
    (and older torch) return NaN there, which the pads' values then carry into every row (0 * NaN)."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    w = lm.model.window
    valid = torch.ones(2, 3 * w, dtype=torch.bool)
    valid[0, : w + 2] = False  # a long left padding: sliding windows of pad queries see only pads
    for start in (0, 1, w):
        masks = lm.model.causal_masks(start, 3 * w, max(0, start - w + 1), valid)
        for kind, mask in masks.items():
            assert mask.any(-1).all(), (kind, start)


def a_first_chat_turn(kw):
    """A tiny chat model, the cache of a conversation's first turn, and (length, next_pos, tokens) as it holds them."""
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    cache = lm.chat_ids([2, 40, 41, 42, 43], return_cache=True, max_new_tokens=8, **kw).cache
    return lm, cache, (cache.length, cache.next_pos.tolist(), [list(r) for r in cache.tokens])


def failing_at_canvas_1():
    """A logits_processor that raises in canvas 1: the prompt and canvas 0 are in the cache by then."""
    calls = []

    def processor(logits, rows):
        calls.append(1)
        if len(calls) > 3:
            raise KeyError("boom")
        return logits
    return processor


def test_a_failed_stream_leaves_the_continued_cache_as_it_was():
    """A stream over a conversation's cache that
    fails part-way leaves the cache as it was before the stream (the docstring's promise; generate has its own undo)."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    c = lm.config.canvas_length
    kw = dict(max_denoising_steps=2, seed=0, sampler="greedy")
    cache = lm.generate([[3, 4, 5], [6, 7]], max_new_tokens=c, return_cache=True, **kw).cache
    before = (cache.length, cache.next_pos.tolist(), cache.valid[:, : cache.length].clone())
    processor = failing_at_canvas_1()

    with pytest.raises(KeyError):
        for _ in lm.stream([[8], [9]], cache=cache, max_new_tokens=3 * c, logits_processor=processor, **kw):
            pass
    assert (cache.length, cache.next_pos.tolist()) == (before[0], before[1])
    assert torch.equal(cache.valid[:, : cache.length], before[2])


def _holes(cache):
    v = cache.valid[:, : cache.length]
    return bool((v[:, :-1] & ~v[:, 1:]).any())


@pytest.mark.parametrize("how", ["close", "cancelled"])
def test_a_continued_stream_that_ends_early_leaves_no_holes(how):
    """The cache a continued stream leaves behind must hold each row as it would alone: no padding after a row's tokens
    (sliding windows count slots, so a hole changes what the next turn sees)."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    c = lm.config.canvas_length
    kw = dict(max_denoising_steps=2, seed=0, sampler="greedy")
    cache = lm.generate([[3, 4, 5], [6, 7]], max_new_tokens=c, return_cache=True, **kw).cache
    commits = []
    cancelled = (lambda: len(commits) >= 2) if how == "cancelled" else None
    events = lm.stream([[8], [9]], cache=cache, max_new_tokens=[c, 3 * c], drafts=False, cancelled=cancelled, **kw)
    for event in events:
        if event.kind == "commit":
            commits.append(event)
            if how == "close" and len(commits) == 2:  # row 0 ended a canvas ago; row 1 has one more to go
                break
    events.close()
    assert bool(commits[0].finished[0]) and not bool(commits[1].finished[1])
    assert not _holes(cache)


def test_leaving_a_chat_stream_after_done_keeps_the_turn():
    """A chat stream continuing a cache,
    whose caller takes Done and then leaves (break, close), keeps the finished turn in the cache, as chat_ids would."""
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=0)
    first = lm.chat_ids([2, 40, 41, 42, 43], return_cache=True, **kw)
    cache = first.cache
    turn2 = list(cache.tokens[0]) + [50, 51, 52]
    events = lm.chat_stream(turn2, cache=cache, **kw)
    for event in events:
        if event.kind == "done":
            out = event.output
            break
    held = (cache.length, cache.next_pos.tolist(), [list(r) for r in cache.tokens])
    assert held[1][0] == len(turn2) + int(out.num_new_tokens[0])
    events.close()  # the caller is done with the stream: the turn it finished stays
    assert (cache.length, cache.next_pos.tolist(), cache.tokens) == held


def test_a_cancelled_chat_stream_leaves_the_conversation_before_the_turn():
    """A chat stream continuing a
    cache that `cancelled` ends leaves the cache holding the conversation before the turn, whose tokens it still knows
    (so the next chat turn continues it)."""
    kw = dict(max_denoising_steps=2, seed=0)
    lm, cache, held = a_first_chat_turn(kw)
    c = lm.config.canvas_length
    commits = []
    events = lm.chat_stream(held[2][0] + [50, 51, 52], cache=cache, max_new_tokens=3 * c,
                            cancelled=lambda: len(commits) >= 1, **kw)
    kinds = []
    for event in events:
        kinds.append(event.kind)
        if event.kind == "commit":
            commits.append(event)
    assert kinds[-1] == "cancelled"
    assert (cache.length, cache.next_pos.tolist(), cache.tokens) == held


@pytest.mark.parametrize("call", ["generate", "chat_ids"])
def test_a_failed_turn_gives_the_cache_back_its_tokens(call):
    """A chat turn that fails part-way
    must leave the conversation's cache as it was, tokens included, so the next turn continues it (chat refuses a cache
    whose tokens it does not know)."""
    kw = dict(max_denoising_steps=2, seed=0)
    lm, cache, held = a_first_chat_turn(kw)
    c = lm.config.canvas_length
    processor = failing_at_canvas_1()

    with pytest.raises(KeyError):
        if call == "generate":
            lm.generate([50, 51, 52], cache=cache, max_new_tokens=3 * c, logits_processor=processor, **kw)
        else:
            lm.chat_ids(held[2][0] + [50, 51, 52], cache=cache, max_new_tokens=3 * c, logits_processor=processor, **kw)
    assert (cache.length, cache.next_pos.tolist(), cache.tokens) == held
    # and the conversation goes on from it
    lm.chat_ids(held[2][0] + [50, 51, 52], cache=cache, max_new_tokens=4, **kw)


def test_a_template_canvas_with_nothing_to_fill_after_a_row_ended_reads_each_rows_own_cache():
    """Once an ended row has
    left the batch's cache (drop_ended_rows), a canvas in which a row's template is all given (idle) shrinks the batch
    again, and each working row must read its own cache row, searchsorted in `held`. The rows' tokens must be those of
    the same batch with stopped rows kept (skip_stopped_rows=False), which never drops a cache row."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    c = lm.config.canvas_length
    H = -1
    rows = [
        [H] + [5] * (c - 1),                                     # ends after canvas 0
        [H] * c + [H] * c + [6] * c + [H] * c,                   # canvas 2 all given: idle there
        [H] * c + [H] * c + [7] + [H] * (c - 1) + [H] * c,       # holes everywhere
        [H] * c + [H] * c + [H] * c + [8] * c,                   # holes in canvas 2, canvas 3 all given
    ]
    width = max(map(len, rows))
    kw = dict(max_denoising_steps=2, seeds=[1, 2, 3, 4], adaptive_stopping=False)
    prompt = [[3, 4], [5, 6, 7], [8], [9, 10]]
    kept = lm.infill(rows, prompt=prompt, skip_stopped_rows=False, **kw)
    out = lm.infill(rows, prompt=prompt, **kw)
    assert out.new_tokens.shape[1] == width
    assert torch.equal(out.new_tokens, kept.new_tokens)


def test_encoding_past_a_caches_capacity_is_a_clear_error():
    """Encoding more tokens than a cache was allocated
    for must be the clear "KVCache: needs N slots ... capacity C" error, not torch's shape error from deep inside."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    cache = lm.new_cache(1, 8)
    with pytest.raises(ValueError, match=r"KVCache: needs 12 slots .* capacity 8"):
        lm.model.encode(torch.tensor([[3] * 12]), cache)
    assert cache.length == 0


def test_a_ctrl_c_between_two_events_closes_generates_stream():
    """A Ctrl-C between two of generate's events left its stream suspended, still holding the cache and its
    GeneratorExit clean-up, until the traceback that keeps it alive goes (a notebook keeps the last one): its clean-up (cache.compact) then runs at some later moment, on a cache
    the user has gone on with. The Ctrl-C is raised in generate's own frame, between two events, by a trace function."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    c = lm.config.canvas_length
    kw = dict(max_denoising_steps=2, seed=0, sampler="greedy")
    cache = lm.generate([[3, 4, 5], [6, 7]], max_new_tokens=c, return_cache=True, **kw).cache
    held = (cache.length, cache.next_pos.tolist())
    code = lm_module.LM.generate.__code__
    seen = []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and "isinstance(event, Done)" in _line(frame):
                seen.append(1)
                if len(seen) == 2:  # after the first event, before the second is looked at
                    raise KeyboardInterrupt
            return local
        return local

    before = sys.gettrace()  # (coverage's or a debugger's, put back after: None turned it off for every later test)
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            lm.generate([[8], [9]], cache=cache, max_new_tokens=3 * c, **kw)
    finally:
        sys.settrace(before)
    assert (cache.length, cache.next_pos.tolist()) == held  # the turn taken back out
    # The traceback is still held (as a notebook holds the last one): the stream must be closed nonetheless.
    open_streams = [s for s in list(lm_module._OPEN_STREAMS) if getattr(s, "gi_frame", None) is not None]
    assert open_streams == [], "generate left its stream suspended over the cache"
    del caught


def _line(frame):
    import linecache
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


@pytest.mark.parametrize("call", ["chat", "generate", "generate_ar", "chat_stream"])
def test_a_cache_another_thread_is_continuing_is_refused_by_name(call):
    """Two threads continuing one cache: the second's chat rewound it under the first's decoding, which answered a
    reply that was not its turn's (and the second failed on an unrelated capacity error). The second call is
    refused by name while the first holds the cache; once that ends, it runs as alone."""
    import copy
    import threading

    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    msgs = [{"role": "user", "content": "hello there"}]
    first = lm.chat(msgs, return_cache=True, **kw)
    turn = msgs + [{"role": "assistant", "content": first.texts[0]}, {"role": "user", "content": "and then"}]
    alone = lm.chat(turn, cache=copy.deepcopy(first.cache), **kw).texts
    held = lm.chat_stream(lm.chat_prompt(turn), cache=first.cache, **kw)
    next(held)  # the first thread's turn has begun, and waits between two events
    tried = {}

    def other():
        try:
            if call == "chat_stream":
                next(lm.chat_stream(lm.chat_prompt(turn), cache=first.cache, **kw))
            elif call == "chat":
                lm.chat(turn, cache=first.cache, **kw)
            elif call == "generate":
                lm.generate([[5, 6]], cache=first.cache, **kw)
            else:
                lm.generate_ar([[5, 6]], cache=first.cache, max_new_tokens=4)
        except ValueError as e:
            tried["error"] = str(e)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert tried.get("error", "").startswith("cache: in use by a call in another thread"), tried
    answer = [e for e in held if type(e).__name__ == "Done"][0].output.texts  # the first turn, undisturbed
    assert answer == alone
    done = []
    thread = threading.Thread(target=lambda: done.append(lm.chat(turn, cache=copy.deepcopy(first.cache), **kw).texts))
    thread.start()
    thread.join()
    assert done == [alone] and first.cache.users == []


def test_a_copy_of_a_held_cache_is_free_and_a_ctrl_c_anywhere_in_the_claim_gives_it_back():
    """A copy (copy.deepcopy: a branch of the conversation) taken while a stream held the cache kept the stream's
    claim, so every other thread was refused the copy forever; a Ctrl-C between taking the claim and the block that
    gives it back kept it the same way. Interrupted at each line of the claim up to its `finally` (whose own first
    line a traced exception can always precede), the cache is free afterwards."""
    import copy
    import inspect
    import linecache
    import threading

    import blockpress.cache as cache_module

    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    first = lm.generate([[5, 6, 7]], return_cache=True, **kw)
    held = lm.stream([[8, 9]], cache=first.cache, **kw)
    next(held)
    branch = copy.deepcopy(first.cache)
    held.close()
    assert branch.users == [] and first.cache.users == []
    done = []
    thread = threading.Thread(target=lambda: done.append(lm.generate([[8, 9]], cache=branch, **kw).texts))
    thread.start()
    thread.join()
    assert len(done) == 1

    code = cache_module.KVCache.in_use.__wrapped__.__code__
    source, start = inspect.getsourcelines(code)
    end = start + next(i for i, text in enumerate(source) if text.strip() == "finally:")
    lines = sorted({line for _, _, line in code.co_lines() if line is not None and code.co_firstlineno < line < end})
    assert len(lines) >= 5
    for stop_at in lines:
        fired = []

        def tracer(frame, event, arg, stop_at=stop_at, fired=fired):
            if frame.f_code is not code:
                return None

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == stop_at and not fired:
                    fired.append(linecache.getline(frame.f_code.co_filename, stop_at).strip())
                    raise KeyboardInterrupt
                return local
            return local

        before = sys.gettrace()  # (coverage's or a debugger's: put back after)
        sys.settrace(tracer)
        try:
            lm.generate([[8, 9]], cache=first.cache, **kw)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(before)
        assert first.cache.users == [], (stop_at, fired)


def test_a_failed_turn_goes_back_to_where_the_cache_stood_when_it_took_the_cache(monkeypatch):
    """generate took the mark it goes back to on failure before it claimed the cache: taken while another thread's
    turn ran, and claimed once that turn had ended, a failure went back past the other turn, dropping it from the
    conversation unsaid. The other thread's turn is forced to end between the two here."""
    import threading

    import blockpress.cache as cache_module

    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    cache = lm.generate([[5, 6, 7]], return_cache=True, **kw).cache
    real_in_use, main = cache_module.KVCache.in_use, threading.get_ident()
    arrived, other_done = threading.Event(), threading.Event()

    def late_in_use(self):  # the second thread is held at its claim until the first thread's turn has ended
        if threading.get_ident() != main and not arrived.is_set():
            arrived.set()
            other_done.wait(60)
        return real_in_use(self)

    monkeypatch.setattr(cache_module.KVCache, "in_use", late_in_use)
    held = lm.stream([[8, 9]], cache=cache, **kw)
    next(held)  # the first thread's turn has begun

    def failing(logits, rows):
        raise RuntimeError("the second turn fails")

    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(
        RuntimeError, lm.generate, [[1, 2]], cache=cache, logits_processor=failing, **kw)))
    thread.start()
    assert arrived.wait(60)
    for _ in held:  # the first thread's turn ends and lets the cache go
        pass
    after_first = (cache.length, cache.next_pos.tolist())
    other_done.set()
    thread.join()
    assert failed and (cache.length, cache.next_pos.tolist()) == after_first


def test_a_chat_turn_beside_an_open_stream_of_the_same_thread_says_so():
    """A second chat_stream on a cache whose first is still open was refused as a cache "extended by generate or
    stream since", which names neither the open stream nor what to do."""
    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    first = lm.chat([{"role": "user", "content": "hello there"}], return_cache=True, **kw)
    ids = lm.chat_prompt([{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.texts[0]},
                          {"role": "user", "content": "and then"}])
    held = lm.chat_stream(ids, cache=first.cache, **kw)
    next(held)
    with pytest.raises(ValueError, match="in use by a stream that is open, suspended between its events"):
        next(lm.chat_stream(ids, cache=first.cache, **kw))
    with pytest.raises(ValueError, match="in use by a stream that is open, suspended between its events"):
        lm.chat_ids(ids, cache=first.cache, **kw)
    done = [e for e in held if type(e).__name__ == "Done"]
    assert done and first.cache.users == []
    assert lm.chat_ids(ids, cache=first.cache, **kw).texts  # the next turn, once the stream has ended


def test_a_cache_and_an_output_holding_one_show_in_a_line():
    """A notebook showing `out` or `out.cache` printed every layer's keys and values (682,744 characters for a
    30-layer tiny model, copied from the device on a GPU): a cache shows its shape in one line."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    out = lm.generate([[3, 4, 5], [6, 7, 8]], max_new_tokens=4, max_denoising_steps=2, seed=0, return_cache=True)
    cache = out.cache
    shown = repr(cache)
    assert shown == (f"KVCache(rows=2, layers={len(cache.keys)}, length={cache.length}, capacity={cache.capacity}, "
                     f"dtype={cache.keys[0].dtype}, device=cpu)")
    assert shown in repr(out) and len(repr(out)) < 4_000


def test_no_call_continues_a_cache_while_a_stream_over_it_is_suspended():
    """A stream's claim was its starting thread's for its whole life, so that thread's own next call went on beside it
    (two async handlers taking turns on one event loop, a stream's consumer calling generate): both wrote the same
    slots and both replies came out wrong, silently. A stream resumed in another thread (an executor's pool) refused
    the starter's calls and let the others through."""
    import concurrent.futures

    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    cache = lm.generate([[5, 6, 7]], return_cache=True, **kw).cache
    alone = lm.generate([[8, 9]], cache=copy.deepcopy(cache), **kw).sequences
    held = lm.stream([[8, 9]], cache=cache, **kw)
    next(held)
    for call in (lambda: lm.generate([[1, 2]], cache=cache, **kw), lambda: list(lm.stream([[1]], cache=cache, **kw)),
                 lambda: lm.generate_ar([[1, 2]], cache=cache, max_new_tokens=2)):
        with pytest.raises(ValueError, match="in use by a stream that is open, suspended between its events"):
            call()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # resumed in a pool thread, then a call from another
        pool.submit(next, held).result()
        with pytest.raises(ValueError, match="in use by a stream"):
            pool.submit(lambda: lm.generate([[1]], cache=cache, **kw)).result()
        done = pool.submit(lambda: [e for e in held if type(e).__name__ == "Done"]).result()
    assert torch.equal(done[0].output.sequences, alone) and cache.users == []
    assert lm.generate([[1, 2]], cache=cache, **kw).num_new_tokens.item() == 8  # free once the stream has ended
    # and once it has handed out its Done, though its caller holds it open (a `break` at Done, a notebook's next())
    held = lm.stream([[3]], cache=cache, **kw)
    done = next(e for e in held if type(e).__name__ == "Done")
    assert cache.users == [] and lm.generate([[4]], cache=done.output.cache, **kw).num_new_tokens.item() == 8
    held.close()


def test_a_chat_stream_held_open_after_its_turn_leaves_the_cache_to_the_next_call():
    """A chat_stream held open past its Done (a notebook's next()) refused the next chat turn ("another call of this
    thread is continuing it"); one held open past its Cancelled let a generate in, then, closed, undid the turn
    again, on a cache that now held the generate's turn, and dropped it unsaid."""
    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    conv = [{"role": "user", "content": "hello there"}]
    first = lm.chat(conv, return_cache=True, **kw)
    conv += [{"role": "assistant", "content": first.texts[0]}, {"role": "user", "content": "and then"}]
    held = lm.chat_stream(lm.chat_prompt(conv), cache=first.cache, **kw)
    done = next(e for e in held if type(e).__name__ == "Done")
    assert first.cache.users == []
    assert lm.chat(conv + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
                   cache=done.output.cache, **kw).texts
    held.close()

    cache = lm.chat(conv, return_cache=True, **kw).cache
    cancelled = lm.chat_stream(lm.chat_prompt(conv + [{"role": "assistant", "content": "y"}, {"role": "user",
                                                                                             "content": "go"}]),
                               cache=cache, cancelled=lambda: True, **kw)
    assert type(next(e for e in cancelled if type(e).__name__ == "Cancelled")).__name__ == "Cancelled"
    before = cache.length  # (the conversation the turn began from: what the cancelled turn left)
    lm.generate([[5, 6, 7]], cache=cache, **kw)  # a turn of its own, beside the stream held open
    after = cache.length
    cancelled.close()
    assert after > before and cache.length == after  # (the closed stream's undo ran once, at its Cancelled)


def test_a_chat_cache_a_generate_extended_and_truncate_took_back_continues_the_chat():
    """The docs say a chat cache extended since by generate is refused by chat, and truncating it (to a mark) is fine:
    but the mark did not bring back the tokens the cache records (generate's encode forgets them), so chat refused
    the truncated cache all the same. Continued, it answers as the conversation does without a cache."""
    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=1)
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    conv = [{"role": "user", "content": "hello there"}]
    first = lm.chat(conv, return_cache=True, **kw)
    mark = first.cache.mark()
    lm.generate([[5, 6, 7]], cache=first.cache, **kw)  # a side turn ...
    assert first.cache.tokens is None
    first.cache.truncate(mark)  # ... taken back out
    conv += [{"role": "assistant", "content": first.texts[0]}, {"role": "user", "content": "and then"}]
    assert lm.chat(conv, cache=first.cache, **kw).texts == lm.chat(conv, **kw).texts


def test_a_cache_and_an_output_holding_one_pickle_and_the_copy_continues_alike():
    """A cache with a live mark (every continuing call takes one) did not pickle (its marks' WeakSet and weak
    references), nor torch.save, nor an output holding it: the copy has no marks (a mark names its own cache)."""
    import io
    import pickle

    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=0, sampler="greedy")
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    out = lm.generate([[2, 3, 4]], return_cache=True, **kw)
    mark = out.cache.mark()
    copied = pickle.loads(pickle.dumps(out))
    buffer = io.BytesIO()
    torch.save(out.cache, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert len(copied.cache.marks) == 0 and len(out.cache.marks) == 1
    with pytest.raises(ValueError, match="made on another cache"):
        copied.cache.truncate(mark)
    want = lm.generate([[5]], cache=copy.deepcopy(out.cache), **kw).new_tokens
    assert torch.equal(lm.generate([[5]], cache=copied.cache, **kw).new_tokens, want)
    assert torch.equal(lm.generate([[5]], cache=loaded, **kw).new_tokens, want)


def test_infill_continuing_a_cache_asks_for_the_turns_prompt_rather_than_a_bos_mid_conversation():
    """infill's default prompt is BOS, which starts a sequence: continuing a cache it put a BOS in the middle of the
    conversation (the fills went wrong). It asks for the turn's text instead; with one, it fills as the whole
    conversation given as the prompt does."""
    kw = dict(max_new_tokens=4, max_denoising_steps=2, seed=0, sampler="greedy")
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    first = lm.generate([[2, 3, 4]], return_cache=True, **kw)
    held = first.cache.length
    with pytest.raises(ValueError, match="prompt: infill continuing a cache needs the turn's text"):
        lm.infill([[7, -1, -1, 8]], cache=first.cache, **kw)
    assert first.cache.length == held  # (refused before anything was encoded)
    conversation = [2, 3, 4, *first.new_tokens[0].tolist()]
    alone = lm.infill([[7, -1, -1, 8]], prompt=[conversation + [9]], **kw)
    continued = lm.infill([[7, -1, -1, 8]], prompt=[[9]], cache=first.cache, **kw)
    assert torch.equal(continued.new_tokens, alone.new_tokens)
    assert lm.infill([[7, -1, -1, 8]], cache=None, **kw).sequences[0, 0].item() == lm.config.text.bos_token_id


def test_a_batch_of_conversations_continued_gets_the_max_length_budget_it_gets_without_the_cache():
    """max_length less the prompt is the default count: continuing a batch whose rows kept unlike prefixes, the
    prompt counted the cache's slots (the longest row's prefix) + the new part's padded width (the other row's new
    tokens), so the batch got fewer new tokens with the cache (34) than without it (42). It counts the widest
    conversation, as the same rows passed whole do; a call's max_length alike."""
    lm = blockpress.random_model(blockpress.ModelConfig.preset("tiny"), seed=0,
                                 tokenizer=train_bpe_tokenizer([""], vocab_size=300))
    lm.generation_config.update(max_new_tokens=None, max_length=60, max_denoising_steps=2)
    kw = dict(seed=0, sampler="greedy")
    first = lm.chat_ids([[2, *range(40, 51)], [2, 60, 61]], return_cache=True, max_new_tokens=4, **kw).cache
    second = [first.tokens[0] + [70, 71], first.tokens[1] + [70, 71] + [72] * 8]  # 18 and 17 tokens
    assert first.length == 16 and [len(r) for r in second] == [18, 17]
    for call in ({}, {"max_length": 50}):
        alone = lm.chat_ids(second, **call, **kw).new_tokens.shape[1]
        assert alone == call.get("max_length", 60) - 18
        assert lm.chat_ids(second, cache=copy.deepcopy(first), **call, **kw).new_tokens.shape[1] == alone
        stream = lm.chat_stream(second, cache=copy.deepcopy(first), **call, **kw)
        assert [e for e in stream if isinstance(e, blockpress.Done)][0].output.new_tokens.shape[1] == alone
