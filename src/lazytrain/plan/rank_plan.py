"""Planning one rank of a data-parallel run (costmodel/topology.py): its budgets, and its predicted step beside the
node's memory -- what `lazytrain plan --world-size N --nodes M` prints and benchmarks/scaling.py tabulates.

Every rank runs the same plan on its share of the global batch (`per_device_train_batch_size` rows), so one
rank's simulated step, with each group's gradient summed over the ranks on its optimizer lane, is the step of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lazytrain.costmodel.topology import Topology, node_host_bytes, rank_host_room
from lazytrain.errors import LazyTrainError
from lazytrain.plan.schedule import program_for
from lazytrain.plan.sim import SimResult, op_seconds, simulate
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.plan.budgets import Budgets
    from lazytrain.plan.plan import Plan


def rank_budgets(budgets: Budgets, cost: CostModel, topology: Topology) -> Budgets:
    """One rank's budgets: unless cpu_act_bytes is set, its share of the node's host room (the node holds the
    shared part once and every rank's own part). A node that cannot hold even that is one line."""
    host_mem = budgets.host_mem_bytes if budgets.host_mem_bytes is not None else cost.hardware.host_mem_bytes
    if topology.local_ranks == 1 or budgets.cpu_act_bytes is not None or host_mem is None:
        return budgets
    room = rank_host_room(cost, topology, host_mem)
    if room < 0:
        parts = node_host_bytes(cost, topology)
        raise LazyTrainError(f"host memory per node: {topology.local_ranks} ranks need {format_bytes(parts['node'])} "
                             f"(shared {format_bytes(parts['shared'])} + {topology.local_ranks} x "
                             f"{format_bytes(parts['per_rank'])}) but the node has {format_bytes(host_mem)}; use "
                             "fewer ranks per node, --optimizer 8bit, or more host memory")
    return replace(budgets, cpu_act_bytes=room)


@dataclass(frozen=True)
class RanksPrediction:
    """One rank's simulated step with the sums over the ranks, beside the same rank alone (none)."""

    topology: Topology
    step: SimResult  # with the sums over the ranks on the optimizer lane
    alone: SimResult  # the same plan and cost, one process
    tokens_per_s: float  # over all ranks
    pcie_bytes: int  # this rank's h2d + d2h bytes per step
    intra_node_bytes: float  # what this rank moves per step to sum the gradients over the ranks, in the node
    inter_node_bytes: float  # ... and across nodes
    reduce_s: float  # seconds of those sums on the optimizer lane
    host: dict[str, int]  # node_host_bytes: shared, per_rank, node (with this rank's offloaded activations)

    @property
    def replicated_node_host_bytes(self) -> int:
        """A node whose ranks each hold the whole host state (no sharing): local ranks x one process's peak."""
        return self.topology.local_ranks * self.alone.peak_bytes["cpu"]


def predict_ranks(plan: Plan, cost: CostModel, topology: Topology, *, optimizer_mode: str) -> RanksPrediction:
    step = simulate(plan, cost, optimizer_mode=optimizer_mode, topology=topology)
    alone = simulate(plan, cost, optimizer_mode=optimizer_mode)
    intra = inter = reduce_s = 0.0
    for op in program_for(plan, cost, optimizer_mode=optimizer_mode, topology=topology).ops:
        if op.kind in ("reduce", "gather"):
            a, b = topology.link_bytes(op.num_bytes, op.kind)
            intra, inter = intra + a, inter + b
            reduce_s += op_seconds(op, cost, topology)
    host = node_host_bytes(cost, topology, step.peak_bytes["cpu"] - cost.static_host_bytes())
    return RanksPrediction(topology=topology, step=step, alone=alone,
                           tokens_per_s=topology.world_size * cost.workload.tokens / step.step_s,
                           pcie_bytes=step.link_bytes["h2d"] + step.link_bytes["d2h"], intra_node_bytes=intra,
                           inter_node_bytes=inter, reduce_s=reduce_s, host=host)
