"""One FSDP2 (or HSDP) reduce-scatter call's engine part, as `exchange.sharded.ShardedExchanger`
takes it: which units its slots hold, their committed rows, FSDP's own reduce-scatter, and where the
step ends (`fsdp.FSDPDADSynchronizer._reduce` makes them, for a row-shard or replicate-hop layout)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from dad_integrations.capture.units import FactorUnit
from dad_integrations.exchange.sharded import EngineCall


class FSDPEngineCall(EngineCall):
    """What a call takes from the `FSDPDADSynchronizer` (``sync``): units, committed rows, the step's
    end, and FSDP's reduce-scatter over ``group`` by ``op`` (under HSDP: inside the node, a sum)."""

    def __init__(self, sync: Any, slots: list, group: dist.ProcessGroup, op):
        super().__init__([u for u in (sync._unit_of.get(id(s.param)) for s in slots) if u is not None])
        self.sync, self.group, self.op = sync, group, op

    def take_pairs(self, unit: FactorUnit, use) -> list:
        return self.sync._committed.take(use)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.reduce_scatter_tensor(out, inp, op=self.op, group=self.group)

    def at_step_end(self, end: Callable[[], None]) -> None:
        if torch._C._current_graph_task_id() < 0:
            end()  # not inside a backward: this call is the step
        else:       # after every group's reduce-scatter, FSDP's final callback included
            Variable._execution_engine.queue_callback(end)
