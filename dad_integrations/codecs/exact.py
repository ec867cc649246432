"""Exact factors (lossless dAD) over a region of a weight's rows: one cut, one rebuild.

A weight's matrix view is ``m x n``. Rank s holds, per use u, rows ``(left_su, right_su)``
(`capture.rows`): row i of its gradient is ``left_su[:, i]^T right_su``, or for an ``embedding``
(``left_su``: token ids) the sum of the D rows whose id is i. A use over a row block ``(o, h)``
(a q/k/v slice of a packed projection, a conv group) has ``h`` left columns, rows ``o:o+h``. A rank
keeping rows ``[r0, r1)`` of the average needs, with ``[a, b) = [r0, r1) ∩ [o, o+h)``,

    G[r0:r1] = scale * sum_s sum_u left_su[:, a-o:b-o]^T right_su      (linear, conv1d)
    G[r0:r1] = scale * sum_s index_add(ids_su in [r0, r1) minus r0, their D rows)   (embedding)

so of each rank's use: the right whole and the left's columns over ``[a, b)`` (nothing where they
miss), or the ids in its rows and their D rows (`cut`, the one encoder). `rebuild`, the one
decoder, adds every source's cut into those rows, one matmul or index add per use and source, one
source after another as an engine sums the ranks' gradients (the sharded engines' round-off is
matched that way; under `Whole` every rank's rows are stacked as one source, one matmul per use).
A riding bias is the sum of its uses' D rows: a linear use's D is its left, whose cut columns are
the bias' rows; a conv1d's is its right, cut along the bias' own length.

The *region* says which rows each rank keeps, and so which collective moves the cuts:

* `Whole`: all rows everywhere (DDP, Horovod, the synchroniser, two levels). Every cut is the
  rank's whole rows, so one packed buffer per rank is all-gathered (`ExactCodec.gather`);
* `RowShards`: FSDP2's ``Shard(0)`` (`ExactCodec.exchange_shards`). A use's right is the same for
  every destination, so it is all-gathered once; the lefts' cuts go by one all-to-all, each placed
  at its rows among the destination's ``c`` columns (zero elsewhere, so a row-blocked use's cut
  arrives as a whole-row one), every use's rows padded to the longest rank's. A unit with an
  embedding use (GPT-2's tied ``wte``/``lm_head``) all-gathers whole factors, each rank cutting its
  rows from them;
* `Ranges`: ZeRO's flat element ranges (ZeRO-3: equal pieces of every parameter; ZeRO-2: a bucket
  cut at arbitrary offsets), each rank its covering rows, keeping its elements
  (`ExactCodec.exchange_ranges`): the cuts of every weight of one reduction call by one all-to-all
  whose per-destination sizes follow from counts every rank agrees on (`use_counts`, one small
  all-gather per call), so no padding is sent and a rank owning nothing of a weight gets nothing.

`sharded_exact_covers` says which units take `RowShards` and `Ranges`. Bytes: `routes.exact`.

On the wire a cut is two blocks per use (`exact_block_specs`): the left's columns (int32 ids for an
embedding) and the right rows, in the wire dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dad_integrations.comm.aggregator import FactorAggregator, Traffic
from dad_integrations.capture.rows import Block, Rows, add_bias_grad, add_rebuilt_grad, compute_dtype
from dad_integrations.capture.units import FactorUnit
from dad_integrations.codecs.wire import ID_DTYPE, BlockSpec, pack, pack_into, packed_size, unpack

Blocks = Optional[Sequence[Block]]  # per use; None: every use covers every row
Range = Tuple[int, int]             # [lo, hi) of the flattened weight; lo >= hi: nothing
Span = Tuple[int, int, int]         # rows [r0, r1) a rank keeps, and the rows its result holds (padded)
RowCounts = Sequence[Sequence[int]]  # by rank, by use
Counts = Sequence[Sequence[int]]     # by use: [rows] (linear, conv1d) or [rows, ids for rank 0, ..., S-1]
# per riding bias: (its use's index, or the indices of the uses of a split bias, its length)
BiasUses = Sequence[Tuple[Union[int, Sequence[int]], int]]


def shard_span(rank: int, world_size: int, m: int) -> Span:
    """``(a, b, c)``: rank's rows ``[a, b)`` of a dim 0 of ``m`` split as ``torch.chunk`` (FSDP2's
    ``Shard(0)``) does, and ``c = ceil(m/S)``, the padded rows of every shard."""
    c = -(-m // world_size)
    return min(rank * c, m), min((rank + 1) * c, m), c


def covering_rows(lo: int, hi: int, n: int) -> Tuple[int, int]:
    """Rows ``[r0, r1)`` of an ``m x n`` weight that hold its flat elements ``[lo, hi)`` ((0, 0) if empty)."""
    if hi <= lo:
        return 0, 0
    return lo // n, -(-hi // n)


class Whole:
    """Every rank keeps every row."""

    def rows(self, dest: int, m: int, n: int) -> Span:
        return 0, m, m


@dataclass(frozen=True)
class RowShards:
    """FSDP2's ``Shard(0)`` over ``world_size`` ranks: rows by `shard_span`, padded to ``c``."""

    world_size: int

    def rows(self, dest: int, m: int, n: int) -> Span:
        return shard_span(dest, self.world_size, m)


