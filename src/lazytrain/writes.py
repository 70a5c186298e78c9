"""The one write path: every file a run or a command writes goes through here, whole or not at all.

A file is written under a temporary name beside it (`.<name>.<pid>.tmp`), fsynced and renamed into place, so a
reader sees the old file or the new one, never half of one. Any failure -- an `OSError` (a full disk, a read-only
or vanished directory), safetensors' `SafetensorError`, a `RuntimeError` from torch's or safetensors' writers --
becomes one `WriteFailed` line naming the path, why, and what to do next; the temporary files are removed first.
Callers stop on it: nothing after a failed write pretends it happened.

`remove` deletes a path without following symbolic links: a link named like a run's file is unlinked, never the
directory it points to.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from lazytrain.errors import LazyTrainError

# What a writer raises on a full disk or a vanished directory (torch's and safetensors' Rust writers raise
# RuntimeError / SafetensorError, not OSError).
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, SafetensorError, RuntimeError)


class WriteFailed(LazyTrainError):
    """A write of `path` failed; the message is the one line a user sees."""

    def __init__(self, path: Path, reason: str, then: str) -> None:
        super().__init__(f"cannot write {path} ({reason}){'; ' + then if then else ''}")
        self.path, self.reason = path, reason


def reason(err: BaseException) -> str:
    """A write error in a few words: the OS's (`No space left on device`) or the first line of the message."""
    if isinstance(err, WriteFailed):
        return err.reason
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    for words in ("No space left on device", "Read-only file system", "Permission denied", "No such file",
                  "Disk quota exceeded"):
        if words.lower() in text.lower():
            return words
    return text[:200]


def temporary(path: Path) -> Path:
    """The temporary name `path` is written under (same directory: the rename stays on one file system)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def writing(path: Path, *, then: str = "", temporaries: tuple[Path, ...] = ()) -> Iterator[None]:
    """Run a write of `path`; on any write error remove `temporaries` and raise one `WriteFailed` line."""
    try:
        yield
    except WriteFailed:
        for tmp in temporaries:
            remove(tmp)
        raise
    except WRITE_ERRORS as err:
        for tmp in temporaries:
            remove(tmp)
        raise WriteFailed(path, reason(err), then) from None


def write_atomic(path: str | Path, data: str | bytes, *, then: str = "") -> Path:
    """Write `data` to `path` whole (temporary name, fsync, rename); a failure leaves the previous file as it was
    and no temporary behind."""
    path = Path(path)
    tmp = temporary(path)
    with writing(path, then=then, temporaries=(tmp,)):
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a file, a link or a directory tree, never following a link; what cannot be removed stays."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def alive(pid: int) -> bool:
    """A process `pid` runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_temporaries(parent: Path, name: str) -> None:
    """Remove `parent/.<name>.tmp-<pid>` left by processes that no longer run (killed mid-write); a running
    process's stays."""
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp-(\d+)")
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m and int(m.group(1)) != os.getpid() and not alive(int(m.group(1))):
            remove(p)
