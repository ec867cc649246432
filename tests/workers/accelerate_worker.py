"""Runs inside `accelerate launch` (2 CPU processes): dAD through `enable_dad` against plain Accelerate.

Usage: accelerate launch --config_file examples/accelerate/cpu_2proc.yaml accelerate_worker.py OUT CASES
Each case is a dict with a "kind":
  "grad": every gradient after each optimizer step's backward (accumulating over
          ``accumulate`` micro-steps with ``accelerator.accumulate``), against a plain Accelerate DDP
          model trained alongside on the same data; then ranks compared bit for bit
          (``zero_after_forward``: zero_grad between forward and backward, see `run_grad`;
          ``batch``: examples per process, plus the process index unless ``even``);
  "replaced": a profiled step: DDP's own gradient all-reduce must not run once dAD is enabled.
The Accelerator is made once per process (mixed precision from the launch).
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations.accelerate import enable_dad  # noqa: E402




def run_grad(accelerator: Accelerator, case: dict) -> dict:
    """Every gradient at every synchronised step against plain Accelerate DDP's (then ranks compared).

    ``zero_after_forward`` ("none" / "zeros"): PyTorch's ImageNet loop, forward ->
    ``optimizer.zero_grad(set_to_none=...)`` -> ``accelerator.backward``, instead of zeroing after the
    step. Inside ``accelerator.accumulate`` the AcceleratedOptimizer zeroes only on the synchronised
    micro-step, so there the earlier micro-steps' gradients are dropped, for DDP and dAD alike.
    """
    name = case["model"]
    after_forward = case.get("zero_after_forward")
    torch.manual_seed(0)
    ref_model = models.build(name)
    mine_model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    mine_opt = torch.optim.SGD(mine_model.parameters(), lr=0.05)
    ref, ref_opt, mine, mine_opt = accelerator.prepare(ref_model, ref_opt, mine_model, mine_opt)
    sync = enable_dad(accelerator, mine, case["config"])
    worst, steps, micro = 0.0, 0, 0
    rank = accelerator.process_index
    reps = set()
    while steps < case.get("steps", 3):
        data = models.batch(name, case.get("batch", 3) + (0 if case.get("even") else rank), seed=1000 * steps + 10 * micro + rank)
        with accelerator.accumulate(ref, mine):
            for model, opt in ((ref, ref_opt), (mine, mine_opt)):
                loss = models.loss_of(name, model, data)
                if after_forward:
                    opt.zero_grad(set_to_none=after_forward == "none")
                accelerator.backward(loss)
            if accelerator.sync_gradients:
                worst = max(worst, max(models.grad_errors(ref_model, mine_model).values()))
                reps |= {p.representation for p in sync.last_step_report().params}
                for model in (ref, mine):
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
            ref_opt.step()
            mine_opt.step()
            if not after_forward:
                ref_opt.zero_grad(set_to_none=True)
                mine_opt.zero_grad(set_to_none=True)
        micro += 1
        if accelerator.sync_gradients:
            steps += 1
    flat = torch.cat([p.detach().reshape(-1) for p in mine_model.parameters()])
    gathered = accelerator.gather(flat.unsqueeze(0))
    totals = sync.last_step_report().totals
    dense_only = [u.name for u in sync.units if u.dense_only]  # failed the first-step check
    accelerator.free_memory()
    return {"worst": worst, "identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
            "sent": totals["sent_bytes"], "allreduce": totals["allreduce_bytes"], "representations": sorted(reps),
            "dense_only": dense_only}


def run_replaced(accelerator: Accelerator, case: dict) -> dict:
    """Profile one step with plain DDP and one with dAD: which gradient all-reduces ran?"""
    name = case["model"]
    out = {}
    for label in ("ddp", "dad"):
        torch.manual_seed(0)
        model = accelerator.prepare(models.build(name))
        if label == "dad":
            enable_dad(accelerator, model, case["config"])
        data = models.batch(name, 3, seed=accelerator.process_index)
        accelerator.backward(models.loss_of(name, model, data))  # first step: DDP and dAD set up
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            accelerator.backward(models.loss_of(name, model, data))
        # DDP's reducer all-reduces its buckets on the main thread: gloo:all_reduce events
        out[label] = sum(int(torch.tensor(s[0]).prod()) for e in prof.events()
                         if e.name == "gloo:all_reduce" for s in e.input_shapes[:1] if s)
        out["numel"] = sum(p.numel() for p in model.parameters())
        accelerator.free_memory()
    return out


RUNNERS = {"grad": run_grad, "replaced": run_replaced}


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(1)
    def run(case: dict) -> dict:
        accelerator.gradient_accumulation_steps = case.get("accumulate", 1)
        accelerator.step = 0  # the accumulation counter starts afresh for each case
        return RUNNERS[case["kind"]](accelerator, case)

    def gather(case_id: str, mine: dict) -> list:
        per_rank = [None] * accelerator.num_processes
        dist.all_gather_object(per_rank, mine)
        return per_rank

    models.write_and_exit(out_path, models.run_all(cases, run, gather))


if __name__ == "__main__":
    main()
