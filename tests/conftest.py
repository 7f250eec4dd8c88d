import warnings

import pytest
import torch

from offloadkit.testing import build_llama, make_batch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_llama():
    return build_llama("tiny")


@pytest.fixture
def tiny_batch():
    return make_batch(256, batch=2, seq_len=32)


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
