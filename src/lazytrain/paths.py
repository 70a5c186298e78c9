"""Where LazyTrain keeps files of its own between runs (the default job's model and data, remembered plans)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the default job's model directory and data files are made once, and plans are remembered:
    $LAZYTRAIN_CACHE, else ~/.cache/lazytrain."""
    return Path(os.environ.get("LAZYTRAIN_CACHE", "~/.cache/lazytrain")).expanduser()
