"""Host memory of a 2-rank data-parallel run against one process with the same global batch.

    python benchmarks/dp_memory.py                       # debug (the runtime overhead), small, medium; both modes
    python benchmarks/dp_memory.py --runs 3 --models debug medium --modes overlap --pythonpath /path/to/other/src
    python benchmarks/dp_memory.py --models debug medium --dtypes fp32 bf16   # bf16 compute, fp32 masters too
    python benchmarks/dp_memory.py --models medium --modes serial --trace /tmp/trace   # where each rank's Pss goes

Starts `python -m lazytrain train` once as one process (global batch 4) and once as 2 ranks (2 rows each; the
environment torchrun would set, gloo, the emulated device), and samples every process's proportional set size
(Pss in /proc/PID/smaps_rollup: a page shared by k processes counts 1/k in each, so the shared weights and the
shared libraries count once in the sum) every 20 ms. Reports the peak of the summed Pss per run. The runtime
overhead of a rank (Python, torch, transformers, gloo) is the debug model's (0.2 M parameters) 2-rank total
minus its 1-process figure; the target of issue 12 is total(2 ranks) <= 1.15 x (1 process + that overhead).
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


def pss_bytes(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Pss:")), 0)


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


def run(model: str, mode: str, dtype: str, ranks: int, pythonpath: str, trace: Path | None = None) -> int:
    """Peak summed Pss of one run of `ranks` processes (1 = a single process with the whole global batch);
    with `trace`, each process's Pss over time by phase (module docstring)."""
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
        peak, samples = 0, []
        while any(p.poll() is None for p in procs):
            now = [pss_bytes(p.pid) for p in procs]
            peak = max(peak, sum(now))
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
    if trace:
        name = f"{model}-{mode}-{dtype}-{ranks}"
        path = next(p for k in itertools.count(1) if not (p := trace / f"{name}-run{k}.json").exists())
        report_trace(path, f"{mode:<7} {dtype} {model:<6} {ranks}:", samples, marks)
    return peak


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
        medians: dict[tuple[str, int], float] = {}
        for model in args.models:
            for ranks in (1, 2):
                peaks = [run(model, mode, dtype, ranks, args.pythonpath, args.trace) / MiB for _ in range(args.runs)]
                medians[model, ranks] = statistics.median(peaks)
                listed = ", ".join(f"{p:.0f}" for p in peaks)
                print(f"{label} {model:<6} {ranks} process(es): peak summed Pss {listed} MiB "
                      f"(median {medians[model, ranks]:.0f})", flush=True)
        if ("debug", 1) in medians and ("debug", 2) in medians:
            overhead = medians["debug", 2] - medians["debug", 1]
            print(f"{label} runtime overhead of a rank (debug model): {overhead:.0f} MiB")
            for model in args.models:
                if model != "debug":
                    one, two = medians[model, 1], medians[model, 2]
                    print(f"{label} {model}: 2 ranks {two:.0f} MiB / (1 process {one:.0f} + overhead {overhead:.0f}) "
                          f"= {two / (one + overhead):.3f} (target <= 1.15)", flush=True)

if __name__ == "__main__":
    main()
