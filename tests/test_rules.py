"""Baseline rules: their tiers, their Plans, and their score under the MILP (a feasible point of it)."""

from __future__ import annotations

import random

import pytest

from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp import PlanningInstance, instance_from_cost, solve_instance, solve_milp
from lazytrain.plan.rules import RULES, evaluate_objective, evaluate_tiers, make_rule_plan, rule_tiers

GB = 1e9


@pytest.mark.parametrize("L,K", [(8, 4), (10, 4), (7, 3), (5, 1), (3, 8)])
def test_megatrain_keeps_every_kth_boundary_and_both_ends(L: int, K: int) -> None:
    tiers = rule_tiers("megatrain", L, interval=K)
    assert len(tiers) == L + 1 and tiers[0] == tiers[-1] == "gpu"
    for i in range(1, L):
        assert tiers[i] == ("gpu" if i % K == 0 else "recompute")


def test_other_rules() -> None:
    assert rule_tiers("keep-all", 4) == ("gpu",) * 5
    assert rule_tiers("recompute-all", 4) == ("gpu", "recompute", "recompute", "recompute", "gpu")
    assert rule_tiers("offload-all", 4) == ("gpu", "cpu", "cpu", "cpu", "gpu")


def test_rule_plans_carry_the_model_and_the_rule() -> None:
    spec = ModelSpec.load("tiny-llama")
    workload = Workload(batch_size=2, seq_len=16)
    for rule in RULES:
        plan = make_rule_plan(rule, spec, interval=2, workload=workload)
        assert plan.report.planner == rule and plan.num_layers == spec.num_layers
        assert plan.model_fingerprint == spec.fingerprint() and plan.workload == workload
    assert make_rule_plan("megatrain", spec, interval=2).report.options == {"interval": 2}


@pytest.mark.parametrize("bad", [{"rule": "every-other"}, {"rule": "megatrain", "interval": 0}])
def test_bad_rules_raise(bad: dict) -> None:
    with pytest.raises(LazyTrainError):
        rule_tiers(bad["rule"], 8, interval=bad.get("interval", 4))


def test_evaluation_charges_recompute_of_each_segment() -> None:
    rng = random.Random(3)
    rho = [rng.uniform(0.05, 0.2) for _ in range(8)]
    inst = PlanningInstance(forward_s=rho, backward_s=[3 * r for r in rho], boundary_bytes=[GB] * 9,
                            param_bytes=[0.1 * GB] * 8, gpu_act_bytes=100 * GB, h2d_bytes_per_s=12 * GB,
                            d2h_bytes_per_s=12 * GB, lambda_z=0, lambda_c=0, lambda_n=0)
    ev = evaluate_tiers(rule_tiers("megatrain", 8, interval=4), inst)
    # segments (0, 4), (4, 8): layers 0..2 and 4..6 run again
    assert ev.recompute_s == pytest.approx(sum(rho[0:3]) + sum(rho[4:7]))
    keep_all = evaluate_tiers(rule_tiers("keep-all", 8), inst)
    assert ev.step_s - keep_all.step_s == pytest.approx(ev.recompute_s)  # fast links: nothing else changes
    # the step is the whole iteration: compute, plus the start's and the end's transfers, and the (instant) head
    # window streaming layer 7's weights
    start_end_head = (GB + 0.1 * GB) / (12 * GB) + (0.1 * GB + GB) / (12 * GB) + 0.1 * GB / (12 * GB)
    assert keep_all.step_s == pytest.approx(sum(rho) + sum(inst.backward_s) + start_end_head)


def test_evaluate_objective_refuses_an_infeasible_plan() -> None:
    inst = PlanningInstance(forward_s=[0.1] * 8, backward_s=[0.3] * 8, boundary_bytes=[GB] * 9,
                            param_bytes=[0.1 * GB] * 8, gpu_act_bytes=4 * GB)
    with pytest.raises(LazyTrainError, match="device"):
        evaluate_objective(rule_tiers("keep-all", 8), inst)


@pytest.fixture(scope="module")
def paper_27b():
    """The paper's 27B / H800 instance: batch 72, seq 1024, gpu cap 70 GB, cpu act 15 GB, nvme 32 GB."""
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.plan.budgets import Budgets

    spec = ModelSpec.load("qwen3.6-27b")
    cost = CostModel(spec, HardwareSpec.load("h800"), Workload(72, 1024))
    budgets = Budgets(gpu_mem_cap_bytes=70 * 10**9, cpu_act_bytes=15 * 10**9, nvme_act_bytes=32 * 10**9)
    return cost, budgets


