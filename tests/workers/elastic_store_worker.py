"""One process posing as a restarted torchelastic rank (the test sets TORCHELASTIC_* and RANK/
WORLD_SIZE; this script hosts the "agent's" store, as torchrun's agent does) and prints JSON:

- ``warned``: per way of making the group (``dad_integrations.init_process_group``, then
  torch's own), whether a real attach (DDP's hook) warned about the restart;
- ``timeout_s``, ``error``: how long ``init_process_group`` with a 3 s timeout took to fail when
  world size 2 is asked and rank 1 never comes, and what it raised.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402


def main() -> None:
    from dad_integrations import elastic, init_process_group, register_dad_comm_hook
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)  # what torchrun's agent hosts
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(agent.port)
    out = {"warned": {}}
    for way, init in (("dad", init_process_group), ("torch", dist.init_process_group)):
        init("gloo", world_size=1, rank=0)
        ddp = torch.nn.parallel.DistributedDataParallel(models.build("mlp"))
        register_dad_comm_hook(ddp, {"mode": "rank", "rank": 2}).close()
        out["warned"][way] = elastic._warned
        dist.destroy_process_group()
    start = time.monotonic()
    try:
        init_process_group("gloo", world_size=2, rank=0, timeout=timedelta(seconds=3))
        out["error"] = None
    except Exception as e:  # noqa: BLE001 (what it raised is the result)
        out["error"] = f"{type(e).__name__}: {e}"
    out["timeout_s"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
    os._exit(0)  # gloo at exit may abort


if __name__ == "__main__":
    main()
