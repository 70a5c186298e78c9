"""The paper-mode MILP: place every layer boundary on gpu / cpu / nvme / recompute, assign transfers to windows.

The formulation follows LazyTrain §2 (reference/lazytrain-paper.md) variable by variable, with the windows
and the device memory stated exactly for the runtime schedule (shared schedule contract, Contract 2).

Index sets
    j in J = {0..L-1}          layers; layer j maps boundary j -> j+1
    i in B = {0..L}            boundaries; 0 = embedding output, L = last layer output (both always gpu)
    (s, e) in E                candidate recompute edges, 0 <= s < e <= L, e - s <= K (max segment length)
    w in W = {0..L}            compute windows. Window w < L is layer w; window L is the loss head
                               (its forward and backward run back to back).

Windows (where a transfer may overlap compute):
    Offload links (d2h, nvme_write) use FORWARD windows: window w < L is the forward of layer w, window L the
    loss head. Boundary i exists once layer i-1 has run. Its d2h uses window i only: the step program frees
    boundary i's device copy once layer i has read it, after waiting for the d2h (so what does not fit in
    window i is exposed, and the memory rows need not hold i longer); its nvme_write may use windows w >= i.
    Reload links (h2d, nvme_read) use BACKWARD windows: window w < L is the backward of layer w (its recompute
    forward, when boundary w+1 is recomputed, plus its autograd forward+backward), window L the loss head.
    The runtime issues the reload of boundary i (the start of segment (i, e)) when the backward of the segment
    after it, (e, e2), begins, and needs it before segment (i, e) begins; the last segment's start is
    reloaded during the loss head. So boundary i may be reloaded in window w iff e <= w < e2 (exactly one
    boundary of i+1..w is materialized), or w = L when e = L.

Parameters (all from the CostModel; bytes, seconds, bytes/second)
    rho[j]      forward time of layer j             beta[j]   autograd re-forward + backward time of layer j
    rho[L]      loss head time (forward+backward)   A[i]      bytes of boundary i
    p[j]        weight bytes of layer j (h2d)       p[L]      loss-head weight bytes
    M_G         device bytes for activations = gpu memory cap - static device bytes (weight and gradient
                slots, the largest working set, boundary-gradient buffers)
    M_C, M_N    host DRAM / NVMe bytes for offloaded activations
    B_D, B_H, B_W, B_R   d2h, h2d, NVMe write, NVMe read rates
    U_F         static device bytes not yet allocated during the forward (gradient slots, boundary gradients)
    T_F, T_B    extra transient device bytes in the forward / backward (0 for the shared schedule)
    R[s,e]      recompute time of edge (s, e) = sum_{j=s..e-2} rho[j]  (0 when e = s+1)
    Window capacities and mandatory traffic (weights streamed by the window itself):
      forward  C^D[w] = B_D rho[w],  G[w] = 0 (w < L), G[L] = p[L] (loss-head gradients);  C^W[w] = B_W rho[w]
      backward C^H[w] = B_H (beta[w] + rho[w] (1 - z[w+1])),  P[w] = p[w] (2 - z[w+1])  (the recompute
               forward streams the weights once more, Contract 2);  C^R[w] = B_R (beta[w] + rho[w] (1 - z[w+1]));
               window L: C^H[L] = B_H rho[L], P[L] = p[L], C^R[L] = B_R rho[L].
    Forward h2d (weights only) and backward d2h (gradients only) carry no activation: their exposure is a
    constant of the model and, like the paper's baseline, is left out of the objective.

Variables (the paper's symbols)
    x[s,e] in {0,1}   edge (s, e) is a segment: s and e materialized, s+1..e-1 recomputed
    z[i] in {0,1}     boundary i is materialized;  g[i], c[i], n[i] in {0,1}: its home is gpu / cpu / nvme
    d[i,w], h[i,w]    bytes of boundary i moved d2h (forward window w) / h2d (backward window w)
    q[i,w], r[i,w]    bytes of boundary i written to / read from NVMe in window w
    eps^D[w], eps^H[w], eps^W[w], eps^R[w] >= 0   bytes of window w's traffic not hidden under its compute
    v[s',s] >= 0      = x[s',s] (c[s'] + n[s']): the backward of the segment starting at s holds the reload
                      buffer of the previous segment's start s' (linearized: v >= x + c + n - 1)

Constraints (one `_add_<family>` each; equations repeated there)
    path, placement, capacity (cpu, nvme), gpu_memory (forward peak and every backward segment: the transient
    memory of recompute blocks and reload buffers, the paper's weak spot 3), d2h/h2d/nvme windows, reload windows,
    reload bounds (a valid inequality from the per-segment closed form: same optimum, stronger LP bound).

Formulations
    "paper" (default): the above, with the per-window reload variables h[i,w], r[i,w].
    "segment": h and r replaced by one exposure per candidate segment (the closed form of the per-window LP, see
    `_add_segment_reloads`); same optimum, about 5x fewer rows, much faster beyond ~80 layers.

Objective (seconds)
    min sum R[s,e] x[s,e] + lambda_z sum z[i] + lambda_c sum c[i] + lambda_n sum n[i]
        + sum_w ( Delta^D[w] / B_D + Delta^H[w] / B_H + eps^W[w] / B_W + eps^R[w] / B_R )
    with Delta[w] = eps[w] - max(0, mandatory[w] - C[w]) evaluated with every boundary materialized: the exposure
    that mandatory weight/gradient traffic causes anyway is subtracted as a constant, so the objective is the
    time that boundary placement adds (recompute + exposed activation traffic + the weight re-stream of
    recomputed layers). lambda_c (prefer gpu over cpu when both are free) is ours; the paper has lambda_z, lambda_n.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import TIERS, Plan, SolveReport, Transfer
from lazytrain.units import format_bytes

log = logging.getLogger(__name__)

DEFAULT_MAX_SEGMENT = 8
FORMULATIONS = ("paper", "segment")
INF = math.inf


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
    fwd_unallocated_bytes: float = 0.0  # U_F: static bytes the forward does not hold yet (gradient slots, grads)
    fwd_transient_bytes: float = 0.0  # T_F: extra device bytes in the forward beyond the boundaries
    bwd_transient_bytes: float = 0.0  # T_B: extra device bytes in the backward beyond boundaries and reloads
    lambda_z: float = 1e-5  # s per materialized boundary (tie-breaker; above the solvers' 1e-6 tolerances)
    lambda_c: float = 1e-5  # s per cpu boundary (prefer gpu when both are free)
    lambda_n: float = 1e-4  # s per nvme boundary
    static_device_bytes: float = 0.0  # for messages only: what the cap lost to static memory
    gpu_mem_cap_bytes: float = 0.0  # for messages only

    def __post_init__(self) -> None:
        L = len(self.forward_s)
        for name in ("forward_s", "backward_s", "boundary_bytes", "param_bytes"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if L < 1 or len(self.backward_s) != L or len(self.param_bytes) != L or len(self.boundary_bytes) != L + 1:
            raise LazyTrainError(
                f"planning instance: need L >= 1 layers with L forward/backward/param entries and L+1 boundaries, "
                f"got {L}, {len(self.backward_s)}, {len(self.param_bytes)}, {len(self.boundary_bytes)}"
            )
        values = [*self.forward_s, *self.backward_s, *self.boundary_bytes, *self.param_bytes, self.head_s,
                  self.head_param_bytes, self.cpu_act_bytes, self.nvme_act_bytes]
        if any(not v >= 0 for v in values):
            raise LazyTrainError("planning instance: times, bytes and budgets must be >= 0")
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise LazyTrainError(f"planning instance: {name} must be > 0, got {getattr(self, name)}")

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def window_s(self, w: int) -> float:
        """Forward compute time of window w (rho[w]; the loss head for w = L)."""
        return self.head_s if w == self.num_layers else self.forward_s[w]

    def recompute_s(self, s: int, e: int) -> float:
        """R[s,e] = sum_{j=s..e-2} rho[j]: the block's last layer output is e, already materialized."""
        return sum(self.forward_s[s:e - 1])

    def min_gpu_act_bytes(self) -> float:
        """A lower bound on the M_G any plan needs: the last layer's backward holds boundaries 0, L-1 and L (and a
        reload buffer when L > 2)."""
        A, L = self.boundary_bytes, self.num_layers
        on_device = A[0] + A[L] + (A[L - 1] if L > 1 else 0.0) + (max(A) if L > 2 else 0.0)
        fwd = A[0] + A[L] + (A[L - 1] if L > 1 else 0.0) + self.fwd_transient_bytes - self.fwd_unallocated_bytes
        return max(on_device + self.bwd_transient_bytes, fwd)


