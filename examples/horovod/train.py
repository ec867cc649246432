"""Train a small byte-level GPT-2 with Horovod, synchronising gradients with dAD.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod/train.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod/train.py --dad '{"mode": "exact"}'
    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod/train.py --allreduce   # plain Horovod

An ordinary Horovod training script; the only dAD-specific line is the optimizer wrapper
(``horovod_dad.DADOptimizer`` instead of ``hvd.DistributedOptimizer``, with the same arguments and
``dad=``; dAD finds the model at its first forward).
The model is built from a ``GPT2Config`` and the data is the Python standard library's own source
read as bytes (`dad_examples.text_data`): nothing is downloaded. It shows the usual Horovod
pieces: broadcast of parameters and optimizer state, gradient accumulation through
``backward_passes_per_step``, clipping between ``synchronize()`` and ``step()`` inside
``skip_synchronize()``, an LR schedule; and at the end the bytes each rank sent per step against
a ring all-reduce of the same gradients, and a check that all ranks hold identical parameters.
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import horovod.torch as hvd
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import horovod_dad
from dad_examples.text_data import VOCAB_SIZE, byte_lm_batches, stdlib_source_bytes

log = logging.getLogger("horovod_example")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and backward pass")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--accumulate", type=int, default=2, help="backward passes per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dad", type=json.loads, default={"mode": "auto", "rank": 4},
                   help="dAD config as JSON (keys of DADConfig)")
    p.add_argument("--fp16", action="store_true", help="hvd.Compression.fp16 (float16 on the wire)")
    p.add_argument("--allreduce", action="store_true", help="plain hvd.DistributedOptimizer, for comparison")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different on purpose: broadcast_parameters makes them equal
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=args.seq_len, n_embd=128, n_layer=2,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none

    if args.allreduce:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression,
                                             backward_passes_per_step=args.accumulate)
    else:  # the one-line change
        optimizer = horovod_dad.DADOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression,
                                             backward_passes_per_step=args.accumulate,
                                             dad=args.dad)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    batches = byte_lm_batches(stdlib_source_bytes(1_000_000), args.batch_size, args.seq_len,
                              rank=hvd.rank(), world_size=hvd.size())
    sent, allreduce, losses = [], [], []
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        for _ in range(args.accumulate):
            ids = next(batches)
            loss = model(input_ids=ids, labels=ids).loss / args.accumulate
            loss.backward()
            losses.append(float(loss.detach()) * args.accumulate)
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with optimizer.skip_synchronize():
            optimizer.step()
        scheduler.step()
        if not args.allreduce:
            totals = optimizer.last_step_report().totals
            sent.append(totals["sent_bytes"])
            allreduce.append(totals["allreduce_bytes"])
        if step % 10 == 0 or step == args.steps - 1:
            window = losses[-args.accumulate * 5:]
            log.info("step %3d  loss %.4f%s", step, sum(window) / len(window),
                     f"  sent {sent[-1]:,.0f} B (all-reduce {allreduce[-1]:,.0f} B)" if sent else "")
    seconds = (time.perf_counter() - start) / args.steps

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="example.identical")
    identical = all(torch.equal(gathered[0], g) for g in gathered)
    if hvd.rank() == 0:
        label = "hvd.DistributedOptimizer" if args.allreduce else f"DADOptimizer {json.dumps(args.dad)}"
        print(f"{label}: final loss {sum(losses[-10:]) / len(losses[-10:]):.4f}, {seconds:.3f} s/step, "
              f"ranks identical: {'yes' if identical else 'NO'}")
        if sent:
            mean_sent, mean_ar = sum(sent) / len(sent), sum(allreduce) / len(allreduce)
            print(f"bytes sent per step and rank: {mean_sent:,.0f} (a ring all-reduce: {mean_ar:,.0f}, "
                  f"ratio {mean_sent / mean_ar:.3f})")
    if not identical:
        raise SystemExit("ranks hold different parameters")


if __name__ == "__main__":
    main()
