"""``rank``: rank-dAD, each rank's own rank-``r`` factors all-gathered.

Each site reduces its gradient (plus its error-feedback residual) to ``P_s Q_s^T`` by a power
iteration warm-started from its last ``Q_s``, sends ``r (m+n)`` numbers, and every rank rebuilds
``(1/S) sum_s P_s Q_s^T``, a rank-``S r`` matrix. Lossy, with error feedback; no rows needed.

- flat: ``(S-1) r (m+n) w`` (an all-gather), rebuild ``2 S r m n`` flops;
- row shards (FSDP2) and ZeRO's partitions: ``(P_s^T, Q_s^T)`` as ``r`` rows of a linear use, through
  the exact codec's exchange (`routes.exact`), under row shards ``(S-1) r (n + ceil(m/S)) w``;
- two levels: the node's sum reduced once by its owner, ``(N-1) r (m+n) w`` between nodes;
- HSDP's replicate hop: ``(R-1) r (ceil(m/L) + ceil(n/L)) w`` between nodes.

Biases go densely beside it.
"""
from __future__ import annotations

from dataclasses import replace

from dad_integrations.builtin_routes import RANK
from dad_integrations.codecs.exact import exchange_bytes
from dad_integrations.codecs.wire import packed_size, rank_block_specs
from dad_integrations.routes.exact import sharded_exact_bytes
from dad_integrations.routes.hops import (between_bias, flat_bias, from_owner, node_itemsize,
                                          on_node_partitions, replicate_bias, shard_bias, to_owner_dense)
from dad_integrations.routes.registry import per_layout, HopBytes, RouteSpec, UnitSizing, register_route


def _r(s: UnitSizing) -> int:
    m, n = s.shape
    return min(s.rank, m, n)


def flat(s: UnitSizing) -> float:
    return (s.world_size - 1) * packed_size(rank_block_specs(s.shape, _r(s), s.wire_dtype)) + flat_bias(s)


def row_shards(s: UnitSizing) -> float:
    return sharded_exact_bytes(replace(s, kinds=("linear",), rows=[[_r(s)]] * s.world_size)) + shard_bias(s)


def partitions(s: UnitSizing):
    return exchange_bytes(("linear",), s.shape, [[[_r(s)]]] * s.world_size, s.ranges, s.wire_dtype)


def two_level(s: UnitSizing) -> HopBytes:
    m, n = s.shape
    r, b = _r(s), node_itemsize(s)
    between = (s.nodes - 1) * r * (m + n) * s.wire.itemsize + between_bias(s)
    back = s.nodes * r * (m + n) * b + s.bias_numel * b  # every node's factors
    return HopBytes(to_owner_dense(s), between, *from_owner(s, back))


def replicate_piece(s: UnitSizing) -> float:
    """Bytes of one node's ``P`` rows of a shard and a ``1/L`` piece of its ``Q``."""
    m, n = s.shape
    return _r(s) * (-(-m // s.local) + -(-n // s.local)) * s.wire.itemsize


def replicate_hop(s: UnitSizing) -> float:
    return (s.nodes - 1) * replicate_piece(s) + replicate_bias(s)


SPEC = register_route(RouteSpec(
    name=RANK,
    summary="each rank's own rank-r factors, all-gathered (rank-dAD)",
    order=3,
    lossless=False,
    needs_rows=False,
    rank_route="allgather",
    state=("warm_start", "error_feedback"),
    **per_layout(
        flat=(("all_gather",), flat),
        row_shards=(("all_gather",), row_shards),
        partitions=(("all_to_all",), partitions),
        two_level=(("all_to_all", "all_gather", "all_gather"), two_level),
        node_partitions=(("all_to_all", "all_to_all", "all_to_all"), on_node_partitions(two_level)),
        replicate_hop=(("all_gather",), replicate_hop),
    ),
    compute=lambda costs, capture, rows, world_size, calls: costs.rank,
))
