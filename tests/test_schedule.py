"""The step program (plan/schedule.py): written once, read by the simulator, the memory count and the executor.

Here: the program's fenced windows; the MILP's step against the simulated step of the program over drawn
instances; and the simulated peak under the cap the plan was solved for.
The executor side (measured arena peak == the program's count) is in test_executor.py.

`test_the_programs_are_the_golden_ones` compares drawn programs with tests/golden/step_programs.json, op for op
and action for action; regenerate it (only after a deliberate change of the step program) with
`python tests/test_schedule.py --regen`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import instance_from_cost, milp_step_s, solve_milp
from lazytrain.plan.plan import Plan
from lazytrain.plan.schedule import STATE_OPS, Shapes, build_program, state_schedule, update_order
from lazytrain.plan.sim import simulate

GOLDEN = Path(__file__).parent / "golden" / "step_programs.json"
SHAPES = Shapes(boundary_bytes=(100,) * 7, param_bytes=(1000,) * 6, head_param_bytes=1000, working_bytes=(50,) * 6,
                head_working_bytes=40, constant_bytes=7)
TIERS = ("gpu", "cpu", "recompute", "nvme", "recompute", "cpu", "gpu")


def _issued(program, kind: str, target: int) -> int:
    """Position among the actions where op (kind, target) is issued."""
    return next(k for k, a in enumerate(program.actions)
                if a.verb == "issue" and (program.ops[a.op].kind, program.ops[a.op].target) == (kind, target))


def _ran(program, kind: str, target: int) -> int:
    return next(k for k, a in enumerate(program.actions)
                if a.verb == "run" and (program.ops[a.op].kind, program.ops[a.op].target) == (kind, target))


def test_default_windows_follow_the_runtime_order() -> None:
    p = build_program(TIERS, SHAPES)
    assert _ran(p, "forward", 0) < _issued(p, "offload", 1) < _ran(p, "forward", 1)  # d2h in window 1
    assert _ran(p, "head", 6) > _issued(p, "reload", 5)  # the last segment's start reloads during the head
    # boundary 3 (nvme) starts segment (3, 5); its h2d is issued as segment (5, 6) starts, its read a segment
    # earlier (the head), staged in the host buffer
    assert _issued(p, "read", 3) < _ran(p, "head", 6) < _issued(p, "reload", 3) < _ran(p, "backward", 5)
    assert p.device_peak_bytes() == max(level for _, level in p.device_trace())


def test_every_window_waits_for_every_transfer_it_issued() -> None:
    """The fence: a transfer issued before compute op k is waited for after k and before compute k+1, so no
    transfer runs across a window and a window lasts its longest lane (what the MILP adds up). Optimizer-lane
    jobs queue across windows and are waited for at the end."""
    p = build_program(TIERS, SHAPES, optimizer_mode="serial")
    runs = [k for k, a in enumerate(p.actions) if a.verb == "run"]
    waited_at = {a.op: k for k, a in enumerate(p.actions) if a.verb == "wait"}
    assert sorted(waited_at) == [op.index for op in p.ops if op.lane != "compute"]  # every job, once
    for k, a in enumerate(p.actions):
        if a.verb != "issue":
            continue
        computes = [r for r in runs if k < r < waited_at[a.op]]
        if p.ops[a.op].lane == "optimizer":
            assert waited_at[a.op] > runs[-1]
        else:
            assert len(computes) <= 1, p.ops[a.op].name  # it overlaps at most its own window's compute


def _cost(L: int, rate_gbps: float, links: tuple[float, float, float, float]) -> CostModel:
    spec = ModelSpec(name=f"chain{L}", model_type="llama", num_layers=L, hidden_size=2048, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=128, intermediate_size=5632, vocab_size=32000)
    h2d, d2h, read, write = (rate_gbps * f for f in links)
    hardware = HardwareSpec.load("h800", h2d_gbps=h2d, d2h_gbps=d2h, nvme_read_gbps=read, nvme_write_gbps=write)
    return CostModel(spec, hardware, Workload(8, 2048, "bf16"))


instances = st.fixed_dictionaries({
    "L": st.integers(4, 16),
    "rate_gbps": st.sampled_from([0.3, 1.0, 3.0, 10.0, 30.0, math.inf]),  # very slow .. free
    "links": st.tuples(*(st.sampled_from([0.25, 0.5, 1.0, 2.0]) for _ in range(4))),
    "nvme": st.booleans(),
    "cap_boundaries": st.floats(4.0, 19.0),  # tight .. loose
    "kept_room": st.sampled_from([0, 0, 1, 2.5, 40]),  # room for this many kept layers' graphs and slots
    "cpu_boundaries": st.floats(0.0, 16.0),
    "mode": st.sampled_from(["overlap", "serial"]),
})


@settings(max_examples=25, deadline=None)
@given(case=instances)
def test_the_milp_step_is_the_simulated_step_and_its_plans_fit_their_cap(case: dict) -> None:
    """The step program's property: on drawn instances (4-16 layers, links very slow to free, nvme on and off, caps
    tight to loose -- up to keeping every layer's graph --, both optimizer modes) the MILP's step of its plan
    (tiers and kept layers) equals the simulated step of the plan's program within 1% + 1 ms (exactly, up to
    rounding), and the simulated device peak stays under the cap."""
    L = case["L"]
    cost = _cost(L, case["rate_gbps"], case["links"])
    A = max(cost.boundary_bytes)
    kept_bytes = cost.graph_bytes[0] + cost.param_bytes[0]
    cap = int(cost.static_device_bytes() + A * min(case["cap_boundaries"], L + 3) + kept_bytes * case["kept_room"])
    budgets = Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=int(A * case["cpu_boundaries"]),
                      nvme_act_bytes=int(A * L) if case["nvme"] else 0)
    try:
        plan = solve_milp(cost, budgets, time_limit_s=20, optimizer_mode=case["mode"])
    except LazyTrainError:
        return  # no placement fits this cap: the error says so (tested in test_milp.py)
    # on a loaded machine a 16-layer solve may stop at its limit: the property holds for the incumbent too
    assert plan.report.status in ("optimal", "time_limit")
    sim = simulate(plan, cost, optimizer_mode=case["mode"])
    assert sim.peak_bytes["gpu"] <= cap
    milp_s = plan.report.options["step_s"]
    assert abs(milp_s - sim.step_s) <= 0.01 * sim.step_s + 1e-3
    assert milp_s == pytest.approx(sim.step_s, rel=1e-6)
    inst = instance_from_cost(cost, budgets, optimizer_mode=case["mode"])
    assert milp_step_s(plan.tiers, inst, plan.kept_layers) == pytest.approx(milp_s, rel=1e-6)


offloads = st.fixed_dictionaries({
    "depth": st.integers(1, 8),
    "optimizer": st.sampled_from(["adamw", "8bit"]),
    "masters": st.sampled_from(["fp32", "bf16"]),
    "update_gbps": st.sampled_from([1.0, 10.0, 100.0, math.inf]),  # host bytes an update moves per second
    # the state files' rates on the NVMe links against the spills' (None: the same; calibration measures both)
    "state_links": st.tuples(*(st.sampled_from([None, 0.5, 1.5, 4.0]) for _ in range(2))),
    # the rate each NVMe direction keeps beside the other, against the slower one alone (None: not stated)
    "mixed": st.sampled_from([None, 0.25, 0.5, 1.0, 2.0]),
})


@settings(max_examples=15, deadline=None)
@given(case=instances, offload=offloads)
def test_the_milp_step_is_the_simulated_step_with_the_states_on_nvme(case: dict, offload: dict) -> None:
    """The same property with the optimizer's state on NVMe: a drawn staging depth, 8-bit or fp32
    states with or without the fp32 masters, updates from free to slower than the forward, the NVMe link from
    very slow to free and shared with the activations', the state files at the spills' rate or their own, the disk's
    rate with both directions at once stated or not; the MILP's step of its plan is the simulated one."""
    L, mode = case["L"], case["mode"]
    base = _cost(L, case["rate_gbps"], case["links"])
    hw = base.hardware
    hardware = hw.with_overrides(**{f"nvme_state_{d}_gbps": None if f is None else f * getattr(hw, f"nvme_{d}_gbps")
                                    for d, f in zip(("read", "write"), offload["state_links"], strict=True)},
                                 nvme_mixed_gbps=None if offload["mixed"] is None
                                 else offload["mixed"] * min(hw.nvme_read_gbps, hw.nvme_write_gbps))
    master = "bf16" if offload["optimizer"] == "8bit" else offload["masters"]
    cost = CostModel(base.spec, hardware, base.workload, offload["optimizer"], master_weights=master,
                     optimizer_offload="nvme")
    seconds = cost.param_bytes[0] * 8 / 1e9 / offload["update_gbps"]  # per layer group: 4 B of state per byte
    cost.optimizer_s = [seconds] * L
    cost.head_optimizer_s = cost.embedding_optimizer_s = seconds * cost.head_param_bytes / cost.param_bytes[0]
    A = max(cost.boundary_bytes)
    cap = int(cost.static_device_bytes() + A * min(case["cap_boundaries"], L + 3))
    budgets = Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=int(A * case["cpu_boundaries"]),
                      nvme_act_bytes=int(A * L) if case["nvme"] else 0)
    depth = min(offload["depth"], L)
    try:
        plan = solve_milp(cost, budgets, time_limit_s=20, optimizer_mode=mode, staging_depth=depth)
    except LazyTrainError:
        return
    assert plan.report.status in ("optimal", "time_limit")
    assert (plan.optimizer_offload, plan.staging_depth) == ("nvme", depth)
    sim = simulate(plan, cost, optimizer_mode=mode)
    assert sim.peak_bytes["gpu"] <= cap
    assert plan.report.options["step_s"] == pytest.approx(sim.step_s, rel=1e-6)
    inst = instance_from_cost(cost, budgets, optimizer_mode=mode, staging_depth=depth)
    assert milp_step_s(plan.tiers, inst, plan.kept_layers) == pytest.approx(sim.step_s, rel=1e-6)
    if hardware.nvme_mixed_gbps is not None:  # both NVMe lanes, spills' and state files', at most the mixed rate
        rates = (inst.nvme_read_bytes_per_s, inst.nvme_write_bytes_per_s, *inst.state_rates)
        assert max(rates) <= hardware.nvme_mixed_gbps * 1e9


