"""The supported model families: one list, read by the planner (ModelSpec) and the runtime (runtime/hf.py).

A `model_type` the planner accepts is one the executor runs: `ModelSpec` refuses any other, so `lazytrain plan`
never plans what `lazytrain train` cannot train. Adding a family: docs/extending.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One supported causal-LM family: the shape of its layers and what each layer call needs.

    Every layer is called as `layer(hidden, attention_mask=masks[kind], position_embeddings=(cos, sin),
    position_ids=positions)`; `kinds` are the per-layer mask kinds it may use (`config.layer_types` picks
    them per layer; without it every layer is `default_kind`, or sliding when `sliding_from_window` and the
    config sets `sliding_window`).
    """

    name: str
    kinds: tuple[str, ...]
    rotary: str  # how the model's rotary module makes cos/sin (for the docs' table)
    extra: str  # what else its layers hold or need
    packing: bool = True  # can attention and state restart at packed example boundaries
    default_kind: str = "full_attention"
    sliding_from_window: bool = False
    hybrid: bool = False  # linear (Gated DeltaNet) and gated full attention layers (ModelSpec's layer shapes)
    moe: bool = False  # experts: every one stored and streamed, num_experts_per_tok computed

    @property
    def dense(self) -> bool:
        """The Llama layer: attention + gated MLP + 2 norms."""
        return not (self.hybrid or self.moe)


_HYBRID = ("full_attention", "linear_attention")
_LINEAR_NOTE = "Gated DeltaNet layers: the 2D padding mask, no cache; gated full attention with q/k norm"
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", ("full_attention",), "RoPE", "-"),
    "mistral": Family("Mistral", ("full_attention", "sliding_attention"), "RoPE", "sliding window on every layer",
                      sliding_from_window=True),
    "qwen2": Family("Qwen2 / Qwen2.5", ("full_attention", "sliding_attention"), "RoPE",
                    "q/k/v biases; tied embeddings in the small sizes"),
    "qwen3": Family("Qwen3", ("full_attention", "sliding_attention"), "RoPE", "q/k RMSNorm"),
    "qwen3_moe": Family("Qwen3-MoE", ("full_attention", "sliding_attention"), "RoPE",
                        "q/k RMSNorm; router + every expert streamed (mlp_only_layers dense)", moe=True),
    "gpt_oss": Family("GPT-OSS", ("full_attention", "sliding_attention"), "YaRN RoPE",
                      "alternating sliding/full layers, attention sinks, biased experts (every one streamed); eager",
                      moe=True),
    "qwen3_5_text": Family("Qwen3.5 / Qwen3.6", _HYBRID, "partial M-RoPE (text positions)", _LINEAR_NOTE,
                           packing=False, hybrid=True),
    "qwen3_5_moe_text": Family("Qwen3.5 / Qwen3.6 MoE", _HYBRID, "partial M-RoPE (text positions)",
                               _LINEAR_NOTE + "; router, shared expert + every expert streamed", packing=False,
                               hybrid=True, moe=True),
}
# Multimodal checkpoints whose text tower `AutoModelForCausalLM` builds (and loads from their folder): the planner
# plans them as their language model.
TEXT_TOWERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_TYPES = frozenset(FAMILIES) | frozenset(TEXT_TOWERS)


def family_of(model_type: str) -> Family | None:
    """The family of a config.json's `model_type` (a multimodal one's text tower's), or None: not supported."""
    return FAMILIES.get(TEXT_TOWERS.get(model_type, model_type))


def supported_families() -> str:
    """'Llama (llama), Mistral (mistral), ...' for error messages."""
    return ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())
