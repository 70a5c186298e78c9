"""Simulator: time the step program (plan/schedule.py, Contract 2) on a CostModel; predict step time, stalls, peaks.

The program is the executor's: one host thread runs the compute ops and issues jobs to five FIFO lanes -- h2d,
d2h, nvme_read, nvme_write and the host *optimizer* lane. A lane runs its jobs in the order they were issued;
a job whose `after` ops are not done blocks its lane (head-of-line, like a CUDA stream waiting on an event or
the emulated device's link thread). Compute blocks only at the program's waits, and the seconds it waits are
charged to the awaited op's lane ("exposed"). Every job is issued in program order at the host thread's
current time, so one pass over the actions computes every start and end exactly (no event queue is needed).
Op seconds: compute from the CostModel's per-layer times; link ops bytes / rate; host jobs the gradient
accumulation ("land", "embedding"), one group's optimizer update ("update j", `update_seconds`; overlap mode,
at the step's start, fenced before group j's forward weight h2d) and the whole serial step ("step",
`total_optimizer_s`, after the backward; MegaTrain's code).

What is modelled of the overlapped-exact optimizer: the steady state (step k's program carries step k-1's
updates), the first group's update exposed before the first h2d, each later group's exposure where its update
has not ended when the forward needs it, and host memory-bandwidth contention with gradient accumulation as
lane serialization (updates and accumulations share the one FIFO optimizer lane). Not modelled: updates slowing
the compute thread or the links through shared memory bandwidth or cores (on the emulated device they share
the CPU), and the bf16 copy refresh as its own cost (it is part of the measured update).

With the optimizer's state on NVMe (optimizer_offload nvme, the program's staging_depth D >= 1) each group's
"state_read" and "state_write" are link ops of the nvme_read / nvme_write lanes, queued FIFO with the activations'
spills and reads, their bytes over the state files' rates on those links (a group's whole file in large aligned
requests, where a spill is one small file: the emulated device's calibration measures the two apart); a later
group's update waits for its read (`after`). The static host bytes then hold no optimizer state, and the program's
host_alloc of the D staging slots counts them.

A program built for several ranks (costmodel/topology.py) sums each group's gradient over the ranks on the optimizer
lane ("reduce j" before "land j", "gather" before the embedding backward), its seconds the topology's bytes over
the hardware's intra-/inter-node rates; every rank runs the same program, so one rank's timeline is the step's.

Memory. Device bytes change at the program's alloc/free actions, so the device peak does not depend on link
speeds and equals `StepProgram.device_peak_bytes` and the executor's arena. Host: the static host bytes plus
every cpu-tier buffer (from its d2h issue) and nvme staging buffer, held to the end of the step (the executor
recycles them across steps) and the staging slots (host_alloc/host_free). NVMe: the optimizer's state files
(optimizer_offload nvme) for the whole step, and each spill file from its write start to step end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import LINKS
from lazytrain.costmodel.topology import ONE_RANK, Topology
from lazytrain.errors import LazyTrainError
from lazytrain.plan.plan import Plan, Prediction
from lazytrain.plan.schedule import LANES, OPTIMIZER_MODES, STALL_LANES, Op, StepProgram, program_for


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
    link_bytes: dict[str, int] = field(default_factory=dict)  # bytes per step on each lane but compute

    def to_prediction(self) -> Prediction:
        return Prediction(step_s=self.step_s, tflops=self.tflops, tokens_per_s=self.tokens_per_s,
                          peak_bytes=dict(self.peak_bytes), exposed_s=dict(self.exposed_s),
                          simulated_step_s=self.step_s)

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
    free_at: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LANES, 0.0))
    jobs: list[_Job] = field(default_factory=list)
    exposed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STALL_LANES, 0.0))
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


def op_seconds(op: Op, cost: CostModel, topology: Topology = ONE_RANK) -> float:
    """Seconds of one program op on `cost` (link ops: bytes over the link rate, a state file's over the state
    files' rate; host ops: gradient accumulation, one group's optimizer update, the whole serial step, or with
    ranks a group's sum over them)."""
    c, k, j = cost, op.kind, op.target
    if k in ("reduce", "gather"):
        return topology.collective_s(op.num_bytes, c.hardware, k)
    if op.lane == "compute":
        return compute_seconds(k, j, c.forward_s, c.backward_s, c.head_s)
    if k in STATE_RATES:  # a state file on its NVMe lane, at the state files' rate
        return _seconds(op.num_bytes, getattr(c, STATE_RATES[k]))
    if op.lane in RATES:
        return _seconds(op.num_bytes, getattr(c, RATES[op.lane]))
    if k == "land":
        return c.head_accumulate_s if j == c.num_layers else c.accumulate_s[j]
    if k == "embedding":
        return c.embedding_accumulate_s
    if k == "update":
        return update_seconds(cost)[j + 1]
    if k == "step":
        return c.total_optimizer_s
    raise LazyTrainError(f"the simulator has no time for op {op.name!r} on lane {op.lane!r}")


def compute_seconds(kind: str, layer: int, forward_s: Sequence[float], backward_s: Sequence[float],
                    head_s: float) -> float:
    """Seconds of a compute op: a forward or recompute rho[j] (a kept layer's forward with autograd too), a backward
    beta[j] (autograd re-forward + backward), a kept layer's backward through its graph beta[j] - rho[j], the head."""
    if kind == "head":
        return head_s
    if kind == "backprop":
        return max(0.0, backward_s[layer] - forward_s[layer])
    return (backward_s if kind == "backward" else forward_s)[layer]


def update_seconds(cost: CostModel) -> tuple[float, ...]:
    """Seconds of op "update j" at index j + 1: the embedding (0 when tied), layers 0..L-1, the head (with the
    tied embedding: that group owns it)."""
    tied = cost.spec.tie_word_embeddings
    head = cost.head_optimizer_s + (cost.embedding_optimizer_s if tied else 0.0)
    return (0.0 if tied else cost.embedding_optimizer_s, *cost.optimizer_s[:cost.num_layers], head)


RATES = {link: f"{link}_bytes_per_s" for link in LINKS}  # the CostModel's (and PlanningInstance's) rate fields
# the optimizer's state files on the NVMe lanes (CostModel: HardwareSpec.nvme_state_*_gbps, else the link's)
STATE_RATES = {"state_read": "state_read_bytes_per_s", "state_write": "state_write_bytes_per_s"}


def simulate(plan: Plan | StepProgram, cost: CostModel, *, optimizer_mode: str = "overlap",
             topology: Topology = ONE_RANK) -> SimResult:
    """Time the step program of `plan` (or a program, which carries its own topology) on `cost` for one rank of
    `topology`; see the module docstring."""
    if optimizer_mode not in OPTIMIZER_MODES:
        raise LazyTrainError(f"optimizer_mode {optimizer_mode!r} is not one of {', '.join(OPTIMIZER_MODES)}")
    if isinstance(plan, StepProgram):
        program = plan
    else:
        if plan.num_layers != cost.num_layers:
            raise LazyTrainError(f"plan has {plan.num_layers} layers but the cost model has {cost.num_layers}")
        program = program_for(plan, cost, optimizer_mode=optimizer_mode, topology=topology)
    r, forward_backward_s, host_activation = _replay(program, lambda op: op_seconds(op, cost, program.topology),
                                                     cost.static_host_bytes(), cost.nvme_state_bytes())
    step_s = r.now
    busy = dict.fromkeys(LANES, 0.0)
    link_bytes = dict.fromkeys(STALL_LANES, 0)
    for job in r.jobs:
        busy[job.stream] += job.end - job.start
        if job.stream != "compute":
            link_bytes[job.stream] += job.num_bytes
    events = tuple(Event(j.stream, j.name, j.start, j.end, j.num_bytes) for j in sorted(r.jobs, key=lambda j: j.start))
    return SimResult(step_s=step_s, forward_backward_s=forward_backward_s, compute_s=busy["compute"],
                     tflops=cost.tflops(step_s), tokens_per_s=cost.tokens_per_s(step_s), exposed_s=dict(r.exposed),
                     busy_s=busy, peak_bytes=dict(r.peak), memory_trace=r.trace, events=events,
                     optimizer_mode=program.optimizer_mode, host_activation_bytes=host_activation,
                     link_bytes=link_bytes)


def step_seconds(program: StepProgram, seconds_of: Callable[[Op], float]) -> tuple[float, dict[str, float]]:
    """The step seconds and per-lane exposed seconds of `program` with op times from `seconds_of` (the same
    replay as `simulate`; the planner's tests time programs of plain-number instances with it)."""
    r, _, _ = _replay(program, seconds_of, 0)
    return r.now, dict(r.exposed)


def _replay(program: StepProgram, seconds_of: Callable[[Op], float], static_host_bytes: int,
            static_nvme_bytes: int = 0) -> tuple[_Replay, float, int]:
    """One pass over the program's actions: (the replay, the forward_backward seconds, host activation bytes)."""
    r = _Replay()
    jobs: dict[int, _Job] = {}
    host_activation = 0
    r.mem("cpu", static_host_bytes)
    if static_nvme_bytes:
        r.mem("nvme", static_nvme_bytes)
    forward_backward_s = None
    for action in program.actions:
        if action.verb == "alloc":
            r.mem("gpu", action.num_bytes)
        elif action.verb == "free":
            r.mem("gpu", -action.num_bytes)
        elif action.verb == "host_alloc":  # a staging slot (optimizer_offload nvme)
            r.mem("cpu", action.num_bytes)
        elif action.verb == "host_free":
            r.mem("cpu", -action.num_bytes)
        elif action.verb == "run":
            op = program.ops[action.op]
            r.compute(op.name, seconds_of(op))
        elif action.verb == "wait":
            r.wait(jobs[action.op])
        else:
            op = program.ops[action.op]
            if forward_backward_s is None and (op.kind == "step" or op.kind == "update"
                                               and program.optimizer_mode == "serial"):
                forward_backward_s = r.now  # the serial optimizer step starts: the executor's wall_s ends
            job = r.issue(op.lane, op.name, seconds_of(op), op.num_bytes, after=tuple(jobs[a] for a in op.after))
            jobs[op.index] = job
            if op.kind == "offload":  # the host buffer: cpu-tier store or nvme staging, recycled across steps
                r.mem("cpu", op.num_bytes)
                if program.tiers[op.target] == "cpu":
                    host_activation += op.num_bytes
            elif op.kind == "spill":
                r.mem("nvme", op.num_bytes, at=job.start)
    return r, r.now if forward_backward_s is None else forward_backward_s, host_activation
