"""Baseline placement rules (MegaTrain's interval rule and three extremes) and their score under the MILP.

Every rule returns the same frozen `Plan` as the MILP. `evaluate_tiers` scores any tier list with the MILP's
objective and checks its constraints, computed here in closed form (an independent implementation: the
tests compare it with the solver on every tier assignment of small instances).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp import PlanningInstance, baseline_exposure_s
from lazytrain.plan.plan import Plan, SolveReport, spec_of
from lazytrain.plan.sim import simulate
from lazytrain.spec.cost import CostModel
from lazytrain.spec.workload import Workload
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


# ---- the MILP objective of a fixed tier list, in closed form ----------------------------------------
@dataclass(frozen=True)
class Evaluation:
    """A tier list scored under the MILP: feasible or the constraints it violates, and its objective (s)."""

    feasible: bool
    objective: float  # seconds, same terms and baseline as the MILP objective
    recompute_s: float
    exposed_s: dict[str, float]  # activation exposure added per link (baseline subtracted)
    violations: tuple[str, ...] = ()
    gpu_act_peak_bytes: float = 0.0  # device bytes beyond the static ones at the worst moment (vs M_G)


def _segments(tiers: Sequence[str]) -> list[tuple[int, int]]:
    kept = [i for i, t in enumerate(tiers) if t != "recompute"]
    return list(zip(kept[:-1], kept[1:], strict=True))


def _forward_exposed(demand: list[float], slack: list[float]) -> float:
    """Bytes that cannot hide when boundary i may use any forward window w >= i: filling each window with the
    pending bytes is optimal because a byte pending now stays eligible for every later window."""
    pending = 0.0
    for w in range(len(slack)):
        pending += demand[w]
        pending -= min(pending, max(0.0, slack[w]))
    return pending


def evaluate_tiers(tiers: Sequence[str], inst: PlanningInstance, *, max_segment: int | None = None) -> Evaluation:
    """Score `tiers` (L+1 entries) under the MILP objective and check its constraints (see plan/milp.py)."""
    L, A = inst.num_layers, inst.boundary_bytes
    tiers = tuple(tiers)
    if len(tiers) != L + 1:
        raise LazyTrainError(f"{len(tiers)} tiers for {L} layers; need {L + 1}")
    g = [t == "gpu" for t in tiers]
    z = [t != "recompute" for t in tiers]
    off = [t in ("cpu", "nvme") for t in tiers]
    segments = _segments(tiers)
    violations: list[str] = []
    if not (g[0] and g[L]):
        violations.append("boundaries 0 and L must be gpu")
    if max_segment is not None and any(e - s > max_segment for s, e in segments):
        violations.append(f"a segment is longer than {max_segment}")
    cpu_bytes = sum(a for a, t in zip(A, tiers, strict=True) if t == "cpu")
    nvme_bytes = sum(a for a, t in zip(A, tiers, strict=True) if t == "nvme")
    if cpu_bytes > inst.cpu_act_bytes * (1 + 1e-9):
        violations.append(f"cpu activations {format_bytes(cpu_bytes)} > {format_bytes(inst.cpu_act_bytes)}")
    if nvme_bytes > inst.nvme_act_bytes * (1 + 1e-9):
        violations.append(f"nvme activations {format_bytes(nvme_bytes)} > {format_bytes(inst.nvme_act_bytes)}")
    tol = 1e-9 * max(1.0, inst.gpu_act_bytes)
    fwd_peak = sum(A[i] for i in range(L - 1) if g[i]) + A[L - 1] + A[L] + inst.fwd_transient_bytes
    gpu_act_peak = fwd_peak - inst.fwd_unallocated_bytes
    if fwd_peak > inst.gpu_act_bytes + inst.fwd_unallocated_bytes + tol:
        violations.append(f"forward needs {format_bytes(fwd_peak)} > "
                          f"{format_bytes(inst.gpu_act_bytes + inst.fwd_unallocated_bytes)} on the device")
    for k, (s, e) in enumerate(segments):
        # the previous segment's start is being reloaded while this one runs backward
        reload_buffer = A[segments[k - 1][0]] if k > 0 and off[segments[k - 1][0]] else 0.0
        peak = sum(A[i] for i in range(s) if g[i]) + sum(A[s:e + 1]) + reload_buffer + inst.bwd_transient_bytes
        gpu_act_peak = max(gpu_act_peak, peak)
        if peak > inst.gpu_act_bytes + tol:
            violations.append(f"backward of segment ({s}, {e}) needs {format_bytes(peak)} > "
                              f"{format_bytes(inst.gpu_act_bytes)} on the device")

    recompute_s = sum(inst.recompute_s(s, e) for s, e in segments)
    exposed_bytes = {"d2h": 0.0, "h2d": 0.0, "nvme_write": 0.0, "nvme_read": 0.0}

    # Offload links, forward windows 0..L (window L = loss head, which sends the head's gradients d2h).
    windows = [inst.window_s(w) for w in range(L + 1)]
    offload = [A[i] if off[i] else 0.0 for i in range(L + 1)]
    nvme = [A[i] if tiers[i] == "nvme" else 0.0 for i in range(L + 1)]
    if math.isfinite(inst.d2h_bytes_per_s):
        mandatory = [0.0] * L + [inst.head_param_bytes]
        slack = [inst.d2h_bytes_per_s * windows[w] - mandatory[w] for w in range(L + 1)]
        exposed_bytes["d2h"] = sum(max(0.0, offload[w] - max(0.0, slack[w])) for w in range(L + 1))  # window i only
    if math.isfinite(inst.nvme_write_bytes_per_s):
        exposed_bytes["nvme_write"] = _forward_exposed(nvme, [inst.nvme_write_bytes_per_s * t for t in windows])

    # Reload links, backward windows: window w < L lasts beta[w] (+ rho[w] when boundary w+1 is recomputed, whose
    # weights then cross h2d twice); the reload of boundary s uses the windows of the segment after (s, e), or the
    # loss head when (s, e) is the last segment. Each window serves at most one reload.
    def reload_exposed(rate: float, mandatory: bool, demand: list[float]) -> float:
        over = []  # mandatory - capacity per window, in the schedule's z
        for w in range(L):
            p = inst.param_bytes[w] if mandatory else 0.0
            recomputed = not z[w + 1]
            over.append(p * (2 if recomputed else 1) - rate * (inst.backward_s[w] + (inst.forward_s[w] if recomputed
                                                                                      else 0.0)))
        over.append((inst.head_param_bytes if mandatory else 0.0) - rate * inst.head_s)
        served = {}
        for k, (s, e) in enumerate(segments):
            served[s] = [L] if e == L else list(range(e, segments[k + 1][1]))
        total = sum(max(0.0, o) for o in over)
        for s, wins in served.items():
            room = sum(max(0.0, -over[w]) for w in wins)
            total += max(0.0, demand[s] - room)
        return total

    if math.isfinite(inst.h2d_bytes_per_s):
        exposed_bytes["h2d"] = reload_exposed(inst.h2d_bytes_per_s, True, offload)
    if math.isfinite(inst.nvme_read_bytes_per_s):
        exposed_bytes["nvme_read"] = reload_exposed(inst.nvme_read_bytes_per_s, False, nvme)

    rates = {"d2h": inst.d2h_bytes_per_s, "h2d": inst.h2d_bytes_per_s, "nvme_write": inst.nvme_write_bytes_per_s,
             "nvme_read": inst.nvme_read_bytes_per_s}
    exposed_s = {link: exposed_bytes[link] / rates[link] for link in rates if math.isfinite(rates[link])}
    # The baseline is counted on h2d (all windows) and d2h (the loss head): subtract it from those links.
    base_h2d = baseline_exposure_s(inst) - _head_d2h_baseline_s(inst)
    if "h2d" in exposed_s:
        exposed_s["h2d"] -= base_h2d
    if "d2h" in exposed_s:  # the loss head's mandatory overflow is not in exposed_bytes["d2h"]: nothing to subtract
        pass
    objective = (recompute_s + inst.lambda_z * sum(z) + inst.lambda_c * tiers.count("cpu")
                 + inst.lambda_n * tiers.count("nvme") + sum(exposed_s.values()))
    return Evaluation(feasible=not violations, objective=objective, recompute_s=recompute_s, exposed_s=exposed_s,
                      violations=tuple(violations), gpu_act_peak_bytes=gpu_act_peak)


def _head_d2h_baseline_s(inst: PlanningInstance) -> float:
    if not math.isfinite(inst.d2h_bytes_per_s):
        return 0.0
    return max(0.0, inst.head_param_bytes - inst.d2h_bytes_per_s * inst.head_s) / inst.d2h_bytes_per_s


def evaluate_objective(plan_or_tiers: Plan | Sequence[str], inst: PlanningInstance) -> float:
    """The MILP objective (seconds) of a plan's tiers; LazyTrainError if the tiers break a constraint."""
    tiers = plan_or_tiers.tiers if isinstance(plan_or_tiers, Plan) else tuple(plan_or_tiers)
    result = evaluate_tiers(tiers, inst)
    if not result.feasible:
        raise LazyTrainError(f"the plan breaks the planner's constraints: {result.violations[0]}")
    return result.objective


def milp_step_s(tiers: Sequence[str], inst: PlanningInstance, cost: CostModel, *, optimizer_mode: str = "overlap"
                ) -> float:
    """The MILP's step seconds of `tiers`: its objective plus the constant it leaves out, that constant taken once
    from the simulator at the placement that adds nothing (every boundary on the device, which the simulator
    times whatever the cap). Where the MILP models the step program exactly this equals the simulated step."""
    L = inst.num_layers
    keep_all = ("gpu",) * (L + 1)
    constant = simulate(Plan(tiers=keep_all, model_fingerprint=cost.spec.fingerprint()), cost,
                        optimizer_mode=optimizer_mode).step_s - evaluate_tiers(keep_all, inst).objective
    return evaluate_tiers(tiers, inst).objective + constant
