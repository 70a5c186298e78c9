"""The one planner dispatcher of `lazytrain plan` and `lazytrain train`: budgets, then the MILP or a rule.

Both commands call the same functions here with the job's inputs (job/inputs.py), so the same job gets the same
budgets and the same planner (train's cost model is calibrated on its device; plan's is the hardware's estimate):

    budgets = default_budgets(options, cost)              # None in the plan options = the rule below, written once
    admission, budgets = admitted(cost, budgets)          # refuse what no plan fits; M_C = the host room left
    plan = make_plan(options, cost, budgets)              # MILP (planner auto|milp) or a rule (and a staging depth)

`options` is the job's plan section (PlanConfig: planner, interval, solver, max_segment, time_limit_s,
mip_rel_gap and the budgets). Data parallelism (costmodel/topology.py): every rank runs the same plan on its
own rows, so the planner plans one rank -- `make_plan(..., topology=...)` puts the gradients' sums over the
ranks in the MILP's step.

`Deadline` bounds the whole planning wall time (building the model, the cost model and the MILP included):
the solver gets what is left after the build, and a build that runs past the limit is stopped with one line.
An import in progress (torch, transformers' modeling code) is not interrupted; the limit acts when it ends.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import replace
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.errors import LazyTrainError
from lazytrain.plan.admission import Admission, admit, staging_budgets
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost, solve_milp
from lazytrain.plan.plan import Plan
from lazytrain.plan.rules import RULES, evaluate_tiers, make_rule_plan

if TYPE_CHECKING:
    from collections.abc import Callable

    from lazytrain.config import PlanConfig
    from lazytrain.costmodel.cost import CostModel

EMULATED_GPU_BOUNDARIES = 5  # emulated device, default cap: static bytes + this many boundary activations
EMULATED_OFFLOAD_BOUNDARIES = 2  # emulated device, default cpu and nvme budgets, in boundary activations


# ---- budgets ----------------------------------------------------------------------------------------------
def default_budgets(options: PlanConfig, cost: CostModel) -> Budgets:
    """The job's budgets with None filled by one rule for both commands.

    On the emulated device (the CPU-only job) the device cap is the static device bytes plus 5 boundary
    activations and cpu and nvme get 2 each: too little to keep every boundary anywhere, so the plan mixes
    tiers. Where the smallest placement needs more than 5 boundaries (a large vocabulary's logits at the loss
    head), the cap is that need and one boundary more: a job given no cap always fits. On a real device: its
    memory, the host room left (admission fills it), and no NVMe tier.
    """
    act = max(cost.boundary_bytes)
    cap, cpu, nvme = options.gpu_mem_cap_bytes, options.cpu_act_bytes, options.nvme_act_bytes
    if cost.hardware.emulated:
        if cap is None:
            depth = 1 if getattr(cost, "optimizer_offload", "host") == "nvme" else 0
            need = instance_from_cost(cost, staging_depth=depth).min_gpu_act_bytes()
            cap = cost.static_device_bytes() + max(EMULATED_GPU_BOUNDARIES * act, math.ceil(need) + act)
        cpu = cpu if cpu is not None else EMULATED_OFFLOAD_BOUNDARIES * act
        nvme = nvme if nvme is not None else EMULATED_OFFLOAD_BOUNDARIES * act
    return Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=cpu, nvme_act_bytes=nvme or 0,
                   host_mem_bytes=options.cpu_mem_bytes)


def admitted(cost: CostModel, budgets: Budgets) -> tuple[Admission, Budgets]:
    """Admission control, then the budgets the planners use: M_C defaults to the host room left."""
    admission = admit(cost, budgets)
    return admission, replace(budgets, cpu_act_bytes=admission.cpu_act_bytes)


# ---- planning ---------------------------------------------------------------------------------------------
def make_plan(options: PlanConfig, cost: CostModel, budgets: Budgets, *, feasibility_only: bool = False,
              strict_rules: bool = True, deadline: Deadline | None = None, optimizer_mode: str = "overlap",
              topology: Topology = ONE_RANK) -> Plan:
    """The MILP's plan (planner auto|milp), or a rule's, under `budgets`.

    A rule's tiers are checked against the same constraints; `strict_rules` refuses one that does not fit
    (train passes False when the cap is its own default and gives the device the rule's peak instead).
    `feasibility_only`: any incumbent will do (the largest-batch search). The MILP's step is for the job's
    `optimizer_mode`, on one rank of `topology` (the sums over the ranks in its step).

    With the optimizer's state on NVMe the staging depth D is a decision under the host memory: one plan per D the
    host holds beside the cpu activations (admission.staging_budgets: each D's slots come out of M_C), the fastest
    kept, a tie to the fewer slots; its report lists each D's step (`staging_steps`). D changes which window each
    state read runs in, i.e. the MILP's rows, not only their coefficients: a D chosen inside one MILP would need a
    big-M row per read and depth, so each D is its own exact MILP (<= MAX_STAGING_DEPTH of them, deepest first; a
    deadline that runs out keeps the best so far). The largest-batch search tries D = 1, the most host room.
    """
    choices = staging_budgets(cost, budgets)
    if choices == [(0, budgets)]:
        return _plan_at(options, cost, budgets, 0, feasibility_only, strict_rules, deadline, optimizer_mode,
                        topology)[0]
    if not choices:
        raise LazyTrainError("host memory: not even one optimizer-state staging slot fits beside the cpu "
                             "activation budget; lower --cpu-act-budget or raise --cpu-mem")
    if feasibility_only:
        choices = choices[:1]
    end_s = deadline.end_s if deadline is not None else time.perf_counter() + options.time_limit_s
    best: tuple[Plan, float] | None = None
    steps, error = [], None
    for depth, budgets_d in reversed(choices):
        if best is not None and time.perf_counter() >= end_s:
            break  # out of time: the best depth so far
        try:
            plan, step_s = _plan_at(options, cost, budgets_d, depth, feasibility_only, strict_rules, deadline,
                                    optimizer_mode, topology, time_limit_s=max(1e-3, end_s - time.perf_counter()))
        except LazyTrainError as err:
            error = error or err
            continue
        steps.append([depth, step_s])
        if best is None or step_s <= best[1] * (1 + 1e-9):
            best = plan, step_s
    if best is None:
        assert error is not None
        raise error
    plan = best[0]
    return replace(plan, report=replace(plan.report, options={**plan.report.options,
                                                              "staging_steps": sorted(steps)}))


def _plan_at(options: PlanConfig, cost: CostModel, budgets: Budgets, staging_depth: int, feasibility_only: bool,
             strict_rules: bool, deadline: Deadline | None, optimizer_mode: str, topology: Topology,
             time_limit_s: float | None = None) -> tuple[Plan, float]:
    """One plan at one staging depth (0: the states in RAM) and its step seconds."""
    if options.planner in RULES:
        plan = make_rule_plan(options.planner, cost.spec, interval=options.interval, workload=cost.workload)
        evaluation = evaluate_tiers(plan.tiers, instance_from_cost(cost, budgets, optimizer_mode=optimizer_mode,
                                                                   topology=topology, staging_depth=staging_depth))
        if strict_rules and not evaluation.feasible:
            raise LazyTrainError(f"the {options.planner} rule does not fit: {evaluation.violations[0]}; lower "
                                 "per_device_train_batch_size or raise the budget")
        report = replace(plan.report, objective=evaluation.objective)
        budgets_bytes = {k: int(v) for k, v in budgets.to_dict().items() if v is not None}
        return replace(plan, report=report, budgets_bytes=budgets_bytes, staging_depth=staging_depth,
                       optimizer_offload="nvme" if staging_depth else "host"), evaluation.step_s
    if time_limit_s is None:
        time_limit_s = options.time_limit_s if deadline is None else deadline.left_s()
    plan = solve_milp(cost, budgets, max_segment=options.max_segment, time_limit_s=time_limit_s,
                      mip_rel_gap=0.999 if feasibility_only else options.mip_rel_gap, solver=options.solver,
                      deadline_s=None if deadline is None else deadline.end_s, optimizer_mode=optimizer_mode,
                      topology=topology, staging_depth=staging_depth)
    return plan, plan.report.options["step_s"]


def describe(plan: Plan) -> str:
    """How a plan was made, for a report line: `MILP (highs, optimal, gap 0.00%, 0.12 s)` or the rule."""
    r = plan.report
    if r.planner == "milp":
        gap = f", gap {r.gap:.2%}" if r.gap is not None and math.isfinite(r.gap) else ""
        return f"MILP ({r.solver}, {r.status}{gap}, {r.seconds:.2f} s)"
    if r.planner == "megatrain":
        return f"MegaTrain rule (every {r.options.get('interval', 4)}th boundary)"
    return f"{r.planner} rule"


# ---- the time limit ---------------------------------------------------------------------------------------
UNSAFE_FRAMES = ("__del__", "_remove", "__exit__")  # where an exception from the alarm would be lost or harmful


class Deadline:
    """A wall-time bound on planning, from its start: `left_s()` for the solver, and (main thread, POSIX) an
    alarm a little after the end that stops Python work still running (e.g. building a long model's MILP)
    with a one-line error. The solver itself stops at the end with its best incumbent, before the alarm."""

    GRACE_S = 1.0  # the alarm fires this long after the end: the solver's own limit comes first
    REPEAT_S = 0.1  # and again every this often until planning has stopped

    def __init__(self, limit_s: float, knob: str = "time_limit_s") -> None:
        self.limit_s = limit_s
        self.knob = knob
        self.end_s = time.perf_counter() + limit_s
        self._previous: Callable[..., object] | int | None = None

    def left_s(self) -> float:
        left = self.end_s - time.perf_counter()
        if left <= 0:
            raise self.error("before the solver started")
        return left

    def expired(self) -> bool:
        return time.perf_counter() >= self.end_s

    def error(self, when: str) -> LazyTrainError:
        return LazyTrainError(f"planning ran past {self.knob} {self.limit_s:g} s {when}; raise {self.knob} "
                              "(--time-limit), or lower max_segment or the model size")

    def _alarm(self, signum: int, frame: FrameType | None) -> None:
        # Not inside an import (it would leave the module half-initialized) or a finalizer (which swallows and
        # prints the exception): the repeating alarm raises in ordinary code a moment later.
        solving = False
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_code.co_name in UNSAFE_FRAMES:
                return
            solving |= frame.f_code.co_name == "_run_interruptibly"  # the solver ran past its own limit
            frame = frame.f_back
        raise self.error("while the solver ran" if solving else "while building the model, the cost model or the MILP")

    def __enter__(self) -> Deadline:
        try:
            self._previous = signal.signal(signal.SIGALRM, self._alarm)
        except (ValueError, AttributeError):  # not the main thread, or no SIGALRM: the solver limit only
            self._previous = None
            return self
        # repeating: an exception raised while Python runs a finalizer is swallowed, so the alarm comes back
        signal.setitimer(signal.ITIMER_REAL, self.limit_s + self.GRACE_S, self.REPEAT_S)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
