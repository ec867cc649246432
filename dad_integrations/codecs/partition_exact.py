"""Exact factors for flat element partitions (lossless dAD under DeepSpeed ZeRO-2/3).

ZeRO keeps on each rank an element range ``[lo, hi)`` of a weight's flattened (row-major) gradient:
ZeRO-3 cuts every parameter into ``S`` equal pieces of ``ceil(numel/S)``; ZeRO-2 cuts a flat bucket
of parameters at arbitrary offsets, so a weight lies wholly in one rank's partition or spans a few.
A rank rebuilds only its *covering rows* ``[r0, r1) = [lo // n, ceil(hi / n))`` of the average and
keeps its elements. For a weight ``m x n`` with uses u and rank s's rows ``(left_su, right_su)``
(`layers`' orientation: row i of ``G_s`` is ``left_s[:, i]^T right_s``),

    G[r0:r1] = scale * sum_s sum_u left_su[:, r0:r1]^T right_su        (linear, conv1d)
    G[r0:r1] = scale * sum_s index_add(ids in [r0, r1), their D rows)    (embedding)

So rank d needs, from every rank s and for every weight d owns a piece of: ``right_su`` whole and
the columns ``r0:r1`` of ``left_su`` (for a use over a row block ``(o, h)`` of the matrix view, whose
left has ``h`` columns, rows ``o:o+h``: the columns of the overlap of ``[r0, r1)`` with its rows, and
nothing where they do not meet; MHA's packed ``in_proj_weight`` called on q/k/v slices), or, for an embedding use, only the ids that fall in its rows
and their D rows. One all-to-all with per-destination sizes carries all of it for the weights of one
reduction call (`FactorAggregator.all_to_all_v`); a rank that owns nothing of a weight receives
nothing for it. The sizes follow from counts every rank agrees on (one small all-gather per call:
per use the row count, and for embedding uses the count of ids per destination), so no padding is
sent. Bytes one rank receives for a weight it owns ``w`` covering rows of:
``sum_{s != d} N_s (n + w)`` (wire dtype), against ZeRO's reduce(-scatter), about ``(S-1)/S m n``.

The pure functions (`covering_rows`, `use_counts`, `block_specs`, `encode`, `decode`) hold the
algebra; `PartitionExactCodec.exchange` packs the blocks as bytes straight into one send buffer
(`wire.pack_into`, ids as int32) and runs the collective through a `FactorAggregator`. Nothing here
knows an engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.capture.rows import Rows, deterministic_index_add
from dad_integrations.codecs.wire import ID_DTYPE, BlockSpec, pack_into, packed_size, unpack

Range = Tuple[int, int]          # [lo, hi) of the flattened weight; lo >= hi: nothing
Block = Optional[Tuple[int, int]]  # a use's row block (offset, height) of the matrix view; None: all rows
Counts = Sequence[Sequence[int]]  # by use: [rows] (linear, conv1d) or [rows, ids for rank 0, ..., S-1]


def covering_rows(lo: int, hi: int, n: int) -> Tuple[int, int]:
    """Rows ``[r0, r1)`` of an ``m x n`` weight that hold its flat elements ``[lo, hi)`` ((0, 0) if empty)."""
    if hi <= lo:
        return 0, 0
    return lo // n, -(-hi // n)


def counts_length(kinds: Sequence[str], world_size: int) -> int:
    """Length of one rank's count vector for a unit (`use_counts` flattened)."""
    return sum(1 + world_size if k == "embedding" else 1 for k in kinds)


def use_span(block: Block, r0: int, r1: int, m: int) -> Tuple[int, int]:
    """The rows ``[a, b)`` of the covering rows ``[r0, r1)`` that a use over ``block`` adds into
    (its left's columns ``a - o : b - o``); empty (``b <= a``) where they do not meet."""
    off, height = block if block is not None else (0, m)
    return max(r0, off), min(r1, off + height)


def use_counts(kinds: Sequence[str], rows: Sequence[Rows], ranges: Sequence[Range], n: int) -> List[List[int]]:
    """This rank's counts, per use: ``[rows]``, and for an embedding use also how many of its ids
    fall in each rank's covering rows (what that rank will receive)."""
    out = []
    for kind, (left, _) in zip(kinds, rows):
        k = [int(left.shape[0])]
        if kind == "embedding":
            for lo, hi in ranges:
                r0, r1 = covering_rows(lo, hi, n)
                k.append(int(((left >= r0) & (left < r1)).sum()) if r1 > r0 else 0)
        out.append(k)
    return out


