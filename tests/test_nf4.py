"""QLoRA's NF4 base against bitsandbytes (its CPU build): the same bytes from the same weights, the same weights
back from the same bytes, and the bytes per parameter the cost model counts."""

from __future__ import annotations

import pytest
import torch

from lazytrain.costmodel.trainable import nf4_bytes
from lazytrain.runtime import nf4

SHAPES = [(64, 128), (96, 40), (33, 70), (300, 257), (1, 5)]  # whole blocks, short last blocks, an odd count


def bnb_quantized(w: torch.Tensor):
    F = pytest.importorskip("bitsandbytes.functional")
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return F, q, state


def test_the_tables_are_bitsandbytes() -> None:
    F = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(nf4.dynamic_code(), F.create_dynamic_map())
    assert torch.equal(torch.tensor(nf4.NF4_CODE), F.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_reads_bitsandbytes_bytes_as_bitsandbytes_does(shape) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.05
    F, q, state = bnb_quantized(w)
    data = nf4.layout(q, state.absmax, state.state2.absmax, state.offset)
    assert data.numel() == nf4_bytes(w.numel())
    # the same products of the same fp32 factors (code x scale + offset, then x absmax): bit for bit
    assert torch.equal(nf4.dequantize(data, shape, torch.float32), F.dequantize_4bit(q, state))


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_makes_bitsandbytes_bytes(shape) -> None:
    """The 4-bit indices and the offset are bitsandbytes'; an absmax's 8-bit code is too, except where its value
    lies within rounding of the midpoint between two codes: bitsandbytes' C kernel searches the code table by
    bisection, ours takes the nearest, so where they differ ours is never farther (or both decode the same: a
    single block's absmax less its mean is 0, and its scale 0)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7 * sum(shape))) * 0.05
    _, q, state = bnb_quantized(w)
    ours = nf4.quantize(w)
    n, blocks = w.numel(), state.absmax.numel()
    half = -(-n // 2)
    assert torch.equal(ours[:half], q.reshape(-1))
    codes = ours[half:half + blocks]
    scales = ours[half + blocks:half + blocks + 4 * state.state2.absmax.numel()].clone().view(torch.float32)
    assert torch.equal(scales, state.state2.absmax)
    offset = ours[half + blocks + scales.numel() * 4:][:4].clone().view(torch.float32)
    assert torch.equal(offset, state.offset.reshape(1))
    differ = (codes != state.absmax).nonzero().flatten()
    assert differ.numel() <= max(1, blocks // 100)
    code = nf4.dynamic_code()
    _, absmax = nf4._blockwise(w.reshape(-1).float(), nf4.BLOCK)
    for i in differ.tolist():
        scale, x = float(state.state2.absmax[i // nf4.ABSMAX_BLOCK]), float(absmax[i] - state.offset)
        assert abs(float(code[int(codes[i])]) * scale - x) <= abs(float(code[int(state.absmax[i])]) * scale - x)


def torch_quantize(weight: torch.Tensor) -> torch.Tensor:
    """The first level as torch ops over the whole tensor (what `quantize` was before its compiled kernel)."""
    flat = weight.reshape(-1).float()
    scaled, absmax = nf4._blockwise(flat, nf4.BLOCK)
    q = nf4._nearest(scaled, torch.tensor(nf4.NF4_CODE))
    if q.numel() % 2:
        q = torch.cat([q, q.new_full((1,), nf4.NF4_CODE.index(0.0))])
    offset = absmax.mean()
    scaled2, absmax2 = nf4._blockwise(absmax - offset, nf4.ABSMAX_BLOCK)
    return nf4.layout((q[::2] << 4) | q[1::2], nf4._nearest(scaled2, nf4.dynamic_code()), absmax2, offset)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 127, 4097, 300 * 257, (1 << 16) + 33])  # (the last: threaded)
def test_the_compiled_quantize_makes_the_torch_formulations_bytes(dtype, numel) -> None:
    gen = torch.Generator().manual_seed(numel)
    w = (torch.randn(numel, generator=gen) * torch.rand(1, generator=gen) * 0.1).to(dtype)
    w[:64] = 0  # an all-zero block (absmax 0)
    w[-min(3, numel):] *= 1e4  # outliers: clamped scales, a block of tiny values beside them
    assert torch.equal(nf4.quantize(w), torch_quantize(w))


def test_nf4_linear_forward_and_input_gradient_are_the_dequantized_linears() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(96, 40, bias=True)
    lin = nf4.Nf4Linear(base, torch.float32)
    dense = torch.nn.Linear(96, 40)
    with torch.no_grad():
        dense.weight.copy_(lin.dequantized())
        dense.bias.copy_(base.bias)
    x = torch.randn(5, 96, generator=gen, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn(5, 40, generator=gen)
    (lin(x) * g).sum().backward()
    (dense(x2) * g).sum().backward()
    # the same fp32 matmul of the same operands: only the kernel's summation order may differ (~1e-7 relative)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    assert lin.packed.numel() * 4 == nf4_bytes(96 * 40)
