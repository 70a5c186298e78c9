"""One calibration path: measured executor steps -> a CostModel (what the planner, simulator and re-planner use).

A measured step (`Executor.last_step`) times every compute op of the step program. `probe_steps` takes the
probe's steps for a floor of seconds, not a count: a shared machine runs slow and fast for seconds at a time, and
3 steps of ~0.3 s put a layer's seconds anywhere in +-15% between processes (docs/benchmarks.md, the idle re-run
on Zen 4). `calibrate` takes the median of each layer's seconds over the steps given, pools layers of the same
kind and size (they run the same kernels: pooling cuts the noise of a shared machine), and rounds every figure
to a geometric grid of `QUANTUM` (4 %) steps. Plans are solved from these numbers, so the same command on the
same machine gives the same plan, while a real change of more than a few percent still moves the model.

Two more figures come from the same steps, so the simulator replays the step the executor runs, not only its ops:
- the host lane's gradient landings ("land j", "embedding": the group's squared norm, its accumulation, the
  embedding's backward; on the optimizer lane) set `grad_accumulate_gbps`. A microbenchmark's add rate timed them
  at 1 ms a step where the default job's measured 27 ms (docs/benchmarks.md).
- the executor's own seconds between compute ops (the program's bookkeeping, allocations, waits' wake-ups: the
  wall clock less the compute ops and the stalls, ~1 % of a step on the emulated device) are spread over the
  compute ops, which the simulator runs back to back.

- the links' rates (`link_gbps`): the bytes each link's jobs moved over their busy seconds, on the emulated
  device, whose links are this host's memcpy (and, where configured, a sleep to the configured rate): so an
  unthrottled link is predicted at the rate it really copies, and a throttled one at the slower of the two. The
  probe's steps move weights (h2d) and gradients (d2h); its NVMe rates come from spill files it writes and reads
  and, with the optimizer's state on NVMe, its state files' rates on the same links ("state_read", "state_write")
  from a state file of a group's size (runtime/probe.py): the two move at different rates on one link. A run's
  steps report their state ops under those names too (runtime/step.py), so the re-planner compares like with
  like. CUDA keeps its preset's link figures (its link jobs' seconds include waiting for the compute stream).

On CUDA the per-op times are CUDA-event times of the compute stream; until those are in, a device whose
per-layer timers see asynchronous launches passes `scale_flops=True`: the FLOP estimate scaled by the
measured step time instead.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import LINKS
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan
from lazytrain.plan.sim import simulate

if TYPE_CHECKING:
    from lazytrain.costmodel.hardware import HardwareSpec
    from lazytrain.costmodel.topology import Topology
    from lazytrain.runtime.executor import StepStats

QUANTUM = 0.04  # relative step of the grid measured seconds are rounded to
PROBE_MIN_STEPS = 3  # measured probe steps at the least (after one warm-up step)
PROBE_MIN_S = 5.0  # and at least this many seconds of them ...
PROBE_MAX_STEPS = 12  # ... unless this many steps came first (a tiny model's steps take milliseconds)
LINK_FIELDS = {**{link: f"{link}_gbps" for link in LINKS},  # HardwareSpec's rate fields
               # the optimizer's state files on the NVMe links (optimizer_offload nvme), apart from the spill files
               "state_read": "nvme_state_read_gbps", "state_write": "nvme_state_write_gbps"}


def probe_steps(step: Callable[[], StepStats]) -> list[StepStats]:
    """The measured steps a calibration takes: `step()` runs one probe step and returns its stats; one warm-up step
    (dropped), then steps until PROBE_MIN_STEPS and PROBE_MIN_S have both passed, or PROBE_MAX_STEPS came first
    (a GPU's 27B steps of a minute: 3; the default job's steps of ~1 s: 5)."""
    step()  # the first step allocates and first-touches what the others reuse
    steps: list[StepStats] = []
    t0 = time.perf_counter()
    while len(steps) < PROBE_MIN_STEPS or (time.perf_counter() - t0 < PROBE_MIN_S and len(steps) < PROBE_MAX_STEPS):
        steps.append(step())
    return steps


def quantize_s(seconds: float, quantum: float = QUANTUM) -> float:
    """`seconds` rounded to the nearest point of the grid (1 + quantum)^k (0 stays 0)."""
    if not seconds > 0 or not math.isfinite(seconds):
        return 0.0 if seconds == 0 else seconds
    step = math.log1p(quantum)
    return float(f"{math.exp(round(math.log(seconds) / step) * step):.6g}")


def _pooled(cost: CostModel, per_layer: list[float]) -> list[float]:
    """Each layer's seconds replaced by the median over the layers of the same kind and parameter count."""
    spec = cost.spec
    keys = [(spec.layer_types[j], spec.layer_params[j]) for j in range(cost.num_layers)]
    groups: dict[tuple[str, int], list[float]] = {}
    for key, t in zip(keys, per_layer, strict=True):
        groups.setdefault(key, []).append(t)
    return [statistics.median(groups[key]) for key in keys]


