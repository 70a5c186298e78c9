"""Online re-planning: drift detection, warm-started re-solve, switch on predicted gain; and on the emulated device
a run whose h2d link slows 4x mid-run re-plans and then steps faster than the same run without re-planning."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch
import transformers

from lazytrain import EmulatedDevice, Executor
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp
from lazytrain.plan.plan import Plan, spec_of
from lazytrain.plan.sim import simulate
from lazytrain.runtime.calibrate import calibrate, rebuilt
from lazytrain.runtime.executor import StepStats
from lazytrain.runtime.replan import Replanner, Switch


def _cost(h2d_gbps: float = 0.3) -> CostModel:
    hardware = HardwareSpec.load("emulated").with_overrides(h2d_gbps=h2d_gbps, d2h_gbps=1e3)
    cost = CostModel(ModelSpec.load("tiny-llama"), hardware, Workload(16, 1024, "fp32"))
    return cost.with_times(forward_s=0.01, backward_s=0.03, head_s=0.02)


def _stats(cost: CostModel, h2d_bytes_per_s: float, *, compute: float = 1.0) -> StepStats:
    """A measured step: the model's compute seconds (times `compute`) and h2d moving at the given rate."""
    moved = 10 * cost.param_bytes[0]
    return StepStats(wall_s=0.5, stall_s={}, peak_device_bytes=0, predicted_peak_device_bytes=0, loss=1.0, tokens=1,
                     forward_s=[compute * t for t in cost.forward_s], backward_s=[compute * t for t in cost.backward_s],
                     head_s=compute * cost.head_s, link_busy_s={"h2d": moved / h2d_bytes_per_s},
                     link_bytes={"h2d": moved})


def test_switches_once_after_warmup_when_drift_and_gain_pass_their_thresholds() -> None:
    cost = _cost()
    L = cost.num_layers
    offload = Plan.from_tiers(cost.spec, ["gpu"] + ["cpu"] * (L - 1) + ["gpu"])
    recompute = Plan.from_tiers(cost.spec, ["gpu"] + ["recompute"] * (L - 1) + ["gpu"])
    asked: list[tuple[float, Plan]] = []

    def solve(c: CostModel, start: Plan) -> Plan:
        asked.append((c.h2d_bytes_per_s, start))
        return recompute

    switches: list[Switch] = []
    rp = Replanner(cost, offload, solve, warmup_steps=2, window=1, on_switch=switches.append)
    slow = cost.h2d_bytes_per_s / 4
    assert simulate(recompute, _stats_cost(cost, slow)).step_s < 0.9 * simulate(offload, _stats_cost(cost, slow)).step_s
    for _ in range(4):  # on the model: no drift, no re-solve
        assert rp.observe(_stats(cost, cost.h2d_bytes_per_s)) is None
    assert rp.observe(_stats(cost, slow)) is recompute
    assert asked == [(pytest.approx(slow, rel=0.05), offload)]  # warm-started from the running plan
    assert [s.new_map for s in switches] == [recompute.placement_map()] and "re-plan at step 5" in switches[0].message()
    assert switches[0].new_predicted_s < switches[0].old_predicted_s
    for _ in range(3):  # the new model is the reference now: the same slow link is no drift
        assert rp.observe(_stats(cost, slow)) is None
    assert len(asked) == 1


def _stats_cost(cost: CostModel, h2d_bytes_per_s: float) -> CostModel:
    return rebuilt(cost, cost.hardware.with_overrides(h2d_gbps=h2d_bytes_per_s / 1e9)).with_times(
        forward_s=cost.forward_s, backward_s=cost.backward_s, head_s=cost.head_s)


def test_no_switch_without_a_predicted_gain() -> None:
    cost = _cost()
    plan = Plan.from_tiers(cost.spec, ["gpu"] * (cost.num_layers + 1))
    rp = Replanner(cost, plan, lambda c, start: plan, warmup_steps=0, window=1)
    assert rp.observe(_stats(cost, cost.h2d_bytes_per_s, compute=2.0)) is None  # drift: re-solved, same plan
    assert rp.switches == [] and rp.cost.forward_s[0] == pytest.approx(2 * cost.forward_s[0], rel=0.05)


