"""The per-rank side of `benchmarks.multinode`: every method on one simulated cluster, taking turns.

Started by ``torchrun --nnodes 2`` in each node's namespace (`benchmarks.sim_cluster`). Each method
trains its own copy of the byte-level GPT-2 from the same weights on the same batches
(`benchmarks._ranks.Runner`); before each step the ranks meet at a barrier, then each node's
first rank reads its inter-node interface's byte counter, the step runs, the ranks meet again and
the counter is read again: the difference, summed over the nodes, is the step's inter-node bytes
(less the second barrier's, measured alone at the start). Results go to rank 0, which writes JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks._ranks import EVAL_BATCHES, Runner
from benchmarks.node_bytes import NodeBytes
from benchmarks.workload import Workload, build_model, median
from dad_integrations.comm.counter import CollectiveCounter

DAD_VARIANTS = {"dad-flat": {"topology": "flat"}, "dad-auto": {}}  # both dad-auto's routes and defaults


def _runner(method: str, opts: dict, w: Workload, init_state, data, counter, solo) -> Runner:
    if method in DAD_VARIANTS:
        return Runner("dad-auto", "real", opts, w, init_state, data, counter, solo,
                      config_extra=DAD_VARIANTS[method])
    return Runner(method, "real", opts, w, init_state, data, counter, solo)


def main(spec_path: str) -> None:
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = Workload(**spec["workload"])
    counter = CollectiveCounter(dist)
    solo = [dist.new_group([i]) for i in range(world)][rank]
    data = stdlib_source_bytes(max_bytes=spec.get("data_bytes", 2_000_000), seed=w.seed)
    torch.manual_seed(w.seed)
    init_state = build_model(w).state_dict()
    eval_iter = byte_lm_batches(data, w.batch, w.seq, seed=w.seed, split="eval")
    eval_batches = [next(eval_iter) for _ in range(EVAL_BATCHES)]
    counter_bytes = NodeBytes(dist.new_group(list(range(world))))  # less a barrier's own bytes

    runners = [_runner(m, spec["opts"], w, init_state, data, counter, solo) for m in spec["methods"]]
    inter: Dict[str, List[float]] = {m: [] for m in spec["methods"]}
    for step in range(spec["steps"]):
        order = runners if step % 2 == 0 else runners[::-1]  # no method always first after the others
        for r in order:
            inter[r.method if r.method != "dad-auto" else _name(r)].append(counter_bytes.step(r.step))
    mine: Dict[str, dict] = {}
    for r in runners:
        name = _name(r)
        two = r.sync._exchanger.two_level if r.sync is not None else None
        mine[name] = {"times": r.times, "losses": r.losses, "inter": inter[name], "eval_loss": r.eval_loss(eval_batches),
                      "ef_bytes": r.error_feedback_bytes(), "sent": r.sent,
                      "levels": sorted({(p.level, p.representation) for p in r.last_report.params})
                      if r.last_report is not None else [],
                      "two_level_steps": bool(two is not None and r.sync._exchanger.policy.two_level),
                      "trials": r.trials(), "settled": r.settled()}
        r.close()
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"ranks": gathered, "world": world}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _name(r: Runner) -> str:
    """The method's name in the results (the dAD runners by their variant)."""
    if r.sync is None:
        return r.method
    return "dad-flat" if r.sync.config.topology == "flat" else "dad-auto"


if __name__ == "__main__":
    main(sys.argv[1])
