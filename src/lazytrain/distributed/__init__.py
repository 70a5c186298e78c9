"""Data-parallel training on torch.distributed: one streaming executor per rank, one host copy of the weights per
node with the optimizer sharded over its ranks, each layer group's gradient summed into its owners as it lands
on the host, one checkpoint writer (docs/parallel.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lazytrain.distributed.batches import RankBatches, check_world_size
from lazytrain.distributed.grads import OwnerGrads
from lazytrain.distributed.ranks import RankLost, Ranks, init_ranks, launched_local_world_size, launched_world_size
from lazytrain.distributed.shared import OptimizerShard, share_model, share_streamed_copies
from lazytrain.runtime.device import return_freed_host_memory
from lazytrain.runtime.executor import Executor

__all__ = ["OptimizerShard", "OwnerGrads", "RankBatches", "RankLost", "Ranks", "attach_executor", "check_world_size",
           "init_ranks", "launched_local_world_size", "launched_world_size", "save_once", "share_model"]


def attach_executor(ranks: Ranks, executor: Executor) -> OptimizerShard:
    """One host copy of the weights per node (`share_model` put them there at start-up; the bf16 streamed copies
    join them now) and the optimizer sharded over its ranks (distributed/shared.py);
    each group's gradient summed over the ranks into the group's owners on the optimizer lane as it lands, micro-
    batch by micro-batch, while the backward of the next layers runs (distributed/grads.py). Returns this rank's
    shard."""
    shard = OptimizerShard.of(ranks, executor, share_streamed_copies(ranks, executor))
    largest = max(executor.slot_numel, executor.head_group.numel)
    executor.keep_gradients(OwnerGrads(ranks, shard.owned_indices, executor.group_names(), largest),
                            shard.owned_indices)
    return_freed_host_memory()  # what sharing freed (and the calibration's buffers) leaves this rank
    return shard


def save_once(ranks: Ranks, step: int, write: Callable[[], Path]) -> Path:
    """Rank 0 writes the checkpoint (it sees the whole state: the shared weights, the optimizer states gathered
    from the shards), only once every rank has finished the step (a lost rank stops it before a byte is
    written); the others wait and learn where it went."""
    ranks.barrier(f"the start of checkpoint {step}")
    path = write() if ranks.is_main else None
    return Path(ranks.broadcast_object(str(path) if path is not None else None, f"the end of checkpoint {step}"))
