"""Runs inside `torchrun` (gloo): compares dAD with DDP on the same data and writes JSON results.

Usage: torchrun --standalone --nproc_per_node N check_worker.py OUT.json CASES.json
Each case is a dict with a "kind": "grad" (every synchronised gradient against DDP's),
"train" (parameters on every rank after several optimizer steps), "bytes" (report against the
tensors handed to torch.distributed), "nonfinite" and "scaler_skip" (a step a loss scaler skips),
"broadcast", or "error" (misuse, e.g. different models per rank).
"""
from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations import (DADConfig, DADSynchronizer, TorchDistributedAggregator,  # noqa: E402
                              register_dad_comm_hook)
from dad_integrations.comm.counter import CollectiveCounter  # noqa: E402


def local_batch(case: dict, step: int, micro: int) -> dict:
    rank = dist.get_rank()
    size = case["batch_by_step"][step] if "batch_by_step" in case else case.get("batch", 3)
    if case.get("uneven"):
        size += 2 * rank
    return models.batch(case["model"], size, seed=10_000 * step + 100 * micro + rank)


def config_of(case: dict) -> DADConfig:
    return DADConfig.from_dict(case.get("config", {}))




def run_grad(case: dict) -> dict:
    """Every parameter's synchronised gradient against DDP's, for several steps."""
    name = case["model"]
    ref = models.build(name)
    mine = copy.deepcopy(ref)
    for model in (ref, mine):  # "grad_hooks": {parameter: factor}, a gradient hook scaling it, on both
        params = dict(model.named_parameters())
        for pname, factor in case.get("grad_hooks", {}).items():
            params[pname].register_hook(lambda g, f=factor: g * f)
    logged = LogLines()
    logging.getLogger("dad_integrations").addHandler(logged)
    ddp = DDP(ref, find_unused_parameters=case.get("unused", False))
    kwargs = case.get("sync", {})  # prescale_factor, postscale_factor, backward_passes_per_step
    if case.get("ddp_hook"):  # dAD inside DDP, as DDP's communication hook
        mine_fwd = DDP(mine, find_unused_parameters=case.get("unused", False))
        sync = register_dad_comm_hook(mine_fwd, config_of(case))
        mine_no_sync = mine_fwd.no_sync
    else:
        mine_fwd = mine
        sync = DADSynchronizer(mine, TorchDistributedAggregator(), config_of(case), **kwargs)
        mine_no_sync = sync.no_sync
    # DDP averages; the expected result is scale * sum = scale * S * DDP's
    ref_scale = sync.scale * dist.get_world_size()
    counted = kwargs.get("backward_passes_per_step", 1) > 1  # micro-steps counted, not in no_sync()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    worst, per_param, components = 0.0, {}, []
    for step in range(case.get("steps", 2)):
        micro_steps = case.get("accumulate", 1)
        # "zero_after_forward": the loop of PyTorch's ImageNet example, forward -> zero_grad ->
        # backward (so with micro-steps, gradients are zeroed between them too)
        after_forward = case.get("zero_after_forward")
        for micro in range(micro_steps):
            data = local_batch(case, step, micro)
            last = micro == micro_steps - 1
            with (ddp.no_sync() if not last else _null()):
                with _autocast(case):
                    loss_ref = models.loss_of(name, ddp, data)
                if after_forward:
                    opt_ref.zero_grad(set_to_none=after_forward == "none")
                loss_ref.backward()
            with (mine_no_sync() if not last and not counted else _null()):
                with _autocast(case):
                    loss_mine = models.loss_of(name, mine_fwd, data)
                if after_forward:
                    opt_mine.zero_grad(set_to_none=after_forward == "none")
                loss_mine.backward()
        time.sleep(case.get("sleep_before_sync", 0))  # lets the test see what began during backward
        if not case.get("ddp_hook"):
            sync.synchronize()
        for p in ref.parameters():
            if p.grad is not None and ref_scale != 1.0:
                p.grad.mul_(ref_scale)
        for pname, e in models.grad_errors(ref, mine).items():
            per_param[pname] = max(per_param.get(pname, 0.0), e)
            worst = max(worst, e)
        report = sync.last_step_report()
        components += [[p.name, p.components, list(p.shape)] for p in report.params
                       if p.representation in ("rank", "rank_allreduce")]
        opt_ref.step()
        opt_mine.step()
        zero = case.get("zero", "none")  # "none": set_to_none, "zeros": zero tensors, "keep": accumulate
        if zero != "keep" and not after_forward:
            opt_ref.zero_grad(set_to_none=zero == "none")
            opt_mine.zero_grad(set_to_none=zero == "none")
    reps = sorted({p.representation for p in report.params})
    overlapped = [p.name for p in report.params if p.overlapped]
    sync.close()
    logging.getLogger("dad_integrations").removeHandler(logged)
    return {"worst": worst, "per_param": per_param, "components": components, "representations": reps,
            "warnings": logged.lines,
            "dense_only": [u.name for u in sync.units if u.dense_only],
            "routes": {p.name: p.representation for p in report.params},  # the last step's, per parameter
            "overlapped": overlapped, "units": [u.name for u in sync.units]}


