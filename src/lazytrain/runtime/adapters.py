"""Which parameters train: LoRA adapters and freeze tuning on a `transformers` causal LM (LLaMA-Factory's and
PEFT's meanings).

The executor streams every parameter of a layer and gives gradients to the trainable ones alone (`requires_grad`;
runtime/store.py), so both methods are a change of the model before the executor is built:

- `add_lora` replaces each targeted `nn.Linear` of the decoder layers with a `LoraLinear`: the frozen base
  linear plus `lora_B(lora_A(dropout(x))) * scaling`, PEFT's `lora.Linear` arithmetic and parameter names
  (`base_layer.weight`, `lora_A.weight`, `lora_B.weight`), so the adapter's state maps onto PEFT's adapter file
  one to one; every other parameter is frozen except `additional_target` modules (PEFT's modules_to_save).
- `freeze` keeps LLaMA-Factory's trainable layers (the last n, or the first -n) and modules trainable and
  freezes the rest.

Frozen parameters are cast to the compute dtype (`cast_frozen`): they have no master weights, no gradient and no
optimizer state, so the host holds them once, in the dtype they stream in.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from lazytrain.errors import LazyTrainError

LORA_ADAPTER_NAME = "default"  # PEFT's adapter name (its file's keys leave it out)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's knobs, LLaMA-Factory's names and defaults (lora_alpha None = 2 x rank)."""

    rank: int = 8
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all",)  # module names (the last part of a dotted name), or "all": every linear
    rslora: bool = False  # scaling alpha / sqrt(rank) instead of alpha / rank
    additional: tuple[str, ...] = ()  # modules trained whole beside the adapters (PEFT's modules_to_save)

    @property
    def scaling(self) -> float:
        alpha = self.alpha if self.alpha is not None else 2 * self.rank
        return alpha / math.sqrt(self.rank) if self.rslora else alpha / self.rank


class LoraLinear(nn.Module):
    """A frozen linear with a trainable low-rank update: base(x) + B(A(dropout(x))) * scaling (PEFT's order)."""

    def __init__(self, base: nn.Linear, settings: LoraSettings) -> None:
        super().__init__()
        rank, scaling, dropout = settings.rank, settings.scaling, settings.dropout
        self.settings = settings
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = scaling
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init: A random, B zero (no change)
        nn.init.zeros_(self.lora_B.weight)

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LazyTrainError(f"model {type(model).__name__} has no decoder layers (model.layers) to adapt")
    return layers


def linear_names(model: nn.Module) -> list[str]:
    """The last name part of every linear module in the decoder layers (what lora_target `all` means: every
    linear but the LM head, as LLaMA-Factory's find_all_linear_modules)."""
    return sorted({name.split(".")[-1] for name, m in decoder_layers(model).named_modules()
                   if isinstance(m, nn.Linear) and name})


