"""The path: the materialized boundaries cut the layers into segments, each a candidate edge x[s,e]."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazytrain.plan.milp.formulation import Formulation

def add_path(form: Formulation) -> None:
    # sum_e x[0,e] = 1 ;  sum_s x[s,L] = 1 ;  for 0 < i < L: sum_s x[s,i] = z[i] = sum_e x[i,e]
    m, L, x = form.m, form.L, form.x
    m.row("path_out[0]", {v: 1.0 for (s, _), v in x.items() if s == 0}, 1, 1)
    m.row(f"path_in[{L}]", {v: 1.0 for (_, e), v in x.items() if e == L}, 1, 1)
    for i in range(1, L):
        into = {v: 1.0 for (_, e), v in x.items() if e == i}
        out = {v: 1.0 for (s, _), v in x.items() if s == i}
        m.row(f"path_in[{i}]", {**into, form.z[i]: -1.0}, 0, 0)
        m.row(f"path_out[{i}]", {**out, form.z[i]: -1.0}, 0, 0)
