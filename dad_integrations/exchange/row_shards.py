"""Shards that are row blocks of each weight (FSDP2's ``Shard(0)``): rank r keeps rows
``[r c, (r+1) c)`` of the average, ``c = ceil(m/S)`` of the matrix view.

A call's buffers are read and written through a `capture.sink.ShardSink`; `RowShardCall` runs its
exchanges: exact factors (`codecs.sharded_exact`: rows ``a:b`` of the average from every rank's
factors; bytes per rank ``(S-1) N n + (S-1)/S N m`` against the reduce-scatter's ``(S-1)/S m n``),
the rank routes (`codecs.sharded_rank`: every ``Q_s`` all-gathered and rows ``a:b`` of every ``P_s``
by all-to-all, ``(S-1) r (n + m/S)``; or PowerSGD's all-reduced P and Q), and the engine's own
reduce-scatter for the rest (`RowShardCall.reduce_rest`, the adapter's). Biases in the weight's
shard ride with exact factors; under a rank route they stay on the engine's reduction.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from dad_integrations.capture.sink import ShardSink, ShardSlot
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.sharded_exact import ShardedExactCodec, exchange_row_counts
from dad_integrations.codecs.sharded_rank import ShardedRankCodec
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.exchange.checks import agree_factors_rebuild
from dad_integrations.exchange.sharded import CallRoutes, ShardedCall
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routes.codec import start_codec_chunks
from dad_integrations.routes.registry import get_route
from dad_integrations.routing.router import UnitShape


class RowShardCall(ShardedCall):
    """One reduce-scatter of row-block shards (see the module doc); the adapter says which units it
    carries (`units`) and runs the engine's reduce-scatter of the rest (`reduce_rest`)."""

    def __init__(self, slots: List[ShardSlot], out: torch.Tensor, inp: torch.Tensor, predivide: float,
                 aggregator: FactorAggregator, scale: float, wire, rank_codec: ShardedRankCodec):
        """``slots``: each parameter's place in the engine's input buffer ``inp`` (already divided by
        ``predivide``) and output chunk ``out``; ``scale``: what the engine's reduce-scatter
        multiplies the sum by."""
        self.slots, self.aggregator, self.scale = slots, aggregator, scale
        self.sink = ShardSink(slots, out, inp, aggregator.world_size, predivide)
        self.route_wire, self.rank_codec = wire, rank_codec

    def reduce_rest(self, slots: List[ShardSlot], report: ShardedStepReport) -> None:
        """The engine's own reduce-scatter of ``slots`` (those no route above covered)."""
        raise NotImplementedError

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        self.sink.add_local(unit.param, residual)

    def agree_counts(self, units):
        counts, traffic = exchange_row_counts(units, self.rows, self.aggregator)
        return counts, traffic, sum(len(u.uses) for u in units)

    def verify(self, units):
        _, failed, traffic = agree_factors_rebuild(units, self.rows, self.sink, self.aggregator)
        return failed, traffic

    def _biases(self, unit: FactorUnit) -> List[nn.Parameter]:
        return riding_biases(self.sink, unit)

    def unit_shape(self, unit: FactorUnit) -> UnitShape:
        return row_unit_shape(self.sink, unit)

    def reduce_dense(self, report: ShardedStepReport) -> None:
        self.reduce_rest(self.slots, report)

    def exchange(self, routes: CallRoutes) -> None:
        sink, report, S, itemsize = self.sink, routes.report, self.aggregator.world_size, self.sink.inp.element_size()
        covered = set()
        # factors travel in the reduce-scatter's dtype where the config names none, as the router counts
        # them (not in the sharded parameters' dtype: fp32 factors under a bf16 policy)
        codec = ShardedExactCodec(self.route_wire or sink.inp.dtype, sink.inp.device)
        for unit in routes.exact:
            biases = self._biases(unit)
            result = codec.exchange(unit, self.rows[unit.index], routes.counts[unit.index], self.aggregator,
                                    self.scale)
            for p in [unit.param] + biases:
                sink.write(p, result.shards[p])
                covered.add(id(p))
                slot = sink.slot(p)
                report.params.append(ShardedParamReport.of_shard(slot.name, "exact", slot.shape, slot.numel, S,
                                                                 itemsize))
            weight = report.params[-1 - len(biases)]  # the bytes go to the weight, biases ride free
            weight.rows = sum(left.shape[0] for left, _ in self.rows[unit.index])
            weight.max_rows, weight.method = max(sum(r) for r in routes.counts[unit.index]), result.method
            weight.add_traffic(result.traffic)
        if routes.ranked:  # biases stay on the engine's reduce-scatter
            codec = self.rank_codec
            items = [codec.local(unit, self.rows[unit.index], sink.local_grad, rep) for unit, rep in routes.ranked]
            for item, result in zip(items, codec.exchange(items, self.aggregator, self.scale, routes.step,
                                                          sink.inp.dtype)):
                p = item.unit.param
                sink.write(p, result.shard)
                covered.add(id(p))
                slot = sink.slot(p)
                entry = ShardedParamReport.of_shard(slot.name, item.representation, slot.shape, slot.numel, S,
                                                    itemsize)
                entry.components, entry.method = result.components, item.method
                entry.add_traffic(result.traffic)
                report.params.append(entry)
        for unit, rep in routes.coded:  # biases stay on the engine's reduce-scatter
            p = unit.param
            m, n = unit.shape
            c = -(-m // S)
            local = torch.zeros(S * c, n, dtype=torch.float32, device=sink.inp.device)
            local[:m] = sink.local_grad(p, torch.float32)
            handle = start_codec_chunks(get_route(rep).codec, list(local.view(S, c * n)), self.aggregator,
                                        name=f"dad.{rep}.{unit.name}")
            a = min(self.aggregator.rank * c, m)
            sink.write(p, handle.wait().view(c, n)[:min(a + c, m) - a].mul_(self.scale).to(sink.out.dtype))
            covered.add(id(p))
            slot = sink.slot(p)
            entry = ShardedParamReport.of_shard(slot.name, rep, slot.shape, slot.numel, S, itemsize)
            entry.add_traffic(handle.traffic)
            report.params.append(entry)
        self.reduce_rest([s for s in self.slots if id(s.param) not in covered], report)


def riding_biases(sink: ShardSink, unit: FactorUnit) -> List[nn.Parameter]:
    """The unit's biases that this call's buffers hold (they ride with its exact factors)."""
    return [b.param for b in unit.biases if sink.slot(b.param) is not None]


def row_unit_shape(sink: ShardSink, unit: FactorUnit) -> UnitShape:
    """What the router sees of a unit of a row-block call: its matrix view; row blocks on
    non-linear uses keep it off sharded exact factors."""
    return UnitShape(tuple(unit.kinds), unit.shape, sum(b.shape[0] for b in riding_biases(sink, unit)),
                     sink.inp.dtype, unit.blocks)
