"""Admission control: refuse a request that no plan can satisfy, before any solve, in one line.

Four budgets are checked, in this order, each against what *every* plan needs:
  host memory     static_host_bytes() (weights, grads, optimizer states by mode; with optimizer_offload nvme no
                  states but one staging slot, the least any plan holds) against --cpu-mem (or the hardware's
                  host memory; unchecked when neither is known);
  device memory   static_device_bytes() (2 weight slots + 2 gradient slots sized for layers, the largest working
                  set of a layer or the loss head, 2 boundary gradients, constants) against --gpu-mem-cap (or the
                  device's memory);
  gpu activations M_G = cap - static_device_bytes() must hold the boundaries every plan keeps on the device
                  at its worst moment: the least peak (`device_floor_bytes`) is the slots + constants + the
                  larger of (a layer's working set + 5 boundary buffers: boundary 0, the layer's input and
                  output, the gradients in and out) and (the head's working set + 3: boundaries 0 and L and
                  the gradient of L, + the head's own weight and gradient slots when it has them: not static,
                  they are live in its window);
  cpu activations --cpu-act-budget must fit in the host memory left after the static host bytes.
The result carries the activation budgets the planners use (M_G, M_C, M_N) and the host room a plan's further
staging slots come out of (`staging_budgets`).
With the optimizer's state on NVMe, `check_nvme_space` is the NVMe side ("nvme: needs M GiB on <dir>"): `lazytrain
train` calls it before it writes anything, `lazytrain plan` when the job names its nvme_dir.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from lazytrain.costmodel.cost import CostModel
from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.units import format_bytes

MAX_STAGING_DEPTH = 8  # staging slots a plan may take: beyond a few the reads have all the slack they can use


@dataclass(frozen=True)
class Admission:
    """What the request needs and the activation budgets left for the planner (bytes; None = unlimited)."""

    host_need_bytes: int  # static host bytes + the cpu activation budget
    host_limit_bytes: int | None  # --cpu-mem or the hardware's; None = not checked
    device_floor_bytes: int  # the least device peak any plan can have
    gpu_mem_cap_bytes: int
    gpu_act_bytes: int  # M_G: cap - static_device_bytes()
    cpu_act_bytes: int | None  # M_C: --cpu-act-budget, else the host room left, else None
    nvme_act_bytes: int | None  # M_N: --nvme-act-budget (0 = no NVMe tier; None = unlimited)
    host_room_bytes: int | None = None  # the host limit less the static bytes (and the least staging); None: unknown


def device_floor_bytes(cost: CostModel) -> int:
    """The least device peak of any plan (the executor's accounting): see the module docstring."""
    fixed, layer, head = _floor_windows(cost)
    return fixed + max(layer, head)


def _floor_windows(cost: CostModel) -> tuple[int, int, int]:
    """(the slots and constants, the least a layer's backward window adds, the least the head's window adds)."""
    A = max(cost.boundary_bytes)
    device = cost.device_breakdown()
    fixed = device["weight_slots"] + device["grad_slots"] + cost.constant_device_bytes
    layer = max(cost.working_bytes) + (5 if cost.num_layers > 1 else 4) * A
    head = cost.head_working_bytes + 3 * A + 2 * cost.head_slot_bytes
    return fixed, layer, head


def _short(what: str, need: int, need_detail: str, limit: int, knob: str, advice: str) -> LazyTrainError:
    return LazyTrainError(
        f"{what}: needs {format_bytes(need)} ({need_detail}) but {knob} gives {format_bytes(limit)} "
        f"(short by {format_bytes(need - limit)}); {advice}"
    )


def host_need(cost: CostModel, staging_depth: int | None = None) -> tuple[int, str]:
    """The static host bytes and their breakdown in words ("weights 28.4 GiB, grads ..."), with `staging_depth`
    staging slots (None: the least any plan holds)."""
    host = cost.host_breakdown(cost.least_staging_depth if staging_depth is None else staging_depth)
    return sum(host.values()), ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in host.items() if v)


def host_line(cost: CostModel, staging_depth: int | None, limit_bytes: int | None, unchecked: str) -> str:
    """The `host:` admission line both commands print: the static host bytes with their breakdown, against
    `limit_bytes` (None: `unchecked` says why)."""
    need, detail = host_need(cost, staging_depth)
    return (f"host: {format_bytes(need)} ({detail}; master weights {cost.master_weights}) "
            + (f"fits {format_bytes(limit_bytes)}" if limit_bytes is not None else f"not checked ({unchecked})"))