def instance_from_cost(cost: Any, budgets: Any = None, **options: Any) -> PlanningInstance:
    """A PlanningInstance from a CostModel (spec/cost.py) and Budgets (plan/budgets.py).

    M_G = (budgets.gpu_mem_cap_bytes or the device's memory) - cost.static_device_bytes(); M_C = cpu activation
    budget (None = unlimited); M_N = nvme activation budget (None = unlimited, 0 = no nvme tier).
    U_F = the gradient slots and boundary-gradient buffers, which the schedule allocates only at the loss head.
    `options` override PlanningInstance fields (e.g. lambda_z).
    """
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
        static_device_bytes=static,
        gpu_mem_cap_bytes=float(gpu_cap),
    )
    breakdown = cost.device_breakdown() if hasattr(cost, "device_breakdown") else {}
    fields["fwd_unallocated_bytes"] = float(breakdown.get("grad_slots", 0) + breakdown.get("boundary_grads", 0))
    fields.update(options)
    return PlanningInstance(**fields)


# ---- the result of a solve (solution, not yet a Plan) ----------------------------------------------
@dataclass(frozen=True)
class MilpSolution:
    """Tiers per boundary, transfers per window and the solve report; `to_plan` attaches a model."""

    tiers: tuple[str, ...]
    transfers: tuple[Transfer, ...]
    report: SolveReport
    exposed_bytes: dict[str, tuple[float, ...]] = field(default_factory=dict)  # eps per link, per window


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
                   "fwd_transient_bytes", "bwd_transient_bytes", "static_device_bytes", "gpu_mem_cap_bytes")
    changes: dict[str, Any] = {k: getattr(inst, k) / unit for k in byte_fields}
    changes["boundary_bytes"] = tuple(a / unit for a in inst.boundary_bytes)
    changes["param_bytes"] = tuple(p / unit for p in inst.param_bytes)
    return replace(inst, **changes)


