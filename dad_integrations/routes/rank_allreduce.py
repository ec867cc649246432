"""``rank_allreduce``: PowerSGD's shared power iteration (Vogels et al., 2019).

``P = sum_s M_s Q`` all-reduced, orthonormalised, ``Q' = sum_s M_s^T P`` all-reduced, with ``Q``
the same on every rank and warm-started from the last step, and error feedback: a rank-``r``
approximation of the *average*. Per power iteration (``rounds``), per rank:
``2 (S-1)/S r (m+n) w`` flat, under FSDP2 and ZeRO alike (``P`` and ``Q`` whole: the
orthonormalisation needs every row of ``P``); ``2 (N-1)/N r (m+n) w`` between nodes at two levels;
``2 (R-1)/R r (ceil(m/L) + ceil(n/L)) w`` on HSDP's replicate hop. Local work: ``~4 k m n r``
flops, an orthonormalisation and the rebuild. Biases go densely beside it.
"""
from __future__ import annotations

from dad_integrations.builtin_routes import RANK_ALLREDUCE
from dad_integrations.routes.hops import (between_bias, flat_bias, from_owner, node_itemsize, on_node_partitions,
                                          replicate_bias, ring_allreduce_bytes, shard_bias, to_owner_dense)
from dad_integrations.routes.rank import replicate_piece
from dad_integrations.routes.registry import per_layout, HopBytes, RouteSpec, UnitSizing, register_route


def _pq(s: UnitSizing) -> float:
    """One power iteration's P and Q all-reduced over the flat group, on the wire."""
    m, n = s.shape
    return ring_allreduce_bytes(min(s.rank, m, n) * (m + n) * s.wire.itemsize, s.world_size)


def flat(s: UnitSizing) -> float:
    return s.rounds * _pq(s) + flat_bias(s)


def row_shards(s: UnitSizing) -> float:
    return s.rounds * _pq(s) + shard_bias(s)


def partitions(s: UnitSizing):
    both = s.rounds * float(_pq(s))
    return both, both


def two_level(s: UnitSizing) -> HopBytes:
    m, n = s.shape
    r, b = min(s.rank, m, n), node_itemsize(s)
    between = s.rounds * ring_allreduce_bytes(r * (m + n) * s.wire.itemsize, s.nodes) + between_bias(s)
    back = r * (m + n) * b + s.bias_numel * b  # the shared P and Q
    return HopBytes(to_owner_dense(s), between, *from_owner(s, back))


def replicate_hop(s: UnitSizing) -> float:
    return s.rounds * ring_allreduce_bytes(replicate_piece(s), s.nodes) + replicate_bias(s)


SPEC = register_route(RouteSpec(
    name=RANK_ALLREDUCE,
    summary="PowerSGD's all-reduced P and Q: rank r of the average",
    order=2,
    lossless=False,
    needs_rows=False,
    rank_route="allreduce",
    state=("warm_start", "error_feedback"),
    **per_layout(
        flat=(("all_reduce",), flat),
        row_shards=(("all_reduce",), row_shards),
        partitions=(("all_reduce",), partitions),
        two_level=(("all_to_all", "all_reduce", "all_gather"), two_level),
        node_partitions=(("all_to_all", "all_reduce", "all_to_all"), on_node_partitions(two_level)),
        replicate_hop=(("all_reduce",), replicate_hop),
    ),
    compute=lambda costs, capture, rows, world_size, calls: costs.rank_allreduce,
))
