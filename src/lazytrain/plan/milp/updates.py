"""The previous step's updates at the step's start (overlap mode): host states, or states staged from NVMe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytrain.plan.milp.model import add_coef
from lazytrain.plan.schedule import update_order

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_updates(form: Formulation) -> None:
    """Overlap mode: the previous step's updates run from the step's start in forward order; the h2d of
    boundary 0 and of group j's forward weights start after update j ends (ends[j]), the FIFO h2d lane in
    order (the start window's length is `start_s`):
        start = max(ends[first] + a_H A[0], ends[0]) + a_H p[0]
        start + sum_{i<=j} T[F_i] >= ends[j+1] + a_H p[j+1]"""
    inst, m, L, A, aH = form.inst, form.m, form.L, form.inst.boundary_bytes, form.aH
    form.start_s = aH * (A[0] + form.p[0])
    if not inst.update_s or inst.optimizer_mode != "overlap":
        return
    if form.state is not None:
        _add_state_pipeline(form)
        return
    ends, t = {}, 0.0
    for target in update_order(L, inst.tied_head):
        t += inst.update_s[target + 1]
        ends[target] = t
    first = ends[L] if inst.tied_head else ends[-1]
    form.start_s = max(first + aH * A[0], ends[0]) + aH * form.p[0]
    for j in range(L):
        due = ends[j + 1] + aH * form.p[j + 1] - form.start_s
        if due > 0:
            m.row(f"update[{j + 1}]", {T: 1.0 for T in form.F[:j + 1]}, lo=due)


def _add_state_pipeline(form: Formulation) -> None:
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
    inst, m, L, A = form.inst, form.m, form.L, form.inst.boundary_bytes
    aH, sR, sW = form.aH, form.sR, form.sW
    state = form.state
    assert state is not None
    D, targets, G = state.depth, state.targets, len(state.targets)
    S = [inst.state_bytes[t + 1] for t in targets]
    form.T0 = m.var("T[start]", lb=aH * (A[0] + form.p[0]))
    form.start_s = 0.0

    def after(name: str, later: int | dict[int, float], earlier: int | dict[int, float] | None,
              seconds: float) -> None:
        """later >= earlier + seconds (each a column or E(w)'s coefficients; earlier None: the step's start)."""
        coefs = dict(later) if isinstance(later, dict) else {later: 1.0}
        for var, coef in ({} if earlier is None else earlier if isinstance(earlier, dict) else {earlier: 1.0}
                          ).items():
            add_coef(coefs, var, -coef)
        m.row(name, coefs, lo=seconds)

    def start_of(w: int) -> dict[int, float] | None:
        return None if w == 0 else _window_end(form, w - 1)

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
            after(f"R[{k}]_fence", _window_end(form, state.read[k]), R[k], 0.0)
        after(f"W[{k}]_update", W[k], U[k], sW * S[k])
        after(f"W[{k}]_issue", W[k], start_of(state.write[k]), sW * S[k])
        if k:
            after(f"W[{k}]_lane", W[k], W[k - 1], sW * S[k])
        after(f"W[{k}]_fence", _window_end(form, state.write[k]), W[k], 0.0)
        if k >= 2 and not (inst.tied_head and t == L):
            after(f"update[{t}]", _window_end(form, k - 1), U[k], aH * form.p[t])
    after("update[first]", _window_end(form, 0), U[0], aH * (A[0] + form.p[0]))
    after("update[0]", _window_end(form, 0), U[1], aH * form.p[0])
    if inst.nvme_act_bytes > 0:  # a spill queues behind its window's state writes: F_j spills j-1, H spills L-1
        for w in range(3, L + 2):
            written = state.writes_in(w)
            b = w - 2 if w <= L else L - 1
            if written and b > 0:
                coefs = {**_window_end(form, w), W[written[-1]]: -1.0, form.n[b]: -form.aW * A[b]}
                m.row(f"spill[{b}]_after_state", coefs, lo=0.0)


def _window_end(form: Formulation, w: int) -> dict[int, float]:
    """E(w), the end of forward-phase window w (0 = start, j + 1 = F_j, L + 1 = H) as column coefficients."""
    assert form.T0 is not None
    return {form.T0: 1.0, **{T: 1.0 for T in form.F[:w]}, **({form.H: 1.0} if w > form.L else {})}
