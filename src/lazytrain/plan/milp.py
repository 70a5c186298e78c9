"""The MILP: place every layer boundary on gpu / cpu / nvme / recompute so that the step is shortest.

The placement part follows the LazyTrain paper's scheduling model (arXiv 2608.11919; docs/planner.md); the time
part is the step program (plan/schedule.py) written as a sum of windows, so the objective *is* the simulated step
(issue 10).

Index sets
    j in J = {0..L-1}          layers; layer j maps boundary j -> j+1
    i in B = {0..L}            boundaries; 0 = embedding output, L = last layer output (both always gpu)
    kept layers                a suffix L-K..L-1 of the layers keeps its graph (saved tensors) and weights on the
                               device from its forward to its backward (Plan.kept_layers): its backward B_j runs
                               through the graph (beta[j] - rho[j]: no re-forward) and streams no weights
    (s, e) in E                candidate recompute edges, 0 <= s < e <= L, e - s <= K (max segment length)
    windows                    one per compute op of the step program, each fenced (every job it issues is
                               waited for at its end): F_j (forward of layer j), H (loss head), R_j (recompute
                               forward of layer j, runs iff boundary j+1 is recomputed), B_j (backward of layer j)

Parameters (all from the CostModel; bytes, seconds, bytes/second)
    rho[j]      forward time of layer j             beta[j]   autograd re-forward + backward time of layer j
    rho[L]      loss head time (forward+backward)   A[i]      bytes of boundary i
    p[j]        weight (= gradient) bytes of layer j; p[L] the loss head's
    G[j]        bytes of layer j's graph when it is kept (its saved tensors beyond its boundaries)
    land[j]     optimizer-lane jobs of group j's gradients: accumulation into .grad, preceded with ranks (data
                parallelism) by the group's sum over the ranks red[j]; land[L] the head's
    d[j]        seconds from the start of the window that sends group j's gradients to the release of land[j]:
                a_D p[j]
    M_G         device bytes for activations = gpu memory cap - static device bytes (layer weight and gradient
                slots, the largest working set W, boundary-gradient buffers)
    h           the loss head's own weight slot and its gradient slot (each p[L]) when it is larger than a layer,
                else 0: not static, counted where live -- the weight slot in F_{L-1} (its h2d) and H, the gradient
                slot in H and the backward's first window (R_s or B_{L-1} of the last segment (s, L), which sends it)
    w[j], w[L]  device working set of layer j's compute (forward, recompute, backward) and of the loss head:
                each window's row counts its own and gives back W (hybrid models mix layer kinds)
    M_C, M_N    host DRAM / NVMe bytes for offloaded activations
    B_D, B_H, B_W, B_R   d2h, h2d, NVMe write, NVMe read rates; a_X = 1 / B_X (0 for an unlimited link)
    U_F         static device bytes not yet allocated during the forward (gradient slots, boundary gradients)
    T_F, T_B    extra transient device bytes in the forward / backward (0 for the shared schedule)
    D, S[k], u[k]  optimizer state on NVMe (issue 24): the staging depth (fixed per solve; the planner solves one
                MILP per depth the host memory allows), group k's state file bytes and update seconds, groups in
                update order; the state ops' windows from plan/schedule.py's StateSchedule
    B_SR, B_SW  the state files' rates on the NVMe read / write links (a group's whole file in large requests, where
                a spill is one small file; default B_R, B_W); s_X = 1 / B_SX. One link each: a state op and a
                spill queue on the same lane, each at its own rate

Variables
    x[s,e] in {0,1}   edge (s, e) is a segment: s and e materialized, s+1..e-1 recomputed
    z[i] in {0,1}     boundary i is materialized;  g[i], c[i], n[i] in {0,1}: its home is gpu / cpu / nvme
    y[j] in {0,1}     layer j is kept: y[j] <= y[j+1] (a suffix), y[j] <= g[j]; K = sum_j y[j]
    v[s,e] >= 0       = x[s,e] (c[s] + n[s]): s is reloaded (h2d) in window B_e (H when e = L) into a device
                      buffer allocated in that window (linearized: v >= x + c + n - 1)
    vn[s,e] >= 0      = x[s,e] n[s]: s is read from NVMe in window B_{e+1} (H when e = L-1)
    T[w] >= 0         seconds of window w
    Q[k], S >= 0      the end of B_k (less the recompute windows of its own segment that run before it), the step
    N_g, N_c, N_n, N_z, N_long  integer counts of the binaries (boundaries per home, materialized, segments that
                      recompute with their end's gradient d2h longer than the recompute window), bounded by what
                      the rows admit: for the branch-and-bound only (`_add_counts`)
    T0, U[k], R[k], W[k] >= 0  optimizer state on NVMe, overlap mode: the start window's seconds and the ends of
                      group k's update, state read and state write (`_add_state_pipeline`)

Constraints (one `_add_<family>` each; equations repeated there)
    path, placement, capacity (cpu, nvme), kept (the suffix), gpu_memory (the forward windows, the loss head and
    every backward segment, each with its own working set and the kept layers' graphs and slots: the transient
    memory of recompute blocks, reload buffers and working sets, the paper's weak spot 3), nvme_reads (vn, and the
    last segment's start off nvme), the windows forward_windows, head_window, recompute_windows, backward_windows
    (each T[w] at least its compute and each lane's load: weights, activations, gradients, a prefetched state
    file), updates (overlap: the forward's weight h2d after each group's update; with the state on NVMe the
    state pipeline's max-plus rows instead), step (Q: the end of each backward window; the step S at least
    the sum of the windows and at least each optimizer-lane release plus the host work queued behind it; a
    release's row is left out where the step's end row implies it), counts (cardinality: at most as many
    boundaries per home as its rows admit).

Objective (seconds)
    min S + lambda_z sum z[i] + lambda_c sum c[i] + lambda_n sum n[i] (+ the whole optimizer step in serial mode,
    with the state on NVMe its updates through the slots: a constant either way)
    Without the tie-breakers (1e-5 s per materialized or cpu boundary, 1e-4 s per nvme boundary) it is the
    simulated step of the plan's program: `MilpSolution.step_s`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import TIERS, Plan, SolveReport, Transfer
from lazytrain.plan.schedule import (
    OFFLOADED,
    OPTIMIZER_MODES,
    STATE_OPS,
    Op,
    Shapes,
    StepProgram,
    build_program,
    segments_of,
    state_schedule,
    update_order,
)
from lazytrain.plan.sim import compute_seconds, op_seconds, update_seconds
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    import highspy

    from lazytrain.costmodel.cost import CostModel
    from lazytrain.plan.budgets import Budgets

log = logging.getLogger(__name__)

# The solver's defaults, written once: the job schema (config.PlanConfig) takes them for its fields.
DEFAULT_SOLVER = "highs"
DEFAULT_MAX_SEGMENT = 8  # layers: the longest recompute segment the MILP considers
DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_MIP_REL_GAP = 0.0  # 0 = optimal
INF = math.inf
LINK_RATES = {"h2d": "h2d_bytes_per_s", "d2h": "d2h_bytes_per_s", "nvme_read": "nvme_read_bytes_per_s",
              "nvme_write": "nvme_write_bytes_per_s"}


# ---- the instance: plain arrays, testable without a model ------------------------------------------
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
    # optimizer_offload nvme (issue 24): D staging slots and each group's state file bytes at index target + 1
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
        if op.lane in LINK_RATES:
            rate = self.state_rates[op.kind == "state_write"] if op.kind in STATE_OPS else \
                getattr(self, LINK_RATES[op.lane])
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
        groups = (*shapes.param_bytes, shapes.head_param_bytes)
        fields.update(topology=topology,
                      reduce_s=tuple(topology.collective_s(shapes.reduce_bytes(b), cost.hardware) for b in groups),
                      gather_s=topology.collective_s(shapes.boundary_bytes[0], cost.hardware, "gather"))
    breakdown = cost.device_breakdown() if hasattr(cost, "device_breakdown") else {}
    fields["fwd_unallocated_bytes"] = float(breakdown.get("grad_slots", 0) + breakdown.get("boundary_grads", 0))
    fields["static_working_bytes"] = float(breakdown.get("working_set", 0))
    fields.update(options)
    return PlanningInstance(**fields)


# ---- the result of a solve (solution, not yet a Plan) ----------------------------------------------
@dataclass(frozen=True)
class MilpSolution:
    """Tiers per boundary, transfers per window and the solve report; `to_plan` attaches a model."""

    tiers: tuple[str, ...]
    transfers: tuple[Transfer, ...]
    report: SolveReport
    step_s: float  # the step seconds of the program the tiers give: the objective less the tie-breakers
    kept_layers: int = 0  # K: the last K layers keep their graphs (Plan.kept_layers)


# ---- a solver-neutral sparse model ---------------------------------------------------------------
class _Model:
    """Columns and rows by name; handed to HiGHS or SCIP unchanged, so both solve the same formulation."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[str, dict[int, float], float, float]] = []
        self.offset = 0.0
        self.stats: dict[str, int] = {}  # the solver's search: branch-and-bound nodes, LP iterations

    def var(self, name: str, lb: float = 0.0, ub: float = INF, cost: float = 0.0, integer: bool = False) -> int:
        self.names.append(name)
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.names) - 1

    def row(self, name: str, coefs: dict[int, float], lo: float = -INF, hi: float = INF) -> None:
        coefs = {k: v for k, v in coefs.items() if v != 0.0}
        if not coefs:  # a constant row: check it here rather than hand the solver an empty row
            if lo > 1e-9 or hi < -1e-9:
                raise _Infeasible(name)
            return
        self.rows.append((name, coefs, lo, hi))


