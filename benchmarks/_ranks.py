"""The per-rank side of `benchmarks.compare`: one phase (one network condition) of every method.

Each rank builds one model per method from the same initial weights and trains it on the same
batches; methods take turns in rounds of a few steps, so that the load of a shared machine falls
on all of them alike. Each method has its own process group, and the ranks meet at a barrier
(untimed) before every step, so that no method's step or route trial is charged for another's.
Results go to rank 0, which writes them as JSON.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.atomo import AtomoState, atomo_hook
from benchmarks.workload import (NullAggregator, Workload, build_model, current_rss_mb, gloo_rank, lower_quartile,
                                 median, peak_memory_mb, reset_peak_memory)
from dad_integrations.comm.counter import CollectiveCounter

DDP_METHODS = ("allreduce", "fp16", "powersgd", "atomo")
DAD_METHODS = ("dad-exact", "dad-rank", "dad-auto", "dad-auto-fp16", "dad-auto-bytes")
METHODS = DDP_METHODS + DAD_METHODS
EVAL_BATCHES = 4
DDP_BUCKET_MB = 25


def dad_config(method: str, rank: int, error_feedback: bool, link: Optional[dict] = None) -> dict:
    """The method's config: the mode and rank, every other key at the config's defaults (error
    feedback on, objective "time" for dad-auto), except error feedback where
    ``--dad-no-error-feedback`` turns it off; dad-auto-fp16 is dad-auto with fp16 on the wire (what
    a user who accepts fp16 compression sets: ``wire_dtype``); dad-auto-bytes is auto by bytes.
    ``link`` states dad-auto's link (its communication-free variant routes by the real run's
    measured one)."""
    if method == "dad-exact":
        return {"mode": "exact"}
    extra = {} if error_feedback else {"error_feedback": False}
    if method in ("dad-auto", "dad-auto-fp16"):
        extra["objective"] = "time"
        if link is not None:
            extra["link"] = link
        if method == "dad-auto-fp16":
            extra["wire_dtype"] = "float16"
    else:
        extra["objective"] = "bytes"
    return {"mode": "rank" if method == "dad-rank" else "auto", "rank": rank, **extra}


class Runner:
    """One method's model, optimizer and batches; `step()` trains one step and times it."""

    def __init__(self, method: str, variant: str, opts: dict, w: Workload, init_state, data: bytes,
                 counter: CollectiveCounter, solo_group, link: Optional[dict] = None,
                 config_extra: Optional[dict] = None):
        from dad_examples.text_data import byte_lm_batches

        self.method, self.variant, self.counter = method, variant, counter
        rank, world = dist.get_rank(), dist.get_world_size()
        model = build_model(w)
        model.load_state_dict(init_state)
        model.train()
        self.model, self.fwd, self.sync, self.hook_state = model, model, None, None
        if method in DDP_METHODS and variant != "local":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

            # a group of its own (every rank builds the runners in the same order): no method's
            # collectives share a group with another's
            group = dist.new_group(list(range(world))) if variant == "real" else solo_group
            # bucket_cap_mb given explicitly, so that the first bucket is 25 MB too (not 1 MB): the
            # benchmark's models fit one bucket. PowerSGD's hook issues collectives from future
            # callbacks; with several buckets on gloo those can reach the ranks' queues in different
            # orders and abort the job (seen here), so every DDP method gets the same single bucket.
            ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=DDP_BUCKET_MB)
            pg = group if group is not None else dist.group.WORLD
            if method == "allreduce":
                ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
            elif method == "fp16":
                ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
            elif method == "powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=pg, matrix_approximation_rank=opts["rank"],
                    start_powerSGD_iter=opts.get("powersgd_warmup", 2),
                    use_error_feedback=True, warm_start=True, random_seed=w.seed)
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
                self.hook_state = state
            else:
                ddp.register_comm_hook(AtomoState(pg, budget=opts["rank"], seed=w.seed), atomo_hook)
            self.fwd = ddp
        elif method in DAD_METHODS and variant == "real":
            from dad_integrations import DADConfig, register_dad_comm_hook

            # as users meet it through Accelerate and the Trainer: DDP's communication hook (on a
            # group of its own, made by the hook), DDP's buckets as the other methods have them
            ddp = DistributedDataParallel(model, process_group=dist.new_group(list(range(world))),
                                          bucket_cap_mb=DDP_BUCKET_MB)
            config = dad_config(method, opts["rank"], opts["dad_error_feedback"], link)
            self.sync = register_dad_comm_hook(ddp, DADConfig.from_dict({**config, **(config_extra or {})}))
            self.fwd = ddp
        elif method in DAD_METHODS and variant != "local":
            from dad_integrations import DADConfig, DADSynchronizer

            # every computation of a step, nothing on a wire (`workload.NullAggregator`)
            self.sync = DADSynchronizer(model, NullAggregator(rank, world), DADConfig.from_dict(
                dad_config(method, opts["rank"], opts["dad_error_feedback"], link)))
        self.opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
        self.batches = byte_lm_batches(data, w.batch, w.seq, rank=rank, world_size=world, seed=w.seed)
        self.times: List[float] = []
        self.losses: List[float] = []
        self.sent: List[float] = []
        self.received: List[float] = []
        self.counted: List[float] = []
        self.last_report = None

    def trials(self) -> List[dict]:
        """dAD's route trials so far (`route_trial.TrialOutcome` as dicts); empty for the others."""
        if self.sync is None:
            return []
        return [dataclasses.asdict(t) for t in self.sync.route_trials]

    def settled(self) -> int:
        """The first step after dAD's last route trial was decided (0: none ran)."""
        trials = self.sync.route_trials if self.sync is not None else []
        return max((t.step + 2 * t.pairs + 1 for t in trials), default=0)

    def step(self) -> None:
        x = next(self.batches)
        self.counter.reset()
        # only real steps are counted: the others' collectives (on a one-rank group) move nothing
        with self.counter if self.variant == "real" else contextlib.nullcontext():
            start = time.perf_counter()
            loss = self.fwd(input_ids=x, labels=x).loss
            loss.backward()
            if self.sync is not None and self.fwd is self.model:  # (DDP's hook: synchronised in backward)
                self.sync.synchronize()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.times.append(time.perf_counter() - start)
        counted = self.counter.traffic()
        self.losses.append(float(loss.detach()))
        self.counted.append(counted.sent)
        if self.sync is not None:
            report = self.sync.last_step_report()
            self.sent.append(report.totals["sent_bytes"])
            self.received.append(report.totals["received_bytes"])
            self.last_report = report
        else:
            self.sent.append(counted.sent)
            self.received.append(counted.received)

    def error_feedback_bytes(self) -> int:
        """Bytes of error-feedback residuals this rank holds (dAD's, or PowerSGD's hook's)."""
        if self.sync is not None:
            memory = self.sync._exchanger.state.memory
            held = [memory.dense(u.name) for u in self.sync.units]
            return sum(t.numel() * t.element_size() for t in held if t is not None)
        if self.hook_state is not None:
            return sum(t.numel() * t.element_size() for t in self.hook_state.error_dict.values())
        return 0

    @torch.no_grad()
    def eval_loss(self, batches: List[torch.Tensor]) -> float:
        self.model.eval()
        loss = sum(float(self.model(input_ids=x, labels=x).loss) for x in batches) / len(batches)
        self.model.train()
        return loss

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.sync = self.fwd = self.model = self.opt = None


