"""HSDP's replicate hop without a cluster: the bytes per route (`routes`' models on the ``replicate_hop`` layout), the
pieces a node's shared Q is cut into (`codecs.replicate_rank.piece_span`), the per-shard merge of
residuals at another node count (`engines.checkpoint.merge_rank_states`), and the torch version
guard of the FSDP seam (`fsdp_seams.hsdp_supported`). The jobs are in `test_hsdp.py`."""
import pytest
import torch

from dad_integrations.codecs.replicate_rank import piece_span
from dad_integrations.engines.checkpoint import merge_rank_states
from dad_integrations.routes import layouts
from dad_integrations.routes.registry import UnitSizing, estimates_on, routes_for


def test_bytes_per_route():
    m, n, R, L, r = 768, 256, 2, 4, 4
    sizing = UnitSizing(("linear",), (m, n), torch.float32, None, rank=r, bias_numel=m, rows=[512], nodes=R, local=L)
    est = estimates_on(layouts.REPLICATE_HOP, sizing, routes_for())
    c = m // L
    bias = 2 * (R - 1) / R * c * 4
    assert est["dense"] == pytest.approx(2 * (R - 1) / R * c * n * 4 + bias)
    piece = r * (c + n // L) * 4  # P's rows of the shard and a 1/L piece of the node's Q: not n per rank
    assert est["rank"] == pytest.approx((R - 1) * piece + bias)
    assert est["rank_allreduce"] == pytest.approx(2 * (R - 1) / R * piece + bias)
    assert est["exact"] >= (R - 1) * 512 * (m + n) * 4  # each rank's own rows, once between nodes
    assert est["rank_allreduce"] < 0.05 * est["dense"]


def test_pieces_cover_the_tensor():
    for numel, L in [(10, 4), (1024, 2), (3, 4), (0, 2)]:
        spans = [piece_span(numel, L, k) for k in range(L)]
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_residuals_merge_per_shard():
    """2 nodes x 2 shards to any node count of width 2: the mean over nodes of each shard's rows."""
    def state(s, value):
        return {"version": 1, "steps": 5, "rank_routes": {"w": {"warm_q": None, "shared_q": torch.ones(3, 1),
                                                                 "residual": torch.full((2, 3), value),
                                                                 "shard": [s, 2]}}}
    merged, _ = merge_rank_states([state(0, 1.0), state(1, 10.0), state(0, 3.0), state(1, 30.0)])
    entry = merged["rank_routes"]["w"]
    assert torch.equal(entry["residual_shards"][0], torch.full((2, 3), 2.0))
    assert torch.equal(entry["residual_shards"][1], torch.full((2, 3), 20.0))
    assert entry["shard"] == [None, 2] and entry.get("residual") is None


def test_hsdp_seam_is_version_guarded(monkeypatch):
    from dad_integrations import fsdp_seams
    assert fsdp_seams.hsdp_supported() is None  # the torch this project pins
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert "2.13" in fsdp_seams.hsdp_supported()
