"""The plan a run executes (`plan_run`): a cost model measured on this machine (runtime/probe.py), the budgets,
then the plan (file, MILP or rule; a MILP plan steadied by the remembered one, plan/cache.py) with the
simulator's prediction of one step.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from lazytrain.costmodel import hardware as hardware_module
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.topology import ONE_RANK, REDUCE_DTYPE_BYTES, Topology, node_host_bytes
from lazytrain.job.inputs import cost_model, resolve_hardware, topology_of
from lazytrain.paths import ram_backed
from lazytrain.plan import planner
from lazytrain.plan.admission import host_line, host_need, nvme_need, nvme_write_bytes, wear_line
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.cache import keep_or_replace, remembered_plan_path
from lazytrain.plan.milp import instance_from_cost, milp_step_s, solve_milp
from lazytrain.plan.plan import Plan, spec_of
from lazytrain.plan.sim import SimResult, simulate
from lazytrain.runtime.calibrate import calibrate_links
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.hf import find_parts
from lazytrain.runtime.nvme_probe import cached_rates, probe_nvme
from lazytrain.runtime.probe import ProbeOptimizer, calibrated_cost
from lazytrain.runtime.replan import Replanner
from lazytrain.runtime.weights import deferred, materialized
from lazytrain.train.build import build_device, compute_dtype
from lazytrain.train.metrics import say
from lazytrain.train.optimizer import build_optimizer, executor_param_groups, group_update, optimizer_step
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from lazytrain.config import JobConfig
    from lazytrain.distributed import Ranks


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
        return _decide(job, model, kind, measured_cost(job, model, kind, probe_batch))
    numel = max(spec_of(model).streamed_group_params)  # the largest streamed group, as the runtime sums it
    sums_s = ranks.time_sums(numel)

    def decide() -> PlannedRun:
        cost = measured_cost(job, model, kind, probe_batch)
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
        plan = planner.make_plan(job.plan, cost, Budgets(**budgets, host_mem_bytes=_staging_room(job, cost)),
                                 deadline=deadline,
                                 strict_rules=job.plan.gpu_mem_cap_bytes is not None,
                                 optimizer_mode=job.optim.optimizer_mode, topology=topology)
        how = planner.describe(plan)
        if plan.report.planner == "milp":
            remembered = remembered_plan_path(cost, budgets, device=kind,
                                              optimizer=[job.optim.optimizer, job.optim.optimizer_mode],
                                              plan_options=asdict(job.plan), torch_version=torch.__version__)
            plan, how = keep_or_replace(plan, how, cost, budgets, job.optim.optimizer_mode, remembered, topology)
    sim = _simulate(plan, cost, job.optim.optimizer_mode, topology)
    milp_s = milp_step_s(plan.tiers, instance_from_cost(cost, Budgets(**budgets),
                                                        optimizer_mode=job.optim.optimizer_mode, topology=topology,
                                                        staging_depth=plan.staging_depth), plan.kept_layers)
    plan = plan.with_prediction(replace(sim.to_prediction(), milp_step_s=milp_s))
    return PlannedRun(plan=plan, cost=cost, how=how, sim=sim, budgets=budgets, topology=topology,
                      serial_step_s=_micro_batch_s(plan, cost, sim, job.optim.optimizer_mode, topology))


def _staging_room(job: JobConfig, cost: CostModel) -> int | None:
    """With the optimizer's state on NVMe, the host memory its staging slots may come out of (planner: one plan per
    depth that fits): --cpu-mem, else what this machine has available now plus the masters this process already
    holds (the model is built; the rest of the host layout is not yet). None in RAM: the budgets as they were."""
    if cost.optimizer_offload != "nvme":
        return None
    if job.plan.cpu_mem_bytes is not None:
        return job.plan.cpu_mem_bytes
    available = hardware_module.available_host_memory_bytes()
    return None if available is None else available + cost.host_breakdown()["weights"]


def disk_rates(job: JobConfig, hardware: HardwareSpec, kind: str) -> HardwareSpec:
    """With optimizer_offload nvme, `hardware` with the NVMe rates of the disk under nvme_dir measured (or remembered
    from an earlier probe of it; nvme_probe false: as it is), said in one line. On CUDA the plan uses them: each
    direction alone, and the slower direction's rate beside the other as nvme_mixed_gbps, which the cost model
    gives both NVMe lanes (the state reads of the next groups run beside the write-backs of the last ones for most
    of a step), unless the job states it (nvme_mixed_gbps). The emulated device's links are its throttle (probed
    only when unthrottled, for the line): its calibration measures them through the same files."""
    throttled = math.isfinite(job.runtime.nvme_read_gbps) and math.isfinite(job.runtime.nvme_write_gbps)
    if job.runtime.optimizer_offload != "nvme" or not job.runtime.nvme_probe or (kind != "cuda" and throttled):
        return hardware  # (a throttled emulated link is slower than the disk: the throttle is its rate)
    directory = job.runtime.nvme_dir or tempfile.gettempdir()
    rates = cached_rates(directory)
    how = "remembered" if rates is not None else "measured"
    rates = rates or probe_nvme(directory, job.runtime.nvme_probe_s)
    say(f"nvme     {directory}: {rates.describe()}, {how}")
    if kind != "cuda":
        return hardware
    return hardware.with_overrides(nvme_read_gbps=rates.read_gbps, nvme_write_gbps=rates.write_gbps,
                                   nvme_mixed_gbps=job.runtime.nvme_mixed_gbps or min(rates.mixed_read_gbps,
                                                                                       rates.mixed_write_gbps),
                                   nvme_state_read_gbps=None, nvme_state_write_gbps=None)


def measured_cost(job: JobConfig, model: PreTrainedModel, kind: str,
                  probe_batch: tuple[torch.Tensor, torch.Tensor]) -> CostModel:
    """The job's CostModel (job/inputs.py: the built model's spec on this machine, its host rates measured) with
    its compute and optimizer seconds (and the emulated device's link rates) measured on the device the run uses,
    its links as the run's (runtime/probe.py), by a throwaway optimizer of the run's kind at learning rate 0."""
    estimate = cost_model(job, spec_of(model), disk_rates(job, resolve_hardware(job.runtime, kind=kind,
                                                                                  measured=True), kind))

    # with the states on NVMe they never sit in host memory together: the probe steps the largest layer alone (its
    # masters read from the model's file for it, when they wait there for the state files: runtime/weights.py)
    # (with ranks, likewise: the run shards the states over the node's ranks, and rank 0 calibrates for all of them)
    # The layer with the most trainable parameters (LoRA: adapters; freeze tuning: a trained layer) and its share
    # of all that train; none (freeze tuning of modules outside the layers alone): all of them, they are small.
    trainable = estimate.layer_trainable_params
    largest = max(range(len(trainable)), key=lambda j: trainable[j])
    sharded = job.parallel.world_size > 1
    names = {f"layer{largest}"} if (job.runtime.optimizer_offload == "nvme" or sharded) and trainable[largest] else None
    share = trainable[largest] / (sum(trainable) + estimate.head_trainable_params
                                  + estimate.embedding_trainable_params) if names else 1.0
    stepped = list(find_parts(model).layers[largest].parameters()) if names else []

    def probe_optimizer(executor: Executor) -> ProbeOptimizer:
        for group in [*executor.layer_groups, executor.head_group]:
            if any(deferred(p) for p in group.params):  # as NvmeStates: a copy its update refreshes (lr 0: none)
                group.packed_by_update = True
        optimizer = build_optimizer(job, model, names=names)
        for group in optimizer.param_groups:  # the same work, but the weights stay as they are (no copy of them)
            group["lr"] = 0.0
        groups = executor_param_groups(optimizer, executor)
        return ProbeOptimizer(
            deferred_update=lambda grad_norm: group_update(job, optimizer, executor, groups, grad_norm, lr=0.0),
            step=lambda grad_norm: optimizer_step(job, optimizer, executor, grad_norm=grad_norm), share=share)

    with materialized(stepped):
        return calibrated_cost(model, estimate, build_device(job, kind, None), probe_batch,
                               compute_dtype=compute_dtype(job), optimizer=probe_optimizer,
                               overlap=job.optim.optimizer_mode == "overlap", scale_flops=kind == "cuda")


def replanner_for(job: JobConfig, planned: PlannedRun) -> Replanner:
    """`replan: true`: re-solve (warm-started, same budgets and MILP options, for one rank of the run's topology)
    when measured times drift."""
    options = job.plan

    def solve(cost: CostModel, start: Plan) -> Plan:
        # the running plan's staging depth and the cpu budget it left (the slots are allocated: D stays)
        staged = {k: v for k, v in start.budgets_bytes.items() if k == "cpu_act_bytes" and start.staging_depth}
        return solve_milp(cost, Budgets(**{**planned.budgets, **staged}), max_segment=options.max_segment,
                          time_limit_s=options.time_limit_s, mip_rel_gap=options.mip_rel_gap, solver=options.solver,
                          start_tiers=start.tiers, start_kept=start.kept_layers,
                          optimizer_mode=job.optim.optimizer_mode, topology=planned.topology,
                          staging_depth=start.staging_depth)

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



def say_host(job: JobConfig, planned: PlannedRun, step_s: float | None, ranks: Ranks | None) -> dict[str, int]:
    """Print admission's `host:` line (`lazytrain plan`'s), with ranks the node's share, what the run writes to
    nvme_dir per step and per day, and a note when nvme_dir is in RAM (its bytes are host memory: counted); return
    the admitted bytes summary.json keeps beside the measured peak."""
    cost, plan = planned.cost, planned.plan
    admitted = {"host_admitted_bytes": host_need(cost, plan.staging_depth)[0]}
    say(host_line(cost, plan.staging_depth, hardware_module.available_host_memory_bytes(),
                  "this machine's memory unknown"))
    if ranks is not None:
        node = node_host_bytes(cost, planned.topology)
        admitted["node_host_admitted_bytes"] = node["node"]
        say(f"host     per node {format_bytes(node['node'])} = shared {format_bytes(node['shared'])} + "
            f"{ranks.local_world_size} x {format_bytes(node['per_rank'])} per rank")
    writes = nvme_write_bytes(cost, plan.boundaries("nvme"), job.optim.gradient_accumulation_steps)
    line = wear_line(writes, step_s or planned.sim.step_s, job.runtime.nvme_tbw)
    if line is not None:
        say(line)
        directory = job.runtime.nvme_dir or tempfile.gettempdir()
        kind = ram_backed(directory)
        if kind is not None:
            held = nvme_need(cost, plan.budgets_bytes.get("nvme_act_bytes"))[0]
            admitted["host_admitted_bytes"] += held
            say(f"note     nvme_dir {directory} is on {kind}, which is RAM: the {format_bytes(held)} written there "
                "are host memory (counted in the admitted bytes); set nvme_dir to a directory on an SSD")
    return admitted
