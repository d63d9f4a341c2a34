import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))
# One thread: the suite's models are small (the random ones hidden 32; the shipped ones 1-6 million weights), too
# small for a second thread to take much of their ops, and on a busy 2-core machine (CI's neighbours, a server
# test's own threads, a subprocess beside the test) two OpenMP threads wait on each other at every op: 20 training
# steps of test_train.py's model took 15-27 s on two threads and 0.9-1.1 s on one, side by side on a loaded machine.
torch.set_num_threads(1)

# A background job of a non-interactive shell (`pytest ... &` in a script) starts with SIGINT ignored, which a training
# run rightly leaves ignored (nohup's SIGHUP alike): the tests that send themselves a Ctrl-C assume Python's own
# handler, which an interactive run has, and ran on past it. The tests of an ignored signal set one themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Property tests draw the same examples on every run ("ci", the default): a failure then reproduces, and CI's
# verdict does not hang on which examples a run happened to draw. A batch row equals its run alone only up to
# float rounding (MKL's GEMMs round a row by the batch's shape), so a rare drawn example with a near tie can flip
# a draw; fixed examples keep such a flip from failing a run at random. HYPOTHESIS_PROFILE=explore draws
# fresh examples, to look for new failures.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def ref_checkpoint(tmp_path_factory):
    """(path, reference model) for a tiny random DiffusionGemma saved by transformers."""
    from reference import make_reference

    path = tmp_path_factory.mktemp("ref")
    model = make_reference(path)
    return path, model


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count itself (to keep a slow one off the other core) would leave every later
    test on its count (one thread for the rest of the suite, at half the speed). (main() puts --threads' back.)"""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
