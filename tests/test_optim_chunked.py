"""Updates in chunks (optim/chunked.py): bit for bit torch.optim.AdamW (fused, after clip_grads_with_norm_) and the
unchunked Hybrid8bitAdamW update, from kept bf16 or fp32 gradients, with clipping, weight decay, bf16 masters with
stochastic rounding and non-finite skips; the transients stay within the chunk buffers."""

from __future__ import annotations

import pytest
import torch

import lazytrain.optim.chunked as chunked
from lazytrain.costmodel.cost import UPDATE_CHUNK_NUMEL
from lazytrain.optim import Hybrid8bitAdamW
from lazytrain.optim.bf16 import rounding_key, stochastic_round_
from lazytrain.optim.chunked import CHUNK_NUMEL, Scratch, clip_coefficient_tensor, step_adamw

SHAPES = [(70_001,), (300, 77), (5,), (4096, 3)]  # several chunks of 4096, odd tails, one smaller than a chunk
SMALL_CHUNK = 4096  # a multiple of the 8-bit block (256) and of torch's 64-byte units, as CHUNK_NUMEL is


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Fresh random gradients of one step (global norm ~20: clipping at 1.0 acts), kept in `dtype`."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen) * 0.05).to(dtype) for s in SHAPES]


def _equal_states(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            va, vb = sa[key], sb[key]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, key


@pytest.mark.exactness
@pytest.mark.parametrize("kept", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_norm", [1.0, 0.0])
def test_step_adamw_equals_torch_adamw_bit_for_bit(monkeypatch, kept, max_norm):
    """20 steps, learning rate changing, weight decay on one group: parameters and states equal torch's fused AdamW
    stepped on fp32 `.grad`s after clip_grads_with_norm_, bit for bit."""
    monkeypatch.setattr(chunked, "CHUNK_NUMEL", SMALL_CHUNK)
    ref_params, params = _params(torch.float32), _params(torch.float32)
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(groups(params), lr=1e-2, fused=True)
    scratch = Scratch()
    for step in range(20):
        grads = _grads(step, kept)
        kept_copy = [g.clone() for g in grads]
        norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        lr = 1e-2 * (0.9 ** step)
        for o in (ref, opt):
            for group in o.param_groups:
                group["lr"] = lr
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.to(torch.float32, copy=True)
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(ref_params, max_norm, torch.tensor(norm), foreach=True)
        ref.step()
        coef = clip_coefficient_tensor(max_norm, norm) if max_norm else None
        step_adamw(opt, [0, 1], dict(zip(params, grads, strict=True)), coef, scratch)
        if kept == torch.bfloat16:  # cast chunk by chunk, the kept gradient untouched (an fp32 one is clipped in place)
            assert all(torch.equal(g, c) for g, c in zip(grads, kept_copy, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))
    _equal_states(opt, ref)
    assert all(b.numel() <= SMALL_CHUNK for b in scratch._buffers.values())
    assert bool(scratch._buffers) == (kept == torch.bfloat16)


def _hybrid(params: list[torch.nn.Parameter], fraction: float) -> Hybrid8bitAdamW:
    return Hybrid8bitAdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                           lr=3e-3, eightbit_fraction=fraction, min_8bit_size=256, max_grad_norm=1.0, seed=7)


@pytest.mark.exactness
@pytest.mark.parametrize(("masters", "kept"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_hybrid8bit_chunked_equals_unchunked_bit_for_bit(monkeypatch, masters, kept, fraction):
    """Hybrid8bitAdamW from kept gradients in chunks of 4096 against the same optimizer given whole gradients in
    the masters' dtype, one chunk per tensor (what it got before: the executor's whole-group cast; fp32 masters then
    take the direct path, no copy), 12 steps with clipping and weight decay, one of them non-finite (skipped by
    both): parameters (bf16 ones rounded stochastically) and states equal bit for bit."""
    whole_params, params = _params(masters), _params(masters)
    whole, opt = _hybrid(whole_params, fraction), _hybrid(params, fraction)
    for step in range(12):
        grads = _grads(step, kept)
        if step == 5:
            grads[1][3, 4] = float("inf")
        norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        whole_grads = [g.to(masters) for g in grads]
        for o, ps, gs, chunk in ((whole, whole_params, whole_grads, 1 << 40), (opt, params, grads, SMALL_CHUNK)):
            monkeypatch.setattr(chunked, "CHUNK_NUMEL", chunk)
            coef = o.begin_step(grad_norm=norm)
            if coef is None:
                assert step == 5
                continue
            for k in range(len(o.param_groups)):
                o.step_group(k, coef, grads=dict(zip(ps, gs, strict=True)))
    assert whole.skipped_steps == opt.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(params, whole_params, strict=True))
    _equal_states(opt, whole)
    assert all(b.numel() <= SMALL_CHUNK for b in opt._scratch._buffers.values())
    assert not torch.equal(params[0].float(), _params(masters)[0].float())  # it did train


@pytest.mark.exactness
def test_a_tensor_larger_than_a_chunk_updates_as_one_whole_tensor():
    """bf16 masters with fp32 states stepped through `.grad` (the optimizer's own API) at the real CHUNK_NUMEL: a
    tensor of two chunks ends exactly as the whole-tensor update (one fp32 copy, one fused AdamW call, one rounding
    pass whose bits follow each element's index in the tensor), and the scratch stays one chunk. 8-bit states take
    no scratch at all (one pass, optim/quant.py)."""
    n = CHUNK_NUMEL + 1000
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16())
    p.grad = (torch.randn(n, generator=gen) * 0.01).bfloat16()
    expected = p.detach().clone()
    opt = Hybrid8bitAdamW([p], lr=1e-3, max_grad_norm=None, seed=11, eightbit_fraction=0.0)
    opt.step(grad_norm=1.0)
    work, m, v = expected.float(), torch.zeros(n), torch.zeros(n)
    torch._fused_adamw_([work], [p.grad.float()], [m], [v], [], [torch.tensor(1.0)], lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    stochastic_round_(expected, work, rounding_key(11, 0, 1))
    assert torch.equal(p.detach(), expected)
    assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
    assert opt._scratch._buffers["grad"].numel() == opt._scratch._buffers["param"].numel() == CHUNK_NUMEL
    eightbit = Hybrid8bitAdamW([p], lr=1e-3)
    eightbit.step(grad_norm=1.0)
    assert eightbit.state[p]["eightbit"] and not eightbit._scratch._buffers


def test_the_cost_models_chunk_is_the_optimizers():
    assert CHUNK_NUMEL == UPDATE_CHUNK_NUMEL and CHUNK_NUMEL % 256 == 0 and CHUNK_NUMEL % 16 == 0
