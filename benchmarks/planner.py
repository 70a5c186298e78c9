"""Planner benchmarks: MILP solve times, HiGHS vs SCIP, MILP vs MegaTrain rule (simulated), rtx3090 max batch.

    python benchmarks/planner.py            # everything (about 5 minutes on a 2-core CPU)
    python benchmarks/planner.py solve      # solve times for 32/64/80/128 layers, HiGHS and SCIP
    python benchmarks/planner.py tight      # 27B with tighter gpu caps, where recompute is needed
    python benchmarks/planner.py instances  # the issue-10 instances: MILP step vs simulated step, both modes
    python benchmarks/planner.py tflops     # simulated TFLOPS, MILP vs rule, at the paper's batch sizes (H800)
    python benchmarks/planner.py maxbatch   # largest feasible batch on the rtx3090 preset, MILP vs rules
    python benchmarks/planner.py ranks      # solve time and step with the collective lane, 1 to 16 ranks
    python benchmarks/planner.py seeds      # HiGHS's nodes / LP iterations of the hard instances, random_seed 0-2

The solve instances are the paper's 27B / H800 case (batch 72, seq 1024, gpu cap 70 GB, cpu act 15 GB,
nvme act 32 GB) with the Qwen3.6-27B layer shapes repeated to L layers. Times are medians of 3 runs.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from typing import Any

from lazytrain.config import load_job_config
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import PRESET_DIR, ModelSpec
from lazytrain.costmodel.topology import Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.job.batch import largest_feasible_batch
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost, solve_instance, solve_milp
from lazytrain.plan.plan import TIERS, SolveReport
from lazytrain.plan.planner import admitted
from lazytrain.plan.rules import evaluate_tiers, make_rule_plan
from lazytrain.plan.sim import simulate

GB = 10**9
PAPER_BUDGETS = Budgets(gpu_mem_cap_bytes=70 * GB, cpu_act_bytes=15 * GB, nvme_act_bytes=32 * GB)
PAPER_BATCH = {"qwen2.5-3b": 192, "qwen2.5-7b": 144, "qwen2.5-14b": 96, "qwen3.6-27b": 72}
PAPER_MEGATRAIN_TFLOPS = {"qwen2.5-3b": 142.80, "qwen2.5-7b": 161.35, "qwen2.5-14b": 171.92, "qwen3.6-27b": 176.90}


def tier_counts(tiers: tuple[str, ...]) -> str:
    """G/C/N/R counts as the tables print them."""
    return "/".join(str(tiers.count(t)) for t in TIERS)


def search(report: SolveReport) -> str:
    """HiGHS's branch-and-bound nodes / LP iterations (one thread: deterministic, whatever the load)."""
    o = report.options
    return f"{o['bb_nodes']} / {o['lp_iterations']}" if "bb_nodes" in o else "-"


def qwen36_with_layers(num_layers: int) -> ModelSpec:
    cfg = json.loads((PRESET_DIR / "qwen3.6-27b.json").read_text())["text_config"]
    cfg = {**cfg, "num_hidden_layers": num_layers}
    cfg.pop("layer_types")  # regenerated: every 4th layer full attention
    return ModelSpec.from_config(cfg, name=f"qwen3.6-27b-shaped-{num_layers}L")


