"""Sharded exact factors (lossless dAD under FSDP2): each rank rebuilds only the rows it keeps.

The algebra. A unit's weight is ``m x n``; rank s holds rows ``(left_s, right_s)`` (`layers`'
orientation) with local gradient ``G_s = left_s^T right_s``, so row i of ``G_s`` is
``left_s[:, i]^T right_s``: dim 0 of the weight is ``left``'s columns. FSDP2 keeps on rank r the
rows ``[a, b) = [r c, min((r+1) c, m))`` of the average, ``c = ceil(m/S)`` (the last shards may be
short or empty; FSDP's buffers pad every shard to ``c`` rows), and

    G[a:b] = scale * sum_s left_s[:, a:b]^T right_s.

So rank r needs every rank's ``right_s`` whole, but of ``left_s`` only the columns ``a:b``:

* an all-gather of ``right``: ``(S-1) N n`` per rank;
* an all-to-all of ``left``'s column slices (rank s sends columns ``[d c, (d+1) c)`` to rank d):
  ``(S-1) N c``, about ``(S-1)/S N m`` per rank;

against FSDP2's dense reduce-scatter, ``(S-1)/S`` of the padded gradient, about ``(S-1)/S m n``.
N is the rows per rank, padded to the longest rank (the collectives need equal sizes). Factors
win when ``N (n + m/S) < m n / S``: few rows, wide layers (`costs.sharded_exact_bytes`).

Per layer kind (`layers`):

* ``linear`` (out x in): ``left`` = D, so the columns ``a:b`` are output units ``a:b``; the bias'
  shard (same ``m``, same rows) is the sum of those very columns, which arrive with the slices;
* ``conv1d`` (in x out, HF GPT-2): ``left`` = X, the input features; ``right`` = D arrives whole,
  and the bias (``out``,) is sharded along its own length: its rows of ``sum D``;
* ``embedding`` (V x d): ``left`` holds token ids, not columns. A unit with an embedding use (GPT-2's
  tied ``wte``/``lm_head``) all-gathers the exact codec's whole factors (`ExactCodec`) and each rank
  keeps the rows whose id lies in ``[a, b)`` (and, for a linear use of the same weight, the
  columns ``a:b``). An all-to-all by id owner would cut this to ``~1/S``; not done yet.

Shapes are the weight's matrix view ``(shape[0], prod(shape[1:]))`` (`FactorUnit.shape`); FSDP2's
``Shard(0)`` of a 3-D or 4-D weight cuts that view's rows (a conv's output channels), so the
algebra is the same.

Row blocks (a packed attention projection's q/k/v slices, `layers.mha`; a grouped conv's groups):
a ``linear`` use with block ``(o, h)`` has ``h`` columns on its left, rows ``o:o+h`` of the view.
Its part of rank d's rows ``[a, b)`` is the overlap ``[max(a, o), min(b, o+h))``: those columns of
its left go, at their place in d's ``c`` columns, into the same slice (zero elsewhere), so the
decode and the bytes are those of a whole-row use; a split bias (``in_proj_bias`` over the
whole-height call and the slices) is the sum of its uses' D columns, each already in its rows.
Units without uses (PowerSGD's floor), and blocks on a non-linear use, never come here
(`exact.sharded_exact_covers`; `exchange` refuses them).

The pure functions (`shard_span`, `encode_sliced`, `decode_sliced`, `decode_whole`) hold the
algebra; `ShardedExactCodec.exchange` runs the collectives through a `FactorAggregator`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.capture.rows import Rows, compute_dtype, deterministic_index_add, output_grad_rows
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.exact import ExactCodec, sharded_exact_covers

RowCounts = Sequence[Sequence[int]]   # by rank, by use
Block = Optional[Tuple[int, int]]     # a use's row block (offset, height) of the matrix view
# per riding bias: (its use's index, or the indices of the uses of a split bias, its length)
BiasUses = Sequence[Tuple[Union[int, Sequence[int]], int]]


def shard_span(rank: int, world_size: int, m: int) -> Tuple[int, int, int]:
    """``(a, b, c)``: rank's rows ``[a, b)`` of a dim 0 of ``m`` split as ``torch.chunk`` (FSDP2's
    ``Shard(0)``) does, and ``c = ceil(m/S)``, the padded rows of every shard."""
    c = -(-m // world_size)
    return min(rank * c, m), min((rank + 1) * c, m), c


def encode_sliced(rows: Sequence[Rows], rows_by_rank: RowCounts, m: int, world_size: int,
                  wire: torch.dtype, blocks: Optional[Sequence[Block]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's two payloads: ``right`` of every use flattened (for the all-gather), and
    ``send`` ``(S, sum_u longest_u, c)``: block d holds columns ``[d c, (d+1) c)`` of every use's
    ``left``, each use's rows padded to its longest rank, columns zero-padded past ``m``. A use
    with a row block ``(o, h)`` (``blocks[u]``) fills only its rows ``o:o+h`` there (module doc)."""
    longest = [max(r[u] for r in rows_by_rank) for u in range(len(rows))]
    _, _, c = shard_span(0, world_size, m)
    device = rows[0][1].device if rows else None
    send = torch.zeros(world_size, sum(longest), c, dtype=wire, device=device)
    row0 = 0
    for u, ((left, _), pad) in enumerate(zip(rows, longest)):
        block = blocks[u] if blocks is not None else None
        off, height = block if block is not None else (0, m)
        for d in range(world_size):
            lo, hi, _ = shard_span(d, world_size, m)
            a, b = max(lo, off), min(hi, off + height)  # the use's rows among rank d's
            if b > a:
                send[d, row0:row0 + left.shape[0], a - lo:b - lo] = left[:, a - off:b - off]
        row0 += pad
    right = torch.cat([r.to(wire).reshape(-1) for _, r in rows]) if rows else torch.zeros(0, dtype=wire)
    return right, send