def _emulated_runs_with_h2d_slowed_4x_at_step_10() -> tuple[CostModel, float, Plan, dict]:
    """The same plan run twice on the emulated device, interleaved step by step, with and without a Replanner; the
    h2d link slows 4x at step 10. Returns the calibrated model, its h2d rate, the first plan and the runs."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    L, B, S = 6, 4, 512
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=L,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=S,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (B, S))
    base = CostModel(spec_of(model), HardwareSpec.load("emulated"), Workload(B, S, "fp32"))
    probe = Executor(model, Plan.from_tiers(model, ["gpu"] * (L + 1)), EmulatedDevice(), cost=base)
    steps = []
    for _ in range(4):
        probe.forward_backward(ids, ids.clone())
        steps.append(probe.last_step)
    act = max(base.boundary_bytes)
    h2d_gbps = act / (0.8 * calibrate(base, steps[1:]).backward_s[0]) / 1e9  # a reload hides under ~ one backward
    cost = calibrate(rebuilt(base, base.hardware.with_overrides(h2d_gbps=h2d_gbps)), steps[1:])
    budgets = Budgets(gpu_mem_cap_bytes=cost.static_device_bytes() + 4 * act, cpu_act_bytes=10 * act, nvme_act_bytes=0)

    def solve(c: CostModel, start: Plan | None) -> Plan:
        return solve_milp(c, budgets, start_tiers=start and start.tiers, start_kept=start.kept_layers if start else 0)

    plan = solve(cost, None)
    assert "cpu" in plan.tiers  # the fast link hides reloads: the plan offloads
    runs = {}
    for replan in (True, False):
        device = EmulatedDevice(h2d_gbps=h2d_gbps)
        runs[replan] = (device, Executor(model, plan, device, cost=cost), Replanner(cost, plan, solve), [])
    for step in range(20):  # the two runs interleaved, so the machine's load hits both alike
        for replan, (device, ex, replanner, walls) in runs.items():
            if step == 10:
                device.slow_link("h2d", 4)
            model.zero_grad(set_to_none=True)
            ex.forward_backward(ids, ids.clone())
            walls.append(ex.last_step.wall_s)
            if replan and (new := replanner.observe(ex.last_step)) is not None:
                ex.set_plan(new)
    for device, *_ in runs.values():
        device.close()
    return cost, h2d_gbps, plan, runs


@pytest.mark.slow
def test_emulated_run_replans_when_h2d_slows_4x_to_a_plan_faster_on_the_slowed_link() -> None:
    """The switch is judged on the true slowed link (simulated), not on wall seconds: those are the machine's load
    as much as the plan's (on 2 loaded cores the steps took 3.5-10 s each, either plan); the perf test times them."""
    cost, h2d_gbps, plan, runs = _emulated_runs_with_h2d_slowed_4x_at_step_10()
    replanner = runs[True][2]
    assert any(s.step > 10 for s in replanner.switches)
    assert replanner.plan.tiers != plan.tiers
    slowed = rebuilt(cost, cost.hardware.with_overrides(h2d_gbps=h2d_gbps / 4)).with_times(
        forward_s=cost.forward_s, backward_s=cost.backward_s, head_s=cost.head_s, optimizer_s=cost.optimizer_s)
    assert simulate(replanner.plan, slowed).step_s < simulate(plan, slowed).step_s


@pytest.mark.perf
def test_emulated_run_replans_when_h2d_slows_4x_and_steps_faster_than_without() -> None:
    _, _, _, runs = _emulated_runs_with_h2d_slowed_4x_at_step_10()
    assert any(s.step > 10 for s in runs[True][2].switches)
    assert statistics.median(runs[True][3][15:]) < statistics.median(runs[False][3][15:])


def test_train_with_replan_on_writes_the_measured_and_predicted_traces(tmp_path) -> None:
    import json

    from lazytrain.cli import main

    out = tmp_path / "run"
    assert main(["train", "--model", "debug", "--corpus", "zen", "--batch-size", "4", "--seq-len", "32",
                 "--eval-batches", "0", "--no-progress", "--steps", "3", "--output-dir", str(out), "replan=true"]) == 0
    for name in ("step_trace_measured.json", "step_trace_predicted.json"):
        events = json.loads((out / name).read_text())["traceEvents"]
        lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"compute", "h2d", "d2h"} <= lanes
        assert any(e["ph"] == "X" and e["cat"] == "compute" and e["name"] == "F0" for e in events)


def test_the_trainers_replanner_warm_starts_from_the_running_plans_tiers_and_kept_layers(monkeypatch) -> None:
    """`replan: true` re-solves from the running plan: its tiers and its kept layers K (not K = 0)."""
    from lazytrain.config import load_job_config
    from lazytrain.train import planning

    cost = _cost()
    L = cost.num_layers
    running = replace(Plan.from_tiers(cost.spec, ["gpu"] * (L + 1)), kept_layers=2)
    asked: list[dict[str, object]] = []
    monkeypatch.setattr(planning, "solve_milp", lambda c, budgets, **options: asked.append(options) or running)
    planned = planning.PlannedRun(plan=running, cost=cost, how="milp", sim=simulate(running, cost))
    replanner = planning.replanner_for(load_job_config({}), planned)
    assert replanner.solve(cost, running) is running
    assert asked[0]["start_tiers"] == running.tiers and asked[0]["start_kept"] == 2
