"""Simulator: replay a Plan on a CostModel as concurrent FIFO streams; predict step time, stalls and memory peaks.

The step schedule is the shared one (Contract 2; docs/cost_model.md) exactly as the executor runs it
(`lazytrain.runtime.executor`): one host thread drives the *compute* stream and issues copies and jobs to
five FIFO streams — h2d, d2h, nvme_read, nvme_write and the CPU *optimizer*. A stream runs its jobs in
the order they were issued; a job whose `after` dependencies are not done blocks its stream (head-of-line,
like a CUDA stream waiting on an event or the emulated device's link thread). Compute blocks only where
the program waits on an event, and the seconds it waits are charged to that event's stream ("exposed").
Because every job is issued in program order at the host thread's current time, one pass in program order
computes every start and end exactly (no event queue is needed).

Program (u indexes weight uses: forward 0..L-1, head, then per segment (s, e) last to first: recompute
s..e-2, backward e-1..s; use u streams into weight slot u % 2):
  start     allocate 2 weight slots and boundary 0; h2d boundary 0; h2d weights of use 0; wait for
            boundary 0; allocate the constants (rotary tables, positions).
  use u     issue h2d of use u+1's weights (its slot was freed by use u-1), wait for use u's weights.
  forward   F_j: reserve working set, compute, boundary j+1 appears, release working set; if boundary j is
            not gpu (j > 0): wait for its d2h (if offloaded), free it; if boundary j+1 is cpu/nvme: d2h it
            (nvme: then nvme_write after the d2h).
  head      allocate 2 gradient slots; reload the last segment's start boundary; use; reserve the head
            working set, allocate the gradient of boundary L, compute (forward + backward, chunked); d2h the
            head's gradients into the host staging, then an optimizer-stream job that adds them into .grad.
  backward  per segment (s, e), last first: reload the previous segment's start boundary (nvme_read after
            its write, then h2d; or h2d after its d2h), wait for boundary s's reload; R_s..R_{e-2}: use,
            reserve, compute, boundary j+1 appears, release; B_{e-1}..B_s: use, reserve, compute, the
            gradient of boundary j appears, wait for the d2h of gradient producer g-2 (two gradient slots),
            release, d2h the weight gradients + an optimizer-stream job adding them into .grad, free boundary
            j+1 and its gradient.
  end       d2h the gradient of boundary 0, an optimizer-stream job for the embedding backward, wait for that
            d2h, free boundary 0 and its gradient; wait for every issued job (forward_backward returns:
            `forward_backward_s`); mode "serial": then the optimizer step of all parameters on the host
            thread (MegaTrain's code). Mode "overlap": each optimizer-stream job also runs that group's
            optimizer step, as soon as the group's gradients are in (the executor's optimizer hook; a tied
            head's group completes at the embedding backward; clipping off, or computed without holding the
            steps). The next step's forward never overlaps this one.

Memory. Device bytes change at the program points above, in program order, so the device peak does not
depend on link speeds and equals the executor's arena accounting (`predict_device_peak`). Host: the static
host bytes plus every cpu-tier buffer (from its d2h issue) and nvme staging buffer, held to the end of the
step (the executor recycles them across steps). NVMe: each spill file from its write start to step end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan, Prediction
from lazytrain.spec.cost import CostModel

STREAMS = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer")
STALL_STREAMS = STREAMS[1:]
OPTIMIZER_MODES = ("overlap", "serial")
OFFLOADED = ("cpu", "nvme")


@dataclass(frozen=True)
class Event:
    """One operation of the timeline: stream, label, start and end seconds, bytes moved (0 for compute)."""

    stream: str
    name: str
    start: float
    end: float
    num_bytes: int = 0


@dataclass(frozen=True)
class SimResult:
    step_s: float  # forward_backward plus, in serial mode, the optimizer step
    forward_backward_s: float  # until every gradient and optimizer-stream job is done (the executor's wall_s)
    compute_s: float  # busy time of the compute stream
    tflops: float  # 6 * N * batch * seq / step_s / 1e12 (MegaTrain convention)
    tokens_per_s: float
    exposed_s: dict[str, float]  # seconds compute waited on each stream; compute_s + sum = step_s
    busy_s: dict[str, float]  # busy seconds per stream
    peak_bytes: dict[str, int]  # "gpu", "cpu" (static host + activation buffers), "nvme"
    memory_trace: dict[str, list[tuple[float, int]]]  # per tier: (seconds, bytes in use after the change)
    events: tuple[Event, ...]
    optimizer_mode: str
    host_activation_bytes: int = 0  # peak bytes of cpu-tier buffers (the executor's peak_host_activation_bytes)

    def to_prediction(self) -> Prediction:
        return Prediction(step_s=self.step_s, tflops=self.tflops, tokens_per_s=self.tokens_per_s,
                          peak_bytes=dict(self.peak_bytes), exposed_s=dict(self.exposed_s))

    def summary(self) -> str:
        stalls = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.exposed_s.items() if v > 0) or "none"
        return (f"step {self.step_s:.3f} s, {self.tflops:.1f} TFLOPS, {self.tokens_per_s:.0f} tok/s, "
                f"peak gpu {self.peak_bytes['gpu'] / 2**30:.2f} GiB; exposed: {stalls}")


@dataclass(eq=False)
class _Job:
    stream: str
    name: str
    start: float
    end: float
    num_bytes: int = 0


@dataclass
class _Replay:
    """The host thread's clock, each stream's FIFO tail, the jobs, and the memory levels."""

    now: float = 0.0
    free_at: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0.0))
    jobs: list[_Job] = field(default_factory=list)
    exposed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STALL_STREAMS, 0.0))
    level: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0, "nvme": 0})
    peak: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0, "nvme": 0})
    trace: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: {"gpu": [], "cpu": [], "nvme": []})

    def issue(self, stream: str, name: str, seconds: float, num_bytes: int = 0,
              after: tuple[_Job | None, ...] = ()) -> _Job:
        """Enqueue a job now; it starts when its stream is free and its `after` jobs are done."""
        start = max([self.now, self.free_at[stream]] + [a.end for a in after if a is not None])
        job = _Job(stream, name, start, start + seconds, num_bytes)
        self.free_at[stream] = job.end
        self.jobs.append(job)
        return job

    def wait(self, job: _Job | None) -> None:
        """The host thread blocks on `job`; the seconds blocked are `job.stream`'s exposed time."""
        if job is not None and job.end > self.now:
            self.exposed[job.stream] += job.end - self.now
            self.now = job.end

    def compute(self, name: str, seconds: float) -> None:
        self.jobs.append(_Job("compute", name, self.now, self.now + seconds))
        self.now += seconds
        self.free_at["compute"] = self.now

    def mem(self, tier: str, delta: int, at: float | None = None) -> None:
        self.level[tier] += delta
        self.peak[tier] = max(self.peak[tier], self.level[tier])
        self.trace[tier].append((self.now if at is None else at, self.level[tier]))