def bench_solve(time_limit_s: float = 120.0) -> None:
    print(f"## MILP solve time, 27B/H800 paper instance, layers varied (max segment 8, time limit {time_limit_s:g} s, "
          "serial optimizer)")
    print("| layers | solver | binaries | variables | constraints | seconds (median of 3) | B&B nodes / LP "
          "iterations | status | gap | step s | simulated s | tiers G/C/N/R | kept layers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    hw = HardwareSpec.load("h800")
    for L in (32, 64, 80, 128):
        cost = CostModel(qwen36_with_layers(L), hw, Workload(72, 1024))
        _, budgets = admitted(cost, PAPER_BUDGETS)
        inst = instance_from_cost(cost, budgets, optimizer_mode="serial")
        for solver in ("highs", "scip"):
            repeats = 1 if solver == "scip" else 3
            runs = [solve_instance(inst, time_limit_s=time_limit_s, solver=solver) for _ in range(repeats)]
            best = runs[-1]
            r, counts = best.report, tier_counts(best.tiers)
            seconds = statistics.median(x.report.seconds for x in runs)
            sim_s = evaluate_tiers(best.tiers, inst, kept_layers=best.kept_layers).step_s
            print(f"| {L} | {solver} | {r.options['num_binaries']} | {r.num_variables} | {r.num_constraints} | "
                  f"{seconds:.2f}{'' if repeats == 3 else ' (1 run)'} | {search(r)} | {r.status} | {r.gap:.2g} | "
                  f"{best.step_s:.3f} | {sim_s:.3f} | {counts} | {best.kept_layers} |")
            sys.stdout.flush()


def bench_solve_tight(time_limit_s: float = 120.0) -> None:
    print("## MILP solve time, 27B/H800, batch 72, cpu act 15 GB, tighter gpu caps and nvme budgets (serial)")
    print("| gpu cap | nvme act | solver | seconds (median of 3) | status | gap | step s | tiers G/C/N/R |")
    print("|---|---|---|---|---|---|---|---|")
    cost = CostModel(ModelSpec.load("qwen3.6-27b"), HardwareSpec.load("h800"), Workload(72, 1024))
    for cap_gb, nvme_gb in ((70, 32), (50, 32), (50, 8), (45, 32), (42, 8)):
        budgets = Budgets(gpu_mem_cap_bytes=cap_gb * GB, cpu_act_bytes=15 * GB, nvme_act_bytes=nvme_gb * GB)
        _, budgets = admitted(cost, budgets)
        inst = instance_from_cost(cost, budgets, optimizer_mode="serial")
        try:
            runs = [solve_instance(inst, time_limit_s=time_limit_s) for _ in range(3)]
        except LazyTrainError as why:
            print(f"| {cap_gb} GB | {nvme_gb} GB | highs | - | infeasible: {why} | | | |")
            continue
        r, counts = runs[-1].report, tier_counts(runs[-1].tiers)
        seconds = statistics.median(x.report.seconds for x in runs)
        print(f"| {cap_gb} GB | {nvme_gb} GB | highs | {seconds:.2f} | {r.status} | {r.gap:.2g} | "
              f"{runs[-1].step_s:.3f} | {counts} |")
        sys.stdout.flush()


INSTANCES = (("qwen3.6-27b", "h800", 72, 1024, 70, 15, 32, {}), ("qwen3.6-27b", "h800", 72, 1024, 50, 15, 8, {}),
             ("qwen3.6-27b", "h800", 72, 1024, 70, 15, 32, {"d2h_gbps": 1.5}),
             ("qwen2.5-7b", "h800", 8, 2048, 30, 40, 0, {}), ("qwen2.5-7b", "rtx3090", 4, 1024, 24, 40, 0, {}))


def bench_instances() -> None:
    print("## MILP plan, MILP step and simulated step of named instances (gpu cap / cpu act / nvme act in GB)")
    print("| model | hardware | batch x seq | budgets | optimizer | tiers G/C/N/R | kept layers | MILP step s | "
          "simulated s | solve s | B&B nodes / LP iterations | peak GiB | step s with no kept layer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, hardware, batch, seq, cap, cpu, nvme, overrides in INSTANCES:
        cost = CostModel(ModelSpec.load(preset), HardwareSpec.load(hardware, **overrides), Workload(batch, seq))
        budgets = Budgets(gpu_mem_cap_bytes=cap * GB, cpu_act_bytes=cpu * GB, nvme_act_bytes=nvme * GB)
        for mode in ("serial", "overlap"):
            plan = solve_milp(cost, budgets, optimizer_mode=mode)
            sim = simulate(plan, cost, optimizer_mode=mode)
            none_kept = plan if not plan.kept_layers else solve_milp(cost, budgets, optimizer_mode=mode, kept_layers=0)
            name = hardware + "".join(f" {k}={v}" for k, v in overrides.items())
            print(f"| {preset} | {name} | {batch} x {seq} | {cap}/{cpu}/{nvme} | {mode} | {tier_counts(plan.tiers)} | "
                  f"{plan.kept_layers} | {plan.report.options['step_s']:.3f} | {sim.step_s:.3f} | "
                  f"{plan.report.seconds:.2f} ({plan.report.status}, gap {plan.report.gap:.2g}) | "
                  f"{search(plan.report)} | {sim.peak_bytes['gpu'] / 2**30:.1f} | "
                  f"{none_kept.report.options['step_s']:.3f} |")
            sys.stdout.flush()


def bench_tflops() -> None:
    print("## Simulated step and TFLOPS, serial vs overlapped-exact optimizer (clipping on in both), MILP (solved for "
          "each mode) vs MegaTrain K=4; h800: paper batch, seq 1024, gpu cap 70 GB, cpu act 15 GB, nvme 32 GB; "
          "rtx3090: batch 4, seq 1024, default budgets")
    print("| model | hardware | batch | paper MegaTrain TFLOPS | rule serial s / TFLOPS | rule overlap | MILP serial | "
          "MILP overlap | MILP overlap / rule serial | MILP overlap / MILP serial | optimizer s (serial) | "
          "exposed in MILP overlap s | MILP overlap tiers G/C/N/R |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [(preset, "h800", batch, PAPER_BUDGETS) for preset, batch in PAPER_BATCH.items()]
    cases.append(("qwen2.5-7b", "rtx3090", 4, Budgets()))
    for preset, hardware, batch, wanted in cases:
        spec = ModelSpec.load(preset)
        cost = CostModel(spec, HardwareSpec.load(hardware), Workload(batch, 1024))
        _, budgets = admitted(cost, wanted)
        rule = make_rule_plan("megatrain", spec, interval=4)
        plans = {("rule", mode): rule for mode in ("serial", "overlap")}
        plans.update({("milp", mode): solve_milp(cost, budgets, optimizer_mode=mode) for mode in ("serial", "overlap")})
        sim = {key: simulate(p, cost, optimizer_mode=key[1]) for key, p in plans.items()}
        cell = {key: f"{r.step_s:.2f} / {r.tflops:.1f}" for key, r in sim.items()}
        paper = f"{PAPER_MEGATRAIN_TFLOPS[preset]:.1f}" if hardware == "h800" else "-"
        print(f"| {preset} | {hardware} | {batch} | {paper} | {cell['rule', 'serial']} | {cell['rule', 'overlap']} | "
              f"{cell['milp', 'serial']} | {cell['milp', 'overlap']} | "
              f"{sim['rule', 'serial'].step_s / sim['milp', 'overlap'].step_s:.3f} | "
              f"{sim['milp', 'serial'].step_s / sim['milp', 'overlap'].step_s:.3f} | {cost.total_optimizer_s:.2f} | "
              f"{sim['milp', 'overlap'].exposed_s['optimizer']:.2f} | {tier_counts(plans['milp', 'overlap'].tiers)} |")
        sys.stdout.flush()


def bench_max_batch() -> None:
    print("## Largest feasible batch, rtx3090 preset (24 GiB), seq 1024, fp32 Adam, default budgets")
    print("| model | MILP | megatrain K=4 | keep-all | recompute-all | offload-all | MILP - rule | MILP plan peak "
          "GiB (simulated) | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    hw = HardwareSpec.load("rtx3090")
    for preset in PAPER_BATCH:
        t0 = time.perf_counter()
        job = load_job_config({"seq_len": 1024, "dtype": "bf16", "optimizer": "adamw", "interval": 4})
        spec = ModelSpec.load(preset)
        sizes = {planner: largest_feasible_batch(job, spec, hw, planner)[0]
                 for planner in ("milp", "megatrain", "keep-all", "recompute-all", "offload-all")}
        cost = CostModel(spec, hw, Workload(sizes["milp"], 1024))
        _, budgets = admitted(cost, Budgets())
        peak = simulate(solve_milp(cost, budgets), cost).peak_bytes["gpu"] / 2**30
        print(f"| {preset} | {sizes['milp']} | {sizes['megatrain']} | {sizes['keep-all']} | {sizes['recompute-all']} "
              f"| {sizes['offload-all']} | {sizes['milp'] - sizes['megatrain']:+d} | {peak:.2f} | "
              f"{time.perf_counter() - t0:.1f} |")
        sys.stdout.flush()


RANK_LAYOUTS = ((1, 1), (8, 1), (16, 2))
RANK_INSTANCES = (("qwen3.6-27b", 72, 1024, PAPER_BUDGETS, {}),
                  ("qwen3.6-27b", 72, 1024, PAPER_BUDGETS, {"intra_node_gbps": 5.0, "inter_node_gbps": 1.0}),
                  ("qwen2.5-7b", 8, 2048, Budgets(gpu_mem_cap_bytes=30 * GB, cpu_act_bytes=40 * GB), {}))


def bench_ranks(time_limit_s: float = 120.0) -> None:
    """The MILP with the collective lane in its windows (one rank of a topology): solve time (HiGHS, median of
    3), its step against the simulated one, and the plan, beside the one-rank MILP on the same rank's cost model
    (no collective in its rows: what `lazytrain plan --world-size` solved before) and its plan simulated with ranks."""
    print("## MILP with the collective lane: one rank of N, serial optimizer, HiGHS, median of 3 solves")
    print("| model | links (intra / inter GB/s) | ranks / nodes / reduce | tiers G/C/N/R | solve s | status | "
          "MILP step s | simulated s | one-rank MILP's tiers | its solve s | its simulated s with ranks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, batch, seq, budgets, overrides in RANK_INSTANCES:
        base = HardwareSpec.load("h800", **overrides)
        for world, nodes in RANK_LAYOUTS:
            topology = Topology(world_size=world, nodes=nodes)
            cost = CostModel(ModelSpec.load(preset), topology.rank_hardware(base), Workload(batch, seq))
            _, admitted_budgets = admitted(cost, budgets)
            runs = [solve_milp(cost, admitted_budgets, time_limit_s=time_limit_s, optimizer_mode="serial",
                               topology=topology) for _ in range(3)]
            plan, r = runs[-1], runs[-1].report
            sim = simulate(plan, cost, optimizer_mode="serial", topology=topology)
            alones = [solve_milp(cost, admitted_budgets, time_limit_s=time_limit_s, optimizer_mode="serial")
                      for _ in range(3)]
            alone = alones[-1]
            alone_s = simulate(alone, cost, optimizer_mode="serial", topology=topology).step_s
            print(f"| {preset} | {base.intra_node_gbps:g} / {base.inter_node_gbps:g} | {world} / {nodes} / "
                  f"host | {tier_counts(plan.tiers)} | {statistics.median(x.report.seconds for x in runs):.2f} "
                  f"| {r.status} | {r.options['step_s']:.3f} | {sim.step_s:.3f} | {tier_counts(alone.tiers)} | "
                  f"{statistics.median(x.report.seconds for x in alones):.2f} | {alone_s:.3f} |")
            sys.stdout.flush()


SEED_INSTANCES = (("qwen3.6-27b", 64, {}, 50, 8, "serial"), ("qwen3.6-27b", 64, {}, 50, 8, "overlap"),
                  ("qwen3.6-27b", 64, {"d2h_gbps": 1.5}, 70, 32, "serial"),
                  ("qwen3.6-27b", 64, {"d2h_gbps": 1.5}, 70, 32, "overlap"),
                  ("qwen3.6-27b", 64, {"d2h_gbps": 1.5}, 50, 8, "overlap"), ("qwen3.6-27b", 128, {}, 70, 32, "serial"),
                  ("qwen3.6-27b", 128, {}, 70, 32, "overlap"))


def bench_seeds(seeds: tuple[int, ...] = (0, 1, 2)) -> None:
    """HiGHS's search is chaotic on these instances (another `random_seed`, 50 or 250 nodes): compare formulations
    by nodes and LP iterations over seeds, deterministic with one thread whatever the load. The seed is set on
    each `highspy.Highs` as it runs (`_solve_highs`'s own options unchanged)."""
    import highspy

    print("## HiGHS's search over random_seed: the hard 27B instances (batch 72, seq 1024, cpu act 15 GB)")
    print("| layers | hardware | gpu cap / nvme act | optimizer | step s | B&B nodes | LP iterations | HiGHS s |")
    print("|---|---|---|---|---|---|---|---|")
    run, seed, seconds = highspy.Highs.run, [0], [0.0]

    def seeded_run(h: highspy.Highs) -> Any:
        h.setOptionValue("random_seed", seed[0])
        t0 = time.perf_counter()
        try:
            return run(h)
        finally:
            seconds[0] = time.perf_counter() - t0

    highspy.Highs.run = seeded_run
    try:
        for preset, L, overrides, cap_gb, nvme_gb, mode in SEED_INSTANCES:
            spec = ModelSpec.load(preset) if L == 64 else qwen36_with_layers(L)
            cost = CostModel(spec, HardwareSpec.load("h800", **overrides), Workload(72, 1024))
            budgets = Budgets(gpu_mem_cap_bytes=cap_gb * GB, cpu_act_bytes=15 * GB, nvme_act_bytes=nvme_gb * GB)
            _, budgets = admitted(cost, budgets)
            inst = instance_from_cost(cost, budgets, optimizer_mode=mode)
            runs, times = [], []
            for value in seeds:
                seed[0] = value
                runs.append(solve_instance(inst, time_limit_s=600.0))
                times.append(f"{seconds[0]:.2f}")
            hardware = "h800" + "".join(f" {k}={v}" for k, v in overrides.items())
            nodes = ", ".join(str(r.report.options["bb_nodes"]) for r in runs)
            iterations = ", ".join(str(r.report.options["lp_iterations"]) for r in runs)
            print(f"| {L} | {hardware} | {cap_gb}/{nvme_gb} | {mode} | {runs[0].step_s:.6f} | {nodes} | {iterations} | "
                  f"{', '.join(times)} |")
            sys.stdout.flush()
    finally:
        highspy.Highs.run = run


def main(argv: list[str]) -> None:
    which = argv or ["solve", "tight", "instances", "tflops", "maxbatch"]
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"command: python benchmarks/planner.py {' '.join(argv)}".rstrip())
    for name in which:
        {"solve": bench_solve, "tight": bench_solve_tight, "instances": bench_instances, "tflops": bench_tflops,
         "maxbatch": bench_max_batch, "ranks": bench_ranks, "seeds": bench_seeds}[name]()
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
