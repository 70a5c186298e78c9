"""Simulator: hand-computed step times and device peaks on tiny synthetic chains, and the stall accounting."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytrain.costmodel.cost import STATE_HEADER_BYTES, CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan, Prediction
from lazytrain.plan.schedule import program_for
from lazytrain.plan.sim import simulate

RNG = random.Random(20261202)


def _spec(L: int) -> ModelSpec:
    return ModelSpec(name=f"chain{L}", model_type="llama", num_layers=L, hidden_size=8, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=4, intermediate_size=16, vocab_size=32)


def synthetic(L: int, *, forward: list[float] | float, backward: list[float] | float | None = None,
              head_s: float = 0.0, weight_bytes: int = 1000, act_bytes: int = 100,
              working: list[int] | int = 50, head_working: int = 40, optimizer_s: float = 0.0,
              links_gbps: dict[str, float] | None = None) -> CostModel:
    """A CostModel whose seconds and bytes are set by hand (links in GB/s; inf = free)."""
    links = {"h2d_gbps": math.inf, "d2h_gbps": math.inf, "nvme_read_gbps": math.inf, "nvme_write_gbps": math.inf,
             **(links_gbps or {})}
    cost = CostModel(_spec(L), HardwareSpec.load("emulated", **links), Workload(1, 4, "fp32"))
    fwd = [forward] * L if isinstance(forward, float | int) else list(forward)
    bwd = [3 * f for f in fwd] if backward is None else backward
    cost = cost.with_times(forward_s=fwd, backward_s=bwd, head_s=head_s, optimizer_s=optimizer_s)
    cost.param_bytes = [weight_bytes] * L
    cost.grad_bytes = [weight_bytes] * L
    cost.head_param_bytes = cost.head_grad_bytes = weight_bytes
    cost.boundary_bytes = [act_bytes] * (L + 1)
    cost.working_bytes = [working] * L if isinstance(working, int) else list(working)
    cost.head_working_bytes = head_working
    cost.head_optimizer_s = cost.embedding_optimizer_s = optimizer_s
    cost.accumulate_s = [0.0] * L
    cost.head_accumulate_s = cost.embedding_accumulate_s = 0.0
    cost.constant_device_bytes = 7
    return cost


def _plan(tiers: list[str]) -> Plan:
    return Plan.from_tiers(_spec(len(tiers) - 1), tiers)


def _compute_sum(cost: CostModel, plan: Plan) -> float:
    total = sum(cost.forward_s) + cost.head_s + sum(cost.backward_s)
    for s, e in plan.segments():
        total += sum(cost.forward_s[s:e - 1])  # recompute s..e-2
    return total


tiers_strategy = st.integers(2, 7).flatmap(lambda L: st.lists(
    st.sampled_from(["gpu", "cpu", "nvme", "recompute"]), min_size=L - 1, max_size=L - 1
).map(lambda inner: ["gpu", *inner, "gpu"]))


@settings(max_examples=40, deadline=None)
@given(tiers=tiers_strategy, seed=st.integers(0, 2**31))
def test_infinite_links_give_the_sum_of_compute(tiers: list[str], seed: int) -> None:
    rng = random.Random(seed)
    L = len(tiers) - 1
    cost = synthetic(L, forward=[rng.uniform(0.1, 1) for _ in range(L)], head_s=rng.uniform(0.1, 1))
    plan = _plan(tiers)
    result = simulate(plan, cost)
    assert result.step_s == pytest.approx(_compute_sum(cost, plan))
    assert result.compute_s == pytest.approx(result.step_s)
    assert all(v == pytest.approx(0.0, abs=1e-12) for v in result.exposed_s.values())


@settings(max_examples=40, deadline=None)
@given(tiers=tiers_strategy, seed=st.integers(0, 2**31), mode=st.sampled_from(["overlap", "serial"]))
def test_compute_plus_exposed_is_the_step_time(tiers: list[str], seed: int, mode: str) -> None:
    rng = random.Random(seed)
    L = len(tiers) - 1
    links = {k: rng.choice([math.inf, rng.uniform(1e-7, 1e-5)]) for k in
             ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps")}
    cost = synthetic(L, forward=[rng.uniform(0.1, 1) for _ in range(L)], head_s=rng.uniform(0.1, 1),
                     optimizer_s=rng.uniform(0, 0.5), links_gbps=links)
    result = simulate(_plan(tiers), cost, optimizer_mode=mode)
    assert result.compute_s + sum(result.exposed_s.values()) == pytest.approx(result.step_s)
    assert result.compute_s == pytest.approx(_compute_sum(cost, _plan(tiers)))
    assert result.memory_trace["gpu"][-1][1] == 0  # every device byte is returned at the end


def test_slow_link_makes_the_step_link_bound_by_hand() -> None:
    # keep-all, 3 layers: 7 weight uses (F0 F1 F2 H B2 B1 B0). Each weight copy takes w >> compute c, so the
    # h2d stream never idles: boundary 0 (a), then 7 copies, then the last compute.
    c, rate_gbps = 1e-3, 1e-6  # 1000 B at 1 kB/s: w = 1 s
    cost = synthetic(3, forward=c, backward=c, head_s=c, weight_bytes=1000, act_bytes=100,
                     links_gbps={"h2d_gbps": rate_gbps})
    a, w = 100 / 1e3, 1000 / 1e3
    result = simulate(_plan(["gpu"] * 4), cost)
    assert result.step_s == pytest.approx(a + 7 * w + c)
    assert result.exposed_s["h2d"] == pytest.approx(a + 7 * w - 6 * c)
    assert result.busy_s["h2d"] == pytest.approx(a + 7 * w)


def test_fast_link_hides_everything_but_the_first_copy() -> None:
    c = 1.0
    cost = synthetic(3, forward=c, backward=c, head_s=c, weight_bytes=1000, act_bytes=100,
                     links_gbps={"h2d_gbps": 1e-5})  # 1000 B at 10 kB/s: w = 0.1 s < c
    result = simulate(_plan(["gpu"] * 4), cost)
    assert result.step_s == pytest.approx(0.01 + 0.1 + 7 * c)
    assert result.exposed_s["h2d"] == pytest.approx(0.11)


def test_more_recompute_costs_exactly_the_recomputed_forwards() -> None:
    L = 6
    fwd = [RNG.uniform(0.1, 1) for _ in range(L)]
    keep = simulate(_plan(["gpu"] * (L + 1)), synthetic(L, forward=fwd))
    plan = _plan(["gpu", "recompute", "recompute", "gpu", "recompute", "gpu", "gpu"])  # segments (0,3) (3,5) (5,6)
    more = simulate(plan, synthetic(L, forward=fwd))
    assert more.compute_s - keep.compute_s == pytest.approx(fwd[0] + fwd[1] + fwd[3])
    everything = simulate(_plan(["gpu"] + ["recompute"] * (L - 1) + ["gpu"]), synthetic(L, forward=fwd))
    assert everything.compute_s - keep.compute_s == pytest.approx(sum(fwd[:L - 1]))
    # one long segment regenerates every boundary before its backward: the same peak as keeping them all
    assert everything.peak_bytes["gpu"] == keep.peak_bytes["gpu"]
    assert more.peak_bytes["gpu"] < keep.peak_bytes["gpu"]


def test_offloading_over_a_slow_link_exposes_stall() -> None:
    L = 5
    offload = _plan(["gpu"] + ["cpu"] * (L - 1) + ["gpu"])
    fast = simulate(offload, synthetic(L, forward=0.1, act_bytes=10**4))
    keep = simulate(_plan(["gpu"] * (L + 1)), synthetic(L, forward=0.1, act_bytes=10**4))
    assert fast.step_s == pytest.approx(keep.step_s)
    slow_cost = synthetic(L, forward=0.1, act_bytes=10**4, links_gbps={"d2h_gbps": 1e-5, "h2d_gbps": 1e-5})
    slow = simulate(offload, slow_cost)  # 1 s per boundary copy vs 0.1 s of compute
    assert slow.exposed_s["d2h"] > 0.5 and slow.exposed_s["h2d"] > 0.5
    assert slow.step_s > keep.step_s + 1.0
    assert slow.peak_bytes["gpu"] < keep.peak_bytes["gpu"]
    nvme = simulate(_plan(["gpu"] + ["nvme"] * (L - 1) + ["gpu"]),
                    synthetic(L, forward=0.1, act_bytes=10**4, links_gbps={"nvme_read_gbps": 1e-5}))
    assert nvme.exposed_s["nvme_read"] > 0.5


def test_serial_optimizer_runs_after_backward() -> None:
    L, opt = 4, 0.2
    cost = synthetic(L, forward=0.5, optimizer_s=opt)
    plan = _plan(["gpu", "recompute", "gpu", "cpu", "gpu"])
    serial = simulate(plan, cost, optimizer_mode="serial")
    overlap = simulate(plan, cost, optimizer_mode="overlap")
    total = opt * (L + 2)  # layers + head + embedding
    assert cost.total_optimizer_s == pytest.approx(total)
    assert serial.step_s == pytest.approx(serial.forward_backward_s + total)
    assert serial.forward_backward_s == pytest.approx(_compute_sum(cost, plan))
    assert serial.exposed_s["optimizer"] == pytest.approx(total)
    # overlap (the previous step's updates, forward order, before each group's forward h2d): the embedding's
    # and layer 0's updates are exposed before F0 (0.4 s); layer j >= 1's ends at 0.2 (j + 2) < 0.4 + 0.5 j
    assert overlap.step_s == pytest.approx(_compute_sum(cost, plan) + 2 * opt)
    assert overlap.exposed_s["optimizer"] == pytest.approx(2 * opt)


def test_overlap_update_slower_than_the_forward_is_exposed_group_by_group() -> None:
    L, opt, fwd = 4, 0.7, 0.5
    cost = synthetic(L, forward=fwd, optimizer_s=opt)
    plan = _plan(["gpu"] * (L + 1))
    overlap = simulate(plan, cost, optimizer_mode="overlap")
    serial = simulate(plan, cost, optimizer_mode="serial")
    # F_j starts when update j ends: (j + 2) * opt; the head's update ends at (L + 2) * opt, the head at
    # max(that, F_{L-1}'s end); then the backward (3 * fwd per layer) runs unhindered
    head_start = max((L + 2) * opt, (L + 1) * opt + fwd)
    assert overlap.step_s == pytest.approx(head_start + L * 3 * fwd)
    assert overlap.exposed_s["optimizer"] == pytest.approx(head_start - L * fwd)
    assert serial.step_s - overlap.step_s == pytest.approx((L + 2) * opt - (head_start - L * fwd))


def _nvme(cost: CostModel, state_bytes: int) -> CostModel:
    """`cost` with its optimizer's state on NVMe, every group's file `state_bytes`."""
    cost.optimizer_offload = "nvme"
    cost.state_group_bytes = lambda: (state_bytes,) * (cost.num_layers + 2)  # type: ignore[method-assign]
    return cost


def test_state_ops_by_hand() -> None:
    """Two layers, every group's update 2 s, its state file 1 s to read and 1 s to write, free PCIe.
    Overlap, one staging slot: the prologue updates the embedding [0, 2]; the start window writes it back [2, 3],
    reads layer 0 into the slot [3, 4], updates it [4, 6] and its weights go up: E0 = 6. F0 writes layer 0 [6, 7],
    reads layer 1 [7, 8], updates it [8, 10]: 10; F1 likewise for the head: 14; H writes the head back: 15;
    B1 (3 s) prefetches the embedding for the next step; B0: 21. Without offload: 14 (the updates back to back).
    Serial, one slot: forward and backward 8 s (the prefetch under B1), then update, write, read per group
    chained: 8 + 4 x 2 + 4 x 1 + 3 x 1 = 23; two slots: the next group's read and this one's update overlap: 17."""
    cost = synthetic(2, forward=1.0, optimizer_s=2.0, links_gbps={"nvme_read_gbps": 1.0, "nvme_write_gbps": 1.0})
    plan = _plan(["gpu"] * 3)
    assert simulate(plan, cost).step_s == pytest.approx(14.0)
    assert simulate(plan, cost, optimizer_mode="serial").step_s == pytest.approx(16.0)
    nvme = _nvme(cost, 10**9)
    one = simulate(replace(plan, optimizer_offload="nvme", staging_depth=1), nvme)
    assert one.step_s == pytest.approx(21.0) and one.compute_s == pytest.approx(8.0)
    assert one.busy_s["nvme_read"] == pytest.approx(4.0) and one.busy_s["nvme_write"] == pytest.approx(4.0)
    assert one.link_bytes["nvme_read"] == one.link_bytes["nvme_write"] == 4 * 10**9
    serial = {D: simulate(replace(plan, optimizer_offload="nvme", staging_depth=D), nvme, optimizer_mode="serial")
              for D in (1, 2)}
    assert serial[1].step_s == pytest.approx(23.0) and serial[1].forward_backward_s == pytest.approx(8.0)
    assert serial[2].step_s == pytest.approx(17.0)
    for r in (one, *serial.values()):
        assert r.compute_s + sum(r.exposed_s.values()) == pytest.approx(r.step_s)


@settings(max_examples=30, deadline=None)
@given(tiers=tiers_strategy, seed=st.integers(0, 2**31), mode=st.sampled_from(["overlap", "serial"]))
def test_state_files_on_free_or_slow_nvme(tiers: list[str], seed: int, mode: str) -> None:
    """Any tiers and depth: compute + exposed = step, the state files' bytes cross the NVMe lanes once each way
    per step, the host peak is the static bytes (no state) + D slots + the cpu boundaries, the NVMe peak holds the
    files; with a free NVMe link a serial step takes what it takes with the states in RAM."""
    rng = random.Random(seed)
    L = len(tiers) - 1
    links = {k: rng.choice([math.inf, rng.uniform(1e-7, 1e-5)]) for k in ("nvme_read_gbps", "nvme_write_gbps")}
    cost = synthetic(L, forward=[rng.uniform(0.1, 1) for _ in range(L)], head_s=rng.uniform(0.1, 1),
                     optimizer_s=rng.uniform(0, 0.5), links_gbps=links)
    ram = simulate(_plan(tiers), cost, optimizer_mode=mode)
    size, depth = rng.randint(1, 10**4), rng.randint(1, L)
    nvme = _nvme(cost, size)
    plan = replace(_plan(tiers), optimizer_offload="nvme", staging_depth=depth)
    result = simulate(plan, nvme, optimizer_mode=mode)
    assert result.compute_s + sum(result.exposed_s.values()) == pytest.approx(result.step_s)
    assert result.link_bytes["nvme_read"] - ram.link_bytes["nvme_read"] == (L + 2) * size
    assert result.link_bytes["nvme_write"] - ram.link_bytes["nvme_write"] == (L + 2) * size
    assert result.peak_bytes["cpu"] == ram.peak_bytes["cpu"] - cost.optimizer_state_bytes() + depth * size
    assert result.peak_bytes["nvme"] == ram.peak_bytes["nvme"] + (L + 2) * (size + STATE_HEADER_BYTES)
    if mode == "serial" and links["nvme_read_gbps"] == links["nvme_write_gbps"] == math.inf:
        assert result.step_s == pytest.approx(ram.step_s)
    assert result.step_s >= ram.step_s - 1e-9  # the state ops only ever delay


def test_device_peak_of_keep_all_two_layers_by_hand() -> None:
    W, A = RNG.randrange(500, 900), RNG.randrange(50, 200)
    w0, w1, hw, k = RNG.randrange(10, 300), RNG.randrange(10, 300), RNG.randrange(10, 300), 7
    cost = synthetic(2, forward=0.1, weight_bytes=W, act_bytes=A, working=[w0, w1], head_working=hw)
    expected = max(
        2 * W + 2 * A + k + w0,  # F0: boundaries 0, 1 and layer 0's working set
        2 * W + 3 * A + k + w1,  # F1
        4 * W + 4 * A + k + hw,  # head: + gradient slots, gradient of boundary 2
        4 * W + 5 * A + k + w1,  # B1: boundaries 0-2, gradients 2 and 1
        4 * W + 4 * A + k + w0,  # B0: boundaries 0-1, gradients 1 and 0
    )
    assert simulate(_plan(["gpu"] * 3), cost).peak_bytes["gpu"] == expected


def _peak_by_hand(tiers: list[str], A: int, slots: int, working: list[int], head_working: int, constant: int) -> int:
    """The executor's allocations replayed in order, written out independently of plan/schedule.py."""
    L = len(tiers) - 1
    used = peak = 0

    def add(n: int) -> None:
        nonlocal used, peak
        used += n
        peak = max(peak, used)

    add(slots + A + constant)  # weight slots, boundary 0, constants
    for j in range(L):
        add(working[j] + A)  # working set, then boundary j+1 appears
        used -= working[j]
        if j > 0 and tiers[j] != "gpu":
            used -= A  # boundary j leaves the device once consumed (offloaded or dropped)
    kept = [i for i, t in enumerate(tiers) if t != "recompute"]
    segments = list(zip(kept[:-1], kept[1:], strict=True))
    add(slots)  # gradient slots
    if tiers[segments[-1][0]] in ("cpu", "nvme"):
        add(A)  # reload of the last segment's start, issued as the head starts
    add(head_working + A)  # head working set, d(boundary L)
    used -= head_working
    for idx in range(len(segments) - 1, -1, -1):
        s, e = segments[idx]
        for j in range(s, e - 1):
            add(working[j] + A)
            used -= working[j]
        for j in range(e - 1, s - 1, -1):
            if j == s and idx > 0 and tiers[segments[idx - 1][0]] in ("cpu", "nvme"):
                add(A)  # reload of the previous segment's start, in this segment's last window
            add(working[j] + A)  # working set, d(boundary j)
            used -= working[j] + 2 * A  # boundary j+1 and its gradient
    return peak


