"""Shared test setup."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets an empty LazyTrain cache of its own (subprocesses inherit it): no test reads or writes the
    user's ~/.cache/lazytrain (the default job's files, the plans `lazytrain train` remembers), so a plan
    remembered by an earlier run never decides a test's plan."""
    monkeypatch.setenv("LAZYTRAIN_CACHE", str(tmp_path_factory.mktemp("lazytrain-cache")))


@pytest.fixture
def two_threads():
    """torch on two threads for the test (the optimizer's multi-thread path needs torch.get_num_threads() > 1; it
    is 1 on a one-core CI runner), restored after."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)
