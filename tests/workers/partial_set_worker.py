"""torchrun worker: whole route sets under DDP's hook on a stated link (tests/test_partial_set.py).

The model mixes one 64 x 64 linear, which the stated link (100 or 10 Mbit/s) has the router
compress (its rank-4 P and Q are an eighth of its bytes), a 64 x 8 one, an 8 x 8 one that rank 4
cannot shrink (dense, though it could compress: the set is partial) and, in case ``leave``, a 32 MB
parameter outside any captured layer. Compressing moves every other gradient off DDP's buckets
(`routing.partial_set`):

- ``leave``: the 32 MB that would leave cost more than the weight saves: from step 1 every weight
  is dense and the steps go by DDP's own buckets; the routes line says the whole set taken.
- ``keep``: no large parameter, 10 Mbit/s: the partial set is the cheapest and is kept.

Each case reports, per step, the routes, the calls on DDP's native path and the decision said.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from models import gather_per_rank, run_all, write_and_exit  # noqa: E402
from time_worker import RecordingAggregator  # noqa: E402

from dad_integrations import DADConfig  # noqa: E402
from dad_integrations.ddp_hook import register_dad_comm_hook  # noqa: E402

# the leaving case's link: the weight saves about 1 ms, against at least 6 ms for 32 MB to leave at
# 10 GB/s a pass; the keeping case's: it saves about 11 ms, against a few small tensors leaving
LINKS = {"leave": {"bandwidth": "100mbit", "latency_us": 0}, "keep": {"bandwidth": "10mbit", "latency_us": 0}}


class Mix(torch.nn.Module):
    def __init__(self, large: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)
        self.c = torch.nn.Linear(8, 8)
        self.large = torch.nn.Parameter(torch.zeros(8 * 2 ** 20 if large else 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.tanh(self.a(x)))).square().mean() + self.large.sum() * 1e-6


def run(case: dict) -> dict:
    model = Mix(case["name"] == "leave")
    agg = RecordingAggregator()
    net = torch.nn.parallel.DistributedDataParallel(model)
    config = DADConfig(mode="auto", rank=4, objective="time", link=LINKS[case["name"]], lossless_steps=0,
                       route_refresh_steps=50)
    sync = register_dad_comm_hook(net, config, agg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = {"routes": [], "native_calls": [], "decision": []}
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        before = len(agg.names)
        net(torch.randn(16, 64, generator=gen)).backward()
        out["native_calls"].append(sum(n == "dad.dense.native" for n in agg.names[before:]))
        report = sync.last_step_report()
        out["routes"].append({p.name: p.representation for p in report.params if p.representation != "overhead"})
        out["decision"].append(report.decision)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def main() -> None:
    dist.init_process_group("gloo")
    cases = {name: {"name": name} for name in ("leave", "keep")}
    write_and_exit(sys.argv[1], run_all(cases, run, gather_per_rank))


if __name__ == "__main__":
    main()
