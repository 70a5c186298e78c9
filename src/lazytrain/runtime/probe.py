"""The calibration probe: the run's model stepped on the device it runs on, timed, into a calibrated CostModel.

Steps of an all-`gpu` plan on an uncapped device of the run's kind, its links as the run's, time every layer's
forward and backward and the loss head exactly as the executor runs them (a warm-up, then at least 3 steps and
5 s of them: `probe_steps`); the run's optimizer at learning rate 0 times the host update (the same work; the
weights do not move, so no copy of them is needed): in overlap mode each probe step runs the previous one's
update on its optimizer lane under its forward, as the run does (so the compute is timed beside it too: an update
timed alone is faster than the run's); in serial mode five steps after the probe.
`runtime/calibrate.py` turns them into the CostModel. On CUDA the executor's per-layer timers see asynchronous
launches, so there the FLOP estimate is scaled by the measured step time instead.

Link rates, on the emulated device, are measured too, as compute is: h2d and d2h from the probe steps' weight
and gradient copies, NVMe from a few spill files of the run's largest boundary written and read back through the
activations' own store and, with the optimizer's state on NVMe, from a state file of a staging slot's size written
and read back through the state files' own module (runtime/statefiles.py) on the same links. The two move at
different rates on one link: a spill is a small file with a CRC32, a state file one group's data in large aligned
requests, several in flight, so the state files run nearer the link's rate than the spills (docs/benchmarks.md).
An emulated link copies with this host's memcpy and sleeps to its configured rate when it has one, so a throttled
link calibrates to about that rate (or slower, if the copies are) and an unthrottled one to what the copies really
take: the model predicts the device either way (tests/test_calibrate.py). CUDA's links keep the hardware's figures.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lazytrain.costmodel.hardware import available_host_memory_bytes
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan
from lazytrain.runtime.calibrate import calibrate, lane_seconds, link_gbps, probe_steps
from lazytrain.runtime.device import EmulatedDevice
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.statefiles import GroupLayout, StateFiles
from lazytrain.runtime.step import GroupUpdate, StepStats
from lazytrain.runtime.store import ActivationStore, aligned_empty
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lazytrain.costmodel.cost import CostModel
    from lazytrain.runtime.device import CudaDevice


@dataclass(frozen=True)
class ProbeOptimizer:
    """The run's optimizer at learning rate 0, as the probe runs it (train/planning.py builds it)."""

    deferred_update: Callable[[float], GroupUpdate]  # overlap: the last step's update at this grad norm
    step: Callable[[float | None], object]  # serial: one optimizer step after the backward, at this grad norm
    # the share of the model's parameters it steps: below 1 when the run's states never sit in host memory together
    # (optimizer_offload nvme), so the probe holds one group's; its seconds are scaled up to the whole update
    share: float = 1.0


def calibrated_cost(model: PreTrainedModel, estimate: CostModel, device: CudaDevice | EmulatedDevice,
                    probe_batch: tuple[torch.Tensor, torch.Tensor], *, compute_dtype: torch.dtype,
                    optimizer: Callable[[Executor], ProbeOptimizer], overlap: bool, scale_flops: bool) -> CostModel:
    """`estimate` (the run's CostModel from the hardware's figures) with its compute and optimizer seconds, and
    on the emulated device its link rates, measured on `device` (uncapped, its links as the run's; closed here),
    `optimizer` built once the executor is.
    `estimate.workload.masked`: the run's batches carry an attention mask or position ids, whose device bytes
    (per-row constants, every SDPA layer's mask copy and repeated k/v) the cost model then counts."""
    workload = estimate.workload
    keep_all = Plan.from_tiers(model, ["gpu"] * (model.config.num_hidden_layers + 1))
    try:
        executor = Executor(model, keep_all, device, compute_dtype=compute_dtype)
        if isinstance(device, EmulatedDevice):
            _check_probe_fits(executor, workload)

        # The optimizer is timed while the probe device's link threads live, as the run's own do while it trains:
        # each link thread that ran torch ops owns an OpenMP team, and libgomp spins long at a barrier only while
        # the process has no more OpenMP threads than CPUs. With the teams gone, on a shared machine every barrier
        # of the optimizer's short parallel regions spins out a time slice while its partner is descheduled: the
        # default job's optimizer step measured 1.5-4 s instead of 0.03 s (docs/benchmarks.md).
        run_optimizer = optimizer(executor)

        def probe() -> StepStats:
            last = executor.last_step
            if overlap and last is not None:  # as the run: the last step's update on this one's optimizer lane
                executor.defer_update(run_optimizer.deferred_update(last.grad_norm or 0.0))
            executor.forward_backward(*probe_batch)  # host sync: returns when the step is done
            return executor.last_step

        steps = probe_steps(probe)  # a warm-up, then seconds of steps (runtime/calibrate.py)
        # rotary, positions, masks (eager attention; and per-row masks when the batches carry them)
        constant_bytes = executor.memory_sizes(workload.batch_size, workload.seq_len,
                                               masked=workload.masked).constant_bytes
        if overlap:  # the updates' seconds on the lane (the first measured step's also first-touches the states)
            optimizer_s = statistics.median(lane_seconds(s, "optimizer", ("update",)) for s in steps)
        else:
            samples = []
            for _ in range(5):  # the first steps allocate and first-touch the states: the fastest of the later four
                t0 = time.perf_counter()
                run_optimizer.step(executor.last_step.grad_norm)
                samples.append(time.perf_counter() - t0)
            # the fastest: a shared machine's interference only ever adds time (their medians moved 60x run to run
            # under load; docs/reliability.md)
            optimizer_s = min(samples[1:])
        optimizer_s /= run_optimizer.share
        links = None
        if isinstance(device, EmulatedDevice):
            state_bytes = _state_probe_bytes(estimate, device)
            links = link_gbps(steps) | nvme_gbps(device, max(estimate.boundary_bytes), state_bytes)
    finally:
        device.close()
    model.zero_grad(set_to_none=True)

    # one calibration path (runtime/calibrate.py): medians, quantized, so the same run plans the same way
    return calibrate(estimate.with_device_constants(constant_bytes), steps, optimizer_s=optimizer_s,
                     scale_flops=scale_flops, links_gbps=links)


