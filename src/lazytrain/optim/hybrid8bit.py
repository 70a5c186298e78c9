"""Hybrid 8-bit AdamW (LazyTrain, arXiv 2608.11919): block-wise 8-bit states for a slice of the parameters, fp32
AdamW for the rest, the clip coefficient fused into the update, non-finite steps skipped.

Why: the optimizer runs on the host over every parameter every step and its fp32 states (8 bytes per
parameter) are the largest item in host memory. 8-bit states need ~2.03 bytes per parameter and the
fused kernel moves ~16 instead of ~28 bytes per parameter, so it need not be slower than fp32.

Usage, whole model (computes the norm itself):

    opt = Hybrid8bitAdamW(model.parameters(), lr=3e-4, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()

Usage, executor (one param group per layer, norms accumulated as gradients reach the host):

    total_sq = torch.zeros(())                       # fp32 accumulator, once per step
    total_sq += per_tensor_sq_norms(layer_grads).sum()  # per layer, as its gradients reach the host
    ...
    clip_coef = opt.begin_step(grad_norm=total_sq.sqrt())  # once per step, after all layers (host sync)
    if clip_coef is not None:                         # None: non-finite gradients, step skipped
        for i in range(len(opt.param_groups)):        # any order, any time before the next step
            opt.step_group(i, clip_coef)

`begin_step` decides skip and clip scale for the whole step; a non-finite norm is rechecked on the
`.grad` tensors by the slow exact path (fp32 overflow of finite gradients still steps), so call it
while the gradients are on the host. `step_group` updates one group with that scale and does not
look at other groups. `opt.step(grad_norm=...)` is `begin_step` then `step_group` for every group.

Which parameters get 8-bit states is fixed at construction, in parameter order: a contiguous CPU
tensor with at least `min_8bit_size` elements is 8-bit while the 8-bit volume stays within
`eightbit_fraction` of all parameters. The choice is in `state[p]["eightbit"]` (saved by state_dict).

bf16 master weights (opt-in: pass bf16 parameters): the update is computed in fp32 from the bf16 weights and
gradient (an fp32 gradient rounds to bf16 first), then written back with stochastic rounding (bf16.py), so
updates below half a bf16 step are kept in expectation. States are as for fp32 parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lazytrain.costmodel.cost import QUANT_BLOCK
from lazytrain.errors import LazyTrainError
from lazytrain.optim.bf16 import rounding_key, stochastic_round_
from lazytrain.optim.chunked import Scratch, chunk_ranges
from lazytrain.optim.clip import _exact_norm, clip_coefficient, global_grad_norm
from lazytrain.optim.quant import M_ZERO_CODE, adamw8bit_reference_, adamw8bit_step_

#: Per-parameter state tensors (8-bit codes and absmax, or fp32 moments); "step" is torch's.
_STATE_TENSORS = ("qm", "qv", "absmax_m", "absmax_v", "exp_avg", "exp_avg_sq")


class NonFiniteGradientsError(LazyTrainError):
    """Too many consecutive optimizer steps had non-finite gradients."""


class Hybrid8bitAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction as torch.optim.AdamW) with hybrid 8-bit states.

    Args:
        lr, betas, eps, weight_decay: as torch.optim.AdamW (per param group).
        max_grad_norm: global L2 clip threshold; None disables clipping (non-finite steps are still
            skipped).
        block_size: elements per absmax block of the 8-bit states.
        eightbit_fraction: share of the parameter volume with 8-bit states, 0.0 (all fp32) .. 1.0.
        min_8bit_size: tensors with fewer elements keep fp32 states.
        max_consecutive_skips: this many non-finite steps in a row raise NonFiniteGradientsError.
        use_reference: run the plain-torch 8-bit update instead of the compiled kernel (tests).
        seed: stochastic rounding of bf16 parameters draws its bits from (seed, parameter index, step).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = 1.0,
        block_size: int = QUANT_BLOCK,
        eightbit_fraction: float = 1.0,
        min_8bit_size: int = 4096,
        max_consecutive_skips: int = 3,
        use_reference: bool = False,
        seed: int = 0,
    ) -> None:
        _check_hparams(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {max_grad_norm}")
        if not (isinstance(block_size, int) and block_size > 0):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 <= eightbit_fraction <= 1.0:
            raise ValueError(f"eightbit_fraction must be in [0, 1], got {eightbit_fraction}")
        if min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be >= 0, got {min_8bit_size}")
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.max_grad_norm = max_grad_norm
        self.block_size = block_size
        self.eightbit_fraction = eightbit_fraction
        self.min_8bit_size = min_8bit_size
        self.max_consecutive_skips = max_consecutive_skips
        self.use_reference = use_reference
        self.seed = seed
        self._index: dict[torch.Tensor, int] = {}  # parameter -> position, for the rounding key
        self.skipped_steps = 0  # non-finite steps skipped so far
        self.consecutive_skips = 0
        self._eightbit_numel = 0
        self._total_numel = 0
        self._scratch = Scratch()  # fp32 chunks of the fp32-state updates that cast (optim/chunked.py)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    # ------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (one per layer in the executor) and allocate its states now."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for p in group["params"]:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"Hybrid8bitAdamW supports fp32 and bf16 parameters only, got {p.dtype}")
            if p.dtype == torch.bfloat16 and not (p.device.type == "cpu" and p.is_contiguous()):
                raise ValueError("Hybrid8bitAdamW: bf16 parameters must be contiguous host tensors")
            self._index[p] = len(self._index)
        self._total_numel += sum(p.numel() for p in group["params"])
        budget = self.eightbit_fraction * self._total_numel
        for p in group["params"]:
            eightbit = (
                self.eightbit_fraction > 0
                and p.numel() >= self.min_8bit_size
                and p.is_contiguous()
                and p.device.type == "cpu"  # the 8-bit kernel runs on the host
                and self._eightbit_numel + p.numel() <= budget * (1 + 1e-12)
            )
            self._init_state(p, eightbit)
            self._eightbit_numel += p.numel() if eightbit else 0

    def _init_state(self, p: torch.Tensor, eightbit: bool) -> None:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["eightbit"] = eightbit
        if eightbit:
            nblocks = (p.numel() + self.block_size - 1) // self.block_size
            state["qm"] = torch.full((p.numel(),), M_ZERO_CODE, dtype=torch.uint8)
            state["qv"] = torch.zeros(p.numel(), dtype=torch.uint8)
            state["absmax_m"] = torch.zeros(nblocks, dtype=torch.float32)
            state["absmax_v"] = torch.zeros(nblocks, dtype=torch.float32)
        else:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    # ------------------------------------------------------------ introspection
    @property
    def eightbit_numel(self) -> int:
        """Parameters with 8-bit states."""
        return self._eightbit_numel

    def state_bytes(self) -> int:
        """Bytes held by optimizer states (codes, absmax, fp32 moments; step counters excluded)."""
        total = 0
        for st in self.state.values():
            for key in _STATE_TENSORS:
                if key in st:
                    total += st[key].numel() * st[key].element_size()
        return total

    def dequantized_states(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of p as fp32 tensors shaped like p (copies for 8-bit states)."""
        from lazytrain.optim.quant import dequantize_blockwise

        st = self.state[p]
        if not st["eightbit"]:
            return st["exp_avg"].clone(), st["exp_avg_sq"].clone()
        m = dequantize_blockwise(st["qm"], st["absmax_m"], True, self.block_size)
        v = dequantize_blockwise(st["qv"], st["absmax_v"], False, self.block_size)
        return m.view_as(p), v.view_as(p)

    # ------------------------------------------------------------ stepping
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def begin_step(self, grad_norm: float | torch.Tensor | None = None) -> float | None:
        """Decide this step's clip coefficient from the global gradient norm.

        grad_norm: global L2 norm computed earlier (e.g. sqrt of summed `per_tensor_sq_norms`);
            None computes it from the current gradients. Returns the coefficient to pass to
            `step_group`, or None when the gradients are not finite: then the step is skipped,
            counted in `skipped_steps`, and the `max_consecutive_skips`-th skip in a row raises.
        """
        if grad_norm is None:
            total = global_grad_norm(self._grads())
        else:
            total = float(grad_norm)
            if not math.isfinite(total):  # fp32 overflow or a real inf/nan: the slow exact path decides
                grads = self._grads()
                total = _exact_norm(grads) if grads else total
        if not math.isfinite(total):
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise NonFiniteGradientsError(
                    f"{self.consecutive_skips} optimizer steps in a row had non-finite gradients "
                    f"(norm {total}, {self.skipped_steps} skipped in all); lower the learning rate or "
                    f"check the loss, or raise max_consecutive_skips (now {self.max_consecutive_skips})"
                )
            return None
        self.consecutive_skips = 0
        return clip_coefficient(total, self.max_grad_norm)

    @torch.no_grad()
    def step_group(self, group_index: int, clip_coef: float = 1.0,
                   grads: dict[torch.Tensor, torch.Tensor] | None = None,
                   copies: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Update the parameters of one param group with gradients scaled by clip_coef (<= 1).

        grads: each parameter's gradient (any float dtype, e.g. a view of the executor's kept bf16 gradient); None =
        `.grad`. Parameters without a gradient are left alone. copies: for fp32 parameters, a contiguous bf16
        tensor each that receives the new weights rounded to nearest (the streamed copy, written in the same pass).
        8-bit states: one fused pass per tensor over the weights, gradient, codes and copy in their own dtypes
        (optim/quant.py), the given gradients left alone. fp32 states: torch's fused AdamW, straight on fp32
        parameters with fp32 gradients (divided by 1/clip_coef in place when clip_coef < 1), else chunk by chunk
        through cache-sized fp32 copies (optim/chunked.py: bit for bit the whole-tensor update), bf16 weights
        rounded back stochastically.
        """
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        grad_scale = None if clip_coef >= 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        fp32_p, fp32_g, fp32_m, fp32_v, fp32_steps = [], [], [], [], []
        for p in group["params"]:
            grad = p.grad if grads is None else grads.get(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise ValueError("Hybrid8bitAdamW does not support sparse gradients")
            st = self.state[p]
            copy = None if copies is None else copies.get(p)
            if st["eightbit"]:
                st["step"] += 1
                self._step_8bit(p, grad, st, group, clip_coef, copy)
            elif p.dtype != torch.float32 or grad.dtype != torch.float32 or copy is not None:
                st["step"] += 1
                self._step_chunked(p, grad, st, group, grad_scale, copy)
            else:
                fp32_p.append(p)
                fp32_g.append(grad)
                fp32_m.append(st["exp_avg"])
                fp32_v.append(st["exp_avg_sq"])
                fp32_steps.append(st["step"])
        if fp32_p:
            torch._foreach_add_(fp32_steps, 1)
            _fused_adamw(fp32_p, fp32_g, fp32_m, fp32_v, fp32_steps, group, beta1, beta2, grad_scale)

    def _step_8bit(self, p: torch.Tensor, grad: torch.Tensor, st: dict[str, Any], group: dict[str, Any],
                   clip_coef: float, copy: torch.Tensor | None) -> None:
        """The fused 8-bit kernel on `p` (fp32 or bf16) and its states (step already counted)."""
        beta1, beta2 = group["betas"]
        step = int(st["step"].item())
        key = rounding_key(self.seed, self._index[p], step)
        hparams = dict(block_size=self.block_size, clip_coef=clip_coef, lr=group["lr"], beta1=beta1, beta2=beta2,
                       eps=group["eps"], weight_decay=group["weight_decay"], step=step)
        states = (st["qm"], st["qv"], st["absmax_m"], st["absmax_v"])
        flat_copy = None if copy is None else copy.view(-1)
        if not self.use_reference:
            adamw8bit_step_(p.detach().view(-1), grad, *states, rounding_key=key, copy=flat_copy, **hparams)
            return
        # the plain-torch twin works on fp32: copies of bf16 weights, rounded back as the kernel rounds
        w = p.detach().view(-1).float()
        adamw8bit_reference_(w, grad.to(p.dtype).float(), *states, **hparams)
        if p.dtype == torch.bfloat16:
            stochastic_round_(p.detach().view(-1), w, key)
        else:
            p.detach().view(-1).copy_(w)
        if flat_copy is not None:
            flat_copy.copy_(w)

    def _step_chunked(self, p: torch.Tensor, grad: torch.Tensor, st: dict[str, Any], group: dict[str, Any],
                      grad_scale: torch.Tensor | None, copy: torch.Tensor | None) -> None:
        """torch's fused AdamW on a tensor with fp32 states whose update needs fp32 copies (bf16 weights or
        gradient) or writes a bf16 copy, CHUNK_NUMEL elements at a time (step already counted)."""
        beta1, beta2 = group["betas"]
        if not p.is_contiguous():  # fp32 masters laid out by someone else: one whole-tensor cast
            _fused_adamw([p], [grad.float()], [st["exp_avg"]], [st["exp_avg_sq"]], [st["step"]], group, beta1, beta2,
                         grad_scale)
            if copy is not None:
                copy.copy_(p)
            return
        bf16 = p.dtype == torch.bfloat16
        key = rounding_key(self.seed, self._index[p], int(st["step"].item()))
        flat_p, flat_g = p.detach().view(-1), grad.detach().reshape(-1)
        flat_m, flat_v = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
        for start, end in chunk_ranges(p.numel()):
            g = self._scratch.grad(flat_g[start:end], p.dtype)
            w = self._scratch.param(flat_p[start:end]) if bf16 else flat_p[start:end]
            _fused_adamw([w], [g], [flat_m[start:end]], [flat_v[start:end]], [st["step"]], group, beta1, beta2,
                         grad_scale)
            if bf16:
                stochastic_round_(flat_p[start:end], w, key, offset=start)
            if copy is not None:
                copy.view(-1)[start:end].copy_(w)

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, grad_norm: float | torch.Tensor | None = None
    ) -> Any:
        """One optimizer step over all groups; grad_norm as in `begin_step`. Returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip_coef = self.begin_step(grad_norm)
        if clip_coef is None:
            return loss
        for i in range(len(self.param_groups)):
            self.step_group(i, clip_coef)
        return loss

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict plus the skip counters (8-bit codes and absmax are plain state tensors)."""
        sd = super().state_dict()
        sd["hybrid8bit"] = {
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "block_size": self.block_size,
            "seed": self.seed,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict saved by this class with the same parameters and block_size."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("hybrid8bit", None)
        if extra is not None and extra["block_size"] != self.block_size:
            raise ValueError(
                f"state_dict has block_size {extra['block_size']} but this optimizer has {self.block_size}; "
                "construct it with the saved block_size"
            )
        # torch casts every state tensor to the parameter dtype; keep the states out of that: uint8
        # codes would take 4x their memory for a moment as float32, and bf16 parameters would round
        # the fp32 absmax and moments to bf16. They are restored with the dtype they were saved in.
        kept: dict[Any, dict[str, torch.Tensor]] = {}
        plain: dict[Any, dict[str, Any]] = {}
        for pid, st in state_dict["state"].items():
            plain[pid] = {k: v for k, v in st.items() if k not in _STATE_TENSORS}
            kept[pid] = {k: v for k, v in st.items() if k in _STATE_TENSORS}
        super().load_state_dict({**state_dict, "state": plain})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            for key, val in kept.get(pid, {}).items():
                self.state[p][key] = val.to(device=p.device)
        self._eightbit_numel = sum(p.numel() for p, st in self.state.items() if st.get("eightbit"))
        if extra is not None:
            self.skipped_steps = extra["skipped_steps"]
            self.consecutive_skips = extra["consecutive_skips"]
            self.seed = extra.get("seed", self.seed)


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One-line ValueErrors for bad AdamW hyperparameters."""
    if isinstance(lr, torch.Tensor) or not lr >= 0.0:
        raise ValueError(f"lr must be a float >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _fused_adamw(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, group: dict,
                 beta1: float, beta2: float, grad_scale: torch.Tensor | None) -> None:
    """torch's fused AdamW kernel on the fp32-state tensors of one group (grads rescaled in place)."""
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=None,
    )
