"""The optimizer's state files on the NVMe SSD: one nameless file per layer group, read and written whole in large
aligned blocks on worker threads (the optimizer lane's NVMe ops), and copied to and from checkpoints in the kernel.

Usage (the optimizer lane):

    layouts = {"layer0": GroupLayout([("0.exp_avg", torch.float32, (4096, 4096)), ...]), ...}
    files = StateFiles(nvme_dir, layouts)           # free space checked, files made and preallocated, or one line
    staging = files.staging("layer0")               # a reused, 4 KiB-aligned host buffer (pinned: host_empty)
    files.read("layer0", staging).wait()            # an IOEvent; wait() raises LazyTrainError on ENOSPC/EIO/...
    states = files.layouts["layer0"].views(staging) # name -> tensor views of the staging buffer
    ...update in place...
    event = files.write("layer0", staging)          # wait() before the buffer is reused
    files.save_safetensors("layer0", ckpt / "trainer_state/optimizer/layer0.safetensors")
    files.load_safetensors("layer0", ckpt / "trainer_state/optimizer/layer0.safetensors")   # resume
    files.close()                                   # the kernel frees the blocks (also after SIGKILL)

A group's file is a safetensors file followed by zeros:

    [u64 N][JSON header, N bytes, spaces to the next 4 KiB][tensor data][zeros up to a multiple of 4 KiB]

The data starts on a 4 KiB boundary and is read and written as one aligned extent, so O_DIRECT works (no page
cache: the SSD's rate, no host memory spent on cached copies of what the staging buffer already holds). Tensors lie
back to back (safetensors allows no holes) in order of falling element size, so each starts on its own element
boundary in the staging buffer; the trailing zeros are not part of the safetensors file, so a checkpoint copies
`safetensors_bytes` of it (`save_safetensors`, os.copy_file_range) and `safetensors.torch.load_file` reads the copy.

Design anchors: DeepSpeed's aio (block 1 MiB, queue depth 8, pinned buffers, libaio) and ColossalAI's TensorNVMe
(per-tensor offload, read/compute/write pipelined). Here: plain positioned I/O on `queue_depth` threads (each
blocking call releases the GIL and keeps one request in flight), one pool each for reads and writes (the
program's two NVMe lanes: neither queues behind the other), `block_bytes` per request, one file per group;
benchmarks/nvme.py measures it against the directory's raw sequential rate. No checksum: the SSD has ECC, and
a CRC at ~1 GB/s on one core would be the slowest link.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.runtime.files import (
    ALIGN_BYTES,
    StorageError,
    bytes_view,
    copy_range,
    io_error,
    open_nameless,
    read_all,
    set_direct,
    write_all,
)
from lazytrain.runtime.store import SPILL_PREFIX, aligned_empty
from lazytrain.units import format_bytes

QUEUE_DEPTH = 4  # requests in flight (worker threads); benchmarks/nvme.py
BLOCK_BYTES = 4 << 20  # bytes per request
MAX_HEADER_BYTES = 100 << 20  # safetensors' own cap on a header's size: a larger one is refused, not parsed

#: torch dtype <-> safetensors dtype name.
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _round_up(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class Extent:
    """Where one tensor lies in a group's data (bytes from the data's start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