def decode_sliced(kinds: Sequence[str], shape: Tuple[int, int], rights: Sequence[torch.Tensor],
                  received: torch.Tensor, rows_by_rank: RowCounts, rank: int, biases: BiasUses,
                  dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Rank's padded shard ``(c, n)`` of ``sum_s left_s^T right_s`` and of each bias, from every
    rank's flattened ``right`` (``rights[s]``) and the all-to-all's ``received`` ``(S, L, c)``
    (block s: rank s's columns ``a:b``, laid out as `encode_sliced` sends them)."""
    m, n = shape
    world = len(rights)
    longest = [max(r[u] for r in rows_by_rank) for u in range(len(kinds))]
    shard = torch.zeros((received.shape[-1], n), dtype=dtype, device=received.device)
    d_sums: List[Optional[torch.Tensor]] = [None] * len(kinds)
    for s in range(world):
        pos, row0 = 0, 0
        for u, kind in enumerate(kinds):
            k = rows_by_rank[s][u]
            right = rights[s][pos:pos + k * n].view(k, n).to(dtype)
            left = received[s, row0:row0 + k].to(dtype)  # rank s's columns a:b (zero past m)
            pos, row0 = pos + k * n, row0 + longest[u]
            if k:
                shard.addmm_(left.t(), right)
                d = (left if kind == "linear" else right).sum(0)
                d_sums[u] = d if d_sums[u] is None else d_sums[u] + d
    values = []
    for uses, length in biases:
        _, _, cb = shard_span(rank, world, length)
        value = torch.zeros(cb, dtype=dtype, device=received.device)
        for u in _bias_uses(uses):  # a split bias: each use's D columns lie in its own rows
            if d_sums[u] is None:
                continue
            if kinds[u] == "linear":  # D's columns a:b: the bias' shard, padded as the weight's rows
                value.add_(d_sums[u])
            else:                     # conv1d: D arrived whole; the bias is sharded along its own length
                ab, bb, _ = shard_span(rank, world, length)
                value[:bb - ab] += d_sums[u][ab:bb]
        values.append(value)
    return shard, values


def _bias_uses(uses: Union[int, Sequence[int]]) -> Sequence[int]:
    return (uses,) if isinstance(uses, int) else tuple(uses)


def decode_whole(kinds: Sequence[str], shape: Tuple[int, int], gathered: Sequence[Rows], rank: int,
                 world_size: int, biases: BiasUses, dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Rank's padded shard of the unit's gradient and biases from every rank's whole factors,
    stacked per use (``gathered[u]``: embedding ids int64, floats in ``dtype``)."""
    m, n = shape
    a, b, c = shard_span(rank, world_size, m)
    shard = torch.zeros((c, n), dtype=dtype, device=gathered[0][1].device if gathered else None)
    for kind, (left, right) in zip(kinds, gathered):
        if kind == "embedding":
            keep = (left >= a) & (left < b)
            deterministic_index_add(shard, left[keep] - a, right[keep].to(dtype))
        elif b > a and left.shape[0]:
            shard[:b - a].addmm_(left[:, a:b].t().to(dtype), right.to(dtype))
    values = []
    for uses, length in biases:  # (whole factors take no row blocks: every use covers the bias)
        ab, bb, cb = shard_span(rank, world_size, length)
        value = torch.zeros(cb, dtype=dtype, device=shard.device)
        for u in _bias_uses(uses):
            value[:bb - ab] += output_grad_rows(kinds[u], gathered[u])[:, ab:bb].to(dtype).sum(0)
        values.append(value)
    return shard, values


def exchange_row_counts(units: Sequence[FactorUnit], rows: Dict[int, Sequence[Rows]],
                        aggregator: FactorAggregator) -> Tuple[Dict[int, List[List[int]]], Traffic]:
    """Every rank's row count per unit (by ``unit.index``) and use, by rank: one small all-gather
    of int64 counts for all ``units`` together, and its traffic."""
    if not units:
        return {}, Traffic()
    mine = torch.tensor([left.shape[0] for u in units for left, _ in rows[u.index]], dtype=torch.int64,
                        device=units[0].param.device)
    handle = aggregator.all_gather(mine, name="dad.sharded.rows", first_dims=[mine.numel()] * aggregator.world_size)
    gathered = [t.tolist() for t in handle.wait()]
    out, k = {}, 0
    for u in units:
        out[u.index] = [g[k:k + len(u.uses)] for g in gathered]
        k += len(u.uses)
    return out, handle.traffic


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
            # (the router never routes these here: `costs.sharded_estimate_bytes` gives them no "exact")
            raise ValueError(f"{unit.name}: sharded exact factors need uses, and row blocks on linear uses only "
                             f"({'no uses' if not unit.has_factors else 'row blocks'})")
        S, rank = aggregator.world_size, aggregator.rank
        shape = unit.shape  # the matrix view: Shard(0) cuts its rows
        cdt = compute_dtype(unit.param)
        # a split bias (in_proj_bias over in_proj's whole call and its q/k/v slices) sums its uses'
        biases = [(tuple(unit.uses.index(u) for u in b.uses), b.param.shape[0]) for b in unit.biases]
        name = f"dad.sharded.{unit.name}"
        if "embedding" not in unit.kinds:  # linear-like uses, whole or row-blocked: column slices
            right, send = encode_sliced(rows, rows_by_rank, shape[0], S, self.whole.wire(unit), unit.blocks)
            gather = aggregator.all_gather(right, name=f"{name}.right",
                                           first_dims=[sum(r) * shape[1] for r in rows_by_rank])
            to_all = aggregator.all_to_all(send, name=f"{name}.left")
            weight, values = decode_sliced(unit.kinds, shape, gather.wait(), to_all.wait(), rows_by_rank, rank,
                                           biases, cdt)
            traffic, method = gather.traffic + to_all.traffic, "sliced"
        else:
            gather = aggregator.all_gather(self.whole.encode(unit, rows), name=name,
                                           first_dims=self.whole.sizes(unit, rows_by_rank))
            gathered = self.whole.stacked_rows(unit, gather.wait(), rows_by_rank)
            weight, values = decode_whole(unit.kinds, shape, gathered, rank, S, biases, cdt)
            traffic, method = gather.traffic, "whole"
        shards = {unit.param: weight.mul_(scale)}
        shards.update((b.param, v.mul_(scale)) for b, v in zip(unit.biases, values))
        return ShardedResult(shards, traffic, method)
