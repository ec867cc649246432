"""Accelerate's multi-node launch with restarts: one ``accelerate launch --rdzv_backend c10d
--max_restarts 1`` per simulated node (tests/test_elastic_nodes.py), a rank killed mid-run.

Usage: accelerate launch ... elastic_accelerate_worker.py OUT WORK

The group comes from `dad_integrations.init_process_group` before ``Accelerator()`` (Accelerate
then uses it: ``PartialState`` initialises a group only when none exists). dAD through
`enable_dad` (rank-dAD, error feedback), checkpoints by ``accelerator.save_state`` every EVERY
steps. Attempt 0: node 1's rank SIGKILLs itself in the middle of step KILL_AT; both agents restart
their ranks. Attempt 1 loads the latest checkpoint, trains to STEPS, then trains an uninterrupted
run from scratch with the same checkpoint boundaries; rank 0 writes how the two compare.
"""
from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from elastic_node_loss_worker import CONFIG, MODEL, batch, latest  # noqa: E402

STEPS, EVERY, KILL_AT = 8, 2, 5




def train(accelerator, ckpt: str, kill: bool) -> Tuple[torch.Tensor, int, list]:
    """From ``ckpt``'s latest checkpoint (or from scratch) to STEPS; returns the parameters, the step
    started from and the losses."""
    from dad_integrations.accelerate import enable_dad
    rank = accelerator.process_index
    model = models.build(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    sync = enable_dad(accelerator, model, CONFIG)
    start = latest(ckpt) or 0
    if start:
        accelerator.load_state(os.path.join(ckpt, f"step{start}"))
    losses = []
    for step in range(start, STEPS):
        loss = models.loss_of(MODEL, model, batch(step, rank))
        if kill and step == KILL_AT and os.environ.get("SIM_CLUSTER_NODE") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if (step + 1) % EVERY == 0:
            accelerator.save_state(os.path.join(ckpt, f"step{step + 1}"))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:  # named once every rank's files are on disk
                with open(os.path.join(ckpt, "latest.tmp"), "w") as f:
                    f.write(str(step + 1))
                os.replace(os.path.join(ckpt, "latest.tmp"), os.path.join(ckpt, "latest"))
            accelerator.wait_for_everyone()
    params = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    sync.close()
    accelerator.free_memory()
    return params, start, losses


def main() -> None:
    out_path, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True)  # a hung attempt fails the job with its stacks
    from accelerate import Accelerator
    from dad_integrations import elastic, init_process_group
    init_process_group("gloo", timeout=timedelta(seconds=30))
    accelerator = Accelerator(cpu=True)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    params, start, losses = train(accelerator, os.path.join(work, "elastic"), kill=attempt == 0)
    if attempt == 0:
        raise SystemExit(f"attempt 0 was to lose a rank at step {KILL_AT}")
    straight, _, straight_losses = train(accelerator, os.path.join(work, "straight"), kill=False)
    first = params.clone()
    dist.broadcast(first, 0)
    mine = {"attempt": attempt, "resumed_from": start, "world": accelerator.num_processes,
            "group_kept": elastic.prefixed_by_attempt(), "params_equal": bool(torch.equal(params, straight)),
            "ranks_identical": bool(torch.equal(first, params)), "losses": losses,
            "straight_losses": straight_losses}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    models.write_and_exit(out_path, {"ranks": per_rank})


if __name__ == "__main__":
    main()
