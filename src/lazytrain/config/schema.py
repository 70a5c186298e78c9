"""The schema of `lazytrain plan` and `lazytrain train`: one JobConfig of nine sections.

Nine sections of kw-only dataclasses (model, finetune, data, plan, runtime, optim, checkpoint, metrics, parallel). Each
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

from lazytrain.config.values import ConfigErrors, Names, check, convert, raise_all
from lazytrain.costmodel.cost import OPTIMIZERS
from lazytrain.costmodel.hardware import EMULATED_LINK_GBPS
from lazytrain.costmodel.model import MAX_DIM, MAX_LAYERS
from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp import DEFAULT_MAX_SEGMENT, DEFAULT_MIP_REL_GAP, DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S
from lazytrain.plan.rules import RULES

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "bf16", "fp32", "fp16"]
Planner = Literal["auto", "milp", *RULES]  # the rules' names are plan/rules.py's
Optimizer = Literal[*OPTIMIZERS]  # the CostModel's names (costmodel/cost.py), one vocabulary
DatasetFormat = Literal["auto", "alpaca", "sharegpt", "messages", "prompt_completion", "text"]

# Bounds of the counts (every count bounded and checked before anything runs). Far beyond any run, and
# low enough that no loop over them (epochs into steps, a schedule's table) can spin or overflow.
MAX_STEPS = 10**9  # optimizer steps (and every count of steps: warm-up, saving, logging, evaluating)
MAX_COUNT = 2**40  # examples, rows, batches, micro-batches
MAX_EPOCHS = 10**6  # passes over the data
MAX_RANKS = 2**20
MAX_TIMEOUT_S = 1e9  # seconds (LLaMA-Factory's examples set ddp_timeout 180000000)


# =====================================================================================================
# sections
# =====================================================================================================
@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The model to plan for or train."""

    model: str = "small"
    """A built-in shape (`small` = 12.8 M params, the default job; `debug` = 0.2 M), a planner preset
    (`qwen2.5-7b`, `qwen3.6-27b`, ... see `lazytrain/costmodel/presets`), a path to a `config.json` / HF model
    directory (its safetensors weights, when present, are where training starts) or a hub id already in the local
    HF cache. A built-in shape runs with the default job's tuned values (config/default_job.yaml); any other
    model with the HF Trainer's defaults."""
    init: Literal["auto", "random"] = "auto"
    """`auto`: the model's weights (a directory or hub id without weights is refused; built-in shapes, planner
    presets and a bare config.json start from a seeded random init); `random`: random from the config alone."""

    def __post_init__(self) -> None:
        check(self, convert(self), (bool(self.model.strip()), "model", "a preset name or a path"))


FinetuningType = Literal["full", "lora", "freeze"]
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target", "use_rslora", "use_dora",
             "pissa_init", "loraplus_lr_ratio", "adapter_name_or_path", "quantization_bit")
FREEZE_KEYS = ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules")


