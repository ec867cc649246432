"""The sharded exact codec's algebra on one process (`dad_integrations.codecs.exact`, `RowShards`).

S ranks are simulated: each rank's payloads are encoded, the all-to-all is done by hand (rank d
receives block d of every rank's ``send``), and every rank's decoded shard must equal its rows of
the full ``sum_s left_s^T right_s`` (zero in the padding rows), biases included.
"""
import pytest
import torch
from torch import nn

from dad_integrations.comm.aggregator import EqualSizeAggregator
from dad_integrations.codecs.exact import shard_span
from dad_integrations.codecs.exact import ExactCodec, decode_sliced, decode_whole, encode_sliced
from dad_integrations.config import DADConfig
from dad_integrations.capture.rows import add_rebuilt_grad, output_grad_rows
from dad_integrations.capture.sink import ShardSink, ShardSlot
from dad_integrations.capture.assign import build_plan

F64 = torch.float64


def _rows(kinds, shape, counts, seed):
    """Per rank, per use: random (left, right) in `layers`' orientation."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    out = []
    for per_use in counts:
        ranks = []
        for kind, k in zip(kinds, per_use):
            left = torch.randint(0, m, (k,), generator=g) if kind == "embedding" else torch.randn(k, m, generator=g,
                                                                                                 dtype=F64)
            ranks.append((left, torch.randn(k, n, generator=g, dtype=F64)))
        out.append(ranks)
    return out


def _full(kinds, shape, rows, biases):
    """The whole sum over ranks of the weight's and each bias' gradient."""
    grad = torch.zeros(shape, dtype=F64)
    for per_rank in rows:
        for kind, pair in zip(kinds, per_rank):
            add_rebuilt_grad(kind, grad, pair)
    bias = [sum(output_grad_rows(kinds[u], r[u]).sum(0) for r in rows) for u, _ in biases]
    return grad, bias


def _check_shard(shard, full, rank, world):
    a, b, c = shard_span(rank, world, full.shape[0])
    assert shard.shape[0] == c
    torch.testing.assert_close(shard[:b - a], full[a:b], rtol=1e-12, atol=1e-12)
    assert not shard[b - a:].any()  # padding rows


@pytest.mark.parametrize("m,world", [(7, 2), (8, 4), (5, 4), (3, 4), (1, 2)])
def test_span_is_torch_chunk_with_padded_rows(m, world):
    chunks = torch.arange(m).chunk(world)
    for r in range(world):
        a, b, c = shard_span(r, world, m)
        assert c == -(-m // world)
        assert list(range(a, b)) == (chunks[r].tolist() if r < len(chunks) else [])


@pytest.mark.parametrize("kinds,shape,counts,bias_len", [
    (("linear",), (7, 5), [[3], [0], [4]], 7),               # Linear (out, in): bias rows = left's columns
    (("conv1d",), (7, 5), [[2], [5], [1]], 5),               # Conv1D (in, out): bias sharded on its own
    (("linear", "linear"), (9, 4), [[2, 0], [1, 3], [0, 0], [4, 1]], 9),  # a weight used by two layers
    (("conv1d",), (3, 6), [[2], [2], [2], [2]], 6),          # more ranks than rows: empty shards
])
def test_sliced_rows_equal_the_slice_of_the_full_product(kinds, shape, counts, bias_len):
    world, m = len(counts), shape[0]
    rows = _rows(kinds, shape, counts, seed=1)
    biases = [(0, bias_len)]
    full, (bias,) = _full(kinds, shape, rows, biases)
    payloads = [encode_sliced(r, counts, m, world, F64) for r in rows]
    rights = [right for right, _ in payloads]
    c = -(-m // world)
    longest = sum(max(k[u] for k in counts) for u in range(len(kinds)))
    for rank in range(world):
        assert payloads[rank][1].shape == (world, longest, c)
        received = torch.stack([send[rank] for _, send in payloads])  # the all-to-all, by hand
        shard, (b_shard,) = decode_sliced(kinds, shape, rights, received, counts, rank, biases, F64)
        _check_shard(shard, full, rank, world)
        _check_shard(b_shard, bias, rank, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_whole_factors_keep_the_ids_in_range(world):
    """GPT-2's tied wte/lm_head: an embedding use (ids) and a linear use (D over the vocabulary)."""
    kinds, shape = ("embedding", "linear"), (9, 4)
    counts = [[3 + r, 2 * r] for r in range(world)]
    rows = _rows(kinds, shape, counts, seed=world)
    full, _ = _full(kinds, shape, rows, [])
    gathered = [(torch.cat([r[u][0] for r in rows]), torch.cat([r[u][1] for r in rows])) for u in range(2)]
    for rank in range(world):
        shard, biases = decode_whole(kinds, shape, gathered, rank, world, [], F64)
        assert biases == []
        _check_shard(shard, full, rank, world)


