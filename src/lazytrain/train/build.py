"""Builders of a run: the model on the host, the device it streams through, the executor that runs the plan."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import LlamaConfig, PreTrainedModel

from lazytrain.costmodel import hardware as hardware_module
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import BUILT_IN_SHAPES, ModelSpec, built_in_config
from lazytrain.distributed.shared import share_model
from lazytrain.errors import LazyTrainError
from lazytrain.job.inputs import cost_model, names
from lazytrain.plan.admission import check_host_memory
from lazytrain.plan.plan import Plan
from lazytrain.runtime.adapters import LoraSettings, add_lora, cast_frozen, freeze, load_adapter, read_adapter
from lazytrain.runtime.device import CudaDevice, EmulatedDevice
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.hf import find_parts
from lazytrain.runtime.nf4 import quantize_base, quantized_linears
from lazytrain.runtime.weights import (
    ModelSource,
    built_spec,
    check_init,
    deferred,
    host_value,
    load_model,
    meta_model,
    resolve_model,
    settle,
)
from lazytrain.train.metrics import say
from lazytrain.units import format_bytes

if TYPE_CHECKING:
    from lazytrain.config import JobConfig
    from lazytrain.costmodel.cost import CostModel
    from lazytrain.distributed import Ranks

Device = CudaDevice | EmulatedDevice


# =====================================================================================================
# model
# =====================================================================================================
def model_source(job: JobConfig, vocab_size: int) -> ModelSource:
    """What `model` names (runtime/weights.py resolves everything but the built-in shapes), checked against
    the tokenizer and the sequence length."""
    if job.model.model in BUILT_IN_SHAPES:
        shape = {k: v for k, v in built_in_config(job.model.model, vocab_size).items() if k != "model_type"}
        config = LlamaConfig(max_position_embeddings=max(1024, job.data.cutoff_len), bos_token_id=256,
                             eos_token_id=257, pad_token_id=258, **shape)
        config._name_or_path = f"lazytrain-{job.model.model}"
        return ModelSource(name=job.model.model, kind="preset", config=config)
    source = resolve_model(job.model.model)
    config = getattr(source.config, "text_config", None) or source.config
    if config.vocab_size < vocab_size:
        raise LazyTrainError(f"model {job.model.model}: vocab_size {config.vocab_size} is smaller than the "
                             f"tokenizer's {vocab_size} ids; raise vocab_size in its config.json")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and job.data.cutoff_len > limit:
        raise LazyTrainError(f"cutoff_len {job.data.cutoff_len} exceeds the model's max_position_embeddings "
                             f"{limit}; lower cutoff_len")
    return source


def build_model(job: JobConfig, source: ModelSource, ranks: Ranks | None = None) -> PreTrainedModel:
    """The host causal LM in the run's layout: built on the meta device first, its parameter count checked against
    the ModelSpec and the host memory (admission), then its weights loaded tensor by tensor straight into the
    masters' dtype (fp32, or bf16 with master_weights bf16: the streamed weights themselves), or a seeded random
    init (built-in shapes, a bare config.json, init random). Masters the run keeps in its NVMe state files
    (`deferred_masters`) are placeholders read from the model's files when the streamed copy and the state files
    are made (runtime/weights.py): the process never holds a whole fp32 model beside its bf16 copy. QLoRA's base
    linears likewise stay in the file until each is quantized (never the whole bf16 base beside its NF4 bytes).

    With ranks the node holds one copy (`distributed.share_model`): local rank 0 loads it and moves it into the
    node's shared memory; the other local ranks load nothing and map it."""
    check_init(source, job.model.init)  # the weights are there: the root cause before any count of them
    if job.finetune.finetuning_type == "lora" and not starts_from_weights(job, source):
        raise LazyTrainError(f"finetuning_type lora adapts a model's weights, and {job.model.model} has none to "
                             "start from (a built-in shape, a bare config.json or init random): give a model "
                             "folder with safetensors weights, or set finetuning_type full")
    meta = meta_model(source.config)
    check_host_fits(job, built_spec(source.config, meta))
    masters = torch.bfloat16 if job.runtime.master_weights == "bf16" else torch.float32
    if job.finetune.finetuning_type == "lora":  # the base is frozen: loaded straight into the compute dtype
        masters = compute_dtype(job)
    if ranks is not None and ranks.local_rank != 0:
        model = meta.to(masters)  # shapes only: the node's copy is mapped below
    else:
        defer = deferred_masters if masters_in_files(job) and ranks is None else None
        if quantized_base(job):  # each base linear read from the file as it is quantized (choose_trainable)
            defer = quantized_linears
        model = load_model(source, init=job.model.init, seed=job.runtime.seed, model=meta, dtype=masters,
                           defer=defer)
    choose_trainable(job, model, source)
    if ranks is not None:
        ranks.node_weights = share_model(ranks, model, compute_dtype(job))
        model.config.use_cache = False
        model.train()
    return model


