"""Shared test setup: the suite runs offline (Hugging Face fails fast instead of retrying), and the
fixtures many test files use: one intra-op thread, a data cache of the session's own."""
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of many small ops: on a shared 2-core machine every
    parallel op waits for both threads to be scheduled. Results are the same bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    """This test session's own data cache, shared by its tests (data tokenised once)."""
    return tmp_path_factory.getbasetemp() / "cache"


@pytest.fixture
def private_cache(cache_root, monkeypatch):
    """Point ``LOSSYSIM_CACHE`` at the session's cache, so a test neither reads nor fills the user's."""
    monkeypatch.setenv("LOSSYSIM_CACHE", str(cache_root))
