"""The per-rank side of `benchmarks.convergence`: train every method on one workload, every seed.

Each rank builds one model per method from the same initial weights and feeds all of them the
same batch at every step: the methods take turns step by step (step t of every method, then step
t + 1 of every method, ...), so a burst of load from elsewhere on a shared machine falls on all of
them alike and no method sees a quieter machine than another.

Bytes are counted where they leave the process: a `CollectiveCounter` wraps the functions of
``torch.distributed`` for the duration of one method's step, so it sees exactly that method's
collectives (DDP's communication hooks, PowerSGD's chained all-reduces, dAD's all-gathers on its
worker thread) and nothing of the other methods, which run before or after. DDP's plain all-reduce
goes through C++ and would be invisible to such a counter, so the ``allreduce`` method registers
PyTorch's ``allreduce_hook`` (the same fp32 sum-then-divide as DDP's default, issued from Python).

Every DDP method gets exactly one bucket: PyTorch's PowerSGD hook chains collectives from future
callbacks, and with several buckets on gloo those can reach the ranks' queues in different orders
and hang or abort the job, so the bucket cap is set far above the models' sizes for all of them.

Results go to rank 0, which writes them as JSON (one file per workload).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:  # imported where used: the launching process needs none of dad_integrations
    from dad_integrations.comm.counter import CollectiveCounter

log = logging.getLogger("benchmarks.convergence")

#: DDP bucket cap (MB), far above every model here: one bucket (see the module docstring)
DDP_BUCKET_MB = 256
#: steps left out of the bytes/step mean (PowerSGD compresses from step 2; dAD verifies step 1)
BYTES_WARMUP = 3
DDP_METHODS = ("allreduce", "fp16", "powersgd")
#: the dAD methods known by name: their config keys (the rank is added from the workload)
DAD_METHODS: Dict[str, dict] = {
    "dad-auto": {"mode": "auto"},
    "dad-rank": {"mode": "rank"},
    "dad-exact": {"mode": "exact"},
}
MLP_WORKLOADS = {"mlp-adam": "adam", "mlp-sgd": "sgd"}
GPT2_WORKLOADS = {"gpt2": "adamw", "gpt2-sgd": "sgd"}
WORKLOADS = tuple(MLP_WORKLOADS) + tuple(GPT2_WORKLOADS)
#: PowerSGD's settings here (PowerSGDState's keys); a ``--powersgd-variant`` overrides some of them
POWERSGD_DEFAULTS = {"start_powerSGD_iter": 2, "use_error_feedback": True, "warm_start": True}
#: SGD's momentum for every SGD workload
SGD_MOMENTUM = 0.9


def dad_method_config(method: str, rank: int, extra: Optional[dict] = None,
                      variants: Optional[Dict[str, dict]] = None) -> dict:
    """The `DADConfig` keys of a dAD method: its own keys, then ``extra``; ``rank`` is added
    unless the method is exact dAD or sets its own. Keys not named keep the config's defaults."""
    base = dict((variants or {}).get(method) or DAD_METHODS[method])
    cfg = {**base, **(extra or {})}
    if cfg.get("mode", "auto") != "exact":
        cfg.setdefault("rank", rank)
    return cfg


def is_dad(method: str, variants: Optional[Dict[str, dict]] = None) -> bool:
    return method in DAD_METHODS or method in (variants or {})


def powersgd_method_config(method: str, rank: int, variants: Optional[Dict[str, dict]] = None) -> dict:
    """`PowerSGDState` keys of ``powersgd`` or a PowerSGD variant: `POWERSGD_DEFAULTS`, the
    variant's keys, and the workload's rank unless the variant sets its own."""
    cfg = dict(POWERSGD_DEFAULTS, matrix_approximation_rank=rank)
    cfg.update((variants or {}).get(method) or {})
    return cfg


# -- workloads ---------------------------------------------------------------------------------

