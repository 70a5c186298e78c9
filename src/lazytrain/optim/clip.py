"""Fast gradient clipping (paper section 3): per-tensor norms with foreach kernels, global norm in fp32.

The clip coefficient is not applied here: the optimizer fuses it into its update, so clipping costs
one read of the gradients (the norms) instead of a read and a write. When the fast fp32 norm is not
finite, `global_grad_norm` takes the slow exact path: it tells overflow of the fp32 sum (all
gradients finite, recompute in fp64) apart from a truly non-finite gradient (returns inf/nan).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def per_tensor_sq_norms(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of each gradient, fp32 accumulation, shape (n_tensors,).

    The executor can call this on each layer's gradients as they reach the host and pass
    `sqrt(sum of all)` to the optimizer later.
    """
    grads = [g for g in grads]
    if not grads:
        return torch.zeros(0)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).square()


def _exact_norm(grads: list[torch.Tensor]) -> float:
    """Slow exact path: inf/nan if any element is not finite, else the fp64-accumulated norm."""
    total_sq = 0.0
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            return math.nan
        total_sq += float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
    return math.sqrt(total_sq)


def global_grad_norm(grads: Iterable[torch.Tensor]) -> float:
    """Global L2 norm of all gradients: foreach per-tensor norms in fp32, exact fallback if not finite."""
    grads = [g for g in grads]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    total = float(torch.linalg.vector_norm(torch.stack(norms), 2.0))
    if math.isfinite(total):
        return total
    return _exact_norm(grads)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Scale for the gradients, exactly as torch.nn.utils.clip_grad_norm_ computes it (<= 1)."""
    if max_norm is None:
        return 1.0
    return min(1.0, float(torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(total_norm) + 1e-6)))
