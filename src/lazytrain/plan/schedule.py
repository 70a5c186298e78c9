"""The step program (Contract 2, docs/architecture.md): one training step of a Plan as ops on lanes, written once.

The executor runs it (`lazytrain.runtime.executor`), the simulator times it on a CostModel (`plan/sim.py`),
the device-memory count walks its alloc/free actions (`StepProgram.device_peak_bytes`) and the MILP adds up its
windows (`plan/milp/`). The program is a list of *actions* in the order the host thread performs them:

    issue op   enqueue a job on its lane (FIFO); it starts once its lane is free and its `after` ops are done
    run op     the host thread runs a compute op (lane `compute`)
    wait op    the host thread blocks until op is done (the seconds blocked are that op's lane's stall)
    alloc/free device bytes of one buffer appear / go (the arena counts them at this program point)
    host_alloc/host_free   host bytes of one buffer (an optimizer-state staging slot) appear / go

Lanes: compute, h2d, d2h, nvme_read, nvme_write, optimizer (the host lane: the previous step's group updates,
then this step's gradient accumulation into `.grad`; with ranks also each group's sum over the ranks,
costmodel/topology.py). Every compute op is one fenced *window* (it waits for every job it issued), so a window
lasts its longest lane and the step is the sum of its windows; the optimizer lane's jobs alone queue across
windows. `_StepBuilder` writes the windows in order, one method each (start, forward j, head, recompute j,
backward j, end); what each window issues, holds and frees, the optimizer modes ("overlap": the previous step's
update group by group under the forward; "serial": MegaTrain's one step after the backward) and the kept layers
are described in docs/executor.md, "The step program, window by window".

With the optimizer's state on the NVMe SSD (`staging_depth` D >= 1) the program also reads each group's
state file into one of D host staging slots before the group's update (`state_read` on the nvme_read lane) and
writes it back after (`state_write` on the nvme_write lane), each fenced in a window like an activation's
transfer and sharing those lanes with the activations' spills and reads; docs/executor.md, "Optimizer state on
NVMe", says which window issues which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazytrain.costmodel.hardware import LINKS
from lazytrain.costmodel.topology import ONE_RANK, REDUCE_DTYPE_BYTES, Topology
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel

# a lane is a FIFO queue of ops: the compute thread, each of the machine's links, the host optimizer's worker; the
# compute thread waits on the others (their stalls)
STALL_LANES = (*LINKS, "optimizer")
LANES = ("compute", *STALL_LANES)
OPTIMIZER_MODES = ("overlap", "serial")
OFFLOADED = ("cpu", "nvme")
COMPUTE_KINDS = ("forward", "recompute", "backward", "keep", "backprop", "head", "loss")
STATE_OPS = ("state_read", "state_write")  # optimizer_offload nvme: a group's state file into / out of staging
WINDOW_LETTER = {"forward": "F", "keep": "F", "recompute": "R", "backward": "B", "backprop": "B"}


@dataclass(frozen=True)
class Shapes:
    """The bytes one step moves and holds (the executor's own, or a CostModel's)."""

    boundary_bytes: tuple[int, ...]  # A[i], i = 0..L
    param_bytes: tuple[int, ...]  # weights streamed per use of layer j (compute dtype) = its gradient bytes
    head_param_bytes: int  # final norm + LM head (the tied embedding for a tied head)
    working_bytes: tuple[int, ...]  # autograd working set of layer j during its backward (re-forward + backward)
    head_working_bytes: int
    constant_bytes: int = 0  # rotary cos/sin, positions, attention masks of the step
    tied_head: bool = False  # the head's group owns the embedding (tied LM head): its update precedes boundary 0
    dtype_bytes: int = 4  # of the compute dtype: the ranks sum a gradient in fp32 (REDUCE_DTYPE_BYTES per element)
    # kept layers (Plan.kept_layers), per layer j; () = 0 for every layer:
    graph_bytes: tuple[int, ...] = ()  # the saved tensors its graph holds from its forward to its backward
    graph_forward_bytes: tuple[int, ...] = ()  # peak of its forward with autograd (its output and graph included)
    graph_backward_bytes: tuple[int, ...] = ()  # its backward's peak beyond its graph, output and input gradient
    # layer j's forward or recompute (no autograd) beyond its output; () = working_bytes (a CostModel's bound: the
    # backward's; measured it is less, and a window the backward's set over-counts can be the step's peak)
    forward_working_bytes: tuple[int, ...] = ()
    # optimizer_offload nvme: each group's state file bytes (what a state_read / state_write moves) at index
    # target + 1 as sim.update_seconds: the untied embedding (0 when tied), layers 0..L-1, the head; () = in RAM
    state_bytes: tuple[int, ...] = ()
    # frozen parameters (LoRA's base, freeze tuning) have no gradient: the bytes of layer j's gradient (its
    # trainable parameters'; 0 = a frozen layer, which sends nothing back), () = param_bytes (full training)
    grad_bytes: tuple[int, ...] = ()
    head_grad_bytes: int = -1  # the head's; -1 = head_param_bytes
    embedding_grad: bool = True  # the embedding trains: boundary 0's gradient goes to the host for it

    def __post_init__(self) -> None:
        L = len(self.param_bytes)
        if L < 1 or len(self.boundary_bytes) != L + 1 or len(self.working_bytes) != L:
            raise LazyTrainError(f"step shapes: need L >= 1 layers, L working sets and L+1 boundaries, got "
                                 f"{L}, {len(self.working_bytes)}, {len(self.boundary_bytes)}")
        if not self.forward_working_bytes:
            object.__setattr__(self, "forward_working_bytes", self.working_bytes)
        elif len(self.forward_working_bytes) != L:
            raise LazyTrainError(f"step shapes: forward_working_bytes needs {L} entries, got "
                                 f"{len(self.forward_working_bytes)}")
        for name in ("graph_bytes", "graph_forward_bytes", "graph_backward_bytes"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0,) * L)
            elif len(getattr(self, name)) != L:
                raise LazyTrainError(f"step shapes: {name} needs {L} entries, got {len(getattr(self, name))}")
        if not self.grad_bytes:
            object.__setattr__(self, "grad_bytes", self.param_bytes)
        elif len(self.grad_bytes) != L:
            raise LazyTrainError(f"step shapes: grad_bytes needs {L} entries, got {len(self.grad_bytes)}")
        if self.head_grad_bytes < 0:
            object.__setattr__(self, "head_grad_bytes", self.head_param_bytes)
        if self.state_bytes and len(self.state_bytes) != L + 2:
            raise LazyTrainError(f"step shapes: state_bytes needs {L + 2} entries (embedding, layers, head), got "
                                 f"{len(self.state_bytes)}")

    @property
    def num_layers(self) -> int:
        return len(self.param_bytes)

    @property
    def slots_bytes(self) -> int:
        """The weight slots (and as many gradient slots): two of the largest layer (layer slots are sized for
        layers)."""
        return 2 * max(self.param_bytes)

    @property
    def head_slot_bytes(self) -> int:
        """The loss head's own weight slot (and its gradient slot) when it is larger than a layer, else 0 (it
        streams through the layer slots). Each exists only around the windows that use it."""
        return self.head_param_bytes if self.head_param_bytes > max(self.param_bytes) else 0

    @property
    def grad_slots_bytes(self) -> int:
        """The two gradient slots: of the largest layer gradient, or the head's when it has no own slot."""
        return 2 * max(*self.grad_bytes, 0 if self.head_slot_bytes else self.head_grad_bytes)

    @property
    def head_grad_slot_bytes(self) -> int:
        """The loss head's own gradient slot (with its own weight slot), else 0."""
        return self.head_grad_bytes if self.head_slot_bytes else 0

    @property
    def staging_slot_bytes(self) -> int:
        """One staging slot: the largest group's state file (0 with the states in RAM)."""
        return max(self.state_bytes, default=0)

    @classmethod
    def from_cost(cls, cost: CostModel) -> Shapes:
        """A CostModel's bytes (a kept layer's: `graph_bounds`; state files with optimizer_offload nvme)."""
        L = cost.num_layers
        working = tuple(int(w) for w in cost.working_bytes[:L])
        graphs = graph_bounds(working, cost.graph_bytes[:L], int(max(cost.boundary_bytes)))
        return cls(boundary_bytes=tuple(int(a) for a in cost.boundary_bytes[:L + 1]),
                   param_bytes=tuple(int(p) for p in cost.param_bytes[:L]),
                   head_param_bytes=int(cost.head_param_bytes),
                   working_bytes=working,
                   head_working_bytes=int(cost.head_working_bytes),
                   constant_bytes=int(cost.constant_device_bytes),
                   tied_head=bool(cost.spec.tie_word_embeddings),
                   dtype_bytes=int(cost.dtype_bytes),
                   graph_bytes=graphs[0], graph_forward_bytes=graphs[1], graph_backward_bytes=graphs[2],
                   state_bytes=cost.state_group_bytes() if cost.optimizer_offload == "nvme" else (),
                   grad_bytes=tuple(int(g) for g in cost.grad_bytes[:L]), head_grad_bytes=int(cost.head_grad_bytes),
                   embedding_grad=bool(cost.embedding_grad_bytes))

    def reduce_bytes(self, grad_bytes: int) -> int:
        """Bytes the ranks sum for a gradient of `grad_bytes` in the compute dtype (fp32: costmodel/topology.py)."""
        return grad_bytes // self.dtype_bytes * REDUCE_DTYPE_BYTES


