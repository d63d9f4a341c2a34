"""blockpress inside other programs: forked workers, interrupted calls, an LM changed under a running stream."""

import subprocess
import sys
import textwrap

import pytest

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
