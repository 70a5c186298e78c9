"""Timelines of one step that people can open: a picture (one row per lane, device memory below) and a
Chrome-trace JSON (chrome://tracing, ui.perfetto.dev: one track per lane).

    from lazytrain.viz import plot_timeline, write_trace
    plot_timeline(simulate(plan, cost), "timeline.png", title="qwen3.6-27b, MILP plan")
    write_trace(simulate(plan, cost).events, "step.json")          # predicted
    write_trace(executor.last_step.timeline, "measured.json")      # measured

The picture needs matplotlib (the `viz` extra); imported lazily so the rest of LazyTrain never pays for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lazytrain import jsonio
from lazytrain.errors import LazyTrainError
from lazytrain.plan.schedule import LANES
from lazytrain.writes import write_atomic, writing

COLORS = {"F": "#4c72b0", "R": "#dd8452", "B": "#55a868", "H": "#c44e52", "h2d": "#8172b3", "d2h": "#937860",
          "nvme_read": "#da8bc3", "nvme_write": "#8c8c8c", "optimizer": "#ccb974"}


def _color(stream: str, name: str) -> str:
    if stream == "compute":
        return COLORS.get(name[:1], "#4c72b0")
    return COLORS.get(stream, "#999999")


def plot_timeline(result: Any, path: str | Path, *, title: str = "") -> Path:
    """Draw `result.events` (a SimResult) as bars per stream and the device memory trace; save to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LazyTrainError("the timeline picture needs matplotlib: pip install 'lazytrain[viz]'") from None
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(14, 5.5), sharex=True, height_ratios=[3, 1.4])
    for row, stream in enumerate(LANES):
        bars = [(e.start, e.end - e.start) for e in result.events if e.stream == stream and e.end > e.start]
        colors = [_color(stream, e.name) for e in result.events if e.stream == stream and e.end > e.start]
        if bars:
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(LANES)), [f"{s}\n(exposed {result.exposed_s.get(s, 0.0) * 1e3:.0f} ms)"
                                      if s != "compute" else s for s in LANES], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title or f"step {result.step_s:.3f} s, {result.tflops:.1f} TFLOPS ({result.optimizer_mode} optimizer)")
    times, levels = zip(*result.memory_trace["gpu"], strict=True) if result.memory_trace["gpu"] else ((0,), (0,))
    mem.step(times, [v / 2**30 for v in levels], where="post", color="#4c72b0")
    mem.set_ylabel("device GiB")
    mem.set_xlabel("seconds")
    mem.axhline(result.peak_bytes["gpu"] / 2**30, color="#c44e52", linewidth=0.8, linestyle="--")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def trace_events(ops: Iterable[object], *, process: str = "step") -> dict[str, list[dict[str, object]]]:
    """Chrome-trace JSON of a step: `ops` are simulator Events (stream, name, start, end) or measured
    `(lane, name, start_s, end_s)` tuples; one thread (track) per lane, complete ("X") events in microseconds."""
    rows = []
    for op in ops:
        lane, name, start, end = (op.stream, op.name, op.start, op.end) if hasattr(op, "stream") else tuple(op)
        rows.append((str(lane), str(name), float(start), float(end)))
    lanes = [lane for lane in LANES if any(r[0] == lane for r in rows)]
    lanes += sorted({r[0] for r in rows} - set(lanes))
    tid = {lane: k + 1 for k, lane in enumerate(lanes)}
    events: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": process}}]
    for lane in lanes:
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[lane], "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid[lane],
                       "args": {"sort_index": tid[lane]}})
    for lane, name, start, end in rows:
        events.append({"name": name, "cat": lane, "ph": "X", "pid": 1, "tid": tid[lane],
                       "ts": round(start * 1e6, 3), "dur": round(max(0.0, end - start) * 1e6, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(ops: Iterable[object], path: str | Path, *, process: str = "step", then: str = "") -> Path:
    """Write `trace_events(ops)` to `path` whole (writes.py: a temporary name, then a rename; a failure is one
    line ending with `then`)."""
    path = Path(path)
    with writing(path, then=then):
        path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, jsonio.dumps(trace_events(ops, process=process)) + "\n", then=then)
