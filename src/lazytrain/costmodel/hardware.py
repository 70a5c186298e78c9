"""HardwareSpec: the machine a plan is made for — device memory, link rates, compute and optimizer speed.

Rates are *achieved* rates, not datasheet peaks: the planner and the simulator turn FLOPs and bytes into
seconds with them, so they must describe what the runtime really gets. Units: GB/s = 1e9 bytes/s,
TFLOPS = 1e12 FLOP/s, Gparams/s = 1e9 parameters/s. `math.inf` means "unlimited" (a link that costs
nothing), which tests use to isolate one effect.

Presets live in `PRESETS` below (one dict per machine, every number with its source). Any field can be
overridden from a YAML/JSON file (`HardwareSpec.load("my_box.yaml")`, optionally `base: h800` in the
file) or by keyword (`HardwareSpec.load("h800", h2d_gbps=20)`). `HardwareSpec.profile()` measures the
machine it runs on (CPU matmul rate, memcpy rate, torch AdamW throughput) for the `emulated` device.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError
from lazytrain.units import MAX_BYTES, MAX_GBPS, MIN_GBPS, rate_in_range

GiB = 2**30
# The machine's data links, each `<link>_gbps` here and a FIFO lane of the step program (plan/schedule.py LANES):
# the one list the planner, the simulator, the devices and the plots read.
LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator plus its host. Every rate is what the runtime achieves, not a datasheet peak."""

    name: str
    gpu_mem_bytes: int  # device memory the arena may use at most (the --gpu-mem-cap default)
    h2d_gbps: float  # host -> device link, GB/s (1e9 B/s); inf = free
    d2h_gbps: float  # device -> host link, GB/s; runs concurrently with h2d (full duplex)
    nvme_read_gbps: float  # NVMe -> host, GB/s
    nvme_write_gbps: float  # host -> NVMe, GB/s
    matmul_tflops: float  # achieved dense matmul rate in the compute dtype, 1e12 FLOP/s (calibrated)
    # host DRAM bandwidth the optimizer's update streams at (all cores), GB/s: its seconds are the bytes it reads
    # and writes per parameter (CostModel.update_bytes_per_param: 16-50 by optimizer and master dtype) over this
    host_mem_gbps: float
    host_mem_bytes: int | None = None  # host DRAM; None = unknown (host admission needs --cpu-mem then)
    mem_gbps: float = math.inf  # device memory bandwidth for memory-bound elementwise ops; inf = ignore them
    layer_overhead_s: float = 0.0  # fixed cost per layer call (kernel launches, dispatch); matters on CPU
    grad_accumulate_gbps: float = math.inf  # host: landed compute-dtype gradient bytes added into .grad per s
    # Data parallelism (costmodel/topology.py): achieved rate of the ranks' gradient sums, GB/s of the bytes each rank
    # moves, between the GPUs of one node (NVLink, or PCIe through the host) and between nodes (the GPU's NIC).
    # `lazytrain train` measures both when its ranks start; None = unknown: `lazytrain plan --world-size N` then
    # asks for it.
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    # optimizer_offload nvme: the rate the optimizer's state files move at on the NVMe links, GB/s: a group's whole
    # file in large aligned requests, several in flight (runtime/statefiles.py), where the activations' spill files
    # are one small file each with a checksum. None = the link's figure (nvme_read_gbps / nvme_write_gbps); the
    # emulated device's calibration measures both (runtime/probe.py).
    nvme_state_read_gbps: float | None = None
    nvme_state_write_gbps: float | None = None
    # The rate each NVMe direction keeps while the other also runs, GB/s (many SSDs share one budget between reads
    # and writes); None = each direction at its own rate regardless. It caps both NVMe lanes of a step whose
    # state files are on NVMe (CostModel: reads and writes run beside each other for most of such a step).
    nvme_mixed_gbps: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise LazyTrainError(f"hardware {self.name!r}: {f.name} must be a number, got {value!r}")
            if f.name == "layer_overhead_s":  # the one field where 0 is meaningful
                if value < 0:
                    raise LazyTrainError(f"hardware {self.name!r}: layer_overhead_s must be >= 0, got {value!r}")
            elif value <= 0:
                raise LazyTrainError(f"hardware {self.name!r}: {f.name} must be > 0, got {value!r}")
        for f in ("gpu_mem_bytes", "host_mem_bytes"):
            value = getattr(self, f)
            if value is not None and value != math.inf:
                object.__setattr__(self, f, int(value))

    # ---- derived rates in bytes/s and FLOP/s --------------------------------------------------
    @property
    def matmul_flops_per_s(self) -> float:
        return self.matmul_tflops * 1e12

    @property
    def emulated(self) -> bool:
        """The EmulatedDevice (the `emulated` preset, profiled or not), whose budgets default to a few boundaries."""
        return self.name.startswith("emulated")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **overrides: Any) -> HardwareSpec:
        """A copy with some fields replaced; unknown field names are refused with the list of known ones."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise LazyTrainError(f"hardware: unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
        return replace(self, **overrides)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | Path = "h800", **overrides: Any) -> HardwareSpec:
        """A preset name (`h800`, `rtx3090`, `h100`, `h200`, `emulated`) or a YAML/JSON file, then `overrides`.

        A file holds field values; `base: <preset>` (default: none, so every field is needed) fills the rest.
        """
        key = str(name_or_path).lower()
        if key in PRESETS:
            spec = cls(**PRESETS[key])
        else:
            path = Path(name_or_path)
            if not path.is_file():
                raise LazyTrainError(
                    f"hardware {str(name_or_path)!r}: no such preset or file; presets: {', '.join(PRESETS)}"
                )
            data = _read_mapping(path)
            base = data.pop("base", None)
            if base is not None and str(base).lower() not in PRESETS:
                raise LazyTrainError(f"hardware file {path}: base {base!r} is not a preset ({', '.join(PRESETS)})")
            values = {**(PRESETS[str(base).lower()] if base else {}), "name": path.stem, **data}
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise LazyTrainError(
                    f"hardware file {path}: unknown field(s) {unknown}; known: {', '.join(sorted(known))}"
                )
            try:
                spec = cls(**{k: _field_value(k, v) for k, v in values.items()})
            except TypeError as err:  # a required field is missing
                raise LazyTrainError(f"hardware file {path}: {err}; add `base: h800` or the missing field") from None
        return spec.with_overrides(**overrides) if overrides else spec

    @classmethod
    def profile(cls, base: str = "emulated", seconds: float = 0.5, **overrides: Any) -> HardwareSpec:
        """Measure this machine: CPU matmul rate, memcpy rate, the bandwidth a fused AdamW step streams at, and
        gradient-add throughput.

        Each figure is the median over about `seconds`. Returns the `base` preset with `matmul_tflops`,
        `host_mem_gbps`, `grad_accumulate_gbps` and (for `emulated`) the link rates capped at the memcpy rate
        measured here — the emulated links cannot copy faster than memcpy.
        """
        measured: dict[str, Any] = {"name": f"{base}-profiled", "matmul_tflops": _matmul_tflops(seconds),
                                    "host_mem_gbps": _adamw_gbps(seconds),
                                    "grad_accumulate_gbps": _grad_add_gbps(seconds)}
        copy_gbps = _copy_gbps(seconds)
        if base == "emulated":
            for link in LINKS:
                measured[f"{link}_gbps"] = min(PRESETS["emulated"][f"{link}_gbps"], copy_gbps)
        return cls.load(base).with_overrides(**{**measured, **overrides})


# Each measurement's buffers die with its function: the profile runs at the start of every run on the emulated
# device, and its transient (64 MiB at most, one measurement's) is resident memory no admission counts.
def _matmul_tflops(seconds: float) -> float:
    import torch

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _time_it(lambda: torch.mm(a, b), seconds) / 1e12


def _copy_gbps(seconds: float) -> float:
    import torch

    src = torch.randn(8 * 2**20)  # 32 MiB, and as much again for the copy
    dst = torch.empty_like(src)
    return src.numel() * 4 / _time_it(lambda: dst.copy_(src), seconds) / 1e9


def _adamw_gbps(seconds: float) -> float:
    """The bandwidth a fused AdamW step streams at: 28 B/param (p, m, v read and written, g read)."""
    import torch

    p = torch.nn.Parameter(torch.randn(2**22))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    return 28 * p.numel() / _time_it(opt.step, seconds) / 1e9


def _grad_add_gbps(seconds: float) -> float:
    import torch

    acc, grad = torch.randn(2**22), torch.randn(2**22)
    return grad.numel() * 4 / _time_it(lambda: acc.add_(grad), seconds) / 1e9


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 avx512_bf16 or AMX, Arm bf16). Without it torch's bf16
    matmuls are several times slower than fp32 (measured 3.4x on an AVX-512 Xeon without them). Linux reads
    /proc/cpuinfo; elsewhere assume yes."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: str, emulated: bool) -> str:
    """`dtype: auto` as a concrete precision: bf16 (the GPU's), except on the emulated device of a CPU without
    native bf16, where fp32 computes several times faster. Other values are returned as they are."""
    if dtype != "auto":
        return dtype
    return "fp32" if emulated and not cpu_has_native_bf16() else "bf16"


def available_host_memory_bytes() -> int | None:
    """Host memory this process can still allocate without swapping: Linux's MemAvailable (else the free
    physical pages), capped by a container's cgroup memory limit; None when neither is known."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            limit = int(Path(limit_file).read_text())  # "max" (v2, no limit) does not parse
        except (OSError, ValueError):
            continue
        available = limit if available is None else min(available, limit)
    return available


