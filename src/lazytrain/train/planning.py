"""The plan a run executes: a cost model measured on this machine, the budgets, then the plan (file, MILP or
rule) with the simulator's prediction of one step.

Reproducible plans: the calibration is timed on a machine shared with other work, and its figures move by
tens of percent run to run (docs/reliability.md), enough to tip the MILP between near-equal plans. So the
MILP's plan is remembered per job and machine (`remembered_plan_path`: model shapes, workload, budgets, links,
optimizer, planner options, CPU) in the cache, and the next run of the same command keeps it unless its own
MILP plan is predicted more than `KEEP_GAIN` faster than the remembered one on this run's calibration: the
same command gives the same plan unless the measured times really changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from lazytrain.config import COST_OPTIMIZER
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import available_host_memory_bytes
from lazytrain.costmodel.topology import ONE_RANK, REDUCE_DTYPE_BYTES, Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan import planner
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost, milp_step_s, solve_milp
from lazytrain.plan.plan import Plan, spec_of
from lazytrain.plan.ranks import topology_of
from lazytrain.plan.rules import evaluate_tiers
from lazytrain.plan.sim import SimResult, simulate
from lazytrain.runtime.calibrate import calibrate, calibrate_links, lane_seconds, probe_steps
from lazytrain.runtime.executor import Executor, StepStats
from lazytrain.runtime.replan import Replanner
from lazytrain.train.build import build_device, build_hardware, workload_of
from lazytrain.train.data import cache_dir
from lazytrain.train.optimizer import build_optimizer, executor_param_groups, group_update, optimizer_step
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from pathlib import Path

    from lazytrain.config import JobConfig
    from lazytrain.distributed import Ranks

KEEP_GAIN = 0.05  # a new MILP plan replaces the remembered one only when predicted this much faster

@dataclass
class PlannedRun:
    """What `plan_run` decided for this run: the `Plan` it executes (plan/plan.py: tiers and kept layers, the plan
    file), with the calibrated cost model it was judged on, how it was made, the budgets and the simulator's step."""

    plan: Plan
    cost: CostModel
    how: str
    sim: SimResult  # the simulator's SimResult for one forward_backward + optimizer step in the run's optimizer mode
    budgets: dict[str, int] = field(default_factory=dict)
    serial_step_s: float = 0.0  # the simulated step with the serial optimizer (for micro-batches without it)
    topology: Topology = ONE_RANK  # data parallelism: the plan is one rank's, its step has the collective lane

    def predicted_step_s(self, grad_accum: int) -> float | None:
        """Seconds of one optimizer step: grad_accum - 1 streamed micro-batches without the optimizer, then
        one with it (serial: after the backward; overlap: the previous step's update under the first one's
        forward, as far as it goes)."""
        if self.sim is None:
            return None
        return (grad_accum - 1) * (self.serial_step_s - self.cost.total_optimizer_s) + self.sim.step_s


def plan_run(job: JobConfig, model: PreTrainedModel, kind: str, probe_batch: tuple[torch.Tensor, torch.Tensor],
             *, ranks: Ranks | None = None) -> PlannedRun:
    """Calibrate, plan, remember: the cost model measured on this machine, budgets from the config, then the plan
    (file, MILP or rule; a MILP plan is kept steady by the remembered one).

    With ranks (torchrun; `job.parallel` holds the launched layout) the ranks first time their gradients' sums
    together (the largest group's, as the runtime sums it: `Ranks.time_sums`); then rank 0 alone calibrates, its
    measured sum rates replacing the hardware's, and plans for one rank of the run (the sums over the ranks in the
    step); every rank then runs rank 0's plan and predictions. The others wait at the broadcast (within
    `collective_timeout_s`): a calibration holds a whole model's gradients and optimizer states, which on every
    rank at once made the node's start-up peak grow with its ranks."""
    if ranks is None:
        return _decide(job, model, kind, calibrated_cost(job, model, kind, workload_of(job), probe_batch))
    spec = spec_of(model)  # the largest streamed group (CostModel.streamed_group_params)
    numel = max(*spec.layer_params, spec.head_params + (spec.embedding_params if spec.tie_word_embeddings else 0))
    sums_s = ranks.time_sums(numel)

    def decide() -> PlannedRun:
        cost = calibrated_cost(job, model, kind, workload_of(job), probe_batch)
        cost = calibrate_links(cost, ranks.topology, REDUCE_DTYPE_BYTES * numel, *sums_s)
        hw = cost.hardware  # rank 0's measured rates go with its plan
        planned = _decide(job, model, kind, cost)
        return replace(planned, how=f"{planned.how}; rank 0's plan for the {ranks.world_size} ranks, their "
                       f"gradients' sums measured at {hw.intra_node_gbps:.3g} GB/s in a node, "
                       f"{hw.inter_node_gbps:.3g} between nodes")

    return ranks.decided_by_main(decide, "the plan")