def host_advice(cost: CostModel) -> str:
    """What would shrink the host layout, most effective first (the same words from both commands)."""
    options = []
    if cost.optimizer_offload == "host":
        nvme = cost.with_optimizer_offload("nvme")
        options.append(f"--optimizer-offload nvme (the optimizer's state on an NVMe SSD: host memory "
                       f"{format_bytes(host_need(nvme)[0])}, {format_bytes(nvme.nvme_state_bytes())} on the SSD)")
    if cost.optimizer != "8bit":
        options.append("--optimizer 8bit (2 instead of 8 bytes of state per parameter)")
    if cost.master_weights == "fp32" and cost.dtype_bytes == 2:
        options.append("--master-weights bf16 with an 8-bit optimizer (4 instead of 8 bytes per parameter)")
    return "use " + ", ".join([*options, "a smaller model or more host memory"])


def check_host_memory(cost: CostModel, limit: int, knob: str) -> None:
    """Raise when the static host bytes (weights, grads, optimizer states, buffers) exceed `limit`: the one rule
    of `lazytrain plan` (against --cpu-mem) and `lazytrain train` (against the available memory)."""
    need, detail = host_need(cost)
    if need > limit:
        raise _short("host memory", need, detail, limit, knob, host_advice(cost))


def admit(cost: CostModel, budgets: Budgets | None = None) -> Admission:
    """Check the budgets against what every plan needs; raise LazyTrainError naming the first short one."""
    budgets = budgets or Budgets()
    hw = cost.hardware

    # ---- host memory: weights, grads, optimizer states, staging ------------------------------------
    static_host = cost.static_host_bytes(cost.least_staging_depth)
    host_limit = budgets.host_mem_bytes if budgets.host_mem_bytes is not None else hw.host_mem_bytes
    host_knob = "--cpu-mem" if budgets.host_mem_bytes is not None else f"the {hw.name} host memory"
    if host_limit is not None:
        check_host_memory(cost, host_limit, host_knob)

    # ---- device memory: slots, working sets, loss head, constants ----------------------------------
    cap = budgets.gpu_mem_cap_bytes if budgets.gpu_mem_cap_bytes is not None else hw.gpu_mem_bytes
    cap_knob = "--gpu-mem-cap" if budgets.gpu_mem_cap_bytes is not None else f"the {hw.name} device memory"
    static_device = cost.static_device_bytes()
    if static_device > cap:
        detail = (f"weight + gradient slots 4 x {format_bytes(cost.layer_slot_bytes)}, largest working set "
                  f"{format_bytes(max(max(cost.working_bytes), cost.head_working_bytes))}, 2 boundary gradients "
                  f"of {format_bytes(max(cost.boundary_bytes))}")
        raise _short("device memory", static_device, detail, cap, cap_knob,
                     "lower --batch-size or --seq-len, or raise " + ("--gpu-mem-cap" if budgets.gpu_mem_cap_bytes
                                                                      is not None else "the device memory"))

    # ---- activation budgets ------------------------------------------------------------------------
    gpu_act = cap - static_device  # M_G
    floor = device_floor_bytes(cost)
    mandatory = floor - static_device  # boundaries every plan holds on the device at its worst moment
    if gpu_act < mandatory:
        A = max(cost.boundary_bytes)
        _, layer, head = _floor_windows(cost)
        head_slots = 2 * cost.head_slot_bytes if head > layer else 0  # the floor is the head's window
        what = f"{(mandatory - head_slots) // A} boundary activations of {format_bytes(A)}" + (
            f" and the loss head's own weight and gradient slots of {format_bytes(cost.head_slot_bytes)}"
            if head_slots else "")
        raise LazyTrainError(
            f"gpu activation budget: every plan holds {what} "
            f"on the device at once ({format_bytes(mandatory)}) but {cap_knob} {format_bytes(cap)} leaves "
            f"{format_bytes(gpu_act)} after {format_bytes(static_device)} of slots and working set "
            f"(short by {format_bytes(mandatory - gpu_act)}); lower --batch-size or raise --gpu-mem-cap"
        )
    host_room = None if host_limit is None else host_limit - static_host
    cpu_act = budgets.cpu_act_bytes
    if cpu_act is not None and host_room is not None and cpu_act > host_room:
        raise LazyTrainError(
            f"cpu activation budget: --cpu-act-budget {format_bytes(cpu_act)} but {host_knob} "
            f"{format_bytes(host_limit)} leaves {format_bytes(host_room)} after {format_bytes(static_host)} of "
            f"weights, grads and optimizer states (short by {format_bytes(cpu_act - host_room)}); "
            "lower --cpu-act-budget or raise --cpu-mem"
        )
    return Admission(host_need_bytes=static_host + (cpu_act or 0), host_limit_bytes=host_limit,
                     device_floor_bytes=floor, gpu_mem_cap_bytes=cap, gpu_act_bytes=gpu_act,
                     cpu_act_bytes=cpu_act if cpu_act is not None else host_room,
                     nvme_act_bytes=budgets.nvme_act_bytes, host_room_bytes=host_room)


