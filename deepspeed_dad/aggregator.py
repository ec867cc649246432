"""`DeepSpeedAggregator`: dAD's collectives over ``deepspeed.comm``.

Follows `dad_integrations.TorchDistributedAggregator`: gloo's and NCCL's all-gather need equal
sizes on every rank, so rows of different lengths are padded to the longest after a size exchange
(skipped when the caller passes ``first_dims``).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from dad_integrations import CommHandle, FactorAggregator


class DeepSpeedAggregator(FactorAggregator):
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
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def group(self) -> Any:
        """The dedicated process group dAD's collectives run on."""
        return self._group

    @property
    def ranks(self) -> List[int]:
        """Global ranks of the group, by group rank."""
        return list(self._ranks)

    def _exchange_first_dims(self, tensor: torch.Tensor) -> List[int]:
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        out = [torch.empty_like(mine) for _ in range(self._world)]
        self._ds_all_gather(out, mine)
        return [int(t.item()) for t in out]

    def _all_gather(self, tensor: torch.Tensor, name: str,
                    first_dims: Optional[List[int]]) -> CommHandle:
        tensor = tensor.contiguous()
        if first_dims is None:
            first_dims = self._exchange_first_dims(tensor)
        elif first_dims[self._rank] != tensor.shape[0]:
            raise ValueError(f"{name}: first_dims says {first_dims[self._rank]} rows for this rank, "
                             f"the tensor has {tensor.shape[0]}")
        longest = max(first_dims)
        if tensor.shape[0] < longest:
            pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        out = [torch.empty_like(tensor) for _ in range(self._world)]
        work = self._ds_all_gather(out, tensor, async_op=True)

        def finish() -> List[torch.Tensor]:
            if work is not None:
                work.wait()
            return [t[:n] for t, n in zip(out, first_dims)]

        return CommHandle(finish)

    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle:
        work = self._ds_all_reduce(tensor, async_op=True)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            if op == "mean":
                tensor.div_(self._world)
            return tensor

        return CommHandle(finish)

    # The two calls into deepspeed.comm; every byte this backend moves passes through them.
    def _ds_all_gather(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        self._count_all_gather([tensor.numel() * tensor.element_size()] * self._world)
        return self._dist.all_gather(out, tensor, group=self._group, async_op=async_op)

    def _ds_all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        self._count_all_reduce(tensor.numel() * tensor.element_size())
        return self._dist.all_reduce(tensor, group=self._group, async_op=async_op)
