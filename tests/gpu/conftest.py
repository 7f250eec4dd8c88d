"""GPU suite fixtures."""

import pytest

from offloadkit.testing import slow_copies


@pytest.fixture
def slow():
    """``slow(cycles, kinds=...)`` delays device copies until the test ends."""
    handles = []

    def start(cycles, kinds=("d2h", "h2d")):
        handles.append(slow_copies(cycles, kinds))

    yield start
    for h in handles:
        h.remove()


@pytest.fixture
def clean_cuda():
    """Free cached device memory before and after a test that measures or needs much of it."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()
