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
import math
import os
import threading
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

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

    # -- topology (`comm.topology`) --------------------------------------------------------------
    def topology_hint(self) -> Optional[Tuple[int, int]]:
        """Horovod's ``cross_rank()`` and ``local_size()`` for the global process set (in a
        smaller set the launcher's node sizes do not apply)."""
        if self._world != hvd.size():
            return None
        return int(hvd.cross_rank()), int(hvd.local_size())

    def collective_timeout(self) -> Optional[timedelta]:
        """Horovod's gloo timeout, ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (Horovod's default: 30 s)."""
        try:
            return timedelta(seconds=float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30")))
        except ValueError:
            return None

    def split(self, partition: Sequence[Sequence[int]]) -> "HorovodAggregator":
        """One process set per part: a set registered at ``hvd.init(process_sets=...)`` with
        exactly those ranks (`node_process_sets` builds them), else one added now where Horovod
        runs with dynamic process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1``; every rank adds them
        in the same order). Returns the aggregator over this rank's part."""
        members = self._process_set.ranks or list(range(hvd.size()))
        registered = {tuple(ranks): ps_id for ps_id, ranks in _registered_sets().items()}

        def make(part: List[int]) -> Any:
            ranks = sorted(members[r] for r in part)
            if tuple(ranks) in registered:
                ps = hvd.ProcessSet(ranks)
                ps.process_set_id = registered[tuple(ranks)]
            elif os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1":
                ps = hvd.add_process_set(ranks)
                registered[tuple(ranks)] = ps.process_set_id
            else:
                raise NotImplementedError(
                    f"no Horovod process set of ranks {ranks}: pass horovod_dad.node_process_sets() to "
                    "hvd.init(process_sets=...), or run with HOROVOD_DYNAMIC_PROCESS_SETS=1")
            return ps

        return HorovodAggregator(self._split_with(partition, make))

    # -- FactorAggregator -----------------------------------------------------------------------
    def _all_gather(self, tensor: torch.Tensor, name: str,
                    first_dims: Optional[List[int]]) -> CommHandle:
        tensor = tensor.contiguous()
        traffic = Traffic()
        if first_dims is None:  # (given ones were checked by `FactorAggregator.all_gather`)
            first_dims, traffic = self._exchange_first_dims(tensor, name)
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
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

    def _all_to_all_v(self, tensor: torch.Tensor, send_sizes: List[int], recv_sizes: List[int],
                      name: str) -> CommHandle:
        traffic = self._count_all_to_all_v(tensor.element_size(), send_sizes, recv_sizes)
        splits = torch.tensor(send_sizes, dtype=torch.int32)
        handle = hvd.alltoall_async(tensor, splits=splits, name=self._prefix + name, process_set=self._process_set)

        def finish() -> torch.Tensor:
            out, _ = hvd.synchronize(handle)
            if out.numel() != sum(recv_sizes):
                raise HorovodInternalError(f"{name}: {out.numel()} elements received, {sum(recv_sizes)} expected: "
                                           "the job's membership changed")
            return out

        return CommHandle(finish, traffic)

    def _exchange_first_dims(self, tensor: torch.Tensor, name: str) -> Tuple[List[int], Traffic]:
        """Every rank's first dimension of ``tensor``, and the traffic of the exchange."""
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        traffic = self._count_all_gather([mine.element_size()] * self._world)
        out = hvd.synchronize(hvd.allgather_async(mine, name=self._prefix + name + ".rows",
                                                  process_set=self._process_set))
        return [int(v) for v in out.tolist()], traffic


def _registered_sets() -> Dict[int, List[int]]:
    """Every process set Horovod knows, by id (its ranks)."""
    from horovod.common.process_sets import _basics

    return {int(k): list(v) for k, v in _basics._get_process_set_ids_and_ranks().items()}


def node_process_sets(local_size: Optional[int] = None, size: Optional[int] = None) -> List[Any]:
    """The process sets dAD's two-level routes run over, for ``hvd.init(process_sets=...)``: one
    per node (``local_size`` consecutive ranks) and one per local index across nodes. Before
    ``hvd.init`` the sizes come from horovodrun's environment (``HOROVOD_LOCAL_SIZE``,
    ``HOROVOD_SIZE``); on one node, or one rank a node, there are none."""
    local_size = int(os.environ.get("HOROVOD_LOCAL_SIZE", 1)) if local_size is None else local_size
    size = int(os.environ.get("HOROVOD_SIZE", 1)) if size is None else size
    if local_size <= 1 or size <= local_size or size % local_size:
        return []
    nodes = [list(range(k, k + local_size)) for k in range(0, size, local_size)]
    cross = [list(range(j, size, local_size)) for j in range(local_size)]
    return [hvd.ProcessSet(ranks) for ranks in nodes + cross]
