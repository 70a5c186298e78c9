"""The executor: runs one plan's training step exactly, streaming layers through a device (Contract 3).

The step is the step program of the plan (`lazytrain.plan.schedule`, Contract 2): `_Step` runs its actions
in order -- issue a job on a lane (h2d, d2h, nvme_read, nvme_write, optimizer), run a compute op, wait for a
job (the seconds waited are that lane's stall), alloc/free a device buffer in the arena -- so the simulator,
the device-memory count and this executor follow one schedule. Every transfer is issued in the window the
program gives it (a function of the plan's tiers). Weights stream into two device slots sized for layers, use
k into slot k % 2 (a loss head larger than a layer into its own slot); weight gradients leave through two
gradient slots (and the head's own; the head's two slots exist only while live, as the program allocates them);
activations are offloaded, spilled,
reloaded and recomputed exactly as the program says; weight gradients land in each group's host buffer
(`WeightGroup.land`: the gradient itself with one micro-batch, else summed in fp32) and, at the start of the
step after `defer_update`, the optimizer lane runs the previous step's update group by group in forward order,
each before that group's forward weight h2d (the overlapped-exact optimizer). The
step's peak device bytes equal `StepProgram.device_peak_bytes()` (the arena counts exactly its alloc/free actions).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from lazytrain.costmodel.cost import HEAD_CHUNK_TOKENS, CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.optim.clip import per_tensor_sq_norms
from lazytrain.plan.plan import Plan
from lazytrain.plan.schedule import Op, Shapes, StepProgram, build_program, graph_bounds, update_order
from lazytrain.runtime.device import Device, EmulatedDevice, Event, check_nvme_dir, check_nvme_space
from lazytrain.runtime.hf import (
    DecoderParts,
    LayerGraph,
    Rotary,
    find_parts,
    graph_backward,
    head_forward_backward,
    head_loss_sum,
    head_named_params,
    is_packed,
    layer_backward,
    layer_forward,
    layer_graph_forward,
    shift_labels,
)
from lazytrain.runtime.live_bytes import LiveBytes
from lazytrain.runtime.store import ActivationStore, WeightGroup, aligned_empty

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}



class GradReducer(Protocol):
    """Data parallelism (distributed/grads.py): each group's gradient summed over the ranks into its owners, micro-
    batch by micro-batch as it lands, on the optimizer lane in program order (collectives: every rank calls): the
    program's "reduce j" and "gather" ops (plan/schedule.py)."""

    topology: Topology  # the ranks the step program sums over

    def node_sum(self, index: int, landing: torch.Tensor) -> torch.Tensor | None:
        """The sum over the ranks of group `index`'s landed micro-batch gradient on its owners, None elsewhere."""
        ...

    def rows(self, index: int, grad0: torch.Tensor, ids: torch.Tensor
             ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every rank's boundary-0 gradient rows and token ids, in rank order, on the owners of `index`."""
        ...


# update(group_index): one group's optimizer update (clip, step, drop its gradients), on the optimizer lane.
GroupUpdate = Callable[[int], None]


@dataclass
class StepStats:
    """What one `forward_backward` measured."""

    wall_s: float
    stall_s: dict[str, float]  # compute blocked waiting on each stream: h2d, d2h, nvme_read, nvme_write, optimizer
    peak_device_bytes: int  # high-water mark of the device arena during the step
    predicted_peak_device_bytes: int  # the step program's alloc/free count for this plan and these sizes
    loss: float
    tokens: int
    forward_s: list[float] = field(default_factory=list)  # per layer: its first forward's compute seconds
    backward_s: list[float] = field(default_factory=list)  # per layer: autograd re-forward + backward seconds
    recompute_s: list[float] = field(default_factory=list)  # per layer: recompute-forward seconds (0 if none)
    head_s: float = 0.0
    link_busy_s: dict[str, float] = field(default_factory=dict)
    link_bytes: dict[str, int] = field(default_factory=dict)
    peak_host_activation_bytes: int = 0
    peak_nvme_bytes: int = 0
    # Global L2 norm of every `.grad` after this step, from fp32 per-tensor norms taken on the optimizer
    # link as each group's gradients land (off the critical path; hand it to the optimizer's clipping).
    # None on micro-batches run with last_micro_batch=False (their gradients are not final yet).
    grad_norm: float | None = None
    grad_sq_norm: float | None = None  # its square, summed group by group (data parallel: this rank's groups)
    # The measured step, op by op: (lane, op name, start s, end s) from the step's start (compute: wall clock
    # around each op; lanes: their jobs' events). Drawn as a trace beside the prediction (lazytrain.viz).
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)
    # every storage the step held on the device, not only the arena's (Device.true_peak_bytes: a device made with
    # measure_memory=True, or CUDA's allocator); None when not measured
    true_peak_device_bytes: int | None = None

    @property
    def exposed_s(self) -> float:
        """Total seconds compute waited on any stream."""
        return sum(self.stall_s.values())


