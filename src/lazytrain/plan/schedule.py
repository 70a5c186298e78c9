"""The step program (Contract 2): one training step of a Plan as ops on lanes, written once.

The executor runs it (`lazytrain.runtime.executor`), the simulator times it on a CostModel (`plan/sim.py`),
the device-memory count walks its alloc/free actions (`StepProgram.device_peak_bytes`). The program is a list
of *actions* in the order the host thread performs them:

    issue op   enqueue a job on its lane (FIFO); it starts once its lane is free and its `after` ops are done
    run op     the host thread runs a compute op (lane `compute`)
    wait op    the host thread blocks until op is done (the seconds blocked are that op's lane's stall)
    alloc/free device bytes of one buffer appear / go (the arena counts them at this program point)

Lanes: compute, h2d, d2h, nvme_read, nvme_write, optimizer (the host lane: gradient accumulation into `.grad`
and, in overlap mode, the optimizer step of each group as it completes), collective (room for data parallelism).

Program (u indexes weight uses: forward 0..L-1, head, then per segment (s, e) last to first: recompute
s..e-2, backward e-1..s; use u streams into weight slot u % 2):
  start     alloc 2 weight slots and boundary 0; issue h2d boundary 0, h2d weights of use 0; wait boundary 0;
            alloc the constants (rotary tables, positions, masks).
  use u     issue h2d of use u+1's weights (its slot was freed by use u-1), wait for use u's weights.
  forward   window w = layer w: (offloads the plan puts in window w are issued first: d2h, and for nvme an
            nvme_write after it) use w; alloc working set; run F_w; alloc boundary w+1; free working set;
            then every offloaded boundary whose last d2h window is w: wait its d2h, free it; a recomputed
            boundary w (w > 0) is freed once F_w has consumed it.
  head      alloc 2 gradient slots; issue the reloads planned for the head window; use; alloc the head working
            set and the gradient of boundary L; run H; free the working set; issue d2h of the head's gradients
            and an optimizer-lane job adding them into .grad.
  backward  per segment (s, e), last first: issue the reloads planned for this segment (nvme_read into the
            host buffer, then h2d into a freshly allocated device buffer, after the read); wait for boundary
            s's reload; R_s..R_{e-2}: use, alloc working set, run, alloc boundary j+1, free working set;
            B_{e-1}..B_s: use, alloc working set, run, alloc the gradient of boundary j, wait for the d2h of
            gradient producer g-2 (two gradient slots), free working set, issue d2h of the weight gradients
            and their optimizer-lane job, free boundary j+1 and its gradient.
  end       issue d2h of the gradient of boundary 0 and the embedding backward on the optimizer lane; wait for
            the d2h; free boundary 0 and its gradient; wait for every issued job; free constants and slots.
            Mode "serial": then the optimizer step of every group on the optimizer lane, waited for
            (MegaTrain's code; the executor leaves it to its caller).

Transfer windows (Plan.transfers; none = the defaults). Offload windows are forward windows (w = layer w);
reload windows backward windows (w < L: layer w's backward and its recompute; w = L: the loss head). A
boundary's d2h is issued at the start of the earliest window the plan names for it (default: window i, the
layer that reads it) and its device copy is freed at the end of the latest (default i). A reload is issued
at the start of the segment holding the earliest (in run order) window the plan names for it (default: the
segment after the boundary's own, or the head for the last segment's start); an nvme_read may be named
earlier than its h2d, so the read is staged in the host buffer before its h2d enters the FIFO h2d lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from lazytrain.plan.plan import Transfer
    from lazytrain.spec.cost import CostModel

LANES = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer", "collective")
STALL_LANES = ("h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
OPTIMIZER_MODES = ("overlap", "serial")
OFFLOADED = ("cpu", "nvme")
COMPUTE_KINDS = ("forward", "recompute", "backward", "head", "loss")


@dataclass(frozen=True)
class Shapes:
    """The bytes one step moves and holds (the executor's own, or a CostModel's)."""

    boundary_bytes: tuple[int, ...]  # A[i], i = 0..L
    param_bytes: tuple[int, ...]  # weights streamed per use of layer j (compute dtype) = its gradient bytes
    head_param_bytes: int  # final norm + LM head (the tied embedding for a tied head)
    working_bytes: tuple[int, ...]  # autograd working set of layer j during each of its computes
    head_working_bytes: int
    constant_bytes: int = 0  # rotary cos/sin, positions, attention masks of the step

    def __post_init__(self) -> None:
        L = len(self.param_bytes)
        if L < 1 or len(self.boundary_bytes) != L + 1 or len(self.working_bytes) != L:
            raise LazyTrainError(f"step shapes: need L >= 1 layers, L working sets and L+1 boundaries, got "
                                 f"{L}, {len(self.working_bytes)}, {len(self.boundary_bytes)}")

    @property
    def num_layers(self) -> int:
        return len(self.param_bytes)

    @property
    def slot_bytes(self) -> int:
        """One weight (or gradient) slot: the largest layer or the loss head."""
        return max(max(self.param_bytes), self.head_param_bytes)

    @classmethod
    def from_cost(cls, cost: CostModel) -> Shapes:
        L = cost.num_layers
        return cls(boundary_bytes=tuple(int(a) for a in cost.boundary_bytes[:L + 1]),
                   param_bytes=tuple(int(p) for p in cost.param_bytes[:L]),
                   head_param_bytes=int(cost.head_param_bytes),
                   working_bytes=tuple(int(w) for w in cost.working_bytes[:L]),
                   head_working_bytes=int(cost.head_working_bytes),
                   constant_bytes=int(cost.constant_device_bytes))


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
            return "H" if self.kind in ("head", "loss") else f"{self.kind[0].upper()}{self.target}"
        return f"{self.kind} {self.target}" if self.target >= 0 else self.kind


@dataclass(frozen=True)
class Action:
    """One step of the host thread: `verb` is issue / run / wait (an op) or alloc / free (a buffer's bytes)."""

    verb: str
    op: int = -1
    buffer: tuple[str, int] = ("", -1)  # (kind, index): weight_slots, grad_slots, boundary, grad, working, constants
    num_bytes: int = 0


@dataclass(frozen=True)
class StepProgram:
    tiers: tuple[str, ...]
    shapes: Shapes
    ops: tuple[Op, ...]
    actions: tuple[Action, ...]
    optimizer_mode: str
    uses: tuple[tuple[str, int], ...]  # weight use u -> (kind, layer); the head's layer is L

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


def weight_uses(tiers: tuple[str, ...], forward_only: bool = False) -> list[tuple[str, int]]:
    L = len(tiers) - 1
    uses = [("forward", j) for j in range(L)] + [("head", L)]
    if forward_only:
        return uses
    for s, e in reversed(segments_of(tiers)):
        uses += [("recompute", j) for j in range(s, e - 1)] + [("backward", j) for j in range(e - 1, s - 1, -1)]
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


def _windows(transfers: tuple[Transfer, ...], link: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for t in transfers:
        if t.link == link:
            out.setdefault(t.boundary, []).append(t.window)
    return out


def build_program(tiers: tuple[str, ...] | list[str], shapes: Shapes, *, transfers: tuple[Transfer, ...] = (),
                  optimizer_mode: str = "overlap", forward_only: bool = False) -> StepProgram:
    """The step program of `tiers` (L+1 entries) with `shapes`' bytes; see the module docstring.

    forward_only: evaluation -- the forward with every boundary freed once the next exists, then the loss head
    forward ("loss"); no gradients, no offloads."""
    tiers = tuple(tiers)
    L = len(tiers) - 1
    if shapes.num_layers != L:
        raise LazyTrainError(f"plan has {L} layers but the step shapes have {shapes.num_layers}")
    if optimizer_mode not in OPTIMIZER_MODES:
        raise LazyTrainError(f"optimizer_mode {optimizer_mode!r} is not one of {', '.join(OPTIMIZER_MODES)}")
    A, P, W = shapes.boundary_bytes, shapes.param_bytes, shapes.slot_bytes
    segments = segments_of(tiers)
    uses = weight_uses(tiers, forward_only)
    b = _Builder()
    if forward_only:
        return _forward_only(tiers, shapes, uses, b)

    # ---- where the plan puts each transfer ----------------------------------------------------------
    offloaded = [i for i in range(1, L) if tiers[i] in OFFLOADED]
    d2h_windows = _windows(transfers, "d2h")
    offload_at: dict[int, list[int]] = {}  # forward window -> boundaries whose d2h is issued before it
    free_after: dict[int, list[int]] = {}  # forward window -> offloaded boundaries freed after it
    for i in offloaded:
        named = [w for w in d2h_windows.get(i, []) if i <= w < L] or [i]
        offload_at.setdefault(min(named), []).append(i)
        free_after.setdefault(max(named), []).append(i)
    # backward points: len(segments) = the head, idx = the start of segment idx (run order: head, n-1, ..., 0)
    head_point = len(segments)
    seg_of_window = {w: idx for idx, (s, e) in enumerate(segments) for w in range(s, e)}
    seg_index = {s: idx for idx, (s, _) in enumerate(segments)}

    def point(windows: list[int], own: int) -> int:
        named = [head_point if w >= L else seg_of_window[w] for w in windows]
        return max(own, max(named)) if named else min(own + 1, head_point)

    h2d_windows, read_windows = _windows(transfers, "h2d"), _windows(transfers, "nvme_read")
    reloads_at: dict[int, list[tuple[str, int]]] = {}  # point -> [(link, boundary)] in issue order
    for i in offloaded:
        if i not in seg_index:  # an offloaded boundary always starts a segment
            raise LazyTrainError(f"boundary {i} is offloaded but no segment starts there")
        own = seg_index[i]
        h2d_point = point(h2d_windows.get(i, []), own)
        if tiers[i] == "nvme":
            # staged: the read goes into the host buffer a segment before its h2d enters the FIFO h2d lane, so a
            # read still in flight does not hold the weight prefetch queued behind the h2d
            read_point = max(point(read_windows.get(i, []), own), min(h2d_point + 1, head_point))
            reloads_at.setdefault(read_point, []).append(("nvme_read", i))
        reloads_at.setdefault(h2d_point, []).append(("h2d", i))

    # ---- helpers -------------------------------------------------------------------------------------
    weights: dict[int, int] = {}
    offload_d2h: dict[int, int] = {}
    host_ready: dict[int, int] = {}
    reads: dict[int, int] = {}
    reloaded: dict[int, list[int]] = {}
    pending: list[int] = []
    grad_d2h: list[int] = []

    def issue_weights(u: int) -> None:
        if u < len(uses) and u not in weights:
            kind, j = uses[u]
            nbytes = shapes.head_param_bytes if kind == "head" else P[j]
            weights[u] = b.issue("h2d", "weights", j, nbytes, use=u)

    def begin_use(u: int) -> None:
        issue_weights(u)
        issue_weights(u + 1)  # prefetch into the other slot, overlapping use u
        b.wait(weights.pop(u))

    def offload(i: int) -> None:
        d2h = b.issue("d2h", "offload", i, A[i])
        offload_d2h[i] = host_ready[i] = d2h
        if tiers[i] == "nvme":
            host_ready[i] = b.issue("nvme_write", "spill", i, A[i], after=(d2h,))
            pending.append(host_ready[i])

    def issue_reloads(at: int) -> None:
        for link, i in reloads_at.get(at, []):
            if link == "nvme_read":
                reads[i] = b.issue("nvme_read", "read", i, A[i], after=(host_ready[i],))
            else:
                b.alloc("boundary", i, A[i])  # the device buffer exists from the reload's issue
                after = reads.get(i, host_ready[i])
                reloaded[i] = [*([reads[i]] if i in reads else []), b.issue("h2d", "reload", i, A[i], after=(after,))]

    def send_grads(j: int, nbytes: int) -> None:
        d2h = b.issue("d2h", "grads", j, nbytes)
        grad_d2h.append(d2h)
        pending.append(d2h)
        pending.append(b.issue("optimizer", "land", j, after=(d2h,)))

    # ---- step start ----------------------------------------------------------------------------------
    b.alloc("weight_slots", -1, 2 * W)
    b.alloc("boundary", 0, A[0])
    upload0 = b.issue("h2d", "boundary0", 0, A[0])
    issue_weights(0)
    b.wait(upload0)
    b.alloc("constants", -1, shapes.constant_bytes)

    # ---- forward -------------------------------------------------------------------------------------
    for j in range(L):
        for i in offload_at.get(j, []):
            offload(i)
        begin_use(j)
        b.alloc("working", j, shapes.working_bytes[j])
        b.run("forward", j, j)
        b.alloc("boundary", j + 1, A[j + 1])
        b.free("working", j, shapes.working_bytes[j])
        if j > 0 and tiers[j] == "recompute":
            b.free("boundary", j, A[j])  # consumed by layer j, regenerated in the backward
        for i in free_after.get(j, []):
            b.wait(offload_d2h[i])  # an offloaded boundary leaves the device once its d2h is done
            b.free("boundary", i, A[i])

    # ---- loss head -----------------------------------------------------------------------------------
    u = L
    b.alloc("grad_slots", -1, 2 * W)
    issue_reloads(head_point)
    begin_use(u)
    b.alloc("working", L, shapes.head_working_bytes)
    b.alloc("grad", L, A[L])
    b.run("head", L, u)
    b.free("working", L, shapes.head_working_bytes)
    send_grads(L, shapes.head_param_bytes)
    u += 1

    # ---- backward ------------------------------------------------------------------------------------
    for idx in range(len(segments) - 1, -1, -1):
        s, e = segments[idx]
        issue_reloads(idx)
        for op in reloaded.pop(s, []):
            b.wait(op)
        for j in range(s, e - 1):  # regenerate boundaries s+1..e-1
            begin_use(u)
            b.alloc("working", j, shapes.working_bytes[j])
            b.run("recompute", j, u)
            b.alloc("boundary", j + 1, A[j + 1])
            b.free("working", j, shapes.working_bytes[j])
            u += 1
        for j in range(e - 1, s - 1, -1):
            begin_use(u)
            b.alloc("working", j, shapes.working_bytes[j])
            b.run("backward", j, u)
            b.alloc("grad", j, A[j])
            if len(grad_d2h) >= 2:
                b.wait(grad_d2h[-2])  # gradient slot of producer g-2 still draining
            b.free("working", j, shapes.working_bytes[j])
            send_grads(j, P[j])
            b.free("boundary", j + 1, A[j + 1])
            b.free("grad", j + 1, A[j + 1])
            u += 1

    # ---- end: embedding backward on the host, drain every lane -------------------------------------
    grad0 = b.issue("d2h", "grad0", 0, A[0])
    pending.append(b.issue("optimizer", "embedding", 0, after=(grad0,)))
    b.wait(grad0)
    b.free("grad", 0, A[0])
    b.free("boundary", 0, A[0])
    for op in pending:
        b.wait(op)
    b.free("constants", -1, shapes.constant_bytes)
    b.free("grad_slots", -1, 2 * W)
    b.free("weight_slots", -1, 2 * W)
    if optimizer_mode == "serial":  # MegaTrain: the whole optimizer step after the backward
        b.wait(b.issue("optimizer", "step"))
    return StepProgram(tiers=tiers, shapes=shapes, ops=tuple(b.ops), actions=tuple(b.actions),
                       optimizer_mode=optimizer_mode, uses=tuple(uses))


def program_for(plan_or_tiers: object, cost: CostModel, *, optimizer_mode: str = "overlap") -> StepProgram:
    """The program of a Plan (its tiers and transfer windows) or a bare tier list, with a CostModel's shapes."""
    tiers = getattr(plan_or_tiers, "tiers", plan_or_tiers)
    transfers = getattr(plan_or_tiers, "transfers", ())
    return build_program(tuple(tiers), Shapes.from_cost(cost), transfers=tuple(transfers),
                         optimizer_mode=optimizer_mode)


def _forward_only(tiers: tuple[str, ...], shapes: Shapes, uses: list[tuple[str, int]], b: _Builder) -> StepProgram:
    L, A, W = len(tiers) - 1, shapes.boundary_bytes, shapes.slot_bytes
    weights: dict[int, int] = {}

    def begin_use(u: int) -> None:
        for v in (u, u + 1):
            if v < len(uses) and v not in weights:
                nbytes = shapes.head_param_bytes if v == L else shapes.param_bytes[v]
                weights[v] = b.issue("h2d", "weights", uses[v][1], nbytes, use=v)
        b.wait(weights.pop(u))

    b.alloc("weight_slots", -1, 2 * W)
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
    b.free("boundary", L, A[L])
    b.free("constants", -1, shapes.constant_bytes)
    b.free("weight_slots", -1, 2 * W)
    return StepProgram(tiers=tiers, shapes=shapes, ops=tuple(b.ops), actions=tuple(b.actions),
                       optimizer_mode="overlap", uses=tuple(uses))
