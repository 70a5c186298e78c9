"""The one planner dispatcher of `lazytrain plan` and `lazytrain train`: hardware, budgets, then the MILP or a rule.

Both commands read the same JobConfig and call the same functions here, so the same job gets the same budgets
and the same planner (train's cost model is calibrated on its device; plan's is the hardware's estimate):

    hardware = resolve_hardware(job.runtime)              # auto: this machine (a CUDA GPU's preset, else emulated)
    cost = cost_model(job, spec, hardware, batch_size)
    budgets = default_budgets(job.plan, cost)             # None in the job = the rule below, written once
    admission, budgets = admitted(cost, budgets)          # refuse what no plan fits; M_C = the host room left
    plan = make_plan(job.plan, cost, budgets)             # MILP (planner auto|milp) or a rule

Data parallelism (`job.parallel`, costmodel/topology.py): every rank runs the same plan on its own rows, so the
planner plans one rank -- `rank_inputs` is the lines above for one rank of the job's topology (its hardware
share, its budgets) and `make_plan(..., topology=...)` puts the gradients' sums over the ranks in the MILP's
step. The batch is per rank (`per_device_train_batch_size`), device memory is per rank; `global_batch` names
the rows of one optimizer step over all ranks.

`Deadline` bounds the whole planning wall time (building the model, the cost model and the MILP included):
the solver gets what is left after the build, and a build that runs past the limit is stopped with one line.
An import in progress (torch, transformers' modeling code) is not interrupted; the limit acts when it ends.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from lazytrain.config import JobConfig, PlanConfig, RuntimeConfig
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec, resolve_dtype
from lazytrain.costmodel.model import BUILT_IN_SHAPES, ModelSpec, built_in_config, preset_names
from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.admission import Admission, admit
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost, solve_milp
from lazytrain.plan.plan import Plan
from lazytrain.plan.ranks import rank_budgets, topology_of
from lazytrain.plan.rules import RULES, evaluate_tiers, make_rule_plan

if TYPE_CHECKING:
    from collections.abc import Callable

LINK_KEYS = ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps")
EMULATED_GPU_BOUNDARIES = 5  # emulated device, default cap: static bytes + this many boundary activations
EMULATED_OFFLOAD_BOUNDARIES = 2  # emulated device, default cpu and nvme budgets, in boundary activations
MAX_BATCH_LIMIT = 1 << 16  # the largest-batch search stops here


# ---- the machine, the model, the cost ---------------------------------------------------------------------
def cuda_visible() -> bool:
    """True when an NVIDIA driver is loaded; only then is torch imported to ask for a usable GPU."""
    if not Path("/proc/driver/nvidia/gpus").is_dir():
        return False
    import torch

    return torch.cuda.is_available()


def cuda_hardware() -> HardwareSpec:
    """The preset closest to this CUDA GPU (by name), with the GPU's own memory."""
    import torch

    name = torch.cuda.get_device_name().lower()
    preset = next((p for p in ("h800", "h200", "h100", "3090") if p in name), "h100")
    preset = "rtx3090" if preset == "3090" else preset
    return HardwareSpec.load(preset, gpu_mem_bytes=torch.cuda.get_device_properties(0).total_memory)


def is_emulated(hardware: HardwareSpec) -> bool:
    return hardware.name.startswith("emulated")


def resolve_hardware(runtime: RuntimeConfig) -> HardwareSpec:
    """`hardware: auto` = this machine: the CUDA GPU's preset, else the emulated device with the job's link
    rates; a preset or a file otherwise. Link rates set for a machine that is not emulated are refused."""
    default = RuntimeConfig()
    links = {k: getattr(runtime, k) for k in LINK_KEYS}
    if runtime.hardware == "auto":
        on_cuda = runtime.device != "cpu" and cuda_visible()
        if runtime.device == "cuda" and not on_cuda:
            raise LazyTrainError("device cuda with hardware auto, but this machine has no CUDA GPU; name the "
                                 "hardware to plan for (e.g. hardware=h800) or use device auto")
        hardware = cuda_hardware() if on_cuda else HardwareSpec.load("emulated")
    else:
        hardware = HardwareSpec.load(runtime.hardware)
    if is_emulated(hardware):
        return hardware.with_overrides(**links)
    changed = [k for k, v in links.items() if v != getattr(default, k)]
    if changed:
        raise LazyTrainError(f"{changed[0]} = {links[changed[0]]:g} sets the emulated device's link, but the hardware "
                             f"is {hardware.name}; set it in a hardware YAML file (base: {hardware.name}) instead")
    return hardware


