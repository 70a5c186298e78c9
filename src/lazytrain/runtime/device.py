"""Devices the executor streams through: an emulated one (CPU compute, capped arena, throttled links) and CUDA.

Both export the same small interface (`Device`), so the executor has one code path:

- an *arena*: `alloc` / `free` / `reserve` / `unreserve` count every byte the executor places on the
  device against a hard capacity; going over raises `DeviceOutOfMemoryError` naming the bytes asked
  and free. `peak_bytes` is the high-water mark of that count (what a plan's predicted peak describes).
- *links*: one FIFO worker thread per stream (`h2d`, `d2h`, `nvme_read`, `nvme_write`, `optimizer`).
  `copy(link, dst, src)` and `submit(link, fn, num_bytes)` enqueue a job and return an `Event`; a job
  starts once the events it depends on are set. On the emulated device the worker copies and then
  sleeps until `num_bytes / bandwidth` has passed since the job started, so overlap and stalls are
  real and measurable on a laptop. On CUDA the h2d/d2h workers issue the copy on their own CUDA
  stream and wait for it, so a set `Event` always means the bytes are there.
- `wait(event)` blocks the compute thread until the event is set and returns the seconds it
  waited: the measured stall of that stream.

The emulated device's memory is this process's heap: `keep_host_memory` (run when one is made) tells glibc's
malloc to keep freed memory mapped, as a GPU's caching allocator keeps its blocks, instead of handing it back to
the kernel and page-faulting it afresh (zeroed) in the next step.
"""

from __future__ import annotations

import ctypes
import os
import platform
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.plan.schedule import STALL_LANES
from lazytrain.runtime.files import StorageError
from lazytrain.runtime.live_bytes import LiveBytes
from lazytrain.runtime.store import clean_stale_spill_files, open_spill_file, spill_dir
from lazytrain.units import format_bytes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX_BYTES = 32 << 20  # the largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)


class DeviceOutOfMemoryError(torch.OutOfMemoryError):
    """The device arena would exceed its capacity (a `torch.OutOfMemoryError`, like CUDA's)."""


class Event:
    """Set by a link worker when its job is done; carries the job's exception, re-raised on wait."""

    __slots__ = ("link", "_done", "error", "start_s", "end_s")

    def __init__(self, link: str, done: bool = False) -> None:
        self.link = link
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.start_s = self.end_s = 0.0
        if done:
            self._done.set()

    def is_set(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()

    def wait(self) -> float:
        """Block until done; return seconds waited. Re-raises the job's exception."""
        if self._done.is_set():
            waited = 0.0
        else:
            t0 = time.perf_counter()
            self._done.wait()
            waited = time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        return waited


def done_event(link: str = "none") -> Event:
    return Event(link, done=True)


class _Link:
    """One FIFO stream: a daemon thread that runs jobs in order, optionally throttled to `bytes_per_s`."""

    def __init__(self, name: str, bytes_per_s: float | None) -> None:
        self.name = name
        self.bytes_per_s = bytes_per_s
        self.busy_s = 0.0
        self.bytes_moved = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lazytrain-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], num_bytes: int, after: Iterable[Event],
               on_done: Callable[[], None] | None) -> Event:
        event = Event(self.name)
        self._queue.put((fn, int(num_bytes), tuple(after), on_done, event))
        return event

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, num_bytes, after, on_done, event = job
            try:
                for dep in after:  # cross-stream dependency, e.g. nvme_write after its d2h
                    dep.wait()
                event.start_s = time.perf_counter()
                fn()
                if self.bytes_per_s:  # emulated bandwidth: the job takes at least bytes / rate
                    remaining = event.start_s + num_bytes / self.bytes_per_s - time.perf_counter()
                    if remaining > 0:
                        time.sleep(remaining)
                if on_done is not None:
                    on_done()
            except BaseException as err:  # surfaced to the compute thread by Event.wait
                event.error = err
            event.end_s = time.perf_counter()
            self.busy_s += event.end_s - event.start_s
            self.bytes_moved += num_bytes
            event.set()
            # drop the job before waiting for the next: its closure holds device tensors (a step's slots)
            job = fn = after = on_done = event = None


