"""Runs inside `torchrun` (2 processes, gloo): rank 1 stalls, rank 0's dAD step must fail within
the job's timeout instead of torch's 30-minute default for new groups.

Usage: torchrun --standalone --nproc_per_node 2 timeout_worker.py OUT_DIR CASE

Both ranks set up together (process groups, dAD, DDP); then rank 1 does no step and only waits
for rank 0's result file, so that it neither takes part in a collective nor closes its
connections (which would fail rank 0 early for another reason). Rank 0 times its step and writes
``OUT_DIR/result.json``: whether it raised, after how long, and the timeout of dAD's group. Both
ranks then leave with ``os._exit(0)``: a process whose group timed out may block in teardown.
A watchdog on rank 0 writes ``"hung": true`` and ends the job where the step never returns
(the code before the fix), so the test fails in a minute, not in 30.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

WATCHDOG_S = 60.0    # rank 0: give up on its step after this long
STALL_CAP_S = 90.0   # rank 1: longest wait for rank 0's result (longer than the watchdog)
INIT_TIMEOUT = datetime.timedelta(seconds=15)   # the user's timeout in the default-timeout cases
EXPLICIT = datetime.timedelta(seconds=5)        # dAD's own timeout in the explicit cases


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def write_result(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)  # rank 1 polls for the file: it must appear whole


def setup(case: str):
    """Both ranks: groups and dAD for ``case``; returns (step function, dAD's process group)."""
    from dad_integrations import DADSynchronizer, TorchDistributedAggregator, register_dad_comm_hook
    exact = {"mode": "exact"}
    if case == "zero2":
        return _zero2()
    if case == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed_dad import DeepSpeedAggregator
        deepspeed.init_distributed(dist_backend="gloo", timeout=INIT_TIMEOUT, verbose=False)
        net = model()
        agg = DeepSpeedAggregator()
        sync = DADSynchronizer(net, agg, exact)
        return lambda x: (net(x).square().mean().backward(), sync.synchronize()), agg.group
    # "explicit": the job keeps torch's default (30 min) and dAD's aggregator gets 5 s
    dist.init_process_group("gloo", timeout=None if case.startswith("explicit") else INIT_TIMEOUT)
    net = model()
    # timeout= only where given: the default cases run unchanged against the code before the fix
    explicit = {"timeout": EXPLICIT} if case.startswith("explicit") else {}
    if case in ("plain", "explicit"):
        agg = TorchDistributedAggregator(**explicit)
        sync = DADSynchronizer(net, agg, exact)
        return lambda x: (net(x).square().mean().backward(), sync.synchronize()), agg.group
    if case in ("ddp", "explicit-ddp"):
        ddp = nn.parallel.DistributedDataParallel(net)
        sync = register_dad_comm_hook(ddp, exact, **explicit)
        return lambda x: ddp(x).square().mean().backward(), sync.aggregator.group
    if case == "fsdp2":
        return _fsdp2(net)
    raise ValueError(f"unknown case {case!r}")


def _fsdp2(net: nn.Module):
    """FSDP2 with dAD inside its reduce-scatter. Both ranks run the forward here (its all-gathers
    are FSDP's); with ``reshard_after_forward=False`` the backward all-gathers nothing, so the
    first collective rank 0 waits on in its step is dAD's, in FSDP's reduce-scatter hook."""
    from torch.distributed.fsdp import fully_shard

    from dad_integrations.fsdp import enable_dad_fsdp
    for layer in (net[0], net[2]):
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(net, reshard_after_forward=False)
    sync = enable_dad_fsdp(net, {"mode": "exact"})
    loss = net(torch.randn(5, 8)).square().mean()
    return lambda x: loss.backward(), dist.group.WORLD


def _zero2():
    """DeepSpeed ZeRO-2 with dAD in place of its gradient reduce-scatter (the ``"dad"`` block):
    forward and backward gather nothing, so rank 0's first collective is the bucket reduction,
    dAD's partition exchange for the factor-covered weights."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    import deepspeed_dad
    deepspeed.init_distributed(dist_backend="gloo", timeout=INIT_TIMEOUT, verbose=False)
    net = model()
    config = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1, "train_batch_size": 10,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "dad": {"mode": "exact"}}
    engine, *_ = deepspeed_dad.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                          config=config)
    att = deepspeed_dad.get_attachment(engine)
    return lambda x: engine.backward(engine(x).square().mean()), att.aggregator.group


def main() -> None:
    out_dir, case = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    path = os.path.join(out_dir, "result.json")
    step, group = setup(case)
    if rank != 0:  # the stalled rank
        deadline = time.monotonic() + STALL_CAP_S
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)

    from dad_integrations.comm.groups import _group_timeout
    timeout = _group_timeout(group)
    base = {"case": case, "group_timeout_s": None if timeout is None else timeout.total_seconds()}
    start = time.monotonic()

    def watchdog() -> None:
        time.sleep(WATCHDOG_S)
        write_result(path, {**base, "raised": False, "hung": True, "elapsed_s": time.monotonic() - start})
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    result = {**base, "raised": False, "hung": False}
    try:
        step(torch.randn(5, 8))
    except Exception as e:  # what the test waits for: the stalled rank's collective timed out
        result.update(raised=True, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    result["elapsed_s"] = time.monotonic() - start
    write_result(path, result)
    os._exit(0)


if __name__ == "__main__":
    main()
