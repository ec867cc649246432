"""torchrun worker (tests/test_visible.py): what a run shows at default log levels.

Nothing configures logging here, as in a user's script. Each rank records the lines of dAD's
``dad_integrations.banner`` channel (`logs.say`) and any torch.compile line on ``dad_integrations``
(recorded at INFO), per case; rank 0 writes them all. Dynamo is imported, as DeepSpeed and
Transformers do, but nothing is compiled. Cases:
- ``trial``: mode auto, rank 4, a measured link, a short route trial after the lossless steps (a
  1024 x 1024 weight of 2 rows a rank). The probe is replaced by one that "measures" 1 Gbit/s and
  300 us on every rank: on a loaded machine a real probe's fit may be all latency, and then the
  refresh compresses nothing and no trial runs;
- ``exact``: mode exact on a stated 100 Gbit/s link with 512 rows a rank (exact factors cost more
  than the all-reduce);
- ``fsdp-exact``: the same under FSDP2 (the warning from the first step's counted bytes).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Dict, List

import torch
import torch._dynamo  # noqa: F401  (imported, as DeepSpeed and Transformers do; nothing compiles)
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from models import write_and_exit  # noqa: E402

from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator  # noqa: E402
from dad_integrations.exchange import policy  # noqa: E402
from dad_integrations.routing import timing  # noqa: E402
from dad_integrations.routing.link import LinkModel  # noqa: E402

CASES = {"fsdp-exact": dict(mode="exact", link={"bandwidth": "100gbit"}),
         "trial": dict(mode="auto", rank=4, objective="time", route_trial_steps=4, route_refresh_steps=1000, lossless_steps=2),
         "exact": dict(mode="exact", link={"bandwidth": "100gbit"})}
STEPS = {"trial": 16, "exact": 3, "fsdp-exact": 3}
WIDTH, ROWS = {"trial": (1024, 2)}, (256, 512)  # per case, else the default


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(case: str, said: Lines, compile_lines: Lines) -> Dict[str, list]:
    said.lines.clear()
    compile_lines.lines.clear()
    torch.manual_seed(0)
    width, rows = WIDTH.get(case, ROWS)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 8))
    if case.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        from dad_integrations.fsdp import enable_dad_fsdp
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        sync = enable_dad_fsdp(model, DADConfig(**CASES[case]))
    else:
        sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(**CASES[case]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS[case]):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x, y = torch.randn(rows, width, generator=g), torch.randn(rows, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not case.startswith("fsdp"):
            sync.synchronize()
        opt.step()
        opt.zero_grad()
    report = sync.last_step_report()
    sync.close()
    return {"said": list(said.lines), "compile": [m for m in compile_lines.lines if "torch.compile" in m],
            "links": dict(report.links), "decision": report.decision}


def _slow_probe(*args, **kwargs) -> LinkModel:
    """A link "measured" alike on every rank (no collective): routes compress, a trial runs."""
    return LinkModel.from_list(LinkModel.from_spec({"bandwidth": "1gbit", "latency_us": 300}).to_list(), measured=True)


def main() -> None:
    timing.probe_link = policy.probe_link = _slow_probe
    dist.init_process_group("gloo")
    said, compile_lines = Lines(), Lines()
    logging.getLogger("dad_integrations.banner").addHandler(said)  # beside its own stderr handler
    logging.getLogger("dad_integrations").addHandler(compile_lines)
    logging.getLogger("dad_integrations").setLevel(logging.INFO)
    out = {case: run(case, said, compile_lines) for case in sys.argv[2].split(",")}
    mine = [None] * dist.get_world_size()
    dist.all_gather_object(mine, out)
    write_and_exit(sys.argv[1], {"ranks": mine})


if __name__ == "__main__":
    main()
