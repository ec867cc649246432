"""`DeepSpeedAggregator`: dAD's collectives over ``deepspeed.comm``.

A `dad_integrations.TorchDistributedAggregator` whose engine calls go to ``deepspeed.comm``
(rows padded to the longest, the same group timeout, launcher hint and peer directory).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

from dad_integrations.comm.aggregator import EqualSizeAggregator
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator, job_peer_directory


class DeepSpeedAggregator(TorchDistributedAggregator):
    """Collectives over a ``deepspeed.comm`` process group.

    Args:
        ranks: global ranks of the data-parallel group; None means every rank.
        timeout: the timeout of dAD's group; None takes DeepSpeed's (``init_distributed(timeout=)``,
            ``DEEPSPEED_TIMEOUT``), read from the default group, so that a stalled rank fails dAD's
            collectives as soon as DeepSpeed's own (``deepspeed.comm.new_group`` takes no timeout
            and would give torch's 30-minute default).

    A new group is always created here, even over every rank, as for `TorchDistributedAggregator`
    (DeepSpeed's own collectives: loss-scale overflow checks, gradient norms). Every rank must
    therefore construct the aggregator at the same point, as for ``deepspeed.comm.new_group``.
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None, *, timeout: Optional[timedelta] = None):
        EqualSizeAggregator.__init__(self)  # (not the torch aggregator's: it would make a group)
        from deepspeed import comm as dist
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedAggregator needs deepspeed.comm initialised: call "
                               "deepspeed.init_distributed() (deepspeed.initialize does) first")
        self._dist = dist
        ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
        self._ranks = ranks
        self._group = _new_group(dist, ranks, timeout)
        if dist.get_rank() not in ranks:
            raise RuntimeError(f"this process (rank {dist.get_rank()}) is not in the group {ranks}")
        self._rank = ranks.index(dist.get_rank())
        self._world = len(ranks)
        self._peers = job_peer_directory()  # publishes this rank's entry now, before any collective

    def split(self, partition: Sequence[Sequence[int]]) -> "DeepSpeedAggregator":
        """One new group per part (every rank creates each, in order, with this group's timeout);
        returns the aggregator over this rank's part."""
        def make(part: List[int]) -> Tuple[List[int], Any]:
            ranks = [self._ranks[r] for r in part]
            return ranks, _new_group(self._dist, ranks, None)

        ranks, group = self._split_with(partition, make)
        out = DeepSpeedAggregator.__new__(DeepSpeedAggregator)
        EqualSizeAggregator.__init__(out)
        out._dist, out._ranks, out._group, out._peers = self._dist, ranks, group, self._peers
        out._rank, out._world = ranks.index(self._dist.get_rank()), len(ranks)
        return out

    @property
    def ranks(self) -> List[int]:
        """Global ranks of the group, by group rank."""
        return list(self._ranks)


def _new_group(ds_dist: Any, ranks: List[int], timeout: Optional[timedelta]) -> Any:
    """``deepspeed.comm.new_group(ranks)``, with the timeout of DeepSpeed's default group.

    DeepSpeed's torch backends (``TorchBackend`` and its subclasses) make groups with
    ``torch.distributed.new_group``, so the group is made there directly, where a timeout can be
    given. Another backend makes the group with its own ``new_group`` (and its timeout).
    """
    import torch.distributed
    from deepspeed.comm import comm as ds_comm  # the live backend: ``deepspeed.comm.cdb`` is a stale copy
    from deepspeed.comm.torch import TorchBackend
    cdb = getattr(ds_comm, "cdb", None)
    if isinstance(cdb, TorchBackend) and torch.distributed.is_initialized():
        from dad_integrations.comm.groups import new_group_like
        return new_group_like(ranks, timeout=timeout)
    if timeout is not None:
        raise ValueError(f"timeout= needs DeepSpeed's torch.distributed backend, not {type(cdb).__name__}")
    return ds_dist.new_group(ranks=ranks)
