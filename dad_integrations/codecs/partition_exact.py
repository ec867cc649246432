"""Exact factors over `Ranges` (lossless dAD under DeepSpeed ZeRO-2/3): the collective that moves the cuts.

ZeRO keeps on each rank an element range ``[lo, hi)`` of a weight's flattened (row-major) gradient:
ZeRO-3 cuts every parameter into ``S`` equal pieces; ZeRO-2 cuts a flat bucket of parameters at
arbitrary offsets, so a weight lies wholly in one rank's partition or spans a few. A rank rebuilds
only its covering rows of the average and keeps its elements, from every rank's cut for those rows
(`exact.cut`: for an embedding use only the ids in them). One all-to-all with per-destination sizes
carries the cuts of every weight of one reduction call; a rank that owns nothing of a weight
receives nothing for it. The sizes follow from counts every rank agrees on (`exact.use_counts`, one
small all-gather per call), so no padding is sent. Bytes: `exchange_bytes`, `routes.exact`.

`block_specs`, `encode` and `decode` frame `exact.cut` and `exact.rebuild` by destination;
`PartitionExactCodec.exchange` packs the cuts straight into one send buffer (`wire.pack_into`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.capture.rows import Rows
from dad_integrations.codecs import exact
from dad_integrations.codecs.exact import Block, Blocks, Range, Ranges, covering_rows
from dad_integrations.codecs.wire import BlockSpec, pack_into, packed_size, unpack

Counts = Sequence[Sequence[int]]  # by use: [rows] (linear, conv1d) or [rows, ids for rank 0, ..., S-1]


def use_counts(kinds: Sequence[str], rows: Sequence[Rows], ranges: Sequence[Range], n: int) -> List[List[int]]:
    """This rank's counts, per use: ``[rows]``, and for an embedding use also how many of its ids
    fall in each rank's covering rows (what that rank will receive)."""
    return exact.use_counts(kinds, rows, [covering_rows(lo, hi, n) for lo, hi in ranges])


def block_specs(kinds: Sequence[str], shape: Tuple[int, int], counts: Counts, dest: int, dest_range: Range,
                wire: torch.dtype, blocks: Blocks = None) -> List[BlockSpec]:
    """Layout of what a rank with ``counts`` sends rank ``dest`` (owning ``dest_range``) for one unit:
    nothing where ``dest`` owns nothing (a use over a row block that misses its rows: two empty blocks)."""
    if dest_range[1] <= dest_range[0]:
        return []
    per_use = [k[1 + dest] if len(k) > 1 else k[0] for k in counts]  # an embedding's: its ids for dest
    return exact.exact_block_specs(kinds, shape, per_use, wire, blocks, Ranges((dest_range,)))


def encode(kinds: Sequence[str], shape: Tuple[int, int], rows: Sequence[Rows], ranges: Sequence[Range],
           wire: torch.dtype, blocks: Blocks = None) -> List[List[torch.Tensor]]:
    """This rank's blocks for one unit, by destination (empty where it owns nothing): `exact.cut`."""
    region = Ranges(tuple(ranges))
    return [exact.cut(kinds, shape, rows, wire, blocks, region, d) if hi > lo else []
            for d, (lo, hi) in enumerate(ranges)]


def decode(kinds: Sequence[str], shape: Tuple[int, int], received: Sequence[Sequence[torch.Tensor]], own: Range,
           dtype: torch.dtype, blocks: Blocks = None) -> torch.Tensor:
    """The flat elements ``own`` of ``sum over sources`` of the unit's gradient, from every source's
    blocks for this rank (``received[s]``, laid out as `encode` makes them); rebuilds only the
    covering rows."""
    lo, hi = own
    if hi <= lo:
        return torch.zeros(0, dtype=dtype, device=next((b.device for parts in received for b in parts), None))
    region = Ranges((own,))
    r0 = region.rows(0, *shape)[0]
    rows, _ = exact.rebuild(kinds, shape, [exact.pairs(parts) for parts in received], dtype, blocks, region)
    return rows.reshape(-1)[lo - r0 * shape[1]:hi - r0 * shape[1]]


def dest_sizes(kinds: Sequence[str], shape: Tuple[int, int], counts: Sequence[Counts], ranges: Sequence[Range],
               wire: torch.dtype, blocks: Blocks = None) -> List[List[int]]:
    """Bytes of one unit's blocks from each source to each destination, ``[s][d]`` (`block_specs`)."""
    return [[packed_size(block_specs(kinds, shape, counts[s], d, ranges[d], wire, blocks)) for d in range(len(ranges))]
            for s in range(len(ranges))]


def exchange_bytes(kinds: Sequence[str], shape: Tuple[int, int], counts: Sequence[Counts],
                   ranges: Sequence[Range], wire: torch.dtype, blocks: Blocks = None) -> Tuple[int, float]:
    """Bytes of one unit's exchange: on its busiest rank (the most any rank sends to, or receives
    from, the others), and sent per rank on average (``counts`` every rank's, ``ranges`` every
    rank's owned range). Under ZeRO-2 a weight often lies in one rank's partition, which then
    receives every other site's factors: the mean alone would hide that, the busiest rank alone
    that the others send nothing."""
    S = len(ranges)
    sizes = [[0 if d == s else v for d, v in enumerate(row)]
             for s, row in enumerate(dest_sizes(kinds, shape, counts, ranges, wire, blocks))]
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
        mine = [use_counts(it.kinds, it.rows, it.ranges, it.shape[1]) for it in items]
        counts, traffic = exact.agree_counts(mine, aggregator, "dad.partition.counts", self.device)
        for it, by_rank in zip(items, counts):
            it.counts = by_rank
        return traffic

    def exchange(self, items: Sequence[PartitionItem], aggregator: FactorAggregator, dtype: torch.dtype,
                 scale: float, deliver: Callable[[int, torch.Tensor], None]) -> Dict[int, Traffic]:
        """Hand ``deliver(key, owned)`` ``scale`` times this rank's owned elements of each item's
        summed gradient, in ``dtype``, one item at a time, and return each item's bytes. Every rank
        calls it with the same items (same keys, shapes, ranges, agreed counts), in order.

        ``owned`` is dropped once ``deliver`` returns, so the rebuild adds one item's covering rows
        to the peak, not every item's owned elements at once."""
        S, me = aggregator.world_size, aggregator.rank
        wire = self.wire_dtype or dtype
        sizes = {it.key: dest_sizes(it.kinds, it.shape, it.counts, it.ranges, wire, it.blocks) for it in items}
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