def model_spec(model: str) -> ModelSpec:
    """A planner preset (no torch import), a built-in shape of `lazytrain train` (`small`), or a user's model
    (directory, config.json, cached hub id) validated and counted as `transformers` builds it (meta device)."""
    if model in BUILT_IN_SHAPES:
        return ModelSpec.from_config(built_in_config(model), name=f"lazytrain-{model}")
    if model in preset_names():
        return ModelSpec.load(model)
    from lazytrain.runtime.weights import built_spec, resolve_model  # imports torch

    return built_spec(resolve_model(model).config)


def cost_model(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, batch_size: int) -> CostModel:
    """The hardware's estimate of every time and byte for one step of `batch_size` x cutoff_len, with the host
    layout the executor allocates (the one admission rule of both commands)."""
    dtype = resolve_dtype(job.runtime.dtype, emulated=hardware.name.startswith("emulated"))
    workload = Workload(batch_size=batch_size, seq_len=job.data.cutoff_len, dtype=dtype, masked=job.data.masked)
    return CostModel(spec, hardware, workload, optimizer=job.optim.optimizer, **host_layout(job))


def host_layout(job: JobConfig) -> dict[str, object]:
    """The CostModel arguments of the executor's host layout for this job (master weights, accumulation)."""
    return {"master_weights": job.runtime.master_weights,
            "grad_accumulation": job.optim.gradient_accumulation_steps}


def rank_inputs(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, batch_size: int
                ) -> tuple[Topology, CostModel, Admission, Budgets]:
    """One rank of the job's run at `batch_size` rows per rank: its topology, its cost model (its share of the
    node's NVMe rate), admission and budgets (its share of the node's host room) -- for `lazytrain plan`, the
    largest-batch search and `per_device_train_batch_size: auto` alike. One rank: the one-process inputs."""
    topology = topology_of(job)
    cost = cost_model(job, spec, topology.rank_hardware(hardware), batch_size)
    admission, budgets = admitted(cost, rank_budgets(default_budgets(job.plan, cost), cost, topology))
    return topology, cost, admission, budgets


def global_batch(job: JobConfig, batch_size: int) -> str:
    """The rows of one optimizer step over all ranks, for reports: `24 (12 per rank x 2 ranks)`."""
    ga, world = job.optim.gradient_accumulation_steps, job.parallel.world_size
    if world == 1 and ga == 1:
        return str(batch_size)
    parts = [f"{batch_size} per rank" if world > 1 else str(batch_size)]
    parts += [f"{world} ranks"] if world > 1 else []
    parts += [f"{ga} accumulated"] if ga > 1 else []
    return f"{batch_size * world * ga} ({' x '.join(parts)})"


