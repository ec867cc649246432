"""dAD's all-dense step against DDP's, on two real gloo ranks: where the time goes.

    python -m benchmarks.dense_path --steps 40 [--profile] [--baseline DIR]

With ``objective="time"`` and a stated fast link (``--link``), auto routes every weight dense and
switches capture off: its step should cost what DDP's all-reduce does. Two ranks (gloo over
loopback, one intra-op thread each) train the same byte-level GPT-2 (`benchmarks.workload`, the
quick preset: 2 layers of 256) from the same weights on the same batches, one step each in turn
(the order reversed every other step, so that a shared machine's load falls on all alike):

  local     the plain model: forward, backward, AdamW (no communication)
  ddp       DistributedDataParallel, its default buckets (25 MB, the first 1 MB), all-reduce
  dad       `DADSynchronizer` over `TorchDistributedAggregator`, mode auto, objective time
  baseline  with ``--baseline DIR``: the same, from the ``dad_integrations`` of the source tree DIR

``--nocomm`` measures what `benchmarks.compare` calls compute overhead instead: DDP over a one-rank
group, dAD over `benchmarks.workload.NullAggregator` (every computation of a step, nothing on a wire).

Prints per runner (slowest rank of each step) the median step, the median per-step difference to
``local``, the main thread's and the whole process's CPU time per step (the process's includes
gloo's threads) and, for dAD, its worker thread's CPU time per step (the exchange) and its
collectives per step. ``--profile`` adds cProfile listings (rank 0) of
dAD's steps on the main thread and of its exchanges on the worker thread. Timing on a shared
machine is noisy: read the per-step differences as an ordering, the CPU times and counts as the
profile.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib
import json
import os
import pstats
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.workload import NullAggregator, Workload, build_model, lm_step, median

FAST_LINK = {"bandwidth": "400gbit", "latency_us": 1.0}


def _package(tree: Optional[str]) -> str:
    """``dad_integrations``, or ``tree``'s copy of it imported as ``dad_baseline``."""
    if tree is None:
        return "dad_integrations"
    tmp = Path(tempfile.mkdtemp(prefix="dad_baseline_"))
    shutil.copytree(Path(tree) / "dad_integrations", tmp / "dad_baseline")
    sys.path.insert(0, str(tmp))
    return "dad_baseline"


class _WorkerClock:
    """CPU seconds of the exchanges (they run on the synchroniser's worker thread), and an
    optional cProfile of them, by wrapping ``package``'s `Exchanger.run`."""

    def __init__(self, package: str, profile: bool):
        self.cpu: List[float] = []
        self.prof = cProfile.Profile() if profile else None
        self.on = False
        try:  # the subpackage layout; a baseline tree may have the flat ``exchange`` module
            mod = importlib.import_module(f"{package}.exchange.exchanger")
        except ModuleNotFoundError:
            mod = importlib.import_module(f"{package}.exchange")
        run = mod.Exchanger.run
        clock = self

        def timed(ex, *a, **k):
            t = time.thread_time()
            if clock.prof is not None and clock.on:
                clock.prof.enable()
            try:
                return run(ex, *a, **k)
            finally:
                if clock.prof is not None and clock.on:
                    clock.prof.disable()
                clock.cpu.append(time.thread_time() - t)

        mod.Exchanger.run = timed


def _runner(kind: str, package: Optional[str], w: Workload, init_state: dict, link: dict, solo=None):
    model = build_model(w)
    model.load_state_dict(init_state)
    model.train()
    fwd, sync = model, None
    if kind == "ddp":
        fwd = torch.nn.parallel.DistributedDataParallel(model, process_group=solo)
    elif package is not None:
        pkg = importlib.import_module(package)
        if solo is None:
            agg = importlib.import_module(f"{package}.torch_distributed").TorchDistributedAggregator()
        else:
            agg = _null_aggregator(package)
        sync = pkg.DADSynchronizer(model, agg, pkg.DADConfig.from_dict(
            {"mode": "auto", "rank": 4, "objective": "time", "link": link}))
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)

    step = lm_step(fwd, opt, sync)
    step.sync, step.model = sync, model
    if solo is not None and sync is not None:
        # the attach-time broadcast summed rank 0's bytes times the world size: put the weights back
        model.load_state_dict(init_state)
    return step


def _null_aggregator(package: str):
    """`NullAggregator` as a subclass of ``package``'s own `FactorAggregator`."""
    base = importlib.import_module(f"{package}.aggregator").FactorAggregator

    def init(self) -> None:
        base.__init__(self)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()

    cls = type("NullAggregator", (base,), {"__init__": init, "_all_gather": NullAggregator._all_gather,
                                           "_all_reduce": NullAggregator._all_reduce})
    return cls()


