"""All-dense steps through DDP's communication hook are DDP's own step: its buckets, as they are.

One 3-rank torchrun job (`workers/dense_native_worker.py`): objective "time" on a stated fast link
routes every weight dense after the checked first step; a plain DDP trains a copy on the same
batches beside it. Three ranks: DDP divides its bucket by the world size before the sum, and
so must dAD for the numbers to agree bit for bit (at two ranks any order of scaling does).
"""
from __future__ import annotations

import json

import pytest

from conftest import WORKERS, result, run_torchrun

CHOOSING = (0, 4)  # the first step; a route refresh (routes chosen anew, ahead of backward)
TOL = 1e-6              # fp32 round-off of dAD's own dense buckets (divided after the sum)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = tmp_path_factory.mktemp("dense_native")
    run_torchrun(WORKERS / "dense_native_worker.py", 3, [work / "out.json"])
    return json.loads((work / "out.json").read_text())


def test_native_dense_step_is_ddps_own(job):
    """Every step native: gradients bit for bit DDP's, one dAD collective per DDP bucket (as many
    as DDP's own all-reduces; a choosing step one more, the forward's row counts), no
    per-parameter hooks in its backward but a choosing step's; the ranks identical."""
    ranks = result(job, "native")
    for r in ranks:
        for step, s in enumerate(r["steps"]):
            assert s["routes"] == ["dense"] and s["reported"] == r["params"], (step, s)
            assert s["worst"] <= TOL, (step, s["worst"])
            assert s["equal"], step
            # (DDP's first step goes by one bucket: it lays out its buckets from that step's order)
            assert s["buckets"] >= (1 if step == 0 else 2) and s["native"] == s["buckets"], (step, s)
            if step in CHOOSING:  # one collective more: the forward's row counts; the hooks on
                assert s["dad_collectives"] == s["buckets"] + 1, (step, s)
                assert s["hooked"] and all(s["hooked"]), (step, s)
                continue
            assert s["dad_collectives"] == s["buckets"], (step, s)
            assert s["hooked"] and not any(s["hooked"]), (step, s)  # micro-steps too (step 6)
    for step in range(len(ranks[0]["steps"])):
        assert len({tuple(r["steps"][step]["digest"]) for r in ranks}) == 1, step


def test_join_takes_the_per_parameter_path_without_hooks(job):
    """A DDP in ``join`` (uneven inputs, micro-steps): dAD's per-parameter path, the hooks parked
    where every unit is dense, and each step's gradients DDP's on every rank."""
    ranks = result(job, "join")
    for r in ranks:
        assert max(r["worst"]) <= TOL, r["worst"]
        assert r["hooked"][0] and not all(r["hooked"]), r["hooked"]
