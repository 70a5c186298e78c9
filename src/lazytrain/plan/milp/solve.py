"""The entry points: build the formulation, run a driver, read its columns back into tiers and a Plan."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp import highs, scip
from lazytrain.plan.milp.families import build
from lazytrain.plan.milp.formulation import Formulation
from lazytrain.plan.milp.instance import PlanningInstance, instance_from_cost
from lazytrain.plan.milp.model import INF, Infeasible
from lazytrain.plan.plan import Plan, SolveReport, Transfer
from lazytrain.plan.schedule import OFFLOADED, segments_of
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.plan.budgets import Budgets

# The solver's defaults, written once: the job schema (config.PlanConfig) takes them for its fields.
DEFAULT_SOLVER = "highs"
DEFAULT_MAX_SEGMENT = 8  # layers: the longest recompute segment the MILP considers
DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_MIP_REL_GAP = 0.0  # 0 = optimal


@dataclass(frozen=True)
class MilpSolution:
    """Tiers per boundary, transfers per window and the solve report; `to_plan` attaches a model."""

    tiers: tuple[str, ...]
    transfers: tuple[Transfer, ...]
    report: SolveReport
    step_s: float  # the step seconds of the program the tiers give: the objective less the tie-breakers
    kept_layers: int = 0  # K: the last K layers keep their graphs (Plan.kept_layers)


SOLVERS = {"highs": highs.solve, "scip": scip.solve}


def solve_instance(inst: PlanningInstance, *, max_segment: int = DEFAULT_MAX_SEGMENT,
                   time_limit_s: float = DEFAULT_TIME_LIMIT_S, mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
                   solver: str = DEFAULT_SOLVER, fixed_tiers: Sequence[str] | None = None,
                   start_tiers: Sequence[str] | None = None, deadline_s: float | None = None,
                   kept_layers: int | None = None, start_kept: int = 0) -> MilpSolution:
    """Build and solve the MILP for `inst`. Infeasible (or no incumbent in time) -> LazyTrainError with numbers.

    kept_layers: K fixed (Plan.kept_layers); None = the MILP decides K, or 0 with `fixed_tiers` (a rule's plan).
    start_tiers, start_kept: a plan to warm-start from (re-planning; HiGHS only, ignored by SCIP).
    deadline_s (a `time.perf_counter()` instant): the solver gets at most what is left of it after the build."""
    if solver not in SOLVERS:
        raise LazyTrainError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
    if not isinstance(max_segment, int) or max_segment < 1:
        raise LazyTrainError(f"max segment length must be a positive integer, got {max_segment!r}")
    if not time_limit_s > 0:
        raise LazyTrainError(f"time limit must be > 0 seconds, got {time_limit_s}")
    if not 0 <= mip_rel_gap < 1:
        raise LazyTrainError(f"relative MIP gap must be in [0, 1), got {mip_rel_gap}")
    t0 = time.perf_counter()
    if fixed_tiers is not None:  # a long recompute block of a rule must still be a candidate edge
        kept = [i for i, t in enumerate(fixed_tiers) if t != "recompute"]
        max_segment = max([max_segment, *(b - a for a, b in zip(kept, kept[1:], strict=False))])
    try:
        if kept_layers is None and fixed_tiers is not None:
            kept_layers = 0
        form = build(inst, min(max_segment, inst.num_layers), fixed_tiers, kept_layers)
    except Infeasible as why:
        raise LazyTrainError(_infeasible_message(inst, max_segment, str(why))) from None
    m = form.m
    if deadline_s is not None:
        left_s = deadline_s - time.perf_counter()
        if left_s <= 0:
            raise LazyTrainError(f"building the MILP took {time.perf_counter() - t0:.1f} s, past the time limit; raise "
                                 "--time-limit or lower --max-segment")
        time_limit_s = min(time_limit_s, left_s)
    start = form.start_values(start_tiers, start_kept) if start_tiers is not None else None
    status, values, objective, gap = SOLVERS[solver](m, time_limit_s, mip_rel_gap, start)
    seconds = time.perf_counter() - t0
    if values is None:
        if status == "infeasible" or status.startswith("infeas"):
            raise LazyTrainError(_infeasible_message(inst, max_segment, "fixed tiers" if fixed_tiers else ""))
        raise LazyTrainError(
            f"the {solver} solver found no plan within its time limit of {time_limit_s:g} s (status {status}); "
            "raise --time-limit or lower --max-segment"
        )
    tiers = _read_tiers(form, values)
    kept = sum(values[y] > 0.5 for y in form.y)
    step_s = m.offset + values[form.S]
    report = SolveReport(
        planner="milp", solver=solver, status=status, objective=objective, gap=gap, seconds=seconds,
        num_variables=len(m.names), num_constraints=len(m.rows),
        options={"max_segment": max_segment, "time_limit_s": time_limit_s, "mip_rel_gap": mip_rel_gap,
                 "num_binaries": sum(m.integer) - len(form.counts), "fixed_tiers": fixed_tiers is not None,
                 "build_s": round(sum(form.build_s.values()), 4), "step_s": step_s,
                 "optimizer_mode": inst.optimizer_mode, "kept_layers": kept, **m.stats,
                 **({"staging_depth": inst.staging_depth} if inst.staging_depth else {}),
                 **({"world_size": inst.topology.world_size, "nodes": inst.topology.nodes}
                    if inst.topology.parallel else {})},
    )
    return MilpSolution(tiers=tiers, transfers=plan_transfers(tiers, inst), report=report, step_s=step_s,
                        kept_layers=kept)


def _read_tiers(form: Formulation, values: list[float]) -> tuple[str, ...]:
    def on(var: int) -> bool:
        return values[var] > 0.5

    return tuple("gpu" if on(form.g[i]) else "cpu" if on(form.c[i]) else "nvme" if on(form.n[i]) else "recompute"
                 for i in range(form.L + 1))


def plan_transfers(tiers: Sequence[str], inst: PlanningInstance) -> tuple[Transfer, ...]:
    """The windows the step program moves each offloaded boundary in (plan/schedule.py): d2h in forward window
    i, nvme write in i+1 (L = the loss head); for segment (i, e) h2d in backward window e and nvme read in e+1
    (L = the loss head, where the last segment's start reloads)."""
    L, A = inst.num_layers, inst.boundary_bytes
    out: list[Transfer] = []
    for i, e in segments_of(tuple(tiers)):
        if i == 0 or tiers[i] not in OFFLOADED:
            continue
        num_bytes = int(round(A[i]))
        out.append(Transfer(boundary=i, window=i, link="d2h", num_bytes=num_bytes))
        if tiers[i] == "nvme":
            out.append(Transfer(boundary=i, window=i + 1, link="nvme_write", num_bytes=num_bytes))
            out.append(Transfer(boundary=i, window=min(e + 1, L), link="nvme_read", num_bytes=num_bytes))
        out.append(Transfer(boundary=i, window=e, link="h2d", num_bytes=num_bytes))
    return tuple(out)


def _infeasible_message(inst: PlanningInstance, max_segment: int, detail: str) -> str:
    A = max(inst.boundary_bytes)
    need = inst.min_gpu_act_bytes()
    if inst.gpu_act_bytes < need:
        return (
            f"no placement fits on the device: the smallest placement needs {format_bytes(need)} beside the static "
            f"bytes (the last layer's backward or the loss head with the boundaries they hold: a boundary is "
            f"{format_bytes(A)}, the loss head's working set {format_bytes(inst.head_bytes())}) but the GPU cap "
            f"{format_bytes(inst.gpu_mem_cap_bytes)} minus static "
            f"{format_bytes(inst.static_device_bytes)} leaves {format_bytes(inst.gpu_act_bytes)}; "
            "raise --gpu-mem-cap or lower --batch-size"
        )
    interior = math.ceil(inst.num_layers / max_segment) - 1
    return (
        f"no placement fits{' with ' + detail if detail else ''}: a boundary is {format_bytes(A)}, the device has "
        f"{format_bytes(inst.gpu_act_bytes)} for activations, cpu {format_bytes(inst.cpu_act_bytes)}, nvme "
        f"{format_bytes(inst.nvme_act_bytes)}, and max segment {max_segment} keeps >= {interior} interior "
        "boundaries; raise --gpu-mem-cap, --cpu-act-budget, --nvme-act-budget or --max-segment, or lower --batch-size"
    )


def solve_milp(cost: CostModel, budgets: Budgets | None = None, *, max_segment: int = DEFAULT_MAX_SEGMENT,
               time_limit_s: float = DEFAULT_TIME_LIMIT_S, mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
               solver: str = DEFAULT_SOLVER,
               fixed_tiers: Sequence[str] | None = None, start_tiers: Sequence[str] | None = None,
               deadline_s: float | None = None, optimizer_mode: str = "overlap",
               topology: Topology = ONE_RANK, kept_layers: int | None = None, start_kept: int = 0,
               staging_depth: int = 0) -> Plan:
    """Solve the MILP for a CostModel under Budgets and return the Plan (Contract 1, docs/architecture.md); its report's
    `options["step_s"]` is the MILP's step seconds of the plan for `optimizer_mode` on one rank of `topology`.
    kept_layers: K fixed, or None: the MILP decides how many layers keep their graphs. staging_depth: D >= 1 for a
    cost model with its optimizer state on NVMe (the planner tries each D the host memory allows)."""
    inst = instance_from_cost(cost, budgets, optimizer_mode=optimizer_mode, topology=topology,
                              staging_depth=staging_depth)
    solution = solve_instance(inst, max_segment=max_segment, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap,
                              solver=solver, fixed_tiers=fixed_tiers, start_tiers=start_tiers, deadline_s=deadline_s,
                              kept_layers=kept_layers, start_kept=start_kept)
    plan = to_plan(solution, cost.spec, workload=getattr(cost, "workload", None), budgets=budgets)
    return replace(plan, optimizer_offload="nvme" if staging_depth else "host", staging_depth=staging_depth)


def milp_step_s(tiers: Sequence[str], inst: PlanningInstance, kept_layers: int = 0) -> float | None:
    """The MILP's step seconds of fixed `tiers` and `kept_layers` (its objective without the tie-breakers),
    whatever the memory budgets (a rule's plan may be over the cap); None for tiers the MILP does not express (the
    last segment's start on nvme: the program chains its read, spill and h2d in the head window)."""
    starts = [s for s, _ in segments_of(tuple(tiers))]
    if tiers[starts[-1]] == "nvme":
        return None
    relaxed = replace(inst, gpu_act_bytes=INF, cpu_act_bytes=INF, nvme_act_bytes=INF if "nvme" in tiers else 0.0)
    return solve_instance(relaxed, fixed_tiers=tiers, max_segment=inst.num_layers, kept_layers=kept_layers).step_s


def to_plan(solution: MilpSolution, spec: Any, workload: Any = None, budgets: Any = None) -> Plan:
    """Attach model identity and budgets to a solution."""
    from lazytrain.plan.plan import spec_of

    spec = spec_of(spec)
    budgets_bytes = {k: int(v) for k, v in (budgets.to_dict() if budgets is not None else {}).items()
                     if v is not None}
    plan = Plan.from_tiers(spec, solution.tiers, workload=workload)
    return Plan(tiers=plan.tiers, model_fingerprint=plan.model_fingerprint, model_name=plan.model_name,
                workload=workload, transfers=solution.transfers, budgets_bytes=budgets_bytes, report=solution.report,
                kept_layers=solution.kept_layers)
