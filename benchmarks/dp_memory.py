"""Host memory of a 2-rank data-parallel run against one process with the same global batch.

    python benchmarks/dp_memory.py                       # debug (the runtime overhead), small, medium; both modes
    python benchmarks/dp_memory.py --runs 3 --models debug medium --modes overlap --pythonpath /path/to/other/src
    python benchmarks/dp_memory.py --models debug medium --dtypes fp32 bf16   # bf16 compute, fp32 masters too
    python benchmarks/dp_memory.py --models medium --modes serial --trace /tmp/trace   # where each rank's Pss goes

Starts `python -m lazytrain train` once as one process (global batch 4) and once as 2 ranks (2 rows each; the
environment torchrun would set, gloo, the emulated device), and samples every process's proportional set size
(Pss in /proc/PID/smaps_rollup: a page shared by k processes counts 1/k in each, so the shared weights and the
shared libraries count once in the sum) every 20 ms. Reports the peak of the summed Pss per run (the median
and the range over `--runs`, the debug model's too). The runtime overhead of a rank (Python, torch,
transformers, gloo) is the debug model's (0.2 M parameters) 2-rank total minus its 1-process figure; the target
of issue 12 is total(2 ranks) <= 1.15 x (1 process + that overhead).

Two per-rank costs that scale with the model are not in the debug model's overhead, and each run reports them:
the emulated device's memory, which is this process's heap here (on a GPU node it is the GPU's, not the host's):
the arena's peak, the highest `peak_device_bytes` of the process's metrics rows (a lower bound: the heap
keeps ~30 MiB of fragmentation besides, `keep_host_memory`); and each rank's buffers to sum gradients into
their owners (two pooled landing buffers of the largest group, an fp32 transient of it for bf16 gradients:
`costmodel/topology.py rank_reduce_bytes`, which is what `Executor.keep_gradients` and `OwnerGrads` allocate). So
beside the formula above ("as host"), it prints the same ratio of the host memory without the emulated
devices' arenas ("GPU node": each run's peak minus its processes' arena peaks, the debug overhead likewise),
and the per-rank overhead with its parts. Each run's peak summed Pss less file pages (Pss_File: the shared
libraries, whose Pss falls as other processes of the machine map them too) is printed beside, to read the noise.
Models: the built-in `debug` (0.2 M parameters) and `small` (12.8 M), and `medium` (51 M: a Llama config.json
written here, random init), each in every `--modes` optimizer mode (overlap: the default) and `--dtypes` compute
dtype (fp32: the emulated device's default; bf16: with fp32 master weights, the GPU default).

`--trace DIR`: each run also writes DIR/<model>-<mode>-<dtype>-<ranks>-run<k>.json (every process's Pss every 20 ms and
the times of its report lines and metrics rows) and prints, per process, its highest Pss in each phase -- load (to
the "model" line), calibrate (to "predict": calibration and planning), set-up (to "shared", one process: "device"),
steps (to the last step's metrics row), checkpoint (to "loss": the last update, the final checkpoint, the summary),
close -- and the phase where the summed peak falls.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STEPS = 3
JOB = ["dataset=zen", "cutoff_len=64", "gradient_accumulation_steps=1", f"max_steps={STEPS}", "planner=megatrain",
       "eval_batches=0", "progress=false"]
MiB = 2**20
MEDIUM = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "max_position_embeddings": 512, "rope_theta": 10000.0, "vocab_size": 512, "tie_word_embeddings": False,
          "hidden_size": 640, "intermediate_size": 1792, "num_hidden_layers": 10, "num_attention_heads": 10,
          "num_key_value_heads": 10}


def pss_bytes(pid: int) -> tuple[int, int]:
    """A process's Pss and the part of it in files (Pss_File: the shared libraries' code, whose Pss depends on
    how many processes of the machine map them, this run's or not)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    kib = {f[0]: int(f[1]) * 1024 for line in text.splitlines() if (f := line.split())[-1] == "kB"}
    return kib.get("Pss:", 0), kib.get("Pss_File:", 0)


PHASES = ("load", "calibrate", "set-up", "steps", "checkpoint", "close")


def phase_of(marks: dict[str, float], t: float) -> str:
    """The phase a process was in at time `t`, from when it printed its report lines and its last metrics row."""
    ends = [marks.get("model"), marks.get("predict"), marks.get("shared", marks.get("device")),
            marks.get("steps"), marks.get("loss")]
    return next((name for name, end in zip(PHASES, ends, strict=False) if end is None or t < end), PHASES[-1])


