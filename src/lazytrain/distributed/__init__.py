"""Data-parallel training on torch.distributed: one streaming executor per rank, gradients summed per layer
group as each group lands on the host, one checkpoint writer (docs/parallel.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lazytrain.distributed.batches import RankBatches, check_world_size
from lazytrain.distributed.ranks import RankLost, Ranks, init_ranks, launched_local_world_size, launched_world_size
from lazytrain.runtime.executor import Executor

__all__ = ["RankBatches", "RankLost", "Ranks", "attach_executor", "check_world_size", "init_ranks",
           "launched_local_world_size", "launched_world_size", "save_once"]


def attach_executor(ranks: Ranks, executor: Executor) -> None:
    """Sum each layer group's gradient over the ranks on the optimizer lane as the group lands on the final
    micro-batch of a step: before the executor takes its norm (so the norm is the global one, and clipping
    agrees with one process) and before an overlapped optimizer steps it; the backward of the next layers runs
    meanwhile."""
    names = executor.group_names()
    executor.grad_hook = lambda index, params: ranks.reduce_grads(names[index], params)


def save_once(ranks: Ranks, step: int, write: Callable[[], Path]) -> Path:
    """Rank 0 writes the checkpoint (every rank holds the same state), only once every rank has finished the
    step (a lost rank stops it before a byte is written); the others wait and learn where it went."""
    ranks.barrier(f"the start of checkpoint {step}")
    path = write() if ranks.is_main else None
    return Path(ranks.broadcast_object(str(path) if path is not None else None, f"the end of checkpoint {step}"))
