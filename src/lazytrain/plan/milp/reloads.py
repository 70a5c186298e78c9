"""Reloads from NVMe: an offloaded segment start on nvme is read a window before its h2d (vn[s,e])."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_nvme_reads(form: Formulation) -> None:
    """An offloaded segment start's nvme read is staged a window before its h2d, in B_{e+1} (H when e = L-1):
        vn[s,e] >= x[s,e] + n[s] - 1      (s > 0, e < L)
    The last segment's start cannot be on nvme (its read would chain with its h2d in H):
        n[s] + x[s,L] <= 1"""
    m, L, x = form.m, form.L, form.x
    use_nvme = form.inst.nvme_act_bytes > 0
    for (s0, s1), xv in x.items():  # the last segment's start (reloaded in the head window) is not on nvme
        if s0 > 0 and s1 == L and use_nvme:
            m.row(f"last_start_not_nvme[{s0}]", {form.n[s0]: 1.0, xv: 1.0}, hi=1.0)
    form.vn = {}
    if use_nvme:
        for (s0, s1), xv in x.items():
            if s0 > 0 and s1 < L:
                vn = form.vn[s0, s1] = m.var(f"vn[{s0},{s1}]")
                m.row(f"nvme_reload[{s0},{s1}]", {vn: -1.0, xv: 1.0, form.n[s0]: 1.0}, hi=1.0)
