"""Runs on several (simulated) nodes: dAD's two-level routes under one engine, checked in one launch.

Usage (one process per rank, started by torchrun, accelerate launch or Horovod's gloo launcher):
    multinode_worker.py ENGINE OUT.json CASES.json
ENGINE: "ddp" (DDP + `register_dad_comm_hook`), "accelerate" (`enable_dad` after ``prepare``) or
"horovod" (`horovod_dad.DADOptimizer`). Each case is a dict with a "kind":

  "mismatch": attach with ``config`` (a topology that cannot hold); every rank must raise
      `TopologyError` at attach, no collective started;
  "exact":    ``steps`` steps of exact two-level dAD; every synchronised gradient against the
      all-reduced average of the same local gradients, floored as usual; ranks end identical;
  "residual": rank routes with error feedback, no optimizer step (the same weights each step, so
      local gradients of a copy are this rank's own): per step and weight the identity
      ``sum_ranks e_k = sum_ranks e_(k-1) + sum_ranks g_k - S * G_k`` (what the average did not get
      is what the residuals hold), which ranks hold residuals (the units' owners only, after a
      two-level step) and the residual bytes per rank; ``save``: a folder to save the state to;
  "resume":   load the state a job of another shape saved in ``load`` (``old_sum``: its residual
      sum per weight, ``old_world``), check that the mean residual carried over, train on;
  "trainer":  (accelerate) `transformers.Trainer` plain and with `DADCallback`, exact: how far apart
      they end, whether they moved, ranks identical.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations.comm.topology import TopologyError  # noqa: E402
from dad_integrations.engines.checkpoint import load_rank_state, save_rank_state  # noqa: E402

ENGINE = sys.argv[1]


class Engine:
    """What each launcher's job does differently: attach, sum over ranks, gather results."""

    def __init__(self) -> None:
        self.accelerator = None
        if ENGINE == "horovod":
            import horovod.torch as hvd
            hvd.init()
            self.hvd = hvd
            self.rank, self.world = hvd.rank(), hvd.size()
        else:
            import torch.distributed as dist
            if ENGINE == "accelerate":
                from accelerate import Accelerator
                self.accelerator = Accelerator(cpu=True)
            else:
                dist.init_process_group("gloo")
            self.dist = dist
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._n = 0

    def attach(self, model: torch.nn.Module, config: dict):
        """The model the loop runs, an optimizer (SGD, lr 0: the weights stay) and the synchroniser."""
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if ENGINE == "horovod":
            from horovod_dad import DADOptimizer
            opt = DADOptimizer(opt, named_parameters=model.named_parameters(), model=model, dad=config)
            return model, opt, lambda: opt._dad_sync
        if ENGINE == "accelerate":
            from dad_integrations.accelerate import enable_dad
            wrapped, opt = self.accelerator.prepare(model, opt)
            sync = enable_dad(self.accelerator, wrapped, config)
            return wrapped, opt, lambda: sync
        from torch.nn.parallel import DistributedDataParallel as DDP
        from dad_integrations import register_dad_comm_hook
        wrapped = DDP(model)
        sync = register_dad_comm_hook(wrapped, config)
        return wrapped, opt, lambda: sync

    def step(self, opt, synced: bool = False) -> None:
        """The optimizer step (Horovod's after its ``synchronize()``, unless the loop called it)."""
        if ENGINE == "horovod":
            if not synced:
                opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone().double()
        self._n += 1
        if ENGINE == "horovod":
            return self.hvd.allreduce(t, op=self.hvd.Sum, name=f"mn.sum.{self._n}")
        self.dist.all_reduce(t)
        return t

    def gather(self, case_id: str, mine: dict) -> list:
        if ENGINE == "horovod":
            return self.hvd.allgather_object(mine, name=f"results.{case_id}")
        out = [None] * self.world
        self.dist.all_gather_object(out, mine)
        return out

    def identical(self, model: torch.nn.Module) -> bool:
        flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        return bool(torch.equal(self.sum(flat), flat * self.world))


def _batch(name: str, step: int, rank: int) -> dict:
    return models.batch(name, 3 + rank % 2, seed=1000 * step + rank)


def run_mismatch(eng: Engine, case: dict) -> dict:
    try:
        eng.attach(models.build(case["model"]), case["config"])
    except TopologyError as e:
        return {"raised": str(e)}
    return {"raised": None}


def run_exact(eng: Engine, case: dict) -> dict:
    name = case["model"]
    ref = models.build(name)
    mine = copy.deepcopy(ref)
    wrapped, opt, sync = eng.attach(mine, case["config"])
    worst, levels = 0.0, []
    for step in range(case.get("steps", 3)):
        data = _batch(name, step, eng.rank)
        ref.zero_grad(set_to_none=True)
        models.loss_of(name, ref, data).backward()
        for p in ref.parameters():
            p.grad = (eng.sum(p.grad) / eng.world).float()
        models.loss_of(name, wrapped, data).backward()
        if ENGINE == "horovod":
            opt.synchronize()
        worst = max(worst, max(models.grad_errors(ref, mine).values()))
        report = sync().last_step_report()
        levels.append(sorted({(p.level, p.representation) for p in report.params}))
        eng.step(opt, synced=True)
    return {"worst": worst, "levels": levels, "identical": eng.identical(mine),
            "topology": sync()._exchanger.two_level.levels.topology.describe()
            if sync()._exchanger.two_level is not None else "flat"}