def graph_bounds(working: Sequence[int], graph: Sequence[int], boundary_bytes: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(graph, graph forward, graph backward) bytes per layer from working sets and graph bytes: a kept layer's
    forward counted as its working set and output, its backward as its working set (the graph included) -- bounds
    of what they hold (the executor's measured shapes are exact)."""
    return (tuple(int(g) for g in graph), tuple(int(w) + int(boundary_bytes) for w in working),
            tuple(max(0, int(w) - int(g)) for w, g in zip(working, graph, strict=True)))


@dataclass(frozen=True)
class Op:
    """One job of the step on one lane. `target` is the layer (compute, weights, grads) or the boundary
    (boundary0, offload, spill, read, reload, grad0), or the group (update, state_read, state_write: -1 the untied
    embedding, j layer j, L the head); `use` the weight use a weights/compute op belongs to; `slot` the staging
    slot a state_read fills or a state_write empties."""

    index: int
    lane: str
    kind: str
    target: int = -1
    num_bytes: int = 0
    after: tuple[int, ...] = ()
    use: int = -1
    slot: int = -1

    @property
    def name(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return "H" if self.kind in ("head", "loss") else f"{WINDOW_LETTER[self.kind]}{self.target}"
        if self.kind in ("update", "state_read", "state_write"):
            return f"{self.kind} {'embedding' if self.target < 0 else self.target}"
        return f"{self.kind} {self.target}" if self.target >= 0 else self.kind


@dataclass(frozen=True)
class Action:
    """One step of the host thread: `verb` is issue / run / wait (an op), alloc / free (a device buffer's bytes)
    or host_alloc / host_free (a host buffer's)."""

    verb: str
    op: int = -1
    # (kind, index): weight_slots, grad_slots, head_weights, head_grads, kept_weights, boundary, grad, working,
    # graph, constants; host: staging (index = slot)
    buffer: tuple[str, int] = ("", -1)
    num_bytes: int = 0


@dataclass(frozen=True)
class StepProgram:
    tiers: tuple[str, ...]
    shapes: Shapes
    ops: tuple[Op, ...]
    actions: tuple[Action, ...]
    optimizer_mode: str
    uses: tuple[tuple[str, int], ...]  # weight use u -> (kind, layer); the head's layer is L
    topology: Topology = ONE_RANK  # the ranks the reduce ops sum over (one: none)
    kept_layers: int = 0  # K: layers L-K..L-1 keep their graph and weights (Plan.kept_layers)
    staging_depth: int = 0  # D: host slots for groups' optimizer states read from NVMe (0 = states in RAM)

    def device_peak_bytes(self) -> int:
        """The high-water mark of the alloc/free actions (link speeds do not move it)."""
        return self._peak("alloc", "free")

    def host_peak_bytes(self) -> int:
        """The high-water mark of the host_alloc/host_free actions: the staging slots (the rest of the host
        layout is static, CostModel.host_breakdown; offloaded activations are counted by the simulator)."""
        return self._peak("host_alloc", "host_free")

    def _peak(self, alloc: str, free: str) -> int:
        used = peak = 0
        for a in self.actions:
            if a.verb == alloc:
                used += a.num_bytes
                peak = max(peak, used)
            elif a.verb == free:
                used -= a.num_bytes
        return peak

    def device_trace(self) -> list[tuple[int, int]]:
        """(action index, device bytes in use after it) at every alloc/free."""
        used, out = 0, []
        for k, a in enumerate(self.actions):
            if a.verb in ("alloc", "free"):
                used += a.num_bytes if a.verb == "alloc" else -a.num_bytes
                out.append((k, used))
        return out


def segments_of(tiers: tuple[str, ...]) -> list[tuple[int, int]]:
    kept = [i for i, t in enumerate(tiers) if t != "recompute"]
    return list(zip(kept[:-1], kept[1:], strict=True))


def weight_uses(tiers: tuple[str, ...], forward_only: bool = False, kept_layers: int = 0) -> list[tuple[str, int]]:
    """The compute ops in program order as (kind, layer); each streams its layer's weights, except a kept
    layer's backward ("backprop": its weights stayed on the device since its forward, "keep")."""
    L = len(tiers) - 1
    first_kept = L - (0 if forward_only else kept_layers)
    uses = [("keep" if j >= first_kept else "forward", j) for j in range(L)] + [("head", L)]
    if forward_only:
        return uses
    for s, e in reversed(segments_of(tiers)):
        uses += [("recompute", j) for j in range(s, e - 1)]
        uses += [("backprop" if j >= first_kept else "backward", j) for j in range(e - 1, s - 1, -1)]
    return uses


def update_order(num_layers: int, tied_head: bool) -> list[int]:
    """The groups' update targets in forward order: -1 (untied embedding) or L (a tied head, which owns the
    embedding) first, then layers 0..L-1, then the untied head."""
    layers = list(range(num_layers))
    return [num_layers, *layers] if tied_head else [-1, *layers, num_layers]


@dataclass(frozen=True)
class StateSchedule:
    """Where the state ops of optimizer_offload nvme go (staging depth D >= 1; docs/executor.md, "Optimizer state
    on NVMe"). Groups k = 0..G-1 in update order (`targets`, update_order); group k lives in slot k % D. The
    forward's windows are numbered 0 = start, j + 1 = F_j, L + 1 = H.

    fence[k]  the window whose weight h2d (boundary 0's for k = 0) waits for group k's update: max(0, k - 1)
    read[k]   k >= D: the window that reads group k's state, min(fence[k - D] + 2, fence[k]): two windows after
              the fence of the slot's previous group (its write is then done), or later chained behind that write
              when the slot is needed sooner (D < 3); its update is enqueued right after it. -1 for k < D: those
              are read in the previous step's backward (`prefetch`)
    write[k]  the window that writes group k's state back: the one after its fence, or the one that reads the
              slot's next group if that is sooner (chained there): min(fence[k] + 1, read[k + D])
    prefetch  the backward window B_j, j = L - 1 - k, that reads group k < D for the next step's update
    """

    targets: tuple[int, ...]
    depth: int
    fence: tuple[int, ...]
    read: tuple[int, ...]
    write: tuple[int, ...]
    prefetch: tuple[int, ...]

    def writes_in(self, window: int) -> list[int]:
        return [k for k, w in enumerate(self.write) if w == window]

    def reads_in(self, window: int) -> list[int]:
        return [k for k, r in enumerate(self.read) if r == window]


def state_schedule(num_layers: int, tied_head: bool, depth: int) -> StateSchedule:
    """The StateSchedule of `depth` staging slots (1..L: the backward's last D windows prefetch)."""
    L = num_layers
    if not 1 <= depth <= L:
        raise LazyTrainError(f"staging_depth {depth} must be in 1..{L} (the model's layers)")
    targets = tuple(update_order(L, tied_head))
    G = len(targets)
    fence = tuple(max(0, k - 1) for k in range(G))
    read = tuple(-1 if k < depth else min(fence[k - depth] + 2, fence[k]) for k in range(G))
    write = tuple(min(fence[k] + 1, read[k + depth]) if k + depth < G else fence[k] + 1 for k in range(G))
    return StateSchedule(targets=targets, depth=depth, fence=fence, read=read, write=write,
                         prefetch=tuple(L - 1 - k for k in range(depth)))


def build_program(tiers: tuple[str, ...] | list[str], shapes: Shapes, *, optimizer_mode: str = "overlap",
                  updates: bool = True, forward_only: bool = False, topology: Topology = ONE_RANK,
                  kept_layers: int = 0, staging_depth: int = 0, last_micro_batch: bool = True) -> StepProgram:
    """The step program of `tiers` (L+1 entries) with `shapes`' bytes, window by window (docs/executor.md,
    "The step program, window by window").

    kept_layers: K, the last K layers keep their graph and weights from forward to backward (Plan.kept_layers;
    boundaries L-K..L must be gpu).

    updates: overlap mode: the step starts with the previous step's group updates on the optimizer lane (False:
    a step's later micro-batch, or no update pending).

    staging_depth: D >= 1: the optimizer's states live in files on the NVMe SSD (`shapes.state_bytes` per group)
    and D host slots stage them (Plan.staging_depth; StateSchedule); 0: in RAM. last_micro_batch: the step's
    gradients are final after this micro-batch, so its backward reads the first D groups' states ahead of the
    update (and in serial mode the updates follow it); with D = 0 it changes nothing.

    forward_only: evaluation -- the forward with every boundary freed once the next exists, then the loss head
    forward ("loss"); no gradients, no offloads."""
    tiers = tuple(tiers)
    L = len(tiers) - 1
    if shapes.num_layers != L:
        raise LazyTrainError(f"plan has {L} layers but the step shapes have {shapes.num_layers}")
    if optimizer_mode not in OPTIMIZER_MODES:
        raise LazyTrainError(f"optimizer_mode {optimizer_mode!r} is not one of {', '.join(OPTIMIZER_MODES)}")
    if not 0 <= kept_layers <= L or any(t != "gpu" for t in tiers[L - kept_layers:]):
        raise LazyTrainError(f"kept_layers={kept_layers} needs 0..{L} and boundaries {L - kept_layers}..{L} on gpu")
    if staging_depth and not shapes.state_bytes:
        raise LazyTrainError("staging_depth > 0 needs the step shapes' state_bytes (optimizer_offload nvme)")
    uses = weight_uses(tiers, forward_only, kept_layers)
    if forward_only:
        return _forward_only(tiers, shapes, uses)
    state = state_schedule(L, shapes.tied_head, staging_depth) if staging_depth else None
    step = _StepBuilder(tiers, shapes, uses, topology, kept_layers, state,
                        overlap_updates=optimizer_mode == "overlap" and updates, prefetch=last_micro_batch)
    step.stage()
    if optimizer_mode == "overlap" and updates:
        step.updates()
    step.start()
    for j in range(L):
        step.forward(j)
    step.head()
    for s, e in reversed(segments_of(tiers)):
        for j in range(s, e - 1):  # regenerate boundaries s+1..e-1
            step.recompute(j)
        for j in range(e - 1, s - 1, -1):
            step.backward(j)
    step.end()
    if optimizer_mode == "serial" and state is None:
        step.optimizer_step()
    elif optimizer_mode == "serial" and last_micro_batch:
        step.serial_updates()
    step.unstage()
    return StepProgram(tiers=tiers, shapes=shapes, ops=tuple(step.ops), actions=tuple(step.actions),
                       optimizer_mode=optimizer_mode, uses=tuple(uses), topology=topology, kept_layers=kept_layers,
                       staging_depth=staging_depth)


class _Program:
    """The op list and the host thread's actions as they are written."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.actions: list[Action] = []

    def enqueue(self, lane: str, kind: str, target: int = -1, num_bytes: int = 0,
                after: tuple[int | None, ...] = (), use: int = -1, slot: int = -1) -> int:
        """Issue a job on `lane` that no window fences (the optimizer lane's, the evaluation's)."""
        op = Op(len(self.ops), lane, kind, target, int(num_bytes), tuple(a for a in after if a is not None), use,
                slot)
        self.ops.append(op)
        self.actions.append(Action("issue", op.index))
        return op.index

    def run_op(self, kind: str, target: int, use: int) -> int:
        op = Op(len(self.ops), "compute", kind, target, 0, (), use)
        self.ops.append(op)
        self.actions.append(Action("run", op.index))
        return op.index

    def wait(self, op: int) -> None:
        self.actions.append(Action("wait", op))

    def alloc(self, kind: str, index: int, num_bytes: int) -> None:
        self.actions.append(Action("alloc", buffer=(kind, index), num_bytes=int(num_bytes)))

    def free(self, kind: str, index: int, num_bytes: int) -> None:
        self.actions.append(Action("free", buffer=(kind, index), num_bytes=int(num_bytes)))

    def host_alloc(self, kind: str, index: int, num_bytes: int) -> None:
        self.actions.append(Action("host_alloc", buffer=(kind, index), num_bytes=int(num_bytes)))

    def host_free(self, kind: str, index: int, num_bytes: int) -> None:
        self.actions.append(Action("host_free", buffer=(kind, index), num_bytes=int(num_bytes)))


class _StepBuilder(_Program):
    """Writes a training step's program one window at a time, in the order the host thread runs them: `updates`
    (overlap), `start`, `forward` j, `head`, then per segment `recompute` j and `backward` j, `end`. Each window
    issues its jobs, runs its compute and ends with a fence: a wait for every job it issued, so it lasts its
    longest lane (the MILP's T[w]). Optimizer-lane jobs are the exception: they queue across windows and `end`
    waits for them."""

    def __init__(self, tiers: tuple[str, ...], shapes: Shapes, uses: list[tuple[str, int]], topology: Topology,
                 kept_layers: int, state: StateSchedule | None = None, *, overlap_updates: bool = False,
                 prefetch: bool = True) -> None:
        super().__init__()
        # optimizer_offload nvme: the state ops' windows; the forward's only when the step starts with the updates,
        # the backward's prefetch only when its gradients are final
        self.state, self.overlap_updates, self.prefetch = state, overlap_updates, prefetch
        self.update_ops: dict[int, int] = {}  # group index k (update order) -> its update op
        self.state_writes: dict[int, int] = {}  # group index k -> its state_write op
        self.tiers, self.shapes, self.uses, self.topology = tiers, shapes, uses, topology
        self.L = len(tiers) - 1
        self.first_kept = self.L - kept_layers  # layers first_kept..L-1 keep their graph and weights
        self.start_of = {e: s for s, e in segments_of(tiers)}  # segment end -> its start
        self.use = 0  # the weight use of the next compute op
        self.window: list[int] = []  # jobs issued in the current window; all are waited for at its end
        self.released: list[tuple[str, int, int]] = []  # buffers freed at the next fence (their transfer done)
        self.offload_d2h: dict[int, int] = {}  # offloaded boundary -> its d2h (nvme: then its write)
        self.reads: dict[int, int] = {}  # nvme boundary -> its read into the host buffer
        self.grads: list[tuple[int, int]] = []  # (group, bytes) whose gradients wait in a gradient slot
        self.landing: list[int] = []  # optimizer-lane jobs: a FIFO queue across windows, waited for at the end
        self.update: dict[int, int] = {}  # group target -> its update op, until the window that fences it

    # ---- the windows ----------------------------------------------------------------------------------------
    def stage(self) -> None:
        """optimizer_offload nvme: the D staging slots, held by the step (the executor keeps them across steps:
        the backward's prefetch fills them for the next step's first updates)."""
        for slot in range(self.state.depth if self.state else 0):
            self.host_alloc("staging", slot, self.shapes.staging_slot_bytes)

    def unstage(self) -> None:
        for slot in range(self.state.depth if self.state else 0):
            self.host_free("staging", slot, self.shapes.staging_slot_bytes)

    def updates(self) -> None:
        """Overlap mode, a step's first micro-batch: the previous step's update of every group on the optimizer
        lane, in forward order; each joins the fence of the window that streams its group. With the states on
        NVMe only the first D groups' here (their states were read in the last backward); each later group's is
        enqueued after its state_read (`_state_ops`)."""
        for k, j in enumerate(update_order(self.L, self.shapes.tied_head)):
            if self.state is None or k < self.state.depth:
                self.update[j] = self.update_ops[k] = self.enqueue("optimizer", "update", j)

    def start(self) -> None:
        """Two weight slots and boundary 0 (the embedding gather, after the embedding's update); h2d of boundary 0
        and of use 0's weights; fence; then the step's constants (rotary tables, positions, masks)."""
        shapes, A = self.shapes, self.shapes.boundary_bytes
        self.alloc("weight_slots", -1, shapes.slots_bytes)
        self.alloc("boundary", 0, A[0])
        self._state_ops(0)
        first = self._fence_update(self.L if shapes.tied_head else -1)
        self.issue("h2d", "boundary0", 0, A[0], after=(first,))
        self._issue_weights(0)
        self.fence()
        self.alloc("constants", -1, shapes.constant_bytes)

    def forward(self, j: int) -> None:
        """F_j: the next use's weights, the d2h of boundary j if offloaded, the nvme write of boundary j-1; layer
        j's forward (with autograd for a kept layer, whose graph stays until its backward); boundary j+1. A
        recomputed boundary j goes with the compute, an offloaded one once the fence saw its d2h."""
        tiers, A, WF = self.tiers, self.shapes.boundary_bytes, self.shapes.forward_working_bytes
        self._state_ops(j + 1)
        self._next_weights()
        if j > 0 and tiers[j] in OFFLOADED:
            self.offload_d2h[j] = self.issue("d2h", "offload", j, A[j])
        if j > 1 and tiers[j - 1] == "nvme":
            self._spill(j - 1)
        if j >= self.first_kept:
            forward_bytes = self.shapes.graph_forward_bytes[j]
            self.alloc("working", j, forward_bytes)
            self.run("keep", j)
            self.free("working", j, forward_bytes)
            self.alloc("boundary", j + 1, A[j + 1])
            self.alloc("graph", j, self.shapes.graph_bytes[j])
            self.fence()
            return
        self.alloc("working", j, WF[j])
        self.run("forward", j)
        self.alloc("boundary", j + 1, A[j + 1])
        self.free("working", j, WF[j])
        if j > 0 and tiers[j] == "recompute":
            self.free("boundary", j, A[j])  # consumed by layer j, regenerated in the backward
        self.fence()
        if j > 0 and tiers[j] in OFFLOADED:
            self.free("boundary", j, A[j])  # its d2h is done: the host holds it

    def head(self) -> None:
        """H: two gradient slots (and the head's own), the next use's weights, the nvme write of boundary L-1, the
        nvme read staged for B_{L-1}, the reload of the last segment's start; the loss head forward + backward,
        which writes the gradient of boundary L and the head's weight gradients (sent in the next window)."""
        tiers, shapes, L = self.tiers, self.shapes, self.L
        A, HS, HG = shapes.boundary_bytes, shapes.head_slot_bytes, shapes.head_grad_slot_bytes
        self.alloc("grad_slots", -1, shapes.grad_slots_bytes)
        if HG:
            self.alloc("head_grads", L, HG)
        last_start = self.start_of[L]
        reloads = last_start > 0 and tiers[last_start] in OFFLOADED
        if reloads:
            self.alloc("boundary", last_start, A[last_start])  # the device buffer exists from the reload's issue
        self._state_ops(L + 1)
        self._next_weights()
        if L > 1 and tiers[L - 1] == "nvme":
            self._spill(L - 1)
        self._stage(L - 1)
        if reloads:
            self._reload(last_start)
        self.alloc("working", L, shapes.head_working_bytes)
        self.alloc("grad", L, A[L])
        self.run("head", L)
        self.free("working", L, shapes.head_working_bytes)
        if HS:
            self.free("head_weights", L, HS)
        self.fence()
        self.grads.append((L, shapes.head_grad_bytes))

    def recompute(self, j: int) -> None:
        """R_j: the next use's weights, the d2h of the previous window's weight gradients; layer j's forward
        again, which regenerates boundary j+1."""
        A, WF = self.shapes.boundary_bytes, self.shapes.forward_working_bytes
        self._next_weights()
        self._send_grads()
        self.alloc("working", j, WF[j])
        self.run("recompute", j)
        self.alloc("boundary", j + 1, A[j + 1])
        self.free("working", j, WF[j])
        self.fence()

    def backward(self, j: int) -> None:
        """B_j: the next use's weights, the d2h of the previous window's weight gradients, the nvme read staged for
        the next segment; at a segment's start (its last window) the reload of the start of the segment before
        it. Layer j's backward (re-forward + backward, or a kept layer's through its graph) writes the gradient
        of boundary j; boundary j+1 and its gradient go."""
        tiers, shapes, A = self.tiers, self.shapes, self.shapes.boundary_bytes
        self._next_weights()
        self._send_grads()
        self._prefetch(self.L - 1 - j)
        self._stage(j - 1)
        previous = self.start_of.get(j, 0) if tiers[j] != "recompute" else 0  # the segment that runs next
        if previous > 0 and tiers[previous] in OFFLOADED:
            self.alloc("boundary", previous, A[previous])  # its reload's device buffer, from its window on
            self._reload(previous)
        if j >= self.first_kept:  # through the kept graph: no re-forward
            backward_bytes = shapes.graph_backward_bytes[j]
            self.alloc("working", j, backward_bytes)
            self.run("backprop", j)
            self.alloc("grad", j, A[j])
            self.free("working", j, backward_bytes)
            self.free("graph", j, shapes.graph_bytes[j])
            self.free("kept_weights", j, shapes.param_bytes[j])
        else:
            self.alloc("working", j, shapes.working_bytes[j])
            self.run("backward", j)
            self.alloc("grad", j, A[j])
            self.free("working", j, shapes.working_bytes[j])
        self.free("boundary", j + 1, A[j + 1])
        self.free("grad", j + 1, A[j + 1])
        self.fence()
        self.grads.append((j, shapes.grad_bytes[j]))

    def end(self) -> None:
        """The last gradients' d2h, the gradient of boundary 0's d2h and the embedding backward on the optimizer
        lane (with ranks, after the gather of every rank's rows); fence; wait for every optimizer-lane job; the
        step's buffers go."""
        shapes, A = self.shapes, self.shapes.boundary_bytes
        self._send_grads()
        if shapes.embedding_grad:  # (a frozen embedding needs no boundary-0 gradient on the host)
            grad0 = self.issue("d2h", "grad0", 0, A[0])
            if self.topology.parallel:  # every rank's boundary-0 gradient rows to the embedding's owners
                grad0 = self.enqueue("optimizer", "gather", 0, A[0], after=(grad0,))
                self.landing.append(grad0)
            self.landing.append(self.enqueue("optimizer", "embedding", 0, after=(grad0,)))
        self.fence()
        for op in self.landing:
            self.wait(op)
        self.free("grad", 0, A[0])
        self.free("boundary", 0, A[0])
        self.free("constants", -1, shapes.constant_bytes)
        self.free("grad_slots", -1, shapes.grad_slots_bytes)
        self.free("weight_slots", -1, shapes.slots_bytes)

    def optimizer_step(self) -> None:
        """Serial mode (MegaTrain): the whole optimizer step after the backward, waited for."""
        self.wait(self.enqueue("optimizer", "step"))

    def serial_updates(self) -> None:
        """Serial mode with the states on NVMe, the last micro-batch: after the backward, each group's update in
        update order, its state_write after it, and the state_read of the group that takes its slot next after
        that write (the first D groups' states were read in this backward); waited for: the last update, then
        the last write."""
        state, S = self.state, self.shapes.state_bytes
        assert state is not None
        D, targets = state.depth, state.targets
        reads: dict[int, int] = {}
        update = write = -1
        for k, j in enumerate(targets):
            update = self.enqueue("optimizer", "update", j, after=(reads.get(k),))
            write = self.enqueue("nvme_write", "state_write", j, S[j + 1], after=(update,), slot=k % D)
            if k + D < len(targets):
                n = targets[k + D]
                reads[k + D] = self.enqueue("nvme_read", "state_read", n, S[n + 1], after=(write,), slot=k % D)
        self.wait(update)
        self.wait(write)

    # ---- what the windows are made of ------------------------------------------------------------------------
    def issue(self, lane: str, kind: str, target: int = -1, num_bytes: int = 0,
              after: tuple[int | None, ...] = (), use: int = -1, slot: int = -1) -> int:
        """Issue a job of this window: the window's fence waits for it."""
        op = self.enqueue(lane, kind, target, num_bytes, after, use, slot)
        self.window.append(op)
        return op

    def run(self, kind: str, j: int) -> None:
        """Run this window's compute op, the next weight use."""
        self.run_op(kind, j, self.use)
        self.use += 1

    def fence(self) -> None:
        """The window ends: wait for every job it issued, then free what waited for them. The state ops last
        (issued first): a wait's seconds are charged to the lane of the job it waits on, so a state_write that ran
        under the group update the window's weights wait for is not reported as exposed."""
        for op in sorted(self.window, key=lambda op: self.ops[op].kind in STATE_OPS):
            self.wait(op)
        self.window.clear()
        for buffer in self.released:
            self.free(*buffer)
        self.released.clear()

    def _fence_update(self, j: int) -> int | None:
        """Group j's pending update joins this window's fence (its lateness is the optimizer lane's exposed
        time); the h2d that reads the group issues after it."""
        update = self.update.pop(j, None)
        if update is not None:
            self.window.append(update)
        return update

    def _state_ops(self, window: int) -> None:
        """optimizer_offload nvme, a step that starts with the updates: this forward window's state_writes (groups
        updated, their fences passed) and state_reads (into the slots those writes empty), first on their lanes;
        each read's group update is enqueued after it, to be fenced where its weights stream (StateSchedule)."""
        state, S = self.state, self.shapes.state_bytes
        if state is None or not self.overlap_updates:
            return
        D, targets = state.depth, state.targets
        for k in state.writes_in(window):
            j = targets[k]
            self.state_writes[k] = self.issue("nvme_write", "state_write", j, S[j + 1], after=(self.update_ops[k],),
                                              slot=k % D)
        for k in state.reads_in(window):
            j = targets[k]
            read = self.issue("nvme_read", "state_read", j, S[j + 1], after=(self.state_writes[k - D],), slot=k % D)
            self.update[j] = self.update_ops[k] = self.enqueue("optimizer", "update", j, after=(read,))

    def _prefetch(self, k: int) -> None:
        """optimizer_offload nvme, the last micro-batch: the backward window B_{L-1-k} reads group k's state into
        slot k, for the update after this backward (k < D; first on the nvme_read lane)."""
        state, S = self.state, self.shapes.state_bytes
        if state is None or not self.prefetch or not 0 <= k < state.depth:
            return
        j = state.targets[k]
        self.issue("nvme_read", "state_read", j, S[j + 1], slot=k)

    def _next_weights(self) -> None:
        self._issue_weights(self.use + 1)

    def _issue_weights(self, u: int) -> None:
        """h2d of use u's weights into its slot (u % 2, a kept layer's own, the head's own when larger than a
        layer); a forward use after its group's update."""
        if u >= len(self.uses):
            return
        kind, j = self.uses[u]
        if kind == "backprop":
            return  # a kept layer's weights stayed on the device since its forward
        if kind == "keep":
            self.alloc("kept_weights", j, self.shapes.param_bytes[j])  # its own slot, until its backward
        if kind == "head" and self.shapes.head_slot_bytes:
            self.alloc("head_weights", self.L, self.shapes.head_slot_bytes)  # its own slot, until its compute ends
        update = self._fence_update(j) if u <= self.L else None
        num_bytes = self.shapes.head_param_bytes if kind == "head" else self.shapes.param_bytes[j]
        self.issue("h2d", "weights", j, num_bytes, after=(update,), use=u)

    def _send_grads(self) -> None:
        """d2h of the last gradient-producing use's gradients (in this window), then their optimizer-lane jobs
        (with ranks the sum over the ranks, then the land), which queue behind the earlier ones, not fenced."""
        if not self.grads:
            return
        j, num_bytes = self.grads.pop()
        if not num_bytes:  # a frozen group: nothing to send or land
            return
        landed = self.issue("d2h", "grads", j, num_bytes)
        if j == self.L and self.shapes.head_grad_slot_bytes:
            # its own gradient slot, once this window's fence saw the d2h
            self.released.append(("head_grads", self.L, self.shapes.head_grad_slot_bytes))
        if self.topology.parallel:  # summed into the group's owners once the whole gradient is on the host
            landed = self.enqueue("optimizer", "reduce", j, self.shapes.reduce_bytes(num_bytes), after=(landed,))
            self.landing.append(landed)
        self.landing.append(self.enqueue("optimizer", "land", j, after=(landed,)))

    def _spill(self, i: int) -> None:
        """nvme write of boundary i, after its d2h (issued in the window before)."""
        A = self.shapes.boundary_bytes
        self.offload_d2h[i] = self.issue("nvme_write", "spill", i, A[i], after=(self.offload_d2h[i],))

    def _stage(self, e: int) -> None:
        """nvme read of the start of the segment ending at e into the host buffer, a window before its h2d."""
        s = self.start_of.get(e, 0)
        if s > 0 and self.tiers[s] == "nvme":
            A = self.shapes.boundary_bytes
            self.reads[s] = self.issue("nvme_read", "read", s, A[s], after=(self.offload_d2h[s],))

    def _reload(self, s: int) -> None:
        """h2d of offloaded boundary s into its device buffer (allocated in this window)."""
        A = self.shapes.boundary_bytes
        ready = self.reads.get(s, self.offload_d2h[s])
        if self.tiers[s] == "nvme" and s not in self.reads:  # read and copy chained in one window
            ready = self.reads[s] = self.issue("nvme_read", "read", s, A[s], after=(self.offload_d2h[s],))
        self.issue("h2d", "reload", s, A[s], after=(ready,))


def program_for(plan_or_tiers: object, cost: CostModel, *, optimizer_mode: str = "overlap",
                topology: Topology = ONE_RANK, staging_depth: int | None = None) -> StepProgram:
    """The program of a Plan (its tiers, kept layers and staging depth) or a bare tier list, with a CostModel's
    shapes (and `topology`'s ranks). `staging_depth` overrides the plan's; a cost model with its optimizer
    state on NVMe needs a depth >= 1 (a plan's, or this)."""
    tiers = getattr(plan_or_tiers, "tiers", plan_or_tiers)
    depth = getattr(plan_or_tiers, "staging_depth", 0) if staging_depth is None else staging_depth
    if cost.optimizer_offload == "nvme" and not depth:
        raise LazyTrainError("optimizer_offload nvme: the plan has no staging depth (it was made for the states "
                             "in RAM); make a new plan with optimizer_offload nvme")
    return build_program(tuple(tiers), Shapes.from_cost(cost), optimizer_mode=optimizer_mode, topology=topology,
                         kept_layers=getattr(plan_or_tiers, "kept_layers", 0),
                         staging_depth=depth if cost.optimizer_offload == "nvme" else 0)


def _forward_only(tiers: tuple[str, ...], shapes: Shapes, uses: list[tuple[str, int]]) -> StepProgram:
    """Evaluation: each use waits for its own weights (issued one use ahead), every boundary is freed once the
    next exists, the loss head runs forward only ("loss")."""
    b = _Program()
    L, A, W, HS = len(tiers) - 1, shapes.boundary_bytes, shapes.slots_bytes, shapes.head_slot_bytes
    weights: dict[int, int] = {}

    def begin_use(u: int) -> None:
        for v in (u, u + 1):
            if v < len(uses) and v not in weights:
                nbytes = shapes.head_param_bytes if v == L else shapes.param_bytes[v]
                if v == L and HS:
                    b.alloc("head_weights", L, HS)  # its own slot, until the loss
                weights[v] = b.enqueue("h2d", "weights", uses[v][1], nbytes, use=v)
        b.wait(weights.pop(u))

    b.alloc("weight_slots", -1, W)
    b.alloc("boundary", 0, A[0])
    upload0 = b.enqueue("h2d", "boundary0", 0, A[0])
    begin_use_0 = b.enqueue("h2d", "weights", 0, shapes.param_bytes[0], use=0)
    weights[0] = begin_use_0
    b.wait(upload0)
    b.alloc("constants", -1, shapes.constant_bytes)
    for j in range(L):
        begin_use(j)
        b.alloc("working", j, shapes.forward_working_bytes[j])
        b.run_op("forward", j, j)
        b.alloc("boundary", j + 1, A[j + 1])
        b.free("working", j, shapes.forward_working_bytes[j])
        b.free("boundary", j, A[j])
    begin_use(L)
    b.alloc("working", L, shapes.head_working_bytes)
    b.run_op("loss", L, L)
    b.free("working", L, shapes.head_working_bytes)
    if HS:
        b.free("head_weights", L, HS)
    b.free("boundary", L, A[L])
    b.free("constants", -1, shapes.constant_bytes)
    b.free("weight_slots", -1, W)
    return StepProgram(tiers=tiers, shapes=shapes, ops=tuple(b.ops), actions=tuple(b.actions),
                       optimizer_mode="overlap", uses=tuple(uses))
