"""Fast gradient clipping (LazyTrain, arXiv 2608.11919): per-tensor norms, global norm.

Contiguous fp32 CPU gradients (the usual case) go through a numba sum-of-squares kernel (float64
accumulation: no fp32 overflow, no rounding drift on long sums) on torch's OpenMP threads, like the
8-bit update (parallel.py). Any other gradient (non-contiguous, not fp32, not on the host) takes
torch's foreach norm in fp32.

The clip coefficient is not applied here: the optimizer fuses it into its update, so clipping costs
one read of the gradients (the norms) instead of a read and a write. When the fast norm is not
finite, `global_grad_norm` takes the slow exact path: it tells overflow of the fp32 sum (all
gradients finite, recompute in fp64) apart from a truly non-finite gradient (returns inf/nan).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from lazytrain.optim.quant import sq_sums_f64


def per_tensor_sq_norms(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of each gradient as fp32, shape (n_tensors,) (float64 or fp32 accumulation, see above).

    The executor can call this on each layer's gradients as they reach the host and pass
    `sqrt(sum of all)` to the optimizer later.
    """
    grads = [g for g in grads]
    if not grads:
        return torch.zeros(0)
    arrays = _host_fp32_arrays(grads)
    if arrays is not None:
        return torch.from_numpy(sq_sums_f64(arrays)).to(torch.float32)  # overflow -> inf, as fp32
    return _torch_norms(grads).square()


def per_tensor_sq_norms_fp32(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """`per_tensor_sq_norms` of the gradients' fp32 casts, bit for bit, without making them: bf16 gradients (of fp32
    master weights, as they landed) are read as their fp32 values in place."""
    grads = [g for g in grads]
    arrays = []
    for g in grads:
        if g.dtype not in (torch.float32, torch.bfloat16) or g.device.type != "cpu" or not g.is_contiguous():
            return per_tensor_sq_norms([x.float() for x in grads])
        flat = g.detach().reshape(-1)
        arrays.append(flat.numpy() if g.dtype == torch.float32 else flat.view(torch.int16).numpy().view(np.uint16))
    if not arrays:
        return torch.zeros(0)
    return torch.from_numpy(sq_sums_f64(arrays)).to(torch.float32)


def _host_fp32_arrays(grads: list[torch.Tensor]) -> list[np.ndarray] | None:
    """Flat numpy views of the gradients when all are dense contiguous fp32 CPU tensors, else None."""
    for g in grads:
        if g.device.type != "cpu" or g.dtype != torch.float32 or g.layout != torch.strided or not g.is_contiguous():
            return None
    return [g.detach().view(-1).numpy() for g in grads]


def _torch_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each gradient as fp32 by torch's foreach kernel, accumulated in fp32 (fp64 gradients in
    fp64: torch refuses to narrow them inside the norm)."""
    if any(g.dtype == torch.float64 for g in grads):
        acc = [None if g.dtype == torch.float64 else torch.float32 for g in grads]
        return torch.stack([torch.linalg.vector_norm(g, dtype=d).float() for g, d in zip(grads, acc, strict=True)])
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))


def _exact_norm(grads: list[torch.Tensor]) -> float:
    """Slow exact path: inf/nan if any element is not finite, else the fp64-accumulated norm."""
    total_sq = 0.0
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            return math.nan
        total_sq += float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
    return math.sqrt(total_sq)


def global_grad_norm(grads: Iterable[torch.Tensor]) -> float:
    """Global L2 norm of all gradients (numba float64 sums of squares for contiguous fp32 host
    gradients, else foreach per-tensor norms in fp32); the exact path decides when not finite."""
    grads = [g for g in grads]
    if not grads:
        return 0.0
    arrays = _host_fp32_arrays(grads)
    if arrays is not None:
        total = math.sqrt(float(sq_sums_f64(arrays).sum()))
    else:
        total = float(torch.linalg.vector_norm(_torch_norms(grads), 2.0))
    if math.isfinite(total):
        return total
    return _exact_norm(grads)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Scale for the gradients, exactly as torch.nn.utils.clip_grad_norm_ computes it (<= 1)."""
    if max_norm is None:
        return 1.0
    return min(1.0, float(torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(total_norm) + 1e-6)))