def _residuals(sync) -> dict:
    memory = sync._exchanger.state.memory
    return {u.name: memory.dense(u.name) for u in sync.units}


def run_residual(eng: Engine, case: dict) -> dict:
    name = case["model"]
    ref = models.build(name)
    mine = copy.deepcopy(ref)
    wrapped, opt, sync = eng.attach(mine, case["config"])
    params = dict(mine.named_parameters())
    ref_params = dict(ref.named_parameters())
    before = None
    worst, holders, nbytes = 0.0, [], []
    for step in range(case.get("steps", 3)):
        data = _batch(name, step, eng.rank)
        ref.zero_grad(set_to_none=True)
        models.loss_of(name, ref, data).backward()
        models.loss_of(name, wrapped, data).backward()
        if ENGINE == "horovod":
            opt.synchronize()
        s = sync()
        now = _residuals(s)
        if before is None:
            before = {k: torch.zeros_like(params[k], dtype=torch.float64) for k in now}
        sums = {}
        for unit in s.units:
            k = unit.name
            e = now[k] if now[k] is not None else torch.zeros_like(params[k])
            sums[k] = eng.sum(e.reshape(params[k].shape))
            local = eng.sum(ref_params[k].grad)
            expected = before[k] + local - eng.world * params[k].grad.double()
            scale = float(local.norm() + before[k].norm()) or 1.0
            worst = max(worst, float((sums[k] - expected).norm()) / scale)
        before = sums
        holders.append(sorted(k for k, e in now.items() if e is not None and float(e.norm()) > 0))
        nbytes.append(sum(e.numel() * e.element_size() for e in now.values() if e is not None))
        eng.step(opt, synced=True)
    s = sync()
    two = s._exchanger.two_level
    out = {"worst": worst, "holders": holders, "bytes": nbytes,
           "total_bytes": sum(p.numel() * 4 for k, p in params.items() if k in {u.name for u in s.units}),
           "owners": two.owner_of if two is not None else {}, "local_rank": two.local if two is not None else -1,
           "sums": {k: v.tolist() for k, v in before.items()} if case.get("save") else None}
    if case.get("save"):
        save_rank_state(s, case["save"], eng.rank, eng.world)
    return out


def run_resume(eng: Engine, case: dict) -> dict:
    name = case["model"]
    mine = models.build(name)
    wrapped, opt, sync = eng.attach(mine, case["config"])
    # the first step attaches under some engines (Horovod finds the model at its first forward)
    models.loss_of(name, wrapped, _batch(name, 0, eng.rank)).backward()
    eng.step(opt)
    s = sync()
    load_rank_state(s, case["load"], eng.rank, eng.world)
    with open(case["old_sum"]) as f:
        old = json.load(f)
    params = dict(mine.named_parameters())
    worst = 0.0
    for k, e in _residuals(s).items():
        new_mean = eng.sum(e.reshape(params[k].shape) if e is not None else torch.zeros_like(params[k])) / eng.world
        old_mean = torch.tensor(old[k], dtype=torch.float64) / case["old_world"]
        worst = max(worst, float((new_mean - old_mean).norm()) / max(float(old_mean.norm()), 1e-30))
    for step in range(2):
        models.loss_of(name, wrapped, _batch(name, step + 1, eng.rank)).backward()
        eng.step(opt)
    return {"worst": worst, "identical": eng.identical(mine)}


def run_trainer(eng: Engine, case: dict) -> dict:
    """`transformers.Trainer` twice from the same weights on the same data, plain and with
    `DADCallback` (exact), as `workers/trainer_worker.py` trains them (Accelerate only: the
    Trainer takes the launcher's state)."""
    import tempfile

    from trainer_worker import train
    from dad_integrations.transformers import DADCallback
    if ENGINE != "accelerate":
        raise ValueError("the trainer case runs under accelerate launch")
    init = models.build("gpt2")
    with tempfile.TemporaryDirectory() as tmp:
        ref, _, _ = train(init, [], tmp)
        mine, _, _ = train(init, [DADCallback({"mode": "exact"})], tmp)
    start = torch.cat([p.detach().reshape(-1) for p in init.parameters()])
    return {"rel_diff": float((mine - ref).norm() / ref.norm()), "moved": float((mine - start).norm()),
            "identical": bool(torch.equal(eng.sum(mine), mine.double() * eng.world))}


RUNNERS = {"mismatch": run_mismatch, "exact": run_exact, "residual": run_residual, "resume": run_resume,
           "trainer": run_trainer}


def main() -> None:
    out_path, cases_path = sys.argv[2], sys.argv[3]
    with open(cases_path) as f:
        cases = json.load(f)
    torch.set_num_threads(1)
    eng = Engine()
    results = models.run_all(cases, lambda case: RUNNERS[case["kind"]](eng, case), eng.gather)
    if ENGINE == "horovod" and eng.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    if ENGINE == "horovod":
        eng.hvd.barrier()  # ranks leave together: an early shutdown would fail the others' process sets
        eng.hvd.shutdown()
        os._exit(0)
    models.write_and_exit(out_path, results)

if __name__ == "__main__":
    main()