@dataclass(kw_only=True, frozen=True)
class FinetuneConfig:
    """Which parameters train (LLaMA-Factory's keys and meanings): every one, LoRA adapters on a frozen base, or the
    last layers (freeze tuning). Frozen parameters stream like the others but get no gradient, no master weights
    and no optimizer state."""

    finetuning_type: FinetuningType = "full"
    """`full`: every parameter; `lora`: low-rank adapters on the targeted linears of a frozen base (PEFT's LoRA);
    `freeze`: the `freeze_trainable_layers` last layers' `freeze_trainable_modules` train, the rest is frozen."""
    lora_rank: int = 8
    """LoRA: the adapters' rank r (>= 1)."""
    lora_alpha: float | None = None
    """LoRA: the scale alpha, the update being B A x alpha / r (alpha / sqrt(r) with use_rslora); None = 2 x
    lora_rank, as LLaMA-Factory."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input, in [0, 1) (the same masks in every re-forward of a layer)."""
    lora_target: Names = "all"
    """LoRA: the linear modules adapted, by name (`q_proj,v_proj`), or `all`: every linear of the decoder layers
    (not the LM head; in an MoE model not the fused experts)."""
    additional_target: Names | None = None
    """LoRA: modules trained whole beside the adapters (`embed_tokens,lm_head`; PEFT's modules_to_save)."""
    use_rslora: bool = False
    """LoRA: rank-stabilized scaling alpha / sqrt(r)."""
    use_dora: bool = False
    """LoRA: DoRA's magnitude vectors; refused (not implemented)."""
    pissa_init: bool = False
    """LoRA: PiSSA's SVD initialization; refused (not implemented)."""
    loraplus_lr_ratio: float | None = None
    """LoRA: LoRA+'s larger learning rate of B; refused (not implemented)."""
    adapter_name_or_path: str | None = None
    """LoRA: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to continue training."""
    quantization_bit: int | None = None
    """LoRA: 4 = QLoRA, the decoder layers' frozen linears held on the host and streamed as bitsandbytes' NF4
    (block 64, double quantization), dequantized on the device; None = the base in the compute dtype (8, LLM.int8,
    is refused: not implemented)."""
    freeze_trainable_layers: int = 2
    """freeze: the last n decoder layers train (the first -n when negative)."""
    freeze_trainable_modules: Names = "all"
    """freeze: the modules of those layers that train (`mlp,self_attn`), or `all`."""
    freeze_extra_modules: Names | None = None
    """freeze: modules outside the decoder layers that train too (`embed_tokens`, `norm`, `lm_head`)."""

    def __post_init__(self) -> None:
        problems = convert(self)
        check(self, problems,
              (1 <= self.lora_rank <= MAX_DIM, "lora_rank", f"an integer in 1..{MAX_DIM}"),
              (self.lora_alpha is None or 0 < self.lora_alpha < math.inf, "lora_alpha", "a positive number"),
              (0 <= self.lora_dropout < 1, "lora_dropout", "a number in [0, 1)"),
              (bool(self.lora_target.strip()), "lora_target", "all or a comma-separated list of module names"),
              (self.freeze_trainable_layers != 0, "freeze_trainable_layers", "a nonzero integer (the last n, or "
                                                                             "the first -n layers)"))
        for key, on in (("use_dora", self.use_dora), ("pissa_init", self.pissa_init),
                        ("loraplus_lr_ratio", self.loraplus_lr_ratio is not None)):
            if on:
                raise LazyTrainError(f"{key} is not implemented (LoRA trains plain low-rank adapters); remove it")
        if self.quantization_bit not in (None, 4):
            raise LazyTrainError(f"quantization_bit {self.quantization_bit}: only 4 (QLoRA's NF4 base) is "
                                 "implemented; use quantization_bit 4 or remove it")
        if self.quantization_bit is not None and self.finetuning_type != "lora":  # as LLaMA-Factory
            raise LazyTrainError(f"quantization_bit {self.quantization_bit} quantizes the frozen base of LoRA "
                                 f"(QLoRA), not of finetuning_type {self.finetuning_type}: set finetuning_type lora "
                                 "or remove quantization_bit")

    def ignored(self) -> list[str]:
        """The keys set away from their defaults that this finetuning_type does not use (LLaMA-Factory ignores
        them too): noted once, not refused."""
        default = FinetuneConfig()
        unused = {"full": (*LORA_KEYS, *FREEZE_KEYS), "lora": FREEZE_KEYS, "freeze": LORA_KEYS}[self.finetuning_type]
        return [k for k in unused if getattr(self, k) != getattr(default, k)]


