"""Baseline placement rules (MegaTrain's interval rule and three extremes) and any tier list under the MILP.

Every rule returns the same frozen `Plan` as the MILP. `evaluate_tiers` checks a tier list against the MILP's
constraints (the memory rows in closed form) and times it with the simulator on the instance: independent of
the MILP's rows, so the tests compare the solver with it on every tier assignment of small instances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp import PlanningInstance
from lazytrain.plan.plan import Plan, SolveReport, spec_of
from lazytrain.plan.schedule import segments_of
from lazytrain.plan.sim import step_seconds
from lazytrain.units import format_bytes

RULES = ("megatrain", "keep-all", "recompute-all", "offload-all")


def rule_tiers(rule: str, num_layers: int, *, interval: int = 4) -> tuple[str, ...]:
    """Tiers of boundaries 0..L under `rule`; boundaries 0 and L are always gpu."""
    L = num_layers
    if rule == "megatrain":  # checkpoint every `interval`-th boundary on the device, recompute the rest
        if not isinstance(interval, int) or interval < 1:
            raise LazyTrainError(f"--interval must be a positive integer, got {interval!r}")
        inner = ["gpu" if i % interval == 0 else "recompute" for i in range(1, L)]
    elif rule == "keep-all":
        inner = ["gpu"] * (L - 1)
    elif rule == "recompute-all":
        inner = ["recompute"] * (L - 1)
    elif rule == "offload-all":
        inner = ["cpu"] * (L - 1)
    else:
        raise LazyTrainError(f"unknown rule {rule!r}; rules: {', '.join(RULES)}")
    return ("gpu", *inner, "gpu")


def make_rule_plan(rule: str, spec: Any, *, interval: int = 4, workload: Workload | None = None) -> Plan:
    """The Plan of a rule for a model (ModelSpec, transformers model or config)."""
    spec = spec_of(spec)
    tiers = rule_tiers(rule, spec.num_layers, interval=interval)
    options = {"interval": interval} if rule == "megatrain" else {}
    plan = Plan.from_tiers(spec, tiers, workload=workload)
    return Plan(tiers=plan.tiers, model_fingerprint=plan.model_fingerprint, model_name=plan.model_name,
                workload=workload, report=SolveReport(planner=rule, status="given", options=options))


# ---- a fixed tier list under the MILP's constraints, timed by the simulator ------------------------------
@dataclass(frozen=True)
class Evaluation:
    """A tier list checked against the MILP's constraints and timed by the simulator on the instance."""

    feasible: bool
    objective: float  # seconds: the simulated step plus the MILP's tie-breakers (what the MILP minimizes)
    step_s: float  # the simulated step of the tiers' program on the instance's times
    recompute_s: float
    exposed_s: dict[str, float]  # seconds compute waits on each lane in the simulated step
    violations: tuple[str, ...] = ()
    gpu_act_peak_bytes: float = 0.0  # device bytes beyond the static ones at the worst moment (vs M_G)


