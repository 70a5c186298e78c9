"""The bytes one step of a model moves and holds at a batch shape (plan/schedule.py's `Shapes`): what the arena counts.

The executor builds its step program from these: the exact bytes of the model's boundaries, streamed weight
groups and step constants (rotary tables, positions, masks), with the working sets and kept-layer graphs of a
CostModel (the planner's when the batch shape is its workload's, else one made for that shape, so the planner,
the simulator and the arena count the same bytes) or, on a device that measures memory, measured by running each
layer shape once under `LiveBytes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.plan.schedule import Shapes, graph_bounds
from lazytrain.runtime.hf import (
    DecoderParts,
    Rotary,
    graph_backward,
    head_forward_backward,
    layer_forward,
    layer_graph_forward,
    shift_labels,
)
from lazytrain.runtime.live_bytes import LiveBytes

if TYPE_CHECKING:
    from lazytrain.costmodel.model import ModelSpec
    from lazytrain.runtime.device import Device
    from lazytrain.runtime.store import WeightGroup

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # a Workload's dtype names

ShapeKey = tuple[int, int, bool]  # (batch, seq_len, masked)


class StepShapes:
    """`Shapes` of one model's step per (batch, seq_len, masked), each made once.

    layer_groups, head_group: the executor's streamed groups (their bytes are the weight uses'); rotary: its step
    constants; cost: the CostModel whose working sets the arena reserves (None: one of each batch shape, on the
    emulated hardware, with `head_chunk_tokens`)."""

    def __init__(self, spec: ModelSpec, parts: DecoderParts, layer_groups: list[WeightGroup], head_group: WeightGroup,
                 rotary: Rotary, device: Device, compute_dtype: torch.dtype, cost: CostModel | None,
                 head_chunk_tokens: int) -> None:
        self.parts, self.layer_groups, self.head_group, self.rotary = parts, layer_groups, head_group, rotary
        self.device, self.compute_dtype, self.cost = device, compute_dtype, cost
        self.head_chunk_tokens = head_chunk_tokens
        self.spec = spec
        self._default_costs: dict[ShapeKey, CostModel] = {}
        self._measured_working: dict[ShapeKey, tuple[tuple[int, ...], int]] = {}
        # the same keys: (graph, graph forward, graph backward, forward working) bytes per layer (Shapes.graph_*,
        # Shapes.forward_working_bytes)
        self._measured_graphs: dict[ShapeKey, tuple[tuple[int, ...], ...]] = {}
        # optimizer_offload nvme: each group's state bytes a state_read / state_write moves, at target + 1 (the
        # executor's real files, `Executor.stage_states`); () = the states in RAM
        self.state_bytes: tuple[int, ...] = ()

    def __call__(self, batch: int, seq_len: int, *, masked: bool = False) -> Shapes:
        """The byte sizes of one step at this batch and sequence length (what the arena will count).

        masked: the steps pass an attention_mask or position_ids (padding, packing), which makes the positions,
        cos/sin and every attention mask per row (see `Rotary.constant_bytes`).
        """
        dtype_bytes = torch.empty((), dtype=self.compute_dtype).element_size()
        cost = self.cost
        if cost is None or (cost.workload.batch_size, cost.workload.seq_len, cost.workload.masked) != (
                batch, seq_len, masked):
            cost = self._default_cost(batch, seq_len, masked)  # e.g. a last, shorter batch than the plan's workload
        L = self.parts.num_layers
        boundary_bytes = batch * seq_len * self.parts.model.config.hidden_size * dtype_bytes
        if getattr(self.device, "live", None) is not None:  # a device that measures memory: the real working sets
            working, head_working = self.measured_working_bytes(batch, seq_len, masked=masked)
            *graphs, forward_working = self._measured_graphs[(batch, seq_len, masked)]
        else:
            working = tuple(int(w) for w in cost.working_bytes)
            head_working = int(cost.head_working_bytes)
            graphs = graph_bounds(working, tuple(int(g) for g in cost.graph_bytes), boundary_bytes)
            forward_working = ()  # the backward's: the planner's bound
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
            forward_working_bytes=forward_working,
            state_bytes=self.state_bytes,
            grad_bytes=tuple(g.grad_bytes for g in self.layer_groups),
            head_grad_bytes=self.head_group.grad_bytes,
            embedding_grad=self.parts.embedding.weight.requires_grad,
        )

    def measured_working_bytes(self, batch: int, seq_len: int, *, masked: bool = False) -> tuple[tuple[int, ...], int]:
        """The device bytes each layer's backward and the loss head really hold beyond the program's own buffers,
        measured once per layer shape by running them on this device under `LiveBytes` (random inputs; cached).

        Layer j: the high-water mark of every storage its autograd re-forward + backward creates, less its
        output d(boundary j) (the program allocates that after the compute, while the working set is still
        counted). Head: the same for the chunked head (its output is written into a buffer the program holds),
        with every label counted (a chunk without labels holds less).

        The same pass measures what a kept layer holds (`Shapes.graph_*`, in `_measured_graphs`): its graph (the
        storages alive after its forward with autograd, less its output), the peak of that forward, and its
        backward's peak beyond the graph, its output and its input's gradient; and a forward or recompute's peak
        (no autograd) less its output (`Shapes.forward_working_bytes`): less than the backward's, and the step's
        peak where such a window holds more than any backward (e.g. the head's own gradient slot, held until the
        first backward-side window's fence, beside a recompute)."""
        key = (batch, seq_len, masked)
        if key in self._measured_working:
            return self._measured_working[key]
        torch_device, dtype, config = self.device.torch_device, self.compute_dtype, self.parts.model.config
        gen = torch.Generator().manual_seed(0)
        shape = (batch, seq_len, config.hidden_size)
        hidden = torch.randn(shape, generator=gen).to(device=torch_device, dtype=dtype)
        grad_out = torch.randn(shape, generator=gen).to(device=torch_device, dtype=dtype)
        ones = torch.ones(batch, seq_len, dtype=torch.long) if masked else None
        consts = self.rotary.constants(hidden, ones)
        boundary_bytes = hidden.numel() * hidden.element_size()
        by_shape: dict[tuple[str, tuple], tuple[int, int, int, int]] = {}
        sizes = []  # per layer: (working set, graph, graph forward peak, graph backward beyond, forward working)
        for j, (layer, group) in enumerate(zip(self.parts.layers, self.layer_groups, strict=True)):
            shape_key = (self.parts.mask_kinds[j], tuple((s.name, s.shape) for s in group.slots),
                         group.trainable_names)
            if shape_key not in by_shape:
                slot = torch.empty(group.numel, dtype=dtype, device=torch_device)
                weights = {n: t.to(device=torch_device, dtype=dtype) for n, t in group.views(group.buffer).items()}
                live = LiveBytes()
                with live:  # layer_backward, in its two halves
                    graph = layer_graph_forward(layer, weights, hidden, consts, self.parts.mask_kinds[j],
                                                group.trainable_names)
                    forward_peak, graph_bytes = live.peak_bytes, live.used_bytes - boundary_bytes
                    live.reset_peak()
                    graph_backward(graph, grad_out, group.grad_views(slot))
                    del graph
                backward_peak = live.peak_bytes
                live = LiveBytes()
                with live, torch.no_grad():  # a forward or recompute (layer_forward, as the step runs it)
                    out = layer_forward(layer, weights, hidden, consts, self.parts.mask_kinds[j])
                    del out
                by_shape[shape_key] = (max(forward_peak, backward_peak) - boundary_bytes, graph_bytes, forward_peak,
                                       max(0, backward_peak - graph_bytes - 2 * boundary_bytes),
                                       live.peak_bytes - boundary_bytes)
            sizes.append(by_shape[shape_key])
        working = [w for w, *_ in sizes]
        self._measured_graphs[key] = tuple(tuple(column) for column in list(zip(*sizes, strict=True))[1:])
        head = self.head_group
        weights = {n: t.to(device=torch_device, dtype=dtype) for n, t in head.views(head.buffer).items()}
        grads = head.grad_views(torch.zeros(head.grad_numel, dtype=dtype, device=torch_device))
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

    def _default_cost(self, batch: int, seq_len: int, masked: bool = False) -> CostModel:
        """The shared CostModel's byte sizes (working sets), so the planner, simulator and arena agree."""
        key = (batch, seq_len, masked)
        if key not in self._default_costs:
            workload = Workload(batch, seq_len, DTYPE_NAMES[self.compute_dtype], masked)
            hardware = self.cost.hardware if self.cost is not None else HardwareSpec.load("emulated")  # its kernels
            self._default_costs[key] = CostModel(self.spec, hardware, workload,
                                                 head_chunk_tokens=self.head_chunk_tokens)
        return self._default_costs[key]
