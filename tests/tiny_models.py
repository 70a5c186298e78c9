"""Tiny random-weight causal LMs of every supported family, batches for them, and the plain transformers
forward/backward every executor test compares with (loss and every gradient)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import torch
import transformers as tf

VOCAB = 61
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe"]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def make_model(kind: str, num_layers: int = 6, attn: str = "eager", seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight causal LM of family `kind`, norms drawn at random too (non-trivial gradients)."""
    common = dict(COMMON, num_hidden_layers=num_layers, attn_implementation=attn)
    torch.manual_seed(seed)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, pad_token_id=3))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=12))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=5))
    elif kind == "qwen3_moe":  # experts on every layer but one dense MLP layer
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=12, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=16, mlp_only_layers=[1],
                                                         norm_topk_prob=True))
    elif kind == "gpt_oss":  # alternating sliding-window and full attention, sinks, biased experts
        yarn = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=1.5e5,
                    original_max_position_embeddings=COMMON["max_position_embeddings"] // 32)
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**common, head_dim=8, num_local_experts=4,
                                                     num_experts_per_tok=2, sliding_window=5, rope_parameters=yarn))
    elif kind in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet layers with a full-attention layer every third
        hybrid = dict(common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4,
                      layer_types=[("full_attention" if (i + 1) % 3 == 0 else "linear_attention")
                                   for i in range(num_layers)])
        if kind == "qwen3_5":
            model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**hybrid))
        else:
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
                **hybrid, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    # As LazyTrain builds its training model (runtime/weights.py): no cache. With one, a reference forward takes
    # the decoding path: Gated DeltaNet layers prepend a zero conv state and slice it off again, which sums the
    # conv's backward in another fp32 order (2e-4 apart in dt_bias, whose gradient is a near-cancelling sum).
    model.config.use_cache = False
    return model


def random_labels(ids: torch.Tensor, gen: torch.Generator, ignore_fraction: float = 0.3) -> torch.Tensor:
    """Labels = ids with a random, uneven share of positions ignored (-100), never a whole row."""
    labels = ids.clone()
    drop = torch.rand(ids.shape, generator=gen) < ignore_fraction
    drop[:, -1] = False
    labels[drop] = -100
    return labels


def make_batch(batch: int = 3, seq_len: int = 11, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    return ids, random_labels(ids, gen)


def num_label_tokens(labels: torch.Tensor) -> int:
    """Non-ignored labels after the shift (the first position predicts nothing)."""
    return int((labels[:, 1:] != -100).sum())


def pack(examples: list[torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row: ids, labels (the first token of each example -100: nothing predicts it), positions.
    The tail is padding, positions restarting at 0 (its own block), labels -100."""
    ids = torch.zeros(seq_len, dtype=torch.long)
    labels = torch.full((seq_len,), -100)
    positions = torch.zeros(seq_len, dtype=torch.long)
    start = 0
    for ex in examples:
        n = len(ex)
        ids[start:start + n] = ex
        labels[start + 1:start + n] = ex[1:]
        positions[start:start + n] = torch.arange(n)
        start += n
    positions[start:] = torch.arange(seq_len - start)
    return ids.unsqueeze(0), labels.unsqueeze(0), positions.unsqueeze(0)


def unpacked(examples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same examples as rows of a right-padded batch with an attention mask."""
    width = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(examples):
        ids[r, :len(e)] = e
        mask[r, :len(e)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


class Gradients(dict):
    """name -> a parameter's fp32 gradient from `reference`, with the size of fp32 rounding on these inputs: `rounding`
    (name -> the gradient's distance from the same backward's in float64) and `loss_rounding` (the loss's)."""

    rounding: dict[str, float]
    loss_rounding: float

    def renamed(self, rename: Callable[[str], str]) -> Gradients:
        """The same gradients and rounding under other names (PEFT's wrapper names -> the executor model's)."""
        out = Gradients((rename(n), g) for n, g in self.items())
        out.rounding = {rename(n): r for n, r in self.rounding.items()}
        out.loss_rounding = self.loss_rounding
        return out


def reference(model: torch.nn.Module, **inputs: torch.Tensor) -> tuple[float, Gradients]:
    """The loss and every trainable parameter's gradient of the model's own forward/backward, on a copy of it; run
    again in float64 on another copy (dropout drawing the same masks) for how far fp32 rounding alone moves each one
    (a gradient that is the small residue of terms that cancel, as Gated DeltaNet's dt_bias, is off by 1e-4 of its
    size in transformers' own fp32)."""
    ref = copy.deepcopy(model)
    before = torch.get_rng_state()
    out = ref(**inputs)
    out.loss.backward()
    after = torch.get_rng_state()
    grads = Gradients((n, p.grad.clone()) for n, p in ref.named_parameters() if p.requires_grad)
    exact = copy.deepcopy(model).double()
    if exact._can_set_experts_implementation():
        exact.set_experts_implementation("eager")  # the grouped-mm kernels take no float64
    torch.set_rng_state(before)  # dropout: the float64 run draws the fp32 run's masks ...
    exact_out = exact(**inputs)
    exact_out.loss.backward()
    torch.set_rng_state(after)  # ... and the caller's generator is where the fp32 run alone left it
    rounding = {n: float((grads[n].double() - p.grad).norm()) for n, p in exact.named_parameters() if p.requires_grad}
    # One draw of rounding on a tensor of a few elements (dt_bias: one per head) can come out far below its typical
    # size, and LazyTrain's draw far above it. The same parameter of every layer rounds alike relative to its size,
    # so each gets the largest relative rounding of its kind across the layers (4 to 6 draws instead of one).
    relative: dict[str, float] = {}
    for n, r in rounding.items():
        relative[_role(n)] = max(relative.get(_role(n), 0.0), r / max(float(grads[n].norm()), 1e-30))
    grads.rounding = {n: max(r, relative[_role(n)] * float(grads[n].norm())) for n, r in rounding.items()}
    grads.loss_rounding = abs(float(out.loss.detach()) - float(exact_out.loss.detach()))
    return float(out.loss.detach()), grads


def _role(name: str) -> str:
    """A parameter's name without its layer index: the same tensor of every layer."""
    return re.sub(r"\.\d+\.", ".#.", name)


# LazyTrain's fp32 rounding in its own summation order is a few times transformers' at most (the same operations,
# another order): so the two fp32 results may lie this many times transformers' distance from float64 apart
ROUNDING_FACTOR = 4


def assert_matches(model: torch.nn.Module, loss: float, ref_loss: float, ref_grads: dict[str, torch.Tensor],
                   tol: float = 1e-5) -> None:
    """The loss and every gradient within `tol` (relative; a gradient by its norm) of `reference`'s, or within
    ROUNDING_FACTOR times fp32 rounding's own size on these inputs where `reference` measured it (`Gradients`)."""
    rounding = getattr(ref_grads, "rounding", {})
    loss_bound = max(tol * abs(ref_loss), ROUNDING_FACTOR * getattr(ref_grads, "loss_rounding", 0.0))
    assert abs(float(loss) - ref_loss) <= loss_bound, (float(loss), ref_loss)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{name} is frozen but has a gradient"
            continue
        assert p.grad is not None, name
        scale = float(ref_grads[name].norm())
        err = float((p.grad - ref_grads[name]).norm())
        bound = max(tol * scale, ROUNDING_FACTOR * rounding.get(name, 0.0))
        assert err <= bound, f"{name}: error {err:.2e} (relative {err / max(scale, 1e-30):.2e}) > {bound:.2e}"
