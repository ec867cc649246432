"""Routes decided ahead of backward (`exchange.ahead`): the forward's row counts, the all-dense
decision that lets a choosing step go by DDP's own buckets, and the first-step check that waits
for the first step that sends factors (a real 2-rank DDP job: `workers/ahead_worker.py`)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import WORKERS, result, run_torchrun
from dad_integrations import DADSynchronizer, TorchDistributedAggregator
from dad_integrations.exchange.ahead import agree_forward_rows, forward_rows

TOL = 1e-6  # a dense gradient is DDP's, to fp32 round-off (floored at 1e-6 of the whole gradient)


class _Mixed(nn.Module):
    """Linear (leading dimensions), embedding and a 2-D convolution, whose rows are not counted ahead."""

    def __init__(self, conv: bool):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 6)
        self.conv = nn.Conv2d(1, 2, 3) if conv else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(ids)).sum()
        if self.conv is not None:
            h = h + self.conv(torch.ones(1, 1, 4, 4)).sum()
        return h


@pytest.mark.parametrize("conv", [False, True])
def test_forward_counts_rows_per_use_and_resets(group, conv):
    """A linear use counts its input's leading rows, an embedding its ids; a kind that cannot tell
    leaves the step's counts unknown; the step's end resets them."""
    torch.manual_seed(0)
    model = _Mixed(conv)
    sync = DADSynchronizer(model, TorchDistributedAggregator(), {"mode": "exact"})
    units = sync._plan.units
    model(torch.randint(0, 10, (3, 5))).backward()
    counted = {u.name: [use.forward_rows for use in u.uses] for u in units}
    assert counted["emb.weight"] == [15] and counted["lin.weight"] == [15]
    mine = forward_rows(units)
    if conv:
        assert counted["conv.weight"] == [None] and mine is None
        assert agree_forward_rows(units, sync.aggregator, torch.device("cpu")) is None
    else:
        assert mine == [15, 15]
        agreed = agree_forward_rows(units, sync.aggregator, torch.device("cpu"))
        assert agreed == {u.index: [[15]] for u in units}
    sync.synchronize()
    assert all(use.forward_rows == 0 for u in units for use in u.uses)
    sync.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = tmp_path_factory.mktemp("ahead")
    run_torchrun(WORKERS / "ahead_worker.py", 2, [work / "out.json"])
    return json.loads((work / "out.json").read_text())


def test_fast_steps_go_by_ddps_buckets_and_the_check_waits(job):
    """On a fast link the first step and the held steps after it are DDP's own (one all-gather of
    counts at step 0, no check, no warning); the refresh that compresses runs the check, which
    sends the weight used outside its layer dense with its warning; dense gradients are DDP's
    (while the two models still hold the same weights)."""
    for rank, r in enumerate(result(job, "defer")):
        steps = r["steps"]
        for i in (0, 1, 2):
            s = steps[i]
            assert s["native"] >= 1 and set(s["routes"].values()) == {"dense"}, (i, s)
            assert s["ahead"] == (1 if i == 0 else 0) and s["names"] == sorted({"ahead", "dense"} if i == 0
                                                                             else {"dense"}), (i, s)
            assert not s["warnings"], (i, s)
        s = steps[3]
        assert s["ahead"] == 1 and s["native"] == 0, s
        assert "meta" in s["names"] and "verify" not in s["names"], s
        assert s["routes"]["hidden.weight"] == "dense", s
        assert any(rep not in ("dense", "exact") for rep in s["routes"].values()), s
        said = [w for w in s["warnings"] if "hidden.weight" in w and "do not rebuild" in w]
        assert len(said) == (1 if rank == 0 else 0), s["warnings"]
        assert steps[4]["routes"]["hidden.weight"] == "dense" and not steps[4]["warnings"]
        for i, s in enumerate(steps[:4]):  # (after step 3's compressed routes the models differ)
            assert s["worst_dense"] <= TOL, (i, s["worst_dense"])


def test_slow_first_step_decides_unit_by_unit_with_the_check(job):
    """On a slow link the decision ahead compresses, so step 0 exchanges counts unit by unit and
    runs the check, as it would without the decision ahead."""
    for rank, r in enumerate(result(job, "slow")):
        s = r["steps"][0]
        assert s["ahead"] == 1 and s["native"] == 0 and "meta" in s["names"], s
        assert s["routes"]["hidden.weight"] == "dense", s
        assert len([w for w in s["warnings"] if "do not rebuild" in w]) == (1 if rank == 0 else 0), s["warnings"]
        assert s["worst_dense"] <= TOL, s["worst_dense"]
