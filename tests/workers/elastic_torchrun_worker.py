"""A torchrun elastic job with dAD (DDP + its communication hook, rank-dAD with error feedback)
whose rank 1 is killed mid-run and which resumes from its last checkpoint.

Usage: torchrun --standalone --nnodes 1:1 --nproc-per-node 2 --max-restarts 1 elastic_torchrun_worker.py OUT WORK

Attempt 0 (TORCHELASTIC_RESTART_COUNT 0) trains, checkpointing every EVERY steps (the model and
optimizer from rank 0, dAD's state from every rank), and rank 1 kills itself (SIGKILL, in the
middle of step KILL_AT, between forward and backward): torchrun stops the other rank and starts
both again. Attempt 1 loads the last checkpoint, trains to STEPS, then trains an uninterrupted run
from scratch with the same checkpoint boundaries and writes how far the two end apart.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from resume_worker import MODEL, batch, flat_params, flat_state  # noqa: E402

CONFIG = {"mode": "rank", "rank": 2, "error_feedback": True}
STEPS, EVERY, KILL_AT = 8, 2, 5


def latest(ckpt: str) -> Optional[int]:
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


def save(ckpt: str, step: int, ddp, opt, sync) -> None:
    """Every rank its dAD state; rank 0 the model and optimizer (the same on every rank), then
    ``latest`` once all are on disk: a rank killed mid-save leaves the last whole checkpoint named."""
    from dad_integrations.engines.checkpoint import save_rank_state
    folder = os.path.join(ckpt, f"step{step}")
    rank, world = dist.get_rank(), dist.get_world_size()
    save_rank_state(sync, folder, rank, world, step=step)
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}, os.path.join(folder, "train.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt, "latest.tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(ckpt, "latest.tmp"), os.path.join(ckpt, "latest"))
    dist.barrier()


def train(ckpt: str, kill: bool) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Train to STEPS from ``ckpt``'s latest checkpoint (or from scratch); returns parameters,
    dAD state and the step resumed from."""
    from dad_integrations import register_dad_comm_hook
    from dad_integrations.engines.checkpoint import load_rank_state
    rank = dist.get_rank()
    model = models.build(MODEL)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sync = register_dad_comm_hook(ddp, CONFIG)
    start = latest(ckpt) or 0
    if start:
        folder = os.path.join(ckpt, f"step{start}")
        saved = torch.load(os.path.join(folder, "train.pt"), weights_only=True)
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        payload = load_rank_state(sync, folder, rank, dist.get_world_size())
        assert payload["step"] == start, payload
    for step in range(start, STEPS):
        loss = models.loss_of(MODEL, ddp, batch(step, rank))
        if kill and step == KILL_AT and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % EVERY == 0:
            save(ckpt, step + 1, ddp, opt, sync)
    out = flat_params(ddp.module), flat_state(sync), start
    sync.close()
    return out


def main() -> None:
    out_path, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    import faulthandler
    faulthandler.dump_traceback_later(240, exit=True)  # a hung attempt fails the job with its stacks
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # the shipped call: the store keyed by the attempt (torchrun's store outlives a dead attempt)
    from datetime import timedelta
    from dad_integrations import init_process_group
    init_process_group("gloo", timeout=timedelta(seconds=120))
    params, state, start = train(os.path.join(work, "elastic"), kill=attempt == 0)
    if attempt == 0:
        raise SystemExit("attempt 0 was to be killed at step %d" % KILL_AT)
    straight_params, straight_state, _ = train(os.path.join(work, "straight"), kill=False)
    mine = {"attempt": attempt, "resumed_from": start, "params_equal": bool(torch.equal(params, straight_params)),
            "state_equal": bool(torch.equal(state, straight_state)),
            "params_rel": float((params - straight_params).norm() / straight_params.norm())}
    first = params.clone()
    dist.broadcast(first, 0)
    mine["ranks_equal"] = bool(torch.equal(first, params))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    models.write_and_exit(out_path, {"ranks": per_rank})


if __name__ == "__main__":
    main()
