"""Data-parallel training on torch.distributed: one streaming executor per rank, gradients summed per layer
group as each group lands on the host, one checkpoint writer (docs/parallel.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lazytrain.distributed.batches import RankBatches, check_world_size
from lazytrain.distributed.ranks import RankLost, Ranks, init_ranks, launched_local_world_size, launched_world_size
from lazytrain.distributed.shared import OptimizerShard, share_host_weights
from lazytrain.runtime.executor import Executor

__all__ = ["OptimizerShard", "RankBatches", "RankLost", "Ranks", "attach_executor", "check_world_size",
           "init_ranks", "launched_local_world_size", "launched_world_size", "save_once"]


def attach_executor(ranks: Ranks, executor: Executor) -> OptimizerShard:
    """Sum each layer group's gradient over the ranks on the optimizer lane as the group lands on the final
    micro-batch of a step: before the executor takes its norm (so the norm is the global one, and clipping
    agrees with one process); the backward of the next layers runs meanwhile. One host copy of the weights per
    node and the optimizer sharded over its ranks (distributed/shared.py): returns this rank's shard."""
    names = executor.group_names()
    executor.grad_hook = lambda index, grads: ranks.reduce_grads(names[index], grads)
    return OptimizerShard.of(ranks, executor, share_host_weights(ranks, executor))


def save_once(ranks: Ranks, step: int, write: Callable[[], Path]) -> Path:
    """Rank 0 writes the checkpoint (it sees the whole state: the shared weights, the optimizer states gathered
    from the shards), only once every rank has finished the step (a lost rank stops it before a byte is
    written); the others wait and learn where it went."""
    ranks.barrier(f"the start of checkpoint {step}")
    path = write() if ranks.is_main else None
    return Path(ranks.broadcast_object(str(path) if path is not None else None, f"the end of checkpoint {step}"))
