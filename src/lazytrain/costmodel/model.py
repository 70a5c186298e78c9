"""ModelSpec: the shapes of a decoder-only LLM, read from a Hugging Face `config.json`.

Shapes only — no weights, no torch. Everything the planner needs about the model (parameter
counts per layer, bytes of a boundary activation per token) is derived here, so the cost model and
the executor agree on one source. `fingerprint()` identifies the shapes; plan files carry it so a
plan made for another model is refused.

Layer families (costmodel/families.py: the one list, the executor runs the same; counts equal those of the
`transformers` model built from the same config):
- dense (llama, mistral, qwen2, qwen3): attention + gated MLP + 2 RMSNorms;
- hybrid (qwen3_5, qwen3_5_moe): `layer_types` mixes `full_attention` layers (gated
  attention: q_proj is twice as wide, q/k RMSNorm) with `linear_attention` (Gated DeltaNet) layers;
- MoE (gpt_oss, qwen3_moe, qwen3_5_moe): every expert is stored (`layer_params`, what streams over
  the link and what the optimizer updates), only `num_experts_per_tok` experts are computed per token
  (`layer_active_params`, what the FLOPs count).
Multimodal wrappers (qwen3_5 with `text_config`) are planned as their language model; the vision
tower is not counted.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lazytrain.costmodel.families import SUPPORTED_TYPES, TEXT_TOWERS, family_of, supported_families
from lazytrain.errors import LazyTrainError

PRESET_DIR = Path(__file__).parent / "presets"  # the planner's model presets: HF config.json files by name

# The built-in shapes of `model` (Llama, GQA, untied head): `small` is the default job, `debug` is for tests. Their
# vocabulary is the tokenizer's (the default job's BPE, or the byte tokenizer's BYTE_VOCAB ids when planned alone).
BUILT_IN_SHAPES: dict[str, dict[str, int]] = {
    # 12.8 M parameters: 8 layers x 1.57 M + 0.2 M embedding/head (byte vocabulary)
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                  num_key_value_heads=2),
    # 0.2 M parameters: a few seconds per hundred steps on one core
    "debug": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
}
BYTE_VOCAB = 259  # the byte tokenizer's ids (data/corpus.py): 256 bytes + bos, eos, pad

# model_type values by layer shape, from the one list of families (a multimodal type as its text tower's)
DENSE_TYPES = {t for t in SUPPORTED_TYPES if family_of(t).dense}
HYBRID_TYPES = {t for t in SUPPORTED_TYPES if family_of(t).hybrid}
MOE_TYPES = {t for t in SUPPORTED_TYPES if family_of(t).moe}
# `transformers` config defaults for keys a config.json of these families may leave out.
_QWEN_HYBRID_DEFAULTS = {"head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5": _QWEN_HYBRID_DEFAULTS,
    "qwen3_5_text": _QWEN_HYBRID_DEFAULTS,
    "qwen3_5_moe": {**_QWEN_HYBRID_DEFAULTS, "num_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "gpt_oss": {"head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "attention_bias": True,
                "sliding_window": 128},
}
_FAMILY_DEFAULTS["qwen3_5_moe_text"] = _FAMILY_DEFAULTS["qwen3_5_moe"]

# Keys added after plans were first written: left out of the fingerprint while at their default (0, all False).
_NEWER_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "expert_intermediate_size", "shared_expert_intermediate_size", "moe_layers")


def _flat(value: Any) -> tuple:
    return tuple(value) if isinstance(value, list | tuple) else (value,)


# Bounds of validate_model_config: far above any real model (the largest have ~130 layers, 32 Ki hidden,
# ~260 Ki vocabulary), low enough that every count and byte figure stays exact in a float.
MAX_LAYERS = 512
MAX_DIM = 1 << 24
# Integer shape keys: required ones (ModelSpec cannot do without them) and optional ones (checked when set).
_REQUIRED_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_DIMS = ("num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
                  "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "full_attention_interval", "sliding_window", "max_position_embeddings")


_NORM_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "norm_eps")


def validate_model_config(cfg: dict[str, Any], name: str = "model") -> None:
    """Refuse a config whose shapes no model can have, naming the key, before anything is sized or built.

    The one check `lazytrain plan` and `lazytrain train` share (ModelSpec.from_config runs it; the model
    loader runs it on config.json before `transformers` fills in its defaults): the four shape keys present,
    integer sizes (not bool, not 64.5), > 0, at most MAX_DIM (MAX_LAYERS for layers), norm epsilons > 0, heads
    dividing the hidden size (unless head_dim is given) and key/value heads dividing the attention heads. A
    multimodal wrapper is checked on its `text_config`.
    """
    if "text_config" in cfg and "num_hidden_layers" not in cfg and isinstance(cfg["text_config"], dict):
        cfg = cfg["text_config"]
    for key in _REQUIRED_DIMS + _OPTIONAL_DIMS:
        if key in _REQUIRED_DIMS and key not in cfg:
            raise LazyTrainError(f"model {name!r}: its config lacks {key}; is it a decoder LLM config.json?")
        if key not in cfg or (cfg[key] is None and key in _OPTIONAL_DIMS):
            continue
        value, limit = cfg[key], MAX_LAYERS if key == "num_hidden_layers" else MAX_DIM
        if isinstance(value, bool) or not isinstance(value, int):
            raise LazyTrainError(f"model {name!r}: {key} must be a positive integer, got {value!r} in its config")
        if not 0 < value <= limit:
            raise LazyTrainError(f"model {name!r}: {key} {value} is outside 1..{limit}; fix {key} in its config")
    for key in _NORM_EPS_KEYS:  # a norm's epsilon <= 0 divides by zero (or roots a negative) on a zero row
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 < value < math.inf):
            raise LazyTrainError(f"model {name!r}: {key} must be a number > 0 (such as 1e-6), got {value!r} in its "
                                 f"config; fix {key}")
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise LazyTrainError(f"model {name!r}: num_key_value_heads {kv_heads} does not divide num_attention_heads "
                             f"{heads}; fix num_key_value_heads in its config")
    hidden = cfg.get("hidden_size")
    if heads and hidden and not cfg.get("head_dim") and hidden % heads:
        raise LazyTrainError(f"model {name!r}: num_attention_heads {heads} does not divide hidden_size {hidden} "
                             "(and no head_dim is given); fix num_attention_heads or set head_dim in its config")


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
    # Per layer: "full_attention", "linear_attention" (Gated DeltaNet, no seq^2 term) or
    # "sliding_attention" (attends to at most `sliding_window` tokens). Dense models: all full.
    layer_types: tuple[str, ...] = field(default=())
    sliding_window: int | None = None
    num_experts: int = 0  # MoE: experts stored per layer (0 = dense MLP)
    num_experts_per_tok: int = 0  # MoE: experts computed per token
    # Gated DeltaNet shapes of the linear-attention layers (0 when there are none): the cost model's
    # recurrence FLOPs and working set (q and k are repeated to the value heads).
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # MoE widths (0 when dense): one routed expert's intermediate size (moe_intermediate_size; GPT-OSS's
    # intermediate_size) and the shared expert's; per layer, whether its MLP is the routed experts (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step keep some dense, of `intermediate_size`). The working-set formulas
    # count the routed experts at their own width.
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = field(default=())
    # Attention that materializes batch x heads x seq^2 scores: attn_implementation "eager" (GPT-OSS always,
    # transformers has no SDPA for its sinks). How the model runs, not a shape: not in the fingerprint.
    eager_attention: bool = False

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
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        object.__setattr__(self, "layer_params", tuple(self.layer_params))
        object.__setattr__(self, "layer_active_params", tuple(self.layer_active_params))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers) or (self.is_moe,) * self.num_layers)
        if len(self.layer_params) != self.num_layers or len(self.layer_active_params) != self.num_layers:
            raise LazyTrainError(f"model {self.name!r}: per-layer parameter counts do not match num_layers")
        if len(self.layer_types) != self.num_layers:
            raise LazyTrainError(
                f"model {self.name!r}: {len(self.layer_types)} layer_types for {self.num_layers} layers"
            )
        if len(self.moe_layers) != self.num_layers:
            raise LazyTrainError(f"model {self.name!r}: {len(self.moe_layers)} moe_layers for {self.num_layers} layers")

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
        """All stored parameters (every expert of an MoE), as `transformers` counts them."""
        return self.embedding_params + sum(self.layer_params) + self.head_params

    @property
    def num_active_params(self) -> int:
        """Parameters one token multiplies (top-k experts of an MoE); equals num_params when dense."""
        return self.embedding_params + sum(self.layer_active_params) + self.head_params

    @property
    def streamed_group_params(self) -> list[int]:
        """Parameters of each group the executor streams: layer 0..L-1, then the head (with a tied embedding)."""
        return [*self.layer_params, self.head_params + (self.embedding_params if self.tie_word_embeddings else 0)]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ---- identity ---------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Stable hash of the shapes (not the name): two specs with equal shapes are the same model."""
        shapes = {k: v for k, v in asdict(self).items()  # keys at their default absent: older hashes stand
                  if k not in ("name", "eager_attention") and not (k in _NEWER_KEYS and not any(_flat(v)))}
        return hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any] | Any, name: str | None = None) -> ModelSpec:
        """From a config dict or a `transformers.PretrainedConfig` (anything with `to_dict()`)."""
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        attention = getattr(config, "_attn_implementation", None) or cfg.get("attn_implementation")
        if "text_config" in cfg and "num_hidden_layers" not in cfg:  # multimodal wrapper: plan the LM
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        model_type = cfg.get("model_type")
        name = name or cfg.get("_name_or_path") or model_type or "model"
        validate_model_config(cfg, name)
        window = _dense_window(cfg, model_type)  # before the defaults: a null sliding_window means none
        cfg = {**_FAMILY_DEFAULTS.get(str(model_type), {}), **{k: v for k, v in cfg.items() if v is not None}}
        if model_type not in SUPPORTED_TYPES:
            raise LazyTrainError(
                f"model {name!r}: model_type {model_type!r} is not supported (the executor cannot train it); "
                f"supported: {supported_families()}, and the multimodal {', '.join(TEXT_TOWERS)} as their text tower"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            num_layers = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            if model_type in DENSE_TYPES:
                types = cfg.get("layer_types") or ["sliding_attention" if window and i >= window[1] else
                                                   "full_attention" for i in range(num_layers)]
                extra: dict[str, Any] = {"layer_types": tuple(types)[:num_layers],
                                         "sliding_window": window[0] if window else None}
            else:
                extra = _hybrid_moe_layers(cfg, model_type, num_layers, hidden, heads, head_dim)
            spec = cls(
                name=str(name),
                model_type=model_type,
                num_layers=num_layers,
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                intermediate_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                attention_out_bias=model_type in ("llama", "gpt_oss") and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)) and model_type in DENSE_TYPES,
                qk_norm=model_type in ("qwen3", "qwen3_moe") or model_type in HYBRID_TYPES,
                eager_attention=attention == "eager" or model_type == "gpt_oss",
                **extra,
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