CORPORA = ("stdlib", "zen")  # built-in byte-level corpora (data/corpus.py); anything else .txt is a text file
MixStrategy = Literal["concat", "interleave_under", "interleave_over"]


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """What the model is trained on, and the shape of every batch."""

    dataset: Names = "math"
    """Training data, one name or several (`a,b` or a YAML list): `math` (the embedded MetaMathQA-like SFT set;
    with a built-in model shape, the default job's model directory and BPE tokenizer), a json/jsonl/parquet/arrow
    SFT file or `save_to_disk` folder (see `dataset_format`), a name in `dataset_dir`'s dataset_info.json
    (LLaMA-Factory's registry), a dataset id already in the local HF datasets cache, or byte-level text for the
    built-in shapes: `stdlib` (docstrings of Python's standard library), `zen` (the Zen of Python) or a .txt file."""
    dataset_dir: str = "data"
    """The folder whose `dataset_info.json` names datasets (LLaMA-Factory's `file_name`, `formatting` alpaca /
    sharegpt, `columns`, `tags`); file names in it are relative to this folder."""
    dataset_format: DatasetFormat = "auto"
    """How rows of an SFT file are read: auto (detected from the columns), alpaca, sharegpt, messages,
    prompt_completion or text (a dataset_info.json entry's `formatting` wins for its dataset)."""
    template: str | None = None
    """Chat template: None = the tokenizer's own; a LLaMA-Factory name (qwen, qwen3, llama3, mistral, gemma, chatml,
    alpaca, default, empty, ...) = that template of LLaMA-Factory, rendered as it renders it (its default system
    prompt, stop words and EOS), whatever chat template the tokenizer has."""
    train_on_prompt: bool = False
    """Compute the loss on prompt tokens too (default: only on the assistant's response tokens)."""
    cutoff_len: int = 256
    """Tokens per sequence (>= 2): examples are truncated to it and every batch row is exactly this long,
    since the plan and the device arena are sized for it."""
    packing: bool = False
    """Pack several short examples into one row (positions restart per example, no attention across them, as
    LLaMA-Factory's neat_packing); false = one example per row, right-padded with an attention mask. Off by
    default as in LLaMA-Factory's sft (its stage pt turns it on; the default job packs)."""
    max_samples: int | None = None
    """Rows read from each dataset at most (>= 1; the first rows of its file); None = all."""
    mix_strategy: MixStrategy = "concat"
    """Several datasets: `concat` (one after the other, then shuffled), `interleave_under` (rows drawn from each by
    `interleave_probs` until the first runs out) or `interleave_over` (until the last runs out, the others
    repeated): HF datasets' interleave_datasets."""
    interleave_probs: tuple[float, ...] | None = None
    """Sampling weights of the datasets for interleave_* (`0.7,0.3`, one per dataset); None = equal."""
    val_size: int | float | None = None
    """Held-out part of the training data: a fraction in (0, 1) or a count of examples (an integer >= 1); None =
    none (or `eval_dataset`, which excludes it, as the built-in math set's own held-out problems do)."""
    eval_dataset: Names | None = None
    """Evaluation data named as `dataset` names it (None = split off by val_size, else no evaluation)."""
    per_device_train_batch_size: int | Literal["auto"] = 8
    """Sequences per micro-batch (>= 1), or `auto`: the largest batch the planner admits under the caps (needs
    `gpu_mem_cap_bytes` on the emulated device, whose default cap grows with the batch)."""
    per_device_eval_batch_size: int | None = None
    """Held-out sequences per evaluation batch (>= 1; None = per_device_train_batch_size). Each runs through the
    executor in the planned batch shape, so memory does not depend on it."""
    overwrite_cache: bool = False
    """Tokenize again even when the tokenized dataset is in the HF datasets cache."""
    preprocessing_num_workers: int | None = None
    """Processes that tokenize (datasets.map num_proc, >= 1); None = this process alone."""
    preprocessing_batch_size: int = 1000
    """Rows per tokenizer call in datasets.map (>= 1)."""

    def __post_init__(self) -> None:
        problems = convert(self)
        if self.val_size == 0:  # LLaMA-Factory's and the HF examples' default: no held-out part
            object.__setattr__(self, "val_size", None)
        batch, eval_batch = self.per_device_train_batch_size, self.per_device_eval_batch_size
        val = self.val_size
        check(self, problems,
              (bool(self.dataset.strip()), "dataset", "a name, a path or a comma-separated list of them"),
              (2 <= self.cutoff_len <= MAX_DIM, "cutoff_len", f"an integer in 2..{MAX_DIM}"),
              (val is None or (isinstance(val, int) and 1 <= val <= MAX_COUNT)
               or (isinstance(val, float) and 0 < val < 1),
               "val_size", f"a fraction in (0, 1) or a count in 1..{MAX_COUNT}"),
              # held-out data named twice: LLaMA-Factory refuses val_size beside eval_dataset too
              (val is None or (self.eval_dataset is None and self.dataset.strip() != "math"), "val_size",
               "unset when eval_dataset names the held-out data, or with dataset math (its own held-out problems)"),
              (batch == "auto" or 1 <= batch <= MAX_DIM, "per_device_train_batch_size",
               f"an integer in 1..{MAX_DIM} or auto"),
              (eval_batch is None or 1 <= eval_batch <= MAX_DIM, "per_device_eval_batch_size",
               f"an integer in 1..{MAX_DIM}"),
              (self.max_samples is None or 1 <= self.max_samples <= MAX_COUNT, "max_samples",
               f"an integer in 1..{MAX_COUNT}"),
              (self.interleave_probs is None or (all(math.isfinite(p) and p >= 0 for p in self.interleave_probs)
                                                 and sum(self.interleave_probs) > 0),
               "interleave_probs", "weights >= 0, not all 0"),
              (self.preprocessing_num_workers is None or 1 <= self.preprocessing_num_workers <= 1024,
               "preprocessing_num_workers", "an integer in 1..1024"),
              (1 <= self.preprocessing_batch_size <= MAX_COUNT, "preprocessing_batch_size",
               f"an integer in 1..{MAX_COUNT}"))

    @property
    def datasets(self) -> tuple[str, ...]:
        """The names in `dataset` (`a,b` -> ("a", "b"))."""
        return names_in(self.dataset)

    @property
    def masked(self) -> bool:
        """Whether the batches carry an attention mask or position ids (the CostModel's masked workload): an SFT
        dataset's do (right padding, or packing's positions), a byte-level corpus's (its rows full) do not."""
        return self.dataset not in CORPORA and not self.dataset.endswith(".txt")


