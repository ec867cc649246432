"""The partition codec's algebra on one process (`dad_integrations.codecs.exact`, `Ranges`).

S ranks are simulated: each rank encodes its blocks by destination, the all-to-all is done by hand
(rank d receives block d of every rank), and every rank's decoded elements must equal its element
range of the flattened ``sum_s G_s``: ZeRO-3's equal pieces and ZeRO-2's arbitrary cuts (a weight
wholly in one rank's partition, or spanning several, boundaries inside a row).
"""
import pytest
import torch

from dad_integrations.comm.aggregator import EqualSizeAggregator
from dad_integrations.codecs.exact import (ExactCodec, PartitionItem, covering_rows, range_cuts, range_rebuild,
                                           range_specs, use_counts)
from dad_integrations.capture.rows import add_rebuilt_grad
from dad_integrations.codecs.wire import packed_size

F64 = torch.float64


def _rows(kinds, shape, counts, seed):
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    out = []
    for per_rank in counts:
        ranks = []
        for kind, k in zip(kinds, per_rank):
            left = (torch.randint(0, m, (k,), generator=g) if kind == "embedding"
                    else torch.randn(k, m, generator=g, dtype=F64))
            ranks.append((left, torch.randn(k, n, generator=g, dtype=F64)))
        out.append(ranks)
    return out


def _full(kinds, shape, rows):
    grad = torch.zeros(shape, dtype=F64)
    for per_rank in rows:
        for kind, pair in zip(kinds, per_rank):
            add_rebuilt_grad(kind, grad, pair)
    return grad.reshape(-1)


