"""The rank side of `benchmarks.scale`: one model (GPT-2 small or a 4-layer TinyLlama-shaped
Llama, built from configs), every method on it, 2 gloo ranks.

Two phases, in the ranks' own processes (started afresh for each model, so nothing of one model
is alive during the next):

1. memory: each method alone (everything of the previous one freed first): build, attach,
   ``mem_steps`` steps; the process' peak RSS (VmHWM, reset before the build) is the method's.
2. timing: methods alive in groups of at most ``together`` (the ranks' memory), the methods of
   a group taking turns step by step, so that load from elsewhere falls on all of them alike.
   With ``together`` 1 each method runs alone, its peak RSS is read here, and phase 1 is skipped.
   Every method has its own process group, and the ranks meet at an untimed barrier on a group
   of their own before every step (as `benchmarks._ranks`).

Per method and step: the step's time (forward, backward, synchronisation, SGD), the bytes one
rank sent (dAD: `last_step_report()`; DDP's hooks: counted at ``torch.distributed``, ring model,
as `benchmarks.compare` counts them) and, for dAD, the routes (weights per representation).
The optimizer is plain SGD: it holds no state, so that two methods of the 307 M model fit on
two ranks beside other jobs (AdamW would add 2.5 GB per method and rank).
"""
from __future__ import annotations

import gc
import json
import time
from collections import Counter
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.workload import current_rss_mb, gloo_rank, lm_step, median, peak_memory_mb, reset_peak_memory
from dad_integrations.comm.counter import CollectiveCounter

METHODS = ("allreduce", "dad-auto", "powersgd", "dad-auto-100mbit")  # in pairs: the first two take turns
STATED_LINK = {"bandwidth": "100mbit", "latency_us": 100}
DDP_DEFAULT_BUCKET_MB = 25  # DDP's own default: all-reduce and dad-auto meet DDP as users do


