"""Topology: data parallelism as the planner sees it -- ranks, nodes, and what reducing one layer group's
gradient costs each rank on the collective lane (plan/schedule.py, plan/sim.py).

`world_size` ranks (one GPU each) over `nodes` nodes, g = world_size / nodes local ranks per node. The ranks of
a node share one host copy of the weights and shard the host optimizer (docs/parallel.md), so each node needs
every group's gradient summed over all ranks once, and each local rank only its 1/g share of it:

    device  (nccl, the GPU presets): on the device, before the d2h -- a ring reduce-scatter within the node,
            each rank sending (g-1)/g x S bytes over the intra-node link, then (nodes > 1) a ring all-reduce of
            its S/g shard among the `nodes` ranks that hold the same shard, 2 (M-1)/M x S/g bytes over the
            inter-node link. The d2h then moves S/g: each rank only its shard over PCIe.
    host    (gloo, the emulated device): every rank moves its whole S to the host, then a flat ring all-reduce
            over all G ranks sends 2 (G-1)/G x S bytes per rank, over the inter-node link when the ring crosses
            nodes (its slowest hop), else the intra-node link.

Seconds = bytes / the HardwareSpec's achieved per-GPU rate, phases one after the other; latency and the
collective's own kernel time are not modelled. The host's CPU (optimizer, gradient accumulation) and a node's
NVMe are shared by its local ranks: each rank steps 1/g of the parameters at 1/g of the node's optimizer rate,
the same seconds as one process stepping all of them (so the CostModel's optimizer times stand), and each
rank's NVMe tier gets 1/g of the disk's rate (`rank_hardware`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazytrain.errors import LazyTrainError
from lazytrain.spec.hardware import HardwareSpec

if TYPE_CHECKING:
    from lazytrain.spec.cost import CostModel

COLLECTIVES = ("device", "host")


@dataclass(frozen=True)
class Topology:
    """`world_size` ranks on `nodes` nodes; `collective`: where the gradients are reduced (module docstring)."""

    world_size: int = 1
    nodes: int = 1
    collective: str = "device"

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise LazyTrainError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if not isinstance(self.nodes, int) or self.nodes < 1 or self.world_size % self.nodes:
            raise LazyTrainError(f"nodes must divide world_size ({self.world_size}) evenly, got {self.nodes!r}; "
                                 "every node runs the same number of ranks")
        if self.collective not in COLLECTIVES:
            raise LazyTrainError(f"collective {self.collective!r} is not one of {', '.join(COLLECTIVES)}")

    @property
    def local_ranks(self) -> int:
        return self.world_size // self.nodes

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def d2h_grad_bytes(self, num_bytes: int) -> int:
        """Bytes of one group's gradient this rank moves to the host: its shard when reduced on the device."""
        if self.collective == "device":
            return math.ceil(num_bytes / self.local_ranks)
        return num_bytes

    def link_bytes(self, num_bytes: int) -> tuple[float, float]:
        """(intra-node, inter-node) bytes this rank sends to reduce one group's gradient of `num_bytes`."""
        if not self.parallel:
            return 0.0, 0.0
        if self.collective == "host":
            ring = 2 * (self.world_size - 1) / self.world_size * num_bytes
            return (0.0, ring) if self.nodes > 1 else (ring, 0.0)
        g, m = self.local_ranks, self.nodes
        return (g - 1) / g * num_bytes, 2 * (m - 1) / m * num_bytes / g

    def reduce_s(self, num_bytes: int, hardware: HardwareSpec) -> float:
        """Seconds of the collective lane to reduce one group's gradient of `num_bytes` (module docstring)."""
        intra, inter = self.link_bytes(num_bytes)
        seconds = 0.0
        for sent, field, rate in ((intra, "intra_node_gbps", hardware.intra_node_gbps),
                                  (inter, "inter_node_gbps", hardware.inter_node_gbps)):
            if sent == 0:
                continue
            if rate is None:
                raise LazyTrainError(f"hardware {hardware.name!r} has no {field}: set it in a hardware file "
                                     f"(base: {hardware.name}) to plan {self.world_size} ranks on {self.nodes} node(s)")
            seconds += sent / (rate * 1e9)
        return seconds

    def rank_hardware(self, hardware: HardwareSpec) -> HardwareSpec:
        """What one rank gets of the node: its own GPU and PCIe link, 1/g of the node's NVMe rates."""
        if self.local_ranks == 1:
            return hardware
        g = self.local_ranks
        return hardware.with_overrides(nvme_read_gbps=hardware.nvme_read_gbps / g,
                                       nvme_write_gbps=hardware.nvme_write_gbps / g)


ONE_RANK = Topology()  # one process: no collective ops


# ---- host memory of a node -------------------------------------------------------------------------------
# host_breakdown keys a node holds once in all: the weights and the bf16 streamed copy shared by its ranks; the
# optimizer states, the kept gradients and their fp32 sums sharded over them by layer group (distributed/shared.py,
# distributed/grads.py)
SHARED_HOST = ("weights", "streamed_copy", "optimizer_states", "grads", "grad_sum")


def rank_reduce_bytes(cost: CostModel, topology: Topology) -> dict[str, int]:
    """What each rank holds to sum gradients into their owners (distributed/grads.py): two pooled landing buffers
    for the groups it does not own (g > 1), and an fp32 transient of the largest group to sum a bf16 gradient."""
    largest = max(cost.streamed_group_params)
    return {"grad_pool": 2 * largest * cost.dtype_bytes if topology.local_ranks > 1 else 0,
            "grad_reduce": 4 * largest if topology.parallel and cost.dtype_bytes != 4 else 0}


def node_host_bytes(cost: CostModel, topology: Topology, rank_activation_bytes: int = 0) -> dict[str, int]:
    """Host bytes of one node: what its ranks hold once in all (`SHARED_HOST`) and what each rank holds for itself
    (the optimizer's cast and working buffers, `rank_reduce_bytes`, and its offloaded
    activations and NVMe staging, `rank_activation_bytes`), as the runtime allocates them.
    {"shared", "per_rank", "node"}."""
    breakdown = cost.host_breakdown()
    shared = sum(v for k, v in breakdown.items() if k in SHARED_HOST)
    private = (sum(breakdown.values()) - shared + sum(rank_reduce_bytes(cost, topology).values())
               + rank_activation_bytes)
    return {"shared": shared, "per_rank": private, "node": shared + topology.local_ranks * private}


def rank_host_room(cost: CostModel, topology: Topology, host_mem_bytes: int) -> int:
    """Host bytes one rank may give its offloaded activations when the node's `host_mem_bytes` hold the shared
    part once and every rank's own part (the cpu activation budget M_C of each rank's plan)."""
    parts = node_host_bytes(cost, topology)
    return (host_mem_bytes - parts["shared"]) // topology.local_ranks - parts["per_rank"]
