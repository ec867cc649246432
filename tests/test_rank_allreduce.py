"""The rank-r all-reduce route (PowerSGD's shared power iteration) in one process: its algebra."""

import pytest
import torch
from torch import nn

from dad_integrations import DADSynchronizer, TorchDistributedAggregator
from dad_integrations.config import DADConfig
from dad_integrations.error_feedback import ErrorFeedback
from dad_integrations.codecs.rank_allreduce import RankAllReduceCodec
from dad_integrations.report import ParamReport
from dad_integrations.units import build_plan


def test_factor_products_equal_dense_products():
    """``M Q = D^T (X Q)`` and ``M^T P = X^T (D P)``: the factor route computes what the dense one does."""
    torch.manual_seed(0)
    layer = nn.Linear(40, 30).double()
    plan = build_plan(layer, DADConfig(mode="rank", rank=3))
    unit = plan.units[0]
    d, x = torch.randn(5, 30, dtype=torch.float64), torch.randn(5, 40, dtype=torch.float64)
    dense_m = d.t() @ x
    codec = RankAllReduceCodec(DADConfig(mode="rank", rank=3, rank_route="allreduce"), None, ErrorFeedback(False))
    entry = ParamReport(unit.name, "rank_allreduce", (30, 40))
    m_s = codec.local(unit, [(d, x)], lambda p, dtype: dense_m, entry)
    assert entry.method == "factors"  # 5 rows: cheaper than the 30 x 40 matrix
    q, p = torch.randn(40, 3, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64)
    torch.testing.assert_close(m_s.mm(q), dense_m @ q)
    torch.testing.assert_close(m_s.rmm(p), dense_m.t() @ p)
    for c in plan.captures:
        c.remove()


@pytest.mark.parametrize("error_feedback", [False, True])
def test_full_rank_rebuilds_the_gradient(group, error_feedback):
    """With r at the matrices' full rank the shared power iteration is exact, factors or dense."""
    torch.manual_seed(0)
    model, ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)), nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4))
    ref.load_state_dict(model.state_dict())
    sync = DADSynchronizer(model, TorchDistributedAggregator(),
                           {"mode": "rank", "rank": 6, "rank_route": "allreduce", "error_feedback": error_feedback})
    for _ in range(3):
        x = torch.randn(3, 6)
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        sync.synchronize()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        reps = {p.representation for p in sync.last_step_report().params if p.name.endswith("weight")}
        assert reps == {"rank_allreduce"}
        model.zero_grad()
        ref.zero_grad()
    sync.close()