def calibrate(cost: CostModel, steps: Sequence[StepStats], *, optimizer_s: float | None = None,
              scale_flops: bool = False, links_gbps: Mapping[str, float] | None = None) -> CostModel:
    """`cost` with the compute seconds (and, given the seconds of one whole optimizer step, the host optimizer
    rate; given measured link rates, GB/s by link name, those) these measured steps show: medians, pooled over
    like layers, quantized (see the module docstring)."""
    steps = [s for s in steps if any(s.forward_s) and any(s.backward_s)]
    if not steps:
        raise LazyTrainError("calibrate: no measured step with layer times (did the steps run?)")
    L = cost.num_layers
    if any(len(s.forward_s) != L for s in steps):
        raise LazyTrainError(f"calibrate: the steps measured {len(steps[0].forward_s)} layers, the model has {L}")
    host: dict[str, float] = {}
    if optimizer_s is not None:
        if not optimizer_s > 0:
            raise LazyTrainError(f"calibrate: optimizer seconds must be > 0, got {optimizer_s}")
        # the bandwidth this job's update streamed at: its bytes (CostModel.update_bytes) over its seconds
        host.update(host_mem_gbps=quantize_s(cost.update_bytes() / optimizer_s / 1e9))
    for link, gbps in (links_gbps or {}).items():
        if not gbps > 0 or not math.isfinite(gbps):
            raise LazyTrainError(f"calibrate: the {link} link's measured rate must be finite and > 0, got {gbps}")
        host[LINK_FIELDS[link]] = quantize_s(gbps)
    landing = _landing_gbps(cost, steps)
    if landing is not None:
        host.update(grad_accumulate_gbps=quantize_s(landing))
    if host:
        cost = rebuilt(cost, cost.hardware.with_overrides(**host))
    if scale_flops:  # asynchronous timers: keep the FLOP shape, scale it to the measured step's compute (its wall
        # clock less its stalls: a lane the step waited on, e.g. an overlapped update, is the simulator's to time)
        keep_all = Plan(tiers=("gpu",) * (L + 1), model_fingerprint=cost.spec.fingerprint())
        flop_compute_s = simulate(keep_all, cost, optimizer_mode="serial").compute_s
        k = quantize_s(statistics.median(s.wall_s - sum(s.stall_s.values()) for s in steps) / flop_compute_s)
        return cost.with_times(forward_s=[k * t for t in cost.forward_s], backward_s=[k * t for t in cost.backward_s],
                               head_s=k * cost.head_s)
    k = 1.0 + _between_ops(steps)
    forward = _pooled(cost, [k * statistics.median(s.forward_s[j] for s in steps) for j in range(L)])
    backward = _pooled(cost, [k * statistics.median(s.backward_s[j] for s in steps) for j in range(L)])
    head = k * statistics.median(s.head_s for s in steps)
    return cost.with_times(forward_s=[quantize_s(t) for t in forward], backward_s=[quantize_s(t) for t in backward],
                           head_s=quantize_s(head))


