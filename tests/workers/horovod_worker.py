"""Runs inside `horovodrun --gloo`: compares horovod_dad.DADOptimizer with hvd.DistributedOptimizer.

Usage: horovodrun -np N -H localhost:N --gloo python horovod_worker.py OUT.json CASES.json
Each case is a dict with a "kind": "grad" (every synchronised gradient against Horovod's on the
same data, then parameters after clipped steps), "train" (ranks identical after several steps,
bytes per step), "errors" (unsupported arguments and protocol misuse), "broadcast" (the Horovod
start-up recipe: broadcast_parameters, broadcast_optimizer_state, an LR scheduler, state dicts)
or "process_set" (a process set of ranks 0 and 1 only).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import warnings

import torch
import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations.comm.counter import CollectiveCounter  # noqa: E402
from horovod_dad import DADOptimizer  # noqa: E402

OPS = {"average": hvd.Average, "sum": hvd.Sum}
COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}

# Bytes of every tensor handed to horovod.torch's collectives (dAD's aggregator calls them there),
# to check the report against. Horovod's own optimizer and helpers call them inside horovod.torch's
# submodules, which this does not see.
COUNTER = CollectiveCounter(hvd).install()


def local_batch(case: dict, step: int, micro: int, rank: int) -> dict:
    size = case.get("batch", 2)
    if case["model"] == "embedding_sparse":
        size += 2 * rank if case.get("uneven") else 0
        return models.batch("embedding", size, seed=10_000 * step + 100 * micro + rank)
    if case.get("uneven"):
        size += 2 * rank
    return models.batch(case["model"], size, seed=10_000 * step + 100 * micro + rank)


def hvd_kwargs(case: dict) -> dict:
    kw = dict(case.get("hvd", {}))
    if "op" in kw:
        kw["op"] = OPS[kw["op"]]
    if "compression" in kw:
        kw["compression"] = COMPRESSION[kw["compression"]]
    return kw




def ranks_identical(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="check.identical")
    return all(torch.equal(gathered[0], g) for g in gathered)


class SparseEmbeddingModel(torch.nn.Module):
    """A sparse embedding (sparse gradients) before a linear layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8, sparse=True)
        self.out = torch.nn.Linear(8, 12)

    def forward(self, ids):
        return self.out(self.emb(ids))


def build(name: str) -> torch.nn.Module:
    if name == "embedding_sparse":
        torch.manual_seed(0)
        return SparseEmbeddingModel()
    return models.build(name)


def loss_of(name: str, model: torch.nn.Module, data: dict) -> torch.Tensor:
    return models.loss_of("embedding" if name == "embedding_sparse" else name, model, data)


def run_grad(case: dict) -> dict:
    """After synchronize(), every gradient against hvd.DistributedOptimizer's on the same data;
    then a clipped step inside skip_synchronize(), and parameters against Horovod's.

    ``zero_after_forward`` ("none" / "zeros": dAD's ``set_to_none``; Horovod's zero_grad takes no
    argument and sets None): forward -> ``zero_grad()`` -> backward, instead of zeroing after the step.
    """
    name, kw = case["model"], hvd_kwargs(case)
    after_forward = case.get("zero_after_forward")
    ref = build(name)
    mine = copy.deepcopy(ref)
    opt_ref = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=ref.named_parameters(), **kw)
    # "no_model": exactly hvd.DistributedOptimizer's arguments (dAD finds the model at its forward)
    opt_mine = DADOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1),
                            named_parameters=mine.named_parameters(), dad=case["config"],
                            model=None if case.get("no_model") else mine, **kw)
    worst, per_param, reps, sent = 0.0, {}, set(), []
    passes = kw.get("backward_passes_per_step", 1)
    for step in range(case.get("steps", 3)):
        for micro in range(passes):
            data = local_batch(case, step, micro, hvd.rank())
            for model, opt in ((ref, opt_ref), (mine, opt_mine)):
                loss = loss_of(name, model, data)
                if after_forward and opt is opt_ref:
                    opt.zero_grad()
                elif after_forward:
                    opt.zero_grad(set_to_none=after_forward == "none")
                loss.backward()
        opt_ref.synchronize()
        opt_mine.synchronize()
        for pname, e in models.grad_errors(ref, mine).items():
            per_param[pname] = max(per_param.get(pname, 0.0), e)
            worst = max(worst, e)
        report = opt_mine.last_step_report()
        reps |= {p.representation for p in report.params}
        sent.append(report.totals["sent_bytes"])
        for model in (ref, mine) if case.get("clip", True) else ():
            # the same clipping on both sides, between synchronize() and step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt_ref.skip_synchronize():
            opt_ref.step()
        with opt_mine.skip_synchronize():
            opt_mine.step()
        if not after_forward:
            opt_ref.zero_grad()
            opt_mine.zero_grad(set_to_none=case.get("set_to_none", True))
    params_err = max(models.rel_err(b.detach(), a.detach(), 1e-12) for a, b in zip(ref.parameters(), mine.parameters()))
    identical = ranks_identical(mine)
    opt_mine.close()
    return {"worst": worst, "per_param": per_param, "params_err": params_err, "identical": identical,
            "representations": sorted(reps), "sent": sent}


