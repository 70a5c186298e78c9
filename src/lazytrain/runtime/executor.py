"""The executor: runs one plan's training step exactly, streaming layers through a device (Contract 3).

Schedule as implemented (see docs/executor.md and the shared schedule contract):

Weights. Every use of a layer's weights (forward, recompute-forward, backward) or of the loss head's
streams the group's packed host buffer into one of two device weight slots over h2d. Use k goes to
slot k % 2; its copy is issued when use k-1 starts (slot k % 2 was freed by use k-2), so it overlaps
use k-1's compute. Uses: forward 0..L-1, head, then per segment (s, e) from last to first:
recompute s..e-2, backward e-1..s.

Forward (no autograd). Boundary 0 = embedding rows gathered on the host, sent over h2d. Layer j
computes boundary j+1. A `cpu` boundary is copied d2h into its host buffer at once; an `nvme` one is
copied d2h and then written to a file on nvme_write. The device copy of boundary j (tier cpu, nvme
or recompute) is freed once layer j's forward has consumed it, after its d2h has finished
(compute waits for it: a d2h stall) -- a tensor being read by compute cannot be freed earlier.

Loss head. The two gradient slots are allocated, the reload of the last segment's start boundary is
issued, then final norm + LM head + cross-entropy run forward+backward in token chunks.

Backward (Contract 2). For segment (s, e), last first: the reload (nvme_read then h2d, or h2d) of the
previous segment's start boundary is issued; boundary s is waited for; layers s..e-2 rerun forward
without autograd; then for j = e-1..s layer j reruns forward with autograd from boundary j and
backpropagates d(boundary j+1); its weight gradients are copied into gradient slot g % 2 (waiting for
that slot's previous d2h) and sent d2h; boundary j+1 and its gradient are freed. On the host the
optimizer link adds each group's gradients into the fp32 `.grad` and, when the group is complete,
calls the optimizer hook. Finally d(boundary 0) goes d2h and is scattered into the embedding's grad.

Memory accounting (the device arena, and `predict_device_peak`): 2 weight slots and, from the loss
head on, 2 gradient slots, each max(layer, head) parameter bytes in the compute dtype; boundary
activations while on the device; boundary gradients (1, or 2 during a layer's backward); a layer's
`working_bytes[j]` during each of its computes (forward, recompute, backward) and the head's during
the head; and the per-step constants (rotary cos/sin, attention masks, positions).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lazytrain.errors import LazyTrainError
from lazytrain.optim.clip import per_tensor_sq_norms
from lazytrain.plan.plan import Plan
from lazytrain.runtime.device import Device, EmulatedDevice, Event, check_nvme_dir, check_nvme_space
from lazytrain.runtime.hf import (
    DecoderParts,
    Rotary,
    find_parts,
    head_forward_backward,
    head_loss_sum,
    head_named_params,
    is_packed,
    layer_backward,
    layer_forward,
    shift_labels,
)
from lazytrain.runtime.store import ActivationStore, WeightGroup
from lazytrain.spec.model import ModelSpec
from lazytrain.spec.workload import Workload

OFFLOADED = ("cpu", "nvme")
HEAD_CHUNK_TOKENS = 1024  # tokens per loss-head chunk (lazytrain.spec.cost uses the same default)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# hook(group_index, params): called on the optimizer link once every gradient of that group is in `.grad`.
OptimizerHook = Callable[[int, list[nn.Parameter]], None]


def layerwise_hook(optimizers: list[torch.optim.Optimizer]) -> OptimizerHook:
    """An optimizer hook stepping `optimizers[i]` (one per `Executor.param_groups()` entry) as group i lands.

    E.g. `layerwise_hook([torch.optim.AdamW(g, lr=3e-4, fused=True) for g in ex.param_groups()])`.
    Global-norm clipping needs every gradient first: clip per group, or use serial mode.
    """

    def hook(index: int, params: list[nn.Parameter]) -> None:
        optimizers[index].step()
        optimizers[index].zero_grad(set_to_none=True)

    return hook


@dataclass
class StepStats:
    """What one `forward_backward` measured."""

    wall_s: float
    stall_s: dict[str, float]  # compute blocked waiting on each stream: h2d, d2h, nvme_read, nvme_write, optimizer
    peak_device_bytes: int  # high-water mark of the device arena during the step
    predicted_peak_device_bytes: int  # `predict_device_peak` for this plan and these sizes
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
    # None on micro-batches run with run_optimizer_hook=False (their gradients are not final yet).
    grad_norm: float | None = None

    @property
    def exposed_s(self) -> float:
        """Total seconds compute waited on any stream."""
        return sum(self.stall_s.values())


@dataclass(frozen=True)
class MemorySizes:
    """The byte sizes the device accounting needs (the executor's own, or a CostModel's)."""

    boundary_bytes: int  # A: one boundary activation (batch * seq * hidden * dtype bytes)
    slot_bytes: int  # one weight (and one gradient) slot: max(layer, head) parameter bytes in compute dtype
    working_bytes: tuple[int, ...]  # per layer: autograd working set reserved during each compute
    head_working_bytes: int
    constant_bytes: int = 0  # rotary cos/sin, attention masks and positions for the step


def predict_device_peak(tiers: tuple[str, ...] | list[str], sizes: MemorySizes) -> int:
    """Peak device bytes of one step of `tiers`, replaying the executor's allocations in order.

    Deterministic: every free happens at a fixed point of the schedule (see the module docstring),
    so the peak does not depend on link speeds.
    """
    tiers = tuple(tiers)
    L = len(tiers) - 1
    A, W = sizes.boundary_bytes, sizes.slot_bytes
    used = peak = 0

    def add(n: int) -> None:
        nonlocal used, peak
        used += n
        peak = max(peak, used)

    add(2 * W)  # weight slots
    add(A)  # boundary 0
    add(sizes.constant_bytes)
    for j in range(L):
        add(sizes.working_bytes[j])
        add(A)  # boundary j+1
        used -= sizes.working_bytes[j]
        if j > 0 and tiers[j] != "gpu":
            used -= A  # boundary j leaves the device once consumed (offloaded or dropped)
    segments = _segments(tiers)
    add(2 * W)  # gradient slots
    if tiers[segments[-1][0]] in OFFLOADED:
        add(A)  # reload of the last segment's start, issued as the head starts
    add(sizes.head_working_bytes)
    add(A)  # d(boundary L)
    used -= sizes.head_working_bytes
    for idx in range(len(segments) - 1, -1, -1):
        s, e = segments[idx]
        if idx > 0 and tiers[segments[idx - 1][0]] in OFFLOADED:
            add(A)  # reload of the previous segment's start, one segment ahead
        for j in range(s, e - 1):  # recompute s+1..e-1
            add(sizes.working_bytes[j])
            add(A)
            used -= sizes.working_bytes[j]
        for j in range(e - 1, s - 1, -1):
            add(sizes.working_bytes[j])
            add(A)  # d(boundary j)
            used -= sizes.working_bytes[j]
            used -= 2 * A  # boundary j+1 and its gradient
    return peak


def estimate_working_bytes(config: Any, batch: int, seq_len: int, dtype_bytes: int) -> int:
    """Autograd working set of one dense decoder layer (saved activations + their gradients), bytes.

    A deliberately simple count so the simulator and the executor can share it: per token,
    10 hidden + 3 query + 4 key/value + 5 intermediate vectors, plus two score matrices per head.
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    q = heads * head_dim
    tokens = batch * seq_len
    per_token = 10 * h + 3 * q + 4 * kv + 5 * config.intermediate_size
    return dtype_bytes * (tokens * per_token + 2 * batch * heads * seq_len * seq_len)


