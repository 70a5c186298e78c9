"""Topology: data parallelism as the planner sees it -- ranks, nodes, and what summing one layer group's gradient
over the ranks costs each rank (plan/schedule.py, plan/sim.py), as the runtime does it (distributed/grads.py).

`world_size` ranks (one GPU each) over `nodes` nodes, g = world_size / nodes local ranks per node. The ranks of
a node share one host copy of the weights and shard the host optimizer by layer group (group i belongs to local
rank i % g of every node; docs/parallel.md). Every micro-batch, as a group's gradient of S bytes lands on the
host (after its d2h), the rank's optimizer lane -- the executor's one host lane, in program order, so the same
order on every rank -- sums it into the group's owners before adding it to the kept gradient:

    reduce  a reduce within the node to the owner (a ring reduce: each rank sends (g-1)/g x S over the intra-node
            link), then (nodes > 1) a ring all-reduce among the `nodes` owners of the group, 2 (M-1)/M x S over the
            inter-node link. S counts fp32 bytes: a bf16 gradient is summed in fp32.
    gather  the embedding's gradient (a scatter of the boundary-0 gradient rows, on the host): every rank's rows of
            S bytes to the owner ((g-1) x S), then an all-gather among the nodes' owners ((M-1) x g x S).

Seconds = bytes / the HardwareSpec's achieved rate, phases one after the other. A collective couples the
ranks' lanes: the reduce of the next group waits for every rank, including the owner still adding the last one
in, so each rank's lane is modelled as running every group's reduce and every group's land (the step of the
slowest rank). Where the ranks' gradients are summed on the host, every rank moves its whole gradient over
PCIe; the nccl reduce-scatter on the device before the d2h (1/g of it) is not built (docs/parallel.md).
`lazytrain train` measures both rates with the runtime's own collectives when it starts
(distributed/grads.py `time_reduce`, runtime/calibrate.py `calibrate_links`); the presets' figures stand for
`lazytrain plan`.

The host's CPU (optimizer, gradient accumulation) and a node's NVMe are shared by its local ranks: each rank
steps 1/g of the parameters at 1/g of the node's optimizer rate, the same seconds as one process stepping all of
them (so the CostModel's optimizer times stand), and each rank's NVMe tier gets 1/g of the disk's rate
(`rank_hardware`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel

REDUCE_DTYPE_BYTES = 4  # the ranks sum gradients in fp32 (distributed/grads.py)


@dataclass(frozen=True)
class Topology:
    """`world_size` ranks on `nodes` nodes (module docstring)."""

    world_size: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise LazyTrainError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if not isinstance(self.nodes, int) or self.nodes < 1 or self.world_size % self.nodes:
            raise LazyTrainError(f"nodes must divide world_size ({self.world_size}) evenly, got {self.nodes!r}; "
                                 "every node runs the same number of ranks")

    @property
    def local_ranks(self) -> int:
        return self.world_size // self.nodes

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def link_bytes(self, num_bytes: float, kind: str = "reduce") -> tuple[float, float]:
        """(intra-node, inter-node) bytes a rank's `kind` ("reduce" or "gather") of `num_bytes` moves (module
        docstring)."""
        g, m = self.local_ranks, self.nodes
        if kind == "gather":
            return (g - 1) * num_bytes, (m - 1) * g * num_bytes
        return (g - 1) / g * num_bytes, 2 * (m - 1) / m * num_bytes

    def collective_s(self, num_bytes: float, hardware: HardwareSpec, kind: str = "reduce") -> float:
        """Seconds of one group's `kind` ("reduce" or "gather") of `num_bytes` on the optimizer lane."""
        intra, inter = self.link_bytes(num_bytes, kind)
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
        rates = {f: getattr(hardware, f) for f in ("nvme_read_gbps", "nvme_write_gbps", "nvme_state_read_gbps",
                                                    "nvme_state_write_gbps", "nvme_mixed_gbps")}
        return hardware.with_overrides(**{f: rate / g for f, rate in rates.items() if rate is not None})


ONE_RANK = Topology()  # one process: no sums over ranks


# ---- host memory of a node -------------------------------------------------------------------------------
# host_breakdown keys a node holds once in all: the weights and the bf16 streamed copy shared by its ranks; the
# optimizer states, the kept gradients and their fp32 sums sharded over them by layer group (distributed/shared.py,
# distributed/grads.py)
SHARED_HOST = ("weights", "streamed_copy", "optimizer_states", "grads", "grad_sum")


def rank_reduce_bytes(cost: CostModel, topology: Topology) -> dict[str, int]:
    """What each rank holds to sum gradients into their owners (distributed/grads.py): two pooled landing buffers
    for the groups it does not own (g > 1), and an fp32 transient of the largest group to sum a bf16 gradient."""
    largest = max(cost.spec.streamed_group_params)
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
