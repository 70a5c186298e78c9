"""The SSD under nvme_dir, measured: what the cost model, the simulator and the MILP plan the NVMe lanes with.

A preset states a disk's rates (rtx3090: 3.5 GB/s reads, 3.0 GB/s writes); a consumer SSD often writes 1-2 GB/s
once its write cache is full, and many write at half their rate while a read runs. `probe_nvme` times the run's
own directory the way the run uses it: state files (runtime/statefiles.py: O_DIRECT where the file system takes it,
the files' request size and queue depth), one write pass and one read pass of a file of `probe_bytes`, each
repeated for about a third of `seconds` (longer: past the drive's write cache), then a write of one file while
another is read (the step program's two NVMe lanes at once). The figures are remembered per device and directory
(the file system's device number, the resolved path, the request size and depth) under the cache directory, so a
later run of the same machine reads them back instead of writing gigabytes again.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lazytrain.jsonio import dumps
from lazytrain.paths import cache_dir
from lazytrain.runtime.statefiles import BLOCK_BYTES, QUEUE_DEPTH, GroupLayout, StateFiles
from lazytrain.writes import write_atomic

PROBE_BYTES = 256 << 20  # one state file of the probe: a large layer group's
CACHE_FILE = "nvme-probe.json"


@dataclass(frozen=True)
class NvmeRates:
    """GB/s of one directory's disk: each direction alone, and each while the other runs (`mixed_*`)."""

    read_gbps: float
    write_gbps: float
    mixed_read_gbps: float
    mixed_write_gbps: float
    direct: bool  # O_DIRECT (no page cache) held
    seconds: float  # how long the probe wrote and read

    def describe(self) -> str:
        return (f"read {self.read_gbps:.2f} GB/s, write {self.write_gbps:.2f} GB/s, both at once read "
                f"{self.mixed_read_gbps:.2f} + write {self.mixed_write_gbps:.2f} GB/s "
                f"({'O_DIRECT' if self.direct else 'page cache'}, {BLOCK_BYTES >> 20} MiB requests x {QUEUE_DEPTH}, "
                f"{self.seconds:.1f} s)")


def _key(directory: Path) -> str:
    resolved = directory.resolve()
    return f"{os.stat(resolved).st_dev}:{resolved}:{BLOCK_BYTES}:{QUEUE_DEPTH}"


def cached_rates(directory: str | Path) -> NvmeRates | None:
    """The rates a probe of `directory`'s disk measured before on this machine, or None."""
    try:
        entry = json.loads((cache_dir() / CACHE_FILE).read_text()).get(_key(Path(directory)))
        return NvmeRates(**entry) if isinstance(entry, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def probe_nvme(directory: str | Path, seconds: float = 3.0, probe_bytes: int = PROBE_BYTES,
               remember: bool = True) -> NvmeRates:
    """Measure `directory`'s disk as the state files use it (module docstring); remembered when `remember`."""
    directory = Path(directory)
    size = min(probe_bytes, max(4 << 20, os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize // 8))
    layout = GroupLayout([("x", torch.uint8, (size,))])
    t0 = time.perf_counter()
    with StateFiles(directory, {"a": layout, "b": layout}, note=lambda _: None) as files:
        buf, other = files.staging("a"), files.staging("b")
        buf.random_(0, 256)
        other.copy_(buf)
        files.write("b", other).wait()  # (a read of blocks never written returns zeros without the disk)
        each = max(seconds / 3, 1e-3)
        write = _rate(lambda: files.write("a", buf).wait(), layout.padded_data_bytes, each)
        read = _rate(lambda: files.read("a", buf).wait(), layout.padded_data_bytes, each)
        mixed_write, mixed_read = _mixed(files, buf, other, layout.padded_data_bytes, each)
        rates = NvmeRates(read, write, mixed_read, mixed_write, files.direct, time.perf_counter() - t0)
    if remember:
        _remember(directory, rates)
    return rates


def _rate(op: object, num_bytes: int, seconds: float) -> float:
    """GB/s of `op` (moving `num_bytes`) repeated for at least `seconds` (at least twice; the first untimed)."""
    op()  # type: ignore[operator]
    done, t0 = 0, time.perf_counter()
    while done < 2 or time.perf_counter() - t0 < seconds:
        op()  # type: ignore[operator]
        done += 1
    return done * num_bytes / (time.perf_counter() - t0) / 1e9


def _mixed(files: StateFiles, buf: torch.Tensor, other: torch.Tensor, num_bytes: int, seconds: float
           ) -> tuple[float, float]:
    """(write GB/s, read GB/s) while a write of file a and a read of file b run at once, for `seconds`."""
    stop = threading.Event()
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            files.read("b", other).wait()
            reads[0] += 1

    thread = threading.Thread(target=reader, name="lazytrain-nvme-probe", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    writes = 0
    while writes < 2 or time.perf_counter() - t0 < seconds:
        files.write("a", buf).wait()
        writes += 1
    write_s = time.perf_counter() - t0
    stop.set()
    thread.join()
    read_s = time.perf_counter() - t0
    return writes * num_bytes / write_s / 1e9, max(reads[0], 1) * num_bytes / read_s / 1e9


def _remember(directory: Path, rates: NvmeRates) -> None:
    path = cache_dir() / CACHE_FILE
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    known[_key(directory)] = asdict(rates)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, dumps(known, indent=1) + "\n")
    except OSError:
        pass  # a cache that cannot be written: the next run probes again
