"""`TorchDistributedAggregator`: the embedded default backend, over ``torch.distributed`` (gloo's and
NCCL's all-gather need equal sizes: an `EqualSizeAggregator`)."""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from dad_integrations.comm.aggregator import EqualSizeAggregator
from dad_integrations.comm.groups import _group_timeout, new_group_like
from dad_integrations.comm.peers import PeerDirectory
from dad_integrations.comm.topology import launcher_hint


class TorchDistributedAggregator(EqualSizeAggregator):
    """Collectives over a ``torch.distributed`` process group (``_dist``: the module whose collectives
    it calls, ``deepspeed.comm`` in `deepspeed_dad.DeepSpeedAggregator`).

    Args:
        group: the process group; None creates a group of all ranks here (`comm.groups`: dAD's
            background collectives never interleave with the user's), on every rank at the same point.
        timeout: the timeout of the group created here; None takes ``init_process_group``'s, so
            that a stalled rank makes dAD fail within the user's timeout, as DDP does.
    """

    _dist = dist

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, timeout: Optional[timedelta] = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributedAggregator needs an initialised default process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
        if group is not None and timeout is not None:
            raise ValueError("timeout applies to the group created here: give the group passed in its "
                             "timeout where it is made (dist.new_group(ranks, timeout=...))")
        self._group = group if group is not None else new_group_like(range(dist.get_world_size()), timeout=timeout)
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        if self._rank < 0:
            raise RuntimeError("this process is not a member of the given process group")
        self._peers = job_peer_directory()  # publishes this rank's entry

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group dAD's collectives run on."""
        return self._group

    def collective_timeout(self) -> Optional[timedelta]:
        """The group's timeout (``init_process_group``'s, or the one given)."""
        return _group_timeout(self._group)

    def peer_directory(self) -> Optional[PeerDirectory]:
        """The job's ranks' addresses and nodes, from the job's store (`comm.peers`)."""
        return self._peers

    def topology_hint(self) -> Optional[Tuple[int, int]]:
        """The launcher's node index and ranks per node (`comm.topology.launcher_hint`: torchrun,
        DeepSpeed's launcher, horovodrun), for a group of every rank (in a smaller group the
        launcher's node sizes do not apply)."""
        if self._world != self._dist.get_world_size():
            return None
        return launcher_hint()

    def split(self, partition: Sequence[Sequence[int]]) -> "TorchDistributedAggregator":
        """One new group per part (global ranks translated from this group's), each with this
        group's timeout; returns the aggregator over this rank's part."""
        return TorchDistributedAggregator(self._split_with(partition, lambda part: new_group_like(
            [dist.get_global_rank(self._group, r) for r in part], base=self._group)))

    # The calls into the engine's module; every byte this backend moves passes through them.
    def _engine_all_gather(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        return self._dist.all_gather(out, tensor, group=self._group, async_op=async_op)

    def _engine_all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        return self._dist.all_reduce(tensor, group=self._group, async_op=async_op)

    def _engine_all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        return self._dist.all_to_all_single(out, tensor, group=self._group, async_op=async_op)

    def _engine_all_to_all_v(self, out: torch.Tensor, tensor: torch.Tensor, out_sizes: List[int],
                             in_sizes: List[int], async_op: bool = False):
        return self._dist.all_to_all_single(out, tensor, output_split_sizes=out_sizes,
                                            input_split_sizes=in_sizes, group=self._group, async_op=async_op)


def job_peer_directory() -> Optional[PeerDirectory]:
    """The job's `PeerDirectory` over torch.distributed's default store (this rank's entry published
    in it), or None where there is no store to read."""
    try:
        store = dist.distributed_c10d._get_default_store()
        me, world = dist.get_rank(), dist.get_world_size()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return PeerDirectory.for_job(store, me, world)
