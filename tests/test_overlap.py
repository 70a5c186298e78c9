"""The overlapped-exact optimizer (optimizer_mode overlap): the step's update runs group by group on the
executor's optimizer lane under the next step's forward, fenced before each group's forward weight h2d, and
gives the parameters and losses of serial mode bit for bit -- with clipping, in fp32 and bf16, with gradient
accumulation, with every optimizer, and with a non-finite step in the middle skipped identically."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
import torch

from lazytrain.config import load_job_config
from lazytrain.runtime import store
from lazytrain.train import train
from lazytrain.train import trainer as trainer_module

RNG = random.Random(20261203)
BASE = dict(model="debug", corpus="zen", batch_size=2, seq_len=32, lr=3e-3, warmup_steps=1, planner="megatrain",
            eval_batches=0, progress=False, max_grad_norm=1.0, seed=0)


def _run(tmp_path, mode: str, *, bad_step: int | None, **values):
    """Train with `values`; on `bad_step` (0-based) layer 1's landed gradient holds an inf. Returns the result and
    the parameters cloned after every step."""
    taken: list[list[torch.Tensor]] = []
    real_land = store.WeightGroup.land
    real_step = trainer_module.Trainer.train_step
    real_group_update = trainer_module.group_update
    current: dict[str, int | None] = {"step": None}
    on_lane: list[bool] = []  # per group update: did it run on the executor's optimizer lane

    def land(self, **kwargs):
        if self.name == "layer.1" and current["step"] == bad_step:
            self.landing[RNG.randrange(self.landing.numel())] = math.inf
        return real_land(self, **kwargs)

    def slow_group_update(*args, **kwargs):
        update = real_group_update(*args, **kwargs)

        def slow(index: int) -> None:  # a slow host optimizer: the forward must wait for each group's update
            on_lane.append(threading.current_thread() is not threading.main_thread())
            time.sleep(0.02)
            update(index)

        return slow

    def train_step(self, index):
        current["step"] = index
        try:
            row = real_step(self, index)
        finally:
            current["step"] = None
        taken.append([p.detach().clone() for p in self.model.parameters()])
        return row

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store.WeightGroup, "land", land)
        mp.setattr(trainer_module.Trainer, "train_step", train_step)
        mp.setattr(trainer_module, "group_update", slow_group_update)
        result = train(load_job_config({**BASE, **values, "optimizer_mode": mode,
                                        "output_dir": str(tmp_path / mode)}))
    return result, taken, on_lane


def _check_identical(tmp_path, steps: int, bad_step: int | None, **values) -> None:
    serial, serial_params, _ = _run(tmp_path, "serial", bad_step=bad_step, steps=steps, **values)
    overlap, overlap_params, on_lane = _run(tmp_path, "overlap", bad_step=bad_step, steps=steps, **values)
    assert overlap.losses == serial.losses  # bit for bit (None on the skipped step)
    # overlap: step k's update runs under step k+1's forward, so the parameters after step k+1 returns are serial
    # mode's after step k; the run drains the last one
    overlap_params = [*overlap_params[1:], [p.detach() for p in overlap.model.parameters()]]
    for k, (a, b) in enumerate(zip(serial_params, overlap_params, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"parameters differ after step {k}"
    if bad_step is not None:
        assert serial.losses[bad_step] is None and overlap.summary["skipped_steps"] == 1
        assert all(torch.equal(x, y) for x, y in zip(overlap_params[bad_step - 1], overlap_params[bad_step],
                                                     strict=True))  # the skipped step changed nothing
    assert any(not torch.equal(x, y) for x, y in zip(overlap_params[0], overlap_params[-1], strict=True))
    # every applied step's update but the last (drained at the end) ran on the next step's optimizer lane
    groups = on_lane.count(False)  # the last step's update, drained on this thread when the run ends
    assert groups > 0
    assert on_lane.count(True) == (steps - 1 - (bad_step is not None)) * groups, (on_lane.count(True), groups)


@pytest.mark.exactness
@pytest.mark.parametrize("optimizer, dtype, accum", [("adamw", "fp32", 1), ("8bit", "bf16", 3),
                                                     ("hybrid8bit", "fp32", 3), ("adamw", "bf16", 1)])
def test_overlap_equals_serial_bit_for_bit_with_clipping_and_a_skipped_step(tmp_path, optimizer, dtype, accum):
    _check_identical(tmp_path, 5, 2, optimizer=optimizer, dtype=dtype, gradient_accumulation_steps=accum)


@pytest.mark.exactness
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "hybrid8bit", "8bit"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("accum", [1, 3])
def test_overlap_equals_serial_for_20_steps(tmp_path, optimizer, dtype, accum):
    _check_identical(tmp_path, 20, 10, optimizer=optimizer, dtype=dtype, gradient_accumulation_steps=accum)
