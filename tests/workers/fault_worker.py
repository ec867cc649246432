"""One rank of a job that trains until a fault injected from outside stops it (`tests/test_faults.py`).

Usage (started in a simulated node's namespace, with torchrun's variables set by the test):
    fault_worker.py OUT_DIR ENGINE TIMEOUT_S
ENGINE: "ddp" (DDP + `register_dad_comm_hook`) or "sync" (`DADSynchronizer` on the bare model),
exact mode, a tiny model. The process group's timeout is TIMEOUT_S. After its 3rd step a rank
writes ``OUT_DIR/ready.<rank>`` (the test injects the fault once every rank has) and trains on.
When a step raises, it writes ``OUT_DIR/result.<rank>.json``: the error's type and message, its
chained cause, the wall-clock time it was raised (the test compares it with the fault's), the steps
done before. A watchdog writes ``"hung": true`` and ends the rank where no step raises within
TIMEOUT_S + 60 s of the ready file, so a hang fails the test instead of timing it out. Ranks leave
with ``os._exit``: a group whose peer is gone may block or abort in teardown.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn


def write(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)  # the test polls for the file: it must appear whole


def main() -> None:
    out_dir, engine, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    from dad_integrations import CollectiveError, DADSynchronizer, TorchDistributedAggregator, register_dad_comm_hook
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if engine == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
        register_dad_comm_hook(model, {"mode": "exact"})
        sync = None
    else:
        model = net
        sync = DADSynchronizer(net, TorchDistributedAggregator(), {"mode": "exact"})
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    path = os.path.join(out_dir, f"result.{rank}.json")
    steps = 0

    def watchdog() -> None:
        while not os.path.exists(os.path.join(out_dir, f"ready.{rank}")):
            time.sleep(0.1)
        time.sleep(timeout_s + 60)
        write(path, {"rank": rank, "raised": False, "hung": True, "steps": steps})
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    gen = torch.Generator().manual_seed(rank)
    while True:
        try:
            loss = model(torch.randn(5, 8, generator=gen)).square().mean()
            loss.backward()
            if sync is not None:
                sync.synchronize()
            opt.step()
            opt.zero_grad(set_to_none=True)
        except Exception as e:  # what the test waits for: the fault, in words
            cause = e.__cause__
            write(path, {"rank": rank, "raised": True, "hung": False, "raised_at": time.time(), "steps": steps,
                         "type": type(e).__name__, "collective_error": isinstance(e, CollectiveError),
                         "message": str(e), "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
                         "attrs": {k: str(getattr(e, k, None)) for k in ("collective", "name", "step", "timeout")}})
            os._exit(0)
        steps += 1
        if steps == 3:
            write(os.path.join(out_dir, f"ready.{rank}"), {"rank": rank})
        time.sleep(0.02)  # a few steps a second is enough; the machine is shared


if __name__ == "__main__":
    main()
