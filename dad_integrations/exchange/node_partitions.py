"""ZeRO-2/3's reduce-scatter across nodes, compressed only between nodes (qgZ's hierarchy, dAD's routes).

ZeRO keeps on each of ``S = N L`` ranks a flat element range of every weight (`exchange.partitions`),
and its reduce-scatter crosses the slow link with most of each weight. A `NodePartitionCall` sends
the weights the router gives a dAD route (`routing.two_level.choose_two_level` on this layout) in
three hops, as qgZ does with its INT4 all-to-alls (reduce inside the node, across nodes, scatter back), but with dAD's
representations on the hop between nodes:

1. **to the owner, inside the node** (`exchange.node_hops`, one all-to-all per call): the node's
   rows stacked, or its local gradients summed, at the weight's owner (`exchange.levels.assign_owners`);
2. **between nodes, owners only**: node k's ranks together own one contiguous stretch of the
   weight, ``[min lo, max hi)`` over its ranks (ZeRO-3: about ``1/N`` of it). The owners run the flat
   partition exchange (a `PartitionCall` of their own) over their cross group (N members) with
   those node ranges in place of the ranks', so every owner rebuilds its node's stretch of the
   scaled average, and only that;
3. **from the owner, inside the node** (one all-to-all per call): each rank's own elements.

Bytes per hop: `routes`' models on ``node_partitions``. The rebuild is done once per node, by the
owner, over ``1/N`` of the rows.

Error feedback (rank routes) is held by the owner, on its node's sum: ``e_k = M_k - P Q^T`` with
``M_k = sum_{j in k} g_j + e_k``. The average still owes ``scale * sum_k e_k``, as flat steps owe
``scale * sum_s e_s``: a rank holding a residual it does not compensate (a non-owner after a flat
step, or any rank after a resume at another size, which gives every rank the old mean) adds it to
its local gradient before hop 1, so it is sent, never lost. Warm starts: the all-reduce route's Q
is shared by the owners of a weight, the all-gather route's is each owner's own.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.capture.rows import compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import ExactCodec, Range
from dad_integrations.exchange.node_hops import HopItem, NodeHops, sums_at_owner
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import is_rank_route
from dad_integrations.comm.aggregator import Traffic
from dad_integrations.exchange.levels import Levels, assign_owners
from dad_integrations.exchange.partitions import PartitionCall, PartitionLayout
from dad_integrations.exchange.sharded import CallRoutes
from dad_integrations.report import ShardedStepReport
from dad_integrations.routing.router import Route, RouteContext, UnitEvidence, spare_seconds
from dad_integrations.routing.two_level import choose_two_level, node_rows_of


@dataclass
class NodeLayout:
    """What every two-level call of one engine shares: the levels (groups, links), the owner of each
    unit (by name), the cross group's `PartitionLayout` and the hops inside the node."""

    levels: Levels
    owner_of: Dict[str, int]
    cross: PartitionLayout
    hops: NodeHops

    @classmethod
    def build(cls, levels: Levels, flat: PartitionLayout, units: Sequence[FactorUnit]) -> "NodeLayout":
        topo = levels.topology
        # by the matrix view's size (ZeRO-3 empties p.data): each owner about 1/L of the work
        owners = assign_owners([float(u.shape[0] * u.shape[1]) for u in units], topo.local_size)
        exchanger = flat.exchanger
        cross = PartitionLayout(exchanger, levels.cross, flat.unit_of, flat.names, flat.device, flat.chunk_bytes)
        rank = exchanger.config.rank
        hops = NodeHops(ExactCodec(exchanger.wire, flat.device), torch.float32, rank, topo.num_nodes, flat.device)
        return cls(levels, {u.name: owners[i] for i, u in enumerate(units)}, cross, hops)


