"""Packing rows into bytes, and the per-unit choice of representation."""
import torch

from dad_integrations.routing.costs import estimate_bytes
from dad_integrations.routing.router import choose as choose_representation
from dad_integrations.codecs.exact import exact_block_specs
from dad_integrations.codecs.wire import pack, packed_size, unpack


def test_pack_round_trip_mixed_dtypes():
    blocks = [torch.arange(5, dtype=torch.int32), torch.randn(5, 3).half(), torch.randn(2, 7)]
    buf = pack(blocks, torch.device("cpu"))
    specs = [(b.dtype, tuple(b.shape)) for b in blocks]
    assert buf.dtype == torch.uint8 and buf.numel() == packed_size(specs)
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), buf])[3:]  # a misaligned view
    for a, b in zip(blocks, unpack(shifted, specs)):
        assert torch.equal(a, b)


def test_auto_picks_fewest_bytes():
    common = dict(kinds=["linear"], shape=(768, 768), bias_numel=768, grad_dtype=torch.float32,
                  wire_dtype=torch.float32, world_size=8)
    few = estimate_bytes(rows_by_rank=[[16]] * 8, rank=0, **common)
    many = estimate_bytes(rows_by_rank=[[4096]] * 8, rank=0, **common)
    assert choose_representation("auto", few, rank_allowed=False) == "exact"
    assert choose_representation("auto", many, rank_allowed=False) == "dense"
    with_rank = estimate_bytes(rows_by_rank=[[4096]] * 8, rank=4, **common)
    assert choose_representation("auto", with_rank, rank_allowed=True) == "rank_allreduce"   # 8 sites
    assert choose_representation("auto", with_rank, rank_allowed=True, rank_route="allgather") == "rank"
    assert choose_representation("exact", many, rank_allowed=False) == "exact"
    assert choose_representation("rank", with_rank, rank_allowed=True, rank_route="allgather") == "rank"


def test_exact_estimate_matches_packed_layout():
    specs = exact_block_specs(["embedding", "linear"], (50, 8), [10, 6], torch.float16)
    assert packed_size(specs) == (40 + 160) + (6 * 50 * 2 + 6 * 8 * 2)


def test_sorted_segment_add_matches_index_add():
    """The atomics-free embedding rebuild used on CUDA gives what index_add_ gives."""
    from dad_integrations.capture.rows import sorted_segment_add
    ids = torch.randint(0, 7, (50,))
    rows = torch.randn(50, 3, dtype=torch.float64)
    a = torch.zeros(7, 3, dtype=torch.float64).index_add_(0, ids, rows)
    b = torch.zeros(7, 3, dtype=torch.float64)
    sorted_segment_add(b, ids, rows)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
