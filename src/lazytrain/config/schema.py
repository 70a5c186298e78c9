"""The schema of `lazytrain plan` and `lazytrain train`: one JobConfig of eight sections.

Eight sections of kw-only dataclasses (model, data, plan, runtime, optim, checkpoint, metrics, parallel). Each
field is written once, here: its type (the value's check and conversion), its default (shared by both commands),
and the docstring below it (the `--help` text and the table in docs/config.md, read from this file by
config/docs.py). Key names follow the HF Trainer and LLaMA-Factory where one exists (`learning_rate`,
`per_device_train_batch_size`, `cutoff_len`, ...). Only the schema lives here: reading YAML and key=value words
is config/load.py, the conversion of values config/values.py, the flags config/arguments.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from lazytrain.config.values import convert as _convert
from lazytrain.config.values import need as _need
from lazytrain.costmodel.model import MAX_DIM
from lazytrain.errors import LazyTrainError

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "bf16", "fp32", "fp16"]
Planner = Literal["auto", "milp", "megatrain", "keep-all", "recompute-all", "offload-all"]
RULES = ("megatrain", "keep-all", "recompute-all", "offload-all")
Optimizer = Literal["adamw", "hybrid8bit", "8bit"]
COST_OPTIMIZER = {"adamw": "fp32", "hybrid8bit": "hybrid", "8bit": "8bit"}  # the CostModel's name for each
DatasetFormat = Literal["auto", "alpaca", "sharegpt", "messages", "prompt_completion", "text"]

# Built-in model shapes of `model` (Llama, GQA, untied head, the byte tokenizer's vocabulary): `small` is the
# default job, `debug` is for tests. Here, not in the trainer, so that `lazytrain plan` reads them without torch.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    # 12.8 M parameters: 8 layers x 1.57 M + 0.2 M embedding/head (byte vocabulary)
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                  num_key_value_heads=2),
    # 0.2 M parameters: a few seconds per hundred steps on one core
    "debug": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
}


# =====================================================================================================
# sections
# =====================================================================================================
@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The model to plan for or train."""

    model: str = "small"
    """A built-in shape (`small` = 12.8 M params, the default job; `debug` = 0.2 M), a planner preset
    (`qwen2.5-7b`, `qwen3.6-27b`, ... see `lazytrain/costmodel/presets`), or a path to a `config.json` / HF model
    directory (its safetensors weights, when present, are where training starts)."""
    init: Literal["auto", "random"] = "auto"
    """`auto`: the model's weights (a directory or hub id without weights is refused; built-in shapes, planner
    presets and a bare config.json start from a seeded random init); `random`: random from the config alone."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(bool(self.model.strip()), "model", self.model, "a preset name or a path")


CORPORA = ("stdlib", "zen")  # built-in byte-level corpora (data/corpus.py); anything else .txt is a text file


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """What the model is trained on, and the shape of every batch."""

    dataset: str = "math"
    """Training data: `math` (the embedded MetaMathQA-like SFT set; with a built-in model shape, the default
    job's model directory and BPE tokenizer), a json/jsonl/parquet/arrow SFT file (see `dataset_format`), or
    byte-level text for the built-in shapes: `stdlib` (docstrings of Python's standard library), `zen` (the Zen
    of Python) or a .txt file."""
    dataset_format: DatasetFormat = "auto"
    """How rows of an SFT file are read: auto (detected from the columns), alpaca, sharegpt, messages,
    prompt_completion or text."""
    template: str | None = None
    """Chat template name for a tokenizer that has none (None = the tokenizer's own)."""
    train_on_prompt: bool = False
    """Compute the loss on prompt tokens too (default: only on the assistant's response tokens)."""
    cutoff_len: int = 256
    """Tokens per sequence (>= 2): examples are truncated to it and every batch row is exactly this long,
    since the plan and the device arena are sized for it."""
    packing: bool = True
    """Pack several short examples into one row (positions restart per example, no attention across them); false
    = one example per row, right-padded with an attention mask."""
    val_size: float | None = None
    """Held-out fraction of the dataset in (0, 1); None = the dataset's own split."""
    eval_dataset: str | None = None
    """A separate evaluation file (None = split off the training data)."""
    per_device_train_batch_size: int | Literal["auto"] = 8
    """Sequences per micro-batch (>= 1), or `auto`: the largest batch the planner admits under the caps (needs
    `gpu_mem_cap_bytes` on the emulated device, whose default cap grows with the batch)."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(2 <= self.cutoff_len <= MAX_DIM, "cutoff_len", self.cutoff_len, f"an integer in 2..{MAX_DIM}")
        _need(self.val_size is None or 0 < self.val_size < 1, "val_size", self.val_size, "in (0, 1)")
        batch = self.per_device_train_batch_size
        _need(batch == "auto" or 1 <= batch <= MAX_DIM, "per_device_train_batch_size", batch,
              f"an integer in 1..{MAX_DIM} or auto")

    @property
    def masked(self) -> bool:
        """Whether the batches carry an attention mask or position ids (the CostModel's masked workload): an SFT
        dataset's do (right padding, or packing's positions), a byte-level corpus's (its rows full) do not."""
        return self.dataset not in CORPORA and not self.dataset.endswith(".txt")


@dataclass(kw_only=True, frozen=True)
class PlanConfig:
    """How boundary activations are placed: the planner and the memory it may use."""

    planner: Planner = "auto"
    """`auto` or `milp` (the MILP), or a rule: `megatrain` (every `interval`-th boundary kept, the rest
    recomputed), `keep-all`, `recompute-all`, `offload-all`."""
    plan_file: str | None = None
    """A saved plan (`lazytrain plan --json`) to run instead of planning; refused when made for another model
    or workload."""
    interval: int = 4
    """MegaTrain rule: keep every K-th boundary on the device (>= 1)."""
    solver: Literal["highs", "scip"] = "highs"
    """MILP solver: highs, or scip (needs PySCIPOpt)."""
    max_segment: int = 8
    """Longest recompute segment the MILP considers, in layers (>= 1)."""
    time_limit_s: float = 60.0
    """Wall-time bound on the whole planning (model and cost building included), seconds; the best plan found
    by then is used, with its gap."""
    mip_rel_gap: float = 0.0
    """Relative MIP gap at which the solver stops, in [0, 1); 0 = optimal."""
    gpu_mem_cap_bytes: int | None = None
    """Peak device memory cap, e.g. 70GB. None = the device's memory; on the emulated device the static device
    bytes plus 5 boundary activations (too small to keep every boundary: the plan mixes tiers)."""
    cpu_act_bytes: int | None = None
    """Host bytes for offloaded boundary activations. None = the host room left after weights, gradients and
    optimizer states; on the emulated device 2 boundary activations."""
    nvme_act_bytes: int | None = None
    """NVMe bytes for spilled boundary activations; 0 = no NVMe tier. None = 0; on the emulated device 2
    boundary activations."""
    cpu_mem_bytes: int | None = None
    """Total host memory the plan may assume, e.g. 2TB. None = the hardware's (or unchecked)."""
    replan: bool = False
    """Re-plan during training when measured times disagree with the cost model."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(self.interval >= 1, "interval", self.interval, "an integer >= 1")
        _need(self.max_segment >= 1, "max_segment", self.max_segment, "an integer >= 1")
        _need(self.time_limit_s > 0, "time_limit_s", self.time_limit_s, "a number of seconds > 0")
        _need(0 <= self.mip_rel_gap < 1, "mip_rel_gap", self.mip_rel_gap, "in [0, 1)")
        _need(self.gpu_mem_cap_bytes != 0, "gpu_mem_cap_bytes", self.gpu_mem_cap_bytes, "> 0")


@dataclass(kw_only=True, frozen=True)
class RuntimeConfig:
    """Where and how the job runs: device, precision, emulated link rates, NVMe directory, seed."""

    device: Device = "auto"
    """`auto` (CUDA when available, else the emulated device), `cpu` (the emulated device) or `cuda`."""
    hardware: str = "auto"
    """The machine the plan is made for: `auto` = the one this job runs on (the CUDA GPU's preset, else the
    emulated device with the `*_gbps` rates below), a preset (h800, rtx3090, h100, h200, emulated) or a
    YAML/JSON hardware file."""
    dtype: Dtype = "auto"
    """Compute / activation precision on the device: bf16 (fp32 master weights and gradients on the host),
    fp32, fp16 (planning only), or auto: bf16, except on the emulated device of a CPU without native bf16
    (no avx512_bf16 / AMX), where fp32 runs several times faster."""
    master_weights: Literal["fp32", "bf16"] = "fp32"
    """The host weights the optimizer updates: fp32 (exact; with bf16 compute 8 bytes/param before optimizer
    states: fp32 weights, their bf16 streamed copy, bf16 gradients) or bf16 (dtype bf16 and an 8-bit or
    hybrid8bit optimizer: the streamed bf16 weights are the masters, updated with stochastic rounding; 4
    bytes/param). Gradient accumulation adds an fp32 gradient sum (4 bytes/param)."""
    h2d_gbps: float = 1.0
    """Emulated host -> device link rate, GB/s (> 0; `inf` = unthrottled). CUDA uses the real link."""
    d2h_gbps: float = 1.0
    """Emulated device -> host link rate, GB/s."""
    nvme_read_gbps: float = 0.5
    """Emulated NVMe read rate, GB/s."""
    nvme_write_gbps: float = 0.5
    """Emulated NVMe write rate, GB/s."""
    nvme_dir: str | None = None
    """Directory for `nvme` boundary files; None = a temporary directory removed at the end."""
    seed: int = 0
    """Seeds the model init, the batch order and the eval batches."""
    progress: bool = True
    """Show the progress bar on stderr (`--no-progress` turns it off; report lines stay on stdout)."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(bool(self.hardware.strip()), "hardware", self.hardware, "auto, a preset name or a file")
        for knob in ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps"):
            _need(getattr(self, knob) > 0, knob, getattr(self, knob), "a rate > 0 in GB/s (inf = unthrottled)")


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """The optimizer, its schedule and the length of the run."""

    optimizer: Optimizer = "adamw"
    """`adamw` (torch AdamW, fp32 states), `hybrid8bit` (Hybrid8bitAdamW: the paper's 2% of the parameters in
    8-bit states) or `8bit` (every tensor of 4096+ elements in 8 bits: ~2 instead of 8 bytes of state per
    parameter). The older names `fp32` and `hybrid` are read as adamw and hybrid8bit."""
    optimizer_mode: Literal["serial", "overlap"] = "overlap"
    """`overlap` (overlapped-exact): once the backward is done (global norm known, clipped), the host updates the
    layer groups in forward order under the next step's forward, each group's weight h2d waiting only for its
    update; parameters bit-identical to `serial`, which steps after the whole backward (MegaTrain's code)."""
    learning_rate: float = 3e-3
    """Peak learning rate (> 0), reached after the warm-up."""
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after the warm-up: cosine (to learning_rate * min_lr_ratio), linear, or constant."""
    warmup_steps: int = 10
    """Linear warm-up steps (>= 0; capped at max_steps - 1)."""
    warmup_ratio: float | None = None
    """Warm-up as a fraction of max_steps, in [0, 1]; when set it replaces warmup_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of learning_rate, in [0, 1]."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (norm gains and biases get none), >= 0."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay, in [0, 1)."""
    adam_epsilon: float = 1e-8
    """Adam's denominator epsilon (> 0)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip threshold (>= 0); 0 = no clipping."""
    max_steps: int = 120
    """Optimizer steps to run (>= 1)."""
    num_train_epochs: float | None = None
    """Passes over the training data (> 0, fractions allowed) of an SFT dataset; when set it decides the number of
    optimizer steps and replaces max_steps. None = max_steps decides."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (>= 1)."""
    max_nonfinite_steps: int = 3
    """A step with a non-finite loss or gradient norm is skipped (no update); this many in a row (>= 1) stop the
    run with one line saying what was non-finite and where it first appeared."""

    def __post_init__(self) -> None:
        _convert(self)
        if self.optimizer in ("fp32", "hybrid"):  # `lazytrain plan`'s names before the schema
            object.__setattr__(self, "optimizer", {"fp32": "adamw", "hybrid": "hybrid8bit"}[self.optimizer])
        _need(math.isfinite(self.learning_rate) and self.learning_rate > 0, "learning_rate", self.learning_rate,
              "a number > 0")
        _need(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        _need(self.warmup_ratio is None or 0 <= self.warmup_ratio <= 1, "warmup_ratio", self.warmup_ratio,
              "in [0, 1]")
        _need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        _need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", self.weight_decay,
              "a number >= 0")
        for knob in ("adam_beta1", "adam_beta2"):
            _need(0 <= getattr(self, knob) < 1, knob, getattr(self, knob), "in [0, 1)")
        _need(0 < self.adam_epsilon < 1, "adam_epsilon", self.adam_epsilon, "in (0, 1)")
        _need(math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm,
              "a number >= 0 (0 = no clipping)")
        _need(self.max_steps >= 1, "max_steps", self.max_steps, "an integer >= 1")
        _need(self.num_train_epochs is None or self.num_train_epochs > 0, "num_train_epochs", self.num_train_epochs,
              "a number > 0")
        _need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", self.gradient_accumulation_steps,
              "an integer >= 1")
        _need(self.max_nonfinite_steps >= 1, "max_nonfinite_steps", self.max_nonfinite_steps, "an integer >= 1")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Where the run writes, how often it saves, and what it resumes from."""

    output_dir: str | None = None
    """Where metrics, the plan, the summary and checkpoints go; None = runs/<UTC timestamp>."""
    overwrite_output_dir: bool = False
    """Write into an existing non-empty output_dir."""
    save_steps: int = 0
    """Save a checkpoint every N optimizer steps (>= 0); 0 = only at the end."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints (>= 1); None = keep all."""
    resume_from_checkpoint: str | None = None
    """A checkpoint directory to continue from, or `auto` (the newest complete one in output_dir)."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(self.save_steps >= 0, "save_steps", self.save_steps, "an integer >= 0")
        _need(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit", self.save_total_limit,
              "an integer >= 1")


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """What the run reports, and how often it evaluates."""

    logging_steps: int = 1
    """Write a metrics row every N optimizer steps (>= 1)."""
    report_to: Literal["none", "tensorboard"] = "none"
    """Also write the scalars to: none, or tensorboard (under output_dir)."""
    eval_steps: int | None = None
    """Evaluate the held-out loss every N steps (>= 1); None = before and after training only."""
    eval_batches: int = 2
    """Held-out batches per evaluation (>= 0); 0 = no evaluation."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(self.logging_steps >= 1, "logging_steps", self.logging_steps, "an integer >= 1")
        _need(self.eval_steps is None or self.eval_steps >= 1, "eval_steps", self.eval_steps, "an integer >= 1")
        _need(self.eval_batches >= 0, "eval_batches", self.eval_batches, "an integer >= 0")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Data parallelism: `torchrun --nproc_per_node N -m lazytrain train ...` runs one executor per rank."""

    world_size: int = 1
    """Ranks training together (>= 1); 1 = as many as the launcher (torchrun) started; another number must equal
    torchrun's WORLD_SIZE. `lazytrain plan` predicts a step of this many ranks (one GPU each)."""
    nodes: int = 1
    """Nodes the ranks run on (>= 1, divides world_size): `lazytrain plan` plans world_size / nodes ranks per
    node; `lazytrain train` takes the layout from torchrun (1 = whatever it started; another number must match)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the default group: auto = nccl on CUDA devices, gloo on the emulated device.
    The run's collectives (all on host tensors: gradients, token counts, objects) use gloo groups beside it."""
    collective_timeout_s: float = 300.0
    """Seconds any collective may wait for the other ranks before the run stops naming the missing rank (> 0)."""

    def __post_init__(self) -> None:
        _convert(self)
        _need(self.world_size >= 1, "world_size", self.world_size, "an integer >= 1")
        _need(self.nodes >= 1 and self.world_size % self.nodes == 0, "nodes", self.nodes,
              f"an integer >= 1 that divides world_size ({self.world_size})")
        _need(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s, "a number > 0")


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "plan": PlanConfig, "runtime": RuntimeConfig, "optim": OptimConfig,
    "checkpoint": CheckpointConfig, "metrics": MetricsConfig, "parallel": ParallelConfig,
}


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """One job of `lazytrain plan` or `lazytrain train`: every section, with one set of defaults."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.runtime.master_weights == "bf16" and self.optim.optimizer == "adamw":
            raise LazyTrainError("master_weights bf16 needs optimizer 8bit or hybrid8bit (their stochastic rounding "
                                 "keeps updates below half a bf16 step; torch's AdamW would round them away)")

    @classmethod
    def build(cls, flat: Mapping[str, Any]) -> JobConfig:
        """From canonical flat keys (`learning_rate`, not `lr`); every section is checked."""
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in flat.items():
            per_section[SECTION_OF[key]][key] = value
        return cls(**{name: SECTIONS[name](**values) for name, values in per_section.items()})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested by section (what `train_config.json` holds; `load.job_config_from_dict` reads it back)."""
        return asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every key at the top level, as in a flat YAML file."""
        return {k: v for section in self.to_dict().values() for k, v in section.items()}

    def changed(self) -> dict[str, Any]:
        """The keys whose value differs from the default (for refusing what a command does not support yet)."""
        default = JobConfig().flat()
        return {k: v for k, v in self.flat().items() if v != default[k]}

    def refuse(self, keys: Iterable[str], command: str) -> None:
        """One-line refusal of the first key in `keys` set away from its default: a set value is never ignored."""
        changed = self.changed()
        for key in keys:
            if key in changed:
                raise LazyTrainError(f"{key} = {changed[key]!r}: not supported by `lazytrain {command}` yet; "
                                     f"remove it (default {JobConfig().flat()[key]!r})")


SECTION_OF: dict[str, str] = {f.name: name for name, section in SECTIONS.items() for f in fields(section)}
KEYS: tuple[str, ...] = tuple(SECTION_OF)
