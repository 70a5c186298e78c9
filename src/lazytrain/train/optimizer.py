"""The host optimizer over the fp32 master weights: building it, its learning-rate schedule, one step, and the
one non-finite policy of every optimizer and mode.

Non-finite policy: a step whose loss or global gradient norm is not finite is skipped: no parameter, optimizer
state or schedule change (the learning-rate schedule counts applied steps only). It is counted and logged;
`max_nonfinite_steps` in a row stop the run with one line naming what was non-finite and where it first
appeared (the loss, or the first layer group of the backward whose gradients were not finite).

Both modes check after the step's last backward, before any update: the global norm then exists. Serial mode
(MegaTrain's code) steps the optimizer there. Overlap mode (overlapped-exact, the default) hands the same
update, group by group (`group_update`), to the executor, which runs it on its optimizer lane under the next
step's forward in forward order; each group is clipped with the step's one coefficient and stepped by the same
per-group kernels, so the parameters after every step are bit-identical to serial mode's, and a non-finite step
is skipped whole in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, get_scheduler

from lazytrain.costmodel.cost import HYBRID_8BIT_FRACTION
from lazytrain.errors import LazyTrainError
from lazytrain.optim import Hybrid8bitAdamW
from lazytrain.optim.chunked import Scratch, clip_coefficient_tensor, step_adamw
from lazytrain.runtime.hf import find_parts

if TYPE_CHECKING:
    from lazytrain.config import JobConfig
    from lazytrain.runtime.executor import Executor
    from lazytrain.train.offload import NvmeStates

ParamGroup = dict[str, object]  # torch's param group: {"params": [...], "lr": ..., "weight_decay": ..., ...}


class NonFiniteRunError(LazyTrainError):
    """`max_nonfinite_steps` steps in a row had a non-finite loss or gradient norm."""


# =====================================================================================================
# building
# =====================================================================================================
def build_optimizer(job: JobConfig, model: PreTrainedModel, nvme: NvmeStates | None = None,
                    names: set[str] | None = None) -> torch.optim.Optimizer:
    """One optimizer over the fp32 master weights, two param groups per layer (decay, no decay); both modes.
    `nvme`: the states (and offloaded masters) move to its files group by group as they are made. `names`: only
    these groups (embedding, layer<j>, head; None: all), e.g. a calibration's that must not hold every state."""
    parts = find_parts(model)
    owners: list[tuple[str, torch.nn.Module]] = [("embedding", parts.embedding)]
    owners += [(f"layer{j}", layer) for j, layer in enumerate(parts.layers)]
    owners += [("head", torch.nn.ModuleList([parts.norm, parts.lm_head]))]
    if names is not None:
        owners = [(name, module) for name, module in owners if name in names]
    groups, seen = [], set()
    for name, module in owners:
        decay, no_decay = [], []
        for p in module.parameters():
            if id(p) in seen or not p.requires_grad:  # tied LM head: the embedding group owns it
                continue
            seen.add(id(p))
            (decay if p.dim() >= 2 else no_decay).append(p)
        groups += [{"params": decay, "weight_decay": job.optim.weight_decay, "name": name},
                   {"params": no_decay, "weight_decay": 0.0, "name": name}]
    groups = [g for g in groups if g["params"]]

    def make(param_groups: list[ParamGroup]) -> torch.optim.Optimizer:
        if job.optim.optimizer != "adamw":
            return hybrid8bit_optimizer(job, param_groups, max_grad_norm=job.optim.max_grad_norm or None)
        return adamw(job, param_groups)

    return make(groups) if nvme is None else nvme.build(make, groups)


def adamw(job: JobConfig, groups: list[ParamGroup]) -> torch.optim.AdamW:
    o = job.optim
    return torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon,
                             fused=True)


def hybrid8bit_optimizer(job: JobConfig, groups: list[ParamGroup], max_grad_norm: float | None
                         ) -> Hybrid8bitAdamW:
    """Hybrid8bitAdamW with the 8-bit share of `optimizer`: the paper's slice or every large tensor. The
    trainer applies the non-finite policy before it steps, so its own skip counter never fires."""
    o = job.optim
    fraction = HYBRID_8BIT_FRACTION if o.optimizer == "hybrid8bit" else 1.0
    return Hybrid8bitAdamW(groups, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon,
                           max_grad_norm=max_grad_norm, eightbit_fraction=fraction)


