"""The cost model: bytes each representation of one unit puts on the wire, and its block layouts.

Every input here is agreed by all ranks (shapes, the config, every rank's row counts from a
size exchange), so every rank estimates the same numbers; `router.route` decides from them, and
the benchmarks' scale table calls the same functions.

Bytes received by one rank, S ranks, weight m x n:
  dense all-reduce   2 (S-1)/S * m n * b
  exact factors      (S-1) * max_s rows_s * (m + n) * w      (gathers pad to the longest rank)
  rank-r factors     (S-1) * r (m + n) * w  + the bias, densely          (all-gather, rank-dAD)
  rank-r all-reduce  k 2 (S-1)/S * r (m + n) * w  + the bias, densely    (PowerSGD's P and Q, k power
                                                                        iterations: k rounds of both)

Sharded (FSDP2: each rank keeps rows ``[rank c, (rank+1) c)`` of the average, ``c = ceil(m/S)``):
  dense reduce-scatter   (S-1)/S * S c n * b = (S-1) * c n * b     (rows padded to S c)
  sharded exact          (S-1) * sum_u max_s rows_su * (n + c) * w (right all-gathered, left's
                         column slices by all-to-all); with an embedding use, the exact factors'
                         all-gather above
  sharded rank-r         (S-1) * r (n + c) * w  + the bias' reduce-scatter  (every Q_s all-gathered,
                         each rank's rows of every P_s by all-to-all: `codecs.sharded_rank`)
  sharded rank-r         2 (S-1)/S * r (m + n) * w  + the bias' reduce-scatter (PowerSGD's P and Q,
    all-reduce           all-reduced whole: the orthonormalisation needs every row of P)
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from dad_integrations.comm.aggregator import ring_allreduce_bytes
from dad_integrations.codecs.wire import exact_block_specs, packed_size, rank_block_specs, sharded_exact_covers

def estimate_bytes(*, kinds: Sequence[str], shape: Tuple[int, int], rows_by_rank: Sequence[Sequence[int]],
                   bias_numel: int, rank: int, grad_dtype: torch.dtype, wire_dtype: torch.dtype,
                   world_size: int, rounds: int = 1,
                   blocks: Optional[Sequence[Optional[Tuple[int, int]]]] = None) -> Dict[str, float]:
    """Estimated bytes this rank receives for each representation of one unit; ``rounds``: the
    rank-r all-reduce's P and Q rounds per step (`codecs.rank_allreduce.rank_allreduce_rounds`);
    ``blocks``: the uses' row blocks (`exact_block_specs`). A unit without uses (no ``kinds``) has
    no exact factors."""
    m, n = shape
    s = world_size
    gb = (wire_dtype if wire_dtype is not None else grad_dtype).itemsize
    dense = ring_allreduce_bytes((m * n + bias_numel) * gb, s)
    out = {"dense": dense}
    if kinds:
        longest = max(packed_size(exact_block_specs(kinds, shape, r, wire_dtype, blocks)) for r in rows_by_rank)
        out["exact"] = (s - 1) * longest
    if rank:
        r = min(rank, m, n)
        bias = ring_allreduce_bytes(bias_numel * gb, s)
        out["rank"] = (s - 1) * packed_size(rank_block_specs(shape, r, wire_dtype)) + bias
        out["rank_allreduce"] = rounds * ring_allreduce_bytes(r * (m + n) * gb, s) + bias
    return out


def all_to_all_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in an all-to-all of ``nbytes``: all blocks but its own."""
    return (world_size - 1) / world_size * nbytes


def reduce_scatter_bytes(shape: Sequence[int], world_size: int, itemsize: int) -> float:
    """Bytes one rank sends in FSDP2's reduce-scatter of one parameter's gradient: ``S - 1`` of its
    ``S`` chunks of ``ceil(shape[0] / S)`` rows (dim 0 padded to ``S`` equal chunks)."""
    rest = 1
    for d in shape[1:]:
        rest *= d
    return (world_size - 1) * -(-shape[0] // world_size) * rest * itemsize


def sharded_exact_bytes(kinds: Sequence[str], shape: Tuple[int, int], rows_by_rank: Sequence[Sequence[int]],
                        wire_dtype: torch.dtype, world_size: int) -> float:
    """Bytes one rank receives in `codecs.sharded_exact`'s exchange of one unit (see the module doc)."""
    s = world_size
    if "embedding" in kinds:  # whole factors, all-gathered
        return (s - 1) * max(packed_size(exact_block_specs(kinds, shape, r, wire_dtype)) for r in rows_by_rank)
    m, n = shape
    w = wire_dtype.itemsize
    longest = sum(max(r[u] for r in rows_by_rank) for u in range(len(kinds)))
    return (s - 1) * longest * (n + -(-m // s)) * w


def sharded_rank_bytes(shape: Tuple[int, int], rank: int, wire_dtype: torch.dtype, world_size: int) -> float:
    """Bytes one rank sends (and receives) in `codecs.sharded_rank`'s all-gather route for one weight
    (m x n, dim 0 sharded): every site's ``Q_s^T`` (r x n) all-gathered, ``(S-1) r n``, and each
    rank's ``c = ceil(m/S)`` rows of every ``P_s`` by all-to-all, ``(S-1) c r``."""
    m, n = shape
    s, r = world_size, min(rank, m, n)
    w = wire_dtype.itemsize
    return (s - 1) * r * (n + -(-m // s)) * w


def sharded_rank_allreduce_bytes(shape: Tuple[int, int], rank: int, wire_dtype: torch.dtype,
                                 world_size: int) -> float:
    """Bytes one rank sends in `codecs.sharded_rank`'s all-reduce route for one weight: PowerSGD's
    ``P`` (m x r) and ``Q`` (n x r) all-reduced whole, ``2 (S-1)/S r (m+n)``, as without sharding."""
    m, n = shape
    w = wire_dtype.itemsize
    return ring_allreduce_bytes(min(rank, m, n) * (m + n) * w, world_size)


def sharded_estimate_bytes(*, kinds: Sequence[str], shape: Tuple[int, int], rows_by_rank: Sequence[Sequence[int]],
                           bias_numel: int, grad_dtype: torch.dtype, wire_dtype: Optional[torch.dtype],
                           world_size: int, rank: int = 0, rounds: int = 1,
                           blocks: Optional[Sequence[Optional[Tuple[int, int]]]] = None) -> Dict[str, float]:
    """Estimated bytes per rank of the sharded representations of one unit: ``"dense"`` (FSDP2's
    reduce-scatter of the weight and its biases, in the gradients' dtype), ``"exact"``, and with a
    ``rank``, ``"rank"`` and ``"rank_allreduce"`` (whose biases go through the reduce-scatter).
    Several biases are counted as one of ``bias_numel`` (their padding may differ by a row each).
    A unit without uses, or with row ``blocks`` on a use other than ``linear`` (`sharded_exact_covers`),
    has no ``"exact"`` here."""
    gb = grad_dtype.itemsize
    wire = wire_dtype or grad_dtype
    bias = reduce_scatter_bytes((bias_numel,), world_size, gb) if bias_numel else 0.0
    out = {"dense": reduce_scatter_bytes(shape, world_size, gb) + bias}
    if sharded_exact_covers(kinds, blocks):
        out["exact"] = sharded_exact_bytes(kinds, shape, rows_by_rank, wire, world_size)
    if rank:
        out["rank"] = sharded_rank_bytes(shape, rank, wire, world_size) + bias
        out["rank_allreduce"] = rounds * sharded_rank_allreduce_bytes(shape, rank, wire, world_size) + bias
    return out


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
