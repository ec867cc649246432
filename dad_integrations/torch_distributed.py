"""`TorchDistributedAggregator`: the embedded default backend, over ``torch.distributed``.

gloo's and NCCL's all-gather need equal sizes on every rank, so rows of different lengths are
padded to the longest after an exchange of sizes (skipped when the caller passes ``first_dims``).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .aggregator import CommHandle, FactorAggregator


class TorchDistributedAggregator(FactorAggregator):
    """Collectives over a ``torch.distributed`` process group.

    Args:
        group: the process group; None uses a new group of all ranks created here, so that dAD's
            collectives (issued from a background thread while backward runs) can never interleave
            with the user's own collectives on the default group. Every rank must construct the
            aggregator at the same point when ``group`` is None, as for ``dist.new_group``.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributedAggregator needs an initialised default process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
        self._group = group if group is not None else dist.new_group(ranks=list(range(dist.get_world_size())))
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        if self._rank < 0:
            raise RuntimeError("this process is not a member of the given process group")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group

    def _exchange_first_dims(self, tensor: torch.Tensor) -> List[int]:
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        out = [torch.empty_like(mine) for _ in range(self._world)]
        self._dist_all_gather(out, mine)
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
        work = self._dist_all_gather(out, tensor, async_op=True)

        def finish() -> List[torch.Tensor]:
            work.wait()
            return [t[:n] for t, n in zip(out, first_dims)]

        return CommHandle(finish)

    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle:
        work = self._dist_all_reduce(tensor, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            if op == "mean":
                tensor.div_(self._world)
            return tensor

        return CommHandle(finish)

    # The two calls into torch.distributed; every byte this backend moves passes through them.
    def _dist_all_gather(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        self._count_all_gather([nbytes] * self._world)
        return dist.all_gather(out, tensor, group=self._group, async_op=async_op)

    def _dist_all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        self._count_all_reduce(tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, group=self._group, async_op=async_op)