ranks = st.fixed_dictionaries({
    "local_ranks": st.sampled_from([1, 2, 4, 8]),
    "nodes": st.sampled_from([1, 2, 4]),
    "intra_gbps": st.sampled_from([0.1, 1.0, 10.0, 160.0, math.inf]),  # very slow .. free
    "inter_gbps": st.sampled_from([0.1, 1.0, 10.0, 50.0, math.inf]),
})


def _check_ranks(case: dict, rank: dict) -> None:
    """The MILP's step of its plan equals the simulated step with the sums over the ranks, for one rank of a drawn
    topology (the rank's hardware: its share of the node's NVMe), and its plan fits the cap."""
    L, mode = case["L"], case["mode"]
    topology = Topology(world_size=rank["local_ranks"] * rank["nodes"], nodes=rank["nodes"])
    cost = _cost(L, case["rate_gbps"], case["links"])
    cost = CostModel(cost.spec, topology.rank_hardware(cost.hardware.with_overrides(
        intra_node_gbps=rank["intra_gbps"], inter_node_gbps=rank["inter_gbps"])), cost.workload)
    A = max(cost.boundary_bytes)
    kept_bytes = cost.graph_bytes[0] + cost.param_bytes[0]
    cap = int(cost.static_device_bytes() + A * min(case["cap_boundaries"], L + 3) + kept_bytes * case["kept_room"])
    budgets = Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=int(A * case["cpu_boundaries"]),
                      nvme_act_bytes=int(A * L) if case["nvme"] else 0)
    try:
        plan = solve_milp(cost, budgets, time_limit_s=20, optimizer_mode=mode, topology=topology)
    except LazyTrainError:
        return
    assert plan.report.status in ("optimal", "time_limit")
    sim = simulate(plan, cost, optimizer_mode=mode, topology=topology)
    assert sim.peak_bytes["gpu"] <= cap
    milp_s = plan.report.options["step_s"]
    assert milp_s == pytest.approx(sim.step_s, rel=1e-6)
    inst = instance_from_cost(cost, budgets, optimizer_mode=mode, topology=topology)
    assert milp_step_s(plan.tiers, inst, plan.kept_layers) == pytest.approx(milp_s, rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(case=instances, rank=ranks)
def test_the_milp_step_is_the_simulated_step_with_the_sums_over_the_ranks(case: dict, rank: dict) -> None:
    """The same property for data parallelism: world sizes 1-32 over 1-4 nodes, the gradients summed on the
    optimizer lane, intra- and inter-node links from 0.1 GB/s to free."""
    _check_ranks(case, rank)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(case=instances, rank=ranks)
def test_the_milp_step_is_the_simulated_step_with_the_sums_over_the_ranks_many_draws(case: dict, rank: dict) -> None:
    _check_ranks(case, rank)


def test_one_rank_plans_as_it_always_did() -> None:
    """World size 1 is the one-process MILP to the bit: the same instance, rows and solution."""
    cost = _cost(8, 3.0, (1.0, 0.5, 1.0, 1.0))
    budgets = Budgets(gpu_mem_cap_bytes=int(cost.static_device_bytes() + 6 * max(cost.boundary_bytes)),
                      cpu_act_bytes=int(2 * max(cost.boundary_bytes)))
    alone = solve_milp(cost, budgets)
    one = solve_milp(cost, budgets, topology=Topology(world_size=1))
    assert instance_from_cost(cost, budgets) == instance_from_cost(cost, budgets, topology=Topology(world_size=1))
    assert (one.tiers, one.report.options["step_s"], one.report.objective) == \
        (alone.tiers, alone.report.options["step_s"], alone.report.objective)


def test_a_slow_collective_link_changes_the_step_and_the_milp_sees_it() -> None:
    """The sums over the ranks in the objective: over a slow link they queue on the optimizer lane past the
    backward, and the MILP's step is the simulated one (not the one-rank step it used to report)."""
    cost = _cost(8, 10.0, (1.0, 1.0, 1.0, 1.0))
    cost = CostModel(cost.spec, cost.hardware.with_overrides(intra_node_gbps=1.0), cost.workload)
    budgets = Budgets(gpu_mem_cap_bytes=int(cost.static_device_bytes() + 12 * max(cost.boundary_bytes)))
    topology = Topology(world_size=4)
    plan = solve_milp(cost, budgets, topology=topology)
    ranks, alone = simulate(plan, cost, topology=topology), simulate(plan, cost)
    assert ranks.exposed_s["optimizer"] > 0.1 * ranks.step_s
    assert plan.report.options["step_s"] == pytest.approx(ranks.step_s, rel=1e-6)
    assert plan.report.options["step_s"] > alone.step_s * 1.1
    assert plan.report.options["world_size"] == 4


def test_a_plan_file_records_both_step_figures(tmp_path) -> None:
    from lazytrain.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--batch-size", "8", "--gpu-mem-cap", "30GB",
                 "--json", str(path)]) == 0
    prediction = Plan.load(path).prediction
    assert prediction is not None and prediction.simulated_step_s == prediction.step_s
    assert prediction.milp_step_s is not None and abs(prediction.milp_step_s / prediction.simulated_step_s - 1) < 0.01


