"""The step in time: one column T[w] per window of the step program (plan/schedule.py).

Each window is fenced: it lasts the longest of its compute and each lane's chain of transfers, T[w] >= each.
Bytes in model units over rates in units/s are seconds (a_X = 1 / rate); the loads are linear in x, z, c, n,
y, v, vn."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytrain.plan.milp.model import INF, add_coef

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_forward_windows(form: Formulation) -> None:
    """F_j: layer j's forward, the next weights (the head's after F_{L-1}), the d2h of boundary j if
    offloaded and the nvme write of boundary j-1:
        T[F_j] >= lb = max(rho[j], a_H p[j+1]),   T[F_j] >= lb + (a_D A[j] - lb)+ (c[j] + n[j]),
        T[F_j] >= lb + (a_W A[j-1] - lb)+ n[j-1]
    (the d2h and write rows lifted by lb, `_lifted`)."""
    inst, A = form.inst, form.inst.boundary_bytes
    form.F: list[int] = []
    for j in range(form.L):
        lb = max(inst.forward_s[j], form.aH * form.p[j + 1])
        loads = [_lifted(lb, {form.c[j]: form.aD * A[j], form.n[j]: form.aD * A[j]})] if j > 0 else []
        if j > 1:
            loads.append(_lifted(lb, {form.n[j - 1]: form.aW * A[j - 1]}))
        form.F.append(_window(form, f"T[F{j}]", lb, loads))


def add_head_window(form: Formulation) -> None:
    """H: the loss head, the weights of the last segment's first use, the reload of its start (v[s,L]), the
    nvme write of boundary L-1 and the read staged for B_{L-1}:
        T[H] >= rho[L],   T[H] >= a_H (sum_s x[s,L] p[s] + sum_s A[s] v[s,L] - p[L-1] y[L-1]),
        T[H] >= a_R sum_s A[s] vn[s,L-1],   T[H] >= a_W A[L-1] n[L-1]
    (a kept layer L-1 streams no weights for its backward)."""
    inst, L, A, aH = form.inst, form.L, form.inst.boundary_bytes, form.aH
    head_h2d = {xv: aH * form.p[s] for (s, e), xv in form.x.items() if e == L}
    head_h2d.update({v: aH * A[s] for (s, e), v in form.v.items() if e == L})
    add_coef(head_h2d, form.y[L - 1], -aH * form.p[L - 1])  # B_{L-1} kept: no weights to stream
    loads = [(0.0, head_h2d), (0.0, _reads(form, L - 1))]
    if L > 1:
        loads.append((0.0, {form.n[L - 1]: form.aW * A[L - 1]}))
    form.H = _window(form, "T[H]", inst.head_s, loads)


def add_recompute_windows(form: Formulation) -> None:
    """R_j runs only when boundary j+1 is recomputed: layer j's forward again, the next weights, and the d2h
    of the gradients of the segment's end e (d[e] = a_D p[e]) when (j, e) is a segment:
        T[R_j] >= busy (1 - z[j+1]) + sum_{e >= j+2} (d[e] - busy)+ x[j,e],   busy = max(rho[j], a_H p[j+1])
        T[R_j] >= sum_{e >= j+2} x[j,e] d[e]
    The lifted edges (d[e] > busy) are the long edges counts.py counts."""
    inst, L = form.inst, form.L
    form.R: list[int] = []
    form.lifted_long = []  # long edges whose gradients' d2h outlasts R_s's compute (counts.py)
    for j in range(L - 1):
        busy = max(inst.forward_s[j], form.aH * form.p[j + 1])
        grads = {xv: form.send[e] for (s, e), xv in form.x.items() if s == j and e >= j + 2}
        lift = {xv: d - busy for xv, d in grads.items() if d > busy}
        form.lifted_long.extend(lift)
        form.R.append(_window(form, f"T[R{j}]", 0.0, [(busy, {form.z[j + 1]: -busy, **lift}), (0.0, grads)],
                                   ub=max([busy, *grads.values()])))


def add_backward_windows(form: Formulation) -> None:
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
    inst, m, x, A, aH = form.inst, form.m, form.x, form.inst.boundary_bytes, form.aH
    p = form.p
    form.B: list[int] = []
    for j in range(form.L):
        g = form.send[j + 1]
        beta = inst.backward_s[j]
        kb = max(0.0, beta - inst.forward_s[j])  # through the kept graph
        lb = kb if m.ub[form.y[j]] > 0 else beta  # a layer that cannot be kept runs its whole backward
        # layer j+1's gradients leave in B_j when w = 1 - z[j+1] + x[j,j+1] (a 0/1 value) is 1: lifted by lb
        lift = max(0.0, g - lb)
        loads = [(lb + lift, {form.z[j + 1]: -lift, x[j, j + 1]: lift})] if lift > 0 else []
        if j > 0:
            h2d = {form.z[j]: -aH * p[j - 1]}
            for (s, e), xv in x.items():
                if e == j:
                    add_coef(h2d, xv, aH * p[s])
            for (s, e), v in form.v.items():
                if e == j:
                    add_coef(h2d, v, aH * A[s])
            add_coef(h2d, form.y[j - 1], -aH * p[j - 1])  # B_{j-1} kept: no weights to stream
            loads.append((aH * p[j - 1], h2d))
        reads = _reads(form, j - 1) if j > 1 else {}
        if reads or j in form.prefetch_s:
            loads.append((form.prefetch_s.get(j, 0.0), reads))
        if inst.graph_bytes and kb < beta:
            loads.append((beta, {form.y[j]: -(beta - kb)}))
        form.B.append(_window(form, f"T[B{j}]", lb, loads))


def _window(form: Formulation, name: str, lb: float, loads: list[tuple[float, dict[int, float]]],
            ub: float = INF) -> int:
    """T >= lb and T >= const + sum coef var for every (const, coefs) in loads."""
    m = form.m
    T = m.var(name, lb=lb, ub=ub)
    for k, (const, coefs) in enumerate(loads):
        coefs = {var: -coef for var, coef in coefs.items() if coef != 0.0}
        if coefs:
            m.row(f"{name}_{k}", {T: 1.0, **coefs}, lo=const)
        elif const > lb:
            m.lb[T] = const
    return T


def _lifted(lb: float, loads: dict[int, float]) -> tuple[float, dict[int, float]]:
    """T >= lb + sum (load - lb)+ x for binaries x of which at most one is 1 in any plan, each x = 1 meaning
    T >= its load: the convex hull of T >= max(lb, load x), the same integer points (T >= load x alone lets a
    fractional x hide the window's compute in the LP relaxation: most of a slow link's seconds, 27B with d2h
    1.5 GB/s)."""
    return lb, {var: load - lb for var, load in loads.items() if load > lb}


def _reads(form: Formulation, e: int) -> dict[int, float]:
    """a_R A[s] vn[s,e]: the nvme reads staged in the window before B_e."""
    A = form.inst.boundary_bytes
    return {vn: form.aR * A[s] for (s, e2), vn in form.vn.items() if e2 == e}
