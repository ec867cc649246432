"""Units the sharded engines must keep off sharded exact factors, in one process (no collective).

The multi-process checks of PowerSGD's coverage floor under FSDP2 and ZeRO-2/3 are in
`test_fsdp2.py` (`test_coverage_floor_under_fsdp2`) and `test_zero.py` (`test_coverage_floor_under_zero`).
Here: a unit without uses (a raw 3-D parameter), and one whose row blocks lie on a non-linear use,
have no sharded "exact" route in any mode (FSDP2's cost model, ZeRO's own estimates) and the sharded
exact codec refuses them; a unit whose linear uses cover row blocks of its weight (a packed
projection called on slices: MHA's ``in_proj_weight``) takes sharded exact factors as a whole-row
unit does (its algebra: `test_sharded_exact`, `test_partition_exact`). The sharded rank routes
reduce blocked units and units without uses from the dense local gradient's matrix view (never
from blocked factors).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dad_integrations.capture.hooks import Use
from dad_integrations.codecs.exact import ExactCodec, sharded_exact_covers
from dad_integrations.codecs.sharded_rank import ShardedRankCodec
from dad_integrations.config import DADConfig
from dad_integrations.routing.router import UnitShape, RouteContext, UnitEvidence, route
from dad_integrations.capture.rows import as_matrix
from dad_integrations.capture.units import FactorUnit

F32 = dict(world_size=2, wire_dtype=torch.float32, sharded=True)


def _units():
    torch.manual_seed(0)
    packed = nn.Linear(4, 6)  # rows 0:3 and 3:6 of its weight used by two calls (q and k slices)
    blocked = FactorUnit(0, "packed.weight", packed.weight,
                         [Use("packed.q", packed, "linear", block=(0, 3)), Use("packed.k", packed, "linear", block=(3, 3))], [])
    whole = FactorUnit(1, "lin.weight", nn.Linear(4, 6).weight, [Use("lin", packed, "linear")], [])
    floor = FactorUnit(2, "pos", nn.Parameter(torch.randn(5, 2, 3)), [], [])
    return blocked, whole, floor


def _conv1d_blocked():
    """Row blocks on a conv1d-layout use (whose left is X, its bias along the other side): no kind
    makes one, and sharded exact factors do not take it."""
    packed = nn.Linear(4, 6)
    return FactorUnit(3, "c.weight", packed.weight, [Use("c.q", packed, "conv1d", block=(0, 3))], [])


def test_sharded_exact_routes_by_uses_and_blocks():
    blocked, whole, floor = _units()
    odd = _conv1d_blocked()
    assert [sharded_exact_covers(u.kinds, u.blocks) for u in (blocked, whole, floor, odd)] == [True, True, False, False]
    assert not blocked.factors_only and not floor.factors_only and whole.factors_only  # rank: dense matrix
    assert floor.shape == (5, 6)
    rows = [[[2, 2]] * 2, [[2]] * 2]
    for mode in ("exact", "auto"):
        cfg = DADConfig(mode=mode, rank=2)
        for unit, counts in ((floor, None), (odd, rows[1])):
            shape = UnitShape(tuple(unit.kinds), unit.shape, 0, torch.float32, unit.blocks)
            # FSDP2: the cost model's sharded estimates; ZeRO: its own, without "exact" for these
            assert route(RouteContext(cfg, **F32), shape, UnitEvidence(rows_by_rank=counts)).representation != "exact"
            zero_like = {"dense": 1.0, "rank": 2.0, "rank_allreduce": 2.0}
            assert route(RouteContext(cfg, **F32), shape, UnitEvidence(rows_by_rank=counts, estimates=zero_like)).representation == "dense"
    # linear uses over row blocks (a packed projection's q and k slices): sharded exact factors
    shape = UnitShape(tuple(blocked.kinds), blocked.shape, 0, torch.float32, blocked.blocks)
    assert route(RouteContext(DADConfig(mode="exact"), **F32), shape, UnitEvidence(rows_by_rank=rows[0])).representation == "exact"
    with pytest.raises(ValueError, match="row blocks"):
        ExactCodec(None, torch.device("cpu")).exchange_shards(odd, [], rows[1], None, 1.0)
    with pytest.raises(ValueError, match="no uses"):
        ExactCodec(None, torch.device("cpu")).exchange_shards(floor, [], [], None, 1.0)


@pytest.mark.parametrize("representation", ["rank", "rank_allreduce"])
def test_sharded_rank_routes_reduce_blocked_and_floor_units_from_the_dense_matrix(representation):
    """Without error feedback the rank routes may reduce on the factors; a blocked unit's factors
    cover only their block, so it (and a unit without uses) is reduced from the dense local
    gradient, as the sink gives it: the matrix view."""
    blocked, whole, floor = _units()
    codec = ShardedRankCodec(DADConfig(mode="rank", rank=2, error_feedback=False), None)
    few = [(torch.randn(1, 3), torch.randn(1, 4)), (torch.randn(1, 3), torch.randn(1, 4))]  # 2 rows: factors would win

    def local_grad(p, dtype):
        return as_matrix(torch.ones(p.shape, dtype=dtype))

    for unit, rows in ((blocked, few), (floor, [])):
        item = codec.local(unit, rows, local_grad, representation)
        assert item.method == "dense" and tuple(item.local.dense.shape) == unit.shape, (unit.name, item.method)
    # the same two rows over whole rows of the weight: reduced on the factors
    assert codec.local(whole, [(torch.randn(2, 6), torch.randn(2, 4))], None, representation).method == "factors"
