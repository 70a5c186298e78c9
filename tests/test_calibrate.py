"""One calibration path: measured steps -> CostModel, medians pooled over like layers and quantized."""

from __future__ import annotations

import math
import os
import random
import statistics
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from lazytrain import EmulatedDevice, Executor
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.topology import Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.milp import solve_milp
from lazytrain.plan.plan import Plan, spec_of
from lazytrain.plan.sim import simulate
from lazytrain.runtime import calibrate as calibration
from lazytrain.runtime.calibrate import QUANTUM, calibrate, calibrate_links, probe_steps, quantize_s, rebuilt
from lazytrain.runtime.probe import nvme_gbps


@dataclass
class Stats:  # the fields of runtime.executor.StepStats calibration reads
    forward_s: list[float]
    backward_s: list[float]
    head_s: float
    wall_s: float = 1.0
    recompute_s: list[float] = field(default_factory=list)
    stall_s: dict[str, float] = field(default_factory=dict)
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)


def test_quantize_is_a_grid_within_half_a_step() -> None:
    rng = random.Random(1)
    for _ in range(500):
        x = 10 ** rng.uniform(-6, 2)
        q = quantize_s(x)
        assert abs(q / x - 1) <= QUANTUM / 2 + 1e-6
        assert quantize_s(q) == q
    assert quantize_s(0.0) == 0.0


def _cost() -> CostModel:
    spec = ModelSpec.load("tiny-llama")
    return CostModel(spec, HardwareSpec.load("emulated"), Workload(2, 64, "fp32"))


def _noisy_steps(cost: CostModel, seed: int, noise: float) -> list[Stats]:
    """Three steps whose layer times sit within +-noise of grid points (pooled medians stay in their bin)."""
    rng = random.Random(seed)
    L = cost.num_layers
    base_f, base_b, base_h = quantize_s(0.0123), quantize_s(0.0371), quantize_s(0.02)
    return [Stats(forward_s=[base_f * (1 + rng.uniform(-noise, noise)) for _ in range(L)],
                  backward_s=[base_b * (1 + rng.uniform(-noise, noise)) for _ in range(L)],
                  head_s=base_h * (1 + rng.uniform(-noise, noise))) for _ in range(3)]


def test_the_same_machine_gives_the_same_cost_model_and_plan() -> None:
    cost = _cost()
    a = calibrate(cost, _noisy_steps(cost, 1, 0.01), optimizer_s=0.05)
    b = calibrate(cost, _noisy_steps(cost, 2, 0.01), optimizer_s=0.0505)
    assert (a.forward_s, a.backward_s, a.head_s, a.optimizer_s) == (b.forward_s, b.backward_s, b.head_s, b.optimizer_s)
    act = max(a.boundary_bytes)
    budgets = Budgets(gpu_mem_cap_bytes=a.static_device_bytes() + 5 * act, cpu_act_bytes=2 * act, nvme_act_bytes=0)
    assert solve_milp(a, budgets).tiers == solve_milp(b, budgets).tiers


def test_medians_pool_like_layers_and_a_real_change_moves_the_model() -> None:
    cost = _cost()
    steps = _noisy_steps(cost, 3, 0.0)
    steps[1].forward_s[0] = 5.0  # one disturbed sample: the median ignores it
    out = calibrate(cost, steps)
    assert len(set(out.forward_s)) == 1 and out.forward_s[0] == pytest.approx(0.0123, rel=QUANTUM)
    slower = calibrate(cost, [Stats([2 * t for t in s.forward_s], s.backward_s, s.head_s) for s in steps])
    assert slower.forward_s[0] == pytest.approx(2 * out.forward_s[0], rel=QUANTUM)


def test_bad_steps_are_refused() -> None:
    cost = _cost()
    L = cost.num_layers
    with pytest.raises(LazyTrainError, match="no measured step"):
        calibrate(cost, [Stats([0.0] * L, [0.0] * L, 0.0)])
    with pytest.raises(LazyTrainError, match="layers"):
        calibrate(cost, [Stats([0.1] * (L + 1), [0.1] * (L + 1), 0.1)])
    with pytest.raises(LazyTrainError, match="optimizer seconds"):
        calibrate(cost, _noisy_steps(cost, 0, 0.0), optimizer_s=0.0)


