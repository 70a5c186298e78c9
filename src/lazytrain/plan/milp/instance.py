"""The planning instance: everything the MILP reads, as plain numbers, testable without a model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp.model import INF
from lazytrain.plan.schedule import (
    OPTIMIZER_MODES,
    STATE_OPS,
    Op,
    Shapes,
    StepProgram,
    build_program,
    state_schedule,
)
from lazytrain.plan.sim import RATES, compute_seconds, op_seconds, update_seconds

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.plan.budgets import Budgets




@dataclass(frozen=True)
class PlanningInstance:
    """Everything the MILP reads, as plain numbers (seconds, bytes, bytes/s). Build one with `instance_from_cost`
    or by hand for synthetic tests. Window w = L is the loss head."""

    forward_s: tuple[float, ...]  # rho[j], j = 0..L-1
    backward_s: tuple[float, ...]  # beta[j]: autograd re-forward + backward of layer j
    boundary_bytes: tuple[float, ...]  # A[i], i = 0..L
    param_bytes: tuple[float, ...]  # p[j]: layer weights streamed h2d per use
    gpu_act_bytes: float  # M_G: device bytes left for boundary activations after static memory
    head_s: float = 0.0  # rho[L]: loss head forward+backward
    head_param_bytes: float = 0.0  # p[L]
    # g[j]: the gradient bytes group j sends back (its trainable parameters'; frozen: 0), g[L] the head's; () = p
    grad_bytes: tuple[float, ...] = ()
    embedding_grad: bool = True  # the boundary-0 gradient goes to the host for the embedding's gradient
    cpu_act_bytes: float = INF  # M_C
    nvme_act_bytes: float = 0.0  # M_N; 0 disables the nvme tier
    h2d_bytes_per_s: float = INF  # B_H
    d2h_bytes_per_s: float = INF  # B_D
    nvme_read_bytes_per_s: float = INF  # B_R
    nvme_write_bytes_per_s: float = INF  # B_W
    graph_bytes: tuple[float, ...] = ()  # G[j]: a kept layer's graph; () = no layer can be kept
    fwd_unallocated_bytes: float = 0.0  # U_F: static bytes the forward does not hold yet (gradient slots, grads)
    fwd_transient_bytes: float = 0.0  # T_F: extra device bytes in the forward beyond the boundaries
    bwd_transient_bytes: float = 0.0  # T_B: extra device bytes in the backward beyond boundaries and reloads
    # w[j]: each layer's working set and the head's (bytes, () = none); W: the one M_G was already net of (the
    # largest), which every window's row gives back before it counts its own
    working_bytes: tuple[float, ...] = ()
    head_working_bytes: float = 0.0
    static_working_bytes: float = 0.0
    lambda_z: float = 1e-5  # s per materialized boundary (tie-breaker; above the solvers' 1e-6 tolerances)
    lambda_c: float = 1e-5  # s per cpu boundary (prefer gpu when both are free)
    lambda_n: float = 1e-4  # s per nvme boundary
    static_device_bytes: float = 0.0  # for messages only: what the cap lost to static memory
    # h: the loss head's own weight slot (and as many for its gradient slot) when it is larger than a layer; not in
    # the static bytes M_G is net of: the rows charge each where it is live (forward_bytes, head_bytes,
    # segment_bytes, head_grad_bytes)
    head_slot_bytes: float = 0.0
    gpu_mem_cap_bytes: float = 0.0  # for messages only
    optimizer_mode: str = "overlap"  # the step program's: "serial" ends with the whole optimizer step
    land_s: tuple[float, ...] = ()  # optimizer-lane job of group j = 0..L-1 and of the head (L): accumulation
    # into .grad (and in overlap mode the group's optimizer step); () = none
    embedding_s: float = 0.0  # the embedding backward on the host (and its group's optimizer step in overlap)
    optimizer_step_s: float = 0.0  # mode "serial": the whole optimizer step after the backward
    # mode "overlap": the previous step's update of each group at the step's start, at index target + 1
    # (embedding, layers 0..L-1, head; sim.update_seconds), run in forward order (schedule.update_order); also in
    # mode "serial" with the states on NVMe, where they follow the backward group by group
    update_s: tuple[float, ...] = ()
    tied_head: bool = False  # the head's group owns the embedding: its update goes first
    # data parallelism (costmodel/topology.py): every group's gradient is summed over the ranks on the optimizer lane
    # before its land, reduce_s[j] seconds for groups j = 0..L-1 and the head (L); boundary 0's gradient rows are
    # gathered to the embedding's owners (gather_s) before the embedding backward. One rank: none of this.
    topology: Topology = ONE_RANK
    reduce_s: tuple[float, ...] = ()
    gather_s: float = 0.0
    # optimizer_offload nvme: D staging slots and each group's state file bytes at index target + 1
    # (embedding, layers 0..L-1, head), read and written by the step program's state ops; 0 / () = the states in RAM
    staging_depth: int = 0
    state_bytes: tuple[float, ...] = ()
    state_read_bytes_per_s: float | None = None  # B_SR on the nvme_read link; None = B_R
    state_write_bytes_per_s: float | None = None  # B_SW on the nvme_write link; None = B_W

    def __post_init__(self) -> None:
        L = len(self.forward_s)
        if self.staging_depth and (not 1 <= self.staging_depth <= L or len(self.state_bytes) != L + 2):
            raise LazyTrainError(f"planning instance: staging_depth {self.staging_depth} needs 1..{L} and state_bytes "
                                 f"for the embedding, {L} layers and the head ({L + 2} entries), got "
                                 f"{len(self.state_bytes)}")
        if self.topology.parallel and len(self.reduce_s) != L + 1:
            raise LazyTrainError(f"planning instance: {self.topology.world_size} ranks need reduce_s for the {L} "
                                 f"layers and the head ({L + 1} entries), got {len(self.reduce_s)}")
        for name in ("forward_s", "backward_s", "boundary_bytes", "param_bytes", "working_bytes", "graph_bytes",
                     "state_bytes"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if not self.working_bytes:
            object.__setattr__(self, "working_bytes", (0.0,) * L)
        if self.graph_bytes and len(self.graph_bytes) != L:
            raise LazyTrainError(f"planning instance: graph_bytes needs {L} entries (or none), got "
                                 f"{len(self.graph_bytes)}")
        if L < 1 or len(self.backward_s) != L or len(self.param_bytes) != L or len(self.boundary_bytes) != L + 1 \
                or len(self.working_bytes) != L:
            raise LazyTrainError(
                f"planning instance: need L >= 1 layers with L forward/backward/param/working entries and L+1 "
                f"boundaries, got {L}, {len(self.backward_s)}, {len(self.param_bytes)}, {len(self.working_bytes)}, "
                f"{len(self.boundary_bytes)}"
            )
        values = [*self.forward_s, *self.backward_s, *self.boundary_bytes, *self.param_bytes, *self.working_bytes,
                  self.head_s, self.head_param_bytes, self.head_working_bytes, self.static_working_bytes,
                  self.cpu_act_bytes, self.nvme_act_bytes, self.head_slot_bytes]
        if any(not v >= 0 for v in values):
            raise LazyTrainError("planning instance: times, bytes and budgets must be >= 0")
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s",
                     "state_read_bytes_per_s", "state_write_bytes_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise LazyTrainError(f"planning instance: {name} must be > 0, got {getattr(self, name)}")

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    @property
    def state_rates(self) -> tuple[float, float]:
        """(B_SR, B_SW): the state files' read and write rates, bytes/s."""
        return (self.nvme_read_bytes_per_s if self.state_read_bytes_per_s is None else self.state_read_bytes_per_s,
                self.nvme_write_bytes_per_s if self.state_write_bytes_per_s is None else self.state_write_bytes_per_s)

    def land_seconds(self) -> tuple[float, ...]:
        return self.land_s or (0.0,) * (self.num_layers + 1)

    def op_seconds(self, op: Op) -> float:
        """Seconds of one step-program op on this instance (what `sim.op_seconds` is on a CostModel)."""
        if op.lane == "compute":
            return compute_seconds(op.kind, op.target, self.forward_s, self.backward_s, self.head_s)
        if op.lane in RATES:
            rate = self.state_rates[op.kind == "state_write"] if op.kind in STATE_OPS else \
                getattr(self, RATES[op.lane])
            return 0.0 if op.num_bytes == 0 or not math.isfinite(rate) else op.num_bytes / rate
        return {"land": lambda: self.land_seconds()[op.target], "embedding": lambda: self.embedding_s,
                "reduce": lambda: self.reduce_s[op.target], "gather": lambda: self.gather_s,
                "step": lambda: self.optimizer_step_s, "update": lambda: self.update_s[op.target + 1]}[op.kind]()

    def program(self, tiers: Sequence[str], kept_layers: int = 0) -> StepProgram:
        """The step program of `tiers` and `kept_layers` with this instance's bytes (no device memory: for
        timing)."""
        L = self.num_layers
        shapes = Shapes(boundary_bytes=tuple(round(a) for a in self.boundary_bytes),
                        param_bytes=tuple(round(p) for p in self.param_bytes),
                        head_param_bytes=round(self.head_param_bytes), working_bytes=(0,) * L, head_working_bytes=0,
                        tied_head=self.tied_head, state_bytes=tuple(round(b) for b in self.state_bytes))
        return build_program(tuple(tiers), shapes, optimizer_mode=self.optimizer_mode, updates=bool(self.update_s),
                             topology=self.topology, kept_layers=kept_layers, staging_depth=self.staging_depth)

    def serial_updates_s(self) -> float:
        """Serial mode with the states on NVMe: the seconds of the program's updates after the backward (update k,
        its write, the read of group k + D after that write, FIFO per lane; the first D groups prefetched), from
        lanes idle at the backward's end: the step's constant tail."""
        state = state_schedule(self.num_layers, self.tied_head, self.staging_depth)
        D, targets = state.depth, state.targets
        rate_r, rate_w = self.state_rates
        read_s = [0.0 if not math.isfinite(rate_r) else self.state_bytes[t + 1] / rate_r for t in targets]
        write_s = [0.0 if not math.isfinite(rate_w) else self.state_bytes[t + 1] / rate_w for t in targets]
        update = write = read = 0.0
        ready: dict[int, float] = {}
        for k, t in enumerate(targets):
            update = max(update, ready.get(k, 0.0)) + self.update_s[t + 1]
            write = max(write, update) + write_s[k]
            if k + D < len(targets):
                read = ready[k + D] = max(read, write) + read_s[k + D]
        return max(update, write)

    def recompute_s(self, s: int, e: int) -> float:
        """R[s,e] = sum_{j=s..e-2} rho[j]: the block's last layer output is e, already materialized."""
        return sum(self.forward_s[s:e - 1])

    # ---- device bytes of each window beyond the static ones and the gpu boundaries below it (rows' terms) ----
    # The static bytes hold the largest working set W and two boundary-gradient buffers G = 2 max A; these terms
    # count each window's own working set instead, so a row reads  sum A g (below) + term <= M_G + W.
    def forward_bytes(self, j: int) -> float:
        """F_j: its input j (whatever its tier: freed after the window), its output j+1, layer j's working set;
        F_{L-1} also the head's own weight slot (h), allocated as its h2d is issued there."""
        A = self.boundary_bytes
        return A[j] + A[j + 1] + self.working_bytes[j] + (self.head_slot_bytes if j == self.num_layers - 1 else 0.0)

    def head_bytes(self) -> float:
        """H: boundary L, its gradient (one of the two buffers G), the head's working set, its own weight and
        gradient slots (2 h)."""
        A = self.boundary_bytes
        return 2 * A[-1] - 2 * max(A) + self.head_working_bytes + 2 * self.head_slot_bytes

    def head_grad_bytes(self, s: int, e: int) -> float:
        """The head's own gradient slot (h) in the first window of segment (s, e) (R_s, or B_s when e = s + 1):
        live there when it is the backward's first (e = L), whose fence sees the slot's d2h."""
        return self.head_slot_bytes if e == self.num_layers else 0.0

    def segment_bytes(self, s: int, e: int) -> float:
        """The backward of segment (s, e): R_j and B_j hold boundaries s..j+1 and layer j's working set (the
        gradients and boundary e of R_j are within G), the first window of the last segment the head's gradient
        slot; the largest over j = s..e-1."""
        A, w = self.boundary_bytes, self.working_bytes
        return max(sum(A[s:j + 2]) + w[j] + (self.head_grad_bytes(s, e) if j == s else 0.0) for j in range(s, e))

    def min_gpu_act_bytes(self) -> float:
        """A lower bound on the M_G any plan needs: the last layer's backward holds boundaries 0, L-1 and L (and a
        reload buffer when L > 2); the head holds boundaries 0 and L; the last forward 0, L-1 and L."""
        A, L = self.boundary_bytes, self.num_layers
        last = self.segment_bytes(L - 1, L) + (A[0] if L > 1 else 0.0) + (max(A) if L > 2 else 0.0)
        head = A[0] + self.head_bytes()
        fwd = (A[0] if L > 1 else 0.0) + self.forward_bytes(L - 1) + self.fwd_transient_bytes \
            - self.fwd_unallocated_bytes
        return max(max(last, head) + self.bwd_transient_bytes, fwd) - self.static_working_bytes


