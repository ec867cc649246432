"""Layouts: where a route runs, as the hops it crosses; and which engine runs on which layout.

A layout names the region a rank rebuilds and the hops its bytes cross. Every route declares, per
layout it supports, the collective it runs on each hop and the bytes it puts there
(`registry.RouteSpec`); a route asked for on a layout it does not declare is refused at attach.

Each engine's choice of layout is declared here too (`ENGINES`, read by the adapters through
`layout_for`), with what a rank keeps of a weight and where error feedback's residuals live
(`RESIDUALS`, which the attach warning about their memory states). The hop table in the docs is
generated from these declarations and the registry (`routes.hop_table`), never written by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

# where a hop runs: its link
GROUP, INSIDE, BETWEEN = "the whole group", "inside a node", "between nodes"

# where a rank route's error-feedback residual of one weight lives (`Layout.residuals`), for the
# docs' table and the attach warning (`codecs.error_feedback.residual_note`)
RESIDUALS: Dict[str, str] = {
    "every_rank": "one whole `m x n` residual per rank-routed weight, on every rank",
    "owner": "one whole `m x n` residual of the node's sum per rank-routed weight, on the weight's owner only "
             "(one rank a node; each owns about `1/L` of the weights)",
    "rows": "each rank its rows of its node's residual, `ceil(m/L) x n`: sharded like the gradient",
}


@dataclass(frozen=True)
class Layout:
    """A layout: its name, its hops in order and the link each crosses, the hop whose collective the
    link model times for a route (``wire_hop``), whether its dense baseline is the engine's
    reduce-scatter, what a rank keeps of a weight's average, where a rank route's residual lives
    (a `RESIDUALS` key) and what the engine's own reduction does inside a node beside dAD's hops."""

    name: str
    hops: Tuple[str, ...]
    links: Tuple[str, ...]
    wire_hop: int = 0
    sharded: bool = False
    keeps: str = ""
    residuals: str = "every_rank"
    engine_inside: str = ""


FLAT = Layout("flat", ("group",), (GROUP,), keeps="the whole averaged gradient")
ROW_SHARDS = Layout("row_shards", ("group",), (GROUP,), sharded=True,
                    keeps="its row block (`Shard(0)`, `ceil(m/S)` rows) of the average")
PARTITIONS = Layout("partitions", ("group",), (GROUP,), sharded=True,
                    keeps="its flat element range (ZeRO's partition) of the average")
TWO_LEVEL = Layout("two_level", ("to_owner", "between", "from_owner"), (INSIDE, BETWEEN, INSIDE), wire_hop=1,
                   keeps="the whole averaged gradient; each weight has one owner a node, which sums the node's "
                         "gradients and alone crosses between nodes", residuals="owner")
NODE_PARTITIONS = Layout("node_partitions", ("to_owner", "between", "from_owner"), (INSIDE, BETWEEN, INSIDE),
                         wire_hop=1, sharded=True,
                         keeps="its flat element range of the average; each weight's owner sums the node's "
                               "gradients and rebuilds the node's stretch", residuals="owner")
REPLICATE_HOP = Layout("replicate_hop", ("between",), (BETWEEN,), sharded=True,
                       keeps="its row block (`ceil(m/L)` rows) of the average, the same on every node; the "
                             "ranks holding the same rows on each node exchange between nodes", residuals="rows",
                       engine_inside="FSDP2's reduce-scatter over the node's ranks before the hop (`dense`, the rank "
                                     "routes); exact factors cross first, then run FSDP2's sharded exact exchange "
                                     "inside the node")

LAYOUTS: Dict[str, Layout] = {x.name: x for x in (FLAT, ROW_SHARDS, PARTITIONS, TWO_LEVEL, NODE_PARTITIONS,
                                                   REPLICATE_HOP)}


@dataclass(frozen=True)
class EngineLayouts:
    """The layouts one adapter runs: ``levels`` holds ``(when, layout)`` pairs, one level first, then
    across nodes where it has a layout of its own; ``engines`` names the engines (and entry points)
    that reach it; ``adapter`` is the module that asks `layout_for`."""

    key: str
    engines: Tuple[str, ...]
    levels: Tuple[Tuple[str, Layout], ...]
    adapter: str


ONE_NODE = "one node, one rank a node, or `topology: \"flat\"`"
NODES = "`N` nodes of `L` ranks (`N, L > 1`)"
ENGINES: Dict[str, EngineLayouts] = {e.key: e for e in (
    EngineLayouts("synchronizer", ("DDP's communication hook", "DADSynchronizer",
                                   "Horovod's DADOptimizer (across nodes: process sets)", "DeepSpeed ZeRO-0 and ZeRO-1",
                                   "Accelerate and the Trainer on DDP or ZeRO-0/1"),
                  ((ONE_NODE, FLAT),
                   (NODES + ": steps at two levels where predicted faster (the first step flat)", TWO_LEVEL)),
                  "dad_integrations.exchange.exchanger"),
    EngineLayouts("fsdp2", ("FSDP2 (1-D mesh)", "Accelerate and the Trainer on FSDP2"),
                  (("any: a 1-D mesh is one level, across nodes too", ROW_SHARDS),), "dad_integrations.fsdp"),
    EngineLayouts("hsdp", ("FSDP2 HSDP (2-D mesh)", "Accelerate and the Trainer on HSDP"),
                  (("a `(\"replicate\", \"shard\")` mesh: shards inside a node, replicas across nodes",
                    REPLICATE_HOP),),
                  "dad_integrations.fsdp"),
    EngineLayouts("zero", ("DeepSpeed ZeRO-2 and ZeRO-3", "Accelerate and the Trainer on ZeRO-2/3"),
                  ((ONE_NODE, PARTITIONS), (NODES, NODE_PARTITIONS)), "deepspeed_dad.zero"),
)}


def layout_for(engine: str, across_nodes: bool = False) -> Layout:
    """The layout adapter ``engine`` (an `ENGINES` key) runs on: its one-level layout, or across
    nodes the last it declares."""
    levels = ENGINES[engine].levels
    return levels[-1][1] if across_nodes else levels[0][1]