@dataclass(frozen=True)
class Ranges:
    """ZeRO's flat element ranges, one per rank: each keeps the covering rows of its range. (ZeRO
    partitions biases on their own: none rides here.)"""

    ranges: Tuple[Range, ...]

    def rows(self, dest: int, m: int, n: int) -> Span:
        r0, r1 = covering_rows(*self.ranges[dest], n)
        return r0, r1, r1 - r0


Region = Union[Whole, RowShards, Ranges]
WHOLE = Whole()


def use_span(block: Block, r0: int, r1: int, m: int) -> Tuple[int, int]:
    """The rows ``[a, b)`` of ``[r0, r1)`` that a use over ``block`` adds into (its left's columns
    ``a - o : b - o``); empty (``b <= a``) where they do not meet."""
    off, height = block if block is not None else (0, m)
    return max(r0, off), min(r1, off + height)


def _block(blocks: Blocks, u: int) -> Block:
    return blocks[u] if blocks is not None else None


def cut(kinds: Sequence[str], shape: Tuple[int, int], rows: Sequence[Rows], wire: torch.dtype,
        blocks: Blocks = None, region: Region = WHOLE, dest: int = 0) -> List[torch.Tensor]:
    """What rank ``dest`` of ``region`` needs of this rank's ``rows``: per use, its left's columns
    over ``dest``'s rows (none, and no right, where the use's rows miss them) and its right, or the
    ids in ``dest``'s rows (relative to its first) and their D rows; floats in ``wire``, ids int32."""
    m, n = shape
    r0, r1, _ = region.rows(dest, m, n)
    out: List[torch.Tensor] = []
    for u, (kind, (left, right)) in enumerate(zip(kinds, rows)):
        if kind == "embedding":
            if r0 > 0 or r1 < m:  # some rows only: the ids that fall in them
                keep = (left >= r0) & (left < r1)
                left, right = left[keep] - r0, right[keep]
            out += [left.to(ID_DTYPE), right.to(wire)]
            continue
        block = _block(blocks, u)
        a, b = use_span(block, r0, r1, m)
        if b <= a:
            out += [left[:0, :0].to(wire), right[:0].to(wire)]
        else:
            off = block[0] if block is not None else 0
            out += [left[:, a - off:b - off].to(wire), right.to(wire)]
    return out


def exact_block_specs(kinds: Sequence[str], shape: Tuple[int, int], counts: Sequence[int], wire: torch.dtype,
                      blocks: Blocks = None, region: Region = WHOLE, dest: int = 0) -> List[BlockSpec]:
    """The layout of `cut`'s blocks from a rank with ``counts[u]`` rows in use u (for an embedding
    use: its ids in ``dest``'s rows, all of them under `Whole`)."""
    m, n = shape
    r0, r1, _ = region.rows(dest, m, n)
    specs: List[BlockSpec] = []
    for u, (kind, k) in enumerate(zip(kinds, counts)):
        if kind == "embedding":
            specs += [(ID_DTYPE, (k,)), (wire, (k, n))]
        else:
            a, b = use_span(_block(blocks, u), r0, r1, m)
            specs += [(wire, (k if b > a else 0, max(b - a, 0))), (wire, (k if b > a else 0, n))]
    return specs