def block_specs(kinds: Sequence[str], shape: Tuple[int, int], counts: Counts, dest: int, dest_range: Range,
                wire: torch.dtype, blocks: Optional[Sequence[Block]] = None) -> List[BlockSpec]:
    """Layout of what a rank with ``counts`` sends rank ``dest`` (owning ``dest_range``) for one unit
    (a use over a row block that misses ``dest``'s covering rows: two empty blocks)."""
    m, n = shape
    r0, r1 = covering_rows(*dest_range, n)
    if r1 <= r0:
        return []
    specs: List[BlockSpec] = []
    for u, (kind, k) in enumerate(zip(kinds, counts)):
        if kind == "embedding":
            specs += [(ID_DTYPE, (k[1 + dest],)), (wire, (k[1 + dest], n))]
        else:
            a, b = use_span(blocks[u] if blocks is not None else None, r0, r1, m)
            rows = k[0] if b > a else 0
            specs += [(wire, (rows, n)), (wire, (rows, max(b - a, 0)))]
    return specs


def encode(kinds: Sequence[str], shape: Tuple[int, int], rows: Sequence[Rows], ranges: Sequence[Range],
           wire: torch.dtype, blocks: Optional[Sequence[Block]] = None) -> List[List[torch.Tensor]]:
    """This rank's blocks for one unit, by destination (empty where it owns nothing): per use,
    ``right`` and ``left``'s covering columns (of a row-blocked use: those over its rows, `use_span`),
    or the ids in the destination's rows (made relative to its first row) and their D rows."""
    m, n = shape
    out = []
    for lo, hi in ranges:
        r0, r1 = covering_rows(lo, hi, n)
        parts: List[torch.Tensor] = []
        if r1 > r0:
            for u, (kind, (left, right)) in enumerate(zip(kinds, rows)):
                if kind == "embedding":
                    keep = (left >= r0) & (left < r1)
                    parts += [(left[keep] - r0).to(ID_DTYPE), right[keep].to(wire)]
                    continue
                block = blocks[u] if blocks is not None else None
                a, b = use_span(block, r0, r1, m)
                if b <= a:  # the use's rows miss the destination's: nothing of it is sent there
                    parts += [right[:0].to(wire), left[:0, :0].to(wire)]
                    continue
                off = block[0] if block is not None else 0
                parts += [right.to(wire), left[:, a - off:b - off].to(wire)]
        out.append(parts)
    return out


def decode(kinds: Sequence[str], shape: Tuple[int, int], received: Sequence[Sequence[torch.Tensor]], own: Range,
           dtype: torch.dtype, blocks: Optional[Sequence[Block]] = None) -> torch.Tensor:
    """The flat elements ``own`` of ``sum over sources`` of the unit's gradient, from every source's
    blocks for this rank (``received[s]``, laid out as `encode` makes them); rebuilds only the
    covering rows."""
    m, n = shape
    lo, hi = own
    r0, r1 = covering_rows(lo, hi, n)
    rows = torch.zeros((r1 - r0, n), dtype=dtype,
                       device=next((b.device for blocks in received for b in blocks), None))
    if r1 <= r0:
        return rows.reshape(-1)
    for parts in received:
        for u, kind in enumerate(kinds):
            first, second = parts[2 * u], parts[2 * u + 1]
            if first.shape[0] == 0:
                continue
            if kind == "embedding":
                deterministic_index_add(rows, first.long(), second.to(dtype))
            else:
                a, b = use_span(blocks[u] if blocks is not None else None, r0, r1, m)
                rows[a - r0:b - r0].addmm_(second.t().to(dtype), first.to(dtype))
    return rows.reshape(-1)[lo - r0 * n:hi - r0 * n]


def exchange_bytes(kinds: Sequence[str], shape: Tuple[int, int], counts: Sequence[Counts],
                   ranges: Sequence[Range], wire: torch.dtype,
                   blocks: Optional[Sequence[Block]] = None) -> Tuple[int, float]:
    """Bytes of one unit's exchange: on its busiest rank (the most any rank sends to, or receives
    from, the others), and sent per rank on average (``counts`` every rank's, ``ranges`` every
    rank's owned range). Under ZeRO-2 a weight often lies in one rank's partition, which then
    receives every other site's factors: the mean alone would hide that, the busiest rank alone
    that the others send nothing."""
    S = len(ranges)
    sizes = [[packed_size(block_specs(kinds, shape, counts[s], d, ranges[d], wire, blocks)) if d != s else 0
              for d in range(S)] for s in range(S)]
    busiest = max(max(sum(row) for row in sizes), max(sum(sizes[s][d] for s in range(S)) for d in range(S)))
    return busiest, sum(map(sum, sizes)) / S


@dataclass
class PartitionItem:
    """One unit in one exchange: its weight's (global) matrix view ``(shape[0], prod(shape[1:]))``
    (`FactorUnit.shape`: ZeRO's owned ranges of the row-major flattening are the same in the view),
    every rank's owned range, this rank's rows per use, and (after `PartitionExactCodec.agree_counts`)
    every rank's counts; ``blocks``: the uses' row blocks (`FactorUnit.blocks`; None: whole rows)."""

    key: int
    kinds: Tuple[str, ...]
    shape: Tuple[int, int]
    ranges: List[Range]
    rows: List[Rows]
    counts: List[List[List[int]]] = field(default_factory=list)   # by rank, by use
    blocks: Optional[Tuple[Block, ...]] = None

    def rows_by_rank(self) -> List[List[int]]:
        """Every rank's row count per use (the router's ``rows_by_rank``)."""
        return [[k[0] for k in per_rank] for per_rank in self.counts]


