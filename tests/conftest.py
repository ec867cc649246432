"""Launches the multi-process checks: real `torchrun` jobs over gloo, one per world size."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The suite's byte assertions (routes, bytes against PowerSGD, the README's tables) are about
# objective "bytes"; a config that names no objective takes $DAD_OBJECTIVE, here and in every job
# the tests launch. Tests of objective "time" name it (tests/test_time_routing.py).
os.environ.setdefault("DAD_OBJECTIVE", "bytes")
# Likewise the suite checks rank routes, their bytes and error feedback from the first steps of
# short runs: configs that name no lossless_steps take 0 here, not the default 10
# (tests/test_config.py checks the default itself).
os.environ.setdefault("DAD_LOSSLESS_STEPS", "0")
WORKERS = Path(__file__).resolve().parent / "workers"


def run_torchrun(script: Path, nproc: int, args: list, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` CPU processes."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


# how a rank dies when gloo's group outlives destroy_process_group and is freed during interpreter
# finalisation (after FSDP2 or DeepSpeed; `workers/models.write_and_exit` says more): test workers
# skip finalisation, a user script (an example) cannot
EXIT_ABORT = "terminate called without an active exception"


def run_accelerate(script: Path, args: list, launch_args: tuple = (), timeout: float = 900,
                   config: Path = ROOT / "examples" / "accelerate" / "cpu_2proc.yaml",
                   exit_abort_reruns: int = 0) -> subprocess.CompletedProcess:
    """Run ``script`` under ``accelerate launch`` with ``config`` (default: the 2-CPU-process one);
    run it again, up to ``exit_abort_reruns`` times, when a rank died of `EXIT_ABORT`."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for _ in range(1 + exit_abort_reruns):
        # a free port each time: the configs' fixed default (29500) may still be held by the last launch
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(_free_port()), *launch_args, str(script), *map(str, args)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if proc.returncode == 0 or EXIT_ABORT not in proc.stderr:
            break
        print(f"{script.name}: a rank aborted at exit ({EXIT_ABORT!r}); running it again", file=sys.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cases(tmp_path_factory, nproc: int, cases: Dict[str, dict]) -> Dict[str, list]:
    """Run the check worker over ``cases``; returns, per case, the list of every rank's result."""
    work = tmp_path_factory.mktemp(f"ranks{nproc}")
    (work / "cases.json").write_text(json.dumps(cases))
    run_torchrun(WORKERS / "check_worker.py", nproc, [work / "out.json", work / "cases.json"])
    return json.loads((work / "out.json").read_text())


def result(results: Dict[str, list], case_id: str) -> list:
    """Every rank's result for a case, failing with the worker's traceback where one raised."""
    per_rank = results[case_id]
    for rank, r in enumerate(per_rank):
        if "exception" in r:
            pytest.fail(f"{case_id} raised on rank {rank}:\n{r['exception']}")
    return per_rank


RESUME_TOL = 1e-6  # fp32 round-off, relative; the resumed runs are bitwise equal here so far


def check_resume(per_rank: list, files: list) -> None:
    """A resumed run (checkpoint after k steps, everything built anew, the rest trained) ends where
    the straight run ends, parameters and dAD state, on every rank; the same resume without dAD's
    state does not (so the test would catch a lost state); the state is per rank (it differs
    across ranks, so one rank's file for all would not do), one file per rank."""
    assert len(per_rank) == 2
    for rank, r in enumerate(per_rank):
        assert r["state_numel"] > 0 and r["state_norm"] > 0, "no dAD state to carry: the test would be vacuous"
        resumed, bare = r["resumed"], r["no-dad-state"]
        assert resumed["params_rel"] <= RESUME_TOL, f"rank {rank}: parameters {resumed['params_rel']:.2e} off"
        assert resumed["state_rel"] <= RESUME_TOL, f"rank {rank}: dAD state {resumed['state_rel']:.2e} off"
        assert bare["params_rel"] > 1e3 * RESUME_TOL, f"rank {rank}: resuming without dAD's state changed nothing"
        assert bare["state_rel"] > 1e3 * RESUME_TOL
        assert r["files"] == files, r["files"]
    assert per_rank[0]["state_fingerprint"] != per_rank[1]["state_fingerprint"], "dAD state equal on both ranks"


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process, for the tests that need torch.distributed initialised."""
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def check_sharded_trial_all_dense(res: dict, tol: float) -> None:
    """A sharded engine's route trial where all dense wins (`tests/workers/models.py`'s
    ``slow_compressed_routes``): steps 1-4 alternate the routes and the engine's own reduction
    (R D D R), every rank decides all dense at step 4 (2 pairs, conclusive), from step 5 every
    weight takes the engine's reduction with capture off, and dense steps with no residual flushed
    into them (the trial's, 2 and 3, hold the residuals; 6, 7) equal the engine's own reduction to
    ``tol``."""
    assert res["arms"][:5] == [None, "routes", "dense", "dense", "routes"], res["arms"]
    compressed = [r != ["dense"] for r in res["routes"]]
    assert compressed == [True, True, False, False, True, False, False, False], res["routes"]
    (trial,) = res["trials"]
    assert (trial["step"], trial["kept"], trial["conclusive"], trial["pairs"]) == (0, False, True, 2), trial
    assert trial["routes_s"] > trial["dense_s"] and trial["compressed"] > 0
    assert res["captured"][1:3] == [0, 0] and res["captured"][0] > 0 and res["captured"][4:] == [0] * 4
    for step in ("2", "3", "6", "7"):
        assert res["errors"][step] <= tol, (step, res["errors"][step])


def check_sharded_trial_kept(res: dict, tol: float) -> None:
    """A sharded engine's route trial where the routes win (the engine's whole-buffer reduction
    slowed): steps 1-4 alternate (R D D R), every rank keeps the routes at step 4 (2 of 2 pairs),
    from step 5 the models' routes compress again (they route each step, as at step 0), and the
    trial's dense steps (2, 3: residuals held) equal the engine's own reduction to ``tol``."""
    assert res["arms"][:5] == [None, "routes", "dense", "dense", "routes"], res["arms"]
    routes = res["routes"]
    assert routes[0] != ["dense"] and routes[2] == routes[3] == ["dense"], routes
    assert all(r != ["dense"] for r in routes[4:]), routes
    (trial,) = res["trials"]
    outcome = (trial["step"], trial["kept"], trial["conclusive"], trial["pairs"], trial["routes_won"])
    assert outcome == (0, True, True, 2, 2), trial
    assert trial["dense_s"] > trial["routes_s"] and trial["compressed"] > 0
    for step in ("2", "3"):
        assert res["errors"][step] <= tol, (step, res["errors"][step])
