"""torchrun worker: routes decided ahead of backward under DDP's hook (tests/test_ahead.py).

A 2-rank DDP with dAD (mode auto, objective time, rank 4, no lossless steps) beside a plain DDP on
the same weights and batches. The model uses one weight outside its layer (``hidden.weight`` in
``F.linear``), so its factors do not rebuild its gradient: the first-step check must send it dense
for good, with its warning, on the first step that sends factors, and never silently otherwise.

- ``defer``: a stated fast link for steps 0-2: every step is DDP's own (routes decided ahead at
  step 0, held after), no check runs, no warning. From step 1 the link is stated slow; the refresh
  at step 3 is decided ahead as well, and compresses, so that step decides unit by unit and runs
  the check: ``hidden.weight`` goes dense with the warning, the others compress.
- ``slow``: the slow link from the start: step 0's decision ahead compresses, so step 0 runs the
  check (after the counts' all-gather) as without it.

Per step: the dAD collectives' names, routes by weight, whether it went by DDP's buckets, the
worst relative error of every gradient sent dense against the plain DDP's, and the warnings.
"""
from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
from models import batch, build, gather_per_rank, grad_errors, loss_of, run_all, write_and_exit  # noqa: E402

from time_worker import RecordingAggregator  # noqa: E402

from dad_integrations import DADConfig, register_dad_comm_hook  # noqa: E402

FAST = {"bandwidth": "1000gbit", "latency_us": 0}
SLOW = {"bandwidth": "1mbit", "latency_us": 100}
MODEL = "mlp_functional"


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run(case: dict) -> dict:
    model, ref = build(MODEL, seed=0), build(MODEL, seed=0)
    agg = RecordingAggregator()
    net, plain = DDP(model), DDP(ref)
    first = FAST if case["name"] == "defer" else SLOW
    config = DADConfig(mode="auto", rank=4, objective="time", link=first, route_refresh_steps=3, lossless_steps=0)
    sync = register_dad_comm_hook(net, config, agg)
    warnings = Warnings()
    logging.getLogger("dad_integrations").addHandler(warnings)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    out = {"steps": []}
    for step in range(5):
        if step == 1:
            sync.set_link(SLOW)  # routes by it from the refresh at step 3
        data = batch(MODEL, 4, seed=100 * step + dist.get_rank())
        before, said = len(agg.names), len(warnings.lines)
        loss_of(MODEL, net, data).backward()
        loss_of(MODEL, plain, data).backward()
        report = sync.last_step_report()
        routes = {p.name: p.representation for p in report.params if p.representation != "overhead"}
        errors = grad_errors(ref, model)
        worst = max(errors[n] for n, rep in routes.items() if rep == "dense")
        names = agg.names[before:]
        out["steps"].append({"names": sorted(set(n.split(".")[1] for n in names)),
                             "native": sum(n == "dad.dense.native" for n in names),
                             "ahead": sum(n == "dad.ahead.rows" for n in names),
                             "routes": routes, "worst_dense": worst, "warnings": warnings.lines[said:]})
        for opt in opts:
            opt.step()
            opt.zero_grad()
    logging.getLogger("dad_integrations").removeHandler(warnings)
    sync.close()
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo")
    write_and_exit(sys.argv[1], run_all({"defer": {"name": "defer"}, "slow": {"name": "slow"}}, run,
                                        gather_per_rank))