def rank_main(rank: int, world: int, port: int, args: dict) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        _run(rank, args)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args: dict) -> None:
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    w = Workload()
    torch.manual_seed(w.seed)
    init_state = build_model(w).state_dict()
    data = stdlib_source_bytes(max_bytes=500_000, seed=w.seed)
    batches = byte_lm_batches(data, w.batch, w.seq, rank=rank, world_size=dist.get_world_size(), seed=w.seed)
    xs = [next(batches) for _ in range(args["steps"])]
    packages = {"local": None, "ddp": None, "dad": "dad_integrations"}
    if args.get("baseline"):
        packages["baseline"] = _package(args["baseline"])
    clocks = {k: _WorkerClock(p, args["profile"] and rank == 0) for k, p in packages.items()
              if p is not None}
    solo = None
    if args["nocomm"]:
        solo = [dist.new_group([i]) for i in range(dist.get_world_size())][rank]
    runners = {k: _runner(k, p, w, init_state, args["link"], solo) for k, p in packages.items()}
    wall: Dict[str, List[float]] = {k: [] for k in runners}
    cpu: Dict[str, List[float]] = {k: [] for k in runners}
    proc: Dict[str, List[float]] = {k: [] for k in runners}
    calls: Dict[str, List[int]] = {k: [] for k in runners}
    prof = cProfile.Profile() if args["profile"] and rank == 0 else None
    warm = args["warmup"]
    for i, x in enumerate(xs):
        for k in (list(runners) if i % 2 == 0 else list(runners)[::-1]):
            dist.barrier()  # both ranks start each step together: the slowest rank's time is the step's
            on = prof is not None and k == "dad" and i >= warm
            if k in clocks:
                clocks[k].on = on
            if on:
                prof.enable()
            sync = runners[k].sync
            before = sync.aggregator.traffic().calls if sync is not None else 0
            c, pc, t = time.thread_time(), time.process_time(), time.perf_counter()
            runners[k](x)
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.thread_time() - c)
            proc[k].append(time.process_time() - pc)
            if on:
                prof.disable()
            if sync is not None:
                calls[k].append(sync.aggregator.traffic().calls - before)
    # the slowest rank's wall time per step
    mine = torch.tensor([wall[k] for k in runners], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        slow = {k: mine[i].tolist()[warm:] for i, k in enumerate(runners)}
        load = open("/proc/loadavg").read().split()[0]
        rep = runners["dad"].sync.last_step_report()
        routes = sorted({q.representation for q in rep.params if q.representation != "overhead"})
        what = "no communication (--nocomm)" if args["nocomm"] else "loopback"
        print(f"2 gloo ranks, {what}, {args['steps'] - warm} timed steps; dAD's routes {routes}; load {load}")
        for k in runners:
            d = median([a - b for a, b in zip(slow[k], slow["local"])]) * 1e3
            line = (f"{k:9s} step {median(slow[k]) * 1e3:7.2f} ms  over local {d:+7.2f} ms  "
                    f"CPU main {median(cpu[k][warm:]) * 1e3:6.2f} ms, process {median(proc[k][warm:]) * 1e3:6.2f} ms")
            if k in clocks:
                line += (f", worker {median(clocks[k].cpu[warm:]) * 1e3:6.2f} ms"
                         f"  collectives {median(calls[k][warm:]):.0f}")
            print(line)
        if "baseline" in slow:
            print(f"dad - baseline: {median([a - b for a, b in zip(slow['dad'], slow['baseline'])]) * 1e3:+.2f} ms")
        print(f"dad - ddp: {median([a - b for a, b in zip(slow['dad'], slow['ddp'])]) * 1e3:+.2f} ms per step")
    for r in runners.values():
        if r.sync is not None:
            r.sync.close()
    if prof is not None:
        print("\ndAD steps, main thread (rank 0):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("tottime").print_stats("dad_integrations", 25)
        print("dAD exchanges, worker thread (rank 0):")
        pstats.Stats(clocks["dad"].prof).sort_stats("tottime").print_stats(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--link", default=json.dumps(FAST_LINK), help="dAD's stated link (config key 'link')")
    p.add_argument("--baseline", help="a source tree whose dad_integrations runs beside this one")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--nocomm", action="store_true", help="DDP on a one-rank group, dAD over NullAggregator")
    a = p.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = {"steps": a.steps, "warmup": a.warmup, "link": json.loads(a.link), "baseline": a.baseline,
            "profile": a.profile, "nocomm": a.nocomm}
    mp.spawn(rank_main, args=(2, port, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
