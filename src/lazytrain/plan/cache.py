"""Remembered plans: the same command on the same machine gives the same plan unless the measured times changed.

The calibration is timed on a machine shared with other work, and its figures move by tens of percent run to
run (docs/reliability.md), enough to tip the MILP between near-equal plans. So the MILP's plan is remembered per
job and machine (`remembered_plan_path`: model shapes, workload, budgets, links, optimizer, planner options,
CPU) in the cache, and the next run of the same command keeps it unless its own MILP plan is predicted more
than `KEEP_GAIN` faster than the remembered one on this run's calibration.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import TYPE_CHECKING

from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.errors import LazyTrainError
from lazytrain.paths import cache_dir
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost
from lazytrain.plan.plan import Plan
from lazytrain.plan.rules import evaluate_tiers
from lazytrain.plan.sim import simulate

if TYPE_CHECKING:
    from pathlib import Path

    from lazytrain.costmodel.cost import CostModel

KEEP_GAIN = 0.05  # a new MILP plan replaces the remembered one only when predicted this much faster


def remembered_plan_path(cost: CostModel, budgets: dict[str, int], *, device: str, optimizer: list[str],
                         plan_options: dict[str, object], torch_version: str) -> Path:
    """Where the plan of this job on this machine is remembered: `<cache>/plans/<hash>.json`, the hash over what
    decides the plan except the measured seconds (those are what `keep_or_replace` judges): `device` the kind
    (cpu, cuda), `optimizer` its kind and mode, `plan_options` the job's plan section (its time limit left out)."""
    hardware = cost.hardware
    key = dict(
        spec=cost.spec.fingerprint(), workload=[cost.workload.batch_size, cost.workload.seq_len, cost.workload.dtype],
        masked=cost.workload.masked, budgets=budgets, device=device, hardware=hardware.name,
        links=[hardware.h2d_gbps, hardware.d2h_gbps, hardware.nvme_read_gbps, hardware.nvme_write_gbps,
               hardware.nvme_state_read_gbps, hardware.nvme_state_write_gbps, hardware.nvme_mixed_gbps],
        optimizer=optimizer, constant_bytes=cost.constant_device_bytes, offload=cost.optimizer_offload,
        trainable=cost.trainable,  # a LoRA job's plan is not a full one's (a frozen base's backward is shorter)
        plan={k: v for k, v in plan_options.items() if k != "time_limit_s"},
        machine=[_cpu_model(), os.cpu_count(), torch_version],
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
    if incumbent is not None and (incumbent.tiers, incumbent.staging_depth) != (plan.tiers, plan.staging_depth):
        # the optimizer's state on NVMe: judged at this plan's staging depth and the cpu budget its slots left (an
        # incumbent of another depth does not fit: this run sized its slots for the new plan)
        staged = {k: v for k, v in plan.budgets_bytes.items() if k == "cpu_act_bytes" and plan.staging_depth}
        inst = instance_from_cost(cost, Budgets(**{**budgets, **staged}), optimizer_mode=optimizer_mode,
                                  topology=topology, staging_depth=plan.staging_depth)
        fits = incumbent.staging_depth == plan.staging_depth and evaluate_tiers(incumbent.tiers, inst).feasible
        old_s = simulate(incumbent, cost, optimizer_mode=optimizer_mode, topology=topology).step_s
        new_s = simulate(plan, cost, optimizer_mode=optimizer_mode, topology=topology).step_s
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
    return plan if plan.report.planner == "milp" and plan.optimizer_offload == cost.optimizer_offload else None


def _cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
