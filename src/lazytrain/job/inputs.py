"""The job as its inputs, once: what `lazytrain plan` and `lazytrain train` read from a JobConfig.

Both commands turn the job into the same values here, and the packages below (`plan/`, `costmodel/`,
`runtime/`) take those values, never the JobConfig:

    dtype     = resolved_dtype(job.runtime, emulated=...)      # dtype auto -> bf16 | fp32
    hardware  = resolve_hardware(job.runtime)                  # auto: this machine (a CUDA GPU's preset, else emulated)
    spec      = model_spec(job.model.model)                    # train: the built model's own (plan.spec_of)
    workload  = workload_of(job, batch_size, dtype)            # one micro-batch of one rank
    cost      = cost_model(job, spec, hardware, batch_size)    # the CostModel of that step, the executor's host layout
    topology  = topology_of(job)                               # data parallelism: ranks and nodes

`rank_inputs` is the lines above for one rank of a data-parallel job, with its admission and budgets. No torch
import here (`lazytrain plan` stays free of it): only a CUDA machine's hardware and a user's model directory
import it, where they are read.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from lazytrain.config import JobConfig, RuntimeConfig
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import EMULATED_LINK_GBPS, HardwareSpec, resolve_dtype
from lazytrain.costmodel.model import BUILT_IN_SHAPES, ModelSpec, built_in_config, preset_names
from lazytrain.costmodel.topology import Topology
from lazytrain.costmodel.trainable import Trainable
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.planner import admitted, default_budgets
from lazytrain.plan.rank_plan import rank_budgets

if TYPE_CHECKING:
    from lazytrain.plan.admission import Admission
    from lazytrain.plan.budgets import Budgets


# ---- the machine ------------------------------------------------------------------------------------------
def cuda_visible() -> bool:
    """True when an NVIDIA driver is loaded; only then is torch imported to ask for a usable GPU."""
    if not Path("/proc/driver/nvidia/gpus").is_dir():
        return False
    import torch

    return torch.cuda.is_available()


def cuda_hardware() -> HardwareSpec:
    """The preset closest to this CUDA GPU (by name), with the GPU's own memory."""
    import torch

    name = torch.cuda.get_device_name().lower()
    preset = next((p for p in ("h800", "h200", "h100", "3090") if p in name), "h100")
    preset = "rtx3090" if preset == "3090" else preset
    return HardwareSpec.load(preset, gpu_mem_bytes=torch.cuda.get_device_properties(0).total_memory)


def resolve_hardware(runtime: RuntimeConfig, *, kind: str | None = None, measured: bool = False) -> HardwareSpec:
    """`hardware: auto` = this machine: the CUDA GPU's preset, else the emulated device with the job's link
    rates; a preset or a file otherwise. PCIe link rates set for a machine that is not emulated are refused; NVMe
    rates (`--nvme-read-gbps`, `--nvme-write-gbps`: the user's SSD, e.g. its sustained write rate once its cache is
    full; `--nvme-mixed-gbps`, any hardware: each direction's rate beside the other) replace the preset's.

    `kind`: the device the run was given (`cuda` or `cpu`, train's `pick_device_kind`) instead of looking;
    `measured`: the emulated device's host rates measured on this CPU (`HardwareSpec.profile`), the figures
    `lazytrain train` calibrates from, instead of the preset's."""
    links = {k: getattr(runtime, k) for k in EMULATED_LINK_GBPS}
    if runtime.hardware == "auto":
        if kind is None:
            on_cuda = runtime.device != "cpu" and cuda_visible()
            if runtime.device == "cuda" and not on_cuda:
                raise LazyTrainError("device cuda with hardware auto, but this machine has no CUDA GPU; name the "
                                     "hardware to plan for (e.g. hardware=h800) or use device auto")
            kind = "cuda" if on_cuda else "cpu"
        if kind == "cuda":
            hardware = cuda_hardware()
        else:
            hardware = HardwareSpec.profile("emulated", seconds=0.1) if measured else HardwareSpec.load("emulated")
    else:
        hardware = HardwareSpec.load(runtime.hardware)
    if runtime.nvme_mixed_gbps is not None:
        hardware = hardware.with_overrides(nvme_mixed_gbps=runtime.nvme_mixed_gbps)
    if hardware.emulated:
        return hardware.with_overrides(**links)
    changed = [k for k, v in links.items() if v != EMULATED_LINK_GBPS[k]]
    pcie = [k for k in changed if not k.startswith("nvme_")]
    if pcie:
        raise LazyTrainError(f"{pcie[0]} = {links[pcie[0]]:g} sets the emulated device's link, but the hardware "
                             f"is {hardware.name}; set it in a hardware YAML file (base: {hardware.name}) instead")
    if changed:  # the SSD is the user's, not the preset's: its stated rates win (the state files' too)
        disk = {k: links[k] for k in changed} | {f"nvme_state_{k.removeprefix('nvme_')}": None for k in changed}
        hardware = hardware.with_overrides(**disk)
    return hardware


