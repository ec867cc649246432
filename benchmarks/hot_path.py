"""dAD's compute overhead against PowerSGD's hook (and against another version of dAD), in one process.

    python -m benchmarks.hot_path --steps 150 --config '{"mode": "auto", "rank": 4, "objective": "bytes", "lossless_steps": 0}'
    git archive 980aa64 | tar -x -C /tmp/base && python -m benchmarks.hot_path --baseline /tmp/base

One process, one-rank gloo group. The runners train the same byte-level GPT-2 (`benchmarks.workload`,
the quick preset's geometry) from the same weights on the same batches, one step each in turn (the
order reversed every other step), so that a shared machine's load falls on all of them alike:

  local      the plain model: forward, backward, optimizer step
  powersgd   DDP over the one-rank group with PowerSGD's hook (error feedback, warm start, from step 2)
  dad        `DADSynchronizer` over `NullAggregator` (behaves as ``--world`` ranks, moves nothing)
  baseline   with ``--baseline DIR``: the same, from the ``dad_integrations`` of the source tree DIR
             (imported under another name, so that both versions run side by side)

Prints per runner the median step and its overhead, the median of the per-step differences to
``local``: what each method computes beside the model (`benchmarks.compare`'s compute overhead),
then the median per-step difference of dAD to PowerSGD (and to the baseline). ``--profile`` adds
cProfile listings of dAD's steps: the main thread, and the exchanges on the synchroniser's worker.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.workload import NullAggregator, Workload, build_model, lm_step, median


def _null_aggregator(package: str, world: int):
    """`NullAggregator` as a subclass of ``package``'s own `FactorAggregator`."""
    base = importlib.import_module(f"{package}.aggregator").FactorAggregator

    def init(self, rank: int, world_size: int) -> None:
        base.__init__(self)
        self._rank, self._world = rank, world_size

    cls = type("NullAggregator", (base,), {"__init__": init, "_all_gather": NullAggregator._all_gather,
                                           "_all_reduce": NullAggregator._all_reduce})
    return cls(0, world)


def _runner(kind: str, package: Optional[str], w: Workload, init_state: dict, world: int,
            config: dict) -> Callable[[torch.Tensor], None]:
    """One method's training step on ``x``; ``step.losses`` and ``step.sync`` (None for DDP) ride along."""
    model = build_model(w)
    model.load_state_dict(init_state)
    model.train()
    fwd, sync = model, None
    if kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, bucket_cap_mb=25)
        state = powerSGD_hook.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=config["rank"],
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                            random_seed=w.seed)
        fwd.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif package is not None:
        pkg = importlib.import_module(package)
        sync = pkg.DADSynchronizer(model, _null_aggregator(package, world), pkg.DADConfig.from_dict(config))
        # the attach-time broadcast is a sum all-reduce to which only rank 0 adds, and
        # NullAggregator multiplies every sum by the world size: put the weights back
        model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
    losses: List[float] = []

    step = lm_step(fwd, opt, sync, losses)
    step.sync, step.losses = sync, losses
    return step


def _baseline_package(tree: str) -> str:
    """Import ``tree``'s ``dad_integrations`` as ``dad_baseline`` (its imports are relative)."""
    tmp = Path(tempfile.mkdtemp(prefix="dad_baseline_"))
    shutil.copytree(Path(tree) / "dad_integrations", tmp / "dad_baseline")
    sys.path.insert(0, str(tmp))
    return "dad_baseline"


def _profile_exchanges() -> cProfile.Profile:
    """Profile every exchange (they run on the synchroniser's worker thread, which cProfile on the
    main thread does not see)."""
    from dad_integrations.exchange.exchanger import Exchanger

    prof, run = cProfile.Profile(), Exchanger.run

    def profiled(self, *a, **k):
        prof.enable()
        try:
            return run(self, *a, **k)
        finally:
            prof.disable()

    Exchanger.run = profiled
    return prof


def _report(times: Dict[str, List[float]], warmup: int) -> None:
    keep = {k: v[warmup:] for k, v in times.items()}

    def diff(a: str, b: str) -> float:
        return median([x - y for x, y in zip(keep[a], keep[b])]) * 1e3

    for k in keep:
        line = f"{k:9s} median step {median(keep[k]) * 1e3:7.2f} ms"
        if k != "local":
            line += f"   overhead {diff(k, 'local'):+7.2f} ms"
        print(line)
    print(f"dad - powersgd: {diff('dad', 'powersgd'):+.2f} ms per step (median of {len(keep['dad'])} steps)")
    if "baseline" in keep:
        print(f"dad - baseline: {diff('dad', 'baseline'):+.2f} ms per step")
        print(f"baseline - powersgd: {diff('baseline', 'powersgd'):+.2f} ms per step")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world", type=int, default=2, help="ranks dAD's aggregator behaves as")
    # the rank routes' steady state: by bytes (over the communication-free aggregator a measured
    # link is instant, and auto by time would send every weight dense), from the first step
    p.add_argument("--config", default='{"mode": "auto", "rank": 4, "objective": "bytes", "lossless_steps": 0}')
    p.add_argument("--baseline", help="a source tree whose dad_integrations runs beside this one")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = json.loads(args.config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    w = Workload()
    torch.manual_seed(w.seed)
    init_state = build_model(w).state_dict()
    batches = byte_lm_batches(stdlib_source_bytes(max_bytes=500_000, seed=w.seed), w.batch, w.seq, seed=w.seed)
    xs = [next(batches) for _ in range(args.steps)]
    packages = {"local": None, "powersgd": None, "dad": "dad_integrations"}
    if args.baseline:
        packages["baseline"] = _baseline_package(args.baseline)
    runners = {k: _runner(k, pkg, w, init_state, args.world, config) for k, pkg in packages.items()}
    times: Dict[str, List[float]] = {k: [] for k in runners}
    prof = cProfile.Profile() if args.profile else None
    worker_prof = _profile_exchanges() if args.profile else None
    for i, x in enumerate(xs):
        for k in (list(runners) if i % 2 == 0 else list(runners)[::-1]):
            if prof is not None and k == "dad" and i >= args.warmup:
                prof.enable()
            t = time.perf_counter()
            runners[k](x)
            times[k].append(time.perf_counter() - t)
            if prof is not None:
                prof.disable()
    for k, r in runners.items():
        assert all(loss == loss for loss in r.losses), f"{k}: the loss went NaN"
    rep = runners["dad"].sync.last_step_report()
    routes = sorted({(q.representation, q.method) for q in rep.params if q.representation != "overhead"}, key=str)
    print(f"config {config}, world {args.world}: dAD's routes {routes}; load {open('/proc/loadavg').read().split()[0]}")
    _report(times, args.warmup)
    for r in runners.values():
        if r.sync is not None:
            r.sync.close()
    if prof is not None:
        print("dAD steps, main thread:")
        pstats.Stats(prof).sort_stats("tottime").print_stats("dad_integrations|autograd", 25)
        print("dAD exchanges, worker thread:")
        pstats.Stats(worker_prof).sort_stats("tottime").print_stats(40)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