class LogLines(logging.Handler):
    """The warnings dAD logs during a case, as text."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_rank_quality(case: dict) -> dict:
    """rank-dAD's rebuilt average against DDP's, per weight, beside the bound the best local rank-r
    approximations give: ||mean_s A_s - mean_s M_s|| <= mean_s ||A_s - M_s||, with A_s = best_r(M_s)."""
    name = case["model"]
    ref = models.build(name)
    local, mine = copy.deepcopy(ref), copy.deepcopy(ref)
    ddp = DDP(ref)
    cfg = config_of(case)
    sync = DADSynchronizer(mine, TorchDistributedAggregator(), cfg)
    data = local_batch(case, 0, 0)
    for model in (ddp, local, mine):
        models.loss_of(name, model, data).backward()
    sync.synchronize()
    out = {}
    params = dict(ref.named_parameters())
    local_params = dict(local.named_parameters())
    for unit in sync.units:
        g = local_params[unit.name].grad.double()
        best = torch.linalg.svdvals(g)[cfg.rank:].pow(2).sum().sqrt().reshape(1)
        dist.all_reduce(best)
        bound = float(best) / dist.get_world_size()
        actual = float((unit.param.grad.double() - params[unit.name].grad.double()).norm())
        out[unit.name] = [actual, bound]
    sync.close()
    return {"errors": out}


def run_train(case: dict) -> dict:
    """Train several steps; gather every rank's parameters to compare them bit for bit."""
    name = case["model"]
    model = models.build(name)
    sync = DADSynchronizer(model, TorchDistributedAggregator(), config_of(case))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(case.get("steps", 20)):
        # two batches in turn, so that a falling loss shows that training works
        loss = models.loss_of(name, model, local_batch(case, step % 2, 0))
        loss.backward()
        sync.synchronize()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(gathered[0], g) for g in gathered)
    totals = sync.last_step_report().totals
    sync.close()
    return {"identical": identical, "losses": losses, "totals": totals}


def run_bytes(case: dict) -> dict:
    """The report's handed bytes against what reached torch.distributed, per step."""
    name = case["model"]
    model = models.build(name)
    agg = TorchDistributedAggregator()
    sync = DADSynchronizer(model, agg, config_of(case))
    steps = []
    for step in range(case.get("steps", 2)):
        with CollectiveCounter(dist) as counter:  # what reached torch.distributed on dAD's group
            models.loss_of(name, model, local_batch(case, step, 0)).backward()
            sync.synchronize()
        report = sync.last_step_report()
        t = report.totals
        steps.append({"recorded": counter.traffic(group=agg.group).handed, "handed": t["handed_bytes"], "sent": t["sent_bytes"],
                      "received": t["received_bytes"], "allreduce": t["allreduce_bytes"],
                      "by_representation": report.by_representation(),
                      "params": [[q.name, q.representation, q.sent_bytes, q.allreduce_bytes]
                                 for q in report.params],
                      "json": json.loads(json.dumps(report.to_dict()))["totals"]})
        model.zero_grad(set_to_none=True)
    sync.close()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"steps": steps, "world_size": dist.get_world_size(), "param_bytes": param_bytes}


