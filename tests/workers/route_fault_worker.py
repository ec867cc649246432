"""One rank of a job whose route choice meets a fault injected from outside (`tests/test_faults.py`:
a link slowed mid-run, a rank paused with SIGSTOP).

Usage (started in a simulated node's namespace, with torchrun's variables set by the test):
    route_fault_worker.py OUT_DIR STEPS PARK_AT LIMIT_S
DDP + `register_dad_comm_hook`, mode auto on a measured link (objective "time", rank 2, no lossless
steps, route trials of 4 steps, no refresh within the run). The model, 48 linear layers of 80 x 80,
is chosen for wide margins on a loaded 2-core machine: its rank routes (3 power iterations: 6
small all-reduces a weight) take 2-6x DDP's one bucket on the unshaped link, and its dense
gradient (1.2 MB) takes ~0.5 s a step at 20 Mbit/s, 4-10x the rank routes. On the unshaped link
the models choose every weight dense at step 0, and no trial runs: the dense steps are watched
against their first interval (`routing.trial.RouteTrial.watch_untried`). The trial's watch lines
(DEBUG, `dad_integrations.routing.trial`) go to the rank's log: the baseline and limit, any miss.

Each step appends one line to ``OUT_DIR/steps.<rank>.jsonl`` (the step's routes and the last
decision, both from the public `StepReport`; the loop's seconds on it) and rewrites
``OUT_DIR/progress.<rank>`` (the steps done). With PARK_AT >= 0 every rank parks after that step
(``parked.<rank>``) until ``OUT_DIR/go`` appears: the test changes the link between two known
steps. After STEPS steps: ``result.<rank>.json`` with the route trials (`route_trials`, public) and
any error. A watchdog writes ``"hung": true`` and ends the rank LIMIT_S after the start, so a stuck
job fails the test instead of timing it out. Ranks leave with ``os._exit`` (teardown is not tested).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from fault_worker import write  # noqa: E402  (results appear whole: the test polls for them)

LAYERS, WIDTH, BATCH = 48, 80, 16
CONFIG = dict(mode="auto", rank=2, power_iterations=3, objective="time", lossless_steps=0, route_trial_steps=4,
              route_refresh_steps=100_000)
GROUP_TIMEOUT_S = 30.0  # a pause of a few seconds is far below it; a lost peer still fails within it


def main() -> None:
    out_dir, steps, park_at, limit_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    started = time.monotonic()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rank = dist.get_rank()
    result_path = os.path.join(out_dir, f"result.{rank}.json")

    def watchdog() -> None:
        time.sleep(max(0.0, limit_s - (time.monotonic() - started)))
        write(result_path, {"rank": rank, "hung": True, "error": None, "trials": []})
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    from dad_integrations import DADConfig, register_dad_comm_hook
    watch_log = logging.getLogger("dad_integrations.routing.trial")  # the watch's baseline, limit, misses
    watch_log.setLevel(logging.DEBUG)
    watch_log.addHandler(logging.StreamHandler(sys.stderr))
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    net = nn.Sequential(*layers)
    model = nn.parallel.DistributedDataParallel(net)
    sync = register_dad_comm_hook(model, DADConfig(**CONFIG))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    error = None
    log = open(os.path.join(out_dir, f"steps.{rank}.jsonl"), "w", buffering=1)
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            loss = model(torch.randn(BATCH, WIDTH, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            report = sync.last_step_report()
            routes = sorted({p.representation for p in report.params if len(p.shape) == 2})
            log.write(json.dumps({"step": report.step, "routes": routes, "decision": report.decision,
                                  "link": report.links.get("flat", ""), "seconds": time.perf_counter() - t0}) + "\n")
            write(os.path.join(out_dir, f"progress.{rank}"), {"step": step})
            if step == park_at:
                write(os.path.join(out_dir, f"parked.{rank}"), {"step": step})
                while not os.path.exists(os.path.join(out_dir, "go")):
                    time.sleep(0.02)
    except Exception as e:  # the test asserts there is none
        error = f"{type(e).__name__}: {e}"
    write(result_path, {"rank": rank, "hung": False, "error": error,
                        "trials": [dataclasses.asdict(t) for t in sync.route_trials]})
    os._exit(0)


if __name__ == "__main__":
    main()