NORM_CHUNK = 1 << 20  # elements per fp32 norm of a bf16 gradient


def sq_norm(grads: list[torch.Tensor]) -> float:
    """Summed squared L2 norms (fp32 per tensor, as the optimizer's clipping takes them). bf16 gradients (bf16
    master weights) are taken in chunks: torch upcasts a whole tensor to fp32 first, 4 B per element of it."""
    if all(g.dtype == torch.float32 for g in grads):
        return float(per_tensor_sq_norms(grads).sum())
    return sum(float(per_tensor_sq_norms(g.reshape(-1).split(NORM_CHUNK)).sum()) for g in grads)


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
        self.cost = cost
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
        self.layer_groups = [WeightGroup(f"layer.{j}", list(layer.named_parameters()), compute_dtype, host_empty)
                             for j, layer in enumerate(self.parts.layers)]
        self.head_group = WeightGroup("head", head_named_params(self.parts), compute_dtype, host_empty)
        self.slot_numel = max(g.numel for g in self.layer_groups)  # layer slots are sized for layers
        self.head_slot_numel = self.head_group.numel if self.head_group.numel > self.slot_numel else 0
        self._embedding_grad: torch.Tensor | None = None  # an untied embedding's gradient, in its dtype
        self._cast: torch.Tensor | None = None  # `WeightGroup.expose`'s transient: the largest group, one dtype
        self._accumulating = False  # the last micro-batch was not its step's last: the next one adds to it
        self.store = ActivationStore(self.device.nvme_dir, host_empty)
        self.rotary = Rotary(self.parts, self.device.torch_device)
        self.last_step: StepStats | None = None
        self._default_costs: dict[tuple[int, int, bool], CostModel] = {}
        self._measured_working: dict[tuple[int, int, bool], tuple[tuple[int, ...], int]] = {}
        # the same keys: (graph, graph forward, graph backward) bytes per layer (Shapes.graph_*)
        self._measured_graphs: dict[tuple[int, int, bool], tuple[tuple[int, ...], ...]] = {}

    def set_plan(self, plan: Plan) -> None:
        """Run `plan` from the next step on (re-planning switches plans between steps)."""
        self.drain()
        plan.check_matches(self.spec)
        if "nvme" in plan.tiers:
            check_nvme_dir(self.device.nvme_dir)
        self.plan = plan

    # ---- the overlapped-exact optimizer -------------------------------------------------------
    def defer_update(self, update: GroupUpdate) -> None:
        """Run `update(group_index)` for every group at the start of the next step, on the optimizer lane, in
        forward order, each before that group's forward weight h2d (and the embedding's before the embedding
        gather); the bf16 streamed copy of each group is refreshed right after its update. Call it once every
        gradient is final (after the step's last micro-batch, the non-finite check passed)."""
        self.drain()
        self._update = update

    def drain(self) -> None:
        """Run the deferred update now, on this thread (before a checkpoint, evaluation, re-planning or the end:
        whatever reads the parameters or the optimizer). No-op when none is pending."""
        update, self._update = self._update, None
        if update is not None:
            for target in update_order(self.parts.num_layers, self.parts.tied):
                self._run_update(update, target)

    def _run_update(self, update: GroupUpdate, target: int) -> None:
        """Group `target`'s update (-1 embedding, j layer, L head) and its streamed copy's refresh (a copy the
        node's ranks share: by its owner, inside `update`)."""
        L = self.parts.num_layers
        index = self.group_names().index("embedding" if target < 0 else "head" if target == L else f"layer.{target}")
        with self.group_grads(index):  # `.grad` in the masters' dtype, this group only (runtime/store.py)
            update(index)
        if target >= 0:
            (self.head_group if target == L else self.layer_groups[target]).pack()

    # ---- parameter groups (one per layer, for a per-layer optimizer) -------------------------
    def param_groups(self) -> list[list[nn.Parameter]]:
        """Parameters by group, in hook order: [embedding (untied only)], layer 0..L-1, head.

        Use as `torch.optim.AdamW([{"params": g} for g in ex.param_groups()], fused=True)`.
        """
        groups = [] if self.parts.tied else [[self.parts.embedding.weight]]
        return groups + [list(g.params) for g in self.layer_groups] + [list(self.head_group.params)]

    def group_names(self) -> list[str]:
        names = [] if self.parts.tied else ["embedding"]
        return names + [g.name for g in self.layer_groups] + ["head"]

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
        largest = max(self.slot_numel, self.head_group.numel)
        pool = [aligned_empty(largest, self.compute_dtype, self.device.host_empty) for _ in range(2)]
        for k, index in enumerate(foreign):
            group = self.group_at(index)
            assert group is not None
            group.landing, group.accum, group.grad = pool[k % 2][:group.numel], None, None

    def gradients(self, index: int) -> list[torch.Tensor]:
        """The gradient buffers of `param_groups()[index]` as they are kept (compute dtype or fp32, flat): what
        a collective sums or a non-finite check reads. Empty before the group's first gradient."""
        group = self.group_at(index)
        grad = self._embedding_grad if group is None else group.grad
        return [] if grad is None else [grad]

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
            params[0].grad = self._embedding_grad
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
            largest = max(self.slot_numel, self.head_group.numel)
            self._cast = aligned_empty(largest * size, torch.uint8, self.device.host_empty)
        return self._cast[:numel * size].view(dtype)

    # ---- accounting ---------------------------------------------------------------------------
    def memory_sizes(self, batch: int, seq_len: int, *, masked: bool = False) -> Shapes:
        """The byte sizes of one step at this batch and sequence length (what the arena will count).

        masked: the steps pass an attention_mask or position_ids (padding, packing), which makes the positions,
        cos/sin and every attention mask per row (see `Rotary.constant_bytes`).
        """
        dtype_bytes = torch.empty((), dtype=self.compute_dtype).element_size()
        config = self.model.config
        cost = self.cost
        if cost is None or (cost.workload.batch_size, cost.workload.seq_len, cost.workload.masked) != (
                batch, seq_len, masked):
            cost = self._default_cost(batch, seq_len, masked)  # e.g. a last, shorter batch than the plan's workload
        L = self.parts.num_layers
        boundary_bytes = batch * seq_len * config.hidden_size * dtype_bytes
        if getattr(self.device, "live", None) is not None:  # a device that measures memory: the real working sets
            working, head_working = self.measured_working_bytes(batch, seq_len, masked=masked)
            graphs = self._measured_graphs[(batch, seq_len, masked)]
        else:
            working = tuple(int(w) for w in cost.working_bytes)
            head_working = int(cost.head_working_bytes)
            graphs = graph_bounds(working, tuple(int(g) for g in cost.graph_bytes), boundary_bytes)
        return Shapes(
            boundary_bytes=(boundary_bytes,) * (L + 1),
            param_bytes=tuple(g.numel * dtype_bytes for g in self.layer_groups),
            head_param_bytes=self.head_group.numel * dtype_bytes,
            working_bytes=working,
            head_working_bytes=head_working,
            constant_bytes=self.rotary.constant_bytes(batch, seq_len, dtype_bytes, masked),
            tied_head=self.parts.tied,
            dtype_bytes=dtype_bytes,
            graph_bytes=graphs[0], graph_forward_bytes=graphs[1], graph_backward_bytes=graphs[2],
        )

    def measured_working_bytes(self, batch: int, seq_len: int, *, masked: bool = False) -> tuple[tuple[int, ...], int]:
        """The device bytes each layer's backward and the loss head really hold beyond the program's own buffers,
        measured once per layer shape by running them on this device under `LiveBytes` (random inputs; cached).

        Layer j: the high-water mark of every storage its autograd re-forward + backward creates, less its
        output d(boundary j) (the program allocates that after the compute, while the working set is still
        counted). Head: the same for the chunked head (its output is written into a buffer the program holds),
        with every label counted (a chunk without labels holds less). A forward or recompute holds less than the
        backward of its layer, so the program over-counts those windows.

        The same pass measures what a kept layer holds (`Shapes.graph_*`, in `_measured_graphs`): its graph (the
        storages alive after its forward with autograd, less its output), the peak of that forward, and its
        backward's peak beyond the graph, its output and its input's gradient."""
        key = (batch, seq_len, masked)
        if key in self._measured_working:
            return self._measured_working[key]
        torch_device, dtype, config = self.device.torch_device, self.compute_dtype, self.model.config
        gen = torch.Generator().manual_seed(0)
        shape = (batch, seq_len, config.hidden_size)
        hidden = torch.randn(shape, generator=gen).to(device=torch_device, dtype=dtype)
        grad_out = torch.randn(shape, generator=gen).to(device=torch_device, dtype=dtype)
        ones = torch.ones(batch, seq_len, dtype=torch.long) if masked else None
        consts = self.rotary.constants(hidden, ones)
        boundary_bytes = hidden.numel() * hidden.element_size()
        by_shape: dict[tuple[str, tuple], tuple[int, int, int, int]] = {}
        sizes = []  # per layer: (working set, graph, graph forward peak, graph backward beyond)
        for j, (layer, group) in enumerate(zip(self.parts.layers, self.layer_groups, strict=True)):
            shape_key = (self.parts.mask_kinds[j], tuple((s.name, s.shape) for s in group.slots))
            if shape_key not in by_shape:
                slot = torch.empty(group.numel, dtype=dtype, device=torch_device)
                weights = {n: t.to(device=torch_device, dtype=dtype) for n, t in group.views(group.buffer).items()}
                live = LiveBytes()
                with live:  # layer_backward, in its two halves
                    graph = layer_graph_forward(layer, weights, hidden, consts, self.parts.mask_kinds[j])
                    forward_peak, graph_bytes = live.peak_bytes, live.used_bytes - boundary_bytes
                    live.reset_peak()
                    graph_backward(graph, grad_out, group.views(slot))
                    del graph
                backward_peak = live.peak_bytes
                by_shape[shape_key] = (max(forward_peak, backward_peak) - boundary_bytes, graph_bytes, forward_peak,
                                       max(0, backward_peak - graph_bytes - 2 * boundary_bytes))
            sizes.append(by_shape[shape_key])
        working = [w for w, *_ in sizes]
        self._measured_graphs[key] = tuple(tuple(column) for column in list(zip(*sizes, strict=True))[1:])
        head = self.head_group
        weights = {n: t.to(device=torch_device, dtype=dtype) for n, t in head.views(head.buffer).items()}
        grads = head.views(torch.zeros(head.numel, dtype=dtype, device=torch_device))
        labels = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
        grad_hidden = torch.empty_like(hidden)
        live = LiveBytes()
        with live:  # as the head op runs it: the shifted labels made on the device, then the chunks
            targets = shift_labels(labels).to(torch_device)
            head_forward_backward(self.parts.norm, weights, hidden, targets, grad_hidden, grads,
                                  self.head_chunk_tokens, 1.0, consts.loss)
            del targets
        self._measured_working[key] = tuple(working), live.peak_bytes
        return self._measured_working[key]

    def program(self, batch: int, seq_len: int, *, masked: bool = False, forward_only: bool = False,
                updates: bool = False) -> StepProgram:
        """The step program this executor runs for a batch of this shape (the plan's tiers and windows);
        `updates`: it starts with the deferred update. With a `grad_reducer` (data parallelism) the gradients' sums
        over the ranks are ops of the program."""
        topology = self.grad_reducer.topology if self.grad_reducer is not None else ONE_RANK
        return build_program(self.plan.tiers, self.memory_sizes(batch, seq_len, masked=masked), updates=updates,
                             forward_only=forward_only, topology=topology, kept_layers=self.plan.kept_layers)

    def _default_cost(self, batch: int, seq_len: int, masked: bool = False) -> CostModel:
        """The shared CostModel's byte sizes (working sets), so the planner, simulator and arena agree."""
        key = (batch, seq_len, masked)
        if key not in self._default_costs:
            workload = Workload(batch, seq_len, DTYPE_NAMES[self.compute_dtype], masked)
            hardware = self.cost.hardware if self.cost is not None else HardwareSpec.load("emulated")  # its kernels
            self._default_costs[key] = CostModel(self.spec, hardware, workload,
                                                 head_chunk_tokens=self.head_chunk_tokens)
        return self._default_costs[key]

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
        step = _Step(self, input_ids, labels, attention_mask, position_ids, loss_scale, last_micro_batch,
                     None if num_tokens is None else int(num_tokens))
        try:
            loss = step.run()
        finally:
            step.cleanup()
        self._accumulating = not last_micro_batch
        self.last_step = step.stats
        return loss

    def forward_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> tuple[float, int]:
        """Evaluation: (summed token loss, count of non-ignored shifted labels), forward only.

        Streams the layers through the device like a training step, but keeps no boundary (there is no
        backward), so its device peak stays below the plan's; gradients and `last_step` are untouched.
        """
        self._check_inputs(input_ids, labels, attention_mask, position_ids)
        self.drain()
        step = _Step(self, input_ids, labels, attention_mask, position_ids, 1.0, False, None, forward_only=True)
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


