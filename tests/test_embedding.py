"""blockpress inside other programs: forked workers, interrupted calls, an LM changed under a running stream."""

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

import blockpress


@pytest.fixture(scope="module")
def lm():
    return blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_a_worker_forked_after_a_load_generates_instead_of_hanging():
    """GNU OpenMP's thread pool does not survive a fork: after blockpress.load (whose reads run threaded ops) every
    worker of a fork multiprocessing.Pool waited forever in its first generate (killed at 120 s, a 0.5 s job).
    A forked child now runs torch on one thread, as torch's DataLoader workers do; it gets the parent's text,
    and the parent keeps its thread count."""
    script = textwrap.dedent("""
        import multiprocessing, torch, blockpress
        torch.set_num_threads(2)
        lm = blockpress.load("blockpress-code")
        torch.randn(256, 256) @ torch.randn(256, 256)  # the pool is up in the parent whatever load ran
        def work(prompt):
            return torch.get_num_threads(), lm.generate(prompt, max_new_tokens=16).texts[0]
        with multiprocessing.get_context("fork").Pool(1) as pool:
            threads, text = pool.apply_async(work, ("def add(a, b):",)).get(timeout=60)
        assert threads == 1, threads
        assert text == lm.generate("def add(a, b):", max_new_tokens=16).texts[0]
        assert torch.get_num_threads() == 2
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


class Interrupt:
    """A logits processor that raises `error` at its `at`-th call (a Ctrl-C landing mid-generate, a failing hook)."""

    def __init__(self, at, error=KeyboardInterrupt):
        self.calls, self.at, self.error = 0, at, error

    def __call__(self, logits, rows):
        self.calls += 1
        if self.calls == self.at:
            raise self.error()
        return logits


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("at", [1, 5])  # in the first canvas, in the third
def test_an_interrupted_turn_leaves_the_cache_as_it_was_and_the_rerun_gets_the_turn(lm, batch, at):
    """A notebook cell `lm.generate(turn, cache=c)` interrupted, then run again: the cache held the prompt and the
    canvases so far (2 or 18 more slots here), and the rerun continued from that half turn: silently another text
    (blockpress-code's differed). The cache now goes back to where it stood, so the rerun is the uninterrupted turn."""
    kw = dict(max_new_tokens=3 * lm.config.canvas_length, max_denoising_steps=2, seed=3,
              min_new_tokens=3 * lm.config.canvas_length)
    first = lm.generate([[3, 4, 5], [6, 7]][:batch], return_cache=True, **kw)
    cache, mark = first.cache, first.cache.mark()
    turn = [[9, 10], [11, 12, 13]][:batch]
    expected = lm.generate(turn, cache=cache, **kw)
    cache.truncate(mark)
    held, length = cache.next_pos.tolist(), cache.length
    with pytest.raises(KeyboardInterrupt):
        lm.generate(turn, cache=cache, logits_processor=Interrupt(at), **kw)
    assert cache.next_pos.tolist() == held and cache.length == length
    again = lm.generate(turn, cache=cache, **kw)
    assert torch.equal(again.new_tokens, expected.new_tokens)


@pytest.mark.parametrize("error", [KeyboardInterrupt, lambda: ValueError("hook")])
def test_an_interrupted_ar_turn_leaves_the_cache_as_it_was(lm, error):
    """generate_ar takes cache= as generate does, but a turn that failed part way (a Ctrl-C, an error in a hook) left
    its prompt and tokens so far in the cache, and the rerun continued from that half turn."""
    first = lm.generate_ar([[3, 4, 5], [6, 7]], max_new_tokens=6, return_cache=True)
    cache, mark = first.cache, first.cache.mark()
    turn = [[9, 10], [11, 12, 13]]
    expected = lm.generate_ar(turn, cache=cache, max_new_tokens=6)
    cache.truncate(mark)
    held, length = cache.next_pos.tolist(), cache.length
    with pytest.raises((KeyboardInterrupt, ValueError)):
        lm.generate_ar(turn, cache=cache, max_new_tokens=6, logits_processor=Interrupt(4, error))
    assert cache.next_pos.tolist() == held and cache.length == length
    assert torch.equal(lm.generate_ar(turn, cache=cache, max_new_tokens=6).new_tokens, expected.new_tokens)


def test_a_stream_that_fails_leaves_the_cache_and_one_left_keeps_its_part(lm):
    """A stream that fails inside (an error, a Ctrl-C) takes its part of the turn back out of the cache, as generate
    does; one that is left (a break) keeps it as documented: the cache may have been continued since."""
    kw = dict(max_new_tokens=3 * lm.config.canvas_length, max_denoising_steps=2, seed=3,
              min_new_tokens=3 * lm.config.canvas_length)
    cache = lm.generate([3, 4, 5], return_cache=True, **kw).cache
    length = cache.length
    with pytest.raises(ValueError, match="hook"):
        for _ in lm.stream([9, 10], cache=cache, logits_processor=Interrupt(3, lambda: ValueError("hook")), **kw):
            pass
    assert cache.length == length
    events = lm.stream([9, 10], cache=cache, **kw)
    next(events)
    events.close()
    assert cache.length > length


def test_a_chat_cache_interrupted_under_generate_keeps_its_known_tokens(lm):
    """A cache lm.chat returned knows its tokens (the next chat turn encodes only what is new); a generate on it
    that is interrupted gives them back with the cache, so a chat turn can still continue it."""
    kw = dict(max_new_tokens=8, max_denoising_steps=2, seed=0)
    out = lm.chat_ids([3, 4, 5], return_cache=True, **kw)
    held = [list(row) for row in out.cache.tokens]
    with pytest.raises(KeyboardInterrupt):
        lm.generate([[9, 10]], cache=out.cache, logits_processor=Interrupt(1), **kw)
    assert out.cache.tokens == held
    lm.chat_ids(held[0] + [9, 10], cache=out.cache, **kw)


@pytest.mark.parametrize("change", ["to", "quantize"])
def test_a_stream_whose_lm_changed_since_it_began_stops_with_a_clear_error(change):
    """lm.to / lm.quantize between two events of a stream (a notebook's stream left in a variable, or another
    thread's call while this one runs): the cast went on into torch's "Expected query, key, and value to have the
    same dtype", and the quantize went on silently, the old weights' keys under the new weights. Both now stop at
    the next step, naming what happened, and the LM answers the next call."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    kw = dict(max_new_tokens=3 * lm.config.canvas_length, max_denoising_steps=2, seed=1)
    events = lm.stream([3, 4, 5], **kw)
    next(events)
    lm.to(dtype="bfloat16") if change == "to" else lm.quantize("int8")
    with pytest.raises(RuntimeError, match=r"^model: its weights changed \(lm.to, lm.quantize, a training step\) "
                                           "while this call was running"):
        list(events)
    assert lm.generate([3, 4, 5], **kw).num_new_tokens.tolist() == [3 * lm.config.canvas_length]


@pytest.mark.parametrize("change", ["to", "quantize"])
def test_a_stream_on_a_cache_whose_lm_changed_before_its_first_event_stops_with_a_clear_error(change):
    """A stream is checked when made, but begins at its first event: one continuing a conversation's cache, made
    and then read after lm.quantize, went on silently on a cache of the old weights' keys and the new ones' (and the
    next turn took that cache as current); after lm.to it failed in torch's dtype mismatch. It stops at once, the
    cache untouched, and the next turn refuses the cache by name."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    kw = dict(max_new_tokens=lm.config.canvas_length, max_denoising_steps=2, seed=1)
    first = lm.generate([3, 4, 5], return_cache=True, **kw)
    held = first.cache.tokens
    events = lm.stream([6, 7], cache=first.cache, **kw)
    lm.to(dtype="bfloat16") if change == "to" else lm.quantize("int8")
    with pytest.raises(RuntimeError, match=r"^model: its weights changed"):
        next(events)
    assert first.cache.tokens == held
    with pytest.raises(ValueError, match=r"^cache: (filled before this model's weights changed|built by another mod)"):
        lm.generate([6, 7], cache=first.cache, **kw)  # (after lm.to, the cache's dtype is named first)


OPEN_AT_EXIT = """
import sys

import torch

import blockpress

torch.set_num_threads(1)
lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
kw = dict(max_new_tokens=2 * lm.config.canvas_length, max_denoising_steps=2, seed=1)
cache = (lm.chat_ids if sys.argv[1] == "chat" else lm.generate)([3, 4, 5], return_cache=True, **kw).cache
if sys.argv[1] == "chat":
    events = lm.chat_stream([3, 4, 5, 6, 7, 8], cache=cache, **kw)
else:
    events = lm.stream([6, 7], cache=cache, **kw)
next(events)
if sys.argv[2] == "raise":
    raise ValueError("the caller's own error")
"""


@pytest.mark.parametrize("kind", ["stream", "chat"])
@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_stream_left_open_on_a_cache_at_exit_lets_the_process_end_as_it_would(kind, ending, tmp_path):
    """A stream over a conversation's cache, suspended when the script ended (or failed with its own error), was
    left to the interpreter's teardown: the process aborted (torch's INTERNAL ASSERT in THPVariable_clear, status
    134, a core dump). Open streams are closed at exit, while torch is whole."""
    import subprocess
    import sys

    script = tmp_path / "open_at_exit.py"
    script.write_text(OPEN_AT_EXIT)
    done = subprocess.run([sys.executable, str(script), kind, ending], capture_output=True, text=True, timeout=300)
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr[-2000:]
    assert "INTERNAL ASSERT" not in done.stderr


def test_streams_are_closed_at_exit_though_another_thread_adds_one_meanwhile(monkeypatch):
    """The exit's copy of the open streams raised "Set changed size during iteration" where another thread made a
    stream meanwhile, and no stream was closed: it is copied again."""
    import blockpress.lm as lm_module

    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    events = lm.stream([3, 4, 5], max_new_tokens=8, max_denoising_steps=2, seed=1)
    next(events)

    class Busy(list):  # its first copy meets another thread's addition
        copies = 0

        def __iter__(self):
            Busy.copies += 1
            if Busy.copies == 1:
                raise RuntimeError("Set changed size during iteration")
            return super().__iter__()

    monkeypatch.setattr(lm_module, "_OPEN_STREAMS", Busy([events]))
    lm_module._close_open_streams()
    assert Busy.copies == 2 and inspect.getgeneratorstate(events) == inspect.GEN_CLOSED


def test_generate_ar_on_a_thread_whose_lm_changes_meanwhile_stops_with_a_clear_error():
    """generate_ar checks before each token: weights changed by another thread while it ran (here by the logits
    processor, which runs between two tokens as another thread may) stop it with the same error."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)

    def cast(logits, rows):
        if lm.dtype == torch.float32:
            lm.to(dtype="bfloat16")
        return logits

    with pytest.raises(RuntimeError, match=r"^model: its weights changed"):
        lm.generate_ar([3, 4, 5], max_new_tokens=6, logits_processor=cast)


@pytest.mark.parametrize("ar", [False, True])
def test_weights_cast_in_the_middle_of_a_pass_say_so_instead_of_torchs_dtype_error(ar):
    """Another thread's lm.to lands in the middle of a forward pass (measured with a thread: every time, torch's
    "Expected query, key, and value to have the same dtype", the check between steps too late). Here a hook on
    the first layer casts the model there, as that thread would."""
    lm = blockpress.random_model(blockpress.ModelConfig.tiny(), seed=0)
    passes = []

    def cast_once(module, args, output):
        passes.append(1)
        if len(passes) == 3:
            lm.to(dtype="bfloat16")

    lm.model.layers[0].register_forward_hook(cast_once)
    with pytest.raises(RuntimeError, match=r"^model: its weights changed") as caught:
        if ar:
            lm.generate_ar([3, 4, 5], max_new_tokens=8)
        else:
            lm.generate([3, 4, 5], max_new_tokens=8, max_denoising_steps=4)
    assert "dtype" in str(caught.value.__cause__)


def test_a_progress_bar_where_there_is_no_stderr_is_left_out(monkeypatch):
    """sys.stderr is None under pythonw and some services: load(progress=True) failed there, in tqdm
    ("'NoneType' object has no attribute 'write'"), after reading nothing. It loads, with no bar."""
    monkeypatch.setattr(sys, "stderr", None)
    lm = blockpress.load("blockpress-code", progress=True)
    assert lm.generate("def add(a, b):", max_new_tokens=8).num_new_tokens.tolist() == [8]


def _holes(cache):
    """Whether some row has an invalid slot after a valid one (padding anywhere but on the left)."""
    valid = cache.valid[:, : cache.length]
    return bool((valid[:, :-1] & ~valid[:, 1:]).any())


@pytest.mark.parametrize("leave", ["last commit", "second commit", "cancelled"])
def test_a_batch_stream_left_early_on_a_cache_leaves_it_as_drained(lm, leave):
    """Rows that end at different canvases leave holes in a continued cache, which the end of the stream compacted:
    a stream left at its last Commit (every row ended, Done unread), at an earlier one, or cancelled, skipped that,
    and the next turn of the row that ended first saw fewer earlier tokens than it does alone."""
    c = lm.config.canvas_length
    kw = dict(max_denoising_steps=2, seed=3, eos_token_id=[], sampler="greedy")
    turn = dict(max_new_tokens=[c, 3 * c], **kw)

    def history():
        return lm.generate([[2, 5, 9, 11], [2, 40, 41, 42, 43, 44, 45]], max_new_tokens=c, return_cache=True,
                           **kw).cache

    def next_turn(cache):
        return lm.generate([[3, 4, 5], [6, 7, 8]], max_new_tokens=2 * c, cache=cache, **kw).new_tokens

    drained = history()
    for _ in lm.stream([[60, 61], [80, 81]], cache=drained, **turn):
        pass
    left = history()
    commits = []
    cancel = leave == "cancelled"
    for event in lm.stream([[60, 61], [80, 81]], cache=left, cancelled=lambda: cancel and len(commits) >= 2, **turn):
        if isinstance(event, blockpress.Commit):
            commits.append(event)
            if (leave == "second commit" and len(commits) == 2) or (leave == "last commit" and bool(event.finished.all())):
                break
    assert not _holes(left)
    if leave == "last commit":
        assert left.next_pos.tolist() == drained.next_pos.tolist()
        assert torch.equal(next_turn(left), next_turn(drained))


@pytest.mark.parametrize("engine", ["generate", "generate_ar"])
def test_an_interrupted_ragged_turn_leaves_the_slots_truncate_may_take(lm, engine):
    """A ragged next turn compacts the cache as it encodes; interrupted, it went back to the mark, every slot where
    it was, yet truncate(2) was refused after as "slots 0 and on moved", where the cache before the turn took it."""
    cache = lm.generate([[2, 3], [2, 4]], max_new_tokens=8, max_denoising_steps=2, seed=0, return_cache=True).cache
    assert cache.moved_from is None
    with pytest.raises(KeyboardInterrupt):
        getattr(lm, engine)([[5], [6, 7]], cache=cache, max_new_tokens=4, logits_processor=Interrupt(1))
    assert cache.moved_from is None
    cache.truncate(2)
    assert cache.next_pos.tolist() == [2, 2]
    # the same through the public route: a mark, a ragged turn, truncate(mark)
    cache = lm.generate([[2, 3], [2, 4]], max_new_tokens=8, max_denoising_steps=2, seed=0, return_cache=True).cache
    mark = cache.mark()
    getattr(lm, engine)([[5], [6, 7]], cache=cache, max_new_tokens=4)
    cache.truncate(mark)
    assert cache.moved_from is None
    cache.truncate(2)


def test_a_stream_left_midway_compacts_no_cache_it_cannot_hand_back(lm, monkeypatch):
    """return_cache's cache reaches the caller at Done: a stream left before it (or cancelled) compacted a cache that
    no one could reach, one gather-copy of every layer's keys and values for nothing."""
    from blockpress.cache import KVCache

    compacted = []
    real = KVCache.compact
    monkeypatch.setattr(KVCache, "compact", lambda self: (compacted.append(self), real(self))[1])
    c = lm.config.canvas_length
    kw = dict(max_new_tokens=[c, 3 * c], max_denoising_steps=2, seed=3, eos_token_id=[], sampler="greedy")
    for event in lm.stream([[2, 5, 9], [2, 40, 41]], return_cache=True, **kw):
        if isinstance(event, blockpress.Commit) and event.canvas_index == 1:
            break
    assert compacted == []
    cache = lm.generate([[2, 5, 9], [2, 40, 41]], max_new_tokens=c, return_cache=True, max_denoising_steps=2).cache
    for event in lm.stream([[3], [4]], cache=cache, **kw):
        if isinstance(event, blockpress.Commit) and event.canvas_index == 1:
            break
    assert compacted and compacted[-1] is cache  # the caller's: compacted
