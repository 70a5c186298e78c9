"""The ranks of a data-parallel run (torch.distributed), and every collective the trainer makes.

`torchrun --nproc_per_node N -m lazytrain train ...` starts N processes with RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT in the environment; `init_ranks` joins them into one process group (nccl on CUDA,
gloo on the emulated device) with a timeout on every collective. Without those variables, or with
WORLD_SIZE 1, it returns None and the run is exactly the single-process one.

Every collective the run makes is on host tensors (the gradients land on the host before they are summed, the
token counts, losses and objects are the host's), so every one goes through gloo groups made beside the default
group (`joined_ranks`), whatever its backend: on CUDA the host tensors never cross PCIe for nccl and back, and a
CUDA run's sums are the ones this machine tests. The default group (nccl on CUDA) is joined and carries nothing.

Every collective goes through `Ranks._collective`: a failure (a peer that died closes its sockets at once; a
peer that hangs trips the timeout) becomes one `RankLost` line naming the rank(s) that did not answer, found by
asking the rendezvous store which ranks are still alive. That line is the run's end: every later collective (the
lanes' queued gradient sums, the fence, a checkpoint's barrier) fails with it at once, never waiting nor calling
the roll again, so a hung rank is reported after one timeout whatever was queued behind the first.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from lazytrain.costmodel.topology import Topology
from lazytrain.errors import LazyTrainError

T = TypeVar("T")
ALIVE_WAIT_S = 3.0  # how long the survivors of a failed collective wait for each other's roll call


class RankLost(LazyTrainError):
    """A collective failed: a rank died, hung past the timeout or left."""


@dataclass
class NodeWeights:
    """This node's shared host mapping (distributed/shared.py's docstring): the weights, the bf16 streamed copies'
    regions, the fence's words."""

    mapping: torch.Tensor  # uint8, the whole file
    weights_bytes: int  # the weights and the streamed copies' regions; the fence's words follow
    copies: dict[str, int]  # executor group name -> byte offset of its compute-dtype streamed copy
    words: torch.Tensor  # int64: a counter per executor group, then each local rank's pid (`GroupFence`)


