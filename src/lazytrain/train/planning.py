"""The plan a run executes: a cost model measured on this machine, the budgets, then the plan (file, MILP or
rule) with the simulator's prediction of one step."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from lazytrain.config import COST_OPTIMIZER
from lazytrain.plan import planner
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost, milp_step_s, solve_milp
from lazytrain.plan.plan import Plan, spec_of
from lazytrain.plan.sim import SimResult, simulate
from lazytrain.runtime.calibrate import calibrate
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.replan import Replanner
from lazytrain.spec.cost import CostModel
from lazytrain.spec.workload import Workload
from lazytrain.train.build import build_device, build_hardware, workload_of
from lazytrain.train.optimizer import build_optimizer, optimizer_step

if TYPE_CHECKING:
    from lazytrain.config import JobConfig

@dataclass
class Planned:
    """The plan, the cost model it was judged on, how it was made, and the simulator's step time."""

    plan: Plan
    cost: CostModel
    how: str
    sim: SimResult  # the simulator's SimResult for one forward_backward + optimizer step in the run's optimizer mode
    budgets: dict[str, int] = field(default_factory=dict)
    serial_step_s: float = 0.0  # the simulated step with the serial optimizer (for micro-batches without it)

    def predicted_step_s(self, grad_accum: int) -> float | None:
        """Seconds of one optimizer step: grad_accum - 1 streamed micro-batches without the optimizer, then
        one with it (serial: after the backward; overlap: hidden under it as far as it goes)."""
        if self.sim is None:
            return None
        return (grad_accum - 1) * (self.serial_step_s - self.cost.total_optimizer_s) + self.sim.step_s


def make_plan(job: JobConfig, model: PreTrainedModel, kind: str, probe_batch: tuple[torch.Tensor, torch.Tensor],
              *, masked: bool = False) -> Planned:
    """Cost model measured on this machine, budgets from the config, then the plan (file, MILP or rule)."""
    spec = spec_of(model)
    workload = workload_of(job)
    cost = calibrated_cost(job, model, kind, workload, probe_batch, masked=masked)
    defaults = planner.default_budgets(job.plan, cost)  # the same rule as `lazytrain plan`
    budgets = {k: v for k, v in defaults.to_dict().items() if k != "host_mem_bytes"}
    if budgets["gpu_mem_cap_bytes"] is None:  # a real device: its memory
        budgets["gpu_mem_cap_bytes"] = cost.hardware.gpu_mem_bytes
    if job.plan.plan_file is not None:
        plan = Plan.load(job.plan.plan_file, spec, workload)
        how = f"loaded from {job.plan.plan_file} ({plan.report.planner})"
        for knob in ("gpu_mem_cap_bytes", "cpu_act_bytes", "nvme_act_bytes"):
            if getattr(job.plan, knob) is None and plan.budgets_bytes.get(knob) is not None:
                budgets[knob] = plan.budgets_bytes[knob]  # the budgets the plan was solved under
    else:
        # the one dispatcher of both commands; a rule over the default cap runs with the device sized to its peak
        # (fit_device_cap), so only a user's cap makes a rule that does not fit an error
        deadline = planner.Deadline(job.plan.time_limit_s)  # the solver gets what is left of the time limit
        plan = planner.make_plan(job.plan, cost, Budgets(**budgets), deadline=deadline,
                                 strict_rules=job.plan.gpu_mem_cap_bytes is not None,
                                 optimizer_mode=job.optim.optimizer_mode)
        how = planner.describe(plan)
    sim = _simulate(plan, cost, job.optim.optimizer_mode)
    milp_s = milp_step_s(plan.tiers, instance_from_cost(cost, Budgets(**budgets),
                                                        optimizer_mode=job.optim.optimizer_mode))
    plan = plan.with_prediction(replace(sim.to_prediction(), milp_step_s=milp_s))
    serial_s = sim.step_s if job.optim.optimizer_mode == "serial" else _simulate(plan, cost, "serial").step_s
    return Planned(plan=plan, cost=cost, how=how, sim=sim, budgets=budgets, serial_step_s=serial_s)


