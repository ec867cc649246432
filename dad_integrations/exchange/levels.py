"""The two levels of a job, built once at attach: the topology (`comm.topology`), its intra-node
and cross-node aggregators, each hop's agreed link model, and which local rank owns each unit.

`build_levels` is a collective (it may all-gather the ranks' nodes, every rank enters every
group's creation, and by time `measure_levels` agrees on the slowest figures).
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.comm.topology import Topology
from dad_integrations.config import DADConfig
from dad_integrations.routing.two_level import TwoLevelTiming

log = logging.getLogger(__name__)


@dataclass
class Levels:
    """The groups of a two-level topology, built once at attach (`comm.topology.level_aggregators`),
    and the agreed link models of both hops (None: routes by bytes)."""

    topology: Topology
    intra: FactorAggregator
    cross: FactorAggregator
    timing: Optional[TwoLevelTiming] = None
    measured: bool = False  # the links were measured (not stated): measured again at each refresh


def assign_owners(costs: Sequence[float], local_size: int) -> List[int]:
    """Owner (local index) of each item: largest cost first, to the least loaded owner (ties to
    the lower index), so that each owner gets about ``1/L`` of the work; deterministic."""
    heap = [(0.0, j) for j in range(local_size)]
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, j = heapq.heappop(heap)
        owners[i] = j
        heapq.heappush(heap, (load + costs[i], j))
    return owners


def build_levels(config: DADConfig, aggregator: FactorAggregator, device: torch.device) -> Optional[Levels]:
    """The two levels of ``aggregator``'s group at attach, or None where the job is flat (one node,
    one rank per node, ``topology: "flat"``): the intra-node and cross-node groups and, by time,
    each hop's link (`measure_levels`, unless ``link`` states them). Every rank calls it at the
    same point."""
    from dad_integrations.comm.link_spec import level_link_specs
    from dad_integrations.comm.topology import level_aggregators, resolve_topology
    from dad_integrations.routing.link import LinkModel
    from dad_integrations.routing.timing import wants_timing

    topology = resolve_topology(config.topology, aggregator, device)
    if not topology.two_level:
        return None
    try:
        intra, cross = level_aggregators(topology, aggregator)
    except NotImplementedError as e:
        if config.topology == "auto":
            if aggregator.rank == 0:  # the same on every rank: said once
                log.warning("dAD: %s; the %s run flat", e, topology.describe())
            return None
        raise
    timing = None
    if wants_timing(config):
        levels = level_link_specs(config.link) if config.link is not None else None
        if levels is not None:
            links = [LinkModel.from_spec(levels["intra"]), LinkModel.from_spec(levels["inter"])]
        elif config.link is not None:
            links = [LinkModel.from_spec(config.link)] * 2
        else:
            links = measure_levels(aggregator, intra, cross, device, top_bytes=level_probe_top(config))
        timing = TwoLevelTiming(links[0], links[1])
        if aggregator.rank == 0:  # the details; `describe_hops` says the line users see
            log.debug("dAD: %s; inside a node %s; between nodes %s", topology.describe(), links[0].describe(),
                      links[1].describe())
    return Levels(topology, intra, cross, timing, measured=timing is not None and config.link is None)


def level_probe_top(config: DADConfig) -> int:
    """The largest probe of each hop (`routing.link.probe_top`): a dense bucket, ``bucket_cap_mb``."""
    from dad_integrations.routing.link import probe_top
    return probe_top((), config.bucket_cap_mb * 2 ** 20)


def measure_levels(world: FactorAggregator, intra: FactorAggregator, cross: FactorAggregator,
                   device: torch.device, *, top_bytes: int) -> list:
    """Both hops' link models, probed on every node and every cross group at once (as a step loads
    them) up to ``top_bytes`` (`level_probe_top`) and agreed across the whole group (the slowest
    figures); a collective."""
    from dad_integrations.routing.link import LinkModel, agree_max, probe_link

    local = (probe_link(intra, device, top_bytes=top_bytes).to_list()
             + probe_link(cross, device, top_bytes=top_bytes).to_list())
    agreed = agree_max(world, local, device, name="dad.link.levels")
    k = len(agreed) // 2
    return [LinkModel.from_list(agreed[:k], measured=True), LinkModel.from_list(agreed[k:], measured=True)]


def _nodes_text(nodes: int, local: int) -> str:
    return f"{nodes} node{'s' if nodes != 1 else ''} x {local} rank{'s' if local != 1 else ''}"


def describe_hops(config: DADConfig, aggregator: FactorAggregator, levels: Optional[Levels],
                  link: Optional[Any] = None, *, two_level: Optional[bool] = None,
                  layout: Optional[str] = None) -> str:
    """The attach line of the job's shape and links (`logs.say` shows it on rank 0):
    ``"dAD across 2 nodes x 2 ranks: two levels; inside a node all-reduce 80 Gbit/s, 20 us
    (measured); between nodes all-reduce 1 Gbit/s, 300 us (measured)"``, or one link where the
    steps are flat. ``link``: the flat steps' `routing.link.LinkModel` (None: routes by bytes);
    ``two_level``: whether the adapter runs two-level steps on ``levels`` (default: where built);
    ``layout="HSDP"``: FSDP2 on a 2-D mesh, whose replicate hop between nodes ``link`` times.
    No collective: a flat job's nodes come from the launcher's hint where there is one."""
    from dad_integrations.routing.link import LinkModel

    world = aggregator.world_size
    unmodelled = "mode exact" if config.mode == "exact" else "routes by bytes"
    if link is None and config.link is not None:  # stated: named without a measurement (per hop: the
        link = LinkModel.from_spec(config.link)   # one between nodes, which flat steps cross)
    if levels is not None:
        topo = levels.topology
        shape = _nodes_text(topo.num_nodes, topo.local_size)
        if two_level is None or two_level:
            if levels.timing is None:
                return f"dAD across {shape}: two levels; links not modelled ({unmodelled})"
            return (f"dAD across {shape}: two levels; inside a node {levels.timing.intra.brief()}; "
                    f"between nodes {levels.timing.inter.brief()}")
        why = "flat (this engine's steps here)"
    else:
        hint = aggregator.topology_hint()
        local = hint[1] if hint is not None and hint[1] > 0 and world % hint[1] == 0 else None
        if isinstance(config.topology, int) and world % config.topology == 0:
            local = config.topology
        shape = _nodes_text(world // local, local) if local is not None else f"{world} ranks"
        if config.topology == "flat":
            why = "flat (topology: flat)"
        elif local is not None and world // local > 1 and local == 1:
            why = "flat (one rank per node)"
        elif local is not None and world // local == 1:
            why = "flat (one node)"
        else:
            why = "flat"
    link_text = f"link {link.brief()}" if link is not None else f"link not modelled ({unmodelled})"
    if layout == "HSDP":  # the engine reduces inside a node, dAD's routes run between nodes
        why = "two levels (HSDP: its reduce-scatter inside a node, dAD's routes between nodes)"
        link_text = f"between nodes {link.brief() if link is not None else link_text}"
    return f"dAD across {shape}: {why}; {link_text}"
