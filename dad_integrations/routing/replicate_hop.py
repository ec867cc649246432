"""Bytes between nodes per route on HSDP's replicate hop (`exchange.replicate_hop`).

HSDP reduces a weight ``m x n`` in two hops: the reduce-scatter inside a node (L ranks, rank s
keeps ``c = ceil(m/L)`` rows), then an all-reduce of each shard between the R nodes, the hop over
the slow network. dAD takes only the second; these are the bytes one rank sends over it (ring
algorithms, `aggregator.Traffic`'s convention), ``w`` the wire itemsize, ``b`` the gradients':

* ``dense``: HSDP's own all-reduce of the shard, ``2 (R-1)/R c n b`` (biases likewise);
* ``exact``: each rank's own rows all-gathered between nodes, ``(R-1) N (m + n) w`` for N rows a
  rank (padded to the most any rank has); the node's shared side (X, of width n) is never sent
  twice: each rank sends its own rows, and the rows of the node are all-gathered inside it;
* ``rank_allreduce`` (PowerSGD): per power iteration ``2 (R-1)/R r (c + n/L) w`` (P's rows of the
  shard and a 1/L piece of the node's Q); biases dense;
* ``rank`` (rank-dAD of each node's sum): ``(R-1) r (c + n/L) w``; biases dense.

The router compares these as one rank's seconds on the link between nodes (the link is probed on
the replicate group, or given as ``link: {"inter": ...}``).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from dad_integrations.routes import layouts
from dad_integrations.routes.registry import UnitSizing, estimates_on, route_names


def replicate_hop_bytes(*, kinds: Sequence[str], shape, rows: Sequence[int], bias_numel: int, nodes: int, local: int,
                        grad_dtype: torch.dtype, wire_dtype: Optional[torch.dtype], rank: Optional[int],
                        rounds: int = 1, blocks=None) -> Dict[str, float]:
    """Bytes one rank sends between nodes per route for one unit, from each route's byte model on
    the ``replicate_hop`` layout (`routes`). ``rows``: per use, the most rows any rank captured
    (agreed, so every rank decides alike)."""
    sizing = UnitSizing(tuple(kinds), tuple(shape), grad_dtype, wire_dtype, rank=rank or 0, rounds=rounds,
                        bias_numel=bias_numel, blocks=blocks, rows=list(rows), nodes=nodes, local=local)
    return estimates_on(layouts.REPLICATE_HOP, sizing, route_names())
