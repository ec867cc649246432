"""Layouts: where a route runs, as the hops it crosses.

A layout names the region a rank rebuilds and the hops its bytes cross. Every route declares, per
layout it supports, the collective it runs on each hop and the bytes it puts there
(`registry.RouteSpec`); a route asked for on a layout it does not declare is refused at attach.

==================  =============================================  ==================================
layout              engines                                        hops (dAD's work on the marked one)
==================  =============================================  ==================================
``flat``            DDP's hook, the synchroniser, Horovod, ZeRO-0/1  one group, whole gradients
``row_shards``      FSDP2 (``Shard(0)``)                           one group, each rank's row block
``partitions``      ZeRO-2/3                                       one group, flat element ranges
``two_level``       DDP across nodes                               to the owner, *between nodes*, back
``node_partitions`` ZeRO-2/3 across nodes                          to the owner, *between nodes*, back
``replicate_hop``   FSDP2 HSDP                                     the engine's reduce-scatter in the
                                                                   node, then *between nodes*
==================  =============================================  ==================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Layout:
    """A layout: its name, its hops in order, the hop whose collective the link model times for a
    route (``wire_hop``), and whether its dense baseline is the engine's reduce-scatter."""

    name: str
    hops: Tuple[str, ...]
    wire_hop: int = 0
    sharded: bool = False


FLAT = Layout("flat", ("group",))
ROW_SHARDS = Layout("row_shards", ("group",), sharded=True)
PARTITIONS = Layout("partitions", ("group",), sharded=True)
TWO_LEVEL = Layout("two_level", ("to_owner", "between", "from_owner"), wire_hop=1)
NODE_PARTITIONS = Layout("node_partitions", ("to_owner", "between", "from_owner"), wire_hop=1, sharded=True)
REPLICATE_HOP = Layout("replicate_hop", ("between",), sharded=True)

LAYOUTS: Dict[str, Layout] = {x.name: x for x in (FLAT, ROW_SHARDS, PARTITIONS, TWO_LEVEL, NODE_PARTITIONS,
                                                   REPLICATE_HOP)}