def use_counts(kinds: Sequence[str], rows: Sequence[Rows], spans: Sequence[Tuple[int, int]]) -> List[List[int]]:
    """This rank's counts per use: ``[rows]``, and for an embedding use also how many of its ids fall
    in each destination's rows ``spans[d]`` (what `cut` sends it; the `Ranges` exchange agrees them)."""
    out = []
    for kind, (left, _) in zip(kinds, rows):
        k = [int(left.shape[0])]
        if kind == "embedding":
            k += [int(((left >= r0) & (left < r1)).sum()) if r1 > r0 else 0 for r0, r1 in spans]
        out.append(k)
    return out


def agree_counts(mine: Sequence[Sequence[Sequence[int]]], aggregator: FactorAggregator, name: str,
                 device: torch.device) -> Tuple[List[List[List[List[int]]]], Traffic]:
    """Every rank's counts, shaped as this rank's ``mine`` (by unit, by use, a few ints: the same
    shape on every rank), by unit, by rank, by use: one all-gather of int64 for all units."""
    flat = torch.tensor([c for unit in mine for k in unit for c in k], dtype=torch.int64, device=device)
    handle = aggregator.all_gather(flat, name=name, first_dims=[flat.numel()] * aggregator.world_size)
    out: List[list] = [[] for _ in mine]
    for values in handle.wait():
        it = iter(values.tolist())
        for unit, by_rank in zip(mine, out):
            by_rank.append([[next(it) for _ in k] for k in unit])
    return out, handle.traffic


def agree_rows(mine: Sequence[Sequence[int]], aggregator: FactorAggregator, name: str,
               device: torch.device) -> Tuple[List[List[List[int]]], Traffic]:
    """`agree_counts` of one count per use (this rank's rows, by unit, by use): by unit, by rank, by use."""
    counts, traffic = agree_counts([[[k] for k in unit] for unit in mine], aggregator, name, device)
    return [[[k[0] for k in r] for r in by_rank] for by_rank in counts], traffic


def pairs(blocks: Sequence[torch.Tensor]) -> List[Rows]:
    """One source's cut, as `cut` lays it out flat, as ``(left, right)`` per use."""
    return list(zip(blocks[0::2], blocks[1::2]))


