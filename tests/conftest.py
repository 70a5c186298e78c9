"""Shared test setup."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets an empty LazyTrain cache of its own (subprocesses inherit it): no test reads or writes the
    user's ~/.cache/lazytrain (the default job's files, the plans `lazytrain train` remembers), so a plan
    remembered by an earlier run never decides a test's plan."""
    monkeypatch.setenv("LAZYTRAIN_CACHE", str(tmp_path_factory.mktemp("lazytrain-cache")))
