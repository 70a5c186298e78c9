"""One step of a plan in progress: its state and the interpretation of its step program (Contract 2 of
docs/architecture.md).

`Step` runs the program's actions in order (plan/schedule.py) -- issue a job on a lane (h2d, d2h, nvme_read,
nvme_write, optimizer), run a compute op, wait for a job (the seconds waited are that lane's stall), alloc/free
a device buffer in the arena -- so the simulator, the device-memory count and the executor follow one schedule.
Each op kind has one handler that does the real work: weights stream into two device slots sized for layers
(use k into slot k % 2, a loss head larger than a layer into its own slot); weight gradients leave through two
gradient slots (and the head's own) and land in each group's host buffer (`WeightGroup.land`); activations are
offloaded, spilled, reloaded and recomputed exactly as the program says; in overlap mode the optimizer lane runs
the previous step's deferred update group by group. `StepStats` is what one step measured.

Host syncs and stream waits are each commented where they happen: the program's waits (`Step._wait`), the
step's end (`Device.synchronize`), the loss read back, and the waits for in-flight jobs after an error.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from lazytrain.errors import LazyTrainError
from lazytrain.optim.clip import per_tensor_sq_norms, per_tensor_sq_norms_fp32
from lazytrain.plan.schedule import STALL_LANES, STATE_OPS, Action, Op, StepProgram
from lazytrain.runtime.hf import (
    LayerGraph,
    graph_backward,
    head_forward_backward,
    head_loss_sum,
    layer_backward,
    layer_forward,
    layer_graph_forward,
    shift_labels,
)

if TYPE_CHECKING:
    from torch import nn

    from lazytrain.costmodel.topology import Topology
    from lazytrain.plan.plan import Plan
    from lazytrain.runtime.device import Device, Event
    from lazytrain.runtime.hf import DecoderParts, Rotary
    from lazytrain.runtime.store import ActivationStore, WeightGroup


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


class StateTier(Protocol):
    """The optimizer's states on NVMe (optimizer_offload nvme; train/offload.py): what the program's state ops do.
    Groups by `param_groups()` index; each call blocks (it is a lane job)."""

    def read(self, index: int, slot: int) -> None:
        """Read group `index`'s states into staging slot `slot` (its update then runs on them)."""
        ...

    def write(self, index: int) -> None:
        """Write group `index`'s updated slot back."""
        ...

    def expect_writes(self, indices: set[int]) -> None:
        """The groups whose state_write the running program issues (every other update writes back itself)."""
        ...

    def abandon(self) -> None:
        """Forget what is staged after an error."""
        ...

    def set_depth(self, depth: int) -> None:
        """A new plan's staging depth (between steps)."""
        ...


class StepOwner(Protocol):
    """What a step uses of its executor (runtime/executor.py): the model's streamed pieces and host buffers, which
    outlive steps."""

    device: Device
    plan: Plan
    parts: DecoderParts
    model: nn.Module
    compute_dtype: torch.dtype
    layer_groups: list[WeightGroup]
    head_group: WeightGroup
    slot_numel: int  # elements of a layer slot (the largest layer group)
    head_slot_numel: int  # the loss head's own slot (0: it streams through the layer slots)
    grad_slot_numel: int  # elements of a gradient slot (the largest trainable part of a group)
    random_layers: bool  # the layers draw random numbers (dropout in training mode): re-forwards replay them
    head_grad_slot_numel: int  # the loss head's own gradient slot (0: none)
    embedding_trainable: bool
    head_chunk_tokens: int
    rotary: Rotary
    store: ActivationStore
    grad_reducer: GradReducer | None
    states: StateTier | None

    def index_of(self, target: int) -> int: ...

    def group_names(self) -> list[str]: ...

    def kept_grads(self, index: int) -> dict[nn.Parameter, torch.Tensor]: ...

    def embedding_grad(self, fresh: bool) -> torch.Tensor: ...


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
    # per link, its jobs' busy seconds and bytes; the optimizer's state files apart, as "state_read" / "state_write"
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


def sq_norm(grads: dict[nn.Parameter, torch.Tensor]) -> float:
    """Summed squared L2 norms of kept gradients taken in their parameters' dtype, as the optimizer takes them
    (fp32 per tensor), with no transient the size of a group. fp32 masters: float64 sums reading bf16 gradients in
    place (`per_tensor_sq_norms_fp32`). bf16 masters: fp32 norms of bf16 chunks (an fp32 sum rounded to bf16 chunk
    by chunk): torch upcasts a whole tensor to fp32 first, 4 B per element of it."""
    if all(p.dtype == torch.float32 for p in grads):
        return float(per_tensor_sq_norms_fp32(list(grads.values())).sum())
    return sum(float(torch.cat([per_tensor_sq_norms([c.to(p.dtype)]) for c in g.reshape(-1).split(NORM_CHUNK)]).sum())
               for p, g in grads.items())