def rebuild(kinds: Sequence[str], shape: Tuple[int, int], sources: Sequence[Sequence[Rows]], dtype: torch.dtype,
            blocks: Blocks = None, region: Region = WHOLE, dest: int = 0,
            biases: BiasUses = (), sketch: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``dest``'s rows of ``sum_s G_s`` from every source's cut (``sources[s][u]``: use u's pair),
    ``(height, n)`` in ``dtype`` (padding rows zero), and its part of each riding bias, padded alike:
    the sum of its uses' D rows (a split bias, ``in_proj_bias`` over the whole call and its q/k/v
    slices: each use in its rows). Sources add one after another, as an engine sums the ranks'
    gradients; rows stacked into one source (`ExactCodec.stacked_rows`) cost one matmul per use.

    ``sketch``: an ``(n, k)`` matrix V in ``dtype``; the weight comes back as ``G V``, ``(height, k)``,
    each use's right replaced by ``right V`` (the gradient is linear in it, in every layout), the
    biases as they are (the first step's check, `exchange.checks`)."""
    m, n = shape
    r0, r1, height = region.rows(dest, m, n)
    device = sources[0][0][1].device if sources and sources[0] else None
    spans = [(r0, r1) if k == "embedding" else use_span(_block(blocks, u), r0, r1, m) for u, k in enumerate(kinds)]
    if sketch is None:
        weight = torch.zeros((height, n), dtype=dtype, device=device)
    else:  # column-major, as the sketch: BLAS then runs the thin products in its fast shape (V^T B^T A)
        weight = torch.zeros((sketch.shape[1], height), dtype=dtype, device=device).t()
    values = [torch.zeros(region.rows(dest, length, 1)[2], dtype=dtype, device=device) for _, length in biases]
    for rows in sources:
        for kind, (left, right), (a, b) in zip(kinds, rows, spans):
            if b > a:  # a linear-like cut's columns are rows a:b; an embedding cut's ids are relative to r0
                if sketch is not None:
                    right = right.to(dtype) @ sketch
                add_rebuilt_grad(kind, weight, (left.long() if kind == "embedding" else left, right), (a - r0, b - a))
        for value, (uses, length) in zip(values, biases):
            b0, b1, _ = region.rows(dest, length, 1)  # a bias is a column: cut and padded as the rows are
            for u in ((uses,) if isinstance(uses, int) else uses):
                (left, right), (a, b) = rows[u], spans[u]
                if kinds[u] != "linear":  # conv1d: D is the right, whole, cut along the bias' own length
                    add_bias_grad(kinds[u], value, (left, right[:, b0:b1]), (0, b1 - b0))
                elif b > a:               # D is the left: the cut's columns are rows a:b, the bias' too
                    add_bias_grad("linear", value, (left, right), (a - r0, b - a))
    return weight, values


def bias_uses(unit: FactorUnit) -> BiasUses:
    """The unit's riding biases as (the indices of their uses, their length)."""
    return [(tuple(unit.uses.index(u) for u in b.uses), b.param.shape[0]) for b in unit.biases]


def rebuild_unit(unit: FactorUnit, rows: Sequence[Rows], dtype: torch.dtype, scale: float = 1.0,
                 sketch: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
    """`rebuild` of a unit from one source's ``rows`` (a rank's own, or every rank's stacked), all of
    it: by parameter, the weight's gradient (times ``sketch`` where given), then each riding bias',
    times ``scale``."""
    weight, values = rebuild(unit.kinds, unit.shape, [rows], dtype, unit.blocks, biases=bias_uses(unit),
                             sketch=sketch)
    return by_param(unit, weight, values, scale)


def by_param(unit: FactorUnit, weight: torch.Tensor, values: Sequence[torch.Tensor],
             scale: float = 1.0) -> Dict[nn.Parameter, torch.Tensor]:
    """A `rebuild`'s weight and bias values by parameter (`FactorUnit.params`), scaled in place."""
    out = dict(zip(unit.params, [weight, *values]))
    if scale != 1.0:
        for g in out.values():
            g.mul_(scale)
    return out


def sharded_exact_covers(kinds: Sequence[str], blocks: Blocks = None) -> bool:
    """Whether the exchanges of exact factors over `RowShards` and `Ranges` carry a unit with uses
    ``kinds`` and row ``blocks``: it needs uses, and a use with a row block must be ``linear`` (its
    D columns are then those rows of a split bias), as a packed attention projection's q/k/v slices
    are. Embedding uses take whole factors under row shards, which place no blocks."""
    if not kinds:
        return False
    if blocks is None:
        return True
    return "embedding" not in kinds and all(b is None or k == "linear" for k, b in zip(kinds, blocks))


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
                  dtype: torch.dtype, stacked: bool = False) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Rank's padded shard ``(c, n)`` of ``sum_s G_s`` and of each bias, from every rank's flattened
    ``right`` (``rights[s]``) and the all-to-all's ``received`` ``(S, L, c)`` (block s: rank s's cuts,
    laid out as `encode_sliced` sends them); ``stacked``: every rank's rows as one source (`rebuild`)."""
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
    if stacked:
        sources = [[tuple(torch.cat(t) for t in zip(*use)) for use in zip(*sources)]]
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


def range_specs(kinds: Sequence[str], shape: Tuple[int, int], counts: Counts, dest: int, dest_range: Range,
                wire: torch.dtype, blocks: Blocks = None) -> List[BlockSpec]:
    """Layout of what a rank with ``counts`` sends rank ``dest`` (owning ``dest_range``) for one unit:
    nothing where ``dest`` owns nothing (a use over a row block that misses its rows: two empty blocks)."""
    if dest_range[1] <= dest_range[0]:
        return []
    per_use = [k[1 + dest] if len(k) > 1 else k[0] for k in counts]  # an embedding's: its ids for dest
    return exact_block_specs(kinds, shape, per_use, wire, blocks, Ranges((dest_range,)))


def range_cuts(kinds: Sequence[str], shape: Tuple[int, int], rows: Sequence[Rows], ranges: Sequence[Range],
               wire: torch.dtype, blocks: Blocks = None) -> List[List[torch.Tensor]]:
    """This rank's blocks for one unit, by destination (empty where it owns nothing): `cut`."""
    region = Ranges(tuple(ranges))
    return [cut(kinds, shape, rows, wire, blocks, region, d) if hi > lo else []
            for d, (lo, hi) in enumerate(ranges)]


def range_rebuild(kinds: Sequence[str], shape: Tuple[int, int], received: Sequence[Sequence[torch.Tensor]],
                  own: Range, dtype: torch.dtype, blocks: Blocks = None) -> torch.Tensor:
    """The flat elements ``own`` of ``sum over sources`` of the unit's gradient, from every source's
    blocks for this rank (``received[s]``, as `range_cuts` makes them): `rebuild` of the covering rows."""
    region = Ranges((own,))  # owning nothing: no rows, no elements
    start = own[0] - region.rows(0, *shape)[0] * shape[1]
    rows, _ = rebuild(kinds, shape, [pairs(parts) for parts in received], dtype, blocks, region)
    return rows.reshape(-1)[start:start + max(own[1] - own[0], 0)]


def dest_sizes(kinds: Sequence[str], shape: Tuple[int, int], counts: Sequence[Counts], ranges: Sequence[Range],
               wire: torch.dtype, blocks: Blocks = None) -> List[List[int]]:
    """Bytes of one unit's blocks from each source to each destination, ``[s][d]`` (`range_specs`)."""
    return [[packed_size(range_specs(kinds, shape, counts[s], d, ranges[d], wire, blocks)) for d in range(len(ranges))]
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
    every rank's owned range, this rank's rows per use, and (after `ExactCodec.agree_range_counts`)
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


def _shares(items: Sequence[PartitionItem], sizes: Dict[int, List[List[int]]], me: int, S: int) -> Dict[int, Traffic]:
    """Each item's part of the one all-to-all (the call counted on the first item)."""
    out = {}
    for i, it in enumerate(items):
        handed = sum(sizes[it.key][me])
        sent = handed - sizes[it.key][me][me]
        received = sum(sizes[it.key][s][me] for s in range(S) if s != me)
        out[it.key] = Traffic(handed, sent, received, 1 if i == 0 else 0)
    return out


class ExactCodec:
    """Exact factors' collectives, one per region (module doc): `gather` (`Whole`), `exchange_shards`
    (`RowShards`), `exchange_ranges` (`Ranges`)."""

    def __init__(self, wire_dtype: Optional[torch.dtype], device: torch.device):
        self.wire_dtype = wire_dtype
        self.device = device

    def wire(self, unit: FactorUnit) -> torch.dtype:
        """None: factors travel in the gradients' dtype."""
        return self.wire_dtype or unit.param.dtype

    def encode(self, unit: FactorUnit, rows: Sequence[Rows]) -> torch.Tensor:
        return pack(cut(unit.kinds, unit.shape, rows, self.wire(unit), unit.blocks), self.device)

    def _specs(self, unit: FactorUnit, counts: Sequence[int]) -> List[BlockSpec]:
        return exact_block_specs(unit.kinds, unit.shape, counts, self.wire(unit), unit.blocks)

    def sizes(self, unit: FactorUnit, rows_by_rank: Sequence[Sequence[int]]) -> List[int]:
        """Every rank's buffer length, from the agreed row counts (no size exchange needed)."""
        return [packed_size(self._specs(unit, r)) for r in rows_by_rank]

    def gather_rows(self, unit: FactorUnit, rows: Sequence[Rows], rows_by_rank: Sequence[Sequence[int]],
                    aggregator: FactorAggregator, name: str) -> Tuple[List[Rows], Traffic]:
        """Every rank's rows of ``aggregator``'s group, `stacked_rows`, by one all-gather of `encode`'s buffers."""
        gather = aggregator.all_gather(self.encode(unit, rows), name=name, first_dims=self.sizes(unit, rows_by_rank))
        return self.stacked_rows(unit, gather.wait(), rows_by_rank), gather.traffic

    def gather(self, group: FactorAggregator, units: Sequence[Tuple[FactorUnit, Sequence[Rows], RowCounts]],
               name: str):
        """One all-gather of several units' buffers (``(unit, rows, every member's row counts)``
        each); returns its handle and what waits for it and `decode`s each unit at a given scale."""
        payloads = [self.encode(unit, rows) for unit, rows, _ in units]
        sizes = [self.sizes(unit, counts) for unit, _, counts in units]  # by unit, by member
        handle = group.all_gather(payloads[0] if len(payloads) == 1 else torch.cat(payloads), name=name,
                                  first_dims=[sum(s[k] for s in sizes) for k in range(group.world_size)])

        def decoded(scale: float) -> list:
            parts = [b.split([s[k] for s in sizes]) for k, b in enumerate(handle.wait())]
            return [self.decode(unit, [p[j] for p in parts], counts, scale)
                    for j, (unit, _, counts) in enumerate(units)]

        return handle, decoded

    def stacked_rows(self, unit: FactorUnit, buffers: Sequence[torch.Tensor],
                     rows_by_rank: Sequence[Sequence[int]]) -> List[Rows]:
        """Per use, every rank's rows stacked in rank order (ids as int64, floats in the compute dtype)."""
        cdt = compute_dtype(unit.param)
        per_rank = [unpack(buf, self._specs(unit, r)) for buf, r in zip(buffers, rows_by_rank)]
        out = []
        for u, kind in enumerate(unit.kinds):
            left = torch.cat([blocks[2 * u] for blocks in per_rank])
            right = torch.cat([blocks[2 * u + 1] for blocks in per_rank]).to(cdt)
            out.append((left.long() if kind == "embedding" else left.to(cdt), right))
        return out

    def decode(self, unit: FactorUnit, buffers: Sequence[torch.Tensor], rows_by_rank: Sequence[Sequence[int]],
               scale: float) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
        """``scale * sum over ranks`` of the weight's and its biases' gradients; None if no rank
        used the weight (its gradient then stays as it is, as with DDP)."""
        if not any(any(r) for r in rows_by_rank):
            return None
        return rebuild_unit(unit, self.stacked_rows(unit, buffers, rows_by_rank), compute_dtype(unit.param), scale)

    def exchange_shards(self, unit: FactorUnit, rows: Sequence[Rows], rows_by_rank: RowCounts,
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
            right, send = encode_sliced(rows, rows_by_rank, shape[0], S, self.wire(unit), unit.blocks)
            gather = aggregator.all_gather(right, name=f"{name}.right",
                                           first_dims=[sum(r) * shape[1] for r in rows_by_rank])
            to_all = aggregator.all_to_all(send, name=f"{name}.left")
            weight, values = decode_sliced(unit.kinds, shape, gather.wait(), to_all.wait(), rows_by_rank, rank,
                                           biases, cdt)
            traffic, method = gather.traffic + to_all.traffic, "sliced"
        else:
            gathered, traffic = self.gather_rows(unit, rows, rows_by_rank, aggregator, name)
            weight, values = decode_whole(unit.kinds, shape, gathered, rank, S, biases, cdt)
            method = "whole"
        return ShardedResult(by_param(unit, weight, values, scale), traffic, method)

    def agree_range_counts(self, items: Sequence[PartitionItem], aggregator: FactorAggregator) -> Traffic:
        """Fill every item's ``counts`` with every rank's (one all-gather of int64 for all items)."""
        mine = [use_counts(it.kinds, it.rows, [covering_rows(lo, hi, it.shape[1]) for lo, hi in it.ranges])
                for it in items]
        counts, traffic = agree_counts(mine, aggregator, "dad.partition.counts", self.device)
        for it, by_rank in zip(items, counts):
            it.counts = by_rank
        return traffic

    def exchange_ranges(self, items: Sequence[PartitionItem], aggregator: FactorAggregator, dtype: torch.dtype,
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
        for d in range(S):   # by destination, items in order: the layout `range_specs` describes
            for it in items:
                parts = range_cuts(it.kinds, it.shape, it.rows, [it.ranges[d]], wire, it.blocks)[0]
                pos += pack_into(parts, send.narrow(0, pos, sizes[it.key][me][d]))
        recv_sizes = [sum(sizes[it.key][s][me] for it in items) for s in range(S)]
        received = aggregator.all_to_all_v(send, send_sizes, recv_sizes, name="dad.partition.factors").wait()
        per_source: Dict[int, List[List[torch.Tensor]]] = {it.key: [] for it in items}
        pos = 0
        for s in range(S):
            for it in items:
                size = sizes[it.key][s][me]
                specs = range_specs(it.kinds, it.shape, it.counts[s], me, it.ranges[me], wire, it.blocks)
                per_source[it.key].append(unpack(received[pos:pos + size], specs) if specs else [])
                pos += size
        for it in items:
            deliver(it.key, range_rebuild(it.kinds, it.shape, per_source.pop(it.key), it.ranges[me], dtype,
                                          it.blocks).mul_(scale))
        return _shares(items, sizes, me, S)

    def local_range(self, item: PartitionItem, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s owned elements of its *own* gradient, rebuilt from its own rows only (the
        first step's check against autograd's local gradient)."""
        wire = self.wire_dtype or dtype
        (own,) = range_cuts(item.kinds, item.shape, item.rows, [item.ranges[rank]], wire, item.blocks)
        return range_rebuild(item.kinds, item.shape, [own], item.ranges[rank], dtype, item.blocks)
