"""A group's fp32-state update in chunks that stay in cache, so no transient grows with the group.

The executor keeps each group's gradient as it landed (bf16 with bf16 compute, fp32 where micro-batches are summed);
torch's fused AdamW steps fp32 tensors only. Casting a whole group's gradient to fp32, or copying bf16 masters to
fp32 to update them, would need a buffer the size of the largest group (2.03 GiB of fp32 gradient for Qwen2.5-7B's
untied head) and move every byte through memory twice more. Here each tensor is updated CHUNK_NUMEL elements at a
time through two reused fp32 buffers (`Scratch`) of 1 MiB each: the cast chunk is still in the core's cache when
the step reads it, so the casts cost no memory traffic (costmodel's `update_bytes_per_param`), and the transients
are a constant whatever the model (costmodel's `update_scratch`). The 8-bit states need no chunks: their kernel
reads every dtype itself (optim/quant.py).

Bit for bit the unchunked update: torch's fused AdamW splits a tensor into 64-byte units and vectorizes each unit
the same way wherever it starts (chunks start on multiples of 2^18 elements, so the elements that take its scalar
tail are the tensor's last ones, as unchunked), the step counter is bumped once per tensor, and stochastic rounding
hashes each element's index within its whole tensor (`stochastic_round_(..., offset)`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

CHUNK_NUMEL = 1 << 18  # elements per chunk: 1 MiB of fp32, within a core's L2; a multiple of torch's 64-byte
# units (costmodel's UPDATE_CHUNK_NUMEL, tested equal)


def chunk_ranges(numel: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each chunk of a tensor of `numel` elements."""
    for start in range(0, numel, CHUNK_NUMEL):
        yield start, min(numel, start + CHUNK_NUMEL)


class Scratch:
    """Two reused fp32 buffers of up to CHUNK_NUMEL elements (a chunk's gradient and, for bf16 masters, its
    weights), grown on demand; the same memory every chunk, so it stays in cache. One update at a time: the
    optimizer lane runs one group after another."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def _take(self, which: str, numel: int) -> torch.Tensor:
        buf = self._buffers.get(which)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[which] = torch.empty(numel, dtype=torch.float32)
        return buf[:numel]

    def grad(self, chunk: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
        """The fp32 gradient of a chunk as the optimizer takes it: the kept gradient cast to the parameter's dtype
        (what autograd's `.grad` would hold: a bf16 master's fp32 sum rounds to bf16), then to fp32."""
        if chunk.dtype != param_dtype:
            chunk = chunk.to(param_dtype)  # bf16 masters with an fp32 sum: a bf16 chunk, bounded too
        return self._take("grad", chunk.numel()).copy_(chunk)

    def param(self, chunk: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of a chunk of bf16 master weights."""
        return self._take("param", chunk.numel()).copy_(chunk)


def step_adamw(optimizer: torch.optim.AdamW, indices: list[int], grads: dict[torch.Tensor, torch.Tensor],
               clip_coef: torch.Tensor | None, scratch: Scratch) -> None:
    """`optimizer.step()` (torch.optim.AdamW with fused=True) over the param groups `indices`, bit for bit, with
    each parameter's gradient taken from `grads` (a view of the kept gradient: a bf16 one is cast chunk by chunk and
    left as it is, an fp32 one is used in place) and scaled by `clip_coef` first as
    `torch.nn.utils.clip_grads_with_norm_` scales `.grad` (an fp32 kept gradient in place, as it does); parameters
    without an entry are not stepped. States are created as torch creates them."""
    for k in indices:
        group = optimizer.param_groups[k]
        if not group["fused"] or group["amsgrad"] or group["maximize"] or group["capturable"]:
            raise ValueError("step_adamw steps torch.optim.AdamW(fused=True) without amsgrad, maximize, capturable")
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            grad = grads.get(p)
            if grad is None:
                continue
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError("step_adamw updates contiguous fp32 parameters")
            state = optimizer.state[p]
            if not state:  # torch's lazy state (adam.py `_init_group`, fused)
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            torch._foreach_add_([state["step"]], 1)
            flat_p, flat_g = p.detach().view(-1), grad.detach().reshape(-1)
            flat_m, flat_v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
            # an fp32 gradient is clipped and read in place: no copy, so no chunks (each is a parallel region)
            ranges = [(0, p.numel())] if grad.dtype == torch.float32 else chunk_ranges(p.numel())
            for start, end in ranges:
                g = flat_g[start:end] if grad.dtype == torch.float32 else scratch.grad(flat_g[start:end], torch.float32)
                if clip_coef is not None:
                    g.mul_(clip_coef)
                torch._fused_adamw_([flat_p[start:end]], [g], [flat_m[start:end]], [flat_v[start:end]], [],
                                    [state["step"]], amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                                    grad_scale=None, found_inf=None)


def clip_coefficient_tensor(max_norm: float, total_norm: float) -> torch.Tensor:
    """The clamped scale `torch.nn.utils.clip_grads_with_norm_` multiplies gradients by (fp32 0-dim tensor)."""
    return torch.clamp(float(max_norm) / (torch.tensor(total_norm) + 1e-6), max=1.0)