def _op_of(program, kind: str, target: int):
    return next(op for op in program.ops if (op.kind, op.target) == (kind, target))


def test_overlap_updates_run_in_forward_order_and_fence_each_groups_forward_h2d() -> None:
    p = build_program(TIERS, SHAPES)  # overlap, first micro-batch: the previous step's updates
    updates = [op for op in p.ops if op.kind == "update"]
    assert [op.target for op in updates] == [-1, 0, 1, 2, 3, 4, 5, 6]  # embedding, layers, head
    assert all(op.lane == "optimizer" for op in updates)
    assert _issued(p, "update", 6) < _issued(p, "boundary0", 0)  # every update is queued before the step starts
    by_target = {op.target: op.index for op in updates}
    assert by_target[-1] in _op_of(p, "boundary0", 0).after  # the embedding gather waits for its update
    for op in p.ops:
        if op.kind == "weights" and p.uses[op.use][0] in ("forward", "head"):
            assert op.after == (by_target[op.target],), op.name  # group j's forward h2d: after update j only
    assert all(not (op.kind == "weights" and op.after) for op in p.ops if op.use > 6)  # later uses: no fence
    # tied head: its group owns the embedding, so it is updated first and fences the gather
    tied = build_program(TIERS, Shapes(**{**SHAPES.__dict__, "tied_head": True}))
    assert [op.target for op in tied.ops if op.kind == "update"] == [6, 0, 1, 2, 3, 4, 5]
    assert _op_of(tied, "update", 6).index in _op_of(tied, "boundary0", 0).after
    # a later micro-batch carries no update; serial mode ends with one "step" instead
    assert not any(op.kind == "update" for op in build_program(TIERS, SHAPES, updates=False).ops)
    serial = build_program(TIERS, SHAPES, optimizer_mode="serial")
    assert [op.kind for op in serial.ops if op.lane == "optimizer"][-1] == "step"
    assert not any(op.kind == "update" for op in serial.ops)
    assert p.device_peak_bytes() == serial.device_peak_bytes()  # the lane moves no device bytes


