"""Positioned file I/O on host buffers: nameless files, whole-buffer reads and writes, one-line errors.

Shared by the activation spill files (store.py) and the optimizer state files (statefiles.py).

- `open_nameless`: a read-write file that has no name (Linux O_TMPFILE; elsewhere created and unlinked at once),
  so SIGKILL, SIGTERM or a crash leave nothing behind and the kernel frees its blocks when the descriptor closes.
  `direct=True` asks for O_DIRECT (no page cache: the SSD's rate, no host memory spent on cached copies); where the
  file system refuses it at open, the file is opened without it.
- `write_all` / `read_all`: the whole buffer at an offset (os.pwrite / os.preadv may move less than asked), into
  and out of the buffer itself (no bytes object in between).
- `io_error`: an OSError as one line that names the directory and says what to do (ENOSPC, EROFS, EIO, ...).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from pathlib import Path

import torch

from lazytrain.errors import LazyTrainError

ALIGN_BYTES = 4096  # O_DIRECT needs buffer address, file offset and length aligned to the logical block (<= 4 KiB)
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def open_nameless(directory: Path, prefix: str, direct: bool = False) -> tuple[int, bool]:
    """(descriptor, whether O_DIRECT is on) of a new read-write file in `directory` without a name.

    Where O_TMPFILE is missing, `<prefix><pid>-<random>.spill` is created and unlinked at once (store.py's
    `clean_stale_spill_files` removes one left by a process that died in between). O_DIRECT refused at open
    (EINVAL) falls back to the page cache.
    """
    flags = os.O_RDWR | os.O_CLOEXEC
    if direct:
        try:
            return _open_nameless(directory, prefix, flags | os.O_DIRECT), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return _open_nameless(directory, prefix, flags), False


def _open_nameless(directory: Path, prefix: str, flags: int) -> int:
    try:
        return os.open(directory, flags | os.O_TMPFILE, 0o600)
    except OSError as err:
        if err.errno not in _NO_TMPFILE:
            raise
    path = Path(directory) / f"{prefix}{os.getpid()}-{secrets.token_hex(6)}.spill"
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    return fd


def set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off on an open descriptor (off: a file system that accepted it at open but refuses the
    I/O, or a copy at unaligned offsets)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (raises OSError)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def read_all(fd: int, data: memoryview, offset: int) -> int:
    """Read into all of `data` from `offset`; returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(data):
        got = os.preadv(fd, [data[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    if not t.is_contiguous():
        raise ValueError("bytes_view needs a contiguous tensor (a copy would be read or written instead)")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


_WHAT_TO_DO = {
    errno.ENOSPC: "free space there or set nvme_dir to another disk",
    errno.EDQUOT: "free space there (disk quota) or set nvme_dir to another disk",
    errno.EROFS: "the file system is read-only; set nvme_dir to a writable disk",
    errno.EACCES: "set nvme_dir to a directory this user may write",
    errno.EPERM: "set nvme_dir to a directory this user may write",
    errno.EIO: "the disk reported an I/O error; check it (dmesg, smartctl) or set nvme_dir to another disk",
}


class StorageError(LazyTrainError):
    """A disk under nvme_dir refused a read or a write (full, read-only, failing): one line; mid-run the trainer
    stops and says which checkpoint is intact and how to continue."""


def io_error(err: OSError, directory: Path, action: str) -> StorageError:
    """One line for `err` raised while doing `action` (e.g. "write an optimizer state file") in `directory`."""
    advice = _WHAT_TO_DO.get(err.errno, "check the disk under nvme_dir or set nvme_dir to another one")
    return StorageError(f"cannot {action} in {directory}: {err.strerror or err}; {advice}")


_NO_COPY_FILE_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)
_BOUNCE_BYTES = 8 << 20


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, num_bytes: int) -> None:
    """Copy `num_bytes` between two files inside the kernel (os.copy_file_range: no detour through this process's
    memory, a reflink where the file system shares blocks); where it is refused (across file systems on older
    kernels, no support), through an 8 MiB buffer. Raises OSError; both descriptors must be without O_DIRECT."""
    done = 0
    try:
        while done < num_bytes:
            got = os.copy_file_range(src_fd, dst_fd, num_bytes - done, src_offset + done, dst_offset + done)
            if got == 0:
                raise OSError(errno.EIO, "the source file ended early")
            done += got
        return
    except OSError as err:
        if err.errno not in _NO_COPY_FILE_RANGE:
            raise
    bounce = bytearray(min(_BOUNCE_BYTES, num_bytes - done))
    view = memoryview(bounce)
    while done < num_bytes:
        part = view[:min(len(view), num_bytes - done)]
        if read_all(src_fd, part, src_offset + done) != len(part):
            raise OSError(errno.EIO, "the source file ended early")
        write_all(dst_fd, part, dst_offset + done)
        done += len(part)
