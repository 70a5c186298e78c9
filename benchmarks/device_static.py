"""Static device bytes and what they cost: the paper instances' slots and working sets, and what the room buys.

    python benchmarks/device_static.py             # everything (a few minutes on a 2-core CPU)
    python benchmarks/device_static.py static      # static device bytes by kind, paper instances
    python benchmarks/device_static.py plans       # 27B/H800 batch 72 at 70 and 50 GB: tiers, kept layers, step
    python benchmarks/device_static.py maxbatch    # largest feasible batch: 27B/H800 at 70 and 50 GB, 7B rtx3090
    python benchmarks/device_static.py why         # issue 10's 40 GB / 36 GB instances: the largest batch that
                                                   # fits, and MILP vs simulated step there

Static bytes are what every window of the step holds (`CostModel.device_breakdown`); the loss head's own weight
and gradient slots (when it is larger than a layer) are charged only in the windows where they are live, so they
are listed apart. Everything here is the cost model's arithmetic and the MILP (HiGHS); no device is used.
"""

from __future__ import annotations

import platform
import sys
import time

from lazytrain.config import load_job_config
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.job.batch import largest_feasible_batch
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp
from lazytrain.plan.plan import TIERS
from lazytrain.plan.planner import admitted
from lazytrain.plan.sim import simulate

GB = 10**9
GiB = 2**30
PAPER = (("qwen2.5-3b", "h800", 192), ("qwen2.5-7b", "h800", 144), ("qwen2.5-14b", "h800", 96),
         ("qwen3.6-27b", "h800", 72), ("qwen2.5-7b", "rtx3090", 4))


def _tiers(tiers: tuple[str, ...]) -> str:
    return "/".join(str(tiers.count(t)) for t in TIERS)


def bench_static() -> None:
    print("## Static device bytes (GiB) by kind, seq 1024, bf16; head slots: the loss head's own weight + gradient "
          "slots where it is larger than a layer")
    print("| model | hardware | batch | weight slots | grad slots | working set | boundary grads | constants | "
          "static total | head slots (each) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset, hardware, batch in PAPER:
        cost = CostModel(ModelSpec.load(preset), HardwareSpec.load(hardware), Workload(batch, 1024))
        d = cost.device_breakdown()
        print(f"| {preset} | {hardware} | {batch} | {d['weight_slots'] / GiB:.2f} | {d['grad_slots'] / GiB:.2f} | "
              f"{d['working_set'] / GiB:.2f} | {d['boundary_grads'] / GiB:.2f} | {d['constants'] / GiB:.3f} | "
              f"{cost.static_device_bytes() / GiB:.2f} | {cost.head_slot_bytes / GiB:.2f} |")


def bench_plans() -> None:
    print("## 27B / H800, batch 72 x 1024, cpu act 15 GB: the MILP's plan (overlap optimizer, HiGHS)")
    print("| gpu cap | nvme act | tiers G/C/N/R | kept layers | MILP step s | simulated s | peak GiB | solve s |")
    print("|---|---|---|---|---|---|---|---|")
    cost = CostModel(ModelSpec.load("qwen3.6-27b"), HardwareSpec.load("h800"), Workload(72, 1024))
    for cap_gb, nvme_gb in ((70, 32), (50, 32), (50, 8)):
        budgets = Budgets(gpu_mem_cap_bytes=cap_gb * GB, cpu_act_bytes=15 * GB, nvme_act_bytes=nvme_gb * GB)
        _, budgets = admitted(cost, budgets)
        plan = solve_milp(cost, budgets, time_limit_s=120)
        sim = simulate(plan, cost)
        print(f"| {cap_gb} GB | {nvme_gb} GB | {_tiers(plan.tiers)} | {plan.kept_layers} | "
              f"{plan.report.options['step_s']:.3f} | {sim.step_s:.3f} | {sim.peak_bytes['gpu'] / GiB:.2f} | "
              f"{plan.report.seconds:.2f} ({plan.report.status}) |")
        sys.stdout.flush()


def _job(cap_gb: float | None, cpu_gb: float | None, nvme_gb: float | None):
    plan = {k: f"{v}GB" for k, v in (("gpu_mem_cap", cap_gb), ("cpu_act_budget", cpu_gb),
                                      ("nvme_act_budget", nvme_gb)) if v is not None}
    return load_job_config({"seq_len": 1024, "dtype": "bf16", "optimizer": "adamw", **plan})


def bench_max_batch() -> None:
    print("## Largest feasible batch (MILP, feasibility search), seq 1024, bf16, fp32 Adam")
    print("| model | hardware | gpu cap / cpu act / nvme act | largest batch | next batch refused because | "
          "search s |")
    print("|---|---|---|---|---|---|")
    cases = (("qwen3.6-27b", "h800", 70, 15, 32), ("qwen3.6-27b", "h800", 50, 15, 32),
             ("qwen2.5-7b", "rtx3090", None, None, None))
    for preset, hardware, cap, cpu, nvme in cases:
        t0 = time.perf_counter()
        batch, why = largest_feasible_batch(_job(cap, cpu, nvme), ModelSpec.load(preset), HardwareSpec.load(hardware),
                                            "milp")
        budgets = "default" if cap is None else f"{cap} / {cpu} / {nvme} GB"
        print(f"| {preset} | {hardware} | {budgets} | {batch} | {why[:90]} | {time.perf_counter() - t0:.1f} |")
        sys.stdout.flush()


def bench_why() -> None:
    print("## Issue 10's 'Why' instances (27B / H800, seq 1024, cpu act 15 GB, nvme act 8 GB): the largest batch "
          "that fits, and the MILP (optimal, overlap) vs the simulator there")
    print("| gpu cap | largest batch | tiers G/C/N/R | kept layers | MILP step s | simulated s | MILP / sim | "
          "peak GiB | solve s |")
    print("|---|---|---|---|---|---|---|---|---|")
    spec, hw = ModelSpec.load("qwen3.6-27b"), HardwareSpec.load("h800")
    for cap_gb in (40, 36):
        batch, why = largest_feasible_batch(_job(cap_gb, 15, 8), spec, hw, "milp")
        if batch == 0:
            print(f"| {cap_gb} GB | 0 | {why[:120]} | | | | | | |")
            continue
        cost = CostModel(spec, hw, Workload(batch, 1024))
        budgets = Budgets(gpu_mem_cap_bytes=cap_gb * GB, cpu_act_bytes=15 * GB, nvme_act_bytes=8 * GB)
        _, budgets = admitted(cost, budgets)
        try:
            plan = solve_milp(cost, budgets, time_limit_s=120)
        except LazyTrainError as err:
            print(f"| {cap_gb} GB | {batch} | optimal solve failed: {err} | | | | | | |")
            continue
        sim = simulate(plan, cost)
        milp_s = plan.report.options["step_s"]
        print(f"| {cap_gb} GB | {batch} | {_tiers(plan.tiers)} | {plan.kept_layers} | {milp_s:.3f} | "
              f"{sim.step_s:.3f} | {milp_s / sim.step_s:.4f} | {sim.peak_bytes['gpu'] / GiB:.2f} | "
              f"{plan.report.seconds:.2f} ({plan.report.status}) |")
        sys.stdout.flush()


def main(argv: list[str]) -> None:
    which = argv or ["static", "plans", "maxbatch", "why"]
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"command: python benchmarks/device_static.py {' '.join(argv)}".rstrip())
    for name in which:
        {"static": bench_static, "plans": bench_plans, "maxbatch": bench_max_batch, "why": bench_why}[name]()
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