def read_marks(proc: subprocess.Popen, start: float, marks: dict[str, float]) -> None:
    """The time of each report line's tag ("model", "predict", ...) as the process prints it (a thread)."""
    for line in proc.stdout:
        if line[:9].strip():
            marks.setdefault(line[:9].strip(), time.monotonic() - start)


def report_trace(path: Path, label: str, samples: list[list[float]], marks: list[dict[str, float]]) -> None:
    """Each process's highest Pss per phase, and where the summed peak falls; the samples to `path`."""
    path.write_text(json.dumps({"samples": samples, "marks": marks}))
    t_peak, *at_peak = max(samples, key=lambda s: sum(s[1:]))
    for r, m in enumerate(marks):
        highest = {ph: max((s[1 + r] for s in samples if phase_of(m, s[0]) == ph), default=0.0) for ph in PHASES}
        print(f"{label} process {r}: " + ", ".join(f"{ph} {b / MiB:.0f}" for ph, b in highest.items()) + " MiB")
    print(f"{label} summed peak {sum(at_peak) / MiB:.0f} MiB at {t_peak:.1f} s ("
          + " + ".join(f"{b / MiB:.0f} in {phase_of(m, t_peak)}" for b, m in zip(at_peak, marks, strict=True))
          + f"); samples in {path}", flush=True)


def arena_peak(metrics: Path) -> int:
    """The emulated device's arena peak over a process's steps (its metrics rows' `peak_device_bytes`)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max(int(row.get("peak_device_bytes", 0)) for row in rows)


def reduce_bytes(model: str, dtype: str) -> int:
    """What a rank of 2 allocates to sum gradients into their owners (module docstring): the runtime's own count,
    `rank_reduce_bytes`."""
    from lazytrain import CostModel, HardwareSpec, ModelSpec, Workload
    from lazytrain.costmodel.topology import Topology, rank_reduce_bytes
    from lazytrain.job.inputs import model_spec

    spec = ModelSpec.from_config(MEDIUM, name="medium") if model == "medium" else model_spec(model)
    cost = CostModel(spec, HardwareSpec.load("emulated"), Workload(2, 64, dtype))
    return sum(rank_reduce_bytes(cost, Topology(world_size=2)).values())


def run(model: str, mode: str, dtype: str, ranks: int, pythonpath: str, trace: Path | None = None
        ) -> tuple[int, int, int]:
    """Peak summed Pss of one run of `ranks` processes (1 = a single process with the whole global batch), the
    sum of its processes' device arena peaks, and the peak summed Pss less file pages; with `trace`, each
    process's Pss over time by phase (module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    with tempfile.TemporaryDirectory() as out:
        if model == "medium":
            (Path(out) / "config.json").write_text(json.dumps(MEDIUM))
        for r in range(ranks):
            env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
            if ranks > 1:
                env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            name = f"{out}/config.json" if model == "medium" else model
            args = [sys.executable, "-m", "lazytrain", "train", f"model={name}", f"optimizer_mode={mode}",
                    f"dtype={dtype}", *JOB,
                    f"per_device_train_batch_size={4 // ranks}", f"output_dir={out}/run"]
            procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE if trace else subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        start = time.monotonic()
        marks: list[dict[str, float]] = [{} for _ in procs]
        readers = [threading.Thread(target=read_marks, args=(p, start, m), daemon=True)
                   for p, m in zip(procs, marks, strict=True)] if trace else []
        for t in readers:
            t.start()
        rows = [Path(out) / "run" / ("" if r == 0 else f"rank-{r}") / "metrics.jsonl" for r in range(ranks)]
        peak, peak_unfiled, samples = 0, 0, []
        while any(p.poll() is None for p in procs):
            parts = [pss_bytes(p.pid) for p in procs]
            now = [pss for pss, _ in parts]
            peak = max(peak, sum(now))
            peak_unfiled = max(peak_unfiled, sum(pss - file for pss, file in parts))
            if trace:
                t = time.monotonic() - start
                samples.append([t, *now])
                for m, f in zip(marks, rows, strict=True):  # the steps end with the last step's row
                    if "steps" not in m and f.exists() and f.read_text().count("\n") >= STEPS:
                        m["steps"] = t
            time.sleep(0.02)
        for t in readers:
            t.join()
        for p in procs:
            if p.returncode != 0:
                raise SystemExit(f"{model} {mode} {dtype} x {ranks}: exit {p.returncode}\n{p.stderr.read()[-2000:]}")
        arenas = sum(arena_peak(f) for f in rows)
    if trace:
        name = f"{model}-{mode}-{dtype}-{ranks}"
        path = next(p for k in itertools.count(1) if not (p := trace / f"{name}-run{k}.json").exists())
        report_trace(path, f"{mode:<7} {dtype} {model:<6} {ranks}:", samples, marks)
    return peak, arenas, peak_unfiled


