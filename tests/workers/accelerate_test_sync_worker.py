"""Runs inside `accelerate launch` (2 CPU processes): Accelerate's own gradient-synchronisation test
script, ``accelerate/test_utils/scripts/test_sync.py``, with dAD; writes JSON results.

Usage: ACCELERATE_USE_CPU=1 accelerate launch --config_file examples/accelerate/cpu_2proc.yaml \
           accelerate_test_sync_worker.py OUT      (DAD_TEST_SYNC=ddp: the control run, without dAD)
Its test functions run unchanged, but for three substitutions in that module's namespace (nothing
of dAD is patched): its ``RegressionModel`` (two scalars, which dAD would send dense) becomes
`LinearRegression`, the same interface through Linear layers whose weights go as exact factors;
its ``get_training_setup`` calls `enable_dad` on the prepared model, after ``accelerator.prepare``
as a user would (``ddp``: not, for the control run); its ``RegressionDataset`` gets a fixed seed. Every function runs on the CPU path
(MULTI_CPU), also those test_sync's ``main`` reserves for GPU types; per function: passed or the
assertion, and which representations dAD's reports showed (so a pass is not a dense fallback).
"""
from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import accelerate.test_utils.scripts.test_sync as test_sync
from accelerate import Accelerator
from accelerate.state import GradientState
from accelerate.test_utils import RegressionDataset

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations.accelerate import enable_dad  # noqa: E402


class LinearRegression(nn.Module):
    """``RegressionModel``'s interface (a batch of scalars in, one out; ``a``, ``b`` accepted)
    through ``Linear(1, 4) -> tanh -> Linear(4, 4) -> tanh -> Linear(4, 1)``. Few elements: test_sync
    compares gradients with ``allclose``'s default tolerance (1e-8 + 1e-5 relative), tight for fp32
    round-off between its full-batch reference and any average over ranks (DDP's too); with 16
    hidden units one of six unseeded runs failed a case."""

    def __init__(self, a=0, b=0, double_output=False):
        super().__init__()
        self.inp = nn.Linear(1, 4)
        self.hidden = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x=None):
        h = torch.tanh(self.inp(x.unsqueeze(-1)))
        return self.out(torch.tanh(self.hidden(h))).squeeze(-1)


class SeededRegressionDataset(RegressionDataset):
    """test_sync's dataset with a fixed seed: its own draws fresh data in every process and run
    (``seed=None``), which would make a failure unrepeatable."""

    def __init__(self, a=2, b=3, length=64, seed=0):
        super().__init__(a=a, b=b, length=length, seed=seed)


SYNCS: list = []
_original_setup = test_sync.get_training_setup


def get_training_setup(accelerator, sched=False):
    """test_sync's setup, then dAD on the prepared model (``DAD_TEST_SYNC=ddp``: without)."""
    out = _original_setup(accelerator, sched)
    if os.environ.get("DAD_TEST_SYNC", "dad") == "dad":
        SYNCS.append(enable_dad(accelerator, out[4] if sched else out[1], {"mode": "exact"}))
    return out


if os.environ.get("DAD_TEST_SYNC_MODEL") != "regression":  # "regression": test_sync's own (control)
    test_sync.RegressionModel = LinearRegression
test_sync.RegressionDataset = SeededRegressionDataset
test_sync.get_training_setup = get_training_setup


def cases(accelerator: Accelerator) -> dict:
    """Every test function of test_sync for several processes, by name (``DAD_TEST_SYNC_SKIP``:
    names left out, separated by ";")."""
    out = {"dataloader_break": test_sync.test_dataloader_break,
           "distributed_sync": lambda: test_sync.test_distributed_sync(accelerator),
           "distributed_sync_multiple_fwd": lambda: test_sync.test_distributed_sync_multiple_fwd(accelerator)}
    for split in (True, False):
        for dispatch in (True, False):
            for each in (True, False):
                flags = f"split={split},dispatch={dispatch},sync_each_batch={each}"
                out[f"gradient_accumulation[{flags}]"] = (
                    lambda s=split, d=dispatch, e=each: test_sync.test_gradient_accumulation(s, d, e))
                out[f"gradient_accumulation_with_opt_and_scheduler[{flags}]"] = (
                    lambda s=split, d=dispatch, e=each: test_sync.test_gradient_accumulation_with_opt_and_scheduler(
                        s, d, e))
    skip = set(filter(None, os.environ.get("DAD_TEST_SYNC_SKIP", "").split(";")))
    return {k: v for k, v in out.items() if k not in skip}


def run_one(fn) -> dict:
    """Run one test function; its outcome and what dAD's synchronisers reported."""
    SYNCS.clear()
    try:
        fn()
        outcome = {"passed": True}
    except AssertionError as e:
        outcome = {"passed": False, "assertion": str(e)[:500]}
    except Exception:  # noqa: BLE001 -- recorded; the other functions still run
        outcome = {"passed": False, "exception": traceback.format_exc()[-2000:]}
    finally:
        GradientState._reset_state()  # what test_sync's functions do at their end, also on failure
    reports = [s.last_step_report() for s in SYNCS if s is not None]
    outcome["syncs"] = len(SYNCS)
    outcome["representations"] = sorted({p.representation for r in reports if r is not None for p in r.params})
    outcome["sent"] = sum(r.totals["sent_bytes"] for r in reports if r is not None)
    return outcome


def main() -> None:
    out_path = sys.argv[1]
    torch.set_num_threads(1)
    accelerator = Accelerator()  # test_sync's own main() starts so: plain, no cpu=True
    results = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes}
    for name, fn in cases(accelerator).items():
        mine = run_one(fn)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        results[name] = per_rank
    models.write_and_exit(out_path, results)


if __name__ == "__main__":
    main()
