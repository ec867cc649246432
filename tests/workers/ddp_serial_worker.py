"""torchrun worker: DDP with find_unused_parameters=True and the dAD hook run inline in the last
bucket's hook (the NCCL ordering mode, `ddp_hook.DDPDriver._serialised`, forced here on gloo),
against DDP's own all-reduce: every gradient, every step, and identical parameters."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
from models import write_and_exit  # noqa: E402

from dad_integrations import DADConfig  # noqa: E402
from dad_integrations.ddp_hook import _DRIVERS, register_dad_comm_hook  # noqa: E402


class Branchy(nn.Module):
    """A layer used only on odd steps: DDP's used-parameter map changes step by step."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(h)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref, mine = Branchy(), Branchy()
    mine.load_state_dict(ref.state_dict())
    ddp_ref = DDP(ref, find_unused_parameters=True, bucket_cap_mb=0.001)
    ddp_mine = DDP(mine, find_unused_parameters=True, bucket_cap_mb=0.001)
    register_dad_comm_hook(ddp_mine, DADConfig(mode="exact"))
    _DRIVERS[mine].serialise = True
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp_ref, ddp_mine)]
    worst, steps = 0.0, 4
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(3 + rank, 8, generator=g)
        for model, opt in zip((ddp_ref, ddp_mine), opts):
            opt.zero_grad(set_to_none=True)
            model(x, use_b=step % 2 == 1).pow(2).mean().backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            if a.grad is None or b.grad is None:
                worst = max(worst, 0.0 if a.grad is None and b.grad is None else float("inf"))
                continue
            worst = max(worst, float((a.grad - b.grad).norm()) / max(float(a.grad.norm()), 1e-12))
        for opt in opts:
            opt.step()
    digest = float(sum(p.detach().double().sum() for p in mine.parameters()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"worst": worst, "digest": digest,
                                      "reports": _DRIVERS[mine].sync.last_step_report() is not None})
    write_and_exit(sys.argv[1], {"ranks": everyone})


if __name__ == "__main__":
    main()
