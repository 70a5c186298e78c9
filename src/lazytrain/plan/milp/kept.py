"""Kept layers: a suffix of the layers keeps its graph on the device from its forward to its backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_kept(form: Formulation) -> None:
    # y[j] <= y[j+1] (the kept layers are a suffix) ;  y[j] <= g[j] (a kept layer's input stays on the device,
    # its graph holds it; boundary L is gpu)
    m, y = form.m, form.y
    if not form.inst.graph_bytes:
        return
    for j in range(form.L):
        if j + 1 < form.L:
            m.row(f"kept_suffix[{j}]", {y[j]: 1.0, y[j + 1]: -1.0}, hi=0.0)
        m.row(f"kept_gpu[{j}]", {y[j]: 1.0, form.g[j]: -1.0}, hi=0.0)
