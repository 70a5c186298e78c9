"""The optimizer state files' throughput (runtime/statefiles.py) against the raw sequential rate of the same directory,
measured side by side in one run.

    python benchmarks/nvme.py                                   # /tmp and /dev/shm, 64 MiB .. 1 GiB, 7 rounds
    python benchmarks/nvme.py --dirs /mnt/nvme --sizes 256,1024 --rounds 9
    python benchmarks/nvme.py --sweep --dirs /tmp --sizes 256  # queue depth x block size, for the defaults

Raw: one thread, one file preallocated like the state files, sequential 64 MiB os.pwrite / os.preadv calls with
O_DIRECT where the file system takes it (what `dd bs=64M oflag=direct` / `iflag=direct` does), the page cache of
the file dropped before every read (posix_fadvise DONTNEED; O_DIRECT bypasses it anyway). Module: one group of the
same size in a `StateFiles`, `write(group, buf).wait()` and `read(group, buf).wait()` from the same 4 KiB-aligned
buffer. Every round runs the four in a new shuffled order (load from other processes hits all alike); the table
gives medians over rounds (GB/s = 1e9 B/s) and the median of the per-round ratios module / raw.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lazytrain.runtime.files import ALIGN_BYTES, bytes_view, open_nameless, read_all, write_all
from lazytrain.runtime.statefiles import BLOCK_BYTES, QUEUE_DEPTH, GroupLayout, StateFiles
from lazytrain.runtime.store import aligned_empty

RAW_BLOCK_BYTES = 64 << 20
MiB = 1 << 20


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class Raw:
    """dd-like sequential I/O of one preallocated nameless file (one thread, large requests)."""

    def __init__(self, directory: Path, num_bytes: int) -> None:
        self.fd, self.direct = open_nameless(directory, "lazytrain-bench-", direct=True)
        os.posix_fallocate(self.fd, 0, num_bytes)

    def write(self, data: memoryview) -> None:
        for start in range(0, len(data), RAW_BLOCK_BYTES):
            write_all(self.fd, data[start:start + RAW_BLOCK_BYTES], start)

    def read(self, data: memoryview) -> None:
        os.posix_fadvise(self.fd, 0, len(data), os.POSIX_FADV_DONTNEED)
        for start in range(0, len(data), RAW_BLOCK_BYTES):
            read_all(self.fd, data[start:start + RAW_BLOCK_BYTES], start)

    def close(self) -> None:
        os.close(self.fd)


def _file_system(directory: Path) -> str:
    done = subprocess.run(["df", "--output=fstype,source", str(directory)], capture_output=True, text=True)
    lines = done.stdout.split("\n")
    return " ".join(lines[1].split()) if done.returncode == 0 and len(lines) > 1 else "?"


def measure(directory: Path, num_bytes: int, rounds: int, queue_depth: int, block_bytes: int) -> dict[str, list[float]]:
    """Seconds per op: raw write/read and module write/read, `rounds` interleaved rounds (after one untimed)."""
    buf = aligned_empty(num_bytes, torch.uint8, _host_empty)
    buf.random_(0, 256)
    data = bytes_view(buf)
    raw = Raw(directory, num_bytes)
    files = StateFiles(directory, {"g": GroupLayout([("x", torch.uint8, (num_bytes,))])}, queue_depth=queue_depth,
                       block_bytes=block_bytes)
    ops = {"raw write": lambda: raw.write(data), "raw read": lambda: raw.read(data),
           "module write": lambda: files.write("g", buf).wait(), "module read": lambda: files.read("g", buf).wait()}
    times: dict[str, list[float]] = {k: [] for k in ops}
    order = random.Random(0)
    try:
        for r in range(rounds + 1):
            for name in order.sample(list(ops), len(ops)):
                t0 = time.perf_counter()
                ops[name]()
                if r > 0:
                    times[name].append(time.perf_counter() - t0)
    finally:
        files.close()
        raw.close()
    times["direct"] = [float(raw.direct and files.direct)]
    return times


def _gbps(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / 1e9


def table(dirs: list[Path], sizes_mib: list[int], rounds: int) -> None:
    print("| directory (file system) | O_DIRECT | size MiB | raw write GB/s | module write GB/s | write module/raw "
          "| raw read GB/s | module read GB/s | read module/raw |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for directory in dirs:
        for size in sizes_mib:
            t = measure(directory, size * MiB, rounds, QUEUE_DEPTH, BLOCK_BYTES)
            ratio = {op: statistics.median(r / m for r, m in zip(t[f"raw {op}"], t[f"module {op}"], strict=True))
                     for op in ("write", "read")}
            n = size * MiB
            print(f"| {directory} ({_file_system(directory)}) | {'yes' if t['direct'][0] else 'no'} | {size} "
                  f"| {_gbps(n, t['raw write']):.2f} | {_gbps(n, t['module write']):.2f} | {ratio['write']:.2f} "
                  f"| {_gbps(n, t['raw read']):.2f} | {_gbps(n, t['module read']):.2f} | {ratio['read']:.2f} |",
                  flush=True)


def sweep(dirs: list[Path], sizes_mib: list[int], rounds: int) -> None:
    print("| directory | size MiB | queue depth | block MiB | module write / raw | module read / raw |")
    print("|---|---:|---:|---:|---:|---:|")
    for directory in dirs:
        for size in sizes_mib:
            for depth in (1, 2, 4, 8):
                for block_mib in (1, 4, 16):
                    t = measure(directory, size * MiB, rounds, depth, block_mib * MiB)
                    w, r = (statistics.median(a / b for a, b in zip(t[f"raw {op}"], t[f"module {op}"], strict=True))
                            for op in ("write", "read"))
                    print(f"| {directory} | {size} | {depth} | {block_mib} | {w:.2f} | {r:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dirs", default="/tmp,/dev/shm", help="comma-separated directories (default /tmp,/dev/shm)")
    ap.add_argument("--sizes", default="64,256,1024", help="group sizes in MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (medians reported)")
    ap.add_argument("--sweep", action="store_true", help="module/raw over queue depth 1-8 x block 1-16 MiB")
    args = ap.parse_args()
    dirs = [Path(d) for d in args.dirs.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    for d in dirs:
        free = shutil.disk_usage(d).free
        if free < 3 * max(sizes) * MiB:
            raise SystemExit(f"{d}: {free / MiB:.0f} MiB free, need {3 * max(sizes)} MiB")
    work = [Path(tempfile.mkdtemp(prefix="lazytrain-bench-", dir=d)) for d in dirs]
    try:
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; queue depth {QUEUE_DEPTH}, block "
              f"{BLOCK_BYTES // MiB} MiB, raw block {RAW_BLOCK_BYTES // MiB} MiB, {args.rounds} rounds, "
              f"alignment {ALIGN_BYTES} B\n")
        (sweep if args.sweep else table)(work, sizes, args.rounds)
        print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    main()
