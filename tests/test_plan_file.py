"""Plan files (Contract 1, docs/architecture.md) made by the planners: round trip, refusal of a foreign plan,
malformed files."""

from __future__ import annotations

import json

import pytest
from checks import one_line

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp
from lazytrain.plan.plan import Plan
from lazytrain.plan.rules import make_rule_plan
from lazytrain.plan.sim import simulate


@pytest.fixture(scope="module")
def milp_plan() -> tuple[Plan, ModelSpec, Workload]:
    spec = ModelSpec.load("qwen2.5-7b")
    workload = Workload(96, 1024)
    cost = CostModel(spec, HardwareSpec.load("h800"), workload)
    budgets = Budgets(gpu_mem_cap_bytes=40 * 10**9, cpu_act_bytes=8 * 10**9, nvme_act_bytes=8 * 10**9)
    plan = solve_milp(cost, budgets)
    return plan.with_prediction(simulate(plan, cost).to_prediction()), spec, workload


def test_milp_plan_round_trips(tmp_path, milp_plan) -> None:
    plan, spec, workload = milp_plan
    assert plan.transfers and {"cpu", "gpu"} <= set(plan.tiers)  # the fixture exercises offloads
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path, spec=spec, workload=workload)
    assert loaded == plan
    assert loaded.report.solver == "highs" and loaded.report.gap == 0
    # every offloaded boundary's bytes leave on d2h in the forward windows at or after it
    for i in plan.boundaries("cpu"):
        moved = [t for t in plan.transfers if t.boundary == i and t.link == "d2h"]
        assert sum(t.num_bytes for t in moved) == pytest.approx(max(CostModel(
            spec, HardwareSpec.load("h800"), workload).boundary_bytes), rel=1e-6)
        assert all(t.window >= i for t in moved)


def test_foreign_plan_is_refused(tmp_path, milp_plan) -> None:
    plan, _, workload = milp_plan
    path = tmp_path / "plan.json"
    plan.save(path)
    with pytest.raises(LazyTrainError, match="made for model"):
        Plan.load(path, spec=ModelSpec.load("qwen2.5-14b"))
    with pytest.raises(LazyTrainError, match="batch"):
        Plan.load(path, spec=ModelSpec.load("qwen2.5-7b"), workload=Workload(8, 1024))


def test_a_plan_file_without_masked_loads_for_masked_and_unmasked_runs(tmp_path, milp_plan) -> None:
    """Plan files written before Workload.masked (no such key) still load, and a plan serves its shape's batches
    padded or not (the executor counts the step's own masks); another shape is still refused."""
    plan, spec, workload = milp_plan
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["workload"].pop("masked") is False
    path.write_text(json.dumps(data))
    masked = Workload(workload.batch_size, workload.seq_len, workload.dtype, masked=True)
    assert Plan.load(path, spec=spec, workload=masked).tiers == plan.tiers
    assert Plan.load(path, spec=spec, workload=workload) == plan
    with pytest.raises(LazyTrainError, match="batch"):
        Plan.load(path, spec=spec, workload=Workload(8, 1024, masked=True))


def test_rule_plan_round_trips(tmp_path) -> None:
    spec = ModelSpec.load("tiny-qwen3")
    plan = make_rule_plan("offload-all", spec)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json", spec=spec) == plan


def test_kept_layers_round_trip_and_show_in_the_map(tmp_path) -> None:
    """A plan whose last K layers keep their graphs: the file keeps K, the map marks their input boundaries."""
    spec = ModelSpec.load("tiny-qwen3")
    L = spec.num_layers
    plan = Plan.from_tiers(spec, ["gpu", *["recompute"] * (L - 3), "gpu", "gpu", "gpu"], kept_layers=2)
    assert plan.placement_map() == "G" + "R" * (L - 3) + "KKG" and plan.kept(L - 1) and not plan.kept(L - 3)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json", spec=spec) == plan
    data = plan.to_dict()
    del data["kept_layers"]  # a plan file written before kept layers: none kept
    assert Plan.from_dict(data).kept_layers == 0


def test_optimizer_offload_and_staging_depth_round_trip(tmp_path) -> None:
    """A plan for the optimizer's state on NVMe keeps its mode and staging depth in the file; an older file (no such
    keys) is a host plan; a run with the other mode is refused in one line."""
    spec = ModelSpec.load("tiny-qwen3")
    plan = Plan.from_tiers(spec, ["gpu"] * (spec.num_layers + 1), staging_depth=2)
    assert (plan.optimizer_offload, plan.staging_depth) == ("nvme", 2)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json", spec=spec) == plan
    data = plan.to_dict()
    assert (data["optimizer_offload"], data["staging_depth"]) == ("nvme", 2)
    del data["optimizer_offload"], data["staging_depth"]
    assert (Plan.from_dict(data).optimizer_offload, Plan.from_dict(data).staging_depth) == ("host", 0)
    plan.check_matches(spec, optimizer_offload="nvme")
    with pytest.raises(LazyTrainError, match="made for optimizer_offload nvme but the run uses host"):
        plan.check_matches(spec, optimizer_offload="host")


def _mutations(data: dict) -> dict[str, object]:
    boundaries = data["boundaries"]
    return {
        "not json": "{",
        "a list": "[]",
        "future version": {**data, "version": 99},
        "no boundaries": {k: v for k, v in data.items() if k != "boundaries"},
        "unknown tier": {**data, "boundaries": [*boundaries[:-2], {"boundary": len(boundaries) - 2, "tier": "ssd"},
                                                boundaries[-1]]},
        "gap in boundaries": {**data, "boundaries": boundaries[:1] + boundaries[2:]},
        "last boundary not gpu": {**data, "boundaries": [*boundaries[:-1], {"boundary": len(boundaries) - 1,
                                                                            "tier": "cpu"}]},
        "transfer out of range": {**data, "transfers": [{"boundary": 1, "window": 999, "link": "d2h",
                                                         "num_bytes": 1}]},
        "bad workload": {**data, "workload": {"batch_size": -3, "seq_len": 1024}},
        "kept layers not an int": {**data, "kept_layers": "all"},
        "kept layer over an offloaded boundary": {**data, "kept_layers": len(boundaries) - 1},
        "unknown optimizer offload": {**data, "optimizer_offload": "ssd"},
        "nvme without a staging depth": {**data, "optimizer_offload": "nvme", "staging_depth": 0},
        "staging depth past the layers": {**data, "optimizer_offload": "nvme", "staging_depth": 10**6},
        "host with a staging depth": {**data, "staging_depth": 2},
    }


@pytest.mark.parametrize("case", list(_mutations({"boundaries": [{}, {}, {}]})))
def test_malformed_plan_files_are_refused_in_one_line(tmp_path, milp_plan, case: str) -> None:
    plan, spec, _ = milp_plan
    bad = _mutations(plan.to_dict())[case]
    path = tmp_path / "bad.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(LazyTrainError) as err:
        Plan.load(path, spec=spec)
    one_line(str(err.value))