def choose_trainable(job: JobConfig, model: PreTrainedModel, source: ModelSource) -> None:
    """finetuning_type: LoRA adapters on the frozen model (from adapter_name_or_path when given) or freeze tuning's
    trainable layers; the frozen parameters then live in the compute dtype alone (no masters)."""
    f = job.finetune
    if f.finetuning_type == "full":
        return
    if f.finetuning_type == "lora":
        if source.directory is not None:  # the adapter folder's base_model_name_or_path
            model.config._name_or_path = str(Path(source.directory).resolve())
        settings = LoraSettings(rank=f.lora_rank, alpha=f.lora_alpha, dropout=f.lora_dropout,
                                targets=names(f.lora_target), rslora=f.use_rslora,
                                additional=names(f.additional_target))
        tensors = None
        if f.adapter_name_or_path is not None:  # its own rank, alpha and targets, as PEFT resumes an adapter
            settings, tensors = read_adapter(Path(f.adapter_name_or_path), f.lora_dropout)
        add_lora(model, settings)
        if tensors is not None:
            load_adapter(model, tensors, f"adapter_name_or_path {f.adapter_name_or_path}")
    else:
        freeze(model, f.freeze_trainable_layers, names(f.freeze_trainable_modules), names(f.freeze_extra_modules))
    if job.runtime.master_weights == "bf16":
        model.to(torch.bfloat16)  # the adapters too: bf16 masters are the streamed buffers
    if quantized_base(job):  # QLoRA: the frozen linears as NF4 bytes
        t0 = time.perf_counter()
        count, weights = quantize_base(model, compute_dtype(job))
        say(f"base     quantization_bit 4: the decoder layers' {count} frozen linears ({weights:,} weights) held and "
            "streamed as NF4 (bitsandbytes' nf4, block 64, double quantization), dequantized on the device; "
            f"quantized in {time.perf_counter() - t0:.1f} s")
    for p in model.parameters():  # what stays in the model's file: masters bound for the state files alone
        if deferred(p) and not (p.requires_grad and masters_in_files(job)):
            p.data = host_value(p)  # (a frozen one has no master; a linear additional_target of QLoRA trains)
            settle(p)
    cast_frozen(model, compute_dtype(job))


def quantized_base(job: JobConfig) -> bool:
    return job.finetune.finetuning_type == "lora" and job.finetune.quantization_bit == 4


def masters_in_files(job: JobConfig) -> bool:
    """Whether the fp32 masters live in the NVMe state files (CostModel.masters_offloaded): a bf16 copy streams."""
    return (job.runtime.optimizer_offload == "nvme" and job.runtime.master_weights == "fp32"
            and compute_dtype(job) == torch.bfloat16)


def deferred_masters(model: PreTrainedModel) -> set[str]:
    """The parameters whose masters go to the state files (train/offload.py): all but the embedding matrix, which
    the forward gathers rows from and so stays in RAM (with a tied head, under both names)."""
    gathered = find_parts(model).embedding.weight
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p is not gathered}


def compute_dtype(job: JobConfig) -> torch.dtype:
    """The dtype the executor computes, streams and lands gradients in."""
    return torch.bfloat16 if job.runtime.dtype == "bf16" else torch.float32


def starts_from_weights(job: JobConfig, source: ModelSource) -> bool:
    return job.model.init == "auto" and bool(source.weight_files)


def check_host_fits(job: JobConfig, spec: ModelSpec) -> None:
    """Refuse, before allocating anything, a model whose host layout (CostModel's `host_breakdown`, from the
    spec `built_spec` checked against the meta-device model) exceeds the memory this machine has available
    now, instead of dying in the middle of an allocation."""
    available = hardware_module.available_host_memory_bytes()
    if available is None:
        return
    cost = cost_model(job, spec, HardwareSpec.load("emulated"))  # host bytes: the job's, on any machine
    check_host_memory(cost, available, "this machine's available memory")


# =====================================================================================================
# device and executor
# =====================================================================================================
def pick_device_kind(requested: str) -> str:
    """`cuda` or `cpu` (the emulated device) for --device auto|cpu|cuda."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise LazyTrainError("device cuda but torch.cuda.is_available() is False; use device cpu or auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def build_device(job: JobConfig, kind: str, capacity_bytes: int | None) -> Device:
    """The device the executor streams through: CUDA, or the emulated one with the configured link rates."""
    if kind == "cuda":
        return CudaDevice(capacity_bytes=capacity_bytes, nvme_dir=job.runtime.nvme_dir)
    return EmulatedDevice(capacity_bytes=capacity_bytes, h2d_gbps=job.runtime.h2d_gbps, d2h_gbps=job.runtime.d2h_gbps,
                          nvme_read_gbps=job.runtime.nvme_read_gbps, nvme_write_gbps=job.runtime.nvme_write_gbps,
                          nvme_dir=job.runtime.nvme_dir)


def build_executor(model: PreTrainedModel, plan: Plan, cost: CostModel, device: Device, job: JobConfig) -> Executor:
    """The layer-streaming executor that runs the plan on the device; the optimizer steps after it (serial)."""
    dtype = compute_dtype(job)
    # cost: the arena reserves the cost model's working sets, so the plan's predicted peak is what is counted
    return Executor(model, plan, device, compute_dtype=dtype, cost=cost)


def fit_device_cap(job: JobConfig, plan: Plan, executor: Executor, device: Device) -> None:
    """Check the plan's device peak (the executor's own replay of its allocations) against the cap, before any
    step. A user's --gpu-mem-cap is a hard limit; the default cap is ours, so a plan that does not fit it (a
    rule, a loaded plan) gets an arena of its own peak instead, with a note."""
    need = executor.predicted_peak_bytes(job.data.per_device_train_batch_size, job.data.cutoff_len,
                                         masked=job.data.masked)
    if need <= device.capacity_bytes:
        return
    if job.plan.gpu_mem_cap_bytes is not None:
        raise LazyTrainError(f"plan {plan.placement_map()} needs {format_bytes(need)} of device memory but "
                             f"gpu_mem_cap_bytes is {format_bytes(device.capacity_bytes)}; raise gpu_mem_cap_bytes, "
                             "lower per_device_train_batch_size / cutoff_len, or plan with planner milp")
    say(f"note     plan {plan.placement_map()} peaks at {format_bytes(need)}, above the default cap "
        f"{format_bytes(device.capacity_bytes)}; the device gets {format_bytes(need)}")
    device.capacity_bytes = need