class _Infeasible(Exception):
    pass


def _add(coefs: dict[int, float], var: int, value: float) -> None:
    coefs[var] = coefs.get(var, 0.0) + value


# ---- the formulation --------------------------------------------------------------------------------
def _scaled(inst: PlanningInstance, unit: float) -> PlanningInstance:
    """The same instance with bytes counted in `unit`s (the largest boundary): coefficients near 1 keep the
    solvers' tolerances meaningful (with raw bytes SCIP stalls on 1e9-sized rows and 1e-10 costs)."""
    byte_fields = ("gpu_act_bytes", "head_param_bytes", "cpu_act_bytes", "nvme_act_bytes", "h2d_bytes_per_s",
                   "d2h_bytes_per_s", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s", "fwd_unallocated_bytes",
                   "fwd_transient_bytes", "bwd_transient_bytes", "static_device_bytes", "gpu_mem_cap_bytes",
                   "head_working_bytes", "static_working_bytes", "head_slot_bytes")
    changes: dict[str, Any] = {k: getattr(inst, k) / unit for k in byte_fields}
    for k in ("state_read_bytes_per_s", "state_write_bytes_per_s"):
        changes[k] = None if getattr(inst, k) is None else getattr(inst, k) / unit
    for name in ("boundary_bytes", "working_bytes", "param_bytes", "graph_bytes", "state_bytes"):
        changes[name] = tuple(b / unit for b in getattr(inst, name))
    return replace(inst, **changes)


