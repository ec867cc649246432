"""Fine-tune a small Llama (built from a ``LlamaConfig``, nothing downloaded) with DeepSpeed ZeRO-3 across
nodes, dAD switched on by the "dad" block of ``ds_config_zero3_multinode.json``.

On a real cluster, per node (DeepSpeed's own launcher reaches remote nodes over ssh; torchrun sets
the same node variables, which dAD reads to find the topology):

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        examples/deepspeed/llama_multinode.py --deepspeed_config examples/deepspeed/ds_config_zero3_multinode.json

On the simulated 2-node cluster of this repository (two network namespaces, CPU, as root), this model
and config with and without dAD, trained side by side and taking turns step by step
(`benchmarks/_zero3_ranks.py`):

    python -m benchmarks.multinode --zero3 --steps 20 --rates 1gbit

Across nodes ZeRO-3 reduce-scatters every gradient over all ranks; dAD sends the weights its router
gives a compressed route in three hops (`dad_integrations.exchange.node_partitions`): reduce to the
weight's owner inside the node, PowerSGD's or rank-dAD's factors (or exact factors) between the
owners of the nodes only, each rank's partition scattered back inside the node. The config also
sets hpZ (``zero_hpz_partition_size`` = ranks per node): backward's parameter all-gather then stays
inside the node, so what crosses nodes in backward is the gradient reduction alone.

Per step it logs the loss and, where the inter-node interface is known (``GLOO_SOCKET_IFNAME``, as on
the simulated cluster), the bytes that crossed between nodes in forward and in backward (each node's
first rank reads its interface's counter between barriers). ``--no-dad`` runs DeepSpeed's own
reduction on the same data; ``--json`` writes every step's figures (rank 0).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import time

import torch
import torch.distributed as tdist
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed
import deepspeed_dad
from dad_examples.text_data import VOCAB_SIZE, byte_lm_batches, stdlib_source_bytes

log = logging.getLogger("llama_multinode")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--no-dad", action="store_true", help="ignore the 'dad' block: DeepSpeed's own reduction")
    p.add_argument("--json", metavar="PATH", help="write every step's figures here (rank 0)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.add_config_arguments(p)
    args = p.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "ds_config_zero3_multinode.json")
    return args


def build_model(hidden: int, layers: int) -> LlamaForCausalLM:
    """A byte-level Llama: vocabulary 256, ``layers`` blocks of width ``hidden``, SwiGLU 8/3 wide."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=max(1, hidden // 64), intermediate_size=hidden * 8 // 3,
                                        max_position_embeddings=512, tie_word_embeddings=False))


def inter_node_tx() -> int:
    """Bytes this node has sent over its inter-node interface (0 where unknown)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, TypeError):
        return 0


def node_bytes(since: int) -> float:
    """Every node's bytes since ``since`` (read by each node's first rank), summed; a barrier first."""
    tdist.barrier()
    mine = torch.tensor([float(inter_node_tx() - since) if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 0.0],
                        dtype=torch.float64)
    tdist.all_reduce(mine)
    return float(mine)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.no_dad:
        config.pop("dad", None)
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                  * tdist.get_world_size())
    model = build_model(args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    init = deepspeed_dad.initialize if not args.no_dad else deepspeed.initialize
    engine, *_ = init(model=model, optimizer=optimizer, config=config)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    batches = byte_lm_batches(stdlib_source_bytes(max_bytes=1_000_000), config["train_micro_batch_size_per_gpu"],
                              args.seq_len, rank=rank, world_size=world)
    steps = []
    for step in range(args.steps):
        x = next(batches)
        tdist.barrier()
        t0, tx0 = time.perf_counter(), inter_node_tx()
        loss = engine(input_ids=x, labels=x).loss
        fwd = node_bytes(tx0)
        tx1 = inter_node_tx()
        engine.backward(loss)
        bwd = node_bytes(tx1)
        engine.step()
        tdist.barrier()
        seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        tdist.all_reduce(seconds, op=tdist.ReduceOp.MAX)
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
        tdist.all_reduce(peak, op=tdist.ReduceOp.MAX)
        steps.append({"loss": float(loss.detach()), "step_s": float(seconds), "forward_inter_bytes": fwd,
                      "backward_inter_bytes": bwd, "peak_rss_bytes": float(peak)})
        if rank == 0:
            log.info("step %d: loss %.4f, %.0f ms, between nodes %.2f MB forward, %.2f MB backward", step,
                     steps[-1]["loss"], 1e3 * steps[-1]["step_s"], fwd / 1e6, bwd / 1e6)
    att = deepspeed_dad.get_attachment(engine)
    if rank == 0 and args.json:
        report = att.last_step_report() if att is not None else None
        with open(args.json, "w") as f:
            json.dump({"dad": not args.no_dad, "world": world, "steps": steps,
                       "routes": report.by_representation() if report is not None else None}, f, indent=1)
    tdist.barrier()
    os._exit(0)  # gloo's threads may abort the interpreter's finalisation now and then


if __name__ == "__main__":
    main()