def instance_from_cost(cost: CostModel, budgets: Budgets | None = None, *, optimizer_mode: str = "overlap",
                       topology: Topology = ONE_RANK, staging_depth: int = 0, **options: Any) -> PlanningInstance:
    """A PlanningInstance from a CostModel (costmodel/cost.py) and Budgets (plan/budgets.py).

    M_G = (budgets.gpu_mem_cap_bytes or the device's memory) - cost.static_device_bytes(); M_C = cpu activation
    budget (None = unlimited); M_N = nvme activation budget (None = unlimited, 0 = no nvme tier).
    U_F = the layer gradient slots and boundary-gradient buffers, which the schedule allocates only at the loss
    head; h = cost.head_slot_bytes (charged where live, not in the static bytes).
    The optimizer-lane seconds are the simulator's for `optimizer_mode`, with (`topology` of more than one rank)
    each group's sum over the ranks as the simulator times the program's bytes. A cost model with its optimizer
    state on NVMe (optimizer_offload nvme) needs `staging_depth` D >= 1 (the planner tries each that fits the host
    memory: planner.staging_choices). `options` override PlanningInstance fields (e.g. lambda_z).
    """
    if optimizer_mode not in OPTIMIZER_MODES:
        raise LazyTrainError(f"optimizer_mode {optimizer_mode!r} is not one of {', '.join(OPTIMIZER_MODES)}")
    offload = getattr(cost, "optimizer_offload", "host") == "nvme"
    if offload != (staging_depth > 0):
        raise LazyTrainError(f"staging_depth {staging_depth} with optimizer_offload "
                             f"{getattr(cost, 'optimizer_offload', 'host')}: nvme needs a depth >= 1, host none")
    L = int(cost.num_layers)
    gpu_cap = getattr(budgets, "gpu_mem_cap_bytes", None)
    if gpu_cap is None:
        gpu_cap = cost.hardware.gpu_mem_bytes
    static = float(cost.static_device_bytes())
    cpu_act = getattr(budgets, "cpu_act_bytes", None)
    nvme_act = getattr(budgets, "nvme_act_bytes", 0) if budgets is not None else 0
    fields: dict[str, Any] = dict(
        forward_s=tuple(cost.forward_s[:L]),
        backward_s=tuple(cost.backward_s[:L]),
        boundary_bytes=tuple(cost.boundary_bytes[:L + 1]),
        param_bytes=tuple(cost.param_bytes[:L]),
        head_s=float(cost.head_s),
        head_param_bytes=float(cost.head_param_bytes),
        grad_bytes=(*(float(g) for g in cost.grad_bytes[:L]), float(cost.head_grad_bytes)),
        embedding_grad=bool(cost.embedding_grad_bytes),
        gpu_act_bytes=max(0.0, float(gpu_cap) - static),
        cpu_act_bytes=INF if cpu_act is None else float(cpu_act),
        nvme_act_bytes=INF if nvme_act is None else float(nvme_act),
        h2d_bytes_per_s=float(cost.h2d_bytes_per_s),
        d2h_bytes_per_s=float(cost.d2h_bytes_per_s),
        nvme_read_bytes_per_s=float(cost.nvme_read_bytes_per_s),
        nvme_write_bytes_per_s=float(cost.nvme_write_bytes_per_s),
        state_read_bytes_per_s=float(cost.state_read_bytes_per_s),
        state_write_bytes_per_s=float(cost.state_write_bytes_per_s),
        static_device_bytes=static,
        gpu_mem_cap_bytes=float(gpu_cap),
        working_bytes=tuple(float(w) for w in cost.working_bytes[:L]),
        head_working_bytes=float(cost.head_working_bytes),
        head_slot_bytes=float(getattr(cost, "head_slot_bytes", 0)),
        optimizer_mode=optimizer_mode,
        land_s=tuple(op_seconds(Op(0, "optimizer", "land", j), cost) for j in range(L + 1)),
        embedding_s=op_seconds(Op(0, "optimizer", "embedding", 0), cost),
        optimizer_step_s=op_seconds(Op(0, "optimizer", "step"), cost),
        update_s=update_seconds(cost) if optimizer_mode == "overlap" or offload else (),
        tied_head=bool(cost.spec.tie_word_embeddings),
        graph_bytes=Shapes.from_cost(cost).graph_bytes,
        staging_depth=staging_depth,
        state_bytes=cost.state_group_bytes() if offload else (),
    )
    if topology.parallel:  # the program's bytes (Shapes.from_cost), timed as the simulator times them
        shapes = Shapes.from_cost(cost)
        groups = (*shapes.grad_bytes, shapes.head_grad_bytes)
        fields.update(topology=topology,
                      reduce_s=tuple(topology.collective_s(shapes.reduce_bytes(b), cost.hardware) for b in groups),
                      gather_s=topology.collective_s(shapes.boundary_bytes[0], cost.hardware, "gather"))
    breakdown = cost.device_breakdown() if hasattr(cost, "device_breakdown") else {}
    fields["fwd_unallocated_bytes"] = float(breakdown.get("grad_slots", 0) + breakdown.get("boundary_grads", 0))
    fields["static_working_bytes"] = float(breakdown.get("working_set", 0))
    fields.update(options)
    return PlanningInstance(**fields)