def test_kept_layers_stream_once_and_hold_their_graphs_until_their_backward() -> None:
    """Kept layers (the last K): their forward keeps a graph and its own weight slot, their backward runs
    through it with no weight h2d (the window before it issues none), and both are freed after it."""
    tiers = ("gpu", "cpu", "recompute", "gpu", "gpu", "gpu", "gpu")
    shapes = Shapes(**{**SHAPES.__dict__, "graph_bytes": (30,) * 6, "graph_forward_bytes": (80,) * 6,
                       "graph_backward_bytes": (20,) * 6})
    p = build_program(tiers, shapes, kept_layers=3)
    computes = [op for op in p.ops if op.lane == "compute"]
    assert [op.kind for op in computes] == ["forward"] * 3 + ["keep"] * 3 + ["head"] + ["backprop"] * 3 + \
        ["recompute", "backward", "backward", "backward"]
    assert [op.name for op in computes][7:10] == ["B5", "B4", "B3"]
    streamed = [op for op in p.ops if op.kind == "weights"]
    assert [op.target for op in streamed] == [0, 1, 2, 3, 4, 5, 6, 1, 2, 1, 0]  # kept 3..5 once; R1, B2, B1, B0
    first = next(k for k, a in enumerate(p.actions) if a.verb == "issue" and a.op == streamed[7].index)
    assert _ran(p, "backprop", 4) < first < _ran(p, "backprop", 3)  # R1's weights stream in B_3's window
    for j in (3, 4, 5):
        alloc = next(k for k, a in enumerate(p.actions) if a.verb == "alloc" and a.buffer == ("graph", j))
        free = next(k for k, a in enumerate(p.actions) if a.verb == "free" and a.buffer == ("graph", j))
        assert _ran(p, "keep", j) < alloc < _ran(p, "head", 6) < _ran(p, "backprop", j) < free
    assert p.device_peak_bytes() == max(level for _, level in p.device_trace())
    assert build_program(tiers, shapes).device_peak_bytes() < p.device_peak_bytes()
    with pytest.raises(LazyTrainError, match="kept_layers=5"):
        build_program(tiers, shapes, kept_layers=5)  # boundary 2 is recomputed


