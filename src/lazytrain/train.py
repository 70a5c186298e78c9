"""`lazytrain train`: train a causal LM with layer streaming under a boundary plan, end to end.

With no arguments it trains a small Llama-style model (12.8 M parameters, random init, seeded) on the
standard library's docstrings (`lazytrain.data`, no downloads) with a byte-level tokenizer, on an
emulated device whose memory cap and activation budgets force a mix of tiers (gpu, cpu, nvme,
recompute). The plan comes from the MILP (or a saved plan file, or a rule); the executor runs it and
every step logs the measured step time beside the simulator's prediction. On a machine with CUDA the
same plan runs on the GPU.

The file reads top to bottom like nanoGPT's train.py, in ruled sections: config, model, device, plan,
optimizer, evaluation, the run (data, model, plan, device, loop, save), the loop, helpers, command line.
`TrainConfig` is the one configuration path; the CLI fills it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError
from lazytrain.runtime.weights import INITS, ModelSource, built_spec, load_model, meta_model, resolve_model
from lazytrain.spec.model import ModelSpec
from lazytrain.units import format_bytes, parse_bytes

OPTIMIZERS = ("adamw", "hybrid8bit", "8bit")
BETAS = (0.9, 0.95)  # Adam betas of every --optimizer (the usual choice for language models)
COST_OPTIMIZER = {"adamw": "fp32", "hybrid8bit": "hybrid", "8bit": "8bit"}  # the CostModel's name for each
OPTIMIZER_MODES = ("serial", "overlap")
DEVICES = ("auto", "cpu", "cuda")
PLANNERS = ("auto", "milp", "megatrain", "keep-all", "recompute-all", "offload-all")
DTYPES = ("bf16", "fp32")

# Built-in model shapes (Llama, GQA, untied head). `small` is the default job; `debug` is for tests.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    # 12.8 M parameters: 8 layers x 1.57 M + 0.2 M embedding/head (byte vocabulary)
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                  num_key_value_heads=2),
    # 0.2 M parameters: a few seconds per hundred steps on one core
    "debug": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
}


# =====================================================================================================
# config
# =====================================================================================================
@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs. Sizes in bytes, rates in GB/s (1e9 bytes/s), times in seconds."""

    model: str = "small"
    """The model: a preset (`small` = 12.8 M params, `debug` = 0.2 M, or a `lazytrain plan` preset such as
    `tiny-llama`), a Hugging Face model directory (config.json + model.safetensors or sharded safetensors
    with their index; a run's `checkpoint/` continues training), a config.json path (its directory's weights
    when it has them, else random init), or a hub id already in the local HF cache (never downloaded). Its
    vocab must hold the tokenizer's 259 ids."""
    init: str = "auto"
    """`auto`: the model's weights (a directory or hub id without weights is refused); presets and a bare
    config.json start from a seeded random init. `random`: random init from the config alone, seeded."""
    corpus: str = "stdlib"
    """Training text: `stdlib` (docstrings of Python's standard library, ~0.8 MB), `zen` (the Zen of Python)
    or a path to a UTF-8 text file."""
    steps: int = 120
    """Optimizer steps to run (>= 1)."""
    batch_size: int = 8
    """Sequences per micro-batch (>= 1)."""
    seq_len: int = 256
    """Tokens (bytes) per sequence (>= 2)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (>= 1); tokens per step = grad_accum * batch_size * seq_len."""
    lr: float = 3e-3
    """Peak learning rate, reached after `warmup_steps`, then cosine-decayed to lr * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warm-up steps (>= 0; capped at steps - 1)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr`, in [0, 1]."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (norm gains and biases get none), >= 0."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip threshold; 0 = no clipping."""
    optimizer: str = "adamw"
    """`adamw` (torch AdamW, fp32 states, fused), `hybrid8bit` (Hybrid8bitAdamW with the paper's 2% of the
    parameters in 8-bit states) or `8bit` (Hybrid8bitAdamW, every tensor of 4096+ elements in 8 bits:
    ~2 instead of 8 bytes of state per parameter). Both Hybrid8bitAdamW modes fuse the clip."""
    optimizer_mode: str = "serial"
    """`serial`: the host optimizer steps after the whole backward (MegaTrain's code). `overlap`: each
    layer's update runs on the optimizer stream as soon as its gradients land, while the device works on
    the layers below (LazyTrain); needs --max-grad-norm 0, since a global clip needs every gradient first."""
    dtype: str = "bf16"
    """Compute / activation precision on the device: `bf16` (fp32 master weights and gradients on the
    host) or `fp32`."""
    device: str = "auto"
    """`auto` (CUDA when available, else the emulated device), `cpu` (emulated device) or `cuda`."""
    plan: str | None = None
    """Path to a saved plan (`lazytrain plan --json`); refused when made for another model or workload.
    None = plan here with `planner`."""
    planner: str = "auto"
    """`auto` (the MILP; the MegaTrain rule only if the MILP module cannot be imported), `milp`, `megatrain`
    (keep every 4th boundary on the device, recompute the rest), `keep-all`, `recompute-all` or `offload-all`."""
    gpu_mem_cap_bytes: int | None = None
    """Device memory cap for the plan and the device arena. None = the budget a loaded `plan` was solved
    under, else the static device bytes plus 5 boundary activations: too small to keep every boundary,
    which forces a mix of tiers."""
    cpu_act_bytes: int | None = None
    """Host bytes for offloaded boundary activations. None = 2 boundary activations (a mix of tiers);
    use a large value (e.g. 1TB) for no limit."""
    nvme_act_bytes: int | None = None
    """NVMe bytes for spilled boundary activations. None = 2 boundary activations; 0 = no NVMe tier."""
    h2d_gbps: float = 1.0
    """Emulated host -> device link rate (CUDA: ignored, the real link is used)."""
    d2h_gbps: float = 1.0
    """Emulated device -> host link rate."""
    nvme_read_gbps: float = 0.5
    """Emulated NVMe read rate."""
    nvme_write_gbps: float = 0.5
    """Emulated NVMe write rate."""
    nvme_dir: str | None = None
    """Directory for `nvme` boundary files; None = a temporary directory removed at the end."""
    eval_batches: int = 2
    """Held-out batches for the eval loss before and after training; 0 = no eval."""
    seed: int = 0
    """Seeds the model init, the batch order and the eval batches."""
    output_dir: str | None = None
    """Where metrics.jsonl, plan.json, summary.json and checkpoint/ go; None = runs/<UTC timestamp>."""
    progress: bool = True
    """Show the tqdm progress bar on stderr (`--no-progress` turns it off; the report lines stay on stdout)."""

    def __post_init__(self) -> None:
        def need(ok: bool, knob: str, value: Any, rule: str) -> None:
            if not ok:
                raise LazyTrainError(f"{knob} {value!r} is invalid: it must be {rule}")

        for knob in ("steps", "batch_size", "grad_accum"):
            v = getattr(self, knob)
            need(isinstance(v, int) and v >= 1, _flag(knob), v, "an integer >= 1")
        need(isinstance(self.seq_len, int) and self.seq_len >= 2, "--seq-len", self.seq_len, "an integer >= 2")
        need(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "--warmup-steps", self.warmup_steps,
             "an integer >= 0")
        need(isinstance(self.eval_batches, int) and self.eval_batches >= 0, "--eval-batches", self.eval_batches,
             "an integer >= 0")
        need(math.isfinite(self.lr) and self.lr > 0, "--lr", self.lr, "a number > 0")
        need(0.0 <= self.min_lr_ratio <= 1.0, "--min-lr-ratio", self.min_lr_ratio, "in [0, 1]")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "--weight-decay", self.weight_decay,
             "a number >= 0")
        need(math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0, "--max-grad-norm", self.max_grad_norm,
             "a number >= 0 (0 = no clipping)")
        need(self.optimizer in OPTIMIZERS, "--optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        need(self.optimizer_mode in OPTIMIZER_MODES, "--optimizer-mode", self.optimizer_mode,
             f"one of {', '.join(OPTIMIZER_MODES)}")
        if self.optimizer_mode == "overlap" and self.max_grad_norm > 0:
            raise LazyTrainError(f"--optimizer-mode overlap steps each layer before the global gradient norm is "
                                 f"known, so it cannot clip at --max-grad-norm {self.max_grad_norm}; pass "
                                 "--max-grad-norm 0 or use --optimizer-mode serial")
        need(self.dtype in DTYPES, "--dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        need(self.device in DEVICES, "--device", self.device, f"one of {', '.join(DEVICES)}")
        need(self.init in INITS, "--init", self.init, f"one of {', '.join(INITS)}")
        need(self.planner in PLANNERS, "--planner", self.planner, f"one of {', '.join(PLANNERS)}")
        for knob in ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps"):
            v = getattr(self, knob)
            need(v > 0, _flag(knob), v, "a rate > 0 in GB/s (inf = unthrottled)")
        for knob in ("gpu_mem_cap_bytes", "cpu_act_bytes", "nvme_act_bytes"):
            v = getattr(self, knob)
            need(v is None or (isinstance(v, int) and v >= 0), _flag(knob), v, "a size >= 0")
        need(self.gpu_mem_cap_bytes != 0, "--gpu-mem-cap", self.gpu_mem_cap_bytes, "> 0")

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.batch_size * self.seq_len


def _flag(knob: str) -> str:
    """The CLI flag of a TrainConfig field, for error messages (`gpu_mem_cap_bytes` -> `--gpu-mem-cap`)."""
    special = {"gpu_mem_cap_bytes": "--gpu-mem-cap", "cpu_act_bytes": "--cpu-act-budget",
               "nvme_act_bytes": "--nvme-act-budget"}
    return special.get(knob, "--" + knob.replace("_", "-"))


# =====================================================================================================
# model
# =====================================================================================================
def model_source(cfg: TrainConfig, vocab_size: int) -> ModelSource:
    """What --model names (runtime/weights.py resolves everything but the built-in presets), checked against
    the tokenizer and the sequence length."""
    from transformers import LlamaConfig

    if cfg.model in MODEL_PRESETS:
        config = LlamaConfig(
            vocab_size=vocab_size, max_position_embeddings=max(1024, cfg.seq_len),
            bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False,
            **MODEL_PRESETS[cfg.model],
        )
        config._name_or_path = f"lazytrain-{cfg.model}"
        return ModelSource(name=cfg.model, kind="preset", config=config)
    source = resolve_model(cfg.model)
    config = getattr(source.config, "text_config", None) or source.config
    if config.vocab_size < vocab_size:
        raise LazyTrainError(
            f"--model {cfg.model}: vocab_size {config.vocab_size} is smaller than the byte tokenizer's "
            f"{vocab_size} ids; raise vocab_size in its config.json"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise LazyTrainError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {limit}; "
                             "lower --seq-len")
    return source


def build_model(cfg: TrainConfig, source: ModelSource) -> Any:
    """The fp32 host causal LM: built on the meta device first, its parameter count checked against the
    ModelSpec and the host memory (admission), then its weights loaded tensor by tensor (or a seeded random
    init: presets, a bare config.json, --init random)."""
    meta = meta_model(source.config)
    check_host_fits(cfg, built_spec(source.config, meta))
    return load_model(source, init=cfg.init, seed=cfg.seed, model=meta)


def check_host_fits(cfg: TrainConfig, spec: ModelSpec) -> None:
    """Refuse, before allocating anything, a model whose host layout (CostModel's `executor_layout`, from the
    spec `built_spec` checked against the meta-device model) exceeds the memory this machine has available
    now, instead of dying in the middle of an allocation."""
    from lazytrain.plan.admission import check_host_memory
    from lazytrain.spec.cost import CostModel
    from lazytrain.spec.hardware import HardwareSpec, available_host_memory_bytes
    from lazytrain.spec.workload import Workload

    available = available_host_memory_bytes()
    if available is None:
        return
    workload = Workload(batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype)
    cost = CostModel(spec, HardwareSpec.load("emulated"), workload,
                     COST_OPTIMIZER[cfg.optimizer], executor_layout=True)
    advice = "use a smaller --model or a machine with more memory"
    if cfg.optimizer != "8bit":
        advice = "use --optimizer 8bit (2 instead of 8 bytes of state per parameter), a smaller --model or more memory"
    check_host_memory(cost, available, "this machine's available memory", advice)


# =====================================================================================================
# device
# =====================================================================================================
def pick_device_kind(requested: str) -> str:
    """`cuda` or `cpu` (the emulated device) for --device auto|cpu|cuda."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise LazyTrainError("--device cuda but torch.cuda.is_available() is False; use --device cpu or auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def build_hardware(cfg: TrainConfig, kind: str) -> Any:
    """The machine the plan is made for: the emulated preset with this CPU's host rates (`profile`) and the
    configured link rates; on CUDA the closest preset by GPU name, with the GPU's memory."""
    from lazytrain.spec.hardware import HardwareSpec

    if kind == "cuda":
        import torch

        name = torch.cuda.get_device_name().lower()
        preset = next((p for p in ("h800", "h200", "h100", "3090") if p in name), "h100")
        preset = "rtx3090" if preset == "3090" else preset
        return HardwareSpec.load(preset, gpu_mem_bytes=torch.cuda.get_device_properties(0).total_memory)
    return HardwareSpec.profile("emulated", seconds=0.1).with_overrides(
        h2d_gbps=cfg.h2d_gbps, d2h_gbps=cfg.d2h_gbps, nvme_read_gbps=cfg.nvme_read_gbps,
        nvme_write_gbps=cfg.nvme_write_gbps,
    )


def build_device(cfg: TrainConfig, kind: str, capacity_bytes: int | None, throttled: bool = True) -> Any:
    """The device the executor streams through: CUDA, or the emulated one with the configured link rates."""
    from lazytrain.runtime.device import CudaDevice, EmulatedDevice

    if kind == "cuda":
        return CudaDevice(capacity_bytes=capacity_bytes, nvme_dir=cfg.nvme_dir)
    if not throttled:
        return EmulatedDevice(capacity_bytes=capacity_bytes, nvme_dir=cfg.nvme_dir)
    return EmulatedDevice(capacity_bytes=capacity_bytes, h2d_gbps=cfg.h2d_gbps, d2h_gbps=cfg.d2h_gbps,
                          nvme_read_gbps=cfg.nvme_read_gbps, nvme_write_gbps=cfg.nvme_write_gbps,
                          nvme_dir=cfg.nvme_dir)


# =====================================================================================================
# plan
# =====================================================================================================
@dataclass
class Planned:
    """The plan, the cost model it was judged on, how it was made, and the simulator's step time."""

    plan: Any
    cost: Any
    how: str
    sim: Any  # the simulator's SimResult for one forward_backward + optimizer step in the run's optimizer mode
    budgets: dict[str, int] = field(default_factory=dict)
    serial_step_s: float = 0.0  # the simulated step with the serial optimizer (for micro-batches without it)

    def predicted_step_s(self, grad_accum: int) -> float | None:
        """Seconds of one optimizer step: grad_accum - 1 streamed micro-batches without the optimizer, then
        one with it (serial: after the backward; overlap: hidden under it as far as it goes)."""
        if self.sim is None:
            return None
        return (grad_accum - 1) * (self.serial_step_s - self.cost.total_optimizer_s) + self.sim.step_s


def make_plan(cfg: TrainConfig, model: Any, kind: str, probe_batch: tuple[Any, Any]) -> Planned:
    """Cost model measured on this machine, budgets from the config, then the plan (file, MILP or rule)."""
    from lazytrain.plan.plan import Plan, spec_of
    from lazytrain.spec.workload import Workload

    spec = spec_of(model)
    workload = Workload(batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype)
    cost = calibrated_cost(cfg, model, kind, workload, probe_batch)
    act = max(cost.boundary_bytes)
    budgets = {
        "gpu_mem_cap_bytes": cfg.gpu_mem_cap_bytes or cost.static_device_bytes() + 5 * act,
        "cpu_act_bytes": 2 * act if cfg.cpu_act_bytes is None else cfg.cpu_act_bytes,
        "nvme_act_bytes": 2 * act if cfg.nvme_act_bytes is None else cfg.nvme_act_bytes,
    }
    if cfg.plan is not None:
        plan = Plan.load(cfg.plan, spec, workload)
        how = f"loaded from {cfg.plan} ({plan.report.planner})"
        for knob, flag_value in (("gpu_mem_cap_bytes", cfg.gpu_mem_cap_bytes), ("cpu_act_bytes", cfg.cpu_act_bytes),
                                 ("nvme_act_bytes", cfg.nvme_act_bytes)):
            if flag_value is None and plan.budgets_bytes.get(knob) is not None:
                budgets[knob] = plan.budgets_bytes[knob]  # the budgets the plan was solved under
    else:
        plan, how = _solve(cfg.planner, cost, spec, workload, budgets)
    sim = _simulate(plan, cost, cfg.optimizer_mode)
    plan = plan.with_prediction(sim.to_prediction())
    serial_s = sim.step_s if cfg.optimizer_mode == "serial" else _simulate(plan, cost, "serial").step_s
    return Planned(plan=plan, cost=cost, how=how, sim=sim, budgets=budgets, serial_step_s=serial_s)


def calibrated_cost(cfg: TrainConfig, model: Any, kind: str, workload: Any, probe_batch: tuple[Any, Any]) -> Any:
    """A CostModel whose compute and optimizer seconds are measured on the device the run uses.

    Four steps of an all-`gpu` plan on an uncapped, unthrottled device of the same kind time every layer's
    forward and backward and the loss head exactly as the executor runs them (the first step warms up);
    five steps of a throwaway optimizer of the run's kind time the host update (the parameters are restored
    afterwards); `lazytrain.runtime.calibrate` turns them into the CostModel. On CUDA the executor's
    per-layer timers see asynchronous launches, so there the FLOP estimate is scaled by the measured step
    time instead. Link rates are the configured (emulated) ones.
    """
    import torch

    from lazytrain.plan.plan import Plan, spec_of
    from lazytrain.runtime.calibrate import calibrate
    from lazytrain.runtime.executor import Executor
    from lazytrain.spec.cost import CostModel

    hardware = build_hardware(cfg, kind)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    keep_all = Plan.from_tiers(model, ["gpu"] * (model.config.num_hidden_layers + 1))
    probe_device = build_device(cfg, kind, None, throttled=False)
    executor = Executor(model, keep_all, probe_device, compute_dtype=dtype)
    steps = []
    for _ in range(4):  # the first step warms up; the calibration takes medians of the next three
        executor.forward_backward(*probe_batch)
        steps.append(executor.last_step)
    probe_device.close()
    constant_bytes = executor.memory_sizes(cfg.batch_size, cfg.seq_len).constant_bytes  # + eager masks

    snapshot = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(cfg, model)
    samples = []
    for _ in range(5):  # the first steps allocate and first-touch the states: the median of the later four
        t0 = time.perf_counter()
        optimizer_step(cfg, optimizer, model, zero_grad=False)
        samples.append(time.perf_counter() - t0)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), snapshot, strict=True):
            p.copy_(saved)
    del optimizer, snapshot
    model.zero_grad(set_to_none=True)

    cost = CostModel(spec_of(model), hardware, workload, COST_OPTIMIZER[cfg.optimizer], executor_layout=True
                     ).with_device_constants(constant_bytes)
    # one calibration path (runtime/calibrate.py): medians, quantized, so the same run plans the same way
    return calibrate(cost, steps[1:], optimizer_s=statistics.median(samples[1:]), scale_flops=kind == "cuda")


