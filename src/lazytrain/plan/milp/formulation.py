"""The formulation: the instance in model units, the links' seconds per unit, and the columns by symbol.

The constraint families (families.py, one module each, their equations in docs/planner.md) read and add columns
through one `Formulation`, so a family's rows name the symbols the docs do: `form.x[s, e]`, `form.z[i]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lazytrain.plan.milp.instance import PlanningInstance
from lazytrain.plan.milp.model import Model
from lazytrain.plan.schedule import StateSchedule, state_schedule


def scaled(inst: PlanningInstance, unit: float) -> PlanningInstance:
    """The same instance with bytes counted in `unit`s (the largest boundary): coefficients near 1 keep the
    solvers' tolerances meaningful (with raw bytes SCIP stalls on 1e9-sized rows and 1e-10 costs)."""
    byte_fields = ("gpu_act_bytes", "head_param_bytes", "cpu_act_bytes", "nvme_act_bytes", "h2d_bytes_per_s",
                   "d2h_bytes_per_s", "nvme_read_bytes_per_s", "nvme_write_bytes_per_s", "fwd_unallocated_bytes",
                   "fwd_transient_bytes", "bwd_transient_bytes", "static_device_bytes", "gpu_mem_cap_bytes",
                   "head_working_bytes", "static_working_bytes", "head_slot_bytes")
    changes: dict[str, Any] = {k: getattr(inst, k) / unit for k in byte_fields}
    for k in ("state_read_bytes_per_s", "state_write_bytes_per_s"):
        changes[k] = None if getattr(inst, k) is None else getattr(inst, k) / unit
    for name in ("boundary_bytes", "working_bytes", "param_bytes", "graph_bytes", "state_bytes", "grad_bytes"):
        changes[name] = tuple(b / unit for b in getattr(inst, name))
    return replace(inst, **changes)



class Formulation:
    """The model `m` and its columns by symbol; families.build adds them and times each family (`build_s`)."""

    x: dict[tuple[int, int], int]  # x[s,e]: segment (s, e)
    z: list[int]  # z[i]: boundary i materialized; g[i], c[i], n[i]: its home
    g: list[int]
    c: list[int]
    n: list[int]
    y: list[int]  # y[j]: layer j kept
    v: dict[tuple[int, int], int]  # v[s,e]: s reloaded (h2d) in B_e
    vn: dict[tuple[int, int], int]  # vn[s,e]: s read from NVMe in B_{e+1}
    F: list[int]  # T[F_j], T[H], T[R_j], T[B_j]: the windows' seconds
    H: int
    R: list[int]
    B: list[int]
    lifted_long: list[int]  # long edges whose gradients' d2h outlasts R_s's compute (counts.py)
    start_s: float  # the start window's seconds when it is a constant (T0 None)
    S: int  # the step
    counts: dict[int, list[int]]  # count column -> the binaries it sums

    def __init__(self, inst: PlanningInstance, max_segment: int, fixed_tiers: Sequence[str] | None,
                 fixed_kept: int | None = None) -> None:
        self.unit = max(max(inst.boundary_bytes), 1.0)  # bytes per model unit
        inst = scaled(inst, self.unit)
        self.inst, self.K, self.L = inst, max_segment, inst.num_layers
        self.m = Model()
        self.fixed = tuple(fixed_tiers) if fixed_tiers is not None else None
        self.fixed_kept = fixed_kept
        self.build_s: dict[str, float] = {}
        # a_X: seconds per model unit on link X; p[L] the loss head's bytes; d[k] = a_D g[k], group k's gradient d2h
        self.aH, self.aD = _inverse(inst.h2d_bytes_per_s), _inverse(inst.d2h_bytes_per_s)
        self.aW, self.aR = _inverse(inst.nvme_write_bytes_per_s), _inverse(inst.nvme_read_bytes_per_s)
        self.sR, self.sW = (_inverse(rate) for rate in inst.state_rates)  # s_X: a state file's seconds per unit
        self.p = [*inst.param_bytes, inst.head_param_bytes]
        self.send = [self.aD * g for g in (inst.grad_bytes or self.p)]  # d[k] = a_D g[k]
        # optimizer_offload nvme: where the state ops go (plan/schedule.py), and the seconds of the state read each
        # backward window B_j prefetches for the next update (B_{L-1-k}, group k < D)
        self.state: StateSchedule | None = \
            state_schedule(self.L, inst.tied_head, inst.staging_depth) if inst.staging_depth else None
        self.prefetch_s = {self.L - 1 - k: self.sR * inst.state_bytes[t + 1]
                           for k, t in enumerate(self.state.targets[:self.state.depth])} if self.state else {}
        self.T0: int | None = None  # the start window's seconds, a column when the state ops make it one

    def start_values(self, tiers: Sequence[str], kept_layers: int = 0) -> dict[int, float] | None:
        """Column values of the binaries for `tiers` and `kept_layers` (a warm start); None when a segment is not
        a candidate."""
        if len(tiers) != self.L + 1:
            return None
        on_path = [i for i, t in enumerate(tiers) if t != "recompute"]
        edges = set(zip(on_path[:-1], on_path[1:], strict=True))
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


def _inverse(rate: float) -> float:
    """Seconds per (scaled) byte of a link; an unlimited link moves anything in no time."""
    return 1.0 / rate if math.isfinite(rate) else 0.0