def calibrated_cost(job: JobConfig, model: PreTrainedModel, kind: str, workload: Workload,
                    probe_batch: tuple[torch.Tensor, torch.Tensor], *, masked: bool = False) -> CostModel:
    """A CostModel whose compute and optimizer seconds are measured on the device the run uses.

    Four steps of an all-`gpu` plan on an uncapped, unthrottled device of the same kind time every layer's
    forward and backward and the loss head exactly as the executor runs them (the first step warms up);
    five steps of a throwaway optimizer of the run's kind time the host update (the parameters are restored
    afterwards); `lazytrain.runtime.calibrate` turns them into the CostModel. On CUDA the executor's
    per-layer timers see asynchronous launches, so there the FLOP estimate is scaled by the measured step
    time instead. Link rates are the configured (emulated) ones. `masked`: the run's batches carry an attention
    mask or position ids, whose device bytes the cost model then counts.
    """
    hardware = build_hardware(job, kind)
    dtype = torch.bfloat16 if job.runtime.dtype == "bf16" else torch.float32
    keep_all = Plan.from_tiers(model, ["gpu"] * (model.config.num_hidden_layers + 1))
    probe_device = build_device(job, kind, None, throttled=False)
    executor = Executor(model, keep_all, probe_device, compute_dtype=dtype)
    steps = []
    for _ in range(4):  # the first step warms up; the calibration takes medians of the next three
        executor.forward_backward(*probe_batch)  # host sync: returns when the step is done
        steps.append(executor.last_step)
    probe_device.close()
    # rotary, positions, masks (eager attention; and per-row masks when the batches carry them)
    constant_bytes = executor.memory_sizes(workload.batch_size, workload.seq_len, masked=masked).constant_bytes

    snapshot = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(job, model)
    samples = []
    for _ in range(5):  # the first steps allocate and first-touch the states: the median of the later four
        t0 = time.perf_counter()
        optimizer_step(job, optimizer, model, zero_grad=False)
        samples.append(time.perf_counter() - t0)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), snapshot, strict=True):
            p.copy_(saved)
    del optimizer, snapshot
    model.zero_grad(set_to_none=True)

    cost = CostModel(spec_of(model), hardware, workload, COST_OPTIMIZER[job.optim.optimizer], executor_layout=True
                     ).with_device_constants(constant_bytes)
    # one calibration path (runtime/calibrate.py): medians, quantized, so the same run plans the same way
    return calibrate(cost, steps[1:], optimizer_s=statistics.median(samples[1:]), scale_flops=kind == "cuda")


def replanner_for(job: JobConfig, planned: Planned) -> Replanner:
    """`replan: true`: re-solve (warm-started, same budgets and MILP options) when measured times drift."""
    options = job.plan

    def solve(cost: CostModel, start: tuple[str, ...]) -> Plan:
        return solve_milp(cost, Budgets(**planned.budgets), max_segment=options.max_segment,
                          time_limit_s=options.time_limit_s, mip_rel_gap=options.mip_rel_gap, solver=options.solver,
                          start_tiers=start, optimizer_mode=job.optim.optimizer_mode)

    return Replanner(planned.cost, planned.plan, solve, optimizer_mode=job.optim.optimizer_mode)


def replace_plan(planned: Planned, plan: Plan, cost: CostModel, optimizer_mode: str) -> Planned:
    """The running plan after a switch, judged on the re-calibrated cost model."""
    sim = _simulate(plan, cost, optimizer_mode)
    serial_s = sim.step_s if optimizer_mode == "serial" else _simulate(plan, cost, "serial").step_s
    return replace(planned, plan=plan.with_prediction(sim.to_prediction()), cost=cost, sim=sim,
                   how=f"re-planned ({plan.report.planner})", serial_step_s=serial_s)


def _simulate(plan: Plan, cost: CostModel, optimizer_mode: str) -> SimResult:
    """The simulator's replay of one step, the optimizer run as this loop runs it."""
    return simulate(plan, cost, optimizer_mode=optimizer_mode)