def _solve(planner: str, cost: Any, spec: Any, workload: Any, budgets: dict[str, int]) -> tuple[Any, str]:
    """MILP under the budgets, or a rule; `auto` falls back to the MegaTrain rule when the MILP is unavailable."""
    if planner in ("auto", "milp"):
        try:
            from lazytrain.plan.budgets import Budgets
            from lazytrain.plan.milp import solve_milp
        except ImportError as err:
            if planner == "milp":
                raise LazyTrainError(f"--planner milp: the MILP planner is not available ({err})") from None
            print(f"note: MILP planner unavailable ({err}); using the MegaTrain rule", file=sys.stderr)
        else:
            plan = solve_milp(cost, Budgets(**budgets))
            r = plan.report
            gap = f", gap {r.gap:.2%}" if r.gap is not None else ""
            return plan, f"MILP ({r.solver}, {r.status}{gap}, {r.seconds:.2f} s)"
        planner = "megatrain"
    from lazytrain.plan.rules import make_rule_plan

    if planner == "megatrain":
        return make_rule_plan("megatrain", spec, interval=4, workload=workload), "MegaTrain rule (every 4th boundary)"
    return make_rule_plan(planner, spec, workload=workload), f"{planner} rule"


def _simulate(plan: Any, cost: Any, optimizer_mode: str) -> Any:
    """The simulator's replay of one step, the optimizer run as this loop runs it."""
    from lazytrain.plan.sim import simulate

    return simulate(plan, cost, optimizer_mode=optimizer_mode)