class _Formulation:
    def __init__(self, inst: PlanningInstance, max_segment: int, fixed_tiers: Sequence[str] | None,
                 formulation: str = "paper") -> None:
        self.unit = max(max(inst.boundary_bytes), 1.0)  # bytes per model unit
        inst = _scaled(inst, self.unit)
        self.inst, self.K, self.L = inst, max_segment, inst.num_layers
        self.per_segment = formulation == "segment"
        self.m = _Model()
        self.fixed = tuple(fixed_tiers) if fixed_tiers is not None else None
        self.build_s: dict[str, float] = {}
        families = [self._add_variables, self._add_path, self._add_placement, self._add_capacity,
                    self._add_gpu_memory, self._add_d2h_windows, self._add_nvme_write_windows, self._add_objective]
        if self.per_segment:
            families += [self._add_segment_reloads]
        else:
            families += [self._add_h2d_windows, self._add_nvme_read_windows, self._add_reload_windows,
                         self._add_reload_bounds]
        for family in families:
            t0 = time.perf_counter()
            family()
            self.build_s[family.__name__.removeprefix("_add_")] = time.perf_counter() - t0
        log.debug("MILP build seconds per family: %s", self.build_s)

    # -- helpers --
    def start_values(self, tiers: Sequence[str]) -> dict[int, float] | None:
        """Column values of the binaries for `tiers` (a warm start); None when a segment is not a candidate."""
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
        return values

    def offload_windows(self, i: int) -> range:
        """Forward windows that may carry boundary i's d2h / nvme write: w = i..L."""
        return range(i, self.L + 1)

    def reload_windows(self, i: int) -> list[int]:
        """Candidate backward windows for boundary i's reload (the reload-window rows pick the segment after i's).

        That segment ends at most 2K after i; window L (loss head) only if i's segment can be the last.
        """
        body = list(range(i + 1, min(self.L - 1, i + 2 * self.K - 1) + 1))
        return body + ([self.L] if i >= self.L - self.K else [])

    def _finite(self, rate: float) -> bool:
        return math.isfinite(rate)

    # -- families --
    def _add_variables(self) -> None:
        m, L, K, inst = self.m, self.L, self.K, self.inst
        # x[s,e]: candidate recompute edges, block length <= K.
        self.x = {(s, e): m.var(f"x[{s},{e}]", 0, 1, inst.recompute_s(s, e), True)
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
        if self.fixed is not None:
            self._fix_tiers()
        offloadable = range(1, L)
        use_nvme = nvme_ub > 0
        # d2h of boundary i only in window i: the runtime frees i's device copy after layer i, waiting for its d2h
        self.d = {(i, i): m.var(f"d[{i},{i}]") for i in offloadable}
        self.h = {} if self.per_segment else {(i, w): m.var(f"h[{i},{w}]") for i in offloadable
                                              for w in self.reload_windows(i)}
        nvme_movers = offloadable if use_nvme else range(0)
        self.q = {(i, w): m.var(f"q[{i},{w}]") for i in nvme_movers for w in self.offload_windows(i)}
        self.r = {} if self.per_segment else {(i, w): m.var(f"r[{i},{w}]") for i in nvme_movers
                                              for w in self.reload_windows(i)}
        windows = range(L + 1)
        self.epsD = [m.var(f"epsD[{w}]") for w in windows] if self._finite(inst.d2h_bytes_per_s) else []
        self.epsH = ([m.var(f"epsH[{w}]") for w in windows]
                     if self._finite(inst.h2d_bytes_per_s) and not self.per_segment else [])
        self.epsW = ([m.var(f"epsW[{w}]") for w in windows]
                     if use_nvme and self._finite(inst.nvme_write_bytes_per_s) else [])
        self.epsR = ([m.var(f"epsR[{w}]") for w in windows]
                     if use_nvme and self._finite(inst.nvme_read_bytes_per_s) and not self.per_segment else [])

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

    def _add_capacity(self) -> None:
        # sum_i A[i] c[i] <= M_C ;  sum_i A[i] n[i] <= M_N
        A, inst = self.inst.boundary_bytes, self.inst
        if math.isfinite(inst.cpu_act_bytes):
            self.m.row("cap_cpu", {self.c[i]: A[i] for i in range(self.L + 1)}, hi=inst.cpu_act_bytes)
        if 0 < inst.nvme_act_bytes < INF:
            self.m.row("cap_nvme", {self.n[i]: A[i] for i in range(self.L + 1)}, hi=inst.nvme_act_bytes)

    def _add_gpu_memory(self) -> None:
        """The paper's sum A g <= M_G, made exact for the schedule (weak spot 3: transient memory). The rows count
        what the simulator's (and executor's) device accounting holds at each phase's peak, beyond the static
        bytes (slots, the largest working set, boundary gradients) already taken out of M_G."""
        A, L, inst, m = self.inst.boundary_bytes, self.L, self.inst, self.m
        # Forward peak (the last layer; earlier layers hold a subset for equal A): every gpu boundary below L-1,
        # the last layer's input L-1 and output L whatever their tier (an offloaded copy is freed once its d2h is
        # done); the gradient slots and boundary gradients are not allocated yet (U_F):
        #   sum_{i <= L-2} A[i] g[i] + A[L-1] + A[L] + T_F <= M_G + U_F
        const = A[L] + A[L - 1] + inst.fwd_transient_bytes - inst.fwd_unallocated_bytes
        m.row("gpu_fwd", {self.g[i]: A[i] for i in range(0, L - 1)}, hi=inst.gpu_act_bytes - const)
        # Reload buffer: while segment (s, e) runs backward, the start s' of the previous segment (s', s) is being
        # reloaded into a device buffer when it is offloaded:  v[s',s] >= x[s',s] + c[s'] + n[s'] - 1.
        self.v = {}
        for (s0, s1), xv in self.x.items():
            if s0 == 0 or s1 == L:
                continue  # boundary 0 is gpu; no segment starts at L
            v = m.var(f"v[{s0},{s1}]")
            self.v[s0, s1] = v
            m.row(f"reload_buffer[{s0},{s1}]", {v: -1.0, xv: 1.0, self.c[s0]: 1.0, self.n[s0]: 1.0}, hi=1.0)
        # Backward of segment (s, e), at layer e-1's autograd: gpu boundaries below s, all of s..e (s reloaded or
        # kept, s+1..e-1 recomputed, e freed only after this layer), the reload buffer of the previous start:
        #   sum_{i<s} A[i] g[i] + sum_e x[s,e] sum_{k=s..e} A[k] + sum_{s'} A[s'] v[s',s] + T_B <= M_G   (s < L)
        # (for s not materialized the row is implied by the row of the segment that contains s).
        for s in range(L):
            coefs = {self.g[i]: A[i] for i in range(s)}
            for (s2, e), xv in self.x.items():
                if s2 == s:
                    coefs[xv] = sum(A[s:e + 1])
            for (s0, s1), v in self.v.items():
                if s1 == s:
                    coefs[v] = A[s0]
            m.row(f"gpu_bwd[{s}]", coefs, hi=inst.gpu_act_bytes - inst.bwd_transient_bytes)

    def _flow_rows(self, name: str, flow: dict[tuple[int, int], int], tiers: list[list[int]]) -> None:
        # sum_w flow[i,w] = A[i] * (sum of the tier indicators that use this link)
        A = self.inst.boundary_bytes
        for i in range(1, self.L):
            coefs = {v: 1.0 for (b, _), v in flow.items() if b == i}
            for tier in tiers:
                _add(coefs, tier[i], -A[i])
            self.m.row(f"{name}_sum[{i}]", coefs, 0, 0)

    def _window_rows(self, name: str, flow: dict[tuple[int, int], int], eps: list[int], rate: float,
                     mandatory_minus_capacity: list[tuple[float, dict[int, float]]]) -> None:
        # sum_i flow[i,w] + mandatory[w] - C[w] <= eps[w] ; the last two may depend on z[w+1] (recompute).
        for w in range(self.L + 1):
            const, z_terms = mandatory_minus_capacity[w]
            coefs = {v: 1.0 for (_, w2), v in flow.items() if w2 == w}
            if not math.isfinite(rate):
                continue  # unlimited link: nothing is ever exposed
            for var, coef in z_terms.items():
                _add(coefs, var, coef)
            _add(coefs, eps[w], -1.0)
            self.m.row(f"{name}[{w}]", coefs, hi=-const)

    def _add_d2h_windows(self) -> None:
        # sum_w d[i,w] = A[i] (c[i] + n[i]) ;  sum_{i <= w} d[i,w] + G[w] <= C^D[w] + eps^D[w]   (forward windows)
        inst, L = self.inst, self.L
        self._flow_rows("d2h", self.d, [self.c, self.n])
        B = inst.d2h_bytes_per_s
        rows = [(-B * inst.forward_s[w], {}) for w in range(L)] + [(inst.head_param_bytes - B * inst.head_s, {})]
        self._window_rows("d2h_window", self.d, self.epsD, B, rows)

    def _backward_rows(self, B: float, mandatory: bool) -> list[tuple[float, dict[int, float]]]:
        """mandatory[w] - C[w] for backward windows as constant + z terms (recompute lengthens the window and, on
        h2d, streams the layer's weights a second time)."""
        inst, rows = self.inst, []
        for w in range(self.L):
            p = inst.param_bytes[w] if mandatory else 0.0
            # P[w] - C[w] = 2 p - B (beta + rho) - z[w+1] (p - B rho)
            const = 2 * p - B * (inst.backward_s[w] + inst.forward_s[w])
            rows.append((const, {self.z[w + 1]: -(p - B * inst.forward_s[w])}))
        head_p = inst.head_param_bytes if mandatory else 0.0
        rows.append((head_p - B * inst.head_s, {}))
        return rows

    def _add_h2d_windows(self) -> None:
        # sum_w h[i,w] = A[i] (c[i] + n[i]) ;  sum_i h[i,w] + P[w] <= C^H[w] + eps^H[w]   (backward windows)
        self._flow_rows("h2d", self.h, [self.c, self.n])
        B = self.inst.h2d_bytes_per_s
        if math.isfinite(B):
            self._window_rows("h2d_window", self.h, self.epsH, B, self._backward_rows(B, mandatory=True))

    def _add_nvme_write_windows(self) -> None:
        # sum_w q[i,w] = A[i] n[i] ;  sum_{i <= w} q[i,w] <= C^W[w] + eps^W[w]   (forward windows)
        if not self.q:
            return
        inst = self.inst
        self._flow_rows("nvme_write", self.q, [self.n])
        B = inst.nvme_write_bytes_per_s
        if math.isfinite(B):
            rows = [(-B * inst.window_s(w), {}) for w in range(self.L + 1)]
            self._window_rows("nvme_write_window", self.q, self.epsW, B, rows)

    def _add_nvme_read_windows(self) -> None:
        # sum_w r[i,w] = A[i] n[i] ;  sum_i r[i,w] <= C^R[w] + eps^R[w]   (backward windows)
        if not self.r:
            return
        self._flow_rows("nvme_read", self.r, [self.n])
        B = self.inst.nvme_read_bytes_per_s
        if math.isfinite(B):
            self._window_rows("nvme_read_window", self.r, self.epsR, B, self._backward_rows(B, mandatory=False))

    def _add_reload_windows(self) -> None:
        # Reload of boundary i only inside the segment after i's segment (i, e), i.e. e <= w < e2 with (e, e2) the
        # next segment; or in the loss head (w = L) when (i, L) is the last segment:
        #   h[i,w] <= A[i] sum_{i<e<=w} x[i,e]                            (i's segment has ended by window w)
        #   h[i,w] <= A[i] (1 - x[i,e] + sum_{b>w} x[e,b])   for i<e<=w   (and the segment after it has not)
        #   h[i,L] <= A[i] x[i,L]                                         (likewise r[i,w])
        A, m, L, x = self.inst.boundary_bytes, self.m, self.L, self.x
        for name, flow in (("h", self.h), ("r", self.r)):
            for (i, w), v in flow.items():
                if w == L:
                    m.row(f"reload_{name}_head[{i}]", {v: 1.0, x[i, L]: -A[i]}, hi=0.0)
                    continue
                ends = [e for e in range(i + 1, w + 1) if (i, e) in x]
                m.row(f"reload_{name}_after[{i},{w}]", {v: 1.0, **{x[i, e]: -A[i] for e in ends}}, hi=0.0)
                for e in ends:
                    coefs = {v: 1.0, x[i, e]: A[i]}
                    for b in range(w + 1, L + 1):
                        if (e, b) in x:
                            coefs[x[e, b]] = -A[i]
                    m.row(f"reload_{name}_before[{i},{w},{e}]", coefs, hi=A[i])

    def _add_reload_bounds(self) -> None:
        """formulation="paper": the segment closed form as valid inequalities on the per-window eps (same optimum;
        a much stronger LP bound, so that long models prove optimality):
          sum_w eps^H[w] >= sum_w max(0, P[w] - C[w]) + sum_{(e,e2)} eps^H[e,e2]     (see _add_segment_reloads)
        """
        self._add_segment_reloads(as_bounds=True)

    def _add_segment_reloads(self, as_bounds: bool = False) -> None:
        """formulation="segment": the reload links per segment instead of per window (same optimum, far fewer rows).

        Each backward window serves only the reload of the previous segment's start, so for fixed tiers the
        exposure of a reload link is
          sum_w max(0, P[w] - C[w])  +  max(0, A[i] - sum_{w in the next segment} max(0, C[w] - P[w]))
        (the closed form of the per-window LP). The first sum is linear in z (each recomputed layer w adds
        delta[w] = max(0, P - C | z[w+1] = 0) - max(0, P - C | z[w+1] = 1), charged on the edges x[s,e]); the second
        is an exposure per candidate segment (e, e2):
          eps^H[e,e2] >= sum_i A[i] v[i,e] - S^H[e,e2] - A_max (1 - x[e,e2]),   S^H[e,e2] = sum_{w=e..e2-1} slack[w]
          eps^H[L]    >= sum_i A[i] v[i,L] - S^H[L]                             (the loss head)
        with v[i,e] >= x[i,e] + c[i] + n[i] - 1 (the reload of i runs in the segment after (i, e)); likewise
        eps^R with n only and no weights on the NVMe link.
        """
        inst, m, L, x, A = self.inst, self.m, self.L, self.x, self.inst.boundary_bytes
        a_max = max(A)
        for (s0, s1), xv in x.items():  # v[i,L] too: the reload of the last segment's start, in the loss head
            if s0 > 0 and s1 == L:
                v = m.var(f"v[{s0},{s1}]")
                self.v[s0, s1] = v
                m.row(f"reload_buffer[{s0},{s1}]", {v: -1.0, xv: 1.0, self.c[s0]: 1.0, self.n[s0]: 1.0}, hi=1.0)
        self.vn = {}
        if inst.nvme_act_bytes > 0 and math.isfinite(inst.nvme_read_bytes_per_s):
            for (s0, s1), xv in x.items():
                if s0 > 0:
                    vn = m.var(f"vn[{s0},{s1}]")
                    self.vn[s0, s1] = vn
                    m.row(f"nvme_reload[{s0},{s1}]", {vn: -1.0, xv: 1.0, self.n[s0]: 1.0}, hi=1.0)

        def window_over(B: float, weights: bool, w: int, recomputed: bool) -> float:
            p = inst.param_bytes[w] * (2 if recomputed else 1) if weights else 0.0
            return p - B * (inst.backward_s[w] + (inst.forward_s[w] if recomputed else 0.0))

        for link, B, weights, indicator, per_window in (("H", inst.h2d_bytes_per_s, True, self.v, self.epsH),
                                                        ("R", inst.nvme_read_bytes_per_s, False, self.vn, self.epsR)):
            if not math.isfinite(B) or (link == "R" and not self.vn):
                continue
            cost = 0.0 if as_bounds else 1.0 / B
            segment_eps = []
            for (e, e2), xv in x.items():
                slack = sum(max(0.0, -window_over(B, weights, w, w < e2 - 1)) for w in range(e, e2))
                coefs = {iv: -A[i] for (i, e_), iv in indicator.items() if e_ == e}
                if coefs:
                    eps = m.var(f"eps{link}[{e},{e2}]", cost=cost)
                    segment_eps.append(eps)
                    coefs.update({eps: 1.0, xv: -a_max})
                    m.row(f"reload_{link}[{e},{e2}]", coefs, lo=-slack - a_max)
            head_slack = max(0.0, B * inst.head_s - (inst.head_param_bytes if weights else 0.0))
            coefs = {iv: -A[i] for (i, e_), iv in indicator.items() if e_ == L}
            if coefs:
                eps = m.var(f"eps{link}[{L}]", cost=cost)
                segment_eps.append(eps)
                m.row(f"reload_{link}[{L}]", {**coefs, eps: 1.0}, lo=-head_slack)
            # the mandatory part: per window max(0, P - C), i.e. its all-kept value + delta[w] (1 - z[w+1])
            delta = [max(0.0, window_over(B, weights, w, True)) - max(0.0, window_over(B, weights, w, False))
                     for w in range(L)]
            if not as_bounds:  # charge the recompute-induced weight exposure on the edges (the rest is baseline)
                for (s0, s1), xv in x.items():
                    m.cost[xv] += sum(delta[s0:s1 - 1]) / B
                continue
            base = (sum(max(0.0, window_over(B, weights, w, False)) for w in range(L))
                    + max(0.0, (inst.head_param_bytes if weights else 0.0) - B * inst.head_s))
            coefs = {eps: 1.0 for eps in per_window}
            for eps in segment_eps:
                coefs[eps] = -1.0
            for w in range(L):
                _add(coefs, self.z[w + 1], delta[w])
            m.row(f"reload_bound_{link}", coefs, lo=base + sum(delta))

    def _add_objective(self) -> None:
        # + sum_w (eps^D/B_D + eps^H/B_H + eps^W/B_W + eps^R/B_R) - baseline, the baseline being the exposure of
        # mandatory traffic with every boundary materialized: sum_w max(0, mandatory[w] - C[w]).
        inst, m = self.inst, self.m
        for eps, B in ((self.epsD, inst.d2h_bytes_per_s), (self.epsH, inst.h2d_bytes_per_s),
                       (self.epsW, inst.nvme_write_bytes_per_s), (self.epsR, inst.nvme_read_bytes_per_s)):
            for v in eps:
                m.cost[v] = 1.0 / B
        # formulation "segment" charges only the recompute-induced part of the mandatory h2d exposure (on x)
        m.offset = -(_d2h_baseline_s(inst) if self.per_segment else baseline_exposure_s(inst))


def _d2h_baseline_s(inst: PlanningInstance) -> float:
    B = inst.d2h_bytes_per_s
    return max(0.0, inst.head_param_bytes - B * inst.head_s) / B if math.isfinite(B) else 0.0


def baseline_exposure_s(inst: PlanningInstance) -> float:
    """Seconds of mandatory weight/gradient exposure on the windows the objective charges, with every boundary
    materialized (no recompute): the constant the paper subtracts."""
    L = inst.num_layers
    total = 0.0
    if math.isfinite(inst.d2h_bytes_per_s):  # forward windows carry gradients only in the loss head
        total += max(0.0, inst.head_param_bytes - inst.d2h_bytes_per_s * inst.head_s) / inst.d2h_bytes_per_s
    if math.isfinite(inst.h2d_bytes_per_s):
        B = inst.h2d_bytes_per_s
        total += sum(max(0.0, inst.param_bytes[w] - B * inst.backward_s[w]) for w in range(L)) / B
        total += max(0.0, inst.head_param_bytes - B * inst.head_s) / B
    return total


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
    h.run()
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
    return name, list(h.getSolution().col_value), objective, _gap(objective, bound)


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
def solve_instance(inst: PlanningInstance, *, max_segment: int = DEFAULT_MAX_SEGMENT, time_limit_s: float = 60.0,
                   mip_rel_gap: float = 0.0, solver: str = "highs", fixed_tiers: Sequence[str] | None = None,
                   formulation: str = "paper", start_tiers: Sequence[str] | None = None,
                   deadline_s: float | None = None) -> MilpSolution:
    """Build and solve the MILP for `inst`. Infeasible (or no incumbent in time) -> LazyTrainError with numbers.

    start_tiers: a plan's tiers to warm-start from (re-planning; HiGHS only, ignored by SCIP).
    deadline_s (a `time.perf_counter()` instant): the solver gets at most what is left of it after the build."""
    if solver not in SOLVERS:
        raise LazyTrainError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
    if not isinstance(max_segment, int) or max_segment < 1:
        raise LazyTrainError(f"max segment length must be a positive integer, got {max_segment!r}")
    if not time_limit_s > 0:
        raise LazyTrainError(f"time limit must be > 0 seconds, got {time_limit_s}")
    if not 0 <= mip_rel_gap < 1:
        raise LazyTrainError(f"relative MIP gap must be in [0, 1), got {mip_rel_gap}")
    if formulation not in FORMULATIONS:
        raise LazyTrainError(f"formulation {formulation!r} is not one of {', '.join(FORMULATIONS)}")
    t0 = time.perf_counter()
    if fixed_tiers is not None:  # a long recompute block of a rule must still be a candidate edge
        kept = [i for i, t in enumerate(fixed_tiers) if t != "recompute"]
        max_segment = max([max_segment, *(b - a for a, b in zip(kept, kept[1:], strict=False))])
    try:
        form = _Formulation(inst, min(max_segment, inst.num_layers), fixed_tiers, formulation)
    except _Infeasible as why:
        raise LazyTrainError(_infeasible_message(inst, max_segment, str(why))) from None
    m = form.m
    if deadline_s is not None:
        left_s = deadline_s - time.perf_counter()
        if left_s <= 0:
            raise LazyTrainError(f"building the MILP took {time.perf_counter() - t0:.1f} s, past the time limit; raise "
                                 "--time-limit or lower --max-segment")
        time_limit_s = min(time_limit_s, left_s)
    start = form.start_values(start_tiers) if start_tiers is not None else None
    status, values, objective, gap = SOLVERS[solver](m, time_limit_s, mip_rel_gap, start)
    seconds = time.perf_counter() - t0
    if values is None:
        if status == "infeasible" or status.startswith("infeas"):
            raise LazyTrainError(_infeasible_message(inst, max_segment, "fixed tiers" if fixed_tiers else ""))
        raise LazyTrainError(
            f"the {solver} solver found no plan within {time_limit_s:g} s (status {status}); "
            "raise --time-limit or lower --max-segment"
        )
    tiers, _, exposed = _read_solution(form, values)
    transfers = fifo_transfers(tiers, inst)  # the solver's split among equally good windows is arbitrary
    report = SolveReport(
        planner="milp", solver=solver, status=status, objective=objective, gap=gap, seconds=seconds,
        num_variables=len(m.names), num_constraints=len(m.rows),
        options={"max_segment": max_segment, "time_limit_s": time_limit_s, "mip_rel_gap": mip_rel_gap,
                 "formulation": formulation,
                 "num_binaries": sum(m.integer), "fixed_tiers": fixed_tiers is not None,
                 "build_s": round(sum(form.build_s.values()), 4)},
    )
    return MilpSolution(tiers=tiers, transfers=transfers, report=report, exposed_bytes=exposed)


def _read_solution(form: _Formulation, values: list[float]) -> tuple[tuple[str, ...], tuple[Transfer, ...],
                                                                       dict[str, tuple[float, ...]]]:
    def on(var: int) -> bool:
        return values[var] > 0.5

    tiers = []
    for i in range(form.L + 1):
        tier = "gpu" if on(form.g[i]) else "cpu" if on(form.c[i]) else "nvme" if on(form.n[i]) else "recompute"
        tiers.append(tier)
    transfers = []
    for link, flow in (("d2h", form.d), ("h2d", form.h), ("nvme_write", form.q), ("nvme_read", form.r)):
        for (i, w), v in sorted(flow.items()):
            num_bytes = int(round(values[v] * form.unit))
            if num_bytes >= 1024:  # solver noise below a KiB is dropped
                transfers.append(Transfer(boundary=i, window=w, link=link, num_bytes=num_bytes))
    exposed = {link: tuple(max(0.0, values[v] * form.unit) for v in eps)
               for link, eps in (("d2h", form.epsD), ("h2d", form.epsH), ("nvme_write", form.epsW),
                                 ("nvme_read", form.epsR)) if eps}
    return tuple(tiers), tuple(transfers), exposed


def fifo_transfers(tiers: Sequence[str], inst: PlanningInstance) -> tuple[Transfer, ...]:
    """Window assignments in the runtime's order: each link is FIFO and issues a copy as soon as it can.

    A d2h is in window i (the step program waits for it there); nvme writes fill forward windows w >= i from
    the earliest; reloads fill the windows of the segment after
    (s, e) in the order the backward runs them (layer e2-1 first), or the loss head. For fixed tiers this
    hides as many bytes as the MILP's optimal d/h/q/r (a byte offloaded now stays eligible later; each
    backward window serves one reload), so it is an optimal assignment; bytes that cannot hide are put in
    the last eligible window, where they are exposed.
    """
    L, A = inst.num_layers, inst.boundary_bytes
    kept = [i for i, t in enumerate(tiers) if t != "recompute"]
    out: list[Transfer] = []

    def forward(link: str, rate: float, mandatory: list[float], movers: list[int]) -> None:
        queue: list[list[float]] = []
        for w in range(L + 1):
            if w in movers:
                queue.append([w, A[w]])
            room = rate * inst.window_s(w) - mandatory[w] if math.isfinite(rate) else INF
            while queue and room > 0:
                take = min(room, queue[0][1])
                out.append(Transfer(boundary=int(queue[0][0]), window=w, link=link, num_bytes=int(round(take))))
                room -= take
                queue[0][1] -= take
                if queue[0][1] <= 0.5:
                    queue.pop(0)
        for i, rest in queue:
            out.append(Transfer(boundary=int(i), window=L, link=link, num_bytes=int(round(rest))))

    def backward(link: str, rate: float, with_weights: bool, movers: set[int]) -> None:
        for k, (s, e) in enumerate(zip(kept, kept[1:], strict=False)):
            if s not in movers:
                continue
            windows = [L] if e == L else list(range(kept[k + 2] - 1, e - 1, -1))
            rest = A[s]
            for w in windows:
                if w == L:
                    room = rate * inst.head_s - (inst.head_param_bytes if with_weights else 0.0)
                else:
                    recomputed = tiers[w + 1] == "recompute"
                    p = inst.param_bytes[w] * (2 if recomputed else 1) if with_weights else 0.0
                    room = rate * (inst.backward_s[w] + (inst.forward_s[w] if recomputed else 0.0)) - p
                take = rest if not math.isfinite(rate) or w == windows[-1] else min(rest, max(0.0, room))
                if take > 0.5:
                    out.append(Transfer(boundary=s, window=w, link=link, num_bytes=int(round(take))))
                rest -= take
                if rest <= 0.5:
                    break

    offloaded = [i for i, t in enumerate(tiers) if t in ("cpu", "nvme")]
    nvme = [i for i, t in enumerate(tiers) if t == "nvme"]
    out.extend(Transfer(boundary=i, window=i, link="d2h", num_bytes=int(round(A[i]))) for i in offloaded)
    forward("nvme_write", inst.nvme_write_bytes_per_s, [0.0] * (L + 1), nvme)
    backward("h2d", inst.h2d_bytes_per_s, True, set(offloaded))
    backward("nvme_read", inst.nvme_read_bytes_per_s, False, set(nvme))
    return tuple(t for t in out if t.num_bytes > 0)


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


def solve_milp(cost: Any, budgets: Any = None, *, max_segment: int = DEFAULT_MAX_SEGMENT, time_limit_s: float = 60.0,
               mip_rel_gap: float = 0.0, solver: str = "highs", fixed_tiers: Sequence[str] | None = None,
               formulation: str = "paper", start_tiers: Sequence[str] | None = None,
               deadline_s: float | None = None) -> Plan:
    """Solve the paper-mode MILP for a CostModel under Budgets and return the Plan (Contract 1).

    formulation "paper" has the per-window reload variables h[i,w], r[i,w] of the paper; "segment" replaces them
    by one exposure per candidate segment (same optimum; much smaller for long models)."""
    inst = instance_from_cost(cost, budgets)
    solution = solve_instance(inst, max_segment=max_segment, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap,
                              solver=solver, fixed_tiers=fixed_tiers, formulation=formulation,
                              start_tiers=start_tiers, deadline_s=deadline_s)
    return to_plan(solution, cost.spec, workload=getattr(cost, "workload", None), budgets=budgets)


def to_plan(solution: MilpSolution, spec: Any, workload: Any = None, budgets: Any = None) -> Plan:
    """Attach model identity and budgets to a solution."""
    from lazytrain.plan.plan import spec_of

    spec = spec_of(spec)
    budgets_bytes = {k: int(v) for k, v in (budgets.to_dict() if budgets is not None else {}).items()
                     if v is not None}
    plan = Plan.from_tiers(spec, solution.tiers, workload=workload)
    return Plan(tiers=plan.tiers, model_fingerprint=plan.model_fingerprint, model_name=plan.model_name,
                workload=workload, transfers=solution.transfers, budgets_bytes=budgets_bytes, report=solution.report)