class GroupLayout:
    """The tensors of one group's state file, their offsets and the file's header.

    tensors: (name, dtype, shape) in any order; they are stored in order of falling element size (stable), so every
    tensor starts on its element boundary. Names follow the checkpoint's "<param index>.<state key>".
    """

    def __init__(self, tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        entries = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in tensors]
        if len({name for name, _, _ in entries}) != len(entries):
            raise ValueError("GroupLayout: tensor names must be unique")
        entries.sort(key=lambda e: -torch.empty((), dtype=e[1]).element_size())
        extents, offset = [], 0
        for name, dtype, shape in entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"GroupLayout: {name} has dtype {dtype}, which safetensors cannot hold")
            num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            extents.append(Extent(name, dtype, shape, offset, num_bytes))
            offset += num_bytes
        self.extents: dict[str, Extent] = {e.name: e for e in extents}
        self.data_bytes = offset
        self.header = safetensors_header(extents)
        self.data_offset = len(self.header)  # a multiple of 4 KiB
        self.padded_data_bytes = max(ALIGN_BYTES, _round_up(self.data_bytes))  # what a read or write moves

    @property
    def file_bytes(self) -> int:
        """Bytes on the disk: header, data and the zeros after it."""
        return self.data_offset + self.padded_data_bytes

    @property
    def safetensors_bytes(self) -> int:
        """The valid safetensors file: header and data."""
        return self.data_offset + self.data_bytes

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor as a view of `buffer` (a staging buffer holding this group's data)."""
        flat = buffer.reshape(-1).view(torch.uint8)
        if flat.numel() < self.data_bytes:
            raise ValueError(f"a buffer of {flat.numel()} bytes cannot hold the {self.data_bytes} of this group")
        return {e.name: flat[e.offset:e.offset + e.num_bytes].view(e.dtype).view(e.shape)
                for e in self.extents.values()}

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> GroupLayout:
        """The layout holding `tensors` (their names, dtypes and shapes)."""
        return cls((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())


def safetensors_header(extents: Sequence[Extent]) -> bytes:
    """The 8-byte size and the JSON header of a safetensors file with `extents` back to back (in the given order,
    offsets as in the extents), padded with spaces (the format allows trailing whitespace) so the data starts on a
    4 KiB boundary."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for e in extents:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [e.offset, e.offset + e.num_bytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    size = _round_up(8 + len(text)) - 8
    return struct.pack("<Q", size) + text + b" " * (size - len(text))


def header_bytes_bound(shapes: Iterable[Sequence[int]], names: Iterable[str], data_bytes: int) -> int:
    """At least the header (`safetensors_header`, page-padded) of a file whose tensors are named `names` and each
    shaped at most as one of `shapes` as text (a parameter's shape: its flat states and block scales print
    shorter), with up to `data_bytes` of data: every name beside every shape, the longest dtype name, offsets of
    data_bytes' digits. What a free-space check counts before the states exist (a page or two a layer, where
    a fixed 1 MiB a file asked for 50 MiB more than a 48-layer model writes)."""
    widest = max((list(shape) for shape in shapes), key=lambda shape: len(json.dumps(shape)), default=[])
    big = 10 ** len(str(data_bytes)) - 1  # no offset prints longer
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for name in names:
        header[name] = {"dtype": "BF16", "shape": widest, "data_offsets": [big, big]}
    return _round_up(8 + len(json.dumps(header, separators=(",", ":"))))


class IOEvent:
    """One submitted read or write of a group: `wait()` returns once every block of it is done (then the buffer
    is free again) and raises a one-line LazyTrainError if any block failed."""

    def __init__(self, blocks: list[Future[None]], describe_error: Callable[[OSError], LazyTrainError]) -> None:
        self._blocks = blocks
        self._describe_error = describe_error
        self.waited = False  # an error of an op nobody waited for surfaces at StateFiles.close

    def done(self) -> bool:
        return all(b.done() for b in self._blocks)

    def wait(self) -> None:
        self.waited = True
        first: BaseException | None = None
        for b in self._blocks:  # every block, even after a failure: none may touch the buffer once this returns
            err = b.exception()
            first = first or err
        if isinstance(first, OSError):
            raise self._describe_error(first) from None
        if first is not None:
            raise first


class StateFiles:
    """One preallocated nameless file per group in `directory`, read and written on `queue_depth` worker threads
    each (reads and writes apart) in requests of `block_bytes`; O_DIRECT where the file system takes it (`direct`
    says whether it did).

    Raises LazyTrainError before writing anything when the directory is missing or the disk lacks the room for all
    files (`file_bytes` of every layout), and when creating them fails (read-only, full, I/O error). `note`: where
    a change the run should know of is said, once (O_DIRECT refused at the first I/O; default: stderr).
    """

    def __init__(self, directory: str | Path, layouts: dict[str, GroupLayout], *, queue_depth: int = QUEUE_DEPTH,
                 block_bytes: int = BLOCK_BYTES, direct: bool = True,
                 host_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                 note: Callable[[str], None] | None = None) -> None:
        if queue_depth < 1 or block_bytes < ALIGN_BYTES or block_bytes % ALIGN_BYTES:
            raise ValueError(f"queue_depth must be >= 1 and block_bytes a multiple of {ALIGN_BYTES}, got "
                             f"{queue_depth}, {block_bytes}")
        self.directory = Path(directory)
        self.layouts = dict(layouts)
        self.block_bytes = block_bytes
        self._host_empty = host_empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._note = note or (lambda text: print(text, file=sys.stderr, flush=True))  # what the run should know
        self._fds: dict[str, int] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._pending: dict[str, list[IOEvent]] = {}
        self._lock = threading.Lock()
        self.check_room(self.total_bytes)
        self.direct = direct
        try:
            for group, layout in self.layouts.items():
                self._create(group, layout)
        except OSError as err:
            self.close()
            raise io_error(err, self.directory, "create the optimizer state files") from None
        except BaseException:
            self.close()
            raise
        # one queue per direction, as the step program has one NVMe lane each: a write's requests never wait behind
        # a read's in a shared queue (where they did, the in-step writes ran at half the disk's rate:
        # benchmarks/offload.py state-ops)
        self._pools = {write: ThreadPoolExecutor(max_workers=queue_depth,
                                                 thread_name_prefix=f"lazytrain-state-{'write' if write else 'read'}")
                       for write in (False, True)}

    def add(self, group: str, layout: GroupLayout) -> None:
        """One more group's file (its room checked first), for a caller that learns the layouts one group at a
        time (an optimizer built group by group, each group's states moved out before the next's exist)."""
        if group in self.layouts:
            raise ValueError(f"StateFiles: group {group} exists")
        self.check_room(layout.file_bytes)
        try:
            self._create(group, layout)
        except OSError as err:
            fd = self._fds.pop(group, None)
            if fd is not None:
                os.close(fd)
            raise io_error(err, self.directory, "create the optimizer state files") from None
        self.layouts[group] = layout

    @property
    def total_bytes(self) -> int:
        """Bytes the files take on the disk."""
        return sum(layout.file_bytes for layout in self.layouts.values())

    def check_room(self, need: int) -> None:
        """Refuse (one line) when the directory is missing or its disk has less than `need` bytes free."""
        if not self.directory.is_dir():
            what = "is not a directory" if self.directory.exists() else "does not exist"
            raise LazyTrainError(f"NVMe directory {self.directory} {what}; create it or set nvme_dir to another one")
        free = shutil.disk_usage(self.directory).free
        if need > free:
            raise StorageError(
                f"nvme: the optimizer state files need {format_bytes(need)} on {self.directory} but the disk has "
                f"{format_bytes(free)} free; free space there or set nvme_dir to another disk")

    def _create(self, group: str, layout: GroupLayout) -> None:
        """The group's file, preallocated (a full disk fails here, not mid-run), its header written."""
        fd, direct = open_nameless(self.directory, SPILL_PREFIX, self.direct)
        self._fds[group] = fd
        self.direct = direct  # one directory: what one file gets, all get
        try:
            os.posix_fallocate(fd, 0, layout.file_bytes)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, layout.file_bytes)  # no preallocation here: a full disk shows at the first write
        page = aligned_empty(layout.data_offset, torch.uint8, self._host_empty)
        page.copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self._io(fd, bytes_view(page), 0, write=True)

    def staging(self, group: str) -> torch.Tensor:
        """The group's staging buffer (uint8, `padded_data_bytes`, 4 KiB-aligned), made on first use and reused.
        Integration code that stages fewer groups at once than it has may pass its own buffers instead."""
        if group not in self._staging:
            self._staging[group] = aligned_empty(self.layouts[group].padded_data_bytes, torch.uint8, self._host_empty)
        return self._staging[group]

    # ---- the lane's ops -----------------------------------------------------------------------------
    def read(self, group: str, buffer: torch.Tensor) -> IOEvent:
        """Submit the read of the group's data into `buffer`; returns at once."""
        return self._submit(group, buffer, write=False)

    def write(self, group: str, buffer: torch.Tensor) -> IOEvent:
        """Submit the write of `buffer` (the group's data) to its file; returns at once."""
        return self._submit(group, buffer, write=True)

    def _submit(self, group: str, buffer: torch.Tensor, write: bool) -> IOEvent:
        layout, fd = self.layouts[group], self._fds[group]
        size = layout.padded_data_bytes
        if buffer.device.type != "cpu" or not buffer.is_contiguous() or buffer.numel() * buffer.element_size() < size:
            raise ValueError(f"{group}: the staging buffer must be a contiguous host tensor of >= {size} bytes")
        if buffer.data_ptr() % ALIGN_BYTES:
            raise ValueError(f"{group}: the staging buffer must start on a {ALIGN_BYTES}-byte boundary")
        data = bytes_view(buffer)[:size]
        blocks = [self._pools[write].submit(self._io, fd, data[start:start + self.block_bytes],
                                            layout.data_offset + start, write=write)
                  for start in range(0, size, self.block_bytes)]
        action = "write an optimizer state file" if write else "read an optimizer state file"
        event = IOEvent(blocks, lambda err: io_error(err, self.directory, action))
        with self._lock:
            self._pending[group] = [e for e in self._pending.get(group, []) if not e.done()] + [event]
        return event

    def _io(self, fd: int, data: memoryview, offset: int, *, write: bool) -> None:
        """One block, on a worker thread (or the caller's at creation)."""
        try:
            self._transfer(fd, data, offset, write)
        except OSError as err:
            if err.errno != errno.EINVAL or not self.direct:
                raise
            with self._lock:  # accepted at open, refused at I/O (e.g. a logical block above 4 KiB): page cache
                if self.direct:
                    for other in self._fds.values():
                        set_direct(other, False)
                    self.direct = False
                    self._note(f"note     {self.directory} refused O_DIRECT at the first state file I/O: the state "
                               "files go through the page cache from now on (each block dropped from it once moved)")
            self._transfer(fd, data, offset, write)

    def _transfer(self, fd: int, data: memoryview, offset: int, write: bool) -> None:
        if write:
            write_all(fd, data, offset)
        elif read_all(fd, data, offset) != len(data):
            raise self._short(fd, offset + len(data))
        if not self.direct:  # (a write: start its write-back) drop the cached copy: the staging buffer holds it
            os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)

    def _short(self, fd: int, end: int) -> LazyTrainError:
        """A read that ended early: the file was truncated under the run (through /proc/<pid>/fd: the files have no
        name to delete them by), not a disk error."""
        group = next((g for g, f in self._fds.items() if f == fd), "?")
        return StorageError(f"the optimizer state file of {group} in {self.directory} was truncated under the run "
                            f"({os.fstat(fd).st_size:,} bytes, {end:,} needed): something else wrote to it; give the "
                            "run a directory of its own and resume from the last checkpoint")

    def wait_all(self, group: str | None = None) -> None:
        """Wait for every submitted op (of `group`, or of all groups)."""
        with self._lock:
            groups = [group] if group is not None else list(self._pending)
            events = [e for g in groups for e in self._pending.pop(g, [])]
        for event in events:
            event.wait()

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_safetensors(self, group: str, path: str | Path, names: Iterable[str] | None = None) -> int:
        """Copy the group's tensors (all, or `names`) into a new safetensors file at `path` inside the kernel, fsync
        it, and return its size. Waits for the group's pending ops first. `path` is overwritten: write to a
        temporary name and rename (the checkpoint's one write path does). Raises OSError: the checkpoint's write
        path says in one line which checkpoint stays intact and what to do."""
        return self.save_combined(path, [(group, names)])

    def save_combined(self, path: str | Path, parts: Sequence[tuple[str, Iterable[str] | None]],
                      host: dict[str, torch.Tensor] | None = None) -> int:
        """`save_safetensors` of several groups into one file: each part is a group and its tensor names (None =
        all), and `host` tensors from host memory beside them (written from their bytes, after the copies); names
        must differ across all of them (e.g. every group's fp32 masters, by parameter name, and the masters that
        stay in RAM, into one master.safetensors). The copied tensors lie in order of falling element size, as in
        the groups' own files."""
        sources: list[tuple[str, Extent]] = []
        for group, names in parts:
            layout = self.layouts[group]
            chosen = list(layout.extents.values()) if names is None else [layout.extents[n] for n in names]
            sources += sorted(((group, e) for e in chosen), key=lambda ge: ge[1].offset)
        host = {name: t.detach().contiguous() for name, t in (host or {}).items()}
        if len({e.name for _, e in sources} | set(host)) != len(sources) + len(host):
            raise ValueError("save_combined: a tensor name occurs twice")
        sources.sort(key=lambda ge: -torch.empty((), dtype=ge[1].dtype).element_size())  # stable
        out, offset = [], 0
        for _, e in sources:
            out.append(Extent(e.name, e.dtype, e.shape, offset, e.num_bytes))
            offset += e.num_bytes
        written = []  # (the host tensors' extents)
        for name, t in host.items():
            written.append((Extent(name, t.dtype, tuple(t.shape), offset, t.numel() * t.element_size()), t))
            offset += written[-1][0].num_bytes
        header = safetensors_header(out + [e for e, _ in written])
        groups = list(dict.fromkeys(group for group, _ in parts))
        for group in groups:
            self.wait_all(group)
        dst_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            write_all(dst_fd, memoryview(header), 0)
            for group in groups:
                data_offset = self.layouts[group].data_offset
                runs = _runs([(data_offset + src.offset, len(header) + dst.offset, src.num_bytes)
                              for (g, src), dst in zip(sources, out, strict=True) if g == group])
                with self._buffered(group) as src_fd:
                    for src, dst, num_bytes in runs:
                        copy_range(src_fd, src, dst_fd, dst, num_bytes)
            for e, t in written:
                write_all(dst_fd, bytes_view(t), len(header) + e.offset)
            os.fsync(dst_fd)
        finally:
            os.close(dst_fd)
        return len(header) + offset

    def load_safetensors(self, group: str, path: str | Path, names: Iterable[str] | None = None, *,
                         others: bool = False) -> None:
        """Copy the tensors of a safetensors file (a checkpoint's) into the group's file. Every tensor of the layout
        (or of `names`) must be in it with its dtype and shape, and no other unless `others` (e.g. one
        master.safetensors for every group). Waits for the group's pending ops first."""
        layout = self.layouts[group]
        try:
            src_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise LazyTrainError(f"cannot read checkpoint file {path}: {err.strerror}; resume from another "
                                 "checkpoint") from None
        try:
            data_offset, entries = read_safetensors_header(src_fd, path)
            runs = _runs([(data_offset + begin, layout.data_offset + layout.extents[name].offset, end - begin)
                          for name, (begin, end) in _matched(entries, layout, path, names, others)])
            self.wait_all(group)
            with self._buffered(group) as dst_fd:
                for src, dst, num_bytes in runs:
                    copy_range(src_fd, src, dst_fd, dst, num_bytes)
        except OSError as err:
            raise io_error(err, self.directory, f"copy {path} into an optimizer state file") from None
        finally:
            os.close(src_fd)

    def _buffered(self, group: str) -> _Buffered:
        return _Buffered(self._fds[group], self.direct)

    def close(self) -> None:
        """Wait for pending ops, close every file (the kernel frees their blocks) and stop the workers; then raise
        the first error of an op nobody waited for (a write-back that failed is lost data, not a detail)."""
        for pool in getattr(self, "_pools", {}).values():
            pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        unwaited = [e for events in getattr(self, "_pending", {}).values() for e in events if not e.waited]
        self._pending = {}
        for event in unwaited:
            event.wait()

    def __del__(self) -> None:  # dropped without close(): still give the blocks back
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> StateFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Buffered:
    """The descriptor with O_DIRECT off while inside (os.copy_file_range goes through the page cache, at offsets
    that need not be aligned); on again after. No block of the file may be in flight meanwhile."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct = fd, direct

    def __enter__(self) -> int:
        if self.direct:
            set_direct(self.fd, False)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        if self.direct:
            set_direct(self.fd, True)


def _runs(copies: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes) copies with neighbours in both files merged into one."""
    runs: list[tuple[int, int, int]] = []
    for src, dst, num_bytes in sorted(copies):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + num_bytes)
        elif num_bytes:
            runs.append((src, dst, num_bytes))
    return runs


