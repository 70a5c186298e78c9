"""Tiny random-weight causal LMs of every supported family, and batches for them (shared by the executor tests)."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 61
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
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def random_labels(ids: torch.Tensor, gen: torch.Generator, ignore_fraction: float = 0.3) -> torch.Tensor:
    """Labels = ids with a random, uneven share of positions ignored (-100), never a whole row."""
    labels = ids.clone()
    drop = torch.rand(ids.shape, generator=gen) < ignore_fraction
    drop[:, -1] = False
    labels[drop] = -100
    return labels


def make_batch(batch: int, seq_len: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    return ids, random_labels(ids, gen)


def num_label_tokens(labels: torch.Tensor) -> int:
    """Non-ignored labels after the shift (the first position predicts nothing)."""
    return int((labels[:, 1:] != -100).sum())
