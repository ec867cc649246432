"""Ranks of the simulated-cluster checks (tests/test_sim_cluster.py); one mode per job.

Usage (under `benchmarks.sim_cluster.SimCluster.torchrun`; ``horovod`` under `.horovod`)::

    sim_cluster_worker.py torch NUMEL      # torchrun: topology variables, a checked gloo all-reduce
    sim_cluster_worker.py horovod NUMEL    # Horovod: topology, allreduce, local/cross process sets
    sim_cluster_worker.py fail             # the last rank exits 1, the others hang
    sim_cluster_worker.py sleep PID_DIR    # every rank writes its pid and sleeps

Each rank prints one line ``ok {json}``; checks raise (the rank exits non-zero, the job fails).
Ranks end with ``os._exit(0)``: gloo may abort at interpreter exit.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def torch_mode(numel: int) -> dict:
    import torch
    import torch.distributed as dist
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    node = int(os.environ["SIM_CLUSTER_NODE"])
    group_rank, rank = int(os.environ["GROUP_RANK"]), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    assert dist.get_world_size() == world and dist.get_rank() == rank
    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert torch.equal(t, torch.full_like(t, expected)), (t[:4], expected)
    # every rank's (node, group rank) seen by all: ranks are laid out node by node
    layout = [None] * world
    dist.all_gather_object(layout, (node, group_rank, int(os.environ["LOCAL_RANK"])))
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "local_world": local, "node": node, "group_rank": group_rank,
            "group_world": int(os.environ["GROUP_WORLD_SIZE"]), "layout": layout}


def horovod_mode(numel: int) -> dict:
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # process sets added after init, on every rank
    import torch
    import horovod.torch as hvd
    hvd.init()
    node = int(os.environ["SIM_CLUSTER_NODE"])
    rank, size = hvd.rank(), hvd.size()
    t = hvd.allreduce(torch.full((numel,), float(rank + 1)), op=hvd.Sum)
    assert torch.equal(t, torch.full_like(t, size * (size + 1) / 2)), t[:4]
    # the sets from every rank's topology: per node (local) and per local rank (cross)
    topo = hvd.allgather_object((rank, hvd.local_rank(), hvd.cross_rank()))
    local_ranks = {c: sorted(r for r, _, cr in topo if cr == c) for c in range(hvd.cross_size())}
    cross_ranks = {lr: sorted(r for r, l, _ in topo if l == lr) for lr in range(hvd.local_size())}
    local_sets = {c: hvd.add_process_set(r) for c, r in local_ranks.items()}
    cross_sets = {lr: hvd.add_process_set(r) for lr, r in cross_ranks.items()}
    local_set, cross_set = local_sets[hvd.cross_rank()], cross_sets[hvd.local_rank()]
    # hierarchical all-reduce: local reduce-scatter, cross all-reduce, local all-gather = flat sum
    x = torch.arange(8 * hvd.local_size(), dtype=torch.float32) * (rank + 1)
    shard = hvd.reducescatter(x, op=hvd.Sum, process_set=local_set)
    shard = hvd.allreduce(shard, op=hvd.Sum, process_set=cross_set)
    full = hvd.allgather(shard, process_set=local_set)
    flat = hvd.allreduce(x, op=hvd.Sum)
    assert torch.allclose(full, flat), (full, flat)
    cross_sum = hvd.allreduce(torch.tensor([float(hvd.cross_rank() + 1)]), op=hvd.Sum, process_set=cross_set)
    assert cross_sum.item() == hvd.cross_size() * (hvd.cross_size() + 1) / 2, cross_sum
    out = {"rank": rank, "size": size, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
           "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "node": node,
           "local_set": local_ranks[hvd.cross_rank()], "cross_set": cross_ranks[hvd.local_rank()]}
    # every rank past its last collective before any shuts down: a rank's shutdown stops Horovod on
    # all, and a process-set collective of the other set may still be in flight
    hvd.barrier()
    hvd.shutdown()
    return out


def fail_mode() -> dict:
    """The last rank (on the last node) exits 1; the others would wait for it forever."""
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        print("failing on purpose", file=sys.stderr, flush=True)
        os._exit(1)
    time.sleep(300)
    return {}


def sleep_mode(pid_dir: str) -> dict:
    """Hang (a job that times out), leaving this rank's pid for the test to check it was killed."""
    Path(pid_dir, f"{os.getpid()}").write_text(os.environ.get("RANK", "?"))
    time.sleep(300)
    return {}


def main() -> None:
    mode = sys.argv[1]
    if mode == "torch":
        res = torch_mode(int(sys.argv[2]))
    elif mode == "horovod":
        res = horovod_mode(int(sys.argv[2]))
    elif mode == "fail":
        res = fail_mode()
    elif mode == "sleep":
        res = sleep_mode(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    # one write(2): a node's ranks share torchrun's stdout, and print's pieces would interleave
    sys.stdout.flush()
    os.write(1, f"ok {json.dumps(res)}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