def names_in(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


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
    solver: Literal["highs", "scip"] = DEFAULT_SOLVER
    """MILP solver: highs, or scip (needs PySCIPOpt)."""
    max_segment: int = DEFAULT_MAX_SEGMENT
    """Longest recompute segment the MILP considers, in layers (>= 1)."""
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    """Wall-time bound on the whole planning (model and cost building included), seconds; the best plan found
    by then is used, with its gap."""
    mip_rel_gap: float = DEFAULT_MIP_REL_GAP
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
        check(self, convert(self),
              (1 <= self.interval <= MAX_LAYERS, "interval", f"an integer in 1..{MAX_LAYERS}"),
              (1 <= self.max_segment <= MAX_LAYERS, "max_segment", f"an integer in 1..{MAX_LAYERS}"),
              (self.time_limit_s > 0, "time_limit_s", "a number of seconds > 0"),
              (0 <= self.mip_rel_gap < 1, "mip_rel_gap", "in [0, 1)"),
              (self.gpu_mem_cap_bytes != 0, "gpu_mem_cap_bytes", "> 0"))


@dataclass(kw_only=True, frozen=True)
class RuntimeConfig:
    """Where and how the job runs: device, precision, emulated link rates, NVMe directory, seeds."""

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
    h2d_gbps: float = EMULATED_LINK_GBPS["h2d_gbps"]  # the emulated preset's rates (costmodel/hardware.py)
    """Emulated host -> device link rate, GB/s (0.001..1e6, or `inf` = unthrottled; every `*_gbps` the same).
    CUDA uses the real link."""
    d2h_gbps: float = EMULATED_LINK_GBPS["d2h_gbps"]
    """Emulated device -> host link rate, GB/s."""
    nvme_read_gbps: float = EMULATED_LINK_GBPS["nvme_read_gbps"]
    """Emulated NVMe read rate, GB/s."""
    nvme_write_gbps: float = EMULATED_LINK_GBPS["nvme_write_gbps"]
    """Emulated NVMe write rate, GB/s."""
    nvme_mixed_gbps: float | None = None
    """The NVMe rate each direction keeps while the other runs, GB/s (many SSDs share one budget: this VM's wrote at
    half its solo rate beside a read). With optimizer_offload nvme the plan caps both NVMe lanes at it; any
    hardware (`--nvme-read-gbps` and `--nvme-write-gbps` too: on a preset they are the user's SSD, not a
    throttle). None = the hardware's figure (the presets state none) or, on CUDA, the probe's of nvme_dir."""
    optimizer_offload: Literal["host", "nvme"] = "host"
    """Where the optimizer's state lives between updates: `host` (RAM) or `nvme` (one file per layer group under
    nvme_dir: the 8-bit or fp32 moments and, with master_weights fp32 and bf16 compute, the fp32 masters but the
    embedding's; read into a few host staging slots ahead of each group's update and written back after it, on
    the NVMe link the activations' spills share; the planner picks the slots' number under the host memory).
    With bf16 compute host RAM then holds about 4 bytes per parameter plus the staging. Freeze tuning: its trained
    layers' files alone; LoRA keeps its adapters' small states in RAM (`nvme` is noted and taken as `host`)."""
    nvme_dir: str | None = None
    """Directory for `nvme` boundary files and, with optimizer_offload nvme, the optimizer's state files (both
    nameless: nothing is left there after the run); None = a temporary directory removed at the end."""
    nvme_probe: bool = True
    """Measure the disk under nvme_dir when the run starts (with optimizer_offload nvme): reads, writes and both at
    once, as the state files move them; on a CUDA device the plan then uses these rates instead of the hardware's
    (remembered per disk and directory; false: keep the hardware's figures)."""
    nvme_probe_s: float = 3.0
    """Seconds the NVMe probe writes and reads (longer: past the drive's write cache, to its sustained rate)."""
    nvme_tbw: float | None = None
    """The rated endurance of the drive under nvme_dir, in TB written (TBW, from its data sheet): `lazytrain plan`
    and `lazytrain train` then say in how many days of training the run's writes reach it. None = not said."""
    seed: int = 42
    """Seeds the model init, the batch order and the eval batches (an integer in 0..2**63-1; 42 as the HF
    Trainer's; the default job's 0)."""
    data_seed: int | None = None
    """Seeds the batch order and the held-out split alone (None = seed), as the HF Trainer's data_seed."""
    progress: bool = True
    """Show the progress bar on stderr (`--no-progress` turns it off; report lines stay on stdout)."""

    def __post_init__(self) -> None:
        check(self, convert(self),
              (bool(self.hardware.strip()), "hardware", "auto, a preset name or a file"),
              *((getattr(self, knob) > 0, knob, "a rate > 0 in GB/s (inf = unthrottled)")
                for knob in ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps")),
              (self.nvme_mixed_gbps is None or self.nvme_mixed_gbps > 0, "nvme_mixed_gbps", "a rate > 0 in GB/s"),
              (self.nvme_probe_s > 0, "nvme_probe_s", "seconds > 0"),
              (self.nvme_tbw is None or self.nvme_tbw > 0, "nvme_tbw", "the drive's rated TB written, > 0"),
              (self.seed >= 0, "seed", "an integer in 0..2**63-1"),
              (self.data_seed is None or self.data_seed >= 0, "data_seed", "an integer in 0..2**63-1"))


# The learning-rate schedules of transformers.get_scheduler that a step count alone drives (reduce_lr_on_plateau
# needs an eval metric, greedy a loss: not these).
Scheduler = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                    "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"]


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """The optimizer, its schedule and the length of the run (the HF Trainer's defaults, except in the default
    job: config/default_job.yaml)."""

    optimizer: Optimizer = "adamw"
    """`adamw` (torch AdamW, fp32 states), `hybrid8bit` (Hybrid8bitAdamW: the paper's 2% of the parameters in
    8-bit states) or `8bit` (every tensor of 4096+ elements in 8 bits: ~2 instead of 8 bytes of state per
    parameter). The older names `fp32` and `hybrid` are read as adamw and hybrid8bit."""
    optimizer_mode: Literal["serial", "overlap"] = "overlap"
    """`overlap` (overlapped-exact): once the backward is done (global norm known, clipped), the host updates the
    layer groups in forward order under the next step's forward, each group's weight h2d waiting only for its
    update; parameters bit-identical to `serial`, which steps after the whole backward (MegaTrain's code)."""
    learning_rate: float = 5e-5
    """Peak learning rate (> 0), reached after the warm-up."""
    lr_scheduler_type: Scheduler = "linear"
    """The schedule after the warm-up, by transformers.get_scheduler (its semantics): linear (to 0), cosine (to
    0), cosine_with_restarts, polynomial, constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr,
    cosine_warmup_with_min_lr, warmup_stable_decay."""
    lr_scheduler_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the schedule (e.g. `{min_lr_rate: 0.1}` for cosine_with_min_lr, `{num_cycles: 2}`
    for cosine_with_restarts, `{power: 2}` for polynomial)."""
    warmup_steps: int | float = 0
    """Linear warm-up from 0: a number of steps (>= 0), or a float in [0, 1) as a fraction of the run's steps."""
    warmup_ratio: float | None = None
    """Warm-up as a fraction of the run's steps, in [0, 1] (LLaMA-Factory's key); when set it replaces
    warmup_steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay on matrices (norm gains and biases get none), >= 0."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay, in [0, 1)."""
    adam_epsilon: float = 1e-8
    """Adam's denominator epsilon (> 0)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip threshold (>= 0); 0 = no clipping."""
    max_steps: int = -1
    """Optimizer steps to run (>= 1); it wins over num_train_epochs, as in the HF Trainer. -1 = num_train_epochs
    decides."""
    num_train_epochs: float = 3.0
    """Passes over the training data (> 0, fractions allowed) when max_steps is -1: ceil(epochs x the batches of
    one epoch / gradient_accumulation_steps) optimizer steps."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (>= 1)."""
    max_nonfinite_steps: int = 3
    """A step with a non-finite loss or gradient norm is skipped (no update); this many in a row (>= 1) stop the
    run with one line saying what was non-finite and where it first appeared."""

    def __post_init__(self) -> None:
        problems = convert(self)
        if self.optimizer in ("fp32", "hybrid"):  # `lazytrain plan`'s names before the schema
            object.__setattr__(self, "optimizer", {"fp32": "adamw", "hybrid": "hybrid8bit"}[self.optimizer])
        warmup = self.warmup_steps
        check(self, problems,
              (math.isfinite(self.learning_rate) and self.learning_rate > 0, "learning_rate", "a number > 0"),
              (0 <= warmup <= MAX_STEPS and (isinstance(warmup, int) or warmup < 1), "warmup_steps",
               f"an integer in 0..{MAX_STEPS} or a fraction in [0, 1)"),
              (self.warmup_ratio is None or 0 <= self.warmup_ratio <= 1, "warmup_ratio", "in [0, 1]"),
              (math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "a number >= 0"),
              (0 <= self.adam_beta1 < 1, "adam_beta1", "in [0, 1)"),
              (0 <= self.adam_beta2 < 1, "adam_beta2", "in [0, 1)"),
              (0 < self.adam_epsilon < 1, "adam_epsilon", "in (0, 1)"),
              (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0, "max_grad_norm",
               "a number >= 0 (0 = no clipping)"),
              (self.max_steps == -1 or 1 <= self.max_steps <= MAX_STEPS, "max_steps",
               f"an integer in 1..{MAX_STEPS} (or -1: num_train_epochs decides)"),
              (0 < self.num_train_epochs <= MAX_EPOCHS, "num_train_epochs", f"a number in (0, {MAX_EPOCHS}]"),
              (1 <= self.gradient_accumulation_steps <= MAX_COUNT, "gradient_accumulation_steps",
               f"an integer in 1..{MAX_COUNT}"),
              (1 <= self.max_nonfinite_steps <= MAX_STEPS, "max_nonfinite_steps", f"an integer in 1..{MAX_STEPS}"))


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Where the run writes, how often it saves, and what it resumes from."""

    output_dir: str | None = None
    """Where metrics, the plan, the summary and checkpoints go; None = runs/<UTC timestamp>-<pid>."""
    overwrite_output_dir: bool = False
    """Write into an existing non-empty output_dir."""
    save_strategy: Literal["steps", "epoch"] = "steps"
    """When checkpoints are saved besides the end of the run: `steps` = every save_steps; `epoch` = at the end of
    every epoch (save_steps unused), as the HF Trainer. (HF's `no` = save_steps 0.)"""
    save_steps: int = 0
    """Save a checkpoint every N optimizer steps (>= 0); 0 = only at the end."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints (>= 1); None = keep all. With load_best_model_at_end the best one is
    kept too."""
    load_best_model_at_end: bool = False
    """The run's model is the checkpoint with the lowest eval_loss (HF's metric_for_best_model eval_loss):
    save_total_limit keeps it, trainer_state.json and summary.json name it, the last lines point to it. Needs the
    save and eval strategies to match (save_steps a multiple of eval_steps), as in the HF Trainer."""
    resume_from_checkpoint: str | None = None
    """A checkpoint directory to continue from, or `auto` (the newest complete one in output_dir; `true` means
    auto, as in the HF Trainer)."""

    def __post_init__(self) -> None:
        check(self, convert(self),
              (0 <= self.save_steps <= MAX_STEPS, "save_steps", f"an integer in 0..{MAX_STEPS}"),
              (self.save_total_limit is None or 1 <= self.save_total_limit <= MAX_STEPS, "save_total_limit",
               f"an integer in 1..{MAX_STEPS}"))


Tracker = Literal["none", "all", "tensorboard", "wandb", "mlflow"]


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """What the run reports, and how often it evaluates."""

    logging_strategy: Literal["steps", "epoch"] = "steps"
    """When metrics rows are written: `steps` = every logging_steps; `epoch` = at the end of every epoch
    (logging_steps unused), as the HF Trainer. The last step, skipped steps and evaluations always write theirs."""
    logging_steps: int = 1
    """Write a metrics row every N optimizer steps (>= 1; steps count from 1, as the HF Trainer's global_step)."""
    logging_first_step: bool = False
    """Also write the row of step 1."""
    report_to: tuple[Tracker, ...] = ("none",)
    """Also send the scalars to trackers (a name or a list): none, tensorboard (under output_dir/tensorboard),
    wandb, mlflow, or all (those whose package is installed), through accelerate's trackers; rank 0 alone."""
    run_name: str | None = None
    """The run's name in the trackers (None = the output directory's name)."""
    plot_loss: bool = True
    """Draw loss.png (train and eval loss against step) at the end, when matplotlib is installed."""
    eval_strategy: Literal["steps", "epoch"] = "steps"
    """When the held-out loss is evaluated during training (it is before and after training in any case):
    `steps` = every eval_steps; `epoch` = at the end of every epoch (eval_steps unused), as the HF Trainer. An
    epoch is one pass over the training examples in optimizer steps, as num_train_epochs counts them. (HF's `no` =
    eval_batches 0.)"""
    eval_steps: int | None = None
    """Evaluate the held-out loss every N steps (>= 1) and at the last step; None = before and after training
    only."""
    eval_batches: int | None = None
    """Cap on held-out batches per evaluation (>= 0; 0 = no evaluation); None = the whole held-out set. A cap that
    cuts is printed."""

    def __post_init__(self) -> None:
        check(self, convert(self),
              (1 <= self.logging_steps <= MAX_STEPS, "logging_steps", f"an integer in 1..{MAX_STEPS}"),
              ("none" not in self.report_to or len(self.report_to) == 1, "report_to", "none alone, or trackers"),
              (self.eval_steps is None or 1 <= self.eval_steps <= MAX_STEPS, "eval_steps",
               f"an integer in 1..{MAX_STEPS}"),
              (self.eval_batches is None or 0 <= self.eval_batches <= MAX_COUNT, "eval_batches",
               f"an integer in 0..{MAX_COUNT}"))


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
        check(self, convert(self),
              (1 <= self.world_size <= MAX_RANKS, "world_size", f"an integer in 1..{MAX_RANKS}"),
              (1 <= self.nodes <= MAX_RANKS and self.world_size % self.nodes == 0, "nodes",
               f"an integer >= 1 that divides world_size ({self.world_size})"),
              (0 < self.collective_timeout_s <= MAX_TIMEOUT_S, "collective_timeout_s",
               f"a number of seconds in (0, {MAX_TIMEOUT_S:.0e}]"))


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "finetune": FinetuneConfig, "data": DataConfig, "plan": PlanConfig,
    "runtime": RuntimeConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig, "metrics": MetricsConfig,
    "parallel": ParallelConfig,
}


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """One job of `lazytrain plan` or `lazytrain train`: every section, with one set of defaults."""

    model: ModelConfig = field(default_factory=ModelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
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
        if self.checkpoint.load_best_model_at_end:
            self._check_best_model()

    def _check_best_model(self) -> None:
        """The HF Trainer's rule (TrainingArguments): load_best_model_at_end needs the save and eval strategies to
        match, and with steps, save_steps a multiple of eval_steps (so each saved step has its evaluation)."""
        m, c = self.metrics, self.checkpoint
        evals = "no" if m.eval_batches == 0 or (m.eval_strategy == "steps" and m.eval_steps is None) \
            else m.eval_strategy
        if evals != c.save_strategy:
            fix = ("set eval_strategy steps with eval_steps" if c.save_strategy == "steps" else
                   "set eval_strategy epoch")
            raise LazyTrainError(f"load_best_model_at_end needs the save and eval strategies to match, as in the HF "
                                 f"Trainer: eval_strategy {evals}, save_strategy {c.save_strategy}; {fix}")
        if evals == "steps" and m.eval_steps is not None and c.save_steps % m.eval_steps:
            raise LazyTrainError(f"load_best_model_at_end needs save_steps to be a multiple of eval_steps, as in the "
                                 f"HF Trainer: save_steps {c.save_steps}, eval_steps {m.eval_steps}; set save_steps "
                                 f"{(c.save_steps // m.eval_steps + 1) * m.eval_steps}")

    @classmethod
    def build(cls, flat: Mapping[str, Any]) -> JobConfig:
        """From canonical flat keys (`learning_rate`, not `lr`); every section is checked, and every problem of
        every section is raised at once."""
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in flat.items():
            per_section[SECTION_OF[key]][key] = value
        sections, problems = {}, []
        for name, values in per_section.items():
            try:
                sections[name] = SECTIONS[name](**values)
            except ConfigErrors as err:
                problems += err.problems
            except LazyTrainError as err:
                problems.append(err)
        raise_all(problems)
        return cls(**sections)

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
