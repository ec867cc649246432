"""dAD's all-dense step against DDP's, on two real gloo ranks: where the time goes.

    python -m benchmarks.dense_path --steps 40 [--profile] [--baseline DIR] [--nocomm] [--runners dad-ddp,...]

With ``objective="time"`` and a stated fast link (``--link``), auto routes every weight dense and
switches capture off: its step should cost what DDP's all-reduce does. Two ranks (gloo over
loopback, one intra-op thread each) train the same byte-level GPT-2 (`benchmarks.workload`, the
quick preset: 2 layers of 256) from the same weights on the same batches, one step each in turn
(the order reversed every other step, so that a shared machine's load falls on all alike):

  local     the plain model: forward, backward, AdamW (no communication)
  ddp       DistributedDataParallel, its default buckets (25 MB, the first 1 MB), all-reduce
  ddp-pyhook
            the same DDP with PyTorch's own all-reduce as a Python communication hook
            (``default_hooks.allreduce_hook``): what any hook costs over DDP's built-in C++ one
            (the call into Python per bucket, and a division of the bucket apart from its copy)
  dad-ddp   the same DDP with dAD's communication hook (`register_dad_comm_hook`, as Accelerate and
            the Trainer use it), mode auto, objective time: an all-dense step sends DDP's own
            buckets (`RoutePolicy.native_dense`)
  dad       `DADSynchronizer` over `TorchDistributedAggregator` (plain torch.distributed, no DDP):
            dAD packs its own dense buckets
  baseline-ddp, baseline
            with ``--baseline DIR``: those two from the ``dad_integrations`` of the source tree DIR

``--nocomm`` measures what `benchmarks.compare` calls compute overhead instead: DDP over a one-rank
group, dAD over `benchmarks.workload.NullAggregator` (every computation of a step, nothing on a wire).

Prints per runner (slowest rank of each step) the median step, the median per-step difference to
``local``, the main thread's and the whole process's CPU time per step (the process's includes
gloo's threads), for dAD the CPU time of its exchanges (`Exchanger.run` on its worker thread;
`Exchanger.run_native`, a step of DDP's own buckets, on the autograd thread) and collectives per
step (DDP's: the buckets it reduced), then each dAD runner against DDP, step by step (the
medians of the per-step difference and ratio: a load that comes and goes falls on both alike).
``--profile`` adds cProfile listings (rank 0) of the dAD runners' steps on the main thread and of
their exchanges. Timing on a shared machine is noisy: read the per-step differences as an
ordering, the CPU times and counts as the profile.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib
import json
import os
import pstats
import re
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
    """``dad_integrations``, or ``tree``'s copy of it imported as ``dad_baseline``: its modules
    import each other by absolute name, so the copy's imports are renamed too (else the copy
    would run this tree's modules)."""
    if tree is None:
        return "dad_integrations"
    tmp = Path(tempfile.mkdtemp(prefix="dad_baseline_"))
    shutil.copytree(Path(tree) / "dad_integrations", tmp / "dad_baseline")
    for path in (tmp / "dad_baseline").rglob("*.py"):
        text = path.read_text()
        renamed = re.sub(r"\bdad_integrations\b", "dad_baseline", text)
        if renamed != text:
            path.write_text(renamed)
    sys.path.insert(0, str(tmp))
    return "dad_baseline"


class _WorkerClock:
    """CPU seconds of the exchanges, per exchanger, and an optional cProfile of them, by wrapping
    ``package``'s `Exchanger.run` (on the synchroniser's worker thread) and `run_native` (a step of
    DDP's own buckets, on the autograd thread, or the worker in older trees)."""

    def __init__(self, package: str, profile: bool):
        self.cpu: Dict[int, List[float]] = {}  # id(exchanger) -> CPU seconds per exchange
        self.prof = cProfile.Profile() if profile else None
        self.on = False
        try:  # the subpackage layout; a baseline tree may have the flat ``exchange`` module
            mod = importlib.import_module(f"{package}.exchange.exchanger")
        except ModuleNotFoundError:
            mod = importlib.import_module(f"{package}.exchange")
        clock = self

        def wrap(run):
            def timed(ex, *a, **k):
                t = time.thread_time()
                if clock.prof is not None and clock.on:
                    clock.prof.enable()
                try:
                    return run(ex, *a, **k)
                finally:
                    if clock.prof is not None and clock.on:
                        clock.prof.disable()
                    clock.cpu.setdefault(id(ex), []).append(time.thread_time() - t)
            return timed

        for name in ("run", "run_native"):
            if hasattr(mod.Exchanger, name):
                setattr(mod.Exchanger, name, wrap(getattr(mod.Exchanger, name)))


