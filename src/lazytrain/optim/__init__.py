"""Host-side optimizer: hybrid 8-bit AdamW with fused gradient clipping (LazyTrain, arXiv 2608.11919)."""

from lazytrain.optim.clip import clip_coefficient, global_grad_norm, per_tensor_sq_norms
from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW, NonFiniteGradientsError

__all__ = [
    "Hybrid8bitAdamW",
    "NonFiniteGradientsError",
    "clip_coefficient",
    "global_grad_norm",
    "per_tensor_sq_norms",
]