def test_measured_sums_become_the_link_rates_the_simulator_times_them_at() -> None:
    """The ranks' timed sums (Ranks.time_sums) -> the rates at which the simulator's reduce op of that many bytes
    takes those seconds again (to the quantum); a phase the layout has not keeps the hardware's figure."""
    cost = calibrate(_cost(), _noisy_steps(_cost(), 1, 0.0))
    rng = random.Random(7)
    S, node_s, across_s = rng.randrange(10**5, 10**8), rng.uniform(0.01, 1.0), rng.uniform(0.01, 1.0)
    for topology, expect in ((Topology(world_size=2), (node_s, None)), (Topology(world_size=2, nodes=2),
                                                                        (None, across_s)),
                             (Topology(world_size=8, nodes=2), (node_s, across_s))):
        out = calibrate_links(cost, topology, S, node_s, across_s)
        intra, inter = topology.link_bytes(S)
        for sent, name, seconds in ((intra, "intra_node_gbps", expect[0]), (inter, "inter_node_gbps", expect[1])):
            rate = getattr(out.hardware, name)
            if seconds is None:
                assert rate == getattr(cost.hardware, name)
            else:
                assert sent / (rate * 1e9) == pytest.approx(seconds, rel=QUANTUM)
        assert topology.collective_s(S, out.hardware) == pytest.approx(node_s * (expect[0] is not None) + across_s
                                                                       * (expect[1] is not None), rel=QUANTUM)
        assert (out.forward_s, out.backward_s, out.head_s) == (cost.forward_s, cost.backward_s, cost.head_s)


