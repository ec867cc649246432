"""Routes for ZeRO-2/3's partitions across nodes: the engine's flat reduce-scatter, or dAD's routes
between nodes only (`exchange.node_partitions`, three hops).

Each route's bytes per hop are its byte model on the ``node_partitions`` layout (`routes`); the
reduce-scatter's all count as between nodes. Time (`TwoLevelTiming`): both hops inside a node on the
intra link; the bytes between nodes on the inter link, where the L owners of a node (or the L ranks
of the reduce-scatter) share it, so both count ``1/L`` of their node's bytes; by bytes, the fewest
between nodes. A pure function of agreed inputs: every rank decides alike.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from dad_integrations.config import DADConfig
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import HopBytes, get_route, tie_order
from dad_integrations.routing.router import UnitShape
from dad_integrations.routing.two_level import NodeRows, TwoLevelTiming, candidates, level_sizing


def choose_partition_route(config: DADConfig, unit: UnitShape, node_rows: Optional[NodeRows], *, step: int,
                           nodes: int, local_size: int, wire_dtype: torch.dtype, itemsize: int,
                           timing: Optional[TwoLevelTiming], dense_only: bool = False
                           ) -> Tuple[str, Dict[str, HopBytes], Dict[str, float]]:
    """The route of one weight (``node_rows``: by node, by use; None where counts were not agreed,
    which rules out exact factors); returns it, every candidate's hops and their seconds (empty by
    bytes). The candidates are `routing.two_level.candidates`' (mode, rank, lossless steps)."""
    reps = candidates(config, unit, step, rows_known=node_rows is not None, dense_only=dense_only)
    sizing = dataclasses.replace(level_sizing(unit, node_rows, nodes=nodes, local_size=local_size, config=config,
                                              wire_dtype=wire_dtype), engine_itemsize=itemsize)
    hops = {rep: get_route(rep).bytes_on(layouts.NODE_PARTITIONS, sizing) for rep in reps}
    between = {rep: h.between for rep, h in hops.items()}
    if timing is None or config.objective != "time":
        return min(reps, key=lambda k: (between[k], tie_order(k))), hops, {}
    seconds = {}
    for rep, h in hops.items():
        if rep == "dense":
            seconds[rep] = timing.inter.seconds(get_route(rep).collective(layouts.NODE_PARTITIONS), h.between) / local_size
        else:
            seconds[rep] = timing.seconds(rep, h, unit, node_rows, local_size)
    best = min(reps, key=lambda k: (seconds[k], between[k], tie_order(k)))
    return best, hops, seconds