class _Formulation:
    def __init__(self, inst: PlanningInstance, max_segment: int, fixed_tiers: Sequence[str] | None,
                 fixed_kept: int | None = None) -> None:
        self.unit = max(max(inst.boundary_bytes), 1.0)  # bytes per model unit
        inst = _scaled(inst, self.unit)
        self.inst, self.K, self.L = inst, max_segment, inst.num_layers
        self.m = _Model()
        self.fixed = tuple(fixed_tiers) if fixed_tiers is not None else None
        self.fixed_kept = fixed_kept
        self.build_s: dict[str, float] = {}
        # a_X: seconds per model unit on link X; p[L] the loss head's bytes; d[k] = a_D p[k], group k's gradient d2h
        self.aH, self.aD = self._inverse(inst.h2d_bytes_per_s), self._inverse(inst.d2h_bytes_per_s)
        self.aW, self.aR = self._inverse(inst.nvme_write_bytes_per_s), self._inverse(inst.nvme_read_bytes_per_s)
        self.sR, self.sW = (self._inverse(rate) for rate in inst.state_rates)  # s_X: a state file's seconds per unit
        self.p = [*inst.param_bytes, inst.head_param_bytes]
        self.send = [self.aD * p for p in self.p]
        # optimizer_offload nvme: where the state ops go (plan/schedule.py), and the seconds of the state read each
        # backward window B_j prefetches for the next update (B_{L-1-k}, group k < D)
        self.state = state_schedule(self.L, inst.tied_head, inst.staging_depth) if inst.staging_depth else None
        self.prefetch_s = {self.L - 1 - k: self.sR * inst.state_bytes[t + 1]
                           for k, t in enumerate(self.state.targets[:self.state.depth])} if self.state else {}
        self.T0: int | None = None  # the start window's seconds, a column when the state ops make it one
        for family in (self._add_variables, self._add_path, self._add_placement, self._add_kept, self._add_capacity,
                       self._add_gpu_memory, self._add_nvme_reads, self._add_forward_windows, self._add_head_window,
                       self._add_recompute_windows, self._add_backward_windows, self._add_updates, self._add_step,
                       self._add_counts):
            t0 = time.perf_counter()
            family()
            self.build_s[family.__name__.removeprefix("_add_")] = time.perf_counter() - t0
        log.debug("MILP build seconds per family: %s", self.build_s)

    # -- helpers --
    def start_values(self, tiers: Sequence[str], kept_layers: int = 0) -> dict[int, float] | None:
        """Column values of the binaries for `tiers` and `kept_layers` (a warm start); None when a segment is not
        a candidate."""
        if len(tiers) != self.L + 1:
            return None
        kept = [i for i, t in enumerate(tiers) if t != "recompute"]
        edges = set(zip(kept[:-1], kept[1:], strict=True))
        if not edges <= set(self.x):
            return None
        values = {v: float(edge in edges) for edge, v in self.x.items()}
        for i, tier in enumerate(tiers):
            for var, on in ((self.z[i], tier != "recompute"), (self.g[i], tier == "gpu"), (self.c[i], tier == "cpu"),
                            (self.n[i], tier == "nvme")):
                values[var] = float(on)
        for j, y in enumerate(self.y):
            values[y] = float(j >= self.L - kept_layers)
        for count, members in self.counts.items():
            values[count] = sum(values[v] for v in members)
        return values

    def _inverse(self, rate: float) -> float:
        """Seconds per (scaled) byte of a link; an unlimited link moves anything in no time."""
        return 1.0 / rate if math.isfinite(rate) else 0.0

    # -- families --
    def _add_variables(self) -> None:
        m, L, K, inst = self.m, self.L, self.K, self.inst
        # x[s,e]: candidate recompute edges, block length <= K.
        self.x = {(s, e): m.var(f"x[{s},{e}]", 0, 1, 0.0, True)
                  for s in range(L) for e in range(s + 1, min(L, s + K) + 1)}
        self.z = [m.var(f"z[{i}]", 0, 1, inst.lambda_z, True) for i in range(L + 1)]
        self.g = [m.var(f"g[{i}]", 0, 1, 0.0, True) for i in range(L + 1)]
        self.c = [m.var(f"c[{i}]", 0, 1, inst.lambda_c, True) for i in range(L + 1)]
        nvme_ub = 1 if inst.nvme_act_bytes > 0 else 0
        self.n = [m.var(f"n[{i}]", 0, nvme_ub, inst.lambda_n, True) for i in range(L + 1)]
        # Boundaries 0 and L stay on the device: g[0] = g[L] = 1 (so z = 1, c = n = 0 there).
        for i in (0, L):
            m.lb[self.g[i]] = m.ub[self.c[i]] = m.ub[self.n[i]] = 0.0
            m.lb[self.g[i]] = 1.0
        # y[j]: layer j keeps its graph (a layer can be kept only when the instance has graph bytes); at most as
        # many as the head row admits with nothing else on the device (the rest fixed to 0: fewer binaries)
        keepable = 1 if inst.graph_bytes else 0
        self.y = [m.var(f"y[{j}]", 0, keepable, 0.0, True) for j in range(L)]
        if self.fixed_kept is not None:
            if self.fixed_kept and not keepable or not 0 <= self.fixed_kept <= L:
                raise _Infeasible(f"kept_layers={self.fixed_kept}")
            for j, y in enumerate(self.y):
                m.lb[y] = m.ub[y] = float(j >= L - self.fixed_kept)
        elif keepable:
            for j in range(L - 1, -1, -1):
                if self._kept_head_bytes(j) > inst.gpu_act_bytes + inst.static_working_bytes + 1e-9:
                    for i in range(j + 1):
                        m.ub[self.y[i]] = 0.0
                    break
        if self.fixed is not None:
            self._fix_tiers()

    def _kept_head_bytes(self, first: int) -> float:
        """The head row's left side with layers first..L-1 kept and every other boundary but 0 off the device:
        boundaries 0 and first..L-1, the head's own bytes, the kept graphs and slots."""
        inst, L, A = self.inst, self.L, self.inst.boundary_bytes
        return ((A[0] if first > 0 else 0.0) + sum(A[first:L]) + inst.head_bytes() + inst.bwd_transient_bytes
                + sum(inst.graph_bytes[j] + inst.param_bytes[j] for j in range(first, L)))

    def _fix_tiers(self) -> None:
        """Fix z, g, c, n (and so x) to a given tier list: evaluates a rule as a point of this MILP."""
        m, fixed = self.m, self.fixed
        assert fixed is not None
        if len(fixed) != self.L + 1 or any(t not in TIERS for t in fixed):
            raise LazyTrainError(f"fixed_tiers needs {self.L + 1} entries from {', '.join(TIERS)}, got {len(fixed)}")
        for i, tier in enumerate(fixed):
            for var, value in ((self.z[i], tier != "recompute"), (self.g[i], tier == "gpu"),
                               (self.c[i], tier == "cpu"), (self.n[i], tier == "nvme")):
                if value and m.ub[var] < 1:
                    raise _Infeasible(f"fixed tier {tier!r} at boundary {i}")
                m.lb[var] = m.ub[var] = float(value)

    def _add_path(self) -> None:
        # sum_e x[0,e] = 1 ;  sum_s x[s,L] = 1 ;  for 0 < i < L: sum_s x[s,i] = z[i] = sum_e x[i,e]
        m, L, x = self.m, self.L, self.x
        m.row("path_out[0]", {v: 1.0 for (s, _), v in x.items() if s == 0}, 1, 1)
        m.row(f"path_in[{L}]", {v: 1.0 for (_, e), v in x.items() if e == L}, 1, 1)
        for i in range(1, L):
            into = {v: 1.0 for (_, e), v in x.items() if e == i}
            out = {v: 1.0 for (s, _), v in x.items() if s == i}
            m.row(f"path_in[{i}]", {**into, self.z[i]: -1.0}, 0, 0)
            m.row(f"path_out[{i}]", {**out, self.z[i]: -1.0}, 0, 0)

    def _add_placement(self) -> None:
        # z[i] = g[i] + c[i] + n[i]   (a materialized boundary has exactly one home)
        for i in range(self.L + 1):
            self.m.row(f"place[{i}]", {self.z[i]: 1.0, self.g[i]: -1.0, self.c[i]: -1.0, self.n[i]: -1.0}, 0, 0)

    def _add_kept(self) -> None:
        # y[j] <= y[j+1] (the kept layers are a suffix) ;  y[j] <= g[j] (a kept layer's input stays on the device,
        # its graph holds it; boundary L is gpu)
        m, y = self.m, self.y
        if not self.inst.graph_bytes:
            return
        for j in range(self.L):
            if j + 1 < self.L:
                m.row(f"kept_suffix[{j}]", {y[j]: 1.0, y[j + 1]: -1.0}, hi=0.0)
            m.row(f"kept_gpu[{j}]", {y[j]: 1.0, self.g[j]: -1.0}, hi=0.0)

    def _add_capacity(self) -> None:
        # sum_i A[i] c[i] <= M_C ;  sum_i A[i] n[i] <= M_N
        A, inst = self.inst.boundary_bytes, self.inst
        if math.isfinite(inst.cpu_act_bytes):
            self.m.row("cap_cpu", {self.c[i]: A[i] for i in range(self.L + 1)}, hi=inst.cpu_act_bytes)
        if 0 < inst.nvme_act_bytes < INF:
            self.m.row("cap_nvme", {self.n[i]: A[i] for i in range(self.L + 1)}, hi=inst.nvme_act_bytes)

    def _add_gpu_memory(self) -> None:
        """The paper's sum A g <= M_G, made exact for the schedule (weak spot 3: transient memory). The rows count
        what the simulator's (and executor's) device accounting holds at each window's peak beyond the static
        bytes (slots, boundary gradients) with that window's own working set: M_G is net of the largest, W, so
        every row's right side gives it back (the terms are PlanningInstance.forward_bytes, head_bytes,
        segment_bytes)."""
        A, L, inst, m = self.inst.boundary_bytes, self.L, self.inst, self.m
        room = inst.gpu_act_bytes + inst.static_working_bytes
        # A kept layer j holds its weights' own slot from its forward h2d (in F_{j-1}) and its graph from its
        # forward (F_j) to its backward (B_j); its forward and backward transients are within w[j] (y terms):
        kept = [inst.graph_bytes[j] + inst.param_bytes[j] for j in range(L)] if inst.graph_bytes else []

        def kept_before(j: int) -> dict[int, float]:
            """Kept layers below j (graph, slot) and layer j's slot: sum_{j'<j} (G[j'] + p[j']) y[j'] + p[j] y[j]."""
            if not kept or j >= L:
                return {}
            return {**{self.y[i]: kept[i] for i in range(j)}, self.y[j]: inst.param_bytes[j]}

        # Forward window F_j: every gpu boundary below j, its input j and output j+1 whatever their tiers (an
        # offloaded copy is freed once its d2h is done), layer j's working set w[j], the kept layers below j and
        # the slots of j and j+1, in F_{L-1} the head's own weight slot h; the gradient slots and boundary gradients
        # are not allocated yet (U_F):
        #   sum_{i<j} A[i] g[i] + A[j] + A[j+1] + w[j] + h [j = L-1] + kept(j) + p[j+1] y[j+1] + T_F <= M_G + W + U_F
        # (row j is implied by a later row whose constant is at least its own: it holds a superset below)
        top = -INF
        for j in range(L - 1, -1, -1):
            const = inst.forward_bytes(j) + inst.fwd_transient_bytes
            if const > top:
                coefs = {**{self.g[i]: A[i] for i in range(j)}, **kept_before(j)}
                if kept and j + 1 < L:
                    coefs[self.y[j + 1]] = inst.param_bytes[j + 1]
                m.row(f"gpu_fwd[{j}]", coefs, hi=room + inst.fwd_unallocated_bytes - const)
                top = const
        # Reload buffer: in window B_s, the last of segment (s, e), the start s' of the previous segment (s', s) is
        # reloaded into a device buffer allocated there when it is offloaded:  v[s',s] >= x[s',s] + c[s'] + n[s'] - 1;
        # the last segment's start (s', L) in the head window H.
        self.v = {}
        for (s0, s1), xv in self.x.items():
            if s0 == 0:
                continue  # boundary 0 is gpu
            v = m.var(f"v[{s0},{s1}]")
            self.v[s0, s1] = v
            m.row(f"reload_buffer[{s0},{s1}]", {v: -1.0, xv: 1.0, self.c[s0]: 1.0, self.n[s0]: 1.0}, hi=1.0)
        # Head window H: every gpu boundary below L, the last segment's start's reload buffer, boundary L, its
        # gradient, the head's working set and its own weight and gradient slots (head_bytes: less the
        # boundary-gradient buffers G already static), every kept layer's graph and slot:
        #   sum_{i<L} A[i] g[i] + sum_s A[s] v[s,L] + 2 A[L] - G + w[L] + 2 h + sum_j (G[j] + p[j]) y[j] + T_B
        #   <= M_G + W
        m.row("gpu_head", {**{self.g[i]: A[i] for i in range(L)},
                           **{v: A[s0] for (s0, s1), v in self.v.items() if s1 == L},
                           **({self.y[j]: kept[j] for j in range(L)} if kept else {})},
              hi=room - inst.head_bytes() - inst.bwd_transient_bytes)
        # Backward of segment (s, e): gpu boundaries below s, and at R_j / B_j boundaries s..j+1 (s reloaded or
        # kept, the rest recomputed or e) with layer j's working set, the largest over j (segment_bytes; the first
        # window of the last segment, e = L, also holds the head's gradient slot h until its d2h is done):
        #   sum_{i<s} A[i] g[i] + sum_e x[s,e] segment_bytes(s, e) + T_B <= M_G + W   (s < L)
        # and in B_s, the segment's last window: gpu boundaries below s, s and s+1, w[s], the reload buffer of the
        # previous start (the same window as the first row when e = s+1; for s = L-1 the backward's first, which
        # holds the head's gradient slot h):
        #   sum_{i<s} A[i] g[i] + (A[s] + A[s+1] + w[s] + h [s = L-1]) z[s] + sum_{s'} A[s'] v[s',s] + T_B <= M_G + W
        # Both add the kept layers whose backward has not run and layer s's own slot (kept(s); nonzero only when s
        # is kept: a suffix). Every B_s holds at least C[s] = A[s] + A[s+1] + w[s] above the gpu boundaries below s,
        # s materialized or not (if not, the segment (s', e) that contains s holds s'..s+1 in B_s, and its rows
        # count more), so both rows charge C[s] whatever z[s] and only the excess with the binaries:
        #   sum_e x[s,e] segment_bytes(s, e) -> C[s] + sum_e x[s,e] (segment_bytes(s, e) - C[s]),  C[s] z[s] -> C[s]
        # The same integer points, a much tighter LP relaxation: a fractional z[s] no longer hides most of the
        # working set w[s] (tens of GB on the 27B) from the row.
        for s in range(L):
            below = {**{self.g[i]: A[i] for i in range(s)}, **kept_before(s)}
            always = A[s] + A[s + 1] + inst.working_bytes[s]
            coefs = dict(below)
            for (s2, e), xv in self.x.items():
                if s2 == s:
                    coefs[xv] = inst.segment_bytes(s, e) - always
            m.row(f"gpu_bwd[{s}]", coefs, hi=room - inst.bwd_transient_bytes - always)
            buffers = {v: A[s0] for (s0, s1), v in self.v.items() if s1 == s}
            if buffers:
                m.row(f"gpu_bwd_reload[{s}]", {**below, self.z[s]: inst.head_grad_bytes(s, s + 1), **buffers},
                      hi=room - inst.bwd_transient_bytes - always)

    # -- the step in time: the step program's windows (plan/schedule.py). Each window is fenced: it lasts the
    # longest of its compute and each lane's chain of transfers, T[w] >= each. Bytes in model units over rates in
    # units/s are seconds (a_X = 1 / rate); the loads are linear in x, z, c, n, y, v, vn. --
    def _add_nvme_reads(self) -> None:
        """An offloaded segment start's nvme read is staged a window before its h2d, in B_{e+1} (H when e = L-1):
            vn[s,e] >= x[s,e] + n[s] - 1      (s > 0, e < L)
        The last segment's start cannot be on nvme (its read would chain with its h2d in H):
            n[s] + x[s,L] <= 1"""
        m, L, x = self.m, self.L, self.x
        use_nvme = self.inst.nvme_act_bytes > 0
        for (s0, s1), xv in x.items():  # the last segment's start (reloaded in the head window) is not on nvme
            if s0 > 0 and s1 == L and use_nvme:
                m.row(f"last_start_not_nvme[{s0}]", {self.n[s0]: 1.0, xv: 1.0}, hi=1.0)
        self.vn = {}
        if use_nvme:
            for (s0, s1), xv in x.items():
                if s0 > 0 and s1 < L:
                    vn = self.vn[s0, s1] = m.var(f"vn[{s0},{s1}]")
                    m.row(f"nvme_reload[{s0},{s1}]", {vn: -1.0, xv: 1.0, self.n[s0]: 1.0}, hi=1.0)

    def _add_forward_windows(self) -> None:
        """F_j: layer j's forward, the next weights (the head's after F_{L-1}), the d2h of boundary j if
        offloaded and the nvme write of boundary j-1:
            T[F_j] >= lb = max(rho[j], a_H p[j+1]),   T[F_j] >= lb + (a_D A[j] - lb)+ (c[j] + n[j]),
            T[F_j] >= lb + (a_W A[j-1] - lb)+ n[j-1]
        (the d2h and write rows lifted by lb, `_lifted`)."""
        inst, A = self.inst, self.inst.boundary_bytes
        self.F: list[int] = []
        for j in range(self.L):
            lb = max(inst.forward_s[j], self.aH * self.p[j + 1])
            loads = [self._lifted(lb, {self.c[j]: self.aD * A[j], self.n[j]: self.aD * A[j]})] if j > 0 else []
            if j > 1:
                loads.append(self._lifted(lb, {self.n[j - 1]: self.aW * A[j - 1]}))
            self.F.append(self._window(f"T[F{j}]", lb, loads))

    def _add_head_window(self) -> None:
        """H: the loss head, the weights of the last segment's first use, the reload of its start (v[s,L]), the
        nvme write of boundary L-1 and the read staged for B_{L-1}:
            T[H] >= rho[L],   T[H] >= a_H (sum_s x[s,L] p[s] + sum_s A[s] v[s,L] - p[L-1] y[L-1]),
            T[H] >= a_R sum_s A[s] vn[s,L-1],   T[H] >= a_W A[L-1] n[L-1]
        (a kept layer L-1 streams no weights for its backward)."""
        inst, L, A, aH = self.inst, self.L, self.inst.boundary_bytes, self.aH
        head_h2d = {xv: aH * self.p[s] for (s, e), xv in self.x.items() if e == L}
        head_h2d.update({v: aH * A[s] for (s, e), v in self.v.items() if e == L})
        _add(head_h2d, self.y[L - 1], -aH * self.p[L - 1])  # B_{L-1} kept: no weights to stream
        loads = [(0.0, head_h2d), (0.0, self._reads(L - 1))]
        if L > 1:
            loads.append((0.0, {self.n[L - 1]: self.aW * A[L - 1]}))
        self.H = self._window("T[H]", inst.head_s, loads)

    def _add_recompute_windows(self) -> None:
        """R_j runs only when boundary j+1 is recomputed: layer j's forward again, the next weights, and the d2h
        of the gradients of the segment's end e (d[e] = a_D p[e]) when (j, e) is a segment:
            T[R_j] >= busy (1 - z[j+1]) + sum_{e >= j+2} (d[e] - busy)+ x[j,e],   busy = max(rho[j], a_H p[j+1])
            T[R_j] >= sum_{e >= j+2} x[j,e] d[e]
        The lifted edges (d[e] > busy) are the long edges `_add_counts` counts."""
        inst, L = self.inst, self.L
        self.R: list[int] = []
        self.lifted_long: list[int] = []  # long edges whose gradients' d2h outlasts R_s's compute (_add_counts)
        for j in range(L - 1):
            busy = max(inst.forward_s[j], self.aH * self.p[j + 1])
            grads = {xv: self.send[e] for (s, e), xv in self.x.items() if s == j and e >= j + 2}
            lift = {xv: d - busy for xv, d in grads.items() if d > busy}
            self.lifted_long.extend(lift)
            self.R.append(self._window(f"T[R{j}]", 0.0, [(busy, {self.z[j + 1]: -busy, **lift}), (0.0, grads)],
                                       ub=max([busy, *grads.values()])))

    def _add_backward_windows(self) -> None:
        """B_j: layer j's backward (kb[j] = max(0, beta[j] - rho[j]) through a kept layer's graph), the next
        weights (layer j-1's unless j is recomputed or j-1 kept; a segment ending at j streams its start's first
        use and reloads it, v[s,j]), the d2h of layer j+1's gradients when j+1's backward ran just before
        (w = 1 - z[j+1] + x[j,j+1], a 0/1 value) and the nvme read staged for B_{j-1}:
            T[B_j] >= lb = beta[j] (kb[j] when j may be kept),   T[B_j] >= beta[j] - (beta[j] - kb[j]) y[j]
            T[B_j] >= lb + (d[j+1] - lb)+ w
            T[B_j] >= a_H (p[j-1] (1 - z[j] - y[j-1]) + sum_s x[s,j] p[s] + sum_s A[s] v[s,j])
            T[B_j] >= a_R (P[j] + sum_s A[s] vn[s,j-1])
        P[j]: with the optimizer's state on NVMe, the state file B_j prefetches for the next update (group k < D in
        B_{L-1-k}), queued on the nvme_read lane before the activations' reads; 0 otherwise."""
        inst, m, x, A, aH = self.inst, self.m, self.x, self.inst.boundary_bytes, self.aH
        p = self.p
        self.B: list[int] = []
        for j in range(self.L):
            g = self.send[j + 1]
            beta = inst.backward_s[j]
            kb = max(0.0, beta - inst.forward_s[j])  # through the kept graph
            lb = kb if m.ub[self.y[j]] > 0 else beta  # a layer that cannot be kept runs its whole backward
            # layer j+1's gradients leave in B_j when w = 1 - z[j+1] + x[j,j+1] (a 0/1 value) is 1: lifted by lb
            lift = max(0.0, g - lb)
            loads = [(lb + lift, {self.z[j + 1]: -lift, x[j, j + 1]: lift})] if lift > 0 else []
            if j > 0:
                h2d = {self.z[j]: -aH * p[j - 1]}
                for (s, e), xv in x.items():
                    if e == j:
                        _add(h2d, xv, aH * p[s])
                for (s, e), v in self.v.items():
                    if e == j:
                        _add(h2d, v, aH * A[s])
                _add(h2d, self.y[j - 1], -aH * p[j - 1])  # B_{j-1} kept: no weights to stream
                loads.append((aH * p[j - 1], h2d))
            reads = self._reads(j - 1) if j > 1 else {}
            if reads or j in self.prefetch_s:
                loads.append((self.prefetch_s.get(j, 0.0), reads))
            if inst.graph_bytes and kb < beta:
                loads.append((beta, {self.y[j]: -(beta - kb)}))
            self.B.append(self._window(f"T[B{j}]", lb, loads))

    def _add_updates(self) -> None:
        """Overlap mode: the previous step's updates run from the step's start in forward order; the h2d of
        boundary 0 and of group j's forward weights start after update j ends (ends[j]), the FIFO h2d lane in
        order (the start window's length is `start_s`):
            start = max(ends[first] + a_H A[0], ends[0]) + a_H p[0]
            start + sum_{i<=j} T[F_i] >= ends[j+1] + a_H p[j+1]"""
        inst, m, L, A, aH = self.inst, self.m, self.L, self.inst.boundary_bytes, self.aH
        self.start_s = aH * (A[0] + self.p[0])
        if not inst.update_s or inst.optimizer_mode != "overlap":
            return
        if self.state is not None:
            self._add_state_pipeline()
            return
        ends, t = {}, 0.0
        for target in update_order(L, inst.tied_head):
            t += inst.update_s[target + 1]
            ends[target] = t
        first = ends[L] if inst.tied_head else ends[-1]
        self.start_s = max(first + aH * A[0], ends[0]) + aH * self.p[0]
        for j in range(L):
            due = ends[j + 1] + aH * self.p[j + 1] - self.start_s
            if due > 0:
                m.row(f"update[{j + 1}]", {T: 1.0 for T in self.F[:j + 1]}, lo=due)

    def _window_end(self, w: int) -> dict[int, float]:
        """E(w), the end of forward-phase window w (0 = start, j + 1 = F_j, L + 1 = H) as column coefficients."""
        assert self.T0 is not None
        return {self.T0: 1.0, **{T: 1.0 for T in self.F[:w]}, **({self.H: 1.0} if w > self.L else {})}

    def _add_state_pipeline(self) -> None:
        """Overlap mode with the optimizer's state on NVMe (staging depth D; plan/schedule.py's StateSchedule):
        group k (update order, targets t[k]) is updated from its staging slot, written back in window write[k] and
        the slot refilled with group k + D in window read[k + D]; the ops start at their window's start E(w - 1),
        first on their lanes, FIFO. The event times are columns with the simulator's max-plus as lower bounds (the
        objective pushes each down to its max): update end U, read end R, write end W, with u = the update's
        seconds, r = s_R S, w = s_W S of the group's file S (at the state files' rates):
            U[k] >= U[k-1] + u[k],   U[k] >= R[k] + u[k] (k >= D; the first D were read in the last backward)
            R[k] >= E(read[k] - 1) + r[k],   R[k] >= R[k-1] + r[k],   R[k] >= W[k - D] + r[k]
            W[k] >= U[k] + w[k],   W[k] >= E(write[k] - 1) + w[k],   W[k] >= W[k-1] + w[k]
        and each window ends after what it issued: E(read[k]) >= R[k], E(write[k]) >= W[k], the start's h2d
        (boundary 0 after group 0's update, then layer 0's weights after its own) E(0) >= U[0] + a_H (A[0] + p[0]),
        E(0) >= U[1] + a_H p[0], the weights of group k >= 2 E(k - 1) >= U[k] + a_H p[t[k]], and a spill behind the
        window's state writes E(w) >= W[last written in w] + a_W A[b] n[b]. The start window is a column T0; the
        host mode's rows (`update[j]`, a constant start) are these with R and W absent."""
        inst, m, L, A = self.inst, self.m, self.L, self.inst.boundary_bytes
        aH, sR, sW = self.aH, self.sR, self.sW
        state = self.state
        assert state is not None
        D, targets, G = state.depth, state.targets, len(state.targets)
        S = [inst.state_bytes[t + 1] for t in targets]
        self.T0 = m.var("T[start]", lb=aH * (A[0] + self.p[0]))
        self.start_s = 0.0

        def after(name: str, later: int | dict[int, float], earlier: int | dict[int, float] | None,
                  seconds: float) -> None:
            """later >= earlier + seconds (each a column or E(w)'s coefficients; earlier None: the step's start)."""
            coefs = dict(later) if isinstance(later, dict) else {later: 1.0}
            for var, coef in ({} if earlier is None else earlier if isinstance(earlier, dict) else {earlier: 1.0}
                              ).items():
                _add(coefs, var, -coef)
            m.row(name, coefs, lo=seconds)

        def start_of(w: int) -> dict[int, float] | None:
            return None if w == 0 else self._window_end(w - 1)

        U = [m.var(f"U[{k}]") for k in range(G)]
        R = {k: m.var(f"R[{k}]") for k in range(D, G)}
        W = [m.var(f"W[{k}]") for k in range(G)]
        for k, t in enumerate(targets):
            upd = inst.update_s[t + 1]
            after(f"U[{k}]_lane", U[k], U[k - 1] if k else None, upd)
            if k >= D:
                after(f"U[{k}]_read", U[k], R[k], upd)
                after(f"R[{k}]_issue", R[k], start_of(state.read[k]), sR * S[k])
                if k > D:
                    after(f"R[{k}]_lane", R[k], R[k - 1], sR * S[k])
                after(f"R[{k}]_slot", R[k], W[k - D], sR * S[k])
                after(f"R[{k}]_fence", self._window_end(state.read[k]), R[k], 0.0)
            after(f"W[{k}]_update", W[k], U[k], sW * S[k])
            after(f"W[{k}]_issue", W[k], start_of(state.write[k]), sW * S[k])
            if k:
                after(f"W[{k}]_lane", W[k], W[k - 1], sW * S[k])
            after(f"W[{k}]_fence", self._window_end(state.write[k]), W[k], 0.0)
            if k >= 2 and not (inst.tied_head and t == L):
                after(f"update[{t}]", self._window_end(k - 1), U[k], aH * self.p[t])
        after("update[first]", self._window_end(0), U[0], aH * (A[0] + self.p[0]))
        after("update[0]", self._window_end(0), U[1], aH * self.p[0])
        if inst.nvme_act_bytes > 0:  # a spill queues behind its window's state writes: F_j spills j-1, H spills L-1
            for w in range(3, L + 2):
                written = state.writes_in(w)
                b = w - 2 if w <= L else L - 1
                if written and b > 0:
                    coefs = {**self._window_end(w), W[written[-1]]: -1.0, self.n[b]: -self.aW * A[b]}
                    m.row(f"spill[{b}]_after_state", coefs, lo=0.0)

    def _add_step(self) -> None:
        """The step S: Q[k] is the end of B_k less the recompute windows of B_k's own segment that run before it,
            Q[L] = start + sum_j T[F_j] + T[H],   Q[k] = Q[k+1] + T[B_k] + T[R_k].
        The optimizer lane is a FIFO queue: group k's jobs (land[k], with ranks red[k] + its land) are released
        when its gradients' d2h ends, d[k] after the end of B_k (of H for the head), and the groups arrive in the
        order L, L-1, .., 0, then the embedding backward (released d0 after the end window starts, when boundary
        0's gradient d2h, queued behind B_0's gradients, ends; with ranks after the gather of every rank's rows,
        gath). So S is at least each release plus the work queued from there on (emb = gath + the embedding
        backward):
            S >= Q[0] + d0 + emb,   d0 = a_D (p[0] + A[0])
            S >= Q[k] + sum_{j=s..k-1} T[R_j] + d[k] + sum_{k' <= k} land[k'] + emb - M (1 - sum_{e>k} x[s,e])
        for every s <= k that may start B_k's segment (s = k needs no M: the sum is empty); a release's row is left
        out where S_end implies it. In serial mode the whole optimizer step follows: the objective's offset."""
        inst, m, L, x, A = self.inst, self.m, self.L, self.x, self.inst.boundary_bytes
        F, R, B, send = self.F, self.R, self.B, self.send
        land = inst.land_seconds()
        if inst.topology.parallel:  # each group's sum over the ranks, queued before its land
            land = tuple(a + r for a, r in zip(land, inst.reduce_s, strict=True))
        grad0 = self.aD * (self.p[0] + A[0])
        Q = [m.var(f"Q[{k}]") for k in range(L + 1)]
        start = {self.T0: -1.0} if self.T0 is not None else {}  # the start window: a column, or a constant
        m.row(f"Q[{L}]", {Q[L]: 1.0, self.H: -1.0, **{T: -1.0 for T in F}, **start}, self.start_s, self.start_s)
        for k in range(L):
            m.row(f"Q[{k}]", {Q[k]: 1.0, Q[k + 1]: -1.0, B[k]: -1.0, **({R[k]: -1.0} if k < L - 1 else {})}, 0, 0)
        S = self.S = m.var("S", cost=1.0)
        emb = inst.gather_s + inst.embedding_s  # (ranks: every rank's rows gathered) the embedding backward
        m.row("S_end", {S: 1.0, Q[0]: -1.0}, lo=grad0 + emb)
        queued = [sum(land[:k + 1]) + emb for k in range(L + 1)]  # work queued from group k on (k = L: all)
        # Q[0] >= Q[k] + sum_{j<k} (T[B_j] + T[R_j]), so S_end implies group k's rows whenever the backward windows
        # below k cannot be shorter than its queue: sum_{j<k} lb(T[B_j]) + d0 >= d[k] + sum_{k' <= k} land[k']
        # (the same integer points and LP relaxation, ~480 big-M rows fewer on 64 layers)
        below = 0.0
        for k in range(L + 1):
            implied = below + grad0 + emb >= send[k] + queued[k]
            if k < L:
                below += m.lb[B[k]]
            if implied:
                continue
            m.row(f"S_land[{k}]", {S: 1.0, Q[k]: -1.0}, lo=send[k] + queued[k])
            if k == L:
                continue
            for s in range(max(0, k - self.K + 1), k):  # B_k's segment starts at s: its R_s..R_{k-1} run before
                starts = {xv: 1.0 for (s2, e), xv in x.items() if s2 == s and e > k}
                if not starts:
                    continue
                M = sum(m.ub[R[j]] for j in range(s, k))
                coefs = {S: 1.0, Q[k]: -1.0, **{R[j]: -1.0 for j in range(s, k)}}
                for xv in starts:
                    coefs[xv] = -M
                m.row(f"S_land[{k},{s}]", coefs, lo=send[k] + queued[k] - M)
        if inst.optimizer_mode == "serial":  # the optimizer step after the backward, from idle lanes: a constant
            m.offset = inst.serial_updates_s() if self.state is not None else inst.optimizer_step_s

    def _window(self, name: str, lb: float, loads: list[tuple[float, dict[int, float]]], ub: float = INF) -> int:
        """T >= lb and T >= const + sum coef var for every (const, coefs) in loads."""
        m = self.m
        T = m.var(name, lb=lb, ub=ub)
        for k, (const, coefs) in enumerate(loads):
            coefs = {var: -coef for var, coef in coefs.items() if coef != 0.0}
            if coefs:
                m.row(f"{name}_{k}", {T: 1.0, **coefs}, lo=const)
            elif const > lb:
                m.lb[T] = const
        return T

    @staticmethod
    def _lifted(lb: float, loads: dict[int, float]) -> tuple[float, dict[int, float]]:
        """T >= lb + sum (load - lb)+ x for binaries x of which at most one is 1 in any plan, each x = 1 meaning
        T >= its load: the convex hull of T >= max(lb, load x), the same integer points (T >= load x alone lets a
        fractional x hide the window's compute in the LP relaxation: most of a slow link's seconds, 27B with d2h
        1.5 GB/s)."""
        return lb, {var: load - lb for var, load in loads.items() if load > lb}

    def _reads(self, e: int) -> dict[int, float]:
        """a_R A[s] vn[s,e]: the nvme reads staged in the window before B_e."""
        A = self.inst.boundary_bytes
        return {vn: self.aR * A[s] for (s, e2), vn in self.vn.items() if e2 == e}

    def _add_counts(self) -> None:
        """Integer counts of the binaries with the cardinality bounds the capacity and memory rows imply:
            N_c = sum_i c[i] <= floor(M_C / a)      N_n = sum_i n[i] <= floor(M_N / a)
            N_g = sum_i g[i] <= min over the head row and each B_s row of the gpu boundaries it admits
            N_z = sum_i z[i] = N_g + N_c + N_n      N_long = sum_{lifted} x[s,e] <= floor(L / 2)
        over the interior boundaries (0 and L are gpu), with a the smallest of them: every boundary a count admits
        takes at least a bytes of its row. The same integer points (an overstated bound fails the brute-force
        tests). The LP relaxation materializes 43.5 boundaries where 41 fit (27B, 50 GB cap) or spreads a long
        segment over fractional edges (27B, d2h 1.5 GB/s); a count is one integer the solver can branch on (at
        most 41 boundaries, or at least 42) and cut on (19 cpu boundaries of 0.75 GB fill 15 GB), which no
        single binary gives it. The bounds are below what each count's own row implies, so presolve keeps the
        counts (HiGHS substitutes an integer column that only sums others and is bounded by them).
        N_long counts only the lifted long edges: (s, e >= s+2) whose end's gradient d2h outlasts R_s's compute
        (`_add_recompute_windows`), the rows where a fractional spread hides seconds. Elsewhere the count's bound is the
        path rows' own (a unit path has at most L / 2 long edges in the LP too) and it only fed HiGHS's root cut
        loop: counting every long edge took 1.7-12x the LP iterations on the 27B at 128 layers (seeds 0-2; 42
        nodes / 56349 iterations vs 1 / 4667 on seed 0). Any subset of a path's long edges has at most
        floor(L / 2) of them."""
        m, L, inst, A = self.m, self.L, self.inst, self.inst.boundary_bytes
        self.counts: dict[int, list[int]] = {}  # count column -> the binaries it sums (start_values)
        free = [i for i in range(1, L) if m.ub[self.z[i]] > m.lb[self.z[i]]]  # 0 and L are gpu; fixed tiers: none
        if not free:
            return
        a = min(A[i] for i in free)

        def fits(budget: float) -> float:
            return math.floor(budget / a + 1e-6) if math.isfinite(budget) and a > 0 else INF

        room = inst.gpu_act_bytes + inst.static_working_bytes - inst.bwd_transient_bytes
        gpu = fits(room - inst.head_bytes() - A[0])  # gpu_head: boundary 0 and the free ones, other terms >= 0
        for s in range(1, L):  # gpu_bwd[s]: 0 and the free gpu boundaries below s, at most one each from s up
            gpu = min(gpu, fits(room - (A[s] + A[s + 1] + inst.working_bytes[s]) - A[0])
                      + sum(1 for i in free if i >= s))
        bounds = {"N_g": (self.g, gpu), "N_c": (self.c, fits(inst.cpu_act_bytes)),
                  "N_n": (self.n, fits(inst.nvme_act_bytes))}
        total: dict[int, float] = {}
        for name, (family, bound) in bounds.items():
            members = [family[i] for i in free if m.ub[family[i]] > 0]
            if members:
                count = self._count(name, members, bound)
                total[count] = 1.0
        if total:
            self._count("N_z", [self.z[i] for i in free], sum(m.ub[v] for v in total), total)
        lifted = [xv for xv in self.lifted_long if m.ub[xv] > 0]
        if lifted:
            self._count("N_long", lifted, L // 2)

    def _count(self, name: str, members: list[int], bound: float, parts: dict[int, float] | None = None) -> int:
        """N = sum members (integer, 0 <= N <= bound); with parts also N = sum parts."""
        m = self.m
        count = m.var(name, 0, min(float(len(members)), bound), 0.0, True)
        m.row(name, {count: 1.0, **{v: -1.0 for v in members}}, 0, 0)
        if parts:
            m.row(f"{name}_parts", {count: 1.0, **{v: -c for v, c in parts.items()}}, 0, 0)
        self.counts[count] = members
        return count


# ---- solvers ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _stdout_silenced():
    """HiGHS prints its banner from C++ when constructed; keep `lazytrain plan` output clean."""
    try:
        fd = os.dup(1)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(fd, 1)
            os.close(fd)


def _solve_highs(m: _Model, time_limit_s: float, mip_rel_gap: float,
                 start: dict[int, float] | None = None) -> tuple[str, list[float] | None, float, float]:
    import highspy
    import numpy as np

    with _stdout_silenced():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.setOptionValue("mip_abs_gap", 0.0 if mip_rel_gap == 0 else 1e-6)  # the tie-breakers are ~1e-6 s
    h.setOptionValue("threads", 1)
    n = len(m.names)
    inf = highspy.kHighsInf
    h.addVars(n, np.array([max(lb, -inf) for lb in m.lb]), np.array([min(ub, inf) for ub in m.ub]))
    idx = np.arange(n, dtype=np.int32)
    h.changeColsCost(n, idx, np.array(m.cost, dtype=float))
    if any(m.integer):
        h.changeColsIntegrality(n, idx, np.array([1 if t else 0 for t in m.integer], dtype=np.uint8))
    starts, index, value, lo, hi = [], [], [], [], []
    for _, coefs, rlo, rhi in m.rows:
        starts.append(len(index))
        index.extend(coefs)
        value.extend(coefs.values())
        lo.append(max(rlo, -inf))
        hi.append(min(rhi, inf))
    h.addRows(len(m.rows), np.array(lo), np.array(hi), len(index), np.array(starts, dtype=np.int32),
              np.array(index, dtype=np.int32), np.array(value, dtype=float))
    h.changeObjectiveOffset(m.offset)
    if start:  # a warm start: the incumbent plan's binaries (HiGHS completes the continuous part)
        h.setSolution(len(start), np.array(list(start), dtype=np.int32), np.array(list(start.values()), dtype=float))
    _run_interruptibly(h)
    status = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    name = {S.kOptimal: "optimal", S.kTimeLimit: "time_limit", S.kInfeasible: "infeasible",
            S.kSolutionLimit: "solution_limit", S.kInterrupt: "interrupted"}.get(status, h.modelStatusToString(status))
    if status == S.kInfeasible or not has_solution:
        return name, None, math.nan, math.nan
    objective = float(info.objective_function_value)
    bound = float(info.mip_dual_bound) if any(m.integer) else objective
    m.stats = {"bb_nodes": int(info.mip_node_count), "lp_iterations": int(info.simplex_iteration_count)}
    return name, list(h.getSolution().col_value), objective, _gap(objective, bound)


# the signals whose handlers raise while HiGHS solves: Ctrl-C, a run's SIGTERM, the planning deadline's alarm
_SOLVE_SIGNALS = {signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGALRM", signal.SIGTERM)}


def _run_interruptibly(h: highspy.Highs) -> None:
    """`h.run()` in HiGHS's solver thread while this one waits, so a signal (Ctrl-C; a run's SIGTERM; the planning
    deadline) is acted on at once: HiGHS is cancelled at its next interrupt check, its thread joined, and the
    exception goes on (h.run() held the signal until the solve ended, up to time_limit_s).

    The thread must never outlive the exception: a process that exits while HiGHS runs aborts ("terminate called
    without an active exception") or hangs. So the signals wait while startSolve() starts it (one landing there
    would leave the thread running, unowned), and a second signal (another Ctrl-C, the deadline's repeating alarm)
    during the join cancels again rather than cutting the join short. Left: Ctrl-C within a millisecond of a solve's
    start still ends in that abort about one time in three, after "interrupted" (in HiGHS's teardown; none later)."""
    h.HandleUserInterrupt = True  # HiGHS's interrupt callbacks stop the solve once cancelSolve() was called
    masked = hasattr(signal, "pthread_sigmask")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SOLVE_SIGNALS) if masked else set()
    try:
        h.startSolve()  # its thread inherits the mask: the signals are this thread's to handle
        try:
            if masked:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal that waited is raised in here
            while not h.wait(0.1)[0]:
                pass
        except BaseException:
            h.cancelSolve()
            _join_solver(h)
            raise
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _join_solver(h: highspy.Highs) -> None:
    """Wait until HiGHS's thread (cancelled) has stopped, whatever signal comes meanwhile."""
    while True:
        try:
            if h.wait(0.1)[0]:
                return
        except BaseException:
            h.cancelSolve()


def _solve_scip(m: _Model, time_limit_s: float, mip_rel_gap: float,
                start: dict[int, float] | None = None) -> tuple[str, list[float] | None, float, float]:
    try:
        import pyscipopt
    except ImportError:
        raise LazyTrainError("--solver scip needs PySCIPOpt: pip install 'lazytrain[scip]' (or use --solver highs)") \
            from None
    s = pyscipopt.Model()
    s.hideOutput()
    s.setParam("limits/time", float(time_limit_s))
    s.setParam("limits/gap", float(mip_rel_gap))
    cols = [s.addVar(name, vtype="B" if (t and lb >= 0 and ub <= 1) else ("I" if t else "C"),
                     lb=lb, ub=None if ub == INF else ub, obj=c)
            for name, lb, ub, c, t in zip(m.names, m.lb, m.ub, m.cost, m.integer, strict=True)]
    for name, coefs, lo, hi in m.rows:
        expr = pyscipopt.quicksum(coef * cols[k] for k, coef in coefs.items())
        if lo == hi:
            s.addCons(expr == lo, name=name)
        else:
            if lo > -INF:
                s.addCons(expr >= lo, name=name + "_lo")
            if hi < INF:
                s.addCons(expr <= hi, name=name)
    s.addObjoffset(m.offset)
    s.optimize()
    status = {"timelimit": "time_limit", "gaplimit": "optimal_within_gap"}.get(s.getStatus(), s.getStatus())
    if s.getNSols() == 0:
        return status, None, math.nan, math.nan
    sol = s.getBestSol()
    objective = float(s.getObjVal())
    return status, [sol[v] for v in cols], objective, \
        _gap(objective, float(s.getDualbound()))


def _gap(objective: float, bound: float) -> float:
    """Relative gap (objective - bound) / max(|objective|, 1 ms); below 1 microsecond (the solvers' tolerance on
    an objective in seconds) it is 0. Without this an objective made only of tie-breakers (~1e-4 s) would turn
    a nanosecond of tolerance into a visible "gap"."""
    if not math.isfinite(bound):
        return math.inf
    absolute = max(0.0, objective - bound)
    return 0.0 if absolute < 1e-6 else absolute / max(abs(objective), 1e-3)


SOLVERS = {"highs": _solve_highs, "scip": _solve_scip}


# ---- public entry points ------------------------------------------------------------------------------
def solve_instance(inst: PlanningInstance, *, max_segment: int = DEFAULT_MAX_SEGMENT,
                   time_limit_s: float = DEFAULT_TIME_LIMIT_S, mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
                   solver: str = DEFAULT_SOLVER, fixed_tiers: Sequence[str] | None = None,
                   start_tiers: Sequence[str] | None = None, deadline_s: float | None = None,
                   kept_layers: int | None = None, start_kept: int = 0) -> MilpSolution:
    """Build and solve the MILP for `inst`. Infeasible (or no incumbent in time) -> LazyTrainError with numbers.

    kept_layers: K fixed (Plan.kept_layers); None = the MILP decides K, or 0 with `fixed_tiers` (a rule's plan).
    start_tiers, start_kept: a plan to warm-start from (re-planning; HiGHS only, ignored by SCIP).
    deadline_s (a `time.perf_counter()` instant): the solver gets at most what is left of it after the build."""
    if solver not in SOLVERS:
        raise LazyTrainError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
    if not isinstance(max_segment, int) or max_segment < 1:
        raise LazyTrainError(f"max segment length must be a positive integer, got {max_segment!r}")
    if not time_limit_s > 0:
        raise LazyTrainError(f"time limit must be > 0 seconds, got {time_limit_s}")
    if not 0 <= mip_rel_gap < 1:
        raise LazyTrainError(f"relative MIP gap must be in [0, 1), got {mip_rel_gap}")
    t0 = time.perf_counter()
    if fixed_tiers is not None:  # a long recompute block of a rule must still be a candidate edge
        kept = [i for i, t in enumerate(fixed_tiers) if t != "recompute"]
        max_segment = max([max_segment, *(b - a for a, b in zip(kept, kept[1:], strict=False))])
    try:
        if kept_layers is None and fixed_tiers is not None:
            kept_layers = 0
        form = _Formulation(inst, min(max_segment, inst.num_layers), fixed_tiers, kept_layers)
    except _Infeasible as why:
        raise LazyTrainError(_infeasible_message(inst, max_segment, str(why))) from None
    m = form.m
    if deadline_s is not None:
        left_s = deadline_s - time.perf_counter()
        if left_s <= 0:
            raise LazyTrainError(f"building the MILP took {time.perf_counter() - t0:.1f} s, past the time limit; raise "
                                 "--time-limit or lower --max-segment")
        time_limit_s = min(time_limit_s, left_s)
    start = form.start_values(start_tiers, start_kept) if start_tiers is not None else None
    status, values, objective, gap = SOLVERS[solver](m, time_limit_s, mip_rel_gap, start)
    seconds = time.perf_counter() - t0
    if values is None:
        if status == "infeasible" or status.startswith("infeas"):
            raise LazyTrainError(_infeasible_message(inst, max_segment, "fixed tiers" if fixed_tiers else ""))
        raise LazyTrainError(
            f"the {solver} solver found no plan within its time limit of {time_limit_s:g} s (status {status}); "
            "raise --time-limit or lower --max-segment"
        )
    tiers = _read_tiers(form, values)
    kept = sum(values[y] > 0.5 for y in form.y)
    step_s = m.offset + values[form.S]
    report = SolveReport(
        planner="milp", solver=solver, status=status, objective=objective, gap=gap, seconds=seconds,
        num_variables=len(m.names), num_constraints=len(m.rows),
        options={"max_segment": max_segment, "time_limit_s": time_limit_s, "mip_rel_gap": mip_rel_gap,
                 "num_binaries": sum(m.integer) - len(form.counts), "fixed_tiers": fixed_tiers is not None,
                 "build_s": round(sum(form.build_s.values()), 4), "step_s": step_s,
                 "optimizer_mode": inst.optimizer_mode, "kept_layers": kept, **m.stats,
                 **({"staging_depth": inst.staging_depth} if inst.staging_depth else {}),
                 **({"world_size": inst.topology.world_size, "nodes": inst.topology.nodes}
                    if inst.topology.parallel else {})},
    )
    return MilpSolution(tiers=tiers, transfers=plan_transfers(tiers, inst), report=report, step_s=step_s,
                        kept_layers=kept)


def _read_tiers(form: _Formulation, values: list[float]) -> tuple[str, ...]:
    def on(var: int) -> bool:
        return values[var] > 0.5

    return tuple("gpu" if on(form.g[i]) else "cpu" if on(form.c[i]) else "nvme" if on(form.n[i]) else "recompute"
                 for i in range(form.L + 1))


def plan_transfers(tiers: Sequence[str], inst: PlanningInstance) -> tuple[Transfer, ...]:
    """The windows the step program moves each offloaded boundary in (plan/schedule.py): d2h in forward window
    i, nvme write in i+1 (L = the loss head); for segment (i, e) h2d in backward window e and nvme read in e+1
    (L = the loss head, where the last segment's start reloads)."""
    L, A = inst.num_layers, inst.boundary_bytes
    out: list[Transfer] = []
    for i, e in segments_of(tuple(tiers)):
        if i == 0 or tiers[i] not in OFFLOADED:
            continue
        num_bytes = int(round(A[i]))
        out.append(Transfer(boundary=i, window=i, link="d2h", num_bytes=num_bytes))
        if tiers[i] == "nvme":
            out.append(Transfer(boundary=i, window=i + 1, link="nvme_write", num_bytes=num_bytes))
            out.append(Transfer(boundary=i, window=min(e + 1, L), link="nvme_read", num_bytes=num_bytes))
        out.append(Transfer(boundary=i, window=e, link="h2d", num_bytes=num_bytes))
    return tuple(out)


def _infeasible_message(inst: PlanningInstance, max_segment: int, detail: str) -> str:
    A = max(inst.boundary_bytes)
    need = inst.min_gpu_act_bytes()
    if inst.gpu_act_bytes < need:
        return (
            f"no placement fits on the device: boundary activations need at least {format_bytes(need)} "
            f"(4 boundaries of {format_bytes(A)}) but the GPU cap {format_bytes(inst.gpu_mem_cap_bytes)} minus static "
            f"{format_bytes(inst.static_device_bytes)} leaves {format_bytes(inst.gpu_act_bytes)}; "
            "raise --gpu-mem-cap or lower --batch-size"
        )
    interior = math.ceil(inst.num_layers / max_segment) - 1
    return (
        f"no placement fits{' with ' + detail if detail else ''}: a boundary is {format_bytes(A)}, the device has "
        f"{format_bytes(inst.gpu_act_bytes)} for activations, cpu {format_bytes(inst.cpu_act_bytes)}, nvme "
        f"{format_bytes(inst.nvme_act_bytes)}, and max segment {max_segment} keeps >= {interior} interior "
        "boundaries; raise --gpu-mem-cap, --cpu-act-budget, --nvme-act-budget or --max-segment, or lower --batch-size"
    )


def solve_milp(cost: CostModel, budgets: Budgets | None = None, *, max_segment: int = DEFAULT_MAX_SEGMENT,
               time_limit_s: float = DEFAULT_TIME_LIMIT_S, mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
               solver: str = DEFAULT_SOLVER,
               fixed_tiers: Sequence[str] | None = None, start_tiers: Sequence[str] | None = None,
               deadline_s: float | None = None, optimizer_mode: str = "overlap",
               topology: Topology = ONE_RANK, kept_layers: int | None = None, start_kept: int = 0,
               staging_depth: int = 0) -> Plan:
    """Solve the MILP for a CostModel under Budgets and return the Plan (Contract 1, docs/architecture.md); its report's
    `options["step_s"]` is the MILP's step seconds of the plan for `optimizer_mode` on one rank of `topology`.
    kept_layers: K fixed, or None: the MILP decides how many layers keep their graphs. staging_depth: D >= 1 for a
    cost model with its optimizer state on NVMe (the planner tries each D the host memory allows)."""
    inst = instance_from_cost(cost, budgets, optimizer_mode=optimizer_mode, topology=topology,
                              staging_depth=staging_depth)
    solution = solve_instance(inst, max_segment=max_segment, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap,
                              solver=solver, fixed_tiers=fixed_tiers, start_tiers=start_tiers, deadline_s=deadline_s,
                              kept_layers=kept_layers, start_kept=start_kept)
    plan = to_plan(solution, cost.spec, workload=getattr(cost, "workload", None), budgets=budgets)
    return replace(plan, optimizer_offload="nvme" if staging_depth else "host", staging_depth=staging_depth)


def milp_step_s(tiers: Sequence[str], inst: PlanningInstance, kept_layers: int = 0) -> float | None:
    """The MILP's step seconds of fixed `tiers` and `kept_layers` (its objective without the tie-breakers),
    whatever the memory budgets (a rule's plan may be over the cap); None for tiers the MILP does not express (the
    last segment's start on nvme: the program chains its read, spill and h2d in the head window)."""
    starts = [s for s, _ in segments_of(tuple(tiers))]
    if tiers[starts[-1]] == "nvme":
        return None
    relaxed = replace(inst, gpu_act_bytes=INF, cpu_act_bytes=INF, nvme_act_bytes=INF if "nvme" in tiers else 0.0)
    return solve_instance(relaxed, fixed_tiers=tiers, max_segment=inst.num_layers, kept_layers=kept_layers).step_s


def to_plan(solution: MilpSolution, spec: Any, workload: Any = None, budgets: Any = None) -> Plan:
    """Attach model identity and budgets to a solution."""
    from lazytrain.plan.plan import spec_of

    spec = spec_of(spec)
    budgets_bytes = {k: int(v) for k, v in (budgets.to_dict() if budgets is not None else {}).items()
                     if v is not None}
    plan = Plan.from_tiers(spec, solution.tiers, workload=workload)
    return Plan(tiers=plan.tiers, model_fingerprint=plan.model_fingerprint, model_name=plan.model_name,
                workload=workload, transfers=solution.transfers, budgets_bytes=budgets_bytes, report=solution.report,
                kept_layers=solution.kept_layers)