@pytest.mark.parametrize(("step_s", "expected"), [(60.0, 3), (2.0, 3), (1.1, 5), (0.7, 8), (0.01, 12)])
def test_probe_steps_take_a_floor_of_seconds_after_a_warm_up(monkeypatch, step_s: float, expected: int) -> None:
    """At least 3 measured steps and 5 s of them (a shared machine's slow and fast phases last seconds), at most 12
    (a tiny model's steps of milliseconds); the warm-up step is run and dropped."""
    clock = [1000.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    ran: list[int] = []

    def step() -> int:
        clock[0] += step_s
        ran.append(len(ran))
        return ran[-1]

    steps = probe_steps(step)  # type: ignore[arg-type]
    assert steps == list(range(1, expected + 1))  # step 0, the warm-up, is not among them
    assert expected == max(calibration.PROBE_MIN_STEPS,
                           min(calibration.PROBE_MAX_STEPS, -(-calibration.PROBE_MIN_S // step_s)))


def _land_timeline(cost: CostModel, rng: random.Random) -> list[tuple[str, str, float, float]]:
    """A step's host-lane jobs: one "land j" per layer and the head, and the embedding's, of random seconds."""
    names = [f"land {j}" for j in range(cost.num_layers + 1)] + ["embedding 0"]
    return [("optimizer", name, 1.0, 1.0 + rng.uniform(1e-4, 5e-3)) for name in names]


def test_the_host_lanes_landings_set_the_rate_the_simulator_times_them_at() -> None:
    """The land and embedding ops' measured seconds -> grad_accumulate_gbps, at which the cost model's seconds for
    those ops add up to the measured ones (to the quantum); steps without them keep the hardware's rate."""
    cost, rng = _cost(), random.Random(5)
    steps = _noisy_steps(cost, 4, 0.0)
    for s in steps:
        s.timeline = _land_timeline(cost, rng)
    out = calibrate(cost, steps)
    per_step = sorted(sum(end - start for lane, _, start, end in s.timeline if lane == "optimizer") for s in steps)
    modelled = sum(out.accumulate_s) + out.head_accumulate_s + out.embedding_accumulate_s
    # one rate for every step's bytes: the median step's seconds (the bytes are the same each step)
    assert modelled == pytest.approx(per_step[1], rel=QUANTUM)
    assert out.hardware.grad_accumulate_gbps != cost.hardware.grad_accumulate_gbps
    assert calibrate(cost, _noisy_steps(cost, 4, 0.0)).hardware == cost.hardware


@pytest.mark.parametrize("gap", [0.0, 0.1, 0.3])
def test_seconds_between_compute_ops_are_spread_over_them(gap: float) -> None:
    """The wall clock less the compute ops and the stalls, as a fraction of the compute, scales every compute
    figure; a step whose stalls and compute fill its wall (or a step without a timeline) scales nothing."""
    cost, rng = _cost(), random.Random(6)
    steps = _noisy_steps(cost, 5, 0.0)
    for s in steps:
        ops = [*s.forward_s, *s.backward_s, s.head_s]
        s.timeline = [("compute", f"op {k}", 0.0, t) for k, t in enumerate(ops)]
        s.stall_s = {"h2d": rng.uniform(0.0, 0.05), "optimizer": rng.uniform(0.0, 0.01)}
        s.wall_s = (1 + gap) * sum(ops) + sum(s.stall_s.values())
    out, plain = calibrate(cost, steps), calibrate(cost, _noisy_steps(cost, 5, 0.0))
    for a, b in ((out.forward_s[0], plain.forward_s[0]), (out.backward_s[0], plain.backward_s[0]),
                 (out.head_s, plain.head_s)):
        assert a == pytest.approx((1 + gap) * b, rel=QUANTUM)


def test_an_executors_steps_calibrate_its_host_lane() -> None:
    """The executor's own timeline: its land and embedding jobs are found by name, and the calibrated model's seconds
    for them add up to what the steps measured."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (2, 32))
    cost = CostModel(spec_of(model), HardwareSpec.load("emulated"), Workload(2, 32, "fp32"))
    probe = Executor(model, Plan.from_tiers(model, ["gpu"] * 4), EmulatedDevice(), cost=cost)
    steps = []
    for _ in range(3):
        probe.forward_backward(ids, ids)
        model.zero_grad(set_to_none=True)
        steps.append(probe.last_step)
    out = calibrate(cost, steps)
    landed = sorted(sum(end - start for lane, name, start, end in s.timeline
                        if lane == "optimizer" and name.split()[0] in ("land", "embedding")) for s in steps)
    assert landed[1] > 0
    modelled = sum(out.accumulate_s) + out.head_accumulate_s + out.embedding_accumulate_s
    assert modelled == pytest.approx(landed[1], rel=QUANTUM)


def test_asynchronous_timers_scale_the_flop_estimate_to_the_steps_compute() -> None:
    """scale_flops (CUDA until per-op events are in): the FLOP shape scaled so that the simulator's compute on an
    all-`gpu` plan is the steps' wall clock less their stalls (a lane the step waited on, e.g. an overlapped update,
    is the simulator's to time, not compute)."""
    cost, rng = _cost(), random.Random(8)
    L = cost.num_layers
    keep_all = Plan(tiers=("gpu",) * (L + 1), model_fingerprint=cost.spec.fingerprint())
    compute = simulate(keep_all, cost, optimizer_mode="serial").compute_s
    steps = _noisy_steps(cost, 6, 0.0)
    for s in steps:
        s.stall_s = {"h2d": rng.uniform(0.0, compute), "optimizer": rng.uniform(0.0, compute)}
        s.wall_s = 3.0 * compute + sum(s.stall_s.values())
    out = calibrate(cost, steps, scale_flops=True)
    assert simulate(keep_all, out, optimizer_mode="serial").compute_s == pytest.approx(3.0 * compute, rel=QUANTUM)
    assert out.forward_s[0] / out.backward_s[0] == pytest.approx(cost.forward_s[0] / cost.backward_s[0])


# ---- link rates: the probe measures the emulated device's copies, as it measures compute ------------------------
LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")


def _probed_job(monkeypatch, model: str, batch: int, seq: int, config_gbps: float, device_gbps: float | None):
    """The job's calibration (train/planning.py's measured_cost) with its links stated at `config_gbps` in the
    config and the device's links at `device_gbps` (None: unthrottled); returns the model, the probe batch, the
    calibrated CostModel, the probe's steps and its NVMe rates."""
    from lazytrain.config import load_job_config
    from lazytrain.runtime import probe
    from lazytrain.train import planning
    from lazytrain.train.build import build_model, model_source
    from lazytrain.train.run_data import load_data

    job = load_job_config(dict(model=model, corpus="zen", batch_size=batch, seq_len=seq, dtype="fp32",
                               optimizer_mode="serial", eval_batches=0, progress=False,
                               **{f"{link}_gbps": config_gbps for link in LINKS}))
    data = load_data(job)
    model_ = build_model(job, model_source(job, data.vocab_size))
    probed, nvme = [], {}
    take, take_nvme = probe.probe_steps, probe.nvme_gbps
    monkeypatch.setattr(probe, "probe_steps", lambda step: probed.extend(take(step)) or probed)
    monkeypatch.setattr(probe, "nvme_gbps", lambda *a: nvme.update(take_nvme(*a)) or nvme)
    monkeypatch.setattr(planning, "build_device", lambda job, kind, cap: EmulatedDevice(
        capacity_bytes=cap, **{f"{link}_gbps": device_gbps for link in LINKS}))
    return model_, data.probe, planning.measured_cost(job, model_, "cpu", data.probe), probed, nvme


def _measured_and_predicted(model, batch, cost: CostModel, device_gbps: float | None) -> tuple[Plan, float, float]:
    """A plan that moves boundaries over every link (cpu and nvme tiers), run on a device with the probe's links:
    its median measured step (5 after a warm-up) and the simulator's prediction on `cost`."""
    L = model.config.num_hidden_layers
    plan = Plan.from_tiers(model, ["gpu"] + [("cpu", "nvme")[j % 2] for j in range(L - 1)] + ["gpu"])
    device = EmulatedDevice(**{f"{link}_gbps": device_gbps for link in LINKS})
    executor = Executor(model, plan, device, cost=cost)
    walls = []
    try:
        for _ in range(6):
            executor.forward_backward(*batch)
            model.zero_grad(set_to_none=True)
            walls.append(executor.last_step.wall_s)
    finally:
        device.close()
    return plan, statistics.median(walls[1:]), simulate(plan, cost, optimizer_mode="serial").forward_backward_s


def test_links_throttled_at_a_rate_the_config_does_not_state_are_calibrated_to_it(monkeypatch):
    """The config says 1 GB/s, the device's links run at 11 MB/s: the probe's copies (weights h2d, gradients d2h)
    and spill files (NVMe) calibrate the rates the device has, and the run's link-bound steps are predicted from
    them (at the configured rates the prediction is tens of times too fast)."""
    device_gbps = 0.011
    model, batch, cost, probed, _ = _probed_job(monkeypatch, "debug", 4, 32, 1.0, device_gbps)
    for link in LINKS:
        # about the throttle, or slower where the copies are (a spill file's write took 0.76x of it at load 5)
        assert 0.5 * device_gbps <= getattr(cost.hardware, f"{link}_gbps") <= 1.02 * device_gbps, link
    plan, measured, predicted = _measured_and_predicted(model, batch, cost, device_gbps)
    # what is checked: the prediction follows the device's rate, not the configured one 90x faster; how close it
    # comes is benchmarks/fidelity.py's figure (a shared machine's load alone moved this ratio to 1.34 at load 14)
    assert 0.5 <= measured / predicted <= 2, (measured, predicted, os.getloadavg())
    configured = calibrate(rebuilt(cost, cost.hardware.with_overrides(**{f"{link}_gbps": 1.0 for link in LINKS})),
                           probed)  # the calibration as it was: compute measured, links as configured
    assert measured / simulate(plan, configured, optimizer_mode="serial").forward_backward_s > 3


def test_an_unthrottled_device_is_predicted_from_its_measured_copies(monkeypatch):
    """`*_gbps: inf` (no throttle): the links run at this host's memcpy and file speed, which the probe measures;
    the model's link rates are those measurements (not the config's inf). Calibrated so from probe steps taken in
    the same rounds as the run's (the machine is shared: a calibration seconds older can be 2x off under load),
    the model predicts the run's steps, and the run's copies go at the rates it was calibrated to (the default
    model at 2 x 16 tokens, whose weight copies take about a third of a step's compute)."""
    model, batch, cost, probed, nvme = _probed_job(monkeypatch, "small", 2, 16, math.inf, None)
    for link, gbps in (calibration.link_gbps(probed) | nvme).items():
        assert getattr(cost.hardware, f"{link}_gbps") == quantize_s(gbps), link
    assert {link for link in LINKS if math.isfinite(getattr(cost.hardware, f"{link}_gbps"))} == set(LINKS)

    L = model.config.num_hidden_layers
    plan = Plan.from_tiers(model, ["gpu"] + [("cpu", "nvme")[j % 2] for j in range(L - 1)] + ["gpu"])
    devices = [EmulatedDevice(), EmulatedDevice()]
    run = Executor(model, plan, devices[0], cost=cost)
    probe = Executor(model, Plan.from_tiers(model, ["gpu"] * (L + 1)), devices[1])  # the probe's all-gpu plan
    steps: dict[Executor, list] = {run: [], probe: []}
    try:
        for r in range(7):  # round-robin, as benchmarks/fidelity.py's sim(probe); round 0 warms up
            for executor in (run, probe):
                executor.forward_backward(*batch)
                model.zero_grad(set_to_none=True)
                if r:
                    steps[executor].append(executor.last_step)
        probe_gbps = calibration.link_gbps(steps[probe]) | nvme_gbps(devices[1], max(cost.boundary_bytes))
    finally:
        for device in devices:
            device.close()
    beside = calibrate(rebuilt(cost, cost.hardware), steps[probe], links_gbps=probe_gbps)
    measured = statistics.median(s.wall_s for s in steps[run])
    predicted = simulate(plan, beside, optimizer_mode="serial").forward_backward_s
    assert 0.67 <= measured / predicted <= 1.5, (measured, predicted, os.getloadavg())
    for link, gbps in calibration.link_gbps(steps[run]).items():
        if link in ("h2d", "d2h"):  # the weights' and gradients' copies (the spill files are the boundaries')
            assert 0.5 <= gbps / getattr(beside.hardware, f"{link}_gbps") <= 2, (link, gbps)


def _op_seconds(path) -> dict[str, list[float]]:
    """Seconds of each op kind ("state_read", "weights", ...) in a step trace a run wrote (lazytrain.viz)."""
    import json

    out: dict[str, list[float]] = {}
    for event in json.loads(path.read_text())["traceEvents"]:
        if event.get("ph") == "X":
            out.setdefault(event["name"].partition(" ")[0], []).append(event["dur"] / 1e6)
    return out


def test_a_throttled_device_with_the_state_on_nvme_predicts_its_state_ops(tmp_path, monkeypatch):
    """optimizer_offload nvme on the emulated device's 0.5 GB/s NVMe links: the state files (a group's file in large
    aligned requests) move at the throttle, the activations' small spill files (CRC32, a file each) slower; the
    probe measures both on the links and the simulator times the state ops at the state files' rate (at the spill
    files' they were predicted 2.5x their measured seconds here, 1.4x on benchmarks/offload.py's 100 M model). The
    run's steps report the state ops apart from the spills, never faster than the throttle."""
    from lazytrain.config import load_job_config
    from lazytrain.train import train
    from lazytrain.train import trainer as trainer_module

    steps = []
    real_step = trainer_module.Trainer.train_step
    monkeypatch.setattr(trainer_module.Trainer, "train_step",
                        lambda self, step: (real_step(self, step), steps.append(self.executor.last_step))[0])
    result = train(load_job_config(dict(model="small", corpus="zen", batch_size=2, seq_len=16, optimizer="adamw",
                                        optimizer_offload="nvme", steps=3, eval_batches=0, progress=False,
                                        save_steps=0, output_dir=str(tmp_path / "run"))))
    measured = _op_seconds(result.output_dir / "step_trace_measured.json")
    predicted = _op_seconds(result.output_dir / "step_trace_predicted.json")
    for kind in ("state_read", "state_write"):
        ratio = statistics.median(measured[kind]) / statistics.median(predicted[kind])
        # the failure this catches is the spill files' rate (2.5x the measured seconds); load alone moved the
        # ratio to 0.75 on 2 shared cores, so the bound sits between the two
        assert 0.5 <= ratio <= 2, (kind, ratio, measured[kind], predicted[kind], os.getloadavg())
    rates = calibration.link_gbps(steps[1:])
    # never above the throttle; below it by the copy's own time, which load stretches (0.65x of it at load 20 on 2
    # cores): the prediction above, on the rates the probe measured, is the claim a loaded machine can check
    assert 0 < rates["state_read"] <= 0.5 * 1.02 and 0 < rates["state_write"] <= 0.5 * 1.02, rates
    assert all(s.link_bytes["state_read"] == s.link_bytes["state_write"] > 0 for s in steps[1:])
