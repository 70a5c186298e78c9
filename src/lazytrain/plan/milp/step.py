"""The step S: the end of the backward, and the optimizer lane's FIFO queue of each group's jobs behind it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_step(form: Formulation) -> None:
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
    out where S_end implies it."""
    inst, m, L, x, A = form.inst, form.m, form.L, form.x, form.inst.boundary_bytes
    F, R, B, send = form.F, form.R, form.B, form.send
    land = inst.land_seconds()
    if inst.topology.parallel:  # each group's sum over the ranks, queued before its land
        land = tuple(a + r for a, r in zip(land, inst.reduce_s, strict=True))
    grad0 = form.send[0] + form.aD * A[0] * inst.embedding_grad
    Q = [m.var(f"Q[{k}]") for k in range(L + 1)]
    start = {form.T0: -1.0} if form.T0 is not None else {}  # the start window: a column, or a constant
    m.row(f"Q[{L}]", {Q[L]: 1.0, form.H: -1.0, **{T: -1.0 for T in F}, **start}, form.start_s, form.start_s)
    for k in range(L):
        m.row(f"Q[{k}]", {Q[k]: 1.0, Q[k + 1]: -1.0, B[k]: -1.0, **({R[k]: -1.0} if k < L - 1 else {})}, 0, 0)
    S = form.S = m.var("S")
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
        for s in range(max(0, k - form.K + 1), k):  # B_k's segment starts at s: its R_s..R_{k-1} run before
            starts = {xv: 1.0 for (s2, e), xv in x.items() if s2 == s and e > k}
            if not starts:
                continue
            M = sum(m.ub[R[j]] for j in range(s, k))
            coefs = {S: 1.0, Q[k]: -1.0, **{R[j]: -1.0 for j in range(s, k)}}
            for xv in starts:
                coefs[xv] = -M
            m.row(f"S_land[{k},{s}]", coefs, lo=send[k] + queued[k] - M)
