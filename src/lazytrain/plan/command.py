"""`lazytrain plan`: solve the boundary placement for a model, machine and workload, and print it.

    lazytrain plan --model qwen3.6-27b --hardware h800 --batch-size 72 --seq-len 1024 \\
        --gpu-mem-cap 70GB --cpu-act-budget 15GB --nvme-act-budget 32GB [--cpu-mem 2TB] \\
        [--rule megatrain --interval 4] [--solver highs|scip] [--json plan.json] [--max-batch]

Prints a one-row placement map (G gpu, C cpu, N nvme, R recompute per boundary), counts per tier, the
recomputed boundaries, the solver's status / time / gap, and the simulator's prediction for the plan beside
the MegaTrain rule. Every value is read as a string and checked here, so a bad one is one `error: ...` line.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.plan import Plan
from lazytrain.units import format_bytes, parse_bytes

RULE_CHOICES = ("megatrain", "keep-all", "recompute-all", "offload-all")
MAX_BATCH_LIMIT = 1 << 16  # the --max-batch search stops here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", help="preset name (e.g. qwen3.6-27b) or path to a config.json / model directory")
    a("--hardware", default="h800", help="preset (h800, rtx3090, h100, h200, emulated) or a YAML/JSON file "
                                         "(default: h800)")
    a("--batch-size", help="sequences per step (required unless --max-batch)")
    a("--seq-len", default="1024", help="tokens per sequence (default: 1024)")
    a("--dtype", default="bf16", help="compute / activation dtype: bf16, fp16 or fp32 (default: bf16)")
    a("--gpu-mem-cap", help="peak device memory cap, e.g. 70GB (default: the device's memory)")
    a("--cpu-act-budget", help="host DRAM for offloaded activations, e.g. 15GB (default: the host room left)")
    a("--nvme-act-budget", default="0", help="NVMe bytes for spilled activations, e.g. 32GB (default: 0 = no NVMe)")
    a("--cpu-mem", help="total host memory, e.g. 2TB (default: the hardware's, or unchecked)")
    a("--optimizer", default="fp32", help="optimizer states: fp32, hybrid (2%% 8-bit) or 8bit (default: fp32)")
    a("--optimizer-mode", default="overlap",
      help="optimizer step in the prediction of the plan: overlap (LazyTrain) or serial (MegaTrain's code)")
    a("--rule", help=f"use a rule instead of the MILP: {', '.join(RULE_CHOICES)}")
    a("--interval", default="4", help="MegaTrain rule: materialize every K-th boundary on the GPU (default: 4)")
    a("--solver", default="highs", help="MILP solver: highs (default) or scip (needs PySCIPOpt)")
    a("--formulation", default="paper",
      help="MILP reload rows: paper (per window, as the paper) or segment (per segment: same optimum, faster)")
    a("--max-segment", default="8", help="longest recompute segment the MILP considers, in layers (default: 8)")
    a("--time-limit", default="60", help="MILP time limit in seconds (default: 60)")
    a("--mip-gap", default="0", help="relative MIP gap at which the solver stops (default: 0 = optimal)")
    a("--json", metavar="PATH", help="write the plan file (Contract 1) here")
    a("--max-batch", action="store_true", help="report the largest feasible batch for the MILP and each rule")
    a("--timeline", metavar="PNG", help="draw the predicted step program, lane by lane, to this picture")
    a("--trace", metavar="JSON", help="write the predicted step program as Chrome-trace JSON (one track per lane; "
                                      "open in ui.perfetto.dev or chrome://tracing)")


# ---- reading the flags ----------------------------------------------------------------------------
def _int(text: Any, flag: str, minimum: int = 1) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise LazyTrainError(f"{flag}: cannot read {text!r} as an integer") from None
    if value < minimum:
        raise LazyTrainError(f"{flag}: {value} is below the minimum {minimum}")
    return value


def _float(text: Any, flag: str, low: float, high: float = math.inf) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise LazyTrainError(f"{flag}: cannot read {text!r} as a number") from None
    if not low <= value < high:
        raise LazyTrainError(f"{flag}: {value} is outside [{low}, {high})")
    return value


def _size(text: str | None, flag: str) -> int | None:
    return None if text is None else parse_bytes(text, what=flag)


def _choice(text: str, flag: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise LazyTrainError(f"{flag}: {text!r} is not one of {', '.join(choices)}")
    return text


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    from lazytrain.spec.hardware import HardwareSpec
    from lazytrain.spec.model import ModelSpec, preset_names

    if not args.model:
        raise LazyTrainError(f"--model is required: a preset ({', '.join(preset_names())}) or a config.json path")
    if args.model in preset_names():  # tests check every preset against transformers; no torch import here
        spec = ModelSpec.load(args.model)
    else:  # a user's config: validated, then counted as transformers builds it (meta device), like `train`
        from lazytrain.runtime.weights import built_spec, resolve_model

        spec = built_spec(resolve_model(args.model).config)
    hardware = HardwareSpec.load(args.hardware)
    budgets = Budgets(gpu_mem_cap_bytes=_size(args.gpu_mem_cap, "--gpu-mem-cap"),
                      cpu_act_bytes=_size(args.cpu_act_budget, "--cpu-act-budget"),
                      nvme_act_bytes=_size(args.nvme_act_budget, "--nvme-act-budget"),
                      host_mem_bytes=_size(args.cpu_mem, "--cpu-mem"))
    from lazytrain.spec.cost import OPTIMIZERS
    from lazytrain.spec.workload import DTYPE_BYTES

    return dict(
        spec=spec, hardware=hardware, budgets=budgets,
        seq_len=_int(args.seq_len, "--seq-len"),
        dtype=_choice(args.dtype, "--dtype", tuple(DTYPE_BYTES)),
        optimizer=_choice(args.optimizer, "--optimizer", tuple(OPTIMIZERS)),
        optimizer_mode=_choice(args.optimizer_mode, "--optimizer-mode", ("overlap", "serial")),
        rule=_choice(args.rule, "--rule", RULE_CHOICES) if args.rule else None,
        interval=_int(args.interval, "--interval"),
        solver=_choice(args.solver, "--solver", ("highs", "scip")),
        formulation=_choice(args.formulation, "--formulation", ("paper", "segment")),
        max_segment=_int(args.max_segment, "--max-segment"),
        time_limit_s=_float(args.time_limit, "--time-limit", 1e-3),
        mip_rel_gap=_float(args.mip_gap, "--mip-gap", 0.0, 1.0),
    )


# ---- planning one request ----------------------------------------------------------------------------
def _cost(cfg: dict[str, Any], batch_size: int) -> Any:
    from lazytrain.spec.cost import CostModel
    from lazytrain.spec.workload import Workload

    workload = Workload(batch_size=batch_size, seq_len=cfg["seq_len"], dtype=cfg["dtype"])
    return CostModel(cfg["spec"], cfg["hardware"], workload, optimizer=cfg["optimizer"])


def admitted_budgets(cost: Any, budgets: Budgets) -> tuple[Any, Budgets]:
    """Admission control, then the budgets the planners use: M_C defaults to the host room left."""
    from lazytrain.plan.admission import admit

    admission = admit(cost, budgets)
    return admission, replace(budgets, cpu_act_bytes=admission.cpu_act_bytes)


def make_plan(cfg: dict[str, Any], cost: Any, budgets: Budgets, *, feasibility_only: bool = False) -> Plan:
    """The MILP plan, or the rule's plan when `cfg["rule"]` is set (checked against the same constraints)."""
    from lazytrain.plan.milp import instance_from_cost, solve_milp
    from lazytrain.plan.rules import evaluate_tiers, make_rule_plan

    if cfg["rule"]:
        plan = make_rule_plan(cfg["rule"], cost.spec, interval=cfg["interval"], workload=cost.workload)
        ev = evaluate_tiers(plan.tiers, instance_from_cost(cost, budgets))
        if not ev.feasible:
            raise LazyTrainError(f"the {cfg['rule']} rule does not fit: {ev.violations[0]}; lower --batch-size or "
                                 "raise the budget")
        report = replace(plan.report, objective=ev.objective)
        budgets_bytes = {k: int(v) for k, v in budgets.to_dict().items() if v is not None}
        return replace(plan, report=report, budgets_bytes=budgets_bytes)
    # feasibility does not depend on the objective: the smaller "segment" rows and any incumbent will do
    return solve_milp(cost, budgets, max_segment=cfg["max_segment"], time_limit_s=cfg["time_limit_s"],
                      mip_rel_gap=0.999 if feasibility_only else cfg["mip_rel_gap"], solver=cfg["solver"],
                      formulation="segment" if feasibility_only else cfg.get("formulation", "paper"))


