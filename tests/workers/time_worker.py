"""torchrun worker: objective "time" on a real gloo group (tests/test_time_routing.py).

Cases (each rank trains the small GPT-2 of `models` on its own batches):
- ``fast``: a stated link of 1 Tbit/s: after the checked first step every weight goes dense and
  stops being captured; every gradient equals the all-reduce of the local gradients.
- ``slow``: 1 Mbit/s: the weights take the rank-r all-reduce route.
- ``flush``: 1 Mbit/s, then `set_link` to 1 Tbit/s: at the refresh the weights leave the rank
  route, and that step's gradient is the all-reduce of the local gradient plus each rank's
  residual.
- ``fast-ddp``: the fast link through DDP's hook: DDP's buckets as they are (`run_fast_ddp`).
- ``measured``: no link stated: measured at attach on this group, every rank routes alike.
- ``trial-dense``, ``trial-keep``, ``trial-sleep``, ``trial-ddp``: route trials on a measured
  link (`run_trial`).
- ``lossless-bytes``, ``lossless-time``: 3 lossless steps, then rank routes (`run_lossless`).
Every case reports the routes per step and a digest of the final parameters.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Dict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from models import batch, build, gather_per_rank, grad_errors, loss_of, run_all, write_and_exit  # noqa: E402

from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator  # noqa: E402
from dad_integrations.ddp_hook import register_dad_comm_hook  # noqa: E402

FAST = {"bandwidth": "1000gbit", "latency_us": 0}
SLOW = {"bandwidth": "1mbit", "latency_us": 100}
MODEL = "gpt2"


def _digest(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


def _reference_grads(model: torch.nn.Module, data: dict, residuals: Dict[str, torch.Tensor],
                     name: str = MODEL) -> torch.nn.Module:
    """A copy of ``model`` whose gradients are the all-reduce mean of each rank's local gradient
    plus its residual (what a dense step that flushes the residuals must give)."""
    ref = build(name)  # not a deepcopy: the model's hooks hold the synchroniser
    ref.load_state_dict(model.state_dict())
    loss_of(name, ref, data).backward()
    for name, p in ref.named_parameters():
        if name in residuals:
            p.grad.add_(residuals[name].to(p.grad.dtype))
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())
    return ref


def _wide() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def run_flush_to_exact(case: dict) -> dict:
    """A 64 x 64 layer at rank 4 on the slow link: 8 rows per rank take the rank-r all-reduce (2 KB
    against 4 KB of factors); at the refresh of step 3 rows fall to 1 and exact factors (0.5 KB) are
    faster. Step 3 sends the residual densely; step 4 goes by exact factors, which need the rows
    captured after the flush."""
    model = _wide()
    sync = DADSynchronizer(model, TorchDistributedAggregator(),
                           DADConfig(mode="auto", rank=4, objective="time", link=SLOW, route_refresh_steps=3))
    out = {"routes": [], "errors": []}
    for step, size in enumerate([8, 8, 8, 1, 1]):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(size, 64, generator=g), torch.randn(size, 8, generator=g)
        ref = None
        if step >= 3:  # the all-reduce of the local gradient (plus, at the flush, the residual)
            ref = _wide()
            ref.load_state_dict(model.state_dict())
            torch.nn.functional.mse_loss(ref(x), y).backward()
            residuals = sync.state_dict()["rank_routes"] if step == 3 else {}
            for name, p in ref.named_parameters():
                r = residuals.get(name, {}).get("residual")
                if r is not None:
                    p.grad.add_(r)
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        torch.nn.functional.mse_loss(model(x), y).backward()
        sync.synchronize()
        report = sync.last_step_report()
        out["routes"].append({p.name: p.representation for p in report.params if len(p.shape) == 2})
        if ref is not None:
            out["errors"].append(max(grad_errors(ref, model).values()))
        model.zero_grad(set_to_none=True)
    out["digest"] = _digest(model)
    sync.close()
    return out


class SlowedAggregator(TorchDistributedAggregator):
    """Real gloo collectives, one kind made slower (each call sleeps first): what a step costs on a
    link or device where that kind is slow, whatever the models predicted."""

    def __init__(self, slow_prefixes: tuple, min_numel: int = 0, seconds: float = 0.15):
        super().__init__()
        self.slow_prefixes, self.min_numel, self.seconds = slow_prefixes, min_numel, seconds
        self.names = []

    def _slow(self, tensor, name) -> None:
        if name.startswith(self.slow_prefixes) and tensor.numel() >= self.min_numel:
            time.sleep(self.seconds)

    def _all_reduce(self, tensor, name, op):
        self.names.append(name)
        self._slow(tensor, name)
        return super()._all_reduce(tensor, name, op)

    def _all_gather(self, tensor, name, first_dims):
        self.names.append(name)
        self._slow(tensor, name)
        return super()._all_gather(tensor, name, first_dims)


def run_trial(case: dict) -> dict:
    """A measured link that the models misjudge (`set_link` to 1 Mbit/s right after attach, as a
    noisy probe could), so step 0 routes every weight by a rank route; route trials of rounds of 4
    steps: steps 1-4 alternate the rank routes and all dense (R D D R: two pairs), decided at the
    end of step 4, then what measured faster. ``trial-dense``: the rank routes' collectives made
    0.15 s slower, so all-dense wins and stays; ``trial-keep``: the dense buckets' all-reduce of
    the weights made slower, so the rank routes come back at step 5. ``trial-sleep``: as
    ``trial-keep``, but the loop sleeps 0.5 s after each step on the routes (an evaluation, a
    checkpoint): time between steps does not count, so the routes still win. ``trial-ddp``: the
    same through DDP's communication hook (the step starts at DDP's forward). The trial's dense
    steps hold the rank routes' error-feedback residuals (``held``) and send the all-reduce's
    gradient, through DDP's hook as DDP's own buckets (``native``)."""
    name = case["name"]
    model = build(MODEL, seed=0)
    keep = name != "trial-dense"
    agg = (SlowedAggregator(("dad.dense.",), min_numel=10_000) if keep
           else SlowedAggregator(("dad.powersgd.", "dad.rank.")))
    config = DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0, route_trial_steps=4,
                       route_refresh_steps=100)
    if name == "trial-ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)
        sync = register_dad_comm_hook(net, config, agg)
    else:
        net = model
        sync = DADSynchronizer(model, agg, config)
    sync.set_link(SLOW)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"routes": [], "errors": {}, "captured": [], "held": [], "native": []}
    for step in range(12):
        data = batch(MODEL, 2, seed=100 * step + dist.get_rank())
        ref = _reference_grads(model, data, {}) if step in (2, 3, 6, 9) else None
        before = len(agg.names)
        loss_of(MODEL, net, data).backward()
        if net is model:
            sync.synchronize()
        if ref is not None:
            out["errors"][step] = max(grad_errors(ref, model).values())
        report = sync.last_step_report()
        routes = sorted({p.representation for p in report.params if p.shape and len(p.shape) == 2})
        out["routes"].append(routes)
        out["captured"].append(sum(c.enabled for c in sync._plan.captures))
        out["held"].append(len(sync._exchanger.state.memory.residuals))
        out["native"].append(sum(n == "dad.dense.native" for n in agg.names[before:]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if name == "trial-sleep" and routes != ["dense"]:
            with torch.no_grad():  # an evaluation pass: starts no step
                loss_of(MODEL, net, data)
            time.sleep(0.5)
    out["trials"] = [dataclasses.asdict(t) for t in sync.route_trials]
    out["overhead_s"] = sync.timing.overhead_s
    out["digest"] = _digest(model)
    out["residuals_after"] = sum(s["residual"] is not None for s in sync.state_dict()["rank_routes"].values())
    if net is model:
        sync.close()
    return out


class RecordingAggregator(TorchDistributedAggregator):
    """Real gloo collectives; remembers each all-reduce's and all-gather's name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def _all_reduce(self, tensor, name, op):
        self.names.append(name)
        return super()._all_reduce(tensor, name, op)

    def _all_gather(self, tensor, name, first_dims):
        self.names.append(name)
        return super()._all_gather(tensor, name, first_dims)


