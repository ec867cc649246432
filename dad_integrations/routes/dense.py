"""``dense``: the gradient as the engine reduces it, the route every unit can take.

All-reduce under DDP and Horovod, ``2 (S-1)/S (m n + biases) b`` per rank; the engine's
reduce-scatter under FSDP2 and ZeRO, ``(S-1) ceil(m/S) n b``; HSDP's all-reduce of the node's shard
between nodes, ``2 (R-1)/R ceil(m/L) n b``. Lossless, no rows, no state, no compute beyond the
engine's own: the baseline every other route is priced against.
"""
from __future__ import annotations

from dad_integrations.builtin_routes import DENSE
from dad_integrations.routes.hops import (node_itemsize, reduce_scatter_bytes, replicate_bias, ring_allreduce_bytes,
                                          shard_bias, to_owner_dense)
from dad_integrations.routes.registry import per_layout, HopBytes, RouteSpec, UnitSizing, register_route


def flat(s: UnitSizing) -> float:
    m, n = s.shape
    return ring_allreduce_bytes((m * n + s.bias_numel) * s.wire.itemsize, s.world_size)


def row_shards(s: UnitSizing) -> float:
    return reduce_scatter_bytes(s.shape, s.world_size, s.grad_dtype.itemsize) + shard_bias(s)


def partitions(s: UnitSizing):
    m, n = s.shape
    S = s.world_size
    dense = float((S - 1) * -(-(m * n) // S) * s.engine_itemsize)
    return dense, dense


def two_level(s: UnitSizing) -> HopBytes:
    m, n = s.shape
    big, b = m * n + s.bias_numel, node_itemsize(s)
    share = (s.local - 1) / s.local
    return HopBytes(to_owner_dense(s), ring_allreduce_bytes(big * b, s.nodes), share * big * b, False)


def node_partitions(s: UnitSizing) -> HopBytes:
    # DeepSpeed's own reduce-scatter over all ranks, all of it counted as between nodes
    m, n = s.shape
    world = s.nodes * s.local
    return HopBytes(0.0, (world - 1) / world * m * n * s.engine_itemsize, 0.0, False)


def replicate_hop(s: UnitSizing) -> float:
    m, n = s.shape
    return ring_allreduce_bytes(-(-m // s.local) * n * s.grad_dtype.itemsize, s.nodes) + replicate_bias(s)


SPEC = register_route(RouteSpec(
    name=DENSE,
    summary="the engine's own reduction of the gradient",
    order=0,
    lossless=True,
    needs_rows=False,
    **per_layout(
        flat=(("all_reduce",), flat),
        row_shards=(("all_to_all",), row_shards),
        partitions=(("all_to_all",), partitions),
        two_level=(("all_to_all", "all_reduce", "all_gather"), two_level),
        node_partitions=(("none", "all_to_all", "none"), node_partitions),
        replicate_hop=(("all_reduce",), replicate_hop),
    ),
    compute=lambda costs, capture, rows, world_size, calls: 0.0,
))
