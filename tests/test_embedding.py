"""blockpress inside other programs: forked workers, interrupted calls, an LM changed under a running stream."""

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