def link_gbps(steps: Sequence[StepStats]) -> dict[str, float]:
    """GB/s each link moved its jobs' bytes at over these steps (their bytes over their busy seconds, summed over
    the steps); links that moved nothing are left out."""
    rates = {}
    for link in LINK_FIELDS:
        busy_s = sum(s.link_busy_s.get(link, 0.0) for s in steps)
        moved = sum(s.link_bytes.get(link, 0) for s in steps)
        if busy_s > 0 and moved > 0:
            rates[link] = moved / busy_s / 1e9
    return rates


def _landing_gbps(cost: CostModel, steps: Sequence[StepStats]) -> float | None:
    """GB/s at which the steps' host lane landed gradients: the bytes the cost model charges to their "land j" and
    "embedding" ops over those ops' measured seconds (median over the steps; None when none ran one)."""
    L = cost.num_layers
    rates = []
    for s in steps:
        num_bytes = seconds = 0.0
        for lane, name, start, end in s.timeline:
            kind, _, target = name.partition(" ")
            if lane == "optimizer" and kind in ("land", "embedding"):
                j = int(target)
                num_bytes += (cost.embedding_grad_bytes if kind == "embedding" else cost.head_grad_bytes if j == L
                              else cost.grad_bytes[j])
                seconds += end - start
        if num_bytes > 0 and seconds > 0:
            rates.append(num_bytes / seconds / 1e9)
    return statistics.median(rates) if rates else None


def lane_seconds(step: StepStats, lane: str, kinds: tuple[str, ...] | None = None) -> float:
    """Seconds a measured step's ops on `lane` took (those of the given op kinds -- "update", "land", ... -- only),
    summed from its timeline."""
    return sum(end - start for on, name, start, end in step.timeline
               if on == lane and (kinds is None or name.partition(" ")[0] in kinds))


def _between_ops(steps: Sequence[StepStats]) -> float:
    """The median fraction of the steps' compute seconds the executor spent between compute ops: the wall clock less
    the compute ops and the stalls (0 for steps without a timeline)."""
    fractions = []
    for s in steps:
        compute = lane_seconds(s, "compute")
        if compute > 0:
            fractions.append(max(0.0, s.wall_s - compute - sum(s.stall_s.values())) / compute)
    return statistics.median(fractions) if fractions else 0.0


def rebuilt(cost: CostModel, hardware: HardwareSpec) -> CostModel:
    """The same CostModel on other hardware (keeps the host layout, head chunk and device constants)."""
    out = CostModel(cost.spec, hardware, cost.workload, cost.optimizer, master_weights=cost.master_weights,
                    grad_accumulation=cost.grad_accumulation, head_chunk_tokens=cost.head_chunk_tokens,
                    optimizer_offload=cost.optimizer_offload, trainable=cost.trainable)
    return out.with_device_constants(cost.constant_device_bytes)


def calibrate_links(cost: CostModel, topology: Topology, num_bytes: int, node_s: float, across_s: float) -> CostModel:
    """`cost` with the intra- and inter-node rates a data-parallel run's sums really get: the ranks summed an fp32
    gradient of `num_bytes` in `node_s` (the reduce in the node) and `across_s` (the all-reduce among the nodes'
    owners; `Ranks.time_sums`), so each rate is the bytes a rank moves in that phase (`Topology.link_bytes`) per
    second, quantized like the compute seconds. A phase the topology does not have keeps the hardware's figure."""
    intra, inter = topology.link_bytes(num_bytes)
    rates = {field: quantize_s(sent / seconds / 1e9)
             for field, sent, seconds in (("intra_node_gbps", intra, node_s), ("inter_node_gbps", inter, across_s))
             if sent > 0 and seconds > 0}
    out = copy.copy(cost)  # the link rates enter only the sums' seconds (costmodel/topology.py): the rest stands
    out.hardware = cost.hardware.with_overrides(**rates)
    return out
