"""Peak host memory while loading a sharded ~300 M-parameter model directory, against what admission counts.

    python benchmarks/loading.py                    # Llama shapes, 302 M parameters, bf16 shards of 200 MB
    python benchmarks/loading.py --runs 3 --shard 500MB --compare-from-pretrained

Writes the model directory into a temporary directory (random bf16 weights, sharded with an index, written by
a child process), then for each run starts a fresh process that imports everything, notes its RSS, loads the
model with `lazytrain.runtime.weights.load_model` while a thread samples VmRSS and RssAnon from
/proc/self/status every 2 ms, and reports the peaks above the baseline. Admission counts the fp32 host
parameters as CostModel(...).host_breakdown()["weights"] = 4 bytes x N; the rest of
static_host_bytes (gradients, optimizer states, streamed copies) is allocated later, by the trainer.
`--compare-from-pretrained` measures `AutoModelForCausalLM.from_pretrained(dir, dtype=float32)` the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CONFIG = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False)

MAKE = textwrap.dedent("""
    import json, sys, torch, transformers
    config = transformers.AutoConfig.for_model(**json.loads(sys.argv[1]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(sys.argv[2], max_shard_size=sys.argv[3])
""")

MEASURE = textwrap.dedent("""
    import json, resource, sys, threading, time
    import torch, transformers
    from lazytrain.runtime.weights import load_model, resolve_model, meta_model
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.workload import Workload

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

    path, how = sys.argv[1], sys.argv[2]
    source = resolve_model(path)
    meta_model(source.config)  # import the modeling code before the baseline
    base = status()
    peak = dict(base)
    done = False
    def sample():
        while not done:
            for k, v in status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.002)
    thread = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    if how == "lazytrain":
        model = load_model(source)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seconds = time.perf_counter() - t0
    done = True
    thread.join()
    for k, v in status().items():
        peak[k] = max(peak[k], v)
    n = sum(p.numel() for p in model.parameters())
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"), Workload(1, 1024, "bf16"),
                     "adamw")
    print(json.dumps({"params": n, "seconds": seconds, "weights_bytes": cost.host_breakdown()["weights"],
                      "static_host_bytes": cost.static_host_bytes(),
                      "peak_rss": peak["VmRSS"] - base["VmRSS"], "peak_anon": peak["RssAnon"] - base["RssAnon"],
                      "peak_file": peak["RssFile"] - base["RssFile"],
                      "after_rss": status()["VmRSS"] - base["VmRSS"]}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shard", default="200MB", help="max_shard_size of the generated directory")
    parser.add_argument("--compare-from-pretrained", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
    with tempfile.TemporaryDirectory(prefix="lazytrain-loading-") as tmp:
        subprocess.run([sys.executable, "-c", MAKE, json.dumps(CONFIG), tmp, args.shard], check=True, env=env,
                       capture_output=True)
        shards = sorted(Path(tmp).glob("*.safetensors"))
        size = sum(p.stat().st_size for p in shards)
        print(f"model dir: {len(shards)} shards, {size / 1e6:.0f} MB (bf16), {args.shard} max per shard")
        hows = ["lazytrain"] + (["from_pretrained"] if args.compare_from_pretrained else [])
        for how in hows:
            rows = []
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, "-c", MEASURE, tmp, how], check=True, env=env,
                                     capture_output=True, text=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[0]
            weights = r["weights_bytes"]
            med = {k: statistics.median(row[k] for row in rows) for k in ("peak_rss", "peak_anon", "peak_file",
                                                                           "after_rss", "seconds")}
            print(f"{how}: {r['params'] / 1e6:.1f} M params; admission's fp32 weights {weights / 2**20:.0f} MiB "
                  f"(static_host_bytes, bf16 adamw: {r['static_host_bytes'] / 2**20:.0f} MiB); median of {len(rows)}: "
                  f"peak RSS +{med['peak_rss'] / 2**20:.0f} MiB ({med['peak_rss'] / weights:.3f}x), "
                  f"anonymous +{med['peak_anon'] / 2**20:.0f} MiB ({med['peak_anon'] / weights:.3f}x), "
                  f"file-backed +{med['peak_file'] / 2**20:.0f} MiB; after load +{med['after_rss'] / 2**20:.0f} MiB; "
                  f"{med['seconds']:.1f} s")


if __name__ == "__main__":
    main()
