"""Where LazyTrain keeps files of its own between runs (the default job's model and data, remembered plans), and
what kind of file system a directory is on."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the default job's model directory and data files are made once, and plans are remembered:
    $LAZYTRAIN_CACHE, else ~/.cache/lazytrain."""
    return Path(os.environ.get("LAZYTRAIN_CACHE", "~/.cache/lazytrain")).expanduser()


RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


def ram_backed(directory: str | Path) -> str | None:
    """The file system type when `directory` lies on one kept in RAM (tmpfs, ramfs: what it holds is host memory),
    else None (also where /proc/mounts cannot be read)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    path = str(Path(directory).resolve())
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind if kind in RAM_FILE_SYSTEMS else None