@settings(max_examples=30, deadline=None)
@given(tiers=tiers_strategy, seed=st.integers(0, 2**31))
def test_device_peak_equals_the_executor_accounting(tiers: list[str], seed: int) -> None:
    rng = random.Random(seed)
    L = len(tiers) - 1
    working = [rng.randrange(1, 400) for _ in range(L)]
    cost = synthetic(L, forward=0.1, weight_bytes=rng.randrange(100, 1000), act_bytes=rng.randrange(10, 300),
                     working=working, head_working=rng.randrange(1, 400),
                     links_gbps={"h2d_gbps": 1e-6, "d2h_gbps": 2e-6})  # the peak must not depend on speeds
    slots = 2 * max(cost.param_bytes) + (cost.head_param_bytes if cost.head_param_bytes > max(cost.param_bytes) else 0)
    by_hand = _peak_by_hand(tiers, cost.boundary_bytes[0], slots, working, cost.head_working_bytes,
                            cost.constant_device_bytes)
    assert simulate(_plan(tiers), cost).peak_bytes["gpu"] == by_hand
    assert program_for(_plan(tiers), cost).device_peak_bytes() == by_hand


def test_host_and_nvme_peaks_count_offloaded_boundaries() -> None:
    tiers = ["gpu", "cpu", "nvme", "cpu", "recompute", "nvme", "gpu"]
    cost = synthetic(6, forward=0.1, act_bytes=123)
    result = simulate(_plan(tiers), cost)
    assert result.peak_bytes["nvme"] == 2 * 123
    assert result.host_activation_bytes == 2 * 123
    assert result.peak_bytes["cpu"] == cost.static_host_bytes() + 4 * 123