def _decide(job: JobConfig, model: PreTrainedModel, kind: str, cost: CostModel) -> PlannedRun:
    """The plan of this job on `cost`: budgets from the config, then the plan file, the MILP or a rule."""
    spec = spec_of(model)
    workload = cost.workload
    topology = topology_of(job)
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
                                 optimizer_mode=job.optim.optimizer_mode, topology=topology)
        how = planner.describe(plan)
        if plan.report.planner == "milp":
            plan, how = keep_or_replace(plan, how, cost, budgets, job.optim.optimizer_mode,
                                        remembered_plan_path(job, cost, budgets, kind), topology)
    sim = _simulate(plan, cost, job.optim.optimizer_mode, topology)
    milp_s = milp_step_s(plan.tiers, instance_from_cost(cost, Budgets(**budgets),
                                                        optimizer_mode=job.optim.optimizer_mode, topology=topology),
                         plan.kept_layers)
    plan = plan.with_prediction(replace(sim.to_prediction(), milp_step_s=milp_s))
    return PlannedRun(plan=plan, cost=cost, how=how, sim=sim, budgets=budgets, topology=topology,
                   serial_step_s=_micro_batch_s(plan, cost, sim, job.optim.optimizer_mode, topology))


def calibrated_cost(job: JobConfig, model: PreTrainedModel, kind: str, workload: Workload,
                    probe_batch: tuple[torch.Tensor, torch.Tensor]) -> CostModel:
    """A CostModel whose compute and optimizer seconds are measured on the device the run uses.

    Steps of an all-`gpu` plan on an uncapped, unthrottled device of the same kind time every layer's
    forward and backward and the loss head exactly as the executor runs them (a warm-up, then at least 3 steps
    and 5 s of them: `probe_steps`);
    a throwaway optimizer of the run's kind at learning rate 0 times the host update (the same work; the weights
    do not move, so no copy of them is needed): in overlap mode each probe step runs the previous one's update on
    its optimizer lane under its forward, as the run does (so the compute is timed beside it too: alone, the
    default job's updates took 23 ms a step where the run's took 39); in serial mode five steps after the probe.
    `lazytrain.runtime.calibrate` turns them
    into the CostModel. On CUDA the executor's per-layer timers see asynchronous launches, so there the FLOP
    estimate is scaled by the measured step time instead. Link rates are the configured (emulated) ones.
    `workload.masked`: the run's batches carry an attention mask or position ids, whose device bytes (per-row
    constants, every SDPA layer's mask copy and repeated k/v) the cost model then counts.
    """
    hardware = build_hardware(job, kind)
    dtype = torch.bfloat16 if job.runtime.dtype == "bf16" else torch.float32
    keep_all = Plan.from_tiers(model, ["gpu"] * (model.config.num_hidden_layers + 1))
    probe_device = build_device(job, kind, None, throttled=False)
    try:
        executor = Executor(model, keep_all, probe_device, compute_dtype=dtype)
        if kind == "cpu":
            _check_probe_fits(executor, workload)

        # The optimizer is timed while the probe device's link threads live, as the run's own do while it trains:
        # each link thread that ran torch ops owns an OpenMP team, and libgomp spins long at a barrier only while
        # the process has no more OpenMP threads than CPUs. With the teams gone, on a shared machine every barrier
        # of the optimizer's short parallel regions spins out a time slice while its partner is descheduled: the
        # default job's optimizer step measured 1.5-4 s instead of 0.03 s (docs/benchmarks.md).
        optimizer = build_optimizer(job, model)
        for group in optimizer.param_groups:  # the same work, but the weights stay as they are (no copy of them)
            group["lr"] = 0.0
        overlap = job.optim.optimizer_mode == "overlap"
        groups = executor_param_groups(optimizer, executor)

        def probe() -> StepStats:
            last = executor.last_step
            if overlap and last is not None:  # as the run: the last step's update on this one's optimizer lane
                executor.defer_update(group_update(job, optimizer, groups, last.grad_norm or 0.0, lr=0.0))
            executor.forward_backward(*probe_batch)  # host sync: returns when the step is done
            return executor.last_step

        steps = probe_steps(probe)  # a warm-up, then seconds of steps (runtime/calibrate.py)
        # rotary, positions, masks (eager attention; and per-row masks when the batches carry them)
        constant_bytes = executor.memory_sizes(workload.batch_size, workload.seq_len,
                                               masked=workload.masked).constant_bytes
        if overlap:  # the updates' seconds on the lane (the first measured step's also first-touches the states)
            optimizer_s = statistics.median(lane_seconds(s, "optimizer", ("update",)) for s in steps)
        else:
            samples = []
            for _ in range(5):  # the first steps allocate and first-touch the states: the fastest of the later four
                t0 = time.perf_counter()
                optimizer_step(job, optimizer, executor, grad_norm=executor.last_step.grad_norm)
                samples.append(time.perf_counter() - t0)
            # the fastest: a shared machine's interference only ever adds time (their medians moved 60x run to run
            # under load; docs/reliability.md)
            optimizer_s = min(samples[1:])
    finally:
        probe_device.close()
    model.zero_grad(set_to_none=True)

    cost = CostModel(spec_of(model), hardware, workload, COST_OPTIMIZER[job.optim.optimizer],
                     **planner.host_layout(job)).with_device_constants(constant_bytes)
    # one calibration path (runtime/calibrate.py): medians, quantized, so the same run plans the same way
    return calibrate(cost, steps, optimizer_s=optimizer_s, scale_flops=kind == "cuda")