def run_nonfinite(case: dict) -> dict:
    """Rank 1's loss turns non-finite at step 1: every rank must end with a non-finite gradient for
    every parameter whose DDP gradient is non-finite, no rank may raise alone, and the next finite
    step must train on (error-feedback residuals and warm starts unchanged by the bad step)."""
    name = case["model"]
    ref = models.build(name)
    mine = copy.deepcopy(ref)
    ddp = DDP(ref)
    sync = DADSynchronizer(mine, TorchDistributedAggregator(), config_of(case))
    bad_value = float(case.get("bad", "nan"))
    mismatched, state_kept, finite_after = [], None, None
    for step in range(3):
        data = local_batch(case, step, 0)
        bad = step == 1 and dist.get_rank() == 1
        for model in (ddp, mine):
            loss = models.loss_of(name, model, data)
            (loss * bad_value if bad else loss).backward()
        before = _tensors(sync.state_dict())
        sync.synchronize()
        if step == 1:
            for (pname, a), b in zip(ref.named_parameters(), mine.parameters()):
                if a.grad is not None and bool(torch.isfinite(a.grad).all()) != bool(torch.isfinite(b.grad).all()):
                    mismatched.append(pname)
            after = _tensors(sync.state_dict())
            state_kept = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        if step == 2:
            finite_after = all(bool(torch.isfinite(p.grad).all()) for p in mine.parameters() if p.grad is not None)
        ref.zero_grad(set_to_none=True)
        mine.zero_grad(set_to_none=True)
    sync.close()
    return {"mismatched": mismatched, "state_kept": state_kept, "finite_after": finite_after}


def run_scaler_skip(case: dict) -> dict:
    """A GradScaler-skipped step must leave no trace: rank 1's loss is infinite at step 2, so every
    rank's synchronised gradients are non-finite and the scaler skips the step and halves its scale.
    The same run with step 2 left out (and the scale halved by hand) must end with the same
    parameters and the same dAD state (error-feedback residuals, warm starts), on every rank."""
    name = case["model"]
    init = models.build(name)
    bad_step, steps = 2, case.get("steps", 5)
    out = {}
    for variant in ("skipped", "absent"):
        model = copy.deepcopy(init)
        sync = DADSynchronizer(model, TorchDistributedAggregator(), config_of(case))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        skipped = None
        for step in range(steps):
            if step == bad_step and variant == "absent":
                scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
                continue
            loss = models.loss_of(name, model, local_batch(case, step, 0))
            if step == bad_step and dist.get_rank() == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            sync.synchronize()
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            if step == bad_step:
                skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            opt.zero_grad(set_to_none=True)
        state = _tensors(sync.state_dict())
        routes = sorted({p.representation for p in sync.last_step_report().params})
        sync.close()
        out[variant] = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                        "state": state, "skipped": skipped, "scale": scaler.get_scale(), "routes": routes}
    a, b = out["skipped"], out["absent"]
    state_diff = max((float((a["state"][k] - b["state"][k]).norm() / b["state"][k].norm().clamp_min(1e-30))
                      for k in b["state"]), default=0.0)
    flat = a["params"]
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {"params_rel": float((a["params"] - b["params"]).norm() / b["params"].norm()),
            "state_rel": state_diff, "same_state_keys": a["state"].keys() == b["state"].keys(),
            "state_numel": sum(t.numel() for t in b["state"].values()), "skipped": a["skipped"],
            "scales": [a["scale"], b["scale"]], "routes": a["routes"],
            "identical": all(torch.equal(gathered[0], g) for g in gathered)}


def _bytes_against_powersgd(case: dict) -> tuple:
    """Bytes per steady-state step (3 on) that reach torch.distributed, dAD against DDP with
    PyTorch's PowerSGD hook at the same rank (error feedback, warm start, compressing from step 2;
    one DDP bucket, as the hook needs on gloo), the same model and batches; returns
    ``(sent by method, the model's initial copy, dAD's last step report, dAD's dense_only units)``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    name, rank, steps = case["model"], case["config"]["rank"], case.get("steps", 5)
    init = models.build(name)
    sent = {}
    for method in ("powersgd", "dad"):
        model = copy.deepcopy(init)
        if method == "powersgd":
            fwd = DDP(model, bucket_cap_mb=256)
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=2, random_seed=0)
            fwd.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            sync = None
        else:
            fwd = model
            sync = DADSynchronizer(model, TorchDistributedAggregator(), config_of(case))
        per_step = []
        for step in range(steps):
            with CollectiveCounter(dist) as counter:
                models.loss_of(name, fwd, local_batch(case, step, 0)).backward()
                if sync is not None:
                    sync.synchronize()
            per_step.append(counter.traffic().sent)
            model.zero_grad(set_to_none=True)
        if sync is not None:
            last = sync.last_step_report().params
            dense_only = [u.name for u in sync.units if u.dense_only]
            sync.close()
        sent[method] = per_step[3:]
    return sent, init, last, dense_only


def run_vs_powersgd(case: dict) -> dict:
    """`_bytes_against_powersgd`, with the routes dAD's last step took."""
    sent, _, last, _ = _bytes_against_powersgd(case)
    return {"sent": sent, "routes": sorted({p.representation for p in last})}


