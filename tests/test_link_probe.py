"""The link probe at the job's sizes: which sizes are probed (the job's buckets and largest weight,
the ceiling, the ladder), the fit over them (small sizes set the latency, large ones the bandwidth),
and a real 2-rank gloo probe that both ranks run alike and agree on."""
from __future__ import annotations

import json
import re

import pytest

from conftest import WORKERS, result, run_torchrun
from dad_integrations.routing.link import (DEFAULT_TOP, PROBE_CEILING, PROBE_FLOOR, fit_link_cost, job_probe_top,
                                           probe_ladder, probe_top)

KIB, MIB = 2 ** 10, 2 ** 20


def test_probe_top_reaches_the_jobs_sizes():
    # the dense bucket where every weight is smaller
    assert probe_top([4 * MIB, 9 * MIB], 25 * MIB) == 25 * MIB
    # a weight sent alone, larger than a bucket
    assert probe_top([40 * MIB], 25 * MIB) == 40 * MIB
    # the ceiling: GPT-2's 50257 x 768 embedding (154 MB in fp32) is probed at 64 MiB
    assert job_probe_top([(50257, 768), (768, 2304)], 25.0) == PROBE_CEILING == 64 * MIB
    assert job_probe_top([(512, 768)] * 2, 2.0) == 2 * MIB   # two 1.5 MiB weights: the bucket
    # a small model's buckets hold all its weights, less than a bucket cap
    assert job_probe_top([(64, 64)] * 3, 25.0) == 3 * 64 * 64 * 4
    assert job_probe_top([(1024, 768)], 2.0) == 3 * MIB   # the 3 MiB weight
    assert job_probe_top([(1024, 768)] * 2, 2.0, itemsize=2) == 2 * MIB
    assert probe_top([], 1) == PROBE_FLOOR                 # never below the smallest probe
    assert probe_top() == DEFAULT_TOP == 25 * MIB


def test_probe_ladder_geometric_up_to_top():
    assert probe_ladder(1 * MIB) == (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB)
    assert probe_ladder(25 * MIB) == (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 25 * MIB)
    assert probe_ladder(PROBE_CEILING)[-2:] == (16 * MIB, 64 * MIB)
    assert probe_ladder(PROBE_FLOOR) == (PROBE_FLOOR,)
    with pytest.raises(ValueError, match="link probe"):
        probe_ladder(100)


def test_fit_large_sizes_set_beta_small_sizes_alpha():
    alpha, beta = 50e-6, 1e9
    sizes = probe_ladder(64 * MIB)
    # the latency-bound sizes jitter by +-40 %, the large ones by +-2 %: what timing noise looks like
    jitter = [1.4, 0.6, 1.3, 0.9, 1.02, 0.98, 1.02, 0.98]
    samples = [(b, (alpha + b / beta) * j) for b, j in zip(sizes, jitter)]
    c = fit_link_cost(samples)
    assert c.beta == pytest.approx(beta, rel=0.03)
    # 2 % of a 64 MiB call (1.3 ms) is 27x the latency; least squares over every size would read it
    # as latency, the fit keeps alpha where the small calls put it
    assert c.alpha == pytest.approx(alpha, rel=0.5)
    # exact samples are recovered
    exact = fit_link_cost([(b, alpha + b / beta) for b in sizes])
    assert exact.alpha == pytest.approx(alpha, rel=1e-6) and exact.beta == pytest.approx(beta, rel=1e-6)
    # small probes only (the old 1 MiB cap) on a link whose small calls run faster than its
    # sustained rate (an eager protocol, a cache) mispredict a 25 MiB bucket; the ladder's large
    # sizes correct it
    def sustained(b):
        return alpha + b / (beta if b >= 4 * MIB else 3 * beta)
    small = fit_link_cost([(b, sustained(b)) for b in probe_ladder(MIB)])
    full = fit_link_cost([(b, sustained(b)) for b in probe_ladder(64 * MIB)])
    bucket = 25 * MIB
    assert abs(full.alpha + bucket / full.beta - sustained(bucket)) < 0.05 * sustained(bucket)
    assert abs(small.alpha + bucket / small.beta - sustained(bucket)) > 0.5 * sustained(bucket)


@pytest.fixture(scope="module")
def probe_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("link")
    run_torchrun(WORKERS / "link_probe_worker.py", 2, [work / "out.json"], timeout=300)
    return json.loads((work / "out.json").read_text())


def _probed(calls, kind):
    """Sizes (bytes, from the call names) of ``kind``'s timed probes, and their element counts."""
    out = []
    for k, name, numel in calls:
        m = re.fullmatch(rf"dad\.link\.{kind}\.(\d+)\.(\d+)", name)
        if m and k == kind:
            out.append((int(m.group(1)), numel))
    return out


def _sizes(calls, kind):
    return sorted({s for s, _ in _probed(calls, kind)})


def test_two_ranks_probe_the_ladder_alike_and_agree(probe_job):
    per_rank = result(probe_job, "ladder")
    assert per_rank[0]["calls"] == per_rank[1]["calls"]   # the same collectives in the same order
    assert per_rank[0]["model"] == per_rank[1]["model"]   # the agreed (slowest) figures
    calls = per_rank[0]["calls"]
    assert _sizes(calls, "all_reduce") == _sizes(calls, "all_gather") == list(probe_ladder(MIB))
    # an all-gather's input is size / S: no probe holds more than its size
    assert all(numel * 4 == size for size, numel in _probed(calls, "all_reduce"))
    assert all(numel * 4 * 2 == size for size, numel in _probed(calls, "all_gather"))
    # one warm-up call at each kind's first size, then 3 timed calls a size
    assert len(_probed(calls, "all_reduce")) == 1 + 3 * len(probe_ladder(MIB))


def test_budget_stops_both_ranks_at_the_same_size(probe_job):
    per_rank = result(probe_job, "budget")
    assert per_rank[0]["calls"] == per_rank[1]["calls"]
    assert per_rank[0]["model"] == per_rank[1]["model"]
    for kind in ("all_reduce", "all_gather"):
        assert _sizes(per_rank[0]["calls"], kind) == [PROBE_FLOOR]


def test_ranks_probe_the_largest_size_any_asks_for(probe_job):
    per_rank = result(probe_job, "uneven")
    assert per_rank[0]["calls"] == per_rank[1]["calls"]
    assert _sizes(per_rank[1]["calls"], "all_reduce")[-1] == MIB


def test_build_timing_probes_the_jobs_sizes(probe_job):
    per_rank = result(probe_job, "job")
    for r in per_rank:
        assert r["top"] == 3 * MIB     # the 1024 x 768 weight, above the 2 MiB buckets
        assert _sizes(r["calls"], "all_reduce") == list(probe_ladder(3 * MIB))
        assert _sizes(r["refresh"], "all_reduce") == list(probe_ladder(3 * MIB))
    assert per_rank[0]["model"] == per_rank[1]["model"]
