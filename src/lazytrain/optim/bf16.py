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

import numpy as np
import torch
from numba import njit

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


@njit(cache=True, error_model="numpy")
def _round_bits(src: np.ndarray, dst: np.ndarray, key: np.uint64) -> None:  # pragma: no cover - compiled
    """dst[i] = upper 16 bits of (bits(src[i]) + 16 random bits): round toward zero or away from it
    with probability given by the discarded low bits (sign-magnitude, so unbiased for negatives too)."""
    mask = np.uint64(_MASK32)
    for i in range(src.size):
        x = (np.uint64(i) * np.uint64(0x9E3779B1) + key) & mask  # counter -> hash input
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(0x7FEB352D)) & mask
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(0x846CA68B)) & mask
        x ^= x >> np.uint64(16)
        dst[i] = np.uint16((np.uint64(src[i]) + (x & np.uint64(0xFFFF))) >> np.uint64(16))


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, key: int) -> None:
    """Write fp32 `src` into bf16 `dst` (same shape, contiguous host tensors) with stochastic rounding."""
    if not (dst.dtype == torch.bfloat16 and src.dtype == torch.float32 and dst.shape == src.shape
            and dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("stochastic_round_: needs contiguous host tensors, fp32 source and bf16 destination")
    bits = src.detach().reshape(-1).view(torch.int32).numpy().view(np.uint32)
    out = dst.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    _round_bits(bits, out, np.uint64(key & _MASK32))
