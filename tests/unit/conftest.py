"""Shared fixtures of the unit tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: their models are tiny, and on a shared
    2-core machine a second spinning thread costs far more than it gives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
