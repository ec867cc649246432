"""Runs inside `torchrun` (2 gloo ranks): dAD exact under ``torch.compile`` in every engine path,
each against the same engine compiled the same way without dAD; writes JSON results.

Usage: torchrun --standalone --nproc_per_node 2 compiled_worker.py OUT.json

Cases (small GPT-2 from a config, backend ``aot_eager``: the same graphs AOTAutograd hands the
inductor, compiled in seconds on a CPU):

- ``hookless_first``: a hook-less copy of the model compiled and run first, then the model with
  dAD compiled: dAD must capture (every factor unit exact), not reuse the copy's graph. It runs
  first, before anything in the process attached dAD.
- ``ddp_before``: ``DDP(torch.compile(model))`` with the dAD hook against ``DDP(torch.compile(ref))``.
- ``ddp_after``: ``torch.compile(DDP(model))`` (DDPOptimizer splits the graph at buckets).
- ``fsdp2_blocks``: torchtitan's pattern: ``fully_shard`` each block and the root, then compile
  each block; `enable_dad_fsdp` against FSDP2's own reduce-scatter.
- ``accelerate``: ``Accelerator(dynamo_backend=...)`` prepares (DDP, then compile) and `enable_dad`.
- ``trainer``: ``Trainer(torch_compile=True)`` with `DADCallback` against the plain Trainer.

Per step, every gradient's relative error (floored at 1e-6 of the whole gradient's norm) and
whether all ranks hold identical parameters; the dAD report's exact parameters.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations import register_dad_comm_hook  # noqa: E402

BACKEND = "aot_eager"
EXACT = {"mode": "exact"}
STEPS = 3


def batch(step: int) -> dict:
    """Rank- and step-dependent token windows (one shape: this is about capture, not dynamic shapes)."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    ids = torch.randint(1, 64, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def grad_error(ref: nn.Module, mine: nn.Module) -> float:
    """Worst per-parameter ||g - g_ref|| / max(||g_ref||, 1e-6 ||whole g_ref||), over ranks (DTensor
    gradients compared shard by shard)."""
    pairs = []
    for a, b in zip(ref.parameters(), mine.parameters()):
        ga, gb = a.grad, b.grad
        if ga is None or gb is None:
            assert ga is None and gb is None, "a gradient in one model only"
            continue
        ga = ga.to_local() if hasattr(ga, "to_local") else ga
        gb = gb.to_local() if hasattr(gb, "to_local") else gb
        pairs.append((float((gb - ga).double().norm()) ** 2, float(ga.double().norm()) ** 2))
    t = torch.tensor(pairs, dtype=torch.float64)
    dist.all_reduce(t)
    whole = float(t[:, 1].sum()) ** 0.5
    return max(float(e) ** 0.5 / max(float(n) ** 0.5, 1e-6 * whole) for e, n in t.tolist())


