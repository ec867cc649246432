"""Runs inside `torchrun` (CPU accelerator, gloo): Accelerate with a DeepSpeed plugin whose config has a
"dad" block, enabled by the one line ``import deepspeed_dad.auto``; writes JSON results.

Usage: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 accelerate_ds_worker.py OUT.json
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

import deepspeed_dad.auto  # noqa: E402,F401  the one added line
import deepspeed_dad  # noqa: E402
from accelerate import Accelerator, DeepSpeedPlugin  # noqa: E402

STEPS = 6


def main() -> None:
    out_path = sys.argv[1]
    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
              "dad": {"enabled": True, "mode": "exact"}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = models.build("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    attachment = deepspeed_dad.get_attachment(model)
    losses, sent, allreduce = [], [], []
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        data = models.batch("gpt2", 2, seed=step % 2 * 10 + rank)
        loss = model(**data).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if attachment is not None:
            totals = attachment.last_step_report().totals
            sent.append(totals["sent_bytes"])
            allreduce.append(totals["allreduce_bytes"])
    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    result = {"attached": attachment is not None, "losses": losses, "sent": sent, "allreduce": allreduce,
              "identical": bool(all(torch.equal(gathered[0], g) for g in gathered)),
              "distributed_type": str(accelerator.distributed_type),
              "engine": type(model).__name__, "num_processes": accelerator.num_processes}
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, result)
    models.write_and_exit(out_path, per_rank)


if __name__ == "__main__":
    main()
