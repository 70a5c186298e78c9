"""Executor benchmarks on the emulated device (run by hand; prints medians and ratios measured side by side).

(a) links throttled so transfers matter: measured step time vs the simulator's prediction, per plan type;
(b) under one device-memory cap: the MILP plan vs the MegaTrain rule, measured in the same run;
(c) no cap, no throttling: executor step / plain `transformers` forward+backward on the CPU.

    python benchmarks/executor.py            # all three, ~3 minutes on 2 cores
    python benchmarks/executor.py --only c
    python benchmarks/executor.py --threads 1   # one torch thread: steadier timings on a shared machine

The simulator gets a CostModel (lazytrain.costmodel.cost) whose per-layer compute seconds are measured by the
executor itself (StepStats.forward_s / backward_s / head_s), because on a shared 2-core CPU compute
time drifts with load: all plans run round-robin so they see the same machine.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from lazytrain import CostModel, EmulatedDevice, Executor, HardwareSpec, ModelSpec, Plan, Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.sim import simulate


def build_model(layers: int, hidden: int, vocab: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=4096, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def batch_of(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, ids.clone()


def megatrain(num_layers: int, interval: int) -> list[str]:
    return ["gpu" if i % interval == 0 or i == num_layers else "recompute" for i in range(num_layers + 1)]


def calibrated(cost: CostModel, stats: list) -> CostModel:
    """`cost` with the per-layer compute seconds medians of these executor steps (StepStats)."""
    med = lambda rows: [statistics.median(col) for col in zip(*rows, strict=True)]  # noqa: E731
    return cost.with_times(forward_s=med([s.forward_s for s in stats]), backward_s=med([s.backward_s for s in stats]),
                           head_s=statistics.median(s.head_s for s in stats))


def replayed(cost: CostModel, st) -> CostModel:
    """`cost` with one step's own measured compute seconds (a recomputed layer: the mean of F_j and R_j,
    since the simulator uses one forward time for both)."""
    forward = [(f + r) / (2 if r > 0 else 1) for f, r in zip(st.forward_s, st.recompute_s, strict=True)]
    return cost.with_times(forward_s=forward, backward_s=st.backward_s, head_s=st.head_s)


def rounds(model, entries: dict, ids, labels, repeats: int, cost: CostModel | None = None) -> dict:
    """Run every (plan, device kwargs) entry once per round, round-robin, so all see the same machine load.

    Returns name -> list of StepStats (the warm-up round dropped).
    """
    executors = {name: Executor(model, plan, EmulatedDevice(**kw), cost=cost) for name, (plan, kw) in entries.items()}
    out: dict = {name: [] for name in entries}
    for r in range(repeats + 1):
        for name, ex in executors.items():
            model.zero_grad(set_to_none=True)
            ex.forward_backward(ids, labels)
            if r:
                out[name].append(ex.last_step)
    return out


def part_a_b(args) -> None:
    model = build_model(args.layers, args.hidden, args.vocab)
    ids, labels = batch_of(args.vocab, args.batch, args.seq)
    L = args.layers
    workload = Workload(args.batch, args.seq, "fp32")
    spec = ModelSpec.from_config(model.config)
    rates = dict(h2d_gbps=args.gbps, d2h_gbps=args.gbps, nvme_read_gbps=args.nvme_gbps, nvme_write_gbps=args.nvme_gbps)
    hw = HardwareSpec.profile(**rates)
    base = CostModel(spec, hw, workload)
    keep = Plan.from_tiers(model, ["gpu"] * (L + 1))
    # first calibration (for the MILP's inputs): the executor's own compute seconds, unthrottled, keep-all
    cost0 = calibrated(base, rounds(model, {"calib": (keep, {})}, ids, labels, 2)["calib"])
    print(f"model: Llama {L} layers, hidden {args.hidden}, vocab {args.vocab}, {spec.num_params / 1e6:.1f} M params; "
          f"batch {args.batch} x seq {args.seq}, fp32; links h2d/d2h {args.gbps} GB/s, nvme {args.nvme_gbps} GB/s")
    print(f"layer forward {cost0.forward_s[0] * 1e3:.1f} ms, backward {cost0.backward_s[0] * 1e3:.1f} ms, head "
          f"{cost0.head_s * 1e3:.1f} ms; weights {base.param_bytes[0] / 1e6:.2f} MB = "
          f"{base.param_bytes[0] / (args.gbps * 1e9) * 1e3:.1f} ms on h2d; "
          f"boundary {base.boundary_bytes[0] / 1e6:.2f} MB = {base.boundary_bytes[0] / (args.gbps * 1e9) * 1e3:.1f} ms")

    plans = {
        "keep-all": ["gpu"] * (L + 1),
        "recompute-all": ["gpu"] + ["recompute"] * (L - 1) + ["gpu"],
        "megatrain-4": megatrain(L, 4),
        "offload-all (cpu)": ["gpu"] + ["cpu"] * (L - 1) + ["gpu"],
        "mix with nvme": ["gpu"] + ["cpu", "nvme", "recompute"] * ((L - 1) // 3) + ["cpu"] * ((L - 1) % 3) + ["gpu"],
    }
    cap = None
    mega_name = ""
    kept: dict[str, int] = {}  # a plan's kept layers (the MILP's)
    try:
        from lazytrain.plan.milp import solve_milp

        # the tightest cap (from MegaTrain-4's predicted peak up, one boundary at a time) the MILP can plan
        # for: keep-all does not fit it, and MegaTrain must recompute
        peak = {n: simulate(Plan.from_tiers(model, t), cost0).peak_bytes["gpu"] for n, t in plans.items()}
        cap = peak["megatrain-4"]
        while True:
            try:
                milp = solve_milp(cost0, Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=None, nvme_act_bytes=0),
                                  time_limit_s=30, optimizer_mode="serial")
                break
            except LazyTrainError:
                if cap >= peak["keep-all"]:
                    raise
                cap += base.boundary_bytes[0]
        # the MegaTrain rule at its best interval under the cap (fastest simulated step that fits)
        sims = {k: simulate(Plan.from_tiers(model, megatrain(L, k)), cost0) for k in range(2, L + 1)}
        best_k = min((r.forward_backward_s, k) for k, r in sims.items() if r.peak_bytes["gpu"] <= cap)[1]
        mega_name = f"megatrain-{best_k} (best K, cap)"
        plans[mega_name] = megatrain(L, best_k)
        plans["milp (same cap)"] = list(milp.tiers)
        kept["milp (same cap)"] = milp.kept_layers
    except ImportError:
        print("lazytrain.plan.milp.solve_milp not available: no MILP plan")

    entries = {name: (Plan.from_tiers(model, t, kept_layers=kept.get(name, 0)), rates) for name, t in plans.items()}
    entries["calib"] = (keep, {})
    stats = rounds(model, entries, ids, labels, args.repeats, cost=base)
    cost = calibrated(base, stats.pop("calib"))
    print(f"\n(a) measured forward_backward vs simulator (no optimizer), median of {args.repeats}, plans round-robin")
    print("    sim(cal): per-layer compute seconds from unthrottled keep-all steps in the same rounds")
    print("    sim(run): each step replayed with its own measured compute seconds; median of the per-step errors")
    print(f"{'plan':28s} {'map':>13s} {'measured':>8s} {'sim(cal)':>8s} {'err':>6s} {'sim(run) err':>12s} "
          f"{'worst':>6s} {'peak MB':>7s} {'sim MB':>7s} {'stall h2d':>9s} {'d2h':>6s}")
    measured = {}
    for name, runs in stats.items():
        plan = entries[name][0]
        wall = statistics.median(s.wall_s for s in runs)
        measured[name] = [s.wall_s for s in runs]
        sim_cal = simulate(plan, cost, optimizer_mode="serial")
        errors = [st.wall_s / simulate(plan, replayed(base, st), optimizer_mode="serial").forward_backward_s - 1
                  for st in runs]
        last = runs[-1]
        print(f"{name:28s} {plan.placement_map():>13s} {wall:8.3f} {sim_cal.forward_backward_s:8.3f} "
              f"{wall / sim_cal.forward_backward_s - 1:+6.1%} {statistics.median(errors):+12.1%} "
              f"{max(errors, key=abs):+6.1%} {last.peak_device_bytes / 1e6:7.2f} "
              f"{sim_cal.peak_bytes['gpu'] / 1e6:7.2f} "
              f"{statistics.median(s.stall_s['h2d'] for s in runs):9.3f} "
              f"{statistics.median(s.stall_s['d2h'] for s in runs):6.3f}")
    if cap is not None:
        name = "milp (same cap)"
        ratios = [a / b for a, b in zip(measured[mega_name], measured[name], strict=True)]
        print(f"\n(b) under the cap {cap / 1e6:.2f} MB: {mega_name} {statistics.median(measured[mega_name]):.3f} s "
              f"vs MILP {statistics.median(measured[name]):.3f} s -> MegaTrain / MILP = "
              f"{statistics.median(ratios):.2f}x (median of per-round ratios; rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")


def cpu_s() -> float:
    """This process's CPU seconds (every thread): the work, less sensitive to other jobs than the wall clock."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def part_c(args) -> None:
    """The executor under the plan the planner picks uncapped (the emulated device's memory, no throttling: keep
    every boundary, and every layer's graph when it fits), its all-`gpu` plan with no kept layer (each layer's
    forward re-run in its backward, the streamed step), and plain transformers, round-robin."""
    from lazytrain.plan.milp import solve_milp

    model = build_model(args.layers, args.hidden, args.vocab)
    ids, labels = batch_of(args.vocab, args.batch, args.seq)
    L = args.layers
    cost = CostModel(ModelSpec.from_config(model.config), HardwareSpec.load("emulated"),
                     Workload(args.batch, args.seq, "fp32"))
    picked = solve_milp(cost, Budgets(cpu_act_bytes=None, nvme_act_bytes=0), time_limit_s=30)
    plans = {f"planner ({picked.placement_map()}, K={picked.kept_layers})": picked,
             "all-gpu, K=0": Plan.from_tiers(model, ["gpu"] * (L + 1))}
    executors = {name: Executor(model, plan, EmulatedDevice()) for name, plan in plans.items()}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in [*plans, "transformers"]}

    def timed(step) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        c0, t0 = cpu_s(), time.perf_counter()
        step()
        return time.perf_counter() - t0, cpu_s() - c0

    for r in range(args.repeats + 1):  # round-robin, so all see the same machine state; round 0 warms up
        for name, ex in executors.items():
            t = timed(lambda ex=ex: ex.forward_backward(ids, labels))
            if r:
                runs[name].append(t)
        t = timed(lambda: model(input_ids=ids, labels=labels).loss.backward())
        if r:
            runs["transformers"].append(t)
    theirs = runs["transformers"]
    b = statistics.median(t[0] for t in theirs)
    print(f"\n(c) no cap, no throttling; transformers forward+backward {b:.3f} s (median of {args.repeats})")
    for name in plans:
        ours = runs[name]
        a = statistics.median(o[0] for o in ours)
        ratios = [o[0] / t[0] for o, t in zip(ours, theirs, strict=True)]
        cpu_ratios = [o[1] / t[1] for o, t in zip(ours, theirs, strict=True)]
        print(f"    {name}: executor {a:.3f} s, ratio of medians {a / b:.2f}x, median per-pair ratio "
              f"{statistics.median(ratios):.2f}x (pairs: {', '.join(f'{r:.2f}' for r in ratios)}); CPU seconds "
              f"median per-pair ratio {statistics.median(cpu_ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--gbps", type=float, default=0.1, help="emulated h2d and d2h GB/s in (a)/(b)")
    parser.add_argument("--nvme-gbps", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["ab", "c"], default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import os

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    if args.only in (None, "ab"):
        part_a_b(args)
    if args.only in (None, "c"):
        part_c(args)


if __name__ == "__main__":
    main()
