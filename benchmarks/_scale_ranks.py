"""The rank side of `benchmarks.scale`: models built from configs (GPT-2 small, a 4-layer
TinyLlama-shaped Llama, or their tiny widths), each method of them (`benchmarks._scale_engines`:
DDP, FSDP2, ZeRO-3, with and without dAD), 2 gloo ranks.

Per model, two phases in the ranks' own processes:

1. memory: each method of a group of several alone (everything of the previous one freed first):
   build, attach, ``mem_steps`` steps; the process' peak RSS (VmHWM, reset before the build) is the
   method's. Skipped where ``mem_steps`` is 0.
2. timing: the groups one after the other; the methods of a group alive together and taking turns
   step by step, so that load from elsewhere falls on all of them alike. A method alone in its group
   reads its peak RSS here (it needs no phase 1). Every DDP method has its own process group, and
   the ranks meet at an untimed barrier on a group of their own before every step (as
   `benchmarks._ranks`).

Per method and step: the step's time, the bytes one rank sent and, for dAD, the routes (weights per
representation).
"""
from __future__ import annotations

import gc
import json
import logging
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks._scale_engines import METHODS, Method, preload
from benchmarks.workload import current_rss_mb, gloo_rank, median, peak_memory_mb, reset_peak_memory
from dad_integrations.comm.counter import CollectiveCounter

__all__ = ["METHODS", "rank_main"]


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    """One rank (``torch.multiprocessing.spawn``): every model of ``spec["runs"]``; rank 0 writes JSON."""
    # DeepSpeed reads these, and its accelerator before its import
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    if rank != 0:
        logging.getLogger("dad_integrations").setLevel(logging.ERROR)
    gloo_rank(rank, world, port, spec.get("timeout_s", 900), lambda: _run_all(spec))
    # End without interpreter finalisation: FSDP2 (its DTensors) and DeepSpeed ZeRO keep the gloo group
    # alive in C++ past destroy_process_group, and freeing it while Python is torn down once in a while
    # aborts the process after its work is done (as `benchmarks.sharded_memory`). The results are on disk.
    logging.shutdown()
    os._exit(0)


def _run_all(spec: dict) -> None:
    from dad_examples.text_data import stdlib_source_bytes

    data = stdlib_source_bytes(max_bytes=spec.get("data_bytes", 1_000_000), seed=spec["seed"])
    preload([m for run in spec["runs"] for g in run["groups"] for m in g["methods"]])
    # the modules' objects are kept for good: collections between methods (the previous method freed
    # first) then scan only what the methods made, not the hundreds of thousands imports made
    gc.collect()
    gc.freeze()
    counter = CollectiveCounter(dist)
    turns = dist.new_group(list(range(dist.get_world_size())))
    results = {}
    for run in spec["runs"]:
        results[run["name"]] = _run_model(dict(spec, **run), data, counter, turns)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as fh:
            json.dump(results, fh)
    dist.barrier()


def _run_model(spec: dict, data: bytes, counter: CollectiveCounter, turns) -> Dict[str, dict]:
    """Both phases for one model; every rank's results, gathered: ``{rank: {method: record}}``."""
    cpu = torch.device("cpu")
    groups: List[dict] = spec["groups"]  # {"methods": [...], "steps": n}
    mine: Dict[str, dict] = {m: {} for g in groups for m in g["methods"]}

    # 1. memory: each method of a group of several alone
    if spec["mem_steps"]:
        for name in (m for g in groups if len(g["methods"]) > 1 for m in g["methods"]):
            gc.collect()
            base = current_rss_mb()
            reset_peak_memory(cpu)
            m = Method(name, spec, data, counter)
            for _ in range(spec["mem_steps"]):
                dist.barrier(group=turns)
                m.step()
            mine[name].update(peak_rss_mb=peak_memory_mb(cpu), rss_before_mb=base, attach_alone_s=m.attach_s,
                              mem_times=list(m.times))
            m.close()
            del m
            gc.collect()
            dist.barrier()

    # 2. timing: the groups in turn, the methods of one taking turns step by step
    for group in groups:
        gc.collect()
        base = current_rss_mb()
        reset_peak_memory(cpu)
        live = [Method(name, spec, data, counter) for name in group["methods"]]
        for _ in range(group["steps"]):
            for m in live:
                dist.barrier(group=turns)  # untimed: both ranks free of the previous method's step
                m.step()
        for m in live:
            mine[m.name].update(m.summary(), group=group["methods"], step_s_median=median(m.times))
            if len(live) == 1:  # alone: the process' peak is the method's
                mine[m.name].update(peak_rss_mb=peak_memory_mb(cpu), rss_before_mb=base, attach_alone_s=m.attach_s)
            m.close()
        del live
        gc.collect()
        dist.barrier()

    gathered: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {str(i): g for i, g in enumerate(gathered)}
