"""torchrun (or ``horovodrun --gloo``) worker: dAD leaves the caller's random generators alone
(tests/test_rng.py).

Usage: torchrun --nproc_per_node 2 rng_worker.py OUT.json ENGINES   (ENGINES: comma-separated)
       horovodrun -np 2 --gloo python rng_worker.py OUT.json horovod

Per engine, two checks:
- ``states``: a model without dropout (so a step of the engine alone draws nothing dAD could
  hide behind): the global generators' states (torch's CPU one, NumPy's, Python's ``random``) right
  before and right after dAD attaches, with mode auto, objective time, a measured link; then after
  each training step, with a route refresh (the link measured again) every 3 steps (``auto``) or,
  where the engine has a `DADSynchronizer`, the link set slow after attach so that rank routes
  (their warm starts) and then a route trial run (``trial``); the same steps' states of the engine
  alone.
- ``losses``: a model with dropout, trained by the engine alone, under dAD exact and under auto at
  a stated 1000 Gbit/s link (every weight dense): each step's loss, as ``float.hex``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import sys
from typing import Callable, Dict, List, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from models import gather_per_rank, run_all, write_and_exit  # noqa: E402

AUTO = {"mode": "auto", "rank": 4, "objective": "time", "lossless_steps": 0, "route_refresh_steps": 3,
        "route_trial_steps": 2}
# the link set slow after attach (`run_states`), and no refresh to measure it fast again: steps 0-2
# take the rank-r all-reduce (warm starts drawn), 3-6 go all dense, then the trial decides
TRIAL = {**AUTO, "route_refresh_steps": 100}
EXACT = {"mode": "exact"}
FAST = {"mode": "auto", "rank": 4, "objective": "time", "lossless_steps": 0,
        "link": {"bandwidth": "1000gbit"}}
SLOW = {"bandwidth": "1mbit", "latency_us": 100}
STEPS = 8


def states() -> Dict[str, str]:
    """A digest of every global generator's state."""
    def digest(x) -> str:
        return hashlib.sha256(repr(x).encode() if not isinstance(x, bytes) else x).hexdigest()[:12]
    np_state = np.random.get_state()
    return {"torch": digest(torch.get_rng_state().numpy().tobytes()),
            "numpy": digest(np_state[1].tobytes() + repr(np_state[2:]).encode()),
            "python": digest(random.getstate())}


def build(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(32, 8)]
    return nn.Sequential(*layers)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def seed_all() -> None:
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)


# -- engines: each returns (model or engine to call, step function, its DADSynchronizer or None) -----
def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def attach_sync(model: nn.Module, dad: Optional[dict]):
    import torch.distributed as dist
    from dad_integrations import DADSynchronizer, TorchDistributedAggregator
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = DADSynchronizer(model, TorchDistributedAggregator(), dad) if dad is not None else None

    def step(x, y) -> float:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if sync is not None:
            sync.synchronize()
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, sync


