"""ModelSpec: the shapes of a decoder-only LLM, read from a Hugging Face `config.json`.

Shapes only — no weights, no torch. Everything the planner needs about the model (parameter
counts per layer, bytes of a boundary activation per token) is derived here, so the cost model and
the executor agree on one source. `fingerprint()` identifies the shapes; plan files carry it so a
plan made for another model is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lazytrain.errors import LazyTrainError

PRESET_DIR = Path(__file__).parent / "presets"

# model_type values whose decoder layer is the dense Llama shape (attention + gated MLP + 2 norms).
DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer; all counts are elements, not bytes."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias=True
    attention_out_bias: bool = False  # Llama attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    # Per-layer parameter counts; filled by from_config so heterogeneous (hybrid/MoE) layers are exact.
    layer_params: tuple[int, ...] = field(default=())
    # Parameters a token actually multiplies per layer (differs from layer_params for MoE).
    layer_active_params: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for knob in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size"):
            value = getattr(self, knob)
            if not isinstance(value, int) or value <= 0:
                raise LazyTrainError(f"model {self.name!r}: {knob} must be a positive integer, got {value!r}")
        if not self.layer_params:
            object.__setattr__(self, "layer_params", (self._dense_layer_params(),) * self.num_layers)
        if not self.layer_active_params:
            object.__setattr__(self, "layer_active_params", self.layer_params)
        if len(self.layer_params) != self.num_layers or len(self.layer_active_params) != self.num_layers:
            raise LazyTrainError(f"model {self.name!r}: per-layer parameter counts do not match num_layers")

    # ---- parameter counts -------------------------------------------------------------------
    def _dense_layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * q + 2 * h * kv + q * h
        if self.attention_qkv_bias:
            attention += q + 2 * kv
        if self.attention_out_bias:
            attention += h
        if self.qk_norm:
            attention += 2 * d
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        return attention + mlp + 2 * h  # + input and post-attention RMSNorm

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final norm plus LM head (0 extra for the head when tied to the embedding)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def num_params(self) -> int:
        return self.embedding_params + sum(self.layer_params) + self.head_params

    # ---- identity ---------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Stable hash of the shapes (not the name): two specs with equal shapes are the same model."""
        shapes = {k: v for k, v in asdict(self).items() if k != "name"}
        return hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any] | Any, name: str | None = None) -> ModelSpec:
        """From a config dict or a `transformers.PretrainedConfig` (anything with `to_dict()`)."""
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if "text_config" in cfg and "num_hidden_layers" not in cfg:  # multimodal wrapper: plan the LM
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        model_type = cfg.get("model_type")
        name = name or cfg.get("_name_or_path") or model_type or "model"
        if model_type not in DENSE_TYPES:
            raise LazyTrainError(
                f"model {name!r}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(sorted(DENSE_TYPES))}"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            spec = cls(
                name=str(name),
                model_type=model_type,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                attention_out_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
            )
        except KeyError as missing:
            raise LazyTrainError(f"model {name!r}: config.json lacks {missing}; is it a decoder LLM config?") from None
        except (TypeError, ValueError) as bad:
            raise LazyTrainError(f"model {name!r}: malformed config value ({bad})") from None
        return spec

    @classmethod
    def load(cls, name_or_path: str | Path) -> ModelSpec:
        """A preset name (`qwen2.5-7b`), a `config.json` file, or a model directory holding one."""
        path = Path(name_or_path)
        preset = PRESET_DIR / f"{name_or_path}.json"
        if not path.exists() and preset.exists():
            path, name = preset, str(name_or_path)
        else:
            name = path.parent.name if path.name == "config.json" else path.name
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise LazyTrainError(
                f"model {str(name_or_path)!r}: no such preset or config.json; presets: {', '.join(preset_names())}"
            )
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise LazyTrainError(f"model config {path}: cannot read it as JSON ({err})") from None
        if not isinstance(config, dict):
            raise LazyTrainError(f"model config {path}: expected a JSON object, got {type(config).__name__}")
        return cls.from_config(config, name=name)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))