def staging_budgets(cost: CostModel, budgets: Budgets, num_layers: int | None = None
                    ) -> list[tuple[int, Budgets]]:
    """The staging depths a plan may take, each with its budgets: with the optimizer's state on NVMe D = 1 ..
    min(L, MAX_STAGING_DEPTH) slots of `staging_slot_bytes`, as many as the host holds beside the cpu activations:
    the slots beyond the first (which admission counted) come out of the host room the activations would get, so
    M_C(D) = min(M_C, room - (D - 1) slot) with room = the host limit less the static bytes and one slot (no limit
    known: the host is not checked, every depth keeps the budgets). In RAM: [(0, budgets)]."""
    if cost.optimizer_offload != "nvme":
        return [(0, budgets)]
    slot, L = cost.staging_slot_bytes, num_layers or cost.num_layers
    limit = budgets.host_mem_bytes if budgets.host_mem_bytes is not None else cost.hardware.host_mem_bytes
    room = None if limit is None else limit - cost.static_host_bytes(1)  # unknown: the host is not checked
    out = []
    for depth in range(1, min(L, MAX_STAGING_DEPTH) + 1):
        left = math.inf if room is None else room - (depth - 1) * slot
        if left < 0:
            break
        cpu = budgets.cpu_act_bytes
        out.append((depth, budgets if left == math.inf else replace(
            budgets, cpu_act_bytes=int(left if cpu is None else min(cpu, left)))))
    return out


def nvme_need(cost: CostModel, nvme_act_bytes: int | None) -> tuple[int, str]:
    """The NVMe bytes a run writes at most: the optimizer's state files (optimizer_offload nvme) and the activation
    spills (its nvme activation budget; 0 = none, None = unlimited: not counted), with the breakdown in words."""
    spills = nvme_act_bytes or 0
    states = cost.nvme_state_bytes()
    parts = [f"optimizer state files {format_bytes(states)}"] if states else []
    parts += [f"activation spills up to {format_bytes(spills)}"] if spills else []
    return states + spills, ", ".join(parts)


def check_nvme_space(cost: CostModel, nvme_act_bytes: int | None, directory: str | Path) -> None:
    """Raise, before anything is written, when `directory` cannot hold what the run writes there (`nvme_need`): the
    one rule of `lazytrain train` (its nvme_dir) and `lazytrain plan` (a job that names one)."""
    need, detail = nvme_need(cost, nvme_act_bytes)
    if not need:
        return
    path = Path(directory)
    if not path.is_dir():
        raise LazyTrainError(f"nvme: needs {format_bytes(need)} ({detail}) on {path}, which is not a directory; "
                             "create it or set nvme_dir to a directory on an NVMe SSD")
    free = shutil.disk_usage(path).free
    if need > free:
        raise LazyTrainError(f"nvme: needs {format_bytes(need)} ({detail}) on {path} but it has {format_bytes(free)} "
                             f"free (short by {format_bytes(need - free)}); free space there, set nvme_dir to another "
                             "disk, or lower --nvme-act-budget")


SECONDS_PER_DAY = 86_400


def nvme_write_bytes(cost: CostModel, nvme_boundaries: list[int], grad_accum: int = 1) -> int:
    """Bytes one optimizer step writes to nvme_dir: every group's state file written back once (optimizer_offload
    nvme) and each nvme boundary spilled once per micro-batch."""
    states = sum(cost.state_group_bytes()) if cost.optimizer_offload == "nvme" else 0
    return states + grad_accum * sum(cost.boundary_bytes[i] for i in nvme_boundaries)


def wear_line(write_bytes: int, step_s: float, tbw_tb: float | None) -> str | None:
    """What the drive under nvme_dir lives through: the bytes written per step and per day of training and, with the
    drive's rated endurance `tbw_tb` (terabytes written), the days of training to that rating; None: no writes."""
    if write_bytes <= 0:
        return None
    per_day = write_bytes * SECONDS_PER_DAY / step_s
    line = f"nvme writes: {format_bytes(write_bytes)} per step, {per_day / 1e12:.3g} TB per day of training"
    if tbw_tb is None:
        return line + " (set nvme_tbw to the drive's rated TBW to see the days to it)"
    return line + f"; the drive's rating of {tbw_tb:g} TBW in {tbw_tb * 1e12 / per_day:.3g} days"