@dataclass
class Ranks:
    """This process's place in the run: its rank, the world, the node, and the collectives."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str  # the default group's (nccl on CUDA); every collective here runs on the gloo groups below
    timeout_s: float
    host_group: dist.ProcessGroup | None = None  # gloo, every rank (None: the default group, gloo in tests)
    node_group: dist.ProcessGroup | None = None  # gloo, this node's ranks (None: the host group)
    across_group: dist.ProcessGroup | None = None  # gloo, the same local rank on every node (None: one node)
    node_weights: NodeWeights | None = None  # the node's shared host mapping, once the model is in it (share_model)
    lost: str | None = None  # the first failed collective's line: every later one fails with it at once

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def topology(self) -> Topology:
        """The ranks and nodes as the planner sees them."""
        return Topology(world_size=self.world_size, nodes=self.world_size // self.local_world_size)

    @property
    def _node(self) -> dist.ProcessGroup | None:
        return self.node_group if self.node_group is not None else self.host_group

    # ---- collectives ------------------------------------------------------------------------------
    def all_reduce_sum(self, values: list[float], what: str) -> list[float]:
        """Sums of `values` over the ranks, in float64 (token counts and losses, exactly for ints < 2**53)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._collective(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.host_group))
        return t.tolist()

    def sum_to_owners(self, what: str, t: torch.Tensor, owner_local: int) -> bool:
        """Sum `t` over every rank into the owners, local rank `owner_local` of each node: a reduce in the node,
        then an all-reduce among the nodes' owners. Returns whether this rank is an owner: only there is `t` the
        sum (elsewhere the reduce may have used it as scratch)."""
        owner = self.rank - self.local_rank + owner_local
        if self.local_world_size > 1:
            self._collective(f"reduce of {what}", lambda: dist.reduce(t, dst=owner, op=dist.ReduceOp.SUM,
                                                                     group=self._node))
        if self.local_rank != owner_local:
            return False
        if self.across_group is not None:
            self._collective(f"all_reduce of {what} across nodes",
                             lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.across_group))
        return True

    def time_sums(self, numel: int, repeats: int = 5) -> tuple[float, float]:
        """Seconds of the two phases of `sum_to_owners` for an fp32 gradient of `numel` elements: the reduce to the
        owner in the node (0.0 with one rank per node) and the all-reduce among the nodes' owners (timed by local
        rank 0 of each node; 0.0 elsewhere and on one node), each the median of `repeats` after a warm-up, every
        run started together after a barrier. Every rank calls it; rank 0's figures become the planner's link
        rates (runtime/calibrate.py `calibrate_links`)."""
        t = torch.randn(numel, generator=torch.Generator().manual_seed(self.rank))
        node = across = None
        if self.local_world_size > 1:
            owner = self.rank - self.local_rank  # local rank 0's groups, as sum_to_owners reduces them
            node = lambda: dist.reduce(t, dst=owner, op=dist.ReduceOp.SUM, group=self._node)  # noqa: E731
        if self.across_group is not None and self.local_rank == 0:  # one owner's all-reduce at a time, as in a run
            across = lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.across_group)  # noqa: E731
        return self._median_s(node, self._node, repeats), self._median_s(across, self.across_group, repeats)

    def _median_s(self, phase: Callable[[], object] | None, group: dist.ProcessGroup | None, repeats: int) -> float:
        """Median seconds of `phase` among the ranks of `group`, each run after a barrier of them."""
        if phase is None:
            return 0.0
        samples = []
        for _ in range(repeats + 1):
            self._collective("timing the gradients' sums", lambda: dist.barrier(group=group))
            t0 = time.perf_counter()
            self._collective("timing the gradients' sums", phase)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])

    def gather_to_owners(self, what: str, tensors: list[torch.Tensor], owner_local: int
                         ) -> list[list[torch.Tensor]] | None:
        """Every rank's `tensors` (shaped alike on every rank), as one list per rank in rank order, on the owners
        (local rank `owner_local` of each node); None on the other ranks."""
        owner = self.rank - self.local_rank + owner_local
        mine = self.local_rank == owner_local
        nodes = self.world_size // self.local_world_size
        per_tensor = []
        for t in tensors:
            parts = [t]
            if self.local_world_size > 1:
                parts = [torch.empty_like(t) for _ in range(self.local_world_size)] if mine else []
                self._collective(f"gather of {what}", lambda t=t, parts=parts: dist.gather(
                    t, parts if mine else None, dst=owner, group=self._node))
            if mine and self.across_group is not None:
                node = torch.stack(parts)
                every = [torch.empty_like(node) for _ in range(nodes)]
                self._collective(f"all_gather of {what} across nodes",
                                 lambda every=every, node=node: dist.all_gather(every, node, group=self.across_group))
                parts = [p for n in every for p in n.unbind(0)]
            per_tensor.append(parts)
        return [list(one_rank) for one_rank in zip(*per_tensor, strict=True)] if mine else None

    def barrier(self, what: str) -> None:
        self._collective(what, lambda: dist.barrier(group=self.host_group))

    def broadcast_object(self, obj: T, what: str) -> T:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        self._collective(what, lambda: dist.broadcast_object_list(box, src=0, group=self.host_group))
        return box[0]

    def gather_to_main(self, obj: T, what: str) -> list[T] | None:
        """Every rank's `obj` on rank 0, in rank order (None on the others): what each owner alone knows."""
        box: list[T] | None = [obj] * self.world_size if self.is_main else None
        self._collective(what, lambda: dist.gather_object(obj, box, dst=0, group=self.host_group))
        return box

    def decided_by_main(self, decide: Callable[[], T], what: str) -> T:
        """`decide()` run on rank 0 alone and its result on every rank (one decision for the run: the batch, the
        plan); a LazyTrainError on rank 0 is raised on every rank with the same line."""
        result: T | None = None
        error: str | None = None
        if self.is_main:
            try:
                result = decide()
            except LazyTrainError as err:
                error = str(err)
        result, error = self.broadcast_object((result, error), what)
        if error is not None:
            raise LazyTrainError(error)
        return result  # type: ignore[return-value]

    def agree(self, ok: bool, what: str) -> bool:
        """True when every rank says ok (a min over the ranks): one rank's refusal stops them all."""
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        self._collective(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group))
        return bool(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- faults -----------------------------------------------------------------------------------
    def _collective(self, what: str, fn: Callable[[], object]) -> None:
        self.check_lost()
        try:
            fn()
        except RuntimeError as err:  # DistBackendError, gloo's connection errors and timeouts are RuntimeErrors
            if self.lost is None:  # (another thread's collective may have failed meanwhile: its line stands)
                lost = self.lost_ranks()
                who = (f"rank {', '.join(map(str, lost))}" if lost else "a rank") + " lost"
                first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
                self.lost = (f"{who} during {what} (rank {self.rank} of {self.world_size} stops; {first}); resume "
                             "from the last checkpoint with resume_from_checkpoint=auto")
            raise RankLost(self.lost) from None

    def check_lost(self) -> None:
        """RankLost with the first failure's line once a collective failed (what waits for the ranks calls it
        first: a queued collective would otherwise wait out the timeout again, one after another)."""
        if self.lost is not None:
            raise RankLost(self.lost)

    def lost_ranks(self) -> list[int]:
        """The ranks that do not answer a roll call on the rendezvous store within ALIVE_WAIT_S (every survivor
        of a failed collective calls it); [] when the store itself is gone (it lived on the lost rank)."""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"lazytrain/alive/{self.rank}", "1")
            keys = [f"lazytrain/alive/{r}" for r in range(self.world_size)]
            deadline = time.monotonic() + ALIVE_WAIT_S
            while time.monotonic() < deadline:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                if not missing:
                    return []
                time.sleep(0.1)
            return missing
        except (RuntimeError, ValueError):
            return []