def test_prediction_and_bad_inputs() -> None:
    cost = synthetic(3, forward=0.25, head_s=0.1)
    result = simulate(_plan(["gpu", "cpu", "recompute", "gpu"]), cost)
    pred = result.to_prediction()
    assert isinstance(pred, Prediction) and pred.step_s == result.step_s
    assert pred.tflops == pytest.approx(cost.tflops(result.step_s))
    assert set(pred.exposed_s) == {"h2d", "d2h", "nvme_read", "nvme_write", "optimizer"}
    assert "TFLOPS" in result.summary()
    assert [e.stream for e in result.events].count("compute") == 3 + 1 + 3 + 1  # F, H, B, one recompute
    with pytest.raises(LazyTrainError, match="optimizer_mode"):
        simulate(_plan(["gpu"] * 4), cost, optimizer_mode="lazy")
    with pytest.raises(LazyTrainError, match="layers"):
        simulate(_plan(["gpu"] * 5), cost)


def test_timeline_picture_is_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from lazytrain.viz import plot_timeline

    cost = synthetic(4, forward=0.2, head_s=0.1, optimizer_s=0.05, links_gbps={"h2d_gbps": 1e-5, "d2h_gbps": 1e-5})
    result = simulate(_plan(["gpu", "cpu", "recompute", "nvme", "gpu"]), cost)
    path = plot_timeline(result, tmp_path / "t" / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