NVME_PROBE_FILES = 5  # spill files written, then read back, per calibration (after one of each to warm up)
STATE_PROBE_OPS = 3  # state file writes, then reads, per calibration (after one of each to warm up)
STATE_PROBE_MAX_BYTES = 256 << 20  # the state file's size at most (a slot's size, where smaller)


def nvme_gbps(device: EmulatedDevice, num_bytes: int, state_bytes: int = 0) -> dict[str, float]:
    """GB/s of the device's NVMe links on spill files of `num_bytes` (the run's largest boundary): written one
    after another on the nvme_write link, then read back on nvme_read, through an ActivationStore as the run's
    spills are (its CRC32 included); each link's file bytes over its jobs' median seconds, the first job of each
    apart (it first-touches the buffers and the directory; a process's first file write is far slower than the next).
    `state_bytes` > 0 (optimizer_offload nvme): also "state_write" and "state_read", the same links' rates on a
    state file of that size written and read whole through StateFiles, as the run's state ops are."""
    num_bytes = max(int(num_bytes), 4096)
    store = ActivationStore(device.nvme_dir, device.host_empty)
    data = device.host_empty((num_bytes,), torch.uint8)
    data.copy_(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8))
    back = device.host_empty((num_bytes,), torch.uint8)
    try:
        gbps = _link_gbps(device, {"nvme_write": lambda k: store.write(k, data),
                                   "nvme_read": lambda k: store.read(k, back)}, num_bytes, NVME_PROBE_FILES)
    finally:
        store.end_step()
    if state_bytes > 0:
        gbps |= _state_gbps(device, int(state_bytes))
    return gbps


def _state_gbps(device: EmulatedDevice, num_bytes: int) -> dict[str, float]:
    """"state_write" and "state_read": GB/s of one state file of `num_bytes` (a group's data) written whole on the
    nvme_write link, then read back on nvme_read, as the run's state ops are (train/offload.py)."""
    with StateFiles(device.nvme_dir, {"probe": GroupLayout([("data", torch.uint8, (num_bytes,))])},
                    host_empty=device.host_empty) as files:
        size = files.layouts["probe"].padded_data_bytes
        slot = aligned_empty(size, torch.uint8, device.host_empty)
        slot.random_(0, 256)
        rates = _link_gbps(device, {"nvme_write": lambda k: files.write("probe", slot).wait(),
                                    "nvme_read": lambda k: files.read("probe", slot).wait()}, size, STATE_PROBE_OPS)
    return {("state_write" if link == "nvme_write" else "state_read"): rate for link, rate in rates.items()}


def _link_gbps(device: EmulatedDevice, jobs: dict[str, Callable[[int], object]], num_bytes: int,
               count: int) -> dict[str, float]:
    """GB/s of each link's job (called with its number 0..count) moving `num_bytes`: `count` + 1 jobs one after
    another, all of a link's before the next link's, the bytes over the median seconds of all but the first."""
    seconds = {}
    for link, job in jobs.items():
        events = [device.submit(link, lambda k=k, job=job: job(k), num_bytes) for k in range(count + 1)]
        for event in events:
            device.wait(event)
        seconds[link] = statistics.median(e.end_s - e.start_s for e in events[1:])
    return {link: num_bytes / s / 1e9 for link, s in seconds.items() if s > 0}


def _state_probe_bytes(cost: CostModel, device: EmulatedDevice) -> int:
    """The state file the calibration times with the optimizer's state on NVMe: a staging slot's size (at most
    STATE_PROBE_MAX_BYTES); 0 with the state in RAM, or when the directory cannot hold the run's state files (the
    run then refuses with its own line, before writing any)."""
    if cost.optimizer_offload != "nvme":
        return 0
    try:
        free = shutil.disk_usage(device.nvme_dir).free
    except OSError:
        return 0
    return min(cost.staging_slot_bytes, STATE_PROBE_MAX_BYTES) if free >= cost.nvme_state_bytes() else 0


def _check_probe_fits(executor: Executor, workload: Workload) -> None:
    """The emulated device's memory is this host's: refuse a calibration step (all boundaries kept, the largest
    device footprint of the run) that would not fit in what the host has available, before allocating it."""
    need = executor.predicted_peak_bytes(workload.batch_size, workload.seq_len, masked=workload.masked)
    available = available_host_memory_bytes()
    if available is not None and need > available:
        raise LazyTrainError(
            f"host memory: the emulated device's calibration step (batch {workload.batch_size} x "
            f"{workload.seq_len}, every boundary kept) needs {format_bytes(need)} but this machine's available "
            f"memory gives {format_bytes(available)}; lower per_device_train_batch_size or cutoff_len")