def test_the_milp_keeps_layers_when_they_fit_and_its_step_is_still_the_simulated_one() -> None:
    """With room for every graph and links that bind, the MILP keeps layers (their backward weight h2d and
    re-forward go), its step equals the simulated one, and the plan fits the cap; without the room it keeps none."""
    cost = _cost(8, 10.0, (1.0, 1.0, 1.0, 1.0))
    A = max(cost.boundary_bytes)
    room = cost.graph_bytes[0] + cost.param_bytes[0]
    for extra, kept in ((0, 0), (40 * room, 8)):
        cap = int(cost.static_device_bytes() + 12 * A + extra)
        budgets = Budgets(gpu_mem_cap_bytes=cap, cpu_act_bytes=0, nvme_act_bytes=0)
        plan = solve_milp(cost, budgets)
        sim = simulate(plan, cost)
        assert plan.kept_layers == kept and sim.peak_bytes["gpu"] <= cap
        assert plan.report.options["step_s"] == pytest.approx(sim.step_s, rel=1e-6)
        inst = instance_from_cost(cost, budgets)
        assert milp_step_s(plan.tiers, inst, kept) == pytest.approx(sim.step_s, rel=1e-6)
    assert sim.link_bytes["h2d"] < simulate(Plan(tiers=plan.tiers, model_fingerprint="-"), cost).link_bytes["h2d"]


def _buffer_at(program, verb: str, kind: str) -> int:
    return next(k for k, a in enumerate(program.actions) if a.verb == verb and a.buffer[0] == kind)


