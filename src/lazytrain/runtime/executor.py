"""The executor: runs one plan's training step exactly, streaming layers through a device (Contract 3,
docs/architecture.md).

`Executor` holds what lives across steps: the model's weight groups in their host layout (runtime/store.py),
the plan, the deferred optimizer update, and the step's byte sizes (`shapes`: runtime/shapes.py, a CostModel's
working sets or measured ones). `forward_backward` builds the plan's step program (plan/schedule.py, Contract 2)
from those shapes and hands it to a `Step` (runtime/step.py), which runs its actions on the device: every
transfer in the window the program gives it, weight gradients landing in each group's host buffer and, at the
start of the step after `defer_update`, the previous step's update group by group under the forward (the
overlapped-exact optimizer). The step's peak device bytes equal `StepProgram.device_peak_bytes()` (the arena
counts exactly its alloc/free actions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from lazytrain.costmodel.cost import HEAD_CHUNK_TOKENS
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.topology import ONE_RANK
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan
from lazytrain.plan.schedule import Shapes, StepProgram, build_program, update_order
from lazytrain.runtime.device import (
    Device,
    EmulatedDevice,
    check_nvme_dir,
    check_nvme_space,
    return_freed_host_memory,
)
from lazytrain.runtime.hf import DecoderParts, Rotary, find_parts, head_named_params, is_packed
from lazytrain.runtime.shapes import DTYPE_NAMES, StepShapes
from lazytrain.runtime.step import GradReducer, GroupUpdate, StateTier, Step, StepStats
from lazytrain.runtime.store import ActivationStore, WeightGroup, aligned_empty

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel

T = TypeVar("T")
# the step's types, for the executor's callers
__all__ = ["Executor", "GradReducer", "GroupUpdate", "StateTier", "StepStats"]


class Executor:
    """Runs a `Plan` for a `transformers` causal LM whose parameters stay on the host.

    compute_dtype: activations, streamed weights and landed gradients (fp32 for exactness; bf16 with the
      model's parameters as master weights: fp32 ones, or bf16 ones that are the streamed buffers themselves).
    The optimizer: step it yourself after `forward_backward` (serial), or hand `defer_update` the update of
      each group: the next step runs it on the optimizer lane under its forward (overlapped-exact).
    cost: the CostModel whose `working_bytes` / `head_working_bytes` the arena reserves (so the simulator and
      the executor count the same bytes); None = a CostModel of the step's batch and sequence length.
    head_chunk_tokens: tokens per loss-head chunk (at most this many rows of logits exist at once);
      None = the cost model's, else 1024.
    """

    def __init__(self, model: nn.Module, plan: Plan, device: Device | None = None, *,
                 compute_dtype: torch.dtype = torch.float32, cost: CostModel | None = None,
                 head_chunk_tokens: int | None = None) -> None:
        if head_chunk_tokens is None:  # the cost model's chunk, so its head working set is the real one
            head_chunk_tokens = cost.head_chunk_tokens if cost is not None else HEAD_CHUNK_TOKENS
        if compute_dtype not in DTYPE_NAMES:
            raise LazyTrainError(f"compute_dtype {compute_dtype} is not supported; use torch.float32 or bfloat16")
        if head_chunk_tokens <= 0:
            raise LazyTrainError(f"head_chunk_tokens must be positive, got {head_chunk_tokens}")
        self.parts: DecoderParts = find_parts(model)  # first: its error lists the supported families
        self.spec = ModelSpec.from_config(model.config)
        plan.check_matches(self.spec)
        self.model = model
        self.plan = plan
        self.device = device if device is not None else EmulatedDevice()
        self.compute_dtype = compute_dtype
        self._update: GroupUpdate | None = None  # the deferred update of the last step (defer_update)
        # data parallelism: sums each group's landed gradient over the ranks into the group's owners (None: one
        # process); set with `keep_gradients`
        self.grad_reducer: GradReducer | None = None
        # optimizer_offload nvme (`stage_states`): who runs the program's state ops, and serial mode's updates as
        # the step program's last ops (the program waits for them; `run_updates` runs them once the caller has
        # decided the step)
        self.states: StateTier | None = None
        self.serial = False
        self._tail: Step | None = None
        self.head_chunk_tokens = head_chunk_tokens
        off_host = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
        if off_host:
            raise LazyTrainError(f"the model's parameters are on {', '.join(off_host)}; the executor streams them "
                                 "from the host: keep the model on the CPU and pass the device as `device`")
        dropout = float(getattr(model.config, "attention_dropout", 0.0) or 0.0)
        if model.training and dropout > 0:
            raise LazyTrainError(f"attention_dropout={dropout} with the model in training mode: the backward "
                                 "re-runs each layer's forward and would draw other masks; set it to 0 or call "
                                 "model.eval()")
        if "nvme" in plan.tiers:
            check_nvme_dir(self.device.nvme_dir)  # before the first step, not in the middle of one
        host_empty = self.device.host_empty
        self.layer_groups = []
        for j, layer in enumerate(self.parts.layers):
            self.layer_groups.append(WeightGroup(f"layer.{j}", list(layer.named_parameters()), compute_dtype,
                                                 host_empty))
            # a group packed by copy (a LoRA layer: its frozen base beside fp32 adapters) freed the tensors it was
            # loaded in; returned now, layer by layer, or the never-trimmed heap of the emulated device
            # (device.keep_host_memory) would keep a second copy of the model
            return_freed_host_memory()
        self.head_group = WeightGroup("head", head_named_params(self.parts), compute_dtype, host_empty)
        self.slot_numel = max(g.numel for g in self.layer_groups)  # layer slots are sized for layers
        self.head_slot_numel = self.head_group.numel if self.head_group.numel > self.slot_numel else 0
        # gradient slots hold the trainable parameters' gradients alone (the head's too when it has no own slot)
        self.grad_slot_numel = max(*(g.grad_numel for g in self.layer_groups),
                                   0 if self.head_slot_numel else self.head_group.grad_numel)
        self.head_grad_slot_numel = self.head_group.grad_numel if self.head_slot_numel else 0
        self.embedding_trainable = self.parts.embedding.weight.requires_grad
        # LoRA dropout: the step replays each layer's draws in its re-forwards (`Step._same_draws`)
        self.random_layers = model.training and any(
            isinstance(m, nn.Dropout) and m.p > 0 for layer in self.parts.layers for m in layer.modules())
        self._embedding_grad: torch.Tensor | None = None  # an untied embedding's gradient, in its dtype
        self._cast: torch.Tensor | None = None  # `WeightGroup.expose`'s transient: the largest group, one dtype
        self._accumulating = False  # the last micro-batch was not its step's last: the next one adds to it
        self.store = ActivationStore(self.device.nvme_dir, host_empty)
        self.rotary = Rotary(self.parts, self.device.torch_device)
        self.last_step: StepStats | None = None
        # the step's byte sizes at each batch shape: the cost model's working sets (or measured ones)
        self.shapes = StepShapes(self.spec, self.parts, self.layer_groups, self.head_group, self.rotary, self.device,
                                 compute_dtype, cost, head_chunk_tokens)

    def set_plan(self, plan: Plan) -> None:
        """Run `plan` from the next step on (re-planning switches plans between steps)."""
        self.drain()
        plan.check_matches(self.spec, optimizer_offload="nvme" if self.states is not None else "host")
        if self.states is not None:
            self.states.set_depth(plan.staging_depth)
        if "nvme" in plan.tiers:
            check_nvme_dir(self.device.nvme_dir)
        self.plan = plan

    # ---- the overlapped-exact optimizer -------------------------------------------------------
    def defer_update(self, update: GroupUpdate) -> None:
        """Run `update(group_index)` for every group at the start of the next step, on the optimizer lane, in
        forward order, each before that group's forward weight h2d (and the embedding's before the embedding
        gather); the bf16 streamed copy of each group is refreshed right after its update. `update` reads the
        group's gradients itself: `kept_grads(index)` as they are kept, or `.grad`s inside `group_grads(index)`.
        Call it once every gradient is final (after the step's last micro-batch, the non-finite check passed)."""
        self.drain()
        self._update = update

    def drain(self) -> None:
        """Run the deferred update now, on this thread (before a checkpoint, evaluation, re-planning or the end:
        whatever reads the parameters or the optimizer). No-op when none is pending."""
        update, self._update = self._update, None
        if update is not None:
            for target in update_order(self.parts.num_layers, self.parts.tied):
                self._run_update(update, target)

    def run_updates(self, update: GroupUpdate) -> None:
        """Serial mode: every group's update now, in update order -- with the states on NVMe as the step program's
        last ops (update, state_write, the next group's state_read, on their lanes; their stalls join
        `last_step`), else on this thread."""
        tail, self._tail = self._tail, None
        if tail is None:
            for target in update_order(self.parts.num_layers, self.parts.tied):
                self._run_update(update, target)
            return
        tail.update = partial(self._run_update, update)
        self._run_states(tail, tail.run_tail)

    def stage_states(self, states: StateTier, state_bytes: tuple[int, ...], *, serial: bool) -> None:
        """optimizer_offload nvme: the optimizer's states live in files and `states` runs the program's state ops
        (the plan's staging_depth slots); `state_bytes`: each group's bytes at target + 1 (Shapes.state_bytes);
        `serial`: optimizer_mode serial (the updates become the program's last ops, `run_updates`)."""
        self.plan.check_matches(self.spec, optimizer_offload="nvme")
        self.states, self.serial = states, serial
        self.shapes.state_bytes = tuple(state_bytes)

    def _run_states(self, step: Step, run: Callable[[], T]) -> T:
        """`run()` (a step's actions) with `states` told which groups the program writes back; after an error
        what is staged is forgotten (the run stops: its last checkpoint counts)."""
        states = self.states
        if states is None:
            return run()
        states.expect_writes({self.index_of(op.target) for op in step.program.ops if op.kind == "state_write"})
        try:
            return run()
        except BaseException:
            states.abandon()
            raise
        finally:
            states.expect_writes(())

    def _run_update(self, update: GroupUpdate, target: int) -> None:
        """Group `target`'s update (-1 embedding, j layer, L head) and its streamed copy's refresh (a copy the
        node's ranks share: by its owner, inside `update`)."""
        L = self.parts.num_layers
        update(self.index_of(target))  # it reads the group's gradients itself (`kept_grads`, or `group_grads`)
        if target >= 0:
            (self.head_group if target == L else self.layer_groups[target]).pack()

    # ---- parameter groups (one per layer, for a per-layer optimizer) -------------------------
    def param_groups(self) -> list[list[nn.Parameter]]:
        """Parameters by group, in hook order: [embedding (untied only)], layer 0..L-1, head.

        Use as `torch.optim.AdamW([{"params": g} for g in ex.param_groups() if g], fused=True)`. Only trainable
        parameters (`requires_grad`): a frozen group is an empty list, so the indices stay those of the groups.
        """
        weight = self.parts.embedding.weight
        groups = [] if self.parts.tied else [[weight] if weight.requires_grad else []]
        return groups + [list(g.trainable) for g in self.layer_groups] + [list(self.head_group.trainable)]

    def group_names(self) -> list[str]:
        names = [] if self.parts.tied else ["embedding"]
        return names + [g.name for g in self.layer_groups] + ["head"]

    def index_of(self, target: int) -> int:
        """The `param_groups()` index of a program target: -1 the untied embedding, j layer j, L the head."""
        L = self.parts.num_layers
        return self.group_names().index("embedding" if target < 0 else "head" if target == L else f"layer.{target}")

    def group_at(self, index: int) -> WeightGroup | None:
        """The streamed group of `param_groups()[index]`; None for an untied embedding (it stays on the host)."""
        if not self.parts.tied:
            index -= 1
            if index < 0:
                return None
        return self.layer_groups[index] if index < len(self.layer_groups) else self.head_group

    # ---- gradients (the host layout: runtime/store.py) ---------------------------------------
    def keep_gradients(self, reducer: GradReducer, owned: set[int]) -> None:
        """Data parallelism: sum every group's gradient over the ranks with `reducer` as it lands, and keep the
        gradients of the groups in `owned` (`param_groups()` indices) only. Every other streamed group lands in
        one of two pooled buffers sized for the largest group (alternating in backward order; a d2h into one waits
        for the land that last read it), which the reducer sends on and nothing keeps."""
        self.grad_reducer = reducer
        foreign = [i for i in reversed(range(len(self.param_groups())))
                   if i not in owned and self.group_at(i) is not None]
        if not foreign:
            return
        largest = max(self.grad_slot_numel, self.head_group.grad_numel)
        pool = [aligned_empty(largest, self.compute_dtype, self.device.host_empty) for _ in range(2)]
        for k, index in enumerate(foreign):
            group = self.group_at(index)
            assert group is not None
            group.landing, group.accum, group.grad = pool[k % 2][:group.grad_numel], None, None

    def embedding_grad(self, fresh: bool) -> torch.Tensor:
        """The gradient the embedding backward scatters into: the tied weight's view of the head group's gradient,
        or the untied embedding's own in its dtype (made on first use; zeroed when `fresh`, a step's first
        micro-batch)."""
        weight = self.parts.embedding.weight
        if self.parts.tied:
            return self.head_group.grad_of(weight)
        if self._embedding_grad is None:
            self._embedding_grad = torch.zeros_like(weight, device="cpu")
        elif fresh:
            self._embedding_grad.zero_()
        weight.grad = self._embedding_grad
        return self._embedding_grad

    def gradients(self, index: int) -> list[torch.Tensor]:
        """The gradient buffers of `param_groups()[index]` as they are kept (compute dtype or fp32, flat): what
        a collective sums or a non-finite check reads. Empty before the group's first gradient."""
        group = self.group_at(index)
        grad = self._embedding_grad if group is None else group.grad
        return [] if grad is None else [grad]

    def kept_grads(self, index: int) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter of `param_groups()[index]` -> its gradient as it is kept: a view of the group's landing
        buffer (compute dtype) or fp32 sum, no cast and no copy; empty before the group's first gradient. What the
        trainer's optimizer steps from (optim/chunked.py casts chunk by chunk)."""
        group = self.group_at(index)
        if group is None:  # the untied embedding (frozen: no parameter, no gradient)
            weights = self.param_groups()[index]
            return {} if self._embedding_grad is None or not weights else {weights[0]: self._embedding_grad}
        if group.grad is None:
            return {}
        return {p: group.grad_of(p) for p in group.trainable}

    @contextmanager
    def group_grads(self, index: int) -> Iterator[list[nn.Parameter]]:
        """The parameters of `param_groups()[index]`, each with a `.grad` in its own dtype while inside: views of
        the kept gradient, or (bf16 gradients of fp32 masters) its fp32 cast in one transient buffer sized for
        the largest group. Step the optimizer on them one group at a time; the casts are dropped on exit. One
        transient buffer: one group at a time, from one thread at a time (the optimizer lane, or the caller's
        after `forward_backward` returned). The gradients stay until the next step's backward lands its own."""
        group = self.group_at(index)
        params = self.param_groups()[index]
        if group is None:
            for p in params:  # (none when the embedding is frozen)
                p.grad = self._embedding_grad
            yield params
            return
        group.expose(self._transient)
        try:
            yield params
        finally:
            group.release()

    def _transient(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        if self._cast is None:
            largest = max(self.grad_slot_numel, self.head_group.grad_numel)
            self._cast = aligned_empty(largest * size, torch.uint8, self.device.host_empty)
        return self._cast[:numel * size].view(dtype)

    # ---- accounting ---------------------------------------------------------------------------
    def memory_sizes(self, batch: int, seq_len: int, *, masked: bool = False) -> Shapes:
        """The byte sizes of one step at this batch and sequence length (what the arena will count; `shapes`)."""
        return self.shapes(batch, seq_len, masked=masked)

    def program(self, batch: int, seq_len: int, *, masked: bool = False, forward_only: bool = False,
                updates: bool = False, last_micro_batch: bool = True) -> StepProgram:
        """The step program this executor runs for a batch of this shape (the plan's tiers and windows);
        `updates`: it starts with the deferred update. With a `grad_reducer` (data parallelism) the gradients' sums
        over the ranks are ops of the program; with the states on NVMe (`stage_states`) their reads and writes
        (and in serial mode, after a step's last micro-batch, its updates)."""
        topology = self.grad_reducer.topology if self.grad_reducer is not None else ONE_RANK
        depth = self.plan.staging_depth if self.states is not None else 0
        return build_program(self.plan.tiers, self.memory_sizes(batch, seq_len, masked=masked), updates=updates,
                             forward_only=forward_only, topology=topology, kept_layers=self.plan.kept_layers,
                             staging_depth=depth, optimizer_mode="serial" if self.serial and depth else "overlap",
                             last_micro_batch=last_micro_batch)

    def predicted_peak_bytes(self, batch: int, seq_len: int, *, masked: bool = False) -> int:
        return self.program(batch, seq_len, masked=masked).device_peak_bytes()

    # ---- one step -----------------------------------------------------------------------------
    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         num_tokens: int | None = None, loss_scale: float = 1.0,
                         last_micro_batch: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch under the plan; returns its loss (fp32, 0-dim, host).

        input_ids, labels: (B, S) int64, labels aligned with input_ids (shifted inside), -100 = ignored.
        attention_mask: (B, S) 1/0, right padding. position_ids: (B, S), restarting at 0 at each packed
        example; attention never crosses examples. num_tokens: the step's count of non-ignored shifted labels
        over all its micro-batches; the return is this micro-batch's summed token loss / num_tokens, so the
        returns of a step's micro-batches add up to its true mean loss (None = this micro-batch's own count).
        A step's gradient is the sum over its micro-batches, exactly like `(loss * loss_scale).backward()` on each:
        pass `last_micro_batch=False` on all but a step's last micro-batch; the next call starts a new step's
        gradient. Where the kept gradient has the parameter's dtype `p.grad` is a view of it; otherwise (bf16
        gradients of fp32 masters) read it through `group_grads` or `gradients`.
        """
        batch, seq_len = self._check_inputs(input_ids, labels, attention_mask, position_ids)
        if num_tokens is not None and (isinstance(num_tokens, bool) or int(num_tokens) != num_tokens
                                       or num_tokens <= 0):
            raise LazyTrainError(f"num_tokens must be a positive int (the step's non-ignored label count), "
                                 f"got {num_tokens!r}")
        if self.plan.workload is not None:
            self.plan.check_matches(self.spec, Workload(batch, seq_len, DTYPE_NAMES[self.compute_dtype]))
        if "nvme" in self.plan.tiers:  # every nvme boundary of the forward waits on disk for the backward
            A = self.memory_sizes(batch, seq_len).boundary_bytes
            spilled = sum(a for a, t in zip(A, self.plan.tiers, strict=True) if t == "nvme")
            check_nvme_space(self.device.nvme_dir, spilled)
        update, self._update = self._update, None  # the deferred update runs on this step's optimizer lane
        self._tail = None  # serial mode: a skipped step's updates never run
        program = self.program(batch, seq_len, masked=attention_mask is not None or position_ids is not None,
                               updates=update is not None, last_micro_batch=last_micro_batch)
        step = Step(self, program, input_ids, labels, attention_mask, position_ids,
                    run_update=None if update is None else partial(self._run_update, update),
                    first_micro_batch=not self._accumulating, final_micro_batch=last_micro_batch,
                    loss_scale=loss_scale, num_tokens=None if num_tokens is None else int(num_tokens))
        try:
            loss = self._run_states(step, step.run)
        finally:
            step.cleanup()
        self._accumulating = not last_micro_batch
        self.last_step = step.stats
        if step.has_tail:  # serial mode with the states on NVMe: the updates wait for `run_updates`
            self._tail = step
        return loss

    def forward_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> tuple[float, int]:
        """Evaluation: (summed token loss, count of non-ignored shifted labels), forward only.

        Streams the layers through the device like a training step, but keeps no boundary (there is no
        backward), so its device peak stays below the plan's; gradients and `last_step` are untouched.
        """
        batch, seq_len = self._check_inputs(input_ids, labels, attention_mask, position_ids)
        self.drain()
        program = self.program(batch, seq_len, masked=attention_mask is not None or position_ids is not None,
                               forward_only=True)
        step = Step(self, program, input_ids, labels, attention_mask, position_ids, run_update=None,
                    first_micro_batch=not self._accumulating, final_micro_batch=False)
        try:
            step.run()
        finally:
            step.cleanup()
        assert step.loss_sum is not None
        return step.loss_sum

    def _check_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None) -> tuple[int, int]:
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise LazyTrainError(f"input_ids and labels must both be (batch, seq_len); got "
                                 f"{tuple(input_ids.shape)} and {tuple(labels.shape)}")
        for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise LazyTrainError(f"{name} must be (batch, seq_len) like input_ids {tuple(input_ids.shape)}, "
                                     f"got {tuple(t.shape)}")
        if attention_mask is not None and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise LazyTrainError("attention_mask must hold only 1 (token) and 0 (padding)")
        if position_ids is not None and not self.parts.family.packing and is_packed(position_ids.cpu()):
            raise LazyTrainError(f"{self.parts.family.name} cannot train on packed rows (its linear-attention "
                                 "state and conv would run across example boundaries); set packing: false")
        return tuple(input_ids.shape)


