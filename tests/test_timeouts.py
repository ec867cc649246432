"""A stalled rank fails dAD within the user's timeout, as it fails DDP, instead of after torch's
30-minute default for new groups (`dad_integrations.comm.groups.new_group_like`).

Each stall case is a 2-process `torchrun` job (`workers/timeout_worker.py`): rank 1 sets up and
then does no step, rank 0 times its step. The jobs mostly wait on timeouts, so they run
concurrently. The groups' timeouts themselves are also checked on a one-rank group in this process.
"""
from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch import nn

from conftest import WORKERS, run_torchrun
from dad_integrations import TorchDistributedAggregator, register_dad_comm_hook
from dad_integrations.comm.groups import _group_timeout, new_group_like

JOB_TIMEOUT_S = 15.0       # init_process_group(timeout=...) in the worker's default-timeout cases
EXPLICIT_S = 5.0           # the aggregator's own timeout in the explicit cases (the job keeps 30 min)
DEFAULT_CASES = ["plain", "ddp", "deepspeed", "fsdp2", "zero2"]
DAD_STALLS = ("fsdp2", "zero2")  # sharded: the collective rank 0 waits on must be dAD's own
EXPLICIT_CASES = ["explicit", "explicit-ddp"]


def _have_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = DEFAULT_CASES + EXPLICIT_CASES
    if not _have_deepspeed():
        cases.remove("deepspeed")
        cases.remove("zero2")

    works = {case: tmp_path_factory.mktemp(case) for case in cases}  # here: mktemp is not thread-safe

    def run(case: str):
        work = works[case]
        try:  # the first DeepSpeed job on a machine JIT-builds its shared-memory op: minutes
            run_torchrun(WORKERS / "timeout_worker.py", 2, [work, case],
                         timeout=600 if case in ("deepspeed", "zero2") else 240)
        except AssertionError as e:  # the job failed: the test of its case reports why
            return {"job_error": str(e)}
        return json.loads((work / "result.json").read_text())

    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(zip(cases, pool.map(run, cases)))


def _check(results: dict, case: str, timeout_s: float, limit_s: float) -> None:
    if case not in results:
        pytest.skip("deepspeed is not installed")
    r = results[case]
    assert "job_error" not in r, r.get("job_error")
    assert not r["hung"], f"{case}: rank 0 still blocked after {r['elapsed_s']:.0f} s"
    assert r["group_timeout_s"] == timeout_s, r
    assert r["raised"], f"{case}: the step returned although rank 1 never took part"
    assert "timed out" in r["error"].lower(), r["traceback"]
    # dAD's own error, naming the fault (tests/test_faults.py: across nodes), under every engine
    assert r["error"].startswith("CollectiveError: dAD's "), r["error"]
    assert f"process group timeout: {timeout_s:g} s" in r["error"], r["error"]
    assert r["elapsed_s"] < limit_s, r
    if case in DAD_STALLS:  # under sharding, in dAD's exchange (not the engine's own collectives)
        assert "dad_integrations" in r["traceback"] or "deepspeed_dad" in r["traceback"], r["traceback"]


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_stalled_rank_fails_within_job_timeout(results, case):
    """dAD's group takes init_process_group's (DeepSpeed's init_distributed's) 15 s timeout, under
    FSDP2 and ZeRO-2 too, where dAD's exchange sits inside the engine's gradient reduction."""
    _check(results, case, JOB_TIMEOUT_S, limit_s=45.0)


@pytest.mark.parametrize("case", EXPLICIT_CASES)
def test_explicit_timeout_overrides_job_default(results, case):
    """TorchDistributedAggregator(timeout=) / register_dad_comm_hook(timeout=) beat the job's 30 min."""
    _check(results, case, EXPLICIT_S, limit_s=20.0)


# -- the groups' timeouts, on a one-rank group in this process ----------------------------------
@pytest.fixture(scope="module")
def one_rank():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=7))
    yield timedelta(seconds=7)
    dist.destroy_process_group()


def test_new_group_takes_base_timeout_and_backend(one_rank):
    assert _group_timeout(dist.group.WORLD) == one_rank
    assert _group_timeout(new_group_like([0])) == one_rank
    short = new_group_like([0], timeout=timedelta(seconds=3))
    assert _group_timeout(short) == timedelta(seconds=3)
    derived = new_group_like([0], base=short)
    assert _group_timeout(derived) == timedelta(seconds=3)
    assert dist.get_backend(derived) == "gloo"


def test_aggregators_groups_take_timeout(one_rank):
    assert _group_timeout(TorchDistributedAggregator().group) == one_rank
    assert _group_timeout(TorchDistributedAggregator(timeout=timedelta(seconds=2)).group) == timedelta(seconds=2)
    with pytest.raises(ValueError, match="timeout"):
        TorchDistributedAggregator(new_group_like([0]), timeout=timedelta(seconds=2))
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    assert _group_timeout(register_dad_comm_hook(ddp, {"mode": "exact"}).aggregator.group) == one_rank
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    sync = register_dad_comm_hook(ddp, {"mode": "exact"}, timeout=timedelta(seconds=2))
    assert _group_timeout(sync.aggregator.group) == timedelta(seconds=2)
