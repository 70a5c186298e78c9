"""Host-side stores: packed layer weights, offloaded boundary activations, NVMe spill files.

- `WeightGroup`: one layer's (or the loss head's) parameters packed densely, in the compute dtype, into
  one host buffer that starts on a 4 KiB boundary, so a layer crosses the link as one copy.
  In fp32 the model's parameters are re-pointed at views of the buffer (no second copy; the optimizer
  updates the buffer in place). In bf16 the buffer is a compute-dtype copy of the fp32 master
  parameters, re-packed before every step: fused optimizers (torch's fused AdamW, our 8-bit kernel) write
  parameters in place without bumping tensor version counters, so no cheaper staleness test is reliable.
- `ActivationStore`: host buffers for `cpu` boundaries and files for `nvme` boundaries, with a CRC32
  checked on read and every file closed when the step ends. Spill files have no name (O_TMPFILE, or
  unlinked right after creation): SIGKILL, SIGTERM or a crash leave nothing behind, and nobody can
  delete one mid-run; the kernel frees the blocks when the descriptor closes or the process ends.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.errors import LazyTrainError

ALIGN_BYTES = 4096
SPILL_PREFIX = "lazytrain-"
STALE_NAME = re.compile(r"^lazytrain-(\d+)-.*\.(spill|bin)$")  # pid in the name
SPILL_DIR_PREFIX = "lazytrain-nvme-"
STALE_DIR = re.compile(r"^lazytrain-nvme-(\d+)-\w+$")


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its group's flat buffer (elements)."""

    name: str  # name in the template module, for torch.func.functional_call
    offset: int
    numel: int
    shape: tuple[int, ...]


