"""`DeepSpeedAggregator`: dAD's collectives over ``deepspeed.comm``.

Like `dad_integrations.TorchDistributedAggregator`, an `EqualSizeAggregator`: gloo's and NCCL's
all-gather need equal sizes on every rank, so rows of different lengths are padded to the longest.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from dad_integrations.aggregator import EqualSizeAggregator


class DeepSpeedAggregator(EqualSizeAggregator):
    """Collectives over a ``deepspeed.comm`` process group.

    Args:
        ranks: global ranks of the data-parallel group; None means every rank.

    A new group is always created here, even over every rank: dAD issues its collectives from a
    background thread while backward runs, and on a shared group they could interleave with
    DeepSpeed's own collectives (loss-scale overflow checks, gradient norms) in a different order
    on different ranks, which hangs or mixes up tensors. Every rank must therefore construct the
    aggregator at the same point, as for ``deepspeed.comm.new_group``.
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None):
        super().__init__()
        from deepspeed import comm as dist
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedAggregator needs deepspeed.comm initialised: call "
                               "deepspeed.init_distributed() (deepspeed.initialize does) first")
        self._dist = dist
        ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
        self._ranks = ranks
        self._group = dist.new_group(ranks=ranks)
        if dist.get_rank() not in ranks:
            raise RuntimeError(f"this process (rank {dist.get_rank()}) is not in the group {ranks}")
        self._rank = ranks.index(dist.get_rank())
        self._world = len(ranks)

    @property
    def group(self) -> Any:
        """The dedicated process group dAD's collectives run on."""
        return self._group

    @property
    def ranks(self) -> List[int]:
        """Global ranks of the group, by group rank."""
        return list(self._ranks)

    # The two calls into deepspeed.comm; every byte this backend moves passes through them.
    def _engine_all_gather(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        return self._dist.all_gather(out, tensor, group=self._group, async_op=async_op)

    def _engine_all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        return self._dist.all_reduce(tensor, group=self._group, async_op=async_op)
