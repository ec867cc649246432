"""A sharded step before any launch: per weight the route auto takes under FSDP2, HSDP or ZeRO-3,
and per hop the bytes one rank sends and the seconds they take.

    python -m dad_integrations.plan --model llama-7b-geometry --sites 64 --tokens-per-rank 4096 \\
        --rank 4 --sharded --engine zero3 --bandwidth 100gbit --compute-tflops 67 --compute-memory-bw 3.35TB/s

The engines' own reduction is a reduce-scatter: each rank keeps its shard of the average. dAD takes
it over per weight (`exchange.sharded`); the planner routes each weight as that exchanger does, on
the same layout (`routes.layouts`) and with the same byte models, link and compute models:

- **FSDP2** (a 1-D mesh; `row_shards`): one hop over the whole group. Each route's bytes on the
  row shards (`router.unit_estimates` with ``sharded=True``), the reduce-scatter of ``ceil(m/S)``
  rows per rank the baseline.
- **ZeRO-3** (`partitions`): one hop; every parameter is cut into ``S`` flat ranges of
  ``ceil(m n / S)`` elements (`zero3_ranges`, DeepSpeed's ``partition_numel``), and the routes are
  weighed on the busiest rank's bytes, ties by the mean (`exchange.partitions.PartitionCall.estimates`).
  An embedding's ids are spread evenly over the ranges (`zero3_counts`). ZeRO-2 cuts one flat
  buffer of a whole parameter group instead: a weight may then lie in one rank's range, so its exact
  factors cost more on that rank than this plan says.
- **HSDP** (a ``(replicate, shard)`` mesh, ``N`` nodes of ``L`` ranks; `replicate_hop`): two hops.
  Inside a node, FSDP2's reduce-scatter over the ``L`` ranks (dense, the rank routes and biases),
  or, for exact factors, the column's rows (``N`` times one rank's) through the 1-D sharded exact
  exchange; between nodes, each route's bytes on the replicate hop, by which the exchanger routes
  (`exchange.replicate_hop.ReplicateHopCall.estimates`, timed on the inter-node link). Not counted
  inside the node: the rank routes' own small collectives there (the power iteration's sums over
  the node's row shards, ``Q``'s pieces gathered), ``r (m + n)``-sized against the reduce-scatter's
  ``m n``, which the exchanger's routing does not price either.

Seconds per weight: each hop's bytes over its link (`link.LinkModel.seconds`, the route's collective
on the row shards, `timing.collective_of`), plus the route's local compute (`compute_model`) and,
where the routes need them, the agreed row counts (one small all-gather per reduction call, its bytes
counted here, its latency not: the planner does not know the engine's calls). The engine's plain
reduce-scatter is priced on the same links: ``engine`` beside ``dad``.

Memory per rank is `routing.memory.plan_memory`'s table, over the routes chosen by time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE, EXACT
from dad_integrations.codecs.exact import covering_rows, sharded_exact_covers
from dad_integrations.config import DADConfig
from dad_integrations.routes import layouts
from dad_integrations.routes.exact import sharded_exact_bytes
from dad_integrations.routes.hops import reduce_scatter_bytes
from dad_integrations.routes.registry import estimates_on, get_route, routes_for
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.router import (RouteContext, UnitEvidence, UnitShape, route, sharded_needs_counts,
                                             unit_estimates, unit_sizing)
from dad_integrations.routing.planner import (ShardedStepPlan, ShardedUnitRow, _mb, _ms, _table, route_counts,
                                              unit_kind, unit_rows)
from dad_integrations.routing.timing import StepTiming, collective_of

ENGINES = {"fsdp2": "FSDP2", "zero3": "ZeRO-3"}   # --engine -> the name in the plan's lines
Range = Tuple[int, int]


@dataclass
class ShardedUnitTime:
    """One weight (or the parameters outside the units) in a sharded step: per hop the bytes one
    rank sends and their seconds, dAD's and the engine's; ``compute``: the route's local seconds."""

    name: str
    shape: Tuple[int, int]
    route: str
    bytes: Dict[str, float]
    seconds: Dict[str, float]
    compute: float
    engine_bytes: Dict[str, float]
    engine_seconds: Dict[str, float]
    rows: List[int] = field(default_factory=list)   # rows per use
    kind: str = ""                                   # the layer kind (`planner.unit_kind`)
    counts_bytes: float = 0.0                        # its share of the call's agreed row counts

    @property
    def dad_seconds(self) -> float:
        return sum(self.seconds.values()) + self.compute


