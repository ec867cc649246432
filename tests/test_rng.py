"""dAD leaves the user's randomness alone, and says when it attaches (issue 25, items 5 and 6).

Real 2-process jobs over gloo (tests/workers/rng_worker.py): one torchrun job for the
torch.distributed engines (a plain `DADSynchronizer`, DDP's communication hook, DeepSpeed ZeRO-0
and ZeRO-2, FSDP2), one Trainer job (`DADCallback`), one ``horovodrun`` job (Horovod).

- Attach in mode auto (objective time, a measured link), a route refresh and a route trial move
  none of the global generators: torch's CPU one, NumPy's, Python's ``random``.
- A model with dropout trains to the losses of the engine alone, bit for bit, under dAD exact and
  under auto at a stated 1000 Gbit/s link.
- Rank 0 prints the attach line once per attach, at default log levels; rank 1 never does.
"""
from __future__ import annotations

import importlib.util
import json
import re
import warnings

import pytest

from conftest import WORKERS, run_torchrun

TORCH_ENGINES = ["sync", "ddp", "deepspeed", "zero2", "fsdp2"]
BANNER = re.compile(r"^dAD attached to (.+?): mode (\w+), .*world size 2$", re.M)


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def torch_job(tmp_path_factory):
    engines = [e for e in TORCH_ENGINES if _have("deepspeed") or e not in ("deepspeed", "zero2")]
    work = tmp_path_factory.mktemp("rng")
    proc = run_torchrun(WORKERS / "rng_worker.py", 2, [work / "out.json", ",".join(engines)])
    return json.loads((work / "out.json").read_text()), proc


def _ok(per_rank: list) -> list:
    for r in per_rank:
        assert "exception" not in r, r.get("exception")
    return per_rank


def _check_states(results: dict, engine: str) -> None:
    alone = _ok(results[f"states-{engine}-None"])
    for variant in ("auto", "trial"):
        key = f"states-{engine}-{variant}"
        if key not in results:
            continue
        for rank, (mine, ref) in enumerate(zip(_ok(results[key]), alone)):
            before, after = mine["attach"]
            assert after == before, f"{key}, rank {rank}: attach moved the global generators"
            assert mine["steps"] == ref["steps"], f"{key}, rank {rank}: a step drew from the global generators"
        if variant == "trial":  # the trial really ran: rank routes (their warm starts), then all dense
            r = results[key][0]
            assert r["trials"] >= 1 and "rank_allreduce" in r["routes"][0], r


@pytest.mark.parametrize("engine", TORCH_ENGINES)
def test_attach_refresh_and_trial_leave_global_rng_alone(torch_job, engine):
    results, _ = torch_job
    if f"states-{engine}-None" not in results:
        pytest.skip(f"{engine} is not installed")
    _check_states(results, engine)


@pytest.mark.parametrize("engine", ["sync", "ddp", "deepspeed"])
def test_dropout_losses_bit_for_bit(torch_job, engine):
    results, _ = torch_job
    if f"losses-{engine}-None" not in results:
        pytest.skip(f"{engine} is not installed")
    alone = _ok(results[f"losses-{engine}-None"])
    for dad in ("exact", "fast"):
        for rank, (mine, ref) in enumerate(zip(_ok(results[f"losses-{engine}-{dad}"]), alone)):
            assert mine["losses"] == ref["losses"], f"{engine} under dAD {dad}, rank {rank}"


def _check_banners(results: dict) -> set:
    """Every dAD case attaches once: one line on rank 0, none on rank 1, none without dAD."""
    engines = set()
    for key, (r0, r1) in results.items():
        assert r1["banners"] == [], key
        if key.endswith("-None"):
            assert r0["banners"] == [], key
        else:
            assert len(r0["banners"]) == 1, (key, r0["banners"])
            engines.add(BANNER.match(r0["banners"][0]).group(1))
    return engines


def test_banner_once_per_attach_on_rank_zero(torch_job):
    """Per case, the lines each rank's banner logger showed; and in the job's output (both ranks'
    stderr), as many lines as attaches: shown at default log levels, never twice."""
    results, proc = torch_job
    engines = _check_banners(results)
    attaches = [k for k in results if not k.endswith("-None")]
    assert len(BANNER.findall(proc.stdout + proc.stderr)) == len(attaches)
    assert {"DADSynchronizer", "DDP (comm hook)", "FSDP2"} <= engines
    if _have("deepspeed"):
        assert {"DeepSpeed ZeRO-0", "DeepSpeed ZeRO-2"} <= engines


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory):
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("rng-trainer")
    run_torchrun(WORKERS / "rng_worker.py", 2, [work / "out.json", "trainer"])
    return json.loads((work / "out.json").read_text())


def test_trainer_callback_leaves_rng_alone_and_announces(trainer_job):
    """`DADCallback` at train begin (auto, a measured link): the states the Trainer's steps see are
    those of the Trainer alone; one attach line, named after the Trainer; no warning."""
    _check_states(trainer_job, "trainer")
    assert _check_banners(trainer_job) == {"Transformers Trainer"}
    for r in _ok(trainer_job["states-trainer-auto"]):
        assert r["warnings"] == [], r["warnings"]


def test_wrapper_scan_warns_nothing():
    """`DADCallback` looks for the Trainer's wrapper among all live objects; reading
    ``__class__`` of ``torch.distributed.reduce_op`` there printed a FutureWarning."""
    pytest.importorskip("transformers")
    import torch.distributed  # noqa: F401  (reduce_op is alive)
    from torch import nn

    from dad_integrations.transformers import _wrapper_of

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _wrapper_of(nn.Linear(2, 2)) == (None, None)
    assert [str(w.message) for w in caught] == []


@pytest.fixture(scope="module")
def horovod_job(tmp_path_factory):
    pytest.importorskip("horovod.torch")
    from test_horovod import _horovodrun
    work = tmp_path_factory.mktemp("rng-horovod")
    _horovodrun(2, [WORKERS / "rng_worker.py", work / "out.json", "horovod"], work / "out.json", 600)
    return json.loads((work / "out.json").read_text())


def test_horovod_leaves_rng_alone(horovod_job):
    _check_states(horovod_job, "horovod")
    alone = _ok(horovod_job["losses-horovod-None"])
    for dad in ("exact", "fast"):
        for mine, ref in zip(_ok(horovod_job[f"losses-horovod-{dad}"]), alone):
            assert mine["losses"] == ref["losses"], dad
    assert _check_banners(horovod_job) == {"Horovod"}
