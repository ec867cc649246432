"""Elastic and resized jobs: dAD's state resumed at another world size (Accelerate, Trainer,
DeepSpeed), a torchrun elastic restart after a killed rank, Horovod elastic.

The resize runs are three torchrun jobs (2 ranks save; 4 ranks resume those and save; 2 ranks
resume the 4-rank checkpoints), every engine in each (workers/elastic_resize_worker.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, WORKERS, run_torchrun

ENGINES = ("accelerate", "trainer", "deepspeed-z0", "deepspeed-z2")


@pytest.fixture(scope="module")
def resized(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("resized")
    script = WORKERS / "elastic_resize_worker.py"
    out = {}
    for nproc, actions in ((2, "save:from2"), (4, "resume:from2,save:from4"), (2, "resume:from4")):
        run_torchrun(script, nproc, [work / f"out{nproc}.json", work, actions], timeout=900)
        out.update(json.loads((work / f"out{nproc}.json").read_text()))
    return out


def _ranks(resized: dict, key: str) -> list:
    per_rank = resized[key]
    for rank, r in enumerate(per_rank):
        if "exception" in r:
            pytest.fail(f"{key} raised on rank {rank}:\n{r['exception']}")
    return per_rank


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("saved, resumed", [(2, 4), (4, 2)])
def test_resume_at_another_world_size_keeps_the_mean_residual(resized, engine, saved, resumed):
    """Saved at ``saved`` ranks, resumed at ``resumed``: right after loading, the new ranks' mean
    residual is the old ranks' mean (sum / S' = sum / S, to round-off), every new rank holds the
    same residuals and the all-reduce route's warm starts as saved; the resumed run trains on and
    every rank ends with the same parameters."""
    per_rank = _ranks(resized, f"resume:from{saved}/{engine}")
    assert len(per_rank) == resumed
    for r in per_rank:
        assert r["old_files"] == saved
        assert r["weights_with_residual"] > 0
        assert r["mean_rel"] < 1e-6, r
        assert r["residual_same"] and r["shared_q_same"] and r["shared_q_as_saved"]
        assert r["params_same"] and r["loss_finite"]
    if engine == "accelerate":  # rank_route allreduce: every rank-routed weight has a shared warm start
        assert all(r["shared_q"] > 0 for r in per_rank)


def test_torchrun_elastic_restart_resumes_equal_to_an_uninterrupted_run(tmp_path):
    """torchrun --max-restarts 1: rank 1 SIGKILLs itself in the middle of step 5 of 8 (first attempt
    only, from TORCHELASTIC_RESTART_COUNT); torchrun stops rank 0 and starts both again, which
    resume from the step-4 checkpoint (dAD's per-rank state files among it) and end bit for bit
    where an uninterrupted run with the same checkpoint boundaries ends: parameters and dAD state
    (a same-size resume is exact, so equality, not only identical ranks, is what to assert).
    The worker prefixes its store keys by attempt (its init_group says why)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1:1", "--nproc-per-node", "2",
           "--max-restarts", "1", str(WORKERS / "elastic_torchrun_worker.py"), str(tmp_path / "out.json"),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert "exitcode: -9" in proc.stderr  # the first attempt's rank 1 was killed
    ranks = json.loads((tmp_path / "out.json").read_text())["ranks"]
    for r in ranks:
        assert r["attempt"] == 1 and r["resumed_from"] == 4
        assert r["params_equal"] and r["state_equal"] and r["ranks_equal"], r