@contextlib.contextmanager
def _replay(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    """Run with the device's generator at `state`, and put it back as it was after."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        if cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


class Step:
    """One forward_backward (or evaluation forward) of `ex`'s plan: runs `program`'s actions in order.

    Each op kind has one handler below that does the real work; the arena counts exactly the program's
    alloc/free actions, and every wait's seconds are charged to the awaited op's lane (`_wait`).

    run_update(target): the previous step's update of group `target` (-1 embedding, j layer, L head) and its
    streamed copy's refresh, which the program's "update" ops run on the optimizer lane (overlap mode, a step's
    first micro-batch); None: no update pending. first_micro_batch: the gradients start afresh; final_micro_batch:
    they are final after this step (their norm is taken)."""

    def __init__(self, ex: StepOwner, program: StepProgram, input_ids: torch.Tensor, labels: torch.Tensor,
                 attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *,
                 run_update: Callable[[int], None] | None, first_micro_batch: bool, final_micro_batch: bool,
                 loss_scale: float = 1.0, num_tokens: int | None = None) -> None:
        self.ex = ex
        self.dev = ex.device
        self.tiers = ex.plan.tiers
        self.L = len(self.tiers) - 1
        self.input_ids = input_ids.cpu()  # host sync if the caller's batch is on the device: the embedding gathers
        self.labels = labels.cpu()
        self.attention_mask = attention_mask.cpu() if attention_mask is not None else None
        self.position_ids = position_ids.cpu() if position_ids is not None else None
        self.num_tokens = num_tokens
        self.loss_scale = loss_scale
        self.final_micro_batch = final_micro_batch  # gradients are final after this step: take their norm
        self.update = run_update  # the deferred update runs on this step's optimizer lane
        self.first_micro_batch = first_micro_batch  # gradients start afresh (the last step's were taken)
        self.grad_sq_norm = 0.0
        self.batch, self.seq_len = input_ids.shape
        self.program = program
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
        self.rng: dict[int, torch.Tensor] = {}  # layer -> the generator's state at its first forward (`_same_draws`)
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
        self._interpret(self.program.actions[:self.tail_start])
        dev.synchronize()  # host sync: the compute stream's last kernels end before the step's time is read
        self.stats.wall_s = time.perf_counter() - self.t_start
        self._time_compute()
        if self.loss is None:  # forward only: evaluate
            return torch.tensor(float("nan"))
        self.stats.loss = float(self.loss)  # host sync (CUDA): the loss read back, after the synchronize above
        if self.final_micro_batch:
            self.stats.grad_sq_norm = self.grad_sq_norm
            self.stats.grad_norm = self.grad_sq_norm ** 0.5
        return self.loss.detach().cpu()  # (already synchronized)

    @property
    def tail_start(self) -> int:
        """Where serial mode's updates start in the program's actions (its end when it has none): with the states
        on NVMe the program ends with them, run by `run_tail` once the caller has decided the step."""
        ops = self.program.ops
        if self.program.optimizer_mode != "serial":
            return len(self.program.actions)
        return next((i for i, a in enumerate(self.program.actions)
                     if a.verb == "issue" and ops[a.op].kind == "update"), len(self.program.actions))

    @property
    def has_tail(self) -> bool:
        return self.tail_start < len(self.program.actions)

    def run_tail(self) -> None:
        """Serial mode's updates (with `update` set now), their state writes and reads; its stalls join the step's."""
        t0 = time.perf_counter()
        try:
            self._interpret(self.program.actions[self.tail_start:])
        except BaseException:
            self._settle()
            raise
        self.stats.wall_s += time.perf_counter() - t0
        for link in self.stats.stall_s:
            self.stats.stall_s[link] = self.stall.get(link, 0.0)

    def _interpret(self, actions: tuple[Action, ...]) -> None:
        dev, ops = self.dev, self.program.ops
        for action in actions:
            if action.verb == "issue":
                op = ops[action.op]
                event = self._issue(op)
                self.events[op.index] = event
                self.pending.append(event)
            elif action.verb == "run":
                with dev.measuring():
                    self._run(ops[action.op])
            elif action.verb == "wait":  # stream wait: the program's fence (or the end's wait for the lanes)
                self._wait(self.events[action.op])
            elif action.verb == "alloc":
                self._alloc_buffer(*action.buffer, action.num_bytes)
            elif action.verb == "free":
                self._free_buffer(*action.buffer, action.num_bytes)
            # host_alloc / host_free: the staging slots, made once by the StateTier and kept across steps (their
            # content carries over: the backward's reads fill them for the next step's first updates)

    # ---- compute ops ------------------------------------------------------------------------------
    def _run(self, op: Op) -> None:
        ex, j, t0 = self.ex, op.target, self.dev.mark()
        weights = self._group_of(op).views(self._weight_slot(op))
        if op.kind == "keep":  # a kept layer: with autograd, its graph (and weights) kept until its backward
            self.graphs[j] = layer_graph_forward(ex.parts.layers[j], weights, self.on_device[j], self.consts,
                                                 ex.parts.mask_kinds[j], ex.layer_groups[j].trainable_names)
            self.out = self.graphs[j].out.detach()
        elif op.kind == "backprop":  # through the kept graph: no re-forward, weights never streamed again
            grads = ex.layer_groups[j].grad_views(self._grad_slot(j))
            self.out = graph_backward(self.graphs.pop(j), self.grads[j + 1], grads)
        elif op.kind in ("forward", "recompute"):
            with torch.no_grad(), self._same_draws(op):
                self.out = layer_forward(ex.parts.layers[j], weights, self.on_device[j], self.consts,
                                         ex.parts.mask_kinds[j])
        elif op.kind == "backward":  # weight gradients straight into the next gradient slot (sent next window)
            grads = ex.layer_groups[j].grad_views(self._grad_slot(j))
            with self._same_draws(op):
                self.out = layer_backward(ex.parts.layers[j], weights, self.on_device[j], self.grads[j + 1],
                                          self.consts, ex.parts.mask_kinds[j], grads)
        elif op.kind == "loss":  # forward only: the chunked head sums the token losses
            targets = shift_labels(self.labels).to(self.dev.torch_device)  # h2d on the compute stream (in order)
            loss_sum, count = head_loss_sum(ex.parts.norm, weights, self.on_device[self.L], targets,
                                            ex.head_chunk_tokens)
            self.loss_sum = (float(loss_sum), count)  # host sync (CUDA): evaluation reads the loss at once
        else:  # the loss head writes its weight gradients straight into the next gradient slot
            head_grads = ex.head_group.grad_views(self._grad_slot(self.L))
            for g in head_grads.values():
                g.zero_()
            targets = shift_labels(self.labels).to(self.dev.torch_device)  # h2d on the compute stream (in order)
            self.loss = head_forward_backward(ex.parts.norm, weights, self.on_device[self.L], targets,
                                              self.grads[self.L], head_grads, ex.head_chunk_tokens, self.loss_scale,
                                              self.consts.loss, self.num_tokens)
        self.marks.append((op, t0, self.dev.mark()))

    def _same_draws(self, op: Op) -> contextlib.AbstractContextManager[object]:
        """A layer with random draws (LoRA dropout in training mode) draws the same masks in its re-forwards as in its
        first forward: the first forward notes the generator's state, each recompute or backward re-forward runs
        from it on a forked generator (as torch.utils.checkpoint's preserve_rng_state), so the step draws exactly
        what the model's own forward draws, in the same order."""
        if not self.ex.random_layers:
            return contextlib.nullcontext()
        dev = self.dev.torch_device
        cuda = dev.type == "cuda"
        if op.kind == "forward":
            self.rng[op.target] = torch.cuda.get_rng_state(dev) if cuda else torch.get_rng_state()
            return contextlib.nullcontext()
        return _replay(self.rng[op.target], dev)

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
            # stream wait: the h2d lane waits for its `after` jobs and for the compute issued so far (the slot's
            # last reader); every lane copy below waits for compute the same way (it wrote the source or last read
            # the destination)
            return dev.copy("h2d", slot[:group.numel], group.buffer, after=[*after, dev.record_compute()])
        if op.kind == "update":
            update, target = self.update, op.target
            assert update is not None
            return dev.submit("optimizer", lambda: update(target), after=after)
        if op.kind in STATE_OPS:  # a group's optimizer states into / out of a staging slot
            states, index, slot = self.ex.states, self.ex.index_of(op.target), op.slot
            assert states is not None
            if op.kind == "state_read":
                return dev.submit("nvme_read", lambda: states.read(index, slot), op.num_bytes, after=after)
            return dev.submit("nvme_write", lambda: states.write(index), op.num_bytes, after=after)
        if op.kind == "boundary0":  # the embedding rows, gathered on the host (after the embedding's update)
            for event in after:  # host wait: the gather reads the embedding its update (optimizer lane) writes
                self._wait(event)
            rows = self.ex.parts.embedding.weight.detach()[self.input_ids].to(self.ex.compute_dtype)  # (B, S, H)
            if dev.torch_device.type == "cuda":
                rows = rows.pin_memory()
            return dev.copy("h2d", self.on_device[0], rows, after=[dev.record_compute()])  # stream wait: as above
        if op.kind == "offload":
            t = self.on_device[i]
            self.host[i] = host = store.host_buffer(i, tuple(t.shape), t.dtype)
            if self.tiers[i] == "cpu":
                store.note_host(host.numel() * host.element_size())
            return dev.copy("d2h", host, t, after=[dev.record_compute()])  # stream wait: the forward wrote t
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
            parts = 1 + (self.ex.parts.tied and self.ex.embedding_trainable) if i == self.L else 1
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
            # stream wait: the last backward wrote the gradient of boundary 0
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
        # stream wait: the d2h waits for the backward that wrote the slot (and a pooled buffer's last land)
        return self.dev.copy("d2h", group.landing, grad_slot[:group.grad_numel],
                             after=[self.dev.record_compute(), *([free] if free is not None else [])])

    def _embedding_backward(self, host_grad: torch.Tensor, index: int) -> None:
        """The embedding's gradient from the boundary-0 gradient, scattered on the host: into the untied
        embedding's own gradient (its dtype), or into the tied weight's view of the head group's gradient. Data
        parallel: every rank's rows, gathered to the group's owners in rank order (the global batch's rows) by the
        gather op before it."""
        ex = self.ex
        emb = ex.parts.embedding
        parts = 2 if ex.parts.tied else 1
        gathered = [(host_grad, self.input_ids)] if ex.grad_reducer is None else self.gathered  # (the gather op's)
        if gathered is None:  # another rank owns the group
            self._arrived(index, parts)
            return
        grad = ex.embedding_grad(fresh=self.first_micro_batch)
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
        grads = self.ex.kept_grads(index)
        if grads:  # (data parallel: only a group's owners hold its gradient)
            self.grad_sq_norm += sq_norm(grads)

    def _group_index(self, name: str) -> int:
        return self.ex.group_names().index(name)

    # ---- the arena: the program's alloc/free actions ------------------------------------------------
    def _alloc_buffer(self, kind: str, i: int, num_bytes: int) -> None:
        ex, dtype = self.ex, self.ex.compute_dtype
        shape = (self.batch, self.seq_len, ex.model.config.hidden_size)
        if kind in ("weight_slots", "grad_slots"):
            numel = ex.slot_numel if kind == "weight_slots" else ex.grad_slot_numel
            slots = [self._alloc((numel,), dtype, kind.replace("_", " ")) for _ in range(2)]
            if kind == "weight_slots":
                self.slots = slots
            else:
                self.grad_slots = slots
        elif kind == "kept_weights":
            self.kept_slots[i] = self._alloc((ex.layer_groups[i].numel,), dtype, f"kept weights {i}")
        elif kind in ("head_weights", "head_grads"):
            numel = ex.head_slot_numel if kind == "head_weights" else ex.head_grad_slot_numel
            self.head_slots[kind] = self._alloc((numel,), dtype, kind.replace("_", " "))
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

    def _settle(self) -> None:
        for event in self.pending:  # host wait: no lane job may still read or write a buffer freed after this
            try:
                event.wait()
            except BaseException:  # the first error is already propagating
                pass

    def _wait(self, event: Event) -> None:
        """Block compute on a lane's event (stream wait: on CUDA the compute stream waits for the lane's copy or
        the host for a host job); the seconds blocked are that lane's stall."""
        self.stall[event.link] += self.dev.wait(event)

    def cleanup(self) -> None:
        """Return every device byte and spill file of the step, also after an error."""
        self._settle()
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
        stats.stall_s = {lane: self.stall.get(lane, 0.0) for lane in STALL_LANES}
        stats.peak_host_activation_bytes = self.ex.store.peak_host_bytes
        stats.peak_nvme_bytes = self.ex.store.peak_nvme_bytes
        before = getattr(self, "links_before", None)
        if before is not None:
            after = self.dev.link_stats()
            stats.link_busy_s = {n: after[n][0] - before[n][0] for n in after}
            stats.link_bytes = {n: after[n][1] - before[n][1] for n in after}
            for op in self.program.ops:  # the state files apart from the spills on their NVMe links: their own rate
                event = self.events.get(op.index)
                if op.kind in STATE_OPS and event is not None and event.end_s > 0:
                    for totals, value in ((stats.link_busy_s, event.end_s - event.start_s),
                                          (stats.link_bytes, op.num_bytes)):
                        totals[op.lane] -= value
                        totals[op.kind] = totals.get(op.kind, 0) + value
        t_start = getattr(self, "t_start", None)
        if t_start is not None:  # the measured trace: compute ops timed here, lane ops by their events
            links = [(op.lane, op.name, self.events[op.index]) for op in self.program.ops if op.index in self.events]
            stats.timeline = sorted(self.timeline + [(lane, name, e.start_s - t_start, e.end_s - t_start)
                                                     for lane, name, e in links if e.end_s > 0],
                                    key=lambda x: x[2])
