"""A data-parallel step on the emulated device against its prediction: 1 process, 2 ranks on one node, and 2 nodes
of 1 rank (two process groups on this machine, `LOCAL_WORLD_SIZE=1`).

    python benchmarks/dp_step.py                          # 8 steps of each layout, once
    python benchmarks/dp_step.py --runs 3 --steps 10      # medians over runs

Each layout is `python -m lazytrain train` with the environment torchrun would set (gloo, the emulated device) on a
51 M-parameter Llama (benchmarks/dp_memory.py's `medium`, random init), `per_device_train_batch_size` rows per
rank, the default planner (the MILP with the gradients' sums over the ranks in its step, at the link rates the
ranks measured when they started: `Ranks.time_sums`). Reported per layout:

- measured: the median `step_s` of steps 1.. (metrics.jsonl of rank 0; step 0 pays the warm-up) beside the
  run's `predicted_step_s` (the simulated step of the plan on rank 0's calibration);
- sim(run): step 1's program replayed by the simulator with every op's own measured seconds (rank 0's
  step_trace_measured.json: compute, links, the optimizer lane's updates, reduces and lands) against that step's
  measured span -- the program's structure checked apart from the cost model's seconds;
- the sums: each group's `reduce` op, measured median against the seconds the planner gave it (its bytes over
  the measured rate), and the rates the ranks measured;
- where the seconds go: step 1's busy seconds per kind of op, measured (step_trace_measured.json) against
  predicted (step_trace_predicted.json, the simulated step the prediction is).
The machine is shared and the ranks share its cores (the emulated device computes on the CPU), so state the
load beside any figure; the sim(run) column is the one load does not move much.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.topology import REDUCE_DTYPE_BYTES, Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.plan.schedule import Shapes, build_program
from lazytrain.plan.sim import step_seconds

MEDIUM = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "max_position_embeddings": 512, "vocab_size": 512, "tie_word_embeddings": False, "rope_theta": 10000.0,
          "hidden_size": 640, "intermediate_size": 1792, "num_hidden_layers": 10, "num_attention_heads": 10,
          "num_key_value_heads": 10}
LAYOUTS = ((1, 1), (2, 1), (2, 2))  # (world size, nodes)
RATES = re.compile(r"sums measured at (\S+) GB/s in a node, (\S+) between nodes")


def run(out: Path, world: int, nodes: int, args: argparse.Namespace) -> str:
    """Rank 0's stdout of one run of `world` ranks on `nodes` nodes (1: a single process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = [f"model={out / 'config.json'}", "dataset=zen", f"cutoff_len={args.seq}", "gradient_accumulation_steps=1",
           f"max_steps={args.steps}", "dtype=fp32", "eval_batches=0", "progress=false",
           f"per_device_train_batch_size={args.batch}", f"output_dir={out / 'run'}"]
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": args.pythonpath}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank % (world // nodes)), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world // nodes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "lazytrain", "train", *job], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{world} ranks on {nodes} node(s): exit {p.returncode}\n{err[-3000:]}")
    return outputs[0][0]


KINDS = {"forward": ("F", "R"), "backward": ("B",), "head": ("H",), "sums": ("reduce", "gather"),
         "land": ("land", "embedding"), "update": ("update",)}


def busy_by_kind(path: Path) -> dict[str, float]:
    """Seconds of a step trace's ops by kind (KINDS: compute ops by their name's letter, optimizer-lane jobs by
    their name's first word), and the h2d and d2h lanes' busy seconds."""
    out = dict.fromkeys([*KINDS, "h2d", "d2h"], 0.0)
    for e in json.loads(path.read_text())["traceEvents"]:
        if e["ph"] != "X":
            continue
        lane, first = e["cat"], e["name"].split()[0]
        kind = lane if lane in ("h2d", "d2h") else next(
            (k for k, names in KINDS.items() if (first[0] if lane == "compute" else first) in names), None)
        if kind is not None:
            out[kind] += e["dur"] / 1e6
    return out


