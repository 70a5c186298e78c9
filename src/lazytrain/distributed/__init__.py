"""Data-parallel training on torch.distributed: one streaming executor per rank, one host copy of the weights per
node with the optimizer sharded over its ranks, each layer group's gradient summed into its owners as it lands
on the host, each owner writing its own optimizer states into a checkpoint (docs/parallel.md)."""

from __future__ import annotations

from lazytrain.distributed.batches import RankBatches, check_world_size
from lazytrain.distributed.grads import OwnerGrads
from lazytrain.distributed.ranks import RankLost, Ranks, init_ranks, launched_local_world_size, launched_world_size
from lazytrain.distributed.shared import OptimizerShard, share_model, share_streamed_copies
from lazytrain.runtime.device import return_freed_host_memory
from lazytrain.runtime.executor import Executor

__all__ = ["OptimizerShard", "OwnerGrads", "RankBatches", "RankLost", "Ranks", "attach_executor", "check_world_size",
           "init_ranks", "launched_local_world_size", "launched_world_size", "share_model"]


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