def _time_it(fn: Any, seconds: float) -> float:
    """Median seconds per call, after one warm-up call, over about `seconds` of calls (at least 3)."""
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def _field_value(name: str, value: Any) -> Any:
    """A hardware file's value: YAML/JSON writes infinity as a string ('inf'); *_bytes fields also take sizes like
    '80GiB'. A file is data, so its sizes and link rates get the ranges the config's have (units.py); tests and
    what-if studies may still build a spec of any positive rate in code."""
    number = _file_number(name, value)
    if isinstance(number, int | float) and not isinstance(number, bool) and number > 0:
        if name.endswith("_gbps") and not rate_in_range(number):
            raise LazyTrainError(f"hardware {name}: {value!r} is not a rate in {MIN_GBPS:g}..{MAX_GBPS:g} GB/s (inf = "
                                 "free)")
        if name.endswith("_bytes") and number != math.inf and number > MAX_BYTES:
            raise LazyTrainError(f"hardware {name}: {value!r} is more than 1 EiB")
    return number


def _file_number(name: str, value: Any) -> Any:
    if name == "name" or not isinstance(value, str):
        return value
    if value.strip().lower() in ("inf", "infinity", ".inf"):
        return math.inf
    if name.endswith("_bytes"):
        from lazytrain.units import parse_bytes

        return parse_bytes(value, what=f"hardware {name}")
    try:
        return float(value)
    except ValueError:
        raise LazyTrainError(f"hardware {name}: cannot read {value!r} as a number") from None


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # noqa: BLE001 - any parse failure is one user-facing line
        detail = " ".join(str(err).split())  # parser messages span lines; errors are one line
        raise LazyTrainError(f"hardware file {path}: cannot read it ({type(err).__name__}: {detail})") from None
    if not isinstance(data, dict):
        raise LazyTrainError(f"hardware file {path}: expected a mapping of field: value, got {type(data).__name__}")
    return data


