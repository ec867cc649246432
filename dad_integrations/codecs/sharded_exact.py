"""Exact factors over `RowShards` (lossless dAD under FSDP2): the collectives that move the cuts.

Of every rank's use, rank r needs the right whole and the left's columns over its rows
(`exact.cut`). The right is the same for every destination, so it is all-gathered once; the lefts'
cuts go by one all-to-all, each placed at its rows among the destination's ``c`` columns (zero
elsewhere, so a row-blocked use's cut arrives as a whole-row one), every use's rows padded to the
longest rank's (the collectives need equal sizes). Bytes: `routes.exact`.

A unit with an embedding use (GPT-2's tied ``wte``/``lm_head``) all-gathers whole factors
(`exact.ExactCodec`) and each rank cuts its rows from them. Units without uses, and blocks on a
non-linear use, never come here (`exact.sharded_exact_covers`; `exchange` refuses them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.capture.rows import Rows, compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import (BiasUses, Blocks, ExactCodec, RowShards, bias_uses, cut, pairs, rebuild,
                                           sharded_exact_covers, use_span)

RowCounts = Sequence[Sequence[int]]   # by rank, by use


def longest(rows_by_rank: RowCounts) -> List[int]:
    """Each use's rows on the rank with the most: what every rank pads that use to."""
    return [max(k) for k in zip(*rows_by_rank)]


def encode_sliced(rows: Sequence[Rows], rows_by_rank: RowCounts, m: int, world_size: int,
                  wire: torch.dtype, blocks: Blocks = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's two payloads: ``right`` of every use flattened (for the all-gather), and
    ``send`` ``(S, sum_u longest_u, c)``: block d holds every use's cut for rank d, at its rows
    among d's ``c`` columns, each use's rows padded to its longest rank."""
    pads = longest(rows_by_rank)
    region, kinds = RowShards(world_size), ("linear",) * len(rows)  # linear-like uses only: no ids here
    rows = [(left, right.to(wire)) for left, right in rows]          # converted once, not per destination
    shape = (m, rows[0][1].shape[1] if rows else 0)
    device = rows[0][1].device if rows else None
    send = torch.zeros(world_size, sum(pads), region.rows(0, m, 0)[2], dtype=wire, device=device)
    for d in range(world_size):
        lo, hi, _ = region.rows(d, m, 0)
        parts, row0 = cut(kinds, shape, rows, wire, blocks, region, d), 0
        for u, pad in enumerate(pads):
            left = parts[2 * u]
            if left.numel():
                a, _ = use_span(blocks[u] if blocks is not None else None, lo, hi, m)
                send[d, row0:row0 + left.shape[0], a - lo:a - lo + left.shape[1]] = left
            row0 += pad
    right = torch.cat([r.reshape(-1) for _, r in rows]) if rows else torch.zeros(0, dtype=wire)
    return right, send


def decode_sliced(kinds: Sequence[str], shape: Tuple[int, int], rights: Sequence[torch.Tensor],
                  received: torch.Tensor, rows_by_rank: RowCounts, rank: int, biases: BiasUses,
                  dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Rank's padded shard ``(c, n)`` of ``sum_s G_s`` and of each bias, from every rank's flattened
    ``right`` (``rights[s]``) and the all-to-all's ``received`` ``(S, L, c)`` (block s: rank s's cuts,
    laid out as `encode_sliced` sends them)."""
    m, n = shape
    region = RowShards(len(rights))
    lo, hi, _ = region.rows(rank, m, n)
    pads, sources = longest(rows_by_rank), []
    for s, counts in enumerate(rows_by_rank):
        rows, pos, row0 = [], 0, 0
        for k, pad in zip(counts, pads):
            rows.append((received[s, row0:row0 + k, :hi - lo], rights[s][pos:pos + k * n].view(k, n)))
            pos, row0 = pos + k * n, row0 + pad
        sources.append(rows)
    # placed among this rank's rows, every cut is a whole-row one
    return rebuild(kinds, shape, sources, dtype, None, region, rank, biases)


def decode_whole(kinds: Sequence[str], shape: Tuple[int, int], gathered: Sequence[Rows], rank: int,
                 world_size: int, biases: BiasUses, dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Rank's padded shard of the unit's gradient and biases from every rank's whole factors,
    stacked per use (``gathered[u]``: embedding ids int64, floats in ``dtype``): its own cut of
    them, rebuilt (whole factors take no row blocks)."""
    region = RowShards(world_size)
    own = pairs(cut(kinds, shape, gathered, dtype, None, region, rank))
    return rebuild(kinds, shape, [own], dtype, None, region, rank, biases)


@dataclass
class ShardedResult:
    """One unit's exchange: padded shards by parameter (weight, then riding biases), its bytes,
    and how (``"sliced"``: all-gather + all-to-all; ``"whole"``: the exact codec's all-gather)."""

    shards: Dict[nn.Parameter, torch.Tensor]
    traffic: Traffic
    method: str


class ShardedExactCodec:
    """Exchanges a unit's exact factors so that each rank rebuilds its own rows (module doc)."""

    def __init__(self, wire_dtype: Optional[torch.dtype], device: torch.device):
        self.whole = ExactCodec(wire_dtype, device)

    def exchange(self, unit: FactorUnit, rows: Sequence[Rows], rows_by_rank: RowCounts,
                 aggregator: FactorAggregator, scale: float) -> ShardedResult:
        """``scale`` times this rank's shard of the sum over ranks, for the weight and its biases.
        Every rank calls this with the same unit and ``rows_by_rank``, in the same order."""
        if not sharded_exact_covers(unit.kinds, unit.blocks):  # refused before any collective
            # (the router never routes these here: their row-shard byte model has no "exact")
            raise ValueError(f"{unit.name}: sharded exact factors need uses, and row blocks on linear uses only "
                             f"({'no uses' if not unit.has_factors else 'row blocks'})")
        S, rank, shape, cdt = aggregator.world_size, aggregator.rank, unit.shape, compute_dtype(unit.param)
        biases, name = bias_uses(unit), f"dad.sharded.{unit.name}"
        if "embedding" not in unit.kinds:  # linear-like uses, whole or row-blocked: column slices
            right, send = encode_sliced(rows, rows_by_rank, shape[0], S, self.whole.wire(unit), unit.blocks)
            gather = aggregator.all_gather(right, name=f"{name}.right",
                                           first_dims=[sum(r) * shape[1] for r in rows_by_rank])
            to_all = aggregator.all_to_all(send, name=f"{name}.left")
            weight, values = decode_sliced(unit.kinds, shape, gather.wait(), to_all.wait(), rows_by_rank, rank,
                                           biases, cdt)
            traffic, method = gather.traffic + to_all.traffic, "sliced"
        else:
            gathered, traffic = self.whole.gather_rows(unit, rows, rows_by_rank, aggregator, name)
            weight, values = decode_whole(unit.kinds, shape, gathered, rank, S, biases, cdt)
            method = "whole"
        shards = {unit.param: weight.mul_(scale)}
        shards.update((b.param, v.mul_(scale)) for b, v in zip(unit.biases, values))
        return ShardedResult(shards, traffic, method)