def link_check(nbytes: int = 1 << 20, reps: int = 2) -> float:
    """Measured all-gather rate, bytes per second per rank (both ranks send at once)."""
    t = torch.zeros(nbytes // 4)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_gather(out, t)
    return nbytes * reps / (time.perf_counter() - start)


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    gloo_rank(rank, world, port, spec.get("timeout_s", 600), lambda: _run_phase(spec))


def _run_phase(spec: dict) -> None:
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    w = Workload(**spec["workload"])
    opts = spec["opts"]
    device = torch.device("cpu")
    counter = CollectiveCounter(dist)  # installed for each counted step
    solo_groups = [dist.new_group([i]) for i in range(world)]
    solo = solo_groups[rank]
    data = stdlib_source_bytes(max_bytes=spec.get("data_bytes", 2_000_000), seed=w.seed)
    torch.manual_seed(w.seed)
    init_state = build_model(w).state_dict()
    eval_iter = byte_lm_batches(data, w.batch, w.seq, seed=w.seed, split="eval")
    eval_batches = [next(eval_iter) for _ in range(EVAL_BATCHES)]
    methods: List[str] = spec["methods"]
    out: Dict[str, dict] = {"net": spec["net"], "rank_results": {}}
    mine: Dict[str, dict] = {}

    out["link_bytes_per_s"] = link_check()

    # 1. peak memory, one method at a time (everything of the previous one freed first)
    if spec.get("mem_steps"):
        for method in ["local"] + methods:
            gc.collect()
            base = current_rss_mb()
            reset_peak_memory(device)
            r = Runner(method, "local" if method == "local" else "real", opts, w, init_state, data, counter,
                       solo)
            for _ in range(spec["mem_steps"]):
                r.step()
            mine.setdefault(method, {})["peak_mem_mb"] = peak_memory_mb(device)
            mine[method]["rss_before_mb"] = base
            r.close()
            del r
            gc.collect()
            dist.barrier()

    # 2. timing: methods take turns in rounds; "local" (no communication) and, where asked,
    #    each method's communication-free variant (compute overhead) run alongside
    runners: List[Runner] = [Runner("local", "local", opts, w, init_state, data, counter, solo)]
    targets = [spec["local_steps"]]
    for method in methods:
        real = Runner(method, "real", opts, w, init_state, data, counter, solo)
        runners.append(real)
        targets.append(spec["steps"])
        if spec.get("nocomm_steps"):
            # routed by time, the variant without communication takes the real run's routes: its link
            timing = real.sync.timing if real.sync is not None else None
            link = timing.link.to_spec() if timing is not None else None
            runners.append(Runner(method, "nocomm", opts, w, init_state, data, counter, solo, link))
            targets.append(spec["nocomm_steps"])
    # round i takes each runner to round(i * total / rounds) steps: the runners' steps are spread
    # evenly over the run, so a burst of load from elsewhere falls on all of them alike
    # Before each step the ranks meet (untimed, on a group of their own): the step, and any route
    # trial's clock in it, starts with both ranks free of the previous method's work.
    turns = dist.new_group(list(range(world)))
    rounds = spec["rounds"]
    for rnd in range(1, rounds + 1):
        for r, total in zip(runners, targets):
            while len(r.times) < (rnd * total) // rounds:
                dist.barrier(group=turns)
                r.step()
    # steady state: after the warm-up and after every dAD runner's last route trial (agreed, so the
    # same on every rank), for every method alike
    warm = max([spec["warmup"]] + [r.settled() for r in runners])
    out["warm_steps"] = warm
    for r in runners:
        key = r.method if r.variant != "nocomm" else f"{r.method}:nocomm"
        rec = mine.setdefault(key, {})
        timed = r.times[warm:] or r.times
        rec.update(step_s=median(timed), step_lq_s=lower_quartile(timed), times=r.times, losses=r.losses)
        if r.variant == "real":
            counted = r.sent[warm:] or r.sent
            rec.update(sent_per_step=sum(counted) / len(counted),
                       received_per_step=sum(r.received[warm:] or r.received) / len(counted),
                       counted_per_step=sum(r.counted[warm:] or r.counted) / len(counted),
                       sent_by_step=r.sent, eval_loss=r.eval_loss(eval_batches))
            if r.sync is not None and r.sync.timing is not None:
                rec["link"] = r.sync.timing.link.describe()
            rec["trials"] = r.trials()
            if r.last_report is not None:
                rec["report"] = [{"name": p.name, "representation": p.representation, "sent": p.sent_bytes,
                                  "allreduce": p.allreduce_bytes, "rows": p.rows, "method": p.method}
                                 for p in r.last_report.params]
        if r.method == "local":
            rec["eval_loss"] = r.eval_loss(eval_batches)
        r.close()
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        out["rank_results"] = {str(i): g for i, g in enumerate(gathered)}
        with open(spec["out"], "w") as fh:
            json.dump(out, fh)
    dist.barrier()
