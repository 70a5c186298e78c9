"""One host copy of the model per node, and the host optimizer sharded over the node's ranks (docs/parallel.md).

Weights (`share_model`, at start-up). Local rank 0 of each node alone loads the model (or builds its seeded
random init); it moves every parameter, one at a time, into one new file in /dev/shm, laid out as the executor
streams them: each layer group's parameters packed in one region where they are what streams (fp32 compute, or
bf16 master weights), every other parameter on its own (the untied embedding; with bf16 compute and fp32 masters
every master weight, each streamed group then getting a region for its bf16 copy). The other local ranks build
the model on the meta device only, map the file (MAP_SHARED) once it is written and make every parameter a view
of it; after a barrier the file is unlinked, so nothing outlives the run (the mappings stay valid until the
processes end). So a node holds the weights once from the start, and the executors' groups find their
parameters already packed (`WeightGroup`: no copy). At `attach_executor` (`share_streamed_copies`) local rank
0 writes its bf16 streamed copies into their regions and every rank adopts them; from then on a group's copy is
refreshed from the masters by the group's owner alone, right after its update and before the fence lets another
rank stream it (`OptimizerShard.refresh`); no rank re-packs it at the start of a step as one process does. The
end of the mapping holds the fence's words (`GroupFence`).

Optimizer. Executor group i (the untied embedding, layer 0..L-1, the head) belongs to local rank
i % local ranks. Its gradient is summed into its owners as it lands (distributed/grads.py), and the global norm
is the sum of the owners' squared norms (`norm_share`), so clipping and the non-finite check are the single
process's; a rank updates (and torch's AdamW creates states for) its own groups only, in the shared weights.
Ranks of the same local rank on different nodes own the same groups and step them alike on their nodes' copies.
The fence that keeps a rank from streaming a group before its owner
updated it:
  serial  a barrier after the step: no rank starts the next forward before every group's update is in.
  overlap (`GroupFence`) the owner of group i runs its update on its optimizer lane at the start of the next
          step, refreshes the group's shared bf16 streamed copy (bf16 compute) and then publishes the update's
          number in a per-group counter in the node's shared mapping; every other rank's optimizer lane, at the
          same place in its program (before group i's forward weight h2d), waits until the counter reaches that
          number. The wait polls; it names the owner as lost at once when its process is gone, or after
          `collective_timeout_s`.

Checkpoints (train/checkpoint.py): each rank of node 0 writes its own optimizer states into the checkpoint, beside
rank 0's export and trainer state; resuming, each rank reads its own (no rank ever holds another's states).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numba
import torch
from llvmlite import ir as llvm_ir
from numba import types
from numba.extending import intrinsic

from lazytrain.distributed.ranks import NodeWeights, RankLost
from lazytrain.errors import LazyTrainError
from lazytrain.runtime.hf import find_parts, head_named_params
from lazytrain.runtime.store import ALIGN_BYTES
from lazytrain.runtime.weights import init_buffers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lazytrain.distributed.ranks import Ranks
    from lazytrain.runtime.executor import Executor, GroupUpdate
    from lazytrain.runtime.store import WeightGroup

SHM_DIR = Path("/dev/shm")
KEPT_STATE = ("step", "eightbit")  # per-parameter entries a rank keeps for groups it does not own
FENCE_POLL_S = 0.0002  # how often a rank waiting at the fence reads its group's counter
ALIVE_CHECK_S = 1.0  # how often it checks that the group's owner still runs (and the timeout)


def share_model(ranks: Ranks, model: PreTrainedModel, compute_dtype: torch.dtype) -> NodeWeights:
    """Put `model`'s parameters in this node's shared mapping (module docstring): on local rank 0 the loaded ones
    are moved there one at a time; on every other local rank `model` is on the meta device and its parameters
    become views of the mapping (its buffers are computed, as loading does)."""
    places, copies, weights_bytes, words = _layout(model, compute_dtype, ranks.local_world_size)
    total = weights_bytes + _aligned(8 * words)
    if not SHM_DIR.is_dir():
        raise LazyTrainError(f"data parallelism shares the weights of a node's ranks through {SHM_DIR}, which this "
                             "machine does not have; run one rank per node")
    token = ranks.broadcast_object(secrets.token_hex(6) if ranks.is_main else None, "the shared weights' name")
    path = SHM_DIR / f"lazytrain-{token}-node{ranks.rank // ranks.local_world_size}.weights"
    params = list(model.parameters())  # (a tied parameter once)
    try:
        if ranks.local_rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, total)
            except OSError as err:
                raise LazyTrainError(f"cannot make {total / 2**30:.2f} GiB of shared memory in {SHM_DIR} "
                                     f"({err.strerror}); free /dev/shm or raise its size") from None
            finally:
                os.close(fd)
            mapping = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
            with torch.no_grad():
                for p in params:  # one at a time: the private copy shrinks as the shared one grows
                    p.data = _view(mapping, places[id(p)], p.data).copy_(p.data)
        else:
            for p in params:
                p._is_hf_initialized = True  # (loaded: the model's init computes the buffers alone)
            init_buffers(model)  # (with meta parameters: nothing of the shared weights is written)
        ranks.barrier("loading the node's shared weights")
        if ranks.local_rank != 0:  # a meta parameter cannot take host data: each becomes a new one, everywhere
            mapping = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
            mapped = {id(p): torch.nn.Parameter(_view(mapping, places[id(p)], p), requires_grad=p.requires_grad)
                      for p in params}
            for module in model.modules():
                for attr, p in module._parameters.items():
                    if p is not None:
                        module._parameters[attr] = mapped[id(p)]
        ranks.barrier("the shared weights mapped")
    finally:  # every rank has it mapped (or the run stops): the file goes, the mappings stay
        if ranks.local_rank == 0:
            path.unlink(missing_ok=True)
    return NodeWeights(mapping=mapping, weights_bytes=weights_bytes, copies=copies,
                       words=mapping[weights_bytes:weights_bytes + 8 * words].view(torch.int64))


def _layout(model: PreTrainedModel, compute_dtype: torch.dtype, local_ranks: int
            ) -> tuple[dict[int, int], dict[str, int], int, int]:
    """Where each parameter (by id) and each streamed copy (by group name) lies in the node's mapping, in bytes,
    the weights' bytes, and the fence's words: the executor's groups (layer 0..L-1, the head) in order, each
    packed as `WeightGroup` packs it where its parameters are what streams, else a region for its copy; then
    every other parameter. The same on every rank (from the model's structure: a meta model gives it too)."""
    parts = find_parts(model)
    groups = [(f"layer.{j}", [p for _, p in layer.named_parameters()]) for j, layer in enumerate(parts.layers)]
    groups.append(("head", [p for _, p in head_named_params(parts)]))
    places: dict[int, int] = {}
    copies: dict[str, int] = {}
    total = 0
    for name, params in groups:
        if all(p.dtype == compute_dtype for p in params):  # packed densely from a 4 KiB boundary
            for p in params:
                places[id(p)] = total
                total += _nbytes(p)
            total = _aligned(total)
        else:
            copies[name] = total
            total += _aligned(sum(p.numel() for p in params) * compute_dtype.itemsize)
    for p in model.parameters():
        if id(p) not in places:
            places[id(p)] = total
            total += _aligned(_nbytes(p))
    num_groups = len(groups) + (0 if parts.tied else 1)  # (an untied embedding is an optimizer group too)
    return places, copies, total, num_groups + local_ranks


def share_streamed_copies(ranks: Ranks, executor: Executor) -> tuple[int, torch.Tensor]:
    """The executor's bf16 streamed copies (bf16 compute, fp32 masters) into their regions of the node's mapping
    (`share_model` made it): local rank 0 writes its own, every rank adopts them and frees its private ones.
    Returns the mapping's weight bytes and the fence's words, this rank's pid written in them."""
    node = ranks.node_weights
    if node is None:
        raise LazyTrainError("data parallelism: the model was not loaded into the node's shared memory "
                             "(build it with build_model(..., ranks=ranks))")
    copied = [g for g in [*executor.layer_groups, executor.head_group] if g.name in node.copies]
    if ranks.local_rank == 0:
        for g in copied:
            _view(node.mapping, node.copies[g.name], g.buffer).copy_(g.buffer)
    ranks.barrier("the shared streamed copies")
    for g in copied:
        g.adopt(_view(node.mapping, node.copies[g.name], g.buffer))
    node.words[len(executor.group_names()) + ranks.local_rank] = os.getpid()
    ranks.barrier("the shared streamed copies adopted")
    return node.weights_bytes, node.words


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def _view(mapping: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return mapping[offset:offset + nbytes].view(like.dtype).view(like.shape)


@dataclass
class GroupFence:
    """The overlapped optimizer's fence across a node's ranks: per-group update counters in the node's shared
    mapping (module docstring). Counters, not a collective: the owner never waits for the others, and a rank
    waits only for the one group it is about to stream."""

    ranks: Ranks
    words: torch.Tensor  # int64: one counter per executor group, then each local rank's pid
    names: list[str]  # the executor groups' names

    def publish(self, index: int, number: int) -> None:
        """Group `index`'s update number `number` is in the shared weights (called by its owner, after it)."""
        _store_release(self._address(index), number)

    def read(self, index: int) -> int:
        return _load_acquire(self._address(index))

    def _address(self, index: int) -> int:
        return self.words.data_ptr() + index * self.words.element_size()

    def wait(self, index: int, number: int) -> None:
        """Until the owner of group `index` published update `number`; RankLost naming the owner when its process
        is gone or `collective_timeout_s` passed. The counter is a release store and an acquire load (C11 atomics,
        `_store_release`), so a rank that sees it sees the weights written before it, on any CPU (x86 orders
        plain stores so; arm64 hosts such as Grace do not)."""
        r = self.ranks
        owner_local = index % r.local_world_size
        owner = r.rank - r.local_rank + owner_local
        pid = int(self.words[len(self.names) + owner_local])
        start = time.monotonic()
        check = start + ALIVE_CHECK_S
        while self.read(index) < number:
            now = time.monotonic()
            if now >= check:
                check = now + ALIVE_CHECK_S
                r.check_lost()  # a collective already found a rank lost: that is the run's line
                gone = not _alive(pid)
                if gone or now - start > r.timeout_s:
                    why = "its process is gone" if gone else f"no update within {r.timeout_s:g} s"
                    r.lost = r.lost or (f"rank {owner} lost during the update of {self.names[index]} (rank {r.rank} "
                                        f"of {r.world_size} stops; {why}); resume from the last checkpoint with "
                                        "resume_from_checkpoint=auto")
                    raise RankLost(r.lost)
            time.sleep(FENCE_POLL_S)


@intrinsic
def _atomic_store_release(typingctx, address, value):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], builder.inttoptr(args[0], llvm_ir.IntType(64).as_pointer()), "release", 8)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _atomic_load_acquire(typingctx, address):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        return builder.load_atomic(builder.inttoptr(args[0], llvm_ir.IntType(64).as_pointer()), "acquire", 8)

    return types.int64(types.int64), codegen


