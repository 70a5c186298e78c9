"""Keys of LLaMA-Factory and the HF Trainer (`TrainingArguments`), each mapped to LazyTrain's or refused with why.

A LLaMA-Factory `train_full` YAML or an HF Trainer config runs as it is wherever LazyTrain does the same thing:
`bf16: true` is `dtype: bf16`, `ddp_timeout` is `collective_timeout_s`, `resume_from_checkpoint: true` is
`auto`, `eval_strategy: steps` evaluates every `eval_steps` and `epoch` at the end of every epoch. A key for
something LazyTrain does not do is refused in one sentence that says what it does instead (`finetuning_type: oft`,
`deepspeed`, `stage: dpo`); a key that only tunes how the original tool runs (`dataloader_num_workers`,
`ddp_find_unused_parameters`) is accepted with a note printed at the start of the run. Every other key of either
tool is refused unless it is off (None, false, 0): no key is silently ignored. The table below is also
docs/config.md's "Coming from LLaMA-Factory / HF Trainer" section (docs.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError

Translation = tuple[dict[str, Any], str | None]  # (our keys and values, a note to print or None)


@dataclass(frozen=True)
class Foreign:
    """One key of LLaMA-Factory (LF) or the HF Trainer (HF): `does` is the docs' sentence, `translate` turns a value
    (and the other keys the user set) into ours, raising Refused when LazyTrain does not do what it asks."""

    source: str
    does: str
    translate: Callable[[Any, Mapping[str, Any]], Translation]


class Refused(LazyTrainError):
    """A foreign key's value LazyTrain does not act on (the loader adds the key and where it came from).

    `method`: the training method the key switches on (GaLore, DPO, ...) when it is one LazyTrain does not do; a
    config that asks for one is refused in that one line, without the lines of the method's own settings."""

    def __init__(self, why: str, method: str | None = None) -> None:
        super().__init__(why)
        self.method = method


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def flag(value: Any) -> bool | None:
    """A YAML / command-line boolean, or None when the value is none/null; anything else is refused."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("none", "null", "~", ""):
        return None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise Refused("expected true or false")


def is_off(value: Any) -> bool:
    """None, false, 0 or an empty string: a value that asks for nothing."""
    if value is None or value is False or (isinstance(value, int | float) and not isinstance(value, bool)
                                           and value == 0):
        return True
    return isinstance(value, str) and value.strip().lower() in ("", "none", "null", "~", "false", "no", "0", "0.0")


def _text(value: Any) -> str:
    return str(value).strip().lower()


def _strategy(value: Any) -> str:
    """An HF `*_strategy` value's name: YAML reads an unquoted `no` as false, as a LLaMA-Factory YAML writes it."""
    return "no" if value is False else _text(value)


# ---- kinds of entries --------------------------------------------------------------------------------
def rename(source: str, ours: str, does: str = "") -> Foreign:
    """The same setting under another name."""
    return Foreign(source, does or f"`{ours}`", lambda value, _: ({ours: value}, None))


def note(source: str, does: str) -> Foreign:
    """Tunes how the original tool runs; LazyTrain has no such knob: accepted, the note printed."""
    return Foreign(source, f"accepted, no effect: {does}", lambda value, _: ({}, None if is_off(value) else does))


def refuse(source: str, why: str, method: str | None = None) -> Foreign:
    """Refused unless off; `method`: the training method it switches on (Refused.method)."""
    def translate(value: Any, _: Mapping[str, Any]) -> Translation:
        if is_off(value):
            return {}, None
        raise Refused(why, method)

    return Foreign(source, f"refused: {why}", translate)


def when_true(source: str, ours: dict[str, Any], does: str) -> Foreign:
    """A boolean that, when true, sets our keys; false asks for nothing."""
    return Foreign(source, does, lambda value, _: (dict(ours) if flag(value) else {}, None))


