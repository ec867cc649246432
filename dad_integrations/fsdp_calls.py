"""One FSDP2 (or HSDP) reduce-scatter call as `exchange.sharded.ShardedExchanger` takes it: which
units its slots hold, their committed rows, FSDP's own reduce-scatter for the rest, and where the
step ends (`fsdp.FSDPDADSynchronizer._reduce` makes them)."""
from __future__ import annotations

from typing import Any, Callable, List

import torch
import torch.distributed as dist
from torch.autograd import Variable

from dad_integrations import fsdp_seams as seams
from dad_integrations.capture.units import FactorUnit
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
from dad_integrations.exchange.replicate_hop import ReplicateHopCall
from dad_integrations.exchange.row_shards import RowShardCall
from dad_integrations.report import ShardedStepReport


class _Units:
    """What both calls take from the `FSDPDADSynchronizer` (``sync``): units, committed rows, the step's end."""

    def units(self) -> List[FactorUnit]:
        return [u for u in (self.sync._unit_of.get(id(s.param)) for s in self.slots) if u is not None]

    def take_pairs(self, unit: FactorUnit, use) -> list:
        return self.sync._committed.take(use)

    def at_step_end(self, end: Callable[[], None]) -> None:
        if torch._C._current_graph_task_id() < 0:
            end()  # not inside a backward: this call is the step
        else:       # after every group's reduce-scatter, FSDP's final callback included
            Variable._execution_engine.queue_callback(end)


class _FSDPCall(_Units, RowShardCall):
    """One FSDP reduce-scatter, as `ShardedExchanger.reduce` takes it (``sync``: the `FSDPDADSynchronizer`)."""

    def __init__(self, sync: Any, slots: list, out: torch.Tensor, inp: torch.Tensor, predivide: float,
                 group: dist.ProcessGroup, op, scale: float, aggregator: TorchDistributedAggregator):
        super().__init__(slots, out, inp, predivide, aggregator, scale, sync.exchanger.wire, sync.exchanger.rank_codec)
        self.sync, self.group, self.op = sync, group, op

    def reduce_rest(self, slots: list, report: ShardedStepReport) -> None:
        seams.reduce_scatter(slots, self.sink, self.group, self.op, report)


class _HSDPCall(_Units, ReplicateHopCall):
    """One HSDP reduce-scatter, FSDP's part of `exchange.replicate_hop.ReplicateHopCall`."""

    def __init__(self, sync: Any, slots: list, out: torch.Tensor, inp: torch.Tensor,
                 predivide: float, scale: float, shard_group: dist.ProcessGroup):
        ex = sync.exchanger
        super().__init__(slots, out, inp, predivide, scale, sync._replicate, ex.wire, ex.rank_codec, ex.config)
        self.sync, self.shard_group = sync, shard_group  # FSDP's reduce-scatter group: the node's ranks

    def reduce_scatter_node(self, compact: torch.Tensor) -> torch.Tensor:
        result = torch.empty(compact.numel() // self.shard_group.size(), dtype=compact.dtype, device=compact.device)
        dist.reduce_scatter_tensor(result, compact, op=dist.ReduceOp.SUM, group=self.shard_group)
        return result