@dataclass
class ShardedTimePlan:
    """A sharded steady-state step by predicted time: the engine and layout, the hops, per weight
    `ShardedUnitTime`, the row counts' exchange, the totals per hop and the step against the
    engine's own reduce-scatter; ``seconds`` are None where no timing was given (by bytes)."""

    engine: str
    layout: str
    hops: List[str]
    units: List[ShardedUnitTime]
    other: ShardedUnitTime
    counts_bytes: float
    counts_seconds: float
    dense_params: int = 0      # parameters outside the units (always the engine's reduction)
    counts: Dict[str, int] = field(default_factory=dict)
    hop_bytes: Dict[str, float] = field(default_factory=dict)
    hop_seconds: Dict[str, float] = field(default_factory=dict)
    engine_hop_bytes: Dict[str, float] = field(default_factory=dict)
    engine_hop_seconds: Dict[str, float] = field(default_factory=dict)
    dad: float = 0.0           # predicted seconds of dAD's step (wire, compute, counts)
    engine_total: float = 0.0  # predicted seconds of the engine's plain reduce-scatter


def zero3_ranges(numel: int, world_size: int) -> List[Range]:
    """ZeRO-3's owned ``[lo, hi)`` of one parameter's ``numel`` elements on each of ``world_size``
    ranks: ``partition_numel = ceil(numel / S)`` each, the last ones short or empty."""
    size = -(-numel // world_size)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(world_size)]


def zero3_counts(kinds: Sequence[str], shape: Tuple[int, int], rows: Sequence[int],
                 ranges: Sequence[Range]) -> List[List[int]]:
    """One rank's counts per use as ZeRO's exchange agrees them (`codecs.exact.use_counts`):
    ``[rows]``, and for an embedding use the ids falling in each range's covering rows, spread
    evenly over the table (the planner knows no ids)."""
    m, n = shape
    out = []
    for kind, k in zip(kinds, rows):
        c = [int(k)]
        if kind == "embedding":
            c += [round(k * (r1 - r0) / m) for r0, r1 in (covering_rows(lo, hi, n) for lo, hi in ranges)]
        out.append(c)
    return out


@functools.lru_cache(maxsize=4096)
def _zero3_estimates(config: DADConfig, shape: UnitShape, use: Tuple[int, ...], world_size: int, itemsize: int):
    """ZeRO-3's estimates of one unit, busiest rank and mean (as `exchange.partitions.PartitionCall`
    weighs them), as tuples of items (hashable, so cached): the layers of a model repeat their
    shapes, and pricing ``S x S`` destinations once per shape keeps a 64-rank plan of a 7B model
    within seconds."""
    s = world_size
    ranges = zero3_ranges(shape.shape[0] * shape.shape[1], s)
    exact = sharded_exact_covers(shape.kinds, shape.blocks)
    counts = [zero3_counts(shape.kinds, shape.shape, list(use), ranges)] * s if shape.has_factors else None
    sizing = unit_sizing(config, shape, None, shape.dtype, world_size=s, engine_itemsize=itemsize, counts=counts,
                         ranges=ranges)
    names = [k for k in routes_for(config.routes) if exact or not get_route(k).needs_rows]
    pairs = estimates_on(layouts.PARTITIONS, sizing, names)
    return tuple((k, v[0]) for k, v in pairs.items()), tuple((k, v[1]) for k, v in pairs.items())


class _Layout:
    """How one engine's layout prices a unit: its estimates to route by, each hop's bytes for the
    chosen route, and the engine's own per hop."""

    def __init__(self, engine: str, config: DADConfig, world_size: int, dtype: torch.dtype, nodes: int, local: int):
        self.engine, self.config, self.S, self.dtype = engine, config, world_size, dtype
        self.item, self.nodes, self.local = dtype.itemsize, nodes, local
        self.layout = (layouts.PARTITIONS if engine == "zero3" else
                       layouts.REPLICATE_HOP if nodes > 1 else layouts.ROW_SHARDS)
        self.hops = ["inside", "between"] if self.layout is layouts.REPLICATE_HOP else ["group"]

    def shape(self, u) -> UnitShape:
        if self.engine == "zero3":  # biases are parameters of their own to ZeRO
            return UnitShape(tuple(u.kinds), u.shape, 0, self.dtype, u.blocks)
        return UnitShape.of(u, self.dtype)

    def counts_bytes(self, shape: UnitShape, ranges) -> float:
        """What the unit adds to its call's agreed row counts (an all-gather of int64)."""
        if not shape.has_factors:
            return 0.0
        ints = (sum(len(c) for c in zero3_counts(shape.kinds, shape.shape, [0] * len(shape.kinds), ranges))
                if self.engine == "zero3" else len(shape.kinds))
        return (self.S - 1) * 8.0 * ints

    def estimates(self, shape: UnitShape, use: List[int], ranges):
        """The bytes the exchanger routes the unit by, and their ties (ZeRO: busiest rank, mean)."""
        cfg, s = self.config, self.S
        if self.engine == "zero3":
            busiest, mean = _zero3_estimates(cfg, shape, tuple(use), s, self.item)
            return dict(busiest), dict(mean)
        if self.layout is layouts.REPLICATE_HOP:
            sizing = unit_sizing(cfg, shape, use, self.dtype, nodes=self.nodes, local=self.local)
            return estimates_on(layouts.REPLICATE_HOP, sizing, routes_for(cfg.routes)), None
        return None, None  # FSDP2: the router's own (`router.unit_estimates`, row shards)

    def inside(self, shape: UnitShape, use: List[int], rep: str) -> float:
        """HSDP's hop inside a node: dAD's bytes per rank for ``rep`` (module doc)."""
        if rep != EXACT:  # the node's reduce-scatter
            return self._reduce_scatter(shape.shape, shape.bias_numel, self.local)
        column = [[self.nodes * k for k in use]] * self.local   # every node's rows of the same shard
        return sharded_exact_bytes(unit_sizing(self.config, shape, column, self.dtype, world_size=self.local))

    def _reduce_scatter(self, shape: Tuple[int, int], bias_numel: int, group: int) -> float:
        """FSDP2's reduce-scatter of a weight and its biases over ``group`` ranks, per rank."""
        bias = reduce_scatter_bytes((bias_numel,), group, self.item) if bias_numel else 0.0
        return reduce_scatter_bytes(shape, group, self.item) + bias

    def engine_bytes(self, shape: Tuple[int, int], bias_numel: int = 0) -> Dict[str, float]:
        """The engine's own reduction of a weight (and its biases) per hop."""
        S, b = self.S, self.item
        if self.engine == "zero3":
            numel = shape[0] * shape[1]
            return {"group": float((S - 1) * -(-numel // S) * b)
                    + (float((S - 1) * -(-bias_numel // S) * b) if bias_numel else 0.0)}
        if self.layout is layouts.REPLICATE_HOP:  # inside the node, then the shard's all-reduce between nodes
            sizing = unit_sizing(self.config, UnitShape((), shape, bias_numel, self.dtype), None, self.dtype,
                                 nodes=self.nodes, local=self.local)
            return {"inside": self._reduce_scatter(shape, bias_numel, self.local),
                    "between": get_route(DENSE).bytes_on(layouts.REPLICATE_HOP, sizing)}
        return {"group": self._reduce_scatter(shape, bias_numel, S)}


def sharded_time_plan(plan, *, engine: str, tokens: int, positions: int, world_size: int, mode: str,
                      rank: Optional[int], rank_route: str = DADConfig.rank_route, dtype: torch.dtype = torch.float32,
                      timing: Optional[StepTiming] = None, intra: Optional[LinkModel] = None, nodes: int = 1,
                      rows=None) -> ShardedTimePlan:
    """A steady-state step of ``plan`` under ``engine`` (`ENGINES`) on ``world_size`` ranks, or on
    ``nodes`` nodes (FSDP2: HSDP), each weight routed as the sharded exchanger routes it: by
    predicted time with a ``timing`` (the link between nodes under HSDP; ``intra`` prices the hop
    inside a node), else by bytes. Per weight and per hop, dAD's bytes and seconds against the
    engine's reduce-scatter (module doc)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown sharded engine {engine!r}; engines: {', '.join(ENGINES)}")
    if nodes > 1 and engine != "fsdp2":
        raise ValueError(f"{ENGINES[engine]} across nodes (node partitions) is not planned in this version: "
                         "plan it on --sites, or plan FSDP2's HSDP")
    if nodes > 1 and (world_size % nodes or intra is None):
        raise ValueError("HSDP: the sites must be whole nodes, and the link inside a node stated")
    s, local = world_size, world_size // nodes
    config = DADConfig(mode=mode, rank=rank, rank_route=rank_route,
                       objective="time" if timing is not None else "bytes")
    lay = _Layout(engine, config, s, dtype, nodes, local)
    ctx = RouteContext(config, world_size=s, wire_dtype=dtype, step=config.lossless_steps, sharded=True,
                       timing=timing)
    links = {"group": timing.link if timing else None, "between": timing.link if timing else None, "inside": intra}
    needs_counts = sharded_needs_counts(config, step=config.lossless_steps)

    def secs(hop: str, rep: str, nbytes: float) -> float:
        # exact factors pay a call's latency on their wire hop, as `StepTiming.route_seconds` counts
        link, calls = links[hop], int(rep == EXACT and hop != "inside")
        return 0.0 if link is None else link.seconds(collective_of(rep, sharded=True), nbytes, calls)

    units: List[ShardedUnitTime] = []
    counts_bytes = 0.0
    for u in plan.units:
        shape = lay.shape(u)
        use = unit_rows(u, tokens, positions, rows)
        by_rank = [use] * s
        ranges = zero3_ranges(shape.shape[0] * shape.shape[1], s) if engine == "zero3" else None
        est, ties = lay.estimates(shape, use, ranges)
        rep = route(ctx, shape, UnitEvidence(rows_by_rank=by_rank, estimates=est, ties=ties)).representation
        if est is None:  # FSDP2: what the router priced
            est = unit_estimates(config, shape, by_rank, s, dtype, sharded=True)
        engine_b = lay.engine_bytes(shape.shape, shape.bias_numel)
        if lay.layout is layouts.REPLICATE_HOP:
            dad_b = {"inside": lay.inside(shape, use, rep), "between": est[rep]}
        else:
            dad_b = {"group": est[rep]}
        if engine == "zero3" and u.bias_numel:  # ZeRO reduce-scatters the biases as parameters of their own
            bias = lay.engine_bytes((u.bias_numel, 1))["group"]
            dad_b["group"] += bias
            engine_b["group"] += bias
        own_counts = lay.counts_bytes(shape, ranges) if needs_counts else 0.0
        counts_bytes += own_counts
        compute = 0.0
        if timing is not None:
            compute = timing.compute.seconds(rep, shape.shape, rows_by_rank=by_rank if shape.has_factors else
                                             [[0] * len(shape.kinds)] * s, world_size=s, calls=len(shape.kinds))
            compute += timing.overhead_s if rep != DENSE else 0.0
        units.append(ShardedUnitTime(
            u.name, tuple(shape.shape), rep, dad_b, {h: secs(h, rep, b) for h, b in dad_b.items()}, compute,
            engine_b, {h: secs(h, DENSE, b) for h, b in engine_b.items()}, use, unit_kind(u), own_counts))
    other_b: Dict[str, float] = {h: 0.0 for h in lay.hops}
    for _, p in plan.dense:
        shape = (p.shape[0], math.prod(p.shape[1:])) if p.dim() > 1 else (p.numel(), 1)
        for h, b in lay.engine_bytes(shape).items():
            other_b[h] += b
    other = ShardedUnitTime(f"other parameters ({len(plan.dense)})", (0, 0), DENSE, dict(other_b),
                            {h: secs(h, DENSE, b) for h, b in other_b.items()}, 0.0, dict(other_b),
                            {h: secs(h, DENSE, b) for h, b in other_b.items()})
    counts_s = timing.link.seconds("all_gather", counts_bytes, 0) if timing is not None else 0.0
    everything = units + [other]
    out = ShardedTimePlan(ENGINES[engine] if lay.layout is not layouts.REPLICATE_HOP else "HSDP", lay.layout.name,
                          lay.hops, units, other, counts_bytes, counts_s, len(plan.dense), counts=route_counts(units))
    for h in lay.hops:
        out.hop_bytes[h] = sum(r.bytes[h] for r in everything)
        out.hop_seconds[h] = sum(r.seconds[h] for r in everything)
        out.engine_hop_bytes[h] = sum(r.engine_bytes[h] for r in everything)
        out.engine_hop_seconds[h] = sum(r.engine_seconds[h] for r in everything)
    out.dad = sum(r.dad_seconds for r in everything) + counts_s
    out.engine_total = sum(out.engine_hop_seconds.values())
    return out


def as_step_plan(tp: ShardedTimePlan) -> ShardedStepPlan:
    """``tp`` as the sharded byte table's plan (`planner.render_sharded`): per weight its bytes over
    every hop with its row counts, beside the engine's."""
    units = [ShardedUnitRow(r.name, r.shape, r.rows, r.route, sum(r.bytes.values()) + r.counts_bytes,
                            sum(r.engine_bytes.values()), r.kind) for r in tp.units]
    other = sum(tp.other.engine_bytes.values())
    return ShardedStepPlan(units=units, dense_params=tp.dense_params,
                           dense_reduce_scatter=other, total=other + sum(u.dad for u in units),
                           reduce_scatter=other + sum(u.reduce_scatter for u in units), counts=dict(tp.counts))


def render_sharded_time(tp: ShardedTimePlan, links: Dict[str, LinkModel], compute_note: str) -> str:
    """The sharded plan by time as a text table: per weight its route, per hop MB and ms, its
    compute, dAD's seconds, and the engine's bytes and seconds; then per hop and in total."""
    eng = tp.engine
    columns = [("route", 14)] + [c for h in tp.hops for c in ((f"{h} MB", 10), (f"{h} ms", 9))] + [
        ("compute ms", 10), ("dAD ms", 9), (f"{eng} MB", max(9, len(eng) + 3)), (f"{eng} ms", max(9, len(eng) + 3))]

    def line(r: ShardedUnitTime) -> List[str]:
        return [r.name, r.route, *[c for h in tp.hops for c in (_mb(r.bytes[h]), _ms(r.seconds[h]))],
                _ms(r.compute), _ms(r.dad_seconds), _mb(sum(r.engine_bytes.values())),
                _ms(sum(r.engine_seconds.values()))]

    rows = [line(r) for r in tp.units + [tp.other]]
    total = ["total", "", *[c for h in tp.hops for c in (_mb(tp.hop_bytes[h]), _ms(tp.hop_seconds[h]))],
             _ms(sum(r.compute for r in tp.units)), _ms(tp.dad - tp.counts_seconds),
             _mb(sum(tp.engine_hop_bytes.values())), _ms(tp.engine_total)]
    footer = ["routes: " + ", ".join(f"{v} {k}" for k, v in sorted(tp.counts.items()))]
    footer += [f"hop {h} ({links[h].brief()}): dAD {_mb(tp.hop_bytes[h])} MB in {_ms(tp.hop_seconds[h])} ms; "
               f"{eng} {_mb(tp.engine_hop_bytes[h])} MB in {_ms(tp.engine_hop_seconds[h])} ms" for h in tp.hops]
    footer.append(f"row counts agreed: {_mb(tp.counts_bytes)} MB, {_ms(tp.counts_seconds)} ms (an all-gather per "
                  "reduction call; its latency not counted)")
    ratio = f" ({tp.dad / tp.engine_total:.3f}x)" if tp.engine_total > 0 else ""
    footer.append(f"predicted step: dAD {_ms(tp.dad)} ms, {eng}'s own reduction {_ms(tp.engine_total)} ms{ratio}")
    header = (f"predicted {eng} step beyond compute, per rank ({tp.layout} layout; MB one rank sends per hop); "
              f"{compute_note}")
    return _table(header, columns, rows, total, footer)
