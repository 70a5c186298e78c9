"""The step program (Contract 2): one training step of a Plan as ops on lanes, written once.

The executor runs it (`lazytrain.runtime.executor`), the simulator times it on a CostModel (`plan/sim.py`),
the device-memory count walks its alloc/free actions (`StepProgram.device_peak_bytes`). The program is a list
of *actions* in the order the host thread performs them:

    issue op   enqueue a job on its lane (FIFO); it starts once its lane is free and its `after` ops are done
    run op     the host thread runs a compute op (lane `compute`)
    wait op    the host thread blocks until op is done (the seconds blocked are that op's lane's stall)
    alloc/free device bytes of one buffer appear / go (the arena counts them at this program point)

Lanes: compute, h2d, d2h, nvme_read, nvme_write, optimizer (the host lane: the previous step's group updates,
then this step's gradient accumulation into `.grad`; with ranks also each group's sum over the ranks,
costmodel/topology.py).

Optimizer modes. "overlap" (overlapped-exact, the default; it clips): the global gradient norm and the
non-finite check need every gradient, so a step's update runs at the start of the NEXT step on the optimizer
lane, one op "update j" per group in forward order (target -1 = the untied embedding, 0..L-1 the layers, L the
head; a tied head's group owns the embedding and goes first), each clipping with the step's one coefficient,
stepping that group and refreshing its compute-dtype copy. The h2d of boundary 0 (the embedding gather) and
each forward weight h2d of group j carry `after=(update j,)`, and update j joins that window's fence (so its
lateness is the optimizer lane's exposed time): the first group's update is exposed, the rest hide under the
forward as far as it goes. Only a step's first micro-batch carries them (`updates=True`): the program is the
steady state, step k timing step k-1's update. "serial" (MegaTrain's code): one op "step", the whole
optimizer, waited for after the backward.

Program (u indexes weight uses: forward 0..L-1, head, then per segment (s, e) last to first: recompute
s..e-2, backward e-1..s; use u streams into weight slot u % 2, the loss head into its own slot when it is
larger than a layer, and its gradients likewise: those two exist only while live, the weight slot from its
h2d's issue in F_{L-1} to the end of the head's compute, the gradient slot from H to the fence of the window that
sends it). Every compute op is one *window*: the jobs the
window issues start as it starts, and the window ends with a wait for all of them (a fence), so a window lasts
max(its compute, each lane's chain of jobs) and the step is the sum of its windows -- exactly what the MILP
(plan/milp.py) adds up. No transfer runs across a window boundary. The optimizer lane is the exception: its jobs
(released as their gradients land) queue across windows and are waited for at the end; a FIFO queue with
release times is also exactly linear.
  updates   (overlap, first micro-batch) "update j" for every group on the optimizer lane, forward order.
  start     alloc 2 weight slots and boundary 0; h2d boundary 0 and the weights of use 0; fence; alloc the
            constants (rotary tables, positions, masks).
  F_j       h2d of use j+1's weights (into the slot use j-1 freed; F_{L-1} allocs the head's own slot first);
            d2h of boundary j if it is offloaded; the
            nvme write of boundary j-1 if it is on nvme (its d2h was done in F_{j-1}); alloc working set; run;
            alloc boundary j+1; free working set (and boundary j if recomputed); fence; an offloaded boundary j
            leaves the device.
  H         alloc 2 gradient slots (and the head's own), the device buffer of the last segment's start if
            offloaded; h2d of the next use's weights; nvme write of boundary L-1; the nvme read staged for
            B_{L-1}; the reload h2d of the last segment's start (after its read, in this window, if it is on
            nvme); alloc the head working set and the gradient of boundary L; run; free the working set and the
            head's weight slot; fence.
  R_j, B_j  per segment (s, e), last first: each window issues the next use's weights and
            the d2h of the previous window's weight gradients (head or B), with their optimizer-lane job after
            it (accumulation into .grad, and in overlap mode the group's optimizer step; not fenced); B_j
            also stages the nvme read of the start of the segment ending at j-1 into the host buffer (one
            window before its h2d), and B_s allocates the device buffer of the next segment's start s' and
            issues its reload h2d (if offloaded). R_j: alloc working set, run, alloc
            boundary j+1, free working set. B_j: alloc working set, run, alloc the gradient of boundary j,
            free working set, boundary j+1 and its gradient. Fence; the window that sent the head's gradients
            frees its gradient slot.
  end       d2h of B_0's gradients and their optimizer job, d2h of the gradient of boundary 0 and the embedding
            backward on the optimizer lane; fence; wait for every optimizer-lane job; free boundary 0, its
            gradient, constants and slots.
            Mode "serial": then the optimizer step of every group on the optimizer lane, waited for
            (MegaTrain's code; the executor leaves it to its caller).
  ranks     (Topology.world_size > 1; distributed/grads.py) every micro-batch, each group's landed gradient is
            summed into its owners by a "reduce j" op on the optimizer lane, after its d2h and before its land
            (its bytes in fp32), and boundary 0's gradient rows are gathered to the embedding's owners by a
            "gather" op before the embedding backward. Like every optimizer-lane job they are not fenced: the
            backward runs on while they queue.

Kept layers (`kept_layers` = K, Plan.kept_layers; boundaries L-K..L gpu): layer j >= L-K is use "keep" in
the forward: its weight h2d (in F_{j-1}) allocates its own slot ("kept_weights" j), F_j allocates its forward's
peak (graph_forward_bytes), runs it with autograd, frees that, allocates boundary j+1 and its graph ("graph" j).
Its backward is use "backprop" (B_j): no weights are issued for it, it allocates its backward's peak beyond the
graph (graph_backward_bytes), runs through the graph, allocates the gradient of boundary j, frees its graph and
its slot. The windows are otherwise the same, so the MILP's step (y[j]) stays the simulated one.

Transfer windows (what `Plan.transfers` records): the d2h of boundary i in F_i, its nvme write in F_{i+1} (H
for i = L-1), its nvme read in B_{e+1} (H for e = L-1) and its h2d in B_e, with (i, e) its segment; the last
segment's start reloads in H.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazytrain.costmodel.topology import ONE_RANK, REDUCE_DTYPE_BYTES, Topology
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from lazytrain.costmodel.cost import CostModel

LANES = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
STALL_LANES = ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
OPTIMIZER_MODES = ("overlap", "serial")
OFFLOADED = ("cpu", "nvme")
COMPUTE_KINDS = ("forward", "recompute", "backward", "keep", "backprop", "head", "loss")
WINDOW_LETTER = {"forward": "F", "keep": "F", "recompute": "R", "backward": "B", "backprop": "B"}


@dataclass(frozen=True)
class Shapes:
    """The bytes one step moves and holds (the executor's own, or a CostModel's)."""

    boundary_bytes: tuple[int, ...]  # A[i], i = 0..L
    param_bytes: tuple[int, ...]  # weights streamed per use of layer j (compute dtype) = its gradient bytes
    head_param_bytes: int  # final norm + LM head (the tied embedding for a tied head)
    working_bytes: tuple[int, ...]  # autograd working set of layer j during each of its computes
    head_working_bytes: int
    constant_bytes: int = 0  # rotary cos/sin, positions, attention masks of the step
    tied_head: bool = False  # the head's group owns the embedding (tied LM head): its update precedes boundary 0
    dtype_bytes: int = 4  # of the compute dtype: the ranks sum a gradient in fp32 (REDUCE_DTYPE_BYTES per element)
    # kept layers (Plan.kept_layers), per layer j; () = 0 for every layer:
    graph_bytes: tuple[int, ...] = ()  # the saved tensors its graph holds from its forward to its backward
    graph_forward_bytes: tuple[int, ...] = ()  # peak of its forward with autograd (its output and graph included)
    graph_backward_bytes: tuple[int, ...] = ()  # its backward's peak beyond its graph, output and input gradient

    def __post_init__(self) -> None:
        L = len(self.param_bytes)
        if L < 1 or len(self.boundary_bytes) != L + 1 or len(self.working_bytes) != L:
            raise LazyTrainError(f"step shapes: need L >= 1 layers, L working sets and L+1 boundaries, got "
                                 f"{L}, {len(self.working_bytes)}, {len(self.boundary_bytes)}")
        for name in ("graph_bytes", "graph_forward_bytes", "graph_backward_bytes"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0,) * L)
            elif len(getattr(self, name)) != L:
                raise LazyTrainError(f"step shapes: {name} needs {L} entries, got {len(getattr(self, name))}")

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

    @classmethod
    def from_cost(cls, cost: CostModel) -> Shapes:
        """A CostModel's bytes (a kept layer's: `graph_bounds`)."""
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
                   graph_bytes=graphs[0], graph_forward_bytes=graphs[1], graph_backward_bytes=graphs[2])

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
    (boundary0, offload, spill, read, reload, grad0); `use` the weight use a weights/compute op belongs to."""

    index: int
    lane: str
    kind: str
    target: int = -1
    num_bytes: int = 0
    after: tuple[int, ...] = ()
    use: int = -1

    @property
    def name(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return "H" if self.kind in ("head", "loss") else f"{WINDOW_LETTER[self.kind]}{self.target}"
        if self.kind == "update":
            return f"update {'embedding' if self.target < 0 else self.target}"
        return f"{self.kind} {self.target}" if self.target >= 0 else self.kind


@dataclass(frozen=True)
class Action:
    """One step of the host thread: `verb` is issue / run / wait (an op) or alloc / free (a buffer's bytes)."""

    verb: str
    op: int = -1
    # (kind, index): weight_slots, grad_slots, head_weights, head_grads, kept_weights, boundary, grad, working,
    # graph, constants
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

    def device_peak_bytes(self) -> int:
        """The high-water mark of the alloc/free actions (link speeds do not move it)."""
        used = peak = 0
        for a in self.actions:
            if a.verb == "alloc":
                used += a.num_bytes
                peak = max(peak, used)
            elif a.verb == "free":
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


@dataclass
class _Builder:
    ops: list[Op] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)

    def issue(self, lane: str, kind: str, target: int = -1, num_bytes: int = 0, after: tuple[int | None, ...] = (),
              use: int = -1) -> int:
        op = Op(len(self.ops), lane, kind, target, int(num_bytes), tuple(a for a in after if a is not None), use)
        self.ops.append(op)
        self.actions.append(Action("issue", op.index))
        return op.index

    def run(self, kind: str, target: int, use: int) -> int:
        op = Op(len(self.ops), "compute", kind, target, 0, (), use)
        self.ops.append(op)
        self.actions.append(Action("run", op.index))
        return op.index

    def wait(self, op: int | None) -> None:
        if op is not None:
            self.actions.append(Action("wait", op))

    def alloc(self, kind: str, index: int, num_bytes: int) -> None:
        self.actions.append(Action("alloc", buffer=(kind, index), num_bytes=int(num_bytes)))

    def free(self, kind: str, index: int, num_bytes: int) -> None:
        self.actions.append(Action("free", buffer=(kind, index), num_bytes=int(num_bytes)))