def _check_probe_fits(executor: Executor, workload: Workload) -> None:
    """The emulated device's memory is this host's: refuse a calibration step (all boundaries kept, the largest
    device footprint of the run) that would not fit in what the host has available, before allocating it."""
    need = executor.predicted_peak_bytes(workload.batch_size, workload.seq_len, masked=workload.masked)
    available = available_host_memory_bytes()
    if available is not None and need > available:
        raise LazyTrainError(
            f"host memory: the emulated device's calibration step (batch {workload.batch_size} x "
            f"{workload.seq_len}, every boundary kept) needs {format_bytes(need)} but this machine's available "
            f"memory gives {format_bytes(available)}; lower per_device_train_batch_size or cutoff_len")


def remembered_plan_path(job: JobConfig, cost: CostModel, budgets: dict[str, int], kind: str) -> Path:
    """Where the plan of this job on this machine is remembered: `<cache>/plans/<hash>.json`, the hash over what
    decides the plan except the measured seconds (those are what `keep_or_replace` judges)."""
    hardware = cost.hardware
    key = dict(
        spec=cost.spec.fingerprint(), workload=[cost.workload.batch_size, cost.workload.seq_len, cost.workload.dtype],
        masked=cost.workload.masked, budgets=budgets, device=kind, hardware=hardware.name,
        links=[hardware.h2d_gbps, hardware.d2h_gbps, hardware.nvme_read_gbps, hardware.nvme_write_gbps],
        optimizer=[job.optim.optimizer, job.optim.optimizer_mode], constant_bytes=cost.constant_device_bytes,
        plan={k: v for k, v in asdict(job.plan).items() if k != "time_limit_s"},
        machine=[_cpu_model(), os.cpu_count(), torch.__version__],
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "plans" / f"{digest}.json"


def keep_or_replace(plan: Plan, how: str, cost: CostModel, budgets: dict[str, int], optimizer_mode: str,
                    remembered: Path, topology: Topology = ONE_RANK) -> tuple[Plan, str]:
    """The remembered plan of this job, unless `plan` (this run's MILP plan) is predicted more than `KEEP_GAIN`
    faster on this run's cost model (one rank of `topology`), or the remembered one no longer fits the budgets;
    the plan chosen is remembered. A cache that cannot be read or written is ignored: it only ever steadies
    plans."""
    incumbent = _read_remembered(remembered, cost)
    if incumbent is not None and incumbent.tiers != plan.tiers:
        inst = instance_from_cost(cost, Budgets(**budgets), optimizer_mode=optimizer_mode, topology=topology)
        fits = evaluate_tiers(incumbent.tiers, inst).feasible
        old_s = _simulate(incumbent, cost, optimizer_mode, topology).step_s
        new_s = _simulate(plan, cost, optimizer_mode, topology).step_s
        if fits and not new_s < old_s * (1 - KEEP_GAIN):
            how = (f"remembered plan, kept: this run's MILP plan {plan.placement_map()} is predicted {new_s:.3f} s vs "
                   f"{old_s:.3f} s, not {KEEP_GAIN:.0%} faster; {remembered}")
            plan = incumbent
        else:
            how += (f"; replaces the remembered {incumbent.placement_map()} ("
                    + (f"{old_s:.3f} s predicted)" if fits else "no longer fits the budgets)"))
    try:
        plan.save(remembered)
    except LazyTrainError:
        pass  # a read-only cache: this run's plan stands, unremembered
    return plan, how


def _read_remembered(path: Path, cost: CostModel) -> Plan | None:
    if not path.is_file():
        return None
    try:
        plan = Plan.load(path, cost.spec, cost.workload)
    except (LazyTrainError, KeyError, TypeError, ValueError):
        return None  # a damaged or foreign file: solved afresh and overwritten
    return plan if plan.report.planner == "milp" else None


def _cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def replanner_for(job: JobConfig, planned: PlannedRun) -> Replanner:
    """`replan: true`: re-solve (warm-started, same budgets and MILP options, for one rank of the run's topology)
    when measured times drift."""
    options = job.plan

    def solve(cost: CostModel, start: Plan) -> Plan:
        return solve_milp(cost, Budgets(**planned.budgets), max_segment=options.max_segment,
                          time_limit_s=options.time_limit_s, mip_rel_gap=options.mip_rel_gap, solver=options.solver,
                          start_tiers=start.tiers, start_kept=start.kept_layers,
                          optimizer_mode=job.optim.optimizer_mode, topology=planned.topology)

    return Replanner(planned.cost, planned.plan, solve, optimizer_mode=job.optim.optimizer_mode,
                     topology=planned.topology)


def replace_plan(planned: PlannedRun, plan: Plan, cost: CostModel, optimizer_mode: str) -> PlannedRun:
    """The running plan after a switch, judged on the re-calibrated cost model."""
    sim = _simulate(plan, cost, optimizer_mode, planned.topology)
    return replace(planned, plan=plan.with_prediction(sim.to_prediction()), cost=cost, sim=sim,
                   how=f"re-planned ({plan.report.planner})",
                   serial_step_s=_micro_batch_s(plan, cost, sim, optimizer_mode, planned.topology))


def _micro_batch_s(plan: Plan, cost: CostModel, sim: SimResult, optimizer_mode: str, topology: Topology) -> float:
    """`PlannedRun.serial_step_s`: the serial step (`sim` when it is that already); with ranks every micro-batch
    sums its gradients over them (distributed/grads.py), so it has the collective lane too."""
    return sim.step_s if optimizer_mode == "serial" else _simulate(plan, cost, "serial", topology).step_s


def _simulate(plan: Plan, cost: CostModel, optimizer_mode: str, topology: Topology = ONE_RANK) -> SimResult:
    """The simulator's replay of one step of one rank, the optimizer run as this loop runs it."""
    return simulate(plan, cost, optimizer_mode=optimizer_mode, topology=topology)