class Device(Protocol):
    """What the executor needs of a device (EmulatedDevice and CudaDevice both provide it)."""

    torch_device: torch.device
    nvme_dir: Path
    capacity_bytes: int | None

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str = "") -> torch.Tensor: ...
    def adopt(self, tensor: torch.Tensor, tag: str = "") -> torch.Tensor: ...
    def free(self, tensor: torch.Tensor) -> None: ...
    def reserve(self, num_bytes: int, tag: str = "") -> int: ...
    def unreserve(self, num_bytes: int) -> None: ...
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def copy(self, link: str, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event] = (),
             on_done: Callable[[], None] | None = None) -> Event: ...
    def submit(self, link: str, fn: Callable[[], object], num_bytes: int = 0, after: Iterable[Event] = (),
               on_done: Callable[[], None] | None = None) -> Event: ...
    def wait(self, event: Event) -> float: ...
    def record_compute(self) -> Event: ...
    def mark(self) -> object: ...
    def seconds_between(self, start: object, end: object) -> float: ...
    def synchronize(self) -> None: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def peak_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def true_peak_bytes(self) -> int | None: ...
    def measuring(self) -> AbstractContextManager[None]: ...
    def link_stats(self) -> dict[str, tuple[float, int]]: ...


class _ArenaDevice:
    """The arena, links and NVMe directory shared by both devices; subclasses say how bytes move."""

    def __init__(self, torch_device: torch.device, capacity_bytes: int | None, rates_gbps: dict[str, float | None],
                 nvme_dir: str | Path | None, measure_memory: bool = False) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise LazyTrainError(f"device capacity_bytes must be positive, got {capacity_bytes}")
        self.torch_device = torch_device
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._used = 0
        self._peak = 0
        self._sizes: dict[int, int] = {}  # id(tensor) -> bytes counted for it
        # measure_memory: also count every storage the step really holds on the device (runtime/live_bytes.py)
        self.live = LiveBytes() if measure_memory else None
        self.links = {name: _Link(name, _bytes_per_s(rates_gbps.get(name))) for name in STALL_LANES}
        if nvme_dir is None:
            self.nvme_dir = spill_dir(Path(tempfile.gettempdir()))
            weakref.finalize(self, shutil.rmtree, str(self.nvme_dir), True)
        else:
            self.nvme_dir = Path(nvme_dir)
        weakref.finalize(self, _close_links, list(self.links.values()))

    # ---- arena ------------------------------------------------------------------------------
    def _count(self, num_bytes: int, tag: str) -> None:
        with self._lock:
            if self.capacity_bytes is not None and self._used + num_bytes > self.capacity_bytes:
                free = self.capacity_bytes - self._used
                raise DeviceOutOfMemoryError(
                    f"device out of memory: tried to allocate {num_bytes} bytes for {tag or 'a tensor'} with "
                    f"{free} bytes free of {self.capacity_bytes} (in use {self._used}); raise the device "
                    "capacity or choose a plan with a smaller predicted peak"
                )
            self._used += num_bytes
            self._peak = max(self._peak, self._used)

    def _uncount(self, num_bytes: int) -> None:
        with self._lock:
            self._used -= num_bytes

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str = "") -> torch.Tensor:
        """A device tensor counted in the arena until `free`."""
        num_bytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        self._count(num_bytes, tag)
        tensor = self._empty(tuple(shape), dtype)
        with self._lock:
            self._sizes[id(tensor)] = num_bytes
        if self.live is not None:
            self.live.add(tensor)
        return tensor

    def adopt(self, tensor: torch.Tensor, tag: str = "") -> torch.Tensor:
        """Count a tensor compute just produced on the device (a layer's output), until `free`."""
        num_bytes = tensor.numel() * tensor.element_size()
        self._count(num_bytes, tag)
        with self._lock:
            self._sizes[id(tensor)] = num_bytes
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor` (idempotent). The caller drops its last reference."""
        with self._lock:
            num_bytes = self._sizes.pop(id(tensor), 0)
            self._used -= num_bytes

    def reserve(self, num_bytes: int, tag: str = "") -> int:
        """Count transient bytes that no tensor of ours holds (a layer's autograd working set)."""
        self._count(int(num_bytes), tag)
        return int(num_bytes)

    def unreserve(self, num_bytes: int) -> None:
        self._uncount(int(num_bytes))

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._used
        if self.live is not None:
            self.live.reset_peak()

    def measuring(self) -> AbstractContextManager[None]:
        """Around the step's compute (on its thread): what it creates counts in `true_peak_bytes`."""
        return self.live if self.live is not None else nullcontext()

    def true_peak_bytes(self) -> int | None:
        """The high-water mark of every storage the step held on the device since `reset_peak` (not only the
        arena's); None unless the device was made with measure_memory=True."""
        return None if self.live is None else self.live.peak_bytes

    # ---- links ------------------------------------------------------------------------------
    def submit(self, link: str, fn: Callable[[], object], num_bytes: int = 0, after: Iterable[Event] = (),
               on_done: Callable[[], None] | None = None) -> Event:
        """Run `fn` on `link`'s worker (FIFO) once `after` are set; it occupies the link for >= bytes/rate."""
        return self.links[link].submit(fn, num_bytes, after, on_done)

    def wait(self, event: Event) -> float:
        """Block the compute thread until `event` is set; the seconds waited are that stream's stall."""
        return event.wait()

    def record_compute(self) -> Event:
        """An event set once the compute issued so far has finished (immediate on the emulated device)."""
        return done_event("compute")

    def mark(self) -> object:
        """A point in the compute stream's time: here the wall clock (compute runs on this thread)."""
        return time.perf_counter()

    def seconds_between(self, start: object, end: object) -> float:
        """Seconds between two marks (after `synchronize` on CUDA)."""
        return float(end) - float(start)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        pass

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def link_stats(self) -> dict[str, tuple[float, int]]:
        """Per link: (seconds busy, bytes moved) since the device was made."""
        return {name: (link.busy_s, link.bytes_moved) for name, link in self.links.items()}

    def close(self) -> None:
        _close_links(list(self.links.values()))


class EmulatedDevice(_ArenaDevice):
    """A device emulated on the CPU: real compute, a capped arena, and links throttled to the given rates.

    `capacity_bytes` None = unlimited; a `*_gbps` of None = unthrottled (GB/s = 1e9 bytes/s);
    `nvme_dir` None = a temporary directory removed with the device; `measure_memory`: count every storage a step
    holds on the device, not only the arena's (`true_peak_bytes`; slows compute: a Python hook per aten op).
    """

    def __init__(self, capacity_bytes: int | None = None, h2d_gbps: float | None = None,
                 d2h_gbps: float | None = None, nvme_read_gbps: float | None = None,
                 nvme_write_gbps: float | None = None, nvme_dir: str | Path | None = None,
                 measure_memory: bool = False) -> None:
        for knob, value in (("h2d_gbps", h2d_gbps), ("d2h_gbps", d2h_gbps), ("nvme_read_gbps", nvme_read_gbps),
                            ("nvme_write_gbps", nvme_write_gbps)):
            if value is not None and not value > 0:
                raise LazyTrainError(f"EmulatedDevice {knob} must be positive (or None = unthrottled), got {value}")
        super().__init__(torch.device("cpu"), capacity_bytes,
                         {"h2d": h2d_gbps, "d2h": d2h_gbps, "nvme_read": nvme_read_gbps,
                          "nvme_write": nvme_write_gbps}, nvme_dir, measure_memory)
        keep_host_memory()

    def close(self) -> None:
        """Stop the links and hand the heap pages the device's memory left free back to the kernel, as a process
        frees its GPU memory: `keep_host_memory` keeps them for the next step, and there is none (the final
        checkpoint, or training after a calibration's probe device, would otherwise sit on top of them)."""
        super().close()
        return_freed_host_memory()

    def slow_link(self, link: str, factor: float) -> None:
        """Test hook: from now on `link` moves bytes `factor` times slower (a throttled link only)."""
        target = self.links[link]
        if not target.bytes_per_s or not factor > 0:
            raise LazyTrainError(f"slow_link: {link} must be throttled and factor > 0, got {factor}")
        target.bytes_per_s /= factor

    def __repr__(self) -> str:
        rates = {n: link.bytes_per_s and link.bytes_per_s / 1e9 for n, link in self.links.items()}
        return f"EmulatedDevice(capacity_bytes={self.capacity_bytes}, gbps={rates})"

    def copy(self, link: str, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event] = (),
             on_done: Callable[[], None] | None = None) -> Event:
        return self.submit(link, lambda: dst.copy_(src), src.numel() * src.element_size(), after, on_done)


class CudaDevice(_ArenaDevice):
    """A CUDA GPU: h2d and d2h copies on their own CUDA streams, pinned host buffers, NVMe files.

    The arena counts the executor's tensors against `capacity_bytes` (default: the GPU's total memory),
    so a plan's predicted peak is checked the same way as on the emulated device.
    """

    def __init__(self, index: int = 0, capacity_bytes: int | None = None, nvme_dir: str | Path | None = None) -> None:
        if not torch.cuda.is_available():
            raise LazyTrainError("CudaDevice needs a CUDA GPU but torch.cuda.is_available() is False; "
                                 "use EmulatedDevice")
        device = torch.device("cuda", index)
        if capacity_bytes is None:
            capacity_bytes = torch.cuda.get_device_properties(device).total_memory
        super().__init__(device, capacity_bytes, {}, nvme_dir)
        self.streams = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}
        self._allocated_at_reset = 0

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        self._allocated_at_reset = torch.cuda.memory_allocated(self.torch_device)

    def true_peak_bytes(self) -> int | None:
        """The caching allocator's high-water mark since `reset_peak`, less what was allocated then (its blocks
        are rounded up to 512 B, and a block a side stream used is reused only once that stream passed it)."""
        return torch.cuda.max_memory_allocated(self.torch_device) - self._allocated_at_reset

    def __repr__(self) -> str:
        return f"CudaDevice({self.torch_device}, capacity_bytes={self.capacity_bytes})"

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def record_compute(self) -> Event:
        """A CUDA event on the compute stream, wrapped so link workers can wait for it."""
        cuda_event = torch.cuda.Event()
        cuda_event.record(torch.cuda.current_stream(self.torch_device))
        event = Event("compute")
        event._cuda = cuda_event  # type: ignore[attr-defined]
        return event

    def mark(self) -> object:
        """A timing CUDA event recorded on the compute stream: launches are asynchronous, so the wall clock
        around a compute op would time its launch, not its kernels."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def seconds_between(self, start: object, end: object) -> float:
        return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]

    def copy(self, link: str, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event] = (),
             on_done: Callable[[], None] | None = None) -> Event:
        after = tuple(after)
        cuda_deps = [getattr(e, "_cuda", None) for e in after]
        host_deps = [e for e, c in zip(after, cuda_deps, strict=True) if c is None]
        stream = self.streams[link]

        def run() -> None:
            with torch.cuda.stream(stream):
                for dep in cuda_deps:
                    if dep is not None:
                        stream.wait_event(dep)
                dst.copy_(src, non_blocking=True)
                for t in (dst, src):
                    if t.is_cuda:
                        t.record_stream(stream)
            stream.synchronize()  # the event below means the bytes have landed

        return self.submit(link, run, src.numel() * src.element_size(), host_deps, on_done)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    @property
    def max_allocated_bytes(self) -> int:
        """What the CUDA caching allocator saw (includes autograd intermediates not in the arena)."""
        return torch.cuda.max_memory_allocated(self.torch_device)


_kept_host_memory = False


def keep_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (once per process); returns whether it does.

    By default glibc returns memory to the kernel: blocks over a dynamic threshold are mmapped and unmapped on
    free, and the heap top is trimmed past another. A training step frees and re-allocates the same tensors
    (boundaries, layer intermediates, gradients) every step, so each step page-faulted them in again (~10-25 k
    minor faults per step of the default job; docs/benchmarks.md). Fixed thresholds stop
    both: heap blocks up to 32 MiB are reused, and the heap is never trimmed (the process keeps its high-water
    mark, as a GPU's caching allocator does). Other C libraries (no `mallopt`), and a process started with glibc's
    own malloc settings (MALLOC_*_ or GLIBC_TUNABLES, e.g. benchmarks/host.py's), are left as they are."""
    global _kept_host_memory
    if _kept_host_memory:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    # -1: never trim (mallopt(3)); a fixed mmap threshold also turns off its dynamic adjustment
    _kept_host_memory = bool(mallopt(M_TRIM_THRESHOLD, -1) and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES))
    return _kept_host_memory


def return_freed_host_memory() -> None:
    """Hand the free pages of malloc's heap back to the kernel once (glibc `malloc_trim`), past `keep_host_memory`'s
    never-trim: a data-parallel rank's set-up frees what it will not use again (the private weights it gave up for
    the node's shared copy, the landing buffers of groups it does not own, its calibration's gradients and
    optimizer states), and a closed emulated device its memory. Elsewhere (no glibc) a no-op."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def check_nvme_dir(path: Path) -> None:
    """Refuse a missing or unwritable NVMe directory before the first step, not in the middle of one, and remove
    the spill files of runs that died there. The probe is a nameless spill file: nothing to clean up after it,
    so a read-only directory gives its own error, not the cleanup's."""
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise LazyTrainError(f"NVMe directory {path} {what}; create it or pass another nvme_dir")
    try:
        fd = open_spill_file(path)
        try:
            os.write(fd, b"x" * 4096)
        finally:
            os.close(fd)
    except OSError as err:
        raise LazyTrainError(f"NVMe directory {path} is not writable ({err.strerror}); pass a writable nvme_dir"
                             ) from None
    clean_stale_spill_files(path)


def check_nvme_space(path: Path, need_bytes: int) -> None:
    """Refuse a step whose spill files (`need_bytes` at once) do not fit the disk's free space, before it starts."""
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        raise StorageError(
            f"NVMe directory {path}: the step spills {format_bytes(need_bytes)} there but the disk has "
            f"{format_bytes(free)} free (short by {format_bytes(need_bytes - free)}); free space, pass another "
            "nvme_dir, or plan with a smaller NVMe activation budget"
        )


def _bytes_per_s(gbps: float | None) -> float | None:
    if gbps is None or gbps == float("inf"):
        return None
    return gbps * 1e9


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _close_links(links: list[_Link]) -> None:
    """Stop the link threads (at device collection or interpreter exit) and let them finish their queue."""
    for link in links:
        link.close()
    for link in links:
        if link._thread is not threading.current_thread():
            link._thread.join(timeout=1.0)