def evaluate_tiers(tiers: Sequence[str], inst: PlanningInstance, *, max_segment: int | None = None,
                   kept_layers: int = 0) -> Evaluation:
    """Check `tiers` (L+1 entries) and `kept_layers` against the MILP's constraints (memory rows in closed form,
    see plan/milp/) and time its step program with the simulator on the instance's op seconds."""
    L, A = inst.num_layers, inst.boundary_bytes
    tiers = tuple(tiers)
    if len(tiers) != L + 1:
        raise LazyTrainError(f"{len(tiers)} tiers for {L} layers; need {L + 1}")
    g = [t == "gpu" for t in tiers]
    z = [t != "recompute" for t in tiers]
    off = [t in ("cpu", "nvme") for t in tiers]
    segments = segments_of(tiers)
    violations: list[str] = []
    if not (g[0] and g[L]):
        violations.append("boundaries 0 and L must be gpu")
    if max_segment is not None and any(e - s > max_segment for s, e in segments):
        violations.append(f"a segment is longer than {max_segment}")
    if tiers[segments[-1][0]] == "nvme":
        violations.append(f"boundary {segments[-1][0]} starts the last segment and is on nvme")
    K = kept_layers
    if K and (not inst.graph_bytes or not all(g[L - K:])):
        violations.append(f"{K} kept layers need their boundaries {L - K}..{L} on gpu (and graph bytes)")
        K = 0  # timed without them
    # a kept layer holds its graph and its weights' own slot from its forward to its backward
    kept = [inst.graph_bytes[j] + inst.param_bytes[j] if j >= L - K and inst.graph_bytes else 0.0 for j in range(L)]
    cpu_bytes = sum(a for a, t in zip(A, tiers, strict=True) if t == "cpu")
    nvme_bytes = sum(a for a, t in zip(A, tiers, strict=True) if t == "nvme")
    if cpu_bytes > inst.cpu_act_bytes * (1 + 1e-9):
        violations.append(f"cpu activations {format_bytes(cpu_bytes)} > {format_bytes(inst.cpu_act_bytes)}")
    if nvme_bytes > inst.nvme_act_bytes * (1 + 1e-9):
        violations.append(f"nvme activations {format_bytes(nvme_bytes)} > {format_bytes(inst.nvme_act_bytes)}")
    # each window's peak beyond the static bytes (which hold the largest working set W, given back here); the kept
    # layers below j and layer j's slot (kept_before), from its forward h2d (in F_{j-1}) to its backward
    room, W = inst.gpu_act_bytes + inst.static_working_bytes, inst.static_working_bytes
    tol = 1e-9 * max(1.0, room)

    def kept_before(j: int) -> float:
        return sum(kept[:j]) + (inst.param_bytes[j] if j < L and kept[j] else 0.0)

    gpu_act_peak = -float("inf")
    for j in range(L):  # F_j: gpu boundaries below j, j, j+1, w[j]; the gradient buffers not yet allocated (U_F)
        fwd_peak = (sum(A[i] for i in range(j) if g[i]) + inst.forward_bytes(j) + kept_before(j)
                    + (inst.param_bytes[j + 1] if j + 1 < L and kept[j + 1] else 0.0) + inst.fwd_transient_bytes)
        gpu_act_peak = max(gpu_act_peak, fwd_peak - inst.fwd_unallocated_bytes - W)
        if fwd_peak > room + inst.fwd_unallocated_bytes + tol:
            violations.append(f"forward of layer {j} needs {format_bytes(fwd_peak)} > "
                              f"{format_bytes(room + inst.fwd_unallocated_bytes)} on the device")
    last_start = segments[-1][0]
    head_peak = (sum(A[i] for i in range(L) if g[i]) + (A[last_start] if off[last_start] else 0.0)
                 + inst.head_bytes() + sum(kept) + inst.bwd_transient_bytes)
    windows = [("the loss head", head_peak)]
    for k, (s, e) in enumerate(segments):
        # R_j / B_j hold boundaries s..j+1 and w[j]; B_s also the buffer the previous segment's start is reloaded
        # into (allocated in B_s, where its h2d is issued) and, when it is the backward's first window (e = s + 1
        # = L), the head's gradient slot
        reload_buffer = A[segments[k - 1][0]] if k > 0 and off[segments[k - 1][0]] else 0.0
        last = A[s] + A[s + 1] + inst.working_bytes[s] + reload_buffer + (inst.head_grad_bytes(s, e) if e == s + 1
                                                                          else 0.0)
        below = sum(A[i] for i in range(s) if g[i]) + kept_before(s)
        peak = below + max(inst.segment_bytes(s, e), last)
        windows.append((f"backward of segment ({s}, {e})", peak + inst.bwd_transient_bytes))
    for what, peak in windows:
        gpu_act_peak = max(gpu_act_peak, peak - W)
        if peak > room + tol:
            violations.append(f"{what} needs {format_bytes(peak)} > {format_bytes(room)} on the device")
    step_s, exposed_s = step_seconds(inst.program(tiers, K), inst.op_seconds)
    objective = (step_s + inst.lambda_z * sum(z) + inst.lambda_c * tiers.count("cpu")
                 + inst.lambda_n * tiers.count("nvme"))
    return Evaluation(feasible=not violations, objective=objective, step_s=step_s,
                      recompute_s=sum(inst.recompute_s(s, e) for s, e in segments), exposed_s=exposed_s,
                      violations=tuple(violations), gpu_act_peak_bytes=gpu_act_peak)


def evaluate_objective(plan_or_tiers: Plan | Sequence[str], inst: PlanningInstance) -> float:
    """The MILP objective (seconds) of a plan's tiers; LazyTrainError if the tiers break a constraint."""
    tiers = plan_or_tiers.tiers if isinstance(plan_or_tiers, Plan) else tuple(plan_or_tiers)
    result = evaluate_tiers(tiers, inst)
    if not result.feasible:
        raise LazyTrainError(f"the plan breaks the planner's constraints: {result.violations[0]}")
    return result.objective