# =====================================================================================================
# optimizer
# =====================================================================================================
def build_optimizer(cfg: TrainConfig, model: Any) -> Any:
    """Host optimizer over the fp32 master weights; one param group per layer (decay and no-decay split)."""
    import torch

    from lazytrain.runtime.hf import find_parts

    parts = find_parts(model)
    owners: list[tuple[str, Any]] = [("embedding", parts.embedding)]
    owners += [(f"layer{j}", layer) for j, layer in enumerate(parts.layers)]
    owners += [("head", torch.nn.ModuleList([parts.norm, parts.lm_head]))]
    groups, seen = [], set()
    for name, module in owners:
        decay, no_decay = [], []
        for p in module.parameters():
            if id(p) in seen or not p.requires_grad:  # tied LM head: the embedding group owns it
                continue
            seen.add(id(p))
            (decay if p.dim() >= 2 else no_decay).append(p)
        groups += [{"params": decay, "weight_decay": cfg.weight_decay, "name": name},
                   {"params": no_decay, "weight_decay": 0.0, "name": name}]
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer != "adamw":
        return hybrid8bit_optimizer(cfg, groups, max_grad_norm=cfg.max_grad_norm or None)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=BETAS, fused=True)


def hybrid8bit_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]], max_grad_norm: float | None) -> Any:
    """Hybrid8bitAdamW with the 8-bit share of `--optimizer`: the paper's slice or every large tensor."""
    from lazytrain.optim import Hybrid8bitAdamW
    from lazytrain.spec.cost import HYBRID_8BIT_FRACTION

    fraction = HYBRID_8BIT_FRACTION if cfg.optimizer == "hybrid8bit" else 1.0
    return Hybrid8bitAdamW(groups, lr=cfg.lr, betas=BETAS, max_grad_norm=max_grad_norm,
                           eightbit_fraction=fraction)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to lr * min_lr_ratio at the last step (step is 0-based)."""
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    if step < warmup:
        return cfg.lr * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, cfg.steps - 1 - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_step(cfg: TrainConfig, optimizer: Any, model: Any, zero_grad: bool = True,
                   grad_norm: float | None = None) -> float:
    """Clip and step on the host; returns the global gradient norm before clipping.

    `grad_norm`: the norm the executor already took as gradients landed (`last_step.grad_norm`);
    Hybrid8bitAdamW then fuses the clip scale into its update with no extra pass over the gradients.
    """
    import torch

    from lazytrain.optim import global_grad_norm

    if cfg.optimizer != "adamw":
        if grad_norm is None:
            grad_norm = global_grad_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step(grad_norm=grad_norm)
    elif cfg.max_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True))
        optimizer.step()
    else:
        grad_norm = global_grad_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


class OverlapStepper:
    """Overlap mode: the executor calls `hook(group_index, params)` on its optimizer stream as soon as a
    group's (a layer's) gradients are all in `.grad`; the hook updates that group and drops its gradients.

    adamw: one fused AdamW per executor group (elementwise, so the same update as one AdamW over all);
    hybrid8bit, 8bit: one Hybrid8bitAdamW whose `step_group` updates the param groups of that executor group.
    No clipping (TrainConfig refuses --max-grad-norm > 0 in this mode).
    """

    def __init__(self, cfg: TrainConfig, executor: Any) -> None:
        import torch

        self.cfg = cfg
        self.groups: list[list[dict[str, Any]]] = []
        for params in executor.param_groups():  # [embedding (untied)], layer 0..L-1, head
            decay = [p for p in params if p.dim() >= 2]
            no_decay = [p for p in params if p.dim() < 2]
            self.groups.append([g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}) if g["params"]])
        if cfg.optimizer != "adamw":
            flat = [g for groups in self.groups for g in groups]
            self.optimizers = [hybrid8bit_optimizer(cfg, flat, max_grad_norm=None)]
            first = [0]
            for groups in self.groups:
                first.append(first[-1] + len(groups))
            self.indices = [range(first[i], first[i + 1]) for i in range(len(self.groups))]
        else:
            self.optimizers = [torch.optim.AdamW(groups, lr=cfg.lr, betas=BETAS, fused=True) for groups in self.groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every param group of every optimizer (the loop sets their learning rate)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def begin_step(self) -> None:
        if self.cfg.optimizer != "adamw":
            self.optimizers[0].begin_step(grad_norm=0.0)  # no clipping: scale 1 for every group

    def hook(self, group_index: int, params: list[Any]) -> None:
        """Runs on the executor's optimizer stream, concurrently with the device's compute."""
        if self.cfg.optimizer != "adamw":
            for k in self.indices[group_index]:
                self.optimizers[0].step_group(k, 1.0)
        else:
            self.optimizers[group_index].step()
        for p in params:
            p.grad = None


# =====================================================================================================
# evaluation
# =====================================================================================================
def evaluate(model: Any, batches: list, dtype: str) -> float:
    """Mean held-out loss with the host model (the plain `transformers` forward, no streaming)."""
    import torch

    if not batches:
        return math.nan
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        for input_ids, labels in batches:
            total += float(model(input_ids=input_ids, labels=labels).loss)
    return total / len(batches)


# =====================================================================================================
# the run
# =====================================================================================================
@dataclass
class TrainResult:
    """What a run leaves behind, for callers in code (tests, notebooks)."""

    model: Any
    plan: Any
    output_dir: Path
    losses: list[float]
    summary: dict[str, Any]


def prepare_output_dir(cfg: TrainConfig) -> Path:
    """Create and probe the output directory now, so an unwritable one fails before any training."""
    out = Path(cfg.output_dir) if cfg.output_dir else Path("runs") / datetime.now(UTC).strftime(
        "%Y%m%d-%H%M%S")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise LazyTrainError(f"--output-dir {out} is not writable ({err.strerror}); pass a writable --output-dir"
                             ) from None
    return out


def train(cfg: TrainConfig) -> TrainResult:
    """Build everything from `cfg`, train for `cfg.steps` steps, save metrics and a checkpoint."""
    import torch

    from lazytrain.data import ByteTokenizer, TokenData

    t_start = time.perf_counter()
    out = prepare_output_dir(cfg)
    if cfg.nvme_dir is not None:  # like the output dir: refused before anything is built
        from lazytrain.runtime.device import check_nvme_dir

        check_nvme_dir(Path(cfg.nvme_dir))
    torch.manual_seed(cfg.seed)

    # ---- data -------------------------------------------------------------------------------------
    tokenizer = ByteTokenizer()
    data = TokenData.from_corpus(cfg.corpus, tokenizer)
    data.check_fits(cfg.seq_len, "train")
    eval_set = []
    if cfg.eval_batches and len(data.val) >= cfg.seq_len:
        eval_set = data.fixed_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
    probe_batch = data.fixed_batches(1, cfg.batch_size, cfg.seq_len, seed=cfg.seed + 2, split="train")[0]

    # ---- model ------------------------------------------------------------------------------------
    source = model_source(cfg, tokenizer.vocab_size)
    model = build_model(cfg, source)
    num_params = sum(p.numel() for p in model.parameters())
    loaded = cfg.init == "auto" and source.weight_files
    init = f"weights from {source.directory}" if loaded else f"random init, seed {cfg.seed}"
    say(f"model    {model.config._name_or_path or cfg.model}: {num_params / 1e6:.1f} M params, "
        f"{model.config.num_hidden_layers} layers, {init}; corpus {cfg.corpus}: {len(data.train):,} train / "
        f"{len(data.val):,} held-out tokens (bytes)")

    # ---- plan -------------------------------------------------------------------------------------
    kind = pick_device_kind(cfg.device)
    planned = make_plan(cfg, model, kind, probe_batch)
    plan = planned.plan
    say(f"budgets  gpu cap {format_bytes(planned.budgets['gpu_mem_cap_bytes'])}, cpu act "
        f"{format_bytes(planned.budgets['cpu_act_bytes'])}, nvme act "
        f"{format_bytes(planned.budgets['nvme_act_bytes'])}; one boundary = "
        f"{format_bytes(max(planned.cost.boundary_bytes))}")
    say(f"plan     {plan.placement_map()}   {_counts(plan)}   ({planned.how})")
    predicted = planned.predicted_step_s(cfg.grad_accum)
    if predicted is not None:
        say(f"predict  {predicted:.3f} s/step (simulator: {planned.sim.summary()})")
    plan.save(out / "plan.json")
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")

    # ---- device, executor, optimizer --------------------------------------------------------------
    device = build_device(cfg, kind, planned.budgets["gpu_mem_cap_bytes"])
    try:
        executor = build_executor(model, planned, device, cfg)
        fit_device_cap(cfg, plan, executor, device)
        say(f"device   {device!r}")
        if cfg.optimizer_mode == "overlap":  # per-layer updates from the executor's optimizer stream
            optimizer = OverlapStepper(cfg, executor)
            executor.optimizer_hook = optimizer.hook
        else:
            optimizer = build_optimizer(cfg, model)
        eval_before = evaluate(model, eval_set, cfg.dtype)
        if eval_set:
            say(f"eval     held-out loss before training: {eval_before:.4f}")
        losses, step_times = train_loop(cfg, data, executor, optimizer, model, out, predicted)
    finally:
        device.close()  # stop the link threads

    # ---- save -------------------------------------------------------------------------------------
    eval_after = evaluate(model, eval_set, cfg.dtype)
    save_checkpoint(model, out / "checkpoint")
    steady = sorted(step_times[1:] or step_times)  # step 0 pays for warm-up (allocator, packing)
    median_step = steady[len(steady) // 2]
    summary = {
        "model": cfg.model, "num_params": num_params, "steps": cfg.steps, "tokens_per_step": cfg.tokens_per_step,
        "placement_map": plan.placement_map(), "planner": planned.how, "budgets_bytes": planned.budgets,
        "first_loss": losses[0], "last_loss": losses[-1],
        "eval_loss_before": eval_before, "eval_loss_after": eval_after,
        "median_step_s": median_step, "predicted_step_s": predicted,
        "median_tokens_per_s": cfg.tokens_per_step / median_step,
        "total_train_s": sum(step_times),
        "total_run_s": time.perf_counter() - t_start,  # setup (data, calibration, plan) + loop + save
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    say(f"loss     first {losses[0]:.4f} -> last {losses[-1]:.4f}"
        + (f"; held-out {eval_before:.4f} -> {eval_after:.4f}" if eval_set else ""))
    say(f"time     median step {median_step:.3f} s measured"
        + (f" vs {predicted:.3f} s predicted ({median_step / predicted:.2f}x)" if predicted else "")
        + f", {summary['median_tokens_per_s']:,.0f} tokens/s")
    say(f"saved    {out}/ (metrics.jsonl, plan.json, summary.json, checkpoint/) after {summary['total_run_s']:.0f} s "
        f"({summary['total_train_s']:.0f} s in the {cfg.steps} steps)")
    return TrainResult(model=model, plan=plan, output_dir=out, losses=losses, summary=summary)


# =====================================================================================================
# loop
# =====================================================================================================
def train_loop(cfg: TrainConfig, data: Any, executor: Any, optimizer: Any, model: Any, out: Path,
               predicted: float | None) -> tuple[list[float], list[float]]:
    """`cfg.steps` optimizer steps; one metrics.jsonl row per step. Returns (losses, measured step seconds)."""
    from tqdm.auto import tqdm

    batches = data.batches(cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    losses: list[float] = []
    step_times: list[float] = []
    bar = tqdm(range(cfg.steps), desc="train", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    with open(out / "metrics.jsonl", "w") as metrics:
        for step in bar:
            # ---- single training step: fetch, stream forward + backward per micro-batch, optimizer
            lr = lr_at(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            micro_losses, stalls, peak = [], {}, 0
            overlap = cfg.optimizer_mode == "overlap"
            if overlap:
                optimizer.begin_step()
            for micro in range(cfg.grad_accum):
                input_ids, labels = next(batches)  # (B, T) each, on the host
                # streams the layers through the device; returns when every gradient is in p.grad (host
                # sync); gradients accumulate, scaled so the step sees the micro-batch mean. In overlap
                # mode the last micro-batch also runs every layer's update (and waits for them all).
                loss = executor.forward_backward(input_ids, labels, loss_scale=1.0 / cfg.grad_accum,
                                                 run_optimizer_hook=micro == cfg.grad_accum - 1)
                micro_losses.append(float(loss))
                measured = executor.last_step
                for stream, seconds in measured.stall_s.items():
                    stalls[stream] = stalls.get(stream, 0.0) + seconds
                peak = max(peak, measured.peak_device_bytes)
            t_opt = time.perf_counter()
            # serial: after the backward, with the norm the executor took as the gradients landed
            grad_norm = None if overlap else optimizer_step(cfg, optimizer, model, grad_norm=measured.grad_norm)
            step_s = time.perf_counter() - t0
            optimizer_s = step_s - (t_opt - t0)

            loss_value = sum(micro_losses) / len(micro_losses)
            if not math.isfinite(loss_value):
                raise LazyTrainError(f"loss became {loss_value} at step {step}; lower --lr (now {cfg.lr})")
            losses.append(loss_value)
            step_times.append(step_s)
            row = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": cfg.tokens_per_step / step_s, "step_s": step_s, "predicted_step_s": predicted,
                   "optimizer_s": optimizer_s, "stall_s": stalls, "peak_device_bytes": peak}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            bar.set_postfix_str(f"loss {loss_value:.3f}  {row['tokens_per_s']:,.0f} tok/s  step {step_s:.2f} s"
                                + (f" (pred {predicted:.2f})" if predicted is not None else ""))
    bar.close()
    return losses, step_times


# =====================================================================================================
# helpers
# =====================================================================================================
def fit_device_cap(cfg: TrainConfig, plan: Any, executor: Any, device: Any) -> None:
    """Check the plan's device peak (the executor's own replay of its allocations) against the cap, before any
    step. A user's --gpu-mem-cap is a hard limit; the default cap is ours, so a plan that does not fit it (a
    rule, a loaded plan) gets an arena of its own peak instead, with a note."""
    need = executor.predicted_peak_bytes(cfg.batch_size, cfg.seq_len)
    if need <= device.capacity_bytes:
        return
    if cfg.gpu_mem_cap_bytes is not None:
        raise LazyTrainError(f"plan {plan.placement_map()} needs {format_bytes(need)} of device memory but "
                             f"--gpu-mem-cap is {format_bytes(device.capacity_bytes)}; raise --gpu-mem-cap, lower "
                             "--batch-size / --seq-len, or plan with --planner milp")
    say(f"note     plan {plan.placement_map()} peaks at {format_bytes(need)}, above the default cap "
        f"{format_bytes(device.capacity_bytes)}; the device gets {format_bytes(need)}")
    device.capacity_bytes = need


def build_executor(model: Any, planned: Planned, device: Any, cfg: TrainConfig) -> Any:
    """The layer-streaming executor that runs the plan on the device; the optimizer steps after it (serial)."""
    import torch

    from lazytrain.runtime.executor import Executor

    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    # cost: the arena reserves the cost model's working sets, so the plan's predicted peak is what is counted
    return Executor(model, planned.plan, device, compute_dtype=dtype, cost=planned.cost)


def save_checkpoint(model: Any, path: Path) -> None:
    """config.json + model.safetensors that `AutoModelForCausalLM.from_pretrained(path)` loads."""
    # Clone: the executor may have re-pointed parameters at views of its packed per-layer buffers,
    # and safetensors refuses tensors that share storage.
    from transformers.utils import logging as hf_logging

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one shard: its progress bar is noise under ours
    try:
        model.save_pretrained(path, state_dict=state)
    except OSError as err:
        raise LazyTrainError(f"cannot write the checkpoint to {path}: {err.strerror}") from None
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def say(text: str) -> None:
    """A line of the run's report on stdout, flushed so it lands before the progress bar (stderr)."""
    print(text, flush=True)