@pytest.mark.parametrize("tiers", [TIERS, ("gpu", "cpu", "gpu", "recompute", "recompute", "recompute", "gpu")])
def test_the_head_slots_live_only_around_the_windows_that_use_them(tiers) -> None:
    """A loss head larger than a layer gets its own weight and gradient slots, which exist only while live: the
    weight slot from its h2d's issue in F_{L-1} to the end of the head's compute, the gradient slot from H to the
    fence of the backward's first window (B_{L-1}, or R_s when the last segment (s, L) recomputes), which waited
    for its d2h. The layer slots stay sized for layers."""
    big = Shapes(**{**SHAPES.__dict__, "head_param_bytes": 3000, "head_grad_bytes": 3000})
    assert (big.slots_bytes, big.head_slot_bytes, SHAPES.head_slot_bytes) == (2000, 3000, 0)
    p = build_program(tiers, big)
    runs = [k for k, a in enumerate(p.actions) if a.verb == "run"]
    head = _ran(p, "head", 6)
    first = runs[runs.index(head) + 1]  # the backward's first window
    alloc_w, free_w = _buffer_at(p, "alloc", "head_weights"), _buffer_at(p, "free", "head_weights")
    assert _ran(p, "forward", 4) < alloc_w < _issued(p, "weights", 6) < _ran(p, "forward", 5)
    assert head < free_w < first
    alloc_g, free_g = _buffer_at(p, "alloc", "head_grads"), _buffer_at(p, "free", "head_grads")
    send = _issued(p, "grads", 6)
    waited = next(k for k, a in enumerate(p.actions) if a.verb == "wait" and a.op == p.actions[send].op)
    assert _ran(p, "forward", 5) < alloc_g < head < send < first < waited < free_g < runs[runs.index(first) + 1]
    assert all(a.num_bytes == 3000 for a in p.actions if a.buffer[0] in ("head_weights", "head_grads"))
    assert [a.num_bytes for a in p.actions if a.buffer[0] in ("weight_slots", "grad_slots")] == [2000] * 4
    # the level never counts a head slot outside those windows: the same program with a small head differs
    # from this one by exactly the live head slots at every alloc/free
    small, heads = build_program(tiers, SHAPES), ("head_weights", "head_grads")
    trace = [(k, level) for k, level in p.device_trace() if p.actions[k].buffer[0] not in heads]
    live = [3000 * (alloc_w <= k < free_w) + 3000 * (alloc_g <= k < free_g) for k, _ in trace]
    assert [level - s for (_, level), (_, s) in zip(trace, small.device_trace(), strict=True)] == live
    # evaluation: the weight slot alone, from F_{L-1}'s issue to the end of the loss
    e = build_program(tiers, big, forward_only=True)
    assert _ran(e, "forward", 4) < _buffer_at(e, "alloc", "head_weights") < _ran(e, "forward", 5)
    assert _ran(e, "loss", 6) < _buffer_at(e, "free", "head_weights")
    assert not any(a.buffer[0] == "head_grads" for a in e.actions)


# ---- the optimizer's state on NVMe ---------------------------------------------------------------------------
# state file bytes at index target + 1: the embedding, layers 0..5, the head
STATES = Shapes(**{**SHAPES.__dict__, "state_bytes": (300, 200, 210, 220, 230, 240, 250, 400)})


def _window(program, k: int) -> int:
    """The forward-phase window of action k: 0 = start, j + 1 = F_j, L + 1 = H (later: the backward's, counted on)."""
    constants = _buffer_at(program, "alloc", "constants")
    return sum(a.verb == "run" for a in program.actions[:k]) + (k > constants)


def _next_run(program, k: int):
    return program.ops[next(a.op for a in program.actions[k:] if a.verb == "run")]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 6])
def test_state_ops_are_issued_where_the_state_schedule_says(depth: int, tied: bool) -> None:
    """Overlap mode, a step's first and last micro-batch: the prologue updates the first D groups (prefetched);
    each forward window writes back the groups StateSchedule.write puts there and reads the ones .read puts there
    (each followed by its group's update, which waits for it), every state op fenced in its window; slot k % D,
    reused only after the write of the group before; the last D backward windows prefetch groups 0..D-1 into
    slots 0..D-1. The device side is the program without offload, to the action; the host side D slots."""
    shapes = Shapes(**{**STATES.__dict__, "tied_head": tied})
    p = build_program(TIERS, shapes, staging_depth=depth)  # device actions as without offload, D slots held
    L, state = 6, state_schedule(6, tied, depth)
    targets = update_order(L, tied)
    assert state.targets == tuple(targets) and p.staging_depth == depth
    waits = {a.op: k for k, a in enumerate(p.actions) if a.verb == "wait"}
    runs = [k for k, a in enumerate(p.actions) if a.verb == "run"]
    reads = [op for op in p.ops if op.kind == "state_read" and op.after]  # the forward's (the prefetch: no after)
    writes = [op for op in p.ops if op.kind == "state_write"]
    updates = {op.target: op for op in p.ops if op.kind == "update"}
    assert [op.target for op in writes] == targets and [op.target for op in reads] == targets[depth:]
    for k, j in enumerate(targets):
        write = writes[k]
        at = next(i for i, a in enumerate(p.actions) if a.verb == "issue" and a.op == write.index)
        assert _window(p, at) == state.write[k] and write.slot == k % depth
        assert write.after == (updates[j].index,) and write.num_bytes == shapes.state_bytes[j + 1]
        assert len([r for r in runs if at < r < waits[write.index]]) <= int(state.write[k] > 0)  # fenced there
        if k < depth:
            assert updates[j].after == ()  # prefetched by the previous step's backward
            continue
        read = reads[k - depth]
        at = next(i for i, a in enumerate(p.actions) if a.verb == "issue" and a.op == read.index)
        assert _window(p, at) == state.read[k] <= state.fence[k] and read.slot == k % depth
        assert read.after == (writes[k - depth].index,)  # the slot's previous group is written back first
        assert updates[j].after == (read.index,) and updates[j].index == read.index + 1
        assert len([r for r in runs if at < r < waits[read.index]]) <= int(state.read[k] > 0)
    prefetch = [op for op in p.ops if op.kind == "state_read" and not op.after]
    assert [(op.target, op.slot) for op in prefetch] == [(targets[k], k) for k in range(depth)]
    for op in prefetch:
        at = next(i for i, a in enumerate(p.actions) if a.verb == "issue" and a.op == op.index)
        assert _next_run(p, at).name == f"B{L - 1 - op.slot}"
        assert len([r for r in runs if at < r < waits[op.index]]) == 1  # fenced in that window
    plain = build_program(TIERS, SHAPES)
    assert [a for a in p.actions if a.verb in ("alloc", "free")] == \
        [a for a in plain.actions if a.verb in ("alloc", "free")]
    assert p.host_peak_bytes() == depth * 400 and plain.host_peak_bytes() == 0
    assert p.actions[0].verb == "host_alloc" and p.actions[-1].verb == "host_free"