def run_fast_ddp(case: dict) -> dict:
    """DDP's hook on a stated fast link: every weight goes dense from the first step (its routes
    decided ahead of backward, `exchange.ahead`), and DDP's buckets go on the wire as they are
    (`RoutePolicy.native_dense`): every gradient equals a plain DDP's on the same weights and
    batches, bit for bit, step after step."""
    model = build(MODEL, seed=0)
    ref = build(MODEL, seed=0)
    agg = RecordingAggregator()
    net = torch.nn.parallel.DistributedDataParallel(model)
    plain = torch.nn.parallel.DistributedDataParallel(ref)
    sync = register_dad_comm_hook(net, DADConfig(mode="auto", rank=4, objective="time", link=FAST), agg)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    out = {"routes": [], "equal": [], "native_calls": []}
    for step in range(5):
        data = batch(MODEL, 2, seed=100 * step + dist.get_rank())
        before = len(agg.names)
        loss_of(MODEL, net, data).backward()
        loss_of(MODEL, plain, data).backward()
        out["native_calls"].append(sum(n == "dad.dense.native" for n in agg.names[before:]))
        out["equal"].append(all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters())))
        report = sync.last_step_report()
        out["routes"].append(sorted({p.representation for p in report.params}))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    out["digest"] = _digest(model)
    return out


