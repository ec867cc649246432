"""Train a small GPT-2 on byte-level Python source, synchronising gradients four ways.

    torchrun --nproc_per_node 2 examples/torchrun/finetune_gpt2.py

Modes, each started from the same initial weights and fed the same batches:

* ``allreduce``: ``torch.nn.parallel.DistributedDataParallel`` (the baseline);
* ``exact``: dAD, lossless factors of every supported layer;
* ``rank``: rank-dAD with ``--rank`` components per weight;
* ``auto``: per parameter and step, the cheapest of all-reduce, dAD and rank-dAD.

At the end a table compares final loss, bytes sent per step and rank, the ratio to a ring
all-reduce of the same gradients and the time per step; each mode also checks that all ranks hold
bit-identical parameters. Runs on CPU with the gloo backend (NCCL when CUDA is available).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from dad_examples.text_data import VOCAB_SIZE, byte_lm_batches, stdlib_source_bytes

MODES = ("allreduce", "exact", "rank", "auto")
LOSS_WINDOW = 5  # final loss = mean of this many last steps

log = logging.getLogger("finetune_gpt2")


@dataclass
class ModeResult:
    """What one mode's run measured (the same on every rank after the all-reduces)."""

    mode: str
    final_loss: float
    sent_bytes_per_step: float
    allreduce_bytes_per_step: float
    ratio_to_allreduce: float
    seconds_per_step: float
    ranks_identical: bool
    max_abs_diff_vs_allreduce: Optional[float]
    losses: List[float]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per mode")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--rank", type=int, default=4, help="rank of rank-dAD (modes 'rank' and 'auto')")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order")
    p.add_argument("--log-every", type=int, default=5, help="log loss and bytes every N steps")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here (rank 0)")
    args = p.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown}; choose from {MODES}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def build_model(device: torch.device) -> GPT2LMHeadModel:
    """A 2-layer byte-level GPT-2 with tied input/output embeddings."""
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=128, n_embd=128, n_layer=2, n_head=4,
        # No dropout: then dAD "exact" and DDP compute the same thing and can be compared
        # step for step, whatever random numbers each synchroniser draws.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None,  # GPT-2's 50256 lies outside a byte vocabulary
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the loss it would fall back to anyway, minus a warning
    return model.to(device)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters (tied ones once) as one flat vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ring_allreduce_bytes(model: torch.nn.Module, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of every gradient: 2 (S-1)/S x gradient bytes."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return 2.0 * (world_size - 1) / world_size * grad_bytes


def all_mean(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def all_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check_ranks_identical(model: torch.nn.Module) -> bool:
    """True when every rank's parameters equal rank 0's bit for bit."""
    mine = flat_params(model)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    # Compare raw bytes, so that NaNs or -0.0 would not pass or fail by accident.
    raw = [g.view(torch.uint8) for g in gathered]
    return all(torch.equal(raw[0], g) for g in raw[1:])


def run_mode(mode: str, args: argparse.Namespace, init_state: Dict[str, torch.Tensor], data: bytes,
             device: torch.device, reference: Optional[torch.Tensor]) -> tuple[ModeResult, torch.Tensor]:
    """Train ``args.steps`` steps with one synchronisation mode; return its result and weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(device)
    model.load_state_dict(init_state)
    model.train()
    allreduce_bytes = ring_allreduce_bytes(model, world)

    sync = None
    if mode == "allreduce":
        trained: torch.nn.Module = DistributedDataParallel(model)  # broadcasts rank 0's weights
    else:
        # Imported here so that the DDP baseline runs even without the core's synchroniser.
        from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator

        for p in model.parameters():  # start every rank from rank 0's weights, as DDP does
            dist.broadcast(p.data, src=0)
        dad_rank = None if mode == "exact" else args.rank
        sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode=mode, rank=dad_rank))
        trained = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches: Iterator[torch.Tensor] = byte_lm_batches(
        data, args.batch_size, args.seq_len, rank=rank, world_size=world, seed=args.seed)

    losses: List[float] = []
    sent: List[float] = []
    step_times: List[float] = []
    # disable=None: the bar shows on rank 0 only when it writes to a terminal (not in CI logs).
    bar = tqdm(range(args.steps), desc=f"{mode:>9}", disable=None if rank == 0 else True, leave=False)
    for step in bar:
        x = next(batches).to(device)
        start = time.perf_counter()
        loss = trained(input_ids=x, labels=x).loss
        loss.backward()
        if sync is not None:
            sync.synchronize()  # every grad is now the mean over ranks, as DDP gives
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)

        losses.append(loss.item())
        if sync is None:
            sent.append(allreduce_bytes)
        else:
            totals = sync.last_step_report().totals
            sent.append(float(totals["sent_bytes"]))
            if step == 0 and abs(totals["allreduce_bytes"] - allreduce_bytes) > 1e-6 * allreduce_bytes:
                log.warning("%s: report's allreduce_bytes %.0f differs from the ring figure %.0f",
                            mode, totals["allreduce_bytes"], allreduce_bytes)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log.info("%-9s step %3d  loss %.4f  sent %10.0f B/rank  (%.3f x all-reduce)",
                     mode, step + 1, losses[-1], sent[-1], sent[-1] / allreduce_bytes)
    bar.close()
    if sync is not None:
        sync.close()

    weights = flat_params(model).clone()
    identical = check_ranks_identical(model)
    diff = None if reference is None else (weights - reference).abs().max().item()
    # The first step pays one-off costs (allocations, DDP buckets, dAD's verification step).
    timed = step_times[1:] or step_times
    tail = losses[-LOSS_WINDOW:]
    sent_mean = all_mean(sum(sent) / len(sent), device)
    result = ModeResult(
        mode=mode,
        final_loss=all_mean(sum(tail) / len(tail), device),
        sent_bytes_per_step=sent_mean,
        allreduce_bytes_per_step=allreduce_bytes,
        ratio_to_allreduce=sent_mean / allreduce_bytes,
        seconds_per_step=all_max(sum(timed) / len(timed), device),  # the slowest rank sets the pace
        ranks_identical=identical,
        max_abs_diff_vs_allreduce=diff,
        losses=losses,
    )
    log.info("%s: ranks hold bit-identical parameters: %s%s", mode, "yes" if identical else "NO",
             "" if diff is None else f"; max |w - w_allreduce| = {diff:.3g}")
    return result, weights


def summary_table(results: List[ModeResult]) -> str:
    header = (f"{'mode':<10}| {'final loss':>10} | {'bytes sent/step/rank':>20} | {'ratio to all-reduce':>19} "
              f"| {'s/step':>7} | {'ranks identical':>15} | {'max |dw| vs allreduce':>21}")
    lines = [header, "-" * len(header)]
    for r in results:
        diff = "-" if r.max_abs_diff_vs_allreduce is None else f"{r.max_abs_diff_vs_allreduce:.3g}"
        lines.append(f"{r.mode:<10}| {r.final_loss:>10.4f} | {r.sent_bytes_per_step:>20,.0f} | "
                     f"{r.ratio_to_allreduce:>19.3f} | {r.seconds_per_step:>7.3f} | "
                     f"{'yes' if r.ranks_identical else 'NO':>15} | {diff:>21}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    # One thread per process: torchrun starts one process per core, more threads would thrash.
    torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")

    try:
        data = stdlib_source_bytes(seed=args.seed)
        torch.manual_seed(args.seed)
        initial = build_model(torch.device("cpu"))
        init_state = copy.deepcopy(initial.state_dict())
        n_params = sum(p.numel() for p in initial.parameters())
        del initial
        log.info("world size %d, backend %s, %d parameters, %d bytes of stdlib source, "
                 "batch %d x %d bytes per rank, %d steps per mode",
                 world, dist.get_backend(), n_params, len(data), args.batch_size, args.seq_len, args.steps)

        results: List[ModeResult] = []
        reference: Optional[torch.Tensor] = None
        with logging_redirect_tqdm():
            for mode in args.modes:
                result, weights = run_mode(mode, args, init_state, data, device, reference)
                if mode == "allreduce":
                    reference = weights
                results.append(result)

        if rank == 0:
            print("\n" + summary_table(results), flush=True)
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as fh:
                    json.dump({"args": vars(args), "world_size": world,
                               "results": [asdict(r) for r in results]}, fh, indent=2)
                log.info("results written to %s", args.json)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