# ---- budgets ----------------------------------------------------------------------------------------------
def default_budgets(options: PlanConfig, cost: CostModel) -> Budgets:
    """The job's budgets with None filled by one rule for both commands.

    On the emulated device (the CPU-only job) the device cap is the static device bytes plus 5 boundary
    activations and cpu and nvme get 2 each: too little to keep every boundary anywhere, so the plan mixes
    tiers. On a real device: its memory, the host room left (admission fills it), and no NVMe tier.
    """
    act = max(cost.boundary_bytes)
    cap, cpu, nvme = options.gpu_mem_cap_bytes, options.cpu_act_bytes, options.nvme_act_bytes
    if is_emulated(cost.hardware):
        cap = cap if cap is not None else cost.static_device_bytes() + EMULATED_GPU_BOUNDARIES * act
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
    """
    if options.planner in RULES:
        plan = make_rule_plan(options.planner, cost.spec, interval=options.interval, workload=cost.workload)
        evaluation = evaluate_tiers(plan.tiers, instance_from_cost(cost, budgets, optimizer_mode=optimizer_mode,
                                                                   topology=topology))
        if strict_rules and not evaluation.feasible:
            raise LazyTrainError(f"the {options.planner} rule does not fit: {evaluation.violations[0]}; lower "
                                 "per_device_train_batch_size or raise the budget")
        report = replace(plan.report, objective=evaluation.objective)
        budgets_bytes = {k: int(v) for k, v in budgets.to_dict().items() if v is not None}
        return replace(plan, report=report, budgets_bytes=budgets_bytes)
    time_limit_s = options.time_limit_s if deadline is None else deadline.left_s()
    return solve_milp(cost, budgets, max_segment=options.max_segment, time_limit_s=time_limit_s,
                      mip_rel_gap=0.999 if feasibility_only else options.mip_rel_gap, solver=options.solver,
                      deadline_s=None if deadline is None else deadline.end_s, optimizer_mode=optimizer_mode,
                      topology=topology)


def describe(plan: Plan) -> str:
    """How a plan was made, for a report line: `MILP (highs, optimal, gap 0.00%, 0.12 s)` or the rule."""
    r = plan.report
    if r.planner == "milp":
        gap = f", gap {r.gap:.2%}" if r.gap is not None and math.isfinite(r.gap) else ""
        return f"MILP ({r.solver}, {r.status}{gap}, {r.seconds:.2f} s)"
    if r.planner == "megatrain":
        return f"MegaTrain rule (every {r.options.get('interval', 4)}th boundary)"
    return f"{r.planner} rule"


def largest_feasible_batch(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, planner: str, *,
                           deadline: Deadline | None = None, limit: int = MAX_BATCH_LIMIT) -> tuple[int, str]:
    """Largest batch per rank that passes admission and for which `planner` finds a plan for one rank of the
    job's run, and why the next one does not (0 and the reason when not even batch 1 fits). Doubling, then
    bisection: feasibility only shrinks as the batch grows."""
    if is_emulated(hardware) and job.plan.gpu_mem_cap_bytes is None:
        raise LazyTrainError("the largest batch on the emulated device needs gpu_mem_cap_bytes (e.g. --gpu-mem-cap "
                             "64MiB): its default cap grows with the batch")
    options = replace(job.plan, planner=planner)
    reasons: dict[int, str] = {}

    def feasible(batch: int) -> bool:
        try:
            topology, cost, _, budgets = rank_inputs(replace(job, plan=options), spec, hardware, batch)
            make_plan(options, cost, budgets, feasibility_only=True, deadline=deadline,
                      optimizer_mode=job.optim.optimizer_mode, topology=topology)
            return True
        except LazyTrainError as err:
            if deadline is not None and deadline.expired():
                raise
            reasons[batch] = str(err)
            return False

    if not feasible(1):
        return 0, reasons[1]
    lo, hi = 1, 2
    while hi <= limit and feasible(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo, f"the search stops at {limit}"
    while hi - lo > 1:  # feasible(lo), not feasible(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    return lo, reasons[hi]


def resolve_batch(job: JobConfig, *, deadline: Deadline | None = None) -> tuple[JobConfig, str | None]:
    """`per_device_train_batch_size: auto` -> the job at the largest batch its planner admits under the caps,
    with a note for the report; any other job unchanged (None). The hardware's cost estimate decides: whether a
    plan fits is a question of bytes, not of measured seconds."""
    if job.data.per_device_train_batch_size != "auto":
        return job, None
    spec = model_spec(job.model.model)
    batch, why = largest_feasible_batch(job, spec, resolve_hardware(job.runtime), job.plan.planner,
                                        deadline=deadline)
    if batch == 0:
        raise LazyTrainError(f"per_device_train_batch_size auto: no batch fits, not even 1: {why}")
    per_rank = " per rank" if job.parallel.world_size > 1 else ""
    total = global_batch(job, batch)
    note = (f"per_device_train_batch_size auto: {batch}{per_rank}, the largest the planner admits ("
            + (f"global batch {total}; " if total != str(batch) else "") + f"next: {why})")
    return replace(job, data=replace(job.data, per_device_train_batch_size=batch)), note


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
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_code.co_name in UNSAFE_FRAMES:
                return
            frame = frame.f_back
        raise self.error("while building the model, the cost model or the MILP")

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