def accept(source: str, allowed: dict[str, dict[str, Any]], why: str, does: str) -> Foreign:
    """Values LazyTrain acts on (each with the keys it sets), any other refused with `why`; `does` for the docs."""
    def translate(value: Any, _: Mapping[str, Any]) -> Translation:
        if value is None or _text(value) in allowed:
            return ({} if value is None else dict(allowed[_text(value)])), None
        raise Refused(why)

    return Foreign(source, does, translate)


# ---- entries that read other keys -----------------------------------------------------------------------
def _unused_steps(steps_key: str, given: Mapping[str, Any]) -> str | None:
    """The note when a *_steps key is set beside a strategy `epoch` (the HF Trainer ignores it silently)."""
    if given.get(steps_key) is None or is_off(given[steps_key]):
        return None
    return f"epoch leaves {steps_key} {given[steps_key]} unused (at the end of every epoch instead, as the HF Trainer)"


def _eval_strategy(value: Any, given: Mapping[str, Any]) -> Translation:
    strategy = "no" if value is None else _strategy(value)
    if strategy == "no":
        return {"eval_batches": 0}, None
    if strategy == "epoch":
        return {"eval_strategy": "epoch"}, _unused_steps("eval_steps", given)
    if strategy == "steps":
        if "eval_steps" in given:
            return {"eval_strategy": "steps"}, None
        if "logging_steps" in given:  # the HF Trainer's fallback
            return {"eval_strategy": "steps", "eval_steps": given["logging_steps"]}, None
        raise Refused("evaluating every N steps needs eval_steps (or logging_steps, as the HF Trainer takes); "
                      "set eval_steps")
    raise Refused("LazyTrain evaluates every eval_steps steps (eval_strategy steps), at the end of every epoch "
                  "(epoch), or before and after training only (no); set one of them")


def _steps_or_epoch(key: str, steps_key: str, value: Any, given: Mapping[str, Any]) -> Translation | None:
    """`<key>: steps | epoch` (None = steps) as our own key of that name; None for any other value."""
    strategy = "steps" if value is None else _strategy(value)
    if strategy not in ("steps", "epoch"):
        return None
    note = _unused_steps(steps_key, given) if strategy == "epoch" else None
    return ({} if value is None else {key: strategy}), note


def _save_strategy(value: Any, given: Mapping[str, Any]) -> Translation:
    if (ours := _steps_or_epoch("save_strategy", "save_steps", value, given)) is not None:
        return ours
    if _strategy(value) == "no":
        return {"save_steps": 0}, "save_strategy no: only the final checkpoint is saved (save_steps 0)"
    raise Refused("LazyTrain saves every save_steps steps (save_strategy steps) or at the end of every epoch "
                  "(epoch), and at the end; set one of them")


def _logging_strategy(value: Any, given: Mapping[str, Any]) -> Translation:
    if (ours := _steps_or_epoch("logging_strategy", "logging_steps", value, given)) is not None:
        return ours
    raise Refused("metrics rows are written every logging_steps steps (logging_strategy steps) or at the end of "
                  "every epoch (epoch); set one of them")


_STAGES = {"rm": "reward modelling", "ppo": "PPO", "dpo": "DPO", "kto": "KTO"}


def _stage(value: Any, given: Mapping[str, Any]) -> Translation:
    stage = _text(value)
    if stage == "sft" or value is None:
        return {}, None
    if stage == "pt":  # LF packs pretraining text unless told not to
        return {**({} if "dataset_format" in given else {"dataset_format": "text"}),
                **({} if "packing" in given or "neat_packing" in given else {"packing": True})}, None
    raise Refused(f"LazyTrain trains with the language-model loss (stage sft or pt); {stage} is not implemented: "
                  "use LLaMA-Factory for it", method=_STAGES.get(stage, f"stage {stage}"))


