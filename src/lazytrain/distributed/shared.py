"""One host copy of the model per node, and the host optimizer sharded over the node's ranks (docs/parallel.md).

Weights. Local rank 0 of each node writes every host weight tensor into one file in /dev/shm -- the executor's
packed layer groups where they are the parameters (fp32 compute) and every other parameter (the untied
embedding; with bf16 compute all the fp32 master weights, while each rank keeps its own bf16 streamed copy).
After a barrier every local rank maps the file (MAP_SHARED) and re-points its tensors at the mapping, which
frees its private copies; after a second barrier the file is unlinked, so nothing outlives the run (the
mappings stay valid until the processes end).

Optimizer. Executor group i (the untied embedding, layer 0..L-1, the head) belongs to local rank
i % local ranks. Every rank still sums every group's gradient as it lands (all-reduce), so the global norm and
the non-finite check are the single process's; just before the step a rank drops the gradients of the groups
it does not own, so its optimizer updates (and torch's AdamW creates states for) its own groups only, in the
shared weights. Ranks of the same local rank on different nodes own the same groups and step them alike on
their nodes' copies. A barrier after the step is the fence: no rank starts the next forward before every
group's update is in the shared copy.

Checkpoints gather the shards' optimizer states to rank 0, which writes them as one state (the single
process's layout); resuming, every rank loads it and drops the states of the groups it does not own.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:

    from lazytrain.distributed.ranks import Ranks
    from lazytrain.runtime.executor import Executor

SHM_DIR = Path("/dev/shm")
ALIGN_BYTES = 4096
KEPT_STATE = ("step", "eightbit")  # per-parameter entries a rank keeps for groups it does not own


def share_host_weights(ranks: Ranks, executor: Executor) -> int:
    """Put this node's host weights in one shared-memory file mapped by every local rank; returns its bytes."""
    groups = [g for g in [*executor.layer_groups, executor.head_group] if g.aliased]
    in_groups = {id(p) for g in groups for p in g.params}
    loose = list({id(p): p for p in executor.model.parameters() if id(p) not in in_groups}.values())
    regions = [g.buffer for g in groups] + [p.data for p in loose]
    offsets, total = [], 0
    for t in regions:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    if not SHM_DIR.is_dir():
        raise LazyTrainError(f"data parallelism shares the weights of a node's ranks through {SHM_DIR}, which this "
                             "machine does not have; run one rank per node")
    token = ranks.broadcast_object(secrets.token_hex(6) if ranks.is_main else None, "the shared weights' name")
    path = SHM_DIR / f"lazytrain-{token}-node{ranks.rank // ranks.local_world_size}.weights"
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
            for t, offset in zip(regions, offsets, strict=True):
                _view(mapping, offset, t).copy_(t)
        ranks.barrier("mapping the shared weights")
        if ranks.local_rank != 0:
            mapping = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        with torch.no_grad():
            for g, offset in zip(groups, offsets[:len(groups)], strict=True):
                g.adopt(_view(mapping, offset, g.buffer))
            for p, offset in zip(loose, offsets[len(groups):], strict=True):
                p.data = _view(mapping, offset, p.data)
        ranks.barrier("the shared weights mapped")
    finally:  # every rank has it mapped (or the run stops): the file goes, the mappings stay
        if ranks.local_rank == 0:
            path.unlink(missing_ok=True)
    return total


def _view(mapping: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return mapping[offset:offset + nbytes].view(like.dtype).view(like.shape)


@dataclass
class OptimizerShard:
    """The parameters this rank's optimizer steps: the executor groups it owns (module docstring)."""

    ranks: Ranks
    owned: set[int] = field(default_factory=set)  # id() of the parameters this rank steps
    owned_groups: list[str] = field(default_factory=list)  # their executor groups' names
    shared_bytes: int = 0  # the node's shared host weights

    @classmethod
    def of(cls, ranks: Ranks, executor: Executor, shared_bytes: int = 0) -> OptimizerShard:
        mine = [i for i in range(len(executor.param_groups())) if i % ranks.local_world_size == ranks.local_rank]
        groups, names = executor.param_groups(), executor.group_names()
        return cls(ranks=ranks, owned={id(p) for i in mine for p in groups[i]}, owned_groups=[names[i] for i in mine],
                   shared_bytes=shared_bytes)

    def describe(self) -> str:
        return (f"host weights {self.shared_bytes / 2**20:,.1f} MiB shared by the {self.ranks.local_world_size} ranks "
                f"of this node; rank {self.ranks.rank} steps {len(self.owned_groups)} layer groups "
                f"({', '.join(self.owned_groups[:3])}{', ...' if len(self.owned_groups) > 3 else ''})")

    def drop_foreign_states(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """After building or loading: the states of parameters another local rank steps (8-bit optimizers
        allocate them eagerly; a loaded checkpoint holds them all)."""
        for opt in optimizers:
            for p, state in opt.state.items():
                if id(p) not in self.owned:
                    for key in [k for k in state if k not in KEPT_STATE]:
                        del state[key]

    def fence(self, step: int) -> None:
        """After the step: every group's update is in the shared weights before any rank's next forward."""
        self.ranks.barrier(f"the updated weights of step {step}")

    def gathered_states(self, optimizers: list[torch.optim.Optimizer]) -> list[dict[str, object]] | None:
        """Every optimizer's state_dict with each parameter's state from the rank that owns it, on rank 0 (None
        on the others): the single process's states. One gather per parameter, so no rank holds more than one
        parameter's states in flight beside what the single process would hold. A collective: every rank calls it."""
        sends = self.ranks.rank < self.ranks.local_world_size  # node 0's ranks: one owner per parameter
        merged = []
        for opt in optimizers:
            sd = opt.state_dict()  # rank 0's: param groups, its own states, the optimizer's extras
            params = [p for group in opt.param_groups for p in group["params"]]
            ids = [pid for group in sd["param_groups"] for pid in group["params"]]
            state = dict(sd["state"])
            for pid, p in zip(ids, params, strict=True):
                mine = sd["state"].get(pid) if sends and id(p) in self.owned and not self.ranks.is_main else None
                shards = self.ranks.gather_to_main(mine, "gathering the optimizer states")
                owner = [s for s in shards or [] if s is not None]  # none before the parameter's first step
                if owner and id(p) not in self.owned:
                    state[pid] = owner[0]
            merged.append({**sd, "state": state})
        return merged if self.ranks.is_main else None