def build_model(spec: dict) -> torch.nn.Module:
    """The model of ``spec["model"]`` from its config (``kind`` gpt2 or llama), dropout off,
    weights from ``spec["seed"]`` (every method and rank builds the same weights)."""
    m = spec["model"]
    torch.manual_seed(spec["seed"])
    if m["kind"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(**m["config"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    elif m["kind"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**m["config"]))
    else:
        raise ValueError(f"unknown model kind {m['kind']!r}: gpt2 or llama")
    model.loss_type = "ForCausalLM"
    model.train()
    return model


def powersgd_bytes(shape: tuple, allreduce_bytes: float, rank: int) -> float:
    """What PyTorch's PowerSGD hook sends for one weight, in the ring model that prices its
    all-reduce at ``allreduce_bytes``: vectors all-reduced whole; a matrix (viewed as
    ``shape[0] x rest``) as P and Q, ``(n + m) r`` values, where that is under half of ``n m``
    (the hook's ``_should_compress`` with its default ``min_compression_rate`` 2), else whole."""
    if len(shape) <= 1:
        return allreduce_bytes
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    compressed = (n + m) * rank
    return allreduce_bytes * compressed / (n * m) if compressed * 2 < n * m else allreduce_bytes


class Method:
    """One method's model, DDP wrapper, hook and batches; `step()` trains and times one step."""

    def __init__(self, name: str, spec: dict, data: bytes, counter: CollectiveCounter):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        from dad_examples.text_data import byte_lm_batches
        from dad_integrations import DADConfig, register_dad_comm_hook

        self.name, self.counter, self.rank_r = name, counter, spec["rank"]
        world = dist.get_world_size()
        model = build_model(spec)
        self.n_params = sum(p.numel() for p in model.parameters())
        # one bucket for PowerSGD's hook (several hang on gloo: the guide's PowerSGD/gloo fact) and
        # for the dAD run compared with it byte for byte; DDP's default buckets for the others
        one = name in ("powersgd", "dad-auto-100mbit")
        bucket_mb = self.n_params * 4 / 2 ** 20 + 1 if one else DDP_DEFAULT_BUCKET_MB
        group = dist.new_group(list(range(world)))  # a group of its own, on every rank in the same order
        start = time.perf_counter()
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
        self.wrap_s = time.perf_counter() - start
        self.sync = None
        start = time.perf_counter()
        if name == "allreduce":
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
        elif name == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=spec["rank"],
                start_powerSGD_iter=spec["powersgd_warmup"], use_error_feedback=True, warm_start=True,
                random_seed=spec["seed"])
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif name == "dad-auto":
            self.sync = register_dad_comm_hook(ddp, DADConfig.from_dict({"mode": "auto"}))
        elif name == "dad-auto-100mbit":
            self.sync = register_dad_comm_hook(ddp, DADConfig.from_dict(
                {"mode": "auto", "rank": spec["rank"], "link": STATED_LINK}))
        else:
            raise ValueError(f"unknown method {name!r}: one of {METHODS}")
        self.attach_s = time.perf_counter() - start
        self.bucket_mb = bucket_mb
        self.model, self.ddp = model, ddp
        self.opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        self.losses: List[float] = []
        self._train = lm_step(ddp, self.opt, losses=self.losses)  # DDP's hook synchronises in backward
        self.batches = byte_lm_batches(data, spec["batch"], spec["seq"], rank=dist.get_rank(), world_size=world,
                                       seed=spec["seed"])
        self.times: List[float] = []
        self.sent: List[float] = []
        self.routes: List[Dict[str, int]] = []
        self.report = None

    def step(self) -> None:
        x = next(self.batches)
        self.counter.reset()
        with self.counter:
            start = time.perf_counter()
            self._train(x)
            self.times.append(time.perf_counter() - start)
        if self.sync is not None:
            self.report = self.sync.last_step_report()
            self.sent.append(self.report.totals["sent_bytes"])
            self.routes.append(dict(Counter(p.representation for p in self.report.params)))
        else:
            self.sent.append(self.counter.traffic().sent)

    def summary(self) -> dict:
        out = {"attach_s": self.attach_s, "ddp_wrap_s": self.wrap_s, "bucket_mb": self.bucket_mb,
               "n_params": self.n_params, "times": self.times, "sent_by_step": self.sent, "losses": self.losses}
        if self.sync is not None:
            out["routes_by_step"] = self.routes
            out["decision"] = self.report.decision if self.report is not None else ""
            out["links"] = dict(self.report.links) if self.report is not None else {}
            out["trials"] = [{"step": t.step, "pairs": t.pairs} for t in self.sync.route_trials]
            if self.report is not None:
                out["weights"] = [{"name": p.name, "shape": list(p.shape), "representation": p.representation,
                                   "sent": p.sent_bytes, "allreduce": p.allreduce_bytes,
                                   "powersgd": powersgd_bytes(tuple(p.shape), p.allreduce_bytes, self.rank_r)}
                                  for p in self.report.params]
        return out

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.sync = self.ddp = self.model = self.opt = self.report = None


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    gloo_rank(rank, world, port, spec.get("timeout_s", 900), lambda: _run(spec))


def _groups(methods: List[str], together: int) -> List[List[str]]:
    return [methods[i:i + together] for i in range(0, len(methods), together)]


def _run(spec: dict) -> None:
    from dad_examples.text_data import stdlib_source_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    counter = CollectiveCounter(dist)
    data = stdlib_source_bytes(max_bytes=spec.get("data_bytes", 1_000_000), seed=spec["seed"])
    cpu = torch.device("cpu")
    mine: Dict[str, dict] = {m: {} for m in spec["methods"]}
    turns = dist.new_group(list(range(world)))

    # 1. memory: one method alive at a time (with ``together`` 1 the timing phase reads it instead)
    if spec["mem_steps"] and spec["together"] > 1:
        for name in spec["methods"]:
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

    # 2. timing: groups of at most `together` methods, taking turns step by step
    solo = spec["together"] == 1
    for group in _groups(spec["methods"], spec["together"]):
        gc.collect()
        base = current_rss_mb()
        reset_peak_memory(cpu)
        live = [Method(name, spec, data, counter) for name in group]
        for _ in range(spec["steps"]):
            for m in live:
                dist.barrier(group=turns)  # untimed: both ranks free of the previous method's step
                m.step()
        for m in live:
            mine[m.name].update(m.summary(), group=group, step_s_median=median(m.times))
            if solo:  # alone: the process' peak is the method's
                mine[m.name].update(peak_rss_mb=peak_memory_mb(cpu), rss_before_mb=base, attach_alone_s=m.attach_s)
            m.close()
        del live
        gc.collect()
        dist.barrier()

    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump({str(i): g for i, g in enumerate(gathered)}, fh)
    dist.barrier()
