"""torchrun worker (tests/test_visible.py): what FSDP2 and DeepSpeed ZeRO-2/3 say, and the residual
memory they hold against the figure their attach warning states.

Usage: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node N sharded_said_worker.py OUT.json CASES

``CASES``: comma-separated ids of `CASES`. Each builds a small MLP (two 256-wide linears, a head)
under its engine, runs ``steps`` steps of 512 rows a rank, and records per rank: the lines of dAD's
``dad_integrations.banner`` channel (`logs.say`), the WARNING records of the adapters' loggers, the
residual bytes the attach warning stated (``residual_bytes_said``) and those the rank routes' error
feedback holds after the steps (numel x itemsize of every residual). Nothing configures logging, as
in a user's script. The link probe is replaced by one that "measures" 100 Gbit/s on every rank (a
fast link, on which exact factors of 512 rows cost more than the reduce-scatter).
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Dict, List

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from models import write_and_exit  # noqa: E402

from dad_integrations.routing import sharded_trial  # noqa: E402
from dad_integrations.routing.link import LinkModel  # noqa: E402

# whole residuals: the whole-residual warning is checked (the default budget, 0.25x, would keep rank-q
# ones here: tests/test_residual_budget.py)
RANK = {"mode": "rank", "rank": 2, "lossless_steps": 0, "objective": "bytes", "residual_budget": None}
EXACT_STATED = {"mode": "exact", "link": {"bandwidth": "100gbit"}}
EXACT_MEASURED = {"mode": "exact", "objective": "time"}
CASES = {
    "fsdp-residuals": ("fsdp", RANK), "zero3-residuals": ("zero3", RANK),
    "zero3-nodes-residuals": ("zero3", dict(RANK, topology=2)),
    "fsdp-exact-measured": ("fsdp", EXACT_MEASURED),
    "zero2-exact-stated": ("zero2", EXACT_STATED), "zero3-exact-measured": ("zero3", EXACT_MEASURED),
}
WIDTH, ROWS, STEPS = 256, 512, 2


class Lines(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, 8))


def held_bytes(codec) -> int:
    """What the rank routes' error feedback holds now: every residual's numel x itemsize."""
    if codec is None:
        return 0
    return sum(t.numel() * t.element_size() for r in codec.memory.residuals.values()
               for t in (r if isinstance(r, tuple) else (r,)))


def run(case: str) -> Dict[str, object]:
    engine, cfg = CASES[case]
    net = model()
    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from dad_integrations.fsdp import enable_dad_fsdp
        for layer in (net[0], net[2], net[4], net):
            fully_shard(layer)
        sync, forward = enable_dad_fsdp(net, cfg), net
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        backward, step = (lambda loss: loss.backward()), (lambda: (opt.step(), opt.zero_grad()))
    else:
        import deepspeed_dad
        zero = {"stage": int(engine[-1]), "reduce_bucket_size": 3000}
        if zero["stage"] == 3:
            zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000})
        ds = {"train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS * dist.get_world_size(),
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
        forward, *_ = deepspeed_dad.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                                               config={**ds, "dad": {"enabled": True, **cfg}})
        sync = deepspeed_dad.get_attachment(forward)
        backward, step = forward.backward, forward.step
    for k in range(STEPS):
        g = torch.Generator().manual_seed(10 * k + dist.get_rank())
        x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 8, generator=g)
        backward(torch.nn.functional.mse_loss(forward(x), y))
        step()
    ex = sync.exchanger
    out = {"said_bytes": ex.residual_bytes_said, "held_bytes": held_bytes(ex.rank_codec)}
    if engine == "fsdp":
        sync.close()
    else:
        sync.detach()
    return out


def _fast_probe(*args, **kwargs) -> LinkModel:
    """A link "measured" alike on every rank (no collective)."""
    return LinkModel.from_list(LinkModel.from_spec({"bandwidth": "100gbit"}).to_list(), measured=True)


def main() -> None:
    sharded_trial.probe_link = _fast_probe  # ShardedTrial's probe is made from it at attach
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    said, warned = Lines(logging.DEBUG), Lines(logging.WARNING)
    logging.getLogger("dad_integrations.banner").addHandler(said)  # beside its own stderr handler
    for name in ("dad_integrations", "deepspeed_dad"):
        logging.getLogger(name).addHandler(warned)
    out = {}
    for case in sys.argv[2].split(","):
        said.lines.clear()
        warned.lines.clear()
        out[case] = dict(run(case), said=list(said.lines), warned=list(warned.lines))
    mine = [None] * dist.get_world_size()
    dist.all_gather_object(mine, out)
    write_and_exit(sys.argv[1], {"ranks": mine})


if __name__ == "__main__":
    main()
