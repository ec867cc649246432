"""Train a small byte-level GPT-2 with DeepSpeed, dAD switched on by the "dad" block of ds_config.json.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed/train.py --deepspeed_config examples/deepspeed/ds_config.json

(on GPUs drop ``DS_ACCELERATOR=cpu``); ``ds_config_zero2.json`` / ``ds_config_zero3.json`` run it
sharded (ZeRO-2/3: each rank rebuilds only its gradient partition; bytes are compared with
DeepSpeed's reduce-scatter). The only dAD line is ``deepspeed_dad.initialize`` in place of
``deepspeed.initialize``; everything else is a plain DeepSpeed loop. The model is built from a
``GPT2Config`` and trained on the Python standard library's own source (bytes as tokens), so nothing
is downloaded. Each logged step shows the loss and the bytes dAD sent per rank against what
DeepSpeed's ring all-reduce of the same gradients would send; ``--no-dad`` runs DeepSpeed's own
all-reduce on the same data for comparison.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import deepspeed
import deepspeed_dad
from dad_examples.text_data import VOCAB_SIZE, byte_lm_batches, stdlib_source_bytes

log = logging.getLogger("deepspeed_train")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--log-every", type=int, default=5, help="log every N steps")
    p.add_argument("--no-dad", action="store_true", help="ignore the 'dad' block: DeepSpeed's own all-reduce")
    p.add_argument("--json", metavar="PATH", help="write losses and bytes per step here (rank 0)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    args = p.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")
    return args


def build_model() -> GPT2LMHeadModel:
    """A 2-layer byte-level GPT-2 (vocabulary 256) with tied input/output embeddings."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    init = deepspeed.initialize if args.no_dad else deepspeed_dad.initialize
    if args.no_dad:  # the same config, without the block DeepSpeed does not know
        args.config, _ = deepspeed_dad.split_config(args.deepspeed_config)
        args.deepspeed_config = None
        engine, _, _, _ = init(args=args, model=model, optimizer=optimizer, config=args.config)
    else:
        engine, _, _, _ = init(args=args, model=model, optimizer=optimizer)
    dad = deepspeed_dad.get_attachment(engine)
    rank, world = engine.global_rank, engine.world_size
    micro = engine.train_micro_batch_size_per_gpu()
    batches = byte_lm_batches(stdlib_source_bytes(max_bytes=2_000_000), micro, args.seq_len,
                              rank=rank, world_size=world)
    # ZeRO-3 keeps only a partition in p.data: its full size is ds_numel
    grad_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size()
                     for p in engine.module.parameters() if p.requires_grad)
    sharded = engine.zero_optimization_stage() >= 2
    # what DeepSpeed's own reduction sends per rank and step: a ring all-reduce, or under ZeRO-2/3 a
    # reduce-scatter (each rank keeps only its partition of the average)
    baseline_name = "reduce-scatter" if sharded else "all-reduce"
    allreduce = ((world - 1) / world if sharded else 2.0 * (world - 1) / world) * grad_bytes
    history = []
    start = time.time()
    for step in range(1, args.steps + 1):
        sent = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            x = next(batches).to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        if dad is not None:
            sent = dad.last_step_report().totals["sent_bytes"]
        else:
            sent = allreduce
        history.append({"step": step, "loss": float(loss.detach()), "sent_bytes": sent})
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            log.info("step %3d  loss %.4f  sent %9.0f bytes/rank (%s %9.0f, ratio %.3f)",
                     step, history[-1]["loss"], sent, baseline_name, allreduce, sent / allreduce)
    elapsed = time.time() - start
    if rank == 0:
        mean_sent = sum(h["sent_bytes"] for h in history) / len(history)
        log.info("done: %s, ZeRO stage %d, %d steps in %.1fs, final loss %.4f, mean %.0f bytes sent/rank/step = "
                 "%.3f x %s", "dAD " + dad.config.mode if dad is not None else "DeepSpeed " + baseline_name,
                 engine.zero_optimization_stage(), args.steps, elapsed, history[-1]["loss"], mean_sent,
                 mean_sent / allreduce, baseline_name)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mode": dad.config.mode if dad is not None else "allreduce", "history": history,
                           "allreduce_bytes": allreduce, "seconds": elapsed}, f, indent=1)


if __name__ == "__main__":
    main()
