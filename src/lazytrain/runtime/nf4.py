"""QLoRA's frozen base: the decoder layers' linears stored as bitsandbytes' NF4 with double quantization
(`BitsAndBytesConfig(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`), streamed packed and
dequantized on the device, one linear at a time, inside its matmul.

NF4 stores each block of 64 weights as 4-bit indices into a fixed 16-value table, times the block's absmax.
Double quantization stores those absmaxes (less their mean, `offset`) 8-bit blockwise too: indices into
bitsandbytes' signed dynamic map, times one fp32 absmax per 256 of them. A weight of n elements costs
n/2 + n/64 + 4n/(64*256) + 4 bytes (costmodel/trainable.py `nf4_bytes`): ~0.516 byte per parameter, a quarter of bf16's.

The quantized linear keeps its bytes in one frozen parameter, the bytes reinterpreted in the compute dtype
(`Nf4Linear.packed`): the executor packs, streams and slots it like any frozen parameter (a copy moves bits,
never values), and the forward reads it back as bytes. The backward dequantizes again rather than keeping the
dequantized weight alive between the passes (bitsandbytes' MatMul4Bit does the same), so a layer on the device
holds its packed bytes and one dequantized linear at a time. The arithmetic is bitsandbytes' reference
(`backends/default/ops.py`): the dequantization in torch, so it runs wherever the executor does; the quantization,
once per weight at load, in a compiled host kernel for the blocks of 64 (the rest in torch). The tests check both
against bitsandbytes' own `quantize_4bit` / `dequantize_4bit`.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from numba import carray, cfunc, njit, types
from numba.core.ccallback import CFunc
from torch import nn

from lazytrain.costmodel.trainable import nf4_bytes
from lazytrain.optim import precompile
from lazytrain.optim.parallel import address, fetch_add, num_threads, run_parallel
from lazytrain.optim.quant import load_fp32
from lazytrain.runtime.adapters import decoder_layers
from lazytrain.runtime.weights import host_value

BLOCK = 64  # weights per absmax (bnb_4bit's default blocksize)
ABSMAX_BLOCK = 256  # absmaxes per fp32 scale in the double quantization (bitsandbytes' nested blocksize)
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)  # bitsandbytes' NF4 table (normal quantiles), ascending


@cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map()`): the double quantization's code, 256 values
    ascending, each exponent decade split linearly. Made once (read-only)."""
    data: list[float] = []
    for i in range(7):  # 7 exponent bits: decades 1e-6 .. 1, 2**i fraction steps in decade i
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _blockwise(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`flat` scaled by its absmax per `block` (the last block may be short), clamped to [-1, 1]; and the absmaxes."""
    n = flat.numel()
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    absmax = padded.abs().max(dim=1).values
    scaled = torch.clamp(padded * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).reshape(-1)[:n]
    return scaled, absmax


def _nearest(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(x, (code[:-1] + code[1:]) / 2).to(torch.uint8)


# ---- the first level, compiled -----------------------------------------------------------------------
# Quantizing a 70B base touches 70e9 weights once, at load: the blocks of 64 go through a compiled kernel on
# torch's OpenMP threads (optim/parallel.py), one pass over the weight in the dtype it was loaded in (bf16 bits or
# fp32), with torch's arithmetic step for step: absmax = max |x|, r = 1 / max(absmax, 1e-38) (fp32, correctly
# rounded as torch's reciprocal), x * r, and the index of the nearest NF4 value = how many midpoints between the
# table's neighbours lie below it (`torch.bucketize`'s count; clamping x * r to [-1, 1] first changes no count, the
# midpoints all lie inside). The result is the bytes the torch formulation made (tests/test_nf4.py checks it).
_MIDS = ((lambda c: (c[:-1] + c[1:]) / 2)(torch.tensor(NF4_CODE))).numpy()  # fp32 (a constant in the kernel)
_ZERO_INDEX = NF4_CODE.index(0.0)  # an odd count's pad nibble: 0, as bitsandbytes
PARALLEL_MIN_NUMEL = 1 << 16  # smaller weights are quantized on the calling thread
_EXACT_FASTMATH = {"nnan", "ninf", "nsz"}  # what changes no result here: finite weights (checked at load)


@njit(cache=True, fastmath=_EXACT_FASTMATH, error_model="numpy", inline="always")
def _nf4_blocks(src, packed, absmax, n, b_first, b_last, scratch):  # pragma: no cover - compiled
    """Blocks [b_first, b_last) of `src` (n elements): their absmaxes and packed 4-bit indices (first one high).
    `scratch`: a block's indices (uint8), so that the index loop runs in vectors."""
    for b in range(b_first, b_last):
        start = b * BLOCK
        end = min(n, start + BLOCK)
        m = np.float32(0.0)
        for i in range(start, end):
            m = max(m, abs(load_fp32(src, i)))
        absmax[b] = m
        r = np.float32(1.0) / max(m, np.float32(1e-38))
        for i in range(end - start):
            x = load_fp32(src, start + i) * r
            q = np.uint8(0)
            for k in range(15):  # (no branch)
                q += np.uint8(x > _MIDS[k])
            scratch[i] = q
        if (end - start) % 2:  # an odd count's pad nibble (the weight's last block)
            scratch[end - start] = _ZERO_INDEX
        half = start // 2
        for j in range((end - start + 1) // 2):
            packed[half + j] = (scratch[2 * j] << 4) | scratch[2 * j + 1]


_NF4_ARGS = np.dtype([("next_item", np.int64), ("src", np.int64), ("packed", np.int64), ("absmax", np.int64),
                      ("numel", np.int64), ("blocks", np.int64), ("chunk", np.int64)], align=True)


@njit(cache=True, fastmath=_EXACT_FASTMATH, error_model="numpy", inline="always")
def _take_blocks(data, a, src):  # pragma: no cover - compiled
    """Work items (`chunk` blocks each) until none are left (optim/parallel.py)."""
    packed = carray(address(a.packed), (a.numel + 1) // 2, np.uint8)
    absmax = carray(address(a.absmax), a.blocks, np.float32)
    scratch = np.empty(BLOCK, np.uint8)
    while True:
        first = fetch_add(data, a.chunk)
        if first >= a.blocks:
            return
        _nf4_blocks(src, packed, absmax, a.numel, first, min(a.blocks, first + a.chunk), scratch)


def _nf4_kernel_fp32(data):  # pragma: no cover - compiled (cfunc, see _kernel)
    a = carray(data, 1, _NF4_ARGS)[0]
    _take_blocks(data, a, carray(address(a.src), a.numel, np.float32))


def _nf4_kernel_bf16(data):  # pragma: no cover - compiled (cfunc, see _kernel): bf16 weights as their bits
    a = carray(data, 1, _NF4_ARGS)[0]
    _take_blocks(data, a, carray(address(a.src), a.numel, np.uint16))


@cache
def _kernel(bf16: bool) -> CFunc:
    precompile.wait()
    return cfunc(types.void(types.voidptr), cache=True, fastmath=_EXACT_FASTMATH, error_model="numpy")(
        _nf4_kernel_bf16 if bf16 else _nf4_kernel_fp32)


def compile_kernels() -> None:
    """Into numba's disk cache (optim/precompile.py's child)."""
    _kernel(bf16=True)
    _kernel(bf16=False)


def _first_level(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 4-bit indices, fp32 absmax per block of 64) of a host weight."""
    flat = weight.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.float()
    flat = flat.contiguous()
    n, blocks = flat.numel(), -(-flat.numel() // BLOCK)
    packed, absmax = torch.empty(-(-n // 2), dtype=torch.uint8), torch.empty(blocks, dtype=torch.float32)
    bf16 = flat.dtype == torch.bfloat16
    src = flat.view(torch.int16).numpy().view(np.uint16) if bf16 else flat.numpy()
    threads = 1 if n < PARALLEL_MIN_NUMEL else num_threads()
    args = np.array([(0, src.ctypes.data, packed.data_ptr(), absmax.data_ptr(), n, blocks,
                      max(16, -(-blocks // (8 * threads))))], dtype=_NF4_ARGS)
    run_parallel(_kernel(bf16), args, threads)
    return packed, absmax


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (on the host) as NF4 with double quantization, as the flat bytes `dequantize` reads: the packed
    indices (two per byte, the first in the high nibble), the absmaxes' 8-bit codes, their fp32 scales, the fp32
    offset."""
    packed, absmax = _first_level(weight)
    offset = absmax.mean()
    scaled2, absmax2 = _blockwise(absmax - offset, ABSMAX_BLOCK)
    return layout(packed, _nearest(scaled2, dynamic_code()), absmax2, offset)


def layout(packed: torch.Tensor, codes: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The parts of a quantized weight (bitsandbytes' `QuantState`: packed indices, absmax codes, the nested
    absmax, the offset) one after the other in `nf4_bytes` bytes."""
    parts = [packed.reshape(-1), codes.reshape(-1), absmax2.float().reshape(-1).view(torch.uint8),
             offset.float().reshape(1).view(torch.uint8)]
    total = sum(p.numel() for p in parts)
    out = torch.zeros(-(-total // 4) * 4, dtype=torch.uint8)  # nf4_bytes: the parts, padded to 4 bytes
    torch.cat(parts, out=out[:total])
    return out


def dequantize(data: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The weight `quantize` stored in the bytes `data` (any dtype's view of them, on any device), in `dtype`."""
    raw = data.reshape(-1).view(torch.uint8)
    n = 1
    for d in shape:
        n *= d
    blocks, half = -(-n // BLOCK), -(-n // 2)
    scales = -(-blocks // ABSMAX_BLOCK)
    packed, codes = raw[:half], raw[half:half + blocks]
    tail = raw[half + blocks:half + blocks + 4 * scales + 4].clone()  # (floats from an unaligned byte offset)
    absmax2, offset = tail[:4 * scales].view(torch.float32), tail[4 * scales:].view(torch.float32)
    absmax = dynamic_code().to(raw.device)[codes.long()]
    absmax = (torch.nn.functional.pad(absmax, (0, scales * ABSMAX_BLOCK - blocks)).view(scales, ABSMAX_BLOCK)
              * absmax2.view(-1, 1)).reshape(-1)[:blocks] + offset
    q = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n].int()  # (int32: half int64's bytes)
    values = torch.tensor(NF4_CODE, device=raw.device)[q]
    del q
    if n % BLOCK:
        values = torch.nn.functional.pad(values, (0, blocks * BLOCK - n))
    values.view(blocks, BLOCK).mul_(absmax.view(-1, 1))  # in place: the transient is one fp32 copy
    return values[:n].view(shape).to(dtype)


class _Nf4Matmul(torch.autograd.Function):
    """x @ dequantize(packed).T: only x gets a gradient (the base is frozen), and the backward dequantizes again
    instead of saving the full-width weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(packed)
        ctx.shape = shape
        return torch.nn.functional.linear(x, dequantize(packed, shape, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        return grad @ dequantize(packed, ctx.shape, grad.dtype), None, None


class Nf4Linear(nn.Module):
    """A frozen linear whose weight is NF4 bytes (`packed`, reinterpreted in the compute dtype); its bias, if any,
    stays as it is (bitsandbytes does not quantize biases)."""

    def __init__(self, base: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        weight = base.weight  # (meta on a rank that maps the node's shared copy: its size alone)
        data = (torch.empty(nf4_bytes(weight.numel()), dtype=torch.uint8, device="meta") if weight.is_meta
                else quantize(host_value(weight)))
        self.packed = nn.Parameter(data.view(dtype), requires_grad=False)
        self.bias = base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Nf4Matmul.apply(x, self.packed, (self.out_features, self.in_features))
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.packed, (self.out_features, self.in_features), dtype)


def quantized_linears(model: nn.Module) -> set[str]:
    """The names of the weights `quantize_base` will quantize (every linear's of the decoder layers): loaded, they
    may stay in the model's file (`load_model`'s `defer`) until each is quantized, so the process never holds the
    whole base in bf16 (a 70B base's 140 GB) beside its NF4 bytes."""
    prefix = next(name for name, m in model.named_modules() if m is decoder_layers(model))
    return {f"{prefix}.{j}.{name}.weight" for j, layer in enumerate(decoder_layers(model))
            for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def quantize_base(model: nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """Replace every frozen `nn.Linear` of the decoder layers (a LoRA linear's base included) with an `Nf4Linear`
    whose bytes are held in `dtype`, one at a time (a weight still in the model's file is read for it); returns
    how many linears, and how many weights they hold."""
    count = weights = 0
    for layer in decoder_layers(model):
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                parent_name, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent_name) if parent_name else layer, child, Nf4Linear(module, dtype))
                count, weights = count + 1, weights + module.weight.numel()
    return count, weights