def _zero3(numel, world):
    p = -(-numel // world)
    return [(min(r * p, numel), min((r + 1) * p, numel)) for r in range(world)]


def _cuts(numel, world, cuts):
    """ZeRO-2: rank d owns [cuts[d], cuts[d+1]) clipped to the weight (it may own nothing)."""
    bounds = [0] + list(cuts) + [numel]
    return [(max(0, min(bounds[d], numel)), max(0, min(bounds[d + 1], numel))) for d in range(world)]


@pytest.mark.parametrize("lo,hi,n,expected", [(0, 12, 4, (0, 3)), (5, 7, 4, (1, 2)), (3, 9, 4, (0, 3)),
                                              (8, 8, 4, (0, 0)), (4, 8, 4, (1, 2))])
def test_covering_rows(lo, hi, n, expected):
    assert covering_rows(lo, hi, n) == expected


CASES = [
    (("linear",), (7, 5), [[3], [0], [4]], "zero3"),
    (("conv1d",), (6, 5), [[2], [5]], "zero3"),
    (("linear", "linear"), (9, 4), [[2, 0], [1, 3], [0, 0], [4, 1]], "zero3"),      # two uses, an idle rank
    (("conv1d",), (3, 6), [[2], [2], [2], [2]], "zero3"),
    (("linear",), (7, 5), [[3], [2]], [35]),                                      # wholly on rank 0
    (("linear",), (7, 5), [[3], [2]], [0]),                                       # wholly on rank 1
    (("linear",), (7, 5), [[3], [2], [1]], [13, 22]),                              # cuts inside rows
    (("embedding", "linear"), (9, 4), [[5, 2], [3, 0], [6, 4]], [7, 30]),          # GPT-2's tied wte/lm_head
    (("embedding",), (11, 3), [[8], [0]], "zero3"),
    (("embedding", "linear"), (9, 4), [[5, 2], [3, 3]], "zero3"),
]


@pytest.mark.parametrize("kinds,shape,counts,layout", CASES)
def test_owned_elements_equal_the_slice_of_the_full_sum(kinds, shape, counts, layout):
    world, numel = len(counts), shape[0] * shape[1]
    ranges = _zero3(numel, world) if layout == "zero3" else _cuts(numel, world, layout)
    rows = _rows(kinds, shape, counts, seed=3)
    full = _full(kinds, shape, rows)
    sent = [range_cuts(kinds, shape, r, ranges, F64) for r in rows]
    agreed = [use_counts(kinds, r, [covering_rows(*o, shape[1]) for o in ranges]) for r in rows]
    for d, (lo, hi) in enumerate(ranges):
        received = [sent[s][d] for s in range(world)]
        for s in range(world):  # what the receiver computes from the counts matches what was sent
            specs = range_specs(kinds, shape, agreed[s], d, ranges[d], F64)
            assert [(t.dtype, tuple(t.shape)) for t in received[s]] == [(dt, sh) for dt, sh in specs]
            # per use: [rows], and an embedding's ids for each rank
            assert [len(k) for k in agreed[s]] == [1 + world if k == "embedding" else 1 for k in kinds]
        owned = range_rebuild(kinds, shape, received, (lo, hi), F64)
        assert owned.shape == (max(0, hi - lo),)
        torch.testing.assert_close(owned, full[lo:hi], rtol=1e-12, atol=1e-12)


def test_a_rank_owning_nothing_receives_nothing():
    kinds, shape = ("linear",), (7, 5)
    ranges = _cuts(35, 2, [35])
    rows = _rows(kinds, shape, [[3], [2]], seed=0)
    for r in rows:
        assert range_cuts(kinds, shape, r, ranges, F64)[1] == []
        assert packed_size(range_specs(kinds, shape, [[3]], 1, ranges[1], F64)) == 0


def test_embedding_ids_go_to_their_owner_only():
    """Ids are sent to the ranks whose covering rows hold them (a boundary row to both)."""
    kinds = ("embedding",)   # a 10 x 2 weight
    ranges = [(0, 9), (9, 20)]          # rank 0 rows 0..4 (row 4 half), rank 1 rows 4..9
    ids = torch.tensor([0, 4, 4, 9, 7])
    (counts,) = use_counts(kinds, [(ids, torch.ones(5, 2, dtype=F64))], [covering_rows(*o, 2) for o in ranges])
    assert counts == [5, 3, 4]          # 0, 4, 4 to rank 0; 4, 4, 9, 7 to rank 1


class _OneRank(EqualSizeAggregator):
    def __init__(self):
        super().__init__()
        self._rank, self._world = 0, 1

    def _engine_all_gather(self, out, tensor, async_op=False):
        out[0].copy_(tensor)

    def _engine_all_reduce(self, tensor, async_op=False):
        pass

    def _engine_all_to_all_v(self, out, tensor, out_sizes, in_sizes, async_op=False):
        out.copy_(tensor)


def test_exchange_on_one_rank_is_the_scaled_local_gradient():
    kinds, shape = ("embedding", "linear"), (9, 4)
    (rows,) = _rows(kinds, shape, [[5, 3]], seed=1)
    items = [PartitionItem(7, kinds, shape, [(3, 30)], rows), PartitionItem(8, ("linear",), shape, [(0, 0)],
                                                                           rows[1:])]
    codec, agg = ExactCodec(None, torch.device("cpu")), _OneRank()
    codec.agree_range_counts(items, agg)
    assert items[0].rows_by_rank() == [[5, 3]]
    owned = {}
    traffic = codec.exchange_ranges(items, agg, F64, scale=0.5, deliver=owned.__setitem__)
    full = _full(kinds, shape, [rows])
    assert list(owned) == [7, 8]        # delivered one by one, in order
    torch.testing.assert_close(owned[7], 0.5 * full[3:30])
    assert owned[8].numel() == 0
    torch.testing.assert_close(codec.local_range(items[0], 0, F64), full[3:30])
    assert traffic[7].sent == 0 and traffic[7].handed > 0


def test_all_to_all_v_checks_sizes():
    agg = _OneRank()
    with pytest.raises(ValueError, match="1-D tensor of 3"):
        agg.all_to_all_v(torch.zeros(2), [3], [3], name="t")
    handle = agg.all_to_all_v(torch.arange(3.0), [3], [3], name="t")
    assert torch.equal(handle.wait(), torch.arange(3.0)) and handle.traffic.sent == 0


@pytest.mark.parametrize("layout", ["zero3", [5, 17], [0, 13], [36]])
def test_row_blocked_linear_uses_rebuild_the_owned_elements(layout):
    """MHA's packed ``in_proj_weight`` (9 x 4): a whole-height use beside q, kv and v row blocks
    (lefts of 3, 6, 3 columns). Each destination gets, per use, only the columns of its covering
    rows that the use's block meets (two empty blocks where it meets none: the sizes `range_specs`
    gives), and every rank's owned elements equal its range of the full sum (cuts inside rows and
    blocks; a rank owning nothing)."""
    E, n, world = 3, 4, 3 if layout != [36] else 2
    m = 3 * E
    blocks = (None, (0, E), (E, 2 * E), (2 * E, E))
    kinds = ("linear",) * 4
    counts = [[2 + s, s, 1, (s + 1) % 2] for s in range(world)]
    g = torch.Generator().manual_seed(1)
    rows = [[(torch.randn(k, m if b is None else b[1], generator=g, dtype=F64), torch.randn(k, n, generator=g, dtype=F64))
             for k, b in zip(per_rank, blocks)] for per_rank in counts]
    full = torch.zeros(m, n, dtype=F64)
    for per_rank in rows:
        for pair, b in zip(per_rank, blocks):
            add_rebuilt_grad("linear", full, pair, b)
    numel = m * n
    ranges = _zero3(numel, world) if layout == "zero3" else _cuts(numel, world, layout)
    agreed = [use_counts(kinds, r, [covering_rows(*o, n) for o in ranges]) for r in rows]
    for d in range(world):
        received = []
        for s in range(world):
            (parts,) = range_cuts(kinds, (m, n), rows[s], [ranges[d]], F64, blocks)
            specs = range_specs(kinds, (m, n), agreed[s], d, ranges[d], F64, blocks)
            assert [tuple(p.shape) for p in parts] == [shape for _, shape in specs]
            received.append(parts)
        lo, hi = ranges[d]
        torch.testing.assert_close(range_rebuild(kinds, (m, n), received, ranges[d], F64, blocks),
                                   full.reshape(-1)[lo:hi], rtol=1e-12, atol=1e-12)