def identical_across_ranks(model: nn.Module) -> bool:
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def train_pair(ref_call, ref: nn.Module, mine_call, mine: nn.Module, sync) -> dict:
    """STEPS steps of both: per step the gradient error; the report's exact parameters."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
    errors, exact = [], []
    for step in range(STEPS):
        for call, opt in zip((ref_call, mine_call), opts):
            opt.zero_grad(set_to_none=True)
            call(batch(step)).loss.backward()
        errors.append(grad_error(ref, mine))
        report = sync.last_step_report() if sync is not None else None
        exact.append(report.totals["params_exact"] if report is not None and hasattr(report, "totals") else None)
        for opt in opts:
            opt.step()
    return {"errors": errors, "exact": exact, "identical": identical_across_ranks(mine),
            "dense_only": sorted(u.name for u in getattr(sync, "units", []) if u.dense_only)}


def case_hookless_first(init: nn.Module) -> dict:
    other = torch.compile(copy.deepcopy(init), backend=BACKEND)  # a reference/teacher model, no dAD
    other(**batch(0)).loss.backward()
    model, ref = copy.deepcopy(init), copy.deepcopy(init)
    ddp, ref_ddp = DDP(model), DDP(ref)
    sync = register_dad_comm_hook(ddp, EXACT)
    ref_c, mine_c = torch.compile(ref_ddp, backend=BACKEND), torch.compile(ddp, backend=BACKEND)
    out = train_pair(lambda b: ref_c(**b), ref, lambda b: mine_c(**b), model, sync)
    other(**batch(1)).loss.backward()  # the copy still runs its own graph, without capture
    out["units"] = len(sync.units)
    return out


def case_ddp_before(init: nn.Module) -> dict:
    model, ref = copy.deepcopy(init), copy.deepcopy(init)
    ddp, ref_ddp = DDP(torch.compile(model, backend=BACKEND)), DDP(torch.compile(ref, backend=BACKEND))
    sync = register_dad_comm_hook(ddp, EXACT)
    return train_pair(lambda b: ref_ddp(**b), ref, lambda b: ddp(**b), model, sync) | {"units": len(sync.units)}


def case_ddp_after(init: nn.Module) -> dict:
    model, ref = copy.deepcopy(init), copy.deepcopy(init)
    ddp = DDP(model)
    sync = register_dad_comm_hook(ddp, EXACT, compiled=True)
    compiled = torch.compile(ddp, backend=BACKEND)
    ref_c = torch.compile(DDP(ref), backend=BACKEND)
    return train_pair(lambda b: ref_c(**b), ref, lambda b: compiled(**b), model, sync) | {"units": len(sync.units)}


def case_fsdp2_blocks(init: nn.Module) -> dict:
    from torch.distributed.fsdp import fully_shard
    from dad_integrations.fsdp import enable_dad_fsdp

    def shard(m: nn.Module) -> nn.Module:
        for block in m.transformer.h:
            fully_shard(block)
        fully_shard(m)
        for block in m.transformer.h:  # torchtitan: compile each block after sharding it
            block.compile(backend=BACKEND)
        return m

    model, ref = shard(copy.deepcopy(init)), shard(copy.deepcopy(init))
    sync = enable_dad_fsdp(model, EXACT)
    out = train_pair(lambda b: ref(**b), ref, lambda b: model(**b), model, None)
    out["report"] = [p.representation for p in sync.last_step_report().params] if sync.last_step_report() else None
    return out


def case_accelerate(init: nn.Module) -> dict:
    from accelerate import Accelerator
    from dad_integrations.accelerate import enable_dad
    acc = Accelerator(cpu=True, dynamo_backend=BACKEND.upper())
    model, ref = copy.deepcopy(init), copy.deepcopy(init)
    ref_p = acc.prepare(ref)
    mine_p = acc.prepare(model)
    sync = enable_dad(acc, mine_p, EXACT)
    return train_pair(lambda b: ref_p(**b), ref, lambda b: mine_p(**b), model, sync) | {
        "compiled": hasattr(mine_p, "_orig_mod"), "units": len(sync.units)}


def case_trainer(init: nn.Module) -> dict:
    from transformers import Trainer, TrainingArguments
    from dad_integrations.transformers import DADCallback

    class Windows(torch.utils.data.Dataset):
        data = torch.randint(1, 64, (16, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return {"input_ids": self.data[i], "labels": self.data[i]}

    def train(callbacks: list, out_dir: str):
        model = copy.deepcopy(init)
        args = TrainingArguments(output_dir=out_dir, max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, data_seed=0,
                                 disable_tqdm=True, use_cpu=True, torch_compile=True,
                                 torch_compile_backend=BACKEND)
        trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=callbacks)
        trainer.train()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), model

    callback = DADCallback(EXACT)
    with tempfile.TemporaryDirectory() as tmp:
        ref, _ = train([], tmp)
        mine, model = train([callback], tmp)
    totals = callback.sync.last_step_report().totals
    return {"rel_diff": float((mine - ref).norm() / ref.norm()), "exact": [totals["params_exact"]],
            "identical": identical_across_ranks(model),
            "dense_only": sorted(u.name for u in callback.sync.units if u.dense_only),
            "units": len(callback.sync.units)}


CASES = {"hookless_first": case_hookless_first, "ddp_before": case_ddp_before, "ddp_after": case_ddp_after,
         "fsdp2_blocks": case_fsdp2_blocks, "accelerate": case_accelerate, "trainer": case_trainer}


def main() -> None:
    out_path = sys.argv[1]
    names = sys.argv[2:] or list(CASES)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    init = models.build("gpt2")
    results = {}
    for name in names:
        try:
            results[name] = CASES[name](init)
        except Exception as e:  # reported, not raised: the other cases still run
            import traceback
            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
    from torch._dynamo.utils import counters
    results["graph_breaks"] = dict(counters["graph_break"])
    models.write_and_exit(out_path, results)


if __name__ == "__main__":
    main()
