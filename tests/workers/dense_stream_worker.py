"""torchrun worker: dense buckets all-reduced during backward (tests/test_dense_stream.py).

Objective "time" on a stated fast link: after the checked first step every weight goes dense with
capture off. The model's first layer is followed by a layer whose backward sleeps `SLEEP` seconds,
so the gradients of every later layer are final well before backward ends; with small buckets
(``bucket_cap_mb``) those layers' buckets must be on the wire before the sleep is over. Every
synchronised gradient is compared with DDP's (its own all-reduce, same weights, same batches).

Cases: ``plain`` (`DADSynchronizer`), ``accumulate`` (two micro-steps, the first inside
``no_sync()``, and gradients kept across steps: priors), ``ddp_hook`` (`register_dad_comm_hook`:
DDP hands its buckets over during backward, results go to its bucket views).
"""
from __future__ import annotations

import copy
import hashlib
import os
import sys
import time
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
from models import gather_per_rank, grad_errors, run_all, write_and_exit  # noqa: E402

from dad_integrations import (DADConfig, DADSynchronizer, TorchDistributedAggregator,  # noqa: E402
                              register_dad_comm_hook)

SLEEP = 0.4
FAST = {"bandwidth": "1000gbit", "latency_us": 0}
CONFIG = {"mode": "auto", "rank": 4, "objective": "time", "link": FAST, "bucket_cap_mb": 0.01}
MARKS: List[float] = []  # when each slow backward ended


class _Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP)
        MARKS.append(time.perf_counter())
        return g


class SlowBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Slow.apply(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), SlowBackward(), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _record(agg) -> List[Tuple[str, float]]:
    """Wrap ``agg.all_reduce`` to note each call's name and start time."""
    calls: List[Tuple[str, float]] = []
    inner = agg.all_reduce

    def all_reduce(tensor, *, name, op="sum"):
        calls.append((name, time.perf_counter()))
        return inner(tensor, name=name, op=op)

    agg.all_reduce = all_reduce
    return calls


def run(case: dict) -> dict:
    ref = build()
    mine = copy.deepcopy(ref)
    ddp = DDP(ref)
    if case["name"] == "ddp_hook":
        fwd = DDP(mine, bucket_cap_mb=0.01)
        sync = register_dad_comm_hook(fwd, CONFIG)
        no_sync = fwd.no_sync
    else:
        fwd = mine
        sync = DADSynchronizer(mine, TorchDistributedAggregator(), DADConfig.from_dict(CONFIG))
        no_sync = sync.no_sync
    calls = _record(sync.aggregator)
    micro = 2 if case["name"] == "accumulate" else 1
    out = {"steps": []}
    for step in range(4):
        for k in range(micro):
            g = torch.Generator().manual_seed(1000 * step + 10 * k + dist.get_rank())
            x, y = torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)
            last = k == micro - 1
            with (ddp.no_sync() if not last else _null()):
                nn.functional.mse_loss(ddp(x), y).backward()
            del calls[:]
            MARKS.clear()
            with (no_sync() if not last else _null()):
                nn.functional.mse_loss(fwd(x), y).backward()
            ended = time.perf_counter()
        if case["name"] != "ddp_hook":
            sync.synchronize()
        report = sync.last_step_report()
        errors = grad_errors(ref, mine)
        out["steps"].append({
            "worst": max(errors.values()),
            "equal": all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), mine.parameters())),
            "routes": sorted({p.representation for p in report.params if p.representation != "overhead"}),
            "captured": sum(c.enabled for c in sync._plan.captures),
            # dense bucket all-reduces: seconds before the slow backward ended (positive: during it)
            "lead": [MARKS[-1] - t for name, t in calls if name.startswith("dad.dense.") and MARKS],
            "backward_end_lead": [ended - t for name, t in calls if name.startswith("dad.dense.")],
            "overlapped": sorted(p.name for p in report.params if p.overlapped),
            "params": [n for n, _ in mine.named_parameters()],
            "digest": hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in mine.parameters())).hexdigest(),
        })
        if case["name"] != "accumulate":  # accumulate: gradients kept across steps (priors)
            for model in (ref, mine):
                model.zero_grad(set_to_none=True)
    sync.close()
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    dist.init_process_group("gloo")
    cases = {name: {"name": name} for name in ("plain", "accumulate", "ddp_hook")}
    write_and_exit(sys.argv[1], run_all(cases, run, gather_per_rank))


if __name__ == "__main__":
    main()