def resolved_dtype(runtime: RuntimeConfig, *, emulated: bool) -> str:
    """The compute dtype (`dtype: auto` made concrete: bf16, or fp32 on the emulated device of a CPU without
    native bf16)."""
    return resolve_dtype(runtime.dtype, emulated=emulated)


# ---- the model, the step, its cost ------------------------------------------------------------------------
def model_spec(model: str) -> ModelSpec:
    """A planner preset (no torch import), a built-in shape of `lazytrain train` (`small`), or a user's model
    (directory, config.json, cached hub id) validated and counted as `transformers` builds it (meta device)."""
    if model in BUILT_IN_SHAPES:
        return ModelSpec.from_config(built_in_config(model), name=f"lazytrain-{model}")
    if model in preset_names():
        return ModelSpec.load(model)
    from lazytrain.runtime.weights import built_spec, resolve_model  # imports torch

    return built_spec(resolve_model(model).config)


def workload_of(job: JobConfig, batch_size: int | None = None, dtype: str | None = None) -> Workload:
    """One micro-batch of one rank: `batch_size` rows (default the job's) of cutoff_len tokens in `dtype`
    (default the job's, once resolved); masked: the dataset's batches carry an attention mask or position ids
    (`DataConfig.masked`), which the device arena is sized for."""
    return Workload(batch_size=job.data.per_device_train_batch_size if batch_size is None else batch_size,
                    seq_len=job.data.cutoff_len, dtype=job.runtime.dtype if dtype is None else dtype,
                    masked=job.data.masked)


def cost_model(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, batch_size: int | None = None
               ) -> CostModel:
    """The hardware's estimate of every time and byte of one step of `batch_size` (default the job's) rows, with
    the host layout the executor allocates for this job (master weights, accumulation): the one CostModel of a
    job, which both commands admit and plan by (train's then calibrated on its device)."""
    dtype = resolved_dtype(job.runtime, emulated=hardware.emulated)
    return CostModel(spec, hardware, workload_of(job, batch_size, dtype), job.optim.optimizer,
                     master_weights=job.runtime.master_weights,
                     grad_accumulation=job.optim.gradient_accumulation_steps,
                     optimizer_offload=job.runtime.optimizer_offload, trainable=trainable_of(job))


def trainable_of(job: JobConfig) -> Trainable:
    """The job's finetuning_type as the cost model prices it (which parameters train)."""
    f = job.finetune
    if f.finetuning_type == "lora":
        return Trainable("lora", rank=f.lora_rank, targets=names(f.lora_target), extra=names(f.additional_target),
                         quantized=f.quantization_bit == 4)
    if f.finetuning_type == "freeze":
        return Trainable("freeze", layers=f.freeze_trainable_layers, extra=names(f.freeze_extra_modules))
    return Trainable()


def names(text: str | None) -> tuple[str, ...]:
    """A comma list of names (lora_target, additional_target, freeze_*_modules) as a tuple."""
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def topology_of(job: JobConfig) -> Topology:
    """The job's ranks and nodes."""
    return Topology(world_size=job.parallel.world_size, nodes=job.parallel.nodes)


def rank_inputs(job: JobConfig, spec: ModelSpec, hardware: HardwareSpec, batch_size: int
                ) -> tuple[Topology, CostModel, Admission, Budgets]:
    """One rank of the job's run at `batch_size` rows per rank: its topology, its cost model (its share of the
    node's NVMe rate), admission and budgets (its share of the node's host room) -- for `lazytrain plan`, the
    largest-batch search and `per_device_train_batch_size: auto` alike. One rank: the one-process inputs."""
    topology = topology_of(job)
    cost = cost_model(job, spec, topology.rank_hardware(hardware), batch_size)
    admission, budgets = admitted(cost, rank_budgets(default_budgets(job.plan, cost), cost, topology))
    return topology, cost, admission, budgets


def adapter_states_in_ram(job: JobConfig) -> tuple[JobConfig, str | None]:
    """LoRA with `optimizer_offload: nvme`: the adapters' masters and states stay in RAM (a rank-16 adapter of a
    70B model is ~0.2 B parameters: ~3 GB of fp32 master, moments and gradient, against the base's bytes), with a
    note; freeze tuning's trained layers go to the state files as full training's. Both commands apply it."""
    if job.finetune.finetuning_type != "lora" or job.runtime.optimizer_offload != "nvme":
        return job, None
    return (replace(job, runtime=replace(job.runtime, optimizer_offload="host")),
            "note     finetuning_type lora: the adapters' optimizer states stay in RAM (they are small); "
            "optimizer_offload nvme -> host")
