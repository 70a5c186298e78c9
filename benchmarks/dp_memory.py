"""Host memory of a 2-rank data-parallel run against one process with the same global batch.

    python benchmarks/dp_memory.py                       # debug (the runtime overhead), small, medium; both modes
    python benchmarks/dp_memory.py --runs 3 --models debug medium --modes overlap --pythonpath /path/to/other/src
    python benchmarks/dp_memory.py --models debug medium --dtypes fp32 bf16   # bf16 compute, fp32 masters too

Starts `python -m lazytrain train` once as one process (global batch 4) and once as 2 ranks (2 rows each; the
environment torchrun would set, gloo, the emulated device), and samples every process's proportional set size
(Pss in /proc/PID/smaps_rollup: a page shared by k processes counts 1/k in each, so the shared weights and the
shared libraries count once in the sum) every 20 ms. Reports the peak of the summed Pss per run. The runtime
overhead of a rank (Python, torch, transformers, gloo) is the debug model's (0.2 M parameters) 2-rank total
minus its 1-process figure; the target of issue 12 is total(2 ranks) <= 1.15 x (1 process + that overhead).
Models: the built-in `debug` (0.2 M parameters) and `small` (12.8 M), and `medium` (51 M: a Llama config.json
written here, random init), each in every `--modes` optimizer mode (overlap: the default) and `--dtypes` compute
dtype (fp32: the emulated device's default; bf16: with fp32 master weights, the GPU default).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = ["dataset=zen", "cutoff_len=64", "gradient_accumulation_steps=1", "max_steps=3", "planner=megatrain",
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


def run(model: str, mode: str, dtype: str, ranks: int, pythonpath: str) -> int:
    """Peak summed Pss of one run of `ranks` processes (1 = a single process with the whole global batch)."""
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
            procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        peak = 0
        while any(p.poll() is None for p in procs):
            peak = max(peak, sum(pss_bytes(p.pid) for p in procs))
            time.sleep(0.02)
        for p in procs:
            if p.returncode != 0:
                raise SystemExit(f"{model} {mode} {dtype} x {ranks}: exit {p.returncode}\n{p.stderr.read()[-2000:]}")
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["debug", "small", "medium"])
    parser.add_argument("--modes", nargs="+", default=["overlap", "serial"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pythonpath", default=str(Path(__file__).resolve().parent.parent / "src"),
                        help="the lazytrain source to measure (default: this checkout's)")
    args = parser.parse_args()
    for mode, dtype in [(m, d) for d in args.dtypes for m in args.modes]:
        label = f"{mode:<7} {dtype}"
        medians: dict[tuple[str, int], float] = {}
        for model in args.models:
            for ranks in (1, 2):
                peaks = [run(model, mode, dtype, ranks, args.pythonpath) / MiB for _ in range(args.runs)]
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
