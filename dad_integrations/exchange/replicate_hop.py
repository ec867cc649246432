"""HSDP's replicate hop: the reduce-scatter stays inside the node, dAD's routes run between nodes.

Under HSDP a weight's rows are sharded over the L ranks of a node and replicated over the R nodes;
its gradient is reduce-scattered inside the node, then each shard is all-reduced between nodes.
`ReplicateHopCall` is one such reduction call (one FSDP parameter group), run by
`exchange.sharded.ShardedExchanger.reduce` like any sharded call. Ranks are placed on a grid ``grid[node][s]`` of
world ranks: the node's L ranks form the ``intra`` group, the R ranks holding rows ``s`` on every
node the ``cross`` group.

Per route, for rank s of node k:

* **exact**: each rank's own rows are all-gathered over ``cross`` (the only bytes between nodes),
  then the rows of the whole column (R times as many) go through the 1-D sharded exact exchange
  inside the node (`codecs.exact`). Every rank of a column stacks the same rows in the same
  order, so the replicas' shards are equal bit for bit;
* **rank routes**: the node's reduce-scatter first (dense, inside the node), then
  `codecs.replicate_rank` on the node's row shards;
* **dense** (and biases under rank routes, and whatever no route covers): the node's
  reduce-scatter, then the shard's all-reduce over ``cross``, which is HSDP's own reduction.

The adapter's engine part (`exchange.sharded.EngineCall`) is FSDP's, as for 1-D sharding: the units
a call carries, where their rows are, and its reduce-scatter, here inside the node.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.builtin_routes import DENSE
from dad_integrations.capture.sink import ShardSlot
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.replicate_rank import ReplicateRankCodec
from dad_integrations.codecs.exact import ExactCodec, longest
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.exchange.row_shards import RowShardCall
from dad_integrations.exchange.sharded import CallRoutes, EngineCall, Estimates, filled
from dad_integrations.routes import layouts
from dad_integrations.routes.codec import start_codec
from dad_integrations.routes.registry import estimates_on, get_route, routes_for
from dad_integrations.report import ShardedParamReport, ShardedStepReport
from dad_integrations.routing.router import RowCounts, unit_sizing

Grid = Sequence[Sequence[int]]  # grid[node][s]: world ranks


class ReplicateGroups:
    """The world, intra-node and cross-node aggregators of one HSDP mesh, and its rank grid."""

    def __init__(self, world: FactorAggregator, intra: FactorAggregator, cross: FactorAggregator, grid: Grid,
                 world_rank: int):
        self.world, self.intra, self.cross = world, intra, cross
        self.grid = [list(row) for row in grid]
        self.nodes, self.local = len(self.grid), len(self.grid[0])
        self.node, self.shard = next((k, row.index(world_rank)) for k, row in enumerate(self.grid)
                                     if world_rank in row)

    def probe_link(self, _aggregator: FactorAggregator, device: torch.device, **sizing: int):
        """The link between nodes: probed on every cross group at once (as a step loads it), the
        slowest figures agreed over the world, so that every rank routes alike (a collective).
        ``sizing``: `routing.link.probe_link`'s ``top_bytes``."""
        from dad_integrations.routing.link import LinkModel, agree_max, probe_link
        local = probe_link(self.cross, device, **sizing).to_list()
        return LinkModel.from_list(agree_max(self.world, local, device, name="dad.link.replicate"), measured=True)

    def column(self, s: int) -> List[int]:
        """The world ranks holding rows ``s``, one per node, in the cross group's order."""
        return [row[s] for row in self.grid]