def test_serial_mode_updates_after_the_backward_through_the_slots() -> None:
    """Serial mode, the last micro-batch: the backward prefetches the first D groups, then every group's update in
    update order, its write after it and the read of the slot's next group after that write; the program waits
    for the last update and the last write. No "step" op; a micro-batch before the last has no state op at all."""
    depth, targets = 3, update_order(6, False)
    p = build_program(TIERS, STATES, optimizer_mode="serial", staging_depth=depth)
    assert not any(op.kind == "step" for op in p.ops)
    last_run = max(k for k, a in enumerate(p.actions) if a.verb == "run")
    tail = [p.ops[a.op] for a in p.actions[last_run:] if a.verb == "issue" and p.ops[a.op].lane != "d2h"
            and p.ops[a.op].kind in ("update", *STATE_OPS)]
    expected = []
    for k, j in enumerate(targets):
        expected += [("update", j), ("state_write", j)]
        if k + depth < len(targets):
            expected.append(("state_read", targets[k + depth]))
    assert [(op.kind, op.target) for op in tail] == expected
    by = {(op.kind, op.target): op for op in tail}
    for k, j in enumerate(targets):
        assert by["state_write", j].after == (by["update", j].index,) and by["state_write", j].slot == k % depth
        if k >= depth:
            assert by["update", j].after == (by["state_read", j].index,)
            assert by["state_read", j].after == (by["state_write", targets[k - depth]].index,)
    ends = [a for a in p.actions if a.verb == "wait"][-2:]
    assert [p.ops[a.op].name for a in ends] == ["update 6", "state_write 6"]
    assert len([op for op in p.ops if op.kind == "state_read" and not op.after]) == depth  # the prefetch
    early = build_program(TIERS, STATES, optimizer_mode="serial", staging_depth=depth, last_micro_batch=False)
    assert not any(op.kind in ("update", "step", *STATE_OPS) for op in early.ops)
    assert early.host_peak_bytes() == depth * 400


def test_a_later_micro_batch_prefetches_only_when_it_is_the_last() -> None:
    """Overlap mode without the updates (a step's later micro-batch): no forward state op; the prefetch reads
    only in the micro-batch whose gradients are final."""
    for last in (False, True):
        p = build_program(TIERS, STATES, updates=False, staging_depth=2, last_micro_batch=last)
        assert [op.kind for op in p.ops if op.kind in ("update", *STATE_OPS)] == ["state_read"] * 2 * last


def test_bad_staging_depths_are_refused() -> None:
    with pytest.raises(LazyTrainError, match="staging_depth 7 must be in 1..6"):
        build_program(TIERS, STATES, staging_depth=7)
    with pytest.raises(LazyTrainError, match="state_bytes"):
        build_program(TIERS, SHAPES, staging_depth=1)
    with pytest.raises(LazyTrainError, match="state_bytes needs 8 entries"):
        Shapes(**{**SHAPES.__dict__, "state_bytes": (1, 2)})
    cost = _cost(6, 3.0, (1.0, 1.0, 1.0, 1.0))
    nvme = CostModel(cost.spec, cost.hardware, cost.workload, optimizer_offload="nvme")
    with pytest.raises(LazyTrainError, match="no staging depth"):
        simulate(Plan.from_tiers(cost.spec, ["gpu"] * 7), nvme)