class Task:
    """One workload: its model, optimizer, this rank's batches and the held-out evaluation."""

    metric_name = ""
    steps = 0
    eval_steps: List[int] = []

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def optimizer(self, params) -> torch.optim.Optimizer:
        raise NotImplementedError

    def batches(self) -> Iterator[Any]:
        raise NotImplementedError

    def loss(self, fwd: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> Dict[str, float]:
        """Held-out numbers of ``model`` (every rank calls it; collectives outside any counter)."""
        raise NotImplementedError


def digits_data() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits: a fixed stratified 80/20 split (random_state 0), features
    standardised with the train split's mean and std. Returns (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, std = xtr.mean(0), xtr.std(0)
    std[std == 0] = 1.0  # constant pixels (always blank in the corners)
    as_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    return as_x(xtr), torch.tensor(ytr), as_x(xte), torch.tensor(yte)


class DigitsMLP(Task):
    """MLP 64-256-256-10 (ReLU) on the digits; rank ``r`` takes its own disjoint slice of every
    global batch of ``world * batch`` rows, drawn from a per-epoch shuffle every rank shares."""

    metric_name = "test_acc"

    def __init__(self, settings: dict, seed: int, rank: int, world: int):
        self.s, self.seed, self.rank, self.world = settings, seed, rank, world
        self.xtr, self.ytr, self.xte, self.yte = digits_data()
        self.per_epoch = len(self.xtr) // (world * settings["batch"])
        self.steps = settings.get("steps") or settings["epochs"] * self.per_epoch
        every = settings.get("eval_every") or self.per_epoch
        self.eval_steps = sorted(set(range(0, self.steps, every)) | {self.steps})

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def optimizer(self, params) -> torch.optim.Optimizer:
        if self.s["optimizer"] == "adam":
            return torch.optim.Adam(params, lr=self.s["lr"])
        return torch.optim.SGD(params, lr=self.s["lr"], momentum=SGD_MOMENTUM)

    def batches(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)  # same on every rank: one shared shuffle
        b, gb = self.s["batch"], self.s["batch"] * self.world
        while True:
            perm = torch.randperm(len(self.xtr), generator=gen)
            for i in range(self.per_epoch):
                idx = perm[i * gb + self.rank * b: i * gb + (self.rank + 1) * b]
                yield self.xtr[idx], self.ytr[idx]

    def loss(self, fwd: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(fwd(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Dict[str, float]:
        logits = model(self.xte)  # 360 rows: every rank evaluates all of them, no collective
        return {"loss": float(F.cross_entropy(logits, self.yte)),
                "acc": float((logits.argmax(1) == self.yte).float().mean()) * 100.0}


def gpt2_rank_batch(settings: dict, world: int) -> int:
    """Sequences per rank and step: ``model.batch`` where set, else ``global_batch / world``."""
    batch = settings["model"].get("batch")
    if batch:
        return int(batch)
    if settings["global_batch"] % world:
        raise ValueError(f"global batch {settings['global_batch']} is not a multiple of {world} ranks")
    return settings["global_batch"] // world


class ByteGPT2(Task):
    """The byte-level GPT-2 of `benchmarks.workload` on stdlib source; held-out loss is the mean
    over fixed eval batches (the same for every seed and world size), which the ranks share out
    and all-reduce. The per-rank batch is either fixed or a fixed global batch split over ranks
    (`gpt2_rank_batch`), so that every world size solves the same optimisation problem."""

    metric_name = "eval_loss"

    def __init__(self, settings: dict, seed: int, rank: int, world: int):
        from benchmarks.workload import Workload
        from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

        self.s, self.seed, self.rank, self.world = settings, seed, rank, world
        self.w = Workload(**dict(settings["model"], batch=gpt2_rank_batch(settings, world)), lr=settings["lr"],
                          seed=seed)
        # one corpus for every seed (seed 0); the seed changes the weights and the batch order
        self.data = stdlib_source_bytes(max_bytes=settings.get("data_bytes", 2_000_000), seed=0)
        ev = byte_lm_batches(self.data, settings["eval_batch"], self.w.seq, seed=0, split="eval")
        self.eval_batches = [next(ev) for _ in range(settings["eval_batches"])]
        self.steps = settings["steps"]
        self.eval_steps = sorted(set(range(0, self.steps, settings["eval_every"])) | {self.steps})

    def build_model(self) -> nn.Module:
        from benchmarks.workload import build_model

        return build_model(self.w)

    def optimizer(self, params) -> torch.optim.Optimizer:
        if self.s.get("optimizer", "adamw") == "sgd":
            return torch.optim.SGD(params, lr=self.s["lr"], momentum=SGD_MOMENTUM)
        return torch.optim.AdamW(params, lr=self.s["lr"])

    def batches(self) -> Iterator[torch.Tensor]:
        from dad_examples.text_data import byte_lm_batches

        return byte_lm_batches(self.data, self.w.batch, self.w.seq, rank=self.rank, world_size=self.world,
                               seed=self.seed)

    def loss(self, fwd: nn.Module, batch) -> torch.Tensor:
        return fwd(input_ids=batch, labels=batch).loss

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Dict[str, float]:
        model.eval()
        mine = self.eval_batches[self.rank::self.world]  # the ranks' models are identical: share out
        total = torch.tensor([sum(float(model(input_ids=x, labels=x).loss) for x in mine), float(len(mine))],
                             dtype=torch.float64)
        model.train()
        dist.all_reduce(total)
        return {"loss": float(total[0] / total[1])}


def make_task(workload: str, settings: dict, seed: int, rank: int, world: int) -> Task:
    """The `Task` of a workload name (``mlp-adam``, ``mlp-sgd``, ``gpt2``, ``gpt2-sgd``)."""
    if workload in MLP_WORKLOADS:
        return DigitsMLP(dict(settings, optimizer=MLP_WORKLOADS[workload]), seed, rank, world)
    if workload in GPT2_WORKLOADS:
        return ByteGPT2(dict(settings, optimizer=GPT2_WORKLOADS[workload]), seed, rank, world)
    raise ValueError(f"unknown workload {workload!r}; known: {WORKLOADS}")


# -- methods -----------------------------------------------------------------------------------

class Runner:
    """One method's model, wrapper (DDP or dAD) and optimizer; `step` trains one counted step."""

    def __init__(self, method: str, task: Task, init_state: dict, spec: dict, seed: int,
                 counter: "CollectiveCounter"):
        self.method, self.task, self.counter = method, task, counter
        model = task.build_model()
        model.load_state_dict(init_state)
        model.train()
        self.model, self.fwd, self.sync = model, model, None
        variants = spec.get("dad_variants") or {}
        ps_variants = spec.get("powersgd_variants") or {}
        r = task.s["rank"]
        self.config: dict = {}
        if method in DDP_METHODS or method in ps_variants:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

            ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
            pg = dist.group.WORLD
            if method == "allreduce":
                ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
            elif method == "fp16":
                ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
            else:
                self.config = powersgd_method_config(method, r, ps_variants)
                state = powerSGD_hook.PowerSGDState(process_group=pg, random_seed=seed, **self.config)
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            self.config["bucket_cap_mb"] = DDP_BUCKET_MB
            self.fwd = ddp
        elif is_dad(method, variants):
            from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator

            cfg = DADConfig.from_dict(dad_method_config(method, r, spec.get("dad_extra"), variants))
            self.config = cfg.to_dict()  # with the defaults it took, for the record
            self.sync = DADSynchronizer(model, TorchDistributedAggregator(), cfg)
        else:
            raise ValueError(f"unknown method {method!r}")
        self.opt = task.optimizer(model.parameters())
        self.losses: List[float] = []
        self.counted: List[float] = []
        self.reported: List[float] = []
        self.times: List[float] = []
        self.cpu_times: List[float] = []
        self.evals: List[Dict[str, float]] = []
        self.last_report = None

    def step(self, batch) -> None:
        """Forward, backward, synchronisation and optimizer step, with the bytes counted."""
        self.counter.reset()
        with self.counter:
            start, cpu = time.perf_counter(), time.process_time()
            loss = self.task.loss(self.fwd, batch)
            loss.backward()
            if self.sync is not None:
                self.sync.synchronize()
            if self.task.s.get("clip_norm"):  # of the synchronised gradient, as a user clips it
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.task.s["clip_norm"])
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.process_time() - cpu)
        self.counted.append(self.counter.traffic().sent)
        self.losses.append(float(loss.detach()))
        if self.sync is not None:
            self.last_report = self.sync.last_step_report()
            self.reported.append(float(self.last_report.totals["sent_bytes"]))

    def evaluate(self) -> None:
        self.evals.append(self.task.evaluate(self.model))

    def divergence(self) -> float:
        """Largest relative difference between the ranks' parameters (0: identical models)."""
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return float((hi - lo).abs().max() / flat.abs().max().clamp_min(1e-30))

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.sync = self.fwd = self.opt = None


def _mean_over_ranks(values: Sequence[float]) -> List[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _steady_mean(xs: Sequence[float]) -> float:
    tail = list(xs[BYTES_WARMUP:]) or list(xs)
    return sum(tail) / len(tail)


def run_seed(workload: str, spec: dict, seed: int, progress: Callable) -> List[dict]:
    """Train every method of ``spec`` on ``workload`` from one seed's weights; records (rank 0's
    view, with per-rank numbers averaged over ranks) for every method."""
    rank, world = dist.get_rank(), dist.get_world_size()
    task = make_task(workload, spec["settings"][workload], seed, rank, world)
    torch.manual_seed(seed)
    init_state = {k: v.clone() for k, v in task.build_model().state_dict().items()}
    from dad_integrations.comm.counter import CollectiveCounter

    counter = CollectiveCounter(dist)
    runners = [Runner(m, task, init_state, spec, seed, counter) for m in spec["methods"]]
    batches = task.batches()
    evals_at = set(task.eval_steps)
    bar = progress(total=task.steps, desc=f"{workload} S={world} seed={seed}")
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(task.steps + 1):
        if step in evals_at:
            for r in runners:
                r.evaluate()
            if rank == 0:  # in the log as it happens: a run cut short still leaves its curves
                log.info("%s seed %d step %d held-out loss: %s", workload, seed, step,
                         ", ".join(f"{r.method} {r.evals[-1]['loss']:.4f}" for r in runners))
        if step == task.steps:
            break
        batch = next(batches)
        for r in runners:  # the methods take turns, step by step, on the same batch
            r.step(batch)
        bar.update(1)
    bar.close()
    wall = time.perf_counter() - started
    # CPU seconds of the training loop, all ranks together (every thread of every rank process):
    # divided by the machine's cores, the loop's wall time on an otherwise idle machine
    cpu = _mean_over_ranks([time.process_time() - cpu_started])[0] * world
    records = []
    for r in runners:
        counted = _mean_over_ranks(r.counted)
        reported = _mean_over_ranks(r.reported) if r.reported else None
        cum, total = [], 0.0
        for b in counted:
            total += b
            cum.append(total)
        final = r.evals[-1]
        rec = {
            "workload": workload, "optimizer": {**GPT2_WORKLOADS, **MLP_WORKLOADS}[workload],
            "world_size": world, "seed": seed, "method": r.method, "config": r.config,
            "rank": task.s["rank"], "steps": task.steps, "settings": spec["settings"][workload],
            "metric_name": task.metric_name,
            "metric": final["acc"] if task.metric_name == "test_acc" else final["loss"],
            "final_eval_loss": final["loss"],
            "bytes_per_step": _steady_mean(counted),
            "bytes_per_step_report": None if reported is None else _steady_mean(reported),
            "bytes_by_step": counted,
            "bytes_report_by_step": reported,
            "cum_bytes": cum,
            "train_loss": _mean_over_ranks(r.losses),
            "eval_steps": list(task.eval_steps),
            "eval_loss": [e["loss"] for e in r.evals],
            "eval_acc": [e["acc"] for e in r.evals] if "acc" in r.evals[-1] else None,
            "step_s_median": sorted(r.times)[len(r.times) // 2],
            # CPU seconds of one rank's step (all its threads), mean over steps and ranks
            "step_cpu_s": _mean_over_ranks([sum(r.cpu_times) / len(r.cpu_times)])[0],
            "rank_divergence": r.divergence(),
            "seed_wall_s": wall, "seed_cpu_s": cpu,
            # dAD: rank 0's last step, per parameter: route and bytes (beside all-reduce's)
            "report": None if r.last_report is None else [
                {"name": p.name, "representation": p.representation, "shape": list(p.shape),
                 "components": p.components, "sent": p.sent_bytes, "allreduce": p.allreduce_bytes}
                for p in r.last_report.params],
        }
        records.append(rec)
        r.close()
    return records


class _NoBar:
    def __init__(self, **_: Any):
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    """Entry point of one rank (``torch.multiprocessing.spawn``): every workload and seed of
    ``spec``; rank 0 writes ``spec["out_dir"]/<workload>-S<world>.json`` after each workload."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logging.basicConfig(level=spec.get("log_level", logging.INFO),
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    if rank != 0:
        logging.getLogger("dad_integrations").setLevel(logging.WARNING)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec.get("timeout_s", 600)))
    if rank == 0 and spec.get("progress", True):
        from tqdm import tqdm

        progress: Callable = lambda **kw: tqdm(leave=False, dynamic_ncols=True, **kw)  # noqa: E731
    else:
        progress = _NoBar
    try:
        for workload in spec["workloads"]:
            started = time.perf_counter()
            records: List[dict] = []
            for seed in spec["seeds"][workload]:
                records += run_seed(workload, spec, seed, progress)
                if rank == 0:
                    done = {r["method"]: r["metric"] for r in records if r["seed"] == seed}
                    log.info("%s, %d ranks, seed %d: %s", workload, world, seed,
                             ", ".join(f"{m} {v:.4g}" for m, v in done.items()))
            if rank == 0:
                path = os.path.join(spec["out_dir"], f"{workload}-S{world}.json")
                with open(path, "w") as fh:
                    json.dump({"records": records, "wall_s": time.perf_counter() - started}, fh)
            dist.barrier()
    finally:
        dist.destroy_process_group()
        log.debug("process group destroyed")
