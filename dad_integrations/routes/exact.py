"""``exact``: dAD's factors, the lossless route (Baker et al., arXiv 2102.09631).

Each rank sends its captured rows, input ``X_s`` and output gradient ``D_s`` (ids for an
embedding), and every rank rebuilds the average ``(1/S) sum_s D_s^T X_s`` exactly. It needs every
rank's row count agreed first (a size exchange) and costs:

- flat: ``(S-1) max_s N_s (m+n) w`` (an all-gather, padded to the longest rank), rebuild
  ``2 S N m n`` flops;
- row shards (FSDP2): every ``X_s`` all-gathered, each rank's columns of every ``D_s`` by
  all-to-all, ``(S-1) N (n + ceil(m/S)) w``;
- ZeRO's partitions: the covering rows of each rank's range, one all-to-all (`exchange_bytes`);
- two levels: every rank's rows to the owner, the node's rows all-gathered between nodes,
  ``(N-1) max_k R_k (m+n) w``, the average back.

Bytes come from the same block specs the codecs pack (`codecs.exact.exact_block_specs`).
"""
from __future__ import annotations

from typing import Optional

from dad_integrations.builtin_routes import EXACT
from dad_integrations.codecs.exact import exact_block_specs, exchange_bytes, longest, shard_span, sharded_exact_covers
from dad_integrations.codecs.wire import packed_size
from dad_integrations.routes.hops import node_itemsize, on_node_partitions
from dad_integrations.routes.registry import per_layout, HopBytes, RouteSpec, UnitSizing, register_route


def _packed(s: UnitSizing, rows, wire) -> int:
    return packed_size(exact_block_specs(s.kinds, s.shape, list(rows), wire, s.blocks))


def flat(s: UnitSizing) -> Optional[float]:
    if not s.kinds or s.rows is None:
        return None
    return (s.world_size - 1) * max(_packed(s, r, s.wire_dtype) for r in s.rows)


def sharded_exact_bytes(s: UnitSizing) -> float:
    """Bytes one rank receives in `ExactCodec.exchange_shards` of one unit."""
    S = s.world_size
    if "embedding" in s.kinds:  # whole factors, all-gathered
        return (S - 1) * max(packed_size(exact_block_specs(s.kinds, s.shape, r, s.wire)) for r in s.rows)
    m, n = s.shape
    return (S - 1) * sum(longest(s.rows)) * (n + shard_span(0, S, m)[2]) * s.wire.itemsize


def row_shards(s: UnitSizing) -> Optional[float]:
    if s.rows is None or not sharded_exact_covers(s.kinds, s.blocks):
        return None
    return sharded_exact_bytes(s)


def partitions(s: UnitSizing):
    if not s.counts:
        return None
    return exchange_bytes(s.kinds, s.shape, s.counts, s.ranges, s.wire_dtype, s.blocks)


def two_level(s: UnitSizing) -> Optional[HopBytes]:
    if not s.kinds or s.rows is None:
        return None
    m, n = s.shape
    packed = [_packed(s, r, s.wire_dtype) for r in s.rows]
    share = (s.local - 1) / s.local
    back = (m * n + s.bias_numel) * node_itemsize(s)
    return HopBytes(share * sum(packed) / s.nodes, (s.nodes - 1) * max(packed), share * back, False)


def replicate_hop(s: UnitSizing) -> Optional[float]:
    if s.rows is None or not sharded_exact_covers(s.kinds, s.blocks):
        return None
    return (s.nodes - 1) * float(_packed(s, s.rows, s.wire))


def compute(costs, capture: float, rows, world_size: int, calls: int) -> float:
    """The capture hooks on every call and a rebuild of ``2 S N m n`` flops, linear in the rows."""
    longest = max((sum(r) for r in rows), default=0)
    return costs.exact_per_row * world_size * longest + capture * calls


SPEC = register_route(RouteSpec(
    name=EXACT,
    summary="every rank's captured factors, rebuilt exactly (dAD)",
    order=1,
    lossless=True,
    needs_rows=True,
    **per_layout(
        flat=(("all_gather",), flat),
        row_shards=(("all_gather",), row_shards),
        partitions=(("all_to_all",), partitions),
        two_level=(("all_to_all", "all_gather", "all_gather"), two_level),
        node_partitions=(("all_to_all", "all_to_all", "all_to_all"), on_node_partitions(two_level)),
        replicate_hop=(("all_gather",), replicate_hop),
    ),
    compute=compute,
))
