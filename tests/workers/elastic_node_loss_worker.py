"""A torchrun elastic job across two simulated nodes that loses node 1 and resumes on node 0.

Usage (one torchrun per node, ``--nnodes 1:2 --max-restarts 1``; tests/test_elastic_nodes.py):
  torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 1 ... elastic_node_loss_worker.py OUT WORK

dAD (DDP's hook, rank-dAD with error feedback) learns a fixed teacher; the group comes from
`dad_integrations.init_process_group`. Attempt 0 (world 4) checkpoints every EVERY steps (model
and optimizer from rank 0, dAD's state from every rank) and logs each step's mean loss; at step
KILL_AT node 1's ranks park between forward and backward and write ``parked.<rank>``: the test
SIGKILLs everything on node 1 then. Attempt 1 (node 0 alone, world 2) resumes from the latest
checkpoint and trains to STEPS; then, as the reference, plain DDP trains from the same checkpoint
on the same batches. Rank 0 writes both runs' losses, when the first resumed step ended, and
whether the ranks ended identical.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from elastic_torchrun_worker import latest, save  # noqa: E402  (the checkpoint's layout, shared)

CONFIG = {"mode": "rank", "rank": 2, "error_feedback": True}
STEPS, EVERY, KILL_AT = 12, 2, 7
MODEL = "mlp"
TEACHER = torch.randn(12, 6, generator=torch.Generator().manual_seed(7)) / 12 ** 0.5


def batch(step: int, rank: int) -> dict:
    """Rank ``rank``'s batch at ``step``: random inputs, the teacher's outputs (a loss that falls)."""
    x = torch.randn(4, 5, 12, generator=torch.Generator().manual_seed(1000 * step + rank))
    return {"x": x, "y": torch.tanh(x @ TEACHER)}






def mean_loss(loss: torch.Tensor) -> float:
    """The loss averaged over ranks (each rank's batch differs)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def train(work: str, attempt: int, with_dad: bool) -> Tuple[List[float], torch.Tensor, int, float]:
    """From the latest checkpoint (or from scratch) to STEPS; returns the losses, the parameters,
    the step started from and when (time.time()) the first step ended."""
    from dad_integrations import register_dad_comm_hook
    from dad_integrations.engines.checkpoint import load_rank_state
    rank = dist.get_rank()
    ckpt = os.path.join(work, "ckpt")
    model = models.build(MODEL)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sync = register_dad_comm_hook(ddp, CONFIG) if with_dad else None
    start = latest(ckpt) or 0
    if start:
        folder = os.path.join(ckpt, f"step{start}")
        saved = torch.load(os.path.join(folder, "train.pt"), weights_only=True)
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if sync is not None:
            load_rank_state(sync, folder, rank, dist.get_world_size())
    losses, first_end = [], 0.0
    for step in range(start, STEPS):
        loss = models.loss_of(MODEL, ddp, batch(step, rank))
        if attempt == 0 and step == KILL_AT and os.environ.get("SIM_CLUSTER_NODE") == "1":
            open(os.path.join(work, f"parked.{rank}"), "w").close()
            time.sleep(300)  # mid-step, until the test kills this node
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_loss(loss))
        if attempt == 0 and rank == 0:
            with open(os.path.join(work, "attempt0.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "world": dist.get_world_size(), "loss": losses[-1]}) + "\n")
        first_end = first_end or time.time()
        if with_dad and attempt == 0 and (step + 1) % EVERY == 0:
            save(ckpt, step + 1, ddp, opt, sync)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    if sync is not None:
        sync.close()
    return losses, params, start, first_end


def main() -> None:
    out_path, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True)  # a hung attempt fails the job with its stacks
    from dad_integrations import init_process_group
    init_process_group("gloo", timeout=timedelta(seconds=30))
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    losses, params, start, first_end = train(work, attempt, with_dad=True)
    if attempt == 0:
        raise SystemExit(f"attempt 0 was to lose node 1 at step {KILL_AT}")
    first = params.clone()
    dist.broadcast(first, 0)
    same = torch.tensor([float(torch.equal(first, params))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    ref_losses, _, ref_start, _ = train(work, attempt, with_dad=False)
    models.write_and_exit(out_path, {
        "attempt": attempt, "world": dist.get_world_size(), "resumed_from": start, "ref_from": ref_start,
        "first_resumed_step_end": first_end, "losses": losses, "ref_losses": ref_losses,
        "ranks_identical": bool(same.item() == 1.0)})


if __name__ == "__main__":
    main()