def _drawn_programs(count: int = 400, seed: int = 1234) -> list[str]:
    """Digests of `count` drawn programs: 1-9 layers, every tier, kept layers, a head larger or smaller than a
    layer, tied or not, both optimizer modes, with and without updates, evaluation, one rank or several."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        L = rng.randint(1, 9)
        tiers = ("gpu", *(rng.choice(["gpu", "cpu", "nvme", "recompute"]) for _ in range(L - 1)), "gpu")
        kept = 0
        while kept < L and tiers[L - kept - 1] == "gpu" and rng.random() < 0.5:
            kept += 1
        per_layer = [tuple(rng.randint(1, 50) for _ in range(L)) for _ in range(3)]
        shapes = Shapes(boundary_bytes=tuple(rng.randint(10, 300) for _ in range(L + 1)),
                        param_bytes=tuple(rng.randint(100, 1000) for _ in range(L)),
                        head_param_bytes=rng.choice([rng.randint(50, 900), rng.randint(1001, 3000)]),
                        working_bytes=tuple(rng.randint(1, 99) for _ in range(L)),
                        head_working_bytes=rng.randint(1, 99),
                        constant_bytes=rng.randint(0, 20), tied_head=rng.random() < 0.5, dtype_bytes=rng.choice([2, 4]),
                        graph_bytes=per_layer[0], graph_forward_bytes=per_layer[1], graph_backward_bytes=per_layer[2])
        p = build_program(tiers, shapes, optimizer_mode=rng.choice(["overlap", "serial"]), updates=rng.random() < 0.7,
                          forward_only=rng.random() < 0.15, kept_layers=kept,
                          topology=ONE_RANK if rng.random() < 0.6 else Topology(world_size=rng.choice([2, 4, 8])))
        text = repr((p.tiers, p.ops, p.actions, p.uses, p.optimizer_mode, p.kept_layers, p.topology))
        out.append(hashlib.sha256(text.encode()).hexdigest()[:16])
    return out


def _drawn_offload_programs(count: int = 150, seed: int = 4321) -> list[str]:
    """Digests of drawn programs with the optimizer's state on NVMe: 1-9 layers, every tier, depth 1..L, tied or
    not, both modes, with and without the updates, last micro-batch or not."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        L = rng.randint(1, 9)
        tiers = ("gpu", *(rng.choice(["gpu", "cpu", "nvme", "recompute"]) for _ in range(L - 1)), "gpu")
        shapes = Shapes(boundary_bytes=tuple(rng.randint(10, 300) for _ in range(L + 1)),
                        param_bytes=tuple(rng.randint(100, 1000) for _ in range(L)),
                        head_param_bytes=rng.randint(50, 3000),
                        working_bytes=tuple(rng.randint(1, 99) for _ in range(L)),
                        head_working_bytes=rng.randint(1, 99), tied_head=rng.random() < 0.5,
                        state_bytes=tuple(rng.randint(100, 5000) for _ in range(L + 2)))
        p = build_program(tiers, shapes, optimizer_mode=rng.choice(["overlap", "serial"]), updates=rng.random() < 0.7,
                          staging_depth=rng.randint(1, L), last_micro_batch=rng.random() < 0.7)
        text = repr((p.tiers, p.ops, p.actions, p.uses, p.optimizer_mode, p.staging_depth))
        out.append(hashlib.sha256(text.encode()).hexdigest()[:16])
    return out


def test_the_programs_are_the_golden_ones() -> None:
    """The step program is what it was (the executor, the simulator, the memory count and the MILP all read it):
    drawn programs equal the golden file's, op for op and action for action."""
    golden = json.loads(GOLDEN.read_text())["digests"]
    drawn = _drawn_programs() + _drawn_offload_programs()
    differ = [k for k, (a, b) in enumerate(zip(golden, drawn, strict=True)) if a != b]
    assert not differ, f"{len(differ)} of {len(drawn)} drawn programs changed (first: draw {differ[0]}); if the " \
        "step program changed on purpose, regenerate the golden file (see the module docstring)"


if __name__ == "__main__" and sys.argv[1:] == ["--regen"]:
    GOLDEN.write_text(json.dumps({"digests": _drawn_programs() + _drawn_offload_programs()}, indent=0) + "\n")
