"""Device memory: every window's peak (boundaries, reload buffers, working sets, kept graphs) fits the cap."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytrain.plan.milp.model import INF

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_gpu_memory(form: Formulation) -> None:
    """The paper's sum A g <= M_G, made exact for the schedule (weak spot 3: transient memory). The rows count
    what the simulator's (and executor's) device accounting holds at each window's peak beyond the static
    bytes (slots, boundary gradients) with that window's own working set: M_G is net of the largest, W, so
    every row's right side gives it back (the terms are PlanningInstance.forward_bytes, head_bytes,
    segment_bytes)."""
    A, L, inst, m = form.inst.boundary_bytes, form.L, form.inst, form.m
    room = inst.gpu_act_bytes + inst.static_working_bytes
    # A kept layer j holds its weights' own slot from its forward h2d (in F_{j-1}) and its graph from its
    # forward (F_j) to its backward (B_j); its forward and backward transients are within w[j] (y terms):
    kept = [inst.graph_bytes[j] + inst.param_bytes[j] for j in range(L)] if inst.graph_bytes else []

    def kept_before(j: int) -> dict[int, float]:
        """Kept layers below j (graph, slot) and layer j's slot: sum_{j'<j} (G[j'] + p[j']) y[j'] + p[j] y[j]."""
        if not kept or j >= L:
            return {}
        return {**{form.y[i]: kept[i] for i in range(j)}, form.y[j]: inst.param_bytes[j]}

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
            coefs = {**{form.g[i]: A[i] for i in range(j)}, **kept_before(j)}
            if kept and j + 1 < L:
                coefs[form.y[j + 1]] = inst.param_bytes[j + 1]
            m.row(f"gpu_fwd[{j}]", coefs, hi=room + inst.fwd_unallocated_bytes - const)
            top = const
    # Reload buffer: in window B_s, the last of segment (s, e), the start s' of the previous segment (s', s) is
    # reloaded into a device buffer allocated there when it is offloaded:  v[s',s] >= x[s',s] + c[s'] + n[s'] - 1;
    # the last segment's start (s', L) in the head window H.
    form.v = {}
    for (s0, s1), xv in form.x.items():
        if s0 == 0:
            continue  # boundary 0 is gpu
        v = m.var(f"v[{s0},{s1}]")
        form.v[s0, s1] = v
        m.row(f"reload_buffer[{s0},{s1}]", {v: -1.0, xv: 1.0, form.c[s0]: 1.0, form.n[s0]: 1.0}, hi=1.0)
    # Head window H: every gpu boundary below L, the last segment's start's reload buffer, boundary L, its
    # gradient, the head's working set and its own weight and gradient slots (head_bytes: less the
    # boundary-gradient buffers G already static), every kept layer's graph and slot:
    #   sum_{i<L} A[i] g[i] + sum_s A[s] v[s,L] + 2 A[L] - G + w[L] + 2 h + sum_j (G[j] + p[j]) y[j] + T_B
    #   <= M_G + W
    m.row("gpu_head", {**{form.g[i]: A[i] for i in range(L)},
                       **{v: A[s0] for (s0, s1), v in form.v.items() if s1 == L},
                       **({form.y[j]: kept[j] for j in range(L)} if kept else {})},
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
        below = {**{form.g[i]: A[i] for i in range(s)}, **kept_before(s)}
        always = A[s] + A[s + 1] + inst.working_bytes[s]
        coefs = dict(below)
        for (s2, e), xv in form.x.items():
            if s2 == s:
                coefs[xv] = inst.segment_bytes(s, e) - always
        m.row(f"gpu_bwd[{s}]", coefs, hi=room - inst.bwd_transient_bytes - always)
        buffers = {v: A[s0] for (s0, s1), v in form.v.items() if s1 == s}
        if buffers:
            m.row(f"gpu_bwd_reload[{s}]", {**below, form.z[s]: inst.head_grad_bytes(s, s + 1), **buffers},
                  hi=room - inst.bwd_transient_bytes - always)
