"""Admission control: refuse a request that no plan can satisfy, before any solve, in one line.

Four budgets are checked, in this order, each against what *every* plan needs:
  host memory     static_host_bytes() (weights, grads, optimizer states by mode, staging) against --cpu-mem
                  (or the hardware's host memory; unchecked when neither is known);
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
The result carries the activation budgets the planners use (M_G, M_C, M_N).
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.costmodel.cost import CostModel
from lazytrain.errors import LazyTrainError
from lazytrain.plan.budgets import Budgets
from lazytrain.units import format_bytes


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


def host_need(cost: CostModel) -> tuple[int, str]:
    """The static host bytes and their breakdown in words ("weights 28.4 GiB, grads ...")."""
    host = cost.host_breakdown()
    return sum(host.values()), ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in host.items() if v)


def host_advice(cost: CostModel) -> str:
    """What would shrink the host layout, most effective first (the same words from both commands)."""
    options = []
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
    static_host = cost.static_host_bytes()
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
                     nvme_act_bytes=budgets.nvme_act_bytes)
