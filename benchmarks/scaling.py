"""Simulated data-parallel scaling: 1, 2, 4, 8 GPUs on one node and 2 nodes x 8, for the h800 example jobs.

    python benchmarks/scaling.py                          # both examples, markdown table on stdout
    python benchmarks/scaling.py --time-limit 20 --configs examples/qwen2.5-7b-sft-h800.yaml

Each row is `lazytrain plan CONFIG --world-size N --nodes M` (lazytrain/plan/rank_plan.py): one rank's plan (the MILP
with the gradients' sums over the ranks on its optimizer lane, per-rank budgets of the example, the node's NVMe
rate shared by its ranks), the MILP's step beside the simulated step with the sums (equal), the simulated step of
the plan the MILP makes without them (the one-rank MILP), the tokens/s of all ranks, the seconds of the sums, the
PCIe bytes one rank moves per step, and the host bytes of one node -- with the weights shared and the optimizer sharded
by the node's ranks (docs/parallel.md), and, beside it, with every rank holding its own copy. Simulated, nothing
measured: no GPU was used.
"""

from __future__ import annotations

import argparse

from lazytrain.config import load_job_config
from lazytrain.job.inputs import model_spec, rank_inputs, resolve_hardware
from lazytrain.plan.planner import make_plan
from lazytrain.plan.rank_plan import predict_ranks
from lazytrain.plan.sim import simulate

LAYOUTS = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 2))  # (world_size, nodes)
CONFIGS = ("examples/qwen2.5-7b-sft-h800.yaml", "examples/plan-qwen3.6-27b-h800.yaml")


def rows(config: str, time_limit_s: float) -> list[str]:
    out, one_gpu_tokens_per_s = [], None
    for world, nodes in LAYOUTS:
        job = load_job_config(config, overrides=[f"world_size={world}", f"nodes={nodes}",
                                                 f"time_limit_s={time_limit_s}"])
        spec, hardware = model_spec(job.model.model), resolve_hardware(job.runtime)
        topology, cost, _, budgets = rank_inputs(job, spec, hardware, job.data.per_device_train_batch_size)
        mode = job.optim.optimizer_mode
        plan = make_plan(job.plan, cost, budgets, optimizer_mode=mode, topology=topology)
        p = predict_ranks(plan, cost, topology, optimizer_mode=mode)
        # the one-rank MILP (no sums in its step), its plan run with ranks
        alone = make_plan(job.plan, cost, budgets, optimizer_mode=mode)
        alone_s = simulate(alone, cost, optimizer_mode=mode, topology=topology).step_s
        counts = plan.counts()
        one_gpu_tokens_per_s = one_gpu_tokens_per_s or p.tokens_per_s  # the first layout is one GPU
        r = plan.report
        out.append(
            f"| {spec.name} | {world} | {nodes} | {job.data.per_device_train_batch_size} x {world} | "
            f"{counts['gpu']}/{counts['cpu']}/{counts['nvme']}/{counts['recompute']} | {r.seconds:.1f} ({r.status}) | "
            f"{r.options['step_s']:.3f} | {p.step.step_s:.3f} | {alone_s:.3f} | "
            f"{p.tokens_per_s:,.0f} | {p.tokens_per_s / one_gpu_tokens_per_s:.2f} | "
            f"{p.reduce_s:.2f} ({p.step.exposed_s['optimizer'] * 1e3:.0f}) | {p.step.link_bytes['h2d'] / 2**30:.1f} + "
            f"{p.step.link_bytes['d2h'] / 2**30:.1f} | {p.intra_node_bytes / 2**30:.1f} / "
            f"{p.inter_node_bytes / 2**30:.1f} | {p.host['node'] / 2**30:.0f} | "
            f"{p.replicated_node_host_bytes / 2**30:.0f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--time-limit", type=float, default=60.0, help="MILP seconds per row")
    args = parser.parse_args()
    print("| model | GPUs | nodes | batch | plan G/C/N/R | solve s | MILP step s | simulated step s | one-rank MILP's "
          "plan, simulated s | tokens/s | x one GPU | sums s (optimizer lane exposed ms) | PCIe GiB per rank (h2d + "
          "d2h) | sums GiB per rank (node / across) | host GiB per node, shared | host GiB per node, replicated |")
    print("|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for config in args.configs:
        for row in rows(config, args.time_limit):
            print(row, flush=True)


if __name__ == "__main__":
    main()
