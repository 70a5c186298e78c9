"""The batch of a job: the largest one its planner admits (`per_device_train_batch_size: auto`, `lazytrain plan
--max-batch`), and the global batch of one optimizer step over all ranks for the reports."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lazytrain.errors import LazyTrainError
from lazytrain.job.inputs import model_spec, rank_inputs, resolve_hardware
from lazytrain.plan.planner import Deadline, make_plan

if TYPE_CHECKING:
    from lazytrain.config import JobConfig
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.model import ModelSpec

MAX_BATCH_LIMIT = 1 << 16  # the largest-batch search stops here


def global_batch(job: JobConfig, batch_size: int) -> str:
    """The rows of one optimizer step over all ranks, for reports: `24 (12 per rank x 2 ranks)`."""
    ga, world = job.optim.gradient_accumulation_steps, job.parallel.world_size
    if world == 1 and ga == 1:
        return str(batch_size)
    parts = [f"{batch_size} per rank" if world > 1 else str(batch_size)]
    parts += [f"{world} ranks"] if world > 1 else []
    parts += [f"{ga} accumulated"] if ga > 1 else []
    return f"{batch_size * world * ga} ({' x '.join(parts)})"


def largest_feasible_batch(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, planner: str, *,
                           deadline: Deadline | None = None, limit: int = MAX_BATCH_LIMIT) -> tuple[int, str]:
    """Largest batch per rank that passes admission and for which `planner` finds a plan for one rank of the
    job's run, and why the next one does not (0 and the reason when not even batch 1 fits). Doubling, then
    bisection: feasibility only shrinks as the batch grows."""
    if hardware.emulated and job.plan.gpu_mem_cap_bytes is None:
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
