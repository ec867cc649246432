"""torchrun worker (tests/test_residual_budget.py): FSDP2 with a residual budget too small for whole
residuals.

Usage: torchrun --standalone --nproc_per_node 2 residual_budget_worker.py OUT.json

Each case builds the same small MLP (two 64-wide linears, a head), ``fully_shard``-s it, attaches
dAD with its config and trains ``STEPS`` steps of SGD on per-rank batches. Per rank it records the
parameters after the steps (as lists), the error feedback's kind and rank, the residuals held
(each one's tensor shapes, their bytes), the figure the attach warning stated and the lines dAD
said at default levels (rank 0).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Dict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from models import write_and_exit  # noqa: E402
from visible_worker import Lines  # noqa: E402

TINY = 0.1  # x the rank's state: whole residuals hold about 0.49x here, rank 5 fits
BASE = {"lossless_steps": 0, "objective": "bytes"}
CASES = {
    "exact": {"mode": "exact"},
    "exact-tiny": {"mode": "exact", "residual_budget": TINY},
    "lossless": {"mode": "rank", "rank": 2, "lossless_steps": 3, "residual_budget": None},
    "lossless-tiny": {"mode": "rank", "rank": 2, "lossless_steps": 3, "residual_budget": TINY},
    "rank-tiny": dict(BASE, mode="rank", rank=2, residual_budget=TINY),
    "rank-user": dict(BASE, mode="rank", rank=2, residual_budget=TINY, error_feedback_rank=3),
    "rank-default": dict(BASE, mode="rank", rank=2),             # the default budget (0.25x): rank 15
    "rank-whole": dict(BASE, mode="rank", rank=2, residual_budget=None),
}
WIDTH, ROWS, STEPS = 64, 32, 3


def run(case: str) -> Dict[str, object]:
    from torch.distributed.fsdp import fully_shard

    from dad_integrations.fsdp import enable_dad_fsdp
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                              torch.nn.Tanh(), torch.nn.Linear(WIDTH, 8))
    for layer in (net[0], net[2], net[4], net):
        fully_shard(layer)
    sync = enable_dad_fsdp(net, dict(CASES[case], link={"bandwidth": "1gbit"}))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for k in range(STEPS):
        g = torch.Generator().manual_seed(10 * k + dist.get_rank())
        x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 8, generator=g)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    memory = sync.exchanger.state.memory
    held = {n: [list(t.shape) for t in (r if isinstance(r, tuple) else (r,))] for n, r in memory.residuals.items()}
    out = {"params": [p.full_tensor().reshape(-1).tolist() for p in net.parameters()],
           "memory": type(memory).__name__, "q": memory.matrix_rank, "held": held,
           "held_bytes": sum(t.numel() * t.element_size() for r in memory.residuals.values()
                             for t in (r if isinstance(r, tuple) else (r,))),
           "said_bytes": sync.exchanger.residual_bytes_said}
    sync.close()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    lines = Lines()
    for name in ("dad_integrations.banner", "dad_integrations"):
        logging.getLogger(name).addHandler(lines)
    out = {}
    for case in CASES:
        lines.lines.clear()
        out[case] = dict(run(case), said=list(lines.lines))
    mine = [None] * dist.get_world_size()
    dist.all_gather_object(mine, out)
    write_and_exit(sys.argv[1], {"ranks": mine})


if __name__ == "__main__":
    main()
