"""The whole process's peak resident memory, from the run's start to its end, beside what admission counted.

Admission (`lazytrain plan`'s and `lazytrain train`'s `host:` line) counts the bytes the run's layout keeps; what
the kernel kills a process for is its resident set at the worst moment, loading and saving included. `PeakRss`
samples VmRSS on a thread (with the phase the run was in, so a report can say *where* the peak was) and takes the
kernel's own high-water mark (`ru_maxrss`) at the end, which no sampling interval can miss. The baseline is the
RSS when the run starts: the interpreter with torch and transformers imported, a fixed cost admission does not
count (docs/benchmarks.md).
"""

from __future__ import annotations

import resource
import sys
import threading
from pathlib import Path

SAMPLE_S = 0.005  # between samples: a 1 GiB allocation first-touched at ~5 GB/s takes 0.2 s, seen ~40 times
STATUS = Path("/proc/self/status")


def rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc; None elsewhere)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def max_rss_bytes() -> int:
    """The kernel's high-water mark of this process's resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class PeakRss:
    """Samples this process's RSS from `start()` to `stop()`, labelled by `phase(name)`; see the module docstring."""

    def __init__(self, interval_s: float = SAMPLE_S) -> None:
        self.interval_s = interval_s
        self.baseline_bytes = rss_bytes() or 0
        self.current = "start"
        self.peaks: dict[str, int] = {}  # phase -> the largest sample in it
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="lazytrain-peak-rss", daemon=True)

    def start(self) -> PeakRss:
        self._thread.start()
        return self

    def phase(self, name: str) -> None:
        """Samples from now on belong to `name` (model, plan, build, steps, save, eval ...)."""
        self._record()
        self.current = name

    def _record(self) -> None:
        rss = rss_bytes()
        if rss is not None:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), rss)

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self._record()

    def stop(self) -> dict[str, object]:
        """The figures summary.json keeps: the peak (the kernel's mark, at least the largest sample), the
        baseline, and the sampled peak of each phase."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self._record()
        sampled = max(self.peaks.values(), default=0)
        peak = max(sampled, max_rss_bytes())
        return {"peak_rss_bytes": peak, "baseline_rss_bytes": self.baseline_bytes,
                "peak_rss_phase": max(self.peaks, key=self.peaks.__getitem__) if self.peaks else None,
                "peak_rss_by_phase_bytes": dict(self.peaks)}