def _runner(kind: str, package: Optional[str], w: Workload, init_state: dict, link: dict, solo=None):
    model = build_model(w)
    model.load_state_dict(init_state)
    model.train()
    fwd, sync = model, None
    via_ddp = kind in ("ddp", "ddp-pyhook", "dad-ddp", "baseline-ddp")
    if via_ddp:
        fwd = torch.nn.parallel.DistributedDataParallel(model, process_group=solo)
    if kind == "ddp-pyhook":  # PyTorch's own all-reduce, as a Python communication hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        fwd.register_comm_hook(solo, allreduce_hook)
    if package is not None:
        pkg = importlib.import_module(package)
        agg = _null_aggregator(package) if solo is not None else None
        config = pkg.DADConfig.from_dict({"mode": "auto", "rank": 4, "objective": "time", "link": link})
        if via_ddp:  # DDP's hook: synchronised when backward ends, no synchronize()
            sync = pkg.register_dad_comm_hook(fwd, config, agg)
        else:
            sync = pkg.DADSynchronizer(model, agg if agg is not None else _aggregator(package), config)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)

    step = lm_step(fwd, opt, None if via_ddp else sync)
    step.sync, step.model, step.ddp = sync, model, fwd if fwd is not model else None
    if solo is not None and sync is not None and not via_ddp:
        # the attach-time broadcast summed rank 0's bytes times the world size: put the weights back
        model.load_state_dict(init_state)
    return step


def _module(package: str, *names: str):
    """The first of ``package``'s modules ``names`` that exists (a baseline tree may have the flat
    layout: ``aggregator`` rather than ``comm.aggregator``)."""
    for name in names:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names} in {package}")


def _aggregator(package: str):
    return _module(package, "comm.torch_distributed", "torch_distributed").TorchDistributedAggregator()


def _null_aggregator(package: str):
    """`NullAggregator` as a subclass of ``package``'s own `FactorAggregator`."""
    base = _module(package, "comm.aggregator", "aggregator").FactorAggregator

    def init(self) -> None:
        base.__init__(self)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()

    cls = type("NullAggregator", (base,), {"__init__": init, "_all_gather": NullAggregator._all_gather,
                                           "_all_reduce": NullAggregator._all_reduce})
    return cls()


def _ddp_buckets(ddp) -> Optional[int]:
    """Buckets DDP reduced in its last backward (its logging data), or None where it does not say."""
    try:
        return int(ddp._get_ddp_logging_data().get("num_buckets_reduced"))
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None


