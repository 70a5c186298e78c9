"""A tiny Llama (random init, no downloads) trained on a synthetic Markov language: all-8-bit states, and
bf16 master weights with stochastic rounding, stay within 2% of the fp32 AdamW loss curve."""

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


def _train(kind: str, steps: int, eval_every: int) -> list[float]:
    """Train from the same init on the same batches; return the held-out loss every `eval_every` steps.

    kind: "fp32" (torch AdamW, clip_grad_norm_), "8bit" (all states 8-bit), "bf16-8bit" / "bf16-fp32"
    (bf16 model: bf16 compute and bf16 master weights with stochastic rounding; 8-bit or fp32 states).
    """
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM(cfg)
    if kind.startswith("bf16"):
        model = model.to(torch.bfloat16)
    if kind == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    else:  # every tensor, norms included, gets 8-bit states (or none)
        fraction = 0.0 if kind == "bf16-fp32" else 1.0
        opt = Hybrid8bitAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0, min_8bit_size=0,
                              eightbit_fraction=fraction)
        assert opt.eightbit_numel == fraction * sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    table = _markov_table(gen)
    curve = []
    for step in range(1, steps + 1):
        ids = _batch(table, gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        if kind == "fp32":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0:
            eval_gen = torch.Generator().manual_seed(2)
            with torch.no_grad():
                batches = [_batch(table, eval_gen) for _ in range(8)]
                curve.append(sum(float(model(input_ids=b, labels=b).loss) for b in batches) / 8)
    return curve


def _check(kinds: tuple[str, ...], steps: int, eval_every: int, start_loss: float = 4.16) -> None:
    """Every point of each kind's held-out loss curve within 2% of fp32 AdamW's (after the first point)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread (no pool wake-ups)
    try:
        fp32 = _train("fp32", steps, eval_every)
        curves = {kind: _train(kind, steps, eval_every) for kind in kinds}
    finally:
        torch.set_num_threads(threads)
    assert fp32[-1] < 0.6 * start_loss, fp32  # it learned something, so the comparison means something
    for kind, curve in curves.items():
        for ours, ref in zip(curve[1:], fp32[1:], strict=True):  # the first point is mid-descent: steep
            assert abs(ours - ref) <= 0.02 * ref, (kind, curve, fp32)


@pytest.mark.exactness
def test_tiny_llama_8bit_matches_fp32_short() -> None:
    _check(("8bit",), steps=100, eval_every=50)


@pytest.mark.exactness
def test_tiny_llama_bf16_master_weights_match_fp32_short() -> None:
    _check(("bf16-8bit", "bf16-fp32"), steps=100, eval_every=50)


@pytest.mark.exactness
@pytest.mark.slow
def test_tiny_llama_8bit_and_bf16_master_match_fp32_300_steps() -> None:
    _check(("8bit", "bf16-8bit", "bf16-fp32"), steps=300, eval_every=50)