def replay(out: Path, world: int, nodes: int, args: argparse.Namespace) -> dict[str, float]:
    """sim(run) of rank 0's measured step 1, and its reduce ops' seconds (measured median, and as planned)."""
    plan = json.loads((out / "run" / "plan.json").read_text())
    tiers = tuple(b["tier"] for b in sorted(plan["boundaries"], key=lambda b: b["boundary"]))
    trace = json.loads((out / "run" / "step_trace_measured.json").read_text())["traceEvents"]
    measured: dict[str, list[tuple[float, float]]] = defaultdict(list)  # name -> (start, seconds), in start order
    for e in sorted((e for e in trace if e["ph"] == "X"), key=lambda e: e["ts"]):
        measured[e["name"]].append((e["ts"] / 1e6, e["dur"] / 1e6))
    span_s = max((e["ts"] + e["dur"]) / 1e6 for e in trace if e["ph"] == "X")
    spec = ModelSpec.from_config(MEDIUM)
    cost = CostModel(spec, HardwareSpec.load("emulated"), Workload(args.batch, args.seq, "fp32"))
    topology = Topology(world_size=world, nodes=nodes)
    program = build_program(tiers, Shapes.from_cost(cost), updates=True, topology=topology)
    used: dict[str, int] = defaultdict(int)
    missing = []

    def seconds_of(op) -> float:  # the k-th op of a name in program order is the k-th measured one
        k, runs = used[op.name], measured.get(op.name, [])
        used[op.name] += 1
        if k >= len(runs):
            missing.append(op.name)
            return 0.0
        return runs[k][1]

    replayed_s, _ = step_seconds(program, seconds_of)
    if missing:
        print(f"  (no measured op for {len(missing)} program ops: {', '.join(sorted(set(missing))[:6])})")
    reduces = [s for name, runs in measured.items() if name.startswith("reduce ") for _, s in runs]
    row = {"replayed_s": replayed_s, "span_s": span_s,
           "reduce_s": statistics.median(reduces) if reduces else 0.0}
    predicted = busy_by_kind(out / "run" / "step_trace_predicted.json")
    for kind, seconds in busy_by_kind(out / "run" / "step_trace_measured.json").items():
        row[f"busy {kind}"], row[f"predicted {kind}"] = seconds, predicted[kind]
    rates = RATES.search((out / "run" / "summary.json").read_text()) if (out / "run" / "summary.json").is_file() \
        else None
    if world > 1 and rates is not None:
        hardware = HardwareSpec.load("emulated", intra_node_gbps=float(rates[1]), inter_node_gbps=float(rates[2]))
        largest = max(spec.layer_params)  # the layers' reduces (the head's is smaller)
        row["planned_reduce_s"] = topology.collective_s(REDUCE_DTYPE_BYTES * largest, hardware)
        row["intra_gbps"], row["inter_gbps"] = float(rates[1]), float(rates[2])
    return row


def one(world: int, nodes: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "config.json").write_text(json.dumps(MEDIUM))
        run(out, world, nodes, args)
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "step_s" in r and r["step"] >= 1]
        result = {"step_s": statistics.median(r["step_s"] for r in steps),
                  "predicted_s": steps[-1]["predicted_step_s"]}
        result.update(replay(out, world, nodes, args))
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="rows per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--pythonpath", default=str(Path(__file__).resolve().parent.parent / "src"),
                        help="the lazytrain source to measure (default: this checkout's)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.runs} run(s) x {args.steps} steps per layout; batch "
          f"{args.batch} x seq {args.seq} per rank, fp32, overlap optimizer")
    print(f"{'layout':<18} {'measured s':>10} {'predicted s':>11} {'ratio':>6} {'sim(run) err':>12} "
          f"{'reduce ms (measured / planned)':>30} {'rates GB/s (node / nodes)':>25}")
    for world, nodes in LAYOUTS:
        results = [one(world, nodes, args) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        name = "1 process" if world == 1 else f"{world} ranks, {nodes} node(s)"
        errors = ", ".join(f"{r['span_s'] / r['replayed_s'] - 1:+.1%}" for r in results)
        reduce = (f"{med['reduce_s'] * 1e3:.1f} / {med['planned_reduce_s'] * 1e3:.1f}" if "planned_reduce_s" in med
                  else "-")
        rates = f"{med['intra_gbps']:.3g} / {med['inter_gbps']:.3g}" if "intra_gbps" in med else "-"
        ratio = med["step_s"] / med["predicted_s"]
        print(f"{name:<18} {med['step_s']:>10.3f} {med['predicted_s']:>11.3f} {ratio:>6.2f} {errors:>12} {reduce:>30} "
              f"{rates:>25}", flush=True)
        print("    busy s, measured / predicted: " + ", ".join(
            f"{kind} {med[f'busy {kind}']:.3f} / {med[f'predicted {kind}']:.3f}" for kind in [*KINDS, "h2d", "d2h"]))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