def estimate_head_working_bytes(config: Any, batch: int, seq_len: int, dtype_bytes: int, chunk_tokens: int) -> int:
    """Loss-head working set: one chunk's logits (fp32 and compute dtype) and its gradient, plus norms."""
    rows = min(chunk_tokens, batch * seq_len)
    return rows * (config.vocab_size * (2 * 4 + dtype_bytes) + 4 * config.hidden_size * dtype_bytes)


def _segments(tiers: tuple[str, ...]) -> list[tuple[int, int]]:
    kept = [i for i, t in enumerate(tiers) if t != "recompute"]
    return list(zip(kept[:-1], kept[1:], strict=True))


class Executor:
    """Runs a `Plan` for a `transformers` causal LM whose parameters stay on the host.

    compute_dtype: activations and streamed weights (fp32 for exactness; bf16 with the model's fp32
      parameters as master weights and fp32 `.grad` accumulation).
    optimizer_hook: `hook(group_index, params)`, run on the optimizer link as soon as all gradients of
      `param_groups()[group_index]` are in `.grad` (overlap mode); None = step the optimizer yourself
      after `forward_backward` (serial mode).
    cost: a `lazytrain.spec.cost.CostModel` whose `working_bytes` / `head_working_bytes` the arena
      reserves (so the simulator and the executor count the same bytes); None = the same CostModel
      formulas for the step's batch and sequence length (`estimate_working_bytes` if that module is absent).
    head_chunk_tokens: tokens per loss-head chunk (at most this many rows of logits exist at once);
      None = the cost model's, else 1024.
    """

    def __init__(self, model: nn.Module, plan: Plan, device: Device | None = None, *,
                 compute_dtype: torch.dtype = torch.float32, optimizer_hook: OptimizerHook | None = None,
                 cost: Any = None, head_chunk_tokens: int | None = None) -> None:
        if head_chunk_tokens is None:  # the cost model's chunk, so its head working set is the real one
            head_chunk_tokens = int(getattr(cost, "head_chunk_tokens", None) or HEAD_CHUNK_TOKENS)
        if compute_dtype not in DTYPE_NAMES:
            raise LazyTrainError(f"compute_dtype {compute_dtype} is not supported; use torch.float32 or bfloat16")
        if head_chunk_tokens <= 0:
            raise LazyTrainError(f"head_chunk_tokens must be positive, got {head_chunk_tokens}")
        self.spec = ModelSpec.from_config(model.config)
        plan.check_matches(self.spec)
        self.model = model
        self.plan = plan
        self.device = device if device is not None else EmulatedDevice()
        self.compute_dtype = compute_dtype
        self.optimizer_hook = optimizer_hook
        self.cost = cost
        self.head_chunk_tokens = head_chunk_tokens
        self.parts: DecoderParts = find_parts(model)
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
        self.slot_numel = max(g.numel for g in [*self.layer_groups, self.head_group])
        # Host staging for each group's gradients (compute dtype, pinned on CUDA).
        self._grad_host = {id(g): host_empty((g.numel,), compute_dtype) for g in [*self.layer_groups, self.head_group]}
        self.store = ActivationStore(self.device.nvme_dir, host_empty)
        self.rotary = Rotary(self.parts, self.device.torch_device)
        self.last_step: StepStats | None = None
        self._default_costs: dict[tuple[int, int], Any] = {}

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

    # ---- accounting ---------------------------------------------------------------------------
    def memory_sizes(self, batch: int, seq_len: int, *, masked: bool = False) -> MemorySizes:
        """The byte sizes of one step at this batch and sequence length (what the arena will count).

        masked: the steps pass an attention_mask or position_ids (padding, packing), which makes the positions,
        cos/sin and every attention mask per row (see `Rotary.constant_bytes`).
        """
        dtype_bytes = torch.empty((), dtype=self.compute_dtype).element_size()
        config = self.model.config
        cost = self.cost
        workload = getattr(cost, "workload", None)
        if cost is None or (workload is not None and (workload.batch_size, workload.seq_len) != (batch, seq_len)):
            cost = self._default_cost(batch, seq_len)  # e.g. a last, shorter batch than the plan's workload
        if cost is not None:
            working = tuple(int(w) for w in cost.working_bytes)
            head_working = int(cost.head_working_bytes)
        else:
            working = (estimate_working_bytes(config, batch, seq_len, dtype_bytes),) * self.parts.num_layers
            head_working = estimate_head_working_bytes(config, batch, seq_len, dtype_bytes, self.head_chunk_tokens)
        return MemorySizes(
            boundary_bytes=batch * seq_len * config.hidden_size * dtype_bytes,
            slot_bytes=self.slot_numel * dtype_bytes,
            working_bytes=working,
            head_working_bytes=head_working,
            constant_bytes=self.rotary.constant_bytes(batch, seq_len, dtype_bytes, masked),
        )

    def _default_cost(self, batch: int, seq_len: int) -> Any:
        """The shared CostModel's byte sizes (working sets), so the planner, simulator and arena agree."""
        key = (batch, seq_len)
        if key not in self._default_costs:
            try:
                from lazytrain.spec.cost import CostModel
                from lazytrain.spec.hardware import HardwareSpec
            except ImportError:  # the cost model is optional for the executor
                self._default_costs[key] = None
            else:
                workload = Workload(batch, seq_len, DTYPE_NAMES[self.compute_dtype])
                self._default_costs[key] = CostModel(self.spec, HardwareSpec.load("emulated"), workload,
                                                     head_chunk_tokens=self.head_chunk_tokens)
        return self._default_costs[key]

    def predicted_peak_bytes(self, batch: int, seq_len: int, *, masked: bool = False) -> int:
        return predict_device_peak(self.plan.tiers, self.memory_sizes(batch, seq_len, masked=masked))

    # ---- one step -----------------------------------------------------------------------------
    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         num_tokens: int | None = None, loss_scale: float = 1.0,
                         run_optimizer_hook: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch under the plan; returns its loss (fp32, 0-dim, host).

        input_ids, labels: (B, S) int64, labels aligned with input_ids (shifted inside), -100 = ignored.
        attention_mask: (B, S) 1/0, right padding. position_ids: (B, S), restarting at 0 at each packed
        example; attention never crosses examples. num_tokens: the step's count of non-ignored shifted labels
        over all its micro-batches; the return is this micro-batch's summed token loss / num_tokens, so the
        returns of a step's micro-batches add up to its true mean loss (None = this micro-batch's own count).
        Gradients *accumulate* into every parameter's `.grad` exactly like `(loss * loss_scale).backward()`
        (zero them between optimizer steps); pass `run_optimizer_hook=False` on all but a step's last
        micro-batch.
        """
        batch, seq_len = self._check_inputs(input_ids, labels, attention_mask, position_ids)
        if num_tokens is not None and (isinstance(num_tokens, bool) or int(num_tokens) != num_tokens
                                       or num_tokens <= 0):
            raise LazyTrainError(f"num_tokens must be a positive int (the step's non-ignored label count), "
                                 f"got {num_tokens!r}")
        if self.plan.workload is not None:
            self.plan.check_matches(self.spec, Workload(batch, seq_len, DTYPE_NAMES[self.compute_dtype]))
        if "nvme" in self.plan.tiers:  # every nvme boundary of the forward waits on disk for the backward
            boundary_bytes = self.memory_sizes(batch, seq_len).boundary_bytes
            check_nvme_space(self.device.nvme_dir, self.plan.tiers.count("nvme") * boundary_bytes)
        step = _Step(self, input_ids, labels, attention_mask, position_ids, loss_scale, run_optimizer_hook,
                     None if num_tokens is None else int(num_tokens))
        try:
            loss = step.run()
        finally:
            step.cleanup()
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
        step = _Step(self, input_ids, labels, attention_mask, position_ids, 1.0, False, None, forward_only=True)
        try:
            loss_sum, count = step.evaluate()
        finally:
            step.cleanup()
        return loss_sum, count

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
        if position_ids is not None and "linear_attention" in self.parts.mask_kinds and is_packed(position_ids.cpu()):
            raise LazyTrainError(f"model_type {self.model.config.model_type!r} has linear-attention layers, whose "
                                 "recurrence cannot restart at packed example boundaries here; set packing: false")
        return tuple(input_ids.shape)


class _Step:
    """The state of one forward_backward: what is on the device, pending events, measured stalls."""

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
        self.run_hook = run_hook and ex.optimizer_hook is not None
        self.grad_sq_norm = 0.0
        self.batch, self.seq_len = input_ids.shape
        masked = attention_mask is not None or position_ids is not None
        self.sizes = ex.memory_sizes(self.batch, self.seq_len, masked=masked)
        self.stall: dict[str, float] = defaultdict(float)
        self.on_device: dict[int, torch.Tensor] = {}  # boundary -> device activation
        self.grads: dict[int, torch.Tensor] = {}  # boundary -> device gradient
        self.offload_events: dict[int, Event] = {}  # boundary -> d2h (cpu) or d2h (nvme: then write)
        self.host_ready: dict[int, Event] = {}  # boundary -> its host copy / file is complete
        self.reload_events: dict[int, list[Event]] = {}  # boundary -> [nvme_read?, h2d]
        self.weight_events: dict[int, Event] = {}  # use index -> h2d of its weights
        self.grad_slot_events: dict[int, Event] = {}  # gradient-slot use -> its d2h
        self.pending: list[Event] = []  # everything to wait for before the step ends
        self.reserved = 0
        self.allocated: list[torch.Tensor] = []
        self.uses = self._weight_uses(forward_only)
        self.slots: list[torch.Tensor] = []
        self.grad_slots: list[torch.Tensor] = []
        self.grad_uses = 0
        self.arrivals: dict[int, int] = defaultdict(int)  # group index -> gradient parts landed
        L = self.L
        self.stats = StepStats(wall_s=0.0, stall_s={}, peak_device_bytes=0,
                               predicted_peak_device_bytes=predict_device_peak(self.tiers, self.sizes),
                               loss=float("nan"), tokens=self.batch * self.seq_len,
                               forward_s=[0.0] * L, backward_s=[0.0] * L, recompute_s=[0.0] * L)

    # ---- the schedule ---------------------------------------------------------------------------
    def _weight_uses(self, forward_only: bool = False) -> list[tuple[str, int]]:
        uses = [("forward", j) for j in range(self.L)] + [("head", self.L)]
        if forward_only:
            return uses
        for s, e in reversed(_segments(self.tiers)):
            uses += [("recompute", j) for j in range(s, e - 1)]
            uses += [("backward", j) for j in range(e - 1, s - 1, -1)]
        return uses

    def _start(self) -> None:
        """Weight slots, boundary 0 (embedding rows gathered on the host, sent h2d), the step's constants."""
        ex, dev = self.ex, self.dev
        for group in [*ex.layer_groups, ex.head_group]:
            group.pack()  # bf16: refresh the streamed copy from the fp32 master weights
        dev.reset_peak()
        self.links_before = dev.link_stats()
        self.t_start = time.perf_counter()
        dtype = ex.compute_dtype
        self.slots = [self._alloc((ex.slot_numel,), dtype, "weight slot") for _ in range(2)]
        rows = ex.parts.embedding.weight.detach()[self.input_ids].to(dtype)  # (B, S, H) on the host
        if dev.torch_device.type == "cuda":
            rows = rows.pin_memory()
        boundary0 = self._alloc(tuple(rows.shape), dtype, "boundary 0")
        ev0 = dev.copy("h2d", boundary0, rows, after=[dev.record_compute()])
        self._issue_weights(0)
        self._wait(ev0)
        self.on_device[0] = boundary0
        self.consts = ex.rotary.constants(boundary0, self.attention_mask, self.position_ids)
        self._reserve(self.sizes.constant_bytes, "rotary tables and masks")

    def evaluate(self) -> tuple[float, int]:
        """Forward only: each boundary is dropped once the next exists; the chunked head sums the token losses."""
        self._start()
        for j in range(self.L):
            self._forward_no_grad(j, j, f"boundary {j + 1}")
            self._free(self.on_device.pop(j))
        self._begin_use(self.L)
        self._reserve(self.sizes.head_working_bytes, "loss head working set")
        targets = shift_labels(self.labels).to(self.dev.torch_device)
        loss_sum, count = head_loss_sum(self.ex.parts.norm, self._weights(self.L), self.on_device[self.L], targets,
                                        self.ex.head_chunk_tokens)
        self._unreserve(self.sizes.head_working_bytes)
        self._free(self.on_device.pop(self.L))
        self.dev.synchronize()
        return float(loss_sum), count

    def run(self) -> torch.Tensor:
        ex, dev = self.ex, self.dev
        dtype = ex.compute_dtype
        self._start()

        # ---- forward: layer j turns boundary j into boundary j+1, no autograd ----
        k = 0
        for j in range(self.L):
            self.stats.forward_s[j] = self._forward_no_grad(j, k, f"boundary {j + 1}")
            if j > 0 and self.tiers[j] != "gpu":
                self._drop_boundary(j)  # consumed by layer j: offloaded copy done or recomputed later
            if self.tiers[j + 1] in OFFLOADED:
                self._offload(j + 1)
            k += 1

        # ---- loss head: gradient slots, first reload, chunked norm + LM head + cross-entropy ----
        self.grad_slots = [self._alloc((ex.slot_numel,), dtype, "gradient slot") for _ in range(2)]
        segments = _segments(self.tiers)
        self._reload(segments[-1][0])
        self._begin_use(k)
        t0 = time.perf_counter()
        self._reserve(self.sizes.head_working_bytes, "loss head working set")
        hidden = self.on_device[self.L]
        grad_hidden = self._alloc(tuple(hidden.shape), dtype, f"gradient of boundary {self.L}")
        grad_slot = self._take_grad_slot()
        head_grads = ex.head_group.views(grad_slot)
        for g in head_grads.values():
            g.zero_()
        targets = shift_labels(self.labels).to(dev.torch_device)
        loss = head_forward_backward(ex.parts.norm, self._weights(k), hidden, targets, grad_hidden, head_grads,
                                     ex.head_chunk_tokens, self.loss_scale, self.num_tokens)
        self._unreserve(self.sizes.head_working_bytes)
        self.stats.head_s = time.perf_counter() - t0
        self.grads[self.L] = grad_hidden
        self._send_grads(ex.head_group, grad_slot, self._group_index("head"), parts=1 + ex.parts.tied)
        k += 1

        # ---- backward: segments last to first (Contract 2) ----
        for idx in range(len(segments) - 1, -1, -1):
            s, e = segments[idx]
            if idx > 0:
                self._reload(segments[idx - 1][0])  # one segment ahead
            self._wait_reload(s)
            for j in range(s, e - 1):  # regenerate s+1..e-1
                self.stats.recompute_s[j] += self._forward_no_grad(j, k, f"boundary {j + 1} (recomputed)")
                k += 1
            for j in range(e - 1, s - 1, -1):
                self._begin_use(k)
                t0 = time.perf_counter()
                self._reserve(self.sizes.working_bytes[j], f"layer {j} working set")
                grad_in, weight_grads = layer_backward(ex.parts.layers[j], self._weights(k), self.on_device[j],
                                                       self.grads[j + 1], self.consts, ex.parts.mask_kinds[j])
                self.grads[j] = self._adopt(grad_in, f"gradient of boundary {j}")
                grad_slot = self._take_grad_slot()
                group = ex.layer_groups[j]
                for name, flat in group.views(grad_slot).items():
                    flat.copy_(weight_grads[name])
                del weight_grads
                self._unreserve(self.sizes.working_bytes[j])
                self.stats.backward_s[j] = time.perf_counter() - t0
                self._send_grads(group, grad_slot, self._group_index(f"layer.{j}"), parts=1)
                self._free(self.on_device.pop(j + 1))
                self._free(self.grads.pop(j + 1))
                k += 1

        # ---- embedding backward on the host: d(boundary 0) scattered into the embedding's grad ----
        grad0 = self.grads[0]
        host0 = self.ex.store.host_buffer(-1, tuple(grad0.shape), grad0.dtype)
        ev = dev.copy("d2h", host0, grad0, after=[dev.record_compute()])
        index = self._group_index("embedding") if not ex.parts.tied else self._group_index("head")
        self.pending.append(dev.submit("optimizer", lambda: self._embedding_backward(host0, index), after=[ev]))
        self._wait(ev)
        self._free(self.grads.pop(0))
        self._free(self.on_device.pop(0))

        # ---- end of step: every gradient on the host, every optimizer hook done ----
        for event in self.pending:
            self._wait(event)
        dev.synchronize()
        self.stats.wall_s = time.perf_counter() - self.t_start
        self.stats.loss = float(loss)
        self.stats.grad_norm = self.grad_sq_norm ** 0.5 if self.final_micro_batch else None
        return loss.detach().cpu()

    def _forward_no_grad(self, j: int, k: int, what: str) -> float:
        """Layer j on weight use k without autograd: boundary j -> boundary j+1 on the device. Returns seconds."""
        self._begin_use(k)
        t0 = time.perf_counter()
        self._reserve(self.sizes.working_bytes[j], f"layer {j} working set")
        with torch.no_grad():
            out = layer_forward(self.ex.parts.layers[j], self._weights(k), self.on_device[j], self.consts,
                                self.ex.parts.mask_kinds[j])
        self.on_device[j + 1] = self._adopt(out, what)
        self._unreserve(self.sizes.working_bytes[j])
        return time.perf_counter() - t0

    # ---- weights --------------------------------------------------------------------------------
    def _group_of_use(self, k: int) -> WeightGroup:
        kind, j = self.uses[k]
        return self.ex.head_group if kind == "head" else self.ex.layer_groups[j]

    def _issue_weights(self, k: int) -> None:
        """h2d of use k's weights into slot k % 2, after the compute that last read that slot."""
        if k >= len(self.uses) or k in self.weight_events:
            return
        group = self._group_of_use(k)
        dst = self.slots[k % 2][:group.numel]
        self.weight_events[k] = self.dev.copy("h2d", dst, group.buffer, after=[self.dev.record_compute()])

    def _begin_use(self, k: int) -> None:
        self._issue_weights(k)
        self._issue_weights(k + 1)  # prefetch: overlaps use k's compute
        self._wait(self.weight_events.pop(k))

    def _weights(self, k: int) -> dict[str, torch.Tensor]:
        return self._group_of_use(k).views(self.slots[k % 2])

    # ---- gradients ------------------------------------------------------------------------------
    def _take_grad_slot(self) -> torch.Tensor:
        g = self.grad_uses
        self.grad_uses += 1
        if g - 2 in self.grad_slot_events:  # slot still draining to the host
            self._wait(self.grad_slot_events.pop(g - 2))
        return self.grad_slots[g % 2]

    def _send_grads(self, group: WeightGroup, grad_slot: torch.Tensor, index: int, parts: int) -> None:
        """d2h of a group's gradients, then (optimizer link) accumulate into `.grad` and maybe run the hook."""
        host = self.ex._grad_host[id(group)]
        ev = self.dev.copy("d2h", host, grad_slot[:group.numel], after=[self.dev.record_compute()])
        self.grad_slot_events[self.grad_uses - 1] = ev
        self.pending.append(ev)

        def land() -> None:
            group.accumulate_grads(host)
            self._arrived(index, parts)

        self.pending.append(self.dev.submit("optimizer", land, after=[ev]))

    def _embedding_backward(self, host_grad: torch.Tensor, index: int) -> None:
        emb = self.ex.parts.embedding
        weight = emb.weight
        ids = self.input_ids.reshape(-1)
        g = host_grad.reshape(-1, host_grad.shape[-1]).to(weight.dtype)
        if emb.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            keep = ids != emb.padding_idx
            ids, g = ids[keep], g[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, g)  # scattered in place: no vocab x hidden temporary
        self._arrived(index, 2 if self.ex.parts.tied else 1)

    def _arrived(self, index: int, parts: int) -> None:
        """A part of group `index`'s gradient is in `.grad`; run the hook when the group is complete."""
        self.arrivals[index] += 1
        if self.arrivals[index] == parts and self.final_micro_batch:
            grads = [p.grad for p in self.ex.param_groups()[index] if p.grad is not None]
            self.grad_sq_norm += float(per_tensor_sq_norms(grads).sum())  # before the hook may step and drop them
        if self.arrivals[index] == parts and self.run_hook:
            params = self.ex.param_groups()[index]
            self.ex.optimizer_hook(index, params)
            group = self._group_at(index)
            if group is not None:
                group.pack()  # bf16: the streamed copy follows the updated master weights

    def _group_index(self, name: str) -> int:
        return self.ex.group_names().index(name)

    def _group_at(self, index: int) -> WeightGroup | None:
        name = self.ex.group_names()[index]
        if name == "head":
            return self.ex.head_group
        if name.startswith("layer."):
            return self.ex.layer_groups[int(name.split(".")[1])]
        return None

    # ---- activations ------------------------------------------------------------------------------
    def _offload(self, i: int) -> None:
        """Boundary i leaves for the host (cpu) or the host and then a file (nvme), in the background."""
        dev, store = self.dev, self.ex.store
        t = self.on_device[i]
        host = store.host_buffer(i, tuple(t.shape), t.dtype)
        ev = dev.copy("d2h", host, t, after=[dev.record_compute()])
        self.offload_events[i] = ev
        if self.tiers[i] == "cpu":
            store.note_host(host.numel() * host.element_size())
            self.host_ready[i] = ev
        else:
            nbytes = host.numel() * host.element_size()
            self.host_ready[i] = dev.submit("nvme_write", lambda: store.write(i, host), nbytes, after=[ev])
            self.pending.append(self.host_ready[i])

    def _drop_boundary(self, i: int) -> None:
        if i in self.offload_events:
            self._wait(self.offload_events.pop(i))  # its d2h must be done before the device copy goes
        self._free(self.on_device.pop(i))

    def _reload(self, i: int) -> None:
        """Bring offloaded boundary i back: nvme_read into its host buffer (nvme), then h2d."""
        if self.tiers[i] not in OFFLOADED or i in self.reload_events:
            return
        dev, store = self.dev, self.ex.store
        shape = (self.batch, self.seq_len, self.ex.model.config.hidden_size)
        host = store.host_buffer(i, shape, self.ex.compute_dtype)
        events = []
        after = [self.host_ready[i]]
        if self.tiers[i] == "nvme":
            read = dev.submit("nvme_read", lambda: store.read(i, host), host.numel() * host.element_size(),
                              after=after)
            events.append(read)
            after = [read]
        t = self._alloc(shape, self.ex.compute_dtype, f"boundary {i} (reloaded)")
        # CUDA: the new block may be memory the compute stream freed but still reads; order after it
        events.append(dev.copy("h2d", t, host, after=[*after, dev.record_compute()]))
        self.on_device[i] = t
        self.reload_events[i] = events

    def _wait_reload(self, i: int) -> None:
        for event in self.reload_events.pop(i, []):
            self._wait(event)

    # ---- arena and waits --------------------------------------------------------------------------
    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        t = self.dev.alloc(shape, dtype, tag)
        self.allocated.append(t)
        return t

    def _adopt(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        self.dev.adopt(t, tag)
        self.allocated.append(t)
        return t

    def _free(self, t: torch.Tensor) -> None:
        self.dev.free(t)

    def _reserve(self, num_bytes: int, tag: str) -> None:
        self.dev.reserve(num_bytes, tag)
        self.reserved += num_bytes

    def _unreserve(self, num_bytes: int) -> None:
        self.dev.unreserve(num_bytes)
        self.reserved -= num_bytes

    def _wait(self, event: Event) -> None:
        """Block compute on a stream's event; the seconds blocked are that stream's stall."""
        self.stall[event.link] += self.dev.wait(event)

    def cleanup(self) -> None:
        """Return every device byte and spill file of the step, also after an error."""
        for event in self.pending:
            try:
                event.wait()
            except BaseException:  # the first error is already propagating
                pass
        for t in self.allocated:
            self.dev.free(t)
        if self.reserved:
            self.dev.unreserve(self.reserved)
            self.reserved = 0
        self.ex.store.end_step()
        stats = self.stats
        stats.peak_device_bytes = self.dev.peak_bytes
        stats.stall_s = {link: self.stall.get(link, 0.0)
                         for link in ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")}
        stats.peak_host_activation_bytes = self.ex.store.peak_host_bytes
        stats.peak_nvme_bytes = self.ex.store.peak_nvme_bytes
        before = getattr(self, "links_before", None)
        if before is not None:
            after = self.dev.link_stats()
            stats.link_busy_s = {n: after[n][0] - before[n][0] for n in after}
            stats.link_bytes = {n: after[n][1] - before[n][1] for n in after}