def run_train(case: dict) -> dict:
    """Several AdamW steps with optimizer.step() (its own synchronize); ranks identical; bytes."""
    name = case["model"]
    model = models.build(name)
    opt = DADOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), named_parameters=model.named_parameters(),
                       model=model, dad=case["config"], **hvd_kwargs(case))
    losses, steps = [], []
    for step in range(case.get("steps", 10)):
        COUNTER.reset()
        loss = loss_of(name, model, local_batch(case, step % 2, 0, hvd.rank()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        report = opt.last_step_report()
        t = report.totals
        steps.append({"sent": t["sent_bytes"], "handed": t["handed_bytes"], "allreduce": t["allreduce_bytes"],
                      "recorded": COUNTER.traffic().handed, "by_representation": report.by_representation()})
    identical = ranks_identical(model)
    opt.close()
    return {"identical": identical, "losses": losses, "steps": steps}


def _raises(fn) -> str:
    try:
        fn()
    except (ValueError, AssertionError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class _CustomCompressor(hvd.Compression.none):
    pass


def run_errors(case: dict) -> dict:
    """Unsupported arguments and protocol misuse: the error each one raises."""
    out = {}

    def build(**kw):
        model = models.build("mlp")
        return model, DADOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), model=model, **kw)

    out["adasum"] = _raises(lambda: build(op=hvd.Adasum))
    out["min"] = _raises(lambda: build(op=hvd.Min))
    out["custom_compression"] = _raises(lambda: build(compression=_CustomCompressor))
    out["predivide_sum"] = _raises(lambda: build(op=hvd.Sum, gradient_predivide_factor=2.0))
    out["passes_zero"] = _raises(lambda: build(backward_passes_per_step=0))
    out["groups_bad"] = _raises(lambda: build(groups=-1))
    out["fp16_vs_bf16"] = _raises(lambda: build(compression=hvd.Compression.fp16, dad={"wire_dtype": "bfloat16"}))
    out["bad_dad_key"] = _raises(lambda: build(dad={"mode": "exact", "rnak": 4}))
    # without model=, the first forward must be of a module holding all the optimizer's parameters
    part = models.build("mlp")
    opt = DADOptimizer(torch.optim.SGD(part.parameters(), lr=0.1), named_parameters=part.named_parameters())
    out["partial_forward"] = _raises(lambda: part.hidden(torch.randn(2, 24)))
    out["after_failed_attach"] = _raises(opt.synchronize)
    opt.close()
    other = models.build("mlp")
    out["outside_model"] = _raises(lambda: DADOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                                        model=models.build("mlp")))
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    out["sparse"] = _raises(lambda: DADOptimizer(torch.optim.SGD(sparse.parameters(), lr=0.1), model=sparse))
    out["unnamed"] = _raises(lambda: build(named_parameters=[("x", next(models.build("mlp").parameters()))]))

    # groups only group Horovod's all-reduces: accepted
    model, opt = build(groups=2)
    out["groups_ok"] = isinstance(opt, torch.optim.SGD)
    opt.close()

    data = local_batch({"model": "mlp"}, 0, 0, hvd.rank())
    model, opt = build()
    loss_of("mlp", model, data).backward()
    out["zero_grad_race"] = _raises(opt.zero_grad)
    out["step_skip_without_sync"] = _raises(lambda: _step_in_skip(opt))
    opt.synchronize()
    opt.zero_grad()
    loss_of("mlp", model, data).backward()
    out["too_many_passes"] = _raises(lambda: loss_of("mlp", model, data).backward())
    opt.close()

    # zero_grad() between two of backward_passes_per_step=2 passes: Horovod refuses it, and so does dAD
    ref = models.build("mlp")
    opt_ref = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=ref.named_parameters(), backward_passes_per_step=2)
    loss_of("mlp", ref, data).backward()
    out["zero_grad_between_passes_horovod"] = _raises(opt_ref.zero_grad)
    model, opt = build(backward_passes_per_step=2)
    loss_of("mlp", model, data).backward()
    out["zero_grad_between_passes"] = _raises(opt.zero_grad)
    opt.close()
    return out


def _step_in_skip(opt) -> None:
    with opt.skip_synchronize():
        opt.step()