class PartitionExactCodec:
    """Runs the exchange of `decode`'s blocks for several units in one all-to-all (module doc)."""

    def __init__(self, wire_dtype: Optional[torch.dtype], device: torch.device):
        self.wire_dtype = wire_dtype
        self.device = device

    def agree_counts(self, items: Sequence[PartitionItem], aggregator: FactorAggregator) -> Traffic:
        """Fill every item's ``counts`` with every rank's (one all-gather of int64 for all items)."""
        S = aggregator.world_size
        mine = [use_counts(it.kinds, it.rows, it.ranges, it.shape[1]) for it in items]
        flat = torch.tensor([c for per_item in mine for k in per_item for c in k], dtype=torch.int64,
                            device=self.device)
        handle = aggregator.all_gather(flat, name="dad.partition.counts", first_dims=[flat.numel()] * S)
        gathered = [t.tolist() for t in handle.wait()]
        for it in items:
            it.counts = [[] for _ in range(S)]
        for s, values in enumerate(gathered):
            pos = 0
            for it in items:
                for kind in it.kinds:
                    width = 1 + S if kind == "embedding" else 1
                    it.counts[s].append(values[pos:pos + width])
                    pos += width
        return handle.traffic

    def exchange(self, items: Sequence[PartitionItem], aggregator: FactorAggregator, dtype: torch.dtype,
                 scale: float, deliver: Callable[[int, torch.Tensor], None]) -> Dict[int, Traffic]:
        """Hand ``deliver(key, owned)`` ``scale`` times this rank's owned elements of each item's
        summed gradient, in ``dtype``, one item at a time, and return each item's bytes. Every rank
        calls it with the same items (same keys, shapes, ranges, agreed counts), in order.

        ``owned`` is dropped once ``deliver`` returns, so the rebuild adds one item's covering rows
        to the peak, not every item's owned elements at once."""
        S, me = aggregator.world_size, aggregator.rank
        wire = self.wire_dtype or dtype
        sizes = {it.key: [[packed_size(block_specs(it.kinds, it.shape, it.counts[s], d, it.ranges[d], wire, it.blocks))
                           for d in range(S)] for s in range(S)] for it in items}   # [source][dest] bytes
        send_sizes = [sum(sizes[it.key][me][d] for it in items) for d in range(S)]
        send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=self.device)
        pos = 0
        for d in range(S):   # by destination, items in order: the layout `block_specs` describes
            for it in items:
                parts = encode(it.kinds, it.shape, it.rows, [it.ranges[d]], wire, it.blocks)[0]
                pos += pack_into(parts, send.narrow(0, pos, sizes[it.key][me][d]))
        recv_sizes = [sum(sizes[it.key][s][me] for it in items) for s in range(S)]
        received = aggregator.all_to_all_v(send, send_sizes, recv_sizes, name="dad.partition.factors").wait()
        per_source: Dict[int, List[List[torch.Tensor]]] = {it.key: [] for it in items}
        pos = 0
        for s in range(S):
            for it in items:
                size = sizes[it.key][s][me]
                specs = block_specs(it.kinds, it.shape, it.counts[s], me, it.ranges[me], wire, it.blocks)
                per_source[it.key].append(unpack(received[pos:pos + size], specs) if specs else [])
                pos += size
        for it in items:
            deliver(it.key, decode(it.kinds, it.shape, per_source.pop(it.key), it.ranges[me], dtype,
                                   it.blocks).mul_(scale))
        return _shares(items, sizes, me, S)

    def local(self, item: PartitionItem, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s owned elements of its *own* gradient, rebuilt from its own rows only (the
        first step's check against autograd's local gradient)."""
        wire = self.wire_dtype or dtype
        (own,) = encode(item.kinds, item.shape, item.rows, [item.ranges[rank]], wire, item.blocks)  # only this rank's
        return decode(item.kinds, item.shape, [own], item.ranges[rank], dtype, item.blocks)


def _shares(items: Sequence[PartitionItem], sizes: Dict[int, List[List[int]]], me: int, S: int) -> Dict[int, Traffic]:
    """Each item's part of the one all-to-all (the call counted on the first item)."""
    out = {}
    for i, it in enumerate(items):
        handed = sum(sizes[it.key][me])
        sent = handed - sizes[it.key][me][me]
        received = sum(sizes[it.key][s][me] for s in range(S) if s != me)
        out[it.key] = Traffic(handed, sent, received, 1 if i == 0 else 0)
    return out
