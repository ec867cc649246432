"""The cost model: bytes each route of one unit puts on the wire, read from the route registry.

Every input here is agreed by all ranks (shapes, the config, every rank's row counts from a size
exchange), so every rank estimates the same numbers; `router.route` decides from them, and the
planner and the benchmarks call the same functions. The formulas are the routes' own
(`dad_integrations.routes`: one module per route, its bytes per layout); this module adapts them to
the flat and FSDP2 callers, and keeps PyTorch's PowerSGD hook's bytes (the byte guarantee's
reference) and the size exchange's.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from dad_integrations.comm.aggregator import ring_allreduce_bytes
from dad_integrations.routes import layouts
from dad_integrations.routes.hops import reduce_scatter_bytes  # noqa: F401  (re-exported: callers import it here)
from dad_integrations.routes.registry import UnitSizing, estimates_on, routes_for

Blocks = Optional[Sequence[Optional[Tuple[int, int]]]]


def estimate_bytes(*, kinds: Sequence[str], shape: Tuple[int, int], rows_by_rank: Sequence[Sequence[int]],
                   bias_numel: int, grad_dtype: torch.dtype, wire_dtype: Optional[torch.dtype], world_size: int,
                   rank: int = 0, rounds: int = 1, blocks: Blocks = None, names: Optional[Sequence[str]] = None,
                   layout: layouts.Layout = layouts.FLAT) -> Dict[str, float]:
    """Estimated bytes this rank receives for each route of one unit on ``layout`` (each route's own
    byte model, `routes`); ``rounds``: the rank-r all-reduce's P and Q rounds per step
    (``DADConfig.power_iterations``); ``blocks``: the uses' row blocks; ``names``: the routes to
    price (`routes.registry.routes_for`: the built-in ones by default). A unit without uses (no
    ``kinds``) has no exact factors."""
    sizing = UnitSizing(tuple(kinds), tuple(shape), grad_dtype, wire_dtype, rank=rank or 0, rounds=rounds,
                        bias_numel=bias_numel, blocks=blocks, rows=rows_by_rank, world_size=world_size)
    return estimates_on(layout, sizing, routes_for() if names is None else names)


def powersgd_bytes(shape: Sequence[int], rank: int, world_size: int, itemsize: int,
                   min_compression_rate: float = 2.0) -> Tuple[float, bool]:
    """Bytes one rank sends for one parameter under PyTorch's PowerSGD DDP hook, in steady state,
    and whether the hook compresses it: tensors of 2 or more dimensions, viewed as
    ``(shape[0], rest)``, are compressed when ``min_compression_rate * r (m+n) < m n`` (the hook's
    ``_should_compress``); the others are all-reduced as they are."""
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) >= 2:
        m, n = shape[0], numel // shape[0]
        r = min(rank, m, n)
        if min_compression_rate * r * (m + n) < m * n:
            return ring_allreduce_bytes(r * (m + n) * itemsize, world_size), True
    return ring_allreduce_bytes(numel * itemsize, world_size), False


def size_exchange_bytes(uses: int, world_size: int) -> float:
    """Bytes one rank sends in a unit's size exchange (an all-gather of ``2 + uses`` int64)."""
    return (world_size - 1) * 8.0 * (2 + uses)
