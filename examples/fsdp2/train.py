"""Train a tiny GPT-2 under FSDP2 twice: FSDP's own reduce-scatter, then dAD inside it.

    torchrun --nproc_per_node 2 examples/fsdp2/train.py [--mode auto|exact|rank] [--rank 4] [--steps 10]
        [--error-feedback-rank 16]

Both runs start from the same weights and read the same byte-level batches (the Python standard
library's source, nothing is downloaded); each block and the root are ``fully_shard``-ed. The dAD
run calls `enable_dad_fsdp` once, after ``fully_shard``: its factor-covered weights then skip
FSDP's reduce-scatter and every rank writes only its shard of the exact average. At the end rank 0
prints loss and bytes sent per rank and step, against what FSDP's reduce-scatter handed to
``torch.distributed`` in the first run. Runs on CPU with gloo (NCCL when CUDA is available).

The defaults (2 x 16 tokens per rank, width 128) are where factors are the cheaper exchange for
most weights (rows per rank well below a shard's rows times the width over their sum); with many
more rows per rank ``auto`` sends the weights through FSDP's own reduce-scatter. With
``--rank r`` (mode ``rank``, or ``auto`` weighing them too) weights may take a rank-r route
(`codecs.sharded_rank`), lossy, with error feedback: one unsharded residual per rank-routed weight
and rank, or its rank-q part with ``--error-feedback-rank q`` (less memory, part of the gain).
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from transformers import GPT2Config, GPT2LMHeadModel

from dad_examples.text_data import VOCAB_SIZE, byte_lm_batches, stdlib_source_bytes
from dad_integrations.fsdp import enable_dad_fsdp


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP's default reduce-scatter, counting what one rank sends: (S-1)/S of each input."""

    def __init__(self, world_size: int):
        self.world_size, self.sent = world_size, 0.0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.sent += (self.world_size - 1) / self.world_size * input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def run(model: GPT2LMHeadModel, args: argparse.Namespace, dad: bool, device: torch.device) -> dict:
    """Shard ``model``, train it ``args.steps`` steps; loss and bytes per step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    counter = CountingReduceScatter(world)
    if dad:
        sync = enable_dad_fsdp(model, {"mode": args.mode, "rank": args.rank, "rank_route": args.rank_route,
                                       "error_feedback_rank": args.error_feedback_rank})
    else:
        for m in [model, *model.transformer.h]:
            m.set_custom_reduce_scatter(counter)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = byte_lm_batches(stdlib_source_bytes(max_bytes=400_000), args.batch_size, args.seq_len, rank=rank,
                           world_size=world, seed=0)
    losses, sent, start = [], 0.0, time.perf_counter()
    for _ in range(args.steps):
        ids = next(data).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if dad:
            sent += sync.last_step_report().totals["sent_bytes"]
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if dad:
        sync.close()
    loss = torch.tensor(losses[-1], device=device)
    dist.all_reduce(loss)  # mean over ranks
    return {"loss": float(loss) / world, "sent": (sent if dad else counter.sent) / args.steps,
            "s_per_step": (time.perf_counter() - start) / args.steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="auto", choices=("auto", "exact", "rank"))
    p.add_argument("--rank", type=int, default=None, help="rank-r routes (needed by --mode rank)")
    p.add_argument("--rank-route", default="auto", choices=("auto", "allgather", "allreduce"))
    p.add_argument("--error-feedback-rank", type=int, default=None,
                   help="keep each error-feedback residual at this rank (default: whole)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=16)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=args.seq_len, n_embd=128, n_layer=2,
                                      n_head=2, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)).to(device)
    results = {"reduce-scatter": run(copy.deepcopy(base), args, False, device),
               f"dad-{args.mode}" + (f"-r{args.rank}" if args.rank else ""): run(copy.deepcopy(base), args, True,
                                                                                device)}
    if dist.get_rank() == 0:
        rs = results["reduce-scatter"]["sent"]
        print(f"{'run':<15}| final loss | bytes sent/step/rank | vs reduce-scatter | s/step")
        print("-" * 72)
        for name, r in results.items():
            print(f"{name:<15}| {r['loss']:>10.4f} | {r['sent']:>20,.0f} | {r['sent'] / rs:>17.3f} | "
                  f"{r['s_per_step']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