def _sgd_step(fwd: nn.Module, opt: torch.optim.Optimizer):
    """A plain step through ``fwd`` (the engine synchronises in backward)."""
    def step(x, y) -> float:
        loss = nn.functional.mse_loss(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def attach_ddp(model: nn.Module, dad: Optional[dict]):
    from dad_integrations.ddp_hook import register_dad_comm_hook
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sync = register_dad_comm_hook(ddp, dad) if dad is not None else None

    return _sgd_step(ddp, opt), sync


def attach_deepspeed(model: nn.Module, dad: Optional[dict], stage: int = 0):
    import deepspeed
    import deepspeed_dad
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 16, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    attachment = None
    if dad is not None:  # attached apart from initialize: what is measured is dAD's attach alone
        before = states()
        attachment = deepspeed_dad.attach(engine, dad)
        ATTACH_STATES.append((before, states()))

    def step(x, y) -> float:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, getattr(attachment, "synchronizer", None) if stage < 2 else None


def attach_fsdp2(model: nn.Module, dad: Optional[dict]):
    from torch.distributed.fsdp import fully_shard
    from dad_integrations.fsdp import enable_dad_fsdp
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if dad is not None:
        enable_dad_fsdp(model, dad)

    return _sgd_step(model, opt), None


def attach_horovod(model: nn.Module, dad: Optional[dict]):
    import horovod.torch as hvd
    import horovod_dad
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if dad is None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = horovod_dad.DADOptimizer(opt, named_parameters=model.named_parameters(), model=model, dad=dad)

    def step(x, y) -> float:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step, getattr(opt, "dad_synchronizer", None) if dad is not None else None


ENGINES: Dict[str, Callable] = {"sync": attach_sync, "ddp": attach_ddp, "deepspeed": attach_deepspeed,
                                "zero2": lambda m, d: attach_deepspeed(m, d, stage=2),
                                "fsdp2": attach_fsdp2, "horovod": attach_horovod}
WITH_SYNC = ("sync", "ddp", "deepspeed", "horovod")  # engines whose attach returns a DADSynchronizer
ATTACH_STATES: List[tuple] = []  # (before, after) of an attach that happens inside an engine's set-up


def run_states(engine: str, dad: Optional[dict]) -> dict:
    """States before and after attach (with dAD), then after every step."""
    rank = _rank() if engine != "horovod" else __import__("horovod.torch").torch.rank()
    model = build(0.0)
    seed_all()
    ATTACH_STATES.clear()
    before = states()
    step, sync = ENGINES[engine](model, dad)
    attach = ATTACH_STATES[0] if ATTACH_STATES else (before, states())
    if sync is not None and dad is TRIAL:
        sync.set_link(SLOW)  # rank routes at once, then a route trial (the link is a measured one)
    after_steps, routes = [], []
    for s in range(STEPS):
        step(*batch(s, rank))
        after_steps.append(states())
        if sync is not None:
            routes.append(sorted({p.representation for p in sync.last_step_report().params}))
    out = {"attach": list(attach), "steps": after_steps}
    if sync is not None:
        out["trials"] = len(getattr(sync, "route_trials", []))
        out["routes"] = routes
    return out


def run_losses(engine: str, dad: Optional[dict]) -> dict:
    rank = _rank() if engine != "horovod" else __import__("horovod.torch").torch.rank()
    model = build(0.1)
    seed_all()
    step, _ = ENGINES[engine](model, dad)
    return {"losses": [float.hex(step(*batch(s, rank))) for s in range(5)]}


def attach_trainer(model: nn.Module, dad: Optional[dict]):
    """A Trainer over the same batches; `DADCallback` attaches at train begin, so ``step`` runs the
    whole training and records the states (and warnings of the callback's attach) per step."""
    import tempfile
    import warnings
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from dad_integrations.transformers import DADCallback

    class Batches(Dataset):
        def __len__(self):
            return 16 * STEPS

        def __getitem__(self, i):
            x, y = batch(i, 0)
            return {"x": x[0], "y": y[0]}

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return {"loss": nn.functional.mse_loss(self.net(x), y)}

    class Record(TrainerCallback):
        def __init__(self, where: str):
            self.where = where

        def on_train_begin(self, *args, **kwargs):
            TRAINER[self.where] = states()

        def on_step_end(self, *args, **kwargs):
            if self.where == "after":
                TRAINER["steps"].append(states())

    class Watched(DADCallback):  # the callback's own warnings while it attaches
        def on_train_begin(self, *args, **kwargs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                super().on_train_begin(*args, **kwargs)
            TRAINER["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]

    callbacks = [Record("before")] + ([Watched(dad)] if dad is not None else []) + [Record("after")]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=8,
                             learning_rate=0.1, report_to=[], save_strategy="no", seed=0, data_seed=0,
                             disable_tqdm=True, use_cpu=True, ddp_backend="gloo", logging_steps=10 ** 6,
                             remove_unused_columns=False)
    trainer = Trainer(model=Loss(), args=args, train_dataset=Batches(), callbacks=callbacks)
    TRAINER.clear()
    TRAINER["steps"] = []

    def step(x, y) -> None:
        trainer.train()
    return step, None


TRAINER: dict = {}


def run_trainer(dad: Optional[dict]) -> dict:
    model = build(0.0)
    seed_all()
    step, _ = attach_trainer(model, dad)
    step(None, None)
    return {"attach": [TRAINER["before"], TRAINER["after"]], "steps": TRAINER["steps"],
            "warnings": TRAINER.get("warnings", [])}


class Banners(logging.Handler):
    """The attach lines this rank showed (`dad_integrations.engines.banner`)."""

    def __init__(self):
        super().__init__()
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("dAD attached to "):  # the channel says routes too (`logs.say`)
            self.lines.append(record.getMessage())


BANNERS = Banners()


def run(case: dict) -> dict:
    dad = {"auto": AUTO, "trial": TRIAL, "exact": EXACT, "fast": FAST, None: None}[case["dad"]]
    BANNERS.lines.clear()
    if case["engine"] == "trainer":
        out = run_trainer(dad)
    elif case["check"] == "states":
        out = run_states(case["engine"], dad)
    else:
        out = run_losses(case["engine"], dad)
    out["banners"] = list(BANNERS.lines)
    return out


def cases(engines: List[str], losses: List[str]) -> Dict[str, dict]:
    out = {}
    for e in engines:
        for dad in (None, "auto", "trial") if e in WITH_SYNC and e != "trainer" else (None, "auto"):
            out[f"states-{e}-{dad}"] = {"engine": e, "check": "states", "dad": dad}
    for e in losses:
        for dad in (None, "exact", "fast"):
            out[f"losses-{e}-{dad}"] = {"engine": e, "check": "losses", "dad": dad}
    return out


def main() -> None:
    out_path, engines = sys.argv[1], sys.argv[2].split(",")
    logging.getLogger("dad_integrations.banner").addHandler(BANNERS)
    losses = [e for e in engines if e in WITH_SYNC]
    if engines == ["horovod"]:
        import horovod.torch as hvd
        hvd.init()

        def gather(case_id: str, mine: dict) -> list:
            return hvd.allgather_object(mine, name=f"results.{case_id}")
        results = run_all(cases(engines, losses), run, gather)
        if hvd.rank() == 0:
            import json
            with open(out_path, "w") as f:
                json.dump(results, f)
        hvd.shutdown()
        return
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if "deepspeed" in engines or "zero2" in engines:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    write_and_exit(out_path, run_all(cases(engines, losses), run, gather_per_rank))


if __name__ == "__main__":
    main()
