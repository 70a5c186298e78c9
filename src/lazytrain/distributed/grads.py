"""Each layer group's gradient summed into the ranks that own it, micro-batch by micro-batch as it lands
(docs/parallel.md "Gradients").

Executor group i belongs to local rank i % g on every node (distributed/shared.py). When a group's gradient of
one micro-batch is on the host (the land op on the executor's optimizer lane: program order, the same on every
rank) every rank of the node sends it to the local owner (a reduce), and the owners of the nodes (the same local
rank on each) sum theirs (an all-reduce): each owner holds the sum over all ranks, the others keep nothing (their
landing buffers are two pooled ones, `Executor.keep_gradients`). The sum is in fp32: a bf16 gradient is cast into
an fp32 transient first and rounded to bf16 once, on the owner, so it does not depend on the number of ranks
beyond that one rounding. An untied embedding's (or a tied head's embedding part's) gradient is a scatter of the
boundary-0 gradient rows on the host: the rows and their token ids are gathered to the owners instead, which
scatter every rank's rows in rank order -- the single process's order over the global batch's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lazytrain.costmodel.topology import Topology
    from lazytrain.distributed.ranks import Ranks


class OwnerGrads:
    """The executor's `grad_reducer` for data parallelism (module docstring)."""

    def __init__(self, ranks: Ranks, owned: set[int], names: list[str], largest_numel: int) -> None:
        self.ranks = ranks
        self.owned = owned
        self.names = names
        self.largest_numel = largest_numel
        self.transient: torch.Tensor | None = None  # fp32, the largest group: a bf16 gradient's sum

    @property
    def topology(self) -> Topology:
        """The ranks the step program sums over (its "reduce j" and "gather" ops run `node_sum` and `rows`)."""
        return self.ranks.topology

    def owns(self, index: int) -> bool:
        return index in self.owned

    def node_sum(self, index: int, landing: torch.Tensor) -> torch.Tensor | None:
        """The sum over every rank of group `index`'s landed gradient (this micro-batch's), on its owners (fp32 in
        the transient for a bf16 one, else in `landing` itself); None on the other ranks. A collective."""
        t = landing
        if landing.dtype != torch.float32:
            if self.transient is None:
                self.transient = torch.empty(self.largest_numel, dtype=torch.float32)
            t = self.transient[:landing.numel()].copy_(landing)
        mine = self.ranks.sum_to_owners(f"{self.names[index]}'s gradient", t, index % self.ranks.local_world_size)
        return t if mine else None

    def rows(self, index: int, grad0: torch.Tensor, ids: torch.Tensor
             ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every rank's boundary-0 gradient rows and token ids, in rank order, on the owners of group `index`;
        None on the other ranks. A collective."""
        gathered = self.ranks.gather_to_owners(f"{self.names[index]}'s gradient rows", [grad0, ids],
                                               index % self.ranks.local_world_size)
        return None if gathered is None else [(g, i) for g, i in gathered]