def _dense_window(cfg: dict[str, Any], model_type: str) -> tuple[int, int] | None:
    """A dense family's sliding window and its first windowed layer, as `transformers` configs set them (the
    runtime's masks follow the same keys, runtime/hf.py): Mistral windows every layer (4096 when the key is
    absent, none when null); Qwen2/Qwen3 only with use_sliding_window, from layer max_window_layers on."""
    if model_type == "mistral":
        window = cfg.get("sliding_window", 4096)
        return (int(window), 0) if window else None
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        return int(cfg["sliding_window"]), int(cfg.get("max_window_layers") or 0)
    return None


def _hybrid_moe_layers(cfg: dict[str, Any], model_type: str, num_layers: int, hidden: int, heads: int,
                       head_dim: int) -> dict[str, Any]:
    """Per-layer stored/active parameter counts and layer types of the hybrid and MoE families.

    Mirrors the module shapes of `transformers` (modeling_qwen3_5, modeling_qwen3_5_moe,
    modeling_gpt_oss); tests compare against the real modules built on the meta device.
    """
    h, kv_heads = hidden, int(cfg.get("num_key_value_heads") or heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = bool(cfg.get("attention_bias", False))
    hybrid = model_type in HYBRID_TYPES
    if hybrid:
        interval = int(cfg.get("full_attention_interval", 4))
        default_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    elif model_type == "gpt_oss":  # alternates sliding and full attention
        default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    else:  # qwen3_moe: Qwen3's attention everywhere
        default_types = ["full_attention"] * num_layers
    layer_types = list(cfg.get("layer_types") or default_types)

    # Full attention. Qwen3.5/Next: gated attention (q_proj emits query and gate: 2x wide), q/k RMSNorm.
    # GPT-OSS: biases on q/k/v/o (attention_bias) and one learned attention sink per head.
    q_out = 2 * q if hybrid else q
    full_attn = h * q_out + 2 * h * kv + q * h
    if bias:
        full_attn += q_out + 2 * kv + h
    full_attn += heads if model_type == "gpt_oss" else 2 * head_dim  # the sinks, or the q/k norm

    # Linear attention (Gated DeltaNet): q/k/v (+z gate, + b/a) input projections, a depthwise causal conv over
    # q/k/v, dt_bias and A_log per value head, a gated RMSNorm over the value head dim, the output projection.
    key_dim = int(cfg.get("linear_num_key_heads", 16)) * int(cfg.get("linear_key_head_dim", 128))
    v_heads = int(cfg.get("linear_num_value_heads", 32))
    v_head_dim = int(cfg.get("linear_value_head_dim", 128))
    value_dim = v_heads * v_head_dim
    conv_dim = 2 * key_dim + value_dim
    linear_attn = (h * (conv_dim + value_dim + 2 * v_heads)  # in_proj_qkv(z) + in_proj_b/a (or _ba)
                   + conv_dim * int(cfg.get("linear_conv_kernel_dim", 4))  # conv1d, no bias
                   + 2 * v_heads + v_head_dim  # dt_bias, A_log, norm
                   + value_dim * h)  # out_proj

    # MLP: dense gated MLP, or a router plus experts (+ a shared expert for Qwen).
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if model_type in MOE_TYPES else 0
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0) if experts else 0
    dense_mlp = 3 * h * int(cfg.get("intermediate_size") or 0)
    inter = shared_inter = 0  # one routed expert's and the shared expert's widths
    if model_type == "gpt_oss":
        inter = int(cfg["intermediate_size"])
        expert = 3 * h * inter + 2 * inter + h  # gate_up (+bias 2I) and down (+bias h)
        router, shared = experts * h + experts, 0
    elif experts:
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        expert = 3 * h * inter
        router = experts * h
        shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
        shared = 3 * h * shared_inter + h if shared_inter else 0  # shared expert + its sigmoid gate
    sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])

    stored, active, moe_layers = [], [], []
    for i, kind in enumerate(layer_types):
        attn = linear_attn if kind == "linear_attention" else full_attn
        moe_layers.append(bool(experts) and i not in mlp_only and (i + 1) % sparse_step == 0)
        if moe_layers[-1]:
            mlp_stored = router + experts * expert + shared
            mlp_active = router + top_k * expert + shared
        else:
            mlp_stored = mlp_active = dense_mlp
        stored.append(attn + mlp_stored + 2 * h)  # + input and post-attention RMSNorm
        active.append(attn + mlp_active + 2 * h)
    return {
        "layer_params": tuple(stored),
        "layer_active_params": tuple(active),
        "layer_types": tuple(layer_types),
        "sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "expert_intermediate_size": inter,
        "shared_expert_intermediate_size": shared_inter,
        "moe_layers": tuple(moe_layers),
        **({"linear_num_key_heads": int(cfg.get("linear_num_key_heads", 16)), "linear_num_value_heads": v_heads,
            "linear_key_head_dim": int(cfg.get("linear_key_head_dim", 128)), "linear_value_head_dim": v_head_dim}
           if "linear_attention" in layer_types else {}),
    }


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def built_in_config(name: str, vocab_size: int = BYTE_VOCAB) -> dict[str, Any]:
    """The config of the built-in shape `name` (BUILT_IN_SHAPES) with this vocabulary: a Llama, untied head."""
    return {"model_type": "llama", "vocab_size": vocab_size, "tie_word_embeddings": False, **BUILT_IN_SHAPES[name]}