def run_broadcast(case: dict) -> dict:
    """Horovod's start-up recipe from different weights per rank, then steps against Horovod's:
    broadcast_parameters, broadcast_optimizer_state (which steps a fresh optimizer once), an LR
    scheduler, state_dict / load_state_dict round trip, step() with its own synchronize()."""
    name = case["model"]
    ref = models.build(name, seed=hvd.rank())
    mine = models.build(name, seed=hvd.rank())
    out = {}
    opts = []
    for model, wrap in ((ref, hvd.DistributedOptimizer), (mine, None)):
        base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if wrap is None:
            opt = DADOptimizer(base, named_parameters=model.named_parameters(), model=model, dad=case["config"])
        else:
            opt = wrap(base, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        opts.append(opt)
    opt_ref, opt_mine = opts
    out["isinstance"] = isinstance(opt_mine, torch.optim.AdamW)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=1, gamma=0.5)
    sched_mine = torch.optim.lr_scheduler.StepLR(opt_mine, step_size=1, gamma=0.5)
    worst = 0.0
    for step in range(3):
        data = local_batch(case, step, 0, hvd.rank())
        for model, opt, sched in ((ref, opt_ref, sched_ref), (mine, opt_mine, sched_mine)):
            opt.zero_grad()
            loss_of(name, model, data).backward()
            opt.synchronize()
        worst = max(worst, max(models.grad_errors(ref, mine).values()))
        for opt, sched in ((opt_ref, sched_ref), (opt_mine, sched_mine)):
            with opt.skip_synchronize():
                opt.step()
            sched.step()
    out["grad_worst"] = worst
    out["params_err"] = max(models.rel_err(b.detach(), a.detach(), 1e-12) for a, b in zip(ref.parameters(), mine.parameters()))
    out["lr"] = opt_mine.param_groups[0]["lr"]
    state = opt_mine.state_dict()
    out["state_has_dad"] = "dad" in state
    opt_mine.load_state_dict(state)
    # plain step() (which synchronises) after the round trip, with a warning-free protocol
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt_mine.zero_grad()
        loss_of(name, mine, local_batch(case, 9, 0, hvd.rank())).backward()
        opt_mine.step()
    out["warnings"] = [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]
    out["identical"] = ranks_identical(mine)
    out["dense_only"] = [u.name for u in opt_mine.dad_synchronizer.units if u.dense_only]
    opt_mine.close()
    return out


def run_process_set(case: dict) -> dict:
    """A process set of ranks 0 and 1: they average over themselves, as Horovod's do; rank 2 steps
    on its local gradients."""
    ps = PROCESS_SETS[0]
    name = case["model"]
    ref = models.build(name)
    mine = copy.deepcopy(ref)
    opt_ref = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=ref.named_parameters(), process_set=ps)
    opt_mine = DADOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1), named_parameters=mine.named_parameters(),
                            process_set=ps, model=mine, dad=case["config"])
    data = local_batch(case, 0, 0, hvd.rank())
    for model in (ref, mine):
        loss_of(name, model, data).backward()
    opt_ref.synchronize()
    opt_mine.synchronize()
    worst = max(models.grad_errors(ref, mine).values())
    report = opt_mine.last_step_report()
    out = {"worst": worst, "included": ps.included(),
           "world_size": None if report is None else report.world_size}
    opt_mine.close()
    return out


def run_two_optimizers(case: dict) -> dict:
    """Two models, each with its own DADOptimizer (a GAN's pattern), beside two Horovod ones: the
    collectives of the four optimizers, in flight together, must not be confused."""
    refs = [models.build("mlp", seed=s) for s in (0, 1)]
    mines = [copy.deepcopy(m) for m in refs]
    opts_ref = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                         named_parameters=[(f"m{i}.{n}", p) for n, p in m.named_parameters()])
                for i, m in enumerate(refs)]
    opts_mine = [DADOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                              model=m, dad=case["config"]) for m in mines]
    worst = 0.0
    for step in range(2):
        data = local_batch({"model": "mlp", "uneven": True}, step, 0, hvd.rank())
        for pair, opts in ((refs, opts_ref), (mines, opts_mine)):
            torch.nn.functional.mse_loss(pair[1](pair[0](data["x"])[..., :6].repeat(1, 1, 2)), data["y"]).backward()
            for opt in opts:
                opt.synchronize()
        for a, b in zip(refs, mines):
            worst = max(worst, max(models.grad_errors(a, b).values()))
        for opt in opts_ref + opts_mine:
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
    prefixes = [o.dad_synchronizer.aggregator.prefix for o in opts_mine]
    for o in opts_mine:
        o.close()
    return {"worst": worst, "prefixes": prefixes}


RUNNERS = {"two_optimizers": run_two_optimizers, "grad": run_grad, "train": run_train, "errors": run_errors, "broadcast": run_broadcast,
           "process_set": run_process_set}
PROCESS_SETS = []


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    if any(c["kind"] == "process_set" for c in cases.values()):
        PROCESS_SETS.append(hvd.ProcessSet([0, 1]))
    hvd.init(process_sets=PROCESS_SETS or None)
    torch.set_num_threads(1)
    results = models.run_all(cases, lambda case: RUNNERS[case["kind"]](case),
                             lambda case_id, mine: hvd.allgather_object(mine, name=f"results.{case_id}"))
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
