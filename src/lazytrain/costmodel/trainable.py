"""Which parameters train (finetuning_type), as counts the cost model prices: full training, LoRA adapters on a
frozen base, or freeze tuning's last layers.

A frozen parameter streams to the device like any other, but its layer's backward runs no weight-gradient GEMM
for it, sends no gradient back, and the host keeps no master, gradient or optimizer state of it: the host holds
it once, in the compute dtype. LoRA adds its adapters (rank r: r x (in + out) per targeted linear) to each
layer's streamed group; they are the layer's only trainable parameters.

QLoRA (`quantized`) holds and streams the decoder layers' linears as bitsandbytes' NF4 with double quantization
(runtime/nf4.py): per linear of n weights, n/2 bytes of 4-bit indices, n/64 bytes of 8-bit absmax codes, an fp32
scale per 256 absmaxes (n/4096 bytes) and an fp32 offset, padded to 4 bytes (`nf4_bytes`): 0.5 + 1/64 + 1/4096 =
~0.516 byte per weight, against bf16's 2. The norms (and an attention's biases) stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.costmodel.model import ModelSpec
from lazytrain.errors import LazyTrainError

FINETUNING_TYPES = ("full", "lora", "freeze")


@dataclass(frozen=True)
class Trainable:
    """kind: full | lora | freeze. lora: `rank` and the `targets` (linear names, ("all",) = every linear of the
    decoder layers). freeze: `layers` (the last n, the first -n), `extra` modules outside the layers that train
    (embed_tokens, norm, lm_head). Freeze tuning of part of a layer (freeze_trainable_modules) is priced as the whole
    layer (an upper bound of its gradient bytes and host state)."""

    kind: str = "full"
    rank: int = 0
    targets: tuple[str, ...] = ("all",)
    layers: int = 0
    extra: tuple[str, ...] = ()
    quantized: bool = False  # lora: the frozen linears of the decoder layers as NF4 (QLoRA)

    def __post_init__(self) -> None:
        if self.kind not in FINETUNING_TYPES:
            raise LazyTrainError(f"finetuning_type {self.kind!r} is not one of {', '.join(FINETUNING_TYPES)}")
        if self.quantized and self.kind != "lora":
            raise LazyTrainError("quantization_bit 4 quantizes a LoRA base: set finetuning_type lora")

    @property
    def full(self) -> bool:
        return self.kind == "full"

    def adapter_params(self, spec: ModelSpec) -> list[int]:
        """Per layer, the LoRA adapters' parameters (0 unless lora): r x (in + out) of each targeted linear."""
        if self.kind != "lora":
            return [0] * spec.num_layers
        return [self.rank * sum(i + o for name, i, o in layer_linears(spec, j)
                                if "all" in self.targets or name in self.targets)
                for j in range(spec.num_layers)]

    def quantized_params(self, spec: ModelSpec) -> list[int]:
        """Per layer, the base weights held as NF4 (0 unless QLoRA): every linear of the layer."""
        if not self.quantized:
            return [0] * spec.num_layers
        return [sum(i * o for _, i, o in layer_linears(spec, j)) for j in range(spec.num_layers)]

    def quantized_bytes(self, spec: ModelSpec) -> list[int]:
        """Per layer, the bytes of its NF4 linears (`nf4_bytes` of each)."""
        if not self.quantized:
            return [0] * spec.num_layers
        return [sum(nf4_bytes(i * o) for _, i, o in layer_linears(spec, j)) for j in range(spec.num_layers)]

    def layer_trainable_params(self, spec: ModelSpec) -> list[int]:
        """Per layer, the parameters that get gradients (and masters, optimizer state)."""
        if self.kind == "full":
            return list(spec.layer_params)
        if self.kind == "lora":
            return self.adapter_params(spec)
        L, n = spec.num_layers, self.layers
        trained = range(max(0, L - n), L) if n > 0 else range(min(-n, L))
        return [p if j in trained else 0 for j, p in enumerate(spec.layer_params)]

    def head_trains(self) -> bool:
        """The final norm and LM head get gradients (full; `extra` naming norm or lm_head)."""
        return self.kind == "full" or bool({"norm", "lm_head"} & set(self.extra))

    def embedding_trains(self, spec: ModelSpec) -> bool:
        return self.kind == "full" or "embed_tokens" in self.extra or (spec.tie_word_embeddings
                                                                        and "lm_head" in self.extra)


def nf4_bytes(numel: int, block: int = 64, absmax_block: int = 256) -> int:
    """Bytes of one NF4 weight of `numel` elements with double quantization (bitsandbytes' block sizes): the 4-bit
    indices, the absmaxes' 8-bit codes, their fp32 scales and the fp32 offset, padded to 4 bytes."""
    blocks = -(-numel // block)
    raw = -(-numel // 2) + blocks + 4 * -(-blocks // absmax_block) + 4
    return -(-raw // 4) * 4


def layer_linears(spec: ModelSpec, j: int) -> list[tuple[str, int, int]]:
    """(name, in, out) of each `nn.Linear` of layer j as transformers builds it: the attention's projections (a
    Gated DeltaNet's in a linear-attention layer) and a dense MLP's (an MoE's routed experts are fused tensors, not
    linears; a shared expert's are)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    if spec.layer_types[j] == "linear_attention":
        key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
        value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
        heads = spec.linear_num_value_heads
        out = [("in_proj_qkv", h, 2 * key_dim + value_dim), ("in_proj_z", h, value_dim), ("in_proj_b", h, heads),
               ("in_proj_a", h, heads), ("out_proj", value_dim, h)]
    else:
        gated = spec.model_type.startswith("qwen3_5")  # gated attention: q_proj also makes the gate
        out = [("q_proj", h, q * (2 if gated else 1)), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h)]
    if not spec.moe_layers[j]:
        width = spec.intermediate_size
    else:
        width = spec.shared_expert_intermediate_size
    if width:
        out += [("gate_proj", h, width), ("up_proj", h, width), ("down_proj", width, h)]
    return out
