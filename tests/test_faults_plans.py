"""Reproducible plans: the same command on the same machine gives the same plan unless the measured times really
changed. The planning path of `lazytrain train` (`train.planning.plan_run`: budgets, MILP, the remembered plan)
is driven with calibrations drawn as a loaded machine gives them (every figure moved by noise within the keep
threshold), then with a real change beyond it."""

from __future__ import annotations

import random

import pytest

from lazytrain.config import load_job_config
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.job.inputs import workload_of
from lazytrain.plan import planner
from lazytrain.plan.budgets import Budgets
from lazytrain.plan.cache import KEEP_GAIN
from lazytrain.plan.plan import spec_of
from lazytrain.train import planning
from lazytrain.train.build import build_model, model_source

RNG = random.Random(20261203)


@pytest.fixture(scope="module")
def setting():
    """The default job's model shape at a batch whose boundaries are large next to its weights (so the tiers
    matter), with the FLOP estimate of the emulated device as the 'true' costs."""
    job = load_job_config(dict(model="small", dataset="zen", dtype="fp32", per_device_train_batch_size=16,
                               cutoff_len=1024))
    model = build_model(job, model_source(job, 259))
    r = job.runtime
    hardware = HardwareSpec.load("emulated").with_overrides(h2d_gbps=r.h2d_gbps, d2h_gbps=r.d2h_gbps,
                                                            nvme_read_gbps=r.nvme_read_gbps,
                                                            nvme_write_gbps=r.nvme_write_gbps)
    cost = CostModel(spec_of(model), hardware, workload_of(job), job.optim.optimizer)
    return job, model, cost


def _measured(cost: CostModel, noise: float, scale: float = 1.0) -> CostModel:
    """`cost`'s compute seconds times `scale`, each figure moved by up to +-noise (a calibration on a loaded
    machine)."""
    def f(t: float) -> float:
        return t * scale * (1 + RNG.uniform(-noise, noise))
    return cost.with_times(forward_s=[f(t) for t in cost.forward_s], backward_s=[f(t) for t in cost.backward_s],
                           head_s=f(cost.head_s))


def _plan(monkeypatch, job, model, cost: CostModel) -> tuple[planning.PlannedRun, str]:
    """The run's plan with `cost` as its calibration, and the plan the MILP alone gives on it."""
    monkeypatch.setattr(planning, "measured_cost", lambda *args, **kwargs: cost)
    planned = planning.plan_run(job, model, "cpu", probe_batch=None)
    fresh = planner.make_plan(job.plan, cost, Budgets(**planned.budgets), optimizer_mode=job.optim.optimizer_mode)
    return planned, fresh.placement_map()


def test_noise_within_the_threshold_keeps_the_plan_and_a_real_change_replaces_it(setting, monkeypatch, tmp_path):
    job, model, cost = setting
    monkeypatch.setenv("LAZYTRAIN_CACHE", str(tmp_path))
    noise = 0.8 * KEEP_GAIN
    runs = [_plan(monkeypatch, job, model, _measured(cost, noise)) for _ in range(8)]
    first = runs[0][0].plan.placement_map()
    assert runs[0][1] == first  # the first run: the MILP's plan, remembered
    assert len({fresh for _, fresh in runs}) > 1, "the noise never moved the MILP: this test shows nothing"
    assert [planned.plan.placement_map() for planned, _ in runs] == [first] * len(runs)
    assert all("remembered plan, kept" in planned.how for planned, fresh in runs if fresh != first)
    (remembered,) = (tmp_path / "plans").iterdir()

    # a real change: compute 200x faster, the links as they were -> transfers no longer hide, recompute wins
    changed, fresh = _plan(monkeypatch, job, model, _measured(cost, noise, scale=0.005))
    assert changed.plan.placement_map() == fresh != first
    assert f"replaces the remembered {first}" in changed.how
    # judged on the new costs, the old plan was more than KEEP_GAIN slower
    old = planning.simulate(runs[0][0].plan, changed.cost, optimizer_mode=job.optim.optimizer_mode).step_s
    assert changed.sim.step_s < old * (1 - KEEP_GAIN)
    # ... and the new plan is the one remembered: noise around the new times keeps it
    again = [_plan(monkeypatch, job, model, _measured(cost, noise, scale=0.005))[0] for _ in range(3)]
    assert {p.plan.placement_map() for p in again} == {fresh}
    assert [p.name for p in (tmp_path / "plans").iterdir()] == [remembered.name]


def test_another_job_or_a_damaged_cache_solves_afresh(setting, monkeypatch, tmp_path):
    job, model, cost = setting
    monkeypatch.setenv("LAZYTRAIN_CACHE", str(tmp_path))
    measured = _measured(cost, 0.0)
    planned, fresh = _plan(monkeypatch, job, model, measured)
    (path,) = (tmp_path / "plans").iterdir()
    path.write_text('{"tiers": ["gpu"')  # a damaged file: ignored, overwritten
    again, _ = _plan(monkeypatch, job, model, measured)
    assert again.plan.placement_map() == fresh and "remembered" not in again.how
    other = load_job_config({**{"model": "small", "dataset": "zen", "dtype": "fp32", "cutoff_len": 1024},
                             "per_device_train_batch_size": 16, "nvme_act_bytes": 0})
    _plan(monkeypatch, other, model, measured)
    assert len(list((tmp_path / "plans").iterdir())) == 2  # another budget: another entry
    blocked = tmp_path / "a-file"  # a cache that cannot be made (root ignores permissions; a file cannot hold one)
    blocked.write_text("")
    monkeypatch.setenv("LAZYTRAIN_CACHE", str(blocked))
    assert _plan(monkeypatch, job, model, measured)[0].plan.placement_map() == fresh
