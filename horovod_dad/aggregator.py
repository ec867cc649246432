"""`HorovodAggregator`: dAD's collectives over Horovod's asynchronous operations.

Horovod matches collectives across ranks by name, not by issue order, and its enqueue is
thread-safe, so dAD's background thread can issue its all-gathers while the training thread (or a
second optimizer) issues its own. Names must therefore agree across ranks and be unique among the
operations in flight: every aggregator prefixes its names with the process set's id and a number
drawn from that process set's counter in this process (the ranks of a set create their optimizers
for it in the same order, as Horovod already requires; ranks outside the set create none, so one
counter for all sets would leave the ranks' names apart from then on).

Horovod's ``allgather`` accepts a different first dimension per rank and concatenates the results,
so no padding is needed; the split needs every rank's first dimension, which is exchanged first
unless the caller passes it. Horovod 0.28 has no bfloat16 collectives: bfloat16 all-gathers travel
as their bits (int16), bfloat16 all-reduces as float32 (the bytes counted are those handed over).
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from dad_integrations.comm.aggregator import CommHandle, FactorAggregator, Traffic

from ._horovod import HorovodInternalError, hvd

log = logging.getLogger(__name__)

_instances: Dict[int, Iterator[int]] = {}  # per process set id
_instances_lock = threading.Lock()


class HorovodAggregator(FactorAggregator):
    """`FactorAggregator` over ``hvd.allgather_async`` / ``hvd.allreduce_async_``.

    Args:
        process_set: the Horovod process set the collectives run over (default: all ranks).
            This process must belong to it.
        prefix: a name prefix for this aggregator's collectives; None draws a unique one
            (``dad<n>.ps<id>.``), identical across ranks as long as every rank creates its
            aggregators in the same order.
    """

    def __init__(self, process_set: Any = None, prefix: Optional[str] = None):
        super().__init__()
        if not hvd.is_initialized():
            raise RuntimeError("HorovodAggregator needs Horovod initialised: call hvd.init() first")
        self._process_set = hvd.global_process_set if process_set is None else process_set
        if not self._process_set.included():
            raise RuntimeError("this process is not a member of the given Horovod process set")
        if prefix is None:
            ps_id = self._process_set.process_set_id
            with _instances_lock:
                n = next(_instances.setdefault(ps_id, itertools.count()))
            prefix = f"dad{n}.ps{self._process_set.process_set_id}."
        self._prefix = prefix
        self._rank = int(self._process_set.rank())
        self._world = int(self._process_set.size())
        log.debug("HorovodAggregator %r: rank %d of %d", self._prefix, self._rank, self._world)

    @property
    def process_set(self) -> Any:
        return self._process_set

    @property
    def prefix(self) -> str:
        """The prefix of every collective's name."""
        return self._prefix

    # -- FactorAggregator -----------------------------------------------------------------------
    def _all_gather(self, tensor: torch.Tensor, name: str,
                    first_dims: Optional[List[int]]) -> CommHandle:
        tensor = tensor.contiguous()
        traffic = Traffic()
        if first_dims is None:
            first_dims, traffic = self._exchange_first_dims(tensor, name)
        elif first_dims[self._rank] != tensor.shape[0]:
            raise ValueError(f"{name}: first_dims says {first_dims[self._rank]} rows for this rank, "
                             f"the tensor has {tensor.shape[0]}")
        row_bytes = _prod(tensor.shape[1:]) * tensor.element_size()
        traffic = traffic + self._count_all_gather([n * row_bytes for n in first_dims])
        dtype = tensor.dtype
        wire = tensor.view(torch.int16) if dtype == torch.bfloat16 else tensor  # same bits
        handle = hvd.allgather_async(wire, name=self._prefix + name, process_set=self._process_set)

        def finish() -> List[torch.Tensor]:
            out = hvd.synchronize(handle)
            if out.shape[0] != sum(first_dims):
                # fewer ranks answered than this aggregator was built for: under Horovod elastic a
                # worker left mid-step (its rows are missing). Horovod's own error for it, so that
                # hvd.elastic.run restores the last commit and resets, as it does for its collectives
                raise HorovodInternalError(f"{name}: {out.shape[0]} rows gathered, {sum(first_dims)} expected "
                                           f"from {len(first_dims)} ranks: the job's membership changed")
            if dtype == torch.bfloat16:
                out = out.view(torch.bfloat16)
            return list(torch.split(out, first_dims))

        return CommHandle(finish, traffic)

    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle:
        target = tensor
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        traffic = self._count_all_reduce(tensor.numel() * tensor.element_size())
        # op=Sum and a division of our own: Horovod's Average divides by the process set's size,
        # which is ours too, but keeping one code path makes "mean" match the torch backend bit for bit
        handle = hvd.allreduce_async_(tensor, name=self._prefix + name, op=hvd.Sum,
                                      process_set=self._process_set)

        def finish() -> torch.Tensor:
            out = hvd.synchronize(handle)
            if op == "mean":
                out.div_(self._world)
            if out is not target:
                target.copy_(out)
            return target

        return CommHandle(finish, traffic)

    def _exchange_first_dims(self, tensor: torch.Tensor, name: str) -> Tuple[List[int], Traffic]:
        """Every rank's first dimension of ``tensor``, and the traffic of the exchange."""
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        traffic = self._count_all_gather([mine.element_size()] * self._world)
        out = hvd.synchronize(hvd.allgather_async(mine, name=self._prefix + name + ".rows",
                                                  process_set=self._process_set))
        return [int(v) for v in out.tolist()], traffic


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