class _Step:
    """One forward_backward: runs the step program's actions in order (Contract 2, plan/schedule.py).

    Each op kind has one handler below that does the real work; the arena counts exactly the program's
    alloc/free actions, and every wait's seconds are charged to the awaited op's lane (`_wait`)."""

    def __init__(self, ex: Executor, input_ids: torch.Tensor, labels: torch.Tensor,
                 attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, loss_scale: float,
                 run_hook: bool, num_tokens: int | None, *, forward_only: bool = False) -> None:
        self.ex = ex
        self.dev = ex.device
        self.tiers = ex.plan.tiers
        self.L = len(self.tiers) - 1
        self.input_ids = input_ids.cpu()
        self.labels = labels.cpu()
        self.attention_mask = attention_mask.cpu() if attention_mask is not None else None
        self.position_ids = position_ids.cpu() if position_ids is not None else None
        self.num_tokens = num_tokens
        self.loss_scale = loss_scale
        self.final_micro_batch = run_hook  # gradients are final after this step: take their norm
        self.update = None if forward_only else ex._update  # the deferred update runs on this step's lane
        if not forward_only:
            ex._update = None
        self.first_micro_batch = not ex._accumulating  # gradients start afresh (the last step's were taken)
        self.grad_sq_norm = 0.0
        self.batch, self.seq_len = input_ids.shape
        masked = attention_mask is not None or position_ids is not None
        self.program = ex.program(self.batch, self.seq_len, masked=masked, forward_only=forward_only,
                                  updates=self.update is not None)
        self.stall: dict[str, float] = defaultdict(float)
        self.on_device: dict[int, torch.Tensor] = {}  # boundary -> device activation
        self.grads: dict[int, torch.Tensor] = {}  # boundary -> device gradient
        self.host: dict[int, torch.Tensor] = {}  # boundary -> its host buffer (cpu tier, nvme staging)
        self.events: dict[int, Event] = {}  # op index -> its event
        self.pending: list[Event] = []  # every issued event (waited for on cleanup after an error)
        self.out: torch.Tensor | None = None  # the last compute's output, adopted by the next alloc
        self.loss: torch.Tensor | None = None
        self.loss_sum: tuple[float, int] | None = None  # forward_only: (summed token loss, token count)
        self.reserved = 0
        self.allocated: dict[int, torch.Tensor] = {}  # id -> device tensor, until freed (then released)
        self.slots: list[torch.Tensor] = []  # two layer slots
        self.head_slots: dict[str, torch.Tensor] = {}  # head_weights / head_grads: the head's own, while live
        self.kept_slots: dict[int, torch.Tensor] = {}  # kept layer -> its weights' own slot
        self.graphs: dict[int, LayerGraph] = {}  # kept layer -> its graph, from its forward to its backward
        self.grad_slots: list[torch.Tensor] = []
        self.grad_uses = 0
        self.arrivals: dict[int, int] = defaultdict(int)  # group index -> gradient parts landed
        self.landing_free: dict[int, Event] = {}  # landing buffer address -> the land op that last read it
        # data parallel, from a reduce / gather op to the land / embedding op after it on the optimizer lane: a
        # group's sum over the ranks (None: another rank owns it), every rank's boundary-0 gradient rows
        self.summed: dict[int, torch.Tensor | None] = {}
        self.gathered: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.timeline: list[tuple[str, str, float, float]] = []  # compute ops: (lane, name, start, end)
        self.marks: list[tuple[Op, object, object]] = []  # compute ops and their device marks (CUDA events)
        L = self.L
        self.stats = StepStats(wall_s=0.0, stall_s={}, peak_device_bytes=0,
                               predicted_peak_device_bytes=self.program.device_peak_bytes(),
                               loss=float("nan"), tokens=self.batch * self.seq_len,
                               forward_s=[0.0] * L, backward_s=[0.0] * L, recompute_s=[0.0] * L)

    # ---- the interpreter ------------------------------------------------------------------------
    def run(self) -> torch.Tensor:
        ex, dev = self.ex, self.dev
        if self.update is None:  # (else each group's update refreshes its copy)
            for group in [*ex.layer_groups, ex.head_group]:
                group.pack()  # bf16: refresh the streamed copy from the fp32 masters (a node's shared one: its owner)
        dev.reset_peak()
        self.links_before = dev.link_stats()
        self.t_start = time.perf_counter()
        self.mark_start = dev.mark()
        ops = self.program.ops
        for action in self.program.actions:
            if action.verb == "issue":
                op = ops[action.op]
                event = self._issue(op)
                self.events[op.index] = event
                self.pending.append(event)
            elif action.verb == "run":
                with dev.measuring():
                    self._run(ops[action.op])
            elif action.verb == "wait":
                self._wait(self.events[action.op])
            elif action.verb == "alloc":
                self._alloc_buffer(*action.buffer, action.num_bytes)
            else:
                self._free_buffer(*action.buffer, action.num_bytes)
        dev.synchronize()
        self.stats.wall_s = time.perf_counter() - self.t_start
        self._time_compute()
        if self.loss is None:  # forward only: evaluate
            return torch.tensor(float("nan"))
        self.stats.loss = float(self.loss)
        if self.final_micro_batch:
            self.stats.grad_sq_norm = self.grad_sq_norm
            self.stats.grad_norm = self.grad_sq_norm ** 0.5
        return self.loss.detach().cpu()

    # ---- compute ops ------------------------------------------------------------------------------
    def _run(self, op: Op) -> None:
        ex, j, t0 = self.ex, op.target, self.dev.mark()
        weights = self._group_of(op).views(self._weight_slot(op))
        if op.kind == "keep":  # a kept layer: with autograd, its graph (and weights) kept until its backward
            self.graphs[j] = layer_graph_forward(ex.parts.layers[j], weights, self.on_device[j], self.consts,
                                                 ex.parts.mask_kinds[j])
            self.out = self.graphs[j].out.detach()
        elif op.kind == "backprop":  # through the kept graph: no re-forward, weights never streamed again
            grads = ex.layer_groups[j].views(self._grad_slot(j))
            self.out = graph_backward(self.graphs.pop(j), self.grads[j + 1], grads)
        elif op.kind in ("forward", "recompute"):
            with torch.no_grad():
                self.out = layer_forward(ex.parts.layers[j], weights, self.on_device[j], self.consts,
                                         ex.parts.mask_kinds[j])
        elif op.kind == "backward":  # weight gradients straight into the next gradient slot (sent next window)
            grads = ex.layer_groups[j].views(self._grad_slot(j))
            self.out = layer_backward(ex.parts.layers[j], weights, self.on_device[j], self.grads[j + 1], self.consts,
                                      ex.parts.mask_kinds[j], grads)
        elif op.kind == "loss":  # forward only: the chunked head sums the token losses
            targets = shift_labels(self.labels).to(self.dev.torch_device)
            loss_sum, count = head_loss_sum(ex.parts.norm, weights, self.on_device[self.L], targets,
                                            ex.head_chunk_tokens)
            self.loss_sum = (float(loss_sum), count)
        else:  # the loss head writes its weight gradients straight into the next gradient slot
            head_grads = ex.head_group.views(self._grad_slot(self.L))
            for g in head_grads.values():
                g.zero_()
            targets = shift_labels(self.labels).to(self.dev.torch_device)
            self.loss = head_forward_backward(ex.parts.norm, weights, self.on_device[self.L], targets,
                                              self.grads[self.L], head_grads, ex.head_chunk_tokens, self.loss_scale,
                                              self.consts.loss, self.num_tokens)
        self.marks.append((op, t0, self.dev.mark()))

    def _time_compute(self) -> None:
        """Each compute op's seconds from its device marks (CUDA events on CUDA, the wall clock on the emulated
        device), read once the step has synchronized."""
        seconds_between, base = self.dev.seconds_between, self.mark_start
        for op, t0, t1 in self.marks:
            j, seconds = op.target, seconds_between(t0, t1)
            if op.kind in ("forward", "keep"):
                self.stats.forward_s[j] = seconds
            elif op.kind == "recompute":
                self.stats.recompute_s[j] += seconds
            elif op.kind == "backward":
                self.stats.backward_s[j] = seconds
            elif op.kind == "backprop":  # with its forward: the re-forward + backward a streamed layer's costs
                self.stats.backward_s[j] = self.stats.forward_s[j] + seconds
            elif op.kind == "head":
                self.stats.head_s = seconds
            start = seconds_between(base, t0)
            self.timeline.append(("compute", op.name, start, start + seconds))

    # ---- lane ops -----------------------------------------------------------------------------------
    def _issue(self, op: Op) -> Event:
        dev, store, after = self.dev, self.ex.store, [self.events[a] for a in op.after]
        i = op.target
        if op.kind == "weights":  # into slot use % 2 (a kept layer's own), after the compute that last read it
            group = self._group_of(op)
            slot = self._weight_slot(op)
            return dev.copy("h2d", slot[:group.numel], group.buffer, after=[*after, dev.record_compute()])
        if op.kind == "update":
            update, target = self.update, op.target
            assert update is not None
            return dev.submit("optimizer", lambda: self.ex._run_update(update, target), after=after)
        if op.kind == "boundary0":  # the embedding rows, gathered on the host (after the embedding's update)
            for event in after:
                self._wait(event)
            rows = self.ex.parts.embedding.weight.detach()[self.input_ids].to(self.ex.compute_dtype)  # (B, S, H)
            if dev.torch_device.type == "cuda":
                rows = rows.pin_memory()
            return dev.copy("h2d", self.on_device[0], rows, after=[dev.record_compute()])
        if op.kind == "offload":
            t = self.on_device[i]
            self.host[i] = host = store.host_buffer(i, tuple(t.shape), t.dtype)
            if self.tiers[i] == "cpu":
                store.note_host(host.numel() * host.element_size())
            return dev.copy("d2h", host, t, after=[dev.record_compute()])
        if op.kind == "spill":
            host = self.host[i]
            return dev.submit("nvme_write", lambda: store.write(i, host), op.num_bytes, after=after)
        if op.kind == "read":
            host = self.host[i]
            return dev.submit("nvme_read", lambda: store.read(i, host), op.num_bytes, after=after)
        if op.kind == "reload":
            # CUDA: the new block may be memory the compute stream freed but still reads; order after it
            return dev.copy("h2d", self.on_device[i], self.host[i], after=[*after, dev.record_compute()])
        if op.kind == "grads":
            return self._send_grads(op)
        if op.kind == "reduce":  # data parallel: this micro-batch's gradient summed into the group's owners
            group = self.ex.head_group if i == self.L else self.ex.layer_groups[i]
            index = self._group_index("head" if i == self.L else f"layer.{i}")
            reducer = self.ex.grad_reducer
            assert reducer is not None

            def reduce() -> None:
                self.summed[index] = reducer.node_sum(index, group.landing)

            return dev.submit("optimizer", reduce, after=after)
        if op.kind == "gather":  # data parallel: every rank's boundary-0 gradient rows to the embedding's owners
            index = self._group_index("head" if self.ex.parts.tied else "embedding")
            reducer, host0 = self.ex.grad_reducer, self.host[-1]
            assert reducer is not None

            def gather() -> None:
                self.gathered = reducer.rows(index, host0, self.input_ids)

            return dev.submit("optimizer", gather, after=after)
        if op.kind == "land":
            group = self.ex.head_group if i == self.L else self.ex.layer_groups[i]
            index = self._group_index("head" if i == self.L else f"layer.{i}")
            parts = 1 + self.ex.parts.tied if i == self.L else 1
            sum_fp32 = parts > 1 and self.ex.compute_dtype != torch.float32  # a tied head: exact in fp32

            def land() -> None:  # data parallel: the sum over the ranks (on its owners; elsewhere nothing)
                source = group.landing if self.ex.grad_reducer is None else self.summed.pop(index)
                if source is not None:
                    group.land(first=self.first_micro_batch, last=self.final_micro_batch, sum_fp32=sum_fp32,
                               source=source)
                self._arrived(index, parts)

            event = dev.submit("optimizer", land, after=after)
            self.landing_free[group.landing.data_ptr()] = event  # a pooled landing buffer is free again
            return event
        if op.kind == "grad0":
            grad0 = self.grads[0]
            self.host[-1] = store.host_buffer(-1, tuple(grad0.shape), grad0.dtype)
            return dev.copy("d2h", self.host[-1], grad0, after=[dev.record_compute()])
        if op.kind == "embedding":
            index = self._group_index("embedding") if not self.ex.parts.tied else self._group_index("head")
            host0 = self.host[-1]
            return dev.submit("optimizer", lambda: self._embedding_backward(host0, index), after=after)
        raise LazyTrainError(f"the executor cannot run op {op.name!r} (the optimizer step is its caller's)")

    def _weight_slot(self, op: Op) -> torch.Tensor:
        """Where the weights of `op`'s use live: a kept layer's own slot, the loss head's own when it has one,
        else layer slot use % 2."""
        kept = self.kept_slots.get(op.target)
        if kept is not None:
            return kept
        if op.target == self.L and "head_weights" in self.head_slots:
            return self.head_slots["head_weights"]
        return self.slots[op.use % 2]

    def _grad_slot(self, target: int) -> torch.Tensor:
        """Where group `target`'s weight gradients are written and sent from: the loss head's own gradient slot
        when it has one, else gradient slot g % 2 (g: gradients sent so far; the program waited for that slot's
        previous d2h)."""
        if target == self.L and "head_grads" in self.head_slots:
            return self.head_slots["head_grads"]
        return self.grad_slots[self.grad_uses % 2]

    def _group_of(self, op: Op) -> WeightGroup:
        return self.ex.head_group if op.target == self.L else self.ex.layer_groups[op.target]

    # ---- gradients ------------------------------------------------------------------------------
    def _send_grads(self, op: Op) -> Event:
        """d2h of a group's gradients from the slot its compute wrote them into (`_grad_slot`)."""
        group = self._group_of(op)
        grad_slot = self._grad_slot(op.target)
        self.grad_uses += 1
        free = self.landing_free.get(group.landing.data_ptr())  # a pooled buffer: after its last land
        return self.dev.copy("d2h", group.landing, grad_slot[:group.numel],
                             after=[self.dev.record_compute(), *([free] if free is not None else [])])

    def _embedding_backward(self, host_grad: torch.Tensor, index: int) -> None:
        """The embedding's gradient from the boundary-0 gradient, scattered on the host: into the untied
        embedding's own gradient (its dtype), or into the tied weight's view of the head group's gradient. Data
        parallel: every rank's rows, gathered to the group's owners in rank order (the global batch's rows) by the
        gather op before it."""
        ex = self.ex
        emb = ex.parts.embedding
        weight = emb.weight
        parts = 2 if ex.parts.tied else 1
        gathered = [(host_grad, self.input_ids)] if ex.grad_reducer is None else self.gathered  # (the gather op's)
        if gathered is None:  # another rank owns the group
            self._arrived(index, parts)
            return
        if ex.parts.tied:
            grad = ex.head_group.grad_of(weight)
        else:
            if ex._embedding_grad is None:
                ex._embedding_grad = torch.zeros_like(weight, device="cpu")
            elif self.first_micro_batch:
                ex._embedding_grad.zero_()
            grad = weight.grad = ex._embedding_grad
        ids = torch.cat([i.reshape(-1) for _, i in gathered]) if len(gathered) > 1 else self.input_ids.reshape(-1)
        g = torch.cat([h.reshape(-1, h.shape[-1]) for h, _ in gathered]) if len(gathered) > 1 else \
            host_grad.reshape(-1, host_grad.shape[-1])
        if emb.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            keep = ids != emb.padding_idx
            ids, g = ids[keep], g[keep]
        if grad.dtype == torch.float32:
            grad.index_add_(0, ids, g.to(grad.dtype))  # scattered in place: no vocab x hidden temporary
        else:  # bf16 master weights: each row's tokens summed in fp32, rounded once
            rows, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(len(rows), g.shape[-1], dtype=torch.float32).index_add_(0, inverse, g.float())
            grad.index_add_(0, rows, summed.to(grad.dtype))
        self._arrived(index, parts)

    def _arrived(self, index: int, parts: int) -> None:
        """A part of group `index`'s gradient is in place; on the step's last micro-batch, once the group is
        complete, take its squared norm."""
        self.arrivals[index] += 1
        if self.arrivals[index] != parts or not self.final_micro_batch:
            return
        ex = self.ex
        with ex.group_grads(index) as params:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:  # (data parallel: only a group's owners hold its gradient)
                self.grad_sq_norm += sq_norm(grads)

    def _group_index(self, name: str) -> int:
        return self.ex.group_names().index(name)

    # ---- the arena: the program's alloc/free actions ------------------------------------------------
    def _alloc_buffer(self, kind: str, i: int, num_bytes: int) -> None:
        ex, dtype = self.ex, self.ex.compute_dtype
        shape = (self.batch, self.seq_len, ex.model.config.hidden_size)
        if kind in ("weight_slots", "grad_slots"):
            slots = [self._alloc((ex.slot_numel,), dtype, kind.replace("_", " ")) for _ in range(2)]
            if kind == "weight_slots":
                self.slots = slots
            else:
                self.grad_slots = slots
        elif kind == "kept_weights":
            self.kept_slots[i] = self._alloc((ex.layer_groups[i].numel,), dtype, f"kept weights {i}")
        elif kind in ("head_weights", "head_grads"):
            self.head_slots[kind] = self._alloc((ex.head_slot_numel,), dtype, kind.replace("_", " "))
        elif kind in ("working", "graph", "constants"):
            if kind == "constants":
                with self.dev.measuring():
                    self.consts = ex.rotary.constants(self.on_device[0], self.attention_mask, self.position_ids)
            self._reserve(num_bytes, "rotary tables and masks" if kind == "constants" else f"{kind} {i}")
        elif self.out is not None:  # a compute's output: boundary i (forward, recompute) or its gradient
            t, self.out = self._adopt(self.out, f"{kind} {i}"), None
            (self.on_device if kind == "boundary" else self.grads)[i] = t
        else:  # boundary 0, a reload's buffer, or the gradient of boundary L (the head writes into it)
            (self.on_device if kind == "boundary" else self.grads)[i] = self._alloc(shape, dtype, f"{kind} {i}")

    def _free_buffer(self, kind: str, i: int, num_bytes: int) -> None:
        if kind == "boundary":
            self._free(self.on_device.pop(i))
        elif kind == "grad":
            self._free(self.grads.pop(i))
        elif kind == "kept_weights":
            self._free(self.kept_slots.pop(i))
        elif kind in ("head_weights", "head_grads"):
            self._free(self.head_slots.pop(kind))
        elif kind in ("working", "graph", "constants"):
            self._unreserve(num_bytes)
        else:
            for t in self.slots if kind == "weight_slots" else self.grad_slots:
                self._free(t)

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        t = self.dev.alloc(shape, dtype, tag)
        self.allocated[id(t)] = t
        return t

    def _adopt(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        self.dev.adopt(t, tag)
        self.allocated[id(t)] = t
        return t

    def _free(self, t: torch.Tensor) -> None:
        self.dev.free(t)
        self.allocated.pop(id(t), None)  # our reference goes with the count: the memory is released

    def _reserve(self, num_bytes: int, tag: str) -> None:
        self.dev.reserve(num_bytes, tag)
        self.reserved += num_bytes

    def _unreserve(self, num_bytes: int) -> None:
        self.dev.unreserve(num_bytes)
        self.reserved -= num_bytes

    def _wait(self, event: Event) -> None:
        """Block compute on a lane's event; the seconds blocked are that lane's stall."""
        self.stall[event.link] += self.dev.wait(event)

    def cleanup(self) -> None:
        """Return every device byte and spill file of the step, also after an error."""
        for event in self.pending:
            try:
                event.wait()
            except BaseException:  # the first error is already propagating
                pass
        self.graphs.clear()  # after an error: a kept layer's saved tensors go with its graph
        for t in self.allocated.values():
            self.dev.free(t)
        if self.reserved:
            self.dev.unreserve(self.reserved)
            self.reserved = 0
        self.ex.store.end_step()
        stats = self.stats
        stats.peak_device_bytes = self.dev.peak_bytes
        stats.true_peak_device_bytes = self.dev.true_peak_bytes()
        stats.stall_s = {link: self.stall.get(link, 0.0)
                         for link in ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")}
        stats.peak_host_activation_bytes = self.ex.store.peak_host_bytes
        stats.peak_nvme_bytes = self.ex.store.peak_nvme_bytes
        before = getattr(self, "links_before", None)
        if before is not None:
            after = self.dev.link_stats()
            stats.link_busy_s = {n: after[n][0] - before[n][0] for n in after}
            stats.link_bytes = {n: after[n][1] - before[n][1] for n in after}
        t_start = getattr(self, "t_start", None)
        if t_start is not None:  # the measured trace: compute ops timed here, lane ops by their events
            links = [(op.lane, op.name, self.events[op.index]) for op in self.program.ops if op.index in self.events]
            stats.timeline = sorted(self.timeline + [(lane, name, e.start_s - t_start, e.end_s - t_start)
                                                     for lane, name, e in links if e.end_s > 0],
                                    key=lambda x: x[2])