def _deepspeed(value: Any, given: Mapping[str, Any]) -> Translation:
    """A DeepSpeed JSON: its ZeRO stage needs nothing (LazyTrain streams the layers itself); an optimizer offloaded
    to NVMe is `optimizer_offload: nvme` in its nvme_path. The path is read as the HF Trainer reads it: relative to
    the directory the command runs in."""
    if is_off(value):
        return {}, None
    if isinstance(value, Mapping):
        config: Any = value
    else:
        path = Path(str(value)).expanduser()
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise Refused(f"no such file {path} (relative to the directory the command runs in: {Path.cwd()}); fix "
                          "the path, or remove deepspeed (LazyTrain streams the layers itself)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise Refused(f"{path} cannot be read as JSON ({reason}); fix the file, or remove deepspeed") from None
    if not isinstance(config, Mapping):
        raise Refused("a DeepSpeed config is a JSON object; fix the file, or remove deepspeed")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else None
    if stage not in (0, 1, 2, 3):
        raise Refused(f"zero_optimization.stage {stage!r}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3; fix the file")
    ours: dict[str, Any] = {}
    said = [f"ZeRO stage {stage} needs nothing here: LazyTrain streams the layers between host and GPU itself "
            "(one copy of the weights and optimizer state in host memory, shared by the ranks of a node)"]
    offload = zero.get("offload_optimizer") or {}
    device = _text(offload.get("device", "none")) if isinstance(offload, Mapping) else "none"
    if device == "nvme":
        if not offload.get("nvme_path"):
            raise Refused("offload_optimizer device nvme needs its nvme_path; set it, or set nvme_dir")
        ours = {"optimizer_offload": "nvme", "nvme_dir": str(offload["nvme_path"])}
        said.append(f"offload_optimizer nvme = optimizer_offload nvme in {offload['nvme_path']}")
    elif device == "cpu":
        said.append("offload_optimizer cpu is what LazyTrain does by default (optimizer state in host memory)")
    param = zero.get("offload_param") or {}
    if isinstance(param, Mapping) and _text(param.get("device", "none")) not in ("none", ""):
        said.append(f"offload_param {_text(param['device'])}: the weights live in host memory and are streamed "
                    "to the GPU layer by layer in any case")
    return ours, "; ".join(said)


def _flash_attn(value: Any, given: Mapping[str, Any]) -> Translation:
    kind = _text(value)
    if value is None or kind in ("auto", "sdpa"):
        return {}, None
    if kind in ("fa2", "fa3", "disabled", "eager"):
        return {}, (f"{kind}: LazyTrain runs attention through sdpa (or the implementation the model's config.json "
                    "names); the same attention, the same result up to rounding")
    raise Refused("flash_attn is auto, sdpa, fa2, fa3 or disabled; LazyTrain runs sdpa")


def _resume(value: Any, given: Mapping[str, Any]) -> Translation:
    if isinstance(value, bool) or _text(value) in _TRUE | _FALSE:
        return {"resume_from_checkpoint": "auto" if flag(value) else None}, None
    return {"resume_from_checkpoint": value}, None


def _report_to(value: Any, given: Mapping[str, Any]) -> Translation:
    return {"report_to": "none" if value is None else value}, None


def _optim(value: Any, given: Mapping[str, Any]) -> Translation:
    name = _text(value)
    if name in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"):
        return {"optimizer": "adamw"}, None
    if name in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit"):
        return {"optimizer": "8bit"}, None
    raise Refused("LazyTrain's optimizers are adamw (torch AdamW), hybrid8bit and 8bit (its own 8-bit AdamW); set "
                  "optimizer to one of them")


LF, HF, BOTH = "LLaMA-Factory", "HF Trainer", "both"

_PRECISION = "`dtype` (bf16: true -> bf16, fp16: true -> fp16; all false -> fp32)"
_DDP = ("LazyTrain sums gradients itself, layer group by layer group, under torchrun (no DistributedDataParallel "
        "to tune)")
_LOADER = ("batches are laid out in the training process from the tokenized examples in memory (no DataLoader "
           "workers)")
_OPTIMIZERS = "LazyTrain's optimizers are adamw, hybrid8bit and 8bit (`optimizer`)"
_LOSS = "LazyTrain trains the plain cross-entropy of the response tokens"
_MEDIA = "LazyTrain trains text models (no images, videos or audio)"
_RECOMPUTE = ("the plan decides which layers to recompute (planner auto: only where memory needs it; planner "
              "recompute-all recomputes every layer)")
_KERNELS = ("LazyTrain runs transformers' own layers, streamed (fused kernels compute the same loss, faster; "
            "none is swapped in)")
_RAY = ("LLaMA-Factory uses Ray only under USE_RAY=1; LazyTrain runs data-parallel ranks under torchrun "
        "(torchrun --nproc_per_node N -m lazytrain train ...)")
_NO_UPLOAD = ("nothing leaves this machine during a run; upload the checkpoint folder afterwards (e.g. hf upload)")

TABLE: dict[str, Foreign] = {
    # ---- model ----
    "model_name_or_path": rename(BOTH, "model"),
    "trust_remote_code": note(LF, "LazyTrain loads only the model classes transformers ships and never runs a "
                                  "model's own code; a model that needs it is refused when loaded"),
    "flash_attn": Foreign(LF, "auto, sdpa accepted (sdpa attention); fa2, fa3, disabled accepted with a note (the "
                              "same attention, sdpa's rounding)", _flash_attn),
    "quantization_method": accept(LF, {"bnb": {}, "bitsandbytes": {}}, "quantization_bit's method is bitsandbytes' "
                                  "(bnb); remove quantization_method", "bnb accepted (with quantization_bit)"),
    "cache_dir": refuse(LF, "models and datasets are read from the HF cache; set HF_HOME (or HF_HUB_CACHE / "
                            "HF_DATASETS_CACHE) instead"),
    "use_fast_tokenizer": accept(LF, {"true": {}}, "the tokenizer is AutoTokenizer's fast one; remove "
                                 "use_fast_tokenizer", "true accepted (the fast tokenizer)"),
    "train_from_scratch": when_true(LF, {"init": "random"}, "true: `init: random`"),
    "disable_gradient_checkpointing": note(LF, _RECOMPUTE),
    "gradient_checkpointing": note(HF, _RECOMPUTE),
    "gradient_checkpointing_kwargs": note(HF, _RECOMPUTE),
    "activation_checkpointing": note(HF, _RECOMPUTE),
    "low_cpu_mem_usage": note(LF, "weights are loaded shard by shard into host memory in any case"),
    "rope_scaling": refuse(LF, "set rope_scaling in the model's config.json"),
    "use_unsloth": refuse(LF, "LazyTrain runs transformers' own layers, streamed; remove use_unsloth"),
    "enable_liger_kernel": note(LF, _KERNELS), "use_liger_kernel": note(HF, _KERNELS),
    "use_v1_kernels": note(LF, _KERNELS),
    "use_unsloth_gc": note(LF, _RECOMPUTE), "use_reentrant_gc": note(LF, _RECOMPUTE),
    # ---- method ----
    "stage": Foreign(LF, "sft accepted; pt = `dataset_format: text` (loss on every token); rm, ppo, dpo, kto "
                         "refused", _stage),
    "do_train": accept(BOTH, {"true": {}}, "`lazytrain train` always trains (`lazytrain plan` plans without "
                       "training); remove do_train false", "true accepted; false refused"),
    "do_eval": Foreign(BOTH, "true accepted (held-out loss before, during and after training); false = "
                             "`eval_batches: 0`", lambda v, _: ({} if flag(v) is not False else {"eval_batches": 0},
                                                                None)),
    "do_predict": refuse(BOTH, "LazyTrain does not generate predictions; evaluate the held-out loss with "
                               "eval_dataset or val_size", "prediction"),
    "pure_bf16": when_true(LF, {"dtype": "bf16", "master_weights": "bf16"},
                           "true: `dtype: bf16` with `master_weights: bf16` (needs optimizer 8bit or hybrid8bit)"),
    "use_galore": refuse(LF, _OPTIMIZERS, "GaLore"), "use_apollo": refuse(LF, _OPTIMIZERS, "APOLLO"),
    "use_badam": refuse(LF, _OPTIMIZERS, "BAdam"), "use_adam_mini": refuse(LF, _OPTIMIZERS, "Adam-mini"),
    "use_muon": refuse(LF, _OPTIMIZERS, "Muon"),
    "use_llama_pro": refuse(LF, "LazyTrain trains every parameter of the model as it is; remove use_llama_pro",
                            "LLaMA Pro"),
    "use_dft_loss": refuse(LF, _LOSS, "the DFT loss"), "use_asft_loss": refuse(LF, _LOSS, "the ASFT loss"),
    "use_eaft_loss": refuse(LF, _LOSS, "the EAFT loss"),
    **{key: refuse(LF, "LazyTrain's adapters are LoRA (finetuning_type lora); OFT is not implemented", "OFT")
       for key in ("oft_rank", "oft_block_size", "oft_target")},
    **{key: refuse(LF, "LazyTrain's LoRA adapters start from the standard initialization; PiSSA is not "
                        "implemented", "PiSSA") for key in ("pissa_iter", "pissa_convert")},
    "mixture_of_depths": refuse(LF, "LazyTrain trains the model's own layers; mixture of depths is not implemented",
                                "mixture of depths"),
    "use_swanlab": refuse(LF, "trackers are report_to wandb, mlflow or tensorboard; SwanLab is not integrated"),
    "deepspeed": Foreign(HF, "a DeepSpeed JSON is read: ZeRO stage 0-3 accepted with a note (LazyTrain streams the "
                             "layers itself); offload_optimizer nvme = `optimizer_offload: nvme` in its nvme_path; "
                             "deepspeed=null on the command line drops a YAML's", _deepspeed),
    "fsdp": refuse(HF, "LazyTrain does not shard with FSDP: each rank streams the whole model from host memory shared "
                       "per node; remove fsdp and launch with torchrun --nproc_per_node N", "FSDP"),
    "fsdp_config": refuse(HF, "LazyTrain does not shard with FSDP; remove fsdp_config"),
    "fp8": refuse(LF, "LazyTrain computes in bf16 or fp32 (`dtype`); remove fp8", "FP8 training"),
    "torch_compile": refuse(HF, "LazyTrain's executor runs the model's layers eagerly, one streamed layer at a time; "
                                "remove torch_compile"),
    # ---- dataset ----
    "neat_packing": when_true(LF, {"packing": True}, "true: `packing: true` (LazyTrain's packing never attends "
                                                     "across examples)"),
    "mask_history": refuse(LF, "the loss covers every assistant turn; mask_history is not implemented"),
    "streaming": refuse(LF, "datasets are read, tokenized and cached whole before training; remove streaming"),
    "tokenized_path": refuse(LF, "LazyTrain tokenizes into its own cache, which the next run with the same data and "
                                 "tokenizer reads back (overwrite_cache re-tokenizes); remove tokenized_path",
                             "a preprocessing run (tokenized_path)"),
    "default_system": refuse(LF, "give the system prompt in the data (a system column or message)"),
    "enable_thinking": accept(LF, {"true": {}}, "templates render as the tokenizer's chat template does; remove "
                              "enable_thinking", "true accepted (the chat template as it is)"),
    "tool_format": refuse(LF, "tool calls are not formatted by LazyTrain; remove tool_format"),
    "media_dir": refuse(LF, _MEDIA, "multimodal training"),
    **{key: refuse(LF, _MEDIA, "multimodal training") for key in (
        "image_max_pixels image_min_pixels image_do_pan_and_scan crop_to_patches video_max_pixels video_min_pixels "
        "video_fps video_maxlen use_audio_in_video audio_sampling_rate freeze_vision_tower "
        "freeze_multi_modal_projector freeze_language_model").split()},
    "ignore_pad_token_for_loss": accept(LF, {"true": {}}, "padding never carries loss", "true accepted"),
    "eval_on_each_dataset": refuse(LF, "the held-out loss is one figure over all eval datasets"),
    # ---- output, logging, saving ----
    "resume_from_checkpoint": Foreign(BOTH, "a checkpoint folder, or true = `auto` (the newest in output_dir), "
                                            "false = none", _resume),
    "report_to": Foreign(BOTH, "none, all, tensorboard, wandb, mlflow (a name or a list)", _report_to),
    "disable_tqdm": Foreign(HF, "true = `progress: false`", lambda v, _: ({"progress": not flag(v)}, None)),
    "logging_strategy": Foreign(HF, "steps = a row every `logging_steps`; epoch = at the end of every epoch "
                                    "(`logging_strategy: epoch`); no refused", _logging_strategy),
    "eval_strategy": Foreign(HF, "steps = evaluate every `eval_steps` (else every logging_steps); epoch = at the end "
                                 "of every epoch (`eval_strategy: epoch`); no = `eval_batches: 0`", _eval_strategy),
    "evaluation_strategy": Foreign(HF, "as eval_strategy (its older name)", _eval_strategy),
    "save_strategy": Foreign(HF, "steps = every `save_steps`; epoch = at the end of every epoch "
                                 "(`save_strategy: epoch`); no = `save_steps: 0` (the final checkpoint only); best "
                                 "refused", _save_strategy),
    "save_only_model": note(HF, "a checkpoint always holds the exact trainer state beside the model, so a run "
                                "resumes from any of them (its HF model folder is the model alone)"),
    "save_safetensors": accept(HF, {"true": {}}, "checkpoints are safetensors; remove save_safetensors",
                               "true accepted"),
    "save_on_each_node": accept(HF, {"false": {}}, "rank 0 writes each checkpoint", "false accepted"),
    "load_best_model_at_end": Foreign(HF, "`load_best_model_at_end` (the checkpoint with the lowest eval_loss is "
                                          "kept and is the run's model)",
                                      lambda v, _: ({"load_best_model_at_end": bool(flag(v))}, None)),
    "metric_for_best_model": accept(HF, {"eval_loss": {}, "loss": {}}, "the best metric is the held-out loss",
                                    "eval_loss, loss accepted (the held-out loss)"),
    "greater_is_better": accept(HF, {"false": {}}, "the best metric is the held-out loss (lower is better)",
                                "false accepted"),
    "push_to_hub": refuse(HF, _NO_UPLOAD),
    "log_level": note(HF, "LazyTrain prints its report lines on rank 0; transformers' own logging stays quiet"),
    "log_level_replica": note(HF, "ranks other than 0 write their lines to output_dir/rank-<r>/console.log"),
    "log_on_each_node": note(HF, "rank 0 alone prints; the others write output_dir/rank-<r>/console.log"),
    "logging_nan_inf_filter": note(HF, "a non-finite step is skipped and logged as such (max_nonfinite_steps)"),
    "include_num_input_tokens_seen": note(HF, "each metrics row holds its step's tokens"),
    "include_effective_tokens_per_second": note(LF, "each metrics row holds tokens_per_s"),
    "skip_memory_metrics": note(HF, "each metrics row holds the device peak (peak_device_bytes)"),
    # ---- training ----
    "bf16": Foreign(BOTH, _PRECISION, lambda v, _: ({"dtype": "bf16"} if flag(v) else {}, None)),
    "fp16": Foreign(BOTH, _PRECISION, lambda v, _: ({"dtype": "fp16"} if flag(v) else {}, None)),
    "tf32": refuse(HF, "matmuls run in `dtype` (bf16 or fp32); TF32 is not switched on"),
    "bf16_full_eval": refuse(HF, "evaluation runs in the training dtype"),
    "fp16_full_eval": refuse(HF, "evaluation runs in the training dtype"),
    "optim": Foreign(HF, "adamw_torch, adamw_torch_fused = `optimizer: adamw`; adamw_8bit, adamw_bnb_8bit, "
                         "paged_adamw_8bit = `optimizer: 8bit`; others refused", _optim),
    "auto_find_batch_size": when_true(HF, {"per_device_train_batch_size": "auto"},
                                      "true: `per_device_train_batch_size: auto` (the largest the planner admits)"),
    "average_tokens_across_devices": accept(HF, {"true": {}}, "the loss is always the mean over the global batch's "
                                            "tokens", "true accepted"),
    "label_smoothing_factor": refuse(HF, "LazyTrain trains the plain cross-entropy; label smoothing is not "
                                         "implemented"),
    "neftune_noise_alpha": refuse(HF, "NEFTune noise is not implemented"),
    "ignore_data_skip": accept(HF, {"false": {}}, "a resumed run continues at the checkpoint's exact data position",
                               "false accepted"),
    "full_determinism": note(HF, "a run is determined by seed and data_seed (same losses digit for digit on the same "
                                 "machine)"),
    "use_cpu": when_true(HF, {"device": "cpu"}, "true: `device: cpu` (the emulated device)"),
    "disable_shuffling": accept(LF, {"false": {}}, "the batch order is shuffled per epoch from data_seed",
                                "false accepted"),
    "compute_accuracy": refuse(LF, "evaluation reports the held-out loss only"),
    "early_stopping_steps": refuse(LF, "runs stop at max_steps (or num_train_epochs)"),
    "eval_on_start": note(HF, "the held-out loss is computed before training in any case"),
    "prediction_loss_only": note(HF, "evaluation computes the loss only in any case"),
    # ---- distributed, data loading: knobs of the original tool's machinery ----
    "ddp_timeout": rename(HF, "collective_timeout_s"),
    "ddp_backend": rename(HF, "backend"),
    "ddp_find_unused_parameters": note(HF, _DDP), "ddp_bucket_cap_mb": note(HF, _DDP),
    "ddp_broadcast_buffers": note(HF, _DDP), "ddp_static_graph": note(HF, _DDP),
    "local_rank": note(HF, "torchrun's LOCAL_RANK is read from the environment"),
    "ray_num_workers": note(LF, _RAY), "ray_init_kwargs": note(LF, _RAY),
    "dataloader_num_workers": note(HF, _LOADER), "dataloader_pin_memory": note(HF, _LOADER),
    "dataloader_persistent_workers": note(HF, _LOADER), "dataloader_prefetch_factor": note(HF, _LOADER),
    "dataloader_drop_last": note(HF, _LOADER + "; the loader streams epochs without a last partial batch"),
    "remove_unused_columns": note(HF, "the tokenized examples hold input_ids and labels only"),
    "label_names": note(HF, "the labels are the tokenized examples' labels"),
    "use_cache": note(HF, "the KV cache is off while training"),
    "torch_empty_cache_steps": note(HF, "the device arena is planned; no cache to empty"),
}

# Every other key of either tool (LLaMA-Factory's hparams, transformers 5's TrainingArguments): refused unless it is
# off (None, false, 0), with one generic sentence.
OTHER_KEYS: dict[str, str] = dict.fromkeys((
    "buffer_size eval_num_beams data_shared_file_system preserve_thinking "
    "loraplus_lr_embedding create_new_adapter module_dropout pref_beta pref_ftx "
    "pref_bco_weight pref_loss dpo_label_smoothing kto_chosen_weight kto_rejected_weight simpo_gamma ppo_buffer_size "
    "ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards ref_model ref_model_adapters ref_model_quantization_bit "
    "reward_model reward_model_adapters reward_model_quantization_bit reward_model_type ld_alpha galore_target "
    "galore_rank galore_update_interval galore_scale galore_proj_type galore_layerwise apollo_target apollo_rank "
    "apollo_update_interval apollo_scale apollo_proj apollo_proj_type apollo_scale_type apollo_layerwise "
    "apollo_scale_front badam_mode badam_start_block badam_switch_mode badam_switch_interval badam_update_ratio "
    "badam_mask_mode badam_verbose swanlab_project swanlab_workspace swanlab_run_name swanlab_mode swanlab_api_key "
    "swanlab_logdir swanlab_lark_webhook_url swanlab_lark_secret use_mca use_megatron_bridge megatron_bridge_args "
    "use_hyper_parallel hyper_parallel_args hyper_parallel_cp_size asft_alpha "
    "eaft_alpha adapter_folder "
    "resize_vocab split_special_tokens add_tokens add_special_tokens new_special_tokens_config init_special_tokens "
    "model_revision shift_attn moe_aux_loss_coef upcast_layernorm "
    "upcast_lmhead_output infer_backend offload_folder use_kv_cache infer_dtype hf_hub_token "
    "ms_hub_token om_hub_token print_param_status quantization_type double_quantization "
    "quantization_device_map export_dir "
    "export_size export_device export_quantization_bit export_quantization_dataset export_quantization_nsamples "
    "export_quantization_maxlen export_legacy_format export_hub_model_id vllm_maxlen vllm_gpu_util "
    "vllm_enforce_eager vllm_max_lora_rank vllm_config sglang_maxlen sglang_mem_fraction sglang_tp_size "
    "sglang_config sglang_lora_backend use_kt kt_cpu_activation kt_weight_path kt_non_expert_weight_path "
    "kt_expert_checkpoint_path kt_use_lora_experts kt_lora_expert_num kt_lora_expert_intermediate_size "
    "compute_dtype device_map model_max_length block_diag_attn master_addr "
    "master_port enable_torch_profiler profiler_output_dir profiler_wait_steps profiler_warmup_steps "
    "profiler_active_steps profiler_repeat profiler_record_shapes profiler_profile_memory profiler_with_stack "
    "profile_modules fp8_backend fp8_enable_fsdp_float8_all_gather"
).split(), LF) | dict.fromkeys((
    "optim_args optim_target_modules activation_checkpointing_kwargs torch_compile_backend torch_compile_mode "
    "liger_kernel_config project trackio_space_id trackio_bucket_id trackio_static_space_id eval_delay "
    "eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics "
    "enable_jit_checkpoint hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision "
    "restore_callback_states_from_checkpoint accelerator_config parallelism_config dataloader_multiprocessing_context "
    "dataloader_in_order train_sampling_strategy length_column_name debug logging_dir group_by_length "
    "fsdp_transformer_layer_cls_to_wrap fsdp_min_num_params predict_with_generate generation_max_length "
    "generation_num_beams"
).split(), HF)


def translate(key: str, value: Any, given: Mapping[str, Any]) -> Translation | None:
    """Our keys for a foreign key (and a note), None when `key` is neither tool's; Refused when LazyTrain does not
    do what the value asks. `given`: every key the user set, as spelled (for keys that depend on others)."""
    entry = TABLE.get(key)
    if entry is not None:
        return entry.translate(value, given)
    if key in OTHER_KEYS:
        if is_off(value):
            return {}, None
        raise Refused(f"a {OTHER_KEYS[key]} setting LazyTrain does not implement; remove it")
    return None


def precision(given: Mapping[str, Any]) -> dict[str, Any]:
    """bf16 / fp16 / pure_bf16 all given and all false: fp32, as the HF Trainer then computes (a true one is
    translated by its own entry)."""
    named = [given[key] for key in ("bf16", "fp16", "pure_bf16") if key in given]
    if named and "dtype" not in given and not any(_safe_flag(v) for v in named):
        return {"dtype": "fp32"}
    return {}


def _safe_flag(value: Any) -> bool:
    try:
        return bool(flag(value))
    except Refused:
        return True  # its own entry reports it