class NodePartitionCall(PartitionCall):
    """One ZeRO reduction call across nodes (module doc): dense weights by DeepSpeed's reduce-scatter,
    the others in three hops."""

    LAYOUT = layouts.NODE_PARTITIONS  # the layout its routes run on (`routes.layouts`)

    def __init__(self, layout: PartitionLayout, nodes: NodeLayout, *args, **kwargs):
        super().__init__(layout, *args, **kwargs)
        self.nodes = nodes
        topo = nodes.levels.topology
        self.topology, self.local, self.L = topo, topo.local_rank, topo.local_size

    # -- routes -----------------------------------------------------------------------------------
    def route(self, ctx: RouteContext, unit: FactorUnit, evidence: UnitEvidence) -> Route:
        """`routing.two_level.choose_two_level` on this layout and the agreed counts (by node)."""
        topo = self.topology
        rows = evidence.rows_by_rank
        node_rows = node_rows_of(rows, topo) if rows is not None and unit.has_factors else None
        rep, _, seconds = choose_two_level(
            self.config, self.unit_shape(unit), node_rows, step=ctx.step or 0, nodes=topo.num_nodes,
            local_size=self.L, wire_dtype=self.route_wire, timing=self.nodes.levels.timing,
            dense_only=evidence.dense_only, layout=self.LAYOUT, engine_itemsize=self.itemsize)
        saved = seconds[DENSE] - seconds[rep] if seconds and DENSE in seconds else 0.0
        return Route(rep, True, saved, spare_seconds(seconds, rep) if DENSE in seconds else 0.0)

    # -- the exchange -----------------------------------------------------------------------------
    def exchange(self, routes: CallRoutes) -> None:
        if not routes.routed:
            return super().exchange(routes)
        topo, report = self.topology, routes.report
        node_ranks = topo.intra_ranks(topo.node)
        items: List[HopItem] = []
        for unit, rep in routes.routed:
            owner = self.nodes.owner_of[unit.name]
            if is_rank_route(rep) and owner != self.local and self.rank_codec is not None:
                # a residual this rank holds but does not compensate (not the owner) rides its local
                # gradient to the owner: sent, never lost (`RouteState.flush`)
                self.rank_codec.state.flush(unit.name, functools.partial(self.add_residual, unit))
            it = HopItem(unit.name, [self.grads[unit.index]], owner, unit=unit, rows=self.rows[unit.index], rep=rep)
            if rep == EXACT:
                by_rank = routes.counts[unit.index]
                it.rank_rows = [list(by_rank[r]) for r in node_ranks]
                it.node_rows = node_rows_of(by_rank, topo)
            items.append(it)
        levels = self.nodes.levels
        # the `GradSink` face hop 1 reads a rank route's local gradient through: the item's parameter is it
        local = SimpleNamespace(local_grad=lambda q, dtype: q.to(dtype))
        mine, to_owner = self.nodes.hops.to_owner(items, local, levels.intra, self.local,
                                                  f"dad.zero.to_owner.{items[0].name}")
        results, between = self._between(mine, routes.step) if mine else ({}, {})
        from_owner = self._from_owner(items, results)
        self._report_items(items, report, to_owner, between, from_owner)

    def node_ranges(self, unit: FactorUnit) -> List[Range]:
        """Each node's stretch of the weight: ``[min lo, max hi)`` over its ranks' owned ranges (a
        superset where they are not adjacent: the owner then rebuilds a little more, never less)."""
        out: List[Range] = []
        ranges = self.ranges[unit.index]
        for ranks in self.topology.nodes:
            spans = [ranges[r] for r in ranks if ranges[r][1] > ranges[r][0]]
            out.append((min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else (0, 0))
        return out

    def _between(self, mine: List[HopItem], step: int) -> Tuple[Dict[int, torch.Tensor], Dict[int, Traffic]]:
        """Hop 2 for this rank's units over its cross group: each unit's stretch of this node."""
        units = [it.unit for it in mine]
        sums = [it.result[0] if sums_at_owner(it.rep) else self.grads[it.unit.index] for it in mine]
        results: Dict[int, torch.Tensor] = {}  # by parameter: its node's stretch
        call = PartitionCall(self.nodes.cross, [u.param for u in units], sums, [self.node_ranges(u) for u in units],
                             scale=self.scale, itemsize=self.itemsize, dtype=self.dtype,
                             deliver=lambda p, owned: results.__setitem__(id(p), owned))
        # exact: the node's stacked rows; rank routes: none (the node sum is reduced, `ShardedRankCodec.local`)
        call.prepare({it.unit.index: (it.rows if it.rep == EXACT else []) for it in mine})
        exact = [it.unit for it in mine if it.rep == EXACT]
        counts = call.agree_counts(exact)[0] if exact else {}  # embeddings: ids per node's rows
        scratch = ShardedStepReport(step + 1, self.nodes.levels.topology.num_nodes)
        call.exchange(CallRoutes(step, counts, scratch, [(it.unit, it.rep) for it in mine]))
        by_name = {p.name: Traffic(p.handed_bytes, p.sent_bytes, p.received_bytes) for p in scratch.params}
        return results, {it.unit.index: by_name.get(it.unit.name, Traffic()) for it in mine}

    def _from_owner(self, items: List[HopItem], results: Mapping[int, torch.Tensor]) -> Traffic:
        """Hop 3: one all-to-all inside the node; every rank delivers its own elements of each unit."""
        topo = self.topology

        def piece(it: HopItem, r: int) -> slice:  # rank r's slice of the owner's stretch
            lo, hi = self.ranges[it.unit.index][r]
            base = self.node_ranges(it.unit)[topo.node][0]
            return slice(lo - base, hi - base) if hi > lo else slice(0, 0)

        def nbytes(it: HopItem) -> int:  # what this rank receives of the unit
            own = piece(it, topo.rank)
            return (own.stop - own.start) * compute_dtype(it.unit.param).itemsize

        mine = [it for it in items if it.owner == self.local]
        by_rank = [[results[id(it.unit.param)][piece(it, r)].to(compute_dtype(it.unit.param)).reshape(-1).view(
            torch.uint8) for it in mine] for r in topo.intra_ranks(topo.node)]
        sizes = [[nbytes(it) for it in items if it.owner == j] for j in range(self.L)]  # by owner, by unit
        recv_sizes = [sum(s) for s in sizes]
        parts = [p for ps in by_rank for p in ps]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=self.layout.device)
        handle = self.nodes.levels.intra.all_to_all_v(send, [sum(p.numel() for p in ps) for ps in by_rank],
                                                      recv_sizes, name=f"dad.zero.from_owner.{items[0].name}")
        got = [iter(part.split(s)) for part, s in zip(handle.wait().split(recv_sizes), sizes)]
        for it in items:
            self.deliver(it.unit, next(got[it.owner]).view(compute_dtype(it.unit.param)))
        return handle.traffic

    def _report_items(self, items: List[HopItem], report: ShardedStepReport, to_owner: Traffic,
                      between: Mapping[int, Traffic], from_owner: Traffic) -> None:
        """Per weight: its route at two levels, the hops inside the node shared by size, and what
        crossed between nodes (the owners'; others 0)."""
        total = float(sum(it.unit.shape[0] * it.unit.shape[1] for it in items)) or 1.0
        for it in items:
            u = it.unit
            share = u.shape[0] * u.shape[1] / total
            hop2 = between.get(u.index, Traffic())
            self._entry(report, u, it.rep, to_owner.share(share), from_owner.share(share), hop2, level="two_level",
                        rows=self.own_rows(u) if it.rep == EXACT else 0, inter_bytes=float(hop2.received))
        self.reduce_dense(report)


def node_partition_layout(levels: Optional[Levels], flat: PartitionLayout,
                          units: Sequence[FactorUnit]) -> Optional[NodeLayout]:
    """The two-level layout where the job spans nodes (``levels`` given), else None (flat calls)."""
    return NodeLayout.build(levels, flat, units) if levels is not None else None