# ---- presets ------------------------------------------------------------------------------------
# matmul_tflops / host_mem_gbps of h800 are calibrated by benchmarks/calibrate.py against the
# MegaTrain H800 rows published with LazyTrain (arXiv 2608.11919); h100/h200 share the H800's compute die and its
# class of host (two sockets of 8-channel DDR5), so they reuse its achieved rates. Link rates: H800 as measured in
# the paper (12 GB/s per direction); the others are typical pinned-memory rates, stated below. mem_gbps: datasheet
# HBM bandwidth x 0.8 (achievable).
# Collective links (per GPU, per direction): H800 as DeepSeek-V3's report states its H800 cluster (arXiv
# 2412.19437 §3.2.2: NVLink 160 GB/s, InfiniBand 50 GB/s per GPU); H100/H200 NVLink 4 = 900 GB/s bidirectional
# (NVIDIA datasheet) -> 450 per direction x 0.8 (the derating of mem_gbps, which also turns the H800's 200 into
# DeepSeek's 160) = 360, and one 400 Gb/s NDR NIC per GPU (DGX H100 datasheet) = 50 GB/s; RTX 3090 below.
_H800_NVLINK_GBPS, _IB_NDR_GBPS = 160.0, 50.0
_NVLINK4_GBPS = 450 * 0.8
_H800_MATMUL_TFLOPS = 298.0  # calibrated (benchmarks/calibrate.py)
# calibrated (benchmarks/calibrate.py): 6.6 Gparams/s of MegaTrain's fp32 Adam step at the 32 B/param our model
# counts for it (fused AdamW, cast chunks in cache); two sockets of 8-channel DDR5-4800 are 614 GB/s on the wire,
# so ~34% of it: a floor (that step is DeepSpeed's CPUAdam, not a triad)
_H800_HOST_MEM_GBPS = 211.2

# The emulated device's link rates, GB/s: what `lazytrain train` throttles its EmulatedDevice to and `lazytrain
# plan` plans for unless the job sets its own (RuntimeConfig's *_gbps defaults are these).
EMULATED_LINK_GBPS = dict(h2d_gbps=1.0, d2h_gbps=1.0, nvme_read_gbps=0.5, nvme_write_gbps=0.5)

