"""Dense buckets go on the wire during backward, as DDP's do, and gradients still equal DDP's.

One 2-rank torchrun job (`workers/dense_stream_worker.py`): objective "time" on a stated fast link
routes every weight dense with capture off; a layer near the input sleeps in its backward, so the
buckets of the layers after it must be all-reduced before that sleep ends.
"""
from __future__ import annotations

import json

import pytest

from conftest import WORKERS, result, run_torchrun

TOL = 1e-5
CASES = ("plain", "accumulate", "ddp_hook")
# the weights after the slow layer (16 KB each: a bucket of its own at a 10 KB cap); the small
# bias after the last of them shares the open bucket with the first layer, sent after the sleep
EARLY = {"3.weight", "5.weight", "7.weight"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = tmp_path_factory.mktemp("dense_stream")
    run_torchrun(WORKERS / "dense_stream_worker.py", 2, [work / "out.json"])
    return json.loads((work / "out.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_dense_buckets_start_during_backward_and_equal_ddp(job, case):
    for rank, r in enumerate(result(job, case)):
        for step, s in enumerate(r["steps"]):
            assert s["worst"] <= TOL, (rank, step, s["worst"])
            if step == 0:  # the checked first step captures rows; from then on: dense, capture off
                continue
            assert s["routes"] == ["dense"], (rank, step, s["routes"])
            assert s["captured"] == 0, (rank, step)
            # the layers after the slow one fill three or more buckets of 10 KB, each all-reduced
            # before the slow backward (and so backward) ended; the first layer's after it. As DDP's
            # hook an all-dense step sends DDP's own buckets (its first one has a larger cap): every
            # one but the first layer's leads
            leads = s["lead"]
            early = len(leads) - 1 if case == "ddp_hook" else 3
            assert len(leads) >= 2 and sum(lead > 0 for lead in leads) >= early, (rank, step, leads)
            assert all(lead > 0 for lead in s["backward_end_lead"][:early]), (rank, step, s["backward_end_lead"])
            assert EARLY <= set(s["overlapped"]), (rank, step, s["overlapped"])


def test_ranks_bit_identical_and_equal_to_ddp(job):
    for case in CASES:
        ranks = result(job, case)
        assert [s["digest"] for s in ranks[0]["steps"]] == [s["digest"] for s in ranks[1]["steps"]], case
        # two ranks: DDP's pre-divided sum and dAD's divided sum are the same numbers
        for r in ranks:
            assert all(s["equal"] for s in r["steps"]), (case, [s["worst"] for s in r["steps"]])


def test_buckets_go_on_the_wire_as_they_fill(group):
    """A bucket is all-reduced when it is full (the first at its own, smaller cap), not at
    `finish`; the results are ``postscale * sum(prescale * g)`` written into ``.grad``, also
    for a parameter whose gradient is not in the buckets' dtype."""
    import torch
    from torch import nn

    from dad_integrations import TorchDistributedAggregator
    from dad_integrations.codecs.dense import DenseBuckets
    from dad_integrations.capture.sink import GradSink

    agg = TorchDistributedAggregator()
    # 1 KB each in the buckets' fp32; the last one fp64 (cast on the way back, not written in one pass)
    params = [nn.Parameter(torch.zeros(256, dtype=torch.float64 if i == 4 else torch.float32)) for i in range(5)]
    for i, p in enumerate(params):
        p.grad = torch.full((256,), float(i + 1), dtype=p.dtype)
    names = []
    buckets = DenseBuckets(agg, GradSink({}), bucket_cap_mb=2 / 1024, dtype=torch.float32,
                           account=lambda name, p, traffic: names.append(name), prescale=2.0,
                           postscale=0.25, first_bucket_mb=1 / 1024, early=lambda: True)
    calls = agg.traffic().calls
    buckets.add("p0", params[0])  # fills the 1 KB first bucket: sent now
    assert agg.traffic().calls == calls + 1
    buckets.add("p1", params[1])
    assert agg.traffic().calls == calls + 1  # 1 of 2 KB
    buckets.add("p2", params[2])  # fills the second bucket
    assert agg.traffic().calls == calls + 2
    buckets.add("p3", params[3])
    buckets.add("p4", params[4])
    assert buckets.finish(check_finite=True)
    assert agg.traffic().calls == calls + 3 and names == ["p0", "p1", "p2", "p3", "p4"]
    assert buckets.overlapped == {"p0", "p1", "p2", "p3", "p4"}
    for i, p in enumerate(params):
        assert torch.equal(p.grad, torch.full((256,), 0.5 * (i + 1), dtype=p.grad.dtype)), i