class WeightGroup:
    """The parameters of one layer (or the head) in one contiguous, aligned host buffer."""

    def __init__(self, name: str, named_params: list[tuple[str, torch.nn.Parameter]], dtype: torch.dtype,
                 host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self.name = name
        self.params = [p for _, p in named_params]
        self.dtype = dtype
        slots, offset = [], 0
        for pname, p in named_params:  # packed densely: the device slot holds exactly the layer's bytes
            slots.append(Slot(pname, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        self.buffer = aligned_empty(offset, dtype, host_empty)
        self.aliased = all(p.dtype == dtype for p in self.params)
        self._ptrs: list[int] = []
        self.pack(force=True)

    @property
    def num_bytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """`flat` (a device slot or this buffer) cut into the named parameter tensors."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}

    def _stale(self) -> bool:
        if self.aliased:  # parameters are views of the buffer unless someone replaced p.data
            return [p.data_ptr() for p in self.params] != self._ptrs
        return True  # a compute-dtype copy of the fp32 master: always refresh (see the module docstring)

    def pack(self, force: bool = False) -> bool:
        """Bring the buffer up to date with the parameters; returns whether it copied anything."""
        if not force and not self._stale():
            return False
        with torch.no_grad():
            for s, p in zip(self.slots, self.params, strict=True):
                view = self.buffer[s.offset:s.offset + s.numel].view(s.shape)
                view.copy_(p.detach())
                if self.aliased:
                    p.data = view  # fp32: the parameter *is* the streamed buffer
        self._ptrs = [p.data_ptr() for p in self.params]
        return True

    def adopt(self, buffer: torch.Tensor) -> None:
        """Use `buffer` (this group's packed weights already in it, e.g. a node's shared-memory copy) as the host
        buffer from now on; fp32 parameters are re-pointed at it, so the old buffer is freed."""
        if buffer.dtype != self.dtype or buffer.numel() != self.numel:
            raise LazyTrainError(f"{self.name}: a buffer of {buffer.numel()} {buffer.dtype} elements cannot hold "
                                 f"{self.numel} {self.dtype} elements")
        self.buffer = buffer
        if self.aliased:
            for s, p in zip(self.slots, self.params, strict=True):
                p.data = buffer[s.offset:s.offset + s.numel].view(s.shape)
        self._ptrs = [p.data_ptr() for p in self.params]

    def accumulate_grads(self, flat_grad: torch.Tensor, scale: float = 1.0) -> None:
        """Add a flat gradient (compute dtype, this group's layout) into each parameter's fp32 `.grad`."""
        for s, p in zip(self.slots, self.params, strict=True):
            g = flat_grad[s.offset:s.offset + s.numel].view(s.shape)
            add_grad(p, g, scale)


def aligned_empty(numel: int, dtype: torch.dtype,
                  host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> torch.Tensor:
    """A flat host tensor whose first byte sits on a 4 KiB boundary (one large DMA per layer)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = host_empty((numel * size + ALIGN_BYTES,), torch.uint8)
    skip = -raw.data_ptr() % ALIGN_BYTES
    return raw[skip:skip + numel * size].view(dtype)


def add_grad(p: torch.nn.Parameter, g: torch.Tensor, scale: float = 1.0) -> None:
    """`p.grad += scale * g` in p's dtype, creating `.grad` on first use (what autograd does)."""
    if p.grad is None:
        p.grad = g.to(p.dtype, copy=True)
        if scale != 1.0:
            p.grad.mul_(scale)
    elif scale != 1.0:
        p.grad.add_(g.to(p.dtype), alpha=scale)
    else:
        p.grad.add_(g.to(p.dtype))


class ActivationStore:
    """Host buffers (`cpu` tier) and spill files (`nvme` tier) for boundary activations of one step."""

    def __init__(self, nvme_dir: Path, host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        self.nvme_dir = Path(nvme_dir)
        self._host_empty = host_empty
        self._host: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # reused across steps
        self._crc: dict[int, int] = {}
        self._files: dict[int, tuple[int, int]] = {}  # boundary -> (fd of its nameless spill file, bytes)
        self.host_bytes_in_use = 0
        self.peak_host_bytes = 0
        self.nvme_bytes_in_use = 0
        self.peak_nvme_bytes = 0

    def host_buffer(self, boundary: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The host buffer of `boundary` (pinned on CUDA), allocated once and recycled across steps."""
        key = (boundary, tuple(shape), dtype)
        if key not in self._host:
            self._host[key] = self._host_empty(tuple(shape), dtype)
        return self._host[key]

    def note_host(self, num_bytes: int) -> None:
        self.host_bytes_in_use += num_bytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes_in_use)

    def write(self, boundary: int, host: torch.Tensor) -> None:
        """Write `host` to a new spill file for the boundary and remember its CRC32 (runs on the nvme_write link)."""
        data = _bytes_view(host)
        fd = -1
        try:
            fd = open_spill_file(self.nvme_dir)
            done = 0
            while done < len(data):  # os.pwrite may write less than asked
                done += os.pwrite(fd, data[done:], done)
        except OSError as err:
            if fd >= 0:
                os.close(fd)  # the partial file (disk full) goes with its only reference
            raise LazyTrainError(f"cannot write an NVMe spill file in {self.nvme_dir}: {err.strerror}; free space "
                                 "there or pass another nvme_dir") from None
        self._crc[boundary] = zlib.crc32(data)
        self._files[boundary] = (fd, len(data))
        self.nvme_bytes_in_use += len(data)
        self.peak_nvme_bytes = max(self.peak_nvme_bytes, self.nvme_bytes_in_use)

    def read(self, boundary: int, host: torch.Tensor) -> None:
        """Read the boundary's spill file into `host` and verify its CRC32 (runs on the nvme_read link)."""
        data = _bytes_view(host)
        fd, _ = self._files[boundary]
        n = 0
        try:
            while n < len(data):
                got = os.preadv(fd, [data[n:]], n)
                if got == 0:
                    break
                n += got
        except OSError as err:
            raise LazyTrainError(f"cannot read an NVMe spill file in {self.nvme_dir}: {err.strerror}; check the "
                                 "disk under nvme_dir") from None
        if n != len(data) or zlib.crc32(data) != self._crc[boundary]:
            raise LazyTrainError(f"an NVMe spill file in {self.nvme_dir} is corrupt (read {n} of {len(data)} bytes, "
                                 "checksum mismatch); check the disk under nvme_dir")

    def fileno(self, boundary: int) -> int:
        """The open descriptor of the boundary's spill file (it has no name; tests reach the bytes through it)."""
        return self._files[boundary][0]

    def remove(self, boundary: int) -> None:
        entry = self._files.pop(boundary, None)
        if entry is not None:
            fd, num_bytes = entry
            os.close(fd)  # the last reference: the file system frees the blocks
            self.nvme_bytes_in_use -= num_bytes
        self._crc.pop(boundary, None)

    def end_step(self) -> None:
        """Close every spill file of the step (also after an error)."""
        for boundary in list(self._files):
            self.remove(boundary)
        self.nvme_bytes_in_use = 0
        self.host_bytes_in_use = 0

    def __del__(self) -> None:  # an executor dropped mid-step still returns its descriptors
        for fd, _ in getattr(self, "_files", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def open_spill_file(directory: Path) -> int:
    """A read-write file in `directory` that has no name, so nothing is left behind however the process ends.

    Linux O_TMPFILE creates it nameless; where the file system lacks it, a named file is created and unlinked at
    once (`clean_stale_spill_files` removes such a file if the process died in between).
    """
    try:
        return os.open(directory, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    path = directory / f"{SPILL_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.spill"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    return fd


def clean_stale_spill_files(directory: Path) -> list[Path]:
    """Remove spill files left in `directory` by processes that no longer exist (pid in the name); returns them.

    Covers named spill files of the fallback in `open_spill_file` and of LazyTrain versions before nameless
    files (`lazytrain-<pid>-...-boundary<i>.bin`). A live process's files are never touched.
    """
    removed = []
    for path in directory.glob(f"{SPILL_PREFIX}*"):
        match = STALE_NAME.match(path.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass  # another process cleaned it first, or the directory is read-only (refused elsewhere)
    return removed


def spill_dir(parent: Path) -> Path:
    """A new spill directory `lazytrain-nvme-<pid>-<random>` under `parent` (the default nvme_dir), after removing
    those of processes that no longer exist: normal exit removes a device's own, SIGKILL cannot."""
    for path in parent.glob(f"{SPILL_DIR_PREFIX}*"):
        match = STALE_DIR.match(path.name)
        if match is not None and path.is_dir() and not _process_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SPILL_DIR_PREFIX}{os.getpid()}-", dir=parent))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