def _tensors(state: dict) -> dict:
    return {(u, k): v for u, s in state["rank_routes"].items() for k, v in s.items() if isinstance(v, torch.Tensor)}


def run_broadcast(case: dict) -> dict:
    """Ranks seeded differently: attaching dAD must give every rank rank 0's parameters and buffers."""
    torch.manual_seed(1000 + dist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model(torch.randn(16, 4))  # running statistics differ across ranks too
    sync = DADSynchronizer(model, TorchDistributedAggregator(), config_of(case))
    flat = torch.cat([t.detach().double().reshape(-1) for t in list(model.parameters()) + list(model.buffers())])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    sync.close()
    return {"identical": all(torch.equal(gathered[0], g) for g in gathered)}


def run_error(case: dict) -> dict:
    """Misuse must raise a clear error on every rank, never hang. Rank 1 builds ``other``."""
    name = case["model"] if dist.get_rank() == 0 else case.get("other", case["model"])
    try:
        model = models.build(name)
        sync = DADSynchronizer(model, TorchDistributedAggregator(), config_of(case))
        models.loss_of(name, model, local_batch(case, 0, 0)).backward()
        sync.synchronize()
    except (ValueError, RuntimeError) as e:
        return {"error": str(e)}
    return {"error": None}


def _autocast(case: dict):
    if case.get("autocast"):
        if case.get("onednn") is False:  # CPUs whose oneDNN has no bf16 LSTM: torch's own path
            return _both(torch.backends.mkldnn.flags(enabled=False),
                         torch.autocast("cpu", dtype=getattr(torch, case["autocast"])))
        return torch.autocast("cpu", dtype=getattr(torch, case["autocast"]))
    return _null()


class _both:
    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        return self.outer.__exit__(*exc)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


RUNNERS = {"grad": run_grad, "rank_quality": run_rank_quality, "train": run_train, "bytes": run_bytes,
           "error": run_error, "nonfinite": run_nonfinite, "broadcast": run_broadcast,
           "scaler_skip": run_scaler_skip, "vs_powersgd": run_vs_powersgd}


def run_vs_powersgd_routes(case: dict) -> dict:
    """`run_vs_powersgd`'s bytes, plus what carried each matrix: the route of every parameter in
    dAD's last step, and which of them PyTorch's PowerSGD hook compresses (``powersgd_bytes``:
    two or more dimensions viewed as ``(shape[0], rest)``, ``2 r (m + n) < m n``). Gradient bytes
    only: DDP's broadcast of buffers (BatchNorm's running statistics) goes through C++
    (``_broadcast_coalesced``), which the counter does not see, and dAD sends no buffers."""
    from dad_integrations.routing.costs import powersgd_bytes

    sent, init, last, dense_only = _bytes_against_powersgd(case)
    rank = case["config"]["rank"]
    routes = {p.name: p.representation for p in last}
    dad_sent = {p.name: p.sent_bytes for p in last}
    params = []
    for pname, p in init.named_parameters():
        if p.requires_grad:
            theirs, compressed = powersgd_bytes(tuple(p.shape), rank, dist.get_world_size(), p.element_size())
            params.append({"name": pname, "shape": list(p.shape), "numel": p.numel(), "route": routes.get(pname),
                           "sent_bytes": dad_sent.get(pname, 0.0), "powersgd_bytes": theirs,
                           "powersgd_compressed": compressed})
    return {"sent": sent, "routes": sorted(set(routes.values())), "params": params, "dense_only": dense_only}


RUNNERS["vs_powersgd_routes"] = run_vs_powersgd_routes


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    # a rank stuck in a collective fails after this long instead of hanging the test run
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DAD_TEST_TIMEOUT", 120))))
    torch.set_num_threads(1)
    with open(cases_path) as f:
        cases = json.load(f)
    models.write_and_exit(out_path, models.run_all(cases, lambda case: RUNNERS[case["kind"]](case),
                                                   models.gather_per_rank))


if __name__ == "__main__":
    main()