def test_megatrain_rule_is_a_feasible_point_of_the_paper_milp(paper_27b) -> None:
    """Fix the MILP's binaries to MegaTrain's rule: feasible, and its objective is the rule's own evaluation."""
    cost, budgets = paper_27b
    tiers = rule_tiers("megatrain", cost.num_layers, interval=4)
    fixed = solve_milp(cost, budgets, max_segment=4, fixed_tiers=tiers)
    assert fixed.tiers == tiers and fixed.report.status == "optimal"
    inst = instance_from_cost(cost, budgets)
    assert fixed.report.objective == pytest.approx(evaluate_objective(tiers, inst), rel=1e-6)
    assert fixed.report.objective > 1.0  # 48 recomputed layers: seconds, not tie-breakers
    free = solve_milp(cost, budgets, max_segment=8)
    assert free.report.status == "optimal" and free.report.gap == pytest.approx(0, abs=1e-6)
    assert free.report.objective < fixed.report.objective
    assert evaluate_tiers(free.tiers, inst).feasible


def test_milp_plans_fit_the_simulated_device(paper_27b) -> None:
    """The MILP's memory rows describe the schedule: the simulator's device peak stays under the cap."""
    from lazytrain.plan.sim import simulate

    cost, budgets = paper_27b
    for cap_gb in (70, 58):
        b = type(budgets)(gpu_mem_cap_bytes=cap_gb * 10**9, cpu_act_bytes=budgets.cpu_act_bytes,
                          nvme_act_bytes=budgets.nvme_act_bytes)
        plan = solve_milp(cost, b)
        peak = simulate(plan, cost).peak_bytes["gpu"]
        assert peak <= cap_gb * 10**9, (cap_gb, peak, plan.placement_map())


@pytest.mark.parametrize("model", ["qwen2.5-7b", "qwen3.6-27b", "gpt-oss-120b", "tiny-qwen3.6"])
def test_device_rows_equal_the_simulated_device_peak(model: str) -> None:
    """The MILP's memory rows count exactly what the simulator's arena holds: static + rows = simulated peak,
    with each layer's own working set (hybrid models mix Gated DeltaNet and gated attention layers; GPT-OSS
    sliding and full attention) and the head's."""
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.plan.plan import Plan
    from lazytrain.plan.sim import simulate

    rng = random.Random(20261202)
    spec = ModelSpec.load(model)
    cost = CostModel(spec, HardwareSpec.load("h800"), Workload(rng.randrange(8, 64), rng.choice([256, 1024])))
    inst = instance_from_cost(cost, None)
    L = spec.num_layers
    plans = [rule_tiers(rule, L) for rule in RULES]
    plans += [("gpu", *(rng.choice(["gpu", "cpu", "nvme", "recompute", "recompute"]) for _ in range(L - 1)), "gpu")
              for _ in range(6)]
    for tiers in plans:  # and with kept layers: one, and as many as the tiers' gpu suffix allows
        suffix = next(k for k in range(L + 1) if k == L or tiers[L - k - 1] != "gpu")
        for kept in sorted({0, min(1, suffix), suffix}):
            predicted = cost.static_device_bytes() + evaluate_tiers(tiers, inst, kept_layers=kept).gpu_act_peak_bytes
            simulated = simulate(Plan.from_tiers(spec, tiers, kept_layers=kept), cost).peak_bytes["gpu"]
            assert predicted == pytest.approx(simulated, rel=1e-9), (tiers, kept)


def test_rtx3090_milp_fits_one_more_sample_than_megatrain() -> None:
    """At the MegaTrain rule's largest batch + 1 the MILP still finds a plan, at 3B, 7B, 14B and 27B."""
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.plan.budgets import Budgets
    from lazytrain.plan.planner import admitted

    hw = HardwareSpec.load("rtx3090")
    for preset in ("qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen3.6-27b"):
        spec = ModelSpec.load(preset)
        tiers = rule_tiers("megatrain", spec.num_layers, interval=4)

        def rule_fits(batch: int, spec: ModelSpec = spec, tiers: tuple[str, ...] = tiers) -> bool:
            cost = CostModel(spec, hw, Workload(batch, 1024))
            try:
                _, budgets = admitted(cost, Budgets())
            except LazyTrainError:
                return False
            return evaluate_tiers(tiers, instance_from_cost(cost, budgets)).feasible

        lo, hi = 1, 2
        assert rule_fits(lo), preset
        while rule_fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if rule_fits(mid) else (lo, mid)
        cost = CostModel(spec, hw, Workload(lo + 1, 1024))
        _, budgets = admitted(cost, Budgets())
        plan = solve_instance(instance_from_cost(cost, budgets), mip_rel_gap=0.5)  # feasibility is the question
        assert plan.tiers[0] == "gpu", preset