def listed(mib: list[float]) -> str:
    """Runs' figures, their median and range."""
    return (", ".join(f"{m:.0f}" for m in mib) + f" MiB (median {statistics.median(mib):.0f}, range "
            f"{max(mib) - min(mib):.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["debug", "small", "medium"])
    parser.add_argument("--modes", nargs="+", default=["overlap", "serial"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pythonpath", default=str(Path(__file__).resolve().parent.parent / "src"),
                        help="the lazytrain source to measure (default: this checkout's)")
    parser.add_argument("--trace", type=Path, help="a folder for each run's Pss samples; prints Pss by phase")
    args = parser.parse_args()
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
    for mode, dtype in [(m, d) for d in args.dtypes for m in args.modes]:
        label = f"{mode:<7} {dtype}"
        host: dict[tuple[str, int], float] = {}  # medians of the peak summed Pss, MiB
        gpu: dict[tuple[str, int], float] = {}  # the same less the processes' arena peaks
        arena: dict[tuple[str, int], float] = {}
        for model in args.models:
            for ranks in (1, 2):
                runs = [run(model, mode, dtype, ranks, args.pythonpath, args.trace) for _ in range(args.runs)]
                peaks = [p / MiB for p, _, _ in runs]
                arenas = [a / MiB for _, a, _ in runs]
                unfiled = [u / MiB for _, _, u in runs]
                less = [p - a for p, a in zip(peaks, arenas, strict=True)]
                host[model, ranks], gpu[model, ranks] = statistics.median(peaks), statistics.median(less)
                arena[model, ranks] = statistics.median(arenas)
                print(f"{label} {model:<6} {ranks} process(es): peak summed Pss {listed(peaks)}; device arena "
                      f"peaks {listed(arenas)}; Pss less the arenas {listed(less)}; peak summed Pss less file "
                      f"pages {listed(unfiled)}", flush=True)
        if ("debug", 1) not in host or ("debug", 2) not in host:
            continue
        overhead = host["debug", 2] - host["debug", 1]
        overhead_gpu = gpu["debug", 2] - gpu["debug", 1]
        print(f"{label} runtime overhead of a rank (debug model): {overhead:.0f} MiB as host, "
              f"{overhead_gpu:.0f} MiB less the arenas")
        for model in args.models:
            if model == "debug":
                continue
            one, two, one_gpu, two_gpu = host[model, 1], host[model, 2], gpu[model, 1], gpu[model, 2]
            pool = reduce_bytes(model, dtype) / MiB
            print(f"{label} {model}: as host: 2 ranks {two:.0f} MiB / (1 process {one:.0f} + overhead "
                  f"{overhead:.0f}) = {two / (one + overhead):.3f}; GPU node (less the device arenas): "
                  f"{two_gpu:.0f} / ({one_gpu:.0f} + {overhead_gpu:.0f}) = {two_gpu / (one_gpu + overhead_gpu):.3f}; "
                  f"the same with both ranks' gradient-sum buffers (2 x {pool:.0f} MiB) in the overhead: "
                  f"{two_gpu / (one_gpu + overhead_gpu + 2 * pool):.3f} (target <= 1.15)", flush=True)
            print(f"{label} {model}: per-rank overhead {overhead_gpu + pool + arena[model, 2] / 2:.0f} MiB = "
                  f"runtime {overhead_gpu:.0f} (debug model, less its arena) + gradient-sum buffers {pool:.0f} + "
                  f"emulated device arena {arena[model, 2] / 2:.0f} (a rank's median; 1 process's: "
                  f"{arena[model, 1]:.0f})", flush=True)

if __name__ == "__main__":
    main()
