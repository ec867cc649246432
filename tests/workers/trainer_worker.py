"""Runs inside `accelerate launch` (2 CPU processes): `transformers.Trainer` with `DADCallback`.

Usage: accelerate launch --config_file examples/accelerate/cpu_2proc.yaml trainer_worker.py OUT
       DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 trainer_worker.py OUT deepspeed [STAGE [json-only]]
Trains the small GPT-2 twice from the same weights on the same data: plain Trainer (DDP all-reduce,
or DeepSpeed ZeRO STAGE's, 1 by default), then with ``DADCallback`` in mode exact (under DeepSpeed,
from the config's "dad" block); writes the final parameters' difference, whether
ranks agree, and the log history (where the callback's byte metrics must appear).
``json-only``: no dAD import and no callback, only the block in ``TrainingArguments(deepspeed=...)``
(the installed import hook attaches dAD); then the engine's dAD report is written instead.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402


class ByteWindows(Dataset):
    """The same ``count`` windows of 16 random bytes (from ``low`` to 63) on every rank; the Trainer's
    sampler shards them."""

    def __init__(self, count: int = 64, low: int = 0):
        self.data = torch.randint(low, 64, (count, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


DEEPSPEED = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
             "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}


def train(init: torch.nn.Module, callbacks: list, out_dir: str, deepspeed: dict = None) -> tuple:
    model = copy.deepcopy(init)
    # DeepSpeed: DS_ACCELERATOR=cpu, and gloo named (Accelerate finds no backend without a GPU)
    device_args = {"deepspeed": deepspeed, "ddp_backend": "gloo"} if deepspeed else {"use_cpu": True}
    args = TrainingArguments(output_dir=out_dir, max_steps=6, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=2,
                             report_to=[], save_strategy="no", seed=0, data_seed=0,
                             disable_tqdm=True, max_grad_norm=1.0, **device_args)
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(), callbacks=callbacks)
    trainer.train()
    params = list(model.parameters())
    with _gathered(params, deepspeed):  # ZeRO-3 keeps only partitions in the module
        flat = torch.cat([p.detach().reshape(-1) for p in params])
    return flat, trainer.state.log_history, _dad_totals(trainer) if deepspeed else None


def _dad_totals(trainer) -> dict:
    """The last step's dAD report of the Trainer's DeepSpeed engine (None: no dAD attached)."""
    import deepspeed_dad  # after training: reads what the config's block attached
    attachment = deepspeed_dad.get_attachment(trainer.model_wrapped)
    return None if attachment is None else attachment.last_step_report().totals


def _gathered(params: list, deepspeed: dict):
    import contextlib
    if deepspeed and deepspeed["zero_optimization"]["stage"] == 3:
        import deepspeed as ds
        return ds.zero.GatheredParameters(params)
    return contextlib.nullcontext()


def main() -> None:
    out_path = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    init = models.build("gpt2")
    on_deepspeed = len(sys.argv) > 2 and sys.argv[2] == "deepspeed"
    stage = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    json_only = len(sys.argv) > 4 and sys.argv[4] == "json-only"
    config = {**DEEPSPEED, "zero_optimization": {"stage": stage}}
    totals = None
    if not json_only:
        from dad_integrations.transformers import DADCallback
    with tempfile.TemporaryDirectory() as tmp:
        if json_only:  # nothing of dAD in the script: the block alone
            ref, _, _ = train(init, [], tmp, config)
            mine, history, totals = train(init, [], tmp, {**config, "dad": {"enabled": True, "mode": "exact"}})
        elif on_deepspeed:  # the "dad" block rules there; the callback finds the engine's dAD
            import deepspeed_dad.auto  # noqa: F401  the one added line
            ref, _, _ = train(init, [], tmp, config)
            mine, history, totals = train(init, [DADCallback()], tmp,
                                          {**config, "dad": {"enabled": True, "mode": "exact"}})
        else:
            ref, _, _ = train(init, [], tmp)
            mine, history, _ = train(init, [DADCallback({"mode": "exact"})], tmp)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    result = {"rel_diff": float((mine - ref).norm() / ref.norm()),
              "moved": float((mine - torch.cat([p.detach().reshape(-1) for p in init.parameters()])).norm()),
              "identical": all(torch.equal(gathered[0], g) for g in gathered),
              "log_history": history, "dad_totals": totals}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    # leave the group before exit: a gloo thread that frees a finished collective's tensors during
    # interpreter shutdown aborts the process ("terminate called without an active exception")
    models.write_and_exit(out_path, per_rank)


if __name__ == "__main__":
    main()