def _seconds(num_bytes: float, bytes_per_s: float) -> float:
    return 0.0 if num_bytes == 0 else num_bytes / bytes_per_s  # inf rate -> 0.0


def simulate(plan: Plan, cost: CostModel, *, optimizer_mode: str = "overlap") -> SimResult:
    """Replay `plan` on `cost`; see the module docstring for the exact program and memory accounting."""
    if optimizer_mode not in OPTIMIZER_MODES:
        raise LazyTrainError(f"optimizer_mode {optimizer_mode!r} is not one of {', '.join(OPTIMIZER_MODES)}")
    L = cost.num_layers
    if plan.num_layers != L:
        raise LazyTrainError(f"plan has {plan.num_layers} layers but the cost model has {L}")
    c, tiers, segments = cost, plan.tiers, plan.segments()
    A, W = c.boundary_bytes, c.slot_bytes
    overlap = optimizer_mode == "overlap"
    r = _Replay()
    pending: list[_Job] = []  # every job the step waits for before returning, in issue order

    uses: list[tuple[str, int]] = [("F", j) for j in range(L)] + [("H", L)]
    for s, e in reversed(segments):
        uses += [("R", j) for j in range(s, e - 1)] + [("B", j) for j in range(e - 1, s - 1, -1)]
    weights: dict[int, _Job] = {}

    def issue_weights(u: int) -> None:
        if u < len(uses) and u not in weights:
            kind, j = uses[u]
            nbytes = c.head_param_bytes if kind == "H" else c.param_bytes[j]
            label = "head" if kind == "H" else f"{kind}{j}"
            weights[u] = r.issue("h2d", f"weights {label}", _seconds(nbytes, c.h2d_bytes_per_s), nbytes)

    def begin_use(u: int) -> None:
        issue_weights(u)
        issue_weights(u + 1)  # prefetch into the other slot, overlapping use u
        r.wait(weights.pop(u))

    offload_d2h: dict[int, _Job] = {}
    host_ready: dict[int, _Job] = {}
    reloads: dict[int, tuple[_Job, ...]] = {}
    host_activation = 0

    def offload(i: int) -> None:
        nonlocal host_activation
        d2h = r.issue("d2h", f"offload {i}", _seconds(A[i], c.d2h_bytes_per_s), A[i])
        offload_d2h[i] = d2h
        r.mem("cpu", A[i])  # the host buffer: cpu-tier store or nvme staging, recycled across steps
        if tiers[i] == "cpu":
            host_ready[i] = d2h
            host_activation += A[i]
        else:
            write = r.issue("nvme_write", f"spill {i}", _seconds(A[i], c.nvme_write_bytes_per_s), A[i], after=(d2h,))
            r.mem("nvme", A[i], at=write.start)
            host_ready[i] = write
            pending.append(write)

    def reload(i: int) -> None:
        if tiers[i] not in OFFLOADED or i in reloads:
            return
        after = host_ready[i]
        jobs: tuple[_Job, ...] = ()
        if tiers[i] == "nvme":
            read = r.issue("nvme_read", f"read {i}", _seconds(A[i], c.nvme_read_bytes_per_s), A[i], after=(after,))
            jobs, after = (read,), read
        r.mem("gpu", A[i])  # the device buffer is allocated when the reload is issued
        jobs += (r.issue("h2d", f"reload {i}", _seconds(A[i], c.h2d_bytes_per_s), A[i], after=(after,)),)
        reloads[i] = jobs

    def send_grads(name: str, nbytes: int, host_s: float) -> _Job:
        d2h = r.issue("d2h", f"grads {name}", _seconds(nbytes, c.d2h_bytes_per_s), nbytes)
        pending.append(d2h)
        pending.append(r.issue("optimizer", f"land {name}", host_s, after=(d2h,)))
        return d2h

    # ---- step start -------------------------------------------------------------------------------
    r.mem("cpu", c.static_host_bytes())
    r.mem("gpu", 2 * W)  # weight slots
    r.mem("gpu", A[0])  # boundary 0
    upload0 = r.issue("h2d", "boundary 0", _seconds(A[0], c.h2d_bytes_per_s), A[0])
    issue_weights(0)
    r.wait(upload0)
    r.mem("gpu", c.constant_device_bytes)

    # ---- forward ----------------------------------------------------------------------------------
    u = 0
    for j in range(L):
        begin_use(u)
        r.mem("gpu", c.working_bytes[j])
        r.compute(f"F{j}", c.forward_s[j])
        r.mem("gpu", A[j + 1])
        r.mem("gpu", -c.working_bytes[j])
        if j > 0 and tiers[j] != "gpu":
            r.wait(offload_d2h.get(j))  # an offloaded boundary leaves the device once its d2h is done
            r.mem("gpu", -A[j])
        if tiers[j + 1] in OFFLOADED:
            offload(j + 1)
        u += 1

    # ---- loss head --------------------------------------------------------------------------------
    r.mem("gpu", 2 * W)  # gradient slots
    reload(segments[-1][0])
    begin_use(u)
    r.mem("gpu", c.head_working_bytes)
    r.mem("gpu", A[L])  # gradient of boundary L
    r.compute("H", c.head_s)
    r.mem("gpu", -c.head_working_bytes)
    # a tied head's group (final norm + the shared embedding weight) completes only at the embedding backward
    tied = c.spec.tie_word_embeddings
    head_step = c.head_optimizer_s if overlap and not tied else 0.0
    grad_d2h = [send_grads("head", c.head_grad_bytes, c.head_accumulate_s + head_step)]
    u += 1

    # ---- backward ---------------------------------------------------------------------------------
    for idx in range(len(segments) - 1, -1, -1):
        s, e = segments[idx]
        if idx > 0:
            reload(segments[idx - 1][0])  # one segment ahead
        for job in reloads.pop(s, ()):
            r.wait(job)
        for j in range(s, e - 1):  # regenerate boundaries s+1..e-1
            begin_use(u)
            r.mem("gpu", c.working_bytes[j])
            r.compute(f"R{j}", c.forward_s[j])
            r.mem("gpu", A[j + 1])
            r.mem("gpu", -c.working_bytes[j])
            u += 1
        for j in range(e - 1, s - 1, -1):
            begin_use(u)
            r.mem("gpu", c.working_bytes[j])
            r.compute(f"B{j}", c.backward_s[j])
            r.mem("gpu", A[j])  # gradient of boundary j
            if len(grad_d2h) >= 2:
                r.wait(grad_d2h[-2])  # gradient slot of producer g-2 still draining
            r.mem("gpu", -c.working_bytes[j])
            host_s = c.accumulate_s[j] + (c.optimizer_s[j] if overlap else 0.0)
            grad_d2h.append(send_grads(f"B{j}", c.grad_bytes[j], host_s))
            r.mem("gpu", -2 * A[j + 1])  # boundary j+1 and its gradient
            u += 1

    # ---- end: embedding backward on the host, drain every stream ----------------------------------
    grad0 = r.issue("d2h", "grad boundary 0", _seconds(A[0], c.d2h_bytes_per_s), A[0])
    embedding_step = (c.embedding_optimizer_s + (c.head_optimizer_s if tied else 0.0)) if overlap else 0.0
    pending.append(r.issue("optimizer", "embedding backward", c.embedding_accumulate_s + embedding_step,
                           after=(grad0,)))
    r.wait(grad0)
    r.mem("gpu", -2 * A[0])  # boundary 0 and its gradient
    for job in pending:
        r.wait(job)
    r.mem("gpu", -(4 * W + c.constant_device_bytes))
    forward_backward_s = r.now
    if not overlap:  # MegaTrain: the whole optimizer step after backward, nothing overlapping it
        start = r.now
        r.now += c.total_optimizer_s
        r.exposed["optimizer"] += c.total_optimizer_s
        r.jobs.append(_Job("optimizer", "optimizer step", start, r.now))
    step_s = r.now

    busy = dict.fromkeys(STREAMS, 0.0)
    for job in r.jobs:
        busy[job.stream] += job.end - job.start
    events = tuple(Event(j.stream, j.name, j.start, j.end, j.num_bytes) for j in sorted(r.jobs, key=lambda j: j.start))
    return SimResult(step_s=step_s, forward_backward_s=forward_backward_s, compute_s=busy["compute"],
                     tflops=c.tflops(step_s), tokens_per_s=c.tokens_per_s(step_s), exposed_s=dict(r.exposed),
                     busy_s=busy, peak_bytes=dict(r.peak), memory_trace=r.trace, events=events,
                     optimizer_mode=optimizer_mode, host_activation_bytes=host_activation)
