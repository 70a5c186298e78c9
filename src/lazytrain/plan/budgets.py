"""Budgets: the memory a plan may use, per tier. Filled from the CLI flags or in code."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lazytrain.errors import LazyTrainError


@dataclass(frozen=True)
class Budgets:
    """Memory limits in bytes. `None` means: take it from the hardware (device/host) or unlimited (activations)."""

    gpu_mem_cap_bytes: int | None = None  # peak device memory cap (--gpu-mem-cap); None = the device's memory
    cpu_act_bytes: int | None = None  # host DRAM for offloaded activations (--cpu-act-budget); None = unlimited
    nvme_act_bytes: int | None = 0  # NVMe bytes for spilled activations (--nvme-act-budget); 0 = no NVMe tier
    host_mem_bytes: int | None = None  # total host memory (--cpu-mem); None = the hardware's, or unchecked

    def __post_init__(self) -> None:
        for knob, value in asdict(self).items():
            if value is not None and (not isinstance(value, int) or value < 0):
                raise LazyTrainError(f"budget {knob} must be a non-negative number of bytes, got {value!r}")

    def to_dict(self) -> dict[str, int | None]:
        return asdict(self)