def largest_feasible_batch(cfg: dict[str, Any], rule: str | None, *, limit: int = MAX_BATCH_LIMIT) -> int:
    """Largest batch that passes admission and for which the planner (MILP when `rule` is None) finds a plan;
    0 when not even batch 1 fits. Doubling, then bisection: feasibility only shrinks as the batch grows."""
    cfg = {**cfg, "rule": rule}

    def feasible(batch: int) -> bool:
        try:
            cost = _cost(cfg, batch)
            _, budgets = admitted_budgets(cost, cfg["budgets"])
            make_plan(cfg, cost, budgets, feasibility_only=True)
            return True
        except LazyTrainError:
            return False

    if not feasible(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and feasible(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:  # feasible(lo), not feasible(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    return lo


# ---- output -------------------------------------------------------------------------------------------
def _ranges(boundaries: list[int]) -> str:
    if not boundaries:
        return "none"
    parts, start = [], boundaries[0]
    for prev, cur in zip(boundaries, [*boundaries[1:], None], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def _prediction_rows(cfg: dict[str, Any], cost: Any, plan: Plan) -> tuple[list[tuple[str, str, Any]], Any]:
    from lazytrain.plan.rules import make_rule_plan
    from lazytrain.plan.sim import simulate

    rows = []
    own = simulate(plan, cost, optimizer_mode=cfg["optimizer_mode"])
    name = plan.report.planner + (f" K={plan.report.options.get('interval')}" if plan.report.planner == "megatrain"
                                  else "")
    rows.append((name, cfg["optimizer_mode"], own))
    rule = make_rule_plan("megatrain", cost.spec, interval=cfg["interval"], workload=cost.workload)
    for mode in ("overlap", "serial"):
        if plan.tiers != rule.tiers or mode != cfg["optimizer_mode"]:
            rows.append((f"megatrain K={cfg['interval']}", mode, simulate(rule, cost, optimizer_mode=mode)))
    return rows, own


def _print_plan(cfg: dict[str, Any], cost: Any, admission: Any, plan: Plan) -> Any:
    spec, hw, wl = cost.spec, cost.hardware, cost.workload
    print(f"model {spec.name} ({spec.num_layers} layers, {spec.num_params / 1e9:.2f} B params), hardware {hw.name}, "
          f"batch {wl.batch_size} x seq {wl.seq_len} ({wl.dtype}), optimizer {cost.optimizer}")
    cpu = "unlimited" if admission.cpu_act_bytes is None else format_bytes(admission.cpu_act_bytes)
    nvme = "unlimited" if admission.nvme_act_bytes is None else format_bytes(admission.nvme_act_bytes)
    print(f"budgets: gpu cap {format_bytes(admission.gpu_mem_cap_bytes)} = static "
          f"{format_bytes(cost.static_device_bytes())} + activations {format_bytes(admission.gpu_act_bytes)}; "
          f"cpu act {cpu}; nvme act {nvme}; boundary {format_bytes(max(cost.boundary_bytes))}")
    print(f"placement (boundaries 0..{plan.num_layers}; G gpu, C cpu, N nvme, R recompute):")
    print(plan.placement_map())
    counts = plan.counts()
    print("counts: " + ", ".join(f"{tier} {n}" for tier, n in counts.items()))
    print(f"recomputed boundaries: {_ranges(plan.boundaries('recompute'))}")
    r = plan.report
    if r.planner == "milp":
        print(f"solver: {r.solver} {r.status} in {r.seconds:.2f} s, gap {r.gap:.2g}, "
              f"objective {r.objective * 1e3:.2f} ms ({r.num_variables} variables, {r.num_constraints} constraints, "
              f"max segment {r.options['max_segment']})")
    else:
        print(f"rule: {r.planner}{' K=' + str(r.options['interval']) if 'interval' in r.options else ''}, "
              f"MILP objective of its tiers {r.objective * 1e3:.2f} ms")
    rows, own = _prediction_rows(cfg, cost, plan)
    print("prediction (simulator):")
    print(f"  {'plan':<16} {'optimizer':<9} {'step s':>8} {'TFLOPS':>7} {'tok/s':>8} {'peak gpu':>10}  exposed")
    for name, mode, res in rows:
        exposed = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in res.exposed_s.items() if v > 5e-4) or "none"
        over = "  OVER THE GPU CAP" if res.peak_bytes["gpu"] > admission.gpu_mem_cap_bytes else ""
        print(f"  {name:<16} {mode:<9} {res.step_s:>8.3f} {res.tflops:>7.1f} {res.tokens_per_s:>8.0f} "
              f"{format_bytes(res.peak_bytes['gpu']):>10}  {exposed}{over}")
    return own


def run(args: argparse.Namespace) -> int:
    cfg = _setup(args)
    if args.max_batch:
        spec = cfg["spec"]
        print(f"largest feasible batch: model {spec.name}, hardware {cfg['hardware'].name}, seq {cfg['seq_len']}, "
              f"optimizer {cfg['optimizer']}")
        planners: list[tuple[str, str | None]] = [("milp", None)]
        planners += [(f"megatrain K={cfg['interval']}" if r == "megatrain" else r, r) for r in RULE_CHOICES]
        for name, rule in planners:
            print(f"  {name:<16} {largest_feasible_batch(cfg, rule)}")
        if args.batch_size is None:
            return 0
    if args.batch_size is None:
        raise LazyTrainError("--batch-size is required (or use --max-batch)")
    cost = _cost(cfg, _int(args.batch_size, "--batch-size"))
    admission, budgets = admitted_budgets(cost, cfg["budgets"])
    plan = make_plan(cfg, cost, budgets)
    own = _print_plan(cfg, cost, admission, plan)
    if args.json:
        plan.with_prediction(own.to_prediction()).save(args.json)
        print(f"plan written to {args.json}")
    if getattr(args, "trace", None):
        from lazytrain.viz import write_trace

        print(f"trace written to {write_trace(own.events, args.trace, process=f'{cost.spec.name} predicted step')}")
    if getattr(args, "timeline", None):
        from lazytrain.viz import plot_timeline

        print(f"timeline written to {plot_timeline(own, args.timeline)}")
    return 0
