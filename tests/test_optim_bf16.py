"""bf16 master weights: stochastic rounding is unbiased, the bf16 step matches torch.optim.AdamW in fp32 in
expectation (where round-to-nearest loses the update), and it is deterministic in (seed, parameter, step)."""

from __future__ import annotations

import pytest
import torch

from lazytrain.optim import Hybrid8bitAdamW
from lazytrain.optim.bf16 import rounding_key, stochastic_round_

N_DRAWS = 400


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 x (equal where x is a bf16 value)."""
    bits = x.view(torch.int32)
    low = (bits & -65536).view(torch.float32)  # truncation: toward zero
    high = ((bits & -65536) + 65536).view(torch.float32)
    exact = low == x
    toward0, away = low, torch.where(exact, low, high)
    return torch.minimum(toward0, away), torch.maximum(toward0, away)


def test_stochastic_rounding_is_unbiased_and_hits_a_neighbour() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.logspace(-3, 3, 4096)
    x[:16] = x[:16].bfloat16().float()  # exact bf16 values must stay exactly
    lo, hi = _bf16_neighbours(x)
    out = torch.empty(N_DRAWS, 4096, dtype=torch.bfloat16)  # copies of x: every element draws its own bits
    stochastic_round_(out, x.repeat(N_DRAWS, 1), rounding_key(0, 0, 1))
    y = out.float()
    assert bool(((y == lo) | (y == hi)).all())
    total = y.double().sum(dim=0)
    assert torch.equal(y[:, :16], x[:16].expand(N_DRAWS, 16))
    ulp = (hi - lo).double().clamp(min=1e-30)
    err = (total / N_DRAWS - x.double()) / ulp  # per element: ~N(0, <= 0.5 / sqrt(N_DRAWS))
    assert float(err[16:].abs().max()) < 6 * 0.5 / N_DRAWS**0.5
    assert abs(float(err[16:].mean())) < 6 * 0.5 / (N_DRAWS * 4080) ** 0.5
    with pytest.raises(ValueError, match="bf16"):
        stochastic_round_(torch.empty(4, dtype=torch.float32), torch.zeros(4), 0)
    first = out[0].clone()
    stochastic_round_(out, x.repeat(N_DRAWS, 1), rounding_key(0, 0, 1))
    assert torch.equal(out[0], first)  # same key, same bits


def test_rounding_key_depends_on_seed_parameter_and_step() -> None:
    keys = {rounding_key(s, i, t) for s in range(3) for i in range(3) for t in range(3)}
    assert len(keys) == 27 and all(0 <= k < 2**32 for k in keys)


@pytest.mark.exactness
@pytest.mark.parametrize("eightbit", [True, False], ids=["8bit-states", "fp32-states"])
def test_bf16_step_matches_fp32_adamw_in_expectation(eightbit: bool) -> None:
    """One step from bf16 weights: each result is a bf16 neighbour of torch.optim.AdamW's fp32 result, and
    their mean over draws is that result. The update (lr 1e-4 on weights ~2) is below half a bf16 step, so
    round-to-nearest (torch AdamW on bf16 weights) loses most of it."""
    gen = torch.Generator().manual_seed(1)
    p0 = (torch.randn(32, 64, generator=gen) + 2.0).bfloat16()  # half a bf16 step: 2^-9..2^-8 of the weight
    g = (torch.randn(32, 64, generator=gen) * 0.01).bfloat16()
    kw = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)
    ref_p = torch.nn.Parameter(p0.float())
    ref_p.grad = g.float()
    torch.optim.AdamW([ref_p], **kw).step()
    ref = ref_p.detach()
    lo, hi = _bf16_neighbours(ref)
    # N_DRAWS copies of the problem side by side in one tensor: every element draws its own rounding bits
    # (the step-1 update is computed before the 8-bit states are quantized, so copies do not interact)
    p = torch.nn.Parameter(p0.repeat(N_DRAWS, 1, 1))
    p.grad = g.repeat(N_DRAWS, 1, 1)
    opt = Hybrid8bitAdamW([p], **kw, max_grad_norm=None, min_8bit_size=0, eightbit_fraction=1.0 if eightbit else 0.0)
    assert opt.state[p]["eightbit"] == eightbit
    opt.step()
    assert p.dtype == torch.bfloat16 and torch.equal(p.grad, g.repeat(N_DRAWS, 1, 1))
    y = p.detach().float()
    assert bool(((y == lo) | (y == hi)).all())
    total = y.double().sum(dim=0)
    ulp = (hi - lo).double()
    err = (total / N_DRAWS - ref.double()) / ulp
    assert float(err.abs().max()) < 6 * 0.5 / N_DRAWS**0.5
    assert abs(float(err.mean())) < 6 * 0.5 / (N_DRAWS * ref.numel()) ** 0.5
    moved = (total / N_DRAWS - p0.double()).abs().mean()
    assert float(moved) > 0.5 * float((ref.double() - p0.double()).abs().mean())  # the update survives
    rtn = torch.nn.Parameter(p0.clone())
    rtn.grad = g.clone()
    torch.optim.AdamW([rtn], **kw).step()
    assert float((rtn.detach() != p0).float().mean()) < 0.1  # round-to-nearest: update mostly lost


@pytest.mark.exactness
def test_bf16_group_order_and_seed() -> None:
    """Stepping group by group in reverse order rounds exactly like step(); another seed rounds differently."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(70, 64), (64,), (5000,)]
    init = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in shapes] for _ in range(3)]

    def run(seed: int, reverse: bool) -> list[torch.Tensor]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = Hybrid8bitAdamW([{"params": ps[:1]}, {"params": ps[1:]}], lr=1e-3, min_8bit_size=1000, seed=seed)
        for g in grads:
            for p, gi in zip(ps, g, strict=True):
                p.grad = gi.clone()
            if reverse:
                coef = opt.begin_step()
                for i in reversed(range(len(opt.param_groups))):
                    opt.step_group(i, coef)
            else:
                opt.step()
        return [p.detach() for p in ps]

    a, b, c = run(0, False), run(0, True), run(1, False)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))


@pytest.mark.exactness
def test_rounding_does_not_depend_on_thread_count() -> None:
    from lazytrain.optim import bf16

    x = torch.randn(3 * bf16.PARALLEL_MIN_NUMEL + 5, generator=torch.Generator().manual_seed(3))
    out = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            dst = torch.empty_like(x, dtype=torch.bfloat16)
            stochastic_round_(dst, x, rounding_key(0, 1, 2))
            out.append(dst)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], x.bfloat16())  # not round-to-nearest