PRESETS: dict[str, dict[str, Any]] = {
    "h800": dict(
        name="h800", gpu_mem_bytes=80 * GiB, h2d_gbps=12.0, d2h_gbps=12.0,
        nvme_read_gbps=2.83, nvme_write_gbps=3.35,
        matmul_tflops=_H800_MATMUL_TFLOPS, host_mem_gbps=_H800_HOST_MEM_GBPS,
        host_mem_bytes=2 * 1024 * GiB, mem_gbps=3350 * 0.8,
        intra_node_gbps=_H800_NVLINK_GBPS, inter_node_gbps=_IB_NDR_GBPS,
    ),
    "h100": dict(
        name="h100", gpu_mem_bytes=80 * GiB, h2d_gbps=25.0, d2h_gbps=25.0,  # PCIe Gen5 x16, pinned, typical
        nvme_read_gbps=6.0, nvme_write_gbps=5.0,
        matmul_tflops=_H800_MATMUL_TFLOPS, host_mem_gbps=_H800_HOST_MEM_GBPS,
        host_mem_bytes=None, mem_gbps=3350 * 0.8,
        intra_node_gbps=_NVLINK4_GBPS, inter_node_gbps=_IB_NDR_GBPS,
    ),
    "h200": dict(
        name="h200", gpu_mem_bytes=141 * 10**9, h2d_gbps=25.0, d2h_gbps=25.0,
        nvme_read_gbps=6.0, nvme_write_gbps=5.0,
        matmul_tflops=_H800_MATMUL_TFLOPS, host_mem_gbps=_H800_HOST_MEM_GBPS,
        host_mem_bytes=None, mem_gbps=4800 * 0.8,
        intra_node_gbps=_NVLINK4_GBPS, inter_node_gbps=_IB_NDR_GBPS,
    ),
    # RTX 3090: 24 GiB; PCIe 4.0 x16 is 31.5 GB/s raw, consumer boards reach about 12-13 GB/s per direction
    # when both directions stream concurrently from pageable-then-pinned staging — we take 12.5 GB/s.
    # bf16 tensor-core peak 71 TFLOPS (fp32 accumulate); achieved = the same fraction of peak as the
    # calibrated H800 (298 / 989 = 30%) -> 21.4 TFLOPS. Host: dual-channel DDR4-3200 (a Ryzen 5000 / Intel 10th-11th
    # generation desktop) is 51.2 GB/s on the wire; STREAM reaches 74-78% of the wire rate on DDR4 (TI's SPRAD45A and
    # SPRACV1B tables) and AIDA64 reads ~46 GB/s at 3200 MT/s (guru3d's DDR4-3200 review) -> 51.2 x 0.75 = 38 GB/s.
    # Between GPUs: no NVLink bridge assumed and GeForce cards have peer-to-peer off, so NCCL goes through host
    # memory over PCIe 4.0: the 12.5 GB/s link x 0.8 = 10 GB/s; between nodes 10 GbE = 1.25 GB/s (a workstation).
    "rtx3090": dict(
        name="rtx3090", gpu_mem_bytes=24 * GiB, h2d_gbps=12.5, d2h_gbps=12.5,
        nvme_read_gbps=3.5, nvme_write_gbps=3.0,
        matmul_tflops=71.0 * _H800_MATMUL_TFLOPS / 989.0, host_mem_gbps=38.0,
        host_mem_bytes=None, mem_gbps=936 * 0.8,
        intra_node_gbps=10.0, inter_node_gbps=1.25,
    ),
    # The EmulatedDevice: compute on this CPU, a memory arena as the "device", link threads that copy and
    # sleep to bytes / rate (EMULATED_LINK_GBPS, the jobs' default rates). Compute figures suit a 2-core laptop;
    # `HardwareSpec.profile()` measures the real ones.
    # Its ranks sum gradients with gloo over loopback TCP on the host: `Ranks.time_sums` of a 20 MB fp32 gradient on
    # a 2-core Xeon (Emerald Rapids), 2 ranks: the reduce in a node 0.23-0.26 GB/s ((g-1)/g of the bytes per second),
    # the all-reduce between 2 "nodes" 0.75-0.85 GB/s (benchmarks/dp_step.py; `lazytrain train` measures its own).
    "emulated": dict(
        name="emulated", gpu_mem_bytes=4 * GiB, **EMULATED_LINK_GBPS,
        matmul_tflops=0.05, host_mem_gbps=4.0,  # ~0.1 Gparams/s at ~40 B/param; runs measure their own
        host_mem_bytes=None, mem_gbps=math.inf, layer_overhead_s=0.0,
        intra_node_gbps=0.25, inter_node_gbps=0.8,
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)
