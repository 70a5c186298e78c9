"""Stochastic rounding of fp32 values to bf16 (the bf16 master-weight mode of Hybrid8bitAdamW).

Why: with bf16 master weights an update smaller than half a bf16 step (2^-8 of the weight) is lost
by round-to-nearest, so small learning rates stall. Rounding up with probability equal to the
fraction below (as torchao's low-bit optimizers do) keeps every update in expectation: E[round(x)] = x.

The random bits come from a counter-based hash of (key, element index), with the key derived from
(seed, parameter index, step): no generator state to save, and the result does not depend on the
order in which tensors or param groups are stepped, so a resumed run and a run stepped group by
group round exactly like the uninterrupted serial one.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from numba import carray, cfunc, njit, types
from numba.core.ccallback import CFunc

from lazytrain.optim import precompile
from lazytrain.optim.parallel import address, fetch_add, num_threads, run_parallel

_MASK32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """lowbias32 (Chris Wellons' integer hash): a bijection on 32-bit integers with good avalanche."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_key(seed: int, param_index: int, step: int) -> int:
    """The 32-bit key of one tensor's rounding at one step."""
    return _mix32(_mix32(_mix32(seed) ^ param_index) ^ step)


PARALLEL_MIN_NUMEL = 1 << 16  # smaller tensors are rounded on the calling thread only


@njit(cache=True, error_model="numpy", inline="always")
def _round_bits(src, dst, key, offset, start, end):  # pragma: no cover - compiled
    """dst[i] = upper 16 bits of (bits(src[i]) + 16 random bits) for i in [start, end): round toward zero
    or away from it with probability given by the discarded low bits (sign-magnitude: unbiased for
    negatives too). The bits hash element i + offset: a slice of a tensor rounds as the whole tensor would."""
    mask = np.uint64(_MASK32)
    for i in range(start, end):
        x = (np.uint64(i + offset) * np.uint64(0x9E3779B1) + key) & mask  # counter -> hash input
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(0x7FEB352D)) & mask
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(0x846CA68B)) & mask
        x ^= x >> np.uint64(16)
        dst[i] = np.uint16((np.uint64(src[i]) + (x & np.uint64(0xFFFF))) >> np.uint64(16))


#: Arguments of the rounding kernel (addresses from ndarray.ctypes.data); work items are element ranges.
_ROUND_ARGS = np.dtype(
    [("next_item", np.int64), ("src", np.int64), ("dst", np.int64), ("numel", np.int64), ("chunk", np.int64),
     ("key", np.uint64), ("offset", np.int64)],
    align=True,
)


def _round_kernel(data):  # pragma: no cover - compiled (cfunc, see _kernel)
    a = carray(data, 1, _ROUND_ARGS)[0]
    src = carray(address(a.src), a.numel, np.uint32)
    dst = carray(address(a.dst), a.numel, np.uint16)
    while True:
        first = fetch_add(data, a.chunk)
        if first >= a.numel:
            return
        _round_bits(src, dst, a.key, a.offset, first, min(a.numel, first + a.chunk))


@cache
def _kernel() -> CFunc:
    precompile.wait()
    return cfunc(types.void(types.voidptr), cache=True, error_model="numpy")(_round_kernel)


def compile_kernels() -> None:
    """Into numba's disk cache (optim/precompile.py's child)."""
    _kernel()


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, key: int, offset: int = 0) -> None:
    """Write fp32 `src` into bf16 `dst` (same shape, contiguous host tensors) with stochastic rounding, on
    torch's OpenMP threads for large tensors (parallel.py); the result does not depend on the thread count.
    `offset`: where `src` starts in the tensor it is a slice of (its elements draw that tensor's bits)."""
    if not (dst.dtype == torch.bfloat16 and src.dtype == torch.float32 and dst.shape == src.shape
            and dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("stochastic_round_: needs contiguous host tensors, fp32 source and bf16 destination")
    bits = src.detach().reshape(-1).view(torch.int32).numpy().view(np.uint32)
    out = dst.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    n = bits.size
    n_threads = 1 if n < PARALLEL_MIN_NUMEL else num_threads()
    chunk = max(4096, -(-n // (8 * n_threads)))
    args = np.array([(0, bits.ctypes.data, out.ctypes.data, n, chunk, key & _MASK32, offset)], dtype=_ROUND_ARGS)
    run_parallel(_kernel(), args, n_threads)