def add_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Wrap every targeted linear of the decoder layers in a `LoraLinear` (A, B fp32) and freeze everything else
    but the `additional` modules; returns the target names. Refuses a target no linear has, in one line."""
    if settings.rank < 1:
        raise LazyTrainError(f"lora_rank must be >= 1, got {settings.rank}")
    available = linear_names(model)
    targets = available if list(settings.targets) == ["all"] else list(settings.targets)
    unknown = sorted(set(targets) - set(available))
    if unknown:
        raise LazyTrainError(f"lora_target {','.join(unknown)}: no such linear module in the decoder layers; "
                             f"choose from {','.join(available)} or all")
    model.requires_grad_(False)
    for layer in decoder_layers(model):
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear) and name.split(".")[-1] in targets:
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, LoraLinear(module, settings))
    train_modules(model, settings.additional, "additional_target")
    return targets


def train_modules(model: nn.Module, names: tuple[str, ...], key: str) -> None:
    """Make trainable every module whose last name part is in `names` (refused in one line if none is)."""
    found = set()
    for name, module in model.named_modules():
        if name.split(".")[-1] in names:
            module.requires_grad_(True)
            found.add(name.split(".")[-1])
    missing = sorted(set(names) - found)
    if missing:
        raise LazyTrainError(f"{key} {','.join(missing)}: no such module in the model")


def freeze(model: nn.Module, trainable_layers: int, trainable_modules: tuple[str, ...],
           extra_modules: tuple[str, ...]) -> list[int]:
    """LLaMA-Factory's freeze tuning: the last `trainable_layers` decoder layers (the first -n when negative),
    within them the `trainable_modules` (`all` = the whole layer), plus the `extra_modules` outside the layers
    (embed_tokens, norm, lm_head); every other parameter frozen. Returns the trainable layer indices."""
    layers = decoder_layers(model)
    L = len(layers)
    ids = range(max(0, L - trainable_layers), L) if trainable_layers > 0 else range(min(-trainable_layers, L))
    inner = sorted({name.split(".")[0] for name, _ in layers[0].named_parameters()})
    unknown = sorted(set(trainable_modules) - {"all", *inner})
    if unknown:
        raise LazyTrainError(f"freeze_trainable_modules {','.join(unknown)}: not in a decoder layer; choose from "
                             f"{','.join(inner)} or all")
    model.requires_grad_(False)
    for j in ids:
        for name, p in layers[j].named_parameters():
            if "all" in trainable_modules or name.split(".")[0] in trainable_modules:
                p.requires_grad_(True)
    outer = sorted({name.split(".")[-1] for name, m in model.named_modules()  # (a tied lm_head included)
                    if name and not re.search(r"\.\d+(\.|$)", name) and any(True for _ in m.parameters(recurse=False))})
    unknown = sorted(set(extra_modules) - set(outer))
    if unknown:
        raise LazyTrainError(f"freeze_extra_modules {','.join(unknown)}: no such module outside the decoder layers; "
                             f"choose from {','.join(outer)}")
    train_modules(model, extra_modules, "freeze_extra_modules")
    return list(ids)


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters in the compute dtype, tensor by tensor (no master copy of what never changes); trainable
    ones stay as they are (their dtype is the masters')."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)


# ---- PEFT's adapter folder: adapter_config.json + adapter_model.safetensors -------------------------------
PEFT_PREFIX = "base_model.model."  # PEFT's names of the wrapped model's tensors


def lora_settings(model: nn.Module) -> LoraSettings | None:
    """The LoRA settings of a model `add_lora` changed (None: it has no adapters), with its targets as found."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLinear)]
    if not layers:
        return None
    targets = tuple(sorted({name.split(".")[-1] for name, _ in layers}))
    return replace(layers[0][1].settings, targets=targets)


def peft_config(model: nn.Module, base_model: str | None) -> dict[str, Any]:
    """adapter_config.json of the model's adapters, as PEFT writes it (`LoraConfig` reads it back)."""
    s = lora_settings(model)
    assert s is not None
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": s.rank,
            "lora_alpha": s.alpha if s.alpha is not None else 2 * s.rank, "lora_dropout": s.dropout,
            "target_modules": list(s.targets), "use_rslora": s.rslora, "use_dora": False, "bias": "none",
            "modules_to_save": list(s.additional) or None, "fan_in_fan_out": False, "init_lora_weights": True,
            "inference_mode": True}


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors: every trainable one (adapters, additional targets) by PEFT's name."""
    return {PEFT_PREFIX + name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def read_adapter(folder: Path, dropout: float) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder's settings and tensors (by the model's names), checked; one line when it is not
    one LazyTrain can train on. The config is data: only its LoRA fields are read."""
    config_path, tensors_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not tensors_path.is_file():
        raise LazyTrainError(f"adapter_name_or_path {folder}: not a PEFT adapter folder (it needs "
                             "adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise ValueError(f"peft_type {config.get('peft_type') if isinstance(config, dict) else None!r}, "
                             "not LORA")
        if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError("DoRA or per-module ranks are not supported")
        targets = config.get("target_modules")
        targets = tuple(targets) if isinstance(targets, list) else tuple(str(targets).split(","))
        settings = LoraSettings(rank=int(config["r"]), alpha=float(config["lora_alpha"]), dropout=dropout,
                                targets=targets, rslora=bool(config.get("use_rslora", False)),
                                additional=tuple(config.get("modules_to_save") or ()))
        tensors = {name.removeprefix(PEFT_PREFIX).replace(".default", ""): t
                   for name, t in load_file(str(tensors_path)).items()}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        raise LazyTrainError(f"adapter_name_or_path {folder}: cannot be read ({err})") from None
    return settings, tensors


def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Every trainable tensor of `model` from `tensors` (shapes checked, finite), or one line naming what is off."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise LazyTrainError(f"{where} has no tensor for {missing[0]} (and {len(missing) - 1} more); it was made "
                             "for another model or other lora_target")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if t.shape != p.shape or not bool(torch.isfinite(t).all()):
                raise LazyTrainError(f"{where}: {name} is {tuple(t.shape)} (the model's {tuple(p.shape)}) or not "
                                     "finite")
            p.copy_(t)
