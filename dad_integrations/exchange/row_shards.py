"""Shards that are row blocks of each weight (FSDP2's ``Shard(0)``): rank r keeps rows
``[r c, (r+1) c)`` of the average, ``c = ceil(m/S)`` of the matrix view.

A call's buffers are read and written through a `capture.sink.ShardSink`; `RowShardCall` runs its
exchanges: exact factors (`codecs.exact`), the rank routes (`codecs.sharded_rank`), routes
with a codec of their own, and the engine's own reduce-scatter for the rest (its engine part's
`EngineCall.reduce_scatter`); their bytes are `routes`' models on ``row_shards``.
Biases in the weight's shard ride with exact factors; under other routes they stay on the engine's
reduction.
"""
from __future__ import annotations

from typing import List, Mapping, Optional

import torch
from torch import nn

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.capture.sink import ShardSink, ShardSlot
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import ExactCodec, agree_rows
from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.exchange.checks import agree_factors_rebuild
from dad_integrations.exchange.sharded import CallRoutes, EngineCall, ShardedCall, filled
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routes.codec import start_codec_chunks
from dad_integrations.routes.registry import get_route
from dad_integrations.routing.router import UnitShape


class RowShardCall(ShardedCall):
    """One reduce-scatter of row-block shards (see the module doc), for the engine part ``engine``
    (its units, rows and reduce-scatter); HSDP's `exchange.replicate_hop.ReplicateHopCall` reuses its
    buffers, counts, checks and reports, a unit seen with the biases that ride with it."""

    def __init__(self, engine: EngineCall, slots: List[ShardSlot], out: torch.Tensor, inp: torch.Tensor,
                 predivide: float, aggregator: FactorAggregator, scale: float, wire, rank_codec, shards: int = 0):
        """``slots``: each parameter's place in the engine's input buffer ``inp`` (``shards`` chunks,
        default the group's size, already divided by ``predivide``) and output chunk ``out``;
        ``scale``: what the engine's reduce-scatter multiplies the sum by."""
        self.engine, self.slots, self.aggregator, self.scale = engine, slots, aggregator, scale
        self.sink = ShardSink(slots, out, inp, shards or aggregator.world_size, predivide)
        self.route_wire, self.rank_codec = wire, rank_codec

    def agree_counts(self, units):
        """Every rank's row count per unit and use: one all-gather of int64 for all ``units``."""
        mine = [[left.shape[0] for left, _ in self.rows[u.index]] for u in units]
        counts, traffic = agree_rows(mine, self.aggregator, "dad.sharded.rows", units[0].param.device)
        return {u.index: c for u, c in zip(units, counts)}, traffic, sum(len(u.uses) for u in units)

    def verify(self, units):
        return agree_factors_rebuild(units, self.rows, self.sink, self.aggregator)

    def leaving(self, units):
        """A call with a compressed weight packs the rest of its buffer for the reduce-scatter and
        writes it back (`reduce_rest`): each unit's gradient bytes in the input, and the rest's."""
        size, index = self.sink.world_size * self.sink.inp.element_size(), {id(u.param): u.index for u in units}
        own, rest, tensors = {}, 0, 0
        for s in self.slots:
            if id(s.param) in index:
                own[index[id(s.param)]] = s.numel * size
            else:
                rest, tensors = rest + s.numel * size, tensors + 1
        return own, (rest, tensors)

    def _biases(self, unit: FactorUnit) -> List[nn.Parameter]:
        """The unit's biases that this call's buffers hold (they ride with its exact factors)."""
        return [b.param for b in unit.biases if self.sink.slot(b.param) is not None]

    def unit_shape(self, unit: FactorUnit) -> UnitShape:
        """What the router sees of a unit: its matrix view; row blocks on non-linear uses keep it off
        sharded exact factors."""
        return UnitShape(tuple(unit.kinds), unit.shape, sum(b.shape[0] for b in self._biases(unit)),
                         self.sink.inp.dtype, unit.blocks)

    def _entry(self, p: nn.Parameter, representation: str, slot: Optional[ShardSlot] = None) -> ShardedParamReport:
        slot = slot or self.sink.slot(p)
        return ShardedParamReport.of_shard(slot.name, representation, slot.shape, slot.numel, self.sink.world_size,
                                           self.sink.inp.element_size())

    def _put(self, p: nn.Parameter, shard: torch.Tensor, representation: str, report: ShardedStepReport,
             covered: set, *traffic: Traffic, **fields) -> ShardedParamReport:
        """Write ``p``'s reduced shard, count it covered and report it (`filled`); returns the entry."""
        self.sink.write(p, shard)
        covered.add(id(p))
        report.params.append(filled(self._entry(p, representation), *traffic, **fields))
        return report.params[-1]

    def _put_exact(self, unit: FactorUnit, shards: Mapping[nn.Parameter, torch.Tensor], report: ShardedStepReport,
                   covered: set, *traffic: Traffic, **fields) -> ShardedParamReport:
        """`_put` the unit's exact shards, the weight's and its riding biases'; returns the weight's
        entry, which the exchange's bytes and ``fields`` go to (the biases ride free)."""
        entries = [self._put(p, shards[p], EXACT, report, covered) for p in [unit.param] + self._biases(unit)]
        rows = sum(left.shape[0] for left, _ in self.rows[unit.index])
        return filled(entries[0], *traffic, rows=rows, **fields)

    def reduce_rest(self, slots: List[ShardSlot], report: ShardedStepReport) -> None:
        """The engine's own reduce-scatter of ``slots`` (those no route above covered)."""
        if not slots:
            return
        sink = self.sink
        if sum(s.numel for s in slots) == sink.chunk:  # nothing went by a route: the buffer as it is
            self.engine.reduce_scatter(sink.out, sink.inp)
        else:
            sink.write_dense(slots, self._scatter(sink.dense_input(slots)))
        report.params += [self._entry(s.param, DENSE, s) for s in slots]

    def _scatter(self, compact: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the engine's reduce-scatter of ``compact`` (one chunk per shard)."""
        result = torch.empty(compact.numel() // self.sink.world_size, dtype=compact.dtype, device=compact.device)
        self.engine.reduce_scatter(result, compact)
        return result

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        self.sink.add_local(unit.param, residual)

    def reduce_dense(self, report: ShardedStepReport) -> None:
        self.reduce_rest(self.slots, report)

    def exchange(self, routes: CallRoutes) -> None:
        sink, report, covered = self.sink, routes.report, set()
        # factors travel in the reduce-scatter's dtype where the config names none, as the router counts
        # them (not in the sharded parameters' dtype: fp32 factors under a bf16 policy)
        codec = ExactCodec(self.route_wire or sink.inp.dtype, sink.inp.device)
        for unit in routes.exact:
            result = codec.exchange_shards(unit, self.rows[unit.index], routes.counts[unit.index], self.aggregator,
                                           self.scale)
            self._put_exact(unit, result.shards, report, covered, result.traffic, method=result.method,
                            max_rows=max(sum(r) for r in routes.counts[unit.index]))
        if routes.ranked:  # biases stay on the engine's reduce-scatter
            codec = self.rank_codec
            items = [codec.local(unit, self.rows[unit.index], sink.local_grad, rep) for unit, rep in routes.ranked]
            for item, result in zip(items, codec.exchange(items, self.aggregator, self.scale, routes.step,
                                                          sink.inp.dtype)):
                self._put(item.unit.param, result.shard, item.representation, report, covered, result.traffic,
                          components=result.components, method=item.method)
        for unit, rep in routes.coded:  # biases stay on the engine's reduce-scatter
            m, n = unit.shape
            S, c = self.aggregator.world_size, -(-m // self.aggregator.world_size)
            local = torch.zeros(S * c, n, dtype=torch.float32, device=sink.inp.device)
            local[:m] = sink.local_grad(unit.param, torch.float32)
            handle = start_codec_chunks(get_route(rep).codec, list(local.view(S, c * n)), self.aggregator,
                                        name=f"dad.{rep}.{unit.name}")
            a = min(self.aggregator.rank * c, m)
            shard = handle.wait().view(c, n)[:min(a + c, m) - a].mul_(self.scale).to(sink.out.dtype)
            self._put(unit.param, shard, rep, report, covered, handle.traffic)
        self.reduce_rest([s for s in self.slots if id(s.param) not in covered], report)