# =====================================================================================================
# schedule
# =====================================================================================================
def warmup_steps(job: JobConfig) -> int:
    """The HF Trainer's warm-up: warmup_steps when > 0 (a float in (0, 1) is a fraction of the run, as in
    transformers 5), else ceil(warmup_ratio x max_steps)."""
    o = job.optim
    if isinstance(o.warmup_steps, float):
        return math.ceil(o.warmup_steps * o.max_steps)
    if o.warmup_steps > 0 or o.warmup_ratio is None:
        return o.warmup_steps
    return math.ceil(o.warmup_ratio * o.max_steps)


class Schedule:
    """The learning rate of every applied update, from `transformers.get_scheduler` with its semantics (warm-up
    from 0, linear / cosine decay to 0, ...): its multiplier of the update's index, a pure function, so a resumed
    run and an overlapped update compute the same rate without a scheduler's state."""

    def __init__(self, job: JobConfig) -> None:
        o = job.optim
        self.learning_rate = o.learning_rate
        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=o.learning_rate)  # holds no real state
        try:
            scheduler = get_scheduler(o.lr_scheduler_type, probe, num_warmup_steps=warmup_steps(job),
                                      num_training_steps=o.max_steps,
                                      scheduler_specific_kwargs=dict(o.lr_scheduler_kwargs))
        except (TypeError, ValueError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise LazyTrainError(f"lr_scheduler_type {o.lr_scheduler_type} with lr_scheduler_kwargs "
                                 f"{dict(o.lr_scheduler_kwargs)}: {reason}; see transformers' get_scheduler for the "
                                 "arguments of each schedule") from None
        self.multiplier = scheduler.lr_lambdas[0]

    def lr_at(self, step: int) -> float:
        """Learning rate of the `step`-th applied update (0-based: the HF scheduler's step count before it)."""
        return self.learning_rate * float(self.multiplier(step))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# =====================================================================================================
# one step (serial mode)
# =====================================================================================================
def optimizer_step(job: JobConfig, optimizer: torch.optim.Optimizer, executor: Executor, *,
                   grad_norm: float, only: set[int] | None = None, nvme: NvmeStates | None = None) -> float:
    """Clip and step on the host, one executor group at a time in update order (`group_update`, `Executor.
    run_updates`: with the states on NVMe, the step program's last ops); returns the
    global gradient norm before clipping.

    `grad_norm`: the norm the executor took as gradients landed (`last_step.grad_norm`): neither the clip nor
    Hybrid8bitAdamW's fused clip scale then needs another pass over the gradients. The updates are elementwise,
    so stepping group by group gives bit for bit the parameters of one step over all of them. `only`: the ids of
    the parameters this rank steps (a node's optimizer shard, distributed/shared.py); None = every parameter.
    """
    # the param groups holding each executor group's parameters (here one may span several: only the parameters
    # with a gradient in the update's dict are stepped)
    holder = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
    groups = [sorted({holder[id(p)] for p in params if id(p) in holder}) for params in executor.param_groups()]
    executor.run_updates(group_update(job, optimizer, executor, groups, grad_norm, lr=None, only=only, nvme=nvme))
    return grad_norm


# =====================================================================================================
# the non-finite policy
# =====================================================================================================
@dataclass
class NonFinitePolicy:
    """Counts non-finite steps; `check` stops the run at the `limit`-th in a row (NonFiniteRunError)."""

    limit: int
    consecutive: int = 0
    skipped: int = 0
    first_where: str = ""  # where the current run of non-finite steps first appeared

    def skip(self, where: str, step: int) -> None:
        """Count a skipped step (`check` then stops the run when it is the `limit`-th in a row)."""
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive == 1:
            self.first_where = f"{where} at step {step}"

    def check(self) -> None:
        if self.consecutive >= self.limit:
            raise NonFiniteRunError(
                f"{self.consecutive} steps in a row were non-finite (first: {self.first_where}); nothing was saved "
                "over the last good checkpoint; lower learning_rate, check the data and the model's weights, or "
                f"raise max_nonfinite_steps (now {self.limit})")

    def applied(self) -> None:
        self.consecutive = 0


def nonfinite_where(executor: Executor, loss: float, grad_norm: float | None) -> str | None:
    """None when the loss and the gradient norm are finite; else what was not: the loss, or the first layer
    group of the backward (head first, then layer L-1 .. 0, then the embedding) with non-finite gradients."""
    if not math.isfinite(loss):
        return f"loss {loss}"
    if grad_norm is not None and math.isfinite(grad_norm):
        return None
    names = executor.group_names()
    for index in backward_order(names):
        grads = executor.gradients(index)
        if grads and not all(bool(torch.isfinite(g).all()) for g in grads):
            return f"gradients of {names[index]}"
    return f"gradient norm {grad_norm}"


def backward_order(names: list[str]) -> list[int]:
    """Executor group indices in the order their gradients land: head, layer L-1 .. 0, embedding."""
    head = [i for i, n in enumerate(names) if n == "head"]
    layers = [i for i, n in enumerate(names) if n.startswith("layer.")]
    embedding = [i for i, n in enumerate(names) if n == "embedding"]
    return head + layers[::-1] + embedding


# =====================================================================================================
# overlap mode: the same step, one executor group at a time
# =====================================================================================================
def executor_param_groups(optimizer: torch.optim.Optimizer, executor: Executor) -> list[list[int]]:
    """For each executor group (`executor.param_groups()` order), the indices of the optimizer's param groups
    holding its parameters (a tied head's group also owns the "embedding" param group)."""
    owner = {id(p): g for g, params in enumerate(executor.param_groups()) for p in params}
    out: list[list[int]] = [[] for _ in executor.param_groups()]
    for k, group in enumerate(optimizer.param_groups):
        owners = {owner[id(p)] for p in group["params"]}
        if len(owners) != 1:
            raise LazyTrainError(f"optimizer param group {group.get('name', k)} spans executor groups {owners}")
        out[owners.pop()].append(k)
    return out


def step_param_groups(optimizer: torch.optim.Optimizer, indices: list[int]) -> None:
    """`optimizer.step()` on the param groups `indices` alone (their `.grad`s: `Executor.group_grads`): torch steps
    each param group on its own, so their updates are those of one step over every group, bit for bit."""
    every = optimizer.param_groups
    optimizer.param_groups = [every[k] for k in indices]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = every


def group_update(job: JobConfig, optimizer: torch.optim.Optimizer, executor: Executor, groups: list[list[int]],
                 grad_norm: float, lr: float | None, only: set[int] | None = None, nvme: NvmeStates | None = None
                 ) -> Callable[[int], None]:
    """`update(executor_group)`: one executor group's update -- the learning rate `lr` of this step (None: as
    set), the clip coefficient of the global `grad_norm`, each param group stepped by its own kernels (torch's
    fused AdamW and Hybrid8bitAdamW step each param group on its own) from the gradients as the executor keeps
    them (`Executor.kept_grads`: no cast of the group, optim/chunked.py), restricted to the parameters in `only`
    when given. Run over every group it equals one whole step bit for bit, in any order; with torch's AdamW, bit
    for bit `clip_grads_with_norm_` then `optimizer.step()` on fp32 `.grad`s. `nvme`: each group's states and
    masters are staged from their files for its update and written back (train/offload.py)."""
    hybrid = isinstance(optimizer, Hybrid8bitAdamW)
    coef = optimizer.begin_step(grad_norm=grad_norm) if hybrid else None
    clip = (clip_coefficient_tensor(job.optim.max_grad_norm, grad_norm)
            if not hybrid and job.optim.max_grad_norm > 0 else None)
    scratch = _scratch(optimizer)

    def update(index: int) -> None:
        grads = executor.kept_grads(index)
        if only is not None:  # another local rank steps the rest (their gradients were needed for the norm only)
            grads = {p: g for p, g in grads.items() if id(p) in only}
        ks = groups[index]
        if lr is not None:
            for k in ks:
                optimizer.param_groups[k]["lr"] = lr
        group = executor.group_at(index)
        # the bf16 streamed copies of fp32 masters: Hybrid8bitAdamW writes them in its own pass (no re-pack after it)
        copies = group.copies() if hybrid and group is not None else {}
        if hybrid:
            if coef is not None:  # None: not finite (the trainer skips such steps before; kept for direct callers)
                for k in ks:
                    optimizer.step_group(k, coef, grads=grads, copies=copies)
        else:
            step_adamw(optimizer, ks, grads, clip, scratch)
        if group is not None:
            group.written([p for p in copies if p in grads] if coef is not None else [])
        for p in executor.param_groups()[index]:
            p.grad = None  # the step is taken: no `.grad` view of the kept gradient stays behind

    return update if nvme is None else nvme.staged(update)


def _scratch(optimizer: torch.optim.Optimizer) -> Scratch:
    """The chunk buffers of `optimizer`'s updates, made once (Hybrid8bitAdamW has its own)."""
    if not hasattr(optimizer, "_scratch"):
        optimizer._scratch = Scratch()
    return optimizer._scratch
