"""Shards that are flat element ranges of each weight (DeepSpeed ZeRO-2/3's partitions).

A call hands over each parameter's flattened local gradient and every rank's owned ``[lo, hi)`` of
it (`PartitionCall`); the rank keeps only its own elements of the average. A weight is handled as
its matrix view ``(shape[0], prod(shape[1:]))``, whose row-major flattening is the partitions':

* routes are weighed on the real ranges (`PartitionCall.estimates`): a weight often lies in one
  rank's partition, and that rank receives every site's factors, so the estimates are the busiest
  rank's bytes and ties go by the mean over ranks;
* exact factors and rank-dAD's ``(P_s^T, Q_s^T)`` (r rows of a linear use) travel together in one
  all-to-all per run of weights (`codecs.exact`); each rank rebuilds the covering rows of
  its range and keeps its elements;
* PowerSGD's all-reduce route (P and Q all-reduced): each rank rebuilds only the covering rows of
  its owned elements (`sharded_rank.reduced_elements`);
* linear uses over row blocks (a packed ``in_proj_weight``) take exact factors as whole-row uses do;
  blocks on other uses keep a unit off them (`exact.sharded_exact_covers`).

Every rank makes the same calls with the same parameters in the same order (the engine's buckets
agree across ranks), so the collectives match.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Set, Tuple

import torch
from torch import nn

from dad_integrations.builtin_routes import DENSE, EXACT, RANK, RANK_ALLREDUCE
from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.units import FactorUnit, param_shape
from dad_integrations.codecs.exact import ExactCodec, PartitionItem, Range, sharded_exact_covers
from dad_integrations.codecs.sharded_rank import RankItem, reduced_elements
from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.exchange.checks import failed_somewhere, verify_tolerance
from dad_integrations.exchange.sharded import CallRoutes, EngineCall, ShardedCall, ShardedExchanger, filled
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import estimates_on, get_route, has_codec, raise_unsupported, routes_for
from dad_integrations.routes.codec import start_codec_chunks
from dad_integrations.routing.router import UnitShape, unit_sizing


@dataclass
class PartitionLayout:
    """What every call of one engine shares: its exchanger and group, the factor units by parameter,
    the parameters' names (reports), the device, and the cap on one all-to-all's factors."""

    exchanger: ShardedExchanger
    aggregator: FactorAggregator
    unit_of: Mapping[int, FactorUnit]
    names: Mapping[int, str]
    device: torch.device
    chunk_bytes: float

    def __post_init__(self) -> None:
        self.codec = ExactCodec(self.exchanger.wire, self.device)


class PartitionCall(ShardedCall):
    """One reduction call over flat partitions (see the module doc)."""

    LAYOUT = layouts.PARTITIONS  # the layout its routes run on (`routes.layouts`)

    def __init__(self, layout: PartitionLayout, params: Sequence[nn.Parameter], local: Sequence[torch.Tensor],
                 ranges: Sequence[Sequence[Range]], *, scale: float, itemsize: int, dtype: torch.dtype,
                 deliver: Callable[[nn.Parameter, torch.Tensor], None]):
        self.layout, self.params, self.scale, self.itemsize, self.dtype, self._deliver = (
            layout, params, scale, itemsize, dtype, deliver)
        self.aggregator, self.rank_codec = layout.aggregator, layout.exchanger.rank_codec
        self.S, self.config = layout.aggregator.world_size, layout.exchanger.config
        self.route_wire = layout.exchanger.wire or dtype
        units: List[FactorUnit] = []
        self.grads: Dict[int, torch.Tensor] = {}
        self.ranges: Dict[int, list] = {}
        for p, g, r in zip(params, local, ranges):
            unit = layout.unit_of.get(id(p))
            if unit is not None:
                units.append(unit)
                self.grads[unit.index], self.ranges[unit.index] = g, list(r)
        self.engine = EngineCall(units)  # ZeRO's: its rows as captured, its own reduction of the rest
        self.items: Dict[int, PartitionItem] = {}
        self.delivered: Set[int] = set()

    def local_of(self, unit: FactorUnit) -> torch.Tensor:
        return self.grads[unit.index]

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        local = self.grads[unit.index]
        local.add_(residual.reshape(-1).to(local.dtype))

    def item(self, unit: FactorUnit) -> PartitionItem:
        # the matrix view (a conv's 4-D weight as (C_out, C_in k k)): ZeRO's flat partitions cut
        # the row-major flattening, which is the view's, so covering rows are the view's rows
        if unit.index not in self.items:
            self.items[unit.index] = PartitionItem(unit.index, tuple(unit.kinds), unit.shape, self.ranges[unit.index],
                                                   self.rows[unit.index], blocks=unit.blocks)
        return self.items[unit.index]

    def agree_counts(self, units):
        items = [self.item(u) for u in units]
        traffic = self.layout.codec.agree_range_counts(items, self.aggregator)
        return {it.key: it.rows_by_rank() for it in items}, traffic, len(items)

    def checkable(self, unit: FactorUnit) -> bool:
        return sharded_exact_covers(unit.kinds, unit.blocks)

    def verify(self, units):
        """Do the factors rebuild this rank's owned part of each unit's local gradient, on every rank?"""
        me, flags = self.aggregator.rank, []
        cdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        for unit in units:
            it = self.item(unit)
            mine = self.layout.codec.local_range(it, me, cdt)
            lo, hi = it.ranges[me]
            autograd = self.grads[it.key][lo:hi].to(cdt) if hi > lo else mine
            tol = verify_tolerance(self.dtype, it.rows)
            err = float((mine - autograd).norm())
            flags.append(0.0 if err <= tol * max(float(autograd.norm()), 1e-30) or err <= 1e-12 else 1.0)
        return failed_somewhere(units, flags, self.aggregator, "dad.zero.verify", self.layout.codec.device)

    def unit_shape(self, unit: FactorUnit) -> UnitShape:
        return UnitShape(tuple(unit.kinds), unit.shape, 0, self.dtype, unit.blocks)

    def reduce_dense(self, report: ShardedStepReport) -> None:
        """Reports every parameter not delivered (all of them here): DeepSpeed reduces them."""
        for p in self.params:
            if id(p) not in self.delivered:
                report.params.append(self._report(self.layout.names.get(id(p), "?"), DENSE, p))

    def _report(self, name: str, representation: str, p: nn.Parameter) -> ShardedParamReport:
        # DeepSpeed's reduce-scatter moves (S-1) of S pieces of ceil(numel/S) elements per rank
        shape = tuple(param_shape(p))
        return ShardedParamReport.of_shard(name, representation, shape, -(-math.prod(shape) // self.S), self.S,
                                           self.itemsize)

    def _entry(self, report: ShardedStepReport, unit: FactorUnit, representation: str, *traffic: Traffic,
               **fields) -> None:
        """Append ``unit``'s entry to ``report``: `_report`, `filled` with ``fields`` and each collective's bytes."""
        report.params.append(filled(self._report(unit.name, representation, unit.param), *traffic, **fields))

    def own_rows(self, unit: FactorUnit) -> int:
        """This rank's captured rows of ``unit``, over its uses."""
        return sum(left.shape[0] for left, _ in self.rows[unit.index])

    def deliver(self, unit: FactorUnit, owned: torch.Tensor) -> None:
        self._deliver(unit.param, owned)
        self.delivered.add(id(unit.param))

    def exchange(self, routes: CallRoutes) -> None:
        report = routes.report
        routed: List[PartitionItem] = []   # exact factors, or (rank-dAD) P_s^T and Q_s^T as rows
        ranked: Dict[int, Tuple[int, str]] = {}   # components sent, how M_s was reduced
        shared: List[Tuple[FactorUnit, RankItem]] = []   # PowerSGD's all-reduce route
        for unit, rep in routes.routed:
            if rep == EXACT:
                routed.append(self.item(unit))
            elif rep == RANK:
                item, ranked[unit.index] = self._rank_item(unit, routes.step)
                routed.append(item)
            elif rep == RANK_ALLREDUCE:
                shared.append((unit, self._local_rank(unit, rep)))
            elif not has_codec(rep):
                raise_unsupported(rep, layouts.PARTITIONS)
        for unit, rep in routes.coded:  # each rank's range of the local gradient, to that rank (qgZ's pattern)
            local = self.grads[unit.index].reshape(-1)
            chunks = [local[lo:hi] if hi > lo else local[:0] for lo, hi in self.ranges[unit.index]]
            handle = start_codec_chunks(get_route(rep).codec, chunks, self.aggregator, name=f"dad.{rep}.{unit.name}")
            self.deliver(unit, handle.wait().mul_(self.scale))
            self._entry(report, unit, rep, handle.traffic)
        if shared:
            self._reduce_shared(shared, routes.step, report)
        units = {u.index: u for u in self.engine.units()}
        for chunk in _chunks(routed, self.layout.chunk_bytes):
            # one all-to-all per chunk: a whole DeepSpeed bucket's factors at once would hold all of
            # their send and receive buffers together, above ZeRO's own peak
            traffic = self.layout.codec.exchange_ranges(chunk, self.aggregator,
                                                        compute_dtype(units[chunk[0].key].param), self.scale,
                                                        lambda key, owned: self.deliver(units[key], owned))
            for it in chunk:
                unit = units[it.key]
                components, method = ranked.get(it.key, (0, "partition"))
                self._entry(report, unit, RANK if it.key in ranked else EXACT, traffic[it.key],
                            rows=self.own_rows(unit), max_rows=max(sum(k) for k in it.rows_by_rank()),
                            components=components, method=method)
        self.reduce_dense(report)

    def estimates(self, unit: FactorUnit, counts) -> Tuple[Dict[str, float], Dict[str, float]]:
        """Each route's bytes for one weight on its busiest rank, and on average (ties), from the real
        ranges (module doc; `routes`' models on ``partitions``)."""
        config, it, exact = self.config, self.item(unit), sharded_exact_covers(unit.kinds, unit.blocks)
        sizing = unit_sizing(config, self.unit_shape(unit), None, self.route_wire, world_size=self.S,
                             engine_itemsize=self.itemsize, counts=it.counts, ranges=it.ranges)
        names = [k for k in routes_for(config.routes) if exact or not get_route(k).needs_rows]
        pairs = estimates_on(layouts.PARTITIONS, sizing, names)
        return {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()}

    def _rank_item(self, unit: FactorUnit, step: int) -> Tuple[PartitionItem, Tuple[int, str]]:
        """Rank-dAD's local half for one weight, ``M_s`` reduced to r rows ``(P_s^T, Q_s^T)`` of a linear
        use (module doc); returns that item and (the components this site sent, how it reduced)."""
        it, ranked = self.item(unit), self._local_rank(unit, RANK)
        p, q, components = self.rank_codec.reduce_own(ranked, step)
        item = PartitionItem(it.key, ("linear",), it.shape, it.ranges, [(p.t(), q.t())])
        item.counts = [[[p.shape[1]]] for _ in range(self.S)]  # padded to r everywhere: no count exchange
        return item, (components, ranked.method)

    def _local_rank(self, unit: FactorUnit, rep: str) -> RankItem:
        """A rank route's ``M_s`` of one weight, from its local gradient's matrix view."""
        local = self.grads[unit.index].view(*unit.shape)
        return self.rank_codec.local(unit, self.item(unit).rows, lambda p, cdt: local.to(cdt), rep)

    def _reduce_shared(self, shared: Sequence[Tuple[FactorUnit, RankItem]], step: int,
                       report: ShardedStepReport) -> None:
        """PowerSGD's exchange for the all-reduce-routed weights of one call; each rank rebuilds
        only the covering rows of its owned elements of ``scale P^ Q'^T`` and delivers those."""
        me = self.aggregator.rank

        def owned(item: RankItem, basis: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            return reduced_elements(basis, q, *self.ranges[item.unit.index][me], self.scale)

        results = self.rank_codec.exchange([ri for _, ri in shared], self.aggregator, self.scale, step,
                                           self.route_wire, rebuild=owned)
        for (unit, ri), res in zip(shared, results):
            self.deliver(unit, res.shard)
            self._entry(report, unit, RANK_ALLREDUCE, res.traffic, rows=self.own_rows(unit),
                        components=res.components, method=ri.method)


def _chunks(items: Sequence[PartitionItem], cap_bytes: float) -> List[List[PartitionItem]]:
    """``items`` in order, cut into runs whose factors (every rank's rows, ``m + n`` numbers each,
    fp32) stay under ``cap_bytes``; an item larger than the cap is a run of its own. Decided on
    agreed counts, so every rank cuts the same runs."""
    runs: List[List[PartitionItem]] = []
    size = 0.0
    for it in items:
        nbytes = sum(sum(r) for r in it.rows_by_rank()) * (it.shape[0] + it.shape[1]) * 4.0
        if not runs or size + nbytes > cap_bytes:
            runs.append([])
            size = 0.0
        runs[-1].append(it)
        size += nbytes
    return runs