def read_safetensors_header(fd: int, path: str | Path) -> tuple[int, dict[str, dict[str, object]]]:
    """(data offset, tensor entries) of the safetensors file open as `fd`; a malformed header is one line. The header
    is data: parsed as JSON, size capped, offsets checked against the file's size."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    bad = f"checkpoint file {path} is not a valid safetensors file"
    if len(raw) != 8:
        raise LazyTrainError(f"{bad} (shorter than 8 bytes); resume from another checkpoint")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise LazyTrainError(f"{bad} (header of {n} bytes in a file of {size}); resume from another checkpoint")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (ValueError, UnicodeDecodeError):
        raise LazyTrainError(f"{bad} (its header is not JSON); resume from another checkpoint") from None
    if not isinstance(header, dict):
        raise LazyTrainError(f"{bad} (its header is not a mapping); resume from another checkpoint")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= size - 8 - n):
            raise LazyTrainError(f"{bad} (tensor {name!r} has no valid data_offsets); resume from another checkpoint")
    return 8 + n, header


def safetensors_names(path: str | Path) -> set[str]:
    """The tensor names of a safetensors file (its header read as data, checked as `read_safetensors_header`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise LazyTrainError(f"cannot read checkpoint file {path}: {err.strerror}; resume from another "
                             "checkpoint") from None
    try:
        return set(read_safetensors_header(fd, path)[1])
    finally:
        os.close(fd)


def _matched(entries: dict[str, dict[str, object]], layout: GroupLayout, path: str | Path,
             names: Iterable[str] | None = None, others: bool = False) -> list[tuple[str, tuple[int, int]]]:
    """(name, (begin, end)) of every layout tensor (or of `names`) in `entries`, after checking names, dtypes and
    shapes (and, unless `others`, that the file holds no other tensor)."""
    fix = "resume with the model and optimizer settings the checkpoint was saved with"
    wanted = list(layout.extents) if names is None else list(names)
    missing = sorted(set(wanted) - set(entries))
    extra = [] if others else sorted(set(entries) - set(wanted))
    if missing or extra:
        raise LazyTrainError(f"checkpoint file {path} holds other tensors than this optimizer's (missing "
                             f"{missing[:3]}, unexpected {extra[:3]}); {fix}")
    out = []
    for e in (layout.extents[name] for name in wanted):
        name = e.name
        entry = entries[name]
        want = (SAFETENSORS_DTYPES[e.dtype], list(e.shape))
        got = (entry.get("dtype"), entry.get("shape"))
        begin, end = entry["data_offsets"]  # type: ignore[misc]
        if got != want or end - begin != e.num_bytes:
            raise LazyTrainError(f"checkpoint file {path}: tensor {name!r} is {got[0]} {got[1]} but this optimizer "
                                 f"holds {want[0]} {want[1]}; {fix}")
        out.append((name, (begin, end)))
    return out