class _OneRank(EqualSizeAggregator):
    """A world of one: the collectives hand the tensor back."""

    def __init__(self):
        super().__init__()
        self._rank, self._world = 0, 1

    def _engine_all_gather(self, out, tensor, async_op=False):
        out[0].copy_(tensor)

    def _engine_all_reduce(self, tensor, async_op=False):
        pass

    def _engine_all_to_all(self, out, tensor, async_op=False):
        out.copy_(tensor)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_exchange_on_one_rank_is_the_local_gradient(kind):
    """The codec's glue (uses, riding biases, scale, sliced or whole) against autograd."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 6).double() if kind == "linear" else nn.Embedding(10, 3).double()
    plan = build_plan(layer, DADConfig(mode="exact"))
    (unit,) = plan.units
    x = torch.randn(5, 4, dtype=F64) if kind == "linear" else torch.randint(0, 10, (5,))
    layer(x).pow(2).sum().backward()
    rows = [(torch.cat([a for a, _ in c.pairs]), torch.cat([b for _, b in c.pairs])) for c in unit.uses]
    result = ExactCodec(None, torch.device("cpu")).exchange_shards(unit, rows, [[r[0].shape[0] for r in rows]],
                                                                   _OneRank(), scale=0.5)
    assert result.method == ("sliced" if kind == "linear" else "whole")
    for p in unit.params:
        torch.testing.assert_close(result.shards[p], 0.5 * p.grad)
    assert result.traffic.sent == 0  # one rank sends nothing
    for c in plan.captures:
        c.remove()


def test_shard_sink_reads_local_gradients_and_writes_padded_shards():
    """FSDP2's layout: chunk r holds rows [r c, (r+1) c) of each parameter, zero past its last row."""
    world = 2  # this is rank 1
    w, b = torch.randn(5, 3), torch.randn(5)  # c = 3: rank 1 holds rows 3, 4 and one padding row
    slots = [ShardSlot("w", nn.Parameter(torch.zeros(5, 3)), 0, 9, 3, (5, 3)),
             ShardSlot("b", nn.Parameter(torch.zeros(5)), 9, 3, 3, (5,))]
    padded = [torch.cat([t, torch.zeros((1,) + t.shape[1:])]) for t in (w, b)]
    inp = torch.cat([torch.cat([t[r * 3:(r + 1) * 3].reshape(-1) for t in padded]) for r in range(world)])
    out = torch.full((12,), 7.0)
    sink = ShardSink(slots, out, inp / 4, world, predivide=4.0)
    torch.testing.assert_close(sink.local_grad(slots[0].param, torch.float32), w)
    torch.testing.assert_close(sink.local_grad(slots[1].param, torch.float32), b)
    assert not sink.local_grad(nn.Parameter(torch.ones(2)), torch.float32).any()  # not in the buffers
    sink.write(slots[0].param, w[3:])                     # two rows: the padding row is zeroed
    sink.write(slots[1].param, None)                      # nothing: zeros
    assert torch.equal(out[:9].view(3, 3), torch.cat([w[3:], torch.zeros(1, 3)]))
    assert not out[9:].any()
    compact = sink.dense_input(slots[1:])                 # b's chunks of every rank
    assert torch.equal(compact * 4, torch.cat([padded[1][:3], padded[1][3:]]))
    sink.write_dense(slots[1:], torch.arange(3.0))
    assert torch.equal(out[9:], torch.arange(3.0))


def test_all_to_all_counts_what_leaves_the_rank():
    """Of S equal blocks handed to an all-to-all, S - 1 leave this rank and S - 1 arrive."""
    agg = _OneRank()
    agg._world = 3
    handle = agg.all_to_all(torch.arange(12.0).view(3, 4), name="t")
    assert torch.equal(handle.wait(), torch.arange(12.0).view(3, 4))
    assert (handle.traffic.handed, handle.traffic.sent, handle.traffic.received) == (48, 32, 32)
    with pytest.raises(ValueError, match="3 blocks"):
        agg.all_to_all(torch.zeros(2, 4), name="t")


def _blocked_rows(blocks, m, n, counts, seed):
    """Per rank, per use: (left, right) with ``height`` columns on a blocked use's left."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(k, m if b is None else b[1], generator=g, dtype=F64), torch.randn(k, n, generator=g, dtype=F64))
             for k, b in zip(per_rank, blocks)] for per_rank in counts]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_row_blocked_linear_uses_land_in_their_rows(world):
    """MHA's packed ``in_proj_weight`` (3E x E): the whole-height self-attention call beside its
    q, kv and v slices (row blocks), with the split ``in_proj_bias`` over all four uses: each
    block's left columns go to the ranks whose rows they are, and every rank's shard of the weight
    and the bias equals its rows of the full sum (shards of 9 rows cut inside blocks at 2 and 4 ranks)."""
    E, n = 3, 4
    m = 3 * E
    blocks = (None, (0, E), (E, 2 * E), (2 * E, E))
    kinds = ("linear",) * 4
    counts = [[2 + s, s, 1, (s + 1) % 2] for s in range(world)]
    rows = _blocked_rows(blocks, m, n, counts, seed=world)
    full, bias = torch.zeros(m, n, dtype=F64), torch.zeros(m, dtype=F64)
    for per_rank in rows:
        for (left, right), b in zip(per_rank, blocks):
            off, h = b if b is not None else (0, m)
            add_rebuilt_grad("linear", full, (left, right), b)
            bias[off:off + h] += left.sum(0)
    payloads = [encode_sliced(r, counts, m, world, F64, blocks) for r in rows]
    rights = [right for right, _ in payloads]
    for rank in range(world):
        received = torch.stack([send[rank] for _, send in payloads])
        shard, (b_shard,) = decode_sliced(kinds, (m, n), rights, received, counts, rank, [((0, 1, 2, 3), m)], F64)
        _check_shard(shard, full, rank, world)
        _check_shard(b_shard, bias, rank, world)