class ReplicateHopCall(RowShardCall):
    """One HSDP reduction call (module doc): ``slots`` place each parameter in the node's
    reduce-scatter buffers (``inp``: L chunks, already divided by ``predivide``; ``out``: this rank's
    chunk); ``scale`` turns a sum over the world of local gradients into what the engine keeps
    before its post-divide; ``engine``'s reduce-scatter runs inside the node."""

    LAYOUT = layouts.REPLICATE_HOP  # the layout its routes run on (`routes.layouts`)

    def __init__(self, engine: EngineCall, slots: List[ShardSlot], out: torch.Tensor, inp: torch.Tensor,
                 predivide: float, scale: float, groups: ReplicateGroups, wire: Optional[torch.dtype],
                 rank_codec: Optional[ReplicateRankCodec], config):
        # counts, checks, a step's finiteness: every rank (the world)
        super().__init__(engine, slots, out, inp, predivide, groups.world, scale, wire, rank_codec, groups.local)
        self.groups, self.config = groups, config

    def add_residual(self, unit: FactorUnit, residual: torch.Tensor) -> None:
        # the node's residual, rank s holding its rows s: into this rank's own chunk only, which
        # the node's reduce-scatter adds once
        slot = self.sink.slot(unit.param)
        view = self.sink.inp.view(self.groups.local, self.sink.chunk)[self.groups.shard,
                                                                     slot.offset:slot.offset + slot.numel]
        view.add_(residual.reshape(-1)[:slot.numel].to(view.dtype) / self.sink.predivide)

    def estimates(self, unit: FactorUnit, counts: Optional[RowCounts]) -> Estimates:
        """Bytes one rank sends between nodes per route (`routes`' models on the ``replicate_hop``
        layout); rows per use: the most any rank captured (agreed, so every rank decides alike)."""
        rows = longest(counts) if counts else [0] * len(unit.uses)
        sizing = unit_sizing(self.config, self.unit_shape(unit), rows, self.route_wire, nodes=self.groups.nodes,
                             local=self.groups.local)
        return estimates_on(layouts.REPLICATE_HOP, sizing, routes_for(self.config.routes)), None

    def reduce_dense(self, report: ShardedStepReport) -> None:
        self._cross_dense(self.slots, None, report)

    def exchange(self, routes: CallRoutes) -> None:
        sink, report, covered = self.sink, routes.report, set()
        for unit in routes.exact:
            shards, traffic, inter = self._exact(unit, routes.counts[unit.index])
            self._put_exact(unit, shards, report, covered, traffic, inter_bytes=inter)
        ranked, coded = routes.ranked, routes.coded
        rest = [s for s in self.slots if id(s.param) not in covered and
                not any(s.param is u.param for u, _ in ranked + coded)]
        if ranked or coded:  # one reduce-scatter inside the node for the routed weights and the rest
            slots = [sink.slot(u.param) for u, _ in ranked]
            coded_slots = [sink.slot(u.param) for u, _ in coded]
            sums = self._node_sums(slots + coded_slots + rest)
            for (u, rep), s in zip(coded, coded_slots):  # a codec of its own, over the replicas
                handle = start_codec(get_route(rep).codec, sums[id(u.param)], self.groups.cross,
                                     name=f"dad.replicate.{rep}.{u.name}")
                sink.write_dense([s], handle.wait().mul_(sink.predivide * self.scale).to(sums[id(u.param)].dtype))
                report.params.append(filled(self._entry(u.param, rep), handle.traffic, inter_bytes=handle.traffic.sent))
            codec = self.rank_codec
            items = [codec.node_local(u, sums[id(u.param)].view(s.rows, -1) * sink.predivide, rep)
                     for (u, rep), s in zip(ranked, slots)]
            results = codec.exchange(items, self.aggregator, self.scale, routes.step, sink.inp.dtype) if items else []
            for item, result in zip(items, results):
                self._put(item.unit.param, result.shard, item.representation, report, covered, result.traffic,
                          components=result.components, inter_bytes=result.traffic.sent)
            self._cross_dense(rest, torch.cat([sums[id(s.param)] for s in rest]) if rest else None, report)
        else:
            self._cross_dense(rest, None, report)

    # -- the hops --------------------------------------------------------------------------------
    def _node_sums(self, slots: Sequence[ShardSlot]) -> Dict[int, torch.Tensor]:
        """This rank's chunk of the node's sum (predivided, flat) of each slot."""
        result = self._scatter(self.sink.dense_input(slots))
        out, pos = {}, 0
        for s in slots:
            out[id(s.param)] = result[pos:pos + s.numel]
            pos += s.numel
        return out

    def _cross_dense(self, slots: Sequence[ShardSlot], node_sum: Optional[torch.Tensor],
                     report: ShardedStepReport) -> None:
        """HSDP's own all-reduce between nodes of the node sums of ``slots`` (None: their reduce-scatter
        inside the node first), scaled, written."""
        if not slots:
            return
        if node_sum is None:
            node_sum = self._scatter(self.sink.dense_input(slots))
        handle = self.groups.cross.all_reduce(node_sum, name="dad.replicate.dense", op="sum")
        total = handle.wait().mul_(self.sink.predivide * self.scale)
        self.sink.write_dense(slots, total)
        whole = float(sum(s.numel for s in slots)) or 1.0
        report.params += [filled(self._entry(s.param, DENSE, s), handle.traffic.share(s.numel / whole),
                                 inter_bytes=handle.traffic.sent * s.numel / whole) for s in slots]

    def _exact(self, unit: FactorUnit, counts: RowCounts) -> Tuple[Dict[nn.Parameter, torch.Tensor], object, float]:
        """Rows across nodes, then the column's rows through the sharded exact exchange inside the node."""
        g = self.groups
        world = [list(c) for c in counts]  # by world rank
        codec = ExactCodec(self.route_wire or self.sink.inp.dtype, self.sink.inp.device)
        column = [world[r] for r in g.column(g.shard)]
        stacked, across = codec.gather_rows(unit, self.rows[unit.index], column, g.cross, f"dad.replicate.{unit.name}")
        intra_counts = [[sum(world[r][u] for r in g.column(s)) for u in range(len(unit.uses))]
                        for s in range(g.local)]
        result = codec.exchange_shards(unit, stacked, intra_counts, g.intra, self.scale)
        return result.shards, across + result.traffic, across.sent

    def _entry(self, p: nn.Parameter, representation: str, slot: Optional[ShardSlot] = None) -> ShardedParamReport:
        slot = slot or self.sink.slot(p)
        entry = super()._entry(p, representation, slot)
        entry.level = "replicate"
        R = self.groups.nodes
        entry.replicate_bytes = 2.0 * (R - 1) / R * slot.numel * self.sink.inp.element_size()
        return entry
