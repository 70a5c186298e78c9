"""Peak host memory of a few training steps of a ~300 M-parameter model in each host layout, against what both
commands admit by (CostModel's executor layout).

    python benchmarks/host.py                          # the three modes, 3 steps each, 1 run
    python benchmarks/host.py --runs 3 --modes bf16-masters --accumulation 2

Each run is a fresh process: it imports everything, notes its RSS, builds the model (random weights, straight in
the masters' dtype), the executor (every boundary kept on the emulated device) and Hybrid8bitAdamW (8-bit states),
then runs forward + backward + the serial optimizer step `--steps` times while a thread samples VmRSS every 2 ms.
The emulated device's memory is host memory too: each sample subtracts what its arena counts at that moment, and
the child runs with MALLOC_MMAP_THRESHOLD_=65536 so that a freed device block leaves the RSS (glibc would keep it
in its heap). Reported against `static_host_bytes()` (states, gradients, weights, the transient cast and the
optimizer's working copies included), above the baseline: the peak while the device is idle (after each
forward-backward and during the optimizer step: the host layout alone) and the peak over the whole run (during
forward-backward it also holds device working memory the arena does not count, e.g. autograd's weight gradients
before they are copied into a gradient slot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

CONFIG = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False)
MODES = {  # name: (dtype, master_weights)
    "fp32-masters": ("bf16", "fp32"),
    "bf16-masters": ("bf16", "bf16"),
    "fp32": ("fp32", "fp32"),
}

MEASURE = textwrap.dedent("""
    import json, sys, threading, time
    import torch, transformers
    from lazytrain import EmulatedDevice, Executor, Plan
    from lazytrain.config import load_job_config
    from lazytrain.optim import Hybrid8bitAdamW
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.costmodel.workload import Workload
    from lazytrain.train.optimizer import optimizer_step

    config_values, dtype, master, steps, accumulation = (json.loads(sys.argv[1]), sys.argv[2], sys.argv[3],
                                                         int(sys.argv[4]), int(sys.argv[5]))
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    masters = torch.bfloat16 if master == "bf16" else torch.float32
    config = transformers.AutoConfig.for_model(**config_values)
    job = load_job_config({"optimizer": "8bit", "master_weights": master, "dtype": dtype,
                           "gradient_accumulation_steps": accumulation})
    device = EmulatedDevice()

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmRSS"].split()[0]) * 1024

    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)  # modeling code imported before the baseline
    base = status()
    peak = {"host": 0, "rss": 0}
    done = False
    def sample():
        while not done:
            rss = status() - base
            peak["rss"] = max(peak["rss"], rss)
            peak["host"] = max(peak["host"], rss - device.used_bytes)
            time.sleep(0.002)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=masters)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    model.model.rotary_emb.__init__(config)  # its inv_freq buffer, emptied by to_empty
    tiers = ["gpu"] * (config.num_hidden_layers + 1)
    ex = Executor(model, Plan.from_tiers(model, tiers), device, compute_dtype=compute)
    opt = Hybrid8bitAdamW([{"params": g} for g in ex.param_groups()], lr=1e-4, max_grad_norm=1.0)
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=gen)
    times, phases = [], {"built": status() - base}
    def phase(name):
        phases[name] = max(phases.get(name, 0), peak["host"])
        peak["host"] = phases["after " + name] = status() - base - device.used_bytes
    phase("build")
    for _ in range(steps):
        t0 = time.perf_counter()
        for i in range(accumulation):
            ex.forward_backward(ids, ids, last_micro_batch=i == accumulation - 1)
        phase("forward_backward")
        optimizer_step(job, opt, ex, grad_norm=ex.last_step.grad_norm)
        phase("optimizer")
        times.append(time.perf_counter() - t0)
    peak["host"] = max(v for k, v in phases.items() if not k.startswith("after"))
    done = True
    thread.join()
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(1, 64, dtype),
                     "8bit", master_weights=master, grad_accumulation=accumulation)
    breakdown = cost.host_breakdown()
    breakdown["optimizer_states"] = opt.state_bytes()  # tensors under 4096 elements keep fp32 states
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "predicted": sum(breakdown.values()),
                      "breakdown": breakdown, "peak_host": peak["host"], "peak_rss": peak["rss"],
                      "after": status() - base - device.used_bytes, "step_s": times, "phases": phases}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path]),
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"cpu: {_cpu_model()}; load average {os.getloadavg()[0]:.1f}; {args.steps} steps, gradient accumulation "
          f"{args.accumulation}, 8-bit states, batch 1 x 64")
    for mode in args.modes:
        dtype, master = MODES[mode]
        rows = []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(CONFIG), dtype, master, str(args.steps),
                                  str(args.accumulation)], check=True, env=env, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[0]
        n, predicted = r["params"], r["predicted"]
        idle = statistics.median(max(v for k, v in row["phases"].items() if k in ("after forward_backward",
                                                                                  "optimizer")) for row in rows)
        peak = statistics.median(row["peak_host"] for row in rows)
        parts = ", ".join(f"{k} {v / n:.2f}" for k, v in r["breakdown"].items() if v)
        print(f"{mode}: {n / 1e6:.1f} M params; executor layout {predicted / 2**20:.0f} MiB = "
              f"{predicted / n:.2f} B/param ({parts}); median of {len(rows)}: peak host RSS with the device idle "
              f"{idle / 2**20:.0f} MiB = {idle / predicted:.3f}x, over the whole run {peak / 2**20:.0f} MiB = "
              f"{peak / predicted:.3f}x; step {statistics.median(r['step_s']):.1f} s")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
