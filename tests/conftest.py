import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def ref_checkpoint(tmp_path_factory):
    """(path, reference model) for a tiny random DiffusionGemma saved by transformers."""
    from reference import make_reference

    path = tmp_path_factory.mktemp("ref")
    model = make_reference(path)
    return path, model
