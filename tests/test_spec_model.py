"""ModelSpec parameter counts against the `transformers` model built from the same config (meta device)."""

from __future__ import annotations

import json
import random

import pytest
from checks import one_line

from lazytrain.costmodel.model import PRESET_DIR, ModelSpec, preset_names
from lazytrain.errors import LazyTrainError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RNG = random.Random(20261202)


def _dims() -> dict:
    """Fresh small shapes each run (seeded), so a count that is right by coincidence is unlikely."""
    heads = RNG.choice([2, 4])
    return {
        "vocab_size": RNG.randrange(300, 700),
        "hidden_size": heads * RNG.choice([8, 16]),
        "intermediate_size": RNG.randrange(40, 120),
        "num_hidden_layers": RNG.randrange(2, 5),
        "num_attention_heads": heads,
        "num_key_value_heads": RNG.choice([1, 2]),
    }


def _configs() -> dict[str, dict]:
    d = _dims()
    linear = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": RNG.choice([8, 12]), "linear_conv_kernel_dim": 4, "head_dim": 16}
    moe = {"num_experts": RNG.choice([4, 8]), "num_experts_per_tok": 2, "moe_intermediate_size": RNG.randrange(16, 40),
           "shared_expert_intermediate_size": RNG.randrange(16, 40)}
    return {
        "llama": {**d, "model_type": "llama"},
        "llama-bias-tied": {**d, "model_type": "llama", "attention_bias": True, "mlp_bias": True,
                            "tie_word_embeddings": True},
        "qwen2": {**d, "model_type": "qwen2"},
        "qwen3": {**d, "model_type": "qwen3", "head_dim": 24},
        "mistral": {**d, "model_type": "mistral", "head_dim": 12},
        "qwen3_moe": {**d, "model_type": "qwen3_moe", "head_dim": 12, "mlp_only_layers": [0],
                      **{k: moe[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}},
        "qwen3_5_text": {**d, "model_type": "qwen3_5_text", "num_hidden_layers": 4, **linear},
        "qwen3_5_moe_text": {**d, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, **linear, **moe},
        "gpt_oss": {**d, "model_type": "gpt_oss", "num_local_experts": RNG.choice([4, 8]), "num_experts_per_tok": 2,
                    "head_dim": 16},
    }


def _hf_counts(cfg: dict) -> tuple[int, list[int]]:
    """Total and per-layer parameter counts of the real module (meta device: no memory, no init cost)."""
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return sum(p.numel() for p in model.parameters()), per_layer


@pytest.mark.parametrize("family", list(_configs()))
def test_param_counts_match_transformers(family: str) -> None:
    cfg = _configs()[family]
    total, per_layer = _hf_counts(cfg)
    spec = ModelSpec.from_config(cfg)
    assert list(spec.layer_params) == per_layer, family
    assert spec.num_params == total, family


def test_moe_active_params_count_top_k_experts() -> None:
    cfg = _configs()["gpt_oss"]
    spec = ModelSpec.from_config(cfg)
    h, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    expert = 3 * h * inter + 2 * inter + h
    for stored, active in zip(spec.layer_params, spec.layer_active_params, strict=True):
        assert stored - active == (experts - 2) * expert
    assert spec.is_moe and spec.num_active_params < spec.num_params


def test_hybrid_layer_types_follow_the_interval() -> None:
    spec = ModelSpec.from_config(_configs()["qwen3_5_text"])
    assert spec.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_multimodal_wrapper_plans_the_language_model() -> None:
    text = _configs()["qwen3_5_text"]
    wrapped = {"model_type": "qwen3_5", "text_config": text, "vision_config": {}, "tie_word_embeddings": False}
    assert ModelSpec.from_config(wrapped).layer_params == ModelSpec.from_config(text).layer_params


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-qwen3.6",
                                    "tiny-gpt-oss"])
def test_tiny_presets_match_transformers(preset: str) -> None:
    spec = ModelSpec.load(preset)
    cfg = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    total, _ = _hf_counts({k: v for k, v in cfg.items() if not k.startswith("_")})
    assert spec.num_params == total


def test_paper_presets_have_the_papers_shapes() -> None:
    spec = ModelSpec.load("qwen3.6-27b")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads,
            spec.intermediate_size) == (64, 5120, 24, 4, 17408)
    assert 26e9 < spec.num_params < 28e9  # language model of a "27B" (the vision tower is not planned)
    for preset, low, high in [("qwen2.5-3b", 3.0e9, 3.2e9), ("qwen2.5-7b", 7.5e9, 7.7e9),
                              ("qwen2.5-14b", 14.6e9, 14.9e9), ("qwen2.5-32b", 32.7e9, 32.8e9),
                              ("llama-3.1-8b", 8.0e9, 8.1e9),
                              ("llama-3.1-70b", 70.5e9, 70.6e9), ("gpt-oss-120b", 116e9, 118e9)]:
        assert low < ModelSpec.load(preset).num_params < high, preset
    oss = ModelSpec.load("gpt-oss-120b")  # OpenAI: 116.8 B total, 5.13 B active (the embedding not counted)
    assert 5.0e9 < oss.num_active_params - oss.embedding_params < 5.3e9


def test_all_presets_load() -> None:
    for preset in preset_names():
        assert ModelSpec.load(preset).num_params > 0


def test_fingerprint_tells_models_apart() -> None:
    a, b = ModelSpec.load("tiny-llama"), ModelSpec.load("tiny-qwen2")
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == ModelSpec.load("tiny-llama").fingerprint()


@pytest.mark.parametrize("bad", [{"model_type": "bert"}, {"model_type": "llama"},
                                 {**_dims(), "model_type": "llama", "hidden_size": "wide"},
                                 {**_dims(), "model_type": "llama", "num_hidden_layers": 0}])
def test_bad_configs_raise_one_line_errors(bad: dict) -> None:
    with pytest.raises(LazyTrainError) as err:
        ModelSpec.from_config(bad)
    one_line(str(err.value))


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(LazyTrainError, match="tiny-llama"):
        ModelSpec.load("no-such-model")