def rank_main(rank: int, world: int, port: int, args: dict) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    _run(rank, args)
    dist.barrier()
    dist.destroy_process_group()
    # as the test workers end (tests/workers/models.write_and_exit): gloo's threads may still hold
    # a finished collective's tensors, and interpreter finalisation then aborts the process once
    # in a while ("terminate called without an active exception") after its work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(rank: int, args: dict) -> None:
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    w = Workload()
    torch.manual_seed(w.seed)
    init_state = build_model(w).state_dict()
    data = stdlib_source_bytes(max_bytes=500_000, seed=w.seed)
    batches = byte_lm_batches(data, w.batch, w.seq, rank=rank, world_size=dist.get_world_size(), seed=w.seed)
    xs = [next(batches) for _ in range(args["steps"])]
    packages = {"local": None, "ddp": None, "ddp-pyhook": None, "dad-ddp": "dad_integrations",
                "dad": "dad_integrations"}
    if args.get("baseline"):
        packages["baseline-ddp"] = packages["baseline"] = _package(args["baseline"])
    if args.get("runners"):  # local and ddp always: the others are read against them
        packages = {k: p for k, p in packages.items() if k in ("local", "ddp") or k in args["runners"]}
    clocks = {p: _WorkerClock(p, args["profile"] and rank == 0) for p in set(packages.values()) if p is not None}
    solo = None
    if args["nocomm"]:
        solo = [dist.new_group([i]) for i in range(dist.get_world_size())][rank]
    runners = {k: _runner(k, p, w, init_state, args["link"], solo) for k, p in packages.items()}
    wall: Dict[str, List[float]] = {k: [] for k in runners}
    cpu: Dict[str, List[float]] = {k: [] for k in runners}
    proc: Dict[str, List[float]] = {k: [] for k in runners}
    calls: Dict[str, List[int]] = {k: [] for k in runners}
    profiled = ("dad-ddp", "dad")
    profs = {k: cProfile.Profile() for k in profiled if k in runners} if args["profile"] and rank == 0 else {}
    worker_profs = {k: cProfile.Profile() for k in profs}
    warm = args["warmup"]
    for i, x in enumerate(xs):
        for k in (list(runners) if i % 2 == 0 else list(runners)[::-1]):
            dist.barrier()  # both ranks start each step together: the slowest rank's time is the step's
            step = runners[k]
            prof = profs.get(k) if i >= warm else None
            if packages[k] is not None:
                clocks[packages[k]].prof = worker_profs.get(k) if prof is not None else None
                clocks[packages[k]].on = prof is not None
            if prof is not None:
                prof.enable()
            sync = step.sync
            before = sync.aggregator.traffic().calls if sync is not None else 0
            c, pc, t = time.thread_time(), time.process_time(), time.perf_counter()
            step(x)
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.thread_time() - c)
            proc[k].append(time.process_time() - pc)
            if prof is not None:
                prof.disable()
            if sync is not None:
                calls[k].append(sync.aggregator.traffic().calls - before)
            elif step.ddp is not None and not args["nocomm"]:
                calls[k].append(_ddp_buckets(step.ddp) or 0)
    # the slowest rank's wall time per step
    mine = torch.tensor([wall[k] for k in runners], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        slow = {k: mine[i].tolist()[warm:] for i, k in enumerate(runners)}
        load = open("/proc/loadavg").read().split()[0]
        rep = next(r.sync for r in runners.values() if r.sync is not None).last_step_report()
        routes = sorted({q.representation for q in rep.params if q.representation != "overhead"})
        what = "no communication (--nocomm)" if args["nocomm"] else "loopback"
        print(f"2 gloo ranks, {what}, {args['steps'] - warm} timed steps; dAD's routes {routes}; load {load}")
        for k in runners:
            d = median([a - b for a, b in zip(slow[k], slow["local"])]) * 1e3
            line = (f"{k:12s} step {median(slow[k]) * 1e3:7.2f} ms  over local {d:+7.2f} ms  "
                    f"CPU main {median(cpu[k][warm:]) * 1e3:6.2f} ms, process {median(proc[k][warm:]) * 1e3:6.2f} ms")
            sync = runners[k].sync
            if sync is not None:
                worker = clocks[packages[k]].cpu.get(id(sync._exchanger), [])[warm:]
                line += f", exchange {median(worker) * 1e3 if worker else 0.0:6.2f} ms"
            if calls[k][warm:]:
                line += f"  collectives {median(calls[k][warm:]):.0f}"
            print(line)
        for k in runners:  # paired step by step: a load that comes and goes falls on both alike
            if k not in ("local", "ddp"):
                diff = median([a - b for a, b in zip(slow[k], slow["ddp"])]) * 1e3
                ratio = median([a / b for a, b in zip(slow[k], slow["ddp"])])
                print(f"{k} - ddp: {diff:+.2f} ms per step, {ratio:.3f} x ddp's step (medians of the "
                      f"per-step difference and ratio)")
        for mine, base in (("dad-ddp", "baseline-ddp"), ("dad", "baseline")):
            if base in slow:
                print(f"{mine} - {base}: {median([a - b for a, b in zip(slow[mine], slow[base])]) * 1e3:+.2f} ms")
    for r in runners.values():
        if r.sync is not None:
            r.sync.close()
    for k, prof in profs.items():
        print(f"\n{k} steps, main thread (rank 0):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("tottime").print_stats("dad_integrations", 25)
        if worker_profs[k].getstats():
            print(f"{k} exchanges (Exchanger.run on the worker thread, run_native on the autograd thread), rank 0:")
            pstats.Stats(worker_profs[k]).sort_stats("tottime").print_stats(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--link", default=json.dumps(FAST_LINK), help="dAD's stated link (config key 'link')")
    p.add_argument("--baseline", help="a source tree whose dad_integrations runs beside this one")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--nocomm", action="store_true", help="DDP on a one-rank group, dAD over NullAggregator")
    p.add_argument("--runners", help="comma-separated runners to time besides local and ddp (default: all)")
    a = p.parse_args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = {"steps": a.steps, "warmup": a.warmup, "link": json.loads(a.link), "baseline": a.baseline,
            "profile": a.profile, "nocomm": a.nocomm, "runners": a.runners.split(",") if a.runners else None}
    mp.spawn(rank_main, args=(2, port, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
