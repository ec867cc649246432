"""Elastic and resized jobs: dAD's state resumed at another world size (Accelerate, Trainer,
DeepSpeed), a torchrun elastic restart after a killed rank, Horovod elastic (2 -> 1 -> 2 workers).

The resize runs are three torchrun jobs (2 ranks save; 4 ranks resume those and save; 2 ranks
resume the 4-rank checkpoints), every engine in each (workers/elastic_resize_worker.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    The worker makes its group with `dad_integrations.init_process_group` (store keyed by attempt)."""
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


def test_horovod_elastic_worker_leaves_and_joins(tmp_path):
    """horovodrun --gloo -np 2 --min-np 1 --max-np 2 with a discovery script: after step 2 the hosts
    file offers one slot (a worker leaves), after 3 steps on one process two again (one joins).
    The documented pattern, hvd.elastic.run and hvd.elastic.TorchState(model, optimizer) with
    DADOptimizer, unchanged: every step's synchronised gradient (lossless dAD) equals Horovod's
    own all-reduce (op Average) of the same local gradients at the size of that step, a rank-dAD
    optimizer with error feedback trains on beside it (its residuals carried to the new size), and
    both ranks end with equal parameters. Before horovod_dad.elastic, the step after the worker
    left failed (dAD's aggregator still split for two ranks) and a joining worker hung."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    if not horovodrun.exists():
        horovodrun = Path(shutil.which("horovodrun") or "horovodrun")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    # a joining worker imports torch and transformers before it meets the others: on two loaded
    # cores that can pass gloo's 30 s default
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HOROVOD_GLOO_TIMEOUT_SECONDS="150")
    out = tmp_path / "out.json"
    cmd = [str(horovodrun), "--gloo", "--network-interface", "lo", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(discover),
           sys.executable, str(WORKERS / "elastic_horovod_worker.py"), str(out), str(hosts)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(out.read_text())
    sizes = [row[1] for row in result["log"]]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2 and result["final_size"] == 2, sizes
    assert max(row[2] for row in result["log"]) < 1e-5, result["log"]
    assert result["params_same"] and result["finite"]
    assert "re-attached for 1 Horovod processes; error-feedback residuals of 10 weight(s)" in proc.stdout + proc.stderr