def launched_world_size() -> int:
    """WORLD_SIZE as a launcher (torchrun) set it; 1 when run directly."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_local_world_size() -> int:
    """LOCAL_WORLD_SIZE (the ranks on this node) as a launcher set it; the world size when it set none."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(launched_world_size())))


def init_ranks(*, backend: str, timeout_s: float, cuda: bool) -> Ranks | None:
    """Join the process group torchrun described in the environment; None for a single process."""
    world = launched_world_size()
    if world == 1:
        return None
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise LazyTrainError("parallel backend nccl needs CUDA devices; use backend gloo (or auto) on the emulated "
                             "device")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    local_world = launched_local_world_size()
    if cuda:
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend=backend, timeout=timeout, rank=rank, world_size=world)
    except (RuntimeError, ValueError) as err:
        raise LazyTrainError(f"rank {rank} could not join the {world} ranks of the run within {timeout_s:g} s "
                             f"({str(err).strip().splitlines()[0][:160]}); check the torchrun flags") from None
    return joined_ranks(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                        backend=backend, timeout_s=timeout_s)


def joined_ranks(*, rank: int, world_size: int, local_rank: int, local_world_size: int, backend: str,
                timeout_s: float) -> Ranks:
    """This rank's `Ranks` on the joined default group (any backend): gloo groups of every rank, of each node and
    across the nodes, for every collective of the run (module docstring). Every rank makes every group
    (`new_group` is a collective)."""
    timeout = timedelta(seconds=timeout_s)
    host = dist.new_group(backend="gloo", timeout=timeout)
    node_group = across_group = None
    if world_size > local_world_size:
        nodes = [dist.new_group(list(range(n, n + local_world_size)), timeout=timeout, backend="gloo")
                 for n in range(0, world_size, local_world_size)]
        across = [dist.new_group(list(range(r, world_size, local_world_size)), timeout=timeout, backend="gloo")
                  for r in range(local_world_size)]
        node_group, across_group = nodes[rank // local_world_size], across[local_rank]
    return Ranks(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                 backend=backend, timeout_s=timeout_s, host_group=host, node_group=node_group,
                 across_group=across_group)
