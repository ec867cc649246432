"""torchrun worker: all-dense steps through DDP's hook are DDP's own buckets (tests/test_dense_native.py).

Objective "time" on a stated fast link: after the checked first step every weight is dense, and
each DDP bucket goes on the wire as it is (`RoutePolicy.native_dense`, `DDPDriver.on_native_bucket`).
Beside it a plain DDP (its own C++ all-reduce) trains a copy on the same batches with the same
buckets; every step compares the two models' gradients bit for bit, counts dAD's collectives on
its group (`CollectiveCounter`) against the buckets DDP handed over, and notes whether the
synchroniser's per-parameter hooks were registered during the step's backward.

Steps: 0 is the first step and 4 a route refresh: both choose routes, ahead of backward on the rows
their forward counted (`exchange.ahead`: one all-gather at the first bucket, the hooks on), every
weight dense, so they too go by DDP's buckets (the first-step check waits for a step that sends
factors); 1-3 and 5-7 native, step 6 in two micro-steps (the first inside both DDPs' ``no_sync()``).

``join``: rank 0 runs out of inputs after 3 steps, rank 1 trains 6, every other step in two
micro-steps: a step of a DDP in ``join`` takes the per-parameter path (DDP's divisor and the
joined rank's shadow are dAD's to apply), here without the per-parameter hooks (every unit dense).
The same loop with DDP's own reduction; each step's gradients on each rank compared.
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
from models import gather_per_rank, run_all, write_and_exit  # noqa: E402

from dad_integrations import CollectiveCounter, register_dad_comm_hook  # noqa: E402

FAST = {"bandwidth": "1000gbit", "latency_us": 0}
CONFIG = {"mode": "auto", "rank": 4, "objective": "time", "link": FAST, "lossless_steps": 0,
          "route_refresh_steps": 4}
CAP_MB = 0.01  # 10 KB buckets: several per step
STEPS = 8
MICRO = {6: 2}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.LayerNorm(48), nn.Tanh(),
                         nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 8))


def run(case: dict) -> dict:
    ref_model = build()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, bucket_cap_mb=CAP_MB)
    net = DDP(model, bucket_cap_mb=CAP_MB)
    sync = register_dad_comm_hook(net, CONFIG)
    hooked = []  # per backward: the synchroniser's per-parameter hooks were registered
    model[0].weight.register_post_accumulate_grad_hook(lambda p: hooked.append(sync._params_hooked))
    buckets = []  # per step: the buckets DDP handed to dAD's hook
    inner = sync_driver_on_bucket(net, buckets)
    out = {"steps": []}
    for step in range(STEPS):
        micro = MICRO.get(step, 1)
        del buckets[:], hooked[:]
        with CollectiveCounter(dist) as counter:
            for k in range(micro):
                g = torch.Generator().manual_seed(1000 * step + 10 * k + dist.get_rank())
                x, y = torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)
                last = k == micro - 1
                for m in (ref, net):
                    with (m.no_sync() if not last else _Null()):
                        nn.functional.mse_loss(m(x), y).backward()
        report = sync.last_step_report()
        out["steps"].append({
            "equal": all(torch.equal(a.grad, b.grad) for a, b in zip(ref_model.parameters(), model.parameters())),
            "worst": max(float((a.grad - b.grad).abs().max()) for a, b in zip(ref_model.parameters(),
                                                                               model.parameters())),
            "routes": sorted({p.representation for p in report.params}),
            "reported": len(report.params),
            "dad_collectives": counter.traffic(group=sync.aggregator.group).calls,
            "native": sum(inner.native),
            "buckets": len(buckets),
            "hooked": hooked[:],
            "digest": [float(p.grad.double().sum()) for p in model.parameters()],
        })
        inner.native.clear()
        for m in (ref_model, model):
            m.zero_grad(set_to_none=True)
    out["params"] = len(list(model.parameters()))
    sync.close()
    return out


def sync_driver_on_bucket(net: DDP, buckets: list):
    """Count the buckets DDP hands over, and which of them went natively."""
    from dad_integrations.ddp_hook import _DRIVERS

    driver = _DRIVERS[net.module]
    native = driver.on_native_bucket

    def on_native_bucket(bucket, on_done):
        buckets.append(bucket.index())
        went = native(bucket, on_done)
        counted.native.append(int(went))
        return went

    class counted:
        pass

    counted.native = []
    driver.on_native_bucket = on_native_bucket
    return counted


def run_join(case: dict) -> dict:
    steps = 3 if dist.get_rank() == 0 else 6
    grads, hooked = {}, {}
    for name in ("ddp", "dad"):
        model = build()
        net = DDP(model, bucket_cap_mb=CAP_MB)
        sync = register_dad_comm_hook(net, CONFIG) if name == "dad" else None
        grads[name], hooked[name] = [], []
        with net.join():
            for step in range(steps):
                for k in range(1 + step % 2):
                    g = torch.Generator().manual_seed(1000 * step + 10 * k + dist.get_rank())
                    x, y = torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)
                    with (net.no_sync() if k < step % 2 else _Null()):
                        nn.functional.mse_loss(net(x), y).backward()
                grads[name].append([p.grad.clone() for p in model.parameters()])
                if sync is not None:
                    hooked[name].append(sync._params_hooked)
                model.zero_grad(set_to_none=True)
        if sync is not None:
            sync.close()
    worst = [max(float((a - b).abs().max()) for a, b in zip(ga, gb)) for ga, gb in zip(grads["ddp"], grads["dad"])]
    return {"worst": worst, "hooked": hooked["dad"]}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    dist.init_process_group("gloo")
    cases = {"native": {"name": "native"}, "join": {"name": "join"}}
    write_and_exit(sys.argv[1], run_all(cases, lambda c: run(c) if c["name"] == "native" else run_join(c),
                                        gather_per_rank))


if __name__ == "__main__":
    main()
