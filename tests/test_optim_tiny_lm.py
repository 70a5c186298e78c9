"""A tiny Llama (random init, no downloads) trained on a synthetic Markov language: all-8-bit states
end within 2% of the fp32 AdamW loss."""

from __future__ import annotations

import pytest
import torch

from lazytrain.optim import Hybrid8bitAdamW

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 32, 16


def _markov_table(gen: torch.Generator) -> torch.Tensor:
    """Each token has 4 likely successors: a learnable language with ~1.3 nats entropy."""
    probs = torch.full((VOCAB, VOCAB), 0.02 / VOCAB)
    for t in range(VOCAB):
        nxt = torch.randperm(VOCAB, generator=gen)[:4]
        probs[t, nxt] += torch.tensor([0.5, 0.25, 0.15, 0.08])
    return probs / probs.sum(dim=1, keepdim=True)


def _batch(table: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    tok = torch.randint(VOCAB, (BATCH,), generator=gen)
    out = [tok]
    for _ in range(SEQ - 1):
        tok = torch.multinomial(table[tok], 1, generator=gen).squeeze(1)
        out.append(tok)
    return torch.stack(out, dim=1)  # (B, T)


def _train(eightbit: bool, steps: int) -> float:
    """Train from the same init on the same batches; return the loss on held-out batches."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM(cfg)
    if eightbit:  # every tensor, norms included, gets 8-bit states
        opt = Hybrid8bitAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, min_8bit_size=0)
        assert opt.eightbit_numel == sum(p.numel() for p in model.parameters())
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    table = _markov_table(gen)
    for _ in range(steps):
        ids = _batch(table, gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        if not eightbit:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    eval_gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        return sum(float(model(input_ids=(b := _batch(table, eval_gen)), labels=b).loss) for _ in range(8)) / 8


def _check(steps: int, start_loss: float = 4.16) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread (no pool wake-ups)
    try:
        fp32, eight = _train(False, steps), _train(True, steps)
    finally:
        torch.set_num_threads(threads)
    assert fp32 < 0.6 * start_loss, fp32  # it learned something, so the comparison means something
    assert abs(eight - fp32) <= 0.02 * fp32, (eight, fp32)


def test_tiny_llama_8bit_matches_fp32_short() -> None:
    _check(steps=100)


@pytest.mark.slow
def test_tiny_llama_8bit_matches_fp32_300_steps() -> None:
    _check(steps=300)
