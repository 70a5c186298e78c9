"""A LoRA (or QLoRA) run on the emulated device: its step measured against the plan's prediction and its peak host
RSS against what admission counted, from `lazytrain train`'s summary.json and plan.json.

    python benchmarks/lora_run.py [--runs 3] [--quantization-bit 4] [--steps 8]

Writes a Llama model directory into a temporary directory (8 layers, hidden 512, intermediate 1376, vocab 512,
random bf16 weights: 24.9 M parameters), then runs `python -m lazytrain train` on it `--runs` times (fresh
processes, one after the other; dataset zen, cutoff_len 256, batch 4, dtype auto: bf16 where the CPU has it, else
fp32; lora_rank 16 on all linears, gpu_mem_cap 128MiB, the MILP's plan) and prints each run and the medians:
measured / predicted step, and (peak RSS - the RSS at start) / (admitted host bytes + the plan's device peak: the
emulated device's memory is this process's heap).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loading import MAKE  # the model directory writer benchmarks/loading.py runs too

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)
MIB = 2**20


def run(model_dir: Path, out: Path, steps: int, quantization_bit: int | None) -> dict[str, float]:
    keys = [f"model={model_dir}", "dataset=zen", "cutoff_len=256", "per_device_train_batch_size=4",
            "finetuning_type=lora", "lora_rank=16", "lora_target=all", f"max_steps={steps}", "planner=milp",
            "gpu_mem_cap=128MiB", "eval_batches=0", "progress=false", "save_steps=0", f"output_dir={out}"]
    keys += [f"quantization_bit={quantization_bit}"] if quantization_bit else []
    with open(out.with_suffix(".log"), "w") as log:  # the run's report, to follow it
        code = subprocess.run([sys.executable, "-m", "lazytrain", "train", *keys], stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code:
        sys.exit(f"lazytrain train exited {code}:\n{out.with_suffix('.log').read_text()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    device = json.loads((out / "plan.json").read_text())["prediction"]["peak_bytes"]["gpu"]
    above = summary["peak_rss_bytes"] - summary["baseline_rss_bytes"]
    return dict(measured_s=summary["median_step_s"], predicted_s=summary["predicted_step_s"],
                admitted=summary["host_admitted_bytes"], device=device, peak=summary["peak_rss_bytes"],
                baseline=summary["baseline_rss_bytes"], ratio=above / (summary["host_admitted_bytes"] + device),
                phase=summary["peak_rss_phase"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quantization-bit", type=int, choices=[4], default=None)
    args = parser.parse_args()
    print(f"cpu {platform.machine()}, {os.cpu_count()} cpus; load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        subprocess.run([sys.executable, "-c", MAKE, json.dumps(CONFIG), str(model_dir), "50MB"], check=True)
        rows = []
        for i in range(args.runs):
            r = run(model_dir, Path(tmp) / f"run{i}", args.steps, args.quantization_bit)
            rows.append(r)
            print(f"run {i}: step {r['measured_s']:.3f} s measured vs {r['predicted_s']:.3f} s predicted "
                  f"({r['measured_s'] / r['predicted_s']:.2f}x); peak RSS {r['peak'] / MIB:.0f} MiB (start "
                  f"{r['baseline'] / MIB:.0f}) vs admitted {r['admitted'] / MIB:.0f} + device {r['device'] / MIB:.0f} "
                  f"MiB: {r['ratio']:.3f}x ({r['phase']}); load {os.getloadavg()[0]:.1f}")
    ratio = statistics.median(r["measured_s"] / r["predicted_s"] for r in rows)
    print(f"median: measured/predicted {ratio:.2f}x, (peak - start)/(admitted + device) "
          f"{statistics.median(r['ratio'] for r in rows):.3f}x")


if __name__ == "__main__":
    main()