def _counts(plan: Any) -> str:
    return " ".join(f"{tier} {n}" for tier, n in plan.counts().items() if n)


# =====================================================================================================
# command line
# =====================================================================================================
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    a = parser.add_argument
    a("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    a("--output-dir", default=None, help="where metrics.jsonl, plan.json, summary.json and checkpoint/ go "
      "(default: runs/<UTC timestamp>)")
    a("--batch-size", type=int, default=d.batch_size, help=f"sequences per micro-batch (default {d.batch_size})")
    a("--seq-len", type=int, default=d.seq_len, help=f"tokens (bytes) per sequence (default {d.seq_len})")
    a("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step (default 1)")
    a("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    a("--warmup-steps", type=int, default=d.warmup_steps, help=f"linear warm-up steps (default {d.warmup_steps})")
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio,
      help=f"final learning rate as a fraction of --lr (default {d.min_lr_ratio})")
    a("--weight-decay", type=float, default=d.weight_decay, help=f"AdamW weight decay (default {d.weight_decay})")
    a("--max-grad-norm", type=float, default=d.max_grad_norm, help="gradient clip norm; 0 = off (default 1.0)")
    a("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="host optimizer (default adamw)")
    a("--optimizer-mode", choices=OPTIMIZER_MODES, default=d.optimizer_mode,
      help="serial: step after the backward (default); overlap: each layer as its gradients land "
      "(needs --max-grad-norm 0)")
    a("--dtype", choices=DTYPES, default=d.dtype, help="device compute precision (default bf16)")
    a("--device", choices=DEVICES, default=d.device,
      help="auto: CUDA when available, else the emulated device (cpu)")
    a("--model", default=d.model, help=f"preset ({', '.join(MODEL_PRESETS)}, or a plan preset), HF model directory, "
      "config.json path or cached hub id (default small)")
    a("--init", choices=INITS, default=d.init, help="auto: the model's weights (presets: random); random: from the "
      "config alone (default auto)")
    a("--corpus", default=d.corpus, help="stdlib (default), zen, or a UTF-8 text file")
    a("--plan", default=None, help="a saved plan file (lazytrain plan --json) to run instead of planning here")
    a("--planner", choices=PLANNERS, default=d.planner, help="how to plan when --plan is not given (default auto)")
    a("--gpu-mem-cap", default=None, help="device memory cap, e.g. 64MiB (default: static bytes + 5 boundaries)")
    a("--cpu-act-budget", default=None, help="host bytes for offloaded boundaries (default: 2 boundaries)")
    a("--nvme-act-budget", default=None, help="NVMe bytes for spilled boundaries (default: 2 boundaries; 0 = off)")
    for link, default in (("h2d", d.h2d_gbps), ("d2h", d.d2h_gbps), ("nvme-read", d.nvme_read_gbps),
                          ("nvme-write", d.nvme_write_gbps)):
        a(f"--{link}-gbps", type=float, default=default, help=f"emulated {link} rate, GB/s (default {default})")
    a("--nvme-dir", default=None, help="directory for nvme boundary files (default: a temporary directory)")
    a("--eval-batches", type=int, default=d.eval_batches, help="held-out batches for the eval loss; 0 = off")
    a("--seed", type=int, default=d.seed, help="seed for init, batches and eval (default 0)")
    a("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    def size(text: str | None, flag: str) -> int | None:
        return None if text is None else parse_bytes(text, what=flag)

    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(
        gpu_mem_cap_bytes=size(args.gpu_mem_cap, "--gpu-mem-cap"),
        cpu_act_bytes=size(args.cpu_act_budget, "--cpu-act-budget"),
        nvme_act_bytes=size(args.nvme_act_budget, "--nvme-act-budget"),
        progress=not args.no_progress,
    )
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    train(config_from_args(args))
    return 0
