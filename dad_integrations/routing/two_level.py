"""Routes across two levels: what a unit costs when only the hop between nodes is compressed.

With ``N`` nodes of ``L`` ranks (`comm.topology`), a two-level step (`exchange.two_level`) moves
each unit through three hops; one local rank, its *owner*, does the unit's work:

1. **to the owner, inside the node** (one all-to-all per bucket): every rank's dense gradient (a
   reduce-scatter: the owner sums the node's) or, for exact factors, every rank's rows;
2. **between nodes, owners only** (over the cross group of the owner's local index): the node's sum
   dense (an all-reduce), as exact factors (an all-gather of the node's rows), as rank-dAD factors
   of the node's sum (an all-gather) or by PowerSGD's all-reduced P and Q;
3. **from the owner, inside the node** (one all-gather per bucket): the average, or where fewer
   bytes the factors it is rebuilt from (P and Q; every node's rank-r factors).

Each hop's bytes are the routes' byte models on the ``two_level`` layout (`routes`). The ``L``
owners of a node run their hop-2 collectives side by side on the one link between nodes, and their
local work side by side too: per unit, hop 2 and the owner's compute count ``1/L`` of their time
(the cross link is measured with every cross group busy at once, so its fitted rate is each
group's share). `TwoLevelTiming.seconds` adds the hops up; `choose_two_level` takes the fastest
route (or the fewest bytes, objective ``"bytes"``), also for ZeRO's partitions across nodes
(`exchange.node_partitions`, the ``node_partitions`` layout, where the engine's reduce-scatter is
the hop between nodes alone), and `compare_levels` compares a whole step of those against the flat
routes' step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.builtin_routes import DENSE
from dad_integrations.comm.topology import Topology
from dad_integrations.config import DADConfig
from dad_integrations.routing.compute_model import ComputeModel
from dad_integrations.routing.link import LinkModel
from dad_integrations.routes import layouts
from dad_integrations.routes.layouts import Layout
from dad_integrations.routes.registry import HopBytes, get_route, routes_for
from dad_integrations.routing.router import UnitShape, candidates_at, choose_at, step_rules, unit_estimates, unit_sizing
from dad_integrations.routing.timing import StepTiming

NodeRows = Sequence[Sequence[int]]  # by node, by use: the rows of every rank of the node


def hop_bytes(rep: str, unit: UnitShape, node_rows: Optional[NodeRows], *, nodes: int, local_size: int,
              config: DADConfig, wire_dtype: torch.dtype) -> HopBytes:
    """`HopBytes` of route ``rep`` for ``unit`` (its byte model on the ``two_level`` layout);
    ``node_rows`` only for ``"exact"``."""
    return get_route(rep).bytes_on(layouts.TWO_LEVEL, unit_sizing(config, unit, node_rows, wire_dtype, nodes=nodes,
                                                                  local=local_size))


@dataclass(frozen=True)
class TwoLevelTiming:
    """The agreed link models of both hops and the compute model (`routing.timing.StepTiming`'s)."""

    intra: LinkModel
    inter: LinkModel
    compute: Optional[ComputeModel] = None

    def seconds(self, rep: str, hops: HopBytes, unit: UnitShape, node_rows: Optional[NodeRows],
                local_size: int, layout: Layout = layouts.TWO_LEVEL) -> float:
        """Predicted seconds of one unit's route over the three hops (owners' share: ``1/L``); on
        ZeRO's partitions across nodes the engine's own reduce-scatter (``dense``) is the hop
        between nodes alone, shared by the node's ``L`` ranks."""
        between = self.inter.seconds(get_route(rep).collective(layout), hops.between, 0) / local_size
        if layout is layouts.NODE_PARTITIONS and rep == DENSE:
            return between
        t = self.intra.seconds("all_to_all", hops.to_owner, 0) + self.intra.seconds("all_gather", hops.from_owner, 0)
        t += between
        if self.compute is not None and rep != DENSE:
            rows = node_rows if node_rows is not None else [[0] * len(unit.kinds)]
            t += self.compute.seconds(rep, unit.shape, rows_by_rank=rows, world_size=len(rows),
                                      calls=len(unit.kinds)) / local_size
        return t


def candidates(config: DADConfig, unit: UnitShape, step: int, *, rows_known: bool, dense_only: bool,
               layout: Layout = layouts.TWO_LEVEL) -> Tuple[str, ...]:
    """The routes ``unit`` may take on ``layout`` in step ``step``: the router's rule
    (`router.candidates_at`) over the routes that run there, exact only where its rows are known."""
    if dense_only:
        return (DENSE,)
    available = [name for name in routes_for(config.routes)
                 if get_route(name).supports(layout)
                 and (not get_route(name).needs_rows or (rows_known and unit.has_factors))]
    return tuple(candidates_at(config, step, available))


def choose_two_level(config: DADConfig, unit: UnitShape, node_rows: Optional[NodeRows], *, step: int,
                     nodes: int, local_size: int, wire_dtype: torch.dtype, timing: Optional[TwoLevelTiming],
                     dense_only: bool = False, layout: Layout = layouts.TWO_LEVEL,
                     engine_itemsize: int = 4) -> Tuple[str, Dict[str, HopBytes], Dict[str, float]]:
    """The route of ``unit`` at two levels (``layout``: two-level DDP's, or ZeRO's partitions
    across nodes with the engine's reduce-scatter in ``engine_itemsize``): `router.choose_at` on
    the bytes between nodes, or by time on the predicted seconds, those bytes breaking ties; returns
    it, every candidate's `HopBytes` and their predicted seconds (empty by bytes). A pure function
    of agreed inputs: every rank decides alike."""
    reps = candidates(config, unit, step, rows_known=node_rows is not None, dense_only=dense_only, layout=layout)
    sizing = unit_sizing(config, unit, node_rows, wire_dtype, nodes=nodes, local=local_size,
                         engine_itemsize=engine_itemsize)
    hops = {rep: get_route(rep).bytes_on(layout, sizing) for rep in reps}
    between = {rep: h.between for rep, h in hops.items()}
    if timing is None or config.objective != "time":
        return choose_at(config, step, between), hops, {}
    seconds = {rep: timing.seconds(rep, h, unit, node_rows, local_size, layout) for rep, h in hops.items()}
    return choose_at(config, step, between, seconds=seconds), hops, seconds


# -- a whole step, flat against two levels ---------------------------------------------------------------
@dataclass(frozen=True)
class LevelUnit:
    """One unit of a step as both levels price it: its shape, the agreed row counts of its last
    size exchange (by rank of the whole group, by use), its wire dtype, and whether it failed its
    first-step check (dense for good, at either level)."""

    shape: UnitShape
    rows_by_rank: Sequence[Sequence[int]]
    wire_dtype: torch.dtype
    dense_only: bool = False


@dataclass(frozen=True)
class LevelChoice:
    """One unit's fastest route flat and at two levels, with what each moves and takes.

    ``flat_bytes`` is what one rank sends on the flat route (`costs.estimate_bytes`); ``seconds``
    at two levels is the owners' share (`TwoLevelTiming.seconds`)."""

    flat_route: str
    flat_seconds: float
    flat_bytes: float
    route: str
    seconds: float
    hops: HopBytes
    node_rows: Optional[NodeRows]


@dataclass(frozen=True)
class LevelComparison:
    """A step's units flat and at two levels (`compare_levels`), and the two steps' seconds."""

    units: Tuple[LevelChoice, ...]
    flat: float
    two_level: float

    @property
    def two_level_faster(self) -> bool:
        """Whether the step runs at two levels: strictly faster predicted (a tie stays flat)."""
        return self.two_level < self.flat


def node_rows_of(rows_by_rank: Sequence[Sequence[int]], topology: Topology) -> List[List[int]]:
    """Rows per node, by use: the sums of each node's ranks' rows (what its owner reduces)."""
    uses = len(rows_by_rank[0]) if rows_by_rank else 0
    return [[sum(rows_by_rank[r][k] for r in ranks) for k in range(uses)] for ranks in topology.nodes]


def flat_choice(config: DADConfig, unit: LevelUnit, *, step: int, world_size: int,
                timing: StepTiming) -> Tuple[str, Dict[str, float], Dict[str, float]]:
    """The flat route of ``unit`` by predicted time, as the router picks it at step ``step``
    (`router.choose_at`; dense for good after a failed check); returns it, every candidate's
    bytes per rank and its seconds."""
    est = unit_estimates(step_rules(config, step)[0], unit.shape, unit.rows_by_rank, world_size, unit.wire_dtype)
    if unit.dense_only:
        est = {DENSE: est[DENSE]}
    seconds = timing.route_seconds(est, shape=unit.shape.shape, uses=len(unit.shape.kinds),
                                   rows_by_rank=unit.rows_by_rank, world_size=world_size)
    return choose_at(config, step, est, seconds=seconds), est, seconds


def compare_levels(config: DADConfig, units: Sequence[LevelUnit], *, step: int, topology: Topology,
                   flat_timing: StepTiming, timing: TwoLevelTiming) -> LevelComparison:
    """Each unit on its fastest route flat (`flat_choice`, on ``flat_timing``: the flat group's
    link spans the nodes) and at two levels (`choose_two_level` on ``timing``), and the two
    steps' predicted seconds: the comparison that decides whether a step runs at two levels
    (`exchange.two_level.TwoLevelExchanger.prefer`). Pure: every rank decides alike."""
    out = []
    for u in units:
        flat, est, flat_seconds = flat_choice(config, u, step=step, world_size=topology.world_size,
                                              timing=flat_timing)
        rows = node_rows_of(u.rows_by_rank, topology) if u.shape.has_factors else None
        rep, hops, seconds = choose_two_level(config, u.shape, rows, step=step, nodes=topology.num_nodes,
                                              local_size=topology.local_size, wire_dtype=u.wire_dtype,
                                              timing=timing, dense_only=u.dense_only)
        out.append(LevelChoice(flat, flat_seconds[flat], est[flat], rep, seconds[rep], hops[rep], rows))
    return LevelComparison(tuple(out), sum(c.flat_seconds for c in out), sum(c.seconds for c in out))