@numba.njit
def _store_release(address: int, value: int) -> None:
    """Store the int64 `value` at `address`, ordered after every store this thread made before (and, through the
    optimizer's OpenMP join, its kernel threads')."""
    _atomic_store_release(address, value)


@numba.njit
def _load_acquire(address: int) -> int:
    """The int64 at `address`; nothing this thread reads after it is read before it."""
    return _atomic_load_acquire(address)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a killed child its parent has not reaped yet is a zombie: gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class OptimizerShard:
    """The parameters this rank's optimizer steps: the executor groups it owns (module docstring)."""

    ranks: Ranks
    owned: set[int] = field(default_factory=set)  # id() of the parameters this rank steps
    owned_indices: set[int] = field(default_factory=set)  # their executor groups' indices
    owned_groups: list[str] = field(default_factory=list)  # and names
    owner_local: dict[int, int] = field(default_factory=dict)  # id() of every parameter -> the local rank stepping it
    shared_bytes: int = 0  # the node's shared host weights
    group_fence: GroupFence | None = None  # the overlapped optimizer's fence (None: no shared weights)
    copies: dict[int, WeightGroup] = field(default_factory=dict)  # owned groups' shared bf16 copies, by index
    updates: int = 0  # deferred updates handed out (`deferred`), the number each publishes

    @classmethod
    def of(cls, ranks: Ranks, executor: Executor, shared: tuple[int, torch.Tensor] | None = None) -> OptimizerShard:
        mine = [i for i in range(len(executor.param_groups())) if i % ranks.local_world_size == ranks.local_rank]
        groups, names = executor.param_groups(), executor.group_names()
        shared_bytes, words = shared if shared is not None else (0, None)
        copies = {i: g for i in mine if (g := executor.group_at(i)) is not None and g.packed_by_update}
        return cls(ranks=ranks, owned={id(p) for i in mine for p in groups[i]}, owned_indices=set(mine),
                   owned_groups=[names[i] for i in mine], shared_bytes=shared_bytes,
                   owner_local={id(p): i % ranks.local_world_size for i, params in enumerate(groups) for p in params},
                   group_fence=None if words is None else GroupFence(ranks, words, names), copies=copies)

    def norm_share(self, sq_norm: float) -> float:
        """This rank's part of the step's squared gradient norm, summed over the ranks: its groups' on node 0 (the
        owners on other nodes hold the same sums)."""
        return sq_norm if self.ranks.rank < self.ranks.local_world_size else 0.0

    def refresh(self, index: int) -> None:
        """After this rank updated group `index`'s masters: its shared bf16 streamed copy from them (no-op in fp32
        compute or bf16 masters, where the shared weights are what streams)."""
        if (group := self.copies.get(index)) is not None:
            group.pack(force=True)

    def deferred(self, update: GroupUpdate) -> GroupUpdate:
        """`update` (one step's, `Executor.defer_update`) as this rank runs it on its optimizer lane: its own
        groups' updates, each refreshing the group's shared streamed copy and then published; for every other
        group, the wait for its owner's."""
        assert self.group_fence is not None
        self.updates += 1
        number, fence, owned = self.updates, self.group_fence, self.owned_indices

        def run(index: int) -> None:
            if index in owned:
                update(index)
                self.refresh(index)
                fence.publish(index, number)
            else:
                fence.wait(index, number)

        return run

    def describe(self) -> str:
        return (f"host weights {self.shared_bytes / 2**20:,.1f} MiB shared by the {self.ranks.local_world_size} ranks "
                f"of this node; rank {self.ranks.rank} steps {len(self.owned_groups)} layer groups "
                f"({', '.join(self.owned_groups[:3])}{', ...' if len(self.owned_groups) > 3 else ''}) and keeps "
                "their gradients alone")

    def drop_foreign_states(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """After building or loading: the states of parameters another local rank steps (8-bit optimizers
        allocate them eagerly; a loaded checkpoint holds them all)."""
        for opt in optimizers:
            for p, state in opt.state.items():
                if id(p) not in self.owned:
                    for key in [k for k in state if k not in KEPT_STATE]:
                        del state[key]

    def fence(self, what: str) -> None:
        """After this rank wrote its groups' masters (serial mode's step, a loaded checkpoint): their shared
        streamed copies refreshed, then every rank's in the shared weights before any rank's next forward."""
        for index in self.copies:
            self.refresh(index)
        self.ranks.barrier(what)