def run_lossless(case: dict) -> dict:
    """Auto at rank 4 with 3 lossless steps (the default is 10; this suite pins 0): steps 0-2 take
    no rank route and every gradient equals the all-reduce's; from step 3 (by time on the slow
    link: the refresh at the lossless steps' end) the weights take rank routes."""
    model = build(MODEL, seed=0)
    objective = case["name"].split("-")[1]
    config = DADConfig(mode="auto", rank=4, objective=objective, lossless_steps=3,
                       link=SLOW if objective == "time" else None)
    sync = DADSynchronizer(model, TorchDistributedAggregator(), config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"routes": [], "errors": []}
    for step in range(5):
        data = batch(MODEL, 2, seed=100 * step + dist.get_rank())
        ref = _reference_grads(model, data, {}) if step < 3 else None
        loss_of(MODEL, model, data).backward()
        sync.synchronize()
        if ref is not None:
            out["errors"].append(max(grad_errors(ref, model).values()))
        report = sync.last_step_report()
        out["routes"].append(sorted({p.representation for p in report.params if p.shape and len(p.shape) == 2}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["digest"] = _digest(model)
    sync.close()
    return out


def run(case: dict) -> dict:
    if case["name"] == "flush-exact":
        return run_flush_to_exact(case)
    if case["name"].startswith("lossless-"):
        return run_lossless(case)
    if case["name"].startswith("trial-"):
        return run_trial(case)
    if case["name"] == "fast-ddp":
        return run_fast_ddp(case)
    model = build(MODEL, seed=0)
    link = {"fast": FAST, "slow": SLOW, "flush": SLOW, "flush-skip": SLOW, "measured": None}[case["name"]]
    flushing = case["name"] in ("flush", "flush-skip")
    # flush-skip: the flush step (3) is not finite (rank 1's loss is NaN, the step skipped as a loss
    # scaler skips it), so its residuals are put back; the next dense step (4) must send them
    flush_step = 4 if case["name"] == "flush-skip" else 3
    config = DADConfig(mode="auto", rank=4, objective="time", link=link, route_refresh_steps=3)
    sync = DADSynchronizer(model, TorchDistributedAggregator(), config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"routes": [], "errors": [], "captured": []}
    for step in range(5):
        data = batch(MODEL, 2, seed=100 * step + dist.get_rank())
        if flushing and step == 1:
            sync.set_link(FAST)  # from the refresh at step 3 on
        ref = None
        skipped = case["name"] == "flush-skip" and step == 3
        if (case["name"] == "fast" or flushing) and step >= 1 and not skipped:
            residuals = {}
            if flushing and step == flush_step:
                for name, s in sync.state_dict()["rank_routes"].items():
                    if s["residual"] is not None:
                        residuals[name] = s["residual"]
                out["flushed"] = len(residuals)
            if case["name"] == "fast" or step == flush_step:
                ref = _reference_grads(model, data, residuals)
        loss = loss_of(MODEL, model, data)
        if skipped and dist.get_rank() == 1:
            loss = loss * float("nan")
        loss.backward()
        sync.synchronize()
        if skipped:  # skipped as a loss scaler skips it: no optimizer step; residuals still owed
            out["kept_after_skip"] = sum(s["residual"] is not None for s in sync.state_dict()["rank_routes"].values())
            opt.zero_grad(set_to_none=True)
            out["routes"].append(["skipped"])
            continue
        if ref is not None:
            out["errors"].append(max(grad_errors(ref, model).values()))
        report = sync.last_step_report()
        out["routes"].append(sorted({p.representation for p in report.params if p.shape and len(p.shape) == 2}))
        out["captured"].append(sum(c.enabled for c in sync._plan.captures))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["digest"] = _digest(model)
    out["residuals_after"] = sum(s["residual"] is not None for s in sync.state_dict()["rank_routes"].values())
    out["link"] = sync.timing.link.to_list()
    sync.close()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    out_path = sys.argv[1]
    cases = {name: {"name": name} for name in ("fast", "slow", "flush", "flush-skip", "measured", "flush-exact",
                                               "trial-dense", "trial-keep", "trial-sleep", "trial-ddp", "fast-ddp",
                                               "lossless-bytes", "lossless-time")}
    write_and_exit(out_path, run_all(cases, run, gather_per_rank))


if __name__ == "__main__":
    main()
