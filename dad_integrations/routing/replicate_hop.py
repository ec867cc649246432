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

from dad_integrations.codecs.wire import exact_block_specs, packed_size, sharded_exact_covers
from dad_integrations.comm.aggregator import ring_allreduce_bytes


def replicate_hop_bytes(*, kinds: Sequence[str], shape, rows: Sequence[int], bias_numel: int, nodes: int, local: int,
                        grad_dtype: torch.dtype, wire_dtype: Optional[torch.dtype], rank: Optional[int],
                        rounds: int = 1, blocks=None) -> Dict[str, float]:
    """Bytes one rank sends between nodes per route for one unit (module doc). ``rows``: per use, the most
    rows any rank captured (agreed, so every rank decides alike)."""
    m, n = shape
    R, L = nodes, local
    c = -(-m // L)
    gb = grad_dtype.itemsize
    wire = wire_dtype or grad_dtype
    bias = ring_allreduce_bytes(-(-bias_numel // L) * gb, R) if bias_numel else 0.0
    out = {"dense": ring_allreduce_bytes(c * n * gb, R) + bias}
    if sharded_exact_covers(kinds, blocks):
        out["exact"] = (R - 1) * float(packed_size(exact_block_specs(kinds, shape, list(rows), wire, blocks)))
    if rank:
        r = min(rank, m, n)
        piece = r * (c + -(-n // L)) * wire.itemsize
        out["rank"] = (R - 1) * piece + bias
        out["rank_allreduce"] = rounds * ring_allreduce_bytes(piece, R) + bias
    return out