def update_order(num_layers: int, tied_head: bool) -> list[int]:
    """The groups' update targets in forward order: -1 (untied embedding) or L (a tied head, which owns the
    embedding) first, then layers 0..L-1, then the untied head."""
    layers = list(range(num_layers))
    return [num_layers, *layers] if tied_head else [-1, *layers, num_layers]


def build_program(tiers: tuple[str, ...] | list[str], shapes: Shapes, *, optimizer_mode: str = "overlap",
                  updates: bool = True, forward_only: bool = False, topology: Topology = ONE_RANK,
                  kept_layers: int = 0) -> StepProgram:
    """The step program of `tiers` (L+1 entries) with `shapes`' bytes; see the module docstring.

    kept_layers: K, the last K layers keep their graph and weights from forward to backward (Plan.kept_layers;
    boundaries L-K..L must be gpu).

    updates: overlap mode: the step starts with the previous step's group updates on the optimizer lane (False:
    a step's later micro-batch, or no update pending).

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
    A, P, W, HS = shapes.boundary_bytes, shapes.param_bytes, shapes.slots_bytes, shapes.head_slot_bytes
    G, GF, GB = shapes.graph_bytes, shapes.graph_forward_bytes, shapes.graph_backward_bytes
    first_kept = L - kept_layers
    segments = segments_of(tiers)
    uses = weight_uses(tiers, forward_only, kept_layers)
    b = _Builder()
    if forward_only:
        return _forward_only(tiers, shapes, uses, b)
    start_of = {e: s for s, e in segments}  # segment end -> its start

    # ---- one fenced window per compute op ---------------------------------------------------------------
    window: list[int] = []  # jobs issued in the current window; all are waited for at its end
    offload_d2h: dict[int, int] = {}
    reads: dict[int, int] = {}
    weights: dict[int, int] = {}
    grads: list[tuple[int, int]] = []  # (group, bytes) whose gradients wait in a gradient slot
    landing: list[int] = []  # optimizer-lane jobs: a FIFO queue across windows, waited for at the end
    released: list[tuple[str, int, int]] = []  # buffers freed at the next fence (once their transfer is done)

    def issue(lane: str, kind: str, target: int = -1, num_bytes: int = 0, after: tuple[int | None, ...] = (),
              use: int = -1) -> int:
        op = b.issue(lane, kind, target, num_bytes, after, use)
        window.append(op)
        return op

    def fence() -> None:
        for op in window:
            b.wait(op)
        window.clear()
        for buffer in released:
            b.free(*buffer)
        released.clear()

    def issue_weights(u: int) -> None:
        if u < len(uses):
            kind, j = uses[u]
            if kind == "backprop":
                return  # a kept layer's weights stayed on the device since its forward
            if kind == "keep":
                b.alloc("kept_weights", j, P[j])  # its own slot, until its backward
            if kind == "head" and HS:
                b.alloc("head_weights", L, HS)  # its own slot, until its compute ends
            fence_update = update.pop(j, None) if u <= L else None  # a forward use waits for its group's update
            if fence_update is not None:
                window.append(fence_update)
            weights[u] = issue("h2d", "weights", j, shapes.head_param_bytes if kind == "head" else P[j],
                               after=(fence_update,), use=u)

    def send_grads() -> None:
        """d2h of the last gradient-producing use's gradients (in this window), then their optimizer-lane jobs
        (with ranks the sum over the ranks, then the land), which queue behind the earlier ones, not fenced."""
        if not grads:
            return
        j, nbytes = grads.pop()
        landed = issue("d2h", "grads", j, nbytes)
        if j == L and HS:
            released.append(("head_grads", L, HS))  # its own gradient slot, once this window's fence saw the d2h
        if topology.parallel:  # summed into the group's owners once the whole gradient is on the host
            landed = b.issue("optimizer", "reduce", j, shapes.reduce_bytes(nbytes), after=(landed,))
            landing.append(landed)
        landing.append(b.issue("optimizer", "land", j, after=(landed,)))

    def reload(s: int) -> None:
        """h2d of offloaded boundary s into its device buffer (allocated when its segment's successor began)."""
        ready = reads.get(s, offload_d2h[s])
        if tiers[s] == "nvme" and s not in reads:  # read and copy chained in one window
            ready = reads[s] = issue("nvme_read", "read", s, A[s], after=(offload_d2h[s],))
        issue("h2d", "reload", s, A[s], after=(ready,))

    def stage(e: int) -> None:
        """nvme read of the start of the segment ending at e into the host buffer, a window before its h2d."""
        s = start_of.get(e, 0)
        if s > 0 and tiers[s] == "nvme":
            reads[s] = issue("nvme_read", "read", s, A[s], after=(offload_d2h[s],))

    def compute(kind: str, j: int, u: int) -> None:
        b.alloc("working", j, shapes.working_bytes[j])
        b.run(kind, j, u)

    # ---- the previous step's update, group by group in forward order (overlap) ----------------------------
    update: dict[int, int] = {}  # group target -> its update op, until the window that fences it
    if optimizer_mode == "overlap" and updates:
        for j in update_order(L, shapes.tied_head):
            update[j] = b.issue("optimizer", "update", j)

    # ---- step start: boundary 0 and the first weights ----------------------------------------------------
    b.alloc("weight_slots", -1, W)
    b.alloc("boundary", 0, A[0])
    first = update.pop(L if shapes.tied_head else -1, None)  # the embedding gather reads the updated embedding
    if first is not None:
        window.append(first)
    issue("h2d", "boundary0", 0, A[0], after=(first,))
    issue_weights(0)
    fence()
    b.alloc("constants", -1, shapes.constant_bytes)

    # ---- forward: window F_j --------------------------------------------------------------------------------
    for j in range(L):
        issue_weights(j + 1)
        if j > 0 and tiers[j] in OFFLOADED:
            offload_d2h[j] = issue("d2h", "offload", j, A[j])
        if j > 1 and tiers[j - 1] == "nvme":
            offload_d2h[j - 1] = issue("nvme_write", "spill", j - 1, A[j - 1], after=(offload_d2h[j - 1],))
        if j >= first_kept:  # with autograd: its graph stays until its backward
            b.alloc("working", j, GF[j])
            b.run("keep", j, j)
            b.free("working", j, GF[j])
            b.alloc("boundary", j + 1, A[j + 1])
            b.alloc("graph", j, G[j])
            fence()
            continue
        compute("forward", j, j)
        b.alloc("boundary", j + 1, A[j + 1])
        b.free("working", j, shapes.working_bytes[j])
        if j > 0 and tiers[j] == "recompute":
            b.free("boundary", j, A[j])  # consumed by layer j, regenerated in the backward
        fence()
        if j > 0 and tiers[j] in OFFLOADED:
            b.free("boundary", j, A[j])  # its d2h is done: the host holds it

    # ---- loss head: window H ----------------------------------------------------------------------------
    b.alloc("grad_slots", -1, W)
    if HS:
        b.alloc("head_grads", L, HS)
    last_start = segments[-1][0]
    if last_start > 0 and tiers[last_start] in OFFLOADED:
        b.alloc("boundary", last_start, A[last_start])  # the device buffer exists from the reload's issue
    issue_weights(L + 1)
    if L > 1 and tiers[L - 1] == "nvme":
        offload_d2h[L - 1] = issue("nvme_write", "spill", L - 1, A[L - 1], after=(offload_d2h[L - 1],))
    stage(L - 1)
    if last_start > 0 and tiers[last_start] in OFFLOADED:
        reload(last_start)
    b.alloc("working", L, shapes.head_working_bytes)
    b.alloc("grad", L, A[L])
    b.run("head", L, L)
    b.free("working", L, shapes.head_working_bytes)
    if HS:
        b.free("head_weights", L, HS)
    fence()
    grads.append((L, shapes.head_param_bytes))

    # ---- backward: per segment (s, e), last first; windows R_s..R_{e-2}, B_{e-1}..B_s ----------------------
    u = L + 1
    for idx in range(len(segments) - 1, -1, -1):
        s, e = segments[idx]
        previous = segments[idx - 1][0] if idx > 0 else 0  # the start of the segment that runs next
        for j in range(s, e - 1):  # regenerate boundaries s+1..e-1
            issue_weights(u + 1)
            send_grads()
            compute("recompute", j, u)
            b.alloc("boundary", j + 1, A[j + 1])
            b.free("working", j, shapes.working_bytes[j])
            fence()
            u += 1
        for j in range(e - 1, s - 1, -1):
            issue_weights(u + 1)
            send_grads()
            stage(j - 1)
            if j == s and previous > 0 and tiers[previous] in OFFLOADED:
                b.alloc("boundary", previous, A[previous])  # its reload's device buffer, from its window on
                reload(previous)
            if j >= first_kept:  # through the kept graph: no re-forward
                b.alloc("working", j, GB[j])
                b.run("backprop", j, u)
                b.alloc("grad", j, A[j])
                b.free("working", j, GB[j])
                b.free("graph", j, G[j])
                b.free("kept_weights", j, P[j])
            else:
                compute("backward", j, u)
                b.alloc("grad", j, A[j])
                b.free("working", j, shapes.working_bytes[j])
            b.free("boundary", j + 1, A[j + 1])
            b.free("grad", j + 1, A[j + 1])
            fence()
            grads.append((j, P[j]))
            u += 1

    # ---- end: the last gradients, the embedding backward on the host -------------------------------------
    send_grads()
    grad0 = issue("d2h", "grad0", 0, A[0])
    if topology.parallel:  # every rank's boundary-0 gradient rows to the embedding's owners
        grad0 = b.issue("optimizer", "gather", 0, A[0], after=(grad0,))
        landing.append(grad0)
    landing.append(b.issue("optimizer", "embedding", 0, after=(grad0,)))
    fence()
    for op in landing:
        b.wait(op)
    b.free("grad", 0, A[0])
    b.free("boundary", 0, A[0])
    b.free("constants", -1, shapes.constant_bytes)
    b.free("grad_slots", -1, W)
    b.free("weight_slots", -1, W)
    if optimizer_mode == "serial":  # MegaTrain: the whole optimizer step after the backward
        b.wait(b.issue("optimizer", "step"))
    return StepProgram(tiers=tiers, shapes=shapes, ops=tuple(b.ops), actions=tuple(b.actions),
                       optimizer_mode=optimizer_mode, uses=tuple(uses), topology=topology, kept_layers=kept_layers)


def program_for(plan_or_tiers: object, cost: CostModel, *, optimizer_mode: str = "overlap",
                topology: Topology = ONE_RANK) -> StepProgram:
    """The program of a Plan (its tiers and kept layers) or a bare tier list, with a CostModel's shapes (and
    `topology`'s ranks)."""
    tiers = getattr(plan_or_tiers, "tiers", plan_or_tiers)
    return build_program(tuple(tiers), Shapes.from_cost(cost), optimizer_mode=optimizer_mode, topology=topology,
                         kept_layers=getattr(plan_or_tiers, "kept_layers", 0))


def _forward_only(tiers: tuple[str, ...], shapes: Shapes, uses: list[tuple[str, int]], b: _Builder) -> StepProgram:
    L, A, W, HS = len(tiers) - 1, shapes.boundary_bytes, shapes.slots_bytes, shapes.head_slot_bytes
    weights: dict[int, int] = {}

    def begin_use(u: int) -> None:
        for v in (u, u + 1):
            if v < len(uses) and v not in weights:
                nbytes = shapes.head_param_bytes if v == L else shapes.param_bytes[v]
                if v == L and HS:
                    b.alloc("head_weights", L, HS)  # its own slot, until the loss
                weights[v] = b.issue("h2d", "weights", uses[v][1], nbytes, use=v)
        b.wait(weights.pop(u))

    b.alloc("weight_slots", -1, W)
    b.alloc("boundary", 0, A[0])
    upload0 = b.issue("h2d", "boundary0", 0, A[0])
    begin_use_0 = b.issue("h2d", "weights", 0, shapes.param_bytes[0], use=0)
    weights[0] = begin_use_0
    b.wait(upload0)
    b.alloc("constants", -1, shapes.constant_bytes)
    for j in range(L):
        begin_use(j)
        b.alloc("working", j, shapes.working_bytes[j])
        b.run("forward", j, j)
        b.alloc("boundary", j + 1, A[j + 1])
        b.free("working", j, shapes.working_bytes[j])
        b.free("boundary", j, A[j])
    begin_use(L)
    b.alloc("working", L, shapes.head_working_bytes)
    b.run("loss", L, L)
    b.free("working", L, shapes.head_working_bytes)
    if HS:
        b.free("head_weights", L, HS)
    b.free("boundary", L, A[L])
    b.free("constants", -1, shapes.constant_bytes)
    b.free("weight_slots", -1, W)
    return StepProgram(tiers=tiers, shapes=shapes, ops=tuple(b.ops), actions=tuple(b.actions),
                       optimizer_mode="overlap", uses=tuple(uses))
