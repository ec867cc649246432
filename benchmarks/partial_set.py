"""Whole route sets against partial ones: dad-auto on a stated link where the router, weight by
weight, compresses only some weights, against DDP's own all-reduce, 2 gloo ranks on this machine.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.partial_set [--layers 12] [--link 2gbit]
        [--steps 8] [--out FILE]

The model is GPT-2 small's shapes built from its config (``--layers`` of them; 12: 124 M), 1 x 128
tokens a rank, fp32, SGD. The two methods take turns step by step (load from elsewhere falls on
both alike), each after an untimed barrier; a step is forward, backward (the hook's exchange) and
the optimizer. Printed (rank 0) and written as JSON: each method's median step time over the steps
after the first two, their ratio, and dad-auto's routes per step (weights per route) and its last
decision line (`routing.partial_set`: "set: ..." where a partial set was replaced).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def build(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.train()
    return model


def main() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from dad_integrations import DADConfig, register_dad_comm_hook

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--link", default="2gbit", help="the stated link's bandwidth")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    methods = {}
    for name in ("ddp", "dad-auto"):
        model = build(args.layers)
        group = dist.new_group(list(range(dist.get_world_size())))
        ddp = DistributedDataParallel(model, process_group=group)
        sync = None
        if name == "ddp":
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
        else:
            sync = register_dad_comm_hook(ddp, DADConfig.from_dict(
                {"mode": "auto", "rank": 4, "lossless_steps": 0, "link": {"bandwidth": args.link, "latency_us": 100}}))
        methods[name] = (ddp, sync, torch.optim.SGD(model.parameters(), lr=1e-4), [])
    gen = torch.Generator().manual_seed(rank)
    routes, decisions = [], []
    for step in range(args.steps):
        ids = torch.randint(0, 50257, (1, 128), generator=gen)
        for name, (ddp, sync, opt, times) in methods.items():
            dist.barrier()
            start = time.perf_counter()
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            if sync is not None:
                report = sync.last_step_report()
                routes.append(dict(Counter(p.representation for p in report.params if p.representation != "overhead")))
                decisions.append(report.decision)
    med = {name: statistics.median(m[3][2:]) for name, m in methods.items()}
    out = {"layers": args.layers, "link": args.link, "median_s": med, "ratio": med["dad-auto"] / med["ddp"],
           "routes": routes, "decision": decisions[-1], "times": {n: m[3] for n, m in methods.items()}}
    if rank == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
